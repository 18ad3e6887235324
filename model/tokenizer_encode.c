/* Encoding: the HF `tokenizers` pipeline, stage by stage.
 *
 *   raw text -> split out non-normalized added tokens (AddedVocabulary::extract_and_normalize)
 *            -> normalize each remaining piece, split out normalized added tokens
 *            -> pre-tokenizers (Split / ByteLevel / Metaspace), piece list to piece list
 *            -> BPE per piece (models::bpe::word::Word::merge_all)
 *            -> post-processor ids around the result.
 * Every stage works on a piece list: one growing byte buffer plus (offset, length) spans,
 * so a 1 MB input costs a handful of allocations rather than one per word. */
#include <stdlib.h>
#include <string.h>
#include <uninorm.h>

#include "model/tokenizer_internal.h"

/* ---- byte-level mapping and UTF-8 ---- */

/* Bytes that GPT-2 keeps as their own code point: '!'..'~', U+00A1..U+00AC, U+00AE..U+00FF.
 * The other 68 bytes map, in byte order, to U+0100..U+0143. */
static int rf__printable(unsigned b) {
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

uint32_t rf__byte_to_cp(unsigned b) {
    if (rf__printable(b)) return b;
    if (b <= 32) return 256 + b;
    if (b <= 160) return 256 + 33 + (b - 127);
    return 256 + 33 + 34; /* 173, the soft hyphen */
}

int rf__cp_to_byte(uint32_t cp) {
    if (cp < 256) return rf__printable(cp) ? (int)cp : -1;
    if (cp < 256 + 33) return (int)(cp - 256);
    if (cp < 256 + 67) return (int)(cp - 256 - 33 + 127);
    if (cp == 256 + 67) return 173;
    return -1;
}

int rf__utf8_next(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned c = s[0];
    if (c < 0x80) { *cp = c; return 1; }
    int k = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (k == 0 || c > 0xF4 || (size_t)k > n) return 0;
    uint32_t v = c & (0x7F >> k);
    for (int i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = v << 6 | (s[i] & 0x3F);
    }
    /* Reject overlong forms, surrogates and values past U+10FFFF. */
    if ((k == 3 && v < 0x800) || (k == 4 && (v < 0x10000 || v > 0x10FFFF)) ||
        (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return k;
}

static int rf__put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | cp >> 6);
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12);
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18);
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Rust's char::is_whitespace (the Unicode White_Space property), used by lstrip/rstrip. */
static int rf__is_ws(uint32_t c) {
    return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* ---- growing buffers ---- */

typedef struct {
    size_t off, len;        /* span in the list's buffer */
    int32_t added;          /* id of an added token, or -1 for text */
    uint8_t first;          /* starts at byte 0 of the original text (Metaspace "first") */
} rf__piece;

typedef struct {
    char *buf;
    size_t len, cap;
    rf__piece *p;
    int n, cap_p;
} rf__plist;

static rf_status rf__nomem(void) { return rf_error(RF_ERR_NOMEM, "tokenizer: out of memory"); }

static rf_status rf__reserve(rf__plist *l, size_t extra) {
    if (l->len + extra <= l->cap) return RF_OK;
    size_t cap = l->cap ? l->cap : 256;
    while (cap < l->len + extra) cap *= 2;
    char *b = realloc(l->buf, cap);
    if (!b) return rf__nomem();
    l->buf = b;
    l->cap = cap;
    return RF_OK;
}

/* Starts a new piece whose bytes the caller appends with rf__bytes; empty text pieces are
 * dropped by rf__end_piece, as HF filters empty splits. */
static rf_status rf__begin_piece(rf__plist *l, int32_t added, int first) {
    if (l->n == l->cap_p) {
        int cap = l->cap_p ? l->cap_p * 2 : 64;
        rf__piece *p = realloc(l->p, (size_t)cap * sizeof *p);
        if (!p) return rf__nomem();
        l->p = p;
        l->cap_p = cap;
    }
    l->p[l->n] = (rf__piece){l->len, 0, added, (uint8_t)first};
    return RF_OK;
}

static rf_status rf__bytes(rf__plist *l, const char *s, size_t n) {
    if (n == 0) return RF_OK;
    RF_TRY(rf__reserve(l, n));
    memcpy(l->buf + l->len, s, n);
    l->len += n;
    return RF_OK;
}

static void rf__end_piece(rf__plist *l) {
    rf__piece *p = &l->p[l->n];
    p->len = l->len - p->off;
    if (p->len > 0 || p->added >= 0) l->n++;
}

static rf_status rf__push(rf__plist *l, const char *s, size_t n, int32_t added, int first) {
    RF_TRY(rf__begin_piece(l, added, first));
    RF_TRY(rf__bytes(l, s, n));
    rf__end_piece(l);
    return RF_OK;
}

static void rf__plist_reset(rf__plist *l) { l->len = 0; l->n = 0; }

static void rf__plist_free(rf__plist *l) {
    free(l->buf);
    free(l->p);
}

/* ---- normalizers ---- */

static int rf__has_non_ascii(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) return 1;
    return 0;
}

/* Unicode normal forms via GNU libunistring; ASCII is invariant under all four. */
static rf_status rf__unicode_form(int type, char **s, size_t *n) {
    if (!rf__has_non_ascii(*s, *n)) return RF_OK;
    uninorm_t nf = type == RF__NORM_NFC ? UNINORM_NFC : type == RF__NORM_NFD ? UNINORM_NFD
                 : type == RF__NORM_NFKC ? UNINORM_NFKC : UNINORM_NFKD;
    size_t m = 0;
    uint8_t *r = u8_normalize(nf, (const uint8_t *)*s, *n, NULL, &m);
    if (!r) return rf__nomem();
    free(*s);
    *s = (char *)r;
    *n = m;
    return RF_OK;
}

/* NormalizedString::replace with a String pattern: every non-overlapping occurrence. */
static rf_status rf__replace(const char *pat, const char *rep, char **s, size_t *n) {
    size_t pl = strlen(pat), rl = strlen(rep), hits = 0;
    for (size_t i = 0; i + pl <= *n; i++)
        if (memcmp(*s + i, pat, pl) == 0) { hits++; i += pl - 1; }
    if (!hits) return RF_OK;
    size_t m = *n + hits * rl - hits * pl, j = 0;
    char *r = malloc(m + 1);
    if (!r) return rf__nomem();
    for (size_t i = 0; i < *n;) {
        if (i + pl <= *n && memcmp(*s + i, pat, pl) == 0) {
            memcpy(r + j, rep, rl);
            j += rl;
            i += pl;
        } else {
            r[j++] = (*s)[i++];
        }
    }
    free(*s);
    *s = r;
    *n = m;
    return RF_OK;
}

static rf_status rf__prepend(const char *pre, char **s, size_t *n) {
    if (*n == 0) return RF_OK; /* normalizers::Prepend leaves an empty string alone */
    size_t pl = strlen(pre);
    char *r = malloc(*n + pl + 1);
    if (!r) return rf__nomem();
    memcpy(r, pre, pl);
    memcpy(r + pl, *s, *n);
    free(*s);
    *s = r;
    *n += pl;
    return RF_OK;
}

rf_status rf__normalize(const rf_tokenizer *t, const char *s, size_t n, char **out,
                        size_t *out_len) {
    char *r = malloc(n + 1);
    if (!r) return rf__nomem();
    memcpy(r, s, n);
    rf_status st = RF_OK;
    for (int i = 0; i < t->n_norms && st == RF_OK; i++) {
        const rf__norm *x = &t->norms[i];
        if (x->type == RF__NORM_PREPEND) st = rf__prepend(x->a, &r, &n);
        else if (x->type == RF__NORM_REPLACE) st = rf__replace(x->a, x->b, &r, &n);
        else st = rf__unicode_form(x->type, &r, &n);
    }
    /* NUL-terminated as well as counted: a normalized added token's text is handed out as a
     * C string (rf_tokenizer_id_to_token), and u8_normalize's result has no room for the NUL */
    char *z = st == RF_OK ? realloc(r, n + 1) : NULL;
    if (!z) {
        free(r);
        return st != RF_OK ? st : rf__nomem();
    }
    z[n] = 0;
    *out = z;
    *out_len = n;
    return RF_OK;
}

/* ---- added tokens ---- */

typedef struct { size_t start, end; int idx; } rf__match;

/* Leftmost-longest, non-overlapping matches of the added tokens with normalized == want_norm
 * (aho-corasick MatchKind::LeftmostLongest in AddedVocabulary). */
static rf_status rf__find_added(const rf_tokenizer *t, const char *s, size_t n, int want_norm,
                                rf__match **out, int *n_out) {
    int cap = 0, k = 0;
    rf__match *m = NULL;
    const uint8_t *can_start = t->added_first[want_norm];
    for (size_t i = 0; i < n;) {
        int best = -1;
        size_t best_len = 0;
        if (!can_start[(unsigned char)s[i]]) { i++; continue; }
        for (int a = 0; a < t->n_added; a++) {
            const rf__added *x = &t->added[a];
            if (x->normalized != want_norm) continue;
            const char *c = want_norm ? x->norm : x->content;
            size_t cl = want_norm ? x->norm_len : x->len;
            if (cl > best_len && cl <= n - i && memcmp(c, s + i, cl) == 0) {
                best = a;
                best_len = cl;
            }
        }
        if (best < 0) { i++; continue; }
        if (k == cap) {
            cap = cap ? cap * 2 : 8;
            rf__match *p = realloc(m, (size_t)cap * sizeof *p);
            if (!p) { free(m); return rf__nomem(); }
            m = p;
        }
        m[k++] = (rf__match){i, i + best_len, best};
        i += best_len;
    }
    *out = m;
    *n_out = k;
    return RF_OK;
}

static int rf__is_word_at(const rf_tokenizer *t, const char *s, size_t n, size_t at) {
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md) return 0;
    int rc = pcre2_match(t->word_re, (PCRE2_SPTR)s, n, at, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK,
                         md, NULL);
    pcre2_match_data_free(md);
    return rc >= 0;
}

/* Start of the last character before `end` (s is valid UTF-8). */
static size_t rf__prev_char(const char *s, size_t end) {
    size_t i = end - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    return i;
}

/* single_word: the token must not touch word characters on either side. */
static int rf__single_word_ok(const rf_tokenizer *t, const char *s, size_t n, rf__match m) {
    if (m.start > 0 && rf__is_word_at(t, s, n, rf__prev_char(s, m.start))) return 0;
    if (m.end < n && rf__is_word_at(t, s, n, m.end)) return 0;
    return 1;
}

/* Widens a match over whitespace as lstrip/rstrip ask (AddedVocabulary::find_matches). */
static void rf__strip_match(const rf__added *x, const char *s, size_t n, size_t floor,
                            rf__match *m) {
    uint32_t cp;
    if (x->lstrip) {
        size_t st = m->start;
        while (st > 0) {
            size_t p = rf__prev_char(s, st);
            rf__utf8_next((const unsigned char *)s + p, n - p, &cp);
            if (!rf__is_ws(cp)) break;
            st = p;
        }
        m->start = st > floor ? st : floor;
    }
    if (x->rstrip) {
        while (m->end < n) {
            int k = rf__utf8_next((const unsigned char *)s + m->end, n - m->end, &cp);
            if (!rf__is_ws(cp)) break;
            m->end += (size_t)k;
        }
    }
}

/* Splits s into text pieces and added-token pieces, appended to out. `first` says whether
 * s starts at byte 0 of the original text. */
static rf_status rf__split_added(const rf_tokenizer *t, const char *s, size_t n, int want_norm,
                                 int first, rf__plist *out) {
    rf__match *m = NULL;
    int k = 0;
    RF_TRY(rf__find_added(t, s, n, want_norm, &m, &k));
    size_t done = 0;
    rf_status st = RF_OK;
    for (int i = 0; i < k && st == RF_OK; i++) {
        const rf__added *x = &t->added[m[i].idx];
        if (x->single_word && !rf__single_word_ok(t, s, n, m[i])) continue;
        rf__strip_match(x, s, n, done, &m[i]);
        if (done < m[i].start) st = rf__push(out, s + done, m[i].start - done, -1, first && done == 0);
        if (st == RF_OK) st = rf__push(out, "", 0, x->id, 0);
        done = m[i].end;
    }
    if (st == RF_OK && done < n) st = rf__push(out, s + done, n - done, -1, first && done == 0);
    free(m);
    return st;
}

/* Raw text -> non-normalized added tokens -> normalizer -> normalized added tokens. */
static rf_status rf__added_and_normalize(const rf_tokenizer *t, const char *text, size_t len,
                                         rf__plist *raw, rf__plist *out) {
    RF_TRY(rf__split_added(t, text, len, 0, 1, raw));
    for (int i = 0; i < raw->n; i++) {
        const rf__piece *p = &raw->p[i];
        if (p->added >= 0) {
            RF_TRY(rf__push(out, "", 0, p->added, 0));
            continue;
        }
        char *norm;
        size_t nl;
        RF_TRY(rf__normalize(t, raw->buf + p->off, p->len, &norm, &nl));
        rf_status st = rf__split_added(t, norm, nl, 1, p->first, out);
        free(norm);
        RF_TRY(st);
    }
    return RF_OK;
}

/* ---- pre-tokenizers ---- */

typedef struct { size_t start, end; int is_match; } rf__seg;

typedef struct {
    rf__seg *s;
    int n, cap;
} rf__segs;

static rf_status rf__seg_push(rf__segs *v, size_t a, size_t b, int is_match) {
    if (v->n == v->cap) {
        int cap = v->cap ? v->cap * 2 : 64;
        rf__seg *p = realloc(v->s, (size_t)cap * sizeof *p);
        if (!p) return rf__nomem();
        v->s = p;
        v->cap = cap;
    }
    v->s[v->n++] = (rf__seg){a, b, is_match};
    return RF_OK;
}

/* Pattern::find_matches for a regex: gaps and matches covering all of s, in order. Empty
 * matches right after a match are skipped, as the onig crate's find_iter does. */
static rf_status rf__regex_segments(const pcre2_code *re, pcre2_match_data *md, const char *s,
                                    size_t n, rf__segs *v) {
    size_t prev = 0, at = 0;
    int have_last = 0;
    size_t last_end = 0;
    v->n = 0;
    while (at <= n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) return rf_error(RF_ERR_INTERNAL, "tokenizer: regex match error %d", rc);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t a = ov[0], b = ov[1];
        if (a == b) {
            at = b < n ? b + (size_t)rf__utf8_next((const unsigned char *)s + b, n - b,
                                                    &(uint32_t){0})
                       : n + 1;
            if (have_last && last_end == b) continue;
        } else {
            at = b;
        }
        if (prev != a) RF_TRY(rf__seg_push(v, prev, a, 0));
        RF_TRY(rf__seg_push(v, a, b, 1));
        prev = b;
        have_last = 1;
        last_end = b;
    }
    if (prev != n) RF_TRY(rf__seg_push(v, prev, n, 0));
    return RF_OK;
}

/* SplitDelimiterBehavior applied to segments, as NormalizedString::split folds them.
 * Afterwards every remaining segment is one piece. */
static void rf__apply_behavior(int behavior, rf__segs *v) {
    int k = 0, prev_match = 0;
    if (behavior == RF__SPLIT_MERGED_NEXT) {
        /* Folded right to left: a match joins the non-match that follows it. */
        k = v->n;
        for (int i = v->n - 1; i >= 0; i--) {
            rf__seg g = v->s[i];
            if (g.is_match && !prev_match && k < v->n) v->s[k].start = g.start;
            else v->s[--k] = g;
            prev_match = g.is_match;
        }
        memmove(v->s, v->s + k, (size_t)(v->n - k) * sizeof *v->s);
        v->n -= k;
        return;
    }
    for (int i = 0; i < v->n; i++) {
        rf__seg g = v->s[i];
        int merge = (behavior == RF__SPLIT_MERGED_PREV && g.is_match && !prev_match) ||
                    (behavior == RF__SPLIT_CONTIGUOUS && g.is_match == prev_match);
        if (behavior == RF__SPLIT_REMOVED && g.is_match) { /* dropped */ }
        else if (merge && k > 0) v->s[k - 1].end = g.end;
        else v->s[k++] = g;
        prev_match = g.is_match;
    }
    v->n = k;
}

typedef struct {
    pcre2_match_data *md;
    rf__segs segs;
} rf__scratch;

static rf_status rf__split_piece(const rf__pretok *p, rf__scratch *sc, const char *s, size_t n,
                                 int first, rf__plist *out) {
    if (p->re) {
        RF_TRY(rf__regex_segments(p->re, sc->md, s, n, &sc->segs));
    } else { /* an empty String pattern: the whole piece is one non-match */
        sc->segs.n = 0;
        RF_TRY(rf__seg_push(&sc->segs, 0, n, 0));
    }
    if (p->invert)
        for (int i = 0; i < sc->segs.n; i++) sc->segs.s[i].is_match = !sc->segs.s[i].is_match;
    rf__apply_behavior(p->behavior, &sc->segs);
    for (int i = 0; i < sc->segs.n; i++) {
        const rf__seg *g = &sc->segs.s[i];
        RF_TRY(rf__push(out, s + g->start, g->end - g->start, -1, first && g->start == 0));
    }
    return RF_OK;
}

/* ByteLevel: optional leading space, optional GPT-2 split, then bytes -> printable chars. */
static rf_status rf__bytelevel_piece(const rf__pretok *p, rf__scratch *sc, const char *s,
                                     size_t n, int first, rf__plist *out) {
    char *tmp = NULL;
    if (p->add_prefix_space && s[0] != ' ') {
        tmp = malloc(n + 1);
        if (!tmp) return rf__nomem();
        tmp[0] = ' ';
        memcpy(tmp + 1, s, n);
        s = tmp;
        n++;
    }
    rf_status st = RF_OK;
    size_t a = 0;
    int si = 0;
    if (p->re) st = rf__regex_segments(p->re, sc->md, s, n, &sc->segs);
    while (st == RF_OK && a < n) {
        size_t b = p->re ? sc->segs.s[si].end : n;
        si++;
        st = rf__begin_piece(out, -1, first && a == 0);
        if (st == RF_OK) st = rf__reserve(out, (b - a) * 2);
        for (size_t i = a; st == RF_OK && i < b; i++)
            out->len += (size_t)rf__put_utf8(out->buf + out->len, rf__byte_to_cp((unsigned char)s[i]));
        if (st == RF_OK) rf__end_piece(out);
        a = b;
    }
    free(tmp);
    return st;
}

/* Metaspace: spaces become the replacement char, a prefix is added per prepend_scheme,
 * then (split) the piece is cut before every replacement char (MergedWithNext). */
static rf_status rf__metaspace_piece(const rf__pretok *p, const char *s, size_t n, int first,
                                     rf__plist *out) {
    size_t rl = strlen(p->repl), start = out->len;
    /* HF tests for a leading replacement after spaces were replaced. */
    int pre = !(n > 0 && s[0] == ' ') && !(n >= rl && memcmp(s, p->repl, rl) == 0) &&
              (p->prepend_scheme == RF__PREPEND_ALWAYS ||
               (p->prepend_scheme == RF__PREPEND_FIRST && first));
    RF_TRY(rf__begin_piece(out, -1, first));
    if (pre) RF_TRY(rf__bytes(out, p->repl, rl));
    for (size_t i = 0; i < n; i++)
        RF_TRY(s[i] == ' ' ? rf__bytes(out, p->repl, rl) : rf__bytes(out, s + i, 1));
    size_t end = out->len;
    /* Cut the bytes just written in place: close the piece before each replacement char. */
    for (size_t i = start + 1; p->split && i + rl <= end; i++) {
        if (memcmp(out->buf + i, p->repl, rl) != 0) continue;
        out->len = i;
        rf__end_piece(out);
        RF_TRY(rf__begin_piece(out, -1, 0));
        out->len = end;
    }
    rf__end_piece(out);
    return RF_OK;
}

static rf_status rf__pretok_one(const rf__pretok *p, rf__scratch *sc, const rf__plist *in,
                                rf__plist *out) {
    for (int i = 0; i < in->n; i++) {
        const rf__piece *q = &in->p[i];
        if (q->added >= 0) {
            RF_TRY(rf__push(out, "", 0, q->added, 0));
            continue;
        }
        /* Only text pieces have bytes: when every piece is an added token the buffer is
         * still NULL, and NULL + 0 is undefined. */
        const char *s = in->buf + q->off;
        if (p->type == RF__PRE_SPLIT) RF_TRY(rf__split_piece(p, sc, s, q->len, q->first, out));
        else if (p->type == RF__PRE_BYTELEVEL) RF_TRY(rf__bytelevel_piece(p, sc, s, q->len, q->first, out));
        else RF_TRY(rf__metaspace_piece(p, s, q->len, q->first, out));
    }
    return RF_OK;
}

/* ---- BPE ---- */

typedef struct { int32_t id; int prev, next; } rf__sym;
typedef struct { int32_t rank, pos, new_id; } rf__cand;

typedef struct {
    int32_t *v;
    int n, cap;
} rf__ids;

static rf_status rf__ids_push(rf__ids *o, int32_t id) {
    if (o->n == o->cap) {
        int cap = o->cap ? o->cap * 2 : 256;
        int32_t *p = realloc(o->v, (size_t)cap * sizeof *p);
        if (!p) return rf__nomem();
        o->v = p;
        o->cap = cap;
    }
    o->v[o->n++] = id;
    return RF_OK;
}

typedef struct {
    rf__sym *sym;
    int n_sym, cap_sym;
    rf__cand *heap;
    int n_heap, cap_heap;
} rf__bpe_work;

static int rf__cand_less(rf__cand a, rf__cand b) {
    return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos;
}

static rf_status rf__heap_push(rf__bpe_work *w, rf__cand c) {
    if (w->n_heap == w->cap_heap) {
        int cap = w->cap_heap ? w->cap_heap * 2 : 64;
        rf__cand *p = realloc(w->heap, (size_t)cap * sizeof *p);
        if (!p) return rf__nomem();
        w->heap = p;
        w->cap_heap = cap;
    }
    int i = w->n_heap++;
    while (i > 0 && rf__cand_less(c, w->heap[(i - 1) / 2])) {
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = c;
    return RF_OK;
}

static rf__cand rf__heap_pop(rf__bpe_work *w) {
    rf__cand top = w->heap[0], last = w->heap[--w->n_heap];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= w->n_heap) break;
        if (c + 1 < w->n_heap && rf__cand_less(w->heap[c + 1], w->heap[c])) c++;
        if (!rf__cand_less(w->heap[c], last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (w->n_heap > 0) w->heap[i] = last;
    return top;
}

static rf_status rf__sym_push(rf__bpe_work *w, int32_t id) {
    if (w->n_sym == w->cap_sym) {
        int cap = w->cap_sym ? w->cap_sym * 2 : 64;
        rf__sym *p = realloc(w->sym, (size_t)cap * sizeof *p);
        if (!p) return rf__nomem();
        w->sym = p;
        w->cap_sym = cap;
    }
    int i = w->n_sym++;
    w->sym[i] = (rf__sym){id, i - 1, -1};
    if (i > 0) w->sym[i - 1].next = i;
    return RF_OK;
}

static int rf__bytes_known(const rf_tokenizer *t, const char *s, int k) {
    for (int j = 0; j < k; j++)
        if (t->byte_ids[(unsigned char)s[j]] < 0) return 0;
    return 1;
}

/* Word::merge_word's initial symbols: one per character, else its <0xNN> byte tokens
 * (byte_fallback), else unk (fused with a preceding unk when fuse_unk), else dropped. */
static rf_status rf__initial_symbols(const rf_tokenizer *t, const char *s, size_t n,
                                     rf__bpe_work *w) {
    int32_t unk = -1; /* pending unk */
    w->n_sym = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = rf__utf8_next((const unsigned char *)s + i, n - i, &cp);
        if (k == 0) k = 1; /* unreachable: input was validated */
        int32_t id = rf__strmap_get(&t->vocab, s + i, (size_t)k);
        if (id >= 0) {
            if (unk >= 0) RF_TRY(rf__sym_push(w, unk));
            unk = -1;
            RF_TRY(rf__sym_push(w, id));
        } else if (t->byte_fallback && rf__bytes_known(t, s + i, k)) {
            for (int j = 0; j < k; j++) RF_TRY(rf__sym_push(w, t->byte_ids[(unsigned char)s[i + j]]));
        } else if (t->unk_id >= 0) {
            if (unk >= 0 && !t->fuse_unk) RF_TRY(rf__sym_push(w, unk));
            unk = t->unk_id;
        }
        i += (size_t)k;
    }
    if (unk >= 0) RF_TRY(rf__sym_push(w, unk));
    return RF_OK;
}

static rf_status rf__push_pair(const rf_tokenizer *t, rf__bpe_work *w, int pos) {
    int32_t rank, id;
    int nx = w->sym[pos].next;
    if (nx < 0 || !rf__pairmap_get(&t->merges, w->sym[pos].id, w->sym[nx].id, &rank, &id))
        return RF_OK;
    return rf__heap_push(w, (rf__cand){rank, pos, id});
}

/* Word::merge_all: repeatedly merge the lowest-rank adjacent pair (leftmost on ties),
 * skipping queue entries made stale by earlier merges. */
static rf_status rf__merge_all(const rf_tokenizer *t, rf__bpe_work *w) {
    w->n_heap = 0;
    for (int i = 0; i + 1 < w->n_sym; i++) RF_TRY(rf__push_pair(t, w, i));
    while (w->n_heap > 0) {
        rf__cand c = rf__heap_pop(w);
        rf__sym *a = &w->sym[c.pos];
        if (a->id < 0 || a->next < 0) continue;
        int32_t rank, id;
        if (!rf__pairmap_get(&t->merges, a->id, w->sym[a->next].id, &rank, &id) || id != c.new_id)
            continue;
        rf__sym *b = &w->sym[a->next];
        a->id = c.new_id;
        a->next = b->next;
        b->id = -1; /* removed: stale entries at its position are skipped */
        if (a->next >= 0) w->sym[a->next].prev = c.pos;
        if (a->prev >= 0) RF_TRY(rf__push_pair(t, w, a->prev));
        RF_TRY(rf__push_pair(t, w, c.pos));
    }
    return RF_OK;
}

static rf_status rf__bpe(const rf_tokenizer *t, const char *s, size_t n, rf__bpe_work *w,
                         rf__ids *out) {
    if (t->ignore_merges) { /* Llama-3: a pre-token that is itself in the vocab is emitted whole */
        int32_t id = rf__strmap_get(&t->vocab, s, n);
        if (id >= 0) return rf__ids_push(out, id);
    }
    RF_TRY(rf__initial_symbols(t, s, n, w));
    if (w->n_sym == 0) return RF_OK;
    RF_TRY(rf__merge_all(t, w));
    for (int i = 0; i >= 0; i = w->sym[i].next) RF_TRY(rf__ids_push(out, w->sym[i].id));
    return RF_OK;
}

/* ---- encode ---- */

static rf_status rf__check_utf8(const char *text, size_t len) {
    for (size_t i = 0; i < len;) {
        if ((unsigned char)text[i] < 0x80) { i++; continue; }
        uint32_t cp;
        int k = rf__utf8_next((const unsigned char *)text + i, len - i, &cp);
        if (k == 0)
            return rf_error(RF_ERR_ARG, "tokenizer encode: invalid UTF-8 at byte %zu", i);
        i += (size_t)k;
    }
    return RF_OK;
}

typedef struct {
    rf__plist a, b;
    rf__scratch sc;
    rf__bpe_work w;
    rf__ids ids;
} rf__encoder;

static void rf__encoder_free(rf__encoder *e) {
    rf__plist_free(&e->a);
    rf__plist_free(&e->b);
    free(e->sc.segs.s);
    if (e->sc.md) pcre2_match_data_free(e->sc.md);
    free(e->w.sym);
    free(e->w.heap);
    free(e->ids.v);
}

static rf_status rf__encode_pieces(const rf_tokenizer *t, rf__encoder *e, const char *text,
                                   size_t len, int add_special) {
    RF_TRY(rf__added_and_normalize(t, text, len, &e->b, &e->a));
    for (int i = 0; i < t->n_pretoks; i++) {
        rf__plist_reset(&e->b);
        RF_TRY(rf__pretok_one(&t->pretoks[i], &e->sc, &e->a, &e->b));
        rf__plist tmp = e->a;
        e->a = e->b;
        e->b = tmp;
    }
    for (int i = 0; add_special && i < t->n_prefix; i++) RF_TRY(rf__ids_push(&e->ids, t->prefix[i]));
    for (int i = 0; i < e->a.n; i++) {
        const rf__piece *p = &e->a.p[i];
        if (p->added >= 0) RF_TRY(rf__ids_push(&e->ids, p->added));
        else RF_TRY(rf__bpe(t, e->a.buf + p->off, p->len, &e->w, &e->ids));
    }
    for (int i = 0; add_special && i < t->n_suffix; i++) RF_TRY(rf__ids_push(&e->ids, t->suffix[i]));
    return RF_OK;
}

rf_status rf_tokenizer_encode(const rf_tokenizer *t, const char *text, size_t len,
                              int add_special, int32_t **ids, int *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    if (len > (size_t)1 << 30)
        return rf_error(RF_ERR_ARG, "tokenizer encode: %zu bytes is over the 1 GiB limit", len);
    RF_TRY(rf__check_utf8(text, len));
    rf__encoder e = {0};
    /* One match block serves every regex: we only read the whole-match offsets. */
    e.sc.md = pcre2_match_data_create(1, NULL);
    rf_status st = e.sc.md ? rf__encode_pieces(t, &e, text, len, add_special) : rf__nomem();
    if (st == RF_OK && !e.ids.v) { /* *ids is malloc'd even when empty */
        st = rf__ids_push(&e.ids, 0);
        e.ids.n = 0;
    }
    if (st == RF_OK) {
        *ids = e.ids.v;
        *n_ids = e.ids.n;
        e.ids.v = NULL;
    }
    rf__encoder_free(&e);
    return st;
}
