/* Hugging Face tokenizer.json BPE tokenizers, read and run in C.
 *
 * Supports the two BPE families current causal LMs ship with, and matches the Rust
 * `tokenizers` library (the reference for every tokenizer.json) token for token:
 *  - byte-level BPE (GPT-2, Qwen2/2.5/3, Llama-3): ByteLevel or Split(Regex)+ByteLevel
 *    pre-tokenizers, NFC normalizer, ignore_merges, ByteLevel decoder;
 *  - SentencePiece-style BPE (Llama-2, Mistral): Prepend/Replace normalizers or the
 *    Metaspace pre-tokenizer, byte_fallback <0xNN> tokens, unk, Replace/ByteFallback/Fuse/
 *    Strip/Metaspace decoders.
 * Anything else in a tokenizer.json (Unigram, WordPiece, unknown normalizers...) is refused
 * with RF_ERR_UNSUPPORTED naming the JSON field, never approximated. See docs/tokenizer.md.
 *
 * A loaded tokenizer is immutable: encode/decode may run from many threads at once. */
#ifndef RF_TOKENIZER_H
#define RF_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct rf_tokenizer rf_tokenizer;

/* Loads a tokenizer.json. The caller owns *out (rf_tokenizer_free).
 * Errors: RF_ERR_IO (file unreadable) and RF_ERR_FORMAT (bad JSON, missing or mistyped field)
 * naming the file and the field; RF_ERR_UNSUPPORTED naming the field whose type we do not
 * implement (e.g. "model.type \"Unigram\" is not supported (rlflow reads BPE)"). Ids may be
 * sparse: memory follows the number of tokens, not the largest id. */
rf_status rf_tokenizer_load(rf_tokenizer **out, const char *path);

/* Loads dir/tokenizer.json plus, when present, dir/tokenizer_config.json: bos_token and
 * eos_token set bos/eos ids; an explicit add_bos_token/add_eos_token adds or drops BOS/EOS
 * around the encoded text as transformers' Llama-family fast tokenizers do. */
rf_status rf_tokenizer_load_dir(rf_tokenizer **out, const char *dir);

/* Accepts NULL. */
void rf_tokenizer_free(rf_tokenizer *t);

/* Encodes `len` bytes of UTF-8 `text` (embedded NULs allowed) like HF
 * encode(text, add_special_tokens=add_special). *ids is malloc'd (also when *n_ids is 0);
 * the caller frees it. Errors: RF_ERR_ARG for invalid UTF-8 (with the byte offset). */
rf_status rf_tokenizer_encode(const rf_tokenizer *t, const char *text, size_t len,
                              int add_special, int32_t **ids, int *n_ids);

/* Decodes ids like HF decode(ids, skip_special_tokens=skip_special): the same decoder chain,
 * including U+FFFD for byte sequences that are not valid UTF-8 (e.g. a cut-off character).
 * *text is malloc'd and NUL-terminated, *len excludes the NUL; the caller frees it. The text
 * itself may hold NULs (a token decoding to U+0000): use *len, not strlen.
 * Errors: RF_ERR_RANGE for an id outside the vocabulary (HF would silently drop it). */
rf_status rf_tokenizer_decode(const rf_tokenizer *t, const int32_t *ids, int n_ids,
                              int skip_special, char **text, size_t *len);

/* Max id + 1 over the model vocab and the added tokens (what an embedding must cover; with
 * sparse ids it can exceed the number of tokens by far). */
int rf_tokenizer_vocab_size(const rf_tokenizer *t);

/* Id of a vocab or added token string, -1 if absent. */
int32_t rf_tokenizer_token_to_id(const rf_tokenizer *t, const char *token);

/* Token string of an id (owned by the tokenizer), NULL if absent. */
const char *rf_tokenizer_id_to_token(const rf_tokenizer *t, int32_t id);

/* BOS id from tokenizer_config.json or the post-processor template; -1 when unknown. */
int32_t rf_tokenizer_bos_id(const rf_tokenizer *t);

/* EOS id from tokenizer_config.json eos_token, else the first present of <|endoftext|>,
 * <|end_of_text|>, </s>, <|im_end|>, <|eot_id|>; -1 when unknown. */
int32_t rf_tokenizer_eos_id(const rf_tokenizer *t);

/* "byte_level" or "sentencepiece". */
const char *rf_tokenizer_family(const rf_tokenizer *t);

/* 1 when the directory has a chat template: chat_template.jinja (where transformers 5 saves
 * it) or a chat_template in tokenizer_config.json (transformers 4). We never run Jinja; this
 * only tells a caller that the model expects a chat format. */
int rf_tokenizer_has_chat_template(const rf_tokenizer *t);

#endif
