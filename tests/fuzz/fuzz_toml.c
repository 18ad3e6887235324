/* TOML parser (common/toml.c) on arbitrary bytes: parse, then walk every node reading its
 * value and position, as the recipe loader does. */
#include "common/toml.h"
#include "fuzz_util.h"

static void walk(const rf_toml *v, int depth) {
    if (depth > 200) return;
    (void)rf_toml_line(v), (void)rf_toml_col(v), (void)rf_toml_origin(v);
    size_t n = rf_toml_count(v), len;
    switch (rf_toml_kind(v)) {
    case RF_TOML_TABLE:
        for (size_t i = 0; i < n; i++) {
            int line, col;
            (void)rf_toml_key(v, i, &len);
            rf_toml_key_pos(v, i, &line, &col);
            walk(rf_toml_value(v, i), depth + 1);
        }
        break;
    case RF_TOML_ARRAY:
        for (size_t i = 0; i < n; i++) walk(rf_toml_at(v, i), depth + 1);
        break;
    case RF_TOML_INTEGER: (void)rf_toml_int(v); break;
    case RF_TOML_FLOAT: (void)rf_toml_float(v); break;
    case RF_TOML_BOOL: (void)rf_toml_bool(v); break;
    default: (void)rf_toml_string(v, &len); break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rf_toml *root = NULL;
    rf_status st = rf_toml_parse(&root, (const char *)data, size, "fuzz.toml");
    rf_fuzz_check_error(st);
    if (st == RF_OK) {
        walk(root, 0);
        const char *s;
        int64_t i;
        rf_fuzz_check_error(rf_toml_get_string(root, "model.path", &s));
        rf_fuzz_check_error(rf_toml_get_int(root, "rollout.n", &i));
    }
    rf_toml_free(root);
    rf_error_clear();
    return 0;
}
