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
 * gradients. Copies and single IEEE operations (embedding forward, add_inplace, scale) are
 * compared bit for bit. */
#define RF_TEST_KERNELS_NO_MAIN
/* One suite, written once against `const rf_kernels *`, shared with the CPU test. */
#include "test_kernels.c"

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
    check_arr_f("embedding_backward", d2, d1, nv, 2 * TOL_GRAD);
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
    cross_logprob_vp(300, 64, 1000, 500, 250, 0.7f); /* rank 2 of 4 */
    cross_logprob_vp(5, 64, 1000, 0, 334, 1.0f);     /* rank 0 of 3 */
    cross_adamw(100003);
}

int main(void) {
    g_gpu = rf_cuda_kernels(0);
    if (!g_gpu) {
        printf("test_kernels_cuda: skipped: %s\n", rf_error_message());
        return 77;
    }
    g_cpu = rf_cpu_kernels();
    CHECK(g_gpu->name && strcmp(g_gpu->name, "cuda") == 0);
    run_kernel_suite(g_gpu, 20240611);
    run_cross_suite(777);
    return rf_test_finish("test_kernels_cuda");
}
