/* Recipe loading (controller/recipe.c) on arbitrary files: TOML, then every key's type, enum
 * and range checks, then validation. A valid recipe is also written back out (rf_recipe_dump,
 * what a checkpoint saves) and must load again. */
#include "controller/recipe.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = rf_fuzz_file("recipe.toml", data, size);
    rf_recipe r;
    rf_status st = rf_recipe_load(&r, path, NULL, 0);
    rf_fuzz_check_error(st);
    if (st == RF_OK) {
        char dump[600];
        snprintf(dump, sizeof dump, "%s.dump", path);
        FILE *f = fopen(dump, "w");
        if (!f || rf_recipe_dump(&r, f) != RF_OK) abort();
        fclose(f);
        rf_recipe r2;
        st = rf_recipe_load(&r2, dump, NULL, 0);
        if (st != RF_OK) {
            fprintf(stderr, "a valid recipe, dumped, does not load: %s\n", rf_error_message());
            abort();
        }
        rf_recipe_free(&r2);
        rf_recipe_free(&r);
    }
    rf_error_clear();
    return 0;
}
