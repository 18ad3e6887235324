/* Final-answer rewards: the `numeric` and `math` rules of reward/reward.h.
 *
 * Both find a final answer in free text (a \boxed{}, a GSM8K "####" line, an "answer is"
 * phrase, or, for `numeric` only, the last number), read numbers the way people write them
 * (signs, thousands commas, decimals, fractions, percentages, \frac), and compare with the
 * ground truth: integers exactly, other numbers by value. The normalisation follows the usual
 * "math-verify-lite" recipes (the MATH dataset's `is_equiv` / lm-eval's minerva_math
 * normaliser): a deliberately small, documented subset, not a CAS. docs/rewards.md has the
 * rules with examples. Everything here is pure: no globals, safe from any thread. */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reward/reward.h"

/* Relative tolerance for non-integer answers: absorbs formatting ("0.1" vs "1/10" computed in
 * doubles) but not a different value. */
#define RF_NUM_RTOL 1e-9

/* A number read from text. Integers are kept as canonical digit strings, so that they compare
 * exactly at any length; everything else as a double. */
typedef struct num {
    int is_int;          /* exact integer: sign + digits */
    int neg;             /* negative (never for zero) */
    char digits[72];     /* integer magnitude, no leading zeros ("0" for zero) */
    double value;        /* always set */
    int percent;         /* written with '%' or "\%" */
    const char *src;     /* where it was read, for info strings */
    int src_len;
} num;

static void set_info(char *info, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_info(char *info, size_t cap, const char *fmt, ...) {
    if (!info || !cap) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(info, cap, fmt, ap);
    va_end(ap);
}

static int is_minus_sign(const char *s) {  /* U+2212 MINUS SIGN */
    return (unsigned char)s[0] == 0xE2 && (unsigned char)s[1] == 0x88 &&
           (unsigned char)s[2] == 0x92;
}

/* Integer magnitude (no sign) from a run of digits: canonical digit string when it fits. */
static int set_int(num *n, const char *d, size_t len) {
    while (len > 1 && *d == '0') d++, len--;
    if (len == 0) d = "0", len = 1;
    if (len >= sizeof n->digits) return 0;
    memcpy(n->digits, d, len);
    n->digits[len] = 0;
    n->is_int = 1;
    if (strcmp(n->digits, "0") == 0) n->neg = 0;
    return 1;
}

/* n = a / b. Exact integer when both are integers of at most 19 digits and b divides a. */
static void num_div(const num *a, const num *b, num *out) {
    num r = *a;
    r.is_int = 0;
    r.neg = a->neg != b->neg;
    r.value = a->value / b->value;
    if (a->is_int && b->is_int && strlen(a->digits) <= 19 && strlen(b->digits) <= 19) {
        unsigned long long x = strtoull(a->digits, NULL, 10), y = strtoull(b->digits, NULL, 10);
        if (y && x % y == 0) {
            char buf[24];
            snprintf(buf, sizeof buf, "%llu", x / y);
            set_int(&r, buf, strlen(buf));
        }
    }
    if (!r.is_int && r.value == 0) r.neg = 0;
    *out = r;
}

/* Builds n from its parts: sign, integer digits (commas already removed), fraction digits. */
static void make_num(num *n, int neg, const char *ip, size_t il, const char *fp, size_t fl) {
    memset(n, 0, sizeof *n);
    n->neg = neg;
    while (fl > 0 && fp[fl - 1] == '0') fl--;  /* "3.50" == "3.5"; "3.0" is the integer 3 */
    char buf[160];
    int w = snprintf(buf, sizeof buf, "%s%.*s.%.*s", neg ? "-" : "", (int)(il < 70 ? il : 70),
                     ip, (int)(fl < 70 ? fl : 70), fp ? fp : "");
    (void)w;
    n->value = strtod(buf, NULL);
    if (il > 70 || fl > 70) {  /* absurdly long: read the value from the full text */
        char *big = malloc(il + fl + 3);
        if (big) {
            sprintf(big, "%s%.*s.%.*s", neg ? "-" : "", (int)il, ip, (int)fl, fp ? fp : "");
            n->value = strtod(big, NULL);
            free(big);
        }
    }
    if (fl == 0) set_int(n, ip, il);
    if (n->value == 0 && !n->is_int) n->neg = 0;
}

/* Reads a number token at s (sign, digits with thousands commas, decimals, "/denominator",
 * '%'). Returns the bytes consumed, 0 when no number starts here. */
static size_t scan_number(const char *s, num *out) {
    size_t p = 0;
    int neg = 0;
    if (s[0] == '-' || s[0] == '+') neg = s[0] == '-', p = 1;
    else if (is_minus_sign(s)) neg = 1, p = 3;
    char ibuf[512];
    size_t il = 0, lead = 0;
    while (isdigit((unsigned char)s[p])) {
        if (il < sizeof ibuf) ibuf[il++] = s[p];
        p++, lead++;
    }
    /* Thousands separators: 1-3 leading digits, then groups of exactly three ("1,234,567");
     * anything else ("1,23", "1, 2") ends the number at the comma. */
    if (lead >= 1 && lead <= 3) {
        while (s[p] == ',' && isdigit((unsigned char)s[p + 1]) && isdigit((unsigned char)s[p + 2]) &&
               isdigit((unsigned char)s[p + 3]) && !isdigit((unsigned char)s[p + 4])) {
            for (int j = 1; j <= 3; j++)
                if (il < sizeof ibuf) ibuf[il++] = s[p + j];
            p += 4;
        }
    }
    const char *fp = NULL;
    size_t fl = 0;
    if (s[p] == '.' && isdigit((unsigned char)s[p + 1])) {
        fp = s + p + 1;
        p++;
        while (isdigit((unsigned char)s[p])) p++, fl++;
    }
    if (il == 0 && fl == 0) return 0;
    make_num(out, neg, ibuf, il, fp, fl);
    /* Fraction a/b of integers, b != 0. */
    if (!fp && s[p] == '/' && isdigit((unsigned char)s[p + 1])) {
        size_t q = p + 1, dl = 0;
        while (isdigit((unsigned char)s[q])) q++, dl++;
        num den;
        make_num(&den, 0, s + p + 1, dl, NULL, 0);
        if (den.value != 0) {
            num_div(out, &den, out);
            p = q;
        }
    }
    if (s[p] == '%') out->percent = 1, p++;
    else if (s[p] == '\\' && s[p + 1] == '%') out->percent = 1, p += 2;
    out->src = s;
    out->src_len = (int)p;
    return p;
}

/* Whether a number token may start at s[i] (the text from `from` on): a digit not glued to a
 * preceding digit, a ".5", or a sign right before one that does not follow a letter or digit
 * ("x-5" and "3-5" are not negative numbers). */
static int number_starts(const char *s, size_t from, size_t i) {
    unsigned char prev = i > from ? (unsigned char)s[i - 1] : ' ';
    const char *c = s + i;
    int digitish = isdigit((unsigned char)c[0]) ||
                   (c[0] == '.' && isdigit((unsigned char)c[1]) && !isdigit(prev));
    if (digitish) return 1;
    int sign_len = (c[0] == '-' || c[0] == '+') ? 1 : is_minus_sign(c) ? 3 : 0;
    if (!sign_len || isalnum(prev)) return 0;
    const char *d = c + sign_len;
    return isdigit((unsigned char)d[0]) || (d[0] == '.' && isdigit((unsigned char)d[1]));
}

/* The first (want_last = 0) or last number in s[from, to). Returns 1 when found. */
static int find_number(const char *s, size_t from, size_t to, int want_last, num *out) {
    int found = 0;
    for (size_t i = from; i < to && s[i];) {
        num n;
        size_t used = number_starts(s, from, i) ? scan_number(s + i, &n) : 0;
        if (!used) {
            i++;
            continue;
        }
        if (i + used > to) break;
        *out = n;
        found = 1;
        if (!want_last) return 1;
        i += used;
    }
    return found;
}

/* Offset of the last occurrence of needle in s (ASCII case-insensitive when ci), -1 if none. */
static long last_of(const char *s, const char *needle, int ci) {
    size_t n = strlen(needle), len = strlen(s);
    for (size_t i = len >= n ? len - n + 1 : 0; i-- > 0;) {
        size_t j = 0;
        while (j < n && (ci ? tolower((unsigned char)s[i + j]) == tolower((unsigned char)needle[j])
                            : s[i + j] == needle[j]))
            j++;
        if (j == n) return (long)i;
    }
    return -1;
}

/* Matching close brace of the group opening at s[0] == '{'; -1 when unterminated. A backslash
 * escapes the next byte ("\{" does not nest). */
static long group_end(const char *s) {
    int depth = 0;
    for (long i = 0; s[i]; i++) {
        if (s[i] == '\\' && s[i + 1]) i++;
        else if (s[i] == '{') depth++;
        else if (s[i] == '}' && --depth == 0) return i;
    }
    return -1;
}

/* Content of a box command at s (just after "\boxed" / "\fbox"): "{...}" with nesting,
 * " {...}", or " x" (one bare token). Sets *beg and *len; returns bytes to skip, 0 when
 * malformed. */
static size_t box_content(const char *s, size_t *beg, size_t *len) {
    size_t p = 0;
    while (s[p] == ' ') p++;
    if (s[p] == '{') {
        long e = group_end(s + p);
        if (e < 0) return 0;
        *beg = p + 1;
        *len = (size_t)e - 1;
        return p + (size_t)e + 1;
    }
    /* "\boxedx" is another command; "\boxed " at the end has no argument */
    if (!s[p] || (p == 0 && !isdigit((unsigned char)s[0]))) return 0;
    size_t q = p;
    while (s[q] && !isspace((unsigned char)s[q]) && s[q] != '$') q++;
    if (q == p) return 0;
    *beg = p;
    *len = q - p;
    return q;
}

/* The last top-level \boxed / \fbox content of s (nested boxes inside it are part of it);
 * returns 1 and its span when there is one. */
static int last_box(const char *s, size_t *beg, size_t *len) {
    int found = 0;
    for (size_t i = 0; s[i];) {
        size_t cmd = strncmp(s + i, "\\boxed", 6) == 0 ? 6 : strncmp(s + i, "\\fbox", 5) == 0 ? 5 : 0;
        size_t b, l, used = cmd ? box_content(s + i + cmd, &b, &l) : 0;
        if (!used) {
            i++;
            continue;
        }
        *beg = i + cmd + b;
        *len = l;
        found = 1;
        i += cmd + used;
    }
    return found;
}

static char *dup_span(const char *s, size_t len) {
    char *d = malloc(len + 1);
    if (!d) return NULL;
    memcpy(d, s, len);
    d[len] = 0;
    return d;
}

/* ---- math normalisation -------------------------------------------------------------------- */

/* Replaces every occurrence of `from` by `to` in the heap string *s (reallocating). `word`:
 * only where `from` is not followed by a letter (so "\left" leaves "\leftarrow" alone). */
static int replace_all(char **s, const char *from, const char *to, int word) {
    size_t fl = strlen(from), tl = strlen(to), len = strlen(*s);
    char *out = malloc(len * (tl > fl ? tl : 1) / (fl ? fl : 1) + len + 1);
    if (!out) return 0;
    size_t o = 0;
    for (const char *p = *s; *p;) {
        if (strncmp(p, from, fl) == 0 && !(word && isalpha((unsigned char)p[fl]))) {
            memcpy(out + o, to, tl);
            o += tl, p += fl;
        } else {
            out[o++] = *p++;
        }
    }
    out[o] = 0;
    free(*s);
    *s = out;
    return 1;
}

/* Handles "\cmd{...}" groups: unwraps (keeps the content) or removes them. */
static void edit_groups(char *s, const char *cmd, int keep_content) {
    size_t cl = strlen(cmd);
    char *w = s;
    for (char *p = s; *p;) {
        if (strncmp(p, cmd, cl) == 0 && !isalpha((unsigned char)p[cl])) {
            char *q = p + cl;
            while (*q == ' ') q++;
            long e = *q == '{' ? group_end(q) : -1;
            if (e >= 0) {
                if (keep_content) {
                    memmove(w, q + 1, (size_t)e - 1);
                    w += e - 1;
                }
                p = q + e + 1;
                continue;
            }
        }
        *w++ = *p++;
    }
    *w = 0;
}

/* "\frac12" -> "\frac{1}{2}", "\sqrt2" -> "\sqrt{2}": braces around bare single-digit /
 * single-letter arguments (n_args of them). */
static int brace_bare_args(char **s, const char *cmd, int n_args) {
    size_t cl = strlen(cmd), len = strlen(*s);
    char *out = malloc(len * 3 + 1);
    if (!out) return 0;
    size_t o = 0;
    for (const char *p = *s; *p;) {
        if (strncmp(p, cmd, cl) == 0 && !isalpha((unsigned char)p[cl])) {
            memcpy(out + o, p, cl);
            o += cl, p += cl;
            for (int a = 0; a < n_args; a++) {
                if (*p == '{') {
                    long e = group_end(p);
                    if (e < 0) break;
                    memcpy(out + o, p, (size_t)e + 1);
                    o += (size_t)e + 1, p += e + 1;
                } else if (isalnum((unsigned char)*p)) {
                    out[o++] = '{', out[o++] = *p++, out[o++] = '}';
                } else {
                    break;
                }
            }
        } else {
            out[o++] = *p++;
        }
    }
    out[o] = 0;
    free(*s);
    *s = out;
    return 1;
}

static void remove_space(char *s) {
    char *w = s;
    for (char *p = s; *p; p++)
        if (!isspace((unsigned char)*p)) *w++ = *p;
    *w = 0;
}

/* Whole-string number: plain numbers and a/b (scan_number), [-]\frac{A}{B} with numeric A, B. */
static int parse_whole(const char *s, num *out) {
    int neg = 0;
    const char *p = s;
    if (strncmp(p, "\\frac{", 6) == 0 || (p[0] == '-' && strncmp(p + 1, "\\frac{", 6) == 0)) {
        if (*p == '-') neg = 1, p++;
        p += 5;
        long e1 = group_end(p);
        if (e1 < 0 || p[e1 + 1] != '{') return 0;
        long e2 = group_end(p + e1 + 1);
        if (e2 < 0 || p[e1 + 1 + e2 + 1]) return 0;
        char *a = dup_span(p + 1, (size_t)e1 - 1), *b = dup_span(p + e1 + 2, (size_t)e2 - 1);
        num na, nb;
        int ok = a && b && parse_whole(a, &na) && parse_whole(b, &nb) && nb.value != 0 &&
                 !na.percent && !nb.percent;
        free(a);
        free(b);
        if (!ok) return 0;
        num_div(&na, &nb, out);
        if (neg && out->value != 0) out->neg = !out->neg, out->value = -out->value;
        out->src = s;
        out->src_len = (int)strlen(s);
        return 1;
    }
    size_t used = scan_number(s, out);
    return used > 0 && s[used] == 0;
}

char *rf_reward_math_normalize(const char *answer) {
    char *s = answer ? dup_span(answer, strlen(answer)) : NULL;
    if (!s) return NULL;
    static const char *const drop[] = {"\\(", "\\)", "\\[", "\\]", "^{\\circ}", "^\\circ",
                                       "\\circ", "\\degree", "\xC2\xB0", "\\%", "%", "\\$", "$", "\\!",
                                       "\\,", "\\;", "\\:", "\\ ", "~", "\\qquad", "\\quad",
                                       "\\displaystyle"};
    int ok = 1;
    for (size_t i = 0; ok && i < sizeof drop / sizeof *drop; i++) ok = replace_all(&s, drop[i], "", 0);
    ok = ok && replace_all(&s, "\\left", "", 1) && replace_all(&s, "\\right", "", 1) &&
         replace_all(&s, "\\dfrac", "\\frac", 1) && replace_all(&s, "\\tfrac", "\\frac", 1) &&
         replace_all(&s, "\xE2\x88\x92", "-", 0) && brace_bare_args(&s, "\\frac", 2) &&
         brace_bare_args(&s, "\\sqrt", 1);
    if (!ok) {
        free(s);
        return NULL;
    }
    /* Units in \text{..}: dropped, unless the group is the whole answer ("\text{Tuesday}"). */
    static const char *const text_cmds[] = {"\\text", "\\textbf", "\\textit", "\\mbox"};
    for (size_t i = 0; i < sizeof text_cmds / sizeof *text_cmds; i++) {
        char *t = dup_span(s, strlen(s));
        if (!t) break;
        edit_groups(t, text_cmds[i], 0);
        remove_space(t);
        if (*t) edit_groups(s, text_cmds[i], 0);
        else edit_groups(s, text_cmds[i], 1);
        free(t);
    }
    edit_groups(s, "\\boxed", 1);  /* a box inside the extracted box */
    edit_groups(s, "\\mathrm", 1);
    edit_groups(s, "\\mathbf", 1);
    remove_space(s);
    size_t len = strlen(s);
    while (len > 0 && s[len - 1] == '.') s[--len] = 0;
    if (isalpha((unsigned char)s[0]) && s[1] == '=' && s[2]) memmove(s, s + 2, len - 1);
    num n;
    if (strchr(s, ',') && parse_whole(s, &n)) {
        char *w = s;
        for (char *p = s; *p; p++)
            if (*p != ',') *w++ = *p;
        *w = 0;
    }
    return s;
}

/* ---- extraction ------------------------------------------------------------------------- */

/* The rest of the line after s[from], trimmed. */
static char *rest_of_line(const char *s, size_t from) {
    while (s[from] == ' ' || s[from] == '\t' || s[from] == ':') from++;
    size_t e = from;
    while (s[e] && s[e] != '\n') e++;
    while (e > from && isspace((unsigned char)s[e - 1])) e--;
    return dup_span(s + from, e - from);
}

/* After "answer is": a $...$ or \(...\) span when the answer opens with one, else up to the
 * end of the sentence (a period followed by whitespace) or of the line. */
static char *answer_phrase(const char *s, size_t from) {
    while (s[from] == ' ' || s[from] == '\t' || s[from] == ':') from++;
    const char *p = s + from;
    if (p[0] == '$' || (p[0] == '\\' && p[1] == '(')) {
        const char *close = p[0] == '$' ? (p[1] == '$' ? "$$" : "$") : "\\)";
        size_t open = p[0] == '$' ? strlen(close) : 2;
        const char *e = strstr(p + open, close);
        if (e) return dup_span(p + open, (size_t)(e - p - open));
    }
    size_t e = 0;
    while (p[e] && p[e] != '\n' && !(p[e] == '.' && (isspace((unsigned char)p[e + 1]))))
        e++;
    return dup_span(p, e);
}

char *rf_reward_math_extract(const char *text) {
    if (!text) return NULL;
    size_t b, l;
    if (last_box(text, &b, &l)) return dup_span(text + b, l);
    long h = last_of(text, "####", 0);
    if (h >= 0) return rest_of_line(text, (size_t)h + 4);
    long a = last_of(text, "answer is", 1);
    if (a >= 0) return answer_phrase(text, (size_t)a + 9);
    return NULL;
}

/* ---- comparison --------------------------------------------------------------------------- */

/* Integers exactly; otherwise by value within RF_NUM_RTOL (relative). */
static int num_equal(const num *pred, const num *truth) {
    if (truth->is_int)
        return pred->is_int && pred->neg == truth->neg && strcmp(pred->digits, truth->digits) == 0;
    double p = pred->value, t = truth->value;
    if (!isfinite(p) || !isfinite(t)) return 0;
    return fabs(p - t) <= RF_NUM_RTOL * fmax(fabs(p), fabs(t));
}

/* The numeric rule's comparison, with its percentage convention. */
static int numeric_match(const num *pred, const num *truth) {
    if (num_equal(pred, truth)) return 1;
    if (truth->percent && !pred->percent) {  /* "0.25" for "25%" */
        double p = pred->value * 100, t = truth->value;
        return isfinite(p) && fabs(p - t) <= RF_NUM_RTOL * fmax(fabs(p), fabs(t)) + 1e-12;
    }
    return 0;
}

/* The numeric rule's final number of `s`; `how` says where it came from. */
static int final_number(const char *s, num *out, const char **how) {
    size_t len = strlen(s), b, l;
    if (last_box(s, &b, &l)) {
        char *box = dup_span(s + b, l), *norm = box ? rf_reward_math_normalize(box) : NULL;
        int ok = norm && parse_whole(norm, out);
        free(box);
        free(norm);
        *how = "\\boxed";
        if (ok) {  /* point the info string at the box text, not the freed copy */
            out->src = s + b;
            out->src_len = (int)l;
            return 1;
        }
        if (find_number(s, b, b + l, 1, out)) return 1;
    }
    long h = last_of(s, "####", 0);
    if (h >= 0 && find_number(s, (size_t)h + 4, len, 0, out)) return *how = "####", 1;
    long a = last_of(s, "answer is", 1);
    if (a >= 0 && find_number(s, (size_t)a + 9, len, 0, out)) return *how = "answer is", 1;
    *how = "last number";
    return find_number(s, 0, len, 1, out);
}

/* The truth's number: the whole string as a number (also after math normalisation, so
 * " 42 " and "-\frac12" work), else its final number as for a response. */
static int truth_number(const char *truth, num *t) {
    if (parse_whole(truth, t)) return 1;
    char *norm = rf_reward_math_normalize(truth);
    int ok = norm && *norm && parse_whole(norm, t);
    free(norm);
    if (ok) {
        t->percent = strchr(truth, '%') != NULL;
        t->src = truth;
        t->src_len = (int)strlen(truth);
        return 1;
    }
    const char *how;
    return final_number(truth, t, &how);
}

float rf_reward_numeric(const char *response, const char *truth, char *info, size_t info_cap) {
    num t, p;
    const char *how_p;
    if (!truth || !truth_number(truth, &t)) {
        set_info(info, info_cap, "truth has no number");
        return 0.0f;
    }
    if (!response || !final_number(response, &p, &how_p)) {
        set_info(info, info_cap, "no number in response (truth %.*s)", t.src_len > 40 ? 40 : t.src_len, t.src);
        return 0.0f;
    }
    int eq = numeric_match(&p, &t);
    set_info(info, info_cap, "pred %.*s (%s) %s truth %.*s", p.src_len > 40 ? 40 : p.src_len,
             p.src, how_p, eq ? "==" : "!=", t.src_len > 40 ? 40 : t.src_len, t.src);
    return eq ? 1.0f : 0.0f;
}

/* The truth's answer for the math rule: its own box or "####" line, else all of it. */
static char *math_truth(const char *truth) {
    size_t b, l;
    if (last_box(truth, &b, &l)) return dup_span(truth + b, l);
    long h = last_of(truth, "####", 0);
    if (h >= 0) return rest_of_line(truth, (size_t)h + 4);
    return dup_span(truth, strlen(truth));
}

float rf_reward_math(const char *response, const char *truth, char *info, size_t info_cap) {
    if (!truth) {
        set_info(info, info_cap, "no truth");
        return 0.0f;
    }
    char *pa = response ? rf_reward_math_extract(response) : NULL;
    if (!pa) {
        set_info(info, info_cap, "no final answer (no \\boxed, ####, or \"answer is\")");
        return 0.0f;
    }
    char *ta = math_truth(truth);
    char *pn = rf_reward_math_normalize(pa), *tn = ta ? rf_reward_math_normalize(ta) : NULL;
    int eq = 0;
    const char *how = "string";
    if (pn && tn) {
        num np, nt;
        if (*tn && parse_whole(pn, &np) && parse_whole(tn, &nt)) eq = num_equal(&np, &nt), how = "number";
        else eq = *tn && strcmp(pn, tn) == 0;
    }
    set_info(info, info_cap, "pred %.40s %s truth %.40s (%s)", pn ? pn : "?", eq ? "==" : "!=",
             tn ? tn : "?", how);
    free(pa);
    free(ta);
    free(pn);
    free(tn);
    return eq ? 1.0f : 0.0f;
}
