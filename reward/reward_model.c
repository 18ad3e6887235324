/* Reward-model scoring: a Llama / Qwen-family ...ForSequenceClassification checkpoint (a
 * decoder with a scalar head, score.weight) run over packed token sequences, pooled at the
 * last token the way transformers pools it (GenericForSequenceClassification: the last token
 * that is not pad_token_id). */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/model.h"
#include "model/model_tp.h"
#include "model/safetensors.h"
#include "reward/reward.h"

/* Tokens per forward pass: bounds the activation memory of one scoring call. */
#define RF_RM_CHUNK_TOKENS 8192

struct rf_reward_model {
    rf_model *m;       /* whole, or NULL when split */
    rf_model_tp *tp;   /* this rank's shard when split over tensor-parallel ranks */
    rf_tokenizer *tok;
    int pad_id;        /* config.json pad_token_id, -1 when absent */
};

/* Reads config.json's architectures (must name a ...ForSequenceClassification) and
 * pad_token_id. num_labels is checked by rf_config_load. */
static rf_status read_rm_config(const char *dir, int *pad_id) {
    char path[4096], *text = NULL;
    size_t len;
    rf_path_join(path, sizeof path, dir, "config.json");
    RF_TRY(rf_read_file(path, &text, &len));
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) return rf_error(RF_ERR_FORMAT, "%s: not valid JSON", path);
    int is_cls = 0;
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(root, "architectures"), *it;
    cJSON_ArrayForEach(it, archs)
        if (cJSON_IsString(it) && strstr(it->valuestring, "ForSequenceClassification")) is_cls = 1;
    const cJSON *pad = cJSON_GetObjectItemCaseSensitive(root, "pad_token_id");
    *pad_id = cJSON_IsNumber(pad) ? pad->valueint : -1;
    cJSON_Delete(root);
    if (!is_cls)
        return rf_error(RF_ERR_FORMAT, "%s: \"architectures\" names no ...ForSequenceClassification: "
                        "not a reward model", path);
    return RF_OK;
}

/* A reward model's head is trained: refuse a checkpoint that lacks it. */
static rf_status check_score_weight(const char *dir) {
    rf_safetensors *st = NULL;
    RF_TRY(rf_st_open_dir(&st, dir));
    int has = rf_st_find(st, "score.weight") != NULL;
    rf_st_close(st);
    if (!has)
        return rf_error(RF_ERR_FORMAT, "%s: no tensor \"score.weight\": not a reward model "
                        "checkpoint (a policy checkpoint has no trained scalar head)", dir);
    return RF_OK;
}

/* Opens the model whole (group NULL) or split over group's ranks. */
static rf_status open_rm(rf_reward_model **rm, const char *dir, const rf_kernels *k, rf_comm *group, double timeout_s) {
    *rm = NULL;
    rf_reward_model *r = calloc(1, sizeof *r);
    if (!r) return rf_error(RF_ERR_NOMEM, "out of memory for reward model %s", dir);
    rf_status s = read_rm_config(dir, &r->pad_id);
    if (s == RF_OK) s = check_score_weight(dir);
    if (s == RF_OK && !group) s = rf_model_load_frozen(&r->m, dir, k, 1); /* never trained here */
    if (s == RF_OK && group) {
        rf_model_config cfg;
        char path[4096];
        rf_path_join(path, sizeof path, dir, "config.json");
        s = rf_config_load(&cfg, path);
        cfg.value_head = 1;
        if (s == RF_OK) s = rf_model_tp_init(&r->tp, &cfg, k, group, timeout_s);
        if (s == RF_OK) s = rf_model_tp_load(r->tp, dir, NULL, NULL);
    }
    if (s == RF_OK && (s = rf_tokenizer_load_dir(&r->tok, dir)) != RF_OK)
        rf_error_wrap(s, "reward model %s", dir);
    if (s != RF_OK) {
        rf_reward_model_close(r);
        return s;
    }
    *rm = r;
    return RF_OK;
}

rf_status rf_reward_model_open(rf_reward_model **rm, const char *dir, const rf_kernels *k) {
    return open_rm(rm, dir, k, NULL, 0);
}

rf_status rf_reward_model_open_tp(rf_reward_model **rm, const char *dir, const rf_kernels *k, rf_comm *group,
                                  double timeout_s) {
    if (!group) return rf_error(RF_ERR_ARG, "reward model %s: no tensor-parallel group", dir);
    return open_rm(rm, dir, k, group, timeout_s);
}

int rf_reward_model_split(const rf_reward_model *rm) { return rm && rm->tp ? rm->tp->tp : 0; }

void rf_reward_model_close(rf_reward_model *rm) {
    if (!rm) return;
    rf_model_tp_free(rm->tp);
    rf_model_free(rm->m);
    rf_tokenizer_free(rm->tok);
    free(rm);
}

const rf_tokenizer *rf_reward_model_tokenizer(const rf_reward_model *rm) { return rm->tok; }

const struct rf_model *rf_reward_model_model(const rf_reward_model *rm) { return rm->m; }

/* Index of the pooled token in seq: the last one that is not pad (transformers takes
 * argmax(arange(T) * (ids != pad)), which is 0 for an all-pad row). */
static int pooled_index(const int32_t *seq, int len, int pad_id) {
    for (int i = len - 1; i >= 0; i--)
        if (seq[i] != pad_id) return i;
    return 0;
}

/* Scores sequences [a, b) in one packed forward pass. */
static rf_status score_chunk(rf_reward_model *rm, const int32_t *const *seqs, const int *lens,
                             int a, int b, float *scores) {
    int T = 0;
    for (int i = a; i < b; i++) T += lens[i];
    int32_t *tok = malloc((size_t)T * sizeof *tok), *cu = malloc((size_t)(b - a + 1) * sizeof *cu);
    float *values = malloc((size_t)T * sizeof *values);
    rf_status s = tok && cu && values ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory scoring %d tokens", T);
    if (s == RF_OK) {
        cu[0] = 0;
        for (int i = a; i < b; i++) {
            memcpy(tok + cu[i - a], seqs[i], (size_t)lens[i] * sizeof *tok);
            cu[i - a + 1] = cu[i - a] + lens[i];
        }
        rf_batch batch = {b - a, T, tok, NULL, cu};
        if (rm->tp) { /* every rank of the group, the same sequences */
            s = rf_model_tp_forward(rm->tp, &batch);
            if (s == RF_OK) s = rf_model_tp_values(rm->tp, values);
        } else {
            s = rf_model_forward(rm->m, &batch);
            if (s == RF_OK) s = rf_model_values(rm->m, values);
        }
        for (int i = a; s == RF_OK && i < b; i++)
            scores[i] = values[cu[i - a] + pooled_index(seqs[i], lens[i], rm->pad_id)];
    }
    free(tok);
    free(cu);
    free(values);
    return s;
}

rf_status rf_reward_model_score(rf_reward_model *rm, const int32_t *const *seqs,
                                const int *lens, int n, float *scores) {
    if (n < 0) return rf_error(RF_ERR_ARG, "reward model: %d sequences", n);
    for (int i = 0; i < n; i++)
        if (lens[i] < 1 || !seqs[i])
            return rf_error(RF_ERR_ARG, "reward model: sequence %d is empty (length %d)", i, lens[i]);
    for (int a = 0; a < n;) {
        int b = a + 1;
        long T = lens[a];
        while (b < n && T + lens[b] <= RF_RM_CHUNK_TOKENS) T += lens[b++];
        RF_TRY(score_chunk(rm, seqs, lens, a, b, scores));
        a = b;
    }
    return RF_OK;
}
