/* The built-in reward rules and the calculator tool on arbitrary model output: the text a
 * policy writes is not ours to trust. The input is "response\0truth" (no NUL: the whole input is
 * the response and the truth is fixed); every rule scores it, and the answer extractors, the
 * countdown checker and the calculator read it too. Scores must be finite and in [0, 1]. */
#include <math.h>

#include "env/calculator.h"
#include "reward/countdown.h"
#include "reward/reward.h"
#include "fuzz_util.h"

static void check_score(const char *rule, float r) {
    if (!(r >= 0.f && r <= 1.f)) {
        fprintf(stderr, "%s scored %g\n", rule, (double)r);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *resp = rf_fuzz_cstr(data, size);
    size_t rlen = strlen(resp);
    const char *truth = rlen < size ? resp + rlen + 1 : "42";
    char info[160];
    check_score("numeric", rf_reward_numeric(resp, truth, info, sizeof info));
    check_score("math", rf_reward_math(resp, truth, info, sizeof info));
    check_score("exact", rf_reward_exact(resp, truth, info, sizeof info));
    check_score("countdown", rf_reward_countdown(resp, truth, info, sizeof info));
    check_score("countdown", rf_reward_countdown(resp, "3 7 25 50 -> 100", info, sizeof info));
    free(rf_reward_math_extract(resp));
    free(rf_reward_math_normalize(resp));
    size_t len;
    const char *span = rf_reward_answer_span(resp, &len);
    if (len && (span < resp || span + len > resp + rlen)) abort();
    int64_t nums[16];
    int n, target;
    (void)rf_countdown_truth_parse(truth, nums, 16, &n, &target);
    (void)rf_task_countdown_check(resp, truth, 24);
    char out[64];
    int ok = rf_calculator_eval(resp, out, sizeof out);
    if (strnlen(out, sizeof out) == sizeof out || (!ok && strncmp(out, "error: ", 7))) abort();
    float r;
    rf_status st = rf_reward_format(resp, "^<think>.*</think>\\s*<answer>.*</answer>$", &r, info,
                                    sizeof info);
    rf_fuzz_check_error(st);
    free(resp);
    rf_error_clear();
    return 0;
}
