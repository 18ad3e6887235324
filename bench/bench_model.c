/* Benchmarks of the compute core on the CPU back end against the hardware, printed as JSON lines.
 *
 * Baselines, measured in the same run (the machine, not a library's idea of it):
 *  - matmul_peak: the best matrix product available on the model's largest training shape
 *    (T, F, C) (MLP up-projection): oneDNN f32, oneDNN bf16 (bf16 operands, f32 result; weights
 *    in oneDNN's preferred layout, reordered once) and OpenBLAS sgemm beside them for reference
 *    (the line "sgemm_peak", as before). The fp32 peak is the best f32 product; the bf16 peak
 *    the best of all of them (a bf16 run could always do its products in f32).
 *  - matmul_from_memory: the same products (oneDNN f32 and bf16) over sets of operands twice
 *    the last-level cache, visited in turn, so that each finds its input, packed weight and
 *    output in memory, as a training step's products do (the mean of the rounds): what the
 *    products alone reach when their operands stream from DRAM, a bound the peak above does
 *    not show on a machine whose products outrun its memory (AMX's bf16 tiles on two cores);
 *  - memory: copy bandwidth over buffers much larger than the last-level cache (DRAM) and over
 *    buffers that fit in it (in cache), and read-only bandwidth over the DRAM buffer, all with
 *    OMP_NUM_THREADS threads (the line "memcpy", as before).
 * Figures, each with its fraction of the matching peak:
 *  - train_step: forward + log-probs + backward + optimizer step (gradient-norm clipping and
 *    AdamW, trainer/optim.c) of B x L tokens; FLOPs 6 N + causal attention per token (PaLM's
 *    MFU convention, rf_model_train_flops_per_token); against the fp32 or bf16 peak, and the
 *    products' from-memory figure beside it;
 *  - prefill: B x L prompt tokens into the KV cache; 2 x (layer matmul weights) per token, the
 *    LM head on each prompt's last token, causal attention;
 *  - decode: KV-cache decoding at batch 1 (weights streamed once per step: against the read
 *    and copy bandwidth of DRAM when the weights exceed the last-level cache, of the cache when
 *    they fit; both are printed) and batch 32 (against the peak);
 *  - adamw: rf_optim_step alone (norm, clipping, AdamW), GB/s of its minimal traffic (the
 *    gradients read once for the norm, then parameters, gradients and both moments read and
 *    parameters and moments written: 8 x 4 bytes per parameter) against the DRAM copy.
 *  - attention: one layer's attention forward and backward on the training batch, GFLOP/s over
 *    the visible pairs against the precision's peak, and which arithmetic each pass ran.
 *  - op (with --profile): time per kernel op over one training step, prefill and decode, from a
 *    timed copy of the back end's table.
 *  - frozen (--frozen, with --precision bf16): the model saved as BF16 and loaded back with
 *    rf_model_load_frozen, whose products read the stored bf16 matrices (no fp32 copy): prefill
 *    and decode only (a frozen model does not train), and a model_memory line with the
 *    resident memory after them, to set beside a run without --frozen.
 * Usage: bench_model [--device cpu|cuda] [--quick] [--config small|qwen0.5b]
 *                    [--precision fp32|bf16] [--profile] [--frozen] [--only LIST] (LIST:
 *                    comma-separated train,prefill,decode1,decode32,adamw,attention)
 * --device cuda runs bench_cuda in its place (the same JSON lines on the GPU, against the GPU's
 * own bf16 peak and copy bandwidth; exec_cuda_bench below).
 * Threads: OMP_NUM_THREADS. small is the 25m preset (C=512, 6 layers, vocab 16384, 26 M
 * parameters); qwen0.5b the shape of Qwen2.5-0.5B (494 M parameters) with random weights. */
#include <cblas.h>
#include <omp.h>
#include <dnnl.h> /* rlflow_core links oneDNN (kernels/cpu/cpu_gemm.c) */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/rng.h"
#include "common/util.h"
#include "kernels/cpu/cpu_internal.h" /* which arithmetic attention runs */
#include "kernels/cpu/cpu_level.h"
#include "model/model.h"
#include "trainer/optim.h"
#include "bench/bench_ops.h"
#include "bench/bench_step.h"

/* ---------------------------------------------------------------- options ---- */

typedef struct bench_opts {
    int quick, profile, frozen;
    const char *config;    /* "small" or "qwen0.5b" */
    rf_precision precision;
    const char *only;      /* NULL = every figure */
    int B, L;              /* training and prefill batch: B sequences of L tokens */
} bench_opts;

static int wanted(const bench_opts *o, const char *name) {
    if (!o->only) return 1;
    size_t n = strlen(name);
    for (const char *p = o->only; (p = strstr(p, name)); p += n)
        if ((p == o->only || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) return 1;
    return 0;
}

static void usage_exit(const char *msg) {
    fprintf(stderr, "bench_model: %s\nusage: bench_model [--device cpu|cuda] [--quick] [--config small|qwen0.5b] "
            "[--precision fp32|bf16] [--profile] [--frozen] [--only train,prefill,decode1,decode32,adamw,attention]\n", msg);
    exit(2);
}

/* --device cuda: the GPU's figures come from bench_cuda (built beside this program with the
 * CUDA back end; it links cuBLASLt for the device's own peak, which this program must not),
 * run in this process's place with the options mapped: --quick, --precision (default bf16 on
 * the GPU), --config small -> --model 25m, qwen0.5b -> qwen0.5b, none -> all three shapes
 * (25m, qwen0.5b, 7b). Options bench_cuda has no counterpart for are refused. Returns only
 * on error (exit status 2). */
static void exec_cuda_bench(int argc, char **argv) {
    char *args[16];
    int n = 0;
    static char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 32);
    if (len <= 0) usage_exit("--device cuda: cannot find this program's directory");
    self[len] = 0;
    char *slash = strrchr(self, '/');
    strcpy(slash + 1, "bench_cuda");
    args[n++] = self;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--device") == 0) i++;
        else if (strcmp(a, "--quick") == 0) args[n++] = argv[i];
        else if (strcmp(a, "--precision") == 0 && val) args[n++] = argv[i], args[n++] = argv[++i];
        else if (strcmp(a, "--config") == 0 && val) {
            args[n++] = "--model";
            args[n++] = strcmp(val, "small") == 0 ? "25m" : argv[i + 1];
            i++;
        } else {
            char msg[256];
            snprintf(msg, sizeof msg, "--device cuda: option \"%s\" is for the CPU bench only", a);
            usage_exit(msg);
        }
    }
    args[n] = NULL;
    execv(self, args);
    fprintf(stderr, "bench_model: --device cuda: cannot run %s: %s (a build without the CUDA "
            "back end has no bench_cuda: configure with -DRLFLOW_CUDA=ON)\n", self, strerror(errno));
    exit(2);
}

/* Where the bench runs: "cpu" (default) or "cuda" (exec_cuda_bench). */
static int wants_cuda(int argc, char **argv) {
    int cuda = 0;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--device") == 0) {
            if (i + 1 >= argc || (strcmp(argv[i + 1], "cpu") && strcmp(argv[i + 1], "cuda")))
                usage_exit("--device must be cpu or cuda");
            cuda = strcmp(argv[++i], "cuda") == 0;
        }
    return cuda;
}

static void parse_opts(bench_opts *o, int argc, char **argv) {
    memset(o, 0, sizeof *o);
    o->config = "small";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--quick") == 0) o->quick = 1;
        else if (strcmp(a, "--device") == 0 && val) i++; /* cpu here (wants_cuda) */
        else if (strcmp(a, "--profile") == 0) o->profile = 1;
        else if (strcmp(a, "--frozen") == 0) o->frozen = 1;
        else if (strcmp(a, "--config") == 0 && val) o->config = val, i++;
        else if (strcmp(a, "--only") == 0 && val) o->only = val, i++;
        else if (strcmp(a, "--precision") == 0 && val) {
            if (strcmp(val, "fp32") == 0) o->precision = RF_PRECISION_FP32;
            else if (strcmp(val, "bf16") == 0) o->precision = RF_PRECISION_BF16;
            else usage_exit("--precision must be fp32 or bf16");
            i++;
        } else {
            char msg[256];
            snprintf(msg, sizeof msg, "unknown or incomplete option \"%s\"", a);
            usage_exit(msg);
        }
    }
    for (const char *p = o->only; p && *p; p += strcspn(p, ",") + (p[strcspn(p, ",")] == ',')) {
        static const char *names[] = {"train", "prefill", "decode1", "decode32", "adamw", "attention"};
        size_t n = strcspn(p, ","), ok = 0;
        for (int i = 0; i < 6; i++) ok |= strlen(names[i]) == n && strncmp(p, names[i], n) == 0;
        if (!ok) usage_exit("--only takes train, prefill, decode1, decode32, adamw, attention");
    }
    if (o->frozen && o->precision != RF_PRECISION_BF16) usage_exit("--frozen needs --precision bf16");
    if (o->frozen && (!o->only || wanted(o, "train") || wanted(o, "adamw")))
        o->only = "prefill,decode1,decode32"; /* a frozen model does not train */
    if (strcmp(o->config, "small") == 0) o->B = 8, o->L = 256;
    else if (strcmp(o->config, "qwen0.5b") == 0) o->B = 2, o->L = 256; /* ~10 GB in training */
    else usage_exit("--config must be small or qwen0.5b");
}

/* The model of --config, random weights (std 0.02 like transformers' init). */
static rf_model *bench_model(const bench_opts *o, const rf_kernels *k) {
    rf_model_config c;
    if (strcmp(o->config, "small") == 0) {
        RF_ASSERT(rf_config_preset(&c, "25m", 16384) == RF_OK);
    } else { /* Qwen/Qwen2.5-0.5B's config.json */
        RF_ASSERT(rf_config_preset(&c, "25m", 151936) == RF_OK);
        c.hidden_size = 896, c.intermediate_size = 4864, c.num_hidden_layers = 24;
        c.num_attention_heads = 14, c.num_key_value_heads = 2, c.head_dim = 64;
        c.rope_theta = 1000000.0f, c.max_position_embeddings = 32768;
    }
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, k) == RF_OK);
    rf_model_init_random(m, 1, 0.02f);
    return m;
}

/* --frozen: m saved as BF16 into a temporary directory (removed again) and loaded back with
 * rf_model_load_frozen; m is freed. */
static rf_model *frozen_model(rf_model *m, const rf_kernels *k) {
    char dir[] = "/tmp/rf_bench_frozen_XXXXXX", cmd[64];
    RF_ASSERT(mkdtemp(dir) != NULL);
    RF_ASSERT(rf_model_save(m, dir, 1, 0) == RF_OK);
    rf_model_free(m);
    rf_model *f = NULL;
    rf_status s = rf_model_load_frozen(&f, dir, k, 0);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "bench_model: could not remove %s\n", dir);
    RF_ASSERT(s == RF_OK && f->wbf16 != NULL);
    return f;
}

/* Resident memory of this process now, in MB (/proc/self/statm); -1 when unreadable. */
static double rss_mb(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0, res = -1;
    if (f) {
        if (fscanf(f, "%ld %ld", &size, &res) != 2) res = -1;
        fclose(f);
    }
    return res < 0 ? -1 : (double)res * (double)sysconf(_SC_PAGESIZE) / (1 << 20);
}

/* ------------------------------------------------------ hardware baselines ---- */

typedef struct hw_baseline {
    double blas_f32, dnnl_f32, dnnl_bf16; /* GFLOP/s on (M, N, K); 0 = unavailable */
    double peak_f32, peak_bf16;           /* best f32 product; best product of any kind */
    double mem_f32, mem_bf16; /* the same products with their operands in memory (dnnl_peak's
                                 sets): what a step's products can reach (best f32; best of any) */
    double dram_copy, cache_copy, dram_read; /* GB/s (copy: read + write bytes) */
    size_t llc_bytes;
    int M, N, K; /* the products' shape */
} hw_baseline;

static double gflops_of(int M, int N, int K, double s) { return 2.0 * M * N * K / s / 1e9; }

static double blas_peak(int M, int N, int K, int reps) {
    float *a = calloc((size_t)M * K, 4), *b = calloc((size_t)N * K, 4), *c = calloc((size_t)M * N, 4);
    for (size_t i = 0; i < (size_t)M * K; i++) a[i] = (float)(i % 7) * 0.01f;
    for (size_t i = 0; i < (size_t)N * K; i++) b[i] = (float)(i % 5) * 0.01f;
    double best = 0;
    for (int r = 0; r <= reps; r++) { /* the first run warms up */
        double t = rf_time_now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1, a, K, b, K, 0, c, N);
        double g = gflops_of(M, N, K, rf_time_now() - t);
        if (r > 0 && g > best) best = g;
    }
    free(a), free(b), free(c);
    return best;
}

#define DNNL_OK(x) RF_ASSERT((x) == dnnl_success)

/* Fills a dnnl memory of n elements of type dt with small values (bf16: the top half of f32). */
static void dnnl_fill(dnnl_memory_t mem, size_t n, dnnl_data_type_t dt, int mod) {
    void *p;
    DNNL_OK(dnnl_memory_get_data_handle(mem, &p));
    for (size_t i = 0; i < n; i++) {
        float f = (float)(i % mod) * 0.01f;
        if (dt == dnnl_f32) {
            ((float *)p)[i] = f;
        } else {
            uint32_t u;
            memcpy(&u, &f, 4);
            ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
        }
    }
}

/* oneDNN matmul (M, K) x (K, N) -> (M, N) f32 with operands of type dt, weights given as
 * (N, K) row-major (the model's layout) and reordered once into the layout oneDNN picks.
 * sets = 1: the best GFLOP/s of reps runs on one set of operands, which stay in the caches (the
 * peak). sets > 1: as many sets of operands (input, packed weight, output), visited in turn for
 * reps rounds, so that each product finds its operands in memory as a training step's products
 * do; the mean GFLOP/s of the rounds after the first. The implementation's name goes to impl
 * (cap bytes). */
static double dnnl_peak(int M, int N, int K, dnnl_data_type_t dt, int reps, int sets, char *impl, size_t cap) {
    dnnl_engine_t eng;
    dnnl_stream_t st;
    DNNL_OK(dnnl_engine_create(&eng, dnnl_cpu, 0));
    DNNL_OK(dnnl_stream_create(&st, eng, dnnl_stream_default_flags));
    dnnl_memory_desc_t a_md, w_any, w_user, c_md;
    dnnl_dims_t ad = {M, K}, wd = {K, N}, cd = {M, N};
    DNNL_OK(dnnl_memory_desc_init_by_tag(&a_md, 2, ad, dt, dnnl_ab));
    DNNL_OK(dnnl_memory_desc_init_by_tag(&w_any, 2, wd, dt, dnnl_format_tag_any));
    DNNL_OK(dnnl_memory_desc_init_by_tag(&w_user, 2, wd, dt, dnnl_ba));
    DNNL_OK(dnnl_memory_desc_init_by_tag(&c_md, 2, cd, dnnl_f32, dnnl_ab));
    dnnl_matmul_desc_t mm;
    DNNL_OK(dnnl_matmul_desc_init(&mm, &a_md, &w_any, NULL, &c_md));
    dnnl_primitive_desc_t pd;
    if (dnnl_primitive_desc_create(&pd, &mm, NULL, eng, NULL) != dnnl_success) {
        snprintf(impl, cap, "unavailable");
        dnnl_stream_destroy(st), dnnl_engine_destroy(eng);
        return 0;
    }
    const char *name = "?";
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name);
    snprintf(impl, cap, "%s", name);
    const dnnl_memory_desc_t *w_md = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
    dnnl_memory_t wu, *a = calloc(sets, sizeof *a), *w = calloc(sets, sizeof *w), *c = calloc(sets, sizeof *c);
    RF_ASSERT(a && w && c);
    DNNL_OK(dnnl_memory_create(&wu, &w_user, eng, DNNL_MEMORY_ALLOCATE));
    dnnl_fill(wu, (size_t)N * K, dt, 5);
    dnnl_primitive_desc_t rpd; /* the weights' reorder, once (as a model would per update) */
    dnnl_primitive_t reorder, prim;
    DNNL_OK(dnnl_reorder_primitive_desc_create(&rpd, &w_user, eng, w_md, eng, NULL));
    DNNL_OK(dnnl_primitive_create(&reorder, rpd));
    for (int i = 0; i < sets; i++) {
        DNNL_OK(dnnl_memory_create(&a[i], &a_md, eng, DNNL_MEMORY_ALLOCATE));
        DNNL_OK(dnnl_memory_create(&w[i], w_md, eng, DNNL_MEMORY_ALLOCATE));
        DNNL_OK(dnnl_memory_create(&c[i], &c_md, eng, DNNL_MEMORY_ALLOCATE));
        dnnl_fill(a[i], (size_t)M * K, dt, 7), dnnl_fill(c[i], (size_t)M * N, dnnl_f32, 3);
        dnnl_exec_arg_t rargs[2] = {{DNNL_ARG_FROM, wu}, {DNNL_ARG_TO, w[i]}};
        DNNL_OK(dnnl_primitive_execute(reorder, st, 2, rargs));
    }
    DNNL_OK(dnnl_primitive_create(&prim, pd));
    double best = 0, total = 0;
    int timed = 0;
    for (int r = 0; r <= reps; r++) {
        double round = rf_time_now();
        for (int i = 0; i < sets; i++) {
            dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, a[i]}, {DNNL_ARG_WEIGHTS, w[i]}, {DNNL_ARG_DST, c[i]}};
            double t = rf_time_now();
            DNNL_OK(dnnl_primitive_execute(prim, st, 3, args));
            DNNL_OK(dnnl_stream_wait(st));
            double g = gflops_of(M, N, K, rf_time_now() - t);
            if (r > 0 && g > best) best = g;
        }
        if (r > 0) total += rf_time_now() - round, timed += sets; /* the first round warms up */
    }
    dnnl_primitive_destroy(prim), dnnl_primitive_destroy(reorder);
    dnnl_primitive_desc_destroy(rpd), dnnl_primitive_desc_destroy(pd);
    for (int i = 0; i < sets; i++) dnnl_memory_destroy(a[i]), dnnl_memory_destroy(w[i]), dnnl_memory_destroy(c[i]);
    dnnl_memory_destroy(wu);
    free(a), free(w), free(c);
    dnnl_stream_destroy(st), dnnl_engine_destroy(eng);
    return sets == 1 ? best : gflops_of(M, N, K, total / timed);
}

/* Bytes of the last-level cache: sysfs (what lscpu shows), else sysconf (which reads CPUID and
 * under some hypervisors says ten times too much), else 32 MiB. */
static size_t llc_bytes(void) {
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    unsigned kb = 0;
    if (f) {
        if (fscanf(f, "%uK", &kb) != 1) kb = 0;
        fclose(f);
    }
    if (kb) return (size_t)kb << 10;
    long s = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return s > 0 ? (size_t)s : (size_t)32 << 20;
}

/* Copy bandwidth of n-byte buffers (read + write counted), each thread copying its share as
 * decoding's threads each stream their share; best GB/s of `reps` timings of `passes` copies. */
static double copy_bw(size_t n, int passes, int reps) {
    char *a = malloc(n), *b = malloc(n);
    memset(a, 1, n), memset(b, 2, n);
    double best = 0;
    for (int r = 0; r < reps; r++) {
        double t = rf_time_now();
        for (int p = 0; p < passes; p++) {
#pragma omp parallel
            {
                int nt = omp_get_num_threads(), id = omp_get_thread_num();
                size_t lo = n / nt * id, hi = id == nt - 1 ? n : n / nt * (id + 1);
                memcpy(b + lo, a + lo, hi - lo);
            }
        }
        double g = 2.0 * n * passes / (rf_time_now() - t) / 1e9;
        if (g > best) best = g;
    }
    free(a), free(b);
    return best;
}

/* Read-only bandwidth over n bytes (a sum of floats), best GB/s of reps. */
static double read_bw(size_t n, int reps) {
    size_t nf = n / 4;
    float *a = malloc(n);
#pragma omp parallel for
    for (size_t i = 0; i < nf; i++) a[i] = 1.0f;
    double best = 0, sink = 0;
    for (int r = 0; r < reps; r++) {
        double t = rf_time_now();
        float s = 0;
#pragma omp parallel for simd reduction(+ : s)
        for (size_t i = 0; i < nf; i++) s += a[i];
        double g = (double)n / (rf_time_now() - t) / 1e9;
        sink += s;
        if (g > best) best = g;
    }
    free(a);
    return sink < 0 ? 0 : best; /* sink keeps the sum alive */
}

/* The CPU's model name and whether it has bf16 instructions (/proc/cpuinfo); which copy of the
 * kernels compiled per x86-64 level runs ("native" in a build for this CPU). */
static void print_machine(void) {
    char line[4096], name[256] = "?";
    int avx512_bf16 = 0, amx_bf16 = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof line, f)) {
        char *c = strchr(line, ':');
        if (!c) continue;
        if (strncmp(line, "model name", 10) == 0 && name[0] == '?') {
            snprintf(name, sizeof name, "%s", c + 2);
            name[strcspn(name, "\n\"\\")] = 0;
        } else if (strncmp(line, "flags", 5) == 0) {
            avx512_bf16 |= strstr(c, " avx512_bf16") != NULL;
            amx_bf16 |= strstr(c, " amx_bf16") != NULL;
        }
    }
    if (f) fclose(f);
    printf("{\"bench\":\"machine\",\"cpu\":\"%s\",\"threads\":%d,\"avx512_bf16\":%s,\"amx_bf16\":%s,"
           "\"cpu_kernels\":\"%s\"}\n",
           name, omp_get_max_threads(), avx512_bf16 ? "true" : "false", amx_bf16 ? "true" : "false",
           rf_cpu_level_name());
}

/* Sets of set_bytes whose total is twice the last-level cache: 4 to 512. */
static int sets_for(size_t set_bytes, size_t llc) {
    size_t n = (2 * llc + set_bytes - 1) / set_bytes;
    return n < 4 ? 4 : n > 512 ? 512 : (int)n;
}

/* The peaks from the products measured: fp32 the best f32 product, bf16 the best of any (a bf16
 * run could always do its products in f32). */
static void set_peaks(hw_baseline *hw) {
    hw->peak_f32 = hw->blas_f32 > hw->dnnl_f32 ? hw->blas_f32 : hw->dnnl_f32;
    hw->peak_bf16 = hw->dnnl_bf16 > hw->peak_f32 ? hw->dnnl_bf16 : hw->peak_f32;
}

static void measure_baseline(hw_baseline *hw, int M, int N, int K, int quick) {
    int reps = quick ? 3 : 10;
    char impl_f32[128], impl_bf16[128];
    hw->blas_f32 = blas_peak(M, N, K, reps);
    hw->dnnl_f32 = dnnl_peak(M, N, K, dnnl_f32, reps, 1, impl_f32, sizeof impl_f32);
    hw->dnnl_bf16 = dnnl_peak(M, N, K, dnnl_bf16, reps, 1, impl_bf16, sizeof impl_bf16);
    set_peaks(hw);
    hw->M = M, hw->N = N, hw->K = K;
    hw->llc_bytes = llc_bytes();
    size_t big = hw->llc_bytes * 8 > ((size_t)256 << 20) ? hw->llc_bytes * 8 : (size_t)256 << 20;
    hw->dram_copy = copy_bw(big, 1, quick ? 3 : 6);
    hw->cache_copy = copy_bw(hw->llc_bytes / 4, 16, quick ? 3 : 6); /* both buffers: half the LLC */
    hw->dram_read = read_bw(big, quick ? 3 : 6);
    /* operands from memory: sets of them twice the last-level cache (4 to 512 sets) */
    size_t set_f32 = 4 * ((size_t)M * K + (size_t)K * N + (size_t)M * N);
    size_t set_bf16 = 2 * ((size_t)M * K + (size_t)K * N) + 4 * (size_t)M * N;
    int sets_f32 = sets_for(set_f32, hw->llc_bytes), sets_bf16 = sets_for(set_bf16, hw->llc_bytes);
    char impl_mem[128];
    double mem_f32 = dnnl_peak(M, N, K, dnnl_f32, quick ? 1 : 3, sets_f32, impl_mem, sizeof impl_mem);
    double mem_bf16 = dnnl_peak(M, N, K, dnnl_bf16, quick ? 1 : 3, sets_bf16, impl_mem, sizeof impl_mem);
    hw->mem_f32 = mem_f32;
    hw->mem_bf16 = mem_bf16 > mem_f32 ? mem_bf16 : mem_f32;
    printf("{\"bench\":\"matmul_peak\",\"lib\":\"onednn\",\"dtype\":\"f32\",\"m\":%d,\"n\":%d,\"k\":%d,"
           "\"gflops\":%.2f,\"impl\":\"%s\",\"threads\":%d}\n", M, N, K, hw->dnnl_f32, impl_f32,
           omp_get_max_threads());
    printf("{\"bench\":\"matmul_peak\",\"lib\":\"onednn\",\"dtype\":\"bf16\",\"m\":%d,\"n\":%d,\"k\":%d,"
           "\"gflops\":%.2f,\"impl\":\"%s\",\"threads\":%d}\n", M, N, K, hw->dnnl_bf16, impl_bf16,
           omp_get_max_threads());
    printf("{\"bench\":\"sgemm_peak\",\"lib\":\"openblas\",\"m\":%d,\"n\":%d,\"k\":%d,\"gflops\":%.2f,"
           "\"peak_fp32_gflops\":%.2f,\"peak_bf16_gflops\":%.2f}\n", M, N, K, hw->blas_f32,
           hw->peak_f32, hw->peak_bf16);
    printf("{\"bench\":\"matmul_from_memory\",\"lib\":\"onednn\",\"dtype\":\"f32\",\"m\":%d,\"n\":%d,"
           "\"k\":%d,\"sets\":%d,\"bytes\":%zu,\"gflops\":%.2f,\"fraction_of_peak\":%.3f}\n", M, N, K,
           sets_f32, set_f32 * sets_f32, mem_f32, mem_f32 / hw->peak_f32);
    printf("{\"bench\":\"matmul_from_memory\",\"lib\":\"onednn\",\"dtype\":\"bf16\",\"m\":%d,\"n\":%d,"
           "\"k\":%d,\"sets\":%d,\"bytes\":%zu,\"gflops\":%.2f,\"fraction_of_peak\":%.3f}\n", M, N, K,
           sets_bf16, set_bf16 * sets_bf16, mem_bf16, mem_bf16 / hw->peak_bf16);
    printf("{\"bench\":\"memcpy\",\"bytes\":%zu,\"gb_per_s\":%.2f,\"dram_copy_gb_per_s\":%.2f,"
           "\"dram_read_gb_per_s\":%.2f,\"cache_copy_bytes\":%zu,\"cache_copy_gb_per_s\":%.2f,"
           "\"llc_bytes\":%zu}\n", big, hw->dram_copy, hw->dram_copy, hw->dram_read,
           hw->llc_bytes / 4, hw->cache_copy, hw->llc_bytes);
}

/* The peaks measured again (3 runs of the product in cache) right before a figure, each kept at
 * the best seen in the run: on a shared machine the start's measurement alone can catch the
 * neighbours' load (152-322 GFLOP/s f32 within an hour on a 2-core Ice Lake Xeon) and then
 * reports a step at more than its peak. Prints the refreshed peak where it rose. */
static void refresh_peak(hw_baseline *hw, rf_precision p) {
    char impl[128];
    double f32 = dnnl_peak(hw->M, hw->N, hw->K, dnnl_f32, 3, 1, impl, sizeof impl), bf16 = 0;
    if (p == RF_PRECISION_BF16) bf16 = dnnl_peak(hw->M, hw->N, hw->K, dnnl_bf16, 3, 1, impl, sizeof impl);
    double old_f32 = hw->peak_f32, old_bf16 = hw->peak_bf16;
    if (f32 > hw->dnnl_f32) hw->dnnl_f32 = f32;
    if (bf16 > hw->dnnl_bf16) hw->dnnl_bf16 = bf16;
    set_peaks(hw);
    if (hw->peak_f32 > old_f32 || hw->peak_bf16 > old_bf16)
        printf("{\"bench\":\"peak_refresh\",\"peak_fp32_gflops\":%.2f,\"peak_bf16_gflops\":%.2f}\n",
               hw->peak_f32, hw->peak_bf16);
}

/* ------------------------------------------------------------------ figures ---- */

static const char *prec_name(rf_precision p) { return p == RF_PRECISION_BF16 ? "bf16" : "fp32"; }

/* How the model holds its weights: "fp32" (with bf16 copies at bf16 precision), or
 * "frozen-bf16" (--frozen: the stored bf16 matrices only). */
static const char *weights_name(const bench_opts *o) { return o->frozen ? "frozen-bf16" : "fp32"; }

static double peak_for(const hw_baseline *hw, rf_precision p) {
    return p == RF_PRECISION_BF16 ? hw->peak_bf16 : hw->peak_f32;
}

static double mem_peak_for(const hw_baseline *hw, rf_precision p) {
    return p == RF_PRECISION_BF16 ? hw->mem_bf16 : hw->mem_f32;
}

static rf_optim_opts bench_optim_opts(void) {
    rf_optim_opts o = {0};
    o.lr = 1e-5f, o.beta1 = 0.9f, o.beta2 = 0.999f, o.eps = 1e-8f, o.weight_decay = 0.01f;
    o.grad_clip = 1.0f, o.total_steps = 1000;
    return o;
}

/* One optimizer step as the trainer takes it; then the back end is told the weights changed. */
static void optim_step(rf_model *m) {
    rf_optim_opts oo = bench_optim_opts();
    double norm;
    float lr;
    RF_ASSERT(rf_optim_step(m, &oo, &norm, &lr) == RF_OK);
    m->k->weights_updated();
}

typedef struct train_times { double fwd, lp, bwd, opt, total; } train_times;

static train_times train_once(rf_model *m, const rf_batch *bt, const int32_t *tgt, float *lp,
                              const float *dlp) {
    train_times t;
    double t0 = rf_time_now();
    rf_model_zero_grad(m);
    RF_ASSERT(rf_model_forward(m, bt) == RF_OK);
    double t1 = rf_time_now();
    RF_ASSERT(rf_model_logprobs(m, tgt, 1.0f, lp, NULL) == RF_OK);
    double t2 = rf_time_now();
    RF_ASSERT(rf_model_backward(m, dlp, NULL, NULL) == RF_OK);
    double t3 = rf_time_now();
    optim_step(m);
    double t4 = rf_time_now();
    t.fwd = t1 - t0, t.lp = t2 - t1, t.bwd = t3 - t2, t.opt = t4 - t3, t.total = t4 - t0;
    return t;
}

static void bench_train(rf_model *m, const bench_opts *o, const hw_baseline *hw) {
    int B = o->B, L = o->L, T = B * L, V = m->cfg.vocab_size, reps = o->quick ? 1 : 3;
    int32_t *tok = malloc(sizeof(int32_t) * T), *tgt = malloc(sizeof(int32_t) * T);
    int32_t *cu = malloc(sizeof(int32_t) * (B + 1));
    float *lp = malloc(sizeof(float) * T), *dlp = malloc(sizeof(float) * T);
    rf_rng r;
    rf_rng_seed(&r, 1);
    for (int t = 0; t < T; t++) {
        tok[t] = (int32_t)(rf_rng_u64(&r) % V), tgt[t] = (int32_t)(rf_rng_u64(&r) % V);
        dlp[t] = -1.0f / T;
    }
    for (int b = 0; b <= B; b++) cu[b] = b * L;
    rf_batch bt = {B, T, tok, NULL, cu};
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    train_times best = {0, 0, 0, 0, 1e30};
    for (int i = 0; i < reps + 1; i++) { /* the first step warms up allocations */
        if (i == reps && o->profile) profile_reset();
        train_times t = train_once(m, &bt, tgt, lp, dlp);
        if (i > 0 && t.total < best.total) best = t;
        if (i == reps && o->profile) profile_print("train_step", t.total);
    }
    double flops = rf_model_train_flops_per_token(&m->cfg, L) * T, gf = flops / best.total / 1e9;
    double peak = peak_for(hw, o->precision);
    printf("{\"bench\":\"train_step\",\"config\":\"%s\",\"precision\":\"%s\",\"params\":%zu,"
           "\"tokens\":%d,\"seconds\":%.4f,\"forward_s\":%.4f,\"logprobs_s\":%.4f,\"backward_s\":%.4f,"
           "\"optim_s\":%.4f,\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"peak_gflops\":%.2f,"
           "\"fraction_of_peak\":%.3f,\"from_memory_gflops\":%.2f,\"fraction_of_from_memory\":%.3f,"
           "\"sgemm_peak_gflops\":%.2f,\"fraction_of_sgemm_peak\":%.3f}\n",
           o->config, prec_name(o->precision), m->n_params, T, best.total, best.fwd, best.lp,
           best.bwd, best.opt, T / best.total, gf, peak, gf / peak, mem_peak_for(hw, o->precision),
           gf / mem_peak_for(hw, o->precision), hw->blas_f32, gf / hw->blas_f32);
    free(tok), free(tgt), free(cu), free(lp), free(dlp);
}

static void bench_adamw(rf_model *m, const bench_opts *o, const hw_baseline *hw) {
    if (!m->grads) RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    for (size_t i = 0; i < m->n_params; i += 97) m->grads[i] = 1e-3f; /* a norm to clip by */
    double best = 1e30;
    for (int i = 0; i < (o->quick ? 3 : 6); i++) {
        double t0 = rf_time_now();
        optim_step(m);
        double el = rf_time_now() - t0;
        if (i > 0 && el < best) best = el;
    }
    double bytes = 32.0 * m->n_params, gbs = bytes / best / 1e9;
    printf("{\"bench\":\"adamw\",\"config\":\"%s\",\"precision\":\"%s\",\"params\":%zu,\"seconds\":%.4f,\"bytes\":%.0f,"
           "\"gb_per_s\":%.2f,\"dram_copy_gb_per_s\":%.2f,\"fraction_of_copy_bw\":%.3f}\n",
           o->config, prec_name(o->precision), m->n_params, best, bytes, gbs, hw->dram_copy,
           gbs / hw->dram_copy);
}

/* One layer's attention on the training batch (B sequences of L tokens, the model's heads),
 * forward (with lse) and backward, through the back end's table: GFLOP/s over the visible
 * (query, key) pairs (forward 2 products, backward 5: 4 D and 10 D flops a pair and head) and
 * their fraction of the precision's peak; "forward" and "backward" say which arithmetic ran
 * (bf16 on AMX's tiles, or fp32: kernels/cpu/cpu_attention_amx.c). */
static void bench_attention(const rf_model *m, const rf_kernels *k, const bench_opts *o, const hw_baseline *hw) {
    int B = o->B, L = o->L, T = B * L, H = m->cfg.num_attention_heads, KVH = m->cfg.num_key_value_heads;
    int D = m->cfg.head_dim;
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D;
    float *q = malloc(sizeof(float) * nq), *kk = malloc(sizeof(float) * nk), *v = malloc(sizeof(float) * nk);
    float *dout = malloc(sizeof(float) * nq), *out = malloc(sizeof(float) * nq), *lse = malloc(sizeof(float) * T * H);
    float *dq = malloc(sizeof(float) * nq), *dk = malloc(sizeof(float) * nk), *dv = malloc(sizeof(float) * nk);
    int32_t *cu = malloc(sizeof(int32_t) * (B + 1)), *kl = malloc(sizeof(int32_t) * B);
    RF_ASSERT(q && kk && v && dout && out && lse && dq && dk && dv && cu && kl);
    rf_rng rng;
    rf_rng_seed(&rng, 7);
    for (size_t i = 0; i < nq; i++) q[i] = rf_rng_normal(&rng), dout[i] = rf_rng_normal(&rng);
    for (size_t i = 0; i < nk; i++) kk[i] = rf_rng_normal(&rng), v[i] = rf_rng_normal(&rng);
    for (int b = 0; b <= B; b++) cu[b] = b * L;
    for (int b = 0; b < B; b++) kl[b] = L;
    double best_f = 1e30, best_b = 1e30;
    for (int r = 0; r < (o->quick ? 3 : 6); r++) {
        double t0 = rf_time_now();
        k->attention_forward(out, lse, q, kk, v, cu, cu, kl, B, H, KVH, D);
        double t1 = rf_time_now();
        k->attention_backward(dq, dk, dv, dout, q, kk, v, out, lse, cu, B, T, H, KVH, D);
        double t2 = rf_time_now();
        if (r > 0) best_f = t1 - t0 < best_f ? t1 - t0 : best_f, best_b = t2 - t1 < best_b ? t2 - t1 : best_b;
    }
    double pairs = (double)B * L * (L + 1) / 2 * H, peak = peak_for(hw, o->precision);
    double gf = 4.0 * D * pairs / best_f / 1e9, gb = 10.0 * D * pairs / best_b / 1e9;
    printf("{\"bench\":\"attention\",\"config\":\"%s\",\"precision\":\"%s\",\"sequences\":%d,\"seq_len\":%d,"
           "\"heads\":%d,\"kv_heads\":%d,\"head_dim\":%d,\"forward\":\"%s\",\"backward\":\"%s\","
           "\"forward_s\":%.5f,\"backward_s\":%.5f,\"forward_gflops\":%.2f,\"backward_gflops\":%.2f,"
           "\"peak_gflops\":%.2f,\"forward_fraction_of_peak\":%.3f,\"backward_fraction_of_peak\":%.3f}\n",
           o->config, prec_name(o->precision), B, L, H, KVH, D, rf_cpu_attention_amx_forward() ? "bf16-tiles" : "fp32",
           rf_cpu_attention_amx_backward(D) ? "bf16-tiles" : "fp32", best_f, best_b, gf, gb, peak, gf / peak, gb / peak);
    free(q), free(kk), free(v), free(dout), free(out), free(lse), free(dq), free(dk), free(dv), free(cu), free(kl);
}

static void bench_prefill(rf_model *m, const bench_opts *o, const hw_baseline *hw) {
    int B = o->B, L = o->L, V = m->cfg.vocab_size;
    rf_kv_cache kv;
    RF_ASSERT(rf_kv_cache_init(&kv, m, B, L) == RF_OK);
    int32_t *tok = malloc(sizeof(int32_t) * B * L);
    int *slots = malloc(sizeof(int) * B), *counts = malloc(sizeof(int) * B);
    for (int i = 0; i < B * L; i++) tok[i] = i % V;
    for (int b = 0; b < B; b++) slots[b] = b, counts[b] = L;
    float *logits = malloc(sizeof(float) * B * V);
    double best = 1e30;
    /* an untimed pass first, the cache emptied after each: the timed ones find their memory
     * touched, as a serving engine's long-lived cache is (the CPU back end maps lazily) */
    for (int i = 0; i < (o->quick ? 2 : 3); i++) {
        if (i > 0 && o->profile) profile_reset();
        double t0 = rf_time_now();
        RF_ASSERT(rf_model_decode(m, &kv, slots, counts, B, tok, logits) == RF_OK);
        double el = rf_time_now() - t0;
        if (i > 0 && el < best) best = el;
        if (i == 1 && o->profile) profile_print("prefill", el);
        for (int b = 0; b < B; b++) kv.len[b] = 0;
    }
    double gf = rf_bench_prefill_flops(&m->cfg, B, L) / best / 1e9, peak = peak_for(hw, o->precision);
    printf("{\"bench\":\"prefill\",\"config\":\"%s\",\"precision\":\"%s\",\"weights\":\"%s\",\"sequences\":%d,"
           "\"prompt_len\":%d,\"seconds\":%.4f,\"tokens_per_s\":%.1f,\"gflops\":%.2f,"
           "\"peak_gflops\":%.2f,\"fraction_of_peak\":%.3f,\"from_memory_gflops\":%.2f,"
           "\"fraction_of_from_memory\":%.3f,\"fraction_of_sgemm_peak\":%.3f}\n",
           o->config, prec_name(o->precision), weights_name(o), B, L, best, B * L / best, gf, peak, gf / peak,
           mem_peak_for(hw, o->precision), gf / mem_peak_for(hw, o->precision), gf / hw->blas_f32);
    rf_kv_cache_free(&kv, m);
    free(tok), free(slots), free(counts), free(logits);
}

/* Bytes of weights one decoding step streams: every parameter once, in the precision the
 * products read them (bf16: the back end's bf16 copies). */
static double weight_bytes(const rf_model *m, rf_precision p) {
    return (double)m->n_params * (p == RF_PRECISION_BF16 ? 2 : 4);
}

static double decode_steps(rf_model *m, rf_kv_cache *kv, int B, int steps, int32_t *tok,
                           const int *slots, const int *ones, float *logits) {
    int V = m->cfg.vocab_size;
    double t0 = rf_time_now();
    for (int s = 0; s < steps; s++) {
        for (int b = 0; b < B; b++) tok[b] = (s * 7 + b) % V;
        RF_ASSERT(rf_model_decode(m, kv, slots, ones, B, tok, logits) == RF_OK);
    }
    return rf_time_now() - t0;
}

static void bench_decode(rf_model *m, int B, const bench_opts *o, const hw_baseline *hw) {
    int P = 16, V = m->cfg.vocab_size, steps = o->quick ? 8 : 32, reps = o->quick ? 1 : 2;
    if (strcmp(o->config, "small") == 0) steps *= 2;
    rf_kv_cache kv;
    RF_ASSERT(rf_kv_cache_init(&kv, m, B, P + 1 + steps) == RF_OK);
    int32_t *tok = malloc(sizeof(int32_t) * B * P);
    int *slots = malloc(sizeof(int) * B), *counts = malloc(sizeof(int) * B), *ones = malloc(sizeof(int) * B);
    for (int b = 0; b < B; b++) slots[b] = b, counts[b] = P, ones[b] = 1;
    float *logits = malloc(sizeof(float) * B * V);
    double best = 1e30, first = 1e30;
    for (int r = 0; r < reps; r++) { /* each repetition: prompt of P tokens, one step, then `steps` */
        for (int b = 0; b < B; b++) kv.len[b] = 0;
        for (int i = 0; i < B * P; i++) tok[i] = (i * 31) % V;
        m->k->weights_updated(); /* as after an update: the prompt and first step make the copies */
        RF_ASSERT(rf_model_decode(m, &kv, slots, counts, B, tok, logits) == RF_OK);
        double f = decode_steps(m, &kv, B, 1, tok, slots, ones, logits);
        if (f < first) first = f;
        if (o->profile) profile_reset();
        double el = decode_steps(m, &kv, B, steps, tok, slots, ones, logits);
        if (el < best) best = el;
        if (o->profile && r == reps - 1) profile_print(B == 1 ? "decode1" : "decode32", el);
    }
    double wb = weight_bytes(m, o->precision), bw = wb * steps / best / 1e9;
    int in_llc = wb <= (double)hw->llc_bytes;
    double read_base = in_llc ? hw->cache_copy : hw->dram_read, copy_base = in_llc ? hw->cache_copy : hw->dram_copy;
    double layers, head; /* FLOPs: every matmul weight once per token (attention over <= 48
                            positions left out) */
    rf_bench_matmul_weights(&m->cfg, &layers, &head);
    double gf = 2.0 * (layers + head) * B * steps / best / 1e9, peak = peak_for(hw, o->precision);
    printf("{\"bench\":\"decode\",\"config\":\"%s\",\"precision\":\"%s\",\"weights\":\"%s\",\"batch\":%d,\"steps\":%d,"
           "\"first_step_s\":%.4f,\"seconds\":%.4f,\"tokens_per_s\":%.1f,\"weight_bytes\":%.0f,\"weights_fit_llc\":%s,"
           "\"weight_gb_per_s\":%.2f,\"memcpy_gb_per_s\":%.2f,\"fraction_of_memcpy_bw\":%.3f,"
           "\"read_gb_per_s\":%.2f,\"fraction_of_read_bw\":%.3f,\"gflops\":%.2f,\"peak_gflops\":%.2f,"
           "\"fraction_of_peak\":%.3f,\"fraction_of_sgemm_peak\":%.3f}\n",
           o->config, prec_name(o->precision), weights_name(o), B, steps, first, best, (double)B * steps / best, wb,
           in_llc ? "true" : "false", bw, copy_base, bw / copy_base, read_base, bw / read_base, gf,
           peak, gf / peak, gf / hw->blas_f32);
    rf_kv_cache_free(&kv, m);
    free(tok), free(slots), free(counts), free(ones), free(logits);
}

int main(int argc, char **argv) {
    bench_opts o;
    setvbuf(stdout, NULL, _IOLBF, 0); /* each line as soon as it is measured (runs are long) */
    if (wants_cuda(argc, argv)) exec_cuda_bench(argc, argv);
    parse_opts(&o, argc, argv);
    const rf_kernels *k = o.profile ? bench_timed_kernels(rf_cpu_kernels(), 0) : rf_cpu_kernels();
    if (k->set_precision(o.precision) != RF_OK) {
        fprintf(stderr, "bench_model: --precision %s: %s\n", prec_name(o.precision), rf_error_message());
        return 1;
    }
    rf_model *m = bench_model(&o, k);
    if (o.frozen) m = frozen_model(m, k);
    hw_baseline hw;
    print_machine();
    /* Baseline shape: the MLP up-projection of a training step, (T, F, C). */
    measure_baseline(&hw, o.B * o.L, m->cfg.intermediate_size, m->cfg.hidden_size, o.quick);
    if (wanted(&o, "train")) refresh_peak(&hw, o.precision), bench_train(m, &o, &hw);
    if (wanted(&o, "adamw")) bench_adamw(m, &o, &hw);
    if (wanted(&o, "attention")) refresh_peak(&hw, o.precision), bench_attention(m, k, &o, &hw);
    if (wanted(&o, "prefill")) refresh_peak(&hw, o.precision), bench_prefill(m, &o, &hw);
    if (wanted(&o, "decode1")) bench_decode(m, 1, &o, &hw);
    if (wanted(&o, "decode32")) refresh_peak(&hw, o.precision), bench_decode(m, 32, &o, &hw);
    printf("{\"bench\":\"model_memory\",\"config\":\"%s\",\"precision\":\"%s\",\"weights\":\"%s\","
           "\"parameters\":%zu,\"weight_bytes_held\":%.0f,\"rss_mb\":%.1f}\n", o.config, prec_name(o.precision),
           weights_name(&o), m->n_params,
           (double)m->n_params * (o.frozen ? 2 : 4) + (double)rf_cpu_gemm_copies_bytes(), rss_mb());
    rf_model_free(m);
    return 0;
}
