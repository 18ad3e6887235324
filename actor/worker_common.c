/* The pieces every training rank runs, whatever its place in the tp x dp grid
 * (actor/worker_internal.h): batches unpacked and packed, the models' update and scoring
 * passes, agreeing to start, data-parallel set-up and the ZeRO-1 moments gathered for a
 * checkpoint (the tensor-parallel peers take part in both).
 *
 * The training worker's files call in one direction: actor/worker.c (the loop that talks to
 * the controller) -> actor/worker_dp.c (data-parallel rank 0 and its peers) ->
 * actor/worker_tp.c (tensor-parallel rank 0 and its peers) -> this file, which calls none of
 * them. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "actor/worker_internal.h"
#include "common/log.h"
#include "common/util.h"
#include "controller/advantages.h"
#include "controller/run_internal.h"
#include "trainer/checkpoint.h"

typedef rf__tworker tworker;

/* ---- batches, the update and scoring ---- */

void rf__worker_samples_free(rf_train_sample *s, int n) {
    for (int i = 0; s && i < n; i++) rf_train_sample_free(&s[i]);
    free(s);
}

#define samples_free rf__worker_samples_free
#define unpack rf__worker_unpack

/* TrainSample.loss_mask (episodes: observation tokens masked out) into s, checked: empty, or
 * one 0 or 1 per response token. */
static rf_status unpack_mask(const Rlflow__TrainSample *t, size_t i, int nr, rf_train_sample *s) {
    if (!t->loss_mask.len) return RF_OK;
    if (t->loss_mask.len != (size_t)nr)
        return rf_error(RF_ERR_FORMAT, "sample %zu: loss_mask has %zu values for %d response tokens", i, t->loss_mask.len, nr);
    for (int j = 0; j < nr; j++)
        if (t->loss_mask.data[j] > 1)
            return rf_error(RF_ERR_FORMAT, "sample %zu: loss_mask[%d] = %d (0 or 1)", i, j, t->loss_mask.data[j]);
    if (!(s->loss_mask = malloc((size_t)nr))) return rf_error(RF_ERR_NOMEM, "out of memory");
    memcpy(s->loss_mask, t->loss_mask.data, (size_t)nr);
    return RF_OK;
}

rf_status rf__worker_unpack(Rlflow__TrainSample **in, size_t n, rf_train_sample **out) {
    rf_train_sample *s = calloc(n ? n : 1, sizeof *s);
    if (!s) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const Rlflow__TrainSample *t = in[i];
        int np = t->n_prompt, nr = (int)t->n_tokens - t->n_prompt;
        if (np < 1 || nr < 1) {
            samples_free(s, (int)i);
            return rf_error(RF_ERR_FORMAT, "sample %zu: %zu tokens with n_prompt %d", i, t->n_tokens, np);
        }
        s[i].n_prompt = np, s[i].n_resp = nr, s[i].group = t->group, s[i].reward = t->reward;
        s[i].tokens = malloc(sizeof(int32_t) * t->n_tokens);
        rf_status st = s[i].tokens ? rf_train_sample_alloc(&s[i]) : rf_error(RF_ERR_NOMEM, "out of memory");
        if (st != RF_OK) {
            samples_free(s, (int)i + 1);
            return st;
        }
        memcpy(s[i].tokens, t->tokens, sizeof(int32_t) * t->n_tokens);
#define COPY(field, dst)                                                                            \
    if (t->n_##field == (size_t)nr) memcpy(s[i].dst, t->field, sizeof(float) * (size_t)nr);         \
    else if (t->n_##field != 0) {                                                                  \
        samples_free(s, (int)i + 1);                                                                \
        return rf_error(RF_ERR_FORMAT, "sample %zu: %zu " #field " for %d response tokens", i,      \
                        t->n_##field, nr);                                                          \
    }
        COPY(behav_logp, behav_logp)
        COPY(advantages, adv)
        COPY(returns, returns)
        COPY(ref_logp, ref_logp)
        COPY(values, values)
#undef COPY
        if (t->n_versions != 0 && t->n_versions != (size_t)nr) {
            samples_free(s, (int)i + 1);
            return rf_error(RF_ERR_FORMAT, "sample %zu: %zu versions for %d response tokens", i, t->n_versions, nr);
        }
        for (int j = 0; j < nr && (size_t)j < t->n_versions; j++) {
            if (t->versions[j] < 0 || t->versions[j] > INT32_MAX) {
                samples_free(s, (int)i + 1);
                return rf_error(RF_ERR_FORMAT, "sample %zu: versions[%d] = %lld (0 .. 2^31-1)", i, j, (long long)t->versions[j]);
            }
            s[i].versions[j] = (int)t->versions[j];
        }
        st = unpack_mask(t, i, nr, &s[i]);
        if (st != RF_OK) {
            samples_free(s, (int)i + 1);
            return st;
        }
    }
    *out = s;
    return RF_OK;
}

int rf__worker_critic_replicas(const tworker *w) {
    rf_adv_kind kind;
    int dp, tp;
    rf_recipe_role_layout(w->r, RF_ROLE_CRITIC, &dp, &tp);
    return rf_adv_kind_parse(w->r->algorithm.name, &kind) == RF_OK && kind == RF_ADV_GAE ? dp : 0;
}

int rf__worker_has_critic(const tworker *w) { return w->replica < rf__worker_critic_replicas(w); }

int rf__worker_has_ref(const tworker *w) {
    int dp, tp;
    rf_recipe_role_layout(w->r, RF_ROLE_REFERENCE, &dp, &tp);
    return rf_recipe_reference_enabled(w->r) && w->replica < dp;
}

int rf__worker_has_rm(const tworker *w) {
    int dp, tp;
    rf_recipe_role_layout(w->r, RF_ROLE_REWARD, &dp, &tp);
    return w->r->reward.model[0] && w->replica < dp;
}

rf_status rf__worker_actor_load(tworker *w) {
    RF_TRY(rf_model_load(&w->actor, w->r->model.path, w->k, 0));
    RF_TRY(rf__lora_attach(w->r, w->actor));
    return rf_model_enable_training(w->actor);
}

rf_status rf__worker_ref_load(tworker *w) {
    const rf_recipe *r = w->r;
    if (w->actor && w->actor->lora.rank && !r->reference.path[0])
        return rf_model_init_borrowed(&w->ref, &w->actor->cfg, w->k, w->actor->params);
    /* never trained: a bf16 checkpoint's matrices stay bf16 when running bf16 */
    return rf_model_load_frozen(&w->ref, r->reference.path[0] ? r->reference.path : r->model.path, w->k, 0);
}

rf_status rf__worker_score(tworker *w, rf_train_sample *s, int n, int flags) {
    const rf_recipe *r = w->r;
    if (n == 0) return RF_OK; /* an empty share: every rank of the replica has it */
    float **ptrs = malloc(sizeof(float *) * (size_t)n);
    if (!ptrs) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status st = RF_OK;
    if (flags & RF_SCORE_REF) {
        for (int i = 0; i < n; i++) ptrs[i] = s[i].ref_logp;
        float inv_temp = 1.0f / (float)r->rollout.temperature;
        if (w->ref_tp) st = rf_actor_logprobs_tp(w->ref_tp, s, n, r->train.micro_batch_tokens, inv_temp, ptrs, NULL);
        else if (w->ref) st = rf_actor_logprobs(w->ref, s, n, r->train.micro_batch_tokens, inv_temp, ptrs, NULL);
        else st = rf_error(RF_ERR_ARG, "scoring: no reference on this rank");
    }
    if (st == RF_OK && (flags & RF_SCORE_VALUES)) {
        for (int i = 0; i < n; i++) ptrs[i] = s[i].values;
        if (w->critic_tp) st = rf_critic_values_tp(w->critic_tp, s, n, r->train.micro_batch_tokens, ptrs);
        else if (w->critic) st = rf_critic_values(w->critic, s, n, r->train.micro_batch_tokens, ptrs);
        else st = rf_error(RF_ERR_ARG, "scoring: no critic on this rank");
    }
    free(ptrs);
    if (st == RF_OK && (flags & RF_SCORE_RM)) {
        float *sc = malloc(sizeof(float) * (size_t)n);
        st = !sc ? rf_error(RF_ERR_NOMEM, "out of memory")
             : w->rm ? rf__reward_model_scores(w->rm, s, n, sc) : rf_error(RF_ERR_ARG, "scoring: no reward model on this rank");
        for (int i = 0; st == RF_OK && i < n; i++) s[i].rm_score = sc[i];
        free(sc);
    }
    return st;
}

rf_status rf__worker_agree_to_start(tworker *w, rf_comm *c, rf_status loaded, const char *kind) {
    char what[96];
    snprintf(what, sizeof what, "%s training ranks agreeing to start", kind);
    int failed;
    RF_TRY(rf_comm_agree(c, loaded, w->r->async.startup_timeout, what, &failed));
    if (failed >= 0)
        return rf_error(RF_ERR_IO, "%s rank %d (world rank %d) could not start; its message says why", kind, failed,
                        rf_comm_world_rank(c, failed));
    return RF_OK;
}

rf_status rf__worker_pack_part(const Rlflow__TrainBatch *b, size_t lo, size_t hi, uint8_t **buf, uint64_t *bytes) {
    Rlflow__TrainBatch sub = *b;
    sub.n_samples = hi - lo;
    sub.samples = b->samples + lo;
    *bytes = rlflow__train_batch__get_packed_size(&sub);
    *buf = malloc(*bytes ? *bytes : 1);
    if (!*buf) return rf_error(RF_ERR_NOMEM, "out of memory for a batch of %llu bytes", (unsigned long long)*bytes);
    rlflow__train_batch__pack(&sub, *buf);
    return RF_OK;
}

rf_status rf__worker_unpack_packed(const uint8_t *buf, size_t bytes, const char *what, Rlflow__TrainBatch **b,
                                   rf_train_sample **s) {
    *s = NULL;
    *b = rlflow__train_batch__unpack(NULL, bytes, buf);
    if (!*b) return rf_error(RF_ERR_FORMAT, "%s did not decode", what);
    return rf__worker_unpack((*b)->samples, (*b)->n_samples, s);
}

void rf__worker_packed_free(Rlflow__TrainBatch *b, rf_train_sample *s) {
    if (s) rf__worker_samples_free(s, (int)b->n_samples);
    if (b) rlflow__train_batch__free_unpacked(b, NULL);
}

/* Whether sh's ranges lie in a batch of n samples (they come from another rank). */
static rf_status share_check(const rf__share *sh, int n, const char *what) {
    if (sh->a_lo >= 0 && sh->a_lo <= sh->a_hi && sh->a_hi <= n && sh->c_lo >= 0 && sh->c_lo <= sh->c_hi && sh->c_hi <= n)
        return RF_OK;
    return rf_error(RF_ERR_FORMAT, "%s: the actor's samples [%lld, %lld) and the critic's [%lld, %lld) are not in its %d "
                    "samples", what, (long long)sh->a_lo, (long long)sh->a_hi, (long long)sh->c_lo, (long long)sh->c_hi, n);
}

rf_status rf__worker_peer_update(tworker *w, const uint8_t *buf, size_t bytes, const char *what, int train,
                                 const rf__share *sh) {
    Rlflow__TrainBatch *b = NULL;
    rf_train_sample *s = NULL;
    rf_status st = rf__worker_unpack_packed(buf, bytes, what, &b, &s);
    int n = b ? (int)b->n_samples : 0;
    rf_update_stats as = {0}, cs = {0};
    double tp, ta;
    if (st == RF_OK) st = share_check(sh, n, what);
    if (st == RF_OK) w->version = (int)b->policy_version;
    if (st == RF_OK && (train < 0 ? n > 0 : train)) st = rf__worker_update(w, s, sh, b->kl_coef, &as, &cs, &tp, &ta);
    if (st == RF_OK) w->version++;
    rf__worker_packed_free(b, s);
    return st;
}

/* The critic's update on samples s (n; this rank's share of them), data parallel and tensor
 * parallel as it is laid out; nothing where this rank holds no critic. */
static rf_status critic_update(tworker *w, rf_train_sample *s, int n, float kl_coef, rf_update_stats *cs) {
    rf_model *critic = w->critic_tp ? w->critic_tp->m : w->critic;
    if (!critic || (n == 0 && !w->dp_critic)) return RF_OK; /* data parallel: every rank takes part */
    rf_update_opts uc = rf__update_opts(w->r, kl_coef, w->kl_est, w->agg, w->version, 1);
    rf_optim_opts co = rf__optim_opts(w->r, 1);
    uc.dp = w->dp_critic;
    uc.tp = w->critic_tp; /* the critic split like the actor: this rank's shard */
    return rf_critic_update(critic, &co, &uc, s, n, cs);
}

rf_status rf__worker_update(tworker *w, rf_train_sample *base, const rf__share *sh, float kl_coef, rf_update_stats *as,
                            rf_update_stats *cs, double *prox_s, double *actor_s) {
    const rf_recipe *r = w->r;
    rf_train_sample *s = base + sh->a_lo;
    int n = (int)(sh->a_hi - sh->a_lo);
    rf_update_opts uo = rf__update_opts(r, kl_coef, w->kl_est, w->agg, w->version, 0);
    rf_optim_opts ao = rf__optim_opts(r, 0);
    uo.dp = w->dp_actor;
    /* proximal log-probs: the current policy's, recomputed when the objective or several
     * updates need them; otherwise equal to the behaviour log-probs */
    int recompute = (uo.pg.decoupled && !uo.prox_from_forward) || r->train.ppo_epochs > 1 || r->train.mini_batches > 1;
    float **ptrs = malloc(sizeof(float *) * (size_t)(n ? n : 1));
    rf_status st = ptrs ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) {
        ptrs[i] = s[i].prox_logp;
        if (!recompute) memcpy(s[i].prox_logp, s[i].behav_logp, sizeof(float) * (size_t)s[i].n_resp);
    }
    uo.tp = w->tp; /* tensor parallel: the actor is this rank's shard */
    /* colocated: the rollout rank of this process reads these weights; its last step ends first */
    if (st == RF_OK && w->ho) st = rf_handover_write_begin(w->ho, r->async.peer_timeout);
    double tp = rf_time_now();
    if (st == RF_OK && recompute)
        st = w->tp ? rf_actor_logprobs_tp(w->tp, s, n, r->train.micro_batch_tokens, uo.inv_temp, ptrs, NULL)
                   : rf_actor_logprobs(w->actor, s, n, r->train.micro_batch_tokens, uo.inv_temp, ptrs, NULL);
    *prox_s = rf_time_now() - tp;
    free(ptrs);
    /* data parallel: every rank takes part, whatever its share (the batch is not empty) */
    int go = n > 0 || w->dp_actor;
    double ta = rf_time_now();
    if (st == RF_OK && go) st = rf_actor_update(w->tp ? w->tp->m : w->actor, &ao, &uo, s, n, as);
    *actor_s = rf_time_now() - ta;
    if (st == RF_OK) st = critic_update(w, base + sh->c_lo, (int)(sh->c_hi - sh->c_lo), kl_coef, cs);
    if (w->ho && rf_recipe_free_kv_cache(r)) { /* colocated: the workspaces go back, for the KV cache */
        rf_model_trim(w->actor), rf_model_trim(w->critic), rf_model_trim(w->ref);
        rf_model_tp_trim(w->tp), rf_model_tp_trim(w->critic_tp), rf_model_tp_trim(w->ref_tp);
    }
    return st;
}

int rf__worker_split_tp(const rf__tworker *w, int role) {
    int dp, tp;
    rf_recipe_role_layout(w->r, role, &dp, &tp);
    return w->tpc && tp > 1 ? tp : 0;
}

/* ---- data parallelism, both sides (worker_dp.c drives it; the tensor-parallel peers of a replica
 * other than 0 set it up too) ---- */

/* Whether this rank's TP position holds (a shard of) the critic in the replicas that have it:
 * the critic's DP group is the ranks of that position. */
static int critic_position(const rf__tworker *w) {
    if (!rf__worker_critic_replicas(w)) return 0;
    if (!w->tpc) return 1;
    int t = rf_comm_rank(w->tpc), tp = rf__worker_split_tp(w, RF_ROLE_CRITIC);
    return tp ? t < tp : t == 0;
}

int rf__dp_zero_reads(const rf__tworker *w, int model) {
    if (!w->dpc || w->r->placement.actor.zero != 1) return 0;
    return model ? rf__worker_critic_replicas(w) > 1 : 1;
}

/* A source of moments that fails: a rank that could not open the checkpoint's files still
 * takes part in rf_dp_init, failing its read, so that every rank fails naming it. */
static rf_status unreadable(void *ctx, int which, size_t a, size_t n, float *dst) {
    (void)which, (void)a, (void)n, (void)dst;
    return rf_error(RF_ERR_IO, "%s", (const char *)ctx);
}

/* Data parallelism over g with options o of whole model m or shard tp (the other NULL;
 * `model` 0 the actor, 1 the critic); resuming with ZeRO-1 (ckpt: the checkpoint's directory,
 * "" on a fresh start) every rank reads its own blocks of the moments from the checkpoint. */
static rf_status dp_model(rf__tworker *w, rf_dp **out, rf_comm *g, rf_model *m, rf_model_tp *tp, int model,
                          const char *ckpt, rf_dp_opts o) {
    rf_ckpt_moments cm;
    char why[1024] = "";
    int read = ckpt[0] && rf__dp_zero_reads(w, model);
    rf_status st = read ? rf_checkpoint_moments_open(&cm, ckpt, model ? "critic" : "actor", m, tp) : RF_OK;
    if (read && st == RF_OK) o.moments = rf_checkpoint_moments_read, o.moments_ctx = &cm;
    if (read && st != RF_OK) {
        snprintf(why, sizeof why, "%s", rf_error_message());
        o.moments = unreadable, o.moments_ctx = why;
    }
    st = tp ? rf_dp_init_tp(out, g, tp, &o) : rf_dp_init(out, g, m, &o);
    if (read && !why[0]) rf_checkpoint_moments_close(&cm);
    return st;
}

/* The critic's data parallelism over the first k = placement.critic.dp of the replicas (k > 1;
 * its group a split of dpc when fewer than all): every rank of dpc takes part. */
static rf_status critic_dp_setup(rf__tworker *w, const rf_dp_opts *o, const char *ckpt) {
    int k = rf__worker_critic_replicas(w), size = rf_comm_size(w->dpc);
    if (k <= 1 || !critic_position(w)) return RF_OK;
    rf_comm *g = w->dpc;
    if (k < size) {
        RF_TRY(rf_comm_split(w->dpc, w->replica < k ? 0 : -1, w->replica, &w->critic_dpc));
        g = w->critic_dpc;
    }
    if (!g) return RF_OK; /* a replica past the critic's */
    RF_TRY(rf_comm_for(g, w->k, "data parallelism", w->r->async.startup_timeout, &w->critic_dev, &g));
    if (w->critic_tp || w->critic) return dp_model(w, &w->dp_critic, g, w->critic, w->critic_tp, 1, ckpt, *o);
    return rf_error(RF_ERR_ARG, "data-parallel replica %d of the critic's %d holds no critic", w->replica, k);
}

/* How the critic is laid out, for the start-up log line. */
static const char *critic_where(const rf__tworker *w, char *buf, size_t cap) {
    int k = rf__worker_critic_replicas(w), size = rf_comm_size(w->dpc);
    if (!k) snprintf(buf, cap, "actor");
    else if (k == size) snprintf(buf, cap, "actor and critic%s", w->tpc && !w->critic_tp ? " (the critic on the replicas' first ranks)" : "");
    else if (k == 1) snprintf(buf, cap, "actor (the critic on %s alone, on whole batches)", w->tpc ? "replica 0" : "rank 1");
    else snprintf(buf, cap, "actor, and the critic over the first %d replicas (its own shares of each batch)", k);
    return buf;
}

rf_status rf__dp_setup(rf__tworker *w, rf_status loaded) {
    const rf_recipe *r = w->r;
    int size = rf_comm_size(w->dpc), rank = rf_comm_rank(w->dpc);
    RF_TRY(rf__worker_agree_to_start(w, w->dpc, loaded, "data-parallel"));
    rf_status st;
    /* set-up waits for rank 0's checkpoint loading: the start-up bound; later, the peers' */
    rf_dp_opts o = {.zero = r->placement.actor.zero, .timeout_s = r->async.startup_timeout};
    /* ZeRO-1: the checkpoint resumed from (rank 0's; "" on a fresh start), from which every rank
     * reads its blocks of the moments (of its whole model or its tensor-parallel shard) */
    char ckpt[sizeof w->ckpt_dir] = "";
    if (rank == 0) snprintf(ckpt, sizeof ckpt, "%s", w->ckpt_dir);
    st = o.zero ? rf_comm_bcast(w->dpc, ckpt, sizeof ckpt, 0, r->async.startup_timeout,
                                "receiving the checkpoint's directory from data-parallel rank 0")
                : RF_OK;
    rf_comm *g = NULL;
    if (st == RF_OK) st = rf_comm_for(w->dpc, w->k, "data parallelism", w->r->async.startup_timeout, &w->dp_dev, &g);
    if (st == RF_OK) st = dp_model(w, &w->dp_actor, g, w->tp ? NULL : w->actor, w->tp, 0, ckpt, o);
    /* the version comes from replica 0 too (the peers have none yet: on --resume rank 0 read
     * it from the checkpoint), for the versions a colocated peer hands its rollout rank and
     * its tensor-parallel ranks' shards */
    int64_t v = w->version;
    if (st == RF_OK)
        st = rf_comm_bcast(w->dpc, &v, sizeof v, 0, r->async.startup_timeout, "receiving the version from replica 0");
    w->version = (int)v;
    /* the critic data parallel over the replicas holding it when there are several
     * (placement.critic.dp = 1: replica 0 trains it alone, on whole batches) */
    if (st == RF_OK) st = critic_dp_setup(w, &o, ckpt);
    if (st != RF_OK) return st;
    rf_dp_set_timeout(w->dp_actor, r->async.peer_timeout);
    if (w->dp_critic) rf_dp_set_timeout(w->dp_critic, r->async.peer_timeout);
    char where[160];
    if (rank == 0 && w->tpc && rf_comm_rank(w->tpc) == 0)
        rf_log_info("training worker: %d data-parallel replicas of %d tensor-parallel ranks%s, %s", size,
                    rf_comm_size(w->tpc), r->placement.actor.zero ? " (ZeRO-1: optimizer state sharded per shard)" : "",
                    critic_where(w, where, sizeof where));
    else if (rank == 0 && !w->tpc)
        rf_log_info("training worker: data parallel over %d ranks%s, %s", size,
                    r->placement.actor.zero ? " (ZeRO-1: optimizer state sharded)" : "", critic_where(w, where, sizeof where));
    w->last_cmd = rf_time_now();
    return RF_OK;
}

void rf__dp_free(rf__tworker *w) {
    rf_dp_free(w->dp_actor), rf_dp_free(w->dp_critic);
    rf_comm_free(w->dp_dev), rf_comm_free(w->critic_dev);
    rf_comm_free(w->critic_dpc);
    w->dp_actor = w->dp_critic = NULL;
    w->critic_dpc = w->dp_dev = w->critic_dev = NULL;
}

/* ---- ZeRO-1 checkpoints: the moments gathered one range (a tensor, or a shard's block of it)
 * at a time onto the DP rank 0 that writes them; the peers send as asked ---- */

typedef struct dp_ask {
    int32_t model, part; /* 0 actor, 1 critic; 1 or 2: the first or second moment; model -1: done */
    int64_t a, n;        /* floats [a, a + n) of the model's buffer */
} dp_ask;

int rf__dp_zero_moments(const rf__tworker *w, int model) {
    const rf_dp *dp = model ? w->dp_critic : w->dp_actor;
    return dp && rf_dp_zero(dp);
}

rf_status rf__dp_moments(rf__tworker *w, int model, int part, size_t a, size_t n, float *dst) {
    dp_ask q = {model, part, (int64_t)a, (int64_t)n};
    RF_TRY(rf_comm_bcast(w->dpc, &q, sizeof q, 0, w->r->async.peer_timeout,
                         "asking the data-parallel ranks for a checkpoint's optimizer state"));
    return rf_dp_moment_range(model ? w->dp_critic : w->dp_actor, part, a, n, dst);
}

rf_status rf__dp_moments_done(rf__tworker *w) {
    if (!rf__dp_zero_moments(w, 0)) return RF_OK;
    dp_ask q = {-1, 0, 0, 0};
    return rf_comm_bcast(w->dpc, &q, sizeof q, 0, w->r->async.peer_timeout,
                         "telling the data-parallel ranks the checkpoint is written");
}

static rf_status zero_tensor(void *ctx, int part, int view, float *dst) {
    const rf__zero_role *z = ctx;
    if (part == 0) return z->whole.tensor(z->whole.ctx, 0, view, dst);
    const rf_param_view *v = &z->whole.views[view];
    const rf_dp *dp = z->model ? z->w->dp_critic : z->w->dp_actor; /* offsets among the trained floats */
    return rf__dp_moments(z->w, z->model, part, v->offset - rf_dp_model(dp)->n_frozen, v->numel, dst);
}

rf_ckpt_role rf__dp_role_of(rf__tworker *w, const rf_model *m, int model, rf__zero_role *z) {
    *z = (rf__zero_role){w, rf_checkpoint_role_of(m), model};
    if (!rf__dp_zero_moments(w, model)) return z->whole;
    rf_ckpt_role r = z->whole;
    r.moments = 1, r.tensor = zero_tensor, r.ctx = z;
    return r;
}

rf_status rf__dp_moments_serve(rf__tworker *w) {
    for (;;) {
        dp_ask q;
        RF_TRY(rf_comm_bcast(w->dpc, &q, sizeof q, 0, 2 * w->r->async.peer_timeout,
                             "waiting for data-parallel rank 0 to ask for a checkpoint's optimizer state"));
        if (q.model < 0) return RF_OK;
        rf_dp *dp = q.model ? w->dp_critic : w->dp_actor;
        if (q.model == 1 && !dp && !rf__worker_has_critic(w)) continue; /* past the critic's replicas */
        if (!dp || q.a < 0 || q.n < 0)
            return rf_error(RF_ERR_FORMAT, "data-parallel rank 0 asked for floats [%lld, %lld) of model %d's moment %d, "
                            "which this rank does not hold", (long long)q.a, (long long)(q.a + q.n), (int)q.model,
                            (int)q.part);
        RF_TRY(rf_dp_moment_range(dp, q.part, (size_t)q.a, (size_t)q.n, NULL));
    }
}
