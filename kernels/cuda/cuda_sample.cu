/* Token sampling on the device (rf_kernels.sample_rows): the step's draws read the logits where
 * the LM head wrote them, and only a token and a log-prob per draw cross to the host, instead of
 * every row of (n, V) logits (at batch 256 and Qwen2.5's 151936 ids, 155 MB a decoding step).
 *
 * One block per draw, the steps of kernels/sample.h's rf_draw_whole: the row's largest logit m,
 * the weights e = expf((z - m) * inv_temp) in double;
 * greedy: the largest logit, lowest id among equal ones; else the first id whose cumulative
 * weight in id order passes u times the total: each thread sums the weights of a contiguous
 * slice of ids in order (double), a block scan of those sums (whose total is the target's
 * base) finds the first slice of positive weight where the cumulative passes the target, and
 * its thread walks it id by id. Always an id of positive weight: where rounding leaves the walk
 * short of the target, the slice's (or the row's) last id of positive weight. The CPU sums the
 * whole row in one chain, so the cumulative differs in the last bits and a pick can differ
 * only where u falls within that rounding of a boundary. The pick's log-prob is then computed
 * as the log-prob kernel computes it (pick_logprob_kernel), as rf_draw_whole does on the CPU. */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

#define RF_SAMPLE_THREADS 256

/* Exclusive prefix sum over the block (RF_SAMPLE_THREADS threads) of x; *total gets the sum.
 * Ends with a barrier. */
static __device__ double block_exclusive_scan(double x, double *total) {
    __shared__ double warp_sums[RF_SAMPLE_THREADS / 32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = RF_SAMPLE_THREADS / 32;
    double incl = x;
    for (int o = 1; o < 32; o <<= 1) {
        double y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    double before = 0, all = 0;
    for (int w = 0; w < nwarps; w++) {
        if (w < warp) before += warp_sums[w];
        all += warp_sums[w];
    }
    __syncthreads();
    *total = all;
    return before + incl - x;
}

/* The smallest v over the block (every thread gets it). Ends with a barrier. */
static __device__ int block_min_int(int v) {
    __shared__ int s[RF_SAMPLE_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
    __syncthreads();
    int m = INT_MAX;
    for (int w = 0; w < RF_SAMPLE_THREADS / 32; w++) m = min(m, s[w]);
    __syncthreads();
    return m;
}

static __device__ inline double draw_weight(const float *z, int j, float m, float inv_temp) {
    return (double)expf((z[j] - m) * inv_temp);
}

/* The largest v over the block (every thread gets it). Ends with a barrier. */
static __device__ int block_max_int(int v) {
    return -block_min_int(-v);
}

static __global__ void sample_rows_kernel(int32_t *picks, const float *logits, int V,
                                          const rf_row_draw *draws) {
    __shared__ float sf[32];
    __shared__ int s_pick;
    rf_row_draw d = draws[blockIdx.x];
    const float *z = logits + (size_t)d.row * V;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, z[j]);
    m = rf__block_max(m, sf);
    if (d.greedy) { /* every path below sets s_pick, once */
        /* the largest logit, lowest id first: per thread, then the block's best value and the
         * lowest id holding it */
        float best = -INFINITY;
        int at = INT_MAX;
        for (int j = threadIdx.x; j < V; j += blockDim.x)
            if (z[j] > best || (z[j] == best && j < at)) best = z[j], at = j;
        float top = rf__block_max(best, sf);
        int first = block_min_int(best == top ? at : INT_MAX);
        if (threadIdx.x == 0) s_pick = first == INT_MAX ? 0 : first;
    } else {
        int per = (V + RF_SAMPLE_THREADS - 1) / RF_SAMPLE_THREADS;
        int j0 = min(V, (int)threadIdx.x * per), j1 = min(V, j0 + per), last = -1;
        double part = 0, total;
        for (int j = j0; j < j1; j++) {
            double e = draw_weight(z, j, m, d.inv_temp);
            if (e > 0) last = j;
            part += e;
        }
        double before = block_exclusive_scan(part, &total), target = d.u * total;
        int owner = block_min_int(part > 0 && target < before + part ? (int)threadIdx.x : INT_MAX);
        int row_last = block_max_int(last);
        if ((int)threadIdx.x == owner) {
            double cum = before;
            int pick = last; /* the walk short of the target by rounding: the slice's last */
            for (int j = j0; j < j1; j++) {
                double e = draw_weight(z, j, m, d.inv_temp);
                cum += e;
                if (e > 0 && target < cum) {
                    pick = j;
                    break;
                }
            }
            s_pick = pick;
        } else if (owner == INT_MAX && threadIdx.x == 0) {
            s_pick = row_last >= 0 ? row_last : 0; /* u * total rounded up to total */
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) picks[blockIdx.x] = s_pick;
}

/* The log-sum-exp of row z at inv_temp as the log-prob kernels compute it (rf__row_softmax_sums;
 * in float), for the whole block: what a pick's log-prob subtracts, whoever draws the pick. */
static __device__ inline float row_lse_block(const float *z, int V, float inv_temp) {
    float m;
    double sum, wsum;
    rf__row_softmax_sums(z, V, inv_temp, &m, &sum, &wsum);
    return m + (float)log(sum);
}

/* One block of RF_LOGPROB_THREADS per draw: the pick's log-prob as the log-prob kernel computes
 * it, so that generation's behaviour log-probs equal the trainer's wherever the logits do. */
static __global__ void pick_logprob_kernel(float *logp, const float *logits, int V, const rf_row_draw *draws,
                                           const int32_t *picks) {
    rf_row_draw d = draws[blockIdx.x];
    const float *z = logits + (size_t)d.row * V;
    float lse = row_lse_block(z, V, d.inv_temp);
    if (threadIdx.x == 0) logp[blockIdx.x] = __fmul_rn(z[picks[blockIdx.x]], d.inv_temp) - lse;
}

/* One block of RF_LOGPROB_THREADS per draw: the row's log-sum-exp alone (rf_cuda_row_lse). */
static __global__ void row_lse_kernel(float *lse, const float *logits, int V, const rf_row_draw *draws) {
    rf_row_draw d = draws[blockIdx.x];
    float v = row_lse_block(logits + (size_t)d.row * V, V, d.inv_temp);
    if (threadIdx.x == 0) lse[blockIdx.x] = v;
}

/* Device room for the n draws, copied up on the stream, and out_bytes of results after them;
 * NULL after recording a failure. */
static char *draws_to_device(const rf_row_draw *draws, int n, size_t out_bytes) {
    cudaStream_t st = rf__cuda.stream;
    size_t db = sizeof(rf_row_draw) * (size_t)n;
    char *buf = NULL;
    if (!RF_CUDA_CHECK(cudaMallocAsync((void **)&buf, db + out_bytes, st))) return NULL;
    if (!RF_CUDA_CHECK(cudaMemcpyAsync(buf, draws, db, cudaMemcpyHostToDevice, st))) {
        RF_CUDA_CHECK(cudaFreeAsync(buf, st));
        return NULL;
    }
    return buf;
}

/* Gives draws_to_device's room back and waits for the stream: 1 when ok and all of it ran. */
static int draws_done(char *buf, int ok) {
    if (buf) RF_CUDA_CHECK(cudaFreeAsync(buf, rf__cuda.stream));
    return ok && RF_CUDA_CHECK(cudaStreamSynchronize(rf__cuda.stream));
}

void rf_cuda_row_lse(float *lse, const float *logits, int V, const rf_row_draw *draws, int n) {
    if (n <= 0) return;
    char *buf = rf__cuda.failed ? NULL : draws_to_device(draws, n, sizeof(float) * (size_t)n);
    int ok = buf != NULL;
    float *d_lse = ok ? (float *)(buf + sizeof(rf_row_draw) * (size_t)n) : NULL;
    if (ok) {
        row_lse_kernel<<<(unsigned)n, RF_LOGPROB_THREADS, 0, rf__cuda.stream>>>(d_lse, logits, V,
                                                                               (const rf_row_draw *)buf);
        ok = RF_CUDA_LAUNCH_CHECK();
    }
    ok = ok && RF_CUDA_CHECK(cudaMemcpyAsync(lse, d_lse, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost,
                                             rf__cuda.stream));
    if (!draws_done(buf, ok)) memset(lse, 0xff, sizeof(float) * (size_t)n); /* the policy's poison: NaN */
}

void rf_cuda_sample_rows(int32_t *picks, float *logp, const float *logits, int V, const rf_row_draw *draws,
                         int n) {
    if (n <= 0) return;
    cudaStream_t st = rf__cuda.stream;
    char *buf = rf__cuda.failed ? NULL : draws_to_device(draws, n, (sizeof(int32_t) + sizeof(float)) * (size_t)n);
    int ok = buf != NULL;
    const rf_row_draw *d_draws = (const rf_row_draw *)buf;
    int32_t *d_picks = ok ? (int32_t *)(buf + sizeof(rf_row_draw) * (size_t)n) : NULL;
    float *d_logp = ok ? (float *)(d_picks + n) : NULL;
    if (ok) {
        sample_rows_kernel<<<(unsigned)n, RF_SAMPLE_THREADS, 0, st>>>(d_picks, logits, V, d_draws);
        ok = RF_CUDA_LAUNCH_CHECK();
    }
    if (ok) {
        pick_logprob_kernel<<<(unsigned)n, RF_LOGPROB_THREADS, 0, st>>>(d_logp, logits, V, d_draws, d_picks);
        ok = RF_CUDA_LAUNCH_CHECK();
    }
    ok = ok && RF_CUDA_CHECK(cudaMemcpyAsync(picks, d_picks, sizeof(int32_t) * (size_t)n, cudaMemcpyDeviceToHost, st));
    ok = ok && RF_CUDA_CHECK(cudaMemcpyAsync(logp, d_logp, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost, st));
    if (!draws_done(buf, ok)) /* the policy's poison: -1 picks, NaN log-probs */
        memset(picks, 0xff, sizeof(int32_t) * (size_t)n), memset(logp, 0xff, sizeof(float) * (size_t)n);
}
