/* The WMMA API (nvcuda::wmma, 16 x 16 x 16, bf16 operands, fp32 accumulator) as the tiled
 * attention uses it, on the CPU (cuda_runtime.h says why). Each lane holds the whole operand
 * tiles, and of an accumulator the elements e with e % 32 == its lane: it computes those and
 * stores only those, so a lane that reads what another lane stored before a barrier of the warp
 * reads stale memory, as on a GPU. The products are exact in fp32 and added in order over k. */
#ifndef RF_CUDA_EMU_MMA_H
#define RF_CUDA_EMU_MMA_H

#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    T x[256];
    enum { num_elements = 256 };
};

static inline int rf_emu_owns(int e) { return e % 32 == (int)(threadIdx.x % 32); }

template <typename Use, typename Layout>
static inline void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout> &f,
                                    const __nv_bfloat16 *p, unsigned ldm) {
    /* (r, c) of the tile: matrix_a is M x K, matrix_b K x N; row_major puts r along rows */
    const bool rows = std::is_same<Layout, row_major>::value;
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.x[r * 16 + c] = rows ? p[r * ldm + c] : p[c * ldm + r];
}
static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p,
                                    unsigned ldm, layout_t l) {
    for (int e = 0; e < 256; e++) {
        int r = e / 16, c = e % 16;
        f.x[e] = l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
    }
}
template <typename Use, typename T, typename Layout>
static inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout> &f, T v) {
    for (int e = 0; e < 256; e++) f.x[e] = v;
}
static inline void fill_fragment(fragment<accumulator, 16, 16, 16, float> &f, float v) {
    for (int e = 0; e < 256; e++) f.x[e] = v;
}
template <typename LA, typename LB>
static inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                            const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> &a,
                            const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> &b,
                            const fragment<accumulator, 16, 16, 16, float> &c) {
    for (int e = 0; e < 256; e++) {
        if (!rf_emu_owns(e)) continue;
        int i = e / 16, j = e % 16;
        float s = c.x[e];
        for (int k = 0; k < 16; k++)
            s += __bfloat162float(a.x[i * 16 + k]) * __bfloat162float(b.x[k * 16 + j]);
        d.x[e] = s;
    }
}
static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f,
                                     unsigned ldm, layout_t l) {
    for (int e = 0; e < 256; e++) {
        if (!rf_emu_owns(e)) continue;
        int r = e / 16, c = e % 16;
        (l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[e];
    }
}
} // namespace wmma
} // namespace nvcuda

#endif
