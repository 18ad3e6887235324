/* docs/reward-api.md's worked example, byte by byte: every "<!-- bytes: NAME -->" block of the
 * page (hex bytes at the start of each line, the explanation after them) is exactly what
 * rlflow's encoder (common/msg.c over protoc-c) produces for the message the page describes,
 * and decodes back to it; so does the unpacked form of per-token rewards the page says
 * decoders accept. A page that drifts from the encoder, or a block that disappears, fails. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>

#include "common/msg.h"
#include "common/util.h"
#include "test_util.h"

/* The bytes of the block after "<!-- bytes: name -->" (n), or -1 when the page has none. */
static int doc_bytes(const char *page, const char *name, uint8_t *out, int cap) {
    char marker[128];
    snprintf(marker, sizeof marker, "<!-- bytes: %s -->\n```\n", name);
    const char *p = strstr(page, marker);
    if (!p) return -1;
    p += strlen(marker);
    int n = 0;
    while (*p && strncmp(p, "```", 3) != 0) {
        /* leading two-digit hex tokens; the first other word ends the bytes of the line */
        while (isxdigit((unsigned char)p[0]) && isxdigit((unsigned char)p[1]) &&
               (p[2] == ' ' || p[2] == '\n') && n < cap) {
            unsigned v;
            sscanf(p, "%2x", &v);
            out[n++] = (uint8_t)v;
            p += 2;
            if (*p == ' ') p++;
        }
        while (*p && *p != '\n') p++;
        if (*p) p++;
    }
    return n;
}

static void check(const char *page, const char *name, rf_msg_type t, const ProtobufCMessage *m) {
    uint8_t doc[512], *enc;
    size_t len;
    int n = doc_bytes(page, name, doc, sizeof doc);
    CHECK_OK(rf_msg_encode(t, m, &enc, &len));
    int same = n == (int)len && !memcmp(doc, enc, len);
    CHECK(same);
    if (!same) {
        fprintf(stderr, "  %s: the page has %d bytes, rlflow encodes %zu:\n   ", name, n, len);
        for (size_t i = 0; i < len; i++) fprintf(stderr, " %02x", enc[i]);
        fprintf(stderr, "\n");
    }
    /* and the page's bytes decode to the same message */
    rf_msg back;
    int ok = n > 0 && rf_msg_decode(doc, (size_t)n, &back) == RF_OK && back.type == t;
    CHECK(ok);
    if (ok) {
        uint8_t *again;
        size_t len2;
        CHECK_OK(rf_msg_encode(t, back.pb, &again, &len2));
        CHECK(len2 == len && !memcmp(again, enc, len));
        free(again);
        rf_msg_free(&back);
    }
    free(enc);
    printf("%-24s %3d bytes on the page, as encoded\n", name, n);
}

int main(void) {
    const char *src = getenv("RF_SOURCE_DIR");
    if (!src) {
        printf("test_reward_doc: RF_SOURCE_DIR not set (run through ctest); skipped\n");
        return 77;
    }
    char path[1024], *page = NULL;
    size_t n;
    snprintf(path, sizeof path, "%s/docs/reward-api.md", src);
    CHECK_OK(rf_read_file(path, &page, &n));
    if (!page) return rf_test_finish("test_reward_doc");

    Rlflow__Hello h = RLFLOW__HELLO__INIT;
    h.protocol_version = 1, h.role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM, h.pid = 4242;
    h.name = "length_judge", h.capacity = 8;
    check(page, "Hello", RF_MSG_HELLO, &h.base);

    Rlflow__HelloAck a = RLFLOW__HELLO_ACK__INIT;
    a.accepted = 1, a.protocol_version = 1, a.heartbeat_interval_ms = 250, a.peer_timeout_ms = 30000;
    check(page, "HelloAck", RF_MSG_HELLO_ACK, &a.base);

    int32_t pids[] = {17, 10, 17, 28}, rids[] = {19};
    Rlflow__RewardRequest q = RLFLOW__REWARD_REQUEST__INIT;
    q.request_id = 17, q.prompt = "2+2=", q.response = "4", q.prompt_ids = pids, q.n_prompt_ids = 4;
    q.response_ids = rids, q.n_response_ids = 1, q.ground_truth = "4";
    q.metadata_json = "{\"level\": 1}", q.sample_index = 1, q.group_id = 3;
    check(page, "RewardRequest", RF_MSG_REWARD_REQUEST, &q.base);

    Rlflow__RewardResponse r = RLFLOW__REWARD_RESPONSE__INIT;
    Rlflow__RewardResponse__ComponentsEntry e1 = RLFLOW__REWARD_RESPONSE__COMPONENTS_ENTRY__INIT,
                                            e2 = RLFLOW__REWARD_RESPONSE__COMPONENTS_ENTRY__INIT;
    e1.key = "correct", e1.value = 1, e2.key = "length", e2.value = 1;
    Rlflow__RewardResponse__ComponentsEntry *comps[] = {&e1, &e2};
    r.request_id = 17, r.reward = 0.75f, r.components = comps, r.n_components = 2, r.info = "ok";
    check(page, "RewardResponse", RF_MSG_REWARD_RESPONSE, &r.base);

    float tok[] = {0.5f, -0.25f, 0.0f};
    Rlflow__RewardResponse rt = RLFLOW__REWARD_RESPONSE__INIT;
    rt.request_id = 19, rt.reward = 1.5f, rt.token_rewards = tok, rt.n_token_rewards = 3;
    check(page, "RewardResponse token_rewards", RF_MSG_REWARD_RESPONSE, &rt.base);
    /* the unpacked form the page says decoders accept: one fixed-32 record (key 0x35) each */
    const uint8_t unpacked[] = {0x11, 0x08, 0x13, 0x15, 0x00, 0x00, 0xc0, 0x3f,
                                0x35, 0x00, 0x00, 0x00, 0x3f, 0x35, 0x00, 0x00, 0x80, 0xbe,
                                0x35, 0x00, 0x00, 0x00, 0x00};
    rf_msg um;
    int decoded = rf_msg_decode(unpacked, sizeof unpacked, &um) == RF_OK;
    const Rlflow__RewardResponse *ur = decoded ? (const Rlflow__RewardResponse *)um.pb : NULL;
    CHECK(ur && ur->request_id == 19 && ur->n_token_rewards == 3 && ur->token_rewards[0] == 0.5f &&
          ur->token_rewards[1] == -0.25f && ur->token_rewards[2] == 0.0f);
    if (decoded) rf_msg_free(&um);

    Rlflow__Heartbeat hb = RLFLOW__HEARTBEAT__INIT;
    hb.seq = 5;
    check(page, "Heartbeat", RF_MSG_HEARTBEAT, &hb.base);

    Rlflow__Shutdown sd = RLFLOW__SHUTDOWN__INIT;
    sd.reason = RF_MSG_SHUTDOWN_DONE;
    check(page, "Shutdown", RF_MSG_SHUTDOWN, &sd.base);

    int32_t neg[] = {-5};
    Rlflow__RewardRequest qn = RLFLOW__REWARD_REQUEST__INIT;
    qn.request_id = 18, qn.response_ids = neg, qn.n_response_ids = 1, qn.sample_index = -1;
    check(page, "RewardRequest negative", RF_MSG_REWARD_REQUEST, &qn.base);

    free(page);
    return rf_test_finish("test_reward_doc");
}
