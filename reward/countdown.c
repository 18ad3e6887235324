/* The countdown checker: a recursive-descent parser over exact 64-bit rationals. See
 * reward/countdown.h. */
#include "reward/countdown.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <stdlib.h>
#include <string.h>


/* An exact rational n/d, d > 0, in lowest terms. */
typedef struct rat {
    int64_t n, d;
} rat;

typedef struct cd_parser {
    const char *p;
    const int64_t *nums; /* (n_nums) */
    int n_nums;
    unsigned char used[64];
    int depth;
    rf_countdown_verdict err; /* first problem met; RF_COUNTDOWN_CORRECT while none */
} cd_parser;

#define CD_MAX_NUMS 64
#define CD_MAX_DEPTH 64

static int fail(cd_parser *ps, rf_countdown_verdict v) {
    if (ps->err == RF_COUNTDOWN_CORRECT) ps->err = v;
    return 0;
}

static int64_t gcd64(int64_t a, int64_t b) {
    if (a < 0) a = -a;
    if (b < 0) b = -b;
    while (b) { int64_t t = a % b; a = b, b = t; }
    return a;
}

/* n/d in lowest terms with d > 0; 0 on overflow (INT64_MIN cannot be negated) or d = 0. */
static int rat_norm(int64_t n, int64_t d, rat *out) {
    if (d == 0 || n == INT64_MIN || d == INT64_MIN) return 0;
    if (d < 0) n = -n, d = -d;
    int64_t g = gcd64(n, d);
    if (g > 1) n /= g, d /= g;
    out->n = n, out->d = d;
    return 1;
}

static int rat_apply(cd_parser *ps, rat a, char op, rat b, rat *out) {
    int64_t x, y, n, d;
    if (op == '/') {
        if (b.n == 0) return fail(ps, RF_COUNTDOWN_DIV_ZERO);
        int64_t t = b.n;
        b.n = b.d, b.d = t; /* a / b = a * (1/b); rat_norm fixes the sign */
        op = '*';
    }
    if (op == '*') {
        if (__builtin_mul_overflow(a.n, b.n, &n) || __builtin_mul_overflow(a.d, b.d, &d))
            return fail(ps, RF_COUNTDOWN_OVERFLOW);
    } else {
        if (__builtin_mul_overflow(a.n, b.d, &x) || __builtin_mul_overflow(b.n, a.d, &y) ||
            __builtin_mul_overflow(a.d, b.d, &d) ||
            (op == '+' ? __builtin_add_overflow(x, y, &n) : __builtin_sub_overflow(x, y, &n)))
            return fail(ps, RF_COUNTDOWN_OVERFLOW);
    }
    return rat_norm(n, d, out) ? 1 : fail(ps, RF_COUNTDOWN_OVERFLOW);
}

static void skip_space(cd_parser *ps) {
    while (*ps->p == ' ' || *ps->p == '\t') ps->p++;
}

static int parse_expr(cd_parser *ps, rat *out);

/* A NUMBER, consumed from the unused given numbers. */
static int parse_number(cd_parser *ps, rat *out) {
    int64_t v = 0;
    int big = 0;
    for (; *ps->p >= '0' && *ps->p <= '9'; ps->p++) {
        if (v > 100000000000000LL) big = 1; /* longer than any listed number can be */
        else v = v * 10 + (*ps->p - '0');
    }
    for (int k = 0; !big && k < ps->n_nums; k++)
        if (!ps->used[k] && ps->nums[k] == v) {
            ps->used[k] = 1, out->n = v, out->d = 1;
            return 1;
        }
    return fail(ps, RF_COUNTDOWN_BAD_NUMBER);
}

static int parse_factor(cd_parser *ps, rat *out) {
    skip_space(ps);
    if (*ps->p >= '0' && *ps->p <= '9') return parse_number(ps, out);
    if (*ps->p != '(' || ps->depth >= CD_MAX_DEPTH) return fail(ps, RF_COUNTDOWN_MALFORMED);
    ps->p++, ps->depth++;
    if (!parse_expr(ps, out)) return 0;
    skip_space(ps);
    if (*ps->p != ')') return fail(ps, RF_COUNTDOWN_MALFORMED);
    ps->p++, ps->depth--;
    return 1;
}

static int parse_term(cd_parser *ps, rat *out) {
    if (!parse_factor(ps, out)) return 0;
    for (;;) {
        skip_space(ps);
        char op = *ps->p;
        if (op != '*' && op != '/') return 1;
        ps->p++;
        rat b;
        if (!parse_factor(ps, &b) || !rat_apply(ps, *out, op, b, out)) return 0;
    }
}

static int parse_expr(cd_parser *ps, rat *out) {
    if (!parse_term(ps, out)) return 0;
    for (;;) {
        skip_space(ps);
        char op = *ps->p;
        if (op != '+' && op != '-') return 1;
        ps->p++;
        rat b;
        if (!parse_term(ps, &b) || !rat_apply(ps, *out, op, b, out)) return 0;
    }
}

/* numbers_json -> nums; 0 when it is not an array of at most 64 integers in [0, 2^53]. */
static int read_numbers(const char *json, int64_t *nums, int *n) {
    cJSON *a = json ? cJSON_Parse(json) : NULL;
    int ok = cJSON_IsArray(a) && cJSON_GetArraySize(a) <= CD_MAX_NUMS;
    *n = 0;
    const cJSON *it;
    if (ok) cJSON_ArrayForEach(it, a) {
        double v = it->valuedouble;
        if (!cJSON_IsNumber(it) || v < 0 || v > 9007199254740992.0 || v != (double)(int64_t)v) {
            ok = 0;
            break;
        }
        nums[(*n)++] = (int64_t)v;
    }
    cJSON_Delete(a);
    return ok;
}

rf_countdown_verdict rf_countdown_check_nums(const char *expr, const int64_t *nums, int n,
                                             int target) {
    if (n < 0 || n > CD_MAX_NUMS) return RF_COUNTDOWN_BAD_INPUT;
    cd_parser ps = {.p = expr, .nums = nums, .n_nums = n};
    if (!expr) return RF_COUNTDOWN_MALFORMED;
    rat v;
    if (!parse_expr(&ps, &v)) return ps.err;
    skip_space(&ps);
    if (*ps.p != '\0') return RF_COUNTDOWN_MALFORMED;
    for (int k = 0; k < n; k++)
        if (!ps.used[k]) return RF_COUNTDOWN_UNUSED_NUMBER;
    return v.d == 1 && v.n == target ? RF_COUNTDOWN_CORRECT : RF_COUNTDOWN_WRONG_VALUE;
}

rf_countdown_verdict rf_task_countdown_check(const char *expr, const char *numbers_json, int target) {
    int64_t nums[CD_MAX_NUMS];
    int n;
    if (!read_numbers(numbers_json, nums, &n)) return RF_COUNTDOWN_BAD_INPUT;
    return rf_countdown_check_nums(expr, nums, n, target);
}

/* Reads a non-negative integer at *p (at most 2^53) and skips spaces after it; 0 when none. */
static int read_uint(const char **p, int64_t *v) {
    const char *s = *p;
    if (!isdigit((unsigned char)*s)) return 0;
    int64_t x = 0;
    for (; isdigit((unsigned char)*s); s++) {
        x = x * 10 + (*s - '0');
        if (x > 9007199254740992LL) return 0;
    }
    while (*s == ' ' || *s == '\t') s++;
    *p = s, *v = x;
    return 1;
}

int rf_countdown_truth_parse(const char *truth, int64_t *nums, int cap, int *n, int *target) {
    const char *p = truth;
    *n = 0;
    if (!p) return 0;
    while (*p == ' ' || *p == '\t') p++;
    int bracket = *p == '[';
    if (bracket) for (p++; *p == ' ' || *p == '\t'; p++) {}
    int64_t v;
    while (read_uint(&p, &v)) {
        if (*n == cap) return 0;
        nums[(*n)++] = v;
        if (*p == ',') for (p++; *p == ' ' || *p == '\t'; p++) {}
    }
    if (bracket) {
        if (*p != ']') return 0;
        for (p++; *p == ' ' || *p == '\t'; p++) {}
    }
    if (*n == 0 || p[0] != '-' || p[1] != '>') return 0;
    for (p += 2; *p == ' ' || *p == '\t'; p++) {}
    if (!read_uint(&p, &v) || *p != '\0' || v > 2147483647) return 0;
    *target = (int)v;
    return 1;
}

const char *rf_countdown_verdict_name(rf_countdown_verdict v) {
    switch (v) {
    case RF_COUNTDOWN_CORRECT: return "correct";
    case RF_COUNTDOWN_WRONG_VALUE: return "wrong value";
    case RF_COUNTDOWN_BAD_NUMBER: return "number not given or used too often";
    case RF_COUNTDOWN_UNUSED_NUMBER: return "a given number is not used";
    case RF_COUNTDOWN_DIV_ZERO: return "division by zero";
    case RF_COUNTDOWN_OVERFLOW: return "overflow";
    case RF_COUNTDOWN_MALFORMED: return "malformed expression";
    case RF_COUNTDOWN_BAD_INPUT: return "bad numbers list";
    }
    return "unknown";
}
