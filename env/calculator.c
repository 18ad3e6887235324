/* The built-in calculator tool environment (env/calculator.h). A recursive-descent parser over
 * int64 with overflow checks; rationals only at a non-exact division. */
#include "env/calculator.h"

#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A value: an integer, or (after a non-exact division) a double. */
typedef struct calc_val {
    int is_int;
    int64_t i;
    double d;
} calc_val;

typedef struct parser {
    const char *p;
    const char *err; /* the first error, NULL while none */
    int depth;
} parser;

static void skip(parser *s) {
    while (*s->p == ' ' || *s->p == '\t' || *s->p == '\n') s->p++;
}

static double as_double(calc_val v) { return v.is_int ? (double)v.i : v.d; }

static calc_val fail(parser *s, const char *why) {
    if (!s->err) s->err = why;
    return (calc_val){1, 0, 0};
}

static calc_val expr(parser *s);

static calc_val number(parser *s) {
    int64_t v = 0;
    if (!isdigit((unsigned char)*s->p)) return fail(s, *s->p ? "cannot parse" : "the expression ends early");
    while (isdigit((unsigned char)*s->p)) {
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, *s->p - '0', &v)) return fail(s, "overflow");
        s->p++;
    }
    return (calc_val){1, v, 0};
}

static calc_val unary(parser *s) {
    skip(s);
    if (*s->p == '-') {
        s->p++;
        calc_val v = unary(s);
        if (v.is_int && v.i == INT64_MIN) return fail(s, "overflow");
        return v.is_int ? (calc_val){1, -v.i, 0} : (calc_val){0, 0, -v.d};
    }
    if (*s->p == '(') {
        if (++s->depth > 64) return fail(s, "too deeply nested");
        s->p++;
        calc_val v = expr(s);
        skip(s);
        if (*s->p != ')') return fail(s, "a parenthesis is not closed");
        s->p++, s->depth--;
        return v;
    }
    return number(s);
}

static calc_val apply(parser *s, calc_val a, char op, calc_val b) {
    if (a.is_int && b.is_int) {
        int64_t r;
        if (op == '/') {
            if (b.i == 0) return fail(s, "division by zero");
            if (a.i == INT64_MIN && b.i == -1) return fail(s, "overflow");
            if (a.i % b.i == 0) return (calc_val){1, a.i / b.i, 0};
            return (calc_val){0, 0, (double)a.i / (double)b.i};
        }
        int of = op == '+' ? __builtin_add_overflow(a.i, b.i, &r) : op == '-' ? __builtin_sub_overflow(a.i, b.i, &r)
                                                                               : __builtin_mul_overflow(a.i, b.i, &r);
        return of ? fail(s, "overflow") : (calc_val){1, r, 0};
    }
    double x = as_double(a), y = as_double(b);
    if (op == '/' && y == 0) return fail(s, "division by zero");
    return (calc_val){0, 0, op == '+' ? x + y : op == '-' ? x - y : op == '*' ? x * y : x / y};
}

static calc_val term(parser *s) {
    calc_val v = unary(s);
    for (skip(s); !s->err && (*s->p == '*' || *s->p == '/'); skip(s)) {
        char op = *s->p++;
        v = apply(s, v, op, unary(s));
    }
    return v;
}

static calc_val expr(parser *s) {
    calc_val v = term(s);
    for (skip(s); !s->err && (*s->p == '+' || *s->p == '-'); skip(s)) {
        char op = *s->p++;
        v = apply(s, v, op, term(s));
    }
    return v;
}

int rf_calculator_eval(const char *text, char *out, size_t cap) {
    parser s = {text, NULL, 0};
    if (strlen(text) > 256) s.err = "the expression is longer than 256 characters";
    calc_val v = s.err ? (calc_val){1, 0, 0} : expr(&s);
    skip(&s);
    if (!s.err && *s.p) s.err = "cannot parse";
    if (s.err) {
        snprintf(out, cap, "error: %s", s.err);
        return 0;
    }
    if (v.is_int) snprintf(out, cap, "%lld", (long long)v.i);
    else snprintf(out, cap, "%.6f", v.d);
    if (!v.is_int) { /* trailing zeros of the 6 decimals go: 3.500000 -> 3.5 */
        char *e = out + strlen(out) - 1;
        while (e > out && *e == '0') *e-- = '\0';
        if (*e == '.') *e = '\0';
    }
    return 1;
}

/* The reply to one call: a reset answers nothing; a turn that ends in a tool call gets its
 * result; any other turn ends the episode. */
typedef struct calc_env {
    char (*obs)[320];
    int cap;
} calc_env;

static rf_status calc_call(void *ctx, const rf_env_call *c, int n, rf_env_reply *out) {
    calc_env *e = ctx;
    if (n > e->cap) {
        void *p = realloc(e->obs, sizeof *e->obs * (size_t)n);
        if (!p) return rf_error(RF_ERR_NOMEM, "calculator: out of memory");
        e->obs = p, e->cap = n;
    }
    for (int i = 0; i < n; i++) {
        out[i] = (rf_env_reply){"", 0.0f, 0, "", "the built-in calculator"};
        if (!c[i].is_step) continue;
        const char *open = NULL, *a = c[i].action ? c[i].action : "";
        for (const char *p = strstr(a, "<calc>"); p; p = strstr(p + 1, "<calc>")) open = p;
        if (!open || strcmp(c[i].finish ? c[i].finish : "", "stop") != 0) {
            out[i].done = 1; /* no tool call: the model answered */
            continue;
        }
        char value[256];
        rf_calculator_eval(open + 6, value, sizeof value);
        snprintf(e->obs[i], sizeof e->obs[i], "<result>%s</result>", value);
        out[i].observation = e->obs[i];
    }
    return RF_OK;
}

static void calc_close(void *ctx) {
    calc_env *e = ctx;
    free(e->obs);
    free(e);
}

rf_status rf_calculator_env(rf_env *out) {
    calc_env *e = calloc(1, sizeof *e);
    if (!e) return rf_error(RF_ERR_NOMEM, "calculator: out of memory");
    *out = (rf_env){e, calc_call, NULL, calc_close, NULL};
    return RF_OK;
}
