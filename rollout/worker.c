/* The rollout worker's event loop: weights, messages, one engine step, repeat. With
 * placement.rollout.tp = G > 1 the worker is G ranks: rank 0 runs this loop with an engine
 * whose steps drive the others (rollout/rollout_tp.h), which serve its commands. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/msg_link.h"
#include "common/rng.h"
#include "common/util.h"
#include "controller/run_internal.h"
#include "resharding/handover.h"
#include "resharding/weights_reshard.h"
#include "resharding/weights_sync.h"
#include "rollout/rollout.h"
#include "rollout/rollout_tp.h"
#include "rollout/worker.h"
#include "rollout/worker_episodes.h"
#include "env/calculator.h"
#include "kernels/kernels.h"

typedef struct worker {
    const rf_recipe *r;
    rf_msg_link *link;
    rf_model *m;           /* the whole model (G = 1), or the shard's (tp->m) */
    rf_model_tp *tp;       /* G > 1: this rank's shard */
    rf_rollout_tp *g;      /* G > 1: the group */
    rf_comm *gcomm;        /* G > 1: the group's communicator (host messages) */
    rf_comm *gdev;         /* G > 1 on CUDA: NCCL over the group, which the shards compute over */
    rf_tokenizer *tok;
    rf_rollout *e;
    int32_t *eos;
    int n_eos, rank;
    int64_t version;
    uint32_t crc;
    double busy, t0, load_s;
    rf_status st; /* first failure inside the callback */
    rf_handover *ho; /* colocated on several devices: the weights of this process's training rank */
    int zero_copy;   /* ho with identical layouts: the model borrows the training shard's buffer */
    rf_wep *ep;      /* [env]: the episodes (rollout/worker_episodes.h); NULL without */
    uint32_t base_crc; /* LoRA: CRC-32C of the frozen base held (the whole model's, from the
                          group's shards with G > 1); every adapters-only transfer must carry it */
} worker;

static Rlflow__FinishReason finish_reason(rf_finish f) {
    return f == RF_FINISH_LENGTH ? RLFLOW__FINISH_REASON__FINISH_LENGTH : RLFLOW__FINISH_REASON__FINISH_STOP;
}

static void on_sample(void *ctx, const rf_rollout_sample *rs) {
    worker *w = ctx;
    if (w->st != RF_OK) return;
    if (rs->turn_end) { /* [env]: to the controller with the step's other turns (rf_wep_flush) */
        w->st = rf_wep_turn(w->ep, rs);
        return;
    }
    int base = 0, episode = w->ep && rf_wep_lookup(w->ep, rs->request_id, &base);
    int64_t *ver = malloc(sizeof(int64_t) * (size_t)(rs->n_tokens ? rs->n_tokens : 1));
    if (!ver) {
        w->st = rf_error(RF_ERR_NOMEM, "out of memory");
        return;
    }
    for (int i = 0; i < rs->n_tokens; i++) ver[i] = rs->versions[i];
    Rlflow__Sample s = RLFLOW__SAMPLE__INIT;
    s.request_id = (uint64_t)(uintptr_t)rs->user;
    s.index = base + rs->index;
    s.n_tokens = (size_t)rs->n_tokens, s.tokens = (int32_t *)rs->tokens;
    s.n_logprobs = (size_t)rs->n_tokens, s.logprobs = (float *)rs->logprobs;
    s.n_versions = (size_t)rs->n_tokens, s.versions = ver;
    s.text = (char *)(rs->text ? rs->text : "");
    s.finish = finish_reason(rs->finish);
    s.weights_checksum = w->crc;
    s.prompt_len = rs->prompt_len;
    if (episode) s.loss_mask = (ProtobufCBinaryData){(size_t)rs->n_tokens, (uint8_t *)rs->mask};
    w->st = rf_msg_link_send(w->link, RF_MSG_SAMPLE, &s.base);
    free(ver);
    if (episode) rf_wep_finished(w->ep, rs->request_id);
}

static rf_status submit(worker *w, const Rlflow__GenerateRequest *g) {
    const rf_recipe *r = w->r;
    /* test hook: take requests and never answer (heartbeats go on), for async.progress_timeout */
    if (getenv("RF_TEST_ROLLOUT_STALL")) return RF_OK;
    rf_rollout_request q = {.prompt = g->prompt_ids, .prompt_len = (int)g->n_prompt_ids, .n = g->n,
                            .max_new_tokens = r->rollout.max_new_tokens,
                            .stop_ids = w->eos, .n_stop_ids = w->n_eos};
    if (g->greedy) {
        q.sampling.greedy = 1, q.sampling.temperature = 1, q.sampling.top_p = 1;
    } else if (g->sampling) {
        q.sampling = (rf_sampling){0, g->sampling->temperature, g->sampling->top_k, g->sampling->top_p};
        if (g->sampling->max_new_tokens > 0) q.max_new_tokens = g->sampling->max_new_tokens;
        q.seed = g->sampling->seed;
    } else {
        return rf_error(RF_ERR_FORMAT, "GenerateRequest %llu carries no sampling parameters",
                        (unsigned long long)g->request_id);
    }
    int has_calc = 0;
    for (int i = 0; i < r->rollout.stop.n && i < RF_MAX_STOP; i++) {
        q.stop[q.n_stop++] = r->rollout.stop.v[i];
        has_calc |= strcmp(r->rollout.stop.v[i], RF_CALC_STOP) == 0;
    }
    rf_status st;
    if (g->episode) { /* [env]: the calculator's tool calls end a turn, as in one process */
        if (!w->ep)
            return rf_error(RF_ERR_FORMAT, "GenerateRequest %llu is an episode, and this run has no [env]",
                            (unsigned long long)g->request_id);
        if (strcmp(r->env.type, "calculator") == 0 && !has_calc && q.n_stop < RF_MAX_STOP) q.stop[q.n_stop++] = RF_CALC_STOP;
        st = rf_wep_submit(w->ep, w->e, g, &q);
    } else {
        st = rf_rollout_submit(w->e, &q, (void *)(uintptr_t)g->request_id, NULL);
    }
    if (st != RF_OK)
        return rf_error_wrap(st, "GenerateRequest %llu", (unsigned long long)g->request_id);
    return RF_OK;
}

static rf_status weights_loaded(worker *w) {
    Rlflow__WeightsLoaded wl = RLFLOW__WEIGHTS_LOADED__INIT;
    wl.version = w->version, wl.checksum = w->crc, wl.rank = w->rank;
    wl.busy_s = w->busy, wl.wall_s = rf_time_now() - w->t0, wl.load_s = w->load_s;
    return rf_msg_link_send(w->link, RF_MSG_WEIGHTS_LOADED, &wl.base);
}

/* Where weights come from: the training worker's whole buffer (weights_sync), or the
 * placement.actor.tp training shards resharded into this worker's whole model, or, with
 * placement.rollout.tp > 1, into each rank's shard. */
typedef struct weights_in {
    rf_weights_rx *rx;
    rf_weights_rs *rs;
    float *stage; /* resharding into a CUDA model: the host buffer it lands in, then uploaded */
    rf_param_view *adapters; /* LoRA: the adapters' table, offsets from 0 (what is resharded) */
} weights_in;

static float *weights_dst(const weights_in *in, const worker *w);

/* The host buffer resharded weights land in before they reach the model (in->stage). */
static rf_status stage_alloc(weights_in *in, const worker *w) {
    if (!(in->stage = malloc(sizeof(float) * (w->m->n_params ? w->m->n_params : 1))))
        return rf_error(RF_ERR_NOMEM, "out of memory for %zu floats of weights", w->m->n_params);
    return RF_OK;
}

/* A model on a device receives host weights into in->stage first (uploaded on arrival); a
 * model kept in bf16 (rf_model_keep_bf16) gets a stage for each version only (rs_receive). */
static rf_status stage_open(weights_in *in, const worker *w) {
    return w->m->k != rf_cpu_kernels() && !w->m->wbf16 ? stage_alloc(in, w) : RF_OK;
}

/* Colocated: nothing to receive; with other layouts the training rank reshards into this
 * rank's buffer (host memory: the model's own, or a stage uploaded to the device). */
static rf_status handover_open(weights_in *in, const worker *w) {
    if (w->zero_copy) return RF_OK;
    RF_TRY(stage_open(in, w));
    rf_handover_offer_dst(w->ho, weights_dst(in, w));
    return RF_OK;
}

static rf_status weights_in_open(weights_in *in, const worker *w, rf_comm *wcomm, int train_rank) {
    const rf_recipe *r = w->r;
    if (w->ho) return handover_open(in, w);
    if (r->placement.actor.tp <= 1 && !w->tp) return rf_weights_rx_init(&in->rx, wcomm, w->m, train_rank);
    RF_TRY(stage_open(in, w));
    rf_param_table pt = w->tp ? (rf_param_table){&w->tp->cfg, w->tp->full_views, w->tp->n_full_views}
                              : rf_param_table_of(w->m);
    /* LoRA: the training shards' adapters into this frozen base's (whole, or split like the
     * base over the G ranks) */
    if (w->tp && w->tp->lora_views) pt = (rf_param_table){&w->tp->cfg, w->tp->lora_views, w->tp->n_lora_views};
    else if (!w->tp && w->m->n_frozen) {
        int n = 0;
        RF_TRY(rf_lora_table(w->m, &in->adapters, &n));
        pt = (rf_param_table){&w->m->cfg, in->adapters, n};
    }
    int dp = r->placement.actor.tp > 1 ? r->placement.actor.dp : 1; /* with tp 1 only DP rank 0 sends */
    RF_TRY(rf_weights_rs_init(&in->rs, &pt, r->placement.actor.tp, dp, w->tp ? w->tp->tp : 1, wcomm, RF_WEIGHTS_RS_BUCKET,
                              r->async.peer_timeout));
    rf_weights_rs_set_base(in->rs, w->base_crc);
    return RF_OK;
}

static void weights_in_close(weights_in *in) {
    rf_weights_rx_free(in->rx);
    rf_weights_rs_free(in->rs);
    free(in->stage);
    free(in->adapters);
}

/* Where resharded weights land (host memory): the model's buffer, or the staging one (under
 * LoRA their adapters' floats). */
static float *weights_dst(const weights_in *in, const worker *w) {
    return (in->stage ? in->stage : w->m->params) + w->m->n_frozen;
}

/* A new version is in the parameters (or in the stage, written into the model here: uploaded
 * to the device, or rounded into a bf16-kept model's store): the back end's converted weight
 * copies (bf16) are stale from now on. */
static rf_status weights_upload(const weights_in *in, const worker *w) {
    size_t f = w->m->n_frozen; /* LoRA: the adapters alone changed */
    if (in->stage) RF_TRY(rf_model_write_params(w->m, f, in->stage + f, w->m->n_params - f));
    w->m->k->weights_updated();
    return RF_OK;
}

/* A resharded version into the model (this rank's shard with G > 1; gcomm: the group's, NULL
 * with G = 1), once it was announced: into the model's buffer, or its stage, written into the
 * model after. A model kept in bf16 gets a stage made for this version and freed once written,
 * so no fp32 copy stays between versions. */
static rf_status rs_receive(weights_in *in, const worker *w, rf_comm *gcomm, int64_t *version, uint32_t *crc) {
    int fresh = w->m->wbf16 && !in->stage;
    if (fresh) RF_TRY(stage_alloc(in, w));
    rf_status st = rf_weights_rs_receive(in->rs, weights_dst(in, w), gcomm, version, crc);
    if (st == RF_OK) st = weights_upload(in, w);
    if (fresh) free(in->stage), in->stage = NULL;
    return st;
}

/* G > 1, every rank of the group before a transfer: a rank that is gone is named here. Inside
 * the transfer a rollout rank waits on the training ranks, which wait on every rollout rank: a
 * lost peer would show as a training rank that stalled. */
static rf_status group_present(const worker *w) {
    return rf_comm_barrier(w->gcomm, w->r->async.peer_timeout, "rollout tensor parallelism: the group meeting for new weights");
}

/* A peer's step guard (colocated: the weights are not being written meanwhile). */
static rf_status step_begin(void *ho) { return rf_handover_read_begin(ho); }
static void step_end(void *ho) { rf_handover_read_end(ho); }

/* Colocated: a version the training rank of this process handed over (with G > 1 every rank of
 * the group waits for its own, then they meet). */
static rf_status handover_poll(weights_in *in, const worker *w, int *arrived, int64_t *version, uint32_t *crc) {
    *arrived = 0;
    int64_t v = rf_handover_latest(w->ho, crc, NULL);
    if (v <= w->version) return RF_OK;
    if (w->g) {
        RF_TRY(rf_rollout_tp_send(w->g, RF_ROLLOUT_TP_WEIGHTS, v));
        RF_TRY(group_present(w));
    }
    RF_TRY(weights_upload(in, w));
    *version = v, *arrived = 1;
    return RF_OK;
}

static rf_status weights_poll(weights_in *in, const worker *w, int *arrived, int64_t *version, uint32_t *crc) {
    if (w->ho) return handover_poll(in, w, arrived, version, crc);
    if (in->rx) return rf_weights_rx_poll(in->rx, w->m, arrived, version, crc);
    *arrived = 0;
    int t = rf_weights_rs_pending(in->rs);
    if (t < 0) return rf_error_wrap(RF_ERR_IO, "receiving weights from the training ranks");
    if (!t) return RF_OK;
    if (w->g) { /* the group's other ranks receive their shards at the same time */
        RF_TRY(rf_rollout_tp_send(w->g, RF_ROLLOUT_TP_WEIGHTS, 0));
        RF_TRY(group_present(w));
    }
    RF_TRY(rs_receive(in, w, w->g ? w->gcomm : NULL, version, crc));
    *arrived = 1;
    return RF_OK;
}

static rf_status serve(worker *w, rf_comm *wcomm, int train_rank) {
    const rf_recipe *r = w->r;
    weights_in in = {0};
    RF_TRY(weights_in_open(&in, w, wcomm, train_rank));
    rf_status st = RF_OK;
    int have_weights = 0, done = 0;
    double delay_ms = rf_test_delay_ms("RF_TEST_DELAY_ROLLOUT_MS"); /* tests only */
    rf_rng delay_rng;
    rf_rng_seed(&delay_rng, 0x9e3779b97f4a7c15ull + (uint64_t)w->rank);
    double waiting_since = rf_time_now();
    while (st == RF_OK && !done) {
        int arrived = 0;
        int64_t v;
        uint32_t crc;
        double t_load = rf_time_now();
        st = weights_poll(&in, w, &arrived, &v, &crc);
        if (st == RF_OK && w->g) st = rf_rollout_tp_keepalive(w->g);
        w->load_s = rf_time_now() - t_load;
        if (st == RF_OK && arrived) {
            w->m->k->weights_updated(); /* every path, rf_weights_rx_poll's in place included */
            w->version = v, w->crc = crc;
            rf_rollout_set_version(w->e, (int)v);
            if (!have_weights) w->t0 = rf_time_now(), w->busy = 0; /* busy/wall from serving on */
            have_weights = 1;
            st = weights_loaded(w);
        }
        if (st != RF_OK) break;
        if (!have_weights) {
            /* nothing to generate with yet; the link answers pings meanwhile */
            if (rf_time_now() - waiting_since > r->async.startup_timeout) {
                st = rf_error(RF_ERR_IO, "no weights from the training worker (rank %d) within %.0f s (async.startup_timeout)",
                              train_rank, r->async.startup_timeout);
                break;
            }
            rf_msg m;
            int got;
            st = rf_msg_link_recv(w->link, 0.001, &m, &got);
            if (st == RF_OK && got) {
                if (m.type == RF_MSG_SHUTDOWN) done = 1;
                else st = rf_error(RF_ERR_FORMAT, "the controller sent %s before any weights arrived",
                                   rf_msg_type_name(m.type));
                rf_msg_free(&m);
            }
            continue;
        }
        int idle = rf_rollout_idle(w->e);
        for (int i = 0; st == RF_OK && i < 4096; i++) {
            rf_msg m;
            int got;
            st = rf_msg_link_recv(w->link, idle && i == 0 ? 0.002 : 0, &m, &got);
            if (st != RF_OK || !got) break;
            if (m.type == RF_MSG_GENERATE_REQUEST) st = submit(w, (Rlflow__GenerateRequest *)m.pb);
            else if (m.type == RF_MSG_ENV_OBSERVATIONS && w->ep) st = rf_wep_answers(w->ep, w->e, (Rlflow__EnvObservations *)m.pb);
            else if (m.type == RF_MSG_SHUTDOWN) {
                const char *why = ((Rlflow__Shutdown *)m.pb)->reason;
                done = 1;
                if (!RF_MSG_SHUTDOWN_CLEAN(why))
                    st = rf_error(RF_ERR_IO, "the controller stopped the run: %s", why ? why : "");
            } else {
                st = rf_error(RF_ERR_FORMAT, "the controller sent a rollout worker %s", rf_msg_type_name(m.type));
            }
            rf_msg_free(&m);
        }
        if (st != RF_OK || done) break;
        if (delay_ms > 0 && rf_rng_uniform(&delay_rng) < 0.2f)
            rf_sleep(rf_rng_uniform(&delay_rng) * delay_ms * 1e-3);
        if (!rf_rollout_idle(w->e)) {
            double t = rf_time_now();
            st = rf__rollout_resume(w->e);
            if (st == RF_OK && w->ho) st = rf_handover_read_begin(w->ho); /* colocated: the weights are not being written */
            if (st == RF_OK) {
                st = rf_rollout_step(w->e);
                if (w->ho) rf_handover_read_end(w->ho);
            }
            w->busy += rf_time_now() - t;
            if (st == RF_OK) st = w->st;
            if (st == RF_OK && w->ep) st = rf_wep_flush(w->ep, w->link);
            /* the cache may go back (not while episodes wait between turns: their KV stays) */
            if (st == RF_OK && rf_rollout_idle(w->e) && !rf_rollout_waiting_turns(w->e)) st = rf__rollout_pause(r, w->e, w->rank);
        }
        if (st == RF_OK && w->ep) st = rf_wep_check(w->ep);
    }
    weights_in_close(&in);
    return st;
}

/* Colocated with identical layouts: the training rank's parameter buffer (its shard's), once
 * it has handed over its first version; NULL otherwise (the model has buffers of its own). */
static rf_status borrowed_params(const worker *w, float **params) {
    *params = NULL;
    if (!w->zero_copy) return RF_OK;
    uint32_t crc;
    return rf_handover_wait_version(w->ho, 0, w->r->async.startup_timeout, "the rollout rank's model", &crc, params);
}

/* The policy's shape, from model.path's config.json. */
static rf_status policy_config(const worker *w, rf_model_config *cfg) {
    char p[4096];
    rf_path_join(p, sizeof p, w->r->model.path, "config.json");
    return rf_config_load(cfg, p);
}

/* Whether this rank's model keeps its matrices in bf16 (rf_model_keep_bf16): weights from the
 * training worker with every version (not colocated; no LoRA, whose frozen base is read from
 * model.path once and checksummed), at bf16 precision on the CPU. */
static int keeps_bf16(const worker *w, const rf_kernels *k) {
    return !w->ho && !w->r->lora.enabled && rf_model_can_keep_bf16(k);
}

/* w->m (the whole model, or this rank's shard), made with nothing written yet, kept in bf16:
 * no fp32 copy of weights this process never updates. Logged. */
static rf_status keep_bf16(worker *w) {
    int kept = 0;
    RF_TRY(rf_model_keep_bf16(w->m, &kept));
    RF_ASSERT(kept); /* keeps_bf16 was checked */
    size_t mat = 0; /* floats held as bf16: the matrices after the embedding table */
    for (int i = 0; i < w->m->n_views; i++)
        if (w->m->views[i].ndim == 2 && w->m->views[i].offset >= w->m->bf16_lo) mat += w->m->views[i].numel;
    char shard[64] = "";
    if (w->tp) snprintf(shard, sizeof shard, ", tensor-parallel rank %d of %d", w->tp->t, w->tp->tp);
    rf_log_info("rollout worker %d%s: weights kept in bf16 (%.1f MB of matrices; the embedding table, norms and "
                "biases fp32, %.1f MB): no fp32 copy of the matrices", w->rank, shard, (double)mat * 2 / (1 << 20),
                (double)(w->m->n_params - mat) * 4 / (1 << 20));
    return RF_OK;
}

/* LoRA, G > 1, the weights not read in place: this rank's shard of the frozen base read from
 * model.path (once: the adapters alone arrive with each version), the recipe's adapters split
 * like it (their values come with the first version), and the whole base's CRC-32C from the
 * group's shards (every rank of the group together, over the host communicator). */
static rf_status tp_lora_open(worker *w, const rf_kernels *k) {
    rf_lora_opts o;
    RF_TRY(rf_model_tp_load(w->tp, w->r->model.path, NULL, NULL));
    RF_TRY(rf__lora_opts(w->r, &o));
    RF_TRY(rf_model_tp_lora_attach(w->tp, &o));
    rf_param_table pt = {&w->tp->cfg, w->tp->full_views, w->tp->n_full_views};
    return rf_weights_rs_base_checksum(w->gcomm, &pt, k, w->tp->m->params, w->r->async.startup_timeout, &w->base_crc);
}

/* G > 1: this rank's shard of the policy (zeros until the first weights, its matrices kept in
 * bf16 where keeps_bf16; under LoRA the frozen base from model.path; or colocated with identical
 * layouts the training shard itself, under LoRA with its adapters bound in place) and its
 * group. */
static rf_status tp_open(worker *w, const rf_kernels *k) {
    rf_model_config cfg;
    RF_TRY(policy_config(w, &cfg));
    rf_comm *c; /* on CUDA the shards compute over NCCL */
    RF_TRY(rf_comm_for(w->gcomm, k, "rollout tensor parallelism", w->r->async.startup_timeout, &w->gdev, &c));
    float *params;
    RF_TRY(borrowed_params(w, &params));
    RF_TRY(rf_model_tp_init_borrowed(&w->tp, &cfg, k, c, w->r->async.peer_timeout, params));
    w->m = w->tp->m;
    if (keeps_bf16(w, k)) RF_TRY(keep_bf16(w)); /* the shard's matrices */
    if (w->r->lora.enabled && w->zero_copy) { /* colocated: the training shard's adapters, in place */
        rf_lora_opts o;
        RF_TRY(rf__lora_opts(w->r, &o));
        RF_TRY(rf_model_tp_lora_bind(w->tp, &o));
    } else if (w->r->lora.enabled) {
        RF_TRY(tp_lora_open(w, k));
    }
    RF_TRY(rf_rollout_tp_init(&w->g, w->tp, w->r->async.peer_timeout));
    if (w->ho) rf_rollout_tp_set_guard(w->g, step_begin, step_end, w->ho);
    return RF_OK;
}

/* G = 1 where keeps_bf16: the policy's shape alone, its matrices kept in bf16 (the checkpoint is
 * not read: every float arrives with the first version). */
static rf_status whole_open_kept(worker *w, const rf_kernels *k) {
    rf_model_config cfg;
    RF_TRY(policy_config(w, &cfg));
    RF_TRY(rf_model_init(&w->m, &cfg, k));
    return keep_bf16(w);
}

/* G = 1: the whole policy (read from the model directory, with the recipe's LoRA adapters, or
 * colocated with identical layouts the training rank's own buffer, under LoRA its adapters
 * bound in place; whole_open_kept where it applies). */
static rf_status whole_open(worker *w, const rf_kernels *k) {
    if (keeps_bf16(w, k)) return whole_open_kept(w, k);
    float *params;
    RF_TRY(borrowed_params(w, &params));
    if (!params) { /* under LoRA the frozen base once, the adapters arriving with each version */
        RF_TRY(rf_model_load(&w->m, w->r->model.path, k, 0));
        RF_TRY(rf__lora_attach(w->r, w->m));
        if (!w->m->n_frozen) return RF_OK;
        rf_param_table pt = rf_param_table_of(w->m);
        return rf_weights_rs_base_checksum(rf_comm_single(), &pt, k, w->m->params, w->r->async.startup_timeout,
                                           &w->base_crc);
    }
    rf_model_config cfg;
    RF_TRY(policy_config(w, &cfg));
    RF_TRY(rf_model_init_borrowed(&w->m, &cfg, k, params));
    if (!w->r->lora.enabled) return RF_OK;
    rf_lora_opts o; /* the training rank's adapters, after its base in the buffer */
    RF_TRY(rf__lora_opts(w->r, &o));
    return rf_model_lora_bind(w->m, &o);
}

/* Rank 0 of the worker: the model (whole, or its shard), tokenizer, stop ids and the engine. */
static rf_status engine_open(worker *w, const rf_kernels *k) {
    const rf_recipe *r = w->r;
    RF_TRY(w->gcomm ? tp_open(w, k) : whole_open(w, k));
    RF_TRY(rf_tokenizer_load_dir(&w->tok, r->model.path));
    RF_TRY(rf__eos_ids(r->model.path, w->m, w->tok, &w->eos, &w->n_eos));
    return rf__rollout_engine(r, rf_recipe_colocated_ranks(r), w->m, w->g, w->tok, &w->e);
}

/* A peer (tensor-parallel rank > 0): its weights and the command it serves. */
typedef struct peer {
    worker *w;
    weights_in in;
} peer;

/* A peer's serve callback: new weights, received with the group. */
static rf_status peer_command(void *ctx, int cmd, int64_t arg) {
    peer *p = ctx;
    int64_t version;
    uint32_t crc;
    if (cmd != RF_ROLLOUT_TP_WEIGHTS)
        return rf_error(RF_ERR_FORMAT, "rollout tensor parallelism: unknown command %d from rank 0 of the group", cmd);
    if (p->w->ho) { /* colocated: this rank's own training rank hands the version over */
        RF_TRY(rf_handover_wait_version(p->w->ho, arg, p->w->r->async.peer_timeout, "rollout tensor parallelism", &crc,
                                        NULL));
        RF_TRY(group_present(p->w));
        return weights_upload(&p->in, p->w);
    }
    RF_TRY(group_present(p->w));
    return rs_receive(&p->in, p->w, p->w->gcomm, &version, &crc);
}

/* A peer's whole life: its shard, its part of the weights transfers, rank 0's commands. */
static rf_status peer_main(worker *w, const rf_kernels *k, rf_comm *wcomm) {
    peer p = {w, {0}};
    RF_TRY(tp_open(w, k));
    rf_status st = weights_in_open(&p.in, w, wcomm, 0);
    if (st == RF_OK)
        rf_log_info("rollout worker %d: tensor-parallel rank %d of %d ready (world rank %d, pid %d)", w->rank,
                    w->tp->t, w->tp->tp, rf_comm_world_rank(w->gcomm, w->tp->t), (int)getpid());
    if (st == RF_OK) st = rf_rollout_tp_serve(w->g, peer_command, &p);
    weights_in_close(&p.in);
    return st;
}

/* Rank 0 with G > 1: the peers stop with it (bounded). Returns st, or the stop's failure
 * when st is RF_OK; an earlier failure keeps its message. */
static rf_status stop_peers(worker *w, rf_status st) {
    if (!w->g) return st;
    char keep[1024];
    snprintf(keep, sizeof keep, "%s", rf_error_message());
    rf_status s = rf_rollout_tp_send(w->g, RF_ROLLOUT_TP_STOP, 0);
    if (st == RF_OK) return s;
    return rf_error(st, "%s", keep);
}

/* Frees what any rank of a rollout worker holds (NULL members are fine). */
static void worker_free(worker *w) {
    rf_msg_link_close(w->link);
    rf_rollout_free(w->e);
    rf_rollout_tp_free(w->g);
    if (w->tp) rf_model_tp_free(w->tp);
    else rf_model_free(w->m);
    rf_comm_free(w->gdev);
    rf_tokenizer_free(w->tok);
    free(w->eos);
    rf_wep_free(w->ep);
}

rf_status rf_rollout_worker_main(const rf_recipe *r, const rf_msg_dial *dial, int rank,
                                 rf_comm *wcomm, rf_comm *gcomm, int train_rank, rf_handover *ho) {
    worker w = {.r = r, .rank = rank, .version = -1, .t0 = rf_time_now(),
                .gcomm = gcomm && rf_comm_size(gcomm) > 1 ? gcomm : NULL, .ho = ho,
                .zero_copy = ho && r->placement.rollout.tp == r->placement.actor.tp};
    const rf_kernels *k = rf_kernels_for(r->model.device);
    if (!k) return rf_error_wrap(RF_ERR_NODEVICE, "model.device = \"%s\"", r->model.device);
    RF_TRY(rf_kernels_apply_precision(k, r->model.precision, "model.precision", NULL));
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    if (w.gcomm && rf_comm_rank(w.gcomm) > 0) {
        rf_status st = peer_main(&w, k, wcomm);
        if (st != RF_OK)
            st = rf_error_wrap(st, "rollout worker %d, tensor-parallel rank %d, on %s", rank, rf_comm_rank(w.gcomm), host);
        worker_free(&w);
        return st;
    }
    rf_msg_client_config cc = {.role = RLFLOW__ROLE__ROLE_ROLLOUT, .rank = rank,
                               .capacity = r->rollout.max_running, .name = "rollout",
                               .timeout_s = r->async.startup_timeout};
    rf_msg_dial_apply(dial, &cc);
    rf_status st = engine_open(&w, k);
    if (st == RF_OK && r->env.type[0]) st = rf_wep_init(&w.ep, r);
    if (st == RF_OK) st = rf_msg_link_open(&w.link, &cc, r->async.peer_timeout);
    if (st == RF_OK) {
        rf_rollout_set_callback(w.e, on_sample, &w);
        st = serve(&w, wcomm, train_rank);
        if (st == RF_OK) rf_msg_link_flush(w.link, 5.0);
    }
    st = stop_peers(&w, st);
    if (st != RF_OK) st = rf_error_wrap(st, "rollout worker %d on %s", rank, host);
    if (st != RF_OK) rf_msg_link_tell_error(&w.link, &cc, r->async.peer_timeout, st);
    worker_free(&w);
    return st;
}
