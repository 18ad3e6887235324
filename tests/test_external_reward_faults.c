/* Rejected replies and per-token rewards in the reward bridge (reward/external.c), against
 * tests/reward_program_echo.c spawned as real processes on loopback TCP:
 *   - per-token rewards round trip bit for bit (one per response token, the echo formula), and
 *     the batch stats count them;
 *   - two programs, 'bad' and 'good', both connected before the batch; 'bad' spoils its 3rd
 *     request (item 4: request 5, sample 4 of group 0, 5 tokens) with one fault: garbage bytes,
 *     a NaN reward, an error reply, 6 per-token rewards for 5 tokens, an infinite per-token
 *     reward, an unknown request id, a second answer, a message a program may not send, a
 *     reward or a per-token reward of 3e38 (finite, but infinite once weighted by the bridge's
 *     weight 2), a NaN component, a component name of 64 bytes. Each
 *     time the score call SUCCEEDS; the exact reason is logged ("warning: reward: rejected a
 *     reply: ..."), returned by rf_external_reward_last_rejection and sent to 'bad' (its log
 *     shows "rlflow says: <reason>"); 'bad' is dropped; item 4 is scored by 'good' (its info
 *     names it) unless 'bad' had already answered it; every item is scored exactly once
 *     (accepted == 50) with the right reward and per-token rewards;
 *   - one program that reconnects after being dropped and answers one NaN: the sample waits
 *     for it to come back and the batch succeeds;
 *   - one reconnecting program that spoils every answer: the batch fails after the attempt
 *     limit (3 by default, 4 through the config) with the exact message, which names the
 *     request, the sample and each rejection's program and reason;
 *   - an info that is not UTF-8 is rejected naming the request and the byte; a program that
 *     keeps a request and never answers it (pings answered) is dropped at each deadline, which
 *     counts against the sample: the batch fails after max_attempts instead of re-sending it
 *     forever; once a stop is asked for (cfg.stop) the sample is not sent again after the first
 *     deadline.
 * Why the faulty request is item 4: programs with equal load get work in the order they
 * connected, so 'bad' (first, capacity 4) gets items 0, 2, 4, 6 of the first 8 and answers in
 * order; request ids start at 1 for a fresh bridge (item i's first request is i + 1, its k-th
 * is 50 (k - 1) + i + 1). Every wait is bounded (alarm(120)). */
#define _POSIX_C_SOURCE 200809L
#include <unistd.h>

#include "common/util.h"
#include "reward/external.h"
#include "reward_test_util.h"
#include "spawn_util.h"
#include "test_util.h"

#define N ECHO_ITEMS

static const char *echo_bin;
static char prog_log[256], our_log[256];
static echo_items items;

/* Starts the echo program as `name` with per-token rewards on and the given extra options
 * (NULL-terminated); its output goes to prog_log. */
static pid_t spawn_echo(const char *ep, const char *name, const char *const *extra) {
    char *argv[32] = {(char *)echo_bin, "--connect", (char *)ep, "--name", (char *)name,
                      "--tokens", "1"};
    int n = 7;
    for (int k = 0; extra && extra[k] && n < 31; k++) argv[n++] = (char *)extra[k];
    argv[n] = NULL;
    pid_t pid = rf_test_spawn(argv, prog_log);
    CHECK(pid > 0);
    return pid;
}

/* 1 when every item got the echo reward and the echo per-token rewards, exactly. */
static int all_exact(const rf_external_reward *x, const float *r) {
    int bad = 0;
    for (int i = 0; i < N; i++) {
        const float *v;
        int n = rf_external_reward_token_rewards(x, i, &v);
        int ok = r[i] == echo_reward(&items.it[i]) &&
                 token_rewards_exact(v, (size_t)n, items.ids[i], (size_t)items.it[i].n_response_ids);
        if (!ok) fprintf(stderr, "  item %d: reward %.9g (want %.9g), %d token rewards\n", i, r[i],
                         echo_reward(&items.it[i]), n);
        bad += !ok;
    }
    return bad == 0;
}

/* Waits up to limit_s for `needle` to appear in the file at path. */
static int file_has(const char *path, const char *needle, double limit_s) {
    for (double t0 = rf_time_now();;) {
        char *text = rf_test_slurp(path);
        int found = strstr(text, needle) != NULL;
        free(text);
        if (found || rf_time_now() - t0 > limit_s) return found;
        rf_sleep(0.02);
    }
}

/* Scores the batch with stderr captured in our_log. */
static rf_status score_captured(rf_external_reward *x, float *r) {
    int saved = stderr_to(our_log);
    rf_error_clear();
    rf_status st = rf_external_reward_score(x, items.it, N, r);
    stderr_back(saved);
    return st;
}

/* ---- per-token rewards ------------------------------------------------------------------------ */

static void test_token_rewards(void) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 3));
    if (!x) return;
    pid_t p = spawn_echo(rf_external_reward_endpoint(x), "tokens", NULL);
    CHECK_OK(rf_external_reward_wait(x, 1, 5));
    float r[N];
    CHECK_OK(rf_external_reward_score(x, items.it, N, r));
    CHECK(all_exact(x, r));
    rf_external_reward_stats st = rf_external_reward_last_stats(x);
    CHECK(st.accepted == N && st.token_rewards == N && st.rejected == 0 && st.resent == 0);
    const float *v = r;
    CHECK(rf_external_reward_token_rewards(x, -1, &v) == 0 && v == NULL);
    v = r;
    CHECK(rf_external_reward_token_rewards(x, N, &v) == 0 && v == NULL);
    /* item 12: 13 tokens 12000 .. 12012 -> 6000 + 0.25 j + 0.5 j */
    int n12 = rf_external_reward_token_rewards(x, 12, &v);
    CHECK(n12 == 13 && v[0] == 6000.0f && v[12] == 6009.0f);
    printf("per-token rewards: %d items, exact\n", N);
    rf_external_reward_close(x);
    CHECK(rf_test_wait(p, 3) == 0);
}

/* ---- one bad reply, another program takes over --------------------------------------------- */

/* 'bad' spoils its 3rd request (item 4) with `mode`; want = the reason after the program's
 * description; by_good: item 4 ends up scored by 'good' (not when 'bad' answered it first). */
static void check_rejected(const char *mode, const char *want_tail, int by_good) {
    rf_external_reward *x = NULL;
    /* reward.external_weight 2: a finite 3e38 overflows once weighted */
    rf_external_reward_config cfg = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 3, .weight = 2};
    CHECK_OK(rf_external_reward_listen_with(&x, &cfg));
    if (!x) return;
    const char *ep = rf_external_reward_endpoint(x);
    if (truncate(prog_log, 0) != 0) { /* no log yet */ }
    const char *bad_opts[] = {"--mode", mode, "--after", "3", NULL};
    pid_t bad = spawn_echo(ep, "bad", bad_opts);
    CHECK_OK(rf_external_reward_wait(x, 1, 5));  /* 'bad' first: it gets items 0, 2, 4, 6 */
    pid_t good = spawn_echo(ep, "good", NULL);
    CHECK_OK(rf_external_reward_wait(x, 2, 5));
    float r[N];
    double t0 = rf_time_now();
    rf_status st = score_captured(x, r);
    double dt = rf_time_now() - t0;
    CHECK_OK(st);
    char want[1024], line[1200], told[1200];
    snprintf(want, sizeof want, "reward program 'bad' (rank 0, pid %d) on %.200s %.600s", (int)bad, ep,
             want_tail);
    const char *got = rf_external_reward_last_rejection(x);
    CHECK(!strcmp(got, want));
    if (strcmp(got, want)) fprintf(stderr, "  rejection \"%s\"\n  want      \"%s\"\n", got, want);
    snprintf(line, sizeof line, "warning: reward: rejected a reply: %s\n", want);
    CHECK(file_has(our_log, line, 0));
    if (!file_has(our_log, line, 0)) fprintf(stderr, "  rlflow logged:\n%s", rf_test_slurp(our_log));
    snprintf(told, sizeof told, "bad: rlflow says: %s\n", want);
    CHECK(file_has(prog_log, told, 2));
    if (st == RF_OK) CHECK(all_exact(x, r));
    rf_external_reward_stats s = rf_external_reward_last_stats(x);
    CHECK(s.accepted == N && s.rejected == 1 && s.lost == 0 && s.resent >= 1 && s.token_rewards == N);
    char info[64];
    snprintf(info, sizeof info, "echo %s n=5", by_good ? "good" : "bad");
    CHECK(!strcmp(rf_external_reward_info(x, 4), info));
    CHECK(rf_external_reward_programs(x) == 1);
    printf("%-9s rejected, batch scored in %.2f s (%d re-sent): %s\n", mode, dt, s.resent, want);
    rf_external_reward_close(x);
    CHECK(rf_test_wait(good, 3) == 0);
    rf_test_kill(bad);
}

static void test_rejected(void) {
    const char *req = "request 5 (sample 4 of group 0)";
    char t[12][320];
    snprintf(t[0], sizeof t[0], "answered reward nan for %s; rewards must be finite", req);
    snprintf(t[1], sizeof t[1], "could not score %s: cannot judge this one", req);
    snprintf(t[2], sizeof t[2], "answered 6 per-token rewards for %s, whose response has 5 tokens", req);
    snprintf(t[3], sizeof t[3], "answered a non-finite per-token reward (inf at token 4) for %s", req);
    snprintf(t[4], sizeof t[4], "sent a malformed message: 5 bytes after tag 17 do not decode as "
             "rlflow.RewardResponse");
    snprintf(t[5], sizeof t[5], "answered request 1000005, which is not one it holds");
    snprintf(t[6], sizeof t[6], "answered %s a second time", req);
    snprintf(t[7], sizeof t[7], "sent a Shutdown, which a reward program may not send");
    snprintf(t[8], sizeof t[8], "answered reward 3e+38 for %s, which overflows to inf once weighted "
             "by reward.external_weight = 2; weighted rewards must be finite", req);
    snprintf(t[9], sizeof t[9], "answered per-token rewards for %s whose weighted value overflows to "
             "inf at token 4 (reward.external_weight = 2); weighted rewards must be finite", req);
    snprintf(t[10], sizeof t[10], "answered a non-finite component (len = nan) for %s", req);
    snprintf(t[11], sizeof t[11], "answered a component named \"nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn"
             "...\" (64 bytes) for %s; component names must be 1 to 63 bytes", req);
    const char *modes[12] = {"nan", "error", "badtokens", "inftoken", "garbage", "badid",
                             "duplicate", "badtype", "big", "bigtoken", "compnan", "longname"};
    for (int k = 0; k < 12; k++) check_rejected(modes[k], t[k], k != 6);
}

/* ---- the only program comes back ------------------------------------------------------------ */

/* One program, which reconnects after being dropped: the rejected sample waits for it. */
static void test_comes_back(void) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 3));
    if (!x) return;
    const char *ep = rf_external_reward_endpoint(x);
    const char *opts[] = {"--mode", "nan", "--after", "1", "--capacity", "1", "--reconnect", "1",
                          NULL};
    pid_t p = spawn_echo(ep, "phoenix", opts);
    CHECK_OK(rf_external_reward_wait(x, 1, 5));
    float r[N];
    CHECK_OK(score_captured(x, r));
    CHECK(all_exact(x, r));
    char want[512];
    snprintf(want, sizeof want, "reward program 'phoenix' (rank 0, pid %d) on %s answered reward "
             "nan for request 1 (sample 0 of group 0); rewards must be finite", (int)p, ep);
    CHECK(!strcmp(rf_external_reward_last_rejection(x), want));
    rf_external_reward_stats s = rf_external_reward_last_stats(x);
    CHECK(s.accepted == N && s.rejected == 1 && s.resent == 1 && s.lost == 0);
    CHECK(!strcmp(rf_external_reward_info(x, 0), "echo phoenix n=1"));
    CHECK(rf_external_reward_programs(x) == 1);
    printf("the only program was dropped, came back and scored the rest\n");
    rf_external_reward_close(x);
    CHECK(rf_test_wait(p, 3) == 0);
}

/* ---- the attempt limit ------------------------------------------------------------------------ */

/* One reconnecting program that spoils every answer with `modes` in turn: the batch fails
 * once sample 0 of group 0 has been rejected max_attempts times (0: the default). reasons: what
 * each rejection says after the program's description. */
static void check_limit(int max_attempts, const char *modes, rf_status want_st,
                        const char *const *reasons) {
    rf_external_reward_config cfg = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 3,
                                     .max_attempts = max_attempts};
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen_with(&x, &cfg));
    if (!x) return;
    const char *ep = rf_external_reward_endpoint(x);
    const char *opts[] = {"--mode", modes, "--after", "1", "--every", "1", "--capacity", "1",
                          "--reconnect", "1", NULL};
    pid_t p = spawn_echo(ep, "hopeless", opts);
    CHECK_OK(rf_external_reward_wait(x, 1, 5));
    float r[N];
    double t0 = rf_time_now();
    rf_status st = score_captured(x, r);
    double dt = rf_time_now() - t0;
    int limit = max_attempts ? max_attempts : RF_EXTERNAL_MAX_ATTEMPTS;
    char want[2048], who[256];
    snprintf(who, sizeof who, "reward program 'hopeless' (rank 0, pid %d) on %s", (int)p, ep);
    int len = snprintf(want, sizeof want, "request %d (sample 0 of group 0) was rejected %d "
                       "times, the limit (max_attempts): ", 1 + N * (limit - 1), limit);
    for (int k = 0; k < limit; k++)
        len += snprintf(want + len, sizeof want - (size_t)len, "%s%d) %s %s", k ? "; " : "", k + 1,
                        who, reasons[k]);
    const char *msg = rf_error_message();
    CHECK(st == want_st && !strcmp(msg, want));
    if (st != want_st || strcmp(msg, want))
        fprintf(stderr, "  got  %s \"%s\"\n  want %s \"%s\"\n", rf_strerror(st), msg,
                rf_strerror(want_st), want);
    rf_external_reward_stats s = rf_external_reward_last_stats(x);
    CHECK(s.accepted == 0 && s.rejected == limit && s.resent == limit - 1);
    const float *v = r;
    CHECK(rf_external_reward_token_rewards(x, 0, &v) == 0 && v == NULL);
    printf("attempt limit %d reached after %.2f s: %s\n", limit, dt, msg);
    CHECK_OK(rf_external_reward_wait(x, 1, 3));  /* it reconnects after its last drop */
    rf_external_reward_close(x);
    CHECK(rf_test_wait(p, 3) == 0);
}

static void test_limit(void) {
    const char *three[] = {
        "answered reward nan for request 1 (sample 0 of group 0); rewards must be finite",
        "could not score request 51 (sample 0 of group 0): cannot judge this one",
        "answered a non-finite per-token reward (inf at token 0) for request 101 (sample 0 of "
        "group 0)"};
    check_limit(0, "nan,error,inftoken", RF_ERR_RANGE, three);
    const char *four[] = {
        "answered 2 per-token rewards for request 1 (sample 0 of group 0), whose response has 1 "
        "token",
        "answered request 1000051, which is not one it holds (it held request 51)",
        "could not score request 101 (sample 0 of group 0): cannot judge this one",
        "sent a malformed message: 5 bytes after tag 17 do not decode as rlflow.RewardResponse "
        "(it held request 151)"};
    check_limit(4, "badtokens,badid,error,garbage", RF_ERR_FORMAT, four);
    rf_external_reward_config bad = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 1,
                                     .max_attempts = -1};
    rf_external_reward *x = NULL;
    CHECK_ERR(rf_external_reward_listen_with(&x, &bad), RF_ERR_ARG, "max_attempts must be >= 0 (got -1)");
    CHECK(x == NULL);
}

static int g_signal;
static int stop_hook(void) { return g_signal; }

static void test_hang_bounded(void) {
    for (int stop = 0; stop < 2; stop++) {
        rf_external_reward_config cfg = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 1,
                                         .max_attempts = stop ? 10 : 2, .stop = stop_hook};
        rf_external_reward *x = NULL;
        CHECK_OK(rf_external_reward_listen_with(&x, &cfg));
        if (!x) return;
        const char *opts[] = {"--mode", stop ? "mute" : "badutf8,mute", "--after", "1", "--every", "1",
                              "--capacity", "1", "--reconnect", "1", NULL};
        pid_t p = spawn_echo(rf_external_reward_endpoint(x), "hangs", opts);
        CHECK_OK(rf_external_reward_wait(x, 1, 5));
        float r[N];
        g_signal = stop ? 15 : 0;
        double t0 = rf_time_now();
        rf_status st = score_captured(x, r);
        double dt = rf_time_now() - t0;
        const char *msg = rf_error_message();
        CHECK(st == RF_ERR_IO && dt < 4);
        if (!stop) {
            CHECK(strstr(msg, "request 51 (sample 0 of group 0) was rejected 2 times, the limit (max_attempts): "
                         "1) reward program 'hangs' (rank 0, pid ") == msg);
            CHECK(strstr(msg, "do not decode as rlflow.RewardResponse: field 4 (info) of rlflow.RewardResponse "
                         "is not valid UTF-8 at byte 0 of its 1 (its reply to request 1 (sample 0 of group 0)); 2) ")
                  != NULL);
            CHECK(strstr(msg, " answered no request for 1.") && strstr(msg, " s (it held request 51)"));
        } else {
            CHECK(strstr(msg, "interrupted (signal 15): the request for sample 0 of group 0 is not sent again; "
                         "reward program 'hangs'") == msg);
        }
        printf("%s: the batch fails after %.2f s: %s\n", stop ? "stop asked for" : "hangs", dt, msg);
        g_signal = 0;
        rf_external_reward_close(x);
        rf_test_kill(p);
    }
}

int main(void) {
    alarm(120);
    echo_bin = getenv("RF_REWARD_ECHO");
    if (!echo_bin || access(echo_bin, X_OK) != 0) {
        printf("test_external_reward_faults: RF_REWARD_ECHO not set (run through ctest); skipped\n");
        return 77;
    }
    snprintf(prog_log, sizeof prog_log, "/tmp/rf_test_extf_%d.log", (int)getpid());
    snprintf(our_log, sizeof our_log, "/tmp/rf_test_extf_%d.err", (int)getpid());
    make_echo_items(&items);
    double t0 = rf_time_now();
    test_token_rewards();
    test_rejected();
    test_comes_back();
    test_limit();
    test_hang_bounded();
    printf("total %.2f s\n", rf_time_now() - t0);
    unlink(prog_log), unlink(our_log);
    return rf_test_finish("test_external_reward_faults");
}
