/* Encoding arbitrary bytes and decoding arbitrary ids (model/tokenizer_encode.c,
 * tokenizer_decode.c) with the test data's real tokenizers (GPT-2, Llama 2, Llama 3, Mistral,
 * Qwen2): the first input byte picks one, the rest is the text, then the same bytes read as
 * int32 ids. Invalid UTF-8 and out-of-range ids must be errors with messages; a text that
 * encodes must decode. */
#include "model/tokenizer.h"
#include "fuzz_util.h"

#ifndef RF_FUZZ_SOURCE_DIR
#define RF_FUZZ_SOURCE_DIR "."
#endif

static rf_tokenizer *toks[5];

static const rf_tokenizer *pick(unsigned i) {
    static const char *const names[5] = {"gpt2", "llama2", "llama3", "mistral", "qwen2"};
    i %= 5;
    if (!toks[i]) {
        const char *src = getenv("RF_SOURCE_DIR");
        char path[1024];
        snprintf(path, sizeof path, "%s/tests/data/tokenizer/%s.json", src ? src : RF_FUZZ_SOURCE_DIR,
                 names[i]);
        if (rf_tokenizer_load(&toks[i], path) != RF_OK) {
            fprintf(stderr, "%s\n", rf_error_message());
            abort();
        }
    }
    return toks[i];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const rf_tokenizer *t = pick(data[0]);
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int32_t *ids = NULL;
    int n = 0;
    rf_status st = rf_tokenizer_encode(t, text, len, data[0] >> 7, &ids, &n);
    rf_fuzz_check_error(st);
    if (st == RF_OK) {
        char *out = NULL;
        size_t olen;
        st = rf_tokenizer_decode(t, ids, n, (data[0] >> 6) & 1, &out, &olen);
        if (st != RF_OK) {
            fprintf(stderr, "encoded ids do not decode: %s\n", rf_error_message());
            abort();
        }
        free(out);
    }
    free(ids);
    int n_raw = (int)(len / 4);
    int32_t *raw = malloc(sizeof(int32_t) * (size_t)(n_raw ? n_raw : 1));
    memcpy(raw, text, (size_t)n_raw * 4);
    char *out = NULL;
    size_t olen;
    rf_fuzz_check_error(rf_tokenizer_decode(t, raw, n_raw, data[0] & 1, &out, &olen));
    free(out);
    free(raw);
    rf_error_clear();
    return 0;
}
