/* Data-parallel training (trainer/data_parallel.h) on CUDA over comm's NCCL back end: the same
 * code as test_dp's MPI runs, the gradients, parameters and optimizer shards in device memory
 * and the small host exchanges (counts, norms, agreement) over the NCCL communicator's own MPI
 * duplicate (rf_comm_host).
 *   - one process on device 0 (a NCCL communicator of one rank): plain DP and ZeRO-1 updates of
 *     a CUDA copy of a tiny model equal the CPU model's update without DP (2 updates x 2 epochs,
 *     clipping that clips) within the CPU-vs-CUDA tolerance of test_model_cuda; rf_dp_sum exact
 *     over the host communicator; rf_dp_moment_range into host memory equals the gathered
 *     moments bit for bit; a resumed ZeRO-1 shard read through rf_dp_opts.moments (host) holds
 *     those floats bit for bit;
 *   - with two or more devices, under mpirun with one rank per device (up to 4): each rank
 *     trains its uneven share on its device, plain and ZeRO-1, and the parameters equal the CPU
 *     update of the whole batch on every rank within the same tolerance, the ranks' parameters
 *     equal bit for bit.
 * Skips (77) without a CUDA device (or a CUDA module: in a build without CUDA, RLFLOW_CUDA_MODULE
 * can name the CPU stand-in, tests/mock_cuda_module.c). Run on one H200 (2026-11-30: the
 * one-device case passes); the case of two or more devices has not run (docs/cuda.md). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "comm/comm.h"
#include "common/util.h"
#include "test_comm_util.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/data_parallel.h"


#define T_OK 60.0
#define NS 12
#define BUCKET 8192
/* CPU and CUDA sum in different orders (test_model_cuda: 1e-3 on gradients); after 4 AdamW
 * steps of lr 3e-3 the parameters agree well within 1e-3 of the largest */
#define TOL 1e-3

static int g_rank, g_size;

/* A copy of CPU model a on the back end k, ready to train. */
static rf_model *on_device(const rf_model *a, const rf_kernels *k) {
    rf_model *m = NULL;
    RF_ASSERT(rf_model_init(&m, &a->cfg, k) == RF_OK);
    k->to_device(m->params, a->params, sizeof(float) * a->n_params);
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    return m;
}

/* max |a - b| / max |b| of device buffer d against host h */
static double rel_diff_dev(const rf_kernels *k, const float *d, const float *h, size_t n) {
    float *x = malloc(sizeof(float) * n);
    RF_ASSERT(x);
    k->to_host(x, d, sizeof(float) * n);
    double diff = 0, mx = 0;
    for (size_t i = 0; i < n; i++) diff = fmax(diff, fabs((double)x[i] - h[i])), mx = fmax(mx, fabs((double)h[i]));
    free(x);
    return mx > 0 ? diff / mx : diff;
}

static rf_optim_opts optim(void) {
    return (rf_optim_opts){.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-6f, .grad_clip = 0.05f};
}

static rf_update_opts update_opts(void) {
    return (rf_update_opts){.pg = {0.2f, 0.28f, 0, 0, 5, 0, RF_KL_K3, 0.01f}, .agg = RF_AGG_TOKEN_MEAN,
                            .max_resp_len = 7, .epochs = 2, .mini_batches = 1, .micro_tokens = 12,
                            .inv_temp = 1.0f, .shuffle_seed = 7};
}

/* rank r's share [lo, hi) of NS samples, uneven (as test_dp) */
static void share(int r, int size, int *lo, int *hi) {
    *lo = NS * r * r / (size * size);
    *hi = NS * (r + 1) * (r + 1) / (size * size);
}

/* A moment source of known floats (a resumed run's files, as rf_checkpoint_moments_read). */
static float known(int which, size_t i) { return which == 1 ? (float)(i % 101) * 1e-3f : (float)(i % 37) * 1e-6f; }
static rf_status known_src(void *ctx, int which, size_t a, size_t n, float *dst) {
    (void)ctx;
    for (size_t i = 0; i < n; i++) dst[i] = known(which, a + i);
    return RF_OK;
}

/* Both updates of the CPU reference on the whole batch, and of device copies over nc (plain,
 * ZeRO-1) on this rank's share; then the comparisons. */
static void train_compare(rf_comm *nc, const rf_kernels *gpu) {
    rf_model *a = rf_test_tiny_model(3, 0);
    rf_model *g = on_device(a, gpu), *z = on_device(a, gpu);
    rf_train_sample s[NS];
    rf_test_train_samples(s, NS, a);
    int lo, hi;
    share(g_rank, g_size, &lo, &hi);
    rf_optim_opts oo = optim();
    rf_update_opts uo = update_opts();
    rf_dp *dp = NULL, *dz = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init(&dp, nc, g, &o));
    o.zero = 1;
    CHECK_OK(rf_dp_init(&dz, nc, z, &o));
    CHECK(z->opt_m == NULL);
    for (int k = 0; dp && dz && k < 2; k++) {
        rf_update_stats sa = {0}, sg = {0}, sz = {0};
        CHECK_OK(rf_actor_update(a, &oo, &uo, s, NS, &sa));
        uo.dp = dp;
        CHECK_OK(rf_actor_update(g, &oo, &uo, s + lo, hi - lo, &sg));
        uo.dp = dz;
        CHECK_OK(rf_actor_update(z, &oo, &uo, s + lo, hi - lo, &sz));
        uo.dp = NULL;
        CHECK(sg.pg.tokens == sa.pg.tokens && sz.pg.tokens == sa.pg.tokens);
        CHECK(sg.optimizer_steps == sa.optimizer_steps && sz.optimizer_steps == sa.optimizer_steps);
        CHECK(sa.grad_norm > oo.grad_clip); /* clipping clips */
        CHECK_CLOSE(sg.grad_norm, sa.grad_norm, 1e-3, 1e-3);
        CHECK_CLOSE(sz.grad_norm, sa.grad_norm, 1e-3, 1e-3);
    }
    double dg = rel_diff_dev(gpu, g->params, a->params, a->n_params);
    double dz_ = rel_diff_dev(gpu, z->params, a->params, a->n_params);
    if (!(dg < TOL && dz_ < TOL)) fprintf(stderr, "rank %d: plain %g, ZeRO-1 %g from the CPU update\n", g_rank, dg, dz_);
    CHECK(dg < TOL && dz_ < TOL);
    /* every rank the same bits (crc of the parameters, gathered over the host communicator) */
    float *h = malloc(sizeof(float) * a->n_params);
    gpu->to_host(h, g->params, sizeof(float) * a->n_params);
    uint32_t crc = rf_crc32c(h, sizeof(float) * a->n_params), *all = calloc((size_t)g_size, sizeof *all);
    CHECK_OK(rf_comm_allgather(rf_comm_host(nc), &crc, all, sizeof crc, T_OK, "parameter checksums"));
    for (int r = 0; r < g_size; r++) CHECK(all[r] == crc);
    /* ZeRO-1's moments: a range gathered into host memory on rank 0 equals the gathered whole */
    if (dz) {
        size_t a0 = 1234, n = a->n_params / 3;
        float *range = g_rank == 0 ? malloc(sizeof(float) * n) : NULL;
        CHECK_OK(rf_dp_moment_range(dz, 2, a0, n, range));
        CHECK_OK(rf_dp_gather_optimizer(dz));
        gpu->to_host(h, z->opt_v, sizeof(float) * a->n_params);
        if (g_rank == 0) CHECK(memcmp(range, h + a0, sizeof(float) * n) == 0);
        CHECK(rel_diff_dev(gpu, z->opt_m, a->opt_m, a->n_params) < 1e-2);
        rf_dp_release_optimizer(dz);
        free(range);
    }
    free(h), free(all);
    rf_dp_free(dp), rf_dp_free(dz);
    for (int i = 0; i < NS; i++) rf_train_sample_free(&s[i]);
    rf_model_free(a), rf_model_free(g), rf_model_free(z);
}

/* Host exchanges and a resumed ZeRO-1 shard read from host memory into the device. */
static void host_side(rf_comm *nc, const rf_kernels *gpu) {
    CHECK(rf_comm_host(nc) != nc && rf_comm_backend(rf_comm_host(nc)) != RF_COMM_NCCL);
    CHECK(rf_comm_size(rf_comm_host(nc)) == g_size && rf_comm_rank(rf_comm_host(nc)) == g_rank);
    rf_model *a = rf_test_tiny_model(5, 0), *m = on_device(a, gpu);
    m->opt_step = 9;
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = 7001, .timeout_s = T_OK, .zero = 1, .moments = known_src};
    CHECK_OK(rf_dp_init(&dp, nc, m, &o));
    if (dp) {
        long in[2] = {(1L << 35) + 7 * g_rank, 4095}, out[2];
        CHECK_OK(rf_dp_sum(dp, in, out, 2, "sum"));
        CHECK(out[0] == g_size * (1L << 35) + 7L * g_size * (g_size - 1) / 2 && out[1] == 4095L * g_size);
        CHECK_OK(rf_dp_gather_optimizer(dp));
        float *h = malloc(sizeof(float) * a->n_params);
        int bad = 0;
        for (int which = 1; which <= 2; which++) {
            gpu->to_host(h, which == 1 ? m->opt_m : m->opt_v, sizeof(float) * a->n_params);
            for (size_t i = 0; i < a->n_params; i++) bad += h[i] != known(which, i);
        }
        CHECK(bad == 0 && m->opt_step == 9);
        free(h);
    }
    rf_dp_free(dp);
    rf_model_free(a), rf_model_free(m);
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = rf_test_mpi_world(&argc, &argv, "test_dp_cuda"), *nc = NULL;
    if (!world) return 1;
    g_rank = rf_comm_rank(world), g_size = rf_comm_size(world);
    int n = rf_cuda_device_count();
    const rf_kernels *gpu = n > 0 ? rf_cuda_kernels(g_rank % n) : NULL;
    CHECK(gpu != NULL);
    if (gpu) CHECK_OK(rf_comm_nccl(world, g_rank % n, T_OK, &nc));
    if (nc) {
        train_compare(nc, gpu);
        host_side(nc, gpu);
        rf_comm_free(nc);
    }
    int rc = rf_test_mpi_finish(world, "test_dp_cuda");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    const rf_kernels *gpu = rf_test_gpu_or_skip("test_dp_cuda");
    if (!gpu) return 77;
    g_rank = 0, g_size = 1;
    rf_comm *nc = NULL;
    CHECK_OK(rf_comm_nccl(rf_comm_single(), 0, T_OK, &nc));
    if (nc) {
        train_compare(nc, gpu);
        host_side(nc, gpu);
        rf_comm_free(nc);
    }
    int n = rf_cuda_device_count();
    if (n >= 2 && rf_test_have_mpirun()) CHECK(rf_test_mpirun_self(n < 4 ? n : 4, 300, NULL) == 0);
    return rf_test_finish("test_dp_cuda");
}
