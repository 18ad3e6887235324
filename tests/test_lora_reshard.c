/* LoRA adapters resharded alone from tensor-parallel training ranks to tensor-parallel rollout
 * ranks (resharding/weights_reshard.h with the adapters' table, model/lora.h rf_lora_table),
 * under `mpirun --oversubscribe` with 4 ranks: world ranks 0-1 hold the training shards (tp 2),
 * ranks 2-3 one rollout worker of generation tp 2, on the GQA and Qwen3 shapes of
 * tests/tp_shapes.h (k/v adapters split at tp 2; replicated with 3 k/v heads).
 *   - the frozen base's CRC-32C combined from the shards of either side
 *     (rf_weights_rs_base_checksum) is the CRC-32C of the whole model's base buffer, computed
 *     here by rf_crc32c over the whole model (and from the whole model alone, rf_comm_single,
 *     the same);
 *   - a version (adapters trained away from their fresh values: random B) reaches the rollout
 *     ranks: each holds exactly its blocks of the whole model's adapters, the frozen base
 *     untouched bit for bit, and the reported CRC-32C is the whole adapters buffer's;
 *   - rollout ranks on another base (another seed) refuse the next version on both ranks with
 *     RF_ERR_FORMAT and the exact message naming both CRC-32Cs; the training ranks' exchange
 *     then fails within its (short) timeout instead of hanging.
 * Skips (77) when mpirun is not installed. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/crc32c.h"
#include "common/rng.h"
#include "common/util.h"
#include "model/lora.h"
#include "model/model_tp.h"
#include "resharding/weights_reshard.h"
#include "test_comm_util.h"
#include "test_util.h"
#include "tp_shapes.h"

#define T_OK 60.0

static int g_rank;

static rf_lora_opts lora_opts(void) {
    rf_lora_opts o = {4, 8.0f, 0.0f, (1u << RF_LORA_N) - 1, RF_LORA_INIT_GAUSSIAN, 5};
    return o;
}

/* A whole model of shape s (random base from seed) with adapters whose B are random too (as if
 * trained: fresh ones are zero). */
static rf_model *whole_model(shape s, uint64_t seed) {
    rf_model_config c = config_of(s);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, seed, 0.2f);
    rf_lora_opts o = lora_opts();
    RF_ASSERT(rf_model_lora_attach(m, &o) == RF_OK);
    rf_rng rng;
    rf_rng_seed(&rng, seed + 100);
    for (int i = 1; i < m->lora.n_views; i += 2)
        for (size_t j = 0; j < m->lora.views[i].numel; j++) m->params[m->lora.views[i].offset + j] = 0.1f * rf_rng_normal(&rng);
    return m;
}

/* This rank's shard (over g) of whole: the base and the adapters' blocks. */
static rf_model_tp *shard_of(const rf_model *whole, rf_comm *g) {
    rf_model_tp *tp = NULL;
    rf_lora_opts o = lora_opts();
    CHECK_OK(rf_model_tp_init(&tp, &whole->cfg, rf_cpu_kernels(), g, T_OK));
    CHECK_OK(rf_model_tp_set_full(tp, whole->params));
    CHECK_OK(rf_model_tp_lora_attach(tp, &o));
    rf_param_table pt = {&tp->cfg, tp->lora_views, tp->n_lora_views};
    rf_layout_extract(&pt, tp->lora_shards, whole->params + whole->n_frozen, tp->m->params + tp->m->n_frozen);
    return tp;
}

static void adapters_alone(rf_comm *world, shape s, rf_comm **refused) {
    int train = g_rank < 2;
    rf_comm *g = NULL; /* this side's tp group */
    CHECK_OK(rf_comm_split(world, train ? 0 : 1, g_rank, &g));
    rf_model *want = whole_model(s, 7), *other = whole_model(s, 9);
    uint32_t base7 = rf_crc32c(want->params, want->n_frozen * sizeof(float));
    uint32_t base9 = rf_crc32c(other->params, other->n_frozen * sizeof(float));
    uint32_t lora7 = rf_crc32c(want->params + want->n_frozen, (want->n_params - want->n_frozen) * sizeof(float));
    /* the whole model alone gives the same base CRC */
    rf_param_table wt = rf_param_table_of(want);
    uint32_t crc = 0;
    CHECK_OK(rf_weights_rs_base_checksum(rf_comm_single(), &wt, rf_cpu_kernels(), want->params, T_OK, &crc));
    CHECK(crc == base7);
    for (int round = 0; round < 2; round++) {
        /* round 0: both sides on base 7; round 1: the rollout ranks on base 9 */
        rf_model_tp *tp = shard_of(train || round == 0 ? want : other, g);
        if (!train) memset(tp->m->params + tp->m->n_frozen, 0, sizeof(float) * (tp->m->n_params - tp->m->n_frozen));
        rf_param_table full = {&tp->cfg, tp->full_views, tp->n_full_views};
        uint32_t base = 0;
        CHECK_OK(rf_weights_rs_base_checksum(g, &full, rf_cpu_kernels(), tp->m->params, T_OK, &base));
        CHECK(base == (train || round == 0 ? base7 : base9));
        rf_param_table pt = {&tp->cfg, tp->lora_views, tp->n_lora_views};
        /* The refused exchange fails its communicator: one of its own each round. Rank 0's
         * messages of the refused round are never received; that communicator is kept until the
         * end (*refused), since a freed one's context id goes to the next split, and MPI would
         * hand the stale messages to it. */
        rf_comm *c = NULL;
        CHECK_OK(rf_comm_split(world, 0, g_rank, &c));
        if (!c) {
            rf_model_tp_free(tp);
            break;
        }
        rf_weights_rs *x = NULL;
        CHECK_OK(rf_weights_rs_init(&x, &pt, 2, 1, 2, c, 1 << 12, round ? 3.0 : T_OK));
        if (!x) {
            rf_comm_free(c), rf_model_tp_free(tp);
            break;
        }
        rf_weights_rs_set_base(x, base);
        float *local = tp->m->params + tp->m->n_frozen;
        size_t nf = tp->m->n_frozen;
        float *frozen = malloc(sizeof(float) * nf);
        memcpy(frozen, tp->m->params, sizeof(float) * nf);
        if (train) {
            uint32_t sum = 0;
            CHECK_OK(rf_weights_rs_checksum(x, g, local, T_OK, &sum));
            CHECK(sum == lora7);
            rf_status st = rf_weights_rs_send(x, local, 4 + round, sum);
            CHECK(round ? st != RF_OK : st == RF_OK); /* refused: the rollout ranks never take part */
        } else {
            int64_t v = -1;
            uint32_t got = 0;
            double t0 = rf_time_now();
            while (rf_weights_rs_pending(x) == 0 && rf_time_now() - t0 < T_OK) rf_sleep(0.001);
            rf_error_clear();
            rf_status st = rf_weights_rs_receive(x, local, g, &v, &got);
            if (round == 0) {
                if (st != RF_OK) fprintf(stderr, "world rank %d: %s\n", g_rank, rf_error_message());
                CHECK(st == RF_OK && v == 4 && got == lora7);
                rf_model_tp *w = shard_of(want, g); /* the blocks this rank must now hold */
                CHECK(memcmp(local, w->m->params + w->m->n_frozen, sizeof(float) * (w->m->n_params - w->m->n_frozen)) == 0);
                rf_model_tp_free(w);
            } else {
                char msg[320];
                snprintf(msg, sizeof msg, "weights version 5 from world rank 0: the training ranks' frozen base weights "
                         "(CRC-32C %08x) are not this rollout worker's (%08x): both must load the same model.path",
                         base7, base9);
                CHECK(st == RF_ERR_FORMAT && strcmp(rf_error_message(), msg) == 0);
                if (strcmp(rf_error_message(), msg) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), msg);
            }
        }
        CHECK(memcmp(frozen, tp->m->params, sizeof(float) * nf) == 0);
        if (g_rank == 2)
            printf("shape %d, round %d: base CRC-32C %08x from the rollout shards (training %08x), adapters %08x\n",
                   (int)s, round, base, base7, lora7);
        free(frozen);
        rf_weights_rs_free(x);
        if (round) *refused = c;
        else rf_comm_free(c);
        rf_model_tp_free(tp);
        CHECK_OK(rf_comm_barrier(world, T_OK, "after a round"));
    }
    rf_model_free(want), rf_model_free(other);
    rf_comm_free(g);
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = rf_test_mpi_world(&argc, &argv, "test_lora_reshard");
    if (!world) return 1;
    g_rank = rf_comm_rank(world);
    if (rf_comm_size(world) == 4) {
        rf_comm *refused[2] = {NULL, NULL};
        adapters_alone(world, SHAPE_GQA, &refused[0]);
        adapters_alone(world, SHAPE_QWEN3, &refused[1]);
        rf_comm_free(refused[0]), rf_comm_free(refused[1]);
    } else {
        CHECK(rf_comm_size(world) == 4);
    }
    int rc = rf_test_mpi_finish(world, "test_lora_reshard");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    if (!rf_test_have_mpirun()) {
        printf("test_lora_reshard: skipped: mpirun not found (apt-get install openmpi-bin)\n");
        return 77;
    }
    const int np[] = {4};
    return rf_test_mpi_part("test_lora_reshard", np, 1);
}
