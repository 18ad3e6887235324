/* The tiled attention algorithm of the CUDA back end (FlashAttention-2: tiles of
 * RF_FLASH_BR queries and RF_FLASH_BC keys, online softmax, lse saved, backward recomputed
 * from lse in a dk/dv pass and a dq pass), as its CPU mirror kernels/cpu/cpu_flash_ref.c runs
 * it, against the CPU back end's attention (an exact softmax per row, sgemm backward), on every
 * machine. Sequence lengths straddle the tile sizes (1, 31, 32, 33, 64, 70, 100) and the key
 * chunks of RF_FLASH_CHUNK (129, 256, 300), GQA groups of
 * 7 and 1, head dims 64 and 128, the training layout and a KV-cache layout.
 *
 * Tolerances (the same reasoning as tests/test_kernels.c): both computations are fp32 and each
 * is within tol_red(K) of the exact result for the K = D + L terms a row reduces over, so they
 * differ by at most 2 tol_red(D + L) forward; backward 2 TOL_GRAD, as test_kernels_cuda's cross
 * checks (gradients that vanish by cancellation leave an array of tiny scale). With bf16 = 1 the tiled code rounds
 * q, k, v, dout to bf16 as it loads them: it must then agree to the same fp32 tolerance with
 * the CPU attention run on inputs rounded beforehand (rounding is idempotent), and differ from
 * the unrounded result by bf16's 2^-8 relative rounding carried through the softmax (checked
 * within 5e-2, and shown to differ by more than fp32 rounding, so the rounding really happens).
 * Also the paged attention as the CUDA back end runs it (the tiled forward over keys read
 * through block tables: bit for bit the training layout's rows, and the CPU back end's paged
 * attention within tolerance), and the tensor-core forward's arithmetic (probabilities rounded
 * to bf16 before P V: RF_FLASH_BF16_MMA) against the FMA kernels' (check_mma_rounding). */
#define RF_TEST_KERNELS_NO_MAIN
#include "test_kernels.c"

#include "kernels/flash_ref.h"

static float *round_copy(const float *x, size_t n) {
    float *y = fnew(n);
    for (size_t i = 0; i < n; i++) y[i] = rf_round_bf16(x[i]);
    return y;
}

static double max_rel_diff(const float *a, const float *b, size_t n) {
    double rms = 0.0, m = 0.0;
    for (size_t i = 0; i < n; i++) rms += (double)b[i] * b[i];
    rms = sqrt(rms / (double)(n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]) / (fabs((double)b[i]) + rms);
        m = d > m ? d : m;
    }
    return m;
}

/* Forward and backward of the training layout, tiled against the CPU back end. */
static void check_train(const int *lens, int n_seq, int H, int KVH, int D, int bf16) {
    const rf_kernels *K = rf_cpu_kernels();
    int32_t cu[16], kl[16];
    int maxlen = packed_lens(lens, n_seq, cu, kl);
    int T = cu[n_seq];
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D, nl = (size_t)T * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *dout = fnormal(nq, 1.0f);
    /* the CPU back end's inputs: rounded beforehand at bf16 */
    float *qr = bf16 ? round_copy(q, nq) : fcopy(q, nq), *kr = bf16 ? round_copy(k, nk) : fcopy(k, nk);
    float *vr = bf16 ? round_copy(v, nk) : fcopy(v, nk), *dr = bf16 ? round_copy(dout, nq) : fcopy(dout, nq);
    float *o1 = fnew(nq), *o2 = fnew(nq), *l1 = fnew(nl), *l2 = fnew(nl);
    run_attention_forward(K, o1, l1, qr, kr, vr, cu, cu, kl, n_seq, T, H, KVH, D);
    rf_flash_ref_forward(o2, l2, q, k, v, cu, cu, kl, n_seq, H, KVH, D, bf16);
    double tol = 2 * tol_red(D + maxlen);
    check_arr_f(bf16 ? "flash bf16 forward out" : "flash forward out", o2, o1, nq, tol);
    check_arr_f(bf16 ? "flash bf16 forward lse" : "flash forward lse", l2, l1, nl, tol);
    float *dq1 = fconst(nq, 1e3f), *dq2 = fconst(nq, 1e3f), *dk1 = fconst(nk, 1e3f);
    float *dk2 = fconst(nk, 1e3f), *dv1 = fconst(nk, 1e3f), *dv2 = fconst(nk, 1e3f);
    /* both from the CPU forward's out and lse, so that only the backward differs (the tiled
     * code's Di = dout . out uses dout rounded at bf16, as the CPU's does here). Gradients that
     * vanish by cancellation (a sequence of one token: dk = 0) make the array's scale tiny:
     * 2 TOL_GRAD as in test_kernels_cuda's cross checks */
    run_attention_backward(K, dq1, dk1, dv1, dr, qr, kr, vr, o1, l1, cu, n_seq, T, H, KVH, D);
    rf_flash_ref_backward(dq2, dk2, dv2, dout, q, k, v, o1, l1, cu, n_seq, T, H, KVH, D, bf16);
    double tg = 2 * TOL_GRAD;
    check_arr_f(bf16 ? "flash bf16 backward dq" : "flash backward dq", dq2, dq1, nq, tg);
    if (maxlen > 1) {
        check_arr_f(bf16 ? "flash bf16 backward dk" : "flash backward dk", dk2, dk1, nk, tg);
    } else {
        /* One key per query: dk = dS^T q with dS = P (dP - Di) = 0 exactly in exact arithmetic,
         * so both sides hold cancellation noise only, of order eps * |dout| |v| sqrt(D) (an
         * unoptimised build of the CPU back end left 5.6e-7; the relative check's floor,
         * 1e-3 * tol, is below that): each must stay under 1e-5, for O(1) inputs. */
        float worst = 0.0f;
        for (size_t i = 0; i < nk; i++) worst = fmaxf(worst, fmaxf(fabsf(dk1[i]), fabsf(dk2[i])));
        if (!(worst <= 1e-5f)) fprintf(stderr, "flash backward dk over single keys: |dk| up to %.3g, want <= 1e-5\n", worst);
        CHECK(worst <= 1e-5f);
    }
    check_arr_f(bf16 ? "flash bf16 backward dv" : "flash backward dv", dv2, dv1, nk, tg);
    if (bf16) { /* the rounding happened: against the unrounded inputs the output moved */
        run_attention_forward(K, o1, l1, q, k, v, cu, cu, kl, n_seq, T, H, KVH, D);
        double d = max_rel_diff(o2, o1, nq);
        if (!(d > 2 * tol && d < 5e-2)) {
            fprintf(stderr, "flash bf16 forward vs fp32 inputs: max relative difference %.3g, "
                    "want in (%.3g, 5e-2)\n", d, 2 * tol);
            CHECK(0);
        }
    }
    free(q), free(k), free(v), free(dout), free(qr), free(kr), free(vr), free(dr);
    free(o1), free(o2), free(l1), free(l2);
    free(dq1), free(dq2), free(dk1), free(dk2), free(dv1), free(dv2);
}

/* KV-cache layout: decode steps and a prefill chunk over a bigger K/V buffer. */
static void check_kvcache(int H, int KVH, int D) {
    const rf_kernels *K = rf_cpu_kernels();
    static const int32_t q_off[5] = {0, 1, 2, 42, 45};
    static const int32_t k_start[4] = {0, 200, 60, 400}, k_len[4] = {50, 130, 75, 3};
    int rows = 410, n_seq = 4;
    size_t nq = (size_t)q_off[n_seq] * H * D, nk = (size_t)rows * KVH * D;
    size_t nl = (size_t)q_off[n_seq] * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *o1 = fnew(nq), *o2 = fnew(nq), *l1 = fnew(nl), *l2 = fnew(nl);
    run_attention_forward(K, o1, l1, q, k, v, q_off, k_start, k_len, n_seq, rows, H, KVH, D);
    rf_flash_ref_forward(o2, l2, q, k, v, q_off, k_start, k_len, n_seq, H, KVH, D, 0);
    check_arr_f("flash forward KV cache out", o2, o1, nq, 2 * tol_red(D + 130));
    check_arr_f("flash forward KV cache lse", l2, l1, nl, 2 * tol_red(D + 130));
    free(q), free(k), free(v), free(o1), free(o2), free(l1), free(l2);
}

/* The CUDA back end's default paged attention (rf_flash_ref_paged_forward: the tiled forward,
 * key tiles through the block table): every row, a decoding step's or a prefill chunk's, has
 * the bits the tiled forward gives the same row in the training layout, so generation and
 * training agree exactly; fp32 and bf16 loads. Contexts of 1 to 1500 keys, chunks of 1, 4 and
 * 40 queries. And, fp32, the CPU back end's paged attention within 2 tol_red(D + 1500). */
static void check_paged_tiled(int H, int KVH, int D, int bf16) {
    enum { NS = 7, BS = 16, MAXB = 96 };
    static const int lens[NS] = {1, 5, 33, 64, 65, 300, 1500}, chunk[NS] = {1, 1, 1, 4, 1, 40, 1};
    int32_t cu[NS + 1], kl[NS];
    packed_lens(lens, NS, cu, kl);
    int T = cu[NS];
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *train = fnew(nq), *lse = fnew((size_t)T * H);
    rf_flash_ref_forward(train, lse, q, k, v, cu, cu, kl, NS, H, KVH, D, bf16);
    paged_view pv = paged_view_make(q, k, v, cu, chunk, NS, MAXB, BS, H, KVH, D);
    size_t np = (size_t)pv.q_off[NS] * H * D;
    float *o1 = fnew(np), *o2 = fnew(np);
    rf_flash_ref_paged_forward(o1, pv.q, pv.kp, pv.vp, pv.q_off, pv.bt, MAXB, kl, NS, BS, H, KVH,
                               D, bf16);
    size_t bad = paged_rows_differing(&pv, NS, o1, train, H, D);
    printf("tiled paged attention%s: %zu of %d query rows differ from training's\n",
           bf16 ? " (bf16 loads)" : "", bad, pv.q_off[NS]);
    CHECK(bad == 0);
    if (!bf16) {
        rf_cpu_kernels()->paged_attention_forward(o2, pv.q, pv.kp, pv.vp, pv.q_off, pv.bt, MAXB,
                                                  kl, NS, BS, H, KVH, D);
        check_arr_f("tiled paged attention vs cpu", o1, o2, np, 2 * tol_red(D + 1500));
    }
    paged_view_free(&pv);
    free(q), free(k), free(v), free(train), free(lse), free(o1), free(o2);
}

/* bf16 rounding: ties to even, NaN and infinities kept. */
static void check_round(void) {
    CHECK(rf_round_bf16(1.0f) == 1.0f);
    CHECK(rf_round_bf16(1.0f + 0x1p-8f) == 1.0f);                  /* tie: to even (1.0) */
    CHECK(rf_round_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);   /* tie: to even (up) */
    CHECK(rf_round_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f); /* above the tie */
    CHECK(rf_round_bf16(-3.0f) == -3.0f);
    CHECK(isinf(rf_round_bf16(INFINITY)) && isnan(rf_round_bf16(NAN)));
}

/* RF_FLASH_BF16_MMA (the tensor-core forward's arithmetic) against RF_FLASH_BF16_LOAD on the
 * same inputs: the probabilities are rounded to bf16 only on their way into P V, so lse (made
 * from the unrounded row sums) is bit for bit the same, and out moves by at most bf16's 2^-9
 * relative rounding of each probability: |delta out| <= 2^-9 max|v| for an average of v's rows,
 * under 4.6 / 512 ~ 9e-3 for these N(0, 1) values of |v| <= 4.6 (a bound of 2e-2 on
 * max_rel_diff, whose denominator is |out| + rms >= the rms of out). It must also move by
 * more than fp32 rounding (2 tol_red(D + L)): the rounding really happens. The backward from
 * the same out and lse, p and ds rounded before their products: each term of dq, dk, dv moves by
 * at most 2^-9 relative, but the sums cancel (a row's ds add up to about zero), so the scaled
 * difference is larger than the forward's (0.009-0.017 measured); bounded by 5e-2, the bound of
 * check_train's bf16 inputs against fp32 ones, and above 2 TOL_GRAD. */
static void check_mma_rounding(const int *lens, int n_seq, int H, int KVH, int D) {
    int32_t cu[16], kl[16];
    int maxlen = packed_lens(lens, n_seq, cu, kl);
    int T = cu[n_seq];
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D, nl = (size_t)T * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *o1 = fnew(nq), *o2 = fnew(nq), *l1 = fnew(nl), *l2 = fnew(nl);
    rf_flash_ref_forward(o1, l1, q, k, v, cu, cu, kl, n_seq, H, KVH, D, RF_FLASH_BF16_LOAD);
    rf_flash_ref_forward(o2, l2, q, k, v, cu, cu, kl, n_seq, H, KVH, D, RF_FLASH_BF16_MMA);
    CHECK(memcmp(l1, l2, sizeof(float) * nl) == 0);
    double d = max_rel_diff(o2, o1, nq), tol = 2 * tol_red(D + maxlen);
    printf("flash forward, P rounded to bf16 vs not: max relative difference %.3g (want in (%.3g, 2e-2))\n",
           d, tol);
    CHECK(d > tol && d < 2e-2);
    /* backward from the same out and lse: p and ds rounded before their products */
    float *dout = fnormal(nq, 1.0f);
    float *g1[3] = {fnew(nq), fnew(nk), fnew(nk)}, *g2[3] = {fnew(nq), fnew(nk), fnew(nk)};
    rf_flash_ref_backward(g1[0], g1[1], g1[2], dout, q, k, v, o1, l1, cu, n_seq, T, H, KVH, D,
                          RF_FLASH_BF16_LOAD);
    rf_flash_ref_backward(g2[0], g2[1], g2[2], dout, q, k, v, o1, l1, cu, n_seq, T, H, KVH, D,
                          RF_FLASH_BF16_MMA);
    static const char *const name[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; i++) {
        size_t n = i ? nk : nq;
        double dg = max_rel_diff(g2[i], g1[i], n);
        printf("flash backward %s, p and ds rounded to bf16 vs not: max relative difference %.3g "
               "(want in (%.3g, 5e-2))\n", name[i], dg, 2 * TOL_GRAD);
        CHECK(dg > 2 * TOL_GRAD && dg < 5e-2);
        free(g1[i]), free(g2[i]);
    }
    free(dout);
    free(q), free(k), free(v), free(o1), free(o2), free(l1), free(l2);
}

int main(void) {
    static const int lens_a[5] = {1, 17, 70, 33, 100}, lens_b[4] = {31, 32, 33, 64};
    rf_rng_seed(&g_rng, 2023);
    g_be = "flash ref vs cpu";
    (void)run_kernel_suite; /* the shared suite is test_kernels's; only its helpers are used here */
    check_round();
    static const int lens_c[3] = {129, 300, 256}; /* across RF_FLASH_CHUNK boundaries */
    for (int bf16 = 0; bf16 <= 1; bf16++) {
        check_train(lens_c, 3, 14, 2, 64, bf16);
        check_train(lens_a, 5, 14, 2, 64, bf16); /* Qwen2.5-0.5B heads */
        check_train(lens_b, 4, 8, 8, 128, bf16);
        check_train(lens_a, 1, 4, 1, 64, bf16); /* one sequence of length 1 */
    }
    check_mma_rounding(lens_a, 5, 14, 2, 64);
    check_mma_rounding(lens_b, 4, 8, 8, 128);
    check_kvcache(14, 2, 64);
    check_kvcache(4, 4, 128);
    for (int bf16 = 0; bf16 <= 1; bf16++) {
        check_paged_tiled(14, 2, 64, bf16);
        check_paged_tiled(8, 8, 128, bf16);
    }
    check_paged_tiled(7, 1, 80, 0);
    return rf_test_finish("test_flash_ref");
}
