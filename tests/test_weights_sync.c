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
 *    message naming both base checksums. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/crc32c.h"
#include "common/util.h"
#include "kernels/kernels.h"
#include "model/lora.h"
#include "model/model.h"
#include "resharding/weights_sync.h"
#include "test_comm_util.h"
#include "test_util.h"

static rf_model *tiny_model(uint64_t seed) {
    rf_model_config cfg;
    if (rf_config_preset(&cfg, "tiny", 50) != RF_OK) return NULL;
    rf_model *m = NULL;
    if (rf_model_init(&m, &cfg, rf_cpu_kernels()) != RF_OK) return NULL;
    rf_model_init_random(m, seed, 1.0f);
    return m;
}

/* Rank 0: sends m as `version` to ranks 1 and 2 and waits; returns how many read it in place. */
static int send_version(rf_comm *c, rf_weights_tx *tx, rf_model *m, int64_t version, uint32_t *crc) {
    static const int dst[2] = {1, 2};
    CHECK_OK(rf_weights_tx_start(tx, c, m, version, dst, 2, 30, crc));
    double t0 = rf_time_now();
    int done = 0;
    while (!done && rf_time_now() - t0 < 30) {
        done = rf_weights_tx_test(tx);
        if (done < 0) break;
    }
    CHECK(done == 1);
    return rf_weights_tx_in_place(tx);
}

/* Ranks 1, 2: polls until a transfer arrives (bounded); returns its status. */
static rf_status receive(rf_weights_rx *rx, rf_model *m, int64_t *version, uint32_t *crc) {
    double t0 = rf_time_now();
    int arrived = 0;
    while (rf_time_now() - t0 < 30) {
        rf_status st = rf_weights_rx_poll(rx, m, &arrived, version, crc);
        if (st != RF_OK || arrived) return st;
        rf_sleep(0.0005);
    }
    return rf_error(RF_ERR_IO, "nothing arrived in 30 s");
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

static void transfers(rf_comm *world) {
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
    rf_comm_free(d);
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

static int under_mpi(int argc, char **argv) {
    rf_comm *world = NULL;
    if (rf_comm_world(&argc, &argv, &world) != RF_OK) {
        fprintf(stderr, "test_weights_sync: %s\n", rf_error_message());
        return 1;
    }
    if (rf_comm_size(world) == 3) transfers(world), lora_transfers(world);
    else CHECK(rf_comm_size(world) == 3);
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
    CHECK(rf_test_mpirun_self(3, 120, NULL) == 0);
    return rf_test_finish("test_weights_sync");
}
