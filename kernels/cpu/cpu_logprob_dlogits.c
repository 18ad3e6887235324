/* The log-prob kernel's logit gradients (cpu_logprob.c's backward): a pass over each row of
 * logits, its own file because it is compiled once per x86-64 level where the build is for any
 * (cpu_level.h): in the baseline's SSE2 it ran the LM head's backward 1.7x slower. */
#include <string.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_level.h"
#include "kernels/kernel_math.h"

/* Elements of a row made at a time in rf_cpu_logprob_dlogits before they are stored. */
#define DLOGIT_BLOCK 1024

/* Each value is a chain of its own (no sums across the row), so the vector width decides speed,
 * not bits: 512-bit vectors where the build has AVX-512 (GCC's tuning for Intel's prefers 256). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("prefer-vector-width=512")
#define RF_DLOGIT_WIDE 1
#endif
void RF_LEVELED(rf_cpu_logprob_dlogits)(float *z, uint16_t *zb, int n, int V, const float *lse,
                                        const float *ent, const int32_t *targets, int v0,
                                        const float *dlogp, const float *dentropy, float inv_temp) {
#pragma omp parallel for if (n * (size_t)V > 65536)
    for (int r = 0; r < n; r++) {
        float *zr = z + (size_t)r * V;
        float dl = dlogp ? dlogp[r] : 0.0f, de = dentropy ? dentropy[r] : 0.0f;
        float l = lse[r], H = ent[r];
        int tgt = targets[r] - v0;
        /* a block at a time in the caches: written back in fp32, or only as bf16 */
        float g[DLOGIT_BLOCK] __attribute__((aligned(64)));
        for (int j0 = 0; j0 < V; j0 += DLOGIT_BLOCK) {
            int m = V - j0 < DLOGIT_BLOCK ? V - j0 : DLOGIT_BLOCK, t = tgt - j0;
            const float *zj = zr + j0;
#pragma omp simd
            for (int j = 0; j < m; j++) {
                float lp = zj[j] - l;
                g[j] = inv_temp * rf_logprob_dlogit(rf_expf_fast(lp), lp, H, j == t, dl, de);
            }
            if (zb) rf_cpu_bf16_convert(zb + (size_t)r * V + j0, g, m);
            else memcpy(zr + j0, g, sizeof(float) * (size_t)m);
        }
    }
}

#ifdef RF_DLOGIT_WIDE
#pragma GCC pop_options
#endif
