#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/log.h"
#include "common/util.h"

int rf_cli_fail(rf_status s) {
    rf_log_status(s);
    return 1;
}

int rf_cli_usage_fail(rf_status s) {
    rf_log_status(s);
    return 2;
}

rf_status rf_cli_backend(const char *device, const rf_kernels **out) {
    *out = rf_kernels_for(device);
    if (*out) return RF_OK;
    int cuda = strcmp(device, "cuda") == 0; /* NULL is the CPU's, which always starts */
    return rf_error_wrap(cuda ? RF_ERR_NODEVICE : RF_ERR_ARG, "--device%s", cuda ? " cuda" : "");
}

rf_status rf_cli_open(const char *dir, const char *device, const char *precision, int frozen, rf_model **m,
                      rf_tokenizer **tok) {
    const rf_kernels *k;
    *m = NULL;
    *tok = NULL;
    RF_TRY(rf_cli_backend(device, &k));
    RF_TRY(rf_kernels_apply_precision(k, precision, "--precision", NULL));
    RF_TRY(frozen ? rf_model_load_frozen(m, dir, k, 0) : rf_model_load(m, dir, k, 0));
    rf_status s = rf_tokenizer_load_dir(tok, dir);
    if (s != RF_OK) {
        rf_model_free(*m);
        *m = NULL;
        return s;
    }
    int tv = rf_tokenizer_vocab_size(*tok), mv = (*m)->cfg.vocab_size;
    if (tv > mv) {
        rf_tokenizer_free(*tok);
        rf_model_free(*m);
        *tok = NULL, *m = NULL;
        return rf_error(RF_ERR_FORMAT, "%s: tokenizer has %d tokens but config.json vocab_size is %d",
                        dir, tv, mv);
    }
    return RF_OK;
}

static int add_id(int32_t *ids, int n, int cap, int id) {
    if (id < 0 || n >= cap) return n;
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return n;
    ids[n] = id;
    return n + 1;
}

int rf_cli_eos_ids(const char *dir, const rf_model *m, const rf_tokenizer *tok, int32_t *ids,
                   int cap) {
    int n = 0;
    char path[4096], *text = NULL;
    rf_path_join(path, sizeof path, dir, "generation_config.json");
    if (rf_file_exists(path) && rf_read_file(path, &text, NULL) == RF_OK) {
        cJSON *r = cJSON_Parse(text), *e = r ? cJSON_GetObjectItem(r, "eos_token_id") : NULL, *it;
        if (cJSON_IsNumber(e)) n = add_id(ids, n, cap, e->valueint);
        if (cJSON_IsArray(e)) cJSON_ArrayForEach(it, e) if (cJSON_IsNumber(it)) n = add_id(ids, n, cap, it->valueint);
        cJSON_Delete(r);
        free(text);
    }
    for (int i = 0; i < m->cfg.n_eos; i++) n = add_id(ids, n, cap, m->cfg.eos_token_ids[i]);
    if (tok) n = add_id(ids, n, cap, rf_tokenizer_eos_id(tok));
    return n;
}
