/* The CUDA back end against the specification and against the CPU back end:
 *  1. the whole suite of tests/test_kernels.c (double-precision references, finite
 *     differences, accumulate/overwrite contract, edge cases) run on the CUDA table;
 *  2. every op run on both back ends on identical random inputs, at the sizes the model uses
 *     (head_dim 64 and 128, hidden 896, vocabulary 1000, hundreds of rows) where CUDA kernels
 *     take their tiled paths, moved with to_device/to_host and compared.
 * Exits 77 (ctest "skipped") when rf_cuda_kernels returns NULL: built without CUDA, or no GPU.
 *
 * Tolerances for part 2: both back ends are held to the spec tolerances of test_kernels.c
 * against the exact result, so they may differ from each other by twice that (triangle
 * inequality): 2 tol_red(K) for forwards reducing over K terms, 2 TOL_ROPE / 2 TOL_ELEM for
 * elementwise math (device expf/cosf are within 2 ulp, no fast math), 2 TOL_GRAD for
 * gradients. Copies and single IEEE operations (embedding forward and backward, add_inplace, scale) are
 * compared bit for bit. Parts 1 and 2 run with RLFLOW_CUDA_TF32=0 (plain fp32 products).
 *  3. precision: TF32 products (the fp32 default) within TF32's rounding of the CPU result;
 *     bf16 products against the CPU on inputs rounded to bf16 beforehand (the products of bf16
 *     numbers are exact in fp32, so only the summation order differs: 2 tol_red(K)); the bf16
 *     weight copies remade after to_device, adamw and copy wrote the weight;
 *  4. attention: the tiled kernels (cuda_flash.cu, the default for D <= 128) and the reference
 *     kernels (RLFLOW_CUDA_ATTENTION=reference) against each other, and the tiled kernels
 *     against their CPU mirror kernels/cpu/cpu_flash_ref.c in fp32, in bf16 on the FMA kernels
 *     (RLFLOW_CUDA_ATTENTION=fma), at precision bf16 under =fp32 (fp32 arithmetic: the fp32
 *     mirror) and in bf16 attention (the default at precision bf16), the tensor-core kernels
 *     (cuda_flash_mma.cu) against the mirror's RF_FLASH_BF16_MMA mode (same roundings:
 *     fp32 rounding only, 2 tol_red(D + L) forward, 2 TOL_GRAD backward; for the tensor-core
 *     kernels every element within 2e-2 / 5e-2 and 95% within the fp32 tolerances, since a
 *     bf16 rounding of p or ds may land on the neighbouring value); the unsplit paged
 *     kernel against the CPU;
 *  5. paged attention (generation's) against attention_forward (training's) bit for bit, row by
 *     row, in every mode with a paged twin (cross_paged_tiled). */
#define RF_TEST_KERNELS_NO_MAIN
/* One suite, written once against `const rf_kernels *`, shared with the CPU test. */
#include "test_kernels.c"

#include "kernels/flash_ref.h"

static const rf_kernels *g_cpu, *g_gpu;

static void cross_elementwise(void) {
    size_t n = 100003;
    float *a = fnormal(n, 1.0f), *b = fnormal(n, 1.0f), *x1 = fcopy(a, n), *x2 = fcopy(a, n);
    run_add_inplace(g_cpu, x1, b, n);
    run_add_inplace(g_gpu, x2, b, n);
    check_exact("add_inplace", x2, x1, n);
    run_scale(g_cpu, x1, 0.123f, n);
    run_scale(g_gpu, x2, 0.123f, n);
    check_exact("scale", x2, x1, n);
    CHECK_CLOSE(run_sum_squares(g_gpu, a, n), run_sum_squares(g_cpu, a, n), 0.0,
                2 * tol_red((int)n));
    free(a), free(b), free(x1), free(x2);
}

static void cross_matmul(int T, int C, int OC) {
    size_t ni = (size_t)T * C, nw = (size_t)OC * C, no = (size_t)T * OC;
    float *inp = fnormal(ni, 1.0f), *w = fnormal(nw, 1.0f), *bias = fnormal(OC, 1.0f);
    float *o1 = fnew(no), *o2 = fnew(no), *dout = fnormal(no, 1.0f);
    run_matmul_forward(g_cpu, o1, inp, w, bias, T, C, OC);
    run_matmul_forward(g_gpu, o2, inp, w, bias, T, C, OC);
    check_arr_f("matmul_forward", o2, o1, no, 2 * tol_red(C));
    float *di1 = fconst(ni, 1e3f), *di2 = fconst(ni, 1e3f), *dw1 = fnormal(nw, 1.0f);
    float *dw2 = fcopy(dw1, nw), *db1 = fnormal(OC, 1.0f), *db2 = fcopy(db1, OC);
    run_matmul_backward(g_cpu, di1, dw1, db1, dout, inp, w, T, C, OC);
    run_matmul_backward(g_gpu, di2, dw2, db2, dout, inp, w, T, C, OC);
    check_arr_f("matmul_backward dinp", di2, di1, ni, 2 * TOL_GRAD);
    check_arr_f("matmul_backward dw", dw2, dw1, nw, 2 * TOL_GRAD);
    check_arr_f("matmul_backward dbias", db2, db1, OC, 2 * TOL_GRAD);
    free(inp), free(w), free(bias), free(o1), free(o2), free(dout), free(di1), free(di2);
    free(dw1), free(dw2), free(db1), free(db2);
}

static void cross_embedding(int V, int T, int C) {
    size_t nv = (size_t)V * C, no = (size_t)T * C;
    int32_t *tok = xmalloc(IB(T));
    for (int t = 0; t < T; t++) tok[t] = (int32_t)(rf_rng_u64(&g_rng) % (uint64_t)(V / 8)); /* repeats */
    float *wte = fnormal(nv, 1.0f), *o1 = fnew(no), *o2 = fnew(no), *dout = fnormal(no, 1.0f);
    run_embedding_forward(g_cpu, o1, tok, wte, V, T, C);
    run_embedding_forward(g_gpu, o2, tok, wte, V, T, C);
    check_exact("embedding_forward", o2, o1, no);
    float *d1 = fnormal(nv, 1.0f), *d2 = fcopy(d1, nv);
    run_embedding_backward(g_cpu, d1, dout, tok, V, T, C);
    run_embedding_backward(g_gpu, d2, dout, tok, V, T, C);
    check_exact("embedding_backward (repeats added in token order, as the CPU)", d2, d1, nv);
    free(tok), free(wte), free(o1), free(o2), free(dout), free(d1), free(d2);
}

static void cross_rmsnorm(int N, int C) {
    size_t n = (size_t)N * C;
    float *inp = fnormal(n, 1.5f), *w = fnormal(C, 0.3f), *o1 = fnew(n), *o2 = fnew(n);
    float *r1 = fnew(N), *r2 = fnew(N), *dout = fnormal(n, 1.0f);
    for (int c = 0; c < C; c++) w[c] += 1.0f;
    run_rmsnorm_forward(g_cpu, o1, r1, inp, w, N, C, 1e-6f);
    run_rmsnorm_forward(g_gpu, o2, r2, inp, w, N, C, 1e-6f);
    check_arr_f("rmsnorm_forward out", o2, o1, n, 2 * tol_red(C));
    check_arr_f("rmsnorm_forward rstd", r2, r1, N, 2 * tol_red(C));
    float *di1 = fnormal(n, 1.0f), *di2 = fcopy(di1, n), *dw1 = fnormal(C, 1.0f);
    float *dw2 = fcopy(dw1, C);
    run_rmsnorm_backward(g_cpu, di1, dw1, dout, inp, w, r1, N, C);
    run_rmsnorm_backward(g_gpu, di2, dw2, dout, inp, w, r1, N, C);
    check_arr_f("rmsnorm_backward dinp", di2, di1, n, 2 * TOL_GRAD);
    check_arr_f("rmsnorm_backward dw", dw2, dw1, C, 2 * TOL_GRAD);
    free(inp), free(w), free(o1), free(o2), free(r1), free(r2), free(dout), free(di1);
    free(di2), free(dw1), free(dw2);
}

static void cross_rope(int T, int H, int D) {
    size_t n = (size_t)T * H * D;
    float inv_freq[128];
    rope_inv_freq(inv_freq, D, 1e6);
    int32_t *pos = xmalloc(IB(T));
    for (int t = 0; t < T; t++) pos[t] = (t * 37) % 2048;
    float *x1 = fnormal(n, 1.0f), *x2 = fcopy(x1, n);
    for (int sign = 1; sign >= -1; sign -= 2) {
        run_rope(g_cpu, x1, pos, inv_freq, T, H, D, sign);
        run_rope(g_gpu, x2, pos, inv_freq, T, H, D, sign);
        /* both round pos * inv_freq to fp32, so the angles agree and only cosf/sinf and two
         * products differ */
        check_arr_f(sign > 0 ? "rope +1" : "rope -1", x2, x1, n, 2 * TOL_ROPE);
    }
    free(pos), free(x1), free(x2);
}

static void cross_attention_train(const int *lens, int n_seq, int H, int KVH, int D) {
    int32_t cu[16], kl[16];
    cu[0] = 0;
    int maxlen = 0;
    for (int s = 0; s < n_seq; s++) {
        cu[s + 1] = cu[s] + lens[s], kl[s] = lens[s];
        if (lens[s] > maxlen) maxlen = lens[s];
    }
    int T = cu[n_seq];
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D, nl = (size_t)T * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *o1 = fnew(nq), *o2 = fnew(nq), *l1 = fnew(nl), *l2 = fnew(nl);
    run_attention_forward(g_cpu, o1, l1, q, k, v, cu, cu, kl, n_seq, T, H, KVH, D);
    run_attention_forward(g_gpu, o2, l2, q, k, v, cu, cu, kl, n_seq, T, H, KVH, D);
    check_arr_f("attention_forward out", o2, o1, nq, 2 * tol_red(D + maxlen));
    check_arr_f("attention_forward lse", l2, l1, nl, 2 * tol_red(D + maxlen));
    float *dout = fnormal(nq, 1.0f), *dq1 = fconst(nq, 1e3f), *dq2 = fconst(nq, 1e3f);
    float *dk1 = fconst(nk, 1e3f), *dk2 = fconst(nk, 1e3f), *dv1 = fconst(nk, 1e3f);
    float *dv2 = fconst(nk, 1e3f);
    /* both from the CPU forward's out and lse, so that only the backward differs */
    run_attention_backward(g_cpu, dq1, dk1, dv1, dout, q, k, v, o1, l1, cu, n_seq, T, H, KVH, D);
    run_attention_backward(g_gpu, dq2, dk2, dv2, dout, q, k, v, o1, l1, cu, n_seq, T, H, KVH, D);
    check_arr_f("attention_backward dq", dq2, dq1, nq, 2 * TOL_GRAD);
    check_arr_f("attention_backward dk", dk2, dk1, nk, 2 * TOL_GRAD);
    check_arr_f("attention_backward dv", dv2, dv1, nk, 2 * TOL_GRAD);
    free(q), free(k), free(v), free(o1), free(o2), free(l1), free(l2), free(dout);
    free(dq1), free(dq2), free(dk1), free(dk2), free(dv1), free(dv2);
}

/* KV-cache layout: decode steps and a chunked prefill into a bigger K/V buffer. */
static void cross_attention_kvcache(int H, int KVH, int D) {
    /* queries 1, 1, 4 (two decode steps, one chunk of a prefill) */
    static const int32_t q_off[4] = {0, 1, 2, 6};
    static const int32_t k_start[3] = {0, 200, 60}, k_len[3] = {50, 130, 9};
    int rows = 330, n_seq = 3;
    size_t nq = (size_t)q_off[n_seq] * H * D, nk = (size_t)rows * KVH * D;
    size_t nl = (size_t)q_off[n_seq] * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *o1 = fnew(nq), *o2 = fnew(nq), *l1 = fnew(nl), *l2 = fnew(nl);
    run_attention_forward(g_cpu, o1, l1, q, k, v, q_off, k_start, k_len, n_seq, rows, H, KVH, D);
    run_attention_forward(g_gpu, o2, l2, q, k, v, q_off, k_start, k_len, n_seq, rows, H, KVH, D);
    check_arr_f("attention_forward KV cache out", o2, o1, nq, 2 * tol_red(D + 130));
    check_arr_f("attention_forward KV cache lse", l2, l1, nl, 2 * tol_red(D + 130));
    free(q), free(k), free(v), free(o1), free(o2), free(l1), free(l2);
}

static void cross_swiglu(size_t n) {
    float *g = fnormal(n, 3.0f), *u = fnormal(n, 1.0f), *o1 = fnew(n), *o2 = fnew(n);
    float *dout = fnormal(n, 1.0f), *dg1 = fnew(n), *dg2 = fnew(n), *du1 = fnew(n);
    float *du2 = fnew(n);
    run_swiglu_forward(g_cpu, o1, g, u, n);
    run_swiglu_forward(g_gpu, o2, g, u, n);
    check_arr_f("swiglu_forward", o2, o1, n, 2 * TOL_ELEM);
    run_swiglu_backward(g_cpu, dg1, du1, dout, g, u, n);
    run_swiglu_backward(g_gpu, dg2, du2, dout, g, u, n);
    check_arr_f("swiglu_backward dgate", dg2, dg1, n, 2 * TOL_ELEM);
    check_arr_f("swiglu_backward dup", du2, du1, n, 2 * TOL_ELEM);
    free(g), free(u), free(o1), free(o2), free(dout), free(dg1), free(dg2), free(du1);
    free(du2);
}

static void cross_logprob(int T, int C, int V, float inv_temp) {
    size_t nh = (size_t)T * C, nw = (size_t)V * C;
    float *h = fnormal(nh, 1.0f), *w = fnormal(nw, 0.2f);
    int32_t *tg = xmalloc(IB(T));
    for (int t = 0; t < T; t++) tg[t] = (int32_t)(rf_rng_u64(&g_rng) % (uint64_t)V);
    tg[0] = V - 1;
    float *lp1 = fnew(T), *lp2 = fnew(T), *e1 = fnew(T), *e2 = fnew(T);
    run_logprob_forward(g_cpu, lp1, e1, h, w, tg, T, C, V, inv_temp);
    run_logprob_forward(g_gpu, lp2, e2, h, w, tg, T, C, V, inv_temp);
    check_arr_f("logprob_forward logp", lp2, lp1, T, 2 * tol_red(C + V));
    check_arr_f("logprob_forward entropy", e2, e1, T, 2 * tol_red(C + V));
    run_logprob_forward(g_gpu, lp2, NULL, h, w, tg, T, C, V, inv_temp);
    check_arr_f("logprob_forward logp (entropy=NULL)", lp2, lp1, T, 2 * tol_red(C + V));
    float *dlp = fnormal(T, 1.0f), *dent = fnormal(T, 1.0f);
    float *dh1 = fconst(nh, 1e3f), *dh2 = fconst(nh, 1e3f), *dw1 = fnormal(nw, 1.0f);
    float *dw2 = fcopy(dw1, nw);
    for (int pass = 0; pass < 2; pass++) {
        const float *de = pass == 0 ? dent : NULL;
        run_logprob_backward(g_cpu, dh1, dw1, dlp, de, h, w, tg, T, C, V, inv_temp);
        run_logprob_backward(g_gpu, dh2, dw2, dlp, de, h, w, tg, T, C, V, inv_temp);
        check_arr_f(de ? "logprob_backward dh" : "logprob_backward dh (dentropy=NULL)", dh2, dh1,
                    nh, 2 * TOL_GRAD);
        check_arr_f(de ? "logprob_backward dw" : "logprob_backward dw (dentropy=NULL)", dw2, dw1,
                    nw, 2 * TOL_GRAD);
    }
    free(h), free(w), free(tg), free(lp1), free(lp2), free(e1), free(e2), free(dlp);
    free(dent), free(dh1), free(dh2), free(dw1), free(dw2);
}

/* The vocabulary-parallel partials and backward over one slice [v0, v0 + Vl) of a vocabulary
 * of V (targets anywhere in V, some in the slice), both back ends from the same inputs; the
 * backward from the CPU's whole-row lse and entropy so that only it differs. */
static void cross_logprob_vp(int T, int C, int V, int v0, int Vl, float inv_temp) {
    size_t nh = (size_t)T * C, nw = (size_t)Vl * C;
    float *h = fnormal(nh, 1.0f), *w = fnormal(nw, 0.2f);
    int32_t *tg = xmalloc(IB(T));
    for (int t = 0; t < T; t++) tg[t] = (int32_t)(rf_rng_u64(&g_rng) % (uint64_t)V);
    tg[0] = v0, tg[T - 1] = v0 + Vl - 1; /* the slice's first and last ids */
    float *p1[4], *p2[4];
    for (int i = 0; i < 4; i++) p1[i] = fnew(T), p2[i] = fnew(T);
    const rf_kernels *K[2] = {g_cpu, g_gpu};
    for (int b = 0; b < 2; b++) {
        float **p = b ? p2 : p1, *d[4];
        for (int i = 0; i < 4; i++) d[i] = put(K[b], p[i], FB(T));
        float *d_h = put(K[b], h, FB(nh)), *d_w = put(K[b], w, FB(nw));
        int32_t *d_tg = put(K[b], tg, IB(T));
        K[b]->logprob_vp_partials(d[0], d[1], d[2], d[3], d_h, d_w, d_tg, T, C, Vl, v0, inv_temp);
        for (int i = 0; i < 4; i++) get(K[b], p[i], d[i], FB(T));
        get(K[b], NULL, d_h, 0), get(K[b], NULL, d_w, 0), get(K[b], NULL, d_tg, 0);
    }
    check_arr_f("logprob_vp_partials max", p2[0], p1[0], T, 2 * tol_red(C));
    check_arr_f("logprob_vp_partials sum of exp", p2[1], p1[1], T, 2 * tol_red(C + Vl));
    check_arr_f("logprob_vp_partials sum of exp x (z - max)", p2[2], p1[2], T, 2 * tol_red(C + Vl));
    check_arr_f("logprob_vp_partials target logit", p2[3], p1[3], T, 2 * tol_red(C));
    /* a whole-row lse and entropy as the tensor-parallel model would combine them */
    float *lse = fnew(T), *ent = fnew(T);
    for (int t = 0; t < T; t++) lse[t] = p1[0][t] + logf(p1[1][t]) + 0.5f, ent[t] = 1.5f;
    float *dlp = fnormal(T, 1.0f), *dent = fnormal(T, 1.0f);
    float *dh1 = fconst(nh, 1e3f), *dh2 = fconst(nh, 1e3f), *dw1 = fnormal(nw, 1.0f), *dw2 = fcopy(dw1, nw);
    for (int b = 0; b < 2; b++) {
        float *dh = b ? dh2 : dh1, *dw = b ? dw2 : dw1;
        float *d_dh = put(K[b], dh, FB(nh)), *d_dw = put(K[b], dw, FB(nw)), *d_dlp = put(K[b], dlp, FB(T));
        float *d_dent = put(K[b], dent, FB(T)), *d_lse = put(K[b], lse, FB(T)), *d_ent = put(K[b], ent, FB(T));
        float *d_h = put(K[b], h, FB(nh)), *d_w = put(K[b], w, FB(nw));
        int32_t *d_tg = put(K[b], tg, IB(T));
        K[b]->logprob_vp_backward(d_dh, d_dw, d_dlp, d_dent, d_lse, d_ent, d_h, d_w, d_tg, T, C, Vl, v0, inv_temp);
        get(K[b], dh, d_dh, FB(nh)), get(K[b], dw, d_dw, FB(nw));
        get(K[b], NULL, d_dlp, 0), get(K[b], NULL, d_dent, 0), get(K[b], NULL, d_lse, 0), get(K[b], NULL, d_ent, 0);
        get(K[b], NULL, d_h, 0), get(K[b], NULL, d_w, 0), get(K[b], NULL, d_tg, 0);
    }
    check_arr_f("logprob_vp_backward dh", dh2, dh1, nh, 2 * TOL_GRAD);
    check_arr_f("logprob_vp_backward dw", dw2, dw1, nw, 2 * TOL_GRAD);
    for (int i = 0; i < 4; i++) free(p1[i]), free(p2[i]);
    free(h), free(w), free(tg), free(lse), free(ent), free(dlp), free(dent), free(dh1), free(dh2), free(dw1), free(dw2);
}

static void cross_adamw(size_t n) {
    float *p1 = fnormal(n, 1.0f), *p2 = fcopy(p1, n), *m1 = fnew(n), *m2 = fnew(n);
    float *v1 = fnew(n), *v2 = fnew(n);
    for (int step = 1; step <= 3; step++) {
        float *g = fnormal(n, 1.0f);
        run_adamw(g_cpu, p1, g, m1, v1, n, 3e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 0.8f);
        run_adamw(g_gpu, p2, g, m2, v2, n, 3e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 0.8f);
        check_arr_f("adamw param", p2, p1, n, 2 * TOL_ELEM);
        check_arr_f("adamw m", m2, m1, n, 2 * TOL_ELEM);
        check_arr_f("adamw v", v2, v1, n, 2 * TOL_ELEM);
        free(g);
    }
    free(p1), free(p2), free(m1), free(m2), free(v1), free(v2);
}

static void run_cross_suite(uint64_t seed) {
    static const int lens_a[4] = {1, 17, 70, 33}, lens_b[2] = {5, 130};
    g_be = "cuda vs cpu";
    rf_rng_seed(&g_rng, seed);
    cross_elementwise();
    cross_matmul(70, 96, 130);
    cross_matmul(1, 896, 64); /* T = 1 (decode) */
    cross_embedding(1000, 300, 64);
    cross_rmsnorm(70, 896);
    cross_rope(70, 14, 64);
    cross_rope(3, 8, 128);
    cross_attention_train(lens_a, 4, 14, 2, 64); /* Qwen2-0.5B heads: 14 query, 2 KV */
    cross_attention_train(lens_b, 2, 8, 8, 128);
    cross_attention_train(lens_a, 1, 4, 1, 64); /* one sequence of length 1 */
    cross_attention_kvcache(14, 2, 64);
    cross_attention_kvcache(8, 4, 128);
    cross_swiglu(100003);
    cross_logprob(300, 64, 1000, 0.7f);
    cross_logprob(5, 64, 1000, 1.0f);
    /* the back end's settings, mistyped: refused naming the variable and the value */
    static const char *const bad[3][3] = {
        {"RLFLOW_CUDA_ATTENTION", "bf-16", "RLFLOW_CUDA_ATTENTION=\"bf-16\": expected bf16, fp32, fma or reference"},
        {"RLFLOW_CUDA_DECODE", "splitk", "RLFLOW_CUDA_DECODE=\"splitk\": expected split or tiled"},
        {"RLFLOW_CUDA_LOGPROB_MB", "64M", "RLFLOW_CUDA_LOGPROB_MB=\"64M\": expected a whole number of megabytes"}};
    for (int i = 0; i < 3; i++) {
        setenv(bad[i][0], bad[i][1], 1);
        CHECK_ERR(g_gpu->set_precision(RF_PRECISION_FP32), RF_ERR_ARG, bad[i][2]);
        unsetenv(bad[i][0]);
    }
    setenv("RLFLOW_CUDA_LOGPROB_MB", "0", 1);
    CHECK_ERR(g_gpu->set_precision(RF_PRECISION_FP32), RF_ERR_ARG, "from 1 to 65536");
    unsetenv("RLFLOW_CUDA_LOGPROB_MB");
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
    /* chunks of 262 rows (1 MB of logits): T = 300 spans two, the second of 38 */
    setenv("RLFLOW_CUDA_LOGPROB_MB", "1", 1);
    cross_logprob(300, 64, 1000, 0.7f);
    unsetenv("RLFLOW_CUDA_LOGPROB_MB");
    cross_logprob_vp(300, 64, 1000, 500, 250, 0.7f); /* rank 2 of 4 */
    cross_logprob_vp(5, 64, 1000, 0, 334, 1.0f);     /* rank 0 of 3 */
    cross_adamw(100003);
}

/* ---- part 3: precision ---- */

static float *bf16_copy(const float *x, size_t n) {
    float *y = fnew(n);
    for (size_t i = 0; i < n; i++) y[i] = rf_round_bf16(x[i]);
    return y;
}

/* Largest |a - b| / (|b| + rms(b)), printed so that a GPU run shows the margins it has. */
static double rel_err(const float *a, const float *b, size_t n) {
    double rms = 0.0, m = 0.0;
    for (size_t i = 0; i < n; i++) rms += (double)b[i] * b[i];
    rms = sqrt(rms / (double)(n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]) / (fabs((double)b[i]) + rms);
        m = d > m ? d : m;
    }
    return m;
}

/* TF32 rounds operands to a 10-bit mantissa (relative 2^-11 = 4.9e-4 each): a product is off
 * by ~1e-3 relative, a sum over C random terms by ~1e-3 of the rms: 5e-3 leaves a margin of
 * five. */
static void cross_tf32(int T, int C, int OC) {
    setenv("RLFLOW_CUDA_TF32", "1", 1);
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
    size_t ni = (size_t)T * C, nw = (size_t)OC * C, no = (size_t)T * OC;
    float *inp = fnormal(ni, 1.0f), *w = fnormal(nw, 1.0f), *o1 = fnew(no), *o2 = fnew(no);
    run_matmul_forward(g_cpu, o1, inp, w, NULL, T, C, OC);
    run_matmul_forward(g_gpu, o2, inp, w, NULL, T, C, OC);
    printf("tf32 matmul_forward (%d, %d, %d): max relative error %.3g (tolerance 5e-3)\n", T, C,
           OC, rel_err(o2, o1, no));
    check_arr_f("tf32 matmul_forward", o2, o1, no, 5e-3);
    free(inp), free(w), free(o1), free(o2);
    setenv("RLFLOW_CUDA_TF32", "0", 1);
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
}

/* bf16 products: the CPU (fp32) on inputs rounded beforehand is the exact twin. */
static void cross_bf16_matmul(int T, int C, int OC) {
    size_t ni = (size_t)T * C, nw = (size_t)OC * C, no = (size_t)T * OC;
    float *inp = fnormal(ni, 1.0f), *w = fnormal(nw, 1.0f), *bias = fnormal(OC, 1.0f);
    float *dout = fnormal(no, 1.0f), *inp_r = bf16_copy(inp, ni), *w_r = bf16_copy(w, nw);
    float *dout_r = bf16_copy(dout, no), *o1 = fnew(no), *o2 = fnew(no);
    run_matmul_forward(g_cpu, o1, inp_r, w_r, bias, T, C, OC);
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_BF16));
    CHECK(g_gpu->get_precision() == RF_PRECISION_BF16);
    run_matmul_forward(g_gpu, o2, inp, w, bias, T, C, OC);
    check_arr_f("bf16 matmul_forward", o2, o1, no, 2 * tol_red(C));
    float *di1 = fnew(ni), *di2 = fnew(ni), *dw1 = fnormal(nw, 1.0f), *dw2 = fcopy(dw1, nw);
    float *db1 = fnew(OC), *db2 = fnew(OC);
    run_matmul_backward(g_gpu, di2, dw2, db2, dout, inp, w, T, C, OC);
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
    /* dbias sums dout in fp32 (no product): the CPU's from the unrounded dout */
    run_matmul_backward(g_cpu, di1, dw1, NULL, dout_r, inp_r, w_r, T, C, OC);
    run_matmul_backward(g_cpu, NULL, NULL, db1, dout, inp, w, T, C, OC);
    check_arr_f("bf16 matmul_backward dinp", di2, di1, ni, 2 * tol_red(OC));
    check_arr_f("bf16 matmul_backward dw", dw2, dw1, nw, 2 * tol_red(T));
    check_arr_f("bf16 matmul_backward dbias", db2, db1, OC, 2 * tol_red(T));
    free(inp), free(w), free(bias), free(dout), free(inp_r), free(w_r), free(dout_r);
    free(o1), free(o2), free(di1), free(di2), free(dw1), free(dw2), free(db1), free(db2);
}

/* The bf16 copy of a weight follows every write to it: to_device, adamw, copy, and a write made
 * around the table followed by weights_updated. A stale copy gives the old product. */
static void cross_bf16_weight_cache(int T, int C, int OC) {
    size_t ni = (size_t)T * C, nw = (size_t)OC * C, no = (size_t)T * OC;
    float *inp = fnormal(ni, 1.0f), *w = fnormal(nw, 1.0f), *want = fnew(no), *got = fnew(no);
    float *d_inp = put(g_gpu, inp, FB(ni)), *d_w = put(g_gpu, w, FB(nw)), *d_o = put(g_gpu, got, FB(no));
    float *g = fnormal(nw, 1.0f), *d_g = put(g_gpu, g, FB(nw));
    float *d_m = g_gpu->alloc(FB(nw)), *d_v = g_gpu->alloc(FB(nw)); /* zero-filled moments */
    CHECK(d_m && d_v);
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_BF16));
    float *inp_r = bf16_copy(inp, ni);
    for (int round = 0; round < 4; round++) {
        const char *what[4] = {"bf16 weight copy, first use", "after to_device", "after adamw",
                               "after copy"};
        if (round == 1) {
            for (size_t i = 0; i < nw; i++) w[i] = -w[i] + 0.5f;
            g_gpu->to_device(d_w, w, FB(nw));
        } else if (round == 2) {
            g_gpu->adamw(d_w, d_g, d_m, d_v, nw, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f);
            g_gpu->to_host(w, d_w, FB(nw));
        } else if (round == 3) {
            g_gpu->copy(d_w, d_g, FB(nw));
            memcpy(w, g, FB(nw));
        }
        g_gpu->matmul_forward(d_o, d_inp, d_w, NULL, T, C, OC);
        g_gpu->to_host(got, d_o, FB(no));
        float *w_r = bf16_copy(w, nw);
        run_matmul_forward(g_cpu, want, inp_r, w_r, NULL, T, C, OC);
        check_arr_f(what[round], got, want, no, 2 * tol_red(C));
        free(w_r);
    }
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
    g_gpu->free(d_inp), g_gpu->free(d_w), g_gpu->free(d_o), g_gpu->free(d_g), g_gpu->free(d_m);
    g_gpu->free(d_v);
    free(inp), free(w), free(want), free(got), free(g), free(inp_r);
}

/* The LM head in bf16: forward against the CPU on rounded h and w (exact twin); backward's
 * dlogit is rounded to bf16 before its products, which no pre-rounding reproduces. Against the
 * CPU's fp32 gradient: three operands rounded by up to 2^-9 each put a random error of about
 * sqrt(3) 2^-9 = 3.4e-3 of the rms on each element; the largest of ~10^5 elements is ~4.5 times
 * that, 1.5e-2: tolerance 3e-2 (a wrong term is O(1)). */
static void cross_bf16_logprob(int T, int C, int V) {
    size_t nh = (size_t)T * C, nw = (size_t)V * C;
    float *h = fnormal(nh, 1.0f), *w = fnormal(nw, 0.2f), *h_r = bf16_copy(h, nh), *w_r = bf16_copy(w, nw);
    int32_t *tg = xmalloc(IB(T));
    for (int t = 0; t < T; t++) tg[t] = (int32_t)(rf_rng_u64(&g_rng) % (uint64_t)V);
    float *lp1 = fnew(T), *lp2 = fnew(T), *e1 = fnew(T), *e2 = fnew(T);
    run_logprob_forward(g_cpu, lp1, e1, h_r, w_r, tg, T, C, V, 0.7f);
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_BF16));
    run_logprob_forward(g_gpu, lp2, e2, h, w, tg, T, C, V, 0.7f);
    check_arr_f("bf16 logprob_forward logp", lp2, lp1, T, 2 * tol_red(C + V));
    check_arr_f("bf16 logprob_forward entropy", e2, e1, T, 2 * tol_red(C + V));
    float *dlp = fnormal(T, 1.0f), *dh1 = fnew(nh), *dh2 = fnew(nh), *dw1 = fnew(nw), *dw2 = fnew(nw);
    run_logprob_backward(g_gpu, dh2, dw2, dlp, NULL, h, w, tg, T, C, V, 0.7f);
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
    run_logprob_backward(g_cpu, dh1, dw1, dlp, NULL, h, w, tg, T, C, V, 0.7f);
    printf("bf16 logprob_backward: max relative error dh %.3g dw %.3g (tolerance 3e-2)\n",
           rel_err(dh2, dh1, nh), rel_err(dw2, dw1, nw));
    check_arr_f("bf16 logprob_backward dh", dh2, dh1, nh, 3e-2);
    check_arr_f("bf16 logprob_backward dw", dw2, dw1, nw, 3e-2);
    free(h), free(w), free(h_r), free(w_r), free(tg), free(lp1), free(lp2), free(e1), free(e2);
    free(dlp), free(dh1), free(dh2), free(dw1), free(dw2);
}

/* ---- part 4: tiled attention ---- */

/* At most a fraction max_frac of the elements beyond tol (check_arr's scaled error): for the
 * tensor-core kernels, whose bf16 roundings of p and ds may land on the neighbouring value for a
 * few elements (the loose bound takes those) while the rest must keep fp32 agreement. */
static void check_mostly(const char *what, const float *got, const float *want, size_t n,
                         double tol, double max_frac) {
    double *w = dcopy(want, n), worst_r;
    size_t worst, bad = count_off(got, w, n, tol, &worst, &worst_r);
    free(w);
    if (bad > max_frac * n)
        fprintf(stderr, "[%s] %s: %zu of %zu elements beyond %.3g (at most %.0f%% may be)\n", g_be,
                what, bad, n, tol, 100 * max_frac);
    CHECK(bad <= max_frac * n);
}

/* Whether got is within tol_all of want everywhere and within tol of it for all but a fraction
 * max_frac (check_arr_f and check_mostly's criteria together), without reporting. */
static int close_mostly(const float *got, const float *want, size_t n, double tol_all, double tol,
                        double max_frac) {
    double *w = dcopy(want, n), worst_r;
    size_t worst, bad_all = count_off(got, w, n, tol_all, &worst, &worst_r);
    size_t bad = count_off(got, w, n, tol, &worst, &worst_r);
    free(w);
    return bad_all == 0 && bad <= max_frac * n;
}

/* One path of the GPU's attention (reference kernels or tiled) at one precision. */
static void gpu_attention(const char *path, int bf16, float *o, float *l, float *dq, float *dk,
                          float *dv, const float *dout, const float *q, const float *k,
                          const float *v, const float *o_in, const float *l_in, const int32_t *cu,
                          const int32_t *kl, int n_seq, int T, int H, int KVH, int D) {
    if (path) setenv("RLFLOW_CUDA_ATTENTION", path, 1);
    CHECK_OK(g_gpu->set_precision(bf16 ? RF_PRECISION_BF16 : RF_PRECISION_FP32));
    run_attention_forward(g_gpu, o, l, q, k, v, cu, cu, kl, n_seq, T, H, KVH, D);
    run_attention_backward(g_gpu, dq, dk, dv, dout, q, k, v, o_in, l_in, cu, n_seq, T, H, KVH, D);
    CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
    unsetenv("RLFLOW_CUDA_ATTENTION");
}

static void cross_flash(const int *lens, int n_seq, int H, int KVH, int D) {
    int32_t cu[16], kl[16];
    int maxlen = packed_lens(lens, n_seq, cu, kl);
    int T = cu[n_seq];
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D, nl = (size_t)T * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f), *dout = fnormal(nq, 1.0f);
    double tf = 2 * tol_red(D + maxlen), tb = 2 * TOL_GRAD;
    /* fp32 (at precision fp32, and at bf16 under RLFLOW_CUDA_ATTENTION=fp32: attention's
     * arithmetic stays fp32); bf16 on the FMA kernels (=fma); bf16 attention (the default at
     * precision bf16), which is the tensor-core kernels where they apply (D a multiple of 16;
     * the module is built for sm_80 and later, RLFLOW_CUDA_ARCHS) */
    for (int mode = RF_FLASH_FP32; mode <= RF_FLASH_BF16_MMA; mode++) {
        if (mode == RF_FLASH_BF16_MMA && D % 16) continue; /* =bf16 is the FMA kernel there */
        /* the tiled code's CPU mirror: out and lse, then gradients from them */
        float *o0 = fnew(nq), *l0 = fnew(nl), *dq0 = fnew(nq), *dk0 = fnew(nk), *dv0 = fnew(nk);
        rf_flash_ref_forward(o0, l0, q, k, v, cu, cu, kl, n_seq, H, KVH, D, mode);
        rf_flash_ref_backward(dq0, dk0, dv0, dout, q, k, v, o0, l0, cu, n_seq, T, H, KVH, D, mode);
        float *o = fnew(nq), *l = fnew(nl), *dq = fconst(nq, 1e3f), *dk = fconst(nk, 1e3f), *dv = fconst(nk, 1e3f);
        /* run 0: the tiled kernels; in fp32 mode also run 1, the same at precision bf16 under
         * RLFLOW_CUDA_ATTENTION=fp32 (a choice of path, so not again on the 4200-token case,
         * which costs minutes on the emulated GPU, tests/cuda_emu), and run 2, the reference
         * kernels (fp32 only) */
        for (int run = 0; run <= (mode == RF_FLASH_FP32 ? 2 : 0); run++) {
            if (run == 1 && T > 1024) continue;
            int ref = run == 2, bf16 = mode != RF_FLASH_FP32 || run == 1;
            const char *path = ref ? "reference" : mode == RF_FLASH_BF16_LOAD ? "fma" : run == 1 ? "fp32" : NULL;
            gpu_attention(path, bf16, o, l, dq, dk, dv, dout, q, k, v, o0, l0, cu, kl, n_seq, T, H, KVH, D);
            char what[96];
            const char *name = ref ? "reference kernels" : run == 1 ? "flash at precision bf16 (fp32 arithmetic)"
                               : mode == RF_FLASH_FP32 ? "flash fp32"
                               : mode == RF_FLASH_BF16_LOAD ? "flash bf16 (FMA)" : "flash bf16 (tensor cores)";
            snprintf(what, sizeof what, "%s vs cpu_flash_ref: out", name);
            /* tensor cores: a probability (or ds) 1 fp32 ulp away from the mirror's may round to
             * the neighbouring bf16 value (2^-8 relative), which moves out by up to 2^-8 max|v|
             * (|v| <= 4.6 for these N(0, 1) values): 2e-2 forward and 5e-2 backward, the bounds
             * test_flash_ref sets on the whole rounding; lse keeps fp32 tolerance */
            int mma = mode == RF_FLASH_BF16_MMA;
            check_arr_f(what, o, o0, nq, mma ? 2e-2 : tf);
            if (mma) check_mostly(what, o, o0, nq, tf, 0.05);
            snprintf(what, sizeof what, "%s vs cpu_flash_ref: lse", name);
            check_arr_f(what, l, l0, nl, tf);
            const float *got[3] = {dq, dk, dv}, *want[3] = {dq0, dk0, dv0};
            static const char *const gname[3] = {"dq", "dk", "dv"};
            if (mma) {
                /* The tensor-core backward runs where the device's shared memory holds its
                 * tiles (at D >= 96 more than sm_86/89's 99 KB); elsewhere the back end takes the
                 * FMA backward with the same bf16 loads: then the gradients must be that mode's
                 * (fp32 tolerance), checked against the mirror run in it. */
                int tc = 1;
                for (int g = 0; g < 3; g++) tc = tc && close_mostly(got[g], want[g], g ? nk : nq, 5e-2, tb, 0.05);
                if (!tc) {
                    rf_flash_ref_backward(dq0, dk0, dv0, dout, q, k, v, o0, l0, cu, n_seq, T, H, KVH, D,
                                          RF_FLASH_BF16_LOAD);
                    printf("bf16 attention backward at D = %d (%d heads, %d KV): not the tensor-core "
                           "kernel's results; checked as the FMA kernel's\n", D, H, KVH);
                    for (int g = 0; g < 3; g++) {
                        snprintf(what, sizeof what, "%s vs cpu_flash_ref: %s (FMA backward)", name, gname[g]);
                        check_arr_f(what, got[g], want[g], g ? nk : nq, tb);
                    }
                    continue;
                }
            }
            for (int g = 0; g < 3; g++) {
                snprintf(what, sizeof what, "%s vs cpu_flash_ref: %s", name, gname[g]);
                check_arr_f(what, got[g], want[g], g ? nk : nq, mma ? 5e-2 : tb);
                if (mma) check_mostly(what, got[g], want[g], g ? nk : nq, tb, 0.05);
            }
        }
        free(o0), free(l0), free(dq0), free(dk0), free(dv0), free(o), free(l), free(dq), free(dk), free(dv);
    }
    free(q), free(k), free(v), free(dout);
}

/* The tiled forward over a KV-cache layout (decode rows and a prefill chunk reading keys of
 * other rows, bottom-right causal alignment), the way prefill and generation call it: fp32 (at
 * precision fp32, and at bf16 under RLFLOW_CUDA_ATTENTION=fp32), bf16 on the FMA kernel (=fma),
 * bf16 attention (precision bf16's default: the tensor-core kernel where D is a multiple of
 * 16), each against the mirror's same mode, tolerances as cross_flash's forward. */
static void cross_flash_kvcache(int H, int KVH, int D) {
    static const int32_t q_off[5] = {0, 1, 2, 42, 45};
    static const int32_t k_start[4] = {0, 200, 60, 400}, k_len[4] = {50, 130, 75, 3};
    int rows = 410, n_seq = 4;
    size_t nq = (size_t)q_off[n_seq] * H * D, nk = (size_t)rows * KVH * D, nl = (size_t)q_off[n_seq] * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *o0 = fnew(nq), *l0 = fnew(nl), *o = fnew(nq), *l = fnew(nl);
    double tf = 2 * tol_red(D + 130);
    /* mode -1: the fp32 mirror against precision bf16 under RLFLOW_CUDA_ATTENTION=fp32; the
     * tensor-core mode is the default at precision bf16 */
    for (int m = -1; m <= RF_FLASH_BF16_MMA; m++) {
        int mode = m < 0 ? RF_FLASH_FP32 : m;
        if (mode == RF_FLASH_BF16_MMA && D % 16) continue;
        rf_flash_ref_forward(o0, l0, q, k, v, q_off, k_start, k_len, n_seq, H, KVH, D, mode);
        if (mode == RF_FLASH_BF16_LOAD) setenv("RLFLOW_CUDA_ATTENTION", "fma", 1);
        if (m < 0) setenv("RLFLOW_CUDA_ATTENTION", "fp32", 1);
        CHECK_OK(g_gpu->set_precision(m ? RF_PRECISION_BF16 : RF_PRECISION_FP32));
        run_attention_forward(g_gpu, o, l, q, k, v, q_off, k_start, k_len, n_seq, rows, H, KVH, D);
        CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
        unsetenv("RLFLOW_CUDA_ATTENTION");
        const char *name = m < 0 ? "flash at precision bf16 (fp32 arithmetic)" : mode == RF_FLASH_FP32 ? "flash fp32"
                           : mode == RF_FLASH_BF16_LOAD ? "flash bf16 (FMA)" : "flash bf16 (tensor cores)";
        char what[96];
        snprintf(what, sizeof what, "%s, KV cache, vs cpu_flash_ref: out", name);
        check_arr_f(what, o, o0, nq, mode == RF_FLASH_BF16_MMA ? 2e-2 : tf);
        if (mode == RF_FLASH_BF16_MMA) check_mostly(what, o, o0, nq, tf, 0.05);
        snprintf(what, sizeof what, "%s, KV cache, vs cpu_flash_ref: lse", name);
        check_arr_f(what, l, l0, nl, tf);
    }
    free(q), free(k), free(v), free(o0), free(l0), free(o), free(l);
}

/* Generation's attention and training's agree bit for bit: paged_attention_forward on the
 * paged view of packed sequences (decoding steps and prefill chunks of 4 and 40 queries,
 * contexts of 1 to 257 keys: up to 3 key chunks of RF_FLASH_CHUNK, shuffled block tables;
 * test_flash_ref takes the mirror to 1500) against attention_forward in the training layout,
 * row by row, in every mode: the tiled kernels at precision fp32 (decoding steps split over
 * their key chunks, RLFLOW_CUDA_DECODE=split, in one block each, =tiled, and as the batch
 * chooses) and at bf16 under RLFLOW_CUDA_ATTENTION=fp32, bf16 loads on the FMA kernels
 * (=fma), the tensor-core kernels (bf16's default, head dims multiple of 16; split, in one
 * block each and as the batch chooses, as the FMA kernels; also against the mirror's
 * RF_FLASH_BF16_MMA mode with cross_flash's tolerances), the reference
 * kernels (=reference, and head dims past RF_FLASH_MAX_D). Also the default against its CPU
 * mirror rf_flash_ref_paged_forward and, fp32, against the CPU back end's paged attention,
 * 2 tol_red(D + 257). */
static void cross_paged_tiled(int H, int KVH, int D) {
    enum { NS = 7, BS = 16, MAXB = 32, MODES = 5 };
    static const int lens[NS] = {1, 5, 33, 64, 129, 160, 257}, chunk[NS] = {1, 1, 1, 4, 1, 40, 1};
    static const char *const att[MODES] = {NULL, "fp32", "fma", "reference", NULL}; /* 4: bf16's default */
    static const char *const dec[3] = {NULL, "split", "tiled"};
    int32_t cu[NS + 1], kl[NS];
    packed_lens(lens, NS, cu, kl);
    int T = cu[NS];
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D, nl = (size_t)T * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *train = fnew(nq), *lse = fnew(nl);
    paged_view pv = paged_view_make(q, k, v, cu, chunk, NS, MAXB, BS, H, KVH, D);
    size_t np = (size_t)pv.q_off[NS] * H * D, npool = pv.pool_rows * KVH * D;
    float *o = fnew(np), *o0 = fnew(np);
    float *d_kp = put(g_gpu, pv.kp, FB(npool)), *d_vp = put(g_gpu, pv.vp, FB(npool));
    float *d_q = put(g_gpu, pv.q, FB(np)), *d_o = put(g_gpu, o, FB(np));
    int32_t *d_qo = put(g_gpu, pv.q_off, IB(NS + 1)), *d_bt = put(g_gpu, pv.bt, IB(NS * MAXB));
    int32_t *d_kl = put(g_gpu, kl, IB(NS));
    for (int m = 0; m < MODES; m++) {
        int bf16 = m == 1 || m == 2 || m == 4, tc = m == 4;
        if (D > RF_FLASH_MAX_D && m != 0) continue; /* the reference kernels in every mode */
        if (tc && D % 16) continue;
        if (att[m]) setenv("RLFLOW_CUDA_ATTENTION", att[m], 1);
        CHECK_OK(g_gpu->set_precision(bf16 ? RF_PRECISION_BF16 : RF_PRECISION_FP32));
        run_attention_forward(g_gpu, train, lse, q, k, v, cu, cu, kl, NS, T, H, KVH, D);
        /* decoding split over key chunks (by the batch: here split; forced; one block each) */
        for (int dm = 0; dm < (m == 0 || m == 2 || m == 4 ? 3 : 1); dm++) {
            if (dec[dm]) setenv("RLFLOW_CUDA_DECODE", dec[dm], 1);
            g_gpu->zero(d_o, FB(np)); /* every row must be written */
            g_gpu->paged_attention_forward(d_o, d_q, d_kp, d_vp, d_qo, d_bt, MAXB, d_kl, NS, BS, H, KVH, D);
            g_gpu->to_host(o, d_o, FB(np));
            unsetenv("RLFLOW_CUDA_DECODE");
            char what[160];
            snprintf(what, sizeof what, "paged attention vs training's, D=%d, precision %s%s%s%s%s", D,
                     bf16 ? "bf16" : "fp32", att[m] ? ", RLFLOW_CUDA_ATTENTION=" : "",
                     att[m] ? att[m] : "", dec[dm] ? ", RLFLOW_CUDA_DECODE=" : "", dec[dm] ? dec[dm] : "");
            size_t bad = paged_rows_differing(&pv, NS, o, train, H, D);
            if (bad) printf("%s: %zu of %d query rows differ\n", what, bad, pv.q_off[NS]);
            CHECK(bad == 0);
            if (tc) { /* and the tensor cores' rounding is the mirror's, as cross_flash holds it */
                rf_flash_ref_paged_forward(o0, pv.q, pv.kp, pv.vp, pv.q_off, pv.bt, MAXB, kl, NS, BS,
                                           H, KVH, D, RF_FLASH_BF16_MMA);
                check_arr_f("tensor-core paged attention vs cpu_flash_ref", o, o0, np, 2e-2);
                check_mostly("tensor-core paged attention vs cpu_flash_ref", o, o0, np,
                             2 * tol_red(D + 257), 0.05);
            }
        }
        CHECK_OK(g_gpu->set_precision(RF_PRECISION_FP32));
        unsetenv("RLFLOW_CUDA_ATTENTION");
        if (m == 0) {
            if (D <= RF_FLASH_MAX_D) {
                rf_flash_ref_paged_forward(o0, pv.q, pv.kp, pv.vp, pv.q_off, pv.bt, MAXB, kl, NS,
                                           BS, H, KVH, D, RF_FLASH_FP32);
                check_arr_f("tiled paged attention vs cpu_flash_ref", o, o0, np, 2 * tol_red(D + 257));
            }
            g_cpu->paged_attention_forward(o0, pv.q, pv.kp, pv.vp, pv.q_off, pv.bt, MAXB, kl, NS,
                                           BS, H, KVH, D);
            check_arr_f("paged attention vs cpu", o, o0, np, 2 * tol_red(D + 257));
        }
    }
    g_gpu->free(d_kp), g_gpu->free(d_vp), g_gpu->free(d_q), g_gpu->free(d_o), g_gpu->free(d_qo);
    g_gpu->free(d_bt), g_gpu->free(d_kl);
    paged_view_free(&pv);
    free(q), free(k), free(v), free(train), free(lse), free(o), free(o0);
}

/* The unsplit paged kernel (RLFLOW_CUDA_ATTENTION=reference: every row, decoding steps and a
 * prefill chunk) against the CPU back end, 2 tol_red(D + 1500): contexts of 1 to 1500 keys,
 * shuffled block tables. */
static void cross_paged_reference(int H, int KVH, int D) {
    enum { NS = 7, BS = 16, MAXB = 96 };
    static const int32_t qlen[NS] = {1, 1, 1, 1, 1, 1, 4}, klen[NS] = {1, 5, 64, 65, 300, 1500, 40};
    int32_t q_off[NS + 1], bt[NS * MAXB];
    int n_blocks = NS * MAXB;
    q_off[0] = 0;
    for (int s = 0; s < NS; s++) q_off[s + 1] = q_off[s] + qlen[s];
    for (int b = 0; b < n_blocks; b++) bt[b] = (int32_t)((b * 389 + 11) % n_blocks);
    size_t rows = (size_t)n_blocks * BS, np = rows * KVH * D, nq = (size_t)q_off[NS] * H * D;
    float *kp = fnormal(np, 1.0f), *vp = fnormal(np, 1.0f), *q = fnormal(nq, 1.0f);
    float *o1 = fnew(nq), *o2 = fnew(nq);
    g_cpu->paged_attention_forward(o1, q, kp, vp, q_off, bt, MAXB, klen, NS, BS, H, KVH, D);
    float *d_kp = put(g_gpu, kp, FB(np)), *d_vp = put(g_gpu, vp, FB(np)), *d_q = put(g_gpu, q, FB(nq));
    float *d_o = put(g_gpu, o2, FB(nq));
    int32_t *d_qo = put(g_gpu, q_off, IB(NS + 1)), *d_bt = put(g_gpu, bt, IB(NS * MAXB));
    int32_t *d_kl = put(g_gpu, klen, IB(NS));
    setenv("RLFLOW_CUDA_ATTENTION", "reference", 1);
    g_gpu->paged_attention_forward(d_o, d_q, d_kp, d_vp, d_qo, d_bt, MAXB, d_kl, NS, BS, H, KVH, D);
    g_gpu->to_host(o2, d_o, FB(nq));
    unsetenv("RLFLOW_CUDA_ATTENTION");
    check_arr_f("paged attention, unsplit kernel, vs cpu", o2, o1, nq, 2 * tol_red(D + 1500));
    g_gpu->free(d_kp), g_gpu->free(d_vp), g_gpu->free(d_q), g_gpu->free(d_o), g_gpu->free(d_qo);
    g_gpu->free(d_bt), g_gpu->free(d_kl);
    free(kp), free(vp), free(q), free(o1), free(o2);
}

static void run_precision_and_flash_suite(uint64_t seed) {
    static const int lens_a[5] = {1, 17, 70, 33, 100}, lens_b[4] = {31, 32, 33, 64};
    g_be = "cuda precision and tiled attention";
    rf_rng_seed(&g_rng, seed);
    cross_tf32(70, 896, 130);
    cross_bf16_matmul(70, 96, 130);
    cross_bf16_matmul(1, 896, 64);
    cross_bf16_weight_cache(9, 64, 48);
    cross_bf16_logprob(300, 64, 1000);
    cross_flash(lens_a, 5, 14, 2, 64);
    cross_flash(lens_b, 4, 8, 8, 128);
    cross_flash(lens_a, 1, 4, 1, 64);
    cross_flash_kvcache(14, 2, 64);
    cross_flash_kvcache(4, 4, 128);
    cross_paged_reference(14, 2, 64);
    cross_paged_reference(8, 8, 128);
    cross_paged_tiled(14, 2, 64);
    cross_paged_tiled(8, 8, 128);
    cross_paged_tiled(7, 1, 80);
    cross_paged_tiled(4, 2, 160);
    /* head dims that are not multiples of 32 (the FMA kernels' partial lanes; the tensor-core
     * ones at 5 and 6 tiles of 16) with a GQA group of 7, and one sequence long enough that
     * every block of both kernels strides over more than one tile (4200 rows: more than 64
     * tiles of 64) */
    static const int lens_long[1] = {4200};
    cross_flash(lens_a, 5, 7, 1, 80);
    cross_flash(lens_b, 4, 4, 2, 96);
    cross_flash(lens_long, 1, 1, 1, 64);
}

/* Usage: test_kernels_cuda [cross|precision] (an argument: part 2 only, or parts 3 to 5 only,
 * the precision and attention checks, for a quick run after a change to those kernels). */
int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : "";
    if (argc > 2 || (argc > 1 && strcmp(only, "cross") != 0 && strcmp(only, "precision") != 0)) {
        fprintf(stderr, "usage: test_kernels_cuda [cross|precision]\n");
        return 2;
    }
    /* parts 1 and 2 hold the back end to fp32: plain fp32 products (read at start and by
     * set_precision) */
    setenv("RLFLOW_CUDA_TF32", "0", 1);
    g_gpu = rf_cuda_kernels(0);
    if (!g_gpu) {
        printf("test_kernels_cuda: skipped: %s\n", rf_error_message());
        return 77;
    }
    g_cpu = rf_cpu_kernels();
    CHECK(g_gpu->name && strcmp(g_gpu->name, "cuda") == 0);
    if (!*only) run_kernel_suite(g_gpu, 20240611);
    if (!*only || strcmp(only, "cross") == 0) run_cross_suite(777);
    if (!*only || strcmp(only, "precision") == 0) run_precision_and_flash_suite(4242);
    return rf_test_finish("test_kernels_cuda");
}
