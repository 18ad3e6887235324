/* Matrix products on the GPU through cuBLAS sgemm (row-major, HF Linear weight layout): the
 * CUDA twin of kernels/cpu/cpu_matmul.c.
 *
 * Row-major <-> column-major. cuBLAS is column-major. A row-major (R, K) matrix with leading
 * dimension K is, read column-major, its transpose (K, R) with the same leading dimension. So
 * to get a row-major product out = A @ B we ask cuBLAS for out^T = B^T @ A^T, passing the row-
 * major buffers as they are: swap the operands, keep every leading dimension equal to the
 * row-major row length, and swap m and n. The three products the back end needs:
 *
 *  1. out (T, OC) = x (T, C) @ w (OC, C)^T          [forward; logits]
 *     col-major: out^T (OC, T) = w (OC, C) @ x^T (C, T)
 *     w's buffer reads as w^T (C, OC), ld C -> op T;  x's reads as x^T (C, T), ld C -> op N
 *     sgemm(T, N, m=OC, n=T, k=C, A=w, lda=C, B=x, ldb=C, C=out, ldc=OC)
 *
 *  2. out (T, C) = x (T, OC) @ w (OC, C)              [dinp; dh]
 *     col-major: out^T (C, T) = w^T (C, OC) @ x^T (OC, T)
 *     w's buffer reads as w^T (C, OC), ld C -> op N;  x's reads as x^T (OC, T), ld OC -> op N
 *     sgemm(N, N, m=C, n=T, k=OC, A=w, lda=C, B=x, ldb=OC, C=out, ldc=C)
 *
 *  3. out (OC, C) = x (T, OC)^T @ y (T, C)            [dw]
 *     col-major: out^T (C, OC) = y^T (C, T) @ x (T, OC)
 *     y's buffer reads as y^T (C, T), ld C -> op N;   x's reads as x^T (OC, T), ld OC -> op T
 *     sgemm(N, T, m=C, n=OC, k=T, A=y, lda=C, B=x, ldb=OC, C=out, ldc=C)
 *
 * beta = 1 accumulates into out (dw +=, bias pre-filled), beta = 0 overwrites (dinp). */
#include "kernels/cuda/cuda_common.cuh"

int rf__cuda_gemm_xwt(float *out, const float *x, const float *w, int T, int C, int OC,
                      float alpha, float beta) {
    return RF_CUBLAS_CHECK(cublasSgemm(rf__cuda.blas, CUBLAS_OP_T, CUBLAS_OP_N, OC, T, C, &alpha,
                                       w, C, x, C, &beta, out, OC));
}

int rf__cuda_gemm_xw(float *out, const float *x, const float *w, int T, int C, int OC,
                     float alpha, float beta) {
    return RF_CUBLAS_CHECK(cublasSgemm(rf__cuda.blas, CUBLAS_OP_N, CUBLAS_OP_N, C, T, OC, &alpha,
                                       w, C, x, OC, &beta, out, C));
}

int rf__cuda_gemm_xtw(float *out, const float *x, const float *y, int T, int C, int OC,
                      float alpha, float beta) {
    return RF_CUBLAS_CHECK(cublasSgemm(rf__cuda.blas, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, T, &alpha,
                                       y, C, x, OC, &beta, out, C));
}

/* out (T, OC): every row = bias (then sgemm adds the product with beta = 1, as on the CPU). */
static __global__ void fill_bias_kernel(float *out, const float *bias, int T, int OC) {
    size_t n = (size_t)T * OC;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = bias[i % OC];
}

void rf_cuda_matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                            int T, int C, int OC) {
    RF_CUDA_GUARD();
    if (T == 0) return;
    if (bias) {
        fill_bias_kernel<<<rf__cuda_blocks((size_t)T * OC), RF_CUDA_THREADS, 0,
                           rf__cuda.stream>>>(out, bias, T, OC);
        if (!RF_CUDA_LAUNCH_CHECK()) return;
    }
    rf__cuda_gemm_xwt(out, inp, w, T, C, OC, 1.0f, bias ? 1.0f : 0.0f);
}

/* dbias (OC) += column sums of dout (T, OC): one thread per column, rows in order (the CPU
 * loop; deterministic; neighbouring threads read neighbouring columns). */
static __global__ void bias_backward_kernel(float *dbias, const float *dout, int T, int OC) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) return;
    float s = 0.0f;
    for (int t = 0; t < T; t++) s += dout[(size_t)t * OC + o];
    dbias[o] += s;
}

void rf_cuda_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                             const float *inp, const float *w, int T, int C, int OC) {
    RF_CUDA_GUARD();
    if (T == 0) return;
    if (dinp && !rf__cuda_gemm_xw(dinp, dout, w, T, C, OC, 1.0f, 0.0f)) return;
    if (dw && !rf__cuda_gemm_xtw(dw, dout, inp, T, C, OC, 1.0f, 1.0f)) return;
    if (dbias) {
        bias_backward_kernel<<<(OC + RF_CUDA_THREADS - 1) / RF_CUDA_THREADS, RF_CUDA_THREADS, 0,
                               rf__cuda.stream>>>(dbias, dout, T, OC);
        RF_CUDA_LAUNCH_CHECK();
    }
}
