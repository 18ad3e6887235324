/* Data-parallel scaling on 2 ranks (trainer/data_parallel.h), printed as JSON lines:
 *  - dp_step ranks 1: optimizer steps per second of one rank (all the machine's threads) on the
 *    whole global batch, without data parallelism (the baseline);
 *  - dp_step ranks 2: the same global batch split over 2 ranks (the threads shared between
 *    them), gradients reduced in buckets during backward ("overlap") or all after it
 *    ("defer"); speedup against the baseline;
 *  - dp_allreduce: the time of reducing the whole gradient buffer in the same buckets with
 *    both ranks ready (nothing else running): the communication to hide;
 *  - dp_overlap: comm time left after backward in each mode, per step: from the moment the
 *    last rank ended its backward pass to the moment the last rank had every bucket
 *    (rf_dp_stats' sync_start / sync_end, one clock on one machine; the wait of a rank that was
 *    done early for a slower one is not counted), and the fraction of the allreduce hidden
 *    behind backward: 1 - exposed(overlap) / allreduce (and 1 - exposed(overlap) /
 *    exposed(defer), against the same steps without overlap). MPI moves a started collective only
 *    inside MPI calls, which the backward hook makes twice per layer; on a machine whose cores
 *    all compute, the copies of a shared-memory allreduce take CPU time from backward either
 *    way.
 * Model: the "small" preset (4 layers, hidden 256) with a 8192-token vocabulary; batch: 32
 * samples of 16 prompt and 48 response tokens (2048 tokens), micro-batches of 512 tokens.
 * Usage: bench_dp [--quick] [--bucket FLOATS] [--preset NAME]. Not started by mpirun, it
 * starts itself under `mpirun -np 2 --oversubscribe`. */
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/actor.h"
#include "comm/comm.h"
#include "common/util.h"
#include "trainer/data_parallel.h"

#define NS 32
#define PROMPT 16
#define RESP 48

static int g_reps = 5;
static size_t g_bucket = (size_t)1 << 20;
static const char *g_preset = "small";

#define DIE(st)                                                                                 \
    do {                                                                                        \
        if ((st) != RF_OK) {                                                                    \
            fprintf(stderr, "bench_dp: %s:%d: %s\n", __FILE__, __LINE__, rf_error_message());   \
            rf_comm_abort(1);                                                                   \
        }                                                                                       \
    } while (0)

static rf_model *model(void) {
    rf_model_config c;
    DIE(rf_config_preset(&c, g_preset, 8192));
    rf_model *m;
    DIE(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_model_init_random(m, 1, 0.02f);
    DIE(rf_model_enable_training(m));
    return m;
}

static void make_samples(rf_train_sample *s) {
    for (int i = 0; i < NS; i++) {
        memset(&s[i], 0, sizeof s[i]);
        s[i].n_prompt = PROMPT, s[i].n_resp = RESP;
        s[i].tokens = malloc(sizeof(int32_t) * (PROMPT + RESP));
        for (int t = 0; t < PROMPT + RESP; t++) s[i].tokens[t] = (i * 131 + t * 17) % 8192;
        DIE(rf_train_sample_alloc(&s[i]));
        for (int t = 0; t < RESP; t++) s[i].adv[t] = (i % 2 ? 1.0f : -1.0f), s[i].behav_logp[t] = s[i].prox_logp[t] = -5.0f;
    }
}

static rf_update_opts opts(void) {
    return (rf_update_opts){.pg = {0.2f, 0.28f, 0, 0, 5, 0, RF_KL_K3, 0}, .agg = RF_AGG_TOKEN_MEAN, .max_resp_len = RESP,
                            .epochs = 1, .mini_batches = 1, .micro_tokens = 512, .inv_temp = 1.0f, .shuffle_seed = 1};
}

static const rf_optim_opts OO = {.lr = 1e-5f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .grad_clip = 1.0f};

static double min_over(rf_comm *c, double v) {
    double all[64] = {0}, m = 1e300;
    DIE(rf_comm_allgather(c, &v, all, sizeof v, 60, "gathering times"));
    for (int i = 0; i < rf_comm_size(c); i++) m = all[i] < m ? all[i] : m;
    return m;
}

static double max_over(rf_comm *c, double v) {
    double all[64] = {0}, m = 0;
    DIE(rf_comm_allgather(c, &v, all, sizeof v, 60, "gathering times"));
    for (int i = 0; i < rf_comm_size(c); i++) m = all[i] > m ? all[i] : m;
    return m;
}

/* Steps per second of rank 0 alone on the whole batch; the other rank waits in a barrier
 * (asleep: comm's waits back off). */
static double one_rank(rf_comm *c, rf_model *m, rf_train_sample *s, int threads) {
    double sps = 0;
    if (rf_comm_rank(c) == 0) {
        omp_set_num_threads(threads);
        rf_update_opts uo = opts();
        rf_update_stats st = {0};
        DIE(rf_actor_update(m, &OO, &uo, s, NS, &st)); /* warm-up */
        double t = rf_time_now();
        for (int r = 0; r < g_reps; r++) DIE(rf_actor_update(m, &OO, &uo, s, NS, &st));
        sps = g_reps / (rf_time_now() - t);
        printf("{\"bench\":\"dp_step\",\"ranks\":1,\"threads\":%d,\"params\":%zu,\"global_tokens\":%d,\"steps_per_s\":%.3f}\n",
               threads, m->n_params, NS * (PROMPT + RESP - 1), sps);
        fflush(stdout);
    }
    DIE(rf_comm_barrier(c, 600, "waiting for the one-rank run"));
    DIE(rf_comm_bcast(c, &sps, sizeof sps, 0, 60, "sharing the baseline"));
    return sps;
}

/* Both ranks on their halves: steps per second and the exposed comm time per step. */
static void two_ranks(rf_comm *c, rf_model *m, rf_train_sample *s, int defer, double base, double *exposed) {
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = g_bucket, .defer = defer, .timeout_s = 600};
    DIE(rf_dp_init(&dp, c, m, &o));
    int r = rf_comm_rank(c), n = rf_comm_size(c), lo = NS * r / n, hi = NS * (r + 1) / n;
    rf_update_opts uo = opts();
    uo.dp = dp;
    rf_update_stats st = {0};
    DIE(rf_actor_update(m, &OO, &uo, s + lo, hi - lo, &st)); /* warm-up */
    DIE(rf_comm_barrier(c, 60, "before timing"));
    const rf_dp_stats *ds = rf_dp_get_stats(dp);
    long e0 = ds->buckets_done_early;
    double sec = 0, ex = 0;
    for (int k = 0; k < g_reps; k++) {
        double t = min_over(c, rf_time_now());
        DIE(rf_actor_update(m, &OO, &uo, s + lo, hi - lo, &st));
        double end = max_over(c, ds->sync_end), last_backward = max_over(c, ds->sync_start);
        sec += max_over(c, rf_time_now()) - t;
        ex += end - last_backward;
    }
    *exposed = ex / g_reps;
    long nb = ds->buckets / ds->syncs;
    if (r == 0)
        printf("{\"bench\":\"dp_step\",\"ranks\":%d,\"threads\":1,\"mode\":\"%s\",\"buckets\":%ld,\"bucket_floats\":%zu,"
               "\"steps_per_s\":%.3f,\"speedup\":%.3f,\"exposed_comm_s\":%.4f,\"buckets_done_during_backward\":%.2f}\n",
               n, defer ? "defer" : "overlap", nb, g_bucket, g_reps / sec, g_reps / sec / base, *exposed,
               (double)(ds->buckets_done_early - e0) / g_reps);
    fflush(stdout);
    rf_dp_free(dp);
}

/* The whole gradient buffer reduced in the same buckets, both ranks ready: best of reps. */
static double allreduce_time(rf_comm *c, rf_model *m) {
    size_t n = m->n_params, B = g_bucket;
    int nb = (int)((n + B - 1) / B);
    rf_comm_group **g = calloc((size_t)nb, sizeof *g);
    double best = 1e9;
    for (int r = 0; r < g_reps + 1; r++) {
        DIE(rf_comm_barrier(c, 60, "before the allreduce"));
        double t = rf_time_now();
        for (int k = 0; k < nb; k++) {
            size_t hi = n - (size_t)k * B, lo = hi > B ? hi - B : 0;
            DIE(rf_comm_allreduce_start(c, m->grads + lo, m->grads + lo, hi - lo, 60, "allreduce", &g[k]));
        }
        for (int k = 0; k < nb; k++) DIE(rf_comm_group_wait(g[k], 60));
        double dt = max_over(c, rf_time_now() - t);
        if (r > 0 && dt < best) best = dt;
    }
    if (rf_comm_rank(c) == 0)
        printf("{\"bench\":\"dp_allreduce\",\"ranks\":%d,\"bytes\":%zu,\"buckets\":%d,\"seconds\":%.4f,\"gb_per_s\":%.2f}\n",
               rf_comm_size(c), n * 4, nb, best, n * 4 / best / 1e9);
    free(g);
    return best;
}

static int run(int argc, char **argv) {
    rf_comm *c = NULL;
    DIE(rf_comm_world(&argc, &argv, &c));
    if (rf_comm_size(c) != 2) {
        fprintf(stderr, "bench_dp: runs on 2 ranks\n");
        return 1;
    }
    int cores = (int)sysconf(_SC_NPROCESSORS_ONLN), per = cores / 2 > 0 ? cores / 2 : 1;
    rf_model *m = model();
    rf_train_sample s[NS];
    make_samples(s);
    double base = one_rank(c, m, s, cores);
    omp_set_num_threads(per);
    double ex_overlap = 0, ex_defer = 0;
    two_ranks(c, m, s, 0, base, &ex_overlap);
    two_ranks(c, m, s, 1, base, &ex_defer);
    double ar = allreduce_time(c, m);
    if (rf_comm_rank(c) == 0) {
        double hidden = 1.0 - ex_overlap / ar;
        hidden = hidden < 0 ? 0 : hidden > 1 ? 1 : hidden;
        printf("{\"bench\":\"dp_overlap\",\"ranks\":2,\"allreduce_s\":%.4f,\"exposed_overlap_s\":%.4f,"
               "\"exposed_defer_s\":%.4f,\"hidden_fraction\":%.3f,\"hidden_vs_defer\":%.3f}\n", ar, ex_overlap,
               ex_defer, hidden, ex_defer > 0 ? 1.0 - ex_overlap / ex_defer : 0.0);
    }
    for (int i = 0; i < NS; i++) rf_train_sample_free(&s[i]);
    rf_model_free(m);
    rf_comm_finalize();
    return 0;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) g_reps = 2;
        else if (strcmp(argv[i], "--bucket") == 0 && i + 1 < argc) g_bucket = (size_t)atoll(argv[++i]);
        else if (strcmp(argv[i], "--preset") == 0 && i + 1 < argc) g_preset = argv[++i];
    }
    if (rf_comm_launched_by_mpi()) return run(argc, argv);
    char self[4096], cmd[8192];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return 1;
    self[len] = '\0';
    /* ranks share the cores: idle OpenMP threads sleep */
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    size_t off = (size_t)snprintf(cmd, sizeof cmd, "mpirun -np 2 --oversubscribe --bind-to none %s %s",
                                  geteuid() == 0 ? "--allow-run-as-root" : "", self);
    for (int i = 1; i < argc && off < sizeof cmd; i++) off += (size_t)snprintf(cmd + off, sizeof cmd - off, " %s", argv[i]);
    int rc = system(cmd);
    return rc == 0 ? 0 : 1;
}
