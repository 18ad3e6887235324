/* The `exact`, `countdown`, `format`, `length` and `overlong` rules, the answer_regex
 * extraction and the weighted combination of rules (rf_reward_rules). The `numeric` and `math`
 * rules live in reward/math_answer.c, the countdown checker in reward/countdown.c.
 *
 * An rf_reward_rules object is immutable after rf_reward_rules_init: the compiled regex is
 * shared by every thread, and each match gets its own PCRE2 match data (pcre2_match is
 * thread-safe for a shared pcre2_code, JIT-compiled or not; PCRE2 docs, pcre2api "Multithreading"). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reward/countdown.h"
#include "reward/reward.h"

typedef enum rule_kind {
    RULE_NUMERIC,
    RULE_MATH,
    RULE_EXACT,
    RULE_COUNTDOWN,
    RULE_FORMAT,
    RULE_LENGTH,
    RULE_OVERLONG,
    RULE_COUNT
} rule_kind;

static const char *const rule_names[RULE_COUNT] = {"numeric", "math", "exact", "countdown",
                                                   "format", "length", "overlong"};
#define RULE_NAMES_TEXT "numeric, math, exact, countdown, format, length, overlong"

/* The rules that compare an answer with the truth: they read the answer_regex capture. */
static int is_correctness(rule_kind k) { return k <= RULE_COUNTDOWN; }

struct rf_reward_rules {
    int n;
    rule_kind kind[RF_REWARD_MAX_RULES];
    float weight[RF_REWARD_MAX_RULES];
    pcre2_code *re;          /* "format": compiled once, read-only */
    pcre2_code *answer_re;   /* answer_regex, NULL when none: compiled once, read-only */
    int answer_group;        /* 1 when answer_re has a capture group, else 0 (whole match) */
    int length_target;
    float length_penalty;
    int overlong_buffer;
    float overlong_penalty;
    int max_new_tokens;
};

/* Compiles `pattern` with the options rf_reward_format documents; `label` names it in errors. */
static rf_status compile_regex_as(const char *label, const char *pattern, pcre2_code **out) {
    int err;
    PCRE2_SIZE off;
    *out = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                         PCRE2_DOTALL | PCRE2_UTF | PCRE2_MATCH_INVALID_UTF, &err, &off, NULL);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return rf_error(RF_ERR_ARG, "%s \"%s\": PCRE2 error at offset %zu: %s", label, pattern,
                        (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE);  /* best effort: the interpreter is the fallback */
    return RF_OK;
}

static rf_status compile_regex(const char *pattern, pcre2_code **out) {
    return compile_regex_as("format regex", pattern, out);
}

rf_status rf_reward_regex_check(const char *label, const char *pattern) {
    pcre2_code *re = NULL;
    rf_status s = compile_regex_as(label, pattern ? pattern : "", &re);
    pcre2_code_free(re);
    return s;
}

/* Searches the whole response for the pattern; *matched = 1 / 0. */
static rf_status regex_search(const pcre2_code *re, const char *response, int *matched) {
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md) return rf_error(RF_ERR_NOMEM, "out of memory for PCRE2 match data");
    const char *subject = response ? response : "";
    int rc = pcre2_match(re, (PCRE2_SPTR)subject, strlen(subject), 0, 0, md, NULL);
    pcre2_match_data_free(md);
    if (rc >= 0 || rc == PCRE2_ERROR_NOMATCH) {
        *matched = rc >= 0;
        return RF_OK;
    }
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return rf_error(RF_ERR_INTERNAL, "format regex match failed: %s", (const char *)msg);
}

rf_status rf_reward_format(const char *response, const char *pattern, float *reward, char *info,
                           size_t info_cap) {
    *reward = 0.0f;
    if (!pattern) return rf_error(RF_ERR_ARG, "format reward: no regex given");
    pcre2_code *re;
    RF_TRY(compile_regex(pattern, &re));
    int matched = 0;
    rf_status s = regex_search(re, response, &matched);
    pcre2_code_free(re);
    RF_TRY(s);
    *reward = matched ? 1.0f : 0.0f;
    if (info && info_cap) snprintf(info, info_cap, "%s", matched ? "match" : "no match");
    return RF_OK;
}

/* ---- exact and countdown ------------------------------------------------------------------ */

static int is_space(char ch) {
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\v' || ch == '\f';
}

const char *rf_reward_answer_span(const char *response, size_t *len) {
    const char *s = response ? response : "", *open = NULL, *p = s;
    for (const char *q; (q = strstr(p, "<answer>")); p = q + 1) open = q;
    const char *b, *e;
    if (open && (e = strstr(open + 8, "</answer>"))) {
        b = open + 8;
    } else { /* the last line that is not blank */
        e = s + strlen(s);
        while (e > s && is_space(e[-1])) e--;
        b = e;
        while (b > s && b[-1] != '\n') b--;
    }
    while (b < e && is_space(*b)) b++;
    while (e > b && is_space(e[-1])) e--;
    *len = (size_t)(e - b);
    return b;
}

/* Normalises n bytes at s into a fresh string: see rf_reward_exact. */
static char *exact_normalize(const char *s, size_t n) {
    char *out = malloc(n + 1);
    if (!out) return NULL;
    size_t k = 0;
    int gap = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (is_space(ch)) {
            gap = k > 0;
            continue;
        }
        if (gap) out[k++] = ' ', gap = 0;
        out[k++] = ch >= 'A' && ch <= 'Z' ? (char)(ch - 'A' + 'a') : ch;
    }
    out[k] = '\0';
    return out;
}

/* rf_reward_exact on an answer already extracted (n bytes at a). */
static float exact_on(const char *a, size_t n, const char *truth, char *info, size_t cap) {
    if (!truth) {
        if (info && cap) snprintf(info, cap, "no truth");
        return 0.0f;
    }
    char *x = exact_normalize(a, n), *y = exact_normalize(truth, strlen(truth));
    /* an empty answer never matches, not even an empty truth: saying nothing earns nothing */
    float v = x && y && x[0] && strcmp(x, y) == 0 ? 1.0f : 0.0f;
    if (info && cap) snprintf(info, cap, "\"%.60s\" %s \"%.60s\"", x ? x : "?", v ? "==" : "!=", y ? y : "?");
    free(x), free(y);
    return v;
}

float rf_reward_exact(const char *response, const char *truth, char *info, size_t info_cap) {
    size_t n;
    const char *a = rf_reward_answer_span(response, &n);
    return exact_on(a, n, truth, info, info_cap);
}

/* rf_reward_countdown on an expression already extracted (n bytes at a). */
static float countdown_on(const char *a, size_t n, const char *truth, char *info, size_t cap) {
    int64_t nums[64];
    int n_nums, target;
    if (!rf_countdown_truth_parse(truth, nums, 64, &n_nums, &target)) {
        if (info && cap) snprintf(info, cap, "truth \"%.60s\" is not \"NUMBERS -> TARGET\"", truth ? truth : "(none)");
        return 0.0f;
    }
    char *expr = malloc(n + 1);
    if (!expr) {
        if (info && cap) snprintf(info, cap, "out of memory");
        return 0.0f;
    }
    memcpy(expr, a, n);
    expr[n] = '\0';
    rf_countdown_verdict v = rf_countdown_check_nums(expr, nums, n_nums, target);
    if (info && cap) snprintf(info, cap, "\"%.60s\": %s (target %d)", expr, rf_countdown_verdict_name(v), target);
    free(expr);
    return v == RF_COUNTDOWN_CORRECT ? 1.0f : 0.0f;
}

float rf_reward_countdown(const char *response, const char *truth, char *info, size_t info_cap) {
    size_t n;
    const char *a = rf_reward_answer_span(response, &n);
    return countdown_on(a, n, truth, info, info_cap);
}

float rf_reward_length(int len, int target, float penalty) {
    if (target <= 0) return 0.0f;
    return (float)(-(double)penalty * fabs((double)len - target) / target);
}

float rf_reward_overlong(int len, int max_len, int buffer, float penalty_factor) {
    if (len >= max_len) return -penalty_factor;
    int start = max_len - buffer;
    if (buffer <= 0 || len <= start) return 0.0f;
    return (float)(-(double)(len - start) / buffer * penalty_factor);
}

/* ---- answer_regex ------------------------------------------------------------------------- */

/* The answer the correctness rules read: with answer_regex, the capture of its last match (a
 * fresh NUL-terminated copy, found = 0 when it never matches); without, the whole response. */
typedef struct answer_text {
    char *capture; /* owned; NULL without answer_regex or without a match */
    int found;
} answer_text;

/* Start of the next search after an empty match at `at`: one whole UTF-8 character further. */
static size_t next_start(const char *s, size_t len, size_t at) {
    at++;
    while (at < len && ((unsigned char)s[at] & 0xC0) == 0x80) at++;
    return at;
}

static rf_status extract_answer(const rf_reward_rules *r, const char *response, answer_text *a) {
    const char *s = response ? response : "";
    size_t len = strlen(s), start = 0, b = 0, e = 0;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(r->answer_re, NULL);
    if (!md) return rf_error(RF_ERR_NOMEM, "out of memory for PCRE2 match data");
    a->found = 0, a->capture = NULL;
    while (start <= len) {
        int rc = pcre2_match(r->answer_re, (PCRE2_SPTR)s, len, start, 0, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            pcre2_match_data_free(md);
            return rf_error(RF_ERR_INTERNAL, "answer_regex match failed: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        int g = r->answer_group;
        /* an optional group that took no part in the match reads as empty */
        b = ov[2 * g] == PCRE2_UNSET ? 0 : ov[2 * g], e = ov[2 * g] == PCRE2_UNSET ? 0 : ov[2 * g + 1];
        a->found = 1;
        start = ov[1] > ov[0] ? ov[1] : next_start(s, len, ov[1]);
    }
    pcre2_match_data_free(md);
    if (!a->found) return RF_OK;
    if (!(a->capture = malloc(e - b + 1))) return rf_error(RF_ERR_NOMEM, "out of memory for an answer");
    memcpy(a->capture, s + b, e - b);
    a->capture[e - b] = '\0';
    return RF_OK;
}

static rf_status validate_params(const rf_reward_rules_config *c, rule_kind k) {
    switch (k) {
    case RULE_FORMAT:
        if (!c->format_regex || !*c->format_regex)
            return rf_error(RF_ERR_ARG, "reward rule \"format\" needs format_regex");
        return RF_OK;
    case RULE_LENGTH:
        if (c->length_target <= 0)
            return rf_error(RF_ERR_ARG, "reward rule \"length\" needs length_target > 0 (got %d)",
                            c->length_target);
        if (!(c->length_penalty >= 0) || !isfinite(c->length_penalty))
            return rf_error(RF_ERR_ARG, "reward rule \"length\": length_penalty must be >= 0 "
                            "(got %g)", c->length_penalty);
        return RF_OK;
    case RULE_OVERLONG:
        if (c->max_new_tokens <= 0 || c->overlong_buffer <= 0 ||
            c->overlong_buffer > c->max_new_tokens)
            return rf_error(RF_ERR_ARG, "reward rule \"overlong\" needs 0 < overlong_buffer <= "
                            "max_new_tokens (got buffer %d, max_new_tokens %d)",
                            c->overlong_buffer, c->max_new_tokens);
        if (!(c->overlong_penalty >= 0) || !isfinite(c->overlong_penalty))
            return rf_error(RF_ERR_ARG, "reward rule \"overlong\": overlong_penalty must be >= 0 "
                            "(got %g)", c->overlong_penalty);
        return RF_OK;
    default:
        return RF_OK;
    }
}

/* Fills kinds and weights from the config's names and weights. */
static rf_status parse_rules(rf_reward_rules *r, const rf_reward_rules_config *c) {
    if (c->n_names == 0 && c->allow_none) return RF_OK;
    if (c->n_names <= 0 || !c->names)
        return rf_error(RF_ERR_ARG, "no reward rules given; valid rules: " RULE_NAMES_TEXT);
    if (c->n_names > RF_REWARD_MAX_RULES)
        return rf_error(RF_ERR_ARG, "%d reward rules given, at most %d", c->n_names,
                        RF_REWARD_MAX_RULES);
    int n_w = c->weights ? c->n_weights : 0;
    if (n_w != 0 && n_w != c->n_names)
        return rf_error(RF_ERR_ARG, "%d reward weights for %d reward rules: give one weight per "
                        "rule (or none for all 1)", n_w, c->n_names);
    for (int i = 0; i < c->n_names; i++) {
        const char *name = c->names[i] ? c->names[i] : "(null)";
        int k = 0;
        while (k < RULE_COUNT && strcmp(name, rule_names[k]) != 0) k++;
        if (k == RULE_COUNT)
            return rf_error(RF_ERR_ARG, "reward rule \"%s\" is unknown; valid rules: "
                            RULE_NAMES_TEXT, name);
        for (int j = 0; j < i; j++)
            if (r->kind[j] == (rule_kind)k)
                return rf_error(RF_ERR_ARG, "reward rule \"%s\" is listed twice", name);
        float w = n_w ? c->weights[i] : 1.0f;
        if (!isfinite(w))
            return rf_error(RF_ERR_ARG, "reward rule \"%s\": weight %g is not finite", name, w);
        r->kind[i] = (rule_kind)k;
        r->weight[i] = w;
        RF_TRY(validate_params(c, (rule_kind)k));
    }
    r->n = c->n_names;
    return RF_OK;
}

rf_status rf_reward_rules_init(rf_reward_rules **out, const rf_reward_rules_config *cfg) {
    *out = NULL;
    rf_reward_rules *r = calloc(1, sizeof *r);
    if (!r) return rf_error(RF_ERR_NOMEM, "out of memory for reward rules");
    rf_status s = parse_rules(r, cfg);
    for (int i = 0; s == RF_OK && i < r->n; i++)
        if (r->kind[i] == RULE_FORMAT) s = compile_regex(cfg->format_regex, &r->re);
    if (s == RF_OK && cfg->answer_regex && cfg->answer_regex[0]) {
        s = compile_regex_as("reward.answer_regex", cfg->answer_regex, &r->answer_re);
        uint32_t groups = 0;
        if (s == RF_OK) pcre2_pattern_info(r->answer_re, PCRE2_INFO_CAPTURECOUNT, &groups);
        r->answer_group = groups > 0;
    }
    if (s != RF_OK) {
        rf_reward_rules_free(r);
        return s;
    }
    r->length_target = cfg->length_target;
    r->length_penalty = cfg->length_penalty;
    r->overlong_buffer = cfg->overlong_buffer;
    r->overlong_penalty = cfg->overlong_penalty;
    r->max_new_tokens = cfg->max_new_tokens;
    *out = r;
    return RF_OK;
}

void rf_reward_rules_free(rf_reward_rules *r) {
    if (!r) return;
    pcre2_code_free(r->re);
    pcre2_code_free(r->answer_re);
    free(r);
}

/* Raw value of a correctness rule on the answer_regex capture. */
static float score_capture(rule_kind k, const answer_text *a, const char *truth, char *info,
                           size_t cap) {
    if (!a->found) {
        if (info && cap) snprintf(info, cap, "answer_regex: no match");
        return 0.0f;
    }
    size_t n = strlen(a->capture);
    const char *b = a->capture, *e = b + n;
    while (b < e && is_space(*b)) b++;
    while (e > b && is_space(e[-1])) e--;
    switch (k) {
    case RULE_NUMERIC: return rf_reward_numeric(a->capture, truth, info, cap);
    case RULE_MATH: return rf_reward_math(a->capture, truth, info, cap);
    case RULE_EXACT: return exact_on(b, (size_t)(e - b), truth, info, cap);
    default: return countdown_on(b, (size_t)(e - b), truth, info, cap);
    }
}

/* Raw value of rule i (before its weight), with its info. */
static rf_status score_one(const rf_reward_rules *r, int i, const char *response,
                           const answer_text *a, int tokens, const char *truth, float *v,
                           char *info, size_t cap) {
    int matched;
    if (r->answer_re && is_correctness(r->kind[i])) {
        *v = score_capture(r->kind[i], a, truth, info, cap);
        return RF_OK;
    }
    switch (r->kind[i]) {
    case RULE_NUMERIC:
        *v = rf_reward_numeric(response, truth, info, cap);
        return RF_OK;
    case RULE_MATH:
        *v = rf_reward_math(response, truth, info, cap);
        return RF_OK;
    case RULE_EXACT:
        *v = rf_reward_exact(response, truth, info, cap);
        return RF_OK;
    case RULE_COUNTDOWN:
        *v = rf_reward_countdown(response, truth, info, cap);
        return RF_OK;
    case RULE_FORMAT:
        RF_TRY(regex_search(r->re, response, &matched));
        *v = matched ? 1.0f : 0.0f;
        if (info) snprintf(info, cap, "%s", matched ? "match" : "no match");
        return RF_OK;
    case RULE_LENGTH:
        *v = rf_reward_length(tokens, r->length_target, r->length_penalty);
        if (info) snprintf(info, cap, "%d tokens, target %d", tokens, r->length_target);
        return RF_OK;
    case RULE_OVERLONG:
        *v = rf_reward_overlong(tokens, r->max_new_tokens, r->overlong_buffer, r->overlong_penalty);
        if (info)
            snprintf(info, cap, "%d tokens, max %d, buffer %d", tokens, r->max_new_tokens,
                     r->overlong_buffer);
        return RF_OK;
    default:
        RF_ASSERT(0);
    }
    return RF_OK;
}

rf_status rf_reward_rules_explain(const rf_reward_rules *r, const char *response,
                                  int response_tokens, const char *truth, float *reward,
                                  float *accuracy, char *info, size_t info_cap) {
    if (response_tokens < 0)
        return rf_error(RF_ERR_ARG, "reward: response_tokens = %d is negative", response_tokens);
    double sum = 0;
    float acc = NAN;
    size_t used = 0;
    if (info && info_cap) info[0] = 0;
    answer_text a = {0};
    if (r->answer_re) RF_TRY(extract_answer(r, response, &a));
    for (int i = 0; i < r->n; i++) {
        float v;
        char one[192];
        /* the info strings are built only when asked for (formatting costs more than scoring) */
        rf_status s = score_one(r, i, response, &a, response_tokens, truth, &v, info ? one : NULL,
                                info ? sizeof one : 0);
        if (s != RF_OK) {
            free(a.capture);
            return s;
        }
        sum += (double)r->weight[i] * v;
        if (isnan(acc) && is_correctness(r->kind[i])) acc = v;
        if (info && used < info_cap) {
            int w = snprintf(info + used, info_cap - used, "%s%s=%g [%s]", i ? "; " : "",
                             rule_names[r->kind[i]], v, one);
            used += w > 0 ? (size_t)w : 0;
        }
    }
    free(a.capture);
    *reward = (float)sum;
    if (accuracy) *accuracy = acc;
    return RF_OK;
}

rf_status rf_reward_rules_score(const rf_reward_rules *r, const char *response,
                                int response_tokens, const char *truth, float *reward,
                                float *accuracy) {
    return rf_reward_rules_explain(r, response, response_tokens, truth, reward, accuracy, NULL, 0);
}
