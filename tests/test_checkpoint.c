/* Checkpoints (trainer/checkpoint.h), in one process:
 *   - a whole actor and critic with AdamW moments saved and loaded back: parameters, both
 *     moments, optimizer steps and the run state (step, data position, KL coefficient and best
 *     score as exact floats) come back bit for bit;
 *   - roles whose tensors are made on demand (rf_checkpoint_save_roles, as the tensor-parallel
 *     and ZeRO-1 training ranks write them) give byte-identical files to the whole models', and
 *     each tensor is asked for once per part;
 *   - a checkpoint's moments read a range at a time (as ZeRO-1 ranks read their blocks) equal
 *     the saved buffer bit for bit for ranges inside rows, across tensors, whole and empty
 *     (F32), and a BF16 model over several files equals rf_model_load's rounding; a range past
 *     the buffer is refused; the parameters-only load leaves the moments alone;
 *   - a role whose tensor function fails part-way: the save returns that error, and the last
 *     good checkpoint stays the newest (`latest` unchanged, no directory for the failed step),
 *     then a later save succeeds;
 *   - the RL admission count ("admitted"): back as saved, absent when 0 (SFT, older releases:
 *     loads as 0), and -3, 2.5, "12" or 1e300 refused with the file, key and value named;
 *   - config.json names the dtype of the weights saved beside it ("dtype" for transformers 5,
 *     "torch_dtype" for 4.x): bfloat16 for BF16 files, float32 for F32 ones and checkpoints,
 *     and rlflow reads back what it writes and what transformers 5 writes;
 *   - the tokenizer files a checkpoint or merge-lora copies include transformers 5's
 *     chat_template.jinja and the 4.x files it still reads, byte for byte. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/checkpoint.h"

static char dir[256];

static void fill_moments(rf_model *m, float scale) {
    for (size_t i = 0; i < m->n_params; i++) {
        m->opt_m[i] = scale * ((float)(i % 101) - 50.0f), m->opt_v[i] = scale * (float)(i % 37) * 1e-3f;
    }
}

static int same_model(const rf_model *a, const rf_model *b) {
    size_t n = sizeof(float) * a->n_params;
    return a->n_params == b->n_params && memcmp(a->params, b->params, n) == 0 && memcmp(a->opt_m, b->opt_m, n) == 0 &&
           memcmp(a->opt_v, b->opt_v, n) == 0 && a->opt_step == b->opt_step;
}

static int same_file(const char *a, const char *b) {
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    int same = rf_read_file(a, &x, &nx) == RF_OK && rf_read_file(b, &y, &ny) == RF_OK && nx == ny && memcmp(x, y, nx) == 0;
    free(x), free(y);
    return same;
}

/* config.json's "dtype" and "torch_dtype" in dir: both equal to want, and the file loads back. */
static void check_config_dtype(const char *dir, const char *want) {
    char p[700], *text = NULL;
    snprintf(p, sizeof p, "%s/config.json", dir);
    CHECK_OK(rf_read_file(p, &text, NULL));
    cJSON *j = text ? cJSON_Parse(text) : NULL;
    const char *d = cJSON_GetStringValue(cJSON_GetObjectItem(j, "dtype"));
    const char *td = cJSON_GetStringValue(cJSON_GetObjectItem(j, "torch_dtype"));
    int ok = d && td && strcmp(d, want) == 0 && strcmp(td, want) == 0;
    if (!ok) fprintf(stderr, "%s: dtype %s, torch_dtype %s; want %s\n", p, d ? d : "-", td ? td : "-", want);
    CHECK(ok);
    rf_model_config c;
    CHECK_OK(rf_config_load(&c, p));
    /* what transformers 5 writes: "dtype" alone */
    cJSON_DeleteItemFromObject(j, "torch_dtype");
    char *t5 = cJSON_Print(j);
    CHECK_OK(rf_config_parse(&c, t5, "transformers 5 config.json"));
    free(t5), free(text);
    cJSON_Delete(j);
}

/* The dtype in config.json follows the weights; the tokenizer files transformers reads are copied. */
static void hf_files(const char *run) {
    rf_model *m = rf_test_tiny_model(5, 0);
    char p[700], q[700];
    snprintf(p, sizeof p, "%s/hf_bf16", dir);
    CHECK_OK(rf_model_save(m, p, 1, 0));
    check_config_dtype(p, "bfloat16");
    snprintf(p, sizeof p, "%s/hf_f32", dir);
    CHECK_OK(rf_model_save(m, p, 0, 0));
    check_config_dtype(p, "float32");
    snprintf(p, sizeof p, "%s/step_000010/actor", run);
    check_config_dtype(p, "float32");
    rf_model_free(m);
    static const char *files[] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                                  "special_tokens_map.json", "added_tokens.json", "additional_chat_templates/tool_use.jinja"};
    snprintf(p, sizeof p, "%s/tok_src/additional_chat_templates", dir);
    CHECK_OK(rf_mkdirs(p));
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(p, sizeof p, "%s/tok_src/%s", dir, files[i]);
        CHECK_OK(rf_write_file_atomic(p, files[i], strlen(files[i]))); /* its own name as content */
    }
    snprintf(p, sizeof p, "%s/tok_src", dir);
    snprintf(q, sizeof q, "%s/tok_dst", dir);
    CHECK_OK(rf_mkdirs(q));
    CHECK_OK(rf_copy_tokenizer_files(p, q));
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(p, sizeof p, "%s/tok_src/%s", dir, files[i]);
        snprintf(q, sizeof q, "%s/tok_dst/%s", dir, files[i]);
        int same = same_file(p, q);
        if (!same) fprintf(stderr, "%s: not copied\n", files[i]);
        CHECK(same);
    }
}

/* A whole model's tensors handed out one at a time, counting the calls; failing at call fail_at. */
typedef struct counting {
    rf_ckpt_role inner;
    int calls, fail_at;
} counting;

static rf_status counted_tensor(void *ctx, int part, int view, float *dst) {
    counting *c = ctx;
    if (++c->calls == c->fail_at) return rf_error(RF_ERR_IO, "tensor %d of part %d could not be gathered", view, part);
    return c->inner.tensor(c->inner.ctx, part, view, dst);
}

static rf_ckpt_role counted(counting *c) {
    rf_ckpt_role r = c->inner;
    r.tensor = counted_tensor, r.ctx = c;
    return r;
}

/* Ranges of a checkpoint's moments (rf_checkpoint_moments_read, on rf_model_read_range) equal
 * the whole buffer's: a float, runs starting and ending inside rows, across tensors, all of
 * it, none; then the same from BF16 files of ~2 KB each (a model's parameters, saved and read
 * as rf_model_load rounds them); a range past the buffer is refused. Plus the parameters-only
 * load: the parameters and the state, the moments left alone. */
static void moment_ranges(const char *run, const rf_model *actor) {
    char ckpt[600];
    CHECK_OK(rf_checkpoint_latest(run, ckpt, sizeof ckpt));
    rf_ckpt_moments cm;
    CHECK_OK(rf_checkpoint_moments_open(&cm, ckpt, "actor", actor, NULL));
    size_t n = actor->n_params, row = (size_t)actor->cfg.hidden_size;
    float *got = malloc(sizeof(float) * (n + 1));
    size_t ranges[][2] = {{0, n}, {0, 1}, {n - 1, 1}, {3, row}, {row - 1, 2}, {5, 3 * row + 7}, {n / 3, n / 2},
                          {n / 2, 0}, {actor->views[1].offset - 3, 10}, {actor->views[2].offset + 1, row * 2}};
    int all_same = 1;
    for (size_t k = 0; k < sizeof ranges / sizeof ranges[0]; k++) {
        size_t a = ranges[k][0], c = ranges[k][1];
        for (int which = 1; which <= 2; which++) {
            got[c] = -1.0f;
            CHECK_OK(rf_checkpoint_moments_read(&cm, which, a, c, got));
            const float *want = (which == 1 ? actor->opt_m : actor->opt_v) + a;
            int same = memcmp(got, want, sizeof(float) * c) == 0 && got[c] == -1.0f;
            if (!same) fprintf(stderr, "moment %d, floats [%zu, %zu): not the saved ones\n", which, a, a + c);
            all_same &= same;
        }
    }
    CHECK(all_same);
    CHECK_ERR(rf_checkpoint_moments_read(&cm, 1, n - 2, 3, got), RF_ERR_ARG, "floats [");
    rf_checkpoint_moments_close(&cm);
    /* BF16 over several files */
    char bf[600];
    snprintf(bf, sizeof bf, "%s/bf16", dir);
    CHECK_OK(rf_model_save(actor, bf, 1, 2048));
    rf_model *rounded = NULL;
    rf_safetensors *st = NULL;
    CHECK_OK(rf_model_load(&rounded, bf, rf_cpu_kernels(), 0));
    CHECK_OK(rf_st_open_dir(&st, bf));
    all_same = rounded && st;
    for (size_t k = 0; all_same && k < sizeof ranges / sizeof ranges[0]; k++) {
        size_t a = ranges[k][0], c = ranges[k][1];
        CHECK_OK(rf_model_read_range(actor->views, actor->n_views, NULL, st, NULL, a, c, got));
        all_same = memcmp(got, rounded->params + a, sizeof(float) * c) == 0;
        if (!all_same) fprintf(stderr, "bf16: floats [%zu, %zu): not rf_model_load's\n", a, a + c);
    }
    CHECK(all_same);
    rf_st_close(st);
    rf_model_free(rounded);
    /* parameters and state only */
    rf_model *a3 = rf_test_tiny_model(9, 0);
    fill_moments(a3, 3.0f);
    rf_ckpt_state got_st = {0};
    char d[600];
    CHECK_OK(rf_checkpoint_load_parts(run, a3, NULL, 0, &got_st, d, sizeof d));
    CHECK(strcmp(d, ckpt) == 0 && got_st.actor_opt_steps == actor->opt_step);
    CHECK(memcmp(a3->params, actor->params, sizeof(float) * n) == 0 && a3->opt_m[5] == 3.0f * (5.0f - 50.0f));
    rf_model_free(a3);
    free(got);
}

/* 1 when the file at path holds needle. */
static int file_has(const char *path, const char *needle) {
    char *text = NULL;
    if (rf_read_file(path, &text, NULL) != RF_OK) return 0;
    int has = strstr(text, needle) != NULL;
    free(text);
    return has;
}

/* trainer_state.json's "admitted" (the RL admission count a resumed run's group ids go on from):
 * back as saved; absent when 0 (SFT's checkpoints, and an older release's, which load as 0);
 * present but not a whole number >= 0, refused naming the file, key and value. */
static void admission_count(const char *run, rf_model *actor, rf_model *critic) {
    rf_ckpt_state st = {.step = 30, .pos = {0, 7}, .kl_beta = 0.1f, .best_val = -1, .admitted = 487}, got = {0};
    CHECK_OK(rf_checkpoint_save(run, actor, critic, NULL, &st, 0));
    CHECK_OK(rf_checkpoint_load(run, NULL, NULL, &got));
    CHECK(got.step == 30 && got.admitted == 487);
    char p[600], want[800];
    snprintf(p, sizeof p, "%s/step_000030/trainer_state.json", run);
    CHECK(file_has(p, "\"admitted\":\t487"));
    st.step = 40, st.admitted = 0;
    CHECK_OK(rf_checkpoint_save(run, actor, critic, NULL, &st, 0));
    got.admitted = -1;
    CHECK_OK(rf_checkpoint_load(run, NULL, NULL, &got));
    snprintf(p, sizeof p, "%s/step_000040/trainer_state.json", run);
    CHECK(got.step == 40 && got.admitted == 0 && !file_has(p, "admitted"));
    static const char *bad[] = {"-3", "2.5", "\"12\"", "1e300"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char text[300];
        snprintf(text, sizeof text, "{\"step\": 40, \"actor_optimizer_steps\": 7, \"critic_optimizer_steps\": 5, "
                 "\"data_epoch\": 0, \"data_index\": 7, \"admitted\": %s, \"kl_beta\": \"0x1p-1\", \"best_val\": \"-0x1p+0\"}",
                 bad[i]);
        CHECK_OK(rf_write_file_atomic(p, text, strlen(text)));
        snprintf(want, sizeof want, "%s: \"admitted\" = %s: not a whole number of groups >= 0", p,
                 strcmp(bad[i], "1e300") == 0 ? "1e+300" : bad[i]);
        CHECK_ERR(rf_checkpoint_load(run, NULL, NULL, &got), RF_ERR_FORMAT, want);
    }
}

/* trainer_state.json's other fields, as a hand-edited or damaged file may hold them: refused
 * naming the file, key and value, never converted out of range (a double outside int's range is
 * undefined behaviour to convert) nor read as a silent 0 ("abc" through strtod). */
static void state_fields_refused(const char *run) {
    static const char *const cases[][2] = {
        {"\"step\": -1", "\"step\" = -1: not a whole number in 0..2147483647"},
        {"\"step\": 40.5", "\"step\" = 40.5: not a whole number in 0..2147483647"},
        {"\"data_index\": 1e300", "\"data_index\" = 1e+300: not a whole number in 0..2147483647"},
        {"\"actor_optimizer_steps\": \"7\"", "\"actor_optimizer_steps\" = \"7\": not a whole number"},
        {"\"kl_beta\": \"abc\"", "\"kl_beta\" = \"abc\": not a number"},
        {"\"kl_beta\": -1", "\"kl_beta\" = -1: not a finite number >= 0"},
        {"\"kl_beta\": 1e300", "\"kl_beta\" = 1e+300: not a finite number >= 0"},
        {"\"best_val\": \"0x1p-2 \"", "\"best_val\" = \"0x1p-2 \": not a number"},
        {"\"data_epoch\": null", "\"data_epoch\" = null: not a whole number in 0..2147483647"},
    };
    char p[600], want[900], text[600];
    snprintf(p, sizeof p, "%s/step_000040/trainer_state.json", run);
    rf_ckpt_state got = {0};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        /* the good file with one field replaced: written first, since cJSON finds the first of
         * two keys of the same name */
        snprintf(text, sizeof text, "{%s, \"step\": 40, \"actor_optimizer_steps\": 7, \"critic_optimizer_steps\": 5, "
                 "\"data_epoch\": 0, \"data_index\": 7, \"kl_beta\": \"0x1p-1\", \"best_val\": \"-0x1p+0\"}",
                 cases[i][0]);
        CHECK_OK(rf_write_file_atomic(p, text, strlen(text)));
        snprintf(want, sizeof want, "%s: %s", p, cases[i][1]);
        CHECK_ERR(rf_checkpoint_load(run, NULL, NULL, &got), RF_ERR_FORMAT, want);
    }
    /* exact hex floats, -inf (no best validation yet) and numbers read back */
    snprintf(text, sizeof text, "{\"step\": 40, \"actor_optimizer_steps\": 7, \"critic_optimizer_steps\": 5, "
             "\"data_epoch\": 2147483647, \"data_index\": 7, \"kl_beta\": 0.5, \"best_val\": \"-inf\"}");
    CHECK_OK(rf_write_file_atomic(p, text, strlen(text)));
    CHECK_OK(rf_checkpoint_load(run, NULL, NULL, &got));
    CHECK(got.step == 40 && got.pos.epoch == 2147483647 && got.kl_beta == 0.5f && isinf(got.best_val) &&
          got.best_val < 0);
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/rf_ckpt_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    char run[300], other[300], p[600], q[600];
    snprintf(run, sizeof run, "%s/run", dir);
    snprintf(other, sizeof other, "%s/roles", dir);
    rf_model *actor = rf_test_tiny_model(1, 0), *critic = rf_test_tiny_model(2, 1);
    fill_moments(actor, 0.01f), fill_moments(critic, -0.02f);
    actor->opt_step = 7, critic->opt_step = 5;
    rf_ckpt_state st = {.step = 10, .pos = {2, 345}, .kl_beta = 0.0123456789f, .best_val = 0.4375};
    CHECK_OK(rf_checkpoint_save(run, actor, critic, NULL, &st, 0));

    /* back bit for bit */
    rf_model *a2 = rf_test_tiny_model(3, 0), *c2 = rf_test_tiny_model(4, 1);
    rf_ckpt_state got = {0};
    CHECK_OK(rf_checkpoint_load(run, a2, c2, &got));
    CHECK(same_model(actor, a2) && same_model(critic, c2));
    CHECK(got.step == 10 && got.pos.epoch == 2 && got.pos.index == 345 && got.kl_beta == st.kl_beta &&
          got.best_val == st.best_val && got.actor_opt_steps == 7 && got.critic_opt_steps == 5);
    char latest[600];
    CHECK_OK(rf_checkpoint_latest(run, latest, sizeof latest));
    snprintf(p, sizeof p, "%s/step_000010", run);
    CHECK(strcmp(latest, p) == 0);

    moment_ranges(run, actor);
    hf_files(run);

    /* tensors on demand: the same bytes, each asked for once per part */
    counting ca = {rf_checkpoint_role_of(actor), 0, 0}, cc = {rf_checkpoint_role_of(critic), 0, 0};
    rf_ckpt_role ra = counted(&ca), rc = counted(&cc);
    CHECK_OK(rf_checkpoint_save_roles(other, &ra, &rc, NULL, &st, 0));
    CHECK(ca.calls == 3 * actor->n_views && cc.calls == 3 * critic->n_views);
    static const char *files[] = {"actor/model.safetensors", "actor/config.json", "actor_optim/model.safetensors",
                                  "actor_optim/moments2/model.safetensors", "critic/model.safetensors",
                                  "critic_optim/moments2/model.safetensors", "trainer_state.json"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(p, sizeof p, "%s/step_000010/%s", run, files[i]);
        snprintf(q, sizeof q, "%s/step_000010/%s", other, files[i]);
        int same = same_file(p, q);
        if (!same) fprintf(stderr, "%s differs between the whole and the on-demand save\n", files[i]);
        CHECK(same);
    }

    /* a failure part-way (a moment tensor of the critic) leaves step 10 the newest */
    st.step = 20;
    counting bad = {rf_checkpoint_role_of(critic), 0, critic->n_views + 3};
    rf_ckpt_role rb = counted(&bad);
    CHECK_ERR(rf_checkpoint_save_roles(run, &ra, &rb, NULL, &st, 0), RF_ERR_IO, "could not be gathered");
    CHECK_OK(rf_checkpoint_latest(run, latest, sizeof latest));
    snprintf(p, sizeof p, "%s/step_000010", run);
    CHECK(strcmp(latest, p) == 0);
    snprintf(p, sizeof p, "%s/step_000020", run);
    CHECK(!rf_file_exists(p));
    CHECK_OK(rf_checkpoint_load(run, a2, c2, &got));
    CHECK(got.step == 10 && same_model(actor, a2));
    /* and the next save goes through */
    CHECK_OK(rf_checkpoint_save(run, actor, critic, NULL, &st, 0));
    CHECK_OK(rf_checkpoint_latest(run, latest, sizeof latest));
    CHECK(strcmp(latest, p) == 0);

    admission_count(run, actor, critic);
    state_fields_refused(run);

    rf_model_free(actor), rf_model_free(critic), rf_model_free(a2), rf_model_free(c2);
    if (!rf_test_failed) rf_remove_tree(dir);
    return rf_test_finish("test_checkpoint");
}
