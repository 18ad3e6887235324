/* Which copy of the kernels compiled per x86-64 level runs (cpu_level.h), and, in a build with
 * levels, each entry point as the call to that copy. */
#include "kernels/cpu/cpu_level.h"

#include <stdint.h>

#include "kernels/cpu/cpu_internal.h"

static int g_level = -1; /* -1 not known yet */

static int detect(void) {
#if defined(RF_CPU_LEVELS)
    __builtin_cpu_init(); /* the features also need the OS to keep the registers (XGETBV) */
    int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512cd");
    return v4 ? RF_CPU_LEVEL_V4 : v3 ? RF_CPU_LEVEL_V3 : RF_CPU_LEVEL_BASE;
#else
    return RF_CPU_LEVEL_BUILD;
#endif
}

static int highest(void) {
    static int h = -1;
    int v = __atomic_load_n(&h, __ATOMIC_RELAXED);
    if (v < 0) __atomic_store_n(&h, v = detect(), __ATOMIC_RELAXED);
    return v;
}

int rf_cpu_level(void) {
    int v = __atomic_load_n(&g_level, __ATOMIC_RELAXED);
    if (v < 0) __atomic_store_n(&g_level, v = highest(), __ATOMIC_RELAXED);
    return v;
}

int rf_cpu_level_available(int level) {
    int h = highest();
    if (h == RF_CPU_LEVEL_BUILD) return level == RF_CPU_LEVEL_BUILD;
    return (level == RF_CPU_LEVEL_BASE || level == RF_CPU_LEVEL_V3 || level == RF_CPU_LEVEL_V4) &&
           level <= h;
}

int rf_cpu_level_use(int level) {
    int old = rf_cpu_level();
    if (rf_cpu_level_available(level)) __atomic_store_n(&g_level, level, __ATOMIC_RELAXED);
    return old;
}

const char *rf_cpu_level_name(void) {
    switch (rf_cpu_level()) {
    case RF_CPU_LEVEL_V4: return "x86-64-v4";
    case RF_CPU_LEVEL_V3: return "x86-64-v3";
    case RF_CPU_LEVEL_BASE: return "x86-64";
    default:
#if defined(__x86_64__)
        return "native"; /* x86-64 without levels: built with -march=native (CMakeLists.txt) */
#else
        return "generic";
#endif
    }
}

#ifdef RF_CPU_LEVELS
/* The copies (cpu_attention.c, cpu_logprob_dlogits.c, ../sample.c) and the calls to them. */
#define RF_COPIES(ret, name, params) \
    ret name##_base params;          \
    ret name##_v3 params;            \
    ret name##_v4 params;
/* The copy of the level that runs. */
#define RF_PICK(name)                                             \
    (rf_cpu_level() == RF_CPU_LEVEL_V4   ? name##_v4              \
     : rf_cpu_level() == RF_CPU_LEVEL_V3 ? name##_v3              \
                                         : name##_base)

RF_COPIES(float, rf_cpu_row_softmax, (float *s, int vis, float m))
float rf_cpu_row_softmax(float *s, int vis, float m) { return RF_PICK(rf_cpu_row_softmax)(s, vis, m); }

RF_COPIES(void, rf_cpu_transpose32,
          (float *dst, int ldd, const float *const *rows, int n, int npad, int cols))
void rf_cpu_transpose32(float *dst, int ldd, const float *const *rows, int n, int npad, int cols) {
    RF_PICK(rf_cpu_transpose32)(dst, ldd, rows, n, npad, cols);
}

RF_COPIES(void, rf_cpu_attend_tasks,
          (float *out, float *lse, const float *q, const int32_t *q_off, const int32_t *k_len,
           const int32_t *tasks, int n_tasks, int max_k, int H, int KVH, int D,
           rf_cpu_kv_rows rows, const void *ctx))
void rf_cpu_attend_tasks(float *out, float *lse, const float *q, const int32_t *q_off,
                         const int32_t *k_len, const int32_t *tasks, int n_tasks, int max_k,
                         int H, int KVH, int D, rf_cpu_kv_rows rows, const void *ctx) {
    RF_PICK(rf_cpu_attend_tasks)(out, lse, q, q_off, k_len, tasks, n_tasks, max_k, H, KVH, D, rows, ctx);
}

RF_COPIES(void, rf_cpu_attention_backward,
          (float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
           const float *v, const float *out, const float *lse, const int32_t *cu_seqlens,
           int n_seq, int T, int H, int KVH, int D))
void rf_cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const int32_t *cu_seqlens, int n_seq, int T,
                               int H, int KVH, int D) {
    RF_PICK(rf_cpu_attention_backward)(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n_seq, T, H, KVH, D);
}

RF_COPIES(void, rf_cpu_logprob_dlogits,
          (float *z, uint16_t *zb, int n, int V, const float *lse, const float *ent,
           const int32_t *targets, int v0, const float *dlogp, const float *dentropy,
           float inv_temp))
void rf_cpu_logprob_dlogits(float *z, uint16_t *zb, int n, int V, const float *lse,
                            const float *ent, const int32_t *targets, int v0, const float *dlogp,
                            const float *dentropy, float inv_temp) {
    RF_PICK(rf_cpu_logprob_dlogits)(z, zb, n, V, lse, ent, targets, v0, dlogp, dentropy, inv_temp);
}

RF_COPIES(void, rf_row_softmax_stats,
          (const float *z, int V, float inv_temp, float *m_out, double *sum_out, double *wsum_out))
void rf_row_softmax_stats(const float *z, int V, float inv_temp, float *m_out, double *sum_out,
                          double *wsum_out) {
    RF_PICK(rf_row_softmax_stats)(z, V, inv_temp, m_out, sum_out, wsum_out);
}
#endif
