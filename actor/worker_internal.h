/* The training worker's state and the pieces its files share: actor/worker.c (the loop that
 * talks to the controller), actor/worker_dp.c (data parallelism: DP rank 0 hands each DP
 * peer its share of a batch over comm; the peers train with it), actor/worker_tp.c (tensor
 * parallelism: TP rank 0 hands every TP peer the whole batch; each trains its shard of the
 * actor, and all of them send their shards to the rollout workers by resharding) and
 * actor/worker_common.c (what every rank runs: unpacking, the update, scoring passes,
 * data-parallel set-up, ZeRO-1 moments). Calls go one way: worker.c -> worker_dp.c ->
 * worker_tp.c -> worker_common.c.
 *
 * Both (placement.actor.dp = D and tp = T > 1, Megatron-LM's grid): training rank i (world
 * rank 1 + i) is TP rank t = i % T of DP replica d = i / T (tp varies fastest). The TP rank 0
 * of each replica (its "leader") is a DP rank over the leaders' DP group; world rank 1 is both
 * DP and TP rank 0. Commands flow rank 1 -> leaders (worker_dp.c) -> their TP peers
 * (worker_tp.c); every rank's DP group (dpc) holds the ranks of its TP position, and the
 * actor's gradients are summed over it (rf_dp_init_tp). Every replica sends weights (each
 * rollout worker's blocks spread over the replicas by the planner); replica 0 alone gathers
 * checkpoints.
 *
 * The critic and the reference sit on the same grid (rf_recipe_role_layout): each on the first
 * dp of the D replicas (placement.critic.dp / placement.reference.dp, 1 .. D); in each of them
 * either whole on the leader (tp 1) or split like the actor over the first tp of its TP ranks
 * (critic_tp, ref_tp; a group split from the replica's when tp is smaller than the actor's).
 * A batch is shared out twice: the actor's D token-balanced shares, and the critic's over its
 * own dp replicas (the whole batch when dp = 1); each replica receives the samples spanning
 * both of its shares and where each lies (rf__share), and trains the critic data parallel
 * over its replicas (critic_dpc) when there are several. A ScoreRequest is split over the
 * first m replicas, m the fewest that hold a model it asks for (token-balanced shares, as
 * training; m = 1: replica 0 scores it alone); within a replica the TP peers take part in the
 * passes of the split models. The reward model sits on the grid the same way
 * ([placement.reward]: whole on each replica's leader, or split over its first tp ranks). */
#ifndef RF_ACTOR_WORKER_INTERNAL_H
#define RF_ACTOR_WORKER_INTERNAL_H

#include "actor/actor.h"
#include "common/msg_link.h"
#include "common/rng.h"
#include "controller/metrics.h"
#include "controller/recipe.h"
#include "model/model_tp.h"
#include "resharding/handover.h"
#include "resharding/weights_reshard.h"
#include "resharding/weights_sync.h"
#include "reward/reward.h"
#include "trainer/checkpoint.h"
#include "trainer/data_parallel.h"

typedef struct rf__tworker {
    const rf_recipe *r;
    const rf_kernels *k;
    rf_msg_link *link;   /* DP rank 0 only */
    rf_model *actor, *ref, *critic; /* whole models; NULL where the shards below hold them (and
                                       the actor with tensor parallelism: tp->m is the shard) */
    rf_reward_model *rm; /* reward.model, on the replicas holding it: whole, or this rank's shard */
    rf_metrics *metrics; /* no files: collects one update's metrics for TrainStats */
    rf_weights_tx *tx;
    rf_comm *wcomm;
    const int *rollout;
    int n_rollout;
    int version;         /* updates done */
    rf_kl_est kl_est;
    rf_loss_agg agg;
    double busy;
    double delay_ms;   /* RF_TEST_DELAY_TRAIN_MS (tests) */
    rf_rng delay_rng;
    /* data parallelism (placement.actor.dp > 1) */
    rf_comm *dpc;        /* the DP ranks (training worker ranks; with tp the ranks of this TP
                            position, one per replica), or NULL */
    int replica;         /* tp x dp: this rank's DP replica (0: it sends weights and
                            checkpoints); 0 otherwise */
    rf_dp *dp_actor, *dp_critic; /* dp_critic: over critic_dpc, when the critic is on several replicas */
    rf_comm *critic_dpc; /* the DP ranks of the replicas holding the critic, when fewer than all of
                            them and more than one (a split of dpc; else NULL: dpc itself) */
    rf_comm *dp_dev, *critic_dev; /* model.device = "cuda": NCCL communicators over dpc and the
                            critic's group, which dp_actor and dp_critic reduce over (dpc
                            carries the host messages: shares, commands, scores) */
    rf_comm *tp_dev, *critic_tp_dev, *ref_tp_dev; /* model.device = "cuda": NCCL communicators
                            the split actor, critic and reference compute over (tpc and the
                            roles' groups carry the host messages); the roles' only when
                            their group is smaller than tpc (else tp_dev) */
    float *wstage;       /* model.device = "cuda": a host copy (shared memory) of the parameters
                            the rollout workers take by resharding, refreshed before each
                            transfer; NULL on the CPU (they read the model's own) */
    double last_cmd;     /* DP or TP rank 0: when it last sent its peers a command */
    /* tensor parallelism (placement.actor.tp > 1): the actor's shard; the reference, critic
     * and reward model are whole on TP rank 0 or split over the first ranks (below) */
    rf_comm *tpc;        /* the TP ranks (training worker ranks 1 .. tp; with dp those of this
                            rank's replica), or NULL */
    rf_model_tp *tp;     /* this rank's shard of the actor */
    rf_weights_rs *wrs;  /* its weights to the rollout workers, by resharding */
    rf_param_view *adapters; /* LoRA, the whole actor resharded (rf__rs_whole_setup): its adapters'
                            table, offsets from 0 (rf_lora_table); NULL otherwise */
    int lora_told;       /* the adapters-only sync was logged (LoRA) */
    int tp_serving;      /* TP rank 0: the peers wait for commands (after the first weights,
                            or at once in replicas other than 0) */
    uint32_t crc;        /* checksum of the weights last sent */
    rf_handover *ho;     /* colocated on several devices: this process's rollout rank takes the
                            weights here (w->wrs from rf_weights_rs_init_colocated), else NULL */
    /* the critic and the reference split over the first placement.critic.tp /
     * placement.reference.tp (> 1) ranks of the replica: this rank's shards, else NULL */
    rf_model_tp *critic_tp, *ref_tp;
    rf_comm *critic_comm, *ref_comm; /* their groups when smaller than the replica's (the first
                                        ranks of tpc; NULL on the others and when whole-sized) */
    rf_comm *rm_comm, *rm_tp_dev; /* the reward model split over placement.reward.tp ranks: its
                            group when smaller than tpc, and its NCCL one on CUDA (rm holds the
                            shard, rf_reward_model_open_tp) */
    unsigned scored;     /* rank 1: bit f set once a ScoreRequest asking for flags f was answered (its layout logged) */
    /* resuming (world rank 1): the checkpoint's directory, from which the split models' shards
     * are read, and its optimizer steps; ckpt_dir empty on a fresh start and on the peers */
    char ckpt_dir[4200];
    int actor_steps, critic_steps;
} rf__tworker;

/* The samples of a batch (or of a replica's part of it) each model trains on: the actor
 * [a_lo, a_hi), the critic [c_lo, c_hi) (empty where this rank holds no critic). */
typedef struct rf__share {
    int64_t a_lo, a_hi, c_lo, c_hi;
} rf__share;

/* What a score pass computes: reference log-probs, critic values, reward-model scores; one
 * bit per model (RF_ROLE_*). */
enum {
    RF_SCORE_REF = 1 << RF_ROLE_REFERENCE,
    RF_SCORE_VALUES = 1 << RF_ROLE_CRITIC,
    RF_SCORE_RM = 1 << RF_ROLE_REWARD,
};

/* ---- every training rank (actor/worker_common.c). The files call in one direction:
 * worker.c -> worker_dp.c -> worker_tp.c -> worker_common.c ---- */

/* This rank's part of scoring samples s (n; their ref_logp / values / rm_score filled), for the models in
 * `flags` it holds: whole ones alone, split ones with every TP rank of its replica (which call
 * it with the same samples and the split models' flags). */
rf_status rf__worker_score(rf__tworker *w, rf_train_sample *s, int n, int flags);

/* A packed TrainBatch (buf, bytes; `what` names it in errors) decoded into *b and its samples
 * into *s; free both with rf__worker_packed_free (also after an error: what was made). */
rf_status rf__worker_unpack_packed(const uint8_t *buf, size_t bytes, const char *what, Rlflow__TrainBatch **b,
                                   rf_train_sample **s);
void rf__worker_packed_free(Rlflow__TrainBatch *b, rf_train_sample *s);

/* The TrainSamples of a message as rf_train_samples (tokens and per-token arrays copied). */
rf_status rf__worker_unpack(Rlflow__TrainSample **in, size_t n, rf_train_sample **out);
void rf__worker_samples_free(rf_train_sample *s, int n);

/* The models' shares of a batch (samples s, sh's ranges in it): proximal log-probs, the
 * actor's update and the critic's, each data parallel when w has DP state for it (then every
 * rank of its DP group calls it, with its share, possibly empty; the statistics are the whole
 * batch's). prox_s / actor_s: seconds spent. */
rf_status rf__worker_update(rf__tworker *w, rf_train_sample *s, const rf__share *sh, float kl_coef,
                            rf_update_stats *as, rf_update_stats *cs, double *prox_s, double *actor_s);

/* Every rank of c (the DP or TP group; `kind` "data-parallel" or "tensor-parallel") says
 * whether it loaded (`loaded`): RF_OK when all did; else this rank's own error, or one naming
 * the first rank of c that failed. Bounded by async.startup_timeout. */
rf_status rf__worker_agree_to_start(rf__tworker *w, rf_comm *c, rf_status loaded, const char *kind);

/* A peer's (DP or TP rank > 0) update from a packed TrainBatch in buf (bytes; `what` names it
 * in errors; sh: each model's samples in it): unpacks it, takes the policy version, runs
 * rf__worker_update when `train` is 1 (-1: when the batch holds samples), and counts the new
 * version. */
rf_status rf__worker_peer_update(rf__tworker *w, const uint8_t *buf, size_t bytes, const char *what,
                                 int train, const rf__share *sh);

/* Samples [lo, hi) of b packed as a TrainBatch with b's other fields (caller frees *buf). */
rf_status rf__worker_pack_part(const Rlflow__TrainBatch *b, size_t lo, size_t hi, uint8_t **buf, uint64_t *bytes);

/* The replicas holding the critic (placement.critic.dp; the first ones), 0 without a critic. */
int rf__worker_critic_replicas(const rf__tworker *w);

/* Whether this rank's replica holds the critic / the reference / the reward model (rank 1's
 * always does when the recipe has it). */
int rf__worker_has_critic(const rf__tworker *w);
int rf__worker_has_ref(const rf__tworker *w);
int rf__worker_has_rm(const rf__tworker *w);

/* The whole actor of this rank: model.path with the recipe's LoRA adapters when [lora] is on
 * (the base frozen, controller/run_internal.h rf__lora_attach), training buffers; and the
 * whole reference: under LoRA with no reference.path of its own, the actor's frozen base seen
 * through a second model without adapters (no second copy; load the actor first). */
rf_status rf__worker_actor_load(rf__tworker *w);
rf_status rf__worker_ref_load(rf__tworker *w);

/* The tensor-parallel ranks `role` (RF_ROLE_*: the reference, the critic, the reward model) is
 * split over here, or 0 when it is whole: a split one no rank loads whole (rf__tp_setup reads
 * the shards). */
int rf__worker_split_tp(const rf__tworker *w, int role);

/* Data parallelism, on every rank of the DP group (a tensor-parallel peer of a replica other
 * than 0 too): */

/* Sets up data parallelism of the loaded actor (and critic) over w->dpc: every DP rank calls it
 * after loading its models (DP rank 0 after resuming), with `loaded` its status so far; when
 * any rank failed every rank returns an error (its own, or one naming the rank that failed).
 * They all start from rank 0's state. */
rf_status rf__dp_setup(rf__tworker *w, rf_status loaded);

void rf__dp_free(rf__tworker *w);

/* Whether a resumed run's ranks read their own ZeRO-1 blocks of the moments of the actor
 * (`model` 0) or the critic (1), whole or a tensor-parallel shard, from the checkpoint in
 * rf__dp_setup, so that the ranks loading it read only its parameters: ZeRO-1 shards them over
 * a DP group. */
int rf__dp_zero_reads(const rf__tworker *w, int model);

/* ZeRO-1 checkpoints: no rank gathers the whole moments. DP rank 0 tells the peers
 * (rf__dp_checkpoint_begin: with tensor parallelism every replica's leader tells its TP
 * peers), then asks for each range it writes (rf__dp_moments: floats [a, a + n) of moment part
 * 1 or 2 of the actor, model 0, or the critic, 1, into dst), and says when the files are done
 * (rf__dp_moments_done); the peers send their blocks of each range until then
 * (rf__dp_moments_serve). rf__dp_zero_moments: whether the model's moments are sharded. */
int rf__dp_zero_moments(const rf__tworker *w, int model);
rf_status rf__dp_moments(rf__tworker *w, int model, int part, size_t a, size_t n, float *dst);
rf_status rf__dp_moments_done(rf__tworker *w);
rf_status rf__dp_moments_serve(rf__tworker *w);

/* A whole model whose moments are ZeRO-1 shards, as a checkpoint role: its whole-model role
 * (rf_checkpoint_role_of) for the parameters, each moment tensor gathered from the DP group
 * (host memory: data parallelism runs on the CPU back end). */
typedef struct rf__zero_role {
    rf__tworker *w;
    rf_ckpt_role whole;
    int model;
} rf__zero_role;

/* DP rank 0: whole model m (`model` 0 the actor, 1 the critic) as a checkpoint role: with its
 * moments from the DP group when they are ZeRO-1 shards (z, the caller's, holds that role's
 * state and must outlive it), else as it is here. */
rf_ckpt_role rf__dp_role_of(rf__tworker *w, const rf_model *m, int model, rf__zero_role *z);

/* ---- data parallelism (actor/worker_dp.c) ---- */

/* A replica leader's share of a score pass, samples [lo, hi) of b unpacked in s: the TP peers
 * get the share when a split model takes part (rf__tp_score_share), then rf__worker_score. */
rf_status rf__worker_score_share(rf__tworker *w, const Rlflow__TrainBatch *b, size_t lo, size_t hi,
                                 rf_train_sample *s, int flags);

/* DP rank 0 opens a checkpoint of ZeRO-1 moments: the peers are told (rf__dp_moments_serve). */
rf_status rf__dp_checkpoint_begin(rf__tworker *w);

/* DP rank 0: sends every peer its shares of batch b (the actor's and the critic's) and returns
 * its own: the samples [*lo, *hi) spanning them, and *sh, each model's range in b. */
rf_status rf__dp_scatter(rf__tworker *w, const Rlflow__TrainBatch *b, size_t *lo, size_t *hi, rf__share *sh);

/* DP rank 0: scores the samples of b (s: them unpacked) over the first m replicas, each its
 * share (rf__worker_score_share; the peers send theirs back; the others get none), filling
 * s's ref_logp / values. */
rf_status rf__dp_score(rf__tworker *w, const Rlflow__TrainBatch *b, rf_train_sample *s, int flags, int m);

/* DP rank 0: a keep-alive for the peers when it has sent them nothing for a while (they give
 * up on a rank 0 silent for async.peer_timeout). */
rf_status rf__dp_keepalive(rf__tworker *w);

/* DP rank 0 without tensor parallelism, with ZeRO-1 (after rf__dp_checkpoint_begin): writes the
 * checkpoint of state cs with the moments gathered tensor by tensor, then tells the peers. */
rf_status rf__dp_checkpoint_save(rf__tworker *w, const rf_ckpt_state *cs);

/* DP rank 0: tells the peers the run is over (bounded; a peer that is gone is not waited for);
 * failed: it ended on an error, and the peers then stop with one too (so that they do not wait
 * in MPI_Finalize for a rank that is gone). */
void rf__dp_stop(rf__tworker *w, int failed);

/* ---- tensor parallelism (actor/worker_tp.c) ---- */

/* Every TP rank, after loading what it holds whole: `loaded` is the rank's status so far (when
 * any rank failed every rank returns an error). Each rank of replica 0 then reads its own
 * shard of the actor from the files (rf_model_tp_load: the model directory, or with
 * w->ckpt_dir set on rank 0 the checkpoint's parameters and AdamW moments; no rank holds the
 * whole actor), and the critic and the reference the recipe splits the same way; the version
 * and optimizer steps are rank 0's, and w->wrs is ready (every replica sends weights over
 * w->wcomm). A replica other than 0 reads its split reference and critic from their model
 * directories; its actor shards stay zero until rf__dp_setup copies replica 0's (and the
 * critic's, when data parallel). */
rf_status rf__tp_setup(rf__tworker *w, rf_status loaded);

/* Every TP rank, together: the checksum of the new weights (the whole buffer's CRC-32C, from
 * the shards; kept in w->crc), then their transfer to the rollout workers (bounded by timeout_s
 * per exchange). Rank 0 calls announce(w) between the two (the WeightsUpdate to the
 * controller). Without tensor parallelism (w->tp NULL, w->wrs from rf__rs_whole_setup) the
 * whole actor is sent the same way. */
rf_status rf__tp_publish(rf__tworker *w, double timeout_s, rf_status (*announce)(rf__tworker *w));

/* The whole actor's weights by resharding (placement.actor.tp = 1 with placement.rollout.tp >
 * 1: the rollout workers hold shards): w->wrs from the one training rank to the rollout ranks.
 * Colocated (w->ho): from every training rank to its own process's rollout rank. */
rf_status rf__rs_whole_setup(rf__tworker *w);

/* TP rank 0: sends every peer the packed TrainBatch buf (bytes) they train on with rank 0 (the
 * whole batch, or with data parallelism the replica's shares), sh: each model's samples in it;
 * `train` is rf__worker_peer_update's. */
rf_status rf__tp_share(rf__tworker *w, const uint8_t *buf, uint64_t bytes, int train, const rf__share *sh);

/* TP rank 0: the TP peers score the packed TrainBatch buf (bytes) with it, for the split
 * models among `flags`; returns at once when none of them is split. */
rf_status rf__tp_score_share(rf__tworker *w, const uint8_t *buf, uint64_t bytes, int flags);

/* The flags of `flags` whose models are split over the TP group here. */
int rf__tp_split_flags(const rf__tworker *w, int flags);

/* A leader of a replica other than 0, around its part of a checkpoint (ZeRO-1): tells its TP
 * peers, whose optimizer shards are gathered with the other replicas'. */
rf_status rf__tp_checkpoint_peers(rf__tworker *w);

/* TP rank 0: a keep-alive for idle peers (as rf__dp_keepalive). */
rf_status rf__tp_keepalive(rf__tworker *w);

/* TP rank 0 of replica 0: writes the checkpoint of state cs (rf_checkpoint_save_roles): the
 * actor's and a split critic's tensors gathered from the shards one at a time as the files are
 * written (the peers told, and their blocks sent as asked: rank 0 holds one whole tensor at a
 * time), a whole critic from w->critic. With ZeRO-1, after rf__dp_checkpoint_begin. */
rf_status rf__tp_checkpoint_save(rf__tworker *w, const rf_ckpt_state *cs);

/* TP rank 0: tells the peers the run is over (bounded; best effort); failed as rf__dp_stop. */
void rf__tp_stop(rf__tworker *w, int failed);

void rf__tp_free(rf__tworker *w);

#endif
