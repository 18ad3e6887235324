/* The `format`, `length` and `overlong` rules and the weighted combination of rules
 * (rf_reward_rules). The answer-matching rules live in reward/math_answer.c.
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

#include "reward/reward.h"

typedef enum rule_kind {
    RULE_NUMERIC,
    RULE_MATH,
    RULE_FORMAT,
    RULE_LENGTH,
    RULE_OVERLONG,
    RULE_COUNT
} rule_kind;

static const char *const rule_names[RULE_COUNT] = {"numeric", "math", "format", "length",
                                                   "overlong"};
#define RULE_NAMES_TEXT "numeric, math, format, length, overlong"

struct rf_reward_rules {
    int n;
    rule_kind kind[RF_REWARD_MAX_RULES];
    float weight[RF_REWARD_MAX_RULES];
    pcre2_code *re;          /* "format": compiled once, read-only */
    int length_target;
    float length_penalty;
    int overlong_buffer;
    float overlong_penalty;
    int max_new_tokens;
};

/* Compiles `pattern` with the options rf_reward_format documents. */
static rf_status compile_regex(const char *pattern, pcre2_code **out) {
    int err;
    PCRE2_SIZE off;
    *out = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                         PCRE2_DOTALL | PCRE2_UTF | PCRE2_MATCH_INVALID_UTF, &err, &off, NULL);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return rf_error(RF_ERR_ARG, "format regex \"%s\": PCRE2 error at offset %zu: %s", pattern,
                        (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE);  /* best effort: the interpreter is the fallback */
    return RF_OK;
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
    free(r);
}

/* Raw value of rule i (before its weight), with its info. */
static rf_status score_one(const rf_reward_rules *r, int i, const char *response, int tokens,
                           const char *truth, float *v, char *info, size_t cap) {
    int matched;
    switch (r->kind[i]) {
    case RULE_NUMERIC:
        *v = rf_reward_numeric(response, truth, info, cap);
        return RF_OK;
    case RULE_MATH:
        *v = rf_reward_math(response, truth, info, cap);
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
    for (int i = 0; i < r->n; i++) {
        float v;
        char one[192];
        /* the info strings are built only when asked for (formatting costs more than scoring) */
        RF_TRY(score_one(r, i, response, response_tokens, truth, &v, info ? one : NULL, info ? sizeof one : 0));
        sum += (double)r->weight[i] * v;
        if (isnan(acc) && (r->kind[i] == RULE_NUMERIC || r->kind[i] == RULE_MATH)) acc = v;
        if (info && used < info_cap) {
            int w = snprintf(info + used, info_cap - used, "%s%s=%g [%s]", i ? "; " : "",
                             rule_names[r->kind[i]], v, one);
            used += w > 0 ? (size_t)w : 0;
        }
    }
    *reward = (float)sum;
    if (accuracy) *accuracy = acc;
    return RF_OK;
}

rf_status rf_reward_rules_score(const rf_reward_rules *r, const char *response,
                                int response_tokens, const char *truth, float *reward,
                                float *accuracy) {
    return rf_reward_rules_explain(r, response, response_tokens, truth, reward, accuracy, NULL, 0);
}
