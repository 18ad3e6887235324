/* CURVE on the reward endpoint (common/curve.h, common/msg.c, reward/external.c, recipe keys,
 * `rlflow keygen`), over loopback TCP with the C client library in a thread:
 *   - `rlflow keygen --out P` writes P.key (mode 600) and P.pub, one Z85 line each, the public
 *     key belongs to the secret one and is printed; it refuses to overwrite without --force;
 *   - key files: comments and blank lines are skipped; a malformed line, a non-Z85 key, two keys
 *     in a secret file, an empty list and a missing file are errors naming the file and line;
 *   - which endpoints count as local (loopback, ipc://, inproc://) and which do not;
 *   - on one CURVE endpoint: a client with an unlisted key is refused with the exact sentence
 *     on its side, even while rlflow is not polling (the ZAP handler has its own thread), and
 *     rlflow logs the refusal naming the endpoint, address and key; a client
 *     without CURVE and one with a wrong server key are refused with their exact sentences; none
 *     of them stops rlflow, which then scores a batch from the allowed client exactly, and from
 *     examples/reward/length_judge.c run with --server-key / --key;
 *   - the non-loopback policy: refused without CURVE, warned with insecure, accepted with CURVE;
 *     half a CURVE configuration and unreadable key files are named; the same rules in recipe
 *     validation; bad keys in the message layer's configs are named.
 * Every wait is bounded (alarm(90)). */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/msg.h"
#include "common/util.h"
#include "controller/recipe.h"
#include "reward/clients/c/rlflow_reward_client.h"
#include "reward/external.h"
#include "spawn_util.h"
#include "test_shell.h"
#include "test_util.h"

static char dir[256];

static void path(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "%s/%s", dir, name);
}

static void write_text(const char *name, const char *text) {
    char p[512];
    path(p, sizeof p, name);
    FILE *f = fopen(p, "w");
    CHECK(f != NULL);
    if (f) fputs(text, f), fclose(f);
}

/* stderr into a file while rlflow logs, to check what it says */
static int saved_stderr = -1, failed_before;
static char capture_path[512];

static void capture_start(void) {
    failed_before = rf_test_failed;
    path(capture_path, sizeof capture_path, "stderr.log");
    fflush(stderr);
    saved_stderr = dup(2);
    int fd = open(capture_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    close(fd);
}

static char *capture_end(void) {
    fflush(stderr);
    dup2(saved_stderr, 2);
    close(saved_stderr);
    char *log = rf_test_slurp(capture_path);
    if (rf_test_failed > failed_before)  /* a CHECK failed while stderr was captured */
        fprintf(stderr, "captured stderr:\n%s\n", log);
    return log;
}

/* ---- keygen and key files ------------------------------------------------------------------ */

typedef struct keys {
    rf_curve_key server_pub, server_sec, alice_pub, alice_sec, mallory_pub, mallory_sec;
} keys;

static void keygen(const char *rlflow, const char *name, rf_curve_key pub, rf_curve_key sec) {
    char *out = NULL, p[512], q[600];
    path(p, sizeof p, name);
    int rc = rf_test_sh(&out, "%s keygen --out %s", rlflow, p);
    CHECK(rc == 0);
    snprintf(q, sizeof q, "%s.pub", p);
    CHECK_OK(rf_curve_read_key(q, 0, pub));
    snprintf(q, sizeof q, "%s.key", p);
    CHECK_OK(rf_curve_read_key(q, 1, sec));
    rf_curve_key derived;
    CHECK_OK(rf_curve_public(sec, derived));
    CHECK(!strcmp(derived, pub));
    CHECK(out && strstr(out, pub));  /* the public key is printed */
    struct stat st;
    CHECK(stat(q, &st) == 0 && (st.st_mode & 0777) == 0600 && st.st_size == 41);
    free(out);
}

static void test_keygen(const char *rlflow, keys *k) {
    keygen(rlflow, "server", k->server_pub, k->server_sec);
    keygen(rlflow, "alice", k->alice_pub, k->alice_sec);
    keygen(rlflow, "mallory", k->mallory_pub, k->mallory_sec);
    CHECK(strcmp(k->alice_pub, k->mallory_pub) != 0);
    char *out = NULL, p[512];
    path(p, sizeof p, "alice");
    CHECK(rf_test_sh(&out, "%s keygen --out %s", rlflow, p) == 1);
    CHECK(out && strstr(out, "alice.key: exists (use --force to replace the key pair)"));
    free(out);
    path(p, sizeof p, "spare");
    CHECK(rf_test_sh(NULL, "%s keygen --out %s && %s keygen --out %s --force", rlflow, p, rlflow, p) == 0);
    CHECK(rf_test_sh(NULL, "%s keygen", rlflow) == 2);
}

static void test_key_files(const keys *k) {
    char text[512], p[512];
    snprintf(text, sizeof text, "# programs allowed to score\n\n  %s  alice's judge\n#laptop\n", k->alice_pub);
    write_text("clients", text);
    rf_curve_key *list = NULL;
    int n = 0;
    path(p, sizeof p, "clients");
    CHECK_OK(rf_curve_read_keys(p, &list, &n));
    CHECK(n == 1 && list && !strcmp(list[0], k->alice_pub));
    free(list);

    snprintf(text, sizeof text, "%s\nnot-a-key\n", k->alice_pub);
    write_text("clients_bad", text);
    path(p, sizeof p, "clients_bad");
    char want[640];
    snprintf(want, sizeof want, "%s:2: a CURVE key is 40 Z85 characters, got 9", p);
    CHECK_ERR(rf_curve_read_keys(p, &list, &n), RF_ERR_ARG, want);
    write_text("clients_tilde", "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~\n");
    path(p, sizeof p, "clients_tilde");
    CHECK_ERR(rf_curve_read_keys(p, &list, &n), RF_ERR_ARG, ":1: \"~~~~");
    CHECK_ERR(rf_curve_read_keys(p, &list, &n), RF_ERR_ARG, "is not Z85 (ZeroMQ RFC 32)");
    write_text("clients_empty", "# nobody yet\n\n");
    path(p, sizeof p, "clients_empty");
    CHECK_ERR(rf_curve_read_keys(p, &list, &n), RF_ERR_ARG, "no keys");
    snprintf(text, sizeof text, "%s\n%s\n", k->alice_sec, k->mallory_sec);
    write_text("two.key", text);
    path(p, sizeof p, "two.key");
    snprintf(want, sizeof want, "%s:2: a second key (the key is on line 1)", p);
    rf_curve_key one;
    CHECK_ERR(rf_curve_read_key(p, 1, one), RF_ERR_ARG, want);
    CHECK_ERR(rf_curve_read_key("/nonexistent/x.key", 1, one), RF_ERR_IO,
              "/nonexistent/x.key: cannot open");
    CHECK_ERR(rf_curve_check("abc", "the test key"), RF_ERR_ARG,
              "the test key: a CURVE key is 40 Z85 characters, got 3");
}

static void test_local(void) {
    const char *local[] = {"ipc:///tmp/x.sock", "inproc://x", "tcp://127.0.0.1:5557",
                           "tcp://127.1.2.3:*", "tcp://localhost:5557", "tcp://[::1]:5557",
                           "tcp://lo:5557"};
    const char *open_[] = {"tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.0.0.5:5557",
                           "tcp://eth0:5557", "tcp://127.0.0.1.example.com:5557",
                           "tcp://128.0.0.1:5557", "ws://127.0.0.1:5557", "tcp://[::]:5557"};
    for (size_t i = 0; i < sizeof local / sizeof *local; i++) {
        CHECK(rf_curve_endpoint_is_local(local[i]) == 1);
        if (!rf_curve_endpoint_is_local(local[i])) fprintf(stderr, "  %s\n", local[i]);
    }
    for (size_t i = 0; i < sizeof open_ / sizeof *open_; i++) {
        CHECK(rf_curve_endpoint_is_local(open_[i]) == 0);
        if (rf_curve_endpoint_is_local(open_[i])) fprintf(stderr, "  %s\n", open_[i]);
    }
}

/* ---- clients in threads -------------------------------------------------------------------- */

typedef struct client_run {
    rf_reward_client_opts o;
    pthread_t th;
    volatile int done;
    volatile sig_atomic_t stop;
    rf_status st;
    char msg[1024];
    double seconds;  /* serve's run time */
} client_run;

static int len_score(const rf_reward_request *q, rf_reward_result *r, void *user) {
    (void)user;
    r->reward = (float)q->n_response_ids + 0.5f;
    snprintf(r->info, sizeof r->info, "n=%zu", q->n_response_ids);
    return 0;
}

static void *client_thread(void *arg) {
    client_run *c = arg;
    double t0 = rf_time_now();
    c->st = rf_reward_client_serve(&c->o, len_score, NULL);
    c->seconds = rf_time_now() - t0;
    snprintf(c->msg, sizeof c->msg, "%s", rf_error_message());
    c->done = 1;
    return NULL;
}

static void client_start(client_run *c, const char *ep, const char *name, const char *server_key,
                         const char *secret) {
    memset(c, 0, sizeof *c);
    c->o = (rf_reward_client_opts){.connect = ep, .name = name, .hello_timeout_s = 4, .quiet = 1,
                                   .curve_server_key = server_key, .curve_secret_key = secret,
                                   .stop = &c->stop};
    CHECK(pthread_create(&c->th, NULL, client_thread, c) == 0);
}

static int client_join(client_run *c, double limit_s) {
    double t0 = rf_time_now();
    while (!c->done && rf_time_now() - t0 < limit_s) rf_sleep(0.01);
    int in_time = c->done;
    c->stop = 1;
    pthread_join(c->th, NULL);
    return in_time;
}

/* The client (joined) ended refused with exactly `want` (or `want2`, when not NULL), well
 * before its 4 s Hello timeout. */
static void expect_refused(client_run *c, const char *want, const char *want2, const char *what) {
    int ok = c->done && c->st == RF_ERR_UNSUPPORTED &&
             (!strcmp(c->msg, want) || (want2 && !strcmp(c->msg, want2)));
    CHECK(ok);
    CHECK(c->seconds < 1.5);
    printf("%-18s refused after %.2f s: %s\n", what, c->seconds, c->msg);
    if (!ok) fprintf(stderr, "  got  %s \"%s\"\n  want \"%s\"\n", rf_strerror(c->st), c->msg, want);
}

#define N_ITEMS 12

static void check_batch(rf_external_reward *x) {
    static int32_t ids[N_ITEMS][N_ITEMS];
    rf_reward_item it[N_ITEMS];
    for (int i = 0; i < N_ITEMS; i++)
        it[i] = (rf_reward_item){.response = "r", .response_ids = ids[i], .n_response_ids = i,
                                 .index = i, .group = 1};
    float r[N_ITEMS];
    CHECK_OK(rf_external_reward_score(x, it, N_ITEMS, r));
    int exact = 0;
    for (int i = 0; i < N_ITEMS; i++) exact += r[i] == (float)i + 0.5f;
    CHECK(exact == N_ITEMS);
}

/* One CURVE endpoint: three kinds of strangers refused, then the allowed client scores. */
static void test_curve_endpoint(const keys *k) {
    char sec[512], cli[512];
    path(sec, sizeof sec, "server.key");
    path(cli, sizeof cli, "clients");
    rf_external_reward_config cfg = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 3,
                                     .curve_secret_file = sec, .curve_clients_file = cli};
    capture_start();
    rf_external_reward *x = NULL;
    rf_status st = rf_external_reward_listen_with(&x, &cfg);
    char *log = capture_end();
    CHECK_OK(st);
    if (!x) return free(log);
    const char *ep = rf_external_reward_endpoint(x);
    char want[2048], logged[1024];
    snprintf(want, sizeof want, "reward: CURVE on %s: 1 allowed program key from %s", ep, cli);
    CHECK(strstr(log, want) != NULL);
    free(log);

    client_run c;
    capture_start();
    /* an unlisted key: refused by the ZAP thread while rlflow is not even polling */
    client_start(&c, ep, "mallory", k->server_pub, k->mallory_sec);
    double t_idle = rf_time_now();
    while (!c.done && rf_time_now() - t_idle < 5) rf_sleep(0.01); /* ends at the refusal */
    int refused_unpolled = c.done;
    rf_error_clear();
    rf_status w1 = rf_external_reward_wait(x, 1, 3); /* 3 s: room for a loaded machine */
    char w1_msg[2048];
    snprintf(w1_msg, sizeof w1_msg, "%s", rf_error_message());
    CHECK(client_join(&c, 5));
    client_run c_mallory = c;
    /* no CURVE at all */
    client_start(&c, ep, "plain", NULL, NULL);
    rf_status w2 = rf_external_reward_wait(x, 1, 3);
    CHECK(client_join(&c, 5));
    client_run c_plain = c;
    /* the right pair, a wrong server key */
    client_start(&c, ep, "lost", k->alice_pub, k->alice_sec);
    rf_status w3 = rf_external_reward_wait(x, 1, 3);
    CHECK(client_join(&c, 5));
    client_run c_lost = c;
    log = capture_end();

    CHECK(refused_unpolled);
    CHECK(w1 == RF_ERR_IO && w2 == RF_ERR_IO && w3 == RF_ERR_IO);
    snprintf(logged, sizeof logged, "refused a connection to %s from 127.0.0.1: its CURVE public "
             "key %s is not among the 1 client keys this endpoint allows", ep, k->mallory_pub);
    snprintf(want, sizeof want, "warning: reward: %s\n", logged);
    CHECK(strstr(log, want) != NULL);  /* rlflow logs the refusal, naming endpoint and key */
    snprintf(want, sizeof want, "no reward program connected to %s within 3.0 s; the last "
             "connection was refused: %s", ep, logged);
    CHECK(!strcmp(w1_msg, want));
    if (strcmp(w1_msg, want)) fprintf(stderr, "  wait: %s\n  want: %s\n", w1_msg, want);
    /* the plain client: the mismatch, or (when the client closed first) a bare failure */
    snprintf(want, sizeof want, "warning: reward: refused a connection to %s without CURVE: this "
             "endpoint requires CURVE", ep);
    char want_b[1024];
    snprintf(want_b, sizeof want_b, "warning: reward: refused a connection to %s: the peer closed "
             "it during the CURVE handshake (a peer without CURVE, or with a wrong server public "
             "key?)", ep);
    CHECK(strstr(log, want) != NULL || strstr(log, want_b) != NULL);
    snprintf(want, sizeof want, "warning: reward: refused a connection to %s: its CURVE handshake "
             "failed with a cryptographic error (it probably uses a wrong server public key)", ep);
    CHECK(strstr(log, want) != NULL);
    if (rf_test_failed) fprintf(stderr, "rlflow logged:\n%s\n", log);
    free(log);

    snprintf(want, sizeof want, "refused by rlflow at %s: CURVE authentication failed (ZAP status "
             "400): this client's public key %s is not among the keys it allows", ep, k->mallory_pub);
    expect_refused(&c_mallory, want, NULL, "unlisted key:");
    /* a plain client sees the mechanism mismatch, or (a race inside ZeroMQ) only the server
     * closing the connection during the handshake: one of two exact sentences */
    char want2[2048];
    snprintf(want, sizeof want, "rlflow at %s requires CURVE: connect with its public key and a "
             "key pair of this program's own whose public key it allows (docs/reward-api.md, "
             "\"CURVE\")", ep);
    snprintf(want2, sizeof want2, "the handshake with rlflow at %s failed 3 times (the server "
             "closed the connection each time): it probably requires CURVE; connect with its "
             "public key and a key pair of this program's own whose public key it allows "
             "(docs/reward-api.md, \"CURVE\")", ep);
    expect_refused(&c_plain, want, want2, "no CURVE:");
    snprintf(want, sizeof want, "the CURVE handshake with rlflow at %s failed 3 times (the server "
             "closed the connection each time): is the server public key right?", ep);
    expect_refused(&c_lost, want, NULL, "wrong server key:");

    /* the allowed program, after all that */
    client_start(&c, ep, "alice", k->server_pub, k->alice_sec);
    CHECK_OK(rf_external_reward_wait(x, 1, 5));
    check_batch(x);
    printf("allowed key: a batch of %d scored exactly over CURVE\n", N_ITEMS);

    /* and the example program with its key files */
    const char *bin = getenv("RF_LENGTH_JUDGE");
    pid_t pid = -1;
    char spub[512], akey[512], plog[512];
    path(spub, sizeof spub, "server.pub");
    path(akey, sizeof akey, "alice.key");
    path(plog, sizeof plog, "length_judge.log");
    if (bin) {
        char *argv[] = {(char *)bin, "--connect", (char *)ep, "--server-key", spub, "--key", akey,
                        "--target", "4", "--name", "cjudge", NULL};
        pid = rf_test_spawn(argv, plog);
        CHECK_OK(rf_external_reward_wait(x, 2, 5));
    }
    CHECK(bin != NULL);
    rf_external_reward_close(x);
    CHECK(client_join(&c, 3) && c.st == RF_OK);
    if (pid > 0) {
        int rc = rf_test_wait(pid, 5);
        char *out = rf_test_slurp(plog);
        CHECK(rc == 0 && strstr(out, "cjudge: connected to") && strstr(out, "with CURVE"));
        if (rc != 0) fprintf(stderr, "length_judge (rc %d) said:\n%s\n", rc, out);
        free(out);
    }
}

/* Non-loopback endpoints: refused without CURVE, warned when insecure, fine with CURVE. */
static void test_policy(void) {
    char sec[512], cli[512], bad[512];
    path(sec, sizeof sec, "server.key");
    path(cli, sizeof cli, "clients");
    path(bad, sizeof bad, "clients_bad");
    rf_external_reward *x = NULL;
    rf_external_reward_config cfg = {.endpoint = "tcp://0.0.0.0:*", .timeout_s = 2};
    CHECK_ERR(rf_external_reward_listen_with(&x, &cfg), RF_ERR_ARG,
              "reward.external = \"tcp://0.0.0.0:*\" can be reached from other machines, and "
              "without CURVE anyone who reaches it can send the rewards that train the policy");
    CHECK(x == NULL);
    cfg.insecure = 1;
    capture_start();
    rf_status st = rf_external_reward_listen_with(&x, &cfg);
    char *log = capture_end();
    CHECK_OK(st);
    CHECK(strstr(log, "warning: reward: tcp://0.0.0.0:* can be reached from other machines "
                      "without authentication (reward.external_insecure = true)") != NULL);
    free(log);
    if (x) {
        /* reachable on loopback too: a plain client scores */
        const char *colon = strrchr(rf_external_reward_endpoint(x), ':');
        char ep[64];
        snprintf(ep, sizeof ep, "tcp://127.0.0.1%s", colon ? colon : ":0");
        client_run c;
        client_start(&c, ep, "plain", NULL, NULL);
        CHECK_OK(rf_external_reward_wait(x, 1, 5));
        check_batch(x);
        rf_external_reward_close(x);
        CHECK(client_join(&c, 3) && c.st == RF_OK);
        x = NULL;
    }
    cfg = (rf_external_reward_config){.endpoint = "tcp://0.0.0.0:*", .timeout_s = 2,
                                      .curve_secret_file = sec, .curve_clients_file = cli};
    CHECK_OK(rf_external_reward_listen_with(&x, &cfg));
    rf_external_reward_close(x);
    x = NULL;
    cfg.curve_clients_file = "";
    CHECK_ERR(rf_external_reward_listen_with(&x, &cfg), RF_ERR_ARG,
              "reward.external_curve_secret is set but reward.external_curve_clients is not");
    cfg.curve_clients_file = cli, cfg.curve_secret_file = "/nonexistent/rlflow.key";
    CHECK_ERR(rf_external_reward_listen_with(&x, &cfg), RF_ERR_IO,
              "reward.external_curve_secret: /nonexistent/rlflow.key: cannot open");
    cfg.curve_secret_file = sec, cfg.curve_clients_file = bad;
    char want[700];
    snprintf(want, sizeof want, "reward.external_curve_clients: %s:2: a CURVE key", bad);
    CHECK_ERR(rf_external_reward_listen_with(&x, &cfg), RF_ERR_ARG, want);
    CHECK(x == NULL);
}

static void test_recipe(void) {
    rf_recipe r;
    const char *open_[] = {"reward.external=tcp://0.0.0.0:5557"};
    CHECK_ERR(rf_recipe_load(&r, NULL, open_, 1), RF_ERR_ARG,
              "--set: reward.external = \"tcp://0.0.0.0:5557\": can be reached from other machines");
    const char *insecure[] = {"reward.external=tcp://0.0.0.0:5557", "reward.external_insecure=true"};
    CHECK_OK(rf_recipe_load(&r, NULL, insecure, 2));
    rf_recipe_free(&r);
    const char *half[] = {"reward.external_curve_secret=rlflow.key"};
    CHECK_ERR(rf_recipe_load(&r, NULL, half, 1), RF_ERR_ARG,
              "reward.external_curve_secret = \"rlflow.key\": needs reward.external_curve_clients too");
    const char *half2[] = {"reward.external_curve_clients=clients"};
    CHECK_ERR(rf_recipe_load(&r, NULL, half2, 1), RF_ERR_ARG,
              "reward.external_curve_clients = \"clients\": needs reward.external_curve_secret too");
    const char *curve[] = {"reward.external=tcp://*:5557", "reward.external_curve_secret=rlflow.key",
                           "reward.external_curve_clients=clients"};
    CHECK_OK(rf_recipe_load(&r, NULL, curve, 3));
    CHECK(!strcmp(r.reward.external_curve_secret, "rlflow.key") &&
          !strcmp(r.reward.external_curve_clients, "clients") && !r.reward.external_insecure);
    rf_recipe_free(&r);
    const char *loopback[] = {"reward.external=tcp://127.0.0.1:5557"};
    CHECK_OK(rf_recipe_load(&r, NULL, loopback, 1));
    rf_recipe_free(&r);
}

/* The message layer's own checks of CURVE settings. */
static void test_msg_config(const keys *k) {
    rf_msg_server *s = NULL;
    const char *none[1] = {NULL};
    rf_msg_server_config sc = {.peer_timeout_s = 1, .curve_secret_key = k->server_sec,
                               .curve_clients = none, .n_curve_clients = 0};
    CHECK_ERR(rf_msg_server_open(&s, "tcp://127.0.0.1:*", &sc), RF_ERR_ARG,
              "CURVE needs at least one allowed client public key");
    const char *bad[1] = {"short"};
    sc.curve_clients = bad, sc.n_curve_clients = 1;
    CHECK_ERR(rf_msg_server_open(&s, "tcp://127.0.0.1:*", &sc), RF_ERR_ARG,
              "allowed client key 1: a CURVE key is 40 Z85 characters, got 5");
    /* one ZAP handler per context: a second CURVE server in the same one is named */
    const char *ok[1] = {k->alice_pub};
    void *ctx = zmq_ctx_new();
    sc = (rf_msg_server_config){.peer_timeout_s = 1, .zmq_ctx = ctx, .curve_secret_key = k->server_sec,
                                .curve_clients = ok, .n_curve_clients = 1};
    rf_msg_server *s1 = NULL, *s2 = NULL;
    CHECK_OK(rf_msg_server_open(&s1, "tcp://127.0.0.1:*", &sc));
    CHECK_ERR(rf_msg_server_open(&s2, "tcp://127.0.0.1:*", &sc), RF_ERR_IO,
              "another CURVE server uses this ZeroMQ context");
    rf_msg_server_close(s1, NULL);
    zmq_ctx_term(ctx);
    rf_msg_client *c = NULL;
    rf_msg_client_config cc = {.endpoint = "tcp://127.0.0.1:9", .timeout_s = 1,
                               .role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM,
                               .curve_server_key = k->server_pub,
                               .curve_public_key = k->mallory_pub, .curve_secret_key = k->alice_sec};
    CHECK_ERR(rf_msg_client_connect(&c, &cc), RF_ERR_ARG, "is not the one of its secret key");
    cc.curve_public_key = NULL, cc.curve_secret_key = NULL;
    CHECK_ERR(rf_msg_client_connect(&c, &cc), RF_ERR_ARG,
              "a CURVE server key needs this client's own key pair too");
}

int main(void) {
    alarm(90);
    const char *rlflow = getenv("RF_RLFLOW");
    if (!rlflow || access(rlflow, X_OK) != 0) {
        printf("test_reward_curve: RF_RLFLOW not set (run through ctest); skipped\n");
        return 77;
    }
    if (!zmq_has("curve")) {
        printf("test_reward_curve: this libzmq has no CURVE; skipped\n");
        return 77;
    }
    snprintf(dir, sizeof dir, "/tmp/rf_test_curve_%d", (int)getpid());
    CHECK_OK(rf_mkdirs(dir));
    double t0 = rf_time_now();
    static keys k;
    test_keygen(rlflow, &k);
    test_key_files(&k);
    test_local();
    test_curve_endpoint(&k);
    test_policy();
    test_recipe();
    test_msg_config(&k);
    printf("total %.2f s\n", rf_time_now() - t0);
    if (!rf_test_failed) rf_remove_tree(dir);
    return rf_test_finish("test_reward_curve");
}
