#include "model/byte_tokenizer.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* Qwen2's pre-tokenizer pattern (digits split one by one). */
static const char *k_split_regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static const char *k_specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};

static const char *k_chatml_jinja =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

/* GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to U+0100 on. */
static void byte_symbol(int b, char out[4]) {
    static int table[256];
    static int ready;
    if (!ready) {
        int n = 0;
        for (int i = 0; i < 256; i++) {
            int printable = (i >= 33 && i <= 126) || (i >= 161 && i <= 172) || (i >= 174);
            table[i] = printable ? i : 256 + n++;
        }
        ready = 1;
    }
    int cp = table[b];
    if (cp < 0x80) {
        out[0] = (char)cp, out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3F)), out[2] = 0;
    }
}

static cJSON *byte_level(void) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "ByteLevel");
    cJSON_AddBoolToObject(o, "add_prefix_space", 0);
    cJSON_AddBoolToObject(o, "trim_offsets", 0);
    cJSON_AddBoolToObject(o, "use_regex", 0);
    return o;
}

static cJSON *tokenizer_json(void) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "version", "1.0");
    cJSON_AddNullToObject(r, "truncation");
    cJSON_AddNullToObject(r, "padding");
    cJSON *added = cJSON_AddArrayToObject(r, "added_tokens");
    for (int i = 0; i < 3; i++) {
        cJSON *t = cJSON_CreateObject();
        cJSON_AddNumberToObject(t, "id", 256 + i);
        cJSON_AddStringToObject(t, "content", k_specials[i]);
        cJSON_AddBoolToObject(t, "single_word", 0);
        cJSON_AddBoolToObject(t, "lstrip", 0);
        cJSON_AddBoolToObject(t, "rstrip", 0);
        cJSON_AddBoolToObject(t, "normalized", 0);
        cJSON_AddBoolToObject(t, "special", 1);
        cJSON_AddItemToArray(added, t);
    }
    cJSON_AddNullToObject(r, "normalizer");
    cJSON *pre = cJSON_AddObjectToObject(r, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "Sequence");
    cJSON *seq = cJSON_AddArrayToObject(pre, "pretokenizers");
    cJSON *split = cJSON_CreateObject();
    cJSON_AddStringToObject(split, "type", "Split");
    cJSON_AddStringToObject(cJSON_AddObjectToObject(split, "pattern"), "Regex", k_split_regex);
    cJSON_AddStringToObject(split, "behavior", "Isolated");
    cJSON_AddBoolToObject(split, "invert", 0);
    cJSON_AddItemToArray(seq, split);
    cJSON_AddItemToArray(seq, byte_level());
    cJSON_AddItemToObject(r, "post_processor", byte_level());
    cJSON_AddItemToObject(r, "decoder", byte_level());
    cJSON *model = cJSON_AddObjectToObject(r, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddStringToObject(model, "continuing_subword_prefix", "");
    cJSON_AddStringToObject(model, "end_of_word_suffix", "");
    cJSON_AddBoolToObject(model, "fuse_unk", 0);
    cJSON_AddBoolToObject(model, "byte_fallback", 0);
    cJSON_AddBoolToObject(model, "ignore_merges", 0);
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int b = 0; b < 256; b++) {
        char sym[4];
        byte_symbol(b, sym);
        cJSON_AddNumberToObject(vocab, sym, b);
    }
    cJSON_AddArrayToObject(model, "merges");
    return r;
}

static cJSON *tokenizer_config(void) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddBoolToObject(r, "add_bos_token", 0);
    cJSON_AddBoolToObject(r, "add_eos_token", 0);
    cJSON_AddNullToObject(r, "bos_token");
    cJSON_AddStringToObject(r, "eos_token", "<|endoftext|>");
    cJSON_AddStringToObject(r, "pad_token", "<|endoftext|>");
    cJSON_AddStringToObject(r, "chat_template", k_chatml_jinja);
    cJSON_AddNumberToObject(r, "model_max_length", 2048);
    cJSON_AddStringToObject(r, "tokenizer_class", "PreTrainedTokenizerFast");
    return r;
}

static rf_status write_json(const char *dir, const char *name, cJSON *j) {
    char path[4096];
    rf_path_join(path, sizeof path, dir, name);
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    if (!text) return rf_error(RF_ERR_NOMEM, "%s: out of memory", path);
    rf_status s = rf_write_file_atomic(path, text, strlen(text));
    free(text);
    return s;
}

rf_status rf_byte_tokenizer_write(const char *dir) {
    RF_TRY(write_json(dir, "tokenizer.json", tokenizer_json()));
    return write_json(dir, "tokenizer_config.json", tokenizer_config());
}
