/* JSONL dataset loading (controller/dataset.c) on arbitrary files, without a tokenizer and with
 * a chat template (string prompts and message lists), then every example and one epoch of
 * the stream read back. */
#include "controller/dataset.h"
#include "fuzz_util.h"

static void load(const char *path, const rf_dataset_opts *o) {
    rf_dataset *ds = NULL;
    rf_status st = rf_dataset_load(&ds, path, o, NULL);
    rf_fuzz_check_error(st);
    if (st != RF_OK) return;
    int n = rf_dataset_size(ds);
    for (int i = 0; i < n; i++) {
        const rf_example *e = rf_dataset_get(ds, i);
        if (!e->prompt_text || !e->extra) abort();
        (void)strlen(e->prompt_text);
        if (e->answer) (void)strlen(e->answer);
    }
    rf_dataset_pos pos = {0, 0};
    const rf_example *batch[4];
    for (int i = 0; i < n + 4 && i < 64; i += 4)
        rf_fuzz_check_error(rf_dataset_next(ds, &pos, 4, batch));
    rf_dataset_free(ds);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = rf_fuzz_file("data.jsonl", data, size);
    load(path, NULL);
    rf_dataset_opts o;
    memset(&o, 0, sizeof o);
    o.chat_template = "qwen2";
    o.need_answer = 1;
    load(path, &o);
    rf_error_clear();
    return 0;
}
