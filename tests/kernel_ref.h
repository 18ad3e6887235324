/* Double-precision reference implementations of every op in kernels/kernels.h, for tests.
 *
 * Written from the header's specification alone, with the plainest loops that say what each
 * op computes, and never from kernels/cpu/: a test that compared a back end with a copy of
 * itself would prove nothing. Everything is double so that the references (and the central
 * finite differences built on them) are ~1e-16 accurate, far below the fp32 errors the tests
 * tolerate. Same argument order as the rf_kernels slots, with double tensors. */
#ifndef RF_KERNEL_REF_H
#define RF_KERNEL_REF_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* out (T, OC) = inp (T, C) @ w (OC, C)^T + bias (OC; NULL = none) */
static void ref_matmul(double *out, const double *inp, const double *w, const double *bias,
                       int T, int C, int OC) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int c = 0; c < C; c++) s += inp[(size_t)t * C + c] * w[(size_t)o * C + c];
            out[(size_t)t * OC + o] = s;
        }
}

/* out (T, C) = wte[tokens[t]] */
static void ref_embedding(double *out, const int32_t *tokens, const double *wte, int T, int C) {
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) out[(size_t)t * C + c] = wte[(size_t)tokens[t] * C + c];
}

/* out = inp * rstd * w, rstd = 1/sqrt(mean(inp^2) + eps), per row of (N, C). */
static void ref_rmsnorm(double *out, double *rstd, const double *inp, const double *w, int N,
                        int C, double eps) {
    for (int n = 0; n < N; n++) {
        const double *x = inp + (size_t)n * C;
        double ms = 0.0;
        for (int c = 0; c < C; c++) ms += x[c] * x[c];
        double r = 1.0 / sqrt(ms / C + eps);
        if (rstd) rstd[n] = r;
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = x[c] * r * w[c];
    }
}

/* Hugging Face apply_rotary_pos_emb, written as transformers writes it:
 *   freqs = position (fp32) * inv_freq (fp32)  -- computed in float32 by transformers
 *   emb = cat(freqs, freqs); x' = x * cos(emb) + rotate_half(x) * sin(emb),
 *   rotate_half(x) = cat(-x[D/2:], x[:D/2]).
 * sign = -1 rotates the other way (sin -> -sin). x (T, H, D) in place; pos (T). */
static void ref_rope(double *x, const int32_t *pos, const float *inv_freq, int T, int H, int D,
                     int sign) {
    int half = D / 2;
    double *row = malloc(sizeof(double) * (size_t)D);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            double *xr = x + ((size_t)t * H + h) * D;
            for (int d = 0; d < D; d++) row[d] = xr[d];
            for (int d = 0; d < D; d++) {
                float freq = (float)pos[t] * inv_freq[d % half]; /* fp32 like transformers */
                double rot = d < half ? -row[d + half] : row[d - half];
                xr[d] = row[d] * cos((double)freq) + rot * sign * sin((double)freq);
            }
        }
    free(row);
}

/* Causal GQA attention over packed sequences with bottom-right-aligned causality:
 * local query i of sequence s sees keys 0 .. i + (k_len[s] - q_len). out (Tq, H, D);
 * lse (Tq, H) (NULL = skip); q (Tq, H, D); k, v (rows, KVH, D). */
static void ref_attention(double *out, double *lse, const double *q, const double *k,
                          const double *v, const int32_t *q_off, const int32_t *k_start,
                          const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    double scale = 1.0 / sqrt((double)D);
    for (int s = 0; s < n_seq; s++) {
        int q_len = q_off[s + 1] - q_off[s], kl = k_len[s];
        double *sc = malloc(sizeof(double) * (size_t)(kl > 0 ? kl : 1));
        for (int i = 0; i < q_len; i++)
            for (int h = 0; h < H; h++) {
                int kvh = h / (H / KVH), last = i + (kl - q_len);
                const double *qr = q + ((size_t)(q_off[s] + i) * H + h) * D;
                double mx = -INFINITY;
                for (int j = 0; j <= last; j++) {
                    const double *kr = k + ((size_t)(k_start[s] + j) * KVH + kvh) * D;
                    double dot = 0.0;
                    for (int d = 0; d < D; d++) dot += qr[d] * kr[d];
                    sc[j] = dot * scale;
                    if (sc[j] > mx) mx = sc[j];
                }
                double sum = 0.0;
                for (int j = 0; j <= last; j++) sum += exp(sc[j] - mx);
                double *o = out + ((size_t)(q_off[s] + i) * H + h) * D;
                for (int d = 0; d < D; d++) o[d] = 0.0;
                for (int j = 0; j <= last; j++) {
                    const double *vr = v + ((size_t)(k_start[s] + j) * KVH + kvh) * D;
                    double p = exp(sc[j] - mx) / sum;
                    for (int d = 0; d < D; d++) o[d] += p * vr[d];
                }
                if (lse) lse[(size_t)(q_off[s] + i) * H + h] = mx + log(sum);
            }
        free(sc);
    }
}

/* out = silu(gate) * up = gate * sigmoid(gate) * up */
static void ref_swiglu(double *out, const double *gate, const double *up, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = gate[i] / (1.0 + exp(-gate[i])) * up[i];
}

/* z = (h (T, C) @ w (V, C)^T) * inv_temp; logp[t] = log softmax(z_t)[targets[t]];
 * entropy[t] = -sum_k p_k log p_k (NULL = skip). */
static void ref_logprob(double *logp, double *entropy, const double *h, const double *w,
                        const int32_t *targets, int T, int C, int V, double inv_temp) {
    double *z = malloc(sizeof(double) * (size_t)V);
    for (int t = 0; t < T; t++) {
        double mx = -INFINITY;
        for (int k = 0; k < V; k++) {
            double dot = 0.0;
            for (int c = 0; c < C; c++) dot += h[(size_t)t * C + c] * w[(size_t)k * C + c];
            z[k] = dot * inv_temp;
            if (z[k] > mx) mx = z[k];
        }
        double sum = 0.0;
        for (int k = 0; k < V; k++) sum += exp(z[k] - mx);
        double lse = mx + log(sum);
        logp[t] = z[targets[t]] - lse;
        if (entropy) {
            double ent = 0.0;
            for (int k = 0; k < V; k++) {
                double lp = z[k] - lse;
                ent -= exp(lp) * lp;
            }
            entropy[t] = ent;
        }
    }
    free(z);
}

/* One step of PyTorch's torch.optim.AdamW (decoupled weight decay; Loshchilov & Hutter 2019):
 *   p <- p * (1 - lr * wd)
 *   m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
 *   p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
 * `step` t is 1-based, counted after this update. */
static void ref_adamw(double *p, const double *g, double *m, double *v, size_t n, double lr,
                      double b1, double b2, double eps, double wd, int step) {
    double bc1 = 1.0 - pow(b1, step), bc2 = 1.0 - pow(b2, step);
    for (size_t i = 0; i < n; i++) {
        p[i] *= 1.0 - lr * wd;
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        p[i] -= lr * (m[i] / bc1) / (sqrt(v[i] / bc2) + eps);
    }
}

#endif
