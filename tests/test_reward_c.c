/* The C reward-program client library (reward/clients/c/rlflow_reward_client.h) end to end,
 * against rlflow's own message server and reward bridge over loopback TCP:
 *   - every RewardRequest field reaches the score function (negative and multi-byte ids, UTF-8,
 *     int64 group ids) and the reward, components, info and per-token rewards come back bit for
 *     bit; Hello carries the name, rank, capacity and pid; an error string, a NaN reward, a bare
 *     non-zero return, one per-token reward too many and an infinite one are sent as the exact
 *     error texts; Shutdown makes serve return RF_OK;
 *   - through rlflow's reward bridge: a batch of 50 scored exactly, per-token rewards included;
 *     a sample the score function always refuses is re-sent after each drop (the client
 *     reconnects) until the attempt limit fails the batch with the exact message;
 *   - a score that takes 2 s, with rlflow's peer timeout at 0.8 s, is not declared lost (the
 *     calling thread answers pings while a worker scores);
 *   - dropped by rlflow (an Error), the client says Hello again on a fresh socket, and the answer
 *     it was computing for the old connection is never sent on the new one;
 *   - rlflow vanishing without a Shutdown and a new one binding the same endpoint: the client
 *     finds it and serves it;
 *   - a protocol mismatch is refused with the same sentence on both sides; no rlflow, idle_exit
 *     and no_reconnect end with their exact messages; bad options are named;
 *   - examples/reward/length_judge.c (the built program) scores a batch exactly as its formula
 *     says and exits 0 on Shutdown, 2 on bad options.
 * Every wait is bounded (alarm(90) as a safety net). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <unistd.h>
#include <zmq.h>

#include "common/msg.h"
#include "common/util.h"
#include "reward/clients/c/rlflow_reward_client.h"
#include "reward/external.h"
#include "reward_test_util.h"
#include "spawn_util.h"
#include "test_util.h"

/* ---- a client running in a thread -------------------------------------------------------- */

typedef struct judge_cfg {
    double slow_s;  /* requests whose ground truth is "slow" sleep this long */
} judge_cfg;

typedef struct serve_run {
    rf_reward_client_opts o;
    judge_cfg cfg;
    pthread_t th;
    volatile int done;
    rf_status st;
    char msg[2048];
    volatile sig_atomic_t stop;
} serve_run;

/* Echoes what it received into the result, so that the server side can check every field. */
static int echo_score(const rf_reward_request *q, rf_reward_result *r, void *user) {
    const judge_cfg *cfg = user;
    if (!strcmp(q->ground_truth, "slow")) rf_sleep(cfg->slow_s);
    if (!strcmp(q->ground_truth, "fail")) {
        snprintf(r->error, sizeof r->error, "cannot judge %s", q->response);
        return 1;
    }
    if (!strcmp(q->ground_truth, "rc")) return 7;
    r->reward = !strcmp(q->ground_truth, "nan") ? NAN
              : (float)q->n_response_ids * 0.5f + (float)q->sample_index + 0.25f;
    float tok[65];
    size_t nt = q->n_response_ids < 64 ? q->n_response_ids : 64;
    for (size_t j = 0; j < nt; j++) tok[j] = echo_token_reward(q->response_ids[j], j);
    tok[nt] = 0;
    if (!strcmp(q->ground_truth, "inftok") && nt) tok[nt - 1] = INFINITY;
    if (rf_reward_result_token_rewards(r, tok, nt + !strcmp(q->ground_truth, "badtok")) != 0)
        return 8;
    rf_reward_result_component(r, "n_resp", (float)q->n_response_ids);
    rf_reward_result_component(r, "sum_resp", (float)sum_ids(q->response_ids, q->n_response_ids));
    rf_reward_result_component(r, "sum_prompt", (float)sum_ids(q->prompt_ids, q->n_prompt_ids));
    snprintf(r->info, sizeof r->info, "id=%llu p=%s r=%s g=%s m=%s s=%lld grp=%lld",
             (unsigned long long)q->request_id, q->prompt, q->response, q->ground_truth,
             q->metadata_json, (long long)q->sample_index, (long long)q->group_id);
    return 0;
}

static void *serve_thread(void *arg) {
    serve_run *r = arg;
    r->st = rf_reward_client_serve(&r->o, echo_score, &r->cfg);
    snprintf(r->msg, sizeof r->msg, "%s", rf_error_message());
    r->done = 1;
    return NULL;
}

static void serve_start(serve_run *r) {
    r->o.stop = &r->stop;
    r->o.quiet = 1;
    r->done = 0;
    CHECK(pthread_create(&r->th, NULL, serve_thread, r) == 0);
}

/* Joins the client; 1 when it returned within limit_s (else it is stopped and joined). */
static int serve_join(serve_run *r, double limit_s) {
    double t0 = rf_time_now();
    while (!r->done && rf_time_now() - t0 < limit_s) rf_sleep(0.01);
    int in_time = r->done;
    r->stop = 1;
    pthread_join(r->th, NULL);
    return in_time;
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_exact(void) {
    rf_msg_server *s = open_server("tcp://127.0.0.1:*", 5);
    if (!s) return;
    static serve_run run;
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = rf_msg_server_endpoint(s), .name = "exact",
                                    .capacity = 3, .threads = 2, .rank = 5, .hello_timeout_s = 5};
    serve_start(&run);
    rf_msg_peer_info info;
    int peer = wait_join(s, 5, &info);
    CHECK(peer > 0);
    CHECK(!strcmp(info.name, "exact") && info.capacity == 3 && info.rank == 5 &&
          info.pid == (int)getpid() && info.role == RLFLOW__ROLE__ROLE_REWARD_PROGRAM);
    static req_set rs;
    make_requests(&rs);
    int sent = 0, got = 0, exact = 0, seen[N_REQ] = {0};
    double t0 = rf_time_now();
    while (peer > 0 && got < N_REQ && rf_time_now() - t0 < 10) {
        while (sent < N_REQ && sent - got < 3)  /* within the declared capacity */
            CHECK_OK(rf_msg_server_send(s, peer, RF_MSG_REWARD_REQUEST, &rs.q[sent++].base));
        rf_msg m;
        if (!wait_response(s, 5, &m, NULL, NULL)) break;
        const Rlflow__RewardResponse *r = (const Rlflow__RewardResponse *)m.pb;
        int i = (int)(r->request_id - 1000);
        if (i >= 0 && i < N_REQ && !seen[i]++) exact += response_exact(&rs.q[i], r, 0);
        got++;
        rf_msg_free(&m);
    }
    CHECK(got == N_REQ);
    CHECK(exact == N_REQ);
    printf("%d requests answered exactly in %.3f s (capacity 3, 2 threads)\n", exact,
           rf_time_now() - t0);

    /* errors: the score function's text, a NaN, a bare return code, per-token rewards */
    const char *truths[] = {"fail", "nan", "rc", "badtok", "inftok"};
    const char *want[] = {"cannot judge resp \xc3\xbc 1", "the score function returned a "
                          "non-finite reward (nan)", "score function returned 7",
                          "the score function returned 2 per-token rewards for a response of 1 "
                          "token", "the score function returned a non-finite per-token reward "
                          "(inf at token 0)"};
    for (int k = 0; k < 5 && peer > 0; k++) {
        Rlflow__RewardRequest q = rs.q[1];
        q.request_id = 5000 + (uint64_t)k, q.ground_truth = (char *)truths[k];
        CHECK_OK(rf_msg_server_send(s, peer, RF_MSG_REWARD_REQUEST, &q.base));
        rf_msg m;
        int ok = wait_response(s, 5, &m, NULL, NULL);
        CHECK(ok);
        if (!ok) continue;
        const Rlflow__RewardResponse *r = (const Rlflow__RewardResponse *)m.pb;
        CHECK(r->request_id == q.request_id && !strcmp(r->error, want[k]) && r->reward == 0 &&
              r->n_components == 0 && r->n_token_rewards == 0);
        if (strcmp(r->error, want[k])) fprintf(stderr, "  error \"%s\", want \"%s\"\n", r->error, want[k]);
        rf_msg_free(&m);
    }
    rf_msg_server_close(s, "test done");
    CHECK(serve_join(&run, 3));
    CHECK(run.st == RF_OK);
    if (run.st != RF_OK) fprintf(stderr, "  serve: %s\n", run.msg);
}

/* A 2 s score with a 0.8 s peer timeout: the calling thread keeps answering pings. */
static void test_slow_score(void) {
    rf_msg_server *s = open_server("tcp://127.0.0.1:*", 0.8);
    if (!s) return;
    static serve_run run;
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = rf_msg_server_endpoint(s), .name = "slow",
                                    .threads = 1, .hello_timeout_s = 5};
    run.cfg.slow_s = 2.0;
    serve_start(&run);
    int peer = wait_join(s, 5, NULL);
    CHECK(peer > 0);
    static req_set rs;
    make_requests(&rs);
    Rlflow__RewardRequest q = rs.q[2];
    q.ground_truth = "slow";
    double t0 = rf_time_now();
    if (peer > 0) CHECK_OK(rf_msg_server_send(s, peer, RF_MSG_REWARD_REQUEST, &q.base));
    rf_msg m;
    int lost = 0, ok = peer > 0 && wait_response(s, 5, &m, NULL, &lost);
    double dt = rf_time_now() - t0;
    CHECK(ok && lost == 0);
    CHECK(dt >= 2.0 && dt < 3.5);
    printf("a 2 s score with a 0.8 s peer timeout: answered after %.2f s, never lost\n", dt);
    if (ok) {
        CHECK(((Rlflow__RewardResponse *)m.pb)->request_id == q.request_id);
        rf_msg_free(&m);
    }
    rf_msg_server_close(s, "test done");
    CHECK(serve_join(&run, 3) && run.st == RF_OK);
}

/* Dropped while scoring: a fresh Hello on a new socket, the stale answer never sent. */
static void test_drop_reconnect(void) {
    rf_msg_server *s = open_server("tcp://127.0.0.1:*", 5);
    if (!s) return;
    static serve_run run;
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = rf_msg_server_endpoint(s), .name = "dropped",
                                    .hello_timeout_s = 5};
    run.cfg.slow_s = 0.8;
    serve_start(&run);
    int a = wait_join(s, 5, NULL);
    CHECK(a > 0);
    static req_set rs;
    make_requests(&rs);
    Rlflow__RewardRequest q = rs.q[3];
    q.ground_truth = "slow";
    if (a > 0) CHECK_OK(rf_msg_server_send(s, a, RF_MSG_REWARD_REQUEST, &q.base));
    rf_sleep(0.1);
    rf_msg_server_drop(s, a, RF_ERR_ARG, "the test drops you", 0);
    rf_msg_peer_info info;
    int b = wait_join(s, 5, &info);
    CHECK(b > 0 && b != a && info.pid == (int)getpid() && !strcmp(info.name, "dropped"));
    /* the slow score finishes meanwhile: its answer belongs to the dropped connection */
    rf_msg m;
    int stale = wait_response(s, 1.5, &m, NULL, NULL);
    CHECK(!stale);
    if (stale) rf_msg_free(&m);
    if (b > 0) CHECK_OK(rf_msg_server_send(s, b, RF_MSG_REWARD_REQUEST, &rs.q[4].base));
    int from = -1, ok = wait_response(s, 5, &m, &from, NULL);
    CHECK(ok && from == b);
    if (ok) {
        CHECK(response_exact(&rs.q[4], (Rlflow__RewardResponse *)m.pb, 0));
        rf_msg_free(&m);
    }
    printf("dropped by rlflow: reconnected as peer %d (was %d), stale answer not sent\n", b, a);
    rf_msg_server_close(s, "test done");
    CHECK(serve_join(&run, 3) && run.st == RF_OK);
}

/* rlflow gone without a Shutdown, a new one on the same endpoint: the client finds it. */
static void test_server_restart(void) {
    void *ctx = zmq_ctx_new(), *raw = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &zero, sizeof zero);
    CHECK(zmq_bind(raw, "tcp://127.0.0.1:*") == 0);
    char ep[256];
    size_t cap = sizeof ep;
    zmq_getsockopt(raw, ZMQ_LAST_ENDPOINT, ep, &cap);
    static serve_run run;
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = ep, .name = "phoenix", .hello_timeout_s = 5};
    serve_start(&run);
    /* the first "rlflow": a bare ROUTER that accepts the Hello, then dies */
    zmq_pollitem_t it = {raw, 0, ZMQ_POLLIN, 0};
    CHECK(zmq_poll(&it, 1, 5000) == 1);
    uint8_t ident[256], frame[512];
    int il = zmq_recv(raw, ident, sizeof ident, 0), fl = zmq_recv(raw, frame, sizeof frame, 0);
    rf_msg hello = {0};
    CHECK(il > 0 && fl > 0 && rf_msg_decode(frame, (size_t)fl, &hello) == RF_OK &&
          hello.type == RF_MSG_HELLO);
    rf_msg_free(&hello);
    Rlflow__HelloAck a = RLFLOW__HELLO_ACK__INIT;
    a.accepted = 1, a.protocol_version = RF_PROTOCOL_VERSION, a.heartbeat_interval_ms = 1000;
    a.peer_timeout_ms = 5000;
    uint8_t *buf;
    size_t len;
    CHECK_OK(rf_msg_encode(RF_MSG_HELLO_ACK, &a.base, &buf, &len));
    zmq_send(raw, ident, (size_t)(il > 0 ? il : 0), ZMQ_SNDMORE);
    zmq_send(raw, buf, len, 0);
    free(buf);
    rf_sleep(0.3);
    zmq_close(raw);
    zmq_ctx_term(ctx);
    /* the second rlflow, on the same endpoint */
    double t0 = rf_time_now();
    rf_msg_server *s = open_server(ep, 5);
    if (!s) return (void)serve_join(&run, 1);
    int peer = wait_join(s, 5, NULL);
    CHECK(peer > 0);
    printf("rlflow restarted on %s: the client was back after %.2f s\n", ep, rf_time_now() - t0);
    static req_set rs;
    make_requests(&rs);
    if (peer > 0) CHECK_OK(rf_msg_server_send(s, peer, RF_MSG_REWARD_REQUEST, &rs.q[7].base));
    rf_msg m;
    int ok = peer > 0 && wait_response(s, 5, &m, NULL, NULL);
    CHECK(ok);
    if (ok) {
        CHECK(response_exact(&rs.q[7], (Rlflow__RewardResponse *)m.pb, 0));
        rf_msg_free(&m);
    }
    rf_msg_server_close(s, "test done");
    CHECK(serve_join(&run, 3) && run.st == RF_OK);
}

/* The client through rlflow's reward bridge: rewards and per-token rewards exact; a sample it
 * always refuses fails the batch after the attempt limit, each refusal having dropped the client
 * (which reconnected) and re-sent the sample. */
static void test_bridge(void) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 3));
    if (!x) return;
    const char *ep = rf_external_reward_endpoint(x);
    static serve_run run;
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = ep, .name = "cbridge", .capacity = 4, .threads = 2,
                                    .hello_timeout_s = 5};
    serve_start(&run);
    CHECK_OK(rf_external_reward_wait(x, 1, 5));
    int exact = score_client_echo(x);
    printf("C client through the bridge: %d of %d rewards and per-token rewards exact\n", exact,
           ECHO_ITEMS);

    /* item 3 (4 tokens) always gets 5 per-token rewards: refused 3 times, as requests 54, 104
     * and 154 (this second batch's ids start at 51: item i's k-th request is 51 + 50 k + i) */
    static echo_items s;
    make_echo_items(&s);
    float r[ECHO_ITEMS];
    s.it[3].truth = "badtok";
    int saved = stderr_to("/dev/null");  /* the three warnings are test_external_reward_faults' */
    rf_error_clear();
    rf_status fail = rf_external_reward_score(x, s.it, ECHO_ITEMS, r);
    stderr_back(saved);
    char want[2048], who[400];
    snprintf(who, sizeof who, "reward program 'cbridge' (rank 0, pid %d) on %s could not score",
             (int)getpid(), ep);
    int len = snprintf(want, sizeof want, "request 154 (sample 3 of group 0) was rejected 3 "
                       "times, the limit (max_attempts): ");
    for (int k = 0; k < 3; k++)
        len += snprintf(want + len, sizeof want - (size_t)len, "%s%d) %s request %d (sample 3 of "
                        "group 0): the score function returned 5 per-token rewards for a response "
                        "of 4 tokens", k ? "; " : "", k + 1, who, 54 + 50 * k);
    CHECK(fail == RF_ERR_FORMAT && !strcmp(rf_error_message(), want));
    if (strcmp(rf_error_message(), want))
        fprintf(stderr, "  got  \"%s\"\n  want \"%s\"\n", rf_error_message(), want);
    CHECK(rf_external_reward_last_stats(x).rejected == 3);
    CHECK_OK(rf_external_reward_wait(x, 1, 5));  /* it reconnected after the last drop */
    rf_external_reward_close(x);
    CHECK(serve_join(&run, 3) && run.st == RF_OK);
}

/* Refusals and ends: protocol mismatch (both sides), nobody there, idle_exit, no_reconnect. */
static void test_ends(void) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 3));
    if (!x) return;
    static serve_run run;
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = rf_external_reward_endpoint(x), .name = "v2",
                                    .protocol_version = 2, .hello_timeout_s = 5};
    serve_start(&run);
    char why[256], want[512];
    snprintf(why, sizeof why, "reward program 'v2' (pid %d) speaks protocol 2, rlflow speaks 1",
             (int)getpid());
    CHECK_ERR(rf_external_reward_wait(x, 1, 5), RF_ERR_UNSUPPORTED, why);
    CHECK(serve_join(&run, 3) && run.st == RF_ERR_UNSUPPORTED);
    snprintf(want, sizeof want, "refused by rlflow at %s: %s", rf_external_reward_endpoint(x), why);
    CHECK(!strcmp(run.msg, want));
    if (strcmp(run.msg, want)) fprintf(stderr, "  got  \"%s\"\n  want \"%s\"\n", run.msg, want);
    rf_external_reward_close(x);

    /* nobody answers */
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = "tcp://127.0.0.1:9", .hello_timeout_s = 0.5};
    double t0 = rf_time_now();
    serve_start(&run);
    CHECK(serve_join(&run, 3) && run.st == RF_ERR_IO);
    CHECK(strstr(run.msg, "rlflow at tcp://127.0.0.1:9 did not answer Hello within 0.5 s") == run.msg);
    CHECK(rf_time_now() - t0 < 1.5);

    /* idle_exit: rlflow stops listening (no pings) */
    rf_msg_server *s = open_server("tcp://127.0.0.1:*", 5);
    if (!s) return;
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = rf_msg_server_endpoint(s), .hello_timeout_s = 5,
                                    .idle_exit_s = 0.6};
    serve_start(&run);
    CHECK(wait_join(s, 5, NULL) > 0);
    CHECK(serve_join(&run, 3) && run.st == RF_ERR_IO);
    snprintf(want, sizeof want, "nothing from rlflow at %s for 0.6 s (idle_exit_s)",
             rf_msg_server_endpoint(s));
    CHECK(!strcmp(run.msg, want));

    /* no_reconnect: dropped once is the end */
    memset(&run, 0, sizeof run);
    run.o = (rf_reward_client_opts){.connect = rf_msg_server_endpoint(s), .hello_timeout_s = 5,
                                    .no_reconnect = 1};
    serve_start(&run);
    int p = wait_join(s, 5, NULL);
    CHECK(p > 0);
    rf_msg_server_drop(s, p, RF_ERR_ARG, "go away", 0);
    CHECK(serve_join(&run, 3) && run.st == RF_ERR_IO);
    snprintf(want, sizeof want, "the connection to rlflow at %s was lost (no_reconnect)",
             rf_msg_server_endpoint(s));
    CHECK(!strcmp(run.msg, want));
    rf_msg_server_close(s, NULL);
}

static void test_bad_options(void) {
    rf_reward_client_opts o = {.threads = -1};
    CHECK_ERR(rf_reward_client_serve(&o, echo_score, NULL), RF_ERR_ARG,
              "threads must be in [0, 1024] (got -1)");
    o = (rf_reward_client_opts){0};
    CHECK_ERR(rf_reward_client_serve(&o, NULL, NULL), RF_ERR_ARG, "no score function");
    o = (rf_reward_client_opts){.curve_secret_key = "x"};
    CHECK_ERR(rf_reward_client_serve(&o, echo_score, NULL), RF_ERR_ARG,
              "a CURVE key pair without rlflow's public key");
    o = (rf_reward_client_opts){.connect = "tcp://127.0.0.1:9", .curve_server_key = "abc",
                                .curve_secret_key = "abc", .hello_timeout_s = 1};
    CHECK_ERR(rf_reward_client_serve(&o, echo_score, NULL), RF_ERR_ARG,
              "the server's CURVE public key: a CURVE key is 40 Z85 characters, got 3");
    rf_reward_result r = {0};
    int ok = 1;
    for (int i = 0; i < RF_REWARD_MAX_COMPONENTS; i++) ok &= rf_reward_result_component(&r, "c", 1) == 0;
    CHECK(ok && rf_reward_result_component(&r, "one too many", 1) == -1);
    r.n_components = 0;
    char long_name[RF_REWARD_NAME_LEN + 1];
    memset(long_name, 'n', RF_REWARD_NAME_LEN), long_name[RF_REWARD_NAME_LEN] = '\0';
    CHECK(rf_reward_result_component(&r, long_name, 1) == -1 && r.n_components == 0);
    CHECK(rf_reward_result_component(&r, "", 1) == -1);
}

/* examples/reward/length_judge.c, the built program, against the reward bridge. */
static void test_example(void) {
    const char *bin = getenv("RF_LENGTH_JUDGE");
    if (!bin || access(bin, X_OK) != 0) {
        printf("RF_LENGTH_JUDGE not set: the example program is not tested\n");
        CHECK(bin != NULL);
        return;
    }
    char log[256];
    snprintf(log, sizeof log, "/tmp/rf_test_rc_%d.log", (int)getpid());
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 10));
    if (!x) return;
    char *argv[] = {(char *)bin, "--connect", (char *)rf_external_reward_endpoint(x), "--target", "8",
                    "--capacity", "4", "--threads", "2", "--name", "cjudge", NULL};
    pid_t pid = rf_test_spawn(argv, log);
    CHECK(pid > 0);
    CHECK_OK(rf_external_reward_wait(x, 1, 10));
    enum { N = 40 };
    static int32_t ids[N][20];
    rf_reward_item it[N];
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < i % 17; j++) ids[i][j] = -5 + 70000 * j;
        it[i] = (rf_reward_item){.prompt = "p", .response = "\xc3\xa9t\xc3\xa9",
                                 .response_ids = ids[i], .n_response_ids = i % 17,
                                 .index = i % 4, .group = i / 4};
    }
    float r[N];
    CHECK_OK(rf_external_reward_score(x, it, N, r));
    int exact = 0;
    for (int i = 0; i < N; i++) {
        int len = i % 17 ? i % 17 : 3;  /* no ids: "été" is 3 characters */
        exact += r[i] == (float)(1.0 - fabs((double)len - 8) / 8);
    }
    CHECK(exact == N);
    /* the component "length", averaged over the batch */
    const char *names[4];
    double means[4], want_mean = 0;
    for (int i = 0; i < N; i++) want_mean += i % 17 ? i % 17 : 3;
    want_mean /= N;
    int nc = rf_external_reward_components(x, names, means, 4);
    CHECK(nc == 1 && !strcmp(names[0], "length"));
    CHECK_CLOSE(nc == 1 ? means[0] : -1, want_mean, 1e-12, 0);  /* sums of small integers: exact */
    CHECK(!strcmp(rf_external_reward_info(x, 5), "len 5, target 8"));
    CHECK(!strcmp(rf_external_reward_info(x, 0), "len 3, target 8"));
    printf("length_judge (C): %d of %d rewards exact\n", exact, N);
    rf_external_reward_close(x);
    CHECK(rf_test_wait(pid, 5) == 0);
    char *out = rf_test_slurp(log);
    CHECK(strstr(out, "cjudge: shutdown (the run is complete) after 40 requests") != NULL);
    if (rf_test_failed) fprintf(stderr, "length_judge said:\n%s\n", out);
    free(out);
    char *bad[] = {(char *)bin, "--target", "0", NULL};
    CHECK(rf_test_wait(rf_test_spawn(bad, log), 5) == 2);
    unlink(log);
}

int main(void) {
    alarm(90);
    double t0 = rf_time_now();
    test_exact();
    test_slow_score();
    test_drop_reconnect();
    test_server_restart();
    test_bridge();
    test_ends();
    test_bad_options();
    test_example();
    printf("total %.2f s\n", rf_time_now() - t0);
    return rf_test_finish("test_reward_c");
}
