/* The message layer (common/msg.c): every message survives encode/decode; the byte-level
 * examples of docs/message-api.md are what the encoder produces; bad frames are refused; a
 * protocol version mismatch is refused with the same sentence on both sides; silent peers and
 * silent servers are detected within their timeout (1 s settings, checked within [0.9, 2] s);
 * a disconnect is seen at the next ping; a client that answers pings is never declared lost.
 * Every wait is bounded; alarm() kills the test if something hangs anyway. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <unistd.h>
#include <zmq.h>

#include "common/msg.h"
#include "common/util.h"
#include "test_util.h"

/* ---- encoding ---------------------------------------------------------------------------- */

/* encode -> decode -> encode gives the same bytes, and the decoded type is the one sent. */
static void check_round_trip(rf_msg_type type, const ProtobufCMessage *m) {
    uint8_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    rf_msg d = {0};
    CHECK_OK(rf_msg_encode(type, m, &a, &na));
    CHECK(na >= 1 && a[0] == (uint8_t)type);
    CHECK_OK(rf_msg_decode(a, na, &d));
    CHECK(d.type == type && d.pb && d.pb->descriptor == m->descriptor);
    if (d.pb) CHECK_OK(rf_msg_encode(type, d.pb, &b, &nb));
    CHECK(na == nb && b && !memcmp(a, b, na));
    if (na != nb) fprintf(stderr, "  round trip of %s: %zu -> %zu bytes\n", rf_msg_type_name(type), na, nb);
    rf_msg_free(&d);
    free(a), free(b);
}

static void test_round_trips(void) {
    int32_t ids[] = {1, -2, 300, 70000, 2147483647};
    float lp[] = {-0.5f, -1.25f, 0.0f};
    int64_t ver[] = {3, 3, 4};
    char *devs[] = {"cpu", "cuda:0"};

    Rlflow__Hello h = RLFLOW__HELLO__INIT;
    h.protocol_version = 1, h.role = RLFLOW__ROLE__ROLE_ROLLOUT, h.rank = 3, h.pid = 99;
    h.name = "w", h.capacity = 2, h.n_devices = 2, h.devices = devs, h.hostname = "host";
    check_round_trip(RF_MSG_HELLO, &h.base);

    Rlflow__HelloAck a = RLFLOW__HELLO_ACK__INIT;
    a.accepted = 1, a.reason = "", a.protocol_version = 1, a.heartbeat_interval_ms = 250;
    a.peer_timeout_ms = 1000;
    check_round_trip(RF_MSG_HELLO_ACK, &a.base);

    Rlflow__Heartbeat hb = RLFLOW__HEARTBEAT__INIT;
    hb.seq = 1ull << 40;
    check_round_trip(RF_MSG_HEARTBEAT, &hb.base);

    Rlflow__Error e = RLFLOW__ERROR__INIT;
    e.code = 3, e.message = "bad", e.request_id = 12;
    check_round_trip(RF_MSG_ERROR, &e.base);

    Rlflow__Shutdown sd = RLFLOW__SHUTDOWN__INIT;
    sd.reason = "done";
    check_round_trip(RF_MSG_SHUTDOWN, &sd.base);

    Rlflow__RewardRequest q = RLFLOW__REWARD_REQUEST__INIT;
    q.request_id = 17, q.prompt = "p", q.response = "r\xc3\xa9", q.prompt_ids = ids;
    q.n_prompt_ids = 5, q.response_ids = ids, q.n_response_ids = 2, q.ground_truth = "4";
    q.metadata_json = "{\"k\": 1}", q.sample_index = 2, q.group_id = -1;
    check_round_trip(RF_MSG_REWARD_REQUEST, &q.base);

    Rlflow__RewardResponse__ComponentsEntry c1 = RLFLOW__REWARD_RESPONSE__COMPONENTS_ENTRY__INIT;
    c1.key = "fmt", c1.value = 0.5f;
    Rlflow__RewardResponse__ComponentsEntry *cs[] = {&c1};
    Rlflow__RewardResponse r = RLFLOW__REWARD_RESPONSE__INIT;
    r.request_id = 17, r.reward = -0.25f, r.n_components = 1, r.components = cs, r.info = "i";
    check_round_trip(RF_MSG_REWARD_RESPONSE, &r.base);

    Rlflow__SamplingParams sp = RLFLOW__SAMPLING_PARAMS__INIT;
    sp.temperature = 1, sp.top_k = 50, sp.top_p = 0.9f, sp.max_new_tokens = 64, sp.seed = 7;
    sp.stop_ids = ids, sp.n_stop_ids = 1;
    Rlflow__GenerateRequest g = RLFLOW__GENERATE_REQUEST__INIT;
    g.request_id = 5, g.prompt_ids = ids, g.n_prompt_ids = 3, g.n = 8, g.sampling = &sp;
    g.group_id = 4, g.min_version = 2;
    check_round_trip(RF_MSG_GENERATE_REQUEST, &g.base);

    Rlflow__Sample s = RLFLOW__SAMPLE__INIT;
    s.request_id = 5, s.index = 1, s.group_id = 4, s.tokens = ids, s.n_tokens = 3;
    s.logprobs = lp, s.n_logprobs = 3, s.versions = ver, s.n_versions = 3, s.text = "t";
    s.finish = RLFLOW__FINISH_REASON__FINISH_STOP, s.weights_checksum = 0xdeadbeef;
    check_round_trip(RF_MSG_SAMPLE, &s.base);

    Rlflow__TrainSample ts = RLFLOW__TRAIN_SAMPLE__INIT;
    ts.tokens = ids, ts.n_tokens = 5, ts.n_prompt = 2, ts.behav_logp = lp, ts.n_behav_logp = 3;
    ts.advantages = lp, ts.n_advantages = 3, ts.versions = ver, ts.n_versions = 3, ts.reward = 1;
    Rlflow__TrainSample *tss[] = {&ts, &ts};
    Rlflow__TrainBatch tb = RLFLOW__TRAIN_BATCH__INIT;
    tb.batch_id = 9, tb.policy_version = 3, tb.n_samples = 2, tb.samples = tss;
    check_round_trip(RF_MSG_TRAIN_BATCH, &tb.base);

    Rlflow__TrainStats__MetricsEntry me = RLFLOW__TRAIN_STATS__METRICS_ENTRY__INIT;
    me.key = "loss", me.value = 0.125;
    Rlflow__TrainStats__MetricsEntry *mes[] = {&me};
    Rlflow__TrainStats st = RLFLOW__TRAIN_STATS__INIT;
    st.batch_id = 9, st.policy_version = 4, st.n_metrics = 1, st.metrics = mes, st.seconds = 1.5;
    check_round_trip(RF_MSG_TRAIN_STATS, &st.base);

    Rlflow__WeightsUpdate wu = RLFLOW__WEIGHTS_UPDATE__INIT;
    wu.version = 4, wu.checksum = 0x12345678, wu.n_bytes = 1ull << 33;
    check_round_trip(RF_MSG_WEIGHTS_UPDATE, &wu.base);

    Rlflow__WeightsLoaded wl = RLFLOW__WEIGHTS_LOADED__INIT;
    wl.version = 4, wl.checksum = 0x12345678, wl.rank = 1;
    check_round_trip(RF_MSG_WEIGHTS_LOADED, &wl.base);

    /* decoded fields, not just bytes: packed ids and the map survive */
    uint8_t *buf;
    size_t n;
    rf_msg d;
    CHECK_OK(rf_msg_encode(RF_MSG_REWARD_REQUEST, &q.base, &buf, &n));
    CHECK_OK(rf_msg_decode(buf, n, &d));
    const Rlflow__RewardRequest *dq = (const Rlflow__RewardRequest *)d.pb;
    CHECK(dq && dq->n_prompt_ids == 5 && dq->prompt_ids[3] == 70000 && dq->prompt_ids[4] == 2147483647);
    CHECK(dq && !strcmp(dq->response, "r\xc3\xa9") && dq->group_id == -1 && dq->sample_index == 2);
    rf_msg_free(&d), free(buf);
    CHECK_OK(rf_msg_encode(RF_MSG_REWARD_RESPONSE, &r.base, &buf, &n));
    CHECK_OK(rf_msg_decode(buf, n, &d));
    const Rlflow__RewardResponse *dr = (const Rlflow__RewardResponse *)d.pb;
    CHECK(dr && dr->reward == -0.25f && dr->n_components == 1 && !strcmp(dr->components[0]->key, "fmt"));
    rf_msg_free(&d), free(buf);

    /* a message of the wrong type for its tag is refused */
    CHECK_ERR(rf_msg_encode(RF_MSG_HELLO, &hb.base, &buf, &n), RF_ERR_ARG, "Heartbeat");
}

static void check_bytes(rf_msg_type type, const ProtobufCMessage *m, const uint8_t *want,
                        size_t want_len, const char *what) {
    uint8_t *b;
    size_t n;
    CHECK_OK(rf_msg_encode(type, m, &b, &n));
    int same = n == want_len && !memcmp(b, want, n);
    CHECK(same);
    if (!same) {
        fprintf(stderr, "  %s encodes as", what);
        for (size_t i = 0; i < n; i++) fprintf(stderr, " %02x", b[i]);
        fprintf(stderr, "\n");
    }
    rf_msg d;
    CHECK_OK(rf_msg_decode(want, want_len, &d));
    rf_msg_free(&d);
    free(b);
}

/* The worked examples of docs/message-api.md (Hello, Heartbeat) and the first version of the
 * reward messages' examples, byte for byte (docs/reward-api.md's own are checked by
 * test_reward_doc). */
static void test_doc_examples(void) {
    Rlflow__Hello h = RLFLOW__HELLO__INIT;
    h.protocol_version = 1, h.role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM, h.pid = 4242;
    h.name = "length_judge", h.capacity = 8;
    const uint8_t hello[] = {0x01, 0x08, 0x01, 0x10, 0x07, 0x20, 0x92, 0x21, 0x2a, 0x0c, 'l', 'e',
                             'n', 'g', 't', 'h', '_', 'j', 'u', 'd', 'g', 'e', 0x30, 0x08};
    check_bytes(RF_MSG_HELLO, &h.base, hello, sizeof hello, "Hello");

    int32_t pids[] = {17, 10, 17, 28}, rids[] = {19};
    Rlflow__RewardRequest q = RLFLOW__REWARD_REQUEST__INIT;
    q.request_id = 17, q.prompt = "2+2=", q.response = "4", q.prompt_ids = pids;
    q.n_prompt_ids = 4, q.response_ids = rids, q.n_response_ids = 1, q.ground_truth = "4";
    q.group_id = 3;
    const uint8_t req[] = {0x10, 0x08, 0x11, 0x12, 0x04, '2', '+', '2', '=', 0x1a, 0x01, '4',
                           0x22, 0x04, 0x11, 0x0a, 0x11, 0x1c, 0x2a, 0x01, 0x13, 0x32, 0x01, '4',
                           0x48, 0x03};
    check_bytes(RF_MSG_REWARD_REQUEST, &q.base, req, sizeof req, "RewardRequest");

    Rlflow__RewardResponse r = RLFLOW__REWARD_RESPONSE__INIT;
    r.request_id = 17, r.reward = 0.75f, r.info = "ok";
    const uint8_t resp[] = {0x11, 0x08, 0x11, 0x15, 0x00, 0x00, 0x40, 0x3f, 0x22, 0x02, 'o', 'k'};
    check_bytes(RF_MSG_REWARD_RESPONSE, &r.base, resp, sizeof resp, "RewardResponse");

    Rlflow__Heartbeat hb = RLFLOW__HEARTBEAT__INIT;
    hb.seq = 5;
    const uint8_t ping[] = {0x03, 0x08, 0x05};
    check_bytes(RF_MSG_HEARTBEAT, &hb.base, ping, sizeof ping, "Heartbeat");
}

static void test_bad_frames(void) {
    rf_msg d;
    const uint8_t unknown[] = {0x63, 0x08, 0x01};
    const uint8_t truncated[] = {RF_MSG_REWARD_RESPONSE, 0x08, 0x01, 0x22, 0x7f, 'x'};
    CHECK_ERR(rf_msg_decode("", 0, &d), RF_ERR_FORMAT, "empty frame");
    CHECK_ERR(rf_msg_decode(unknown, sizeof unknown, &d), RF_ERR_FORMAT, "unknown message type tag 99");
    CHECK_ERR(rf_msg_decode(truncated, sizeof truncated, &d), RF_ERR_FORMAT,
              "do not decode as rlflow.RewardResponse");
    CHECK(d.pb == NULL);
    CHECK(!strcmp(rf_msg_type_name(RF_MSG_TRAIN_STATS), "TrainStats"));
    CHECK(!strcmp(rf_msg_role_name(RLFLOW__ROLE__ROLE_REWARD_PROGRAM), "reward program"));
}

/* rf_msg_validate on hand-built bytes (EnvReply: 1 request_id uint64, 2 observation string,
 * 3 reward float, 4 done bool; RewardResponse: 3 components map<string, float>, 6 token_rewards
 * repeated float): each wire-type mismatch, a NUL in a string, invalid UTF-8 (only from external
 * programs), unknown fields skipped, truncated input, packed and unpacked repeated scalars, a
 * map entry's string checked inside. */
static void expect_invalid(const ProtobufCMessageDescriptor *d, const uint8_t *b, size_t n, int utf8, const char *want) {
    char why[400];
    int ok = rf_msg_validate(d, b, n, utf8, why, sizeof why);
    CHECK(!ok && strstr(why, want));
    if (ok || !strstr(why, want)) fprintf(stderr, "validate: got \"%s\", want \"%s\"\n", ok ? "(valid)" : why, want);
}

static void test_validate(void) {
    const ProtobufCMessageDescriptor *er = &rlflow__env_reply__descriptor, *rr = &rlflow__reward_response__descriptor;
    /* done (bool) as length-delimited "yes": protobuf-c alone reads it as true */
    const uint8_t done_str[] = {0x08, 0x01, 0x22, 0x03, 'y', 'e', 's'};
    ProtobufCMessage *m = protobuf_c_message_unpack(er, NULL, sizeof done_str, done_str);
    printf("protobuf-c alone %s a bool sent as \"yes\"\n", m ? "accepts" : "refuses");
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    expect_invalid(er, done_str, sizeof done_str, 0,
                   "field 4 (done) of rlflow.EnvReply at byte 2 has wire type 2 (length-delimited), expected 0 (varint)");
    const uint8_t id_64[] = {0x09, 1, 0, 0, 0, 0, 0, 0, 0};
    expect_invalid(er, id_64, sizeof id_64, 0, "field 1 (request_id) of rlflow.EnvReply at byte 0 has wire type 1 "
                   "(64-bit), expected 0 (varint)");
    const uint8_t reward_varint[] = {0x08, 0x01, 0x18, 0x05};
    expect_invalid(er, reward_varint, sizeof reward_varint, 0, "field 3 (reward) of rlflow.EnvReply at byte 2 has "
                   "wire type 0 (varint), expected 5 (32-bit)");
    const uint8_t obs_varint[] = {0x10, 0x05};
    expect_invalid(er, obs_varint, sizeof obs_varint, 0, "field 2 (observation) of rlflow.EnvReply at byte 0 has "
                   "wire type 0 (varint), expected 2 (length-delimited)");
    const uint8_t obs_32[] = {0x15, 0, 0, 0, 0};
    expect_invalid(er, obs_32, sizeof obs_32, 0, "expected 2 (length-delimited)");
    const uint8_t group[] = {0x0b, 0x0c};
    expect_invalid(er, group, sizeof group, 0, "field 1 at byte 0 of rlflow.EnvReply has wire type group start");
    const uint8_t zero_key[] = {0x00, 0x01};
    expect_invalid(er, zero_key, sizeof zero_key, 0, "a bad field key at byte 0");
    /* a NUL in a string: protobuf-c would cut it there */
    const uint8_t nul[] = {0x08, 0x01, 0x12, 0x03, 'a', 0x00, 'b'};
    expect_invalid(er, nul, sizeof nul, 0, "field 2 (observation) of rlflow.EnvReply holds a NUL byte at byte 1 of its 3");
    /* invalid UTF-8: refused from external programs only (rlflow's own text may be cut mid-character) */
    const uint8_t bad_utf8[] = {0x08, 0x07, 0x12, 0x02, 'a', 0xff};
    CHECK(rf_msg_validate(er, bad_utf8, sizeof bad_utf8, 0, NULL, 0));
    expect_invalid(er, bad_utf8, sizeof bad_utf8, 1, "field 2 (observation) of rlflow.EnvReply is not valid UTF-8 at "
                   "byte 1 of its 2");
    const uint8_t overlong[] = {0x12, 0x02, 0xc0, 0x80}, surrogate[] = {0x12, 0x03, 0xed, 0xa0, 0x80},
                  past_max[] = {0x12, 0x04, 0xf4, 0x90, 0x80, 0x80}, cut[] = {0x12, 0x02, 'x', 0xe2};
    expect_invalid(er, overlong, sizeof overlong, 1, "not valid UTF-8 at byte 0");
    expect_invalid(er, surrogate, sizeof surrogate, 1, "not valid UTF-8 at byte 0");
    expect_invalid(er, past_max, sizeof past_max, 1, "not valid UTF-8 at byte 0");
    expect_invalid(er, cut, sizeof cut, 1, "not valid UTF-8 at byte 1");
    const uint8_t good_utf8[] = {0x12, 0x09, 'r', 0xc3, 0xa9, 0xe2, 0x82, 0xac, 0xf0, 0x9f, 0x98};
    expect_invalid(er, good_utf8, sizeof good_utf8, 1, "not valid UTF-8 at byte 6"); /* 4-byte form cut short */
    const uint8_t fine_utf8[] = {0x12, 0x0a, 'r', 0xc3, 0xa9, 0xe2, 0x82, 0xac, 0xf0, 0x9f, 0x98, 0x80};
    CHECK(rf_msg_validate(er, fine_utf8, sizeof fine_utf8, 1, NULL, 0));
    /* unknown fields of every wire type are skipped; the known ones still decode */
    const uint8_t unknown[] = {0x08, 0x07, 0xf8, 0x01, 0x05, 0xf1, 0x01, 1, 2, 3, 4, 5, 6, 7, 8,
                               0x8a, 0x01, 0x02, 'h', 'i', 0xfd, 0x01, 9, 9, 9, 9, 0x12, 0x01, 'o'};
    CHECK(rf_msg_validate(er, unknown, sizeof unknown, 1, NULL, 0));
    uint8_t frame[64] = {RF_MSG_ENV_REPLY};
    memcpy(frame + 1, unknown, sizeof unknown);
    rf_msg d;
    CHECK_OK(rf_msg_decode_external(frame, sizeof unknown + 1, &d, NULL));
    const Rlflow__EnvReply *r = (const Rlflow__EnvReply *)d.pb;
    CHECK(r && r->request_id == 7 && !strcmp(r->observation, "o"));
    rf_msg_free(&d);
    /* truncated: a length past the end, a varint cut, a fixed value cut */
    const uint8_t trunc_len[] = {0x12, 0x05, 'a'}, trunc_varint[] = {0x08, 0x80}, trunc_fixed[] = {0x1d, 0, 0};
    expect_invalid(er, trunc_len, sizeof trunc_len, 0, "field 2 at byte 0 of rlflow.EnvReply runs past the end");
    expect_invalid(er, trunc_varint, sizeof trunc_varint, 0, "runs past the end");
    expect_invalid(er, trunc_fixed, sizeof trunc_fixed, 0, "runs past the end");
    /* repeated float: packed (a multiple of 4 bytes) or one record per value */
    const uint8_t packed[] = {0x32, 0x08, 0, 0, 0x80, 0x3f, 0, 0, 0, 0x40}, unpacked[] = {0x35, 0, 0, 0x80, 0x3f};
    const uint8_t packed_bad[] = {0x32, 0x03, 0, 0, 0x80}, packed_varint[] = {0x30, 0x01};
    CHECK(rf_msg_validate(rr, packed, sizeof packed, 1, NULL, 0));
    CHECK(rf_msg_validate(rr, unpacked, sizeof unpacked, 1, NULL, 0));
    expect_invalid(rr, packed_bad, sizeof packed_bad, 0, "field 6 (token_rewards) of rlflow.RewardResponse: its packed "
                   "values at byte 2 do not fill its 3 bytes");
    expect_invalid(rr, packed_varint, sizeof packed_varint, 0, "field 6 (token_rewards) of rlflow.RewardResponse at "
                   "byte 0 has wire type 0 (varint), expected 5 (32-bit)");
    /* a map entry is a message: its key (a string) and value (a float) are checked inside */
    const uint8_t comp_utf8[] = {0x1a, 0x08, 0x0a, 0x01, 0xff, 0x15, 0, 0, 0x80, 0x3f};
    const uint8_t comp_type[] = {0x1a, 0x05, 0x0a, 0x01, 'a', 0x10, 0x01};
    expect_invalid(rr, comp_utf8, sizeof comp_utf8, 1, "field 1 (key) of rlflow.RewardResponse.ComponentsEntry is not "
                   "valid UTF-8 at byte 0 of its 1");
    expect_invalid(rr, comp_type, sizeof comp_type, 0, "field 2 (value) of rlflow.RewardResponse.ComponentsEntry at "
                   "byte 5 has wire type 0 (varint), expected 5 (32-bit)");
    /* decode: a failing message is refused as one that does not decode, naming its request */
    uint8_t f2[16] = {RF_MSG_ENV_REPLY};
    memcpy(f2 + 1, bad_utf8, sizeof bad_utf8);
    uint64_t rid = 0;
    CHECK_ERR(rf_msg_decode_external(f2, sizeof bad_utf8 + 1, &d, &rid), RF_ERR_FORMAT,
              "6 bytes after tag 20 do not decode as rlflow.EnvReply: field 2 (observation) of rlflow.EnvReply is not "
              "valid UTF-8 at byte 1 of its 2");
    CHECK(d.pb == NULL && rid == 7);
    CHECK_OK(rf_msg_decode(f2, sizeof bad_utf8 + 1, &d)); /* rlflow's own peers: UTF-8 not required */
    rf_msg_free(&d);
    memcpy(f2 + 1, done_str, sizeof done_str);
    CHECK_ERR(rf_msg_decode(f2, sizeof done_str + 1, &d), RF_ERR_FORMAT, "7 bytes after tag 20 do not decode as "
              "rlflow.EnvReply: field 4 (done)");
    printf("wire checks: wire types, NUL, UTF-8, unknown fields, truncation, packed, map entries\n");
}

/* ---- connections ------------------------------------------------------------------------- */

/* A client in a thread: connect, then (when stay > 0) answer pings until Shutdown, an error,
 * or `stay` seconds. */
typedef struct client_job {
    rf_msg_client_config cfg;
    double stay;
    int close_early;  /* close right after connecting (a disconnect) */
    rf_status st;
    char err[1024];
    int got_shutdown;
    double t_fail;    /* seconds from start to the failure */
} client_job;

static void *client_main(void *arg) {
    client_job *j = arg;
    double t0 = rf_time_now();
    rf_msg_client *c;
    j->st = rf_msg_client_connect(&c, &j->cfg);
    if (j->st != RF_OK) {
        j->t_fail = rf_time_now() - t0;
        snprintf(j->err, sizeof j->err, "%s", rf_error_message());
        return NULL;
    }
    while (!j->close_early && rf_time_now() - t0 < j->stay) {
        rf_msg m;
        rf_status st = rf_msg_client_recv(c, 0.5, &m);
        if (st != RF_OK) continue;  /* nothing for 0.5 s: keep waiting until `stay` */
        if (m.type == RF_MSG_SHUTDOWN) j->got_shutdown = 1;
        rf_msg_free(&m);
        if (j->got_shutdown) break;
    }
    rf_msg_client_close(c);
    return NULL;
}

static rf_msg_server *open_server(double timeout_s, int accept_role) {
    rf_msg_server *s = NULL;
    rf_msg_server_config cfg = {.accept_role = accept_role, .peer_timeout_s = timeout_s};
    CHECK_OK(rf_msg_server_open(&s, "tcp://127.0.0.1:*", &cfg));
    return s;
}

/* Polls until an event of `kind` or `limit` seconds; returns it in ev (kind NONE on timeout). */
static void wait_event(rf_msg_server *s, rf_msg_event_kind kind, double limit, rf_msg_event *ev) {
    double t0 = rf_time_now();
    while (rf_time_now() - t0 < limit) {
        CHECK_OK(rf_msg_server_poll(s, 0.1, ev));
        if (ev->kind == RF_MSG_EV_MESSAGE) rf_msg_free(&ev->msg);
        if (ev->kind == kind) return;
    }
    ev->kind = RF_MSG_EV_NONE;
}

static void test_version_mismatch(void) {
    rf_msg_server *s = open_server(2, RLFLOW__ROLE__ROLE_REWARD_PROGRAM);
    if (!s) return;
    client_job j = {.cfg = {.endpoint = rf_msg_server_endpoint(s),
                            .role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM, .name = "judge",
                            .timeout_s = 3, .protocol_version = 2}};
    pthread_t t;
    pthread_create(&t, NULL, client_main, &j);
    rf_msg_event ev;
    wait_event(s, RF_MSG_EV_REFUSED, 3, &ev);
    pthread_join(t, NULL);
    char want[128];
    snprintf(want, sizeof want, "reward program 'judge' (pid %d) speaks protocol 2, rlflow speaks 1",
             (int)getpid());
    CHECK(ev.kind == RF_MSG_EV_REFUSED && strstr(ev.text, want));
    CHECK(j.st == RF_ERR_UNSUPPORTED && strstr(j.err, want) && strstr(j.err, "refused by rlflow at tcp://127.0.0.1:"));
    if (!strstr(j.err, want)) fprintf(stderr, "  server: \"%s\"\n  client: \"%s\"\n", ev.text, j.err);
    CHECK(rf_msg_server_peers(s, NULL, 0) == 0);

    /* a worker of another role is refused by a reward endpoint */
    client_job k = {.cfg = {.endpoint = rf_msg_server_endpoint(s), .role = RLFLOW__ROLE__ROLE_ROLLOUT,
                            .rank = 2, .timeout_s = 3}};
    pthread_create(&t, NULL, client_main, &k);
    wait_event(s, RF_MSG_EV_REFUSED, 3, &ev);
    pthread_join(t, NULL);
    CHECK(ev.kind == RF_MSG_EV_REFUSED && strstr(ev.text, "rollout worker") &&
          strstr(ev.text, "accepts only a reward program"));
    CHECK(k.st == RF_ERR_UNSUPPORTED && strstr(k.err, "accepts only a reward program"));
    rf_msg_server_close(s, NULL);
}

/* A peer that said Hello and then never reads nor answers: lost after ~1 s with a 1 s setting. */
static void test_silent_peer(void) {
    rf_msg_server *s = open_server(1.0, 0);
    if (!s) return;
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    CHECK(zmq_connect(d, rf_msg_server_endpoint(s)) == 0);
    Rlflow__Hello h = RLFLOW__HELLO__INIT;
    h.protocol_version = RF_PROTOCOL_VERSION, h.role = RLFLOW__ROLE__ROLE_ROLLOUT, h.rank = 5;
    h.pid = 77, h.name = "mute";
    uint8_t *buf;
    size_t n;
    CHECK_OK(rf_msg_encode(RF_MSG_HELLO, &h.base, &buf, &n));
    CHECK(zmq_send(d, buf, n, 0) == (int)n);
    free(buf);
    rf_msg_event ev;
    wait_event(s, RF_MSG_EV_JOINED, 2, &ev);
    CHECK(ev.kind == RF_MSG_EV_JOINED && ev.info.rank == 5 && ev.info.pid == 77);
    CHECK(strstr(ev.info.desc, "rollout worker 'mute' (rank 5, pid 77) on tcp://127.0.0.1:") != NULL);
    double t0 = rf_time_now();
    wait_event(s, RF_MSG_EV_LOST, 5, &ev);
    double dt = rf_time_now() - t0;
    CHECK(ev.kind == RF_MSG_EV_LOST && strstr(ev.text, "rollout worker 'mute' (rank 5, pid 77)") &&
          strstr(ev.text, "sent nothing for 1."));
    CHECK(dt >= 0.9 && dt <= 2.0);
    printf("silent peer reported after %.2f s (timeout 1 s): %s\n", dt, ev.text);
    CHECK(rf_msg_server_peers(s, NULL, 0) == 0);
    /* its connection is still open: it was told why (an Error after the pings it never read) */
    char told[600] = "";
    zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
    while (!told[0] && zmq_poll(&it, 1, 1000) > 0) {
        zmq_msg_t f;
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, d, ZMQ_DONTWAIT) < 0) break;
        rf_msg m;
        if (rf_msg_decode(zmq_msg_data(&f), zmq_msg_size(&f), &m) == RF_OK) {
            if (m.type == RF_MSG_ERROR)
                snprintf(told, sizeof told, "%s", ((const Rlflow__Error *)m.pb)->message);
            rf_msg_free(&m);
        }
        zmq_msg_close(&f);
    }
    CHECK(!strcmp(told, ev.text));
    if (strcmp(told, ev.text)) fprintf(stderr, "  the peer was told \"%s\"\n", told);
    zmq_close(d);
    zmq_ctx_term(ctx);
    rf_msg_server_close(s, NULL);
}

/* A peer that sends a message over the server's max_msg_bytes is disconnected by ZeroMQ before
 * the message is allocated and reported lost at the next ping (1 s here), naming the peer and
 * the limit; a message of the limit's size minus a few bytes still arrives (as a malformed one:
 * its bytes are filler). */
static void test_size_limit(void) {
    rf_msg_server *s = NULL;
    rf_msg_server_config cfg = {.peer_timeout_s = 5, .heartbeat_s = 0.5, .max_msg_bytes = 4096};
    CHECK_OK(rf_msg_server_open(&s, "tcp://127.0.0.1:*", &cfg));
    if (!s) return;
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    CHECK(zmq_connect(d, rf_msg_server_endpoint(s)) == 0);
    Rlflow__Hello h = RLFLOW__HELLO__INIT;
    h.protocol_version = RF_PROTOCOL_VERSION, h.role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM;
    h.pid = 78, h.name = "big";
    uint8_t *buf;
    size_t n;
    CHECK_OK(rf_msg_encode(RF_MSG_HELLO, &h.base, &buf, &n));
    CHECK(zmq_send(d, buf, n, 0) == (int)n);
    free(buf);
    rf_msg_event ev;
    wait_event(s, RF_MSG_EV_JOINED, 2, &ev);
    CHECK(ev.kind == RF_MSG_EV_JOINED);
    static uint8_t big[4097];
    memset(big, 0xff, sizeof big);
    big[0] = RF_MSG_REWARD_RESPONSE;
    CHECK(zmq_send(d, big, 4000, 0) == 4000);
    wait_event(s, RF_MSG_EV_MALFORMED, 2, &ev);
    CHECK(ev.kind == RF_MSG_EV_MALFORMED && strstr(ev.text, "reward program 'big' (rank 0, pid 78)"));
    CHECK(zmq_send(d, big, sizeof big, 0) == (int)sizeof big);
    double t0 = rf_time_now();
    wait_event(s, RF_MSG_EV_LOST, 3, &ev);
    double dt = rf_time_now() - t0;
    CHECK(ev.kind == RF_MSG_EV_LOST && strstr(ev.text, "reward program 'big' (rank 0, pid 78) on tcp://") &&
          strstr(ev.text, " disconnected (it exited, closed its socket, or sent a message over the "
                          "4096-byte limit)"));
    if (ev.kind != RF_MSG_EV_LOST) fprintf(stderr, "  no LOST event: \"%s\"\n", ev.text);
    printf("oversize message: peer lost after %.2f s: %s\n", dt, ev.text);
    CHECK(rf_msg_server_peers(s, NULL, 0) == 0);
    zmq_close(d);
    zmq_ctx_term(ctx);
    rf_msg_server_close(s, NULL);
}

/* A server that never answers Hello: the client gives up after its 1 s timeout. */
static void test_silent_server(void) {
    void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(r, ZMQ_LINGER, &zero, sizeof zero);
    CHECK(zmq_bind(r, "tcp://127.0.0.1:*") == 0);
    char ep[256];
    size_t cap = sizeof ep;
    zmq_getsockopt(r, ZMQ_LAST_ENDPOINT, ep, &cap);
    rf_msg_client_config cfg = {.endpoint = ep, .role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM, .timeout_s = 1.0};
    rf_msg_client *c = NULL;
    double t0 = rf_time_now();
    CHECK_ERR(rf_msg_client_connect(&c, &cfg), RF_ERR_IO, "did not answer Hello within 1.0 s");
    double dt = rf_time_now() - t0;
    CHECK(c == NULL && dt >= 0.9 && dt <= 2.0);
    zmq_close(r);
    zmq_ctx_term(ctx);
}

/* A client answering pings stays registered well past the timeout; one that closes its socket
 * is reported disconnected at the next ping, long before the timeout. */
static void test_heartbeats_and_disconnect(void) {
    rf_msg_server *s = open_server(1.0, 0);
    if (!s) return;
    client_job j = {.cfg = {.endpoint = rf_msg_server_endpoint(s), .role = RLFLOW__ROLE__ROLE_ACTOR,
                            .rank = 1, .timeout_s = 3},
                    .stay = 10};
    pthread_t t;
    pthread_create(&t, NULL, client_main, &j);
    rf_msg_event ev;
    wait_event(s, RF_MSG_EV_JOINED, 3, &ev);
    CHECK(ev.kind == RF_MSG_EV_JOINED);
    int id = ev.peer;
    wait_event(s, RF_MSG_EV_LOST, 2.5, &ev);  /* 2.5 timeouts of listening */
    CHECK(ev.kind == RF_MSG_EV_NONE && rf_msg_server_peer(s, id) != NULL);
    CHECK(rf_msg_server_silence(s, id) < 1.0);
    /* time away from poll is not silence */
    sleep(2);
    wait_event(s, RF_MSG_EV_LOST, 0.5, &ev);
    CHECK(ev.kind == RF_MSG_EV_NONE && rf_msg_server_peer(s, id) != NULL);
    /* Shutdown reaches the client */
    Rlflow__Shutdown sd = RLFLOW__SHUTDOWN__INIT;
    sd.reason = "test over";
    CHECK_OK(rf_msg_server_send(s, id, RF_MSG_SHUTDOWN, &sd.base));
    pthread_join(t, NULL);
    CHECK(j.st == RF_OK && j.got_shutdown);
    rf_msg_server_close(s, NULL);

    s = open_server(5.0, 0);
    if (!s) return;
    client_job k = {.cfg = {.endpoint = rf_msg_server_endpoint(s), .role = RLFLOW__ROLE__ROLE_CRITIC,
                            .rank = 0, .name = "quitter", .timeout_s = 3},
                    .close_early = 1};
    pthread_create(&t, NULL, client_main, &k);
    wait_event(s, RF_MSG_EV_JOINED, 3, &ev);
    pthread_join(t, NULL);
    double t0 = rf_time_now();
    wait_event(s, RF_MSG_EV_LOST, 4, &ev);
    double dt = rf_time_now() - t0;
    CHECK(ev.kind == RF_MSG_EV_LOST && strstr(ev.text, "critic worker 'quitter'") &&
          strstr(ev.text, "disconnected"));
    CHECK(dt < 2.5);  /* pings every 1 s; the timeout is 5 s */
    printf("disconnect reported after %.2f s (timeout 5 s): %s\n", dt, ev.text);
    rf_msg_server_close(s, NULL);
}

int main(void) {
    alarm(60);  /* a safety net: no part may hang the suite */
    test_round_trips();
    test_doc_examples();
    test_bad_frames();
    test_validate();
    test_version_mismatch();
    test_silent_peer();
    test_silent_server();
    test_size_limit();
    test_heartbeats_and_disconnect();
    return rf_test_finish("test_msg");
}
