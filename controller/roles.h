/* The roles the RL loop (controller/controller.c) drives, as a table of operations with a
 * context (ggml / NCCL style {iface, ctx}): rollout (a group's generate request in, samples
 * out), scorer (reward-model scores, reference log-probs, proximal log-probs, values of a
 * group's samples), trainer (a batch in, statistics and a new weights version out) and
 * checkpoint (save step N). The loop is written once against this table; two implementations
 * reach the roles:
 *   - the message one (controller/controller.c): GenerateRequest / ScoreRequest / TrainBatch /
 *     CheckpointRequest over ZeroMQ to rollout and training workers in other processes or on
 *     other machines, and the events that come back (split and colocated multi-device runs);
 *   - the in-process one (controller/roles_inproc.c): the roles called directly on rf_run's
 *     engine, actor, reference, critic and reward model, no message encoding. It queues each
 *     request and runs the queue when the loop asks for progress, a whole kind at once: every
 *     pending generate request submitted to the engine and run until idle (or as [env]
 *     episodes), every pending scoring request of a kind in one call in group order, so the
 *     one-process default keeps its batching.
 * Requests go out through the table; what comes back reaches the loop through rf_role_sink,
 * from inside progress(). */
#ifndef RF_ROLES_H
#define RF_ROLES_H

#include <stdint.h>

#include "actor/actor.h"
#include "common/status.h"
#include "controller/dataset.h"
#include "controller/metrics.h"
#include "rollout/rollout.h"
#include "trainer/checkpoint.h"

/* What a scoring request asks for (rf_role_iface.score). */
enum {
    RF_ROLE_SCORE_RM = 1,     /* reward-model scores into s[i].rm_score */
    RF_ROLE_SCORE_REF = 2,    /* reference log-probs into s[i].ref_logp */
    RF_ROLE_SCORE_VALUES = 4, /* critic values into s[i].values */
    RF_ROLE_SCORE_PROX = 8    /* proximal log-probs into s[i].prox_logp (the current actor's); a
                                 trainer that recomputes them itself (the training worker) may
                                 leave the behaviour log-probs there */
};

/* A group's generate request: n samples of the example's prompt, sampled with seed, seed + 1,
 * ... (rf__group_seed of step, round and place; greedy: validation), at weights version
 * min_version or newer. */
typedef struct rf_role_gen {
    uint64_t req;          /* the loop's request id, unique in the run */
    int64_t group_id;      /* admission id; -1: validation */
    const rf_example *ex;
    int n, greedy;
    int step, round, place; /* where the group's seed comes from (rf__group_seed) */
    uint64_t seed;
    int min_version;
} rf_role_gen;

/* Where the roles deliver what comes back (called from progress()). */
typedef struct rf_role_sink {
    void *ctx; /* the loop */
    /* sample `index` of request req, generated and scored by the reward rules (the loop takes
     * *s over: its fields are moved out and *s zeroed) */
    rf_status (*sample)(void *ctx, uint64_t req, int index, rf_train_sample *s);
    /* the scoring request req is answered: its samples hold what was asked for */
    rf_status (*scored)(void *ctx, uint64_t req);
    /* the batch for `version` - 1 is trained: the actor is at `version`; its statistics are set
     * on the run's metrics; seconds the trainer was busy */
    rf_status (*trained)(void *ctx, int version, double seconds);
    /* the checkpoint of `step` is written, in `seconds` */
    rf_status (*checkpointed)(void *ctx, int step, double seconds);
} rf_role_sink;

typedef struct rf_role_iface {
    const char *name; /* "in-process", "message" */
    /* 1: the roles run beside the loop (other processes): admission runs ahead of training as
     * far as async.max_staleness allows, and the async/ metrics are set; 0: the roles run
     * inside progress(), one step at a time (k = 0, synchronous on-policy) */
    int concurrent;
    /* the oldest weights version the rollout side serves (-1: none yet) */
    int (*served)(void *ctx);
    rf_status (*generate)(void *ctx, const rf_role_gen *q);
    /* samples s (n, owned by the loop, left in place until scored() answers) of request req;
     * flags: RF_ROLE_SCORE_* */
    rf_status (*score)(void *ctx, uint64_t req, rf_train_sample *s, int n, int flags);
    /* a batch (n samples with advantages, s taken over by the role) for the actor at `version`,
     * with KL coefficient kl_coef */
    rf_status (*train)(void *ctx, rf_train_sample *s, int n, int version, float kl_coef);
    rf_status (*checkpoint)(void *ctx, const rf_ckpt_state *st);
    /* runs or waits for work (up to timeout seconds) and delivers what came back to sink */
    rf_status (*progress)(void *ctx, double timeout, const rf_role_sink *sink);
    /* the step's deployment-specific metrics (perf/..., idle/...) on m when a step is trained;
     * step_s: its wall seconds */
    void (*step_metrics)(void *ctx, rf_metrics *m, double step_s);
} rf_role_iface;

typedef struct rf_roles {
    const rf_role_iface *iface;
    void *ctx;
} rf_roles;

struct rf_run;

/* The in-process roles over run's engine, actor, reference, critic and reward model (set up by
 * controller/run.c). rf_roles_inproc_free releases the queues, not the run. */
rf_status rf_roles_inproc_init(rf_roles *out, struct rf_run *run);
void rf_roles_inproc_free(rf_roles *roles);

#endif
