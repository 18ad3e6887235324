/* External reward programs (reward/external.c) against the C program
 * tests/reward_program_echo.c, spawned as real processes on loopback TCP and ipc:// in /tmp:
 * a batch of 50 comes back with the values the program's formula gives (exact: the same float
 * expression on both sides), with no per-token rewards when the program sends none; two
 * programs share the work; a program killed mid-batch has its requests re-sent to the other
 * one, and alone it makes the batch fail naming it and the request once nobody comes back; a
 * silent program is reported after the 1 s timeout; a lone program whose NaN reply is rejected
 * (and which does not reconnect) leaves the batch waiting for another program, which then
 * fails naming the rejection; a protocol mismatch is refused with the same sentence in rlflow
 * and in the program; close sends Shutdown and the programs exit 0. Rejected replies with
 * other programs to take over are test_external_reward_faults.c. Every wait is bounded
 * (timeouts of 1-3 s, alarm(60) as a safety net). */
#define _POSIX_C_SOURCE 200809L
#include <unistd.h>

#include "common/util.h"
#include "reward/external.h"
#include "reward_test_util.h"
#include "spawn_util.h"
#include "test_util.h"

#define N_ITEMS ECHO_ITEMS

static const char *echo_bin;
static char log_path[256];

typedef echo_items items;

static pid_t spawn_echo(const char *ep, const char *name, const char *mode, int after,
                        const char *protocol) {
    char after_s[16];
    snprintf(after_s, sizeof after_s, "%d", after);
    char *argv[] = {(char *)echo_bin, "--connect", (char *)ep, "--name", (char *)name, "--mode",
                    (char *)mode, "--after", after_s, "--protocol", (char *)protocol, NULL};
    pid_t pid = rf_test_spawn(argv, log_path);
    CHECK(pid > 0);
    return pid;
}

static int check_batch(rf_external_reward *x, const items *s) {
    float r[N_ITEMS];
    rf_status st = rf_external_reward_score(x, s->it, N_ITEMS, r);
    CHECK_OK(st);
    if (st != RF_OK) return 0;
    int bad = 0, tokens = 0;
    for (int i = 0; i < N_ITEMS; i++) {
        const float *v = &r[0];
        bad += r[i] != echo_reward(&s->it[i]);
        tokens += rf_external_reward_token_rewards(x, i, &v) != 0 || v != NULL;
    }
    CHECK(bad == 0);
    CHECK(tokens == 0);  /* the program sent none */
    char want[64];
    snprintf(want, sizeof want, "n=%d", s->it[7].n_response_ids);
    CHECK(strstr(rf_external_reward_info(x, 7), want) != NULL);
    rf_external_reward_stats st2 = rf_external_reward_last_stats(x);
    CHECK(st2.accepted == N_ITEMS && st2.rejected == 0 && st2.token_rewards == 0);
    return bad == 0;
}

/* One program over ipc://, started before rlflow binds; two batches; Shutdown on close. */
static void test_basic(const items *s) {
    char ep[128];
    snprintf(ep, sizeof ep, "ipc:///tmp/rf_test_ext_%d.sock", (int)getpid());
    pid_t p = spawn_echo(ep, "echo", "ok", 0, "0");
    rf_external_reward *x = NULL;
    double t0 = rf_time_now();
    CHECK_OK(rf_external_reward_open(&x, ep, 5));
    if (!x) return rf_test_kill(p);
    CHECK(rf_external_reward_programs(x) == 1);
    CHECK(check_batch(x, s));
    CHECK(check_batch(x, s));  /* request ids continue; nothing stale is mistaken */
    float none[1];
    CHECK_OK(rf_external_reward_score(x, s->it, 0, none));
    printf("2 batches of %d over %s in %.2f s\n", N_ITEMS, ep, rf_time_now() - t0);
    rf_external_reward_close(x);
    CHECK(rf_test_wait(p, 3) == 0);  /* Shutdown received: clean exit */
    unlink(ep + strlen("ipc://"));
}

/* Two programs on TCP; the first dies abruptly on its 3rd request: the batch still completes
 * with every value right (its requests went to the other program). The 3rd, not a later one:
 * the batch fills both programs' capacity of 4 at once, so it always gets 3, where with 6 a
 * doomed program that the scheduler left waiting (a loaded machine) could see steady answer
 * the whole batch first and never die (seen once in CI). */
static void test_failover(const items *s) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 2));
    if (!x) return;
    const char *ep = rf_external_reward_endpoint(x);
    pid_t a = spawn_echo(ep, "doomed", "die", 3, "0"), b = spawn_echo(ep, "steady", "ok", 0, "0");
    CHECK_OK(rf_external_reward_wait(x, 2, 5));
    double t0 = rf_time_now();
    CHECK(check_batch(x, s));
    CHECK(rf_external_reward_programs(x) == 1);
    printf("failover batch in %.2f s\n", rf_time_now() - t0);
    CHECK(rf_test_wait(a, 1) == 9);  /* it did die */
    rf_external_reward_close(x);
    CHECK(rf_test_wait(b, 3) == 0);
}

/* A lone faulty program: the batch fails naming it, within bounds. */
static void check_fault(const items *s, const char *mode, int after, double timeout_s,
                        rf_status want_st, const char *want1, const char *want2, double max_s) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", timeout_s));
    if (!x) return;
    pid_t p = spawn_echo(rf_external_reward_endpoint(x), mode, mode, after, "0");
    CHECK_OK(rf_external_reward_wait(x, 1, 5));
    float r[N_ITEMS];
    double t0 = rf_time_now();
    rf_error_clear();
    rf_status st = rf_external_reward_score(x, s->it, N_ITEMS, r);
    double dt = rf_time_now() - t0;
    const char *msg = rf_error_message();
    char who[64];
    snprintf(who, sizeof who, "reward program '%s' (rank 0, pid %d)", mode, (int)p);
    int ok = st == want_st && strstr(msg, who) && strstr(msg, want1) && (!want2 || strstr(msg, want2));
    CHECK(ok);
    CHECK(dt < max_s);
    /* a failed batch leaves no info and no per-token rewards behind */
    const float *v = r;
    CHECK(rf_external_reward_token_rewards(x, 0, &v) == 0 && v == NULL);
    CHECK(!strcmp(rf_external_reward_info(x, 0), ""));
    printf("%-8s -> after %.2f s: %s\n", mode, dt, msg);
    if (!ok) fprintf(stderr, "  expected %s with \"%s\" / \"%s\"\n", rf_strerror(want_st), want1, want2 ? want2 : "");
    rf_external_reward_close(x);
    rf_test_kill(p);
}

static void test_faults(const items *s) {
    check_fault(s, "die", 3, 1.0, RF_ERR_IO, "disconnected (it exited, closed its socket, or sent a "
                "message over the 64 MiB limit) while scoring request", "no other reward program connected", 4.0);
    /* a message over 64 MiB: ZeroMQ closes the connection unread; reported as for a crash */
    check_fault(s, "huge", 3, 1.0, RF_ERR_IO, "disconnected (it exited, closed its socket, or sent a "
                "message over the 64 MiB limit) while scoring request", "no other reward program connected", 6.0);
    check_fault(s, "silent", 3, 1.0, RF_ERR_IO, "sent nothing for 1.", "while scoring request", 4.0);
    /* the rejected program does not reconnect: the bridge waits 1 s for one, then fails with
     * the rejection's reason (the run would have gone on had any program come back) */
    check_fault(s, "nan", 5, 1.0, RF_ERR_IO,
                "answered reward nan for request 5 (sample 4 of group 0); rewards must be finite; "
                "no other reward program connected to tcp://127.0.0.1:", "within 1.0 s", 3.0);
}

/* Version mismatch: refused in rlflow and in the program with the same sentence. */
static void test_version(void) {
    char ep[128];
    snprintf(ep, sizeof ep, "ipc:///tmp/rf_test_ext_v_%d.sock", (int)getpid());
    if (truncate(log_path, 0) != 0) { /* no log yet */ }
    pid_t p = spawn_echo(ep, "future", "ok", 0, "2");
    rf_external_reward *x = NULL;
    char want[128];
    snprintf(want, sizeof want, "reward program 'future' (pid %d) speaks protocol 2, rlflow speaks 1", (int)p);
    CHECK_ERR(rf_external_reward_open(&x, ep, 3), RF_ERR_UNSUPPORTED, want);
    CHECK(x == NULL);
    CHECK(rf_test_wait(p, 3) == 4);
    char *log = rf_test_slurp(log_path);
    CHECK(strstr(log, want) != NULL);
    if (!strstr(log, want)) fprintf(stderr, "  program said: %s\n", log);
    free(log);
    unlink(ep + strlen("ipc://"));

    /* and nobody at all: a bounded wait with a hint */
    double t0 = rf_time_now();
    CHECK_ERR(rf_external_reward_open(&x, "tcp://127.0.0.1:*", 1.0), RF_ERR_IO,
              "no reward program connected to tcp://127.0.0.1:");
    CHECK(rf_time_now() - t0 < 2.0);
    CHECK_ERR(rf_external_reward_open(&x, "tcp://127.0.0.1:*", 0), RF_ERR_ARG, "external_timeout");
}

int main(void) {
    alarm(60);
    echo_bin = getenv("RF_REWARD_ECHO");
    if (!echo_bin || access(echo_bin, X_OK) != 0) {
        printf("test_external_reward: RF_REWARD_ECHO not set (run through ctest); skipped\n");
        return 77;
    }
    snprintf(log_path, sizeof log_path, "/tmp/rf_test_ext_%d.log", (int)getpid());
    static items s;
    make_echo_items(&s);
    double t0 = rf_time_now();
    test_basic(&s);
    test_failover(&s);
    test_faults(&s);
    test_version();
    printf("total %.2f s\n", rf_time_now() - t0);
    CHECK(rf_time_now() - t0 < 20.0);
    unlink(log_path);
    return rf_test_finish("test_external_reward");
}
