/* Paged KV cache writes on the GPU: the CUDA twin of kernels/cpu/cpu_paged.c's paged_kv_write,
 * same layouts and arguments. Attention over the paged cache (paged_attention_forward) is
 * training's attention reading keys through the block table, so that generation and training
 * give a row the same bits (docs/cuda.md, "Paged attention"): cuda_attention.cu chooses between
 * the tiled forward of cuda_flash.cu (and cuda_flash_mma.cu) and the reference forward, as for
 * attention_forward. */
#include "kernels/cuda/cuda_common.cuh"

static __global__ void paged_kv_write_kernel(float *k_pool, float *v_pool, const float *k,
                                             const float *v, const int32_t *slots, int T,
                                             int row) {
    size_t n = (size_t)T * row;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / row, c = i % row, dst = (size_t)slots[t] * row + c;
        k_pool[dst] = k[i];
        v_pool[dst] = v[i];
    }
}

void rf_cuda_paged_kv_write(float *k_pool, float *v_pool, const float *k, const float *v,
                            const int32_t *slots, int T, int KVH, int D) {
    RF_CUDA_GUARD();
    if (T <= 0) return;
    paged_kv_write_kernel<<<rf__cuda_blocks((size_t)T * KVH * D), RF_CUDA_THREADS, 0,
                            rf__cuda.stream>>>(k_pool, v_pool, k, v, slots, T, KVH * D);
    RF_CUDA_LAUNCH_CHECK();
}
