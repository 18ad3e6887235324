/* The in-process roles (controller/roles.h): the RL loop's requests run directly on rf_run's
 * engine, actor, reference, critic and reward model, no message and no ZeroMQ hop. Requests
 * are queued; progress() runs one kind of work at a time, all of it at once, in this order: a
 * checkpoint; the validation requests (greedy, rf_generate on the actor, or greedy [env]
 * episodes); the generate requests (all submitted to the engine and run until idle, or one
 * round of [env] episodes); the requests with reward-model scores (one call over their samples
 * in request order, and the reference / proximal / value scores they also ask for); the other
 * scoring requests (reference, proximal log-probs, values: one call each over every pending
 * sample in request order); the training batch. The loop answers each delivery
 * before asking again, so a step's generation, scoring and update are batched as whole as the
 * one-process loop always batched them. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/interrupt.h"
#include "controller/roles.h"
#include "controller/run_internal.h"
#include "model/generate.h"
#include "rollout/rollout.h"

typedef struct score_req {
    uint64_t req;
    rf_train_sample *s;
    int n, flags;
} score_req;

typedef struct inproc {
    rf_run *run;
    int version;                  /* the actor's weights version (updates done) */
    rf_role_gen *gen;             /* (n_gen) pending generate requests, in order */
    int n_gen, cap_gen;
    score_req *sc;                /* (n_sc) pending scoring requests, in order */
    int n_sc, cap_sc;
    rf_train_sample *batch;       /* the pending training batch (n_batch), or NULL */
    int n_batch, batch_version;
    float batch_kl;
    rf_ckpt_state ckpt;
    int ckpt_pending;
    double gen_tokens;            /* sampled tokens since the last step */
    /* seconds per phase since the last step (perf/share_*) */
    double t_gen, t_ref, t_prox, t_critic, t_actor, t_critic_train;
} inproc;

static int served(void *ctx) { return ((inproc *)ctx)->version; }

static rf_status generate(void *ctx, const rf_role_gen *q) {
    inproc *x = ctx;
    RF_TRY(rf_grow((void **)&x->gen, &x->cap_gen, x->n_gen + 1, sizeof *x->gen));
    x->gen[x->n_gen++] = *q;
    return RF_OK;
}

static rf_status score(void *ctx, uint64_t req, rf_train_sample *s, int n, int flags) {
    inproc *x = ctx;
    RF_TRY(rf_grow((void **)&x->sc, &x->cap_sc, x->n_sc + 1, sizeof *x->sc));
    x->sc[x->n_sc++] = (score_req){req, s, n, flags};
    return RF_OK;
}

static rf_status train(void *ctx, rf_train_sample *s, int n, int version, float kl_coef) {
    inproc *x = ctx;
    if (x->batch) {
        for (int i = 0; i < n; i++) rf_train_sample_free(&s[i]);
        free(s);
        return rf_error(RF_ERR_ARG, "in-process trainer: a batch for version %d while the one for %d waits", version,
                        x->batch_version);
    }
    x->batch = s, x->n_batch = n, x->batch_version = version, x->batch_kl = kl_coef;
    return RF_OK;
}

static rf_status checkpoint(void *ctx, const rf_ckpt_state *st) {
    inproc *x = ctx;
    x->ckpt = *st, x->ckpt_pending = 1;
    return RF_OK;
}

/* ---- generation ---- */

typedef struct gen_sink {
    rf_run *run;
    const rf_role_gen *q; /* (the requests, by user index) */
    rf_train_sample *out; /* (request p's sample j at p * n + j) */
    int n;
    rf_status st;
} gen_sink;

/* The engine's callback: each finished sample scored by the reward rules at once. */
static void on_engine_sample(void *ctx, const rf_rollout_sample *rs) {
    gen_sink *g = ctx;
    int p = (int)(intptr_t)rs->user;
    rf_train_sample *s = &g->out[p * g->n + rs->index];
    if (g->st != RF_OK) return;
    memset(s, 0, sizeof *s);
    g->st = rf__sample_init(g->run, s, rs->prompt, rs->prompt_len, rs->tokens, rs->logprobs, rs->n_tokens, rs->text,
                            g->q[p].ex->answer);
    if (g->st == RF_OK) memcpy(s->versions, rs->versions, sizeof(int) * (size_t)s->n_resp);
}

/* Requests q (k, n samples each) on the engine at once: submitted in order, run until idle. */
static rf_status engine_generate(inproc *x, const rf_role_gen *q, int k, int n, rf_train_sample *out) {
    rf_run *run = x->run;
    const rf_recipe *r = run->r;
    gen_sink g = {run, q, out, n, RF_OK};
    rf_rollout_set_callback(run->engine, on_engine_sample, &g);
    rf_rollout_set_version(run->engine, x->version);
    rf_status st = RF_OK;
    for (int p = 0; st == RF_OK && p < k; p++) {
        rf_rollout_request e = {.prompt = q[p].ex->prompt_ids, .prompt_len = q[p].ex->n_prompt, .n = n,
                                .sampling = {0, (float)r->rollout.temperature, r->rollout.top_k,
                                             (float)r->rollout.top_p},
                                .max_new_tokens = r->rollout.max_new_tokens, .seed = q[p].seed,
                                .stop_ids = run->eos, .n_stop_ids = run->n_eos};
        for (int i = 0; i < r->rollout.stop.n && i < RF_MAX_STOP; i++) e.stop[e.n_stop++] = r->rollout.stop.v[i];
        st = rf_rollout_submit(run->engine, &e, (void *)(intptr_t)p, NULL);
    }
    if (st == RF_OK) st = rf__rollout_resume(run->engine);
    if (st == RF_OK) st = rf_rollout_run_until_idle(run->engine);
    if (st == RF_OK) st = rf__rollout_pause(r, run->engine, -1);
    rf_rollout_set_callback(run->engine, NULL, NULL);
    return st != RF_OK ? st : g.st;
}

/* Greedy validation responses to requests q (k, one sample each) by rf_generate on the actor. */
static rf_status greedy_generate(inproc *x, const rf_role_gen *q, int k, rf_train_sample *out) {
    rf_run *run = x->run;
    const int32_t **prompts = calloc((size_t)k, sizeof *prompts);
    int *lens = calloc((size_t)k, sizeof *lens);
    rf_gen_output *o = calloc((size_t)k, sizeof *o);
    rf_status st = prompts && lens && o ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for validation");
    for (int i = 0; st == RF_OK && i < k; i++) prompts[i] = q[i].ex->prompt_ids, lens[i] = q[i].ex->n_prompt;
    rf_gen_params gp = {.sampling = {.greedy = 1}, .max_new_tokens = run->r->rollout.max_new_tokens,
                        .eos_ids = run->eos, .n_eos = run->n_eos};
    if (st == RF_OK) st = rf_generate(run->actor, run->tok, prompts, lens, k, &gp, o, 0);
    for (int i = 0; st == RF_OK && i < k; i++)
        st = rf__sample_init(run, &out[i], q[i].ex->prompt_ids, q[i].ex->n_prompt, o[i].tokens, o[i].logprobs,
                             o[i].n_tokens, o[i].text, q[i].ex->answer);
    for (int i = 0; o && i < k; i++) rf_gen_output_free(&o[i]);
    free(prompts), free(lens), free(o);
    return st;
}

/* One round of [env] episodes: requests q (k) of one step and round, places 0 .. k-1. */
static rf_status episode_generate(inproc *x, const rf_role_gen *q, int k, rf_train_sample *out) {
    rf_run *run = x->run;
    const rf_example **ex = calloc((size_t)k, sizeof *ex);
    int64_t *groups = calloc((size_t)k, sizeof *groups);
    if (!ex || !groups) {
        free(ex), free(groups);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    rf_status st = RF_OK;
    for (int p = 0; st == RF_OK && p < k; p++) {
        ex[p] = q[p].ex, groups[p] = q[p].group_id;
        if (q[p].step != x->version || q[p].round != q[0].round || q[p].place != p)
            st = rf_error(RF_ERR_ARG, "in-process episodes: request %d is step %d, round %d, place %d (expected step %d, "
                          "round %d, place %d)", p, q[p].step, q[p].round, q[p].place, x->version, q[0].round, p);
    }
    double tokens = 0;
    if (st == RF_OK) st = rf__generate_episodes(run, ex, groups, k, q[0].round, out, &tokens);
    free(ex), free(groups);
    return st;
}

/* Runs the pending generate requests of one kind (greedy ones first) and delivers the samples. */
static rf_status run_generation(inproc *x, const rf_role_sink *sink) {
    int greedy = 0;
    for (int i = 0; i < x->n_gen; i++) greedy |= x->gen[i].greedy;
    rf_role_gen *q = malloc(sizeof *q * (size_t)x->n_gen);
    if (!q) return rf_error(RF_ERR_NOMEM, "out of memory");
    int k = 0, rest = 0, n = 0;
    for (int i = 0; i < x->n_gen; i++) { /* this kind out of the queue, in order */
        if (x->gen[i].greedy == greedy) q[k++] = x->gen[i];
        else x->gen[rest++] = x->gen[i];
    }
    x->n_gen = rest;
    for (int i = 0; i < k; i++) n = q[i].n > n ? q[i].n : n;
    rf_train_sample *out = calloc((size_t)(k * n), sizeof *out);
    rf_status st = out ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < k; i++)
        if (q[i].n != n) st = rf_error(RF_ERR_ARG, "in-process rollout: requests of %d and %d samples at once", q[i].n, n);
    double t = rf_time_now();
    if (st == RF_OK) {
        if (greedy && x->run->env.call) st = rf__val_episodes(x->run, q, k, out);
        else if (greedy) st = greedy_generate(x, q, k, out);
        else if (x->run->env.call) st = episode_generate(x, q, k, out);
        else st = engine_generate(x, q, k, n, out);
    }
    if (!greedy) x->t_gen += rf_time_now() - t;
    if (st != RF_OK && x->run->env.call && rf_interrupt_signal()) {
        /* a stop was asked for and the environment could not finish these episodes (its
         * programs stopped answering): they are abandoned, as a split run abandons the groups
         * still generating, and the loop writes the checkpoint of the step reached */
        rf_log_warn("interrupted (signal %d): the episodes under way are abandoned: %s", rf_interrupt_signal(),
                    rf_error_message());
        for (int i = 0; out && i < k * n; i++) rf_train_sample_free(&out[i]);
        free(out), free(q);
        return RF_OK;
    }
    for (int i = 0; st == RF_OK && !greedy && i < k * n; i++) x->gen_tokens += out[i].n_resp;
    for (int i = 0; st == RF_OK && i < k * n; i++) st = sink->sample(sink->ctx, q[i / n].req, i % n, &out[i]);
    for (int i = 0; out && i < k * n; i++) rf_train_sample_free(&out[i]);
    free(out), free(q);
    return st;
}

/* ---- scoring ---- */

/* The pending requests with (want = 1) or without the reward-model flag, out of the queue in
 * order, their samples side by side in *all (shallow copies: the arrays are the loop's). */
static rf_status take_scoring(inproc *x, int want_rm, score_req **reqs, int *k, rf_train_sample **all, int *n) {
    *reqs = malloc(sizeof **reqs * (size_t)x->n_sc);
    if (!*reqs) return rf_error(RF_ERR_NOMEM, "out of memory");
    int rest = 0;
    *k = 0, *n = 0;
    for (int i = 0; i < x->n_sc; i++) {
        if (!!(x->sc[i].flags & RF_ROLE_SCORE_RM) == want_rm) (*reqs)[(*k)++] = x->sc[i], *n += x->sc[i].n;
        else x->sc[rest++] = x->sc[i];
    }
    x->n_sc = rest;
    *all = malloc(sizeof **all * (size_t)(*n ? *n : 1));
    if (!*all) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0, at = 0; i < *k; at += (*reqs)[i].n, i++) memcpy(*all + at, (*reqs)[i].s, sizeof **all * (size_t)(*reqs)[i].n);
    return RF_OK;
}

/* Reference, proximal log-probs and values of s (n) as flags ask, each in one call. */
static rf_status policy_scores(inproc *x, rf_train_sample *s, int n, int flags) {
    rf_run *run = x->run;
    const rf_recipe *r = run->r;
    int mt = r->train.micro_batch_tokens;
    float inv_temp = 1.0f / (float)r->rollout.temperature;
    float **ptrs = malloc(sizeof(float *) * (size_t)(n ? n : 1));
    if (!ptrs) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status st = RF_OK;
    double t = rf_time_now();
    if (flags & RF_ROLE_SCORE_REF) {
        for (int i = 0; i < n; i++) ptrs[i] = s[i].ref_logp;
        st = run->ref ? rf_actor_logprobs(run->ref, s, n, mt, inv_temp, ptrs, NULL)
                      : rf_error(RF_ERR_ARG, "in-process scorer: reference log-probs asked, the run has no reference");
    }
    x->t_ref += rf_time_now() - t, t = rf_time_now();
    if (st == RF_OK && (flags & RF_ROLE_SCORE_PROX)) {
        for (int i = 0; i < n; i++) ptrs[i] = s[i].prox_logp;
        st = rf_actor_logprobs(run->actor, s, n, mt, inv_temp, ptrs, NULL);
    }
    x->t_prox += rf_time_now() - t, t = rf_time_now();
    if (st == RF_OK && (flags & RF_ROLE_SCORE_VALUES)) {
        for (int i = 0; i < n; i++) ptrs[i] = s[i].values;
        st = run->critic ? rf_critic_values(run->critic, s, n, mt, ptrs)
                         : rf_error(RF_ERR_ARG, "in-process scorer: values asked, the run has no critic");
    }
    x->t_critic += rf_time_now() - t;
    free(ptrs);
    return st;
}

/* The pending requests with reward-model scores if any, else all the others: one call per kind
 * of score over all their samples. */
static rf_status run_scoring(inproc *x, const rf_role_sink *sink) {
    int want_rm = 0, flags = 0;
    for (int i = 0; i < x->n_sc; i++) want_rm |= !!(x->sc[i].flags & RF_ROLE_SCORE_RM);
    score_req *q = NULL;
    rf_train_sample *all = NULL;
    int k = 0, n = 0;
    rf_status st = take_scoring(x, want_rm, &q, &k, &all, &n);
    for (int i = 0; i < k; i++) flags |= q[i].flags;
    double t = rf_time_now();
    if (st == RF_OK && want_rm) {
        float *sc = malloc(sizeof(float) * (size_t)(n ? n : 1));
        st = !sc ? rf_error(RF_ERR_NOMEM, "out of memory")
             : x->run->rm ? rf__reward_model_scores(x->run->rm, all, n, sc)
                          : rf_error(RF_ERR_ARG, "in-process scorer: reward-model scores asked, the run has no reward model");
        for (int i = 0, at = 0; st == RF_OK && i < k; at += q[i].n, i++)
            for (int j = 0; j < q[i].n; j++) q[i].s[j].rm_score = sc[at + j];
        free(sc);
        x->t_gen += rf_time_now() - t; /* the reward is part of generating a sample (perf/share_generate) */
    }
    if (st == RF_OK && (flags & ~RF_ROLE_SCORE_RM)) st = policy_scores(x, all, n, flags);
    for (int i = 0; st == RF_OK && i < k; i++) st = sink->scored(sink->ctx, q[i].req);
    free(q), free(all);
    return st;
}

/* ---- training, checkpoints ---- */

static rf_status run_training(inproc *x, const rf_role_sink *sink) {
    rf_run *run = x->run;
    const rf_recipe *r = run->r;
    rf_train_sample *s = x->batch;
    int n = x->n_batch, v = x->batch_version;
    x->batch = NULL;
    double t0 = rf_time_now(), t = t0;
    rf_update_stats as = {0}, cs = {0};
    rf_optim_opts ao = rf__optim_opts(r, 0), co = rf__optim_opts(r, 1);
    rf_update_opts uo = rf__update_opts(r, x->batch_kl, run->kl_est, run->agg, v, 0);
    rf_update_opts uc = rf__update_opts(r, x->batch_kl, run->kl_est, run->agg, v, 1);
    rf_status st = v == x->version ? RF_OK
                                   : rf_error(RF_ERR_ARG, "in-process trainer: a batch for version %d, the actor is at %d",
                                              v, x->version);
    if (st == RF_OK && n > 0) st = rf_actor_update(run->actor, &ao, &uo, s, n, &as);
    x->t_actor += rf_time_now() - t, t = rf_time_now();
    if (st == RF_OK && run->critic && n > 0) st = rf_critic_update(run->critic, &co, &uc, s, n, &cs);
    x->t_critic_train += rf_time_now() - t;
    if (rf_recipe_free_kv_cache(r)) /* training pauses: its workspaces go back, for the KV cache */
        rf_model_trim(run->actor), rf_model_trim(run->critic), rf_model_trim(run->ref);
    for (int i = 0; i < n; i++) rf_train_sample_free(&s[i]);
    free(s);
    if (st != RF_OK) return st;
    rf__update_metrics(run->metrics, r, &as, run->critic ? &cs : NULL);
    rf_metrics_set(run->metrics, "perf/train_tokens_per_s", (double)as.tokens / fmax(x->t_actor, 1e-9));
    x->version++;
    return sink->trained(sink->ctx, x->version, rf_time_now() - t0);
}

static rf_status run_checkpoint(inproc *x, const rf_role_sink *sink) {
    rf_run *run = x->run;
    const rf_recipe *r = run->r;
    x->ckpt_pending = 0;
    double t = rf_time_now();
    /* with LoRA the checkpoint holds the adapters in PEFT's layout too (step_N/adapter) */
    RF_TRY(rf_checkpoint_save(r->logging.dir, run->actor, run->critic, r->model.path, &x->ckpt, r->checkpoint.keep));
    return sink->checkpointed(sink->ctx, x->ckpt.step, rf_time_now() - t);
}

static rf_status progress(void *ctx, double timeout, const rf_role_sink *sink) {
    (void)timeout;
    inproc *x = ctx;
    if (x->ckpt_pending) return run_checkpoint(x, sink);
    if (x->n_gen) return run_generation(x, sink);
    if (x->n_sc) return run_scoring(x, sink);
    if (x->batch) return run_training(x, sink);
    return rf_error(RF_ERR_ARG, "in-process roles: the loop waits with no request pending (step %d)", x->version);
}

/* perf/gen_tokens_per_s (over the generation time alone, the engine's throughput) and
 * perf/share_*: each phase's share of the step's role time. */
static void step_metrics(void *ctx, rf_metrics *m, double step_s) {
    (void)step_s;
    inproc *x = ctx;
    rf_metrics_set(m, "perf/gen_tokens_per_s", x->gen_tokens / fmax(x->t_gen, 1e-9));
    x->gen_tokens = 0;
    double total = x->t_gen + x->t_ref + x->t_prox + x->t_critic + x->t_actor + x->t_critic_train;
    total = fmax(total, 1e-9);
    rf_metrics_set(m, "perf/share_generate", x->t_gen / total);
    rf_metrics_set(m, "perf/share_reference", x->t_ref / total);
    rf_metrics_set(m, "perf/share_prox", x->t_prox / total);
    rf_metrics_set(m, "perf/share_critic", (x->t_critic + x->t_critic_train) / total);
    rf_metrics_set(m, "perf/share_train", x->t_actor / total);
    x->t_gen = x->t_ref = x->t_prox = x->t_critic = x->t_actor = x->t_critic_train = 0;
}

static const rf_role_iface INPROC = {"in-process", 0, served, generate, score, train, checkpoint, progress, step_metrics};

rf_status rf_roles_inproc_init(rf_roles *out, rf_run *run) {
    inproc *x = calloc(1, sizeof *x);
    if (!x) return rf_error(RF_ERR_NOMEM, "out of memory");
    x->run = run, x->version = run->step;
    out->iface = &INPROC, out->ctx = x;
    return RF_OK;
}

void rf_roles_inproc_free(rf_roles *roles) {
    inproc *x = roles ? roles->ctx : NULL;
    if (!x) return;
    for (int i = 0; x->batch && i < x->n_batch; i++) rf_train_sample_free(&x->batch[i]);
    free(x->batch), free(x->gen), free(x->sc);
    free(x);
    roles->ctx = NULL;
}
