/* Resharding throughput between layouts for a model-sized parameter buffer (~250 MB of fp32:
 * C 1024, F 2816, 4 layers, 16 heads, 4 kv heads, vocabulary 16384), against memcpy bandwidth
 * measured in the same run, printed as JSON lines.
 *
 * For each pair of layouts, every rank moves what the plan gives it (rf_reshard_run, after a
 * warm-up run, best of `reps`); bytes = what lands in the destination buffers of all ranks
 * (received + copied locally), seconds = from a barrier to a barrier after the work (the wall
 * time of all ranks, right also when ranks share cores). The baseline ("memcpy_gb_per_s")
 * is every rank copying the same number of bytes into its destination buffer with memcpy at
 * the same time, so both see the same memory bandwidth and the same number of busy cores;
 * "fraction_of_memcpy" is the ratio. Each case runs with the CRC-32C check (verify 1) and
 * without (verify 0).
 *
 * The weights_sync lines (identical layouts, the split run's path) also run with LoRA adapters
 * on the same model (rank 8 on q, v and rank 16 on every projection): only the adapters travel
 * ("lora_rank", "targets"), against the full weights' transfer measured just before
 * ("full_seconds", "speedup") and the receiver's memcpy of the adapters' bytes. The
 * weights_sync_bf16_kept lines receive the full weights into a model kept in bf16
 * (rf_model_keep_bf16, a split run's rollout worker at bf16 precision on the CPU: checksum and
 * rounding into the bf16 store, no fp32 copy) against the fp32 receive measured just before
 * ("fp32_seconds").
 *
 * Usage: bench_reshard [--np N] [--bucket BYTES] [--quick]. Not started by mpirun, it starts
 * itself under `mpirun -np N --oversubscribe` (N = 2 by default). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common/crc32c.h"
#include "common/shm.h"
#include "common/util.h"
#include "kernels/kernels.h"
#include "model/lora.h"
#include "model/model.h"
#include "resharding/reshard.h"
#include "resharding/weights_sync.h"

static rf_param_table g_pt;
static size_t g_bucket = 16u << 20;
static int g_reps = 3;

#define DIE(st)                                                                              \
    do {                                                                                     \
        if ((st) != RF_OK) {                                                                 \
            fprintf(stderr, "bench_reshard: %s:%d: %s\n", __FILE__, __LINE__, rf_error_message()); \
            rf_comm_abort(1);                                                                \
        }                                                                                    \
    } while (0)

/* The slowest rank's time. */
static double max_over_ranks(rf_comm *c, double t) {
    int n = rf_comm_size(c);
    double *all = malloc(sizeof(double) * (size_t)n), m = 0;
    DIE(rf_comm_allgather(c, &t, all, sizeof t, 60, "gathering times"));
    for (int i = 0; i < n; i++) m = all[i] > m ? all[i] : m;
    free(all);
    return m;
}

static double sum_over_ranks(rf_comm *c, double v) {
    int n = rf_comm_size(c);
    double *all = malloc(sizeof(double) * (size_t)n), s = 0;
    DIE(rf_comm_allgather(c, &v, all, sizeof v, 60, "gathering sizes"));
    for (int i = 0; i < n; i++) s += all[i];
    free(all);
    return s;
}

static float *local_buffer(const rf_reshard_plan *p, const rf_layout *l, int rank, int src) {
    int t = 0;
    if (!rf_layout_find(l, rank, NULL, &t)) return NULL;
    size_t n = src ? p->src_floats[t] : p->dst_floats[t];
    float *b = NULL;
    if (src) DIE(rf_shm_alloc((void **)&b, sizeof(float) * (n + 1), "bench source")); /* as training ranks hold weights */
    else if (!(b = malloc(sizeof(float) * (n + 1)))) DIE(rf_error(RF_ERR_NOMEM, "out of memory"));
    for (size_t i = 0; i < n; i++) b[i] = (float)(i % 1000003) * (src ? 1.0f : -1.0f);
    return b;
}

/* Every rank copies `bytes` into dst (of at least that size) at the same time: best of reps. */
static double memcpy_seconds(rf_comm *c, float *dst, size_t bytes) {
    char *from = malloc(bytes + 1);
    memset(from, 7, bytes + 1);
    double best = 1e30;
    for (int r = 0; r < g_reps + 1; r++) {
        DIE(rf_comm_barrier(c, 60, "memcpy baseline"));
        double t = rf_time_now();
        if (bytes) memcpy(dst, from, bytes);
        DIE(rf_comm_barrier(c, 60, "memcpy baseline"));
        double s = max_over_ranks(c, rf_time_now() - t);
        if (r > 0 && s < best) best = s;
    }
    free(from);
    return best;
}

static const char *name_of(const rf_layout *l, char *out, size_t cap) {
    snprintf(out, cap, "tp%d dp%d ranks %d-%d", l->tp, l->dp, rf_layout_rank(l, 0, 0), rf_layout_rank(l, l->dp - 1, l->tp - 1));
    if (l->ranks && l->ranks[0] > l->ranks[l->dp * l->tp - 1]) snprintf(out, cap, "tp%d dp%d ranks reversed", l->tp, l->dp);
    return out;
}

static void bench_pair(rf_comm *c, const rf_layout *a, const rf_layout *b, size_t bucket) {
    int rank = rf_comm_rank(c);
    rf_reshard_plan *p = NULL;
    DIE(rf_reshard_plan_make(&p, &g_pt, a, b, bucket, rf_comm_size(c)));
    float *src = local_buffer(p, a, rank, 1), *dst = local_buffer(p, b, rank, 0);
    size_t recv = 0, copied = 0;
    rf_reshard_plan_bytes(p, rank, NULL, &recv, &copied);
    double bytes = sum_over_ranks(c, (double)(recv + copied));
    double base = memcpy_seconds(c, dst, recv + copied);
    for (int mode = 0; mode < 4; mode++) {
        int in_place = mode < 2, verify = !(mode & 1);
        rf_reshard_opts o = {.timeout_s = 120, .no_verify = !verify, .no_shm = !in_place};
        rf_reshard *x = NULL;
        DIE(rf_reshard_init(&x, p, c, &o));
        double best = 1e30;
        for (int r = 0; r < g_reps + 1; r++) {
            DIE(rf_comm_barrier(c, 60, "resharding"));
            double t = rf_time_now();
            DIE(rf_reshard_run(x, src, dst, r));
            DIE(rf_comm_barrier(c, 60, "resharding"));
            double s = max_over_ranks(c, rf_time_now() - t);
            if (r > 0 && s < best) best = s;
        }
        double peers = sum_over_ranks(c, rf_reshard_in_place_peers(x));
        rf_reshard_free(x);
        if (rank == 0) {
            char na[64], nb[64];
            double gbs = bytes / best / 1e9, mgbs = bytes / base / 1e9;
            printf("{\"bench\":\"reshard\",\"ranks\":%d,\"from\":\"%s\",\"to\":\"%s\",\"zero_copy\":%d,\"buckets\":%d,"
                   "\"bucket_bytes\":%zu,\"in_place\":%d,\"in_place_pairs\":%.0f,\"verify\":%d,\"bytes\":%.0f,\"seconds\":%.4f,\"gb_per_s\":%.2f,"
                   "\"memcpy_gb_per_s\":%.2f,\"fraction_of_memcpy\":%.3f}\n",
                   rf_comm_size(c), name_of(a, na, sizeof na), name_of(b, nb, sizeof nb), p->zero_copy, p->n_buckets, bucket,
                   in_place, peers / 2, verify, bytes, best, gbs, p->zero_copy ? 0.0 : mgbs, p->zero_copy ? 0.0 : gbs / mgbs);
            fflush(stdout);
        }
    }
    rf_shm_free(src), free(dst);
    rf_reshard_plan_free(p);
}

/* The comm layer alone: `bytes` from rank 0 to the last rank in one rf_comm_sendrecv, against
 * the receiving rank's memcpy of as much in the same run: the ceiling resharding works under
 * (OpenMPI's single copy across processes, CMA, when it has it). */
static void raw_transfer(rf_comm *c, size_t bytes) {
    int rank = rf_comm_rank(c), last = rf_comm_size(c) - 1;
    if (last == 0) return;
    char *buf = NULL;
    if (rank == 0 || rank == last) {
        buf = malloc(bytes);
        memset(buf, rank, bytes);
    }
    double base = memcpy_seconds(c, rank == last ? (float *)buf : NULL, rank == last ? bytes : 0);
    double best = 1e30;
    for (int r = 0; r < g_reps + 1; r++) {
        rf_comm_p2p op = {buf, bytes, rank == 0 ? last : 0, rank == 0};
        DIE(rf_comm_barrier(c, 60, "raw transfer"));
        double t = rf_time_now();
        if (rank == 0 || rank == last) DIE(rf_comm_sendrecv(c, &op, 1, 120, "raw transfer"));
        DIE(rf_comm_barrier(c, 60, "raw transfer"));
        double s = max_over_ranks(c, rf_time_now() - t);
        if (r > 0 && s < best) best = s;
    }
    if (rank == 0)
        printf("{\"bench\":\"comm_sendrecv\",\"ranks\":%d,\"bytes\":%zu,\"seconds\":%.4f,\"gb_per_s\":%.2f,\"memcpy_gb_per_s\":%.2f,"
               "\"fraction_of_memcpy\":%.3f}\n",
               rf_comm_size(c), bytes, best, bytes / best / 1e9, bytes / base / 1e9, base / best);
    free(buf);
}

/* Weights between identical layouts (resharding/weights_sync.h), rank 0 to the last rank: the
 * receiver's stall (the rf_weights_rx_poll call that takes a transfer: receive or read in
 * place, checksum, into the model), read in place and through messages, against the
 * receiver's memcpy of as much. With adapters on m (LoRA) only they travel: `full` holds the
 * full weights' seconds (in place, messages) to compare with; without, it receives them. */
static void weights_sync(rf_comm *c, rf_model *m, rf_model *rm, double full[2]) {
    int rank = rf_comm_rank(c), last = rf_comm_size(c) - 1;
    if (last == 0) return;
    size_t bytes = (m->n_params - m->n_frozen) * sizeof(float);
    /* into the floats a transfer writes (under LoRA the adapters: the base must stay as loaded) */
    double base = memcpy_seconds(c, rank == last ? m->params + m->n_frozen : NULL, rank == last ? bytes : 0);
    for (int in_place = 1; in_place >= 0; in_place--) {
        rf_weights_tx *tx = NULL;
        rf_weights_rx *rx = NULL;
        if (rank == 0) {
            DIE(rf_weights_tx_init(&tx, m));
            rf_weights_tx_set_in_place(tx, in_place);
        }
        if (rank == last) DIE(rf_weights_rx_init(&rx, c, rm, 0));
        double best = 1e30;
        for (int r = 0; r < g_reps + 1; r++) {
            uint32_t crc = 0;
            int64_t v = 0;
            int arrived = 0;
            DIE(rf_comm_barrier(c, 60, "weights sync"));
            if (rank == 0) {
                DIE(rf_weights_tx_start(tx, c, m, r, &last, 1, 60, &crc));
                DIE(rf_weights_tx_wait(tx, 60));
            }
            double s = 0; /* the receiver's stall: the poll that takes the transfer */
            while (rank == last && !arrived) {
                double t = rf_time_now();
                DIE(rf_weights_rx_poll(rx, rm, &arrived, &v, &crc));
                s = rf_time_now() - t;
            }
            DIE(rf_comm_barrier(c, 60, "weights sync"));
            s = max_over_ranks(c, s);
            if (r > 0 && s < best) best = s;
        }
        if (rank == 0 && rm != m)
            printf("{\"bench\":\"weights_sync_bf16_kept\",\"ranks\":2,\"in_place\":%d,\"bytes\":%zu,\"seconds\":%.4f,"
                   "\"fp32_seconds\":%.4f,\"ratio_to_fp32\":%.2f,\"gb_per_s\":%.2f,\"memcpy_gb_per_s\":%.2f,"
                   "\"fraction_of_memcpy\":%.3f}\n",
                   in_place, bytes, best, full[1 - in_place], best / full[1 - in_place], bytes / best / 1e9,
                   bytes / base / 1e9, base / best);
        else if (rank == 0 && !m->lora.rank)
            printf("{\"bench\":\"weights_sync\",\"ranks\":2,\"in_place\":%d,\"bytes\":%zu,\"seconds\":%.4f,\"gb_per_s\":%.2f,"
                   "\"memcpy_gb_per_s\":%.2f,\"fraction_of_memcpy\":%.3f}\n",
                   in_place, bytes, best, bytes / best / 1e9, bytes / base / 1e9, base / best);
        else if (rank == 0)
            printf("{\"bench\":\"weights_sync_lora\",\"ranks\":2,\"in_place\":%d,\"lora_rank\":%d,\"targets\":\"%s\","
                   "\"bytes\":%zu,\"full_bytes\":%zu,\"seconds\":%.6f,\"full_seconds\":%.4f,\"speedup\":%.1f,"
                   "\"gb_per_s\":%.2f,\"memcpy_gb_per_s\":%.2f,\"fraction_of_memcpy\":%.3f}\n",
                   in_place, m->lora.rank, m->lora.targets == ((1u << RF_LORA_N) - 1) ? "all" : "q,v", bytes,
                   m->n_params * sizeof(float), best, full[1 - in_place], full[1 - in_place] / best, bytes / best / 1e9,
                   bytes / base / 1e9, base / best);
        if (!m->lora.rank && rm == m) full[1 - in_place] = best;
        rf_weights_tx_free(tx);
        rf_weights_rx_free(rx);
    }
}

/* weights_sync with adapters on a model of config cfg: rank r on `targets`. */
static void weights_sync_lora(rf_comm *c, const rf_model_config *cfg, int r, unsigned targets, double full[2]) {
    rf_model *m = NULL;
    DIE(rf_model_init(&m, cfg, rf_cpu_kernels()));
    memset(m->params, 0, sizeof(float) * m->n_params); /* the same frozen base on both ranks */
    rf_lora_opts o = {r, 2.0f * (float)r, 0.0f, targets, RF_LORA_INIT_GAUSSIAN, 1};
    DIE(rf_model_lora_attach(m, &o));
    weights_sync(c, m, m, full);
    rf_model_free(m);
}

/* weights_sync of m into a model of the same config kept in bf16 on the receiving rank. */
static void weights_sync_kept(rf_comm *c, rf_model *m, double full[2]) {
    rf_model *k = NULL;
    int kept = 0;
    DIE(rf_cpu_kernels()->set_precision(RF_PRECISION_BF16));
    DIE(rf_model_init(&k, &m->cfg, rf_cpu_kernels()));
    DIE(rf_model_keep_bf16(k, &kept));
    if (kept) weights_sync(c, m, k, full);
    rf_model_free(k);
    DIE(rf_cpu_kernels()->set_precision(RF_PRECISION_FP32));
}

/* The checksum's speed on rank 0 alone (256 MB): rf_crc32c_extend (the crc32 instruction on
 * three streams), the tables, and the checked copy, against memcpy. */
static void checksum_speed(rf_comm *c) {
    if (rf_comm_rank(c) != 0) return;
    size_t n = 256u << 20;
    unsigned char *a = malloc(n), *b = malloc(n);
    memset(a, 1, n), memset(b, 2, n);
    const char *names[4] = {"memcpy", "crc32c", "crc32c_table", "crc32c_copy"};
    double best[4];
    for (int k = 0; k < 4; k++) {
        best[k] = 1e30;
        for (int r = 0; r < (k == 2 ? 2 : 5); r++) {
            volatile uint32_t sink = 0;
            double t = rf_time_now();
            if (k == 0) memcpy(b, a, n);
            if (k == 1) sink = rf_crc32c_extend(0, a, n);
            if (k == 2) sink = rf_crc32c_table_extend(0, a, n);
            if (k == 3) sink = rf_crc32c_copy(0, b, a, n);
            (void)sink;
            t = rf_time_now() - t;
            best[k] = t < best[k] ? t : best[k];
        }
        printf("{\"bench\":\"checksum\",\"what\":\"%s\",\"bytes\":%zu,\"gb_per_s\":%.2f,\"fraction_of_memcpy\":%.3f}\n", names[k], n,
               n / best[k] / 1e9, best[0] / best[k]);
    }
    free(a), free(b);
}

/* memcpy bandwidth of rank 0 alone (the machine's single-core figure). */
static void memcpy_alone(rf_comm *c) {
    if (rf_comm_rank(c) != 0) return;
    size_t n = 256u << 20;
    char *a = malloc(n), *b = malloc(n);
    memset(a, 1, n), memset(b, 2, n);
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t = rf_time_now();
        memcpy(b, a, n);
        t = rf_time_now() - t;
        best = t < best ? t : best;
    }
    printf("{\"bench\":\"memcpy\",\"ranks\":1,\"bytes\":%zu,\"gb_per_s\":%.2f}\n", n, n / best / 1e9);
    free(a), free(b);
}

static int run(int argc, char **argv) {
    rf_comm *c = NULL;
    DIE(rf_comm_world(&argc, &argv, &c));
    rf_model_config cfg;
    DIE(rf_config_preset(&cfg, "25m", 16384));
    cfg.hidden_size = 1024, cfg.intermediate_size = 2816, cfg.num_hidden_layers = 4;
    cfg.num_attention_heads = 16, cfg.num_key_value_heads = 4, cfg.head_dim = 64;
    rf_model *m = NULL; /* only its parameter table is used: the buffer stays untouched */
    DIE(rf_model_init(&m, &cfg, rf_cpu_kernels()));
    g_pt = rf_param_table_of(m);
    int n = rf_comm_size(c);
    if (rf_comm_rank(c) == 0)
        printf("{\"bench\":\"reshard_model\",\"params\":%zu,\"bytes\":%zu,\"ranks\":%d}\n", m->n_params, m->n_params * 4, n);
    memcpy_alone(c);
    checksum_speed(c);
    raw_transfer(c, m->n_params * sizeof(float));
    double full[2] = {0, 0};
    weights_sync(c, m, m, full);
    weights_sync_kept(c, m, full);
    weights_sync_lora(c, &cfg, 8, 1u << RF_LORA_Q | 1u << RF_LORA_V, full);
    weights_sync_lora(c, &cfg, 16, (1u << RF_LORA_N) - 1, full);
    int *rev = malloc(sizeof(int) * (size_t)n);
    for (int i = 0; i < n; i++) rev[i] = n - 1 - i;
    rf_layout train_tp = {.tp = n, .dp = 1}, gen_rep = {.tp = 1, .dp = n}, train_rev = {.tp = n, .dp = 1, .ranks = rev};
    rf_layout one0 = {.tp = 1, .dp = 1, .first_rank = 0}, one1 = {.tp = 1, .dp = 1, .first_rank = n - 1};
    bench_pair(c, &one0, &one1, g_bucket);          /* split: the whole model from one rank to another */
    bench_pair(c, &train_tp, &gen_rep, g_bucket);   /* colocated: tp shards gathered into full replicas */
    bench_pair(c, &gen_rep, &train_tp, g_bucket);   /* and back: every rank cuts its shard locally */
    bench_pair(c, &train_tp, &train_rev, g_bucket); /* every shard to another rank */
    bench_pair(c, &train_tp, &train_tp, g_bucket);  /* identical: zero copy */
    size_t sizes[3] = {1u << 20, 4u << 20, 64u << 20};
    for (int i = 0; i < 3 && g_reps > 1; i++) bench_pair(c, &one0, &one1, sizes[i]);
    free(rev);
    rf_model_free(m);
    rf_comm_finalize();
    return 0;
}

int main(int argc, char **argv) {
    int np = 2;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--np") == 0 && i + 1 < argc) np = atoi(argv[++i]);
        else if (strcmp(argv[i], "--bucket") == 0 && i + 1 < argc) g_bucket = (size_t)atoll(argv[++i]);
        else if (strcmp(argv[i], "--quick") == 0) g_reps = 1;
    }
    if (rf_comm_launched_by_mpi()) return run(argc, argv);
    char self[4096], cmd[8192];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return 1;
    self[len] = '\0';
    size_t off = (size_t)snprintf(cmd, sizeof cmd, "mpirun -np %d --oversubscribe %s %s", np,
                                  geteuid() == 0 ? "--allow-run-as-root" : "", self);
    for (int i = 1; i < argc && off < sizeof cmd; i++) off += (size_t)snprintf(cmd + off, sizeof cmd - off, " %s", argv[i]);
    int rc = system(cmd);
    return rc == 0 ? 0 : 1;
}
