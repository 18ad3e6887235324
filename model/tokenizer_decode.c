/* Decoding: ids -> token strings -> the decoder chain of tokenizer.json -> one string.
 * Each decoder maps a list of token strings to a new list, exactly like decode_chain in the
 * HF `tokenizers` decoders module; the final list is concatenated. */
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer_internal.h"

typedef struct { char *s; size_t n; } rf__str;
typedef struct { rf__str *v; int n, cap; } rf__toks;

static rf_status rf__nomem(void) { return rf_error(RF_ERR_NOMEM, "tokenizer decode: out of memory"); }

static void rf__toks_free(rf__toks *l) {
    for (int i = 0; i < l->n; i++) free(l->v[i].s);
    free(l->v);
    l->v = NULL;
    l->n = l->cap = 0;
}

/* Appends a copy of s[0..n). */
static rf_status rf__toks_push(rf__toks *l, const char *s, size_t n) {
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        rf__str *v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) return rf__nomem();
        l->v = v;
        l->cap = cap;
    }
    char *c = malloc(n + 1);
    if (!c) return rf__nomem();
    memcpy(c, s, n);
    c[n] = '\0';
    l->v[l->n++] = (rf__str){c, n};
    return RF_OK;
}

/* A byte buffer that grows. */
typedef struct { char *s; size_t n, cap; } rf__buf;

static rf_status rf__buf_add(rf__buf *b, const void *p, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *s = realloc(b->s, cap);
        if (!s) return rf__nomem();
        b->s = s;
        b->cap = cap;
    }
    memcpy(b->s + b->n, p, n);
    b->n += n;
    b->s[b->n] = '\0';
    return RF_OK;
}

/* Moves b into the list as one token. */
static rf_status rf__toks_take(rf__toks *l, rf__buf *b) {
    rf_status st = rf__toks_push(l, b->s ? b->s : "", b->n);
    free(b->s);
    *b = (rf__buf){0};
    return st;
}

/* Length of the maximal prefix of an ill-formed sequence at s (>= 1): what Rust's
 * String::from_utf8_lossy replaces with one U+FFFD (Unicode "maximal subpart" practice). */
static size_t rf__bad_prefix(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    int need = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC2 ? 1 : 0;
    if (need == 0 || c > 0xF4) return 1;
    unsigned lo = 0x80, hi = 0xBF;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
    size_t k = 1;
    for (; k <= (size_t)need && k < n; k++) {
        if (s[k] < lo || s[k] > hi) break;
        lo = 0x80;
        hi = 0xBF;
    }
    return k;
}

/* Replaces ill-formed UTF-8 with U+FFFD, as the ByteLevel and ByteFallback decoders do. */
static rf_status rf__lossy(const char *s, size_t n, rf__buf *out) {
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = rf__utf8_next((const unsigned char *)s + i, n - i, &cp);
        if (k > 0) {
            RF_TRY(rf__buf_add(out, s + i, (size_t)k));
            i += (size_t)k;
        } else {
            RF_TRY(rf__buf_add(out, "\xEF\xBF\xBD", 3));
            i += rf__bad_prefix((const unsigned char *)s + i, n - i);
        }
    }
    return RF_OK;
}

static int rf__utf8_valid(const char *s, size_t n) {
    uint32_t cp;
    for (size_t i = 0; i < n;) {
        int k = rf__utf8_next((const unsigned char *)s + i, n - i, &cp);
        if (k == 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

/* decoders::byte_level: each token's chars back to bytes (a token with a char outside the
 * table contributes its own UTF-8), all fused into one lossy string. */
static rf_status rf__dec_bytelevel(rf__toks *l) {
    rf__buf raw = {0}, out = {0};
    rf_status st = RF_OK;
    for (int i = 0; i < l->n && st == RF_OK; i++) {
        size_t start = raw.n;
        const char *s = l->v[i].s;
        for (size_t j = 0; j < l->v[i].n && st == RF_OK;) {
            uint32_t cp;
            int k = rf__utf8_next((const unsigned char *)s + j, l->v[i].n - j, &cp);
            int b = k > 0 ? rf__cp_to_byte(cp) : -1;
            if (b < 0) { /* fall back to the token's raw bytes */
                raw.n = start;
                st = rf__buf_add(&raw, s, l->v[i].n);
                break;
            }
            unsigned char c = (unsigned char)b;
            st = rf__buf_add(&raw, &c, 1);
            j += (size_t)k;
        }
    }
    if (st == RF_OK) st = rf__lossy(raw.s ? raw.s : "", raw.n, &out);
    free(raw.s);
    rf__toks_free(l);
    if (st == RF_OK) st = rf__toks_take(l, &out);
    free(out.s);
    return st;
}

/* "<0xNN>" -> NN, else -1. */
static int rf__byte_token(const rf__str *t) {
    const char *s = t->s;
    if (t->n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Flushes a run of byte tokens: its string when valid UTF-8, else one U+FFFD per byte. */
static rf_status rf__flush_bytes(rf__toks *out, rf__buf *run) {
    if (run->n == 0) return RF_OK;
    rf_status st = RF_OK;
    if (rf__utf8_valid(run->s, run->n)) st = rf__toks_push(out, run->s, run->n);
    else
        for (size_t i = 0; i < run->n && st == RF_OK; i++) st = rf__toks_push(out, "\xEF\xBF\xBD", 3);
    run->n = 0;
    return st;
}

/* decoders::byte_fallback. */
static rf_status rf__dec_bytefallback(rf__toks *l) {
    rf__toks out = {0};
    rf__buf run = {0};
    rf_status st = RF_OK;
    for (int i = 0; i < l->n && st == RF_OK; i++) {
        int b = rf__byte_token(&l->v[i]);
        if (b >= 0) {
            unsigned char c = (unsigned char)b;
            st = rf__buf_add(&run, &c, 1);
            continue;
        }
        st = rf__flush_bytes(&out, &run);
        if (st == RF_OK) st = rf__toks_push(&out, l->v[i].s, l->v[i].n);
    }
    if (st == RF_OK) st = rf__flush_bytes(&out, &run);
    free(run.s);
    rf__toks_free(l);
    *l = out;
    return st;
}

static rf_status rf__dec_fuse(rf__toks *l) {
    rf__buf b = {0};
    rf_status st = RF_OK;
    for (int i = 0; i < l->n && st == RF_OK; i++) st = rf__buf_add(&b, l->v[i].s, l->v[i].n);
    rf__toks_free(l);
    if (st == RF_OK) st = rf__toks_take(l, &b);
    free(b.s);
    return st;
}

/* Replaces every `pat` in each token with `rep`; with drop_first_token, token 0 loses its
 * occurrences instead (the Metaspace decoder's treatment of the prepended replacement). */
static rf_status rf__dec_replace(rf__toks *l, const char *pat, const char *rep, int drop_first) {
    size_t pl = strlen(pat), rl = strlen(rep);
    for (int i = 0; i < l->n; i++) {
        rf__buf b = {0};
        const char *s = l->v[i].s;
        size_t n = l->v[i].n;
        rf_status st = rf__buf_add(&b, "", 0);
        for (size_t j = 0; j < n && st == RF_OK;) {
            if (j + pl <= n && memcmp(s + j, pat, pl) == 0) {
                if (!(drop_first && i == 0)) st = rf__buf_add(&b, rep, rl);
                j += pl;
            } else {
                st = rf__buf_add(&b, s + j, 1);
                j++;
            }
        }
        if (st != RF_OK) {
            free(b.s);
            return st;
        }
        free(l->v[i].s);
        l->v[i] = (rf__str){b.s, b.n};
    }
    return RF_OK;
}

/* decoders::strip: up to `start` leading and `stop` trailing copies of one character. */
static void rf__dec_strip(rf__toks *l, const char *c, int start, int stop) {
    size_t cl = strlen(c);
    for (int i = 0; i < l->n; i++) {
        char *s = l->v[i].s;
        size_t a = 0, b = l->v[i].n;
        for (int k = 0; k < start && a + cl <= b && memcmp(s + a, c, cl) == 0; k++) a += cl;
        for (int k = 0; k < stop && b >= a + cl && memcmp(s + b - cl, c, cl) == 0; k++) b -= cl;
        memmove(s, s + a, b - a);
        s[b - a] = '\0';
        l->v[i].n = b - a;
    }
}

static rf_status rf__run_decoder(const rf__dec *d, rf__toks *l) {
    switch (d->type) {
    case RF__DEC_BYTELEVEL: return rf__dec_bytelevel(l);
    case RF__DEC_BYTEFALLBACK: return rf__dec_bytefallback(l);
    case RF__DEC_FUSE: return rf__dec_fuse(l);
    case RF__DEC_REPLACE: return rf__dec_replace(l, d->a, d->b, 0);
    case RF__DEC_METASPACE:
        return rf__dec_replace(l, d->repl, " ", d->prepend_scheme != RF__PREPEND_NEVER);
    case RF__DEC_STRIP: rf__dec_strip(l, d->a, d->start, d->stop); return RF_OK;
    }
    return rf_error(RF_ERR_INTERNAL, "tokenizer decode: decoder type %d", d->type);
}

static rf_status rf__collect(const rf_tokenizer *t, const int32_t *ids, int n_ids,
                             int skip_special, rf__toks *l) {
    for (int i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        const rf__tok *x = rf__id_tok(t, id);
        size_t n = 0;
        const char *s = x ? rf__tok_text(t, x, &n) : NULL;
        if (!s)
            return rf_error(RF_ERR_RANGE, "tokenizer decode: id %d at position %d is not in the "
                            "vocabulary of %s (size %d)", (int)id, i, t->path, t->n_ids);
        if (skip_special && x->special) continue;
        RF_TRY(rf__toks_push(l, s, n));
    }
    return RF_OK;
}

rf_status rf_tokenizer_decode(const rf_tokenizer *t, const int32_t *ids, int n_ids,
                              int skip_special, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    rf__toks l = {0};
    rf_status st = rf__collect(t, ids, n_ids, skip_special, &l);
    for (int i = 0; st == RF_OK && i < t->n_decs; i++) st = rf__run_decoder(&t->decs[i], &l);
    rf__buf out = {0};
    if (st == RF_OK) st = rf__buf_add(&out, "", 0);
    /* Without a decoder HF joins tokens with spaces; with one it concatenates. */
    for (int i = 0; st == RF_OK && i < l.n; i++) {
        if (i > 0 && !t->has_decoder) st = rf__buf_add(&out, " ", 1);
        if (st == RF_OK) st = rf__buf_add(&out, l.v[i].s, l.v[i].n);
    }
    rf__toks_free(&l);
    if (st != RF_OK) {
        free(out.s);
        return st;
    }
    *text = out.s;
    *len = out.n;
    return RF_OK;
}
