/* Rewards: every built-in rule on hand-written cases (GSM8K and MATH answer forms, signs,
 * thousands commas, decimals, fractions, percentages, nested boxes, no answer), the format
 * regex, the length and DAPO overlong shaping at their boundaries, the weighted combination
 * and its validation errors; and the reward model against transformers'
 * Qwen2ForSequenceClassification (tests/data/reward_model, made by
 * tests/tools/make_reward_model.py). */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <cjson/cJSON.h>
#include <pthread.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "reward/reward.h"
#include "test_util.h"

typedef struct rule_case {
    const char *response, *truth;
    float want;
} rule_case;

static const rule_case numeric_cases[] = {
    {"Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72", 1},
    {"#### 1,234", "1234", 1},
    {"The total is 1234.", "1,234", 1},
    {"#### 1,234,567", "1234567", 1},
    {"#### 1,23", "123", 0},                       /* "1,23" is not a thousands grouping */
    {"So we get 1, 2, 3", "3", 1},                 /* a list: the last number is 3 */
    {"The temperature drops to -5 degrees.", "-5", 1},
    {"The temperature drops to \xE2\x88\x92" "5 degrees.", "-5", 1},  /* U+2212 minus */
    {"#### -5", "5", 0},
    {"The range is 3-5", "5", 1},                  /* '-' after a digit is not a sign */
    {"#### +7", "7", 1},
    {"It costs $3.50", "3.5", 1},
    {"It costs 3.5", "3.50", 1},
    {"#### 3.0", "3", 1},                          /* trailing .0 is the integer */
    {"#### 3.01", "3", 0},
    {"#### 2.5", "3", 0},
    {"#### 0.5", "1/2", 1},
    {"#### 1/2", "0.5", 1},
    {"#### 6/3", "2", 1},                          /* an integer fraction is an integer */
    {"#### 1/3", "0.33333333", 0},                 /* 1e-8 relative apart: a different value */
    {"#### 1/3", "0.3333333333", 1},               /* 1e-10 relative apart: within 1e-9 */
    {"#### 0.333333333333", "1/3", 1},             /* 1e-12 relative apart: formatting */
    {"The answer is \\boxed{\\frac{1}{2}}", "0.5", 1},
    {"The answer is \\boxed{\\dfrac{3}{4}}.", "0.75", 1},
    {"\\boxed{-\\frac{1}{2}}", "-0.5", 1},
    {"\\boxed{12 \\text{ apples}}", "12", 1},
    {"\\boxed{x = 5}", "5", 1},
    {"\\boxed {7}", "7", 1},
    {"\\fbox{8} is the answer", "8", 1},
    {"\\boxed{\\boxed{9}}", "9", 1},
    {"\\boxed{1,000}", "1000", 1},
    {"I'd say \\boxed{4} but 5 is also there", "4", 1},   /* the box beats the last number */
    {"#### 10\nAfter more thought 11", "10", 1},          /* #### beats the last number */
    {"The answer is 12. Checking: 3 * 4 = 12, plus 1 is 13.", "12", 1},
    {"The answer is 12. Wait, the answer is 13.", "13", 1},  /* the last "answer is" */
    {"The answer is unknown. But it might be 21", "21", 1},  /* marker without a number */
    {"First 3, then 5, finally 8", "8", 1},               /* multiple numbers: last wins */
    {"No idea.", "5", 0},                                 /* no answer at all */
    {"", "5", 0},
    {"#### 50%", "50", 1},                                /* % ignored on the response */
    {"#### 50", "50%", 1},
    {"#### 0.5", "50%", 1},                               /* truth has %: 0.5 is 50% */
    {"#### 0.5", "50", 0},                                /* ...but not without it */
    {"It rose by 25\\%", "25%", 1},
    {"#### 123456789012345678901234567890", "123456789012345678901234567890", 1},
    {"#### 123456789012345678901234567891", "123456789012345678901234567890", 0},
    {"#### 007", "7", 1},
    {"#### .5", "0.5", 1},
    {"Janet pays 16 - 3 - 4 = 9 dollars. #### 9", "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18", 0},
    {"#### 18", "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18", 1},  /* raw GSM8K truth */
    {"#### 0", "-0", 1},
    {"#### 42", "no number here", 0},
};

static const rule_case math_cases[] = {
    {"So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", 1},
    {"\\boxed{\\frac{1}{2}}", "0.5", 1},
    {"\\boxed{0.5}", "\\frac12", 1},
    {"\\boxed{\\dfrac{1}{2}}", "\\tfrac{1}{2}", 1},
    {"\\boxed{1/2}", "\\frac{1}{2}", 1},
    {"\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1},          /* equal as numbers */
    {"\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0},
    {"\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1},  /* nested braces, \sqrt3 */
    {"\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1},
    {"\\boxed {(1,2)}", "(1, 2)", 1},
    {"\\boxed{(2,1)}", "(1,2)", 0},
    {"$\\boxed{10\\text{ cm}}$", "10", 1},
    {"\\boxed{\\text{Tuesday}}", "Tuesday", 1},
    {"\\boxed{90^\\circ}", "90", 1},
    {"\\boxed{90^{\\circ}}", "90", 1},
    {"\\fbox{x^2+1}", "x^2 + 1", 1},
    {"\\boxed{x = 3}", "3", 1},
    {"\\boxed{3.}", "3", 1},
    {"\\boxed{1,000}", "1000", 1},
    {"\\boxed{-\\frac{3}{4}}", "-0.75", 1},
    {"\\boxed{\\frac{3}{4}}", "-0.75", 0},
    {"\\boxed{\\pi}", "\\pi", 1},
    {"\\boxed{2\\pi}", "\\pi", 0},
    {"\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1},               /* escaped braces do not nest */
    {"\\boxed{50\\%}", "50", 1},
    {"#### 42", "42", 1},
    {"Work...\n#### 1,234", "1234", 1},
    {"The answer is $\\frac{3}{5}$.", "0.6", 1},
    {"The answer is 7.", "7", 1},
    {"I think the answer is 7. Maybe.", "7", 1},
    {"The final answer is 12", "\\boxed{12}", 1},          /* truth from its own box */
    {"\\boxed{72}", "48/2 = 24\n#### 72", 1},              /* truth from its #### line */
    {"The result is 5", "5", 0},                          /* no box, no marker: 0 */
    {"\\boxed{", "5", 0},                                 /* unterminated box */
    {"", "5", 0},
    {"\\boxed{5} and later \\boxed{6}", "6", 1},            /* the last box */
    {"\\boxed{\\sqrt{2}}", "\\sqrt2", 1},
    {"\\boxed{\\left[0, 1\\right)}", "[0,1)", 1},
    {"\\boxed{\\leftarrow}", "\\leftarrow", 1},            /* \left only as a command */
    {"\\boxed{\xE2\x88\x92" "2}", "-2", 1},
    {"\\boxed{\\$5}", "5", 1},
};

/* countdown: truth "3 7 25 50 -> 82" unless said; adversarial answers first */
static const rule_case countdown_cases[] = {
    {"(50-25)*3+7", "3 7 25 50 -> 82", 1},
    {" ( 50 - 25 ) * 3 + 7 ", "3 7 25 50 -> 82", 1},
    {"82", "3 7 25 50 -> 82", 0},                          /* bare target */
    {"The answer is 82", "3 7 25 50 -> 82", 0},
    {"50+25+7", "3 7 25 50 -> 82", 0},                     /* = 82, but 3 is missing */
    {"50+25+7+3-3", "3 7 25 50 -> 82", 0},                 /* 3 reused */
    {"(50-25)*3+7+0", "3 7 25 50 -> 82", 0},               /* a number not given */
    {"(50-25)*3+7*1", "3 7 25 50 -> 82", 0},
    {"(50-25)**3+7", "3 7 25 50 -> 82", 0},                /* other operators */
    {"(50-25)^3+7", "3 7 25 50 -> 82", 0},
    {"(50-25)x3+7", "3 7 25 50 -> 82", 0},
    {"(50-25)\xC3\x97" "3+7", "3 7 25 50 -> 82", 0},       /* U+00D7 multiplication sign */
    {"(50-25)%3+7", "3 7 25 50 -> 82", 0},
    {"(50-25)*3+7=82", "3 7 25 50 -> 82", 0},              /* the whole answer must be the expression */
    {"(50-25)*3+7.0", "3 7 25 50 -> 82", 0},
    {"-3+(50-25)+7+53", "3 7 25 50 -> 82", 0},             /* no unary minus */
    {"((50-25)*3+7", "3 7 25 50 -> 82", 0},                /* unbalanced */
    {"(50-25)*3+7)", "3 7 25 50 -> 82", 0},
    {"(50-25*3+7", "3 7 25 50 -> 82", 0},
    {"99999999999999999999999*3+7-25-50", "3 7 25 50 -> 82", 0}, /* huge numbers */
    {"9223372036854775807*2", "2 9223372036854775807 -> 1", 0},
    {"3000000000*3000000000*3000000000", "3000000000 3000000000 3000000000 -> 1", 0}, /* overflow */
    {"50/(25-25)*3+7", "3 7 25 25 50 -> 7", 0},            /* division by zero */
    {"", "3 7 25 50 -> 82", 0},
    {"(50-25)*3+7", "3 7 25 50 -> 81", 0},                 /* wrong value */
    {"8/(3/24)", "3 8 24 -> 64", 1},                       /* 3/24 = 1/8 on the way */
    {"5*(5-1/5)", "1 5 5 5 -> 24", 1},                     /* 24 through 24/5 */
    {"7/2", "2 7 -> 3", 0},                                /* 3.5: no truncating division */
    {"7/2*2", "2 2 7 -> 7", 1},
    {"50/3*3", "3 3 50 -> 50", 1},                         /* a number listed twice, used twice */
    {"(50-25)*3+7", "[3, 7, 25, 50] -> 82", 1},            /* truth forms */
    {"(50-25)*3+7", "3,7,25,50->82", 1},
    {"(50-25)*3+7", "82", 0},                              /* a truth without numbers */
    {"(50-25)*3+7", "3 7 25 50 -> ", 0},
    {"(50-25)*3+7", NULL, 0},
    {"Let me see.\n<answer>(50-25)*3+7</answer>", "3 7 25 50 -> 82", 1},   /* the answer tag */
    {"<answer>82</answer>", "3 7 25 50 -> 82", 0},
    {"<answer>(50-25)*3+7</answer> or 82", "3 7 25 50 -> 82", 1},
    {"<answer>1+2</answer><answer>(50-25)*3+7</answer>", "3 7 25 50 -> 82", 1}, /* the last tag */
    {"I try 50+25.\n(50-25)*3+7\n\n", "3 7 25 50 -> 82", 1},  /* the last line */
    {"(50-25)*3+7\nso 82", "3 7 25 50 -> 82", 0},
    /* docs/rewards.md: numbers match by value (leading zeros), the truth's limits */
    {"0007+75", "7 75 -> 82", 1},
    {"2147483646+1", "2147483646 1 -> 2147483647", 1},
    {"3+4", "3 4 -> 2147483648", 0},                      /* target above 2^31 - 1 */
    {"3+4-9007199254740993+9007199254740993", "3 4 9007199254740993 9007199254740993 -> 7", 0},
};

/* exact: trim, collapse whitespace, ASCII case folded */
static const rule_case exact_cases[] = {
    {"Paris", "Paris", 1},
    {"paris", "PARIS", 1},
    {"  New   York \t", "new york", 1},
    {"<answer> New\n York </answer>", "New York", 1},
    {" New\n  York ", "york", 1},                          /* docs/rewards.md: the last line */
    {" New\n  York ", "new york", 0},
    {"<answer>x</answer> <answer>y", "x", 0},              /* an unclosed last tag: the line */
    {"<answer>x</answer> <answer>y", "<answer>x</answer> <answer>y", 1},
    {"I think\nParis\n", "Paris", 1},                      /* the last line */
    {"Paris\nI think", "Paris", 0},
    {"Paris.", "Paris", 0},                                /* punctuation kept */
    {"3.0", "3", 0},                                       /* no number handling */
    {"NewYork", "New York", 0},
    {"\xC3\x89" "cole", "\xC3\xA9" "cole", 0},             /* no Unicode folding */
    {"\xC3\xA9" "cole", "\xC3\xA9" "cole", 1},
    {"", "", 0},                                           /* empty answers earn nothing */
    {"   \n ", "", 0},
    {"Paris", NULL, 0},
};

static void test_table(const char *rule, const rule_case *cases, int n,
                       float (*fn)(const char *, const char *, char *, size_t)) {
    for (int i = 0; i < n; i++) {
        char info[256];
        float got = fn(cases[i].response, cases[i].truth, info, sizeof info);
        CHECK(got == cases[i].want);
        if (got != cases[i].want)
            fprintf(stderr, "  %s case %d: response \"%s\" truth \"%s\": got %g want %g (%s)\n",
                    rule, i, cases[i].response, cases[i].truth, got, cases[i].want, info);
    }
    printf("%s: %d cases\n", rule, n);
}

static void test_info_strings(void) {
    char info[128];
    CHECK(rf_reward_numeric("#### 1,234", "1234", info, sizeof info) == 1.0f);
    CHECK(strstr(info, "1,234") && strstr(info, "####") && strstr(info, "=="));
    CHECK(rf_reward_numeric("no number", "7", info, sizeof info) == 0.0f);
    CHECK(strstr(info, "no number in response") != NULL);
    CHECK(rf_reward_numeric("3", NULL, info, sizeof info) == 0.0f);
    CHECK(strstr(info, "truth") != NULL);
    CHECK(rf_reward_math("nothing", "7", info, sizeof info) == 0.0f);
    CHECK(strstr(info, "no final answer") != NULL);
    char tiny[8];
    rf_reward_numeric("#### 1,234,567", "1234567", tiny, sizeof tiny);  /* truncates safely */
    CHECK(strlen(tiny) == 7);
    CHECK(rf_reward_numeric("#### 5", "5", NULL, 0) == 1.0f);
    CHECK(rf_reward_numeric(NULL, "5", NULL, 0) == 0.0f);
}

static void test_math_helpers(void) {
    char *e = rf_reward_math_extract("a \\boxed{\\frac{1}{\\sqrt{2}}} b");
    CHECK(e && strcmp(e, "\\frac{1}{\\sqrt{2}}") == 0);
    free(e);
    CHECK(rf_reward_math_extract("no answer here") == NULL);
    e = rf_reward_math_extract("x\n#### 17 \nmore");
    CHECK(e && strcmp(e, "17") == 0);
    free(e);
    char *n = rf_reward_math_normalize(" $\\left( \\dfrac12, 3 \\right)$. ");
    CHECK(n && strcmp(n, "(\\frac{1}{2},3)") == 0);
    free(n);
    n = rf_reward_math_normalize("5\\,\\text{m}^2");
    CHECK(n && strcmp(n, "5^2") == 0);  /* units go; documented limitation: the ^2 stays */
    free(n);
}

static void test_format(void) {
    const char *re = "^<think>.*</think>\\s*<answer>.*</answer>\\s*$";
    float r;
    char info[64];
    CHECK_OK(rf_reward_format("<think>a\nb</think>\n<answer>42</answer>", re, &r, info, sizeof info));
    CHECK(r == 1.0f && strcmp(info, "match") == 0);  /* DOTALL: '.' crosses the newline */
    CHECK_OK(rf_reward_format("<think>a</think> 42", re, &r, NULL, 0));
    CHECK(r == 0.0f);
    CHECK_OK(rf_reward_format("prefix <answer>1</answer>", "<answer>\\d+</answer>", &r, NULL, 0));
    CHECK(r == 1.0f);  /* unanchored: a search, not a full match */
    CHECK_OK(rf_reward_format("prefix <answer>1</answer>", "\\A<answer>", &r, NULL, 0));
    CHECK(r == 0.0f);
    CHECK_OK(rf_reward_format("caf\xC3\xA9 \xC3", "caf.", &r, NULL, 0));  /* cut-off UTF-8 */
    CHECK(r == 1.0f);
    CHECK_OK(rf_reward_format("", "^$", &r, NULL, 0));
    CHECK(r == 1.0f);
    CHECK_ERR(rf_reward_format("x", "<answer>(.*", &r, NULL, 0), RF_ERR_ARG, "<answer>(.*");
    CHECK_ERR(rf_reward_format("x", "<answer>(.*", &r, NULL, 0), RF_ERR_ARG, "offset 11");
    CHECK_ERR(rf_reward_format("x", "a[b", &r, NULL, 0), RF_ERR_ARG, "missing terminating ]");
    CHECK_ERR(rf_reward_format("x", NULL, &r, NULL, 0), RF_ERR_ARG, "no regex");
}

static void test_length_and_overlong(void) {
    CHECK_CLOSE(rf_reward_length(100, 100, 0.5f), 0.0, 0, 0);
    CHECK_CLOSE(rf_reward_length(150, 100, 0.5f), -0.25, 1e-7, 0);
    CHECK_CLOSE(rf_reward_length(50, 100, 0.5f), -0.25, 1e-7, 0);
    CHECK_CLOSE(rf_reward_length(0, 100, 1.0f), -1.0, 1e-7, 0);
    CHECK_CLOSE(rf_reward_length(400, 100, 1.0f), -3.0, 1e-7, 0);  /* unclipped */
    /* DAPO: Lmax 1000, Lc 200, factor 1: zero up to 800, linear to -1 at 1000, -1 beyond. */
    CHECK(rf_reward_overlong(0, 1000, 200, 1.0f) == 0.0f);
    CHECK(rf_reward_overlong(800, 1000, 200, 1.0f) == 0.0f);
    CHECK_CLOSE(rf_reward_overlong(801, 1000, 200, 1.0f), -0.005, 1e-7, 0);
    CHECK_CLOSE(rf_reward_overlong(900, 1000, 200, 1.0f), -0.5, 1e-7, 0);
    CHECK_CLOSE(rf_reward_overlong(999, 1000, 200, 1.0f), -0.995, 1e-7, 0);
    CHECK(rf_reward_overlong(1000, 1000, 200, 1.0f) == -1.0f);
    CHECK(rf_reward_overlong(5000, 1000, 200, 1.0f) == -1.0f);
    CHECK_CLOSE(rf_reward_overlong(900, 1000, 200, 0.5f), -0.25, 1e-7, 0);
    CHECK(rf_reward_overlong(1000, 1000, 1000, 2.0f) == -2.0f);  /* buffer = whole range */
    CHECK_CLOSE(rf_reward_overlong(1, 1000, 1000, 2.0f), -0.002, 1e-7, 0);
    CHECK(rf_reward_overlong(0, 1000, 1000, 2.0f) == 0.0f);
}

static rf_reward_rules_config base_config(const char *const *names, int n, const float *w, int nw) {
    rf_reward_rules_config c = {0};
    c.names = names;
    c.n_names = n;
    c.weights = w;
    c.n_weights = nw;
    c.format_regex = "<answer>.*</answer>";
    c.length_target = 100;
    c.length_penalty = 0.1f;
    c.overlong_buffer = 200;
    c.overlong_penalty = 1.0f;
    c.max_new_tokens = 1000;
    return c;
}

static void test_combination(void) {
    const char *names[] = {"math", "format", "overlong", "length"};
    const float w[] = {1.0f, 0.5f, 1.0f, 2.0f};
    rf_reward_rules_config c = base_config(names, 4, w, 4);
    rf_reward_rules *r = NULL;
    CHECK_OK(rf_reward_rules_init(&r, &c));
    float rew, acc;
    /* math 1, format 1, overlong at 900 of 1000 (buffer 200) -0.5, length |900-100|/100*0.1 = -0.8 */
    CHECK_OK(rf_reward_rules_score(r, "<answer>\\boxed{\\frac{1}{2}}</answer>", 900, "0.5", &rew, &acc));
    CHECK_CLOSE(rew, 1.0 + 0.5 - 0.5 - 2.0 * 0.8, 1e-6, 0);
    CHECK(acc == 1.0f);
    CHECK_OK(rf_reward_rules_score(r, "\\boxed{3}", 100, "0.5", &rew, &acc));
    CHECK_CLOSE(rew, 0.0, 1e-7, 0);
    CHECK(acc == 0.0f);
    char info[512];
    CHECK_OK(rf_reward_rules_explain(r, "<answer>\\boxed{2}</answer>", 100, "2", &rew, &acc, info, sizeof info));
    CHECK(strstr(info, "math=1 [") && strstr(info, "; format=1 [match]") && strstr(info, "overlong=0"));
    CHECK_CLOSE(rew, 1.5, 1e-7, 0);
    CHECK_ERR(rf_reward_rules_score(r, "x", -1, "2", &rew, &acc), RF_ERR_ARG, "negative");
    rf_reward_rules_free(r);

    /* No weights: all 1; no correctness rule: accuracy NAN; numeric accuracy. */
    const char *n2[] = {"format"};
    c = base_config(n2, 1, NULL, 0);
    CHECK_OK(rf_reward_rules_init(&r, &c));
    CHECK_OK(rf_reward_rules_score(r, "<answer>1</answer>", 10, NULL, &rew, &acc));
    CHECK(rew == 1.0f && isnan(acc));
    rf_reward_rules_free(r);
    const char *n3[] = {"numeric", "math"};
    const float w3[] = {1.0f, 0.0f};
    c = base_config(n3, 2, w3, 2);
    CHECK_OK(rf_reward_rules_init(&r, &c));
    CHECK_OK(rf_reward_rules_score(r, "#### 1,234", 10, "1234", &rew, &acc));
    CHECK(rew == 1.0f && acc == 1.0f);  /* accuracy from the first correctness rule */
    rf_reward_rules_free(r);
    rf_reward_rules_free(NULL);
}

static void test_validation(void) {
    rf_reward_rules *r = (rf_reward_rules *)1;
    const char *bad[] = {"math", "exact_match"};
    rf_reward_rules_config c = base_config(bad, 2, NULL, 0);
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "\"exact_match\" is unknown");
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "numeric, math, exact, countdown, format, length, overlong");
    CHECK(r == NULL);
    const char *two[] = {"math", "format"};
    const float w1[] = {1.0f};
    c = base_config(two, 2, w1, 1);
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "1 reward weights for 2 reward rules");
    const float wn[] = {1.0f, NAN};
    c = base_config(two, 2, wn, 2);
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "not finite");
    const char *dup[] = {"math", "math"};
    c = base_config(dup, 2, NULL, 0);
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "listed twice");
    c = base_config(two, 0, NULL, 0);
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "no reward rules");
    c = base_config(two, 2, NULL, 0);
    c.format_regex = "<answer>(";
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "format regex \"<answer>(\"");
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "offset 9");
    c.format_regex = NULL;
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "needs format_regex");
    const char *len[] = {"length"};
    c = base_config(len, 1, NULL, 0);
    c.length_target = 0;
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "length_target > 0");
    const char *ol[] = {"overlong"};
    c = base_config(ol, 1, NULL, 0);
    c.overlong_buffer = 2000;
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "0 < overlong_buffer <= max_new_tokens");
    c.overlong_buffer = 100;
    c.overlong_penalty = -1;
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG, "overlong_penalty must be >= 0");
    /* A parameter of a rule that is not listed is not checked. */
    const char *m[] = {"math"};
    c = base_config(m, 1, NULL, 0);
    c.format_regex = "(";
    c.length_target = -5;
    CHECK_OK(rf_reward_rules_init(&r, &c));
    rf_reward_rules_free(r);
}

/* Many threads share one rules object (the regex and its JIT code); each result must equal the
 * single-threaded one. Run under ASan/TSan this also proves the per-call match data. */
typedef struct thread_arg {
    const rf_reward_rules *r;
    int bad;
} thread_arg;

/* answer_regex: the last match's first group (or the whole match) is what the correctness rules
 * read; no match scores 0; the other rules see the whole response. */
static void test_answer_regex(void) {
    const char *names[] = {"numeric", "format"};
    rf_reward_rules_config c = base_config(names, 2, NULL, 0);
    c.answer_regex = "<answer>(.*?)</answer>";
    rf_reward_rules *r;
    float rew, acc;
    char info[512];
    CHECK_OK(rf_reward_rules_init(&r, &c));
    /* without the regex, numeric would read the last number, 9 */
    CHECK_OK(rf_reward_rules_explain(r, "I guess 5 <answer>7</answer> then 9", 10, "7", &rew, &acc, info, sizeof info));
    CHECK(rew == 2.0f && acc == 1.0f);
    CHECK_OK(rf_reward_rules_score(r, "<answer>1</answer> no, <answer>7</answer>", 10, "7", &rew, &acc));
    CHECK(rew == 2.0f && acc == 1.0f); /* the last match */
    CHECK_OK(rf_reward_rules_explain(r, "7 <answer>7", 10, "7", &rew, &acc, info, sizeof info));
    CHECK(rew == 0.0f && acc == 0.0f && strstr(info, "numeric=0 [answer_regex: no match]"));
    rf_reward_rules_free(r);

    const char *ex[] = {"exact", "countdown"};
    c = base_config(ex, 1, NULL, 0);
    c.answer_regex = "Final: ([^\n]*)";
    CHECK_OK(rf_reward_rules_init(&r, &c));
    CHECK_OK(rf_reward_rules_score(r, "Final: x\nFinal:   New  York  \nbye", 10, "new york", &rew, &acc));
    CHECK(rew == 1.0f && acc == 1.0f);
    CHECK_OK(rf_reward_rules_score(r, "New York", 10, "new york", &rew, &acc));
    CHECK(rew == 0.0f);
    rf_reward_rules_free(r);
    c = base_config(ex + 1, 1, NULL, 0);
    c.answer_regex = "=\\s*([-+*/() 0-9]+)$";
    CHECK_OK(rf_reward_rules_init(&r, &c));
    CHECK_OK(rf_reward_rules_score(r, "so it is = (50-25)*3+7", 10, "3 7 25 50 -> 82", &rew, &acc));
    CHECK(rew == 1.0f && acc == 1.0f);
    rf_reward_rules_free(r);

    /* no group: the whole match; empty matches step over UTF-8 characters and end */
    const char *num[] = {"numeric"};
    c = base_config(num, 1, NULL, 0);
    c.answer_regex = "\\d+(?=!)";
    CHECK_OK(rf_reward_rules_init(&r, &c));
    CHECK_OK(rf_reward_rules_score(r, "3 then 4! then 5", 10, "4", &rew, &acc));
    CHECK(rew == 1.0f);
    rf_reward_rules_free(r);
    c.answer_regex = "\\d*";
    CHECK_OK(rf_reward_rules_init(&r, &c));
    CHECK_OK(rf_reward_rules_explain(r, "\xC3\xA9" "12\xC3\xA9", 10, "12", &rew, &acc, info, sizeof info));
    CHECK(rew == 0.0f); /* the last match is the empty one at the end */
    c.answer_regex = "(x)?(\\d+)";
    rf_reward_rules_free(r);
    CHECK_OK(rf_reward_rules_init(&r, &c));
    CHECK_OK(rf_reward_rules_explain(r, "12", 10, "12", &rew, &acc, info, sizeof info));
    CHECK(rew == 0.0f && strstr(info, "numeric=0")); /* group 1 took no part: empty answer */
    rf_reward_rules_free(r);
    c.answer_regex = "<answer>(.*";
    r = (rf_reward_rules *)1;
    CHECK_ERR(rf_reward_rules_init(&r, &c), RF_ERR_ARG,
              "reward.answer_regex \"<answer>(.*\": PCRE2 error at offset 11: missing closing parenthesis");
    CHECK(r == NULL);
    CHECK_ERR(rf_reward_regex_check("reward.answer_regex", "a{2,1}"), RF_ERR_ARG,
              "reward.answer_regex \"a{2,1}\": PCRE2 error at offset 5: numbers out of order in {} quantifier");
    CHECK_OK(rf_reward_regex_check("reward.answer_regex", "(a)"));

    /* the countdown rule through the rules object: accuracy, and the explanation */
    const char *cd[] = {"countdown", "format"};
    c = base_config(cd, 2, NULL, 0);
    CHECK_OK(rf_reward_rules_init(&r, &c));
    CHECK_OK(rf_reward_rules_explain(r, "<answer>50+25+7</answer>", 10, "3 7 25 50 -> 82", &rew, &acc, info, sizeof info));
    CHECK(rew == 1.0f && acc == 0.0f);
    CHECK(strstr(info, "countdown=0 [\"50+25+7\": a given number is not used (target 82)]"));
    rf_reward_rules_free(r);
}

static void *score_thread(void *p) {
    thread_arg *a = p;
    for (int i = 0; i < 2000; i++) {
        float rew, acc;
        const char *resp = i % 2 ? "<answer>\\boxed{12}</answer>" : "\\boxed{13}";
        if (rf_reward_rules_score(a->r, resp, 900, "12", &rew, &acc) != RF_OK ||
            rew != (i % 2 ? 1.0f : -0.5f))
            a->bad++;
    }
    return NULL;
}

static void test_threads(void) {
    const char *names[] = {"math", "format", "overlong"};
    const float w[] = {1.0f, 0.5f, 1.0f};
    rf_reward_rules_config c = base_config(names, 3, w, 3);
    rf_reward_rules *r;
    CHECK_OK(rf_reward_rules_init(&r, &c));
    pthread_t th[4];
    thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thread_arg){r, 0};
        pthread_create(&th[i], NULL, score_thread, &args[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(args[i].bad == 0);
    }
    rf_reward_rules_free(r);
}

/* Scores within 2e-5 of transformers: fp32 on both sides, differing only in summation order
 * (the same tolerance as tests/test_hf_golden.c, ~10x the differences observed there). */
#define RM_TOL 2e-5

static void test_reward_model(const char *src) {
    char dir[4096], path[4096], *text = NULL;
    size_t len;
    snprintf(dir, sizeof dir, "%s/tests/data/reward_model", src);
    rf_path_join(path, sizeof path, dir, "expected.json");
    CHECK_OK(rf_read_file(path, &text, &len));
    cJSON *exp = text ? cJSON_Parse(text) : NULL;
    free(text);
    rf_reward_model *rm = NULL;
    CHECK_OK(rf_reward_model_open(&rm, dir, rf_cpu_kernels()));
    if (!exp || !rm) {
        cJSON_Delete(exp);
        rf_reward_model_close(rm);
        return;
    }
    const cJSON *texts = cJSON_GetObjectItem(exp, "texts"), *ids = cJSON_GetObjectItem(exp, "ids"),
                *want = cJSON_GetObjectItem(exp, "scores");
    int n = cJSON_GetArraySize(texts);
    int32_t *seqs[8];
    int lens[8];
    float scores[8], one;
    /* rlflow's tokenizer must give HF's ids for the transcripts. */
    for (int i = 0; i < n; i++) {
        const char *t = cJSON_GetArrayItem(texts, i)->valuestring;
        CHECK_OK(rf_tokenizer_encode(rf_reward_model_tokenizer(rm), t, strlen(t), 0, &seqs[i], &lens[i]));
        const cJSON *w = cJSON_GetArrayItem(ids, i);
        CHECK(lens[i] == cJSON_GetArraySize(w));
        for (int j = 0; j < lens[i] && j < cJSON_GetArraySize(w); j++)
            CHECK(seqs[i][j] == cJSON_GetArrayItem(w, j)->valueint);
    }
    CHECK(seqs[2][lens[2] - 1] == 0);  /* the third ends in the pad token: pooling skips it */
    CHECK_OK(rf_reward_model_score(rm, (const int32_t *const *)seqs, lens, n, scores));
    for (int i = 0; i < n; i++) {
        CHECK_CLOSE(scores[i], cJSON_GetArrayItem(want, i)->valuedouble, RM_TOL, RM_TOL);
        printf("reward model: sequence %d (%d tokens): %.7f, transformers %.7f\n", i, lens[i],
               scores[i], cJSON_GetArrayItem(want, i)->valuedouble);
    }
    /* One at a time gives the same (packing does not leak across sequences). */
    for (int i = 0; i < n; i++) {
        CHECK_OK(rf_reward_model_score(rm, (const int32_t *const *)&seqs[i], &lens[i], 1, &one));
        CHECK_CLOSE(one, scores[i], 1e-6, 1e-6);
    }
    /* Dropping the third sequence's trailing pad token changes nothing: it was never pooled. */
    int l2 = lens[2] - 1;
    CHECK_OK(rf_reward_model_score(rm, (const int32_t *const *)&seqs[2], &l2, 1, &one));
    CHECK_CLOSE(one, scores[2], 1e-6, 1e-6);
    int32_t pads[3] = {0, 0, 0}, *pp = pads, first = 0;
    int three = 3, onel = 1;
    float all_pad, just_first;
    int32_t *fp = &first;
    CHECK_OK(rf_reward_model_score(rm, (const int32_t *const *)&pp, &three, 1, &all_pad));
    CHECK_OK(rf_reward_model_score(rm, (const int32_t *const *)&fp, &onel, 1, &just_first));
    CHECK_CLOSE(all_pad, just_first, 1e-6, 1e-6);  /* all pad: transformers pools token 0 */
    int zero = 0;
    CHECK_ERR(rf_reward_model_score(rm, (const int32_t *const *)seqs, &zero, 1, scores), RF_ERR_ARG,
              "sequence 0 is empty");
    int32_t badtok = 999999, *bp = &badtok;
    CHECK(rf_reward_model_score(rm, (const int32_t *const *)&bp, &onel, 1, scores) != RF_OK);
    CHECK_OK(rf_reward_model_score(rm, NULL, NULL, 0, scores));
    for (int i = 0; i < n; i++) free(seqs[i]);
    rf_reward_model_close(rm);
    cJSON_Delete(exp);
}

static void test_reward_model_refusals(const char *src) {
    char dir[4096];
    rf_reward_model *rm = (rf_reward_model *)1;
    /* A causal LM config is not a reward model. */
    snprintf(dir, sizeof dir, "%s/tests/data/hf/qwen2_tied", src);
    CHECK_ERR(rf_reward_model_open(&rm, dir, rf_cpu_kernels()), RF_ERR_FORMAT,
              "ForSequenceClassification");
    CHECK(rm == NULL);
    /* A classifier config over a checkpoint without score.weight (a policy) is refused, naming
     * the directory, instead of starting a zero head as a critic would. */
    char tmp[] = "/tmp/rf_test_reward_XXXXXX";
    CHECK(mkdtemp(tmp) != NULL);
    char from[4096], to[4096], *data = NULL;
    size_t len;
    snprintf(from, sizeof from, "%s/tests/data/hf/qwen2_tied/model.safetensors", src);
    snprintf(to, sizeof to, "%s/model.safetensors", tmp);
    CHECK_OK(rf_read_file(from, &data, &len));
    CHECK_OK(rf_write_file_atomic(to, data, len));
    free(data);
    snprintf(from, sizeof from, "%s/tests/data/reward_model/config.json", src);
    snprintf(to, sizeof to, "%s/config.json", tmp);
    CHECK_OK(rf_read_file(from, &data, &len));
    CHECK_OK(rf_write_file_atomic(to, data, len));
    free(data);
    CHECK_ERR(rf_reward_model_open(&rm, tmp, rf_cpu_kernels()), RF_ERR_FORMAT, "score.weight");
    CHECK_ERR(rf_reward_model_open(&rm, tmp, rf_cpu_kernels()), RF_ERR_FORMAT, tmp);
    remove(to);
    snprintf(to, sizeof to, "%s/model.safetensors", tmp);
    remove(to);
    rmdir(tmp);
    /* No tokenizer: the error names the directory. */
    snprintf(dir, sizeof dir, "%s/tests/data/hf/qwen2_value_head", src);
    CHECK_ERR(rf_reward_model_open(&rm, dir, rf_cpu_kernels()), RF_ERR_IO, "qwen2_value_head");
    rf_reward_model_close(NULL);
}

int main(void) {
    test_table("numeric", numeric_cases, (int)(sizeof numeric_cases / sizeof *numeric_cases),
               rf_reward_numeric);
    test_table("math", math_cases, (int)(sizeof math_cases / sizeof *math_cases), rf_reward_math);
    test_table("countdown", countdown_cases, (int)(sizeof countdown_cases / sizeof *countdown_cases),
               rf_reward_countdown);
    test_table("exact", exact_cases, (int)(sizeof exact_cases / sizeof *exact_cases), rf_reward_exact);
    test_answer_regex();
    test_info_strings();
    test_math_helpers();
    test_format();
    test_length_and_overlong();
    test_combination();
    test_validation();
    test_threads();
    const char *src = getenv("RF_SOURCE_DIR");
    if (src) {
        test_reward_model(src);
        test_reward_model_refusals(src);
    } else {
        printf("RF_SOURCE_DIR unset: reward model tests skipped\n");
    }
    return rf_test_finish("test_reward");
}
