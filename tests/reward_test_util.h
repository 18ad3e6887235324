/* Shared by the reward-client and reward-bridge tests (test_reward_c, test_external_reward*):
 * a message server standing in for rlflow, bounded waits for its events, a set of
 * RewardRequests whose echoed answers can be checked field by field, the per-token rewards the
 * echo score functions give, and stderr captured to a file (to check what rlflow logs). */
#ifndef RF_REWARD_TEST_UTIL_H
#define RF_REWARD_TEST_UTIL_H

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "common/msg.h"
#include "common/util.h"
#include "reward/external.h"
#include "test_util.h"

static inline long sum_ids(const int32_t *v, size_t n) {
    long s = 0;
    for (size_t i = 0; i < n; i++) s += v[i];
    return s;
}

/* ---- server ------------------------------------------------------------------------------- */

static inline rf_msg_server *open_server(const char *ep, double peer_timeout_s) {
    rf_msg_server_config cfg = {.accept_role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM,
                                .peer_timeout_s = peer_timeout_s};
    rf_msg_server *s = NULL;
    CHECK_OK(rf_msg_server_open(&s, ep, &cfg));
    return s;
}

/* Polls until a peer joins; its id, or -1 after limit_s. */
static inline int wait_join(rf_msg_server *s, double limit_s, rf_msg_peer_info *info) {
    double t0 = rf_time_now();
    while (rf_time_now() - t0 < limit_s) {
        rf_msg_event ev;
        if (rf_msg_server_poll(s, 0.1, &ev) != RF_OK) return -1;
        if (ev.kind == RF_MSG_EV_MESSAGE) rf_msg_free(&ev.msg);
        if (ev.kind == RF_MSG_EV_JOINED) {
            if (info) *info = ev.info;
            return ev.peer;
        }
    }
    return -1;
}

/* Polls until a RewardResponse arrives (the caller frees *m); 0 after limit_s or on a LOST
 * event (counted in *lost). */
static inline int wait_response(rf_msg_server *s, double limit_s, rf_msg *m, int *from, int *lost) {
    double t0 = rf_time_now();
    while (rf_time_now() - t0 < limit_s) {
        rf_msg_event ev;
        if (rf_msg_server_poll(s, 0.05, &ev) != RF_OK) return 0;
        if (ev.kind == RF_MSG_EV_LOST) {
            if (lost) (*lost)++;
            fprintf(stderr, "  lost: %s\n", ev.text);
            return 0;
        }
        if (ev.kind != RF_MSG_EV_MESSAGE) continue;
        if (ev.msg.type == RF_MSG_REWARD_RESPONSE) {
            *m = ev.msg;
            if (from) *from = ev.peer;
            return 1;
        }
        rf_msg_free(&ev.msg);
    }
    return 0;
}

/* ---- stderr to a file ----------------------------------------------------------------------- */

/* Sends this process's stderr to `path` (truncated) until stderr_back; returns the old fd. */
static inline int stderr_to(const char *path) {
    fflush(stderr);
    int saved = dup(2), fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) dup2(fd, 2), close(fd);
    return saved;
}

static inline void stderr_back(int saved) {
    fflush(stderr);
    if (saved >= 0) dup2(saved, 2), close(saved);
}

/* ---- per-token rewards ----------------------------------------------------------------------- */

/* The per-token reward the echo score functions (tests/reward_program_echo.c, echo_score of
 * tests/test_reward_c.c, echo of tests/tools/reward_client_py.py) give token j of id `id`:
 * halves and quarters of integers below 2^20, exact in float and in double alike. */
static inline float echo_token_reward(int32_t id, size_t j) {
    return (float)id * 0.5f + 0.25f * (float)j;
}

/* 1 when v (n) holds exactly the echo per-token rewards of ids (n_ids). */
static inline int token_rewards_exact(const float *v, size_t n, const int32_t *ids, size_t n_ids) {
    if (n != n_ids) return 0;
    for (size_t j = 0; j < n; j++)
        if (v[j] != echo_token_reward(ids[j], j)) return 0;
    return 1;
}

/* ---- a batch for the bridge, scored by tests/reward_program_echo.c ----------------------------- */

#define ECHO_ITEMS 50

typedef struct echo_items {
    rf_reward_item it[ECHO_ITEMS];
    char resp[ECHO_ITEMS][32], truth[ECHO_ITEMS][32];
    int32_t ids[ECHO_ITEMS][16];
    int32_t prompt_ids[4];
} echo_items;

/* Item i: 1 + i % 13 response ids 1000 i + j, sample i % 8 of group i / 8; every 10th response
 * equals its ground truth (+100 in the echo formula). */
static inline void make_echo_items(echo_items *s) {
    for (int i = 0; i < 4; i++) s->prompt_ids[i] = 100 + i;
    for (int i = 0; i < ECHO_ITEMS; i++) {
        int n = 1 + i % 13;
        for (int j = 0; j < n; j++) s->ids[i][j] = 1000 * i + j;
        snprintf(s->resp[i], sizeof s->resp[i], "answer %d", i);
        snprintf(s->truth[i], sizeof s->truth[i], i % 10 == 0 ? "answer %d" : "%d", i);
        s->it[i] = (rf_reward_item){.prompt = "what?", .response = s->resp[i],
                                    .prompt_ids = s->prompt_ids, .n_prompt_ids = 4,
                                    .response_ids = s->ids[i], .n_response_ids = n,
                                    .truth = s->truth[i], .metadata_json = "{\"src\": \"test\"}",
                                    .index = i % 8, .group = i / 8};
    }
}

/* Scores the echo items through x with a client-library program whose score function gives
 * n_response_ids * 0.5 + index + 0.25 and the echo per-token rewards (test_reward_c's
 * echo_score, reward_client_py.py's echo); checks every reward, every per-token reward and the
 * batch's stats; returns how many items were exact. */
static inline int score_client_echo(rf_external_reward *x) {
    static echo_items s;
    make_echo_items(&s);
    float r[ECHO_ITEMS];
    CHECK_OK(rf_external_reward_score(x, s.it, ECHO_ITEMS, r));
    int exact = 0;
    for (int i = 0; i < ECHO_ITEMS; i++) {
        const float *v;
        int n = rf_external_reward_token_rewards(x, i, &v);
        exact += r[i] == (float)s.it[i].n_response_ids * 0.5f + (float)s.it[i].index + 0.25f &&
                 token_rewards_exact(v, (size_t)n, s.ids[i], (size_t)s.it[i].n_response_ids);
    }
    CHECK(exact == ECHO_ITEMS);
    rf_external_reward_stats st = rf_external_reward_last_stats(x);
    CHECK(st.accepted == ECHO_ITEMS && st.token_rewards == ECHO_ITEMS && st.rejected == 0);
    return exact;
}

/* The echo program's formula, as it computes it (float). */
static inline float echo_reward(const rf_reward_item *it) {
    return (float)it->n_response_ids + 0.01f * (float)strlen(it->response) +
           (strcmp(it->response, it->truth) == 0 ? 100.0f : 0.0f);
}

/* ---- requests ------------------------------------------------------------------------------ */

#define N_REQ 24

typedef struct req_set {
    Rlflow__RewardRequest q[N_REQ];
    char prompt[N_REQ][32], resp[N_REQ][32], truth[N_REQ][16], meta[N_REQ][32];
    int32_t pids[N_REQ][3], rids[N_REQ][8];
} req_set;

static inline void make_requests(req_set *s) {
    for (int i = 0; i < N_REQ; i++) {
        Rlflow__RewardRequest q = RLFLOW__REWARD_REQUEST__INIT;
        snprintf(s->prompt[i], sizeof s->prompt[i], "prompt %d \xc3\xa9", i);
        snprintf(s->resp[i], sizeof s->resp[i], i % 3 ? "resp \xc3\xbc %d" : "", i);
        snprintf(s->truth[i], sizeof s->truth[i], "gt%d", i);
        snprintf(s->meta[i], sizeof s->meta[i], "{\"k\": %d}", i);
        s->pids[i][0] = i, s->pids[i][1] = -i, s->pids[i][2] = 70000 * i;
        int n = i % 5;
        for (int j = 0; j < n; j++) s->rids[i][j] = -5 + 70000 * j + i;
        q.request_id = 1000 + (uint64_t)i;
        q.prompt = s->prompt[i], q.response = s->resp[i], q.ground_truth = s->truth[i];
        q.metadata_json = s->meta[i];
        q.prompt_ids = s->pids[i], q.n_prompt_ids = 3;
        q.response_ids = s->rids[i], q.n_response_ids = (size_t)n;
        q.sample_index = i == 5 ? -3 : i % 4;
        q.group_id = ((int64_t)1 << 40) + i / 4;
        s->q[i] = q;
    }
}

static inline const Rlflow__RewardResponse__ComponentsEntry *
component(const Rlflow__RewardResponse *r, const char *key) {
    for (size_t i = 0; i < r->n_components; i++)
        if (!strcmp(r->components[i]->key, key)) return r->components[i];
    return NULL;
}

/* The response to q is exactly what the echo score functions compute: the C one of
 * tests/test_reward_c.c, or, with `python`, the one of tests/tools/reward_client_py.py, whose
 * info also shows the metadata's "k" (read through Request.metadata). */
static inline int response_exact(const Rlflow__RewardRequest *q, const Rlflow__RewardResponse *r,
                          int python) {
    char info[1024];
    int len = snprintf(info, sizeof info, "id=%llu p=%s r=%s g=%s m=%s s=%lld grp=%lld",
                       (unsigned long long)q->request_id, q->prompt, q->response, q->ground_truth,
                       q->metadata_json, (long long)q->sample_index, (long long)q->group_id);
    if (python) snprintf(info + len, sizeof info - (size_t)len, " k=%d", (int)(q->request_id - 1000));
    /* exact in float and in double alike (halves and quarters of small integers), so the C
     * function (float) and the Python one (double, sent as float) give these very bits */
    float want = (float)q->n_response_ids * 0.5f + (float)q->sample_index + 0.25f;
    const Rlflow__RewardResponse__ComponentsEntry *n = component(r, "n_resp"),
                                                  *sr = component(r, "sum_resp"),
                                                  *sp = component(r, "sum_prompt");
    int ok = r->request_id == q->request_id && r->reward == want && !strcmp(r->info, info) &&
             !*r->error && r->n_components == 3 && n && n->value == (float)q->n_response_ids &&
             sr && sr->value == (float)sum_ids(q->response_ids, q->n_response_ids) && sp &&
             sp->value == (float)sum_ids(q->prompt_ids, q->n_prompt_ids) &&
             token_rewards_exact(r->token_rewards, r->n_token_rewards, q->response_ids,
                                 q->n_response_ids);
    if (!ok)
        fprintf(stderr, "  request %llu: got reward %.9g info \"%s\" error \"%s\" (%zu comps, "
                        "%zu token rewards), want %.9g \"%s\" (%zu token rewards)\n",
                (unsigned long long)q->request_id, r->reward, r->info, r->error, r->n_components,
                r->n_token_rewards, want, info, q->n_response_ids);
    return ok;
}

#endif
