/* Weights between identical layouts (resharding/weights_sync.h), 3 ranks under mpirun: rank 0
 * sends, ranks 1 and 2 receive.
 *  - read in place (one host): both receivers' parameters equal the sender's bit for bit, over
 *    two versions (the mapping is kept), the version and CRC-32C reported;
 *  - a receiver that declines the offer gets the parameters as a message; a sender that does not
 *    offer sends them to both;
 *  - a damaged checksum is refused by every receiver, in place and through messages, with the
 *    exact message, and the sender still completes;
 *  - a receiver that never takes a transfer: the sender's wait fails within its bound, naming
 *    it;
 *  - LoRA (adapters on the same frozen base on both sides): only the adapters travel (the
 *    header's count, in place and as a message), the receiver's whole buffer then equals the
 *    sender's bit for bit and the reported CRC-32C is that of the adapters
 *    (rf_weights_checksum); a receiver whose base differs refuses the transfer with the exact
 *    message naming both base checksums.
 *  - a receiver kept in bf16 (rf_model_keep_bf16: a split run's rollout worker at bf16 precision
 *    on the CPU), in place and through messages, over two versions of the "small" preset (tied,
 *    with q/k/v biases and random norms) and of the "25m" one untied (its 71 MB travel as 5
 *    messages, received one at a time through two small buffers; into an fp32 receiver they
 *    arrive bit for bit too): its store holds exactly the
 *    bf16 rounding of each matrix after the embedding table, the table and the 1-D tensors
 *    their fp32 bits, the reported CRC-32C is the sender's; the matrices' fp32 pages are never
 *    made resident (mincore); and the rollout engine on it (sampled and greedy: ids and
 *    behaviour log-probs) and its log-probs and entropies give the same bits as an fp32 model
 *    holding the sender's weights at the same precision. A receiver that kept the first
 *    version's weights, or rounded another way, fails these;
 *  - rf_model_keep_bf16 keeps nothing at fp32 precision or with adapters, a frozen model
 *    refuses rf_model_write_params, and a kept one refuses training, with the exact texts.
 * ctest runs it again with oneDNN capped at AVX2 (bf16 emulated: the kept values widened). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common/crc32c.h"
#include "common/util.h"
#include "kernels/kernels.h"
#include "common/rng.h"
#include "model/dtype.h"
#include "model/lora.h"
#include "model/model.h"
#include "resharding/weights_sync.h"
#include "rollout/rollout.h"
#include "test_comm_util.h"
#include "mem_util.h"
#include "test_util.h"

static rf_model *tiny_model(uint64_t seed) {
    rf_model_config cfg;
    if (rf_config_preset(&cfg, "tiny", 50) != RF_OK) return NULL;
    rf_model *m = NULL;
    if (rf_model_init(&m, &cfg, rf_cpu_kernels()) != RF_OK) return NULL;
    rf_model_init_random(m, seed, 1.0f);
    return m;
}

/* Rank 0: sends m as `version` to ranks 1 and 2 and waits; returns how many read it in place.
 * Bounded by 300 s: a receiver may still be checking the previous version (the kept ones run
 * the rollout engine twice on the 25m model, minutes on a loaded machine); a sender that gave
 * up would free the stage under a receiver still reading it. */
static int send_version(rf_comm *c, rf_weights_tx *tx, rf_model *m, int64_t version, uint32_t *crc) {
    static const int dst[2] = {1, 2};
    CHECK_OK(rf_weights_tx_start(tx, c, m, version, dst, 2, 300, crc));
    double t0 = rf_time_now();
    int done = 0;
    while (!done && rf_time_now() - t0 < 300) {
        done = rf_weights_tx_test(tx);
        if (done < 0) break;
    }
    CHECK(done == 1);
    return rf_weights_tx_in_place(tx);
}

/* Ranks 1, 2: polls until a transfer arrives (bounded by 300 s, as send_version); returns its
 * status. */
static rf_status receive(rf_weights_rx *rx, rf_model *m, int64_t *version, uint32_t *crc) {
    double t0 = rf_time_now();
    int arrived = 0;
    while (rf_time_now() - t0 < 300) {
        rf_status st = rf_weights_rx_poll(rx, m, &arrived, version, crc);
        if (st != RF_OK || arrived) return st;
        rf_sleep(0.0005);
    }
    return rf_error(RF_ERR_IO, "nothing arrived in 300 s");
}

/* Ranks 1, 2: the transfer of `version` arrives and holds the parameters of a model made from
 * `seed`. */
static void expect(rf_weights_rx *rx, rf_model *m, int64_t version, uint64_t seed) {
    rf_model *want = tiny_model(seed);
    int64_t v = -1;
    uint32_t crc = 0;
    CHECK_OK(receive(rx, m, &v, &crc));
    CHECK(v == version);
    CHECK(want && memcmp(m->params, want->params, m->n_params * sizeof(float)) == 0);
    CHECK(want && crc == rf_crc32c(want->params, want->n_params * sizeof(float)));
    rf_model_free(want);
}

static void expect_damaged(rf_weights_rx *rx, rf_model *m, int64_t version, uint64_t seed) {
    rf_model *want = tiny_model(seed);
    uint32_t good = rf_crc32c(want->params, want->n_params * sizeof(float));
    int64_t v = -1;
    uint32_t crc = 0;
    rf_error_clear();
    CHECK(receive(rx, m, &v, &crc) == RF_ERR_FORMAT);
    char msg[160];
    snprintf(msg, sizeof msg, "weights version %lld from rank 0 arrived damaged: CRC-32C %08x, sent as %08x", (long long)version, good,
             good ^ 1u);
    CHECK(strcmp(rf_error_message(), msg) == 0);
    if (strcmp(rf_error_message(), msg) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), msg);
    rf_model_free(want);
}

static void transfers(rf_comm *world, rf_comm **keep) {
    int rank = rf_comm_rank(world);
    rf_model *m = tiny_model(rank == 0 ? 7 : 1000 + (uint64_t)rank);
    if (!m) return;
    rf_weights_tx *tx = NULL;
    rf_weights_rx *rx = NULL;
    if (rank == 0) CHECK_OK(rf_weights_tx_init(&tx, m));
    else CHECK_OK(rf_weights_rx_init(&rx, world, m, 0));
    uint32_t crc = 0;
    if (rank == 0) {
        CHECK(send_version(world, tx, m, 1, &crc) == 2); /* both read in place */
        CHECK(crc == rf_crc32c(m->params, m->n_params * sizeof(float)));
        rf_model_init_random(m, 8, 1.0f);
        CHECK(send_version(world, tx, m, 2, &crc) == 2);
        CHECK(send_version(world, tx, m, 3, &crc) == 1); /* rank 2 declines */
        rf_weights_tx_set_in_place(tx, 0);
        CHECK(send_version(world, tx, m, 4, &crc) == 0);
        rf_weights_tx_set_in_place(tx, 1);
        setenv("RF_TEST_WEIGHTS_DAMAGE", "1", 1);
        CHECK(send_version(world, tx, m, 5, &crc) == 2);
        rf_weights_tx_set_in_place(tx, 0);
        CHECK(send_version(world, tx, m, 6, &crc) == 0);
        unsetenv("RF_TEST_WEIGHTS_DAMAGE");
    } else {
        expect(rx, m, 1, 7);
        expect(rx, m, 2, 8);
        if (rank == 2) rf_weights_rx_set_in_place(rx, 0);
        expect(rx, m, 3, 8);
        rf_weights_rx_set_in_place(rx, 1);
        expect(rx, m, 4, 8);
        expect_damaged(rx, m, 5, 8);
        expect_damaged(rx, m, 6, 8);
    }
    CHECK_OK(rf_comm_barrier(world, 30, "after the transfers"));
    /* rank 2 never takes version 7: rank 0's wait names it (on a communicator of its own: one
     * that timed out refuses further work) */
    rf_comm *d = NULL;
    CHECK_OK(rf_comm_split(world, 0, rank, &d));
    if (rank == 0) {
        rf_weights_tx *t2 = NULL;
        CHECK_OK(rf_weights_tx_init(&t2, m));
        static const int dst[2] = {1, 2};
        CHECK_OK(rf_weights_tx_start(t2, d, m, 7, dst, 2, 5, &crc));
        double t0 = rf_time_now();
        rf_error_clear();
        rf_status st = rf_weights_tx_wait(t2, 0.5);
        double dt = rf_time_now() - t0;
        CHECK(st == RF_ERR_IO);
        const char *want = "waiting for rank 2 to take weights version 7: rank 2 did not complete it within 0.5 s";
        CHECK(strcmp(rf_error_message(), want) == 0);
        if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), want);
        CHECK(dt >= 0.5 && dt < 5.0);
        rf_weights_tx_free(t2);
    } else if (rank == 1) {
        rf_weights_rx *r2 = NULL;
        CHECK_OK(rf_weights_rx_init(&r2, d, m, 0));
        expect(r2, m, 7, 8);
        rf_weights_rx_free(r2);
    }
    CHECK_OK(rf_comm_barrier(world, 30, "after the timeout"));
    /* rank 0's version 7 to rank 2 is never received: d is kept to the end (*keep), since a freed
     * communicator's context id goes to the next split, and MPI would hand that split the stale
     * messages (test_lora_reshard failed so) */
    *keep = d;
    rf_weights_tx_free(tx);
    rf_weights_rx_free(rx);
    rf_model_free(m);
}

/* The tiny model (base from `seed`) with rank-4 adapters on every projection, B drawn from
 * `bseed` (0: zero, as attached). */
static rf_model *lora_model(uint64_t seed, uint64_t bseed) {
    rf_model *m = tiny_model(seed);
    rf_lora_opts o = {4, 8.0f, 0.0f, (1u << RF_LORA_N) - 1, RF_LORA_INIT_GAUSSIAN, 5};
    if (!m || rf_model_lora_attach(m, &o) != RF_OK) return m;
    for (int i = 1; bseed && i < m->lora.n_views; i += 2)
        for (size_t j = 0; j < m->lora.views[i].numel; j++)
            m->params[m->lora.views[i].offset + j] = (float)((j * 2654435761u + bseed) % 1000) * 1e-3f - 0.5f;
    return m;
}

static void lora_transfers(rf_comm *world) {
    int rank = rf_comm_rank(world);
    /* rank 2's base differs (seed 9): it must refuse */
    rf_model *m = lora_model(rank == 2 ? 9 : 7, rank == 0 ? 21 : 0), *want = lora_model(7, 21);
    if (!m || !want || !m->lora.rank) return;
    size_t n_lora = m->n_params - m->n_frozen;
    uint32_t crc = 0, base7 = rf_crc32c(want->params, want->n_frozen * sizeof(float));
    CHECK_OK(rf_weights_checksum(want, &crc));
    CHECK(crc == rf_crc32c(want->params + want->n_frozen, n_lora * sizeof(float)));
    rf_comm *d = NULL; /* ranks 0 and 1, then 0 and 2 on a communicator of their own */
    CHECK_OK(rf_comm_split(world, rank == 2 ? 1 : 0, rank, &d));
    if (rank == 0) {
        rf_weights_tx *tx = NULL;
        CHECK_OK(rf_weights_tx_init(&tx, m));
        static const int one[1] = {1};
        uint32_t sent = 0;
        for (int in_place = 1; in_place >= 0; in_place--) {
            rf_weights_tx_set_in_place(tx, in_place);
            CHECK_OK(rf_weights_tx_start(tx, d, m, 10 + in_place, one, 1, 30, &sent));
            CHECK(sent == crc);
            CHECK_OK(rf_weights_tx_wait(tx, 30));
        }
        rf_weights_tx_free(tx);
    } else if (rank == 1) {
        rf_weights_rx *rx = NULL;
        CHECK_OK(rf_weights_rx_init(&rx, d, m, 0));
        for (int in_place = 1; in_place >= 0; in_place--) {
            memset(m->params + m->n_frozen, 0, n_lora * sizeof(float));
            int64_t v = -1;
            uint32_t got = 0;
            CHECK_OK(receive(rx, m, &v, &got));
            CHECK(v == 10 + in_place && got == crc);
            CHECK(memcmp(m->params, want->params, m->n_params * sizeof(float)) == 0);
        }
        rf_weights_rx_free(rx);
    }
    CHECK_OK(rf_comm_barrier(world, 30, "after the LoRA transfers"));
    rf_comm *e = NULL;
    CHECK_OK(rf_comm_split(world, rank == 1 ? 1 : 0, rank, &e));
    if (rank == 0) { /* offered: the header goes, the refusal leaves the reply pending (freed) */
        rf_weights_tx *tx = NULL;
        CHECK_OK(rf_weights_tx_init(&tx, m));
        static const int other[1] = {1};
        uint32_t sent = 0;
        CHECK_OK(rf_weights_tx_start(tx, e, m, 12, other, 1, 30, &sent));
        rf_weights_tx_free(tx);
    } else if (rank == 2) {
        rf_weights_rx *rx = NULL;
        CHECK_OK(rf_weights_rx_init(&rx, e, m, 0));
        int64_t v = -1;
        uint32_t got = 0;
        rf_error_clear();
        CHECK(receive(rx, m, &v, &got) == RF_ERR_FORMAT);
        char msg[320];
        snprintf(msg, sizeof msg, "weights version 12 from rank 0: the training worker's frozen base weights (CRC-32C "
                 "%08x of %zu floats) are not this worker's (%08x): both must load the same model.path", base7,
                 m->n_frozen, rf_crc32c(m->params, m->n_frozen * sizeof(float)));
        CHECK(strcmp(rf_error_message(), msg) == 0);
        if (strcmp(rf_error_message(), msg) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), msg);
        rf_weights_rx_free(rx);
    }
    CHECK_OK(rf_comm_barrier(world, 30, "after the refused base"));
    rf_comm_free(e), rf_comm_free(d);
    rf_model_free(m), rf_model_free(want);
}

/* ---- receivers kept in bf16 ---- */

/* Preset "small" (tied) or, untied, "25m" with its LM head (17.9M floats: the parameters travel
 * as 5 messages), vocabulary 512, random from seed, 1-D tensors random too (a mix-up of fp32
 * and bf16 floats shows). */
static rf_model *small_model(uint64_t seed, int untied) {
    rf_model_config cfg;
    if (rf_config_preset(&cfg, untied ? "25m" : "small", 512) != RF_OK) return NULL;
    cfg.tie_word_embeddings = !untied;
    rf_model *m = NULL;
    if (rf_model_init(&m, &cfg, rf_cpu_kernels()) != RF_OK) return NULL;
    rf_model_init_random(m, seed, 0.05f);
    rf_rng r;
    rf_rng_seed(&r, seed + 1);
    for (int i = 0; i < m->n_views; i++)
        if (m->views[i].ndim == 1)
            for (size_t j = 0; j < m->views[i].numel; j++)
                m->params[m->views[i].offset + j] = (strstr(m->views[i].name, "norm") ? 1.0f : 0.0f) + 0.2f * rf_rng_normal(&r);
    rf_cpu_kernels()->weights_updated();
    return m;
}

/* What the rollout engine samples (up to 16 samples of up to 24 tokens): ids, log-probs. */
typedef struct engine_out {
    int n_tokens[16];
    int32_t tokens[16][24];
    float logprobs[16][24];
} engine_out;

static void collect(void *ctx, const rf_rollout_sample *s) {
    engine_out *o = ctx;
    int i = (int)(intptr_t)s->user * 4 + s->index;
    if (i < 0 || i >= 16 || s->n_tokens > 24) return;
    o->n_tokens[i] = s->n_tokens;
    memcpy(o->tokens[i], s->tokens, sizeof(int32_t) * (size_t)s->n_tokens);
    memcpy(o->logprobs[i], s->logprobs, sizeof(float) * (size_t)s->n_tokens);
}

/* The rollout engine (as a rollout worker runs it) on m: four prompts, four samples each,
 * sampled (greedy: the first two prompts greedy), 24 new tokens. */
static void engine_run(rf_model *m, engine_out *o) {
    memset(o, 0, sizeof *o);
    static const int32_t p[4][6] = {{1, 5, 9}, {7, 3, 3, 200, 11}, {42}, {300, 301, 302, 303, 304, 305}};
    static const int lens[4] = {3, 5, 1, 6};
    rf_rollout *e = NULL;
    CHECK_OK(rf_rollout_init(&e, m, &(rf_rollout_opts){.block_size = 4, .n_blocks = 256}));
    if (!e) return;
    rf_rollout_set_callback(e, collect, o);
    for (int i = 0; i < 4; i++) {
        rf_rollout_request q = {.prompt = p[i], .prompt_len = lens[i], .n = 4, .max_new_tokens = 24, .seed = 17 + (uint64_t)i,
                                .sampling = {i < 2, 1.0f, 0, 1.0f}};
        CHECK_OK(rf_rollout_submit(e, &q, (void *)(intptr_t)i, NULL));
    }
    CHECK_OK(rf_rollout_run_until_idle(e));
    rf_rollout_free(e);
}

/* Log-probs and entropies of a packed batch of 3 sequences (40 tokens) at temperature 1/0.8. */
static void batch_logprobs(rf_model *m, float *lp, float *en) {
    enum { T = 40 };
    int32_t tok[T], tgt[T], cu[4] = {0, 11, 30, T};
    for (int t = 0; t < T; t++) tok[t] = (t * 37 + 11) % 512, tgt[t] = (t * 53 + 7) % 512;
    rf_batch b = {3, T, tok, NULL, cu};
    CHECK_OK(rf_model_forward(m, &b));
    CHECK_OK(rf_model_logprobs(m, tgt, 0.8f, lp, en));
}

/* The kept model m holds want's weights as a rollout worker must: the matrices after the
 * table exactly rounded to bf16 in the store, the rest fp32 bit for bit, no matrix's fp32 page
 * resident; and computes what want computes, bit for bit. */
static void expect_kept(rf_model *m, rf_model *want, const char *what) {
    int stored = 1;
    for (int i = 0; i < m->n_views; i++) {
        const rf_param_view *v = &m->views[i];
        for (size_t j = 0; j < v->numel; j++) {
            size_t o = v->offset + j;
            if (v->ndim == 2 && o >= m->bf16_lo) stored &= m->wbf16[o] == rf_f32_to_bf16(want->params[o]);
            else stored &= memcmp(&m->params[o], &want->params[o], sizeof(float)) == 0;
        }
    }
    CHECK(stored);
    const rf_param_view *q = rf_model_find(m, "model.layers.0.self_attn.q_proj.weight");
    const rf_param_view *d = rf_model_find(m, "model.layers.2.mlp.down_proj.weight");
    int res = rf_test_resident_pages(m, q->offset, q->numel) + rf_test_resident_pages(m, d->offset, d->numel);
#ifndef __SANITIZE_ADDRESS__ /* AddressSanitizer builds: every block from malloc, cleared */
    CHECK(res == 0);
#endif
    float la[40], ea[40], lb[40], eb[40];
    batch_logprobs(want, la, ea);
    batch_logprobs(m, lb, eb);
    int lp_same = memcmp(la, lb, sizeof la) == 0 && memcmp(ea, eb, sizeof ea) == 0;
    CHECK(lp_same && la[0] < 0);
    static engine_out oa, ob;
    engine_run(want, &oa);
    engine_run(m, &ob);
    int gen_same = memcmp(&oa, &ob, sizeof oa) == 0, n = 0;
    for (int i = 0; i < 16; i++) n += oa.n_tokens[i];
    CHECK(gen_same && n > 16);
    printf("kept in bf16 (%s): store %s, q/down fp32 pages resident %d, log-probs %s, engine's %d tokens %s\n", what,
           stored ? "exact" : "WRONG", res, lp_same ? "bit-identical" : "DIFFER", n, gen_same ? "bit-identical" : "DIFFER");
}

/* Rank 0 sends versions 1 (seed 31) and 2 (seed 32) of the small model (tied, then untied) to
 * ranks 1 (in place) and 2 (messages), whose models are kept in bf16. */
static void kept_transfers(rf_comm *world) {
    int rank = rf_comm_rank(world);
    CHECK_OK(rf_cpu_kernels()->set_precision(RF_PRECISION_BF16));
    for (int untied = 0; untied < 2; untied++) {
        rf_model *m = NULL;
        int kept = 0;
        if (rank == 0) {
            m = small_model(31, untied);
        } else {
            rf_model_config cfg;
            CHECK_OK(rf_config_preset(&cfg, untied ? "25m" : "small", 512));
            cfg.tie_word_embeddings = !untied;
            CHECK_OK(rf_model_init(&m, &cfg, rf_cpu_kernels()));
            if (m) CHECK_OK(rf_model_keep_bf16(m, &kept));
            CHECK(kept == 1 && m && m->wbf16 && m->bf16_lo == (size_t)512 * cfg.hidden_size);
        }
        if (!m) return;
        if (rank == 0) {
            rf_weights_tx *tx = NULL;
            CHECK_OK(rf_weights_tx_init(&tx, m));
            uint32_t crc = 0;
            CHECK(send_version(world, tx, m, 1, &crc) == 1); /* rank 2 declines */
            rf_model_free(m);
            m = small_model(32, untied);
            CHECK(send_version(world, tx, m, 2, &crc) == 1);
            rf_weights_tx_free(tx);
        } else {
            rf_weights_rx *rx = NULL;
            CHECK_OK(rf_weights_rx_init(&rx, world, m, 0));
            if (rank == 2) rf_weights_rx_set_in_place(rx, 0);
            for (int v = 1; v <= 2; v++) {
                rf_model *want = small_model(30 + (uint64_t)v, untied);
                int64_t got_v = -1;
                uint32_t crc = 0;
                CHECK_OK(receive(rx, m, &got_v, &crc));
                rf_cpu_kernels()->weights_updated(); /* as the rollout worker does after each version */
                CHECK(got_v == v && crc == rf_crc32c(want->params, want->n_params * sizeof(float)));
                char what[64];
                snprintf(what, sizeof what, "%s, version %d, %s", untied ? "25m untied" : "small tied", v,
                         rank == 1 ? "in place" : "messages");
                expect_kept(m, want, what);
                rf_model_free(want);
            }
            rf_weights_rx_free(rx);
        }
        rf_model_free(m);
        CHECK_OK(rf_comm_barrier(world, 600, "after the transfers kept in bf16"));
    }
    CHECK_OK(rf_cpu_kernels()->set_precision(RF_PRECISION_FP32));
}

/* The 25m model's 5 messages into an fp32 model (rank 2, declining the offer): its parameters
 * equal the sender's bit for bit. */
static void fp32_messages(rf_comm *world) {
    int rank = rf_comm_rank(world);
    rf_model *m = small_model(rank == 0 ? 33 : 34, 1);
    if (!m) return;
    if (rank == 0) {
        rf_weights_tx *tx = NULL;
        static const int two[1] = {2};
        uint32_t crc = 0;
        CHECK_OK(rf_weights_tx_init(&tx, m));
        rf_weights_tx_set_in_place(tx, 0);
        CHECK_OK(rf_weights_tx_start(tx, world, m, 3, two, 1, 30, &crc));
        CHECK_OK(rf_weights_tx_wait(tx, 60));
        rf_weights_tx_free(tx);
    } else if (rank == 2) {
        rf_weights_rx *rx = NULL;
        rf_model *want = small_model(33, 1);
        int64_t v = -1;
        uint32_t crc = 0;
        CHECK_OK(rf_weights_rx_init(&rx, world, m, 0));
        CHECK_OK(receive(rx, m, &v, &crc));
        int same = want && v == 3 && memcmp(m->params, want->params, m->n_params * sizeof(float)) == 0;
        CHECK(same && crc == rf_crc32c(want->params, want->n_params * sizeof(float)));
        printf("fp32 receiver, %zu floats as messages: %s\n", m->n_params, same ? "bit-identical" : "DIFFER");
        rf_weights_rx_free(rx);
        rf_model_free(want);
    }
    CHECK_OK(rf_comm_barrier(world, 60, "after the fp32 messages"));
    rf_model_free(m);
}

/* Single process: where rf_model_keep_bf16 keeps nothing, and what a frozen or kept model refuses. */
static void kept_refusals(void) {
    const rf_kernels *k = rf_cpu_kernels();
    rf_model *m = small_model(5, 0), *l = lora_model(7, 0);
    int kept = -1;
    CHECK_OK(k->set_precision(RF_PRECISION_FP32));
    CHECK(!rf_model_can_keep_bf16(k));
    CHECK_OK(rf_model_keep_bf16(m, &kept));
    CHECK(kept == 0 && !m->wbf16);
    CHECK_OK(k->set_precision(RF_PRECISION_BF16));
    CHECK(rf_model_can_keep_bf16(k));
    CHECK_OK(rf_model_keep_bf16(l, &kept));
    CHECK(kept == 0 && !l->wbf16);
    rf_model_free(m), rf_model_free(l);
    rf_model_config cfg;
    CHECK_OK(rf_config_preset(&cfg, "small", 512));
    CHECK_OK(rf_model_init(&m, &cfg, k));
    CHECK_OK(rf_model_keep_bf16(m, &kept));
    CHECK(kept == 1);
    rf_error_clear();
    CHECK(rf_model_enable_training(m) == RF_ERR_UNSUPPORTED);
    const char *want = "training: the model keeps its matrices in bf16 only, for generation (rf_model_keep_bf16: a rollout "
                       "worker's weights, written with each version)";
    CHECK(strcmp(rf_error_message(), want) == 0);
    if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), want);
    rf_error_clear();
    CHECK(rf_model_share_params(m) == RF_ERR_UNSUPPORTED);
    const char *head = "sharing parameters between processes: the model keeps its matrices in bf16 only";
    CHECK(strncmp(rf_error_message(), head, strlen(head)) == 0);
    m->bf16_store = 0; /* as a frozen model: writing refused */
    float one = 1.0f;
    rf_error_clear();
    CHECK(rf_model_write_params(m, 0, &one, 1) == RF_ERR_UNSUPPORTED);
    want = "writing parameters: the model was loaded frozen with its weights in bf16 (rf_model_load_frozen), which never change";
    CHECK(strcmp(rf_error_message(), want) == 0);
    if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), want);
    rf_model_free(m);
    CHECK_OK(k->set_precision(RF_PRECISION_FP32));
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = NULL;
    if (rf_comm_world(&argc, &argv, &world) != RF_OK) {
        fprintf(stderr, "test_weights_sync: %s\n", rf_error_message());
        return 1;
    }
    rf_comm *kept = NULL;
    if (rf_comm_size(world) == 3) transfers(world, &kept), lora_transfers(world), kept_transfers(world), fp32_messages(world);
    else CHECK(rf_comm_size(world) == 3);
    rf_comm_free(kept);
    int rc = rf_test_mpi_finish(world, "test_weights_sync");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    if (!rf_test_have_mpirun()) {
        printf("test_weights_sync: skipped: mpirun not found (apt-get install openmpi-bin)\n");
        return 77;
    }
    kept_refusals();
    CHECK(rf_test_mpirun_self(3, 840, NULL) == 0);
    return rf_test_finish("test_weights_sync");
}
