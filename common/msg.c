/* The message layer: framing, handshake, heartbeats and CURVE over ZeroMQ (see common/msg.h,
 * docs/message-api.md and docs/reward-api.md). */
#define _POSIX_C_SOURCE 200809L
#include "common/msg.h"

#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/msg_zap.h"
#include "common/util.h"

/* ---- encoding ---------------------------------------------------------------------------- */

static const struct {
    int type;
    const char *name;
    const ProtobufCMessageDescriptor *desc;
} msg_table[] = {
    {RF_MSG_HELLO, "Hello", &rlflow__hello__descriptor},
    {RF_MSG_HELLO_ACK, "HelloAck", &rlflow__hello_ack__descriptor},
    {RF_MSG_HEARTBEAT, "Heartbeat", &rlflow__heartbeat__descriptor},
    {RF_MSG_ERROR, "Error", &rlflow__error__descriptor},
    {RF_MSG_SHUTDOWN, "Shutdown", &rlflow__shutdown__descriptor},
    {RF_MSG_REWARD_REQUEST, "RewardRequest", &rlflow__reward_request__descriptor},
    {RF_MSG_REWARD_RESPONSE, "RewardResponse", &rlflow__reward_response__descriptor},
    {RF_MSG_ENV_RESET, "EnvReset", &rlflow__env_reset__descriptor},
    {RF_MSG_ENV_STEP, "EnvStep", &rlflow__env_step__descriptor},
    {RF_MSG_ENV_REPLY, "EnvReply", &rlflow__env_reply__descriptor},
    {RF_MSG_GENERATE_REQUEST, "GenerateRequest", &rlflow__generate_request__descriptor},
    {RF_MSG_SAMPLE, "Sample", &rlflow__sample__descriptor},
    {RF_MSG_ENV_TURNS, "EnvTurns", &rlflow__env_turns__descriptor},
    {RF_MSG_ENV_OBSERVATIONS, "EnvObservations", &rlflow__env_observations__descriptor},
    {RF_MSG_TRAIN_BATCH, "TrainBatch", &rlflow__train_batch__descriptor},
    {RF_MSG_TRAIN_STATS, "TrainStats", &rlflow__train_stats__descriptor},
    {RF_MSG_WEIGHTS_UPDATE, "WeightsUpdate", &rlflow__weights_update__descriptor},
    {RF_MSG_WEIGHTS_LOADED, "WeightsLoaded", &rlflow__weights_loaded__descriptor},
    {RF_MSG_SCORE_REQUEST, "ScoreRequest", &rlflow__score_request__descriptor},
    {RF_MSG_SCORE_RESPONSE, "ScoreResponse", &rlflow__score_response__descriptor},
    {RF_MSG_CHECKPOINT_REQUEST, "CheckpointRequest", &rlflow__checkpoint_request__descriptor},
    {RF_MSG_CHECKPOINT_DONE, "CheckpointDone", &rlflow__checkpoint_done__descriptor},
};
#define N_MSG_TYPES ((int)(sizeof msg_table / sizeof msg_table[0]))

const char *rf_msg_type_name(int type) {
    for (int i = 0; i < N_MSG_TYPES; i++)
        if (msg_table[i].type == type) return msg_table[i].name;
    return "unknown";
}

const ProtobufCMessageDescriptor *rf_msg_descriptor(int type) {
    for (int i = 0; i < N_MSG_TYPES; i++)
        if (msg_table[i].type == type) return msg_table[i].desc;
    return NULL;
}

const char *rf_msg_role_name(int role) {
    switch (role) {
    case RLFLOW__ROLE__ROLE_CONTROLLER: return "controller";
    case RLFLOW__ROLE__ROLE_ROLLOUT: return "rollout worker";
    case RLFLOW__ROLE__ROLE_ACTOR: return "actor worker";
    case RLFLOW__ROLE__ROLE_CRITIC: return "critic worker";
    case RLFLOW__ROLE__ROLE_REFERENCE: return "reference worker";
    case RLFLOW__ROLE__ROLE_REWARD: return "reward worker";
    case RLFLOW__ROLE__ROLE_REWARD_PROGRAM: return "reward program";
    case RLFLOW__ROLE__ROLE_ENVIRONMENT: return "environment program";
    default: return "peer of unknown role";
    }
}

rf_status rf_msg_encode(rf_msg_type type, const ProtobufCMessage *m, uint8_t **buf, size_t *len) {
    *buf = NULL, *len = 0;
    const ProtobufCMessageDescriptor *d = rf_msg_descriptor(type);
    if (!d || !m || m->descriptor != d)
        return rf_error(RF_ERR_ARG, "encoding a %s: the message is a %s", rf_msg_type_name(type),
                        m ? m->descriptor->short_name : "NULL");
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(n + 1);
    if (!b) return rf_error(RF_ERR_NOMEM, "out of memory encoding a %s", d->short_name);
    b[0] = (uint8_t)type;
    protobuf_c_message_pack(m, b + 1);
    *buf = b, *len = n + 1;
    return RF_OK;
}

/* ---- the wire checks protobuf-c leaves out ------------------------------------------------
 * protobuf-c (1.x) accepts a known field sent with the wrong wire type in some cases (a bool as
 * a length-delimited "yes" reads as true), cuts a string at its first NUL byte (its strings are
 * C strings) and never checks UTF-8. The encoding rules are those of
 * https://protobuf.dev/programming-guides/encoding/ (proto3: string fields hold UTF-8). */

/* Reads a varint at *p (< end) into *v; 0 when truncated or over 10 bytes. */
static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    *v = 0;
    for (int shift = 0; shift < 70 && *p < end; shift += 7) {
        uint8_t c = *(*p)++;
        *v |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80)) return 1;
    }
    return 0;
}

/* The wire type a field of type t is sent with when not packed. */
static int wire_type_of(ProtobufCType t) {
    switch (t) {
    case PROTOBUF_C_TYPE_SFIXED64: case PROTOBUF_C_TYPE_FIXED64: case PROTOBUF_C_TYPE_DOUBLE: return 1;
    case PROTOBUF_C_TYPE_SFIXED32: case PROTOBUF_C_TYPE_FIXED32: case PROTOBUF_C_TYPE_FLOAT: return 5;
    case PROTOBUF_C_TYPE_STRING: case PROTOBUF_C_TYPE_BYTES: case PROTOBUF_C_TYPE_MESSAGE: return 2;
    default: return 0; /* int32, sint32, uint32, int64, sint64, uint64, bool, enum */
    }
}

static const char *wire_name(int w) {
    static const char *names[8] = {"varint", "64-bit", "length-delimited", "group start", "group end",
                                   "32-bit", "6 (undefined)", "7 (undefined)"};
    return names[w & 7];
}

/* A packed run of field f's scalars (n bytes at p): whole varints, or a multiple of the width. */
static int packed_ok(const ProtobufCFieldDescriptor *f, const uint8_t *p, size_t n) {
    int w = wire_type_of(f->type);
    if (w == 1 || w == 5) return n % (w == 1 ? 8 : 4) == 0;
    const uint8_t *end = p + n;
    uint64_t v;
    while (p < end)
        if (!read_varint(&p, end, &v)) return 0;
    return 1;
}

static int validate(const ProtobufCMessageDescriptor *d, const uint8_t *b, size_t n, size_t at, int utf8, int depth,
                    char *why, size_t cap);

/* Checks the length-delimited value (n bytes at p, message offset at) of known field f. */
static int validate_len(const ProtobufCMessageDescriptor *d, const ProtobufCFieldDescriptor *f, const uint8_t *p,
                        size_t n, size_t at, int utf8, int depth, char *why, size_t cap) {
    if (f->type == PROTOBUF_C_TYPE_STRING) {
        const uint8_t *nul = memchr(p, 0, n);
        size_t bad = utf8 ? rf_utf8_invalid_at(p, n) : n;
        if (nul && (size_t)(nul - p) <= bad) {
            snprintf(why, cap, "field %u (%s) of %s holds a NUL byte at byte %zu of its %zu (strings may not "
                     "hold one)", f->id, f->name, d->name, (size_t)(nul - p), n);
            return 0;
        }
        if (bad < n) {
            snprintf(why, cap, "field %u (%s) of %s is not valid UTF-8 at byte %zu of its %zu", f->id, f->name,
                     d->name, bad, n);
            return 0;
        }
        return 1;
    }
    if (f->type == PROTOBUF_C_TYPE_MESSAGE) return validate(f->descriptor, p, n, at, utf8, depth + 1, why, cap);
    if (f->type != PROTOBUF_C_TYPE_BYTES && !packed_ok(f, p, n)) {
        snprintf(why, cap, "field %u (%s) of %s: its packed values at byte %zu do not fill its %zu bytes",
                 f->id, f->name, d->name, at, n);
        return 0;
    }
    return 1;
}

/* Checks the protobuf bytes b (n; at = their offset in the outermost message) of message d:
 * every field's key and value are whole, a known field comes with its type's wire type (or
 * length-delimited for a repeated scalar, packed), string fields hold no NUL byte (and, with
 * utf8, are valid UTF-8), messages inside are checked alike. Unknown fields are skipped. 1 when
 * all is well, else 0 with *why. */
static int validate(const ProtobufCMessageDescriptor *d, const uint8_t *b, size_t n, size_t at, int utf8, int depth,
                    char *why, size_t cap) {
    if (depth > 32) return snprintf(why, cap, "messages nested over 32 deep"), 0;
    const uint8_t *p = b, *end = b + n;
    while (p < end) {
        size_t key_at = at + (size_t)(p - b);
        uint64_t key, v;
        if (!read_varint(&p, end, &key) || key >> 3 == 0 || key >> 3 > 536870911u) {
            snprintf(why, cap, "a bad field key at byte %zu of %s", key_at, d->name);
            return 0;
        }
        int w = (int)(key & 7);
        const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3));
        const uint8_t *val = p;
        size_t len = 0;
        int ok = 1;
        if (w == 0) ok = read_varint(&p, end, &v);
        else if (w == 1 || w == 5) ok = (size_t)(end - p) >= (len = w == 1 ? 8 : 4), p += ok ? len : 0;
        else if (w == 2) ok = read_varint(&p, end, &v) && v <= (uint64_t)(end - p), val = p, len = (size_t)v, p += ok ? len : 0;
        else {
            snprintf(why, cap, "field %u at byte %zu of %s has wire type %s, which proto3 does not use",
                     (unsigned)(key >> 3), key_at, d->name, wire_name(w));
            return 0;
        }
        if (!ok) {
            snprintf(why, cap, "field %u at byte %zu of %s runs past the end", (unsigned)(key >> 3), key_at,
                     d->name);
            return 0;
        }
        if (!f) continue; /* unknown: skipped, as proto3 says */
        int want = wire_type_of(f->type);
        int packed = f->label == PROTOBUF_C_LABEL_REPEATED && w == 2 && want != 2;
        if (w != want && !packed) {
            snprintf(why, cap, "field %u (%s) of %s at byte %zu has wire type %d (%s), expected %d (%s)", f->id,
                     f->name, d->name, key_at, w, wire_name(w), want, wire_name(want));
            return 0;
        }
        if (w == 2 && !validate_len(d, f, val, len, at + (size_t)(val - b), utf8, depth, why, cap)) return 0;
    }
    return 1;
}

int rf_msg_validate(const ProtobufCMessageDescriptor *d, const void *bytes, size_t n, int utf8, char *why,
                    size_t cap) {
    char scratch[8];
    if (!why || cap == 0) why = scratch, cap = sizeof scratch;
    why[0] = '\0';
    return validate(d, bytes, n, 0, utf8, 0, why, cap);
}

/* The uint64 field "request_id" of m (0 without one). */
static uint64_t request_id_of(const ProtobufCMessage *m) {
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(m->descriptor, "request_id");
    if (!f || f->type != PROTOBUF_C_TYPE_UINT64 || f->label == PROTOBUF_C_LABEL_REPEATED) return 0;
    uint64_t v;
    memcpy(&v, (const char *)m + f->offset, sizeof v);
    return v;
}

/* rf_msg_decode, with UTF-8 checked when utf8 is set; *request_id (when not NULL) is the
 * request_id of a message that unpacked but failed the checks, else 0. */
static rf_status decode(const void *buf, size_t len, int utf8, rf_msg *out, uint64_t *request_id) {
    out->pb = NULL, out->type = 0;
    if (request_id) *request_id = 0;
    const uint8_t *b = buf;
    if (len == 0) return rf_error(RF_ERR_FORMAT, "an empty frame (no type tag)");
    const ProtobufCMessageDescriptor *d = rf_msg_descriptor(b[0]);
    if (!d) return rf_error(RF_ERR_FORMAT, "unknown message type tag %d (%zu bytes)", b[0], len);
    out->pb = protobuf_c_message_unpack(d, NULL, len - 1, b + 1);
    if (!out->pb)
        return rf_error(RF_ERR_FORMAT, "%zu bytes after tag %d do not decode as rlflow.%s", len - 1,
                        b[0], d->short_name);
    char why[400];
    if (!rf_msg_validate(d, b + 1, len - 1, utf8, why, sizeof why)) {
        if (request_id) *request_id = request_id_of(out->pb);
        rf_msg_free(out);
        return rf_error(RF_ERR_FORMAT, "%zu bytes after tag %d do not decode as rlflow.%s: %s", len - 1, b[0],
                        d->short_name, why);
    }
    out->type = b[0];
    return RF_OK;
}

rf_status rf_msg_decode(const void *buf, size_t len, rf_msg *out) { return decode(buf, len, 0, out, NULL); }

rf_status rf_msg_decode_external(const void *buf, size_t len, rf_msg *out, uint64_t *request_id) {
    return decode(buf, len, 1, out, request_id);
}

void rf_msg_free(rf_msg *m) {
    if (!m) return;
    if (m->pb) protobuf_c_message_free_unpacked(m->pb, NULL);
    m->pb = NULL;
}

/* ---- shared socket helpers --------------------------------------------------------------- */

static rf_status zmq_fail(const char *what, const char *endpoint) {
    return rf_error(RF_ERR_IO, "%s %s: %s", what, endpoint, zmq_strerror(zmq_errno()));
}

static int ms(double s) { return s <= 0 ? 0 : (int)ceil(s * 1000.0); }

/* Sends [ident] + tag + protobuf; flags ZMQ_DONTWAIT or 0 (then SNDTIMEO bounds it).
 * Returns 0 or the errno. */
static int send_frames(void *sock, const uint8_t *ident, size_t ident_len, rf_msg_type type,
                       const ProtobufCMessage *m, int flags) {
    uint8_t *buf;
    size_t len;
    if (rf_msg_encode(type, m, &buf, &len) != RF_OK) return EINVAL;
    int rc = 0;
    if (ident && zmq_send(sock, ident, ident_len, ZMQ_SNDMORE | flags) < 0) rc = zmq_errno();
    if (!rc && zmq_send(sock, buf, len, flags) < 0) rc = zmq_errno();
    free(buf);
    return rc;
}

/* Receives one multi-part message: up to two frames are kept (ident + payload for a ROUTER,
 * payload for a DEALER), further frames counted in *extra and dropped. */
static int recv_parts(void *sock, zmq_msg_t *parts, int want, int *extra) {
    *extra = 0;
    int got = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            for (int i = 0; i < got; i++) zmq_msg_close(&parts[i]);
            return -1;
        }
        more = zmq_msg_more(&m);
        if (got < want) parts[got++] = m;
        else (*extra)++, zmq_msg_close(&m);
    }
    for (int i = got; i < want; i++) zmq_msg_init(&parts[i]);
    return got;
}

static rf_status make_socket(void **ctx, int *own_ctx, void *shared, void **sock, int type,
                             double send_timeout_s) {
    *own_ctx = shared == NULL;
    *ctx = shared ? shared : zmq_ctx_new();
    if (!*ctx) return rf_error(RF_ERR_IO, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    *sock = zmq_socket(*ctx, type);
    if (!*sock) return rf_error(RF_ERR_IO, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    int zero = 0, sndtimeo = ms(send_timeout_s);
    zmq_setsockopt(*sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(*sock, ZMQ_SNDTIMEO, &sndtimeo, sizeof sndtimeo);
    return RF_OK;
}

static void close_socket(void *ctx, int own_ctx, void *sock, int linger_ms) {
    if (sock) {
        zmq_setsockopt(sock, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
        zmq_close(sock);
    }
    if (ctx && own_ctx) zmq_ctx_term(ctx);
}

/* Starts a ZeroMQ socket monitor on `sock` (zmq_socket_monitor) and connects a PAIR socket to
 * it. Names are unique per process: a closed socket's monitor endpoint is released only
 * later, by ZeroMQ's reaper. */
static rf_status open_monitor(void *ctx, void *sock, int events, void **mon,
                              const char *endpoint) {
    static atomic_uint seq;
    char name[96];
    snprintf(name, sizeof name, "inproc://rf-msg-monitor-%d-%u", (int)getpid(),
             atomic_fetch_add(&seq, 1u));
    if (zmq_socket_monitor(sock, name, events) != 0) return zmq_fail("cannot monitor", endpoint);
    *mon = zmq_socket(ctx, ZMQ_PAIR);
    int zero = 0;
    if (*mon) zmq_setsockopt(*mon, ZMQ_LINGER, &zero, sizeof zero);
    if (!*mon || zmq_connect(*mon, name) != 0) return zmq_fail("cannot monitor", endpoint);
    return RF_OK;
}

static void close_monitor(void *sock, void *mon) {
    if (!mon) return;
    zmq_socket_monitor(sock, NULL, 0);
    zmq_close(mon);
}

/* Reads one monitor event without waiting (a 6-byte frame: uint16 event, uint32 value, host
 * order; then the endpoint frame). 0 when none is pending. */
static int read_event(void *mon, uint16_t *event, uint32_t *value) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, mon, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m);
        return 0;
    }
    int ok = zmq_msg_size(&m) >= 6;
    if (ok) {
        memcpy(event, zmq_msg_data(&m), 2);
        memcpy(value, (const uint8_t *)zmq_msg_data(&m) + 2, 4);
    }
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    while (more) {
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, mon, ZMQ_DONTWAIT) < 0) more = 0;
        else more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    if (!ok) *event = 0, *value = 0;
    return 1;
}

/* ---- server ------------------------------------------------------------------------------ */

typedef struct srv_peer {
    int id;
    uint8_t ident[256];
    size_t ident_len;
    double last_seen;  /* rf_time_now() of its last message, shifted past non-listening gaps */
    int lost;          /* a send failed: reported (and removed) by the next poll */
    char lost_text[512];
    rf_msg_peer_info info;
} srv_peer;

struct rf_msg_server {
    void *ctx, *sock;
    rf_msg_zap *zap;        /* CURVE only: the ZAP handler (its own thread) */
    void *mon;              /* CURVE only: the ROUTER's monitor, for failed handshakes */
    char last_refusal[768]; /* the last handshake refusal reported, and when: repeats are quiet */
    double last_refusal_at;
    int own_ctx;
    char endpoint[256];
    rf_msg_server_config cfg;
    double hb;  /* ping interval, s */
    srv_peer *peers;
    int n_peers, cap_peers, next_id;
    /* lookups for thousands of peers: index in peers by id (-1: none) and an open-addressing
     * hash of routing ids (-1: empty), rebuilt when a peer leaves */
    int *slot_of_id, cap_ids;
    int *htab, hcap;
    double next_check;  /* no peer can time out before this; 0: scan at the next poll */
    double last_ping, last_active;
    double last_drop;   /* when a peer was last sent an Error and forgotten (it may reconnect) */
    uint64_t ping_seq;
};

/* CURVE on the ROUTER: the ZAP handler is bound first, so that no connection is ever admitted
 * without it (libzmq lets every CURVE client in when no handler is bound). */
static rf_status server_curve(rf_msg_server *s, const rf_msg_server_config *cfg,
                              const char *endpoint) {
    char what[320];
    snprintf(what, sizeof what, "message server %s: the CURVE secret key", endpoint);
    RF_TRY(rf_curve_check(cfg->curve_secret_key, what));
    int n = cfg->n_curve_clients;
    if (n < 1 || !cfg->curve_clients)
        return rf_error(RF_ERR_ARG, "message server %s: CURVE needs at least one allowed client "
                                    "public key", endpoint);
    rf_curve_key *keys = rf_calloc((size_t)n, sizeof *keys);
    if (!keys) return RF_ERR_NOMEM;
    rf_status st = RF_OK;
    for (int i = 0; i < n && st == RF_OK; i++) {
        snprintf(what, sizeof what, "message server %s: allowed client key %d", endpoint, i + 1);
        st = rf_curve_check(cfg->curve_clients[i], what);
        if (st == RF_OK) memcpy(keys[i], cfg->curve_clients[i], sizeof keys[i]);
    }
    if (st == RF_OK && !zmq_has("curve"))
        st = rf_error(RF_ERR_UNSUPPORTED, "message server %s: this libzmq has no CURVE support",
                      endpoint);
    if (st == RF_OK) st = rf_msg_zap_start(&s->zap, s->ctx, endpoint, keys, n);
    free(keys);
    RF_TRY(st);
    int one = 1;
    if (zmq_setsockopt(s->sock, ZMQ_CURVE_SERVER, &one, sizeof one) != 0 ||
        zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, cfg->curve_secret_key, RF_CURVE_KEY_LEN) != 0 ||
        zmq_setsockopt(s->sock, ZMQ_ZAP_DOMAIN, "rlflow", 6) != 0)
        return zmq_fail("cannot set up CURVE on", endpoint);
    return open_monitor(s->ctx, s->sock,
                        ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                        &s->mon, endpoint);
}

rf_status rf_msg_server_open(rf_msg_server **out, const char *endpoint,
                             const rf_msg_server_config *cfg) {
    *out = NULL;
    if (!endpoint || !*endpoint || strlen(endpoint) >= 256)
        return rf_error(RF_ERR_ARG, "message server: missing or overlong endpoint");
    if (!cfg || !(cfg->peer_timeout_s > 0) || cfg->heartbeat_s < 0)
        return rf_error(RF_ERR_ARG, "message server %s: peer timeout must be > 0 s", endpoint);
    rf_msg_server *s = rf_calloc(1, sizeof *s);
    if (!s) return RF_ERR_NOMEM;
    s->cfg = *cfg;
    s->hb = cfg->heartbeat_s > 0 ? cfg->heartbeat_s : fmin(1.0, cfg->peer_timeout_s / 4);
    s->next_id = 1;
    rf_status st = make_socket(&s->ctx, &s->own_ctx, cfg->zmq_ctx, &s->sock, ZMQ_ROUTER,
                               cfg->peer_timeout_s);
    int one = 1;
    if (st == RF_OK) zmq_setsockopt(s->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    /* ZeroMQ reads a message's size before allocating it; over the limit it closes the
     * connection instead (the peer is then reported lost, mark_lost) */
    if (st == RF_OK && cfg->max_msg_bytes > 0 &&
        zmq_setsockopt(s->sock, ZMQ_MAXMSGSIZE, &cfg->max_msg_bytes, sizeof cfg->max_msg_bytes) != 0)
        st = zmq_fail("cannot set the message size limit of", endpoint);
    if (st == RF_OK && cfg->curve_secret_key) st = server_curve(s, cfg, endpoint);
    if (st == RF_OK && zmq_bind(s->sock, endpoint) != 0) st = zmq_fail("cannot bind", endpoint);
    size_t cap = sizeof s->endpoint;
    if (st == RF_OK && zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, s->endpoint, &cap) != 0)
        snprintf(s->endpoint, sizeof s->endpoint, "%s", endpoint);
    if (st == RF_OK && s->zap) rf_msg_zap_set_endpoint(s->zap, s->endpoint);
    if (st != RF_OK) {
        rf_msg_server_close(s, NULL);
        return st;
    }
    s->last_ping = s->last_active = rf_time_now();
    *out = s;
    return RF_OK;
}

const char *rf_msg_server_endpoint(const rf_msg_server *s) { return s->endpoint; }

static srv_peer *find_peer(const rf_msg_server *s, int id) {
    if (id < 0 || id >= s->cap_ids || s->slot_of_id[id] < 0) return NULL;
    return &s->peers[s->slot_of_id[id]];
}

static uint32_t ident_hash(const uint8_t *p, size_t n) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

static void hash_insert(rf_msg_server *s, int slot) {
    const srv_peer *p = &s->peers[slot];
    uint32_t i = ident_hash(p->ident, p->ident_len) & (uint32_t)(s->hcap - 1);
    while (s->htab[i] >= 0) i = (i + 1) & (uint32_t)(s->hcap - 1);
    s->htab[i] = slot;
}

/* Rebuilds both lookups from the peers array (after a removal or growth). */
static void reindex(rf_msg_server *s) {
    for (int i = 0; i < s->cap_ids; i++) s->slot_of_id[i] = -1;
    for (int i = 0; i < s->hcap; i++) s->htab[i] = -1;
    for (int k = 0; k < s->n_peers; k++) {
        s->slot_of_id[s->peers[k].id] = k;
        hash_insert(s, k);
    }
}

/* Room in the lookups for peer id `id` and one more peer. 0 when out of memory. */
static int index_room(rf_msg_server *s, int id) {
    int rebuild = 0;
    if (id >= s->cap_ids) {
        int cap = s->cap_ids ? 2 * s->cap_ids : 64;
        while (cap <= id) cap *= 2;
        int *n = realloc(s->slot_of_id, sizeof(int) * (size_t)cap);
        if (!n) return 0;
        s->slot_of_id = n, s->cap_ids = cap, rebuild = 1;
    }
    if (2 * (s->n_peers + 1) > s->hcap) {
        int cap = s->hcap ? 2 * s->hcap : 64;
        int *n = realloc(s->htab, sizeof(int) * (size_t)cap);
        if (!n) return 0;
        s->htab = n, s->hcap = cap, rebuild = 1;
    }
    if (rebuild) reindex(s);
    return 1;
}

static srv_peer *find_ident(rf_msg_server *s, const void *ident, size_t len) {
    if (!s->hcap) return NULL;
    uint32_t i = ident_hash(ident, len) & (uint32_t)(s->hcap - 1);
    for (; s->htab[i] >= 0; i = (i + 1) & (uint32_t)(s->hcap - 1)) {
        srv_peer *p = &s->peers[s->htab[i]];
        if (p->ident_len == len && !memcmp(p->ident, ident, len)) return p;
    }
    return NULL;
}

static void remove_peer(rf_msg_server *s, srv_peer *p) {
    *p = s->peers[--s->n_peers];
    reindex(s);
}

static rf_status recv_one(rf_msg_server *s, rf_msg_event *ev);

/* Before the Shutdowns: the Hellos already waiting are answered, so that a peer that reconnects
 * (after being dropped) gets its Shutdown too. A peer dropped in the last 2 s is given up to
 * 0.5 s to come back; otherwise only what has arrived is read. Bounded either way. */
static void take_late_hellos(rf_msg_server *s) {
    double now = rf_time_now(), until = now + (s->last_drop > 0 && now - s->last_drop < 2.0 ? 0.5 : 0.0);
    for (int k = 0; k < 1000; k++) {
        double left = until - rf_time_now();
        zmq_pollitem_t it = {s->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, left > 0 ? ms(left) : 0) <= 0) return;
        rf_msg_event ev;
        memset(&ev, 0, sizeof ev);
        if (recv_one(s, &ev) != RF_OK) return;
        if (ev.kind == RF_MSG_EV_MESSAGE) rf_msg_free(&ev.msg);
    }
}

void rf_msg_server_close(rf_msg_server *s, const char *reason) {
    if (!s) return;
    if (s->sock && reason) take_late_hellos(s);
    Rlflow__Shutdown sd = RLFLOW__SHUTDOWN__INIT;
    sd.reason = (char *)(reason ? reason : "");
    for (int i = 0; s->sock && i < s->n_peers; i++)
        send_frames(s->sock, s->peers[i].ident, s->peers[i].ident_len, RF_MSG_SHUTDOWN, &sd.base,
                    ZMQ_DONTWAIT);
    close_monitor(s->sock, s->mon);
    rf_msg_zap_stop(s->zap);
    /* a short linger so the Shutdowns leave before the socket goes; bounded */
    close_socket(s->ctx, s->own_ctx, s->sock, s->n_peers ? 500 : 0);
    free(s->peers);
    free(s->slot_of_id), free(s->htab);
    free(s);
}

const rf_msg_peer_info *rf_msg_server_peer(const rf_msg_server *s, int peer) {
    const srv_peer *p = find_peer(s, peer);
    return p && !p->lost ? &p->info : NULL;
}

double rf_msg_server_silence(const rf_msg_server *s, int peer) {
    const srv_peer *p = find_peer(s, peer);
    return p ? rf_time_now() - p->last_seen : 0.0;
}

int rf_msg_server_peers(const rf_msg_server *s, int *ids, int cap) {
    int n = 0;
    for (int i = 0; i < s->n_peers; i++)
        if (!s->peers[i].lost) {
            if (ids && n < cap) ids[n] = s->peers[i].id;
            n++;
        }
    return n;
}

static void mark_lost(rf_msg_server *s, srv_peer *p, int err) {
    if (p->lost) return;
    p->lost = 1;
    s->next_check = 0;
    if (err == EHOSTUNREACH && s->cfg.max_msg_bytes > 0) {
        /* ZeroMQ closes a connection that sends an oversize message and says nothing else */
        char lim[32];
        if (s->cfg.max_msg_bytes % (1 << 20) == 0)
            snprintf(lim, sizeof lim, "%lld MiB", (long long)(s->cfg.max_msg_bytes >> 20));
        else
            snprintf(lim, sizeof lim, "%lld-byte", (long long)s->cfg.max_msg_bytes);
        snprintf(p->lost_text, sizeof p->lost_text, "%s disconnected (it exited, closed its "
                 "socket, or sent a message over the %s limit)", p->info.desc, lim);
    } else if (err == EHOSTUNREACH)
        snprintf(p->lost_text, sizeof p->lost_text, "%s disconnected", p->info.desc);
    else if (err == EAGAIN)
        snprintf(p->lost_text, sizeof p->lost_text,
                 "%s stopped reading (a send timed out after %.1f s)", p->info.desc,
                 s->cfg.peer_timeout_s);
    else
        snprintf(p->lost_text, sizeof p->lost_text, "%s: send failed: %s", p->info.desc,
                 zmq_strerror(err));
}

rf_status rf_msg_server_send(rf_msg_server *s, int peer, rf_msg_type type,
                             const ProtobufCMessage *m) {
    srv_peer *p = find_peer(s, peer);
    if (!p) return rf_error(RF_ERR_ARG, "message server %s: no peer %d", s->endpoint, peer);
    if (p->lost) return rf_error(RF_ERR_IO, "%s", p->lost_text);
    int err = send_frames(s->sock, p->ident, p->ident_len, type, m, 0);
    if (err == EINVAL) return RF_ERR_ARG;  /* rf_msg_encode recorded the message */
    if (err) {
        mark_lost(s, p, err);
        return rf_error(RF_ERR_IO, "%s", p->lost_text);
    }
    return RF_OK;
}

/* Sends peer p an Error saying why (a peer whose connection is gone cannot be reached; the
 * attempt costs nothing) and forgets it; it may reconnect. */
static void drop_peer(rf_msg_server *s, srv_peer *p, int code, const char *message, uint64_t request_id) {
    Rlflow__Error e = RLFLOW__ERROR__INIT;
    e.code = code, e.message = (char *)(message ? message : ""), e.request_id = request_id;
    send_frames(s->sock, p->ident, p->ident_len, RF_MSG_ERROR, &e.base, ZMQ_DONTWAIT);
    remove_peer(s, p);
    s->last_drop = rf_time_now();
}

void rf_msg_server_drop(rf_msg_server *s, int peer, int code, const char *message,
                        uint64_t request_id) {
    srv_peer *p = find_peer(s, peer);
    if (p) drop_peer(s, p, code, message, request_id);
}

/* Pings every peer; a ping that cannot be routed marks the peer lost (disconnected). A full
 * queue (EAGAIN) is not an error here: silence detection covers a peer that stopped reading. */
static void ping_all(rf_msg_server *s, double now) {
    Rlflow__Heartbeat hb = RLFLOW__HEARTBEAT__INIT;
    hb.seq = ++s->ping_seq;
    for (int i = 0; i < s->n_peers; i++) {
        srv_peer *p = &s->peers[i];
        if (p->lost) continue;
        int err = send_frames(s->sock, p->ident, p->ident_len, RF_MSG_HEARTBEAT, &hb.base,
                              ZMQ_DONTWAIT);
        if (err && err != EAGAIN) mark_lost(s, p, err);
    }
    s->last_ping = now;
}

/* Reports (and forgets) the first peer that is lost or silent past the timeout. */
/* Reports one lost peer, scanning the peers only when one may be lost (a send failed, or the
 * earliest possible timeout has come): with thousands of peers a scan per event would cost
 * more than the events. */
static int report_lost(rf_msg_server *s, double now, rf_msg_event *ev) {
    if (now < s->next_check) return 0;
    double next = INFINITY;
    for (int i = 0; i < s->n_peers; i++) {
        srv_peer *p = &s->peers[i];
        double silent = now - p->last_seen;
        if (!p->lost && silent <= s->cfg.peer_timeout_s) {
            next = fmin(next, p->last_seen + s->cfg.peer_timeout_s + 1e-3);
            continue;
        }
        ev->kind = RF_MSG_EV_LOST, ev->peer = p->id, ev->info = p->info, ev->silent = !p->lost;
        if (p->lost) snprintf(ev->text, sizeof ev->text, "%s", p->lost_text);
        else snprintf(ev->text, sizeof ev->text, "%s sent nothing for %.1f s", p->info.desc, silent);
        drop_peer(s, p, RF_ERR_IO, ev->text, 0); /* a silent peer's connection may still be open */
        s->next_check = 0; /* there may be more */
        return 1;
    }
    s->next_check = s->cfg.peer_timeout_s > 0 ? next : INFINITY;
    return 0;
}

static void describe(char *out, size_t cap, const Rlflow__Hello *h, const char *endpoint,
                     int with_rank) {
    char name[80] = "";
    if (h->name && *h->name) snprintf(name, sizeof name, " '%.63s'", h->name);
    if (with_rank)
        snprintf(out, cap, "%s%s (rank %d, pid %d) on %s", rf_msg_role_name(h->role), name,
                 h->rank, h->pid, endpoint);
    else
        snprintf(out, cap, "%s%s (pid %d)", rf_msg_role_name(h->role), name, h->pid);
}

static void ack(rf_msg_server *s, const uint8_t *ident, size_t len, int accepted,
                const char *reason) {
    Rlflow__HelloAck a = RLFLOW__HELLO_ACK__INIT;
    a.accepted = accepted, a.reason = (char *)reason, a.protocol_version = RF_PROTOCOL_VERSION;
    a.heartbeat_interval_ms = (uint32_t)ms(s->hb);
    a.peer_timeout_ms = (uint32_t)ms(s->cfg.peer_timeout_s);
    send_frames(s->sock, ident, len, RF_MSG_HELLO_ACK, &a.base, ZMQ_DONTWAIT);
}

/* The handshake: refuse (REFUSED, with the same sentence sent back) or register (JOINED). */
static void on_hello(rf_msg_server *s, const uint8_t *ident, size_t len, const uint8_t *buf,
                     size_t n, rf_msg_event *ev) {
    rf_msg m;
    char who[160];
    ev->kind = RF_MSG_EV_REFUSED;
    if ((s->cfg.check_utf8 ? rf_msg_decode_external(buf, n, &m, NULL) : rf_msg_decode(buf, n, &m)) != RF_OK) {
        snprintf(ev->text, sizeof ev->text, "a peer on %s sent a malformed Hello: %s", s->endpoint,
                 rf_error_message());
        ack(s, ident, len, 0, ev->text);
        return;
    }
    const Rlflow__Hello *h = (const Rlflow__Hello *)m.pb;
    describe(who, sizeof who, h, s->endpoint, 0);
    if (h->protocol_version != RF_PROTOCOL_VERSION)
        snprintf(ev->text, sizeof ev->text, "%s speaks protocol %u, rlflow speaks %d", who,
                 h->protocol_version, RF_PROTOCOL_VERSION);
    else if (s->cfg.accept_role && (int)h->role != s->cfg.accept_role)
        snprintf(ev->text, sizeof ev->text, "%s connected to %s, which accepts only a %s", who,
                 s->endpoint, rf_msg_role_name(s->cfg.accept_role));
    else if (len > sizeof s->peers[0].ident)
        snprintf(ev->text, sizeof ev->text, "%s: routing id longer than 256 bytes", who);
    else if (s->n_peers == s->cap_peers) {
        int cap = s->cap_peers ? 2 * s->cap_peers : 8;
        srv_peer *np = realloc(s->peers, sizeof *np * (size_t)cap);
        if (np) s->peers = np, s->cap_peers = cap;
        else snprintf(ev->text, sizeof ev->text, "%s: out of memory registering it", who);
    }
    if (!ev->text[0] && !index_room(s, s->next_id))
        snprintf(ev->text, sizeof ev->text, "%s: out of memory registering it", who);
    if (ev->text[0]) {
        ack(s, ident, len, 0, ev->text);
        rf_msg_free(&m);
        return;
    }
    srv_peer *p = &s->peers[s->n_peers++];
    memset(p, 0, sizeof *p);
    p->id = s->next_id++;
    memcpy(p->ident, ident, len), p->ident_len = len;
    p->last_seen = rf_time_now();
    s->slot_of_id[p->id] = s->n_peers - 1;
    hash_insert(s, s->n_peers - 1);
    s->next_check = 0;
    p->info.role = h->role, p->info.rank = h->rank, p->info.pid = h->pid;
    p->info.capacity = h->capacity > 0 ? h->capacity : 1;
    snprintf(p->info.name, sizeof p->info.name, "%s", h->name ? h->name : "");
    describe(p->info.desc, sizeof p->info.desc, h, s->endpoint, 1);
    rf_msg_free(&m);
    ack(s, ident, len, 1, "");
    ev->kind = RF_MSG_EV_JOINED, ev->peer = p->id, ev->info = p->info;
}

/* Reports a refused handshake, unless the same one was reported in the last 10 s (a refused
 * DEALER reconnects every 100 ms by itself). */
static void refuse_auth(rf_msg_server *s, rf_msg_event *ev, const char *text) {
    double now = rf_time_now();
    if (!strcmp(text, s->last_refusal) && now - s->last_refusal_at < 10) return;
    snprintf(s->last_refusal, sizeof s->last_refusal, "%s", text);
    s->last_refusal_at = now;
    ev->kind = RF_MSG_EV_REFUSED, ev->auth = 1, ev->peer = -1;
    snprintf(ev->text, sizeof ev->text, "%s", text);
}

/* Handshakes that failed before ZAP: a peer without CURVE, or with a wrong server key. A peer
 * without CURVE may also close first, on seeing the mismatch itself: then the failure comes
 * without details. */
static void on_server_monitor(rf_msg_server *s, rf_msg_event *ev) {
    uint16_t e;
    uint32_t v;
    while (ev->kind == RF_MSG_EV_NONE && read_event(s->mon, &e, &v)) {
        char text[768];
        if (e == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            snprintf(text, sizeof text, "refused a connection to %s: the peer closed it during "
                     "the CURVE handshake (a peer without CURVE, or with a wrong server public "
                     "key?)", s->endpoint);
        else if (e != ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)
            continue;
        else if (v == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
            snprintf(text, sizeof text, "refused a connection to %s without CURVE: this endpoint "
                     "requires CURVE (the peer needs the server's public key and a key pair of "
                     "its own whose public key is allowed)", s->endpoint);
        else if (v == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
            snprintf(text, sizeof text, "refused a connection to %s: its CURVE handshake failed "
                     "with a cryptographic error (it probably uses a wrong server public key)",
                     s->endpoint);
        else
            snprintf(text, sizeof text, "refused a connection to %s: its handshake failed (ZMTP "
                     "protocol error 0x%x)", s->endpoint, (unsigned)v);
        refuse_auth(s, ev, text);
    }
}

/* Reads one message; fills ev when it is worth reporting (left NONE otherwise). */
static rf_status recv_one(rf_msg_server *s, rf_msg_event *ev) {
    zmq_msg_t part[2];
    int extra;
    int got = recv_parts(s->sock, part, 2, &extra);
    if (got < 0) {
        if (zmq_errno() == EAGAIN || zmq_errno() == EINTR) return RF_OK;
        return zmq_fail("receiving on", s->endpoint);
    }
    const uint8_t *ident = zmq_msg_data(&part[0]), *buf = zmq_msg_data(&part[1]);
    size_t ilen = zmq_msg_size(&part[0]), n = got == 2 ? zmq_msg_size(&part[1]) : 0;
    srv_peer *p = find_ident(s, ident, ilen);
    if (!p && n > 0 && buf[0] == RF_MSG_HELLO && !extra) {
        on_hello(s, ident, ilen, buf, n, ev);
    } else if (!p) {
        /* Not registered: a peer declared lost that kept going, or one that skipped Hello. */
        Rlflow__Error e = RLFLOW__ERROR__INIT;
        e.code = RF_ERR_ARG;
        e.message = "not registered with rlflow (send Hello first; a peer declared lost must "
                    "reconnect with a new socket)";
        send_frames(s->sock, ident, ilen, RF_MSG_ERROR, &e.base, ZMQ_DONTWAIT);
    } else if (!p->lost) {
        p->last_seen = rf_time_now();
        rf_msg m = {0};
        rf_status st = extra ? rf_error(RF_ERR_FORMAT, "%d frames in one message, expected 1",
                                        extra + 1)
                     : s->cfg.check_utf8 ? rf_msg_decode_external(buf, n, &m, &ev->request_id)
                                         : rf_msg_decode(buf, n, &m);
        ev->peer = p->id, ev->info = p->info;
        if (st != RF_OK) {
            ev->kind = RF_MSG_EV_MALFORMED;
            snprintf(ev->text, sizeof ev->text, "%s sent a malformed message: %s", p->info.desc,
                     rf_error_message());
        } else if (m.type == RF_MSG_HEARTBEAT || m.type == RF_MSG_HELLO) {
            rf_msg_free(&m);  /* liveness only; a repeated Hello changes nothing */
            ev->peer = -1;
        } else {
            ev->kind = RF_MSG_EV_MESSAGE, ev->msg = m;
        }
    }
    zmq_msg_close(&part[0]), zmq_msg_close(&part[1]);
    return RF_OK;
}

void rf_msg_server_keepalive(rf_msg_server *s) {
    double now = rf_time_now();
    if (now - s->last_ping >= s->hb) ping_all(s, now);
}

rf_status rf_msg_server_poll(rf_msg_server *s, double timeout_s, rf_msg_event *ev) {
    memset(ev, 0, sizeof *ev);
    ev->kind = RF_MSG_EV_NONE, ev->peer = -1;
    double now = rf_time_now();
    /* Time spent away from this loop is not the peers' silence: nobody pinged them. */
    double gap = now - s->last_active;
    if (gap > s->hb) {
        for (int i = 0; i < s->n_peers; i++) s->peers[i].last_seen = fmin(now, s->peers[i].last_seen + gap);
        s->next_check = 0;
    }
    double deadline = now + (timeout_s > 0 ? timeout_s : 0);
    rf_status st = RF_OK;
    for (;;) {
        now = rf_time_now();
        if (now - s->last_ping >= s->hb) ping_all(s, now);
        if (report_lost(s, now, ev)) break;
        double wait = fmin(fmin(deadline - now, s->last_ping + s->hb - now), s->next_check - now);
        if (s->zap && rf_msg_zap_refusal(s->zap, ev->text, sizeof ev->text)) {
            ev->kind = RF_MSG_EV_REFUSED, ev->auth = 1;
            break;
        }
        /* with CURVE, wake at least every 0.25 s for the ZAP thread's refusals */
        if (s->zap) wait = fmin(wait, 0.25);
        zmq_pollitem_t it[2] = {{s->sock, 0, ZMQ_POLLIN, 0}, {s->mon, 0, ZMQ_POLLIN, 0}};
        int rc = zmq_poll(it, s->mon ? 2 : 1, wait > 0 ? ms(wait) : 0);
        if (rc < 0 && zmq_errno() != EINTR) {
            st = zmq_fail("polling", s->endpoint);
            break;
        }
        if (rc > 0) {
            if (s->mon && (it[1].revents & ZMQ_POLLIN)) on_server_monitor(s, ev);
            if (ev->kind == RF_MSG_EV_NONE && (it[0].revents & ZMQ_POLLIN)) st = recv_one(s, ev);
            if (st != RF_OK || ev->kind != RF_MSG_EV_NONE) break;
            continue;
        }
        if (rf_time_now() >= deadline) break;
    }
    s->last_active = rf_time_now();
    return st;
}

/* ---- client ------------------------------------------------------------------------------ */

struct rf_msg_client {
    void *ctx, *sock;
    void *mon;              /* the DEALER's monitor, NULL without cfg.monitor or CURVE */
    int own_ctx;
    char endpoint[256];
    double hb, peer_timeout;
    int curve;              /* connected with CURVE */
    rf_curve_key pub;       /* this client's public key (CURVE), for messages */
    int established;        /* a ZeroMQ handshake succeeded on this socket */
    int disconnected;       /* ... and that connection closed since */
    int weak_failures;      /* handshakes the server closed without a reason, in a row */
    char fail[640];         /* why the connection cannot work; "" while it can */
};

static void client_free(rf_msg_client *c, int linger_ms) {
    close_monitor(c->sock, c->mon);
    close_socket(c->ctx, c->own_ctx, c->sock, linger_ms);
    free(c);
}

void rf_msg_client_close(rf_msg_client *c) {
    if (!c) return;
    /* a bounded linger so a last response still leaves */
    client_free(c, 500);
}

/* A handshake the server refused: the sentence the user gets. */
static void client_refused(rf_msg_client *c, uint16_t e, uint32_t v) {
    if (e == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && v == 400)
        snprintf(c->fail, sizeof c->fail, "refused by rlflow at %s: CURVE authentication failed "
                 "(ZAP status 400): this client's public key %s is not among the keys it allows",
                 c->endpoint, c->pub);
    else if (e == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
        snprintf(c->fail, sizeof c->fail, "refused by rlflow at %s: CURVE authentication failed "
                 "(ZAP status %u)", c->endpoint, (unsigned)v);
    else if (v == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH && !c->curve)
        snprintf(c->fail, sizeof c->fail, "rlflow at %s requires CURVE: connect with its public "
                 "key and a key pair of this program's own whose public key it allows "
                 "(docs/reward-api.md, \"CURVE\")", c->endpoint);
    else if (v == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        snprintf(c->fail, sizeof c->fail, "rlflow at %s does not use CURVE, but this client was "
                 "given a server key: connect without CURVE", c->endpoint);
    else
        snprintf(c->fail, sizeof c->fail, "the handshake with rlflow at %s failed (ZMTP protocol "
                 "error 0x%x)", c->endpoint, (unsigned)v);
}

/* The server closed the connection during the handshake, again and again, without saying why.
 * With CURVE: it could not decrypt our Hello (a wrong server key). Without: it requires CURVE
 * (a ZMTP mechanism mismatch that the peer reported by closing before this side could read
 * its greeting: a race the monitor loses now and then). */
static void weak_failure(rf_msg_client *c) {
    if (c->curve)
        snprintf(c->fail, sizeof c->fail, "the CURVE handshake with rlflow at %s failed %d times "
                 "(the server closed the connection each time): is the server public key right?",
                 c->endpoint, c->weak_failures);
    else
        snprintf(c->fail, sizeof c->fail, "the handshake with rlflow at %s failed %d times (the "
                 "server closed the connection each time): it probably requires CURVE; connect "
                 "with its public key and a key pair of this program's own whose public key it "
                 "allows (docs/reward-api.md, \"CURVE\")", c->endpoint, c->weak_failures);
}

/* Reads the monitor's pending events; 1 when the connection cannot work (c->fail says why). */
static int client_watch(rf_msg_client *c) {
    uint16_t e;
    uint32_t v;
    while (!c->fail[0] && c->mon && read_event(c->mon, &e, &v)) {
        if (e == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) c->established = 1, c->weak_failures = 0;
        else if (e == ZMQ_EVENT_DISCONNECTED && c->established) c->disconnected = 1;
        else if (e == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH || e == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)
            client_refused(c, e, v);
        else if (e == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && ++c->weak_failures >= 3)
            weak_failure(c);
    }
    return c->fail[0] != 0;
}

int rf_msg_client_disconnected(rf_msg_client *c) {
    client_watch(c);
    return c->disconnected || c->fail[0];
}

void *rf_msg_client_socket(rf_msg_client *c) { return c->sock; }

void rf_msg_client_timing(const rf_msg_client *c, double *heartbeat_s, double *peer_timeout_s) {
    if (heartbeat_s) *heartbeat_s = c->hb;
    if (peer_timeout_s) *peer_timeout_s = c->peer_timeout;
}

rf_status rf_msg_client_send(rf_msg_client *c, rf_msg_type type, const ProtobufCMessage *m) {
    int err = send_frames(c->sock, NULL, 0, type, m, 0);
    if (err == EINVAL) return RF_ERR_ARG;
    if (err)
        return rf_error(RF_ERR_IO, "sending a %s to rlflow at %s: %s", rf_msg_type_name(type),
                        c->endpoint, err == EAGAIN ? "timed out" : zmq_strerror(err));
    return RF_OK;
}

rf_status rf_msg_client_send_raw(rf_msg_client *c, const void *frame, size_t len) {
    if (zmq_send(c->sock, frame, len, 0) < 0)
        return rf_error(RF_ERR_IO, "sending %zu bytes to rlflow at %s: %s", len, c->endpoint,
                        zmq_errno() == EAGAIN ? "timed out" : zmq_strerror(zmq_errno()));
    return RF_OK;
}

/* The next frame within timeout_s, decoded; RF_ERR_IO (with a message) when none came;
 * RF_ERR_UNSUPPORTED when the monitor saw the handshake refused. */
static rf_status client_recv_raw(rf_msg_client *c, double timeout_s, rf_msg *out) {
    double deadline = rf_time_now() + timeout_s;
    for (;;) {
        if (client_watch(c)) return rf_error(RF_ERR_UNSUPPORTED, "%s", c->fail);
        double wait = deadline - rf_time_now();
        zmq_pollitem_t it[2] = {{c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0}};
        int rc = zmq_poll(it, c->mon ? 2 : 1, wait > 0 ? ms(wait) : 0);
        if (rc < 0 && zmq_errno() != EINTR) return zmq_fail("polling", c->endpoint);
        if (rc > 0 && (it[0].revents & ZMQ_POLLIN)) {
            zmq_msg_t part;
            int extra;
            if (recv_parts(c->sock, &part, 1, &extra) < 0) continue;
            rf_status st = extra ? rf_error(RF_ERR_FORMAT, "%d frames in one message", extra + 1)
                                 : rf_msg_decode(zmq_msg_data(&part), zmq_msg_size(&part), out);
            zmq_msg_close(&part);
            if (st != RF_OK)
                return rf_error_wrap(st, "rlflow at %s sent a malformed message", c->endpoint);
            return RF_OK;
        }
        if (rf_time_now() >= deadline) {
            if (client_watch(c)) return rf_error(RF_ERR_UNSUPPORTED, "%s", c->fail);
            return rf_error(RF_ERR_IO, "rlflow at %s sent nothing for %.1f s", c->endpoint,
                            timeout_s);
        }
    }
}

rf_status rf_msg_client_try_recv(rf_msg_client *c, double timeout_s, rf_msg *out, int *got) {
    *got = 0;
    out->pb = NULL;
    if (client_watch(c)) return rf_error(RF_ERR_UNSUPPORTED, "%s", c->fail);
    zmq_pollitem_t it = {c->sock, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(&it, 1, ms(timeout_s));
    if (rc < 0 && zmq_errno() != EINTR) return zmq_fail("polling", c->endpoint);
    if (rc <= 0) return RF_OK;
    RF_TRY(client_recv_raw(c, 0, out));
    if (out->type == RF_MSG_HEARTBEAT) {
        Rlflow__Heartbeat hb = RLFLOW__HEARTBEAT__INIT;
        hb.seq = ((Rlflow__Heartbeat *)out->pb)->seq;
        rf_msg_free(out);
        return rf_msg_client_send(c, RF_MSG_HEARTBEAT, &hb.base);
    }
    *got = 1;
    return RF_OK;
}

rf_status rf_msg_client_recv(rf_msg_client *c, double timeout_s, rf_msg *out) {
    for (;;) {
        RF_TRY(client_recv_raw(c, timeout_s, out));
        if (out->type != RF_MSG_HEARTBEAT) return RF_OK;
        Rlflow__Heartbeat hb = RLFLOW__HEARTBEAT__INIT;
        hb.seq = ((Rlflow__Heartbeat *)out->pb)->seq;
        rf_msg_free(out);
        RF_TRY(rf_msg_client_send(c, RF_MSG_HEARTBEAT, &hb.base));
    }
}

static rf_status client_handshake(rf_msg_client *c, const rf_msg_client_config *cfg) {
    char host[128] = "";
    gethostname(host, sizeof host - 1);
    Rlflow__Hello h = RLFLOW__HELLO__INIT;
    h.protocol_version = cfg->protocol_version ? cfg->protocol_version : RF_PROTOCOL_VERSION;
    h.role = cfg->role, h.rank = cfg->rank, h.pid = (int32_t)getpid();
    h.name = (char *)(cfg->name ? cfg->name : ""), h.capacity = cfg->capacity, h.hostname = host;
    RF_TRY(rf_msg_client_send(c, RF_MSG_HELLO, &h.base));
    rf_msg m;
    rf_status got = client_recv_raw(c, cfg->timeout_s, &m);
    if (got == RF_ERR_UNSUPPORTED) return got;  /* the handshake was refused: c->fail */
    if (got == RF_ERR_IO && strstr(rf_error_message(), "sent nothing"))
        return rf_error(RF_ERR_IO, "rlflow at %s did not answer Hello within %.1f s%s",
                        c->endpoint, cfg->timeout_s,
                        c->weak_failures ? " (the server closed the connection during the "
                                           "handshake: check its CURVE settings)" : "");
    if (got != RF_OK) return rf_error_wrap(got, "waiting for the HelloAck of rlflow at %s",
                                           c->endpoint);
    rf_status st = RF_OK;
    const Rlflow__HelloAck *a = (const Rlflow__HelloAck *)m.pb;
    if (m.type != RF_MSG_HELLO_ACK)
        st = rf_error(RF_ERR_FORMAT, "rlflow at %s answered Hello with a %s", c->endpoint,
                      rf_msg_type_name(m.type));
    else if (!a->accepted)
        st = rf_error(RF_ERR_UNSUPPORTED, "refused by rlflow at %s: %s", c->endpoint, a->reason);
    else if (a->protocol_version != h.protocol_version)
        st = rf_error(RF_ERR_UNSUPPORTED, "rlflow at %s speaks protocol %u, this %s speaks %u",
                      c->endpoint, a->protocol_version, rf_msg_role_name(cfg->role),
                      h.protocol_version);
    else
        c->hb = a->heartbeat_interval_ms / 1000.0, c->peer_timeout = a->peer_timeout_ms / 1000.0;
    rf_msg_free(&m);
    return st;
}

/* CURVE on the DEALER: the server's public key and this client's key pair, checked first so a
 * mistyped key is named instead of failing as a silent handshake. */
static rf_status client_curve(rf_msg_client *c, const rf_msg_client_config *cfg) {
    RF_TRY(rf_curve_check(cfg->curve_server_key, "the server's CURVE public key"));
    if (!cfg->curve_secret_key)
        return rf_error(RF_ERR_ARG, "a CURVE server key needs this client's own key pair too "
                                    "(its secret key; rlflow keygen writes one)");
    RF_TRY(rf_curve_check(cfg->curve_secret_key, "this client's CURVE secret key"));
    RF_TRY(rf_curve_public(cfg->curve_secret_key, c->pub));
    if (cfg->curve_public_key) {
        RF_TRY(rf_curve_check(cfg->curve_public_key, "this client's CURVE public key"));
        if (strcmp(cfg->curve_public_key, c->pub) != 0)
            return rf_error(RF_ERR_ARG, "this client's CURVE public key %s is not the one of its "
                                        "secret key (%s): the two files are not one pair",
                            cfg->curve_public_key, c->pub);
    }
    if (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, cfg->curve_server_key, RF_CURVE_KEY_LEN) ||
        zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, c->pub, RF_CURVE_KEY_LEN) ||
        zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, cfg->curve_secret_key, RF_CURVE_KEY_LEN))
        return zmq_fail("cannot set up CURVE for", cfg->endpoint);
    c->curve = 1;
    return RF_OK;
}

rf_status rf_msg_client_connect(rf_msg_client **out, const rf_msg_client_config *cfg) {
    *out = NULL;
    if (!cfg || !cfg->endpoint || !*cfg->endpoint || strlen(cfg->endpoint) >= 256 ||
        !(cfg->timeout_s > 0))
        return rf_error(RF_ERR_ARG, "message client: an endpoint and a timeout > 0 are needed");
    rf_msg_client *c = rf_calloc(1, sizeof *c);
    if (!c) return RF_ERR_NOMEM;
    snprintf(c->endpoint, sizeof c->endpoint, "%s", cfg->endpoint);
    rf_status st = make_socket(&c->ctx, &c->own_ctx, cfg->zmq_ctx, &c->sock, ZMQ_DEALER,
                               cfg->timeout_s);
    if (st == RF_OK && cfg->curve_server_key) st = client_curve(c, cfg);
    if (st == RF_OK && (cfg->monitor || c->curve))
        st = open_monitor(c->ctx, c->sock,
                          ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                              ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                              ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_DISCONNECTED,
                          &c->mon, cfg->endpoint);
    if (st == RF_OK && zmq_connect(c->sock, cfg->endpoint) != 0)
        st = zmq_fail("cannot connect to", cfg->endpoint);
    if (st == RF_OK) st = client_handshake(c, cfg);
    if (st != RF_OK) {
        client_free(c, 0);
        return st;
    }
    *out = c;
    return RF_OK;
}

void rf_msg_dial_apply(const rf_msg_dial *d, rf_msg_client_config *cc) {
    cc->endpoint = d->endpoint;
    if (!d->server_key[0]) return;
    cc->curve_server_key = d->server_key;
    cc->curve_public_key = d->public_key;
    cc->curve_secret_key = d->secret_key;
}
