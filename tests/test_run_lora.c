/* End-to-end LoRA runs of `rlflow run` on the small arithmetic task of tests/run_util.h
 * ([lora] on every projection, rank 8, KL to the reference = the frozen base):
 *  - GRPO with adapters learns: the training reward of steps 101-120 above that of steps 1-20,
 *    and the held-out accuracy after the run above the one before it; the KL to the reference
 *    is 0 at step 1 up to fp32 rounding (a fresh adapter is the base model, B = 0) and positive
 *    later;
 *  - a run resumed from its step-20 checkpoint logs the same per-step metrics, bit for bit, as
 *    the uninterrupted run, and the checkpoint holds the adapters and their moments only; its
 *    PEFT copy drives `rlflow generate --adapter` and `rlflow merge-lora` to the same tokens;
 *  - `rlflow sft` with [lora] writes a PEFT adapter;
 *  - bad [lora] values fail with the exact error naming the key (layouts on several processes:
 *    tests/test_split_lora_tp.c). */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/safetensors.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

static const char *LORA = "[lora]\nenabled = true\nrank = 8\nalpha = 16\n"
                          "targets = [\"q\", \"k\", \"v\", \"o\", \"gate\", \"up\", \"down\"]\n";

/* 120 steps at lr 2e-3 (adapters take a larger rate than full fine-tuning) with kl_coef 0.01.
 * Measured on this task: reward 0.253 -> 0.369, accuracy 0.175 -> 0.225 (40 prompts) at 5e-3, a
 * rate at the edge of divergence: on an Intel Xeon with AMX the mean reward of steps 101-120
 * rose 0.02-0.10 above steps 1-20 over six seeds there (0.130 and 0.054 with AMX off, 0.062 and
 * 0.032 in fp32), and fell at 1e-2; at 2e-3 seed 1 rose 0.094-0.101 on AMX, AVX512-BF16, AVX2
 * and fp32 alike, seed 11 0.054-0.072 (2026-11-30). The
 * held-out accuracy is printed, not asserted: greedy answers to 40 prompts move with the last bits
 * of any kernel (0.200 -> 0.125 after a vectorised exp, the reward still rising 0.232 -> 0.306),
 * as in test_run's bf16 run. */
static void learns(void) {
    char *out;
    int rc = rf_test_sh(&out, "cd %s && %s run r.toml --set logging.dir=%s/lora --set logging.val_every=60 2>&1",
                        dir, rlflow, dir);
    CHECK(rc == 0);
    CHECK(strstr(out, "lora: rank 8, alpha 16 on 28 tensors") != NULL);
    const char *v = strstr(out, "validation accuracy: ");
    double a = -1, b = -1;
    CHECK(v && sscanf(v, "validation accuracy: %lf -> %lf", &a, &b) == 2);
    if (rc || !v) fprintf(stderr, "%s\n", out);
    free(out);
    double r0 = rf_test_metric_mean(dir, "lora", "reward/mean", 1, 20);
    double r1 = rf_test_metric_mean(dir, "lora", "reward/mean", 101, 120);
    double k1 = rf_test_metric_mean(dir, "lora", "actor/kl_ref", 1, 1);
    double k60 = rf_test_metric_mean(dir, "lora", "actor/kl_ref", 60, 60);
    printf("lora: mean reward steps 1-20 %.3f, steps 101-120 %.3f; validation accuracy %.3f -> %.3f; "
           "kl_ref step 1 %.3g, step 60 %.3g\n", r0, r1, a, b, k1, k60);
    /* a rise under RF_TEST_MIN_RISE is a noisy draw now and then (a sanitizer build's roundings:
     * 0.191 -> 0.243): repeated once with another train.seed, which must then learn */
    if (!(r1 > r0 + RF_TEST_MIN_RISE)) rf_test_learned(dir, rlflow, "lora", "--set logging.val_every=60", &r0, &r1);
    CHECK(a >= 0 && a <= 1 && b >= 0 && b <= 1);
    CHECK(fabs(k1) < 1e-6); /* the two passes pack their batches differently: fp32 rounding, seen 2.6e-8 */
    CHECK(k60 > 0);
}

static void resume(void) {
    rf_test_resume_matches(dir, rlflow);
    char *out;
    /* the checkpoint: 2 layers x 7 targets x (A, B) tensors, all adapters, nothing of the base */
    char p[512];
    snprintf(p, sizeof p, "%s/half/step_000040/actor", dir);
    rf_safetensors *st = NULL;
    CHECK_OK(rf_st_open_dir(&st, p));
    if (st) {
        int lora = 0;
        for (int i = 0; i < rf_st_count(st); i++) lora += strstr(rf_st_at(st, i)->name, ".lora_") != NULL;
        CHECK(rf_st_count(st) == 28 && lora == 28);
        CHECK(rf_st_find(st, "model.layers.1.mlp.down_proj.lora_B.weight") != NULL);
        rf_st_close(st);
    }
    /* the checkpoint's PEFT copy: generate with it unmerged, and merged by merge-lora (fp32:
     * the same greedy tokens, log-probs within fp32 rounding) */
    char *a = NULL, *b = NULL;
    CHECK(rf_test_sh(&a, "%s generate --model %s/sft --adapter %s/half/step_000040/adapter --precision fp32 "
                         "--prompt 3+4= --greedy --max-new-tokens 4 --json 2>/dev/null", rlflow, dir, dir) == 0);
    CHECK(rf_test_sh(&out, "%s merge-lora --model %s/sft --adapter %s/half/step_000040/adapter --out %s/merged 2>&1",
                     rlflow, dir, dir, dir) == 0);
    free(out);
    CHECK(rf_test_sh(&b, "%s generate --model %s/merged --precision fp32 --prompt 3+4= --greedy "
                         "--max-new-tokens 4 --json 2>/dev/null", rlflow, dir) == 0);
    cJSON *ja = a ? cJSON_Parse(a) : NULL, *jb = b ? cJSON_Parse(b) : NULL;
    CHECK(ja && jb);
    if (ja && jb) {
        char *ta = cJSON_PrintUnformatted(cJSON_GetObjectItem(ja, "tokens")),
             *tb = cJSON_PrintUnformatted(cJSON_GetObjectItem(jb, "tokens"));
        CHECK(strcmp(ta, tb) == 0);
        const cJSON *la = cJSON_GetObjectItem(ja, "logprobs"), *lb = cJSON_GetObjectItem(jb, "logprobs");
        for (int i = 0; i < cJSON_GetArraySize(la); i++)
            CHECK(fabs(cJSON_GetArrayItem(la, i)->valuedouble - cJSON_GetArrayItem(lb, i)->valuedouble) < 1e-5);
        free(ta), free(tb);
    }
    cJSON_Delete(ja), cJSON_Delete(jb);
    free(a), free(b);
}

/* rlflow sft with [lora]: writes a PEFT adapter (config and tensors), not a model. */
static void sft(void) {
    char *out;
    int rc = rf_test_sh(&out, "cd %s && %s sft r.toml --set sft.max_steps=5 --set sft.out=%s/sft_lora 2>&1", dir, rlflow, dir);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(rf_test_sh(&out, "test -f %s/sft_lora/adapter_config.json && test -f %s/sft_lora/adapter_model.safetensors "
                           "&& ! test -f %s/sft_lora/model.safetensors", dir, dir, dir) == 0);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/sft --adapter %s/sft_lora --prompt 3+4= --greedy --max-new-tokens 4 2>&1",
                     rlflow, dir, dir) == 0);
    free(out);
}

static void bad(const char *set, const char *want) {
    char *out;
    int rc = rf_test_sh(&out, "cd %s && %s run r.toml --set '%s' --set logging.dir=%s/bad 2>&1", dir, rlflow, set, dir);
    CHECK(rc == 1);
    CHECK(strstr(out, want) != NULL);
    if (!strstr(out, want)) fprintf(stderr, "--set %s: %s\n", set, out);
    free(out);
}

static void bad_recipes(void) {
    bad("lora.rank=0", "error: --set: lora.rank = 0: must be >= 1");
    bad("lora.targets=[\"q\",\"qkv\"]",
        "error: --set: lora.targets: \"qkv\" is not allowed (allowed: \"q\", \"k\", \"v\", \"o\", \"gate\", \"up\", \"down\")");
    bad("lora.targets=[]", "error: --set: lora.targets = []: names no projection");
    bad("lora.dropout=0.1", "error: --set: lora.dropout = 0.1 is not implemented yet (dropout on the adapter input; set it to 0)");
    /* layouts on several processes: tests/test_split_lora_tp.c */
}

int main(void) {
    rlflow = getenv("RF_RLFLOW");
    if (!rlflow) {
        printf("test_run_lora: skipped: RF_RLFLOW not set\n");
        return 77;
    }
    snprintf(dir, sizeof dir, "/tmp/rf_run_lora_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    char extra[512];
    snprintf(extra, sizeof extra, "%s", LORA);
    rf_test_write_recipe(dir, RF_TEST_VAL_ENDS, extra);
    /* the recipe's [train] lr and [algorithm] kl_coef for adapters */
    char *out = NULL;
    rf_test_sh(&out, "cd %s && sed -i 's/^lr = 5e-4$/lr = 2e-3/; s/^clip_high = 0.28$/clip_high = 0.28\\nkl_coef = 0.01/' r.toml", dir);
    free(out);
    learns();
    resume();
    sft();
    bad_recipes();
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_run_lora");
}
