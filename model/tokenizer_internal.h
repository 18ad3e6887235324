/* Internal layout of rf_tokenizer, shared by tokenizer.c (loading), tokenizer_encode.c and
 * tokenizer_decode.c. Each pipeline stage mirrors one component type of the HF
 * `tokenizers` library (normalizers, pre_tokenizers, models::bpe, decoders, processors);
 * the comments name the Rust behaviour being reproduced. Not a public header. */
#ifndef RF_TOKENIZER_INTERNAL_H
#define RF_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "model/tokenizer.h"

/* Open-addressing map from byte strings (not owned) to int32 values. */
typedef struct {
    uint32_t cap;           /* power of two */
    uint32_t n;
    const char **keys;      /* (cap) NULL = empty slot */
    uint32_t *lens;         /* (cap) */
    int32_t *vals;          /* (cap) */
} rf__strmap;

/* Open-addressing map from a (left id, right id) pair to a merge's rank and result id. */
typedef struct {
    uint32_t cap;
    uint32_t n;
    uint64_t *keys;         /* (cap) left << 32 | right; UINT64_MAX = empty */
    int32_t *ranks;         /* (cap) */
    int32_t *new_ids;       /* (cap) */
} rf__pairmap;

typedef struct {
    char *content;          /* as written in tokenizer.json */
    size_t len;
    char *norm;             /* content after the normalizer (matched when `normalized`) */
    size_t norm_len;
    int32_t id;
    uint8_t special, single_word, lstrip, rstrip, normalized;
} rf__added;

enum { RF__NORM_NFC, RF__NORM_NFD, RF__NORM_NFKC, RF__NORM_NFKD, RF__NORM_PREPEND,
       RF__NORM_REPLACE };
typedef struct {
    int type;
    char *a, *b;            /* PREPEND: a = prefix; REPLACE: a = pattern, b = content */
} rf__norm;

enum { RF__PRE_SPLIT, RF__PRE_BYTELEVEL, RF__PRE_METASPACE };
enum { RF__SPLIT_ISOLATED, RF__SPLIT_REMOVED, RF__SPLIT_MERGED_PREV, RF__SPLIT_MERGED_NEXT,
       RF__SPLIT_CONTIGUOUS };
enum { RF__PREPEND_ALWAYS, RF__PREPEND_FIRST, RF__PREPEND_NEVER };
typedef struct {
    int type;
    pcre2_code *re;         /* SPLIT, and BYTELEVEL with use_regex (the GPT-2 pattern) */
    int behavior, invert;   /* SPLIT */
    int add_prefix_space;   /* BYTELEVEL */
    int prepend_scheme, split; /* METASPACE */
    char repl[8];           /* METASPACE replacement character, UTF-8 */
} rf__pretok;

enum { RF__DEC_BYTELEVEL, RF__DEC_REPLACE, RF__DEC_BYTEFALLBACK, RF__DEC_FUSE, RF__DEC_STRIP,
       RF__DEC_METASPACE };
typedef struct {
    int type;
    char *a, *b;            /* REPLACE: pattern, content; STRIP: a = content char */
    int start, stop;        /* STRIP */
    int prepend_scheme;     /* METASPACE */
    char repl[8];           /* METASPACE */
} rf__dec;

/* Open-addressing map from a token id to its slot in rf_tokenizer.slots. */
typedef struct {
    uint32_t cap;           /* power of two (0 before the first id) */
    uint32_t n;
    int32_t *keys;          /* (cap) id, -1 = empty */
    int32_t *vals;          /* (cap) slot */
} rf__idmap;

/* What one id stands for. */
typedef struct {
    char *text;             /* model vocab text, NULL when the id is only an added token */
    uint32_t len;
    int32_t id;
    int32_t added;          /* index into added[], or -1: added text wins for an id */
    uint8_t special;        /* 1 when decode(skip_special) drops the id */
} rf__tok;

#define RF__MAX_ID 2147483646 /* max id + 1 must fit an int */

struct rf_tokenizer {
    char *path;             /* for error messages */
    int n_ids;              /* max id + 1 */
    /* One slot per distinct id (vocab or added), so memory follows the token count however
     * sparse the ids are (HF allows any u32 ids). */
    rf__tok *slots;         /* (n_slots) */
    int n_slots, cap_slots;
    rf__idmap slot_of;      /* id -> index into slots */
    rf__strmap vocab;       /* model vocab: token -> id */
    rf__strmap all;         /* vocab and added tokens: token -> id (token_to_id) */
    rf__pairmap merges;
    int32_t unk_id;         /* -1 when none */
    int fuse_unk, byte_fallback, ignore_merges;
    int32_t byte_ids[256];  /* id of "<0xNN>" or -1 (byte_fallback) */

    rf__added *added;       /* (n_added) in tokenizer.json order */
    uint8_t added_first[2][256]; /* [normalized][byte]: 1 if some added token starts with it */
    int n_added;
    rf__norm *norms;        /* (n_norms) normalizer chain, applied in order */
    int n_norms;
    rf__pretok *pretoks;    /* (n_pretoks) pre-tokenizer chain */
    int n_pretoks;
    rf__dec *decs;          /* (n_decs) decoder chain */
    int n_decs;
    int has_decoder;        /* 0: HF joins tokens with " " */

    int32_t *prefix;        /* (n_prefix) ids the post-processor puts before the text */
    int n_prefix;
    int32_t *suffix;        /* (n_suffix) ids it puts after */
    int n_suffix;
    int32_t bos_id, eos_id;
    int byte_level;
    int has_chat_template;
    pcre2_code *word_re;    /* "\\w", compiled when an added token is single_word */
};

/* Text HF gives for an id (added tokens first, the normalized form for normalized ones);
 * NULL when the id has none (tokenizer.c). */
const char *rf__id_text(const rf_tokenizer *t, int32_t id, size_t *len);

/* The slot of an id, NULL when no token has it (tokenizer.c). */
const rf__tok *rf__id_tok(const rf_tokenizer *t, int32_t id);

/* Text HF gives for a slot (rf__id_text without the lookup); NULL when it has none. */
const char *rf__tok_text(const rf_tokenizer *t, const rf__tok *x, size_t *len);

/* Maps (tokenizer.c). */
rf_status rf__strmap_init(rf__strmap *m, uint32_t expect);
void rf__strmap_free(rf__strmap *m);
rf_status rf__strmap_put(rf__strmap *m, const char *key, uint32_t len, int32_t val);
int32_t rf__strmap_get(const rf__strmap *m, const char *key, size_t len); /* -1 if absent */
int rf__pairmap_get(const rf__pairmap *m, int32_t l, int32_t r, int32_t *rank, int32_t *new_id);

/* GPT-2's byte <-> printable-character mapping (bytes_to_unicode in the GPT-2 encoder.py and
 * pre_tokenizers::byte_level), in tokenizer_encode.c. */
uint32_t rf__byte_to_cp(unsigned b);
int rf__cp_to_byte(uint32_t cp); /* -1 when cp is not one of the 256 images */

/* UTF-8 helpers (tokenizer_encode.c). Returns the length of a valid sequence at s[0..n), or
 * 0 when invalid; *cp receives the code point. */
int rf__utf8_next(const unsigned char *s, size_t n, uint32_t *cp);
/* Applies the normalizer chain to s; *out is malloc'd. Used for added-token contents too. */
rf_status rf__normalize(const rf_tokenizer *t, const char *s, size_t n, char **out,
                        size_t *out_len);

#endif
