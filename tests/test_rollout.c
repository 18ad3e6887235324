/* The rollout engine and its paged KV cache:
 *  - paged attention over scattered blocks equals the contiguous attention_forward bit for bit
 *    on the CPU (same arithmetic, only the key addresses differ), and the CUDA paged ops equal
 *    the CPU ones within fp32 tolerance (skipped without a GPU);
 *  - with n = 1 and seeds seed + r, the engine reproduces rf_generate token for token, greedy
 *    and sampled, with stop ids and with stop strings;
 *  - the n samples of one prompt share its KV blocks (one prefill, references = n, copy on
 *    write of the partially filled last block) and still equal n independent rf_generate runs;
 *  - a pool too small for the batch forces preemption, and the outputs do not change;
 *  - a pool sized from memory: the longest load when the budget holds it, the budget's blocks
 *    when not (generation still finishes), refused below one sequence;
 *  - the pool's memory given back while idle (and the model's workspace) is allocated again by
 *    the next step with work, and the outputs do not change; refused while sequences run, an
 *    allocation that fails is an error naming the size;
 *  - continuous batching admits a queued request as soon as a running one finishes;
 *  - policy versions are recorded per token; errors are clear. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "model/byte_tokenizer.h"
#include "model/generate.h"
#include "rollout/kv_pool.h"
#include "rollout/rollout.h"
#include "test_util.h"

/* ---- kernels ---- */

static float frand(rf_rng *r) { return rf_rng_uniform(r) * 2.0f - 1.0f; }

/* Sequences with cached keys (decode rows and a prefill after a cache), laid out contiguously
 * and, through a shuffled block table, in a pool; paged_kv_write scatters the rows. Case 0 has
 * short query runs only (the CPU's row path); case 1 has runs of 16 rows and more (its blocked
 * path: 70 rows after 10 cached keys are two blocks of 64 and 6). */
typedef struct att_case {
    int n, H, KVH, D, bs, max_blocks, Tq, Tk;
    int32_t q_off[5], k_start[4], k_len[4];
    int32_t *table, *slots; /* (n, max_blocks), (Tk) */
    float *q, *k, *v;       /* (Tq, H, D), (Tk, KVH, D) */
} att_case;

static void att_case_init(att_case *c, rf_rng *r, int which) {
    static const int qlens[2][4] = {{1, 5, 1, 7}, {1, 70, 16, 3}}, klens[2][4] = {{9, 12, 1, 7}, {9, 80, 16, 30}};
    const int *qlen = qlens[which], *klen = klens[which];
    *c = (att_case){.n = 4, .H = 4, .KVH = 2, .D = 8, .bs = 4, .max_blocks = which ? 20 : 3};
    for (int s = 0; s < c->n; s++) {
        c->q_off[s + 1] = c->q_off[s] + qlen[s];
        c->k_start[s] = c->Tk, c->k_len[s] = klen[s];
        c->Tk += klen[s];
    }
    c->Tq = c->q_off[c->n];
    c->table = malloc(sizeof(int32_t) * (size_t)(c->n * c->max_blocks));
    c->slots = malloc(sizeof(int32_t) * (size_t)c->Tk);
    int n_pool = c->n * c->max_blocks;
    for (int i = 0; i < n_pool; i++) c->table[i] = (i * 7 + 3) % n_pool; /* a permutation */
    for (int s = 0; s < c->n; s++)
        for (int j = 0; j < klen[s]; j++)
            c->slots[c->k_start[s] + j] = c->table[s * c->max_blocks + j / c->bs] * c->bs + j % c->bs;
    size_t nq = (size_t)c->Tq * c->H * c->D, nk = (size_t)c->Tk * c->KVH * c->D;
    c->q = malloc(sizeof(float) * nq), c->k = malloc(sizeof(float) * nk), c->v = malloc(sizeof(float) * nk);
    for (size_t i = 0; i < nq; i++) c->q[i] = frand(r);
    for (size_t i = 0; i < nk; i++) c->k[i] = frand(r), c->v[i] = frand(r);
}

static void att_case_free(att_case *c) {
    free(c->table), free(c->slots), free(c->q), free(c->k), free(c->v);
}

static void *upload(const rf_kernels *K, const void *host, size_t bytes) {
    void *d = K->alloc(bytes);
    RF_ASSERT(d);
    K->to_device(d, host, bytes);
    return d;
}

/* Scatters k, v into a pool and runs paged attention on back end K; out (Tq, H, D) host. */
static void run_paged(const rf_kernels *K, const att_case *c, float *out, float *k_pool_host) {
    size_t pool = (size_t)c->n * c->max_blocks * c->bs * c->KVH * c->D;
    size_t nk = (size_t)c->Tk * c->KVH * c->D, nq = (size_t)c->Tq * c->H * c->D;
    float *kp = K->alloc(pool * 4), *vp = K->alloc(pool * 4), *o = K->alloc(nq * 4);
    float *k = upload(K, c->k, nk * 4), *v = upload(K, c->v, nk * 4), *q = upload(K, c->q, nq * 4);
    int32_t *slots = upload(K, c->slots, (size_t)c->Tk * 4), *qo = upload(K, c->q_off, sizeof c->q_off);
    int32_t *tb = upload(K, c->table, (size_t)c->n * c->max_blocks * 4);
    int32_t *kl = upload(K, c->k_len, sizeof c->k_len);
    K->paged_kv_write(kp, vp, k, v, slots, c->Tk, c->KVH, c->D);
    K->paged_attention_forward(o, q, kp, vp, qo, tb, c->max_blocks, kl, c->n, c->bs, c->H, c->KVH, c->D);
    K->to_host(out, o, nq * 4);
    if (k_pool_host) K->to_host(k_pool_host, kp, pool * 4);
    void *all[] = {kp, vp, o, k, v, q, slots, qo, tb, kl};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) K->free(all[i]);
}

static void paged_attention_equals_contiguous(int which) {
    rf_rng r;
    rf_rng_seed(&r, 3);
    att_case c;
    att_case_init(&c, &r, which);
    const rf_kernels *K = rf_cpu_kernels();
    size_t nq = (size_t)c.Tq * c.H * c.D, row = (size_t)c.KVH * c.D;
    float *want = malloc(nq * 4), *got = malloc(nq * 4);
    float *pool = malloc((size_t)c.n * c.max_blocks * c.bs * row * 4);
    K->attention_forward(want, NULL, c.q, c.k, c.v, c.q_off, c.k_start, c.k_len, c.n, c.H, c.KVH, c.D);
    run_paged(K, &c, got, pool);
    CHECK(memcmp(want, got, nq * 4) == 0); /* same arithmetic: bit-identical */
    int placed = 1; /* every key row sits in its slot */
    for (int t = 0; t < c.Tk; t++)
        placed &= memcmp(pool + (size_t)c.slots[t] * row, c.k + (size_t)t * row, row * 4) == 0;
    CHECK(placed);
    /* CUDA twin, when a GPU is present. fp32 with a different summation order (warp sums,
     * online softmax): 1e-5 absolute on outputs of magnitude <= 1. */
    const rf_kernels *G = rf_cuda_kernels(0);
    if (G) {
        run_paged(G, &c, got, NULL);
        double worst = 0;
        for (size_t i = 0; i < nq; i++) worst = fmax(worst, fabs(got[i] - want[i]));
        CHECK(worst < 1e-5);
        printf("paged attention cuda vs cpu: max abs diff %.3g\n", worst);
    } else {
        printf("paged attention cuda vs cpu: skipped (%s)\n", rf_error_message());
    }
    free(want), free(got), free(pool);
    att_case_free(&c);
}

/* ---- engine ---- */

#define MAX_OUT 64

/* Samples the callback received, copied, at slot (request user base + sample index). */
typedef struct collector {
    rf_gen_output out[MAX_OUT];
    int *versions[MAX_OUT];
    int preempted[MAX_OUT];
    int delivered, order[MAX_OUT];
} collector;

static void collect(void *ctx, const rf_rollout_sample *s) {
    collector *c = ctx;
    int at = (int)(intptr_t)s->user + s->index;
    RF_ASSERT(at < MAX_OUT && !c->out[at].tokens);
    rf_gen_output *o = &c->out[at];
    o->n_tokens = s->n_tokens, o->finish = s->finish;
    o->tokens = malloc(sizeof(int32_t) * (size_t)s->n_tokens);
    o->logprobs = malloc(sizeof(float) * (size_t)s->n_tokens);
    c->versions[at] = malloc(sizeof(int) * (size_t)s->n_tokens);
    memcpy(o->tokens, s->tokens, sizeof(int32_t) * (size_t)s->n_tokens);
    memcpy(o->logprobs, s->logprobs, sizeof(float) * (size_t)s->n_tokens);
    memcpy(c->versions[at], s->versions, sizeof(int) * (size_t)s->n_tokens);
    o->text = s->text ? rf_strdup(s->text) : NULL;
    c->preempted[at] = s->n_preempted;
    c->order[c->delivered++] = at;
}

static void collector_free(collector *c) {
    for (int i = 0; i < MAX_OUT; i++) {
        rf_gen_output_free(&c->out[i]);
        free(c->versions[i]);
    }
    memset(c, 0, sizeof *c);
}

static rf_model *tiny_model(void) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", RF_BYTE_TOKENIZER_VOCAB) == RF_OK);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, 4, 0.5f);
    return m;
}

enum { N_PROMPTS = 5 };
static int32_t g_prompt_mem[N_PROMPTS][24];
static const int32_t *g_prompts[N_PROMPTS];
static int g_lens[N_PROMPTS] = {3, 9, 16, 1, 21};

static void make_prompts(void) {
    rf_rng r;
    rf_rng_seed(&r, 11);
    for (int i = 0; i < N_PROMPTS; i++) {
        for (int j = 0; j < g_lens[i]; j++) g_prompt_mem[i][j] = (int32_t)(rf_rng_u64(&r) % 256);
        g_prompts[i] = g_prompt_mem[i];
    }
}

/* A model description giving `decode` (whole host rows of logits, drawn by the engine) where
 * rf_rollout_init's draws on the back end (decode_sample, rf_model_draw). */
static rf_status host_pool_init(void *ctx, rf_kv_pool *p, int n_blocks, int block_size) {
    return rf_kv_pool_init(p, ctx, n_blocks, block_size);
}
static rf_status host_decode(void *ctx, rf_kv_pool *p, const rf_paged_seq *seqs, int n, const int32_t *tokens,
                             float *logits) {
    return rf_model_decode_paged(ctx, p, seqs, n, tokens, logits);
}
static rf_status host_release(void *ctx, rf_kv_pool *p) {
    (void)ctx;
    return rf_kv_pool_release(p);
}
static void host_copy(void *ctx, rf_kv_pool *p, int dst, int src, int n_rows) {
    (void)ctx;
    rf_kv_pool_copy(p, dst, src, n_rows);
}
static rf_rollout_model g_host_mc; /* set by host_rows_draw_alike; used by run_engine when g_use_host */
static int g_use_host;

/* Submits prompt i with n samples (user base i * n) for each prompt, then runs until idle. */
static rf_status run_engine(rf_model *m, const rf_rollout_opts *o, const rf_gen_params *p, int n,
                            collector *col, rf_rollout_stats *st) {
    rf_rollout *e;
    RF_TRY(g_use_host ? rf_rollout_init_model(&e, &g_host_mc, o) : rf_rollout_init(&e, m, o));
    rf_rollout_set_callback(e, collect, col);
    rf_status s = RF_OK;
    for (int i = 0; s == RF_OK && i < N_PROMPTS; i++) {
        rf_rollout_request q = {g_prompts[i], g_lens[i], n, p->sampling, p->max_new_tokens,
                                p->seed + (uint64_t)(n == 1 ? i : 0), p->eos_ids, p->n_eos, {0}, p->n_stop, 0, 0};
        for (int j = 0; j < p->n_stop; j++) q.stop[j] = p->stop[j];
        s = rf_rollout_submit(e, &q, (void *)(intptr_t)(i * n), NULL);
    }
    if (s == RF_OK) s = rf_rollout_run_until_idle(e);
    if (st) rf_rollout_get_stats(e, st);
    CHECK(rf_kv_pool_used(rf_rollout_pool(e)) == 0); /* every block returned */
    rf_rollout_free(e);
    return s;
}

/* out[i] equal to want[i] for count outputs: tokens exactly, log-probs exactly or within tol. */
static int same_outputs(const rf_gen_output *want, const rf_gen_output *got, int count, double tol) {
    int ok = 1;
    for (int i = 0; i < count; i++) {
        ok &= got[i].tokens && got[i].n_tokens == want[i].n_tokens && got[i].finish == want[i].finish;
        if (!ok) return 0;
        ok &= memcmp(got[i].tokens, want[i].tokens, sizeof(int32_t) * (size_t)want[i].n_tokens) == 0;
        for (int t = 0; t < want[i].n_tokens; t++)
            ok &= fabs(got[i].logprobs[t] - want[i].logprobs[t]) <= tol;
        if (!ok) {
            fprintf(stderr, "output %d differs:\n", i);
            for (int t = 0; t < want[i].n_tokens; t++)
                fprintf(stderr, "  %d: %d %d  %.9g %.9g\n", t, want[i].tokens[t], got[i].tokens[t],
                        want[i].logprobs[t], got[i].logprobs[t]);
            return 0;
        }
        if (want[i].text) ok &= got[i].text && strcmp(got[i].text, want[i].text) == 0;
    }
    return ok;
}

static void generate_all(rf_model *m, const rf_tokenizer *tok, const rf_gen_params *p,
                         rf_gen_output *out) {
    CHECK_OK(rf_generate(m, tok, g_prompts, g_lens, N_PROMPTS, p, out, 0));
}

/* n = 1, seeds seed + r: the engine's outputs are rf_generate's, bit for bit (same batches,
 * same arithmetic: step 1 prefills every prompt together, later steps decode together). */
static void matches_generate(rf_model *m, const rf_tokenizer *tok) {
    rf_rollout_opts o = {.block_size = 4};
    rf_gen_params gp = {.sampling = {1, 1.0f, 0, 1.0f}, .max_new_tokens = 12, .seed = 5};
    rf_gen_params variants[4];
    variants[0] = gp;                                     /* greedy */
    gp.sampling = (rf_sampling){0, 1.0f, 0, 1.0f}, gp.max_new_tokens = 20, gp.seed = 9;
    variants[1] = gp;                                     /* sampled */
    gp.sampling = (rf_sampling){0, 0.8f, 20, 0.9f};
    variants[2] = gp;                                     /* top-k + top-p */
    variants[3] = variants[1];                            /* sampled with a stop id, below */
    rf_gen_output plain[N_PROMPTS];
    generate_all(m, NULL, &variants[1], plain);
    int32_t eos = plain[1].tokens[3];
    variants[3].eos_ids = &eos, variants[3].n_eos = 1;
    for (int i = 0; i < N_PROMPTS; i++) rf_gen_output_free(&plain[i]);
    for (int v = 0; v < 4; v++) {
        rf_gen_output want[N_PROMPTS];
        collector col = {0};
        generate_all(m, NULL, &variants[v], want);
        CHECK_OK(run_engine(m, &o, &variants[v], 1, &col, NULL));
        CHECK(col.delivered == N_PROMPTS);
        CHECK(same_outputs(want, col.out, N_PROMPTS, 0.0));
        if (v == 3) CHECK(col.out[1].finish == RF_FINISH_EOS && col.out[1].n_tokens <= 4);
        for (int i = 0; i < N_PROMPTS; i++) rf_gen_output_free(&want[i]);
        collector_free(&col);
    }
    /* stop strings through the tokenizer: same cut text, finish reason and tokens */
    rf_gen_output want[N_PROMPTS];
    generate_all(m, tok, &variants[1], want);
    char stop[2] = {0, 0};
    for (int t = 2; t < want[0].n_tokens && !stop[0]; t++)
        if (want[0].tokens[t] > 32 && want[0].tokens[t] < 127) stop[0] = (char)want[0].tokens[t];
    for (int i = 0; i < N_PROMPTS; i++) rf_gen_output_free(&want[i]);
    rf_gen_params gs = variants[1];
    gs.stop[0] = stop, gs.n_stop = 1;
    generate_all(m, tok, &gs, want);
    collector col = {0};
    o.tok = tok;
    CHECK_OK(run_engine(m, &o, &gs, 1, &col, NULL));
    CHECK(stop[0] && want[0].finish == RF_FINISH_STOP && col.out[0].finish == RF_FINISH_STOP);
    CHECK(same_outputs(want, col.out, N_PROMPTS, 0.0));
    for (int i = 0; i < N_PROMPTS; i++) rf_gen_output_free(&want[i]);
    collector_free(&col);
}

/* rf_generate over n copies of prompt p with seeds seed + i: what n samples must produce. */
static void generate_copies(rf_model *m, const int32_t *p, int len, int n, const rf_gen_params *gp,
                            rf_gen_output *out) {
    const int32_t *ps[16];
    int lens[16];
    for (int i = 0; i < n; i++) ps[i] = p, lens[i] = len;
    CHECK_OK(rf_generate(m, NULL, ps, lens, n, gp, out, 0));
}

/* Tolerance on log-probs where the engine batches differently from the reference run. Where
 * the CPU back end's products are batch-invariant (rf_cpu_batch_invariant_exact: oneDNN's
 * AVX-512 kernels) none: attention gives every row the same bits whatever runs beside it, so a
 * row's log-prob cannot depend on the batch. Elsewhere the products block by row count, K/V
 * rows differ in the last fp32 bits and the difference is carried to later positions through
 * the cache: with this std-0.5 random model the drift seen is <= 3e-5 on log-probs of
 * magnitude ~1; tokens must still match. */
#define LOGP_TOL (rf_cpu_batch_invariant_exact() ? 0.0 : 1e-4)

/* A group of n = 4 samples: one prefill, the prompt's blocks referenced 4 times, the partially
 * filled last block copied by 3 samples on their first append (the 4th writes in place). The
 * first token comes from a prefill of 1 prompt instead of rf_generate's 4 copies (LOGP_TOL). */
static void group_shares_prompt_blocks(rf_model *m) {
    enum { N = 4, LEN = 13, BS = 4 };
    rf_gen_params gp = {.sampling = {0, 1.0f, 0, 1.0f}, .max_new_tokens = 16, .seed = 21};
    rf_rollout *e;
    CHECK_OK(rf_rollout_init(&e, m, &(rf_rollout_opts){.block_size = BS, .n_blocks = 64}));
    collector col = {0};
    rf_rollout_set_callback(e, collect, &col);
    rf_rollout_request q = {g_prompts[4], LEN, N, gp.sampling, gp.max_new_tokens, gp.seed, NULL, 0, {0}, 0, 0, 0};
    CHECK_OK(rf_rollout_submit(e, &q, (void *)0, NULL));
    CHECK_OK(rf_rollout_step(e));
    const rf_kv_pool *p = rf_rollout_pool(e);
    int prompt_blocks = (LEN + BS - 1) / BS, all_shared = 1;
    CHECK(rf_kv_pool_used(p) == prompt_blocks); /* not 4 x */
    for (int b = 0; b < p->n_blocks; b++)
        if (p->ref[b]) all_shared &= p->ref[b] == N;
    CHECK(all_shared);
    rf_rollout_stats st;
    rf_rollout_get_stats(e, &st);
    CHECK(st.prefix_blocks_shared == (N - 1) * prompt_blocks && st.prefill_tokens == LEN);
    CHECK_OK(rf_rollout_step(e));
    rf_rollout_get_stats(e, &st);
    CHECK(st.cow_copies == N - 1 && rf_kv_pool_used(p) == prompt_blocks + N - 1);
    CHECK_OK(rf_rollout_run_until_idle(e));
    rf_rollout_get_stats(e, &st);
    CHECK(st.peak_blocks_used < N * prompt_blocks + N * 4 && rf_kv_pool_used(p) == 0);
    rf_rollout_free(e);
    rf_gen_output want[N];
    generate_copies(m, g_prompts[4], LEN, N, &gp, want);
    CHECK(col.delivered == N && same_outputs(want, col.out, N, LOGP_TOL));
    for (int i = 0; i < N; i++) rf_gen_output_free(&want[i]);
    collector_free(&col);
}

/* max_running = 3 < n = 4: the group starts in two parts, still prefilled once (the fourth
 * sample starts from the retained prompt blocks and logits), with the same outputs. */
static void group_split_by_max_running(rf_model *m) {
    rf_gen_params gp = {.sampling = {0, 1.0f, 0, 1.0f}, .max_new_tokens = 10, .seed = 77};
    collector all = {0}, part = {0};
    rf_rollout_stats st;
    CHECK_OK(run_engine(m, &(rf_rollout_opts){.block_size = 4}, &gp, 4, &all, NULL));
    CHECK_OK(run_engine(m, &(rf_rollout_opts){.block_size = 4, .max_running = 3}, &gp, 4, &part, &st));
    int prompt_tokens = 0;
    for (int i = 0; i < N_PROMPTS; i++) prompt_tokens += g_lens[i];
    CHECK(st.prefill_tokens == prompt_tokens && st.preemptions == 0);
    CHECK(same_outputs(all.out, part.out, 4 * N_PROMPTS, LOGP_TOL));
    collector_free(&all);
    collector_free(&part);
}

/* The engine drawing from whole host rows (a model giving `decode`) and from rows left on the
 * back end (rf_rollout_init: decode_sample, rf_model_draw): the same outputs bit for bit,
 * sampled, greedy and top-k/top-p, with groups split by max_running (their first tokens drawn
 * from captured prefix rows). */
static void host_rows_draw_alike(rf_model *m) {
    g_host_mc = (rf_rollout_model){.cfg = &m->cfg, .ctx = m, .k = m->k, .kv_heads = m->cfg.num_key_value_heads,
                                   .pool_init = host_pool_init, .pool_release = host_release, .decode = host_decode,
                                   .copy = host_copy};
    static const rf_sampling kinds[3] = {{0, 1.0f, 0, 1.0f}, {1, 1.0f, 0, 1.0f}, {0, 0.8f, 20, 0.9f}};
    for (int k = 0; k < 3; k++) {
        rf_gen_params gp = {.sampling = kinds[k], .max_new_tokens = 10, .seed = 31};
        collector dev = {0}, host = {0};
        rf_rollout_opts o = {.block_size = 4, .max_running = 3};
        CHECK_OK(run_engine(m, &o, &gp, 4, &dev, NULL));
        g_use_host = 1;
        CHECK_OK(run_engine(m, &o, &gp, 4, &host, NULL));
        g_use_host = 0;
        CHECK(dev.delivered == 4 * N_PROMPTS && host.delivered == 4 * N_PROMPTS);
        CHECK(same_outputs(host.out, dev.out, 4 * N_PROMPTS, 0.0));
        collector_free(&dev);
        collector_free(&host);
    }
}

/* A pool with room for one long sample only: sequences are preempted and recomputed, and
 * every output is unchanged (tokens exactly; log-probs within LOGP_TOL: a recomputed position
 * comes out of a prefill instead of a decode step, a different batch shape, which changes no
 * bit where the products are batch-invariant; the attention of 31a6a2b, whose decoding rows
 * took another path than prefill's, failed this and the next check at tolerance 0). */
static void preemption_keeps_outputs(rf_model *m) {
    rf_gen_params gp = {.sampling = {0, 1.0f, 0, 1.0f}, .max_new_tokens = 24, .seed = 31};
    rf_rollout_opts tiny = {.block_size = 4, .n_blocks = (21 + 24 + 3) / 4};
    rf_gen_output want[N_PROMPTS];
    generate_all(m, NULL, &gp, want);
    collector col = {0};
    rf_rollout_stats st;
    CHECK_OK(run_engine(m, &tiny, &gp, 1, &col, &st));
    CHECK(st.preemptions > 0 && st.peak_blocks_used <= tiny.n_blocks);
    CHECK(same_outputs(want, col.out, N_PROMPTS, LOGP_TOL));
    int any = 0;
    for (int i = 0; i < N_PROMPTS; i++) any |= col.preempted[i] > 0;
    CHECK(any);
    printf("preemption, n=1: %lld preemptions, %lld steps, peak %d of %d blocks\n",
           (long long)st.preemptions, (long long)st.steps, st.peak_blocks_used, tiny.n_blocks);
    for (int i = 0; i < N_PROMPTS; i++) rf_gen_output_free(&want[i]);
    collector_free(&col);
    /* groups of 3 under the same pressure against a pool with room for everything */
    collector big = {0};
    CHECK_OK(run_engine(m, &(rf_rollout_opts){.block_size = 4}, &gp, 3, &big, NULL));
    CHECK_OK(run_engine(m, &tiny, &gp, 3, &col, &st));
    CHECK(st.preemptions > 0 && col.delivered == 3 * N_PROMPTS);
    CHECK(same_outputs(big.out, col.out, 3 * N_PROMPTS, LOGP_TOL));
    printf("preemption, n=3: %lld preemptions, %lld steps\n", (long long)st.preemptions,
           (long long)st.steps);
    collector_free(&big);
    collector_free(&col);
}

/* The back end's free memory as the pool sizing sees it (a CPU table with mem_info replaced). */
static size_t g_free_bytes;
static int g_mem_fails;
static int fake_mem_info(size_t *free_bytes, size_t *total_bytes) {
    if (g_mem_fails) {
        rf_error(RF_ERR_CUDA, "fake: the device is gone");
        return -1;
    }
    *free_bytes = g_free_bytes, *total_bytes = 2 * g_free_bytes;
    return 0;
}

/* n_blocks = 0: max_running sequences of max_seq_len positions when the memory budget holds
 * them, as many blocks as the budget holds when it does not (generation then preempts and
 * still finishes), refused when that is not one sequence; the model's position limit without
 * max_seq_len. */
static void pool_sized_from_memory(rf_model *m) {
    rf_kernels fake = *m->k;
    fake.mem_info = fake_mem_info;
    const rf_kernels *cpu = m->k;
    m->k = &fake;
    size_t block = 2 * sizeof(float) * (size_t)m->cfg.num_hidden_layers * 4 * (size_t)m->cfg.num_key_value_heads *
                   (size_t)m->cfg.head_dim;
    rf_rollout_opts o = {.block_size = 4, .max_running = 6, .max_seq_len = 30, .mem_fraction = 0.5};
    rf_rollout *e = NULL;
    rf_rollout_stats st;
    g_free_bytes = (size_t)1 << 40; /* room for all: 6 sequences x ceil(30 / 4) blocks */
    CHECK_OK(rf_rollout_init(&e, m, &o));
    rf_rollout_get_stats(e, &st);
    CHECK(st.pool_blocks == 6 * 8);
    rf_rollout_free(e);
    g_free_bytes = 25 * block + block / 2; /* half of it holds 12.75 blocks */
    CHECK_OK(rf_rollout_init(&e, m, &o));
    rf_rollout_get_stats(e, &st);
    CHECK(st.pool_blocks == 12);
    rf_rollout_free(e);
    rf_gen_params gp = {.sampling = {0, 1.0f, 0, 1.0f}, .max_new_tokens = 8, .seed = 5};
    collector col = {0};
    CHECK_OK(run_engine(m, &o, &gp, 3, &col, &st));
    CHECK(st.pool_blocks == 12 && col.delivered == 3 * N_PROMPTS && st.peak_blocks_used <= 12 && st.preemptions > 0);
    printf("pool sized from memory: 12 blocks, %lld preemptions, peak %d\n", (long long)st.preemptions,
           st.peak_blocks_used);
    collector_free(&col);
    g_free_bytes = 16 * block - 1, o.mem_fraction = 1; /* all of it: 15.99 blocks, 15 */
    CHECK_OK(rf_rollout_init(&e, m, &o));
    rf_rollout_get_stats(e, &st);
    CHECK(st.pool_blocks == 15);
    rf_rollout_free(e);
    g_free_bytes = 8 * block - 1; /* 7.99 blocks: one sequence needs 8 */
    char want[256];
    snprintf(want, sizeof want, "of the 0.0 MB free on cpu holds 7 blocks of 4 positions (%.2f MB each), fewer than the "
             "8 that one sequence of 30 positions needs", (double)block / (1 << 20));
    CHECK_ERR(rf_rollout_init(&e, m, &o), RF_ERR_NOMEM, want);
    CHECK(e == NULL);
    o.max_seq_len = 0; /* the model's limit */
    g_free_bytes = (size_t)1 << 40;
    CHECK_OK(rf_rollout_init(&e, m, &o));
    rf_rollout_get_stats(e, &st);
    CHECK(st.pool_blocks == 6 * ((rf_config_max_seq(&m->cfg) + 3) / 4));
    rf_rollout_free(e);
    g_mem_fails = 1;
    CHECK_ERR(rf_rollout_init(&e, m, &o), RF_ERR_NODEVICE, "sizing the KV cache from cpu memory");
    g_mem_fails = 0;
    o.mem_fraction = 1.5;
    CHECK_ERR(rf_rollout_init(&e, m, &o), RF_ERR_ARG, "mem_fraction (1.5) must be in (0, 1]");
    o.n_blocks = 12; /* given: no sizing, mem_fraction unused but still checked */
    o.mem_fraction = 0.5, g_mem_fails = 1;
    CHECK_OK(rf_rollout_init(&e, m, &o));
    rf_rollout_get_stats(e, &st);
    CHECK(st.pool_blocks == 12);
    rf_rollout_free(e);
    g_mem_fails = 0;
    m->k = cpu;
}

/* A back end whose allocations fail while g_alloc_fails is set. */
static int g_alloc_fails;
static void *failing_alloc(size_t bytes) { return g_alloc_fails ? NULL : rf_cpu_kernels()->alloc(bytes); }

/* Submits every prompt with n samples (user base round * N_PROMPTS * n + i * n). */
static void submit_prompts(rf_rollout *e, const rf_gen_params *p, int n, int round) {
    for (int i = 0; i < N_PROMPTS; i++) {
        rf_rollout_request q = {g_prompts[i], g_lens[i], n, p->sampling, p->max_new_tokens, p->seed, NULL, 0, {0}, 0, 0, 0};
        CHECK_OK(rf_rollout_submit(e, &q, (void *)(intptr_t)((round * N_PROMPTS + i) * n), NULL));
    }
}

/* rf_rollout_release_cache between two rounds of the same requests: the second round's
 * samples equal the first's bit for bit, the pool is allocated again by its first step, the
 * model's workspace was given back; refused while a sequence runs; a failed allocation at the
 * next step is RF_ERR_NOMEM naming the pool. */
static void cache_release_keeps_outputs(rf_model *m) {
    rf_kernels failing = *m->k;
    failing.alloc = failing_alloc;
    const rf_kernels *cpu = m->k;
    m->k = &failing;
    rf_gen_params gp = {.sampling = {0, 1.0f, 0, 1.0f}, .max_new_tokens = 12, .seed = 77};
    rf_rollout *e = NULL;
    CHECK_OK(rf_rollout_init(&e, m, &(rf_rollout_opts){.block_size = 4, .n_blocks = 40}));
    collector col = {0};
    rf_rollout_set_callback(e, collect, &col);
    submit_prompts(e, &gp, 2, 0);
    CHECK_OK(rf_rollout_run_until_idle(e));
    const rf_kv_pool *pool = rf_rollout_pool(e);
    CHECK(rf_kv_pool_held(pool) && m->act_mem != NULL);
    CHECK_OK(rf_rollout_release_cache(e));
    CHECK(!rf_kv_pool_held(pool) && m->act_mem == NULL && m->act_cap == 0);
    CHECK_OK(rf_rollout_release_cache(e)); /* already released: nothing to do */
    rf_rollout_stats st;
    rf_rollout_get_stats(e, &st);
    CHECK(st.cache_releases == 1 && st.pool_blocks == 40);
    submit_prompts(e, &gp, 2, 1);
    CHECK(!rf_kv_pool_held(pool)); /* submitting allocates nothing */
    CHECK_OK(rf_rollout_step(e));
    CHECK(rf_kv_pool_held(pool));
    CHECK_ERR(rf_rollout_release_cache(e), RF_ERR_ARG,
              "rollout: the KV cache cannot be released while sequences run (10) or wait (0)");
    CHECK_OK(rf_rollout_run_until_idle(e));
    CHECK(col.delivered == 4 * N_PROMPTS);
    rf_gen_output *first = col.out, *second = col.out + 2 * N_PROMPTS;
    CHECK(same_outputs(first, second, 2 * N_PROMPTS, 0));
    CHECK_OK(rf_rollout_release_cache(e));
    g_alloc_fails = 1;
    submit_prompts(e, &gp, 1, 5);
    char want[160];
    snprintf(want, sizeof want, "rollout: allocating the released KV cache again: kv pool: out of cpu memory for 40 "
             "blocks of 4 positions (%zu MB)", rf_kv_pool_bytes(pool) >> 20);
    CHECK_ERR(rf_rollout_step(e), RF_ERR_NOMEM, want);
    g_alloc_fails = 0;
    rf_rollout_free(e);
    collector_free(&col);
    /* the pool alone: a release with a block in use is refused */
    rf_kv_pool p;
    CHECK_OK(rf_kv_pool_init(&p, m, 3, 4));
    int b = rf_kv_pool_alloc(&p);
    CHECK_ERR(rf_kv_pool_release(&p), RF_ERR_INTERNAL, "kv pool: releasing its memory while 1 of its 3 blocks are in use");
    CHECK(rf_kv_pool_held(&p));
    rf_kv_pool_unref(&p, b);
    CHECK_OK(rf_kv_pool_release(&p));
    CHECK_OK(rf_kv_pool_acquire(&p));
    CHECK(rf_kv_pool_held(&p) && rf_kv_pool_alloc(&p) == b);
    rf_kv_pool_free(&p);
    m->k = cpu;
    printf("KV cache released between two rounds: %d samples each, the same bit for bit\n", 2 * N_PROMPTS);
}

/* max_running = 2 and three requests: the third joins as soon as the first finishes, while
 * the second is still running; samples are delivered one at a time, as they finish. */
static void continuous_batching_admits_on_finish(rf_model *m) {
    static const int max_new[3] = {2, 10, 3};
    rf_sampling smp = {0, 1.0f, 0, 1.0f};
    rf_rollout *e;
    CHECK_OK(rf_rollout_init(&e, m, &(rf_rollout_opts){.block_size = 4, .max_running = 2}));
    collector col = {0};
    rf_rollout_set_callback(e, collect, &col);
    for (int i = 0; i < 3; i++) {
        rf_rollout_request q = {g_prompts[i], g_lens[i], 1, smp, max_new[i], 40 + (uint64_t)i, NULL, 0, {0}, 0, 0, 0};
        uint64_t id;
        CHECK_OK(rf_rollout_submit(e, &q, (void *)(intptr_t)i, &id));
        CHECK(id == (uint64_t)i);
    }
    rf_rollout_stats st;
    CHECK_OK(rf_rollout_step(e));
    rf_rollout_get_stats(e, &st);
    CHECK(st.running == 2 && st.waiting == 1 && col.delivered == 0);
    CHECK_OK(rf_rollout_step(e));
    rf_rollout_get_stats(e, &st);
    CHECK(col.delivered == 1 && col.order[0] == 0 && st.running == 1 && st.waiting == 1);
    CHECK_OK(rf_rollout_step(e)); /* request 2 admitted next to request 1's decode */
    rf_rollout_get_stats(e, &st);
    CHECK(st.running == 2 && st.waiting == 0 && col.delivered == 1);
    CHECK_OK(rf_rollout_run_until_idle(e));
    CHECK(col.delivered == 3 && col.order[1] == 2 && col.order[2] == 1);
    rf_rollout_get_stats(e, &st);
    CHECK(st.steps == 10 && st.tokens_generated == 15);
    rf_rollout_free(e);
    for (int i = 0; i < 3; i++) {
        rf_gen_params gp = {.sampling = smp, .max_new_tokens = max_new[i], .seed = 40 + (uint64_t)i};
        rf_gen_output want;
        CHECK_OK(rf_generate(m, NULL, &g_prompts[i], &g_lens[i], 1, &gp, &want, 0));
        CHECK(same_outputs(&want, &col.out[i], 1, LOGP_TOL));
        rf_gen_output_free(&want);
    }
    collector_free(&col);
}

/* Each token carries the version set when it was sampled. */
static void versions_per_token(rf_model *m) {
    rf_rollout *e;
    CHECK_OK(rf_rollout_init(&e, m, NULL));
    collector col = {0};
    rf_rollout_set_callback(e, collect, &col);
    rf_rollout_request q = {g_prompts[1], g_lens[1], 2, {0, 1.0f, 0, 1.0f}, 6, 1, NULL, 0, {0}, 0, 0, 0};
    CHECK_OK(rf_rollout_submit(e, &q, (void *)0, NULL));
    rf_rollout_set_version(e, 3);
    CHECK_OK(rf_rollout_step(e));
    CHECK_OK(rf_rollout_step(e));
    rf_rollout_set_version(e, 4);
    CHECK_OK(rf_rollout_run_until_idle(e));
    static const int want[6] = {3, 3, 4, 4, 4, 4};
    for (int s = 0; s < 2; s++)
        CHECK(col.out[s].n_tokens == 6 && memcmp(col.versions[s], want, sizeof want) == 0);
    rf_rollout_free(e);
    collector_free(&col);
}

static void errors(rf_model *m) {
    rf_rollout *e = NULL;
    CHECK_ERR(rf_rollout_init(&e, m, &(rf_rollout_opts){.max_running = 8, .max_batch_tokens = 4}),
              RF_ERR_ARG, "exceeds max_batch_tokens");
    CHECK_ERR(rf_rollout_init(&e, m, &(rf_rollout_opts){.n_blocks = -1}), RF_ERR_ARG, "n_blocks (-1) and max_seq_len (0) >= 0");
    rf_rollout_model none = {.cfg = &m->cfg, .ctx = m, .k = m->k, .kv_heads = 1}; /* neither model call */
    CHECK_ERR(rf_rollout_init_model(&e, &none, NULL), RF_ERR_ARG, "exactly one of decode and decode_sample");
    CHECK(e == NULL);
    CHECK_OK(rf_rollout_init(&e, m, &(rf_rollout_opts){.block_size = 4, .n_blocks = 4}));
    int32_t p[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, bad_tok[2] = {1, 300};
    rf_rollout_request ok = {p, 6, 1, {0, 1.0f, 0, 1.0f}, 10, 0, NULL, 0, {0}, 0, 0, 0}, q;
    CHECK_OK(rf_rollout_submit(e, &ok, NULL, NULL)); /* 16 positions: exactly the pool */
    q = ok, q.prompt_len = 10;
    CHECK_ERR(rf_rollout_submit(e, &q, NULL, NULL), RF_ERR_RANGE, "but the whole pool holds 4");
    q = ok, q.n = 0;
    CHECK_ERR(rf_rollout_submit(e, &q, NULL, NULL), RF_ERR_ARG, "n (samples) must be >= 1");
    q = ok, q.max_new_tokens = 0;
    CHECK_ERR(rf_rollout_submit(e, &q, NULL, NULL), RF_ERR_ARG, "max_new_tokens must be >= 1");
    q = ok, q.sampling.temperature = 0;
    CHECK_ERR(rf_rollout_submit(e, &q, NULL, NULL), RF_ERR_ARG, "temperature must be > 0");
    q = ok, q.prompt_len = 0;
    CHECK_ERR(rf_rollout_submit(e, &q, NULL, NULL), RF_ERR_ARG, "prompt is empty");
    q = ok, q.prompt = bad_tok, q.prompt_len = 2;
    CHECK_ERR(rf_rollout_submit(e, &q, NULL, NULL), RF_ERR_RANGE, "outside the vocabulary");
    q = ok, q.stop[0] = "x", q.n_stop = 1;
    CHECK_ERR(rf_rollout_submit(e, &q, NULL, NULL), RF_ERR_ARG, "stop strings need a tokenizer");
    q = ok, q.max_new_tokens = 5000;
    CHECK_ERR(rf_rollout_submit(e, &q, NULL, NULL), RF_ERR_RANGE, "model's limit");
    rf_rollout_stats st;
    rf_rollout_get_stats(e, &st);
    CHECK(st.waiting == 1); /* failed submits queue nothing */
    CHECK_OK(rf_rollout_run_until_idle(e));
    rf_rollout_get_stats(e, &st);
    CHECK(st.samples_finished == 1 && st.peak_blocks_used == 4);
    rf_rollout_free(e);
    rf_rollout_free(NULL);
}

int main(void) {
    paged_attention_equals_contiguous(0);
    paged_attention_equals_contiguous(1);
    make_prompts();
    char dir[] = "/tmp/rf_rollout_XXXXXX";
    RF_ASSERT(mkdtemp(dir));
    CHECK_OK(rf_byte_tokenizer_write(dir));
    rf_tokenizer *tok = NULL;
    CHECK_OK(rf_tokenizer_load_dir(&tok, dir));
    rf_model *m = tiny_model();
    matches_generate(m, tok);
    group_shares_prompt_blocks(m);
    group_split_by_max_running(m);
    host_rows_draw_alike(m);
    preemption_keeps_outputs(m);
    pool_sized_from_memory(m);
    cache_release_keeps_outputs(m);
    continuous_batching_admits_on_finish(m);
    versions_per_token(m);
    errors(m);
    rf_model_free(m);
    rf_tokenizer_free(tok);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    return rf_test_finish("test_rollout");
}
