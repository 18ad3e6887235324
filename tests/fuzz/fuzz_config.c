/* Model config.json parsing (model/config.c) on arbitrary text; a parsed config is turned back
 * into JSON (what a checkpoint writes), which must parse again, and its RoPE frequencies and
 * maximum sequence length are computed. */
#include "model/config.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = rf_fuzz_cstr(data, size);
    rf_model_config cfg;
    memset(&cfg, 0, sizeof cfg);
    rf_status st = rf_config_parse(&cfg, text, "config.json");
    rf_fuzz_check_error(st);
    if (st == RF_OK) {
        (void)rf_config_max_seq(&cfg);
        if (cfg.head_dim > 0 && cfg.head_dim <= 4096) {
            float *inv = malloc(sizeof(float) * (size_t)cfg.head_dim);
            rf_config_inv_freq(&cfg, inv);
            free(inv);
        }
        char *json = rf_config_to_json(&cfg, (size % 2) == 1);
        rf_model_config back;
        memset(&back, 0, sizeof back);
        if (!json || rf_config_parse(&back, json, "written config.json") != RF_OK) {
            fprintf(stderr, "a parsed config, written back, does not parse: %s\n%s\n",
                    rf_error_message(), json ? json : "(null)");
            abort();
        }
        free(json);
    }
    free(text);
    rf_error_clear();
    return 0;
}
