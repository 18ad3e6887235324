/* rlflow's LoRA adapters against Hugging Face PEFT: the adapter in tests/data/lora/adapter was
 * written by rlflow (rf_lora_save_peft; `test_lora_golden --write-adapter DIR` makes it again)
 * on the tiny Qwen2 base tests/data/hf/qwen2_tied; tests/tools/make_lora_golden.py loaded it
 * with transformers + PEFT (PeftModel.from_pretrained) and wrote the log-probs PyTorch computes
 * into tests/data/lora/expected.json. rlflow must reproduce them with the adapter loaded
 * unmerged (rf_lora_load_peft) and merged into the weights (rf_lora_merge), save the adapter
 * again byte for byte, and refuse PEFT configurations it does not implement, naming the field.
 * `rlflow merge-lora` must write tests/data/lora/merged byte for byte: the directory the script
 * loaded with transformers alone (no PEFT) as a plain model, whose log-probs it checked against
 * PEFT's and wrote as logprobs_merge_lora; rlflow reads that directory to the same numbers.
 * The other way round, tests/data/lora/peft_adapter was written by PEFT itself (get_peft_model +
 * save_pretrained, with every field PEFT 0.21 puts in adapter_config.json): rlflow loads it and
 * gives PEFT's log-probs (logprobs_peft_made). */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"
#include "model/lora.h"
#include "test_shell.h"
#include "test_util.h"

/* fp32 on both sides (the kernels' default precision here), differing in summation order, as
 * tests/test_hf_golden.c: 2e-5. */
#define TOL 2e-5

static char base[1024], data[1024];
static const char *rlflow;

/* Writes the adapter the golden files were made from: rank 4, alpha 8 on every projection,
 * kaiming A, and B drawn from normal(0, 0.1) (a fresh B is zero and would prove nothing). */
static int write_adapter(const char *dir) {
    rf_model *m;
    CHECK_OK(rf_model_load(&m, base, rf_cpu_kernels(), 0));
    rf_lora_opts o = {4, 8.0f, 0.0f, (1u << RF_LORA_N) - 1, RF_LORA_INIT_KAIMING, 3};
    CHECK_OK(rf_model_lora_attach(m, &o));
    rf_rng r;
    rf_rng_seed(&r, 4);
    for (int i = 1; i < m->lora.n_views; i += 2)
        for (size_t j = 0; j < m->lora.views[i].numel; j++) m->params[m->lora.views[i].offset + j] = 0.1f * rf_rng_normal(&r);
    CHECK_OK(rf_lora_save_peft(m, dir, "tests/data/hf/qwen2_tied"));
    rf_model_free(m);
    return rf_test_finish("test_lora_golden --write-adapter");
}

/* The model's log-probs of SEQS against expected.json's array `key`; returns the largest
 * difference. */
static double compare(rf_model *m, const cJSON *exp, const char *key) {
    const cJSON *seqs = cJSON_GetObjectItem(exp, "sequences"), *want = cJSON_GetObjectItem(exp, key), *s;
    double worst = 0;
    int si = 0;
    cJSON_ArrayForEach(s, seqs) {
        int len = cJSON_GetArraySize(s);
        int32_t tok[32], tgt[32], cu[2] = {0, len - 1};
        for (int i = 0; i < len - 1; i++) {
            tok[i] = cJSON_GetArrayItem(s, i)->valueint;
            tgt[i] = cJSON_GetArrayItem(s, i + 1)->valueint;
        }
        rf_batch b = {1, len - 1, tok, NULL, cu};
        float lp[32];
        CHECK_OK(rf_model_forward(m, &b));
        CHECK_OK(rf_model_logprobs(m, tgt, 1.0f, lp, NULL));
        for (int i = 0; i < len - 1; i++) {
            double w = cJSON_GetArrayItem(cJSON_GetArrayItem(want, si), i)->valuedouble;
            CHECK_CLOSE(lp[i], w, TOL, TOL);
            worst = fmax(worst, fabs(lp[i] - w));
        }
        si++;
    }
    return worst;
}

static void golden(void) {
    char p[1200], *text = NULL;
    snprintf(p, sizeof p, "%s/expected.json", data);
    CHECK_OK(rf_read_file(p, &text, NULL));
    cJSON *exp = text ? cJSON_Parse(text) : NULL;
    free(text);
    CHECK(exp != NULL);
    if (!exp) return;
    rf_model *m;
    CHECK_OK(rf_model_load(&m, base, rf_cpu_kernels(), 0));
    double b0 = compare(m, exp, "logprobs_base");
    snprintf(p, sizeof p, "%s/adapter", data);
    CHECK_OK(rf_lora_load_peft(m, p));
    CHECK(m->lora.rank == 4 && fabsf(m->lora.scale - 2.0f) < 1e-7f && m->lora.n_views == 28);
    double a = compare(m, exp, "logprobs");
    /* the adapter must matter: its log-probs differ from the base's by far more than TOL */
    const cJSON *w = cJSON_GetObjectItem(exp, "logprobs"), *wb = cJSON_GetObjectItem(exp, "logprobs_base");
    double moved = 0;
    for (int s = 0; s < cJSON_GetArraySize(w); s++)
        for (int i = 0; i < cJSON_GetArraySize(cJSON_GetArrayItem(w, s)); i++)
            moved = fmax(moved, fabs(cJSON_GetArrayItem(cJSON_GetArrayItem(w, s), i)->valuedouble -
                                     cJSON_GetArrayItem(cJSON_GetArrayItem(wb, s), i)->valuedouble));
    CHECK(moved > 100 * TOL);
    /* saved again: the same bytes */
    char tmp[] = "/tmp/rf_lora_golden_XXXXXX";
    CHECK(mkdtemp(tmp) != NULL);
    CHECK_OK(rf_lora_save_peft(m, tmp, "tests/data/hf/qwen2_tied"));
    char f1[1300], f2[1300], *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    snprintf(f1, sizeof f1, "%s/adapter/adapter_model.safetensors", data);
    snprintf(f2, sizeof f2, "%s/adapter_model.safetensors", tmp);
    CHECK_OK(rf_read_file(f1, &x, &nx));
    CHECK_OK(rf_read_file(f2, &y, &ny));
    CHECK(x && y && nx == ny && memcmp(x, y, nx) == 0);
    free(x), free(y);
    CHECK_OK(rf_lora_merge(m));
    CHECK(m->lora.rank == 0 && m->n_frozen == 0);
    double mg = compare(m, exp, "logprobs_merged");
    printf("max |logprob - PEFT|: base %.2e, adapter %.2e, merged %.2e; the adapter moves log-probs by %.3g\n", b0, a,
           mg, moved);
    rf_model_free(m);
    cJSON_Delete(exp);
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    CHECK(system(cmd) == 0);
}

/* An adapter PEFT wrote (rank 2, alpha 6 on q, k, gate, down) gives PEFT's log-probs. */
static void peft_made(void) {
    char p[1200], *text = NULL;
    snprintf(p, sizeof p, "%s/expected.json", data);
    CHECK_OK(rf_read_file(p, &text, NULL));
    cJSON *exp = text ? cJSON_Parse(text) : NULL;
    free(text);
    const cJSON *w = exp ? cJSON_GetObjectItem(exp, "logprobs_peft_made") : NULL;
    CHECK(w != NULL);
    if (!w) {
        cJSON_Delete(exp);
        return;
    }
    /* the adapter must matter, as in golden() */
    const cJSON *wb = cJSON_GetObjectItem(exp, "logprobs_base");
    double moved = 0;
    for (int s = 0; s < cJSON_GetArraySize(w); s++)
        for (int i = 0; i < cJSON_GetArraySize(cJSON_GetArrayItem(w, s)); i++)
            moved = fmax(moved, fabs(cJSON_GetArrayItem(cJSON_GetArrayItem(w, s), i)->valuedouble -
                                     cJSON_GetArrayItem(cJSON_GetArrayItem(wb, s), i)->valuedouble));
    CHECK(moved > 100 * TOL);
    rf_model *m;
    CHECK_OK(rf_model_load(&m, base, rf_cpu_kernels(), 0));
    snprintf(p, sizeof p, "%s/peft_adapter", data);
    CHECK_OK(rf_lora_load_peft(m, p));
    /* 2 layers x 4 targets x (A, B) */
    CHECK(m->lora.rank == 2 && fabsf(m->lora.scale - 3.0f) < 1e-7f && m->lora.n_views == 16);
    printf("PEFT-made adapter: max |logprob - PEFT| %.2e; it moves log-probs by %.3g\n",
           compare(m, exp, "logprobs_peft_made"), moved);
    rf_model_free(m);
    cJSON_Delete(exp);
}

/* Whether files a and b hold the same bytes. */
static int same_file(const char *a, const char *b) {
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    CHECK_OK(rf_read_file(a, &x, &nx));
    CHECK_OK(rf_read_file(b, &y, &ny));
    int same = x && y && nx == ny && memcmp(x, y, nx) == 0;
    free(x), free(y);
    return same;
}

/* rlflow merge-lora writes the directory transformers loaded to PEFT's log-probs. */
static void merged_dir(void) {
    char tmp[] = "/tmp/rf_lora_merged_XXXXXX", *out = NULL, p[1300], q[1300];
    CHECK(mkdtemp(tmp) != NULL);
    int rc = rf_test_sh(&out, "%s merge-lora --model %s --adapter %s/adapter --out %s/m", rlflow, base, data, tmp);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    const char *files[2] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/merged/%s", data, files[i]);
        snprintf(q, sizeof q, "%s/m/%s", tmp, files[i]);
        CHECK(same_file(p, q));
    }
    char *text = NULL;
    snprintf(p, sizeof p, "%s/expected.json", data);
    CHECK_OK(rf_read_file(p, &text, NULL));
    cJSON *exp = text ? cJSON_Parse(text) : NULL;
    free(text);
    CHECK(exp && cJSON_GetObjectItem(exp, "logprobs_merge_lora"));
    rf_model *m;
    snprintf(p, sizeof p, "%s/merged", data);
    CHECK_OK(rf_model_load(&m, p, rf_cpu_kernels(), 0));
    if (exp && cJSON_GetObjectItem(exp, "logprobs_merge_lora"))
        printf("merge-lora's directory: max |logprob - transformers| %.2e\n", compare(m, exp, "logprobs_merge_lora"));
    rf_model_free(m);
    cJSON_Delete(exp);
    rf_test_sh(NULL, "rm -rf %s", tmp);
}

/* A PEFT config with something rlflow does not implement, written into a copy of the adapter
 * in data/<sub>. */
static void refuses_in(const char *sub, const char *edit, const char *want) {
    char tmp[] = "/tmp/rf_lora_bad_XXXXXX", cmd[4000];
    CHECK(mkdtemp(tmp) != NULL);
    snprintf(cmd, sizeof cmd, "cp %s/%s/* %s/ && sed -i '%s' %s/adapter_config.json", data, sub, tmp, edit, tmp);
    CHECK(system(cmd) == 0);
    rf_model *m;
    CHECK_OK(rf_model_load(&m, base, rf_cpu_kernels(), 0));
    rf_status s = rf_lora_load_peft(m, tmp);
    CHECK(s != RF_OK && strstr(rf_error_message(), want) != NULL);
    if (s == RF_OK || !strstr(rf_error_message(), want)) fprintf(stderr, "%s: got \"%s\"\n", edit, rf_error_message());
    rf_model_free(m);
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    CHECK(system(cmd) == 0);
}

static void refuses(const char *edit, const char *want) { refuses_in("adapter", edit, want); }

/* PEFT's variants in the config PEFT itself wrote: refused naming the field, never ignored (an
 * activated LoRA, alora_invocation_tokens, adds no tensor and would load to wrong log-probs). */
static void refuses_peft_variants(void) {
    static const char *const cases[][2] = {
        {"s/\"lora_bias\": false/\"lora_bias\": true/", "\"lora_bias\" is set; rlflow's LoRA does not implement it"},
        {"s/\"alora_invocation_tokens\": null/\"alora_invocation_tokens\": [5]/",
         "\"alora_invocation_tokens\" is set; rlflow's LoRA does not implement it"},
        {"s/\"use_qalora\": false/\"use_qalora\": true/", "\"use_qalora\" is set; rlflow's LoRA does not implement it"},
        {"s/\"exclude_modules\": null/\"exclude_modules\": [\"q_proj\"]/",
         "\"exclude_modules\" is set; rlflow's LoRA does not implement it"},
        {"s/\"trainable_token_indices\": null/\"trainable_token_indices\": [1]/",
         "\"trainable_token_indices\" is set; rlflow's LoRA does not implement it"},
        {"s/\"r\": 2,/\"r\": 2, \"a_later_option\": 1,/", "\"a_later_option\" is set; rlflow's LoRA does not implement it"},
        {"s/\"init_lora_weights\": true/\"init_lora_weights\": \"pissa\"/",
         "\"init_lora_weights\" = \"pissa\" is not implemented (an initialisation that changes the base weights"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) refuses_in("peft_adapter", cases[i][0], cases[i][1]);
}

int main(int argc, char **argv) {
    const char *src = getenv("RF_SOURCE_DIR");
    rlflow = getenv("RF_RLFLOW");
    if ((!src || !rlflow) && argc < 3) {
        printf("test_lora_golden: skipped: RF_SOURCE_DIR or RF_RLFLOW not set\n");
        return 77;
    }
    snprintf(base, sizeof base, "%s/tests/data/hf/qwen2_tied", src ? src : ".");
    snprintf(data, sizeof data, "%s/tests/data/lora", src ? src : ".");
    if (argc == 3 && strcmp(argv[1], "--write-adapter") == 0) return write_adapter(argv[2]);
    golden();
    merged_dir();
    peft_made();
    refuses("s/\"use_rslora\":\\tfalse/\"use_rslora\": true/", "adapter_config.json: \"use_rslora\" is set; rlflow's LoRA does not implement it");
    refuses("s/\"bias\":\\t\"none\"/\"bias\": \"all\"/", "adapter_config.json: \"bias\" must be \"none\" (trained biases are not implemented)");
    refuses("s/\"q_proj\"/\"qkv_proj\"/", "adapter_config.json: target_modules: \"qkv_proj\" is not one of q_proj");
    refuses("s/\"r\":\\t4/\"r\": 0/", "adapter_config.json: \"r\" must be an integer in 1..2147483647");
    /* found by fuzz_peft_config (UBSan: a double outside int's range converted) */
    refuses("s/\"r\":\\t4/\"r\": 5e76/", "adapter_config.json: \"r\" must be an integer in 1..2147483647");
    refuses("s/\"r\":\\t4/\"r\": 4.5/", "adapter_config.json: \"r\" must be an integer in 1..2147483647");
    refuses("s/\"lora_alpha\":\\t8/\"lora_alpha\": 1e300/", "adapter_config.json: \"lora_alpha\" must be a finite number > 0");
    refuses("s/\"r\":\\t4/\"r\": 2/", "adapter_model.safetensors");
    refuses_peft_variants();
    return rf_test_finish("test_lora_golden");
}
