/* The Python reward client (reward/clients/python/rlflow_reward.py) and its example program,
 * examples/reward/length_judge.py, against rlflow's reward bridge and message server over
 * loopback TCP:
 *   - length_judge.py scores a batch of 50 with 1 - |len - target| / target, bit for bit what C
 *     computes (both in double, rounded to float once), sends its info strings, exits 0 on
 *     Shutdown;
 *   - the module's protobuf descriptor matches proto/rlflow.proto field for field, and it
 *     encodes the worked examples of docs/reward-api.md to the bytes rlflow's encoder makes;
 *   - through the module (tests/tools/reward_client_py.py): every request field reaches the
 *     score function (Request.metadata parsed), reward, components, info and per-token rewards
 *     come back exactly (from the dict and the 4-tuple forms of a score function's result);
 *     Hello carries name, capacity and pid; an exception, a NaN, one per-token reward too many
 *     and an infinite one are sent as exact error texts; a 2 s score with a 0.8 s peer timeout
 *     is not declared lost; dropped by rlflow it says Hello again and its stale answer is never
 *     sent;
 *   - through rlflow's reward bridge: a batch of 50 with its per-token rewards, bit for bit;
 *   - a protocol mismatch is refused with the same sentence on both sides (exit 4);
 *   - CURVE: length_judge.py with --server-key / --key scores exactly; an unlisted key and a
 *     client without CURVE are refused with their exact sentences (exit 4).
 * Skipped (77) when no python3 with pyzmq and protobuf is found. Waits bounded (alarm(120)). */
#define _POSIX_C_SOURCE 200809L
#include <unistd.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/util.h"
#include "reward/external.h"
#include "spawn_util.h"
#include "test_shell.h"
#include "test_util.h"
#include "reward_test_util.h"

#define N_ITEMS 50
#define TARGET 8

static const char *py, *src, *rlflow;
static char tool[1024], judge[1024], log_path[256], dir[256];

/* A python3 that imports zmq and google.protobuf: the one in PATH, else Debian's. */
static const char *find_python(void) {
    static const char *cands[] = {"python3", "/usr/bin/python3"};
    for (int i = 0; i < 2; i++)
        if (rf_test_sh(NULL, "%s -c 'import zmq, google.protobuf' >/dev/null", cands[i]) == 0)
            return cands[i];
    return NULL;
}

static pid_t spawn(char **argv) {
    if (truncate(log_path, 0) != 0) { /* no log yet */ }
    pid_t pid = rf_test_spawn(argv, log_path);
    CHECK(pid > 0);
    return pid;
}

/* ---- length_judge.py ------------------------------------------------------------------------ */

static void length_items(rf_reward_item *it, int32_t (*ids)[20]) {
    for (int i = 0; i < N_ITEMS; i++) {
        int n = i % 17;
        for (int j = 0; j < n; j++) ids[i][j] = -5 + 70000 * j;  /* negative and multi-byte ids */
        it[i] = (rf_reward_item){.prompt = "say something", .response = "\xc3\xa9t\xc3\xa9",
                                 .response_ids = ids[i], .n_response_ids = n, .index = i % 4,
                                 .group = i / 4};
    }
}

/* Scores a batch and checks every reward bit for bit and one info string. */
static void check_length_batch(rf_external_reward *x) {
    static int32_t ids[N_ITEMS][20];
    rf_reward_item it[N_ITEMS];
    length_items(it, ids);
    float r[N_ITEMS];
    double t0 = rf_time_now();
    CHECK_OK(rf_external_reward_score(x, it, N_ITEMS, r));
    printf("50 rewards from length_judge.py in %.3f s\n", rf_time_now() - t0);
    int exact = 0;
    for (int i = 0; i < N_ITEMS; i++) {
        int len = i % 17 ? i % 17 : 3;  /* no token ids: "été" counts 3 characters */
        float want = (float)(1.0 - fabs((double)len - TARGET) / TARGET);
        exact += r[i] == want;
        if (r[i] != want) fprintf(stderr, "  item %d: %.9g, want %.9g\n", i, r[i], want);
    }
    CHECK(exact == N_ITEMS);
    CHECK(!strcmp(rf_external_reward_info(x, 3), "len 3, target 8"));
}

static void test_length_judge(void) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 10));
    if (!x) return;
    char *argv[] = {(char *)py, judge, "--connect", (char *)rf_external_reward_endpoint(x),
                    "--target", "8", "--capacity", "4", NULL};
    pid_t pid = spawn(argv);
    CHECK_OK(rf_external_reward_wait(x, 1, 15));
    check_length_batch(x);
    /* a second batch on the same connection */
    static int32_t ids[N_ITEMS][20];
    rf_reward_item it[N_ITEMS];
    length_items(it, ids);
    float r[2];
    CHECK_OK(rf_external_reward_score(x, it + 16, 2, r));
    CHECK(r[0] == (float)(1.0 - 8.0 / 8.0) && r[1] == (float)(1.0 - 5.0 / 8.0));
    rf_external_reward_close(x);
    CHECK(rf_test_wait(pid, 5) == 0);
    char *out = rf_test_slurp(log_path);
    CHECK(strstr(out, "length_judge: shutdown (the run is complete) after 52 requests") != NULL);
    if (rf_test_failed) fprintf(stderr, "length_judge.py said:\n%s\n", out);
    free(out);
}

/* ---- schema and bytes ----------------------------------------------------------------------- */

static void hex(const uint8_t *b, size_t n, char *out) {
    for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

/* `name hex` of rlflow's encoding of m, as the tool prints it. */
static void c_line(char *out, const char *name, rf_msg_type t, const ProtobufCMessage *m) {
    uint8_t *buf;
    size_t len;
    char h[512] = "";
    if (rf_msg_encode(t, m, &buf, &len) == RF_OK && len < 250) hex(buf, len, h), free(buf);
    sprintf(out, "%s %s\n", name, h);
}

static void test_schema_and_bytes(void) {
    char *out = NULL;
    CHECK(rf_test_sh(&out, "%s %s --check-schema %s/proto/rlflow.proto", py, tool, src) == 0);
    CHECK(out && strstr(out, "7 messages and enum Role match"));
    if (out && !strstr(out, "match")) fprintf(stderr, "%s", out);
    free(out);

    /* the worked examples of docs/reward-api.md, from rlflow's encoder */
    Rlflow__Hello h = RLFLOW__HELLO__INIT;
    h.protocol_version = 1, h.role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM, h.pid = 4242;
    h.name = "length_judge", h.capacity = 8;
    int32_t pids[] = {17, 10, 17, 28}, rids[] = {19};
    Rlflow__RewardRequest q = RLFLOW__REWARD_REQUEST__INIT;
    q.request_id = 17, q.prompt = "2+2=", q.response = "4", q.prompt_ids = pids, q.n_prompt_ids = 4;
    q.response_ids = rids, q.n_response_ids = 1, q.ground_truth = "4";
    q.metadata_json = "{\"level\": 1}", q.sample_index = 1, q.group_id = 3;
    Rlflow__RewardResponse r = RLFLOW__REWARD_RESPONSE__INIT;
    Rlflow__RewardResponse__ComponentsEntry e1 = RLFLOW__REWARD_RESPONSE__COMPONENTS_ENTRY__INIT,
                                            e2 = RLFLOW__REWARD_RESPONSE__COMPONENTS_ENTRY__INIT;
    e1.key = "correct", e1.value = 1, e2.key = "length", e2.value = 1;
    Rlflow__RewardResponse__ComponentsEntry *comps[] = {&e1, &e2};
    r.request_id = 17, r.reward = 0.75f, r.components = comps, r.n_components = 2, r.info = "ok";
    float tok[] = {0.5f, -0.25f, 0.0f};
    Rlflow__RewardResponse rt = RLFLOW__REWARD_RESPONSE__INIT;
    rt.request_id = 19, rt.reward = 1.5f, rt.token_rewards = tok, rt.n_token_rewards = 3;
    Rlflow__Heartbeat hb = RLFLOW__HEARTBEAT__INIT;
    hb.seq = 5;
    char want[2048], line[600];
    want[0] = '\0';
    c_line(line, "Hello", RF_MSG_HELLO, &h.base), strcat(want, line);
    c_line(line, "RewardRequest", RF_MSG_REWARD_REQUEST, &q.base), strcat(want, line);
    c_line(line, "RewardResponse", RF_MSG_REWARD_RESPONSE, &r.base), strcat(want, line);
    c_line(line, "RewardResponse token_rewards", RF_MSG_REWARD_RESPONSE, &rt.base), strcat(want, line);
    c_line(line, "Heartbeat", RF_MSG_HEARTBEAT, &hb.base), strcat(want, line);
    CHECK(rf_test_sh(&out, "%s %s --encode-examples", py, tool) == 0);
    CHECK(out && !strcmp(out, want));
    if (out && strcmp(out, want)) fprintf(stderr, "python:\n%srlflow:\n%s", out, want);
    free(out);
}

/* ---- the module through the echo driver ------------------------------------------------------ */

static void test_echo(void) {
    rf_msg_server *s = open_server("tcp://127.0.0.1:*", 0.8);
    if (!s) return;
    char *argv[] = {(char *)py, tool, "--serve", "--connect", (char *)rf_msg_server_endpoint(s),
                    "--name", "pyecho", "--capacity", "3", "--threads", "2", NULL};
    pid_t pid = spawn(argv);
    rf_msg_peer_info info;
    int peer = wait_join(s, 15, &info);
    CHECK(peer > 0 && !strcmp(info.name, "pyecho") && info.capacity == 3 && info.pid == (int)pid);
    static req_set rs;
    make_requests(&rs);
    int sent = 0, got = 0, exact = 0, seen[N_REQ] = {0};
    double t0 = rf_time_now();
    while (peer > 0 && got < N_REQ && rf_time_now() - t0 < 10) {
        while (sent < N_REQ && sent - got < 3)
            CHECK_OK(rf_msg_server_send(s, peer, RF_MSG_REWARD_REQUEST, &rs.q[sent++].base));
        rf_msg m;
        if (!wait_response(s, 5, &m, NULL, NULL)) break;
        const Rlflow__RewardResponse *r = (const Rlflow__RewardResponse *)m.pb;
        int i = (int)(r->request_id - 1000);
        if (i >= 0 && i < N_REQ && !seen[i]++) exact += response_exact(&rs.q[i], r, 1);
        got++;
        rf_msg_free(&m);
    }
    CHECK(exact == N_REQ);
    printf("the Python module answered %d requests exactly in %.3f s\n", exact, rf_time_now() - t0);

    const char *truths[] = {"fail", "nan", "badtok", "inftok", "str", "bool", "strtok", "compnan",
                            "longname", "huge"};
    const char *want[] = {"ValueError: cannot judge resp \xc3\xbc 1", "ValueError: the score "
                          "function returned a non-finite reward (nan)", "ValueError: the score "
                          "function returned 2 per-token rewards for a response of 1 token",
                          "ValueError: the score function returned a non-finite per-token reward "
                          "(inf at token 0)",
                          "TypeError: the score function returned str '0.5' as the reward; it must "
                          "be a number (an int or a float, not a bool or a string)",
                          "TypeError: the score function returned bool True as the reward; it must "
                          "be a number (an int or a float, not a bool or a string)",
                          "TypeError: the score function returned str '1' as the per-token reward "
                          "at token 0; it must be a number (an int or a float, not a bool or a "
                          "string)",
                          "ValueError: the score function returned a non-finite component 'x' (nan)",
                          "ValueError: the score function returned a component named 'nnnnnnnnnnnnnnnn"
                          "nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn'; component names must be "
                          "strings of 1 to 63 bytes",
                          "ValueError: the answer is 68157454 bytes, over rlflow's message limit of "
                          "67108864 bytes (a long info?)"};
    for (int k = 0; k < 10 && peer > 0; k++) {
        Rlflow__RewardRequest q = rs.q[1];
        q.request_id = 5000 + (uint64_t)k, q.ground_truth = (char *)truths[k];
        CHECK_OK(rf_msg_server_send(s, peer, RF_MSG_REWARD_REQUEST, &q.base));
        rf_msg m;
        int ok = wait_response(s, 5, &m, NULL, NULL);
        CHECK(ok);
        if (!ok) continue;
        const Rlflow__RewardResponse *r = (const Rlflow__RewardResponse *)m.pb;
        CHECK(r->request_id == q.request_id && !strcmp(r->error, want[k]) && r->n_components == 0 &&
              r->n_token_rewards == 0);
        if (strcmp(r->error, want[k])) fprintf(stderr, "  error \"%s\", want \"%s\"\n", r->error, want[k]);
        rf_msg_free(&m);
    }

    /* 2 s of scoring against a 0.8 s peer timeout */
    Rlflow__RewardRequest slow = rs.q[2];
    slow.ground_truth = "slow";
    t0 = rf_time_now();
    if (peer > 0) CHECK_OK(rf_msg_server_send(s, peer, RF_MSG_REWARD_REQUEST, &slow.base));
    rf_msg m;
    int lost = 0, ok = peer > 0 && wait_response(s, 5, &m, NULL, &lost);
    double dt = rf_time_now() - t0;
    CHECK(ok && lost == 0 && dt >= 2.0 && dt < 3.5);
    printf("a 2 s Python score with a 0.8 s peer timeout: answered after %.2f s, never lost\n", dt);
    if (ok) rf_msg_free(&m);

    /* dropped while scoring: Hello again, the stale answer never sent */
    slow.request_id = 6000;
    if (peer > 0) CHECK_OK(rf_msg_server_send(s, peer, RF_MSG_REWARD_REQUEST, &slow.base));
    rf_sleep(0.1);
    rf_msg_server_drop(s, peer, RF_ERR_ARG, "the test drops you", 0);
    int b = wait_join(s, 10, &info);
    CHECK(b > 0 && b != peer && info.pid == (int)pid);
    int stale = wait_response(s, 2.5, &m, NULL, NULL);
    CHECK(!stale);
    if (stale) rf_msg_free(&m);
    if (b > 0) CHECK_OK(rf_msg_server_send(s, b, RF_MSG_REWARD_REQUEST, &rs.q[4].base));
    int from = -1;
    ok = wait_response(s, 5, &m, &from, NULL);
    CHECK(ok && from == b);
    if (ok) {
        CHECK(response_exact(&rs.q[4], (Rlflow__RewardResponse *)m.pb, 1));
        rf_msg_free(&m);
    }
    rf_msg_server_close(s, "test done");
    CHECK(rf_test_wait(pid, 5) == 0);
    char *out = rf_test_slurp(log_path);
    CHECK(strstr(out, "pyecho: rlflow says: the test drops you") && strstr(out, "pyecho: served"));
    if (rf_test_failed) fprintf(stderr, "reward_client_py.py said:\n%s\n", out);
    free(out);
}

/* The module through rlflow's reward bridge: rewards and per-token rewards bit for bit, from
 * both result forms (dict for even request ids, 4-tuple for odd ones). */
static void test_bridge(void) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 10));
    if (!x) return;
    char *argv[] = {(char *)py, tool, "--serve", "--connect", (char *)rf_external_reward_endpoint(x),
                    "--name", "pybridge", "--capacity", "4", "--threads", "2", "--quiet", NULL};
    pid_t pid = spawn(argv);
    CHECK_OK(rf_external_reward_wait(x, 1, 15));
    int exact = score_client_echo(x);
    printf("the Python module through the bridge: %d of %d rewards and per-token rewards exact\n",
           exact, ECHO_ITEMS);
    rf_external_reward_close(x);
    CHECK(rf_test_wait(pid, 5) == 0);
}

/* A protocol mismatch: the same sentence in rlflow and in the program, which exits 4. */
static void test_version(void) {
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 10));
    if (!x) return;
    char *argv[] = {(char *)py, tool, "--serve", "--connect", (char *)rf_external_reward_endpoint(x),
                    "--name", "pyv2", "--protocol", "2", NULL};
    pid_t pid = spawn(argv);
    char why[256], want[600];
    snprintf(why, sizeof why, "reward program 'pyv2' (pid %d) speaks protocol 2, rlflow speaks 1", (int)pid);
    CHECK_ERR(rf_external_reward_wait(x, 1, 15), RF_ERR_UNSUPPORTED, why);
    CHECK(rf_test_wait(pid, 5) == 4);
    snprintf(want, sizeof want, "pyv2: refused by rlflow at %s: %s\n", rf_external_reward_endpoint(x), why);
    char *out = rf_test_slurp(log_path);
    CHECK(strstr(out, want) != NULL);
    if (!strstr(out, want)) fprintf(stderr, "  program said: %s  want: %s", out, want);
    free(out);
    rf_external_reward_close(x);
}

/* ---- CURVE ----------------------------------------------------------------------------------- */

static void keygen(const char *name, rf_curve_key pub) {
    char p[512], q[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    CHECK(rf_test_sh(NULL, "%s keygen --out %s >/dev/null", rlflow, p) == 0);
    snprintf(q, sizeof q, "%s.pub", p);
    CHECK_OK(rf_curve_read_key(q, 0, pub));
}

static void test_curve(void) {
    rf_curve_key server, alice, mallory;
    keygen("server", server), keygen("alice", alice), keygen("mallory", mallory);
    char sec[512], cli[512], spub[512], akey[512], mkey[512], text[128];
    snprintf(sec, sizeof sec, "%s/server.key", dir);
    snprintf(spub, sizeof spub, "%s/server.pub", dir);
    snprintf(cli, sizeof cli, "%s/clients", dir);
    snprintf(akey, sizeof akey, "%s/alice.key", dir);
    snprintf(mkey, sizeof mkey, "%s/mallory.key", dir);
    snprintf(text, sizeof text, "%s alice\n", alice);
    CHECK_OK(rf_write_file_atomic(cli, text, strlen(text)));
    rf_external_reward_config cfg = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 10,
                                     .curve_secret_file = sec, .curve_clients_file = cli};
    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen_with(&x, &cfg));
    if (!x) return;
    const char *ep = rf_external_reward_endpoint(x);
    char want[1024], want2[1024];

    /* an unlisted key: exit 4 with the exact sentence */
    char *bad[] = {(char *)py, judge, "--connect", (char *)ep, "--server-key", spub, "--key", mkey,
                   "--name", "pymallory", NULL};
    pid_t pid = spawn(bad);
    CHECK(rf_external_reward_wait(x, 1, 2) == RF_ERR_IO);  /* nobody allowed came */
    CHECK(rf_test_wait(pid, 10) == 4);
    snprintf(want, sizeof want, "pymallory: refused by rlflow at %s: CURVE authentication failed "
             "(ZAP status 400): this client's public key %s is not among the keys it allows\n", ep, mallory);
    char *out = rf_test_slurp(log_path);
    CHECK(strstr(out, want) != NULL);
    if (!strstr(out, want)) fprintf(stderr, "  program said: %s  want: %s", out, want);
    free(out);

    /* no CURVE: exit 4, one of the two sentences (see test_reward_curve) */
    char *plain[] = {(char *)py, judge, "--connect", (char *)ep, "--name", "pyplain", NULL};
    pid = spawn(plain);
    CHECK(rf_external_reward_wait(x, 1, 2) == RF_ERR_IO);
    CHECK(rf_test_wait(pid, 10) == 4);
    snprintf(want, sizeof want, "pyplain: rlflow at %s requires CURVE: connect with its public key "
             "and a key pair of this program's own whose public key it allows (docs/reward-api.md, "
             "\"CURVE\")\n", ep);
    snprintf(want2, sizeof want2, "pyplain: the handshake with rlflow at %s failed 3 times (the "
             "server closed the connection each time): it probably requires CURVE; connect with "
             "its public key and a key pair of this program's own whose public key it allows "
             "(docs/reward-api.md, \"CURVE\")\n", ep);
    out = rf_test_slurp(log_path);
    CHECK(strstr(out, want) || strstr(out, want2));
    if (!strstr(out, want) && !strstr(out, want2)) fprintf(stderr, "  program said: %s", out);
    free(out);

    /* the allowed key */
    char *good[] = {(char *)py, judge, "--connect", (char *)ep, "--server-key", spub, "--key", akey,
                    "--target", "8", NULL};
    pid = spawn(good);
    CHECK_OK(rf_external_reward_wait(x, 1, 15));
    check_length_batch(x);
    rf_external_reward_close(x);
    CHECK(rf_test_wait(pid, 5) == 0);
    out = rf_test_slurp(log_path);
    CHECK(strstr(out, "length_judge: connected to") && strstr(out, " with CURVE"));
    free(out);
    printf("CURVE: the allowed Python program scored exactly; unlisted and plain ones refused\n");
}

int main(void) {
    alarm(120);
    src = getenv("RF_SOURCE_DIR"), py = find_python(), rlflow = getenv("RF_RLFLOW");
    if (!src || !py) {
        printf("test_external_reward_py: %s; skipped\n",
               !src ? "RF_SOURCE_DIR not set (run through ctest)"
                    : "no python3 with pyzmq and protobuf (python3-zmq, python3-protobuf)");
        return 77;
    }
    snprintf(tool, sizeof tool, "%s/tests/tools/reward_client_py.py", src);
    snprintf(judge, sizeof judge, "%s/examples/reward/length_judge.py", src);
    snprintf(log_path, sizeof log_path, "/tmp/rf_test_ext_py_%d.log", (int)getpid());
    snprintf(dir, sizeof dir, "/tmp/rf_test_ext_py_%d", (int)getpid());
    double t0 = rf_time_now();
    test_length_judge();
    test_schema_and_bytes();
    test_echo();
    test_bridge();
    test_version();
    if (rlflow && zmq_has("curve") && rf_mkdirs(dir) == RF_OK) {
        test_curve();
        rf_remove_tree(dir);
    } else {
        printf("no rlflow binary (RF_RLFLOW) or no CURVE in libzmq: the CURVE part is skipped\n");
    }
    printf("total %.2f s\n", rf_time_now() - t0);
    unlink(log_path);
    return rf_test_finish("test_external_reward_py");
}
