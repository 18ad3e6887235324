/* Whole-model checks on tiny configurations of every supported shape:
 *  - gradients of a loss on log-probs, entropy and values against central finite differences;
 *  - a packed batch gives the same log-probs as each sequence run alone;
 *  - KV-cache prefill + decode gives the same logits as a full forward;
 *  - config.json parsing refuses what we do not implement, naming the field. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/shm.h"
#include "kernels/sample.h"
#include "model/model.h"
#include "model/model_internal.h"
#include "test_util.h"

static rf_model_config tiny_config(rf_arch arch, int tied, int value_head) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", 97) == RF_OK);
    c.hidden_size = 16, c.intermediate_size = 24, c.num_hidden_layers = 2;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 6;
    c.arch = arch;
    c.qkv_bias = arch == RF_ARCH_QWEN2;
    c.o_bias = arch == RF_ARCH_LLAMA; /* exercise attention_bias on o_proj too */
    if (arch == RF_ARCH_LLAMA) c.qkv_bias = 1;
    c.qk_norm = arch == RF_ARCH_QWEN3;
    c.tie_word_embeddings = tied;
    c.value_head = value_head;
    c.rope_theta = 500.0f; /* small theta so that positions rotate visibly */
    return c;
}

/* A fixed packed batch of three sequences (lengths 5, 1, 7). */
static const int32_t tok[13] = {3, 17, 42, 5, 90, 11, 7, 7, 23, 64, 1, 0, 96};
static const int32_t tgt[13] = {17, 42, 5, 90, 2, 12, 7, 23, 64, 1, 0, 96, 50};
static const int32_t cu[4] = {0, 5, 6, 13};

/* Scalar loss in double: sum a_t logp_t + b_t H_t (+ c_t v_t for a value head). */
static double loss(rf_model *m, const double *a, const double *b) {
    rf_batch bt = {3, 13, tok, NULL, cu};
    float lp[13], ent[13];
    RF_ASSERT(rf_model_forward(m, &bt) == RF_OK);
    if (m->score) {
        RF_ASSERT(rf_model_values(m, lp) == RF_OK);
        double s = 0;
        for (int t = 0; t < 13; t++) s += a[t] * lp[t];
        return s;
    }
    RF_ASSERT(rf_model_logprobs(m, tgt, 1.0f / 0.9f, lp, ent) == RF_OK);
    double s = 0;
    for (int t = 0; t < 13; t++) s += a[t] * lp[t] + b[t] * ent[t];
    return s;
}

/* Finite differences in fp32 forward passes with the loss summed in double: h = 1e-2 keeps
 * rounding noise (~1e-7 relative per logit, amplified by 1/h) well under the tolerance of 2% +
 * 1e-3, while the O(h^2) truncation error of the central difference stays below 1e-4. */
static void grad_check(rf_arch arch, int tied, int value_head) {
    rf_model_config c = tiny_config(arch, tied, value_head);
    rf_model *m;
    CHECK_OK(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_model_init_random(m, 7, 0.3f);
    CHECK_OK(rf_model_enable_training(m));
    double a[13], b[13];
    float fa[13], fb[13];
    rf_rng r;
    rf_rng_seed(&r, 3);
    for (int t = 0; t < 13; t++) {
        a[t] = fa[t] = rf_rng_normal(&r);
        b[t] = fb[t] = 0.5f * rf_rng_normal(&r);
    }
    loss(m, a, b);
    rf_model_zero_grad(m);
    if (value_head)
        CHECK_OK(rf_model_backward(m, NULL, NULL, fa));
    else
        CHECK_OK(rf_model_backward(m, fa, fb, NULL));
    int bad = 0, checked = 0;
    for (int v = 0; v < m->n_views; v++) {
        const rf_param_view *pv = &m->views[v];
        for (int trial = 0; trial < 3; trial++) {
            size_t i = pv->offset + (size_t)(rf_rng_u64(&r) % pv->numel);
            float keep = m->params[i], h = 1e-2f;
            m->params[i] = keep + h;
            m->k->weights_updated(); /* the back end's weight copies follow (kernels.h) */
            double lp = loss(m, a, b);
            m->params[i] = keep - h;
            m->k->weights_updated();
            double lm = loss(m, a, b);
            m->params[i] = keep;
            m->k->weights_updated();
            double fd = (lp - lm) / (2.0 * h), an = m->grads[i];
            checked++;
            if (fabs(fd - an) > 1e-3 + 2e-2 * fabs(fd)) {
                bad++;
                fprintf(stderr, "arch %d tied %d vh %d: %s[%zu]: analytic %.6g, numeric %.6g\n", arch,
                        tied, value_head, pv->name, i - pv->offset, an, fd);
            }
        }
    }
    CHECK(bad == 0);
    CHECK(checked >= 3 * 10);
    rf_model_free(m);
}

/* A tiny model with random weights (std 0.3) from `seed`. */
static rf_model *random_model(rf_arch arch, int tied, int value_head, uint64_t seed) {
    rf_model_config c = tiny_config(arch, tied, value_head);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, seed, 0.3f);
    return m;
}

/* Each sequence run alone must give the same log-probs as inside the packed batch. */
static void packing_check(rf_arch arch) {
    rf_model *m = random_model(arch, 0, 0, 11);
    rf_batch all = {3, 13, tok, NULL, cu};
    float lp_all[13], lp_one[13];
    CHECK_OK(rf_model_forward(m, &all));
    CHECK_OK(rf_model_logprobs(m, tgt, 1.0f, lp_all, NULL));
    for (int s = 0; s < 3; s++) {
        int n = cu[s + 1] - cu[s];
        int32_t one_cu[2] = {0, n};
        rf_batch b = {1, n, tok + cu[s], NULL, one_cu};
        CHECK_OK(rf_model_forward(m, &b));
        CHECK_OK(rf_model_logprobs(m, tgt + cu[s], 1.0f, lp_one + cu[s], NULL));
    }
    /* Same math in a different summation order only inside sgemm blocking: 1e-5. */
    for (int t = 0; t < 13; t++) CHECK_CLOSE(lp_one[t], lp_all[t], 1e-5, 1e-5);
    /* every activation buffer starts on a 64-byte line whatever T (13, 5, 1, 7 here):
     * rf__rows_padded */
    int misaligned = 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const rf_layer_acts *a = &m->acts[l];
        const float *bufs[] = {a->x, a->ln1, a->rstd1, a->q_rstd, a->k_rstd, a->q, a->k, a->v, a->att,
                               a->lse, a->x_mid, a->ln2, a->rstd2, a->gate, a->up, a->act};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) misaligned += (uintptr_t)bufs[i] % 64 != 0;
    }
    misaligned += (uintptr_t)m->x_final % 64 != 0 || (uintptr_t)m->scratch % 64 != 0 || (uintptr_t)m->scratch2 % 64 != 0;
    CHECK(misaligned == 0);
    rf_model_free(m);
}

/* rf_model_share_params moves the parameters into shareable memory: same values, every weight
 * pointer moved with them (log-probs and values bit-identical), the buffer found by
 * rf_shm_lookup; a second call changes nothing. */
static void share_check(rf_arch arch, int tied, int value_head) {
    rf_model *m = random_model(arch, tied, value_head, 5);
    rf_batch all = {3, 13, tok, NULL, cu};
    float before[13], after[13];
    CHECK_OK(rf_model_forward(m, &all));
    CHECK_OK(value_head ? rf_model_values(m, before) : rf_model_logprobs(m, tgt, 1.0f, before, NULL));
    rf_shm_ref ref;
    CHECK(rf_shm_lookup(m->params, m->n_params * sizeof(float), &ref) == 0);
    float *old = m->params;
    CHECK_OK(rf_model_share_params(m));
    CHECK(m->params_shared == 1 && m->params != old);
    CHECK(rf_shm_lookup(m->params, m->n_params * sizeof(float), &ref) == 1);
    CHECK(m->wte == m->params && m->layers[0].ln1 == m->params + m->views[1].offset);
    CHECK(!tied || m->lm_head == m->wte);
    CHECK_OK(rf_model_forward(m, &all));
    CHECK_OK(value_head ? rf_model_values(m, after) : rf_model_logprobs(m, tgt, 1.0f, after, NULL));
    CHECK(memcmp(before, after, sizeof before) == 0);
    float *now = m->params;
    CHECK_OK(rf_model_share_params(m));
    CHECK(m->params == now);
    rf_model_free(m);
}

/* Decoding reserves one layer's activation buffers (it runs every layer through acts[0]); a
 * forward reserves every layer's, which later decodes reuse, growing every layer's. The logits do
 * not depend on which: a decode on a fresh model, after a forward, and a fresh model again. Also
 * the KV cache's 32-bit row limit. */
static void decode_reserve_check(void) {
    rf_model_config c = tiny_config(RF_ARCH_QWEN2, 1, 0);
    int L = c.num_hidden_layers, V = c.vocab_size;
    CHECK(L >= 2);
    rf_model *m;
    CHECK_OK(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_model_init_random(m, 9, 0.3f);
    const int32_t toks[12] = {3, 17, 42, 5, 90, 8, 7, 7, 23, 64, 1, 0};
    int slots[2] = {0, 1}, counts[2] = {5, 7};
    float *a = malloc(sizeof(float) * 2 * V), *b = malloc(sizeof(float) * 2 * V);
    rf_kv_cache kv;
    CHECK_OK(rf_kv_cache_init(&kv, m, 2, 16));
    CHECK_OK(rf_model_decode(m, &kv, slots, counts, 2, toks, a));
    CHECK(m->act_layers == 1 && m->act_cap >= 12 && m->acts[0].x && !m->acts[1].x && !m->acts[L - 1].gate);
    int32_t cu[3] = {0, 5, 12};
    rf_batch bt = {2, 12, toks, NULL, cu};
    CHECK_OK(rf_model_forward(m, &bt));
    CHECK(m->act_layers == L && m->acts[L - 1].gate);
    float *mem = m->act_mem;
    kv.len[0] = kv.len[1] = 0;
    CHECK_OK(rf_model_decode(m, &kv, slots, counts, 2, toks, b));
    CHECK(m->act_mem == mem && m->act_layers == L); /* the forward's buffers serve */
    CHECK(memcmp(a, b, sizeof(float) * 2 * V) == 0);
    /* more tokens than the forward's: every layer's buffers again, not a swap to one layer */
    rf_kv_cache big;
    int bslots[3] = {0, 1, 2}, bcounts[3] = {5, 7, 4};
    int32_t btoks[16];
    memcpy(btoks, toks, sizeof toks);
    memcpy(btoks + 12, toks, 4 * sizeof(int32_t));
    CHECK_OK(rf_kv_cache_init(&big, m, 3, 16));
    CHECK_OK(rf_model_decode(m, &big, bslots, bcounts, 3, btoks, NULL));
    CHECK(m->act_cap >= 16 && m->act_layers == L);
    rf_kv_cache_free(&big, m);
    rf_model_trim(m);
    CHECK(m->act_layers == 0 && m->act_cap == 0);
    kv.len[0] = kv.len[1] = 0;
    CHECK_OK(rf_model_decode(m, &kv, slots, counts, 2, toks, b));
    CHECK(m->act_layers == 1 && memcmp(a, b, sizeof(float) * 2 * V) == 0);
    rf_kv_cache_free(&kv, m);
    CHECK_ERR(rf_kv_cache_init(&kv, m, 1 << 21, 2048), RF_ERR_RANGE, "more than 2147483647 rows a layer");
    free(a), free(b);
    rf_model_free(m);
}

/* Prefill two sequences (lengths 5 and 7) at once, then decode 3 tokens one at a time for
 * both; each step's logits must equal the full forward's logits at that position. */
static void kv_cache_check(rf_arch arch) {
    rf_model_config c = tiny_config(arch, 1, 0);
    rf_model *m;
    CHECK_OK(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_model_init_random(m, 5, 0.3f);
    int V = c.vocab_size;
    const int32_t seqA[8] = {3, 17, 42, 5, 90, 8, 9, 10}, seqB[10] = {7, 7, 23, 64, 1, 0, 96, 4, 5, 6};
    float *full = malloc(sizeof(float) * 18 * V), *dec = malloc(sizeof(float) * 2 * V);
    int32_t toks[18];
    memcpy(toks, seqA, sizeof seqA);
    memcpy(toks + 8, seqB, sizeof seqB);
    int32_t cu2[3] = {0, 8, 18};
    rf_batch b = {2, 18, toks, NULL, cu2};
    CHECK_OK(rf_model_forward(m, &b));
    int rows[18];
    for (int i = 0; i < 18; i++) rows[i] = i;
    CHECK_OK(rf_model_logits(m, rows, 18, full));
    rf_kv_cache kv;
    CHECK_OK(rf_kv_cache_init(&kv, m, 3, 16));
    int slots[2] = {2, 0}, counts[2] = {5, 7};
    int32_t pre[12];
    memcpy(pre, seqA, 5 * sizeof(int32_t));
    memcpy(pre + 5, seqB, 7 * sizeof(int32_t));
    CHECK_OK(rf_model_decode(m, &kv, slots, counts, 2, pre, dec));
    double maxdiff = 0;
    for (int j = 0; j < V; j++) {
        maxdiff = fmax(maxdiff, fabs(dec[j] - full[4 * V + j]));
        maxdiff = fmax(maxdiff, fabs(dec[V + j] - full[(8 + 6) * V + j]));
    }
    for (int step = 0; step < 3; step++) {
        int ones[2] = {1, 1};
        int32_t nt[2] = {seqA[5 + step], seqB[7 + step]};
        CHECK_OK(rf_model_decode(m, &kv, slots, ones, 2, nt, dec));
        for (int j = 0; j < V; j++) {
            maxdiff = fmax(maxdiff, fabs(dec[j] - full[(5 + step) * V + j]));
            maxdiff = fmax(maxdiff, fabs(dec[V + j] - full[(8 + 7 + step) * V + j]));
        }
    }
    /* fp32, differing only in accumulation order: 1e-4 absolute on logits of magnitude ~1. */
    CHECK(maxdiff < 1e-4);
    if (maxdiff >= 1e-4) fprintf(stderr, "kv cache max |diff| %g\n", maxdiff);
    CHECK(kv.len[2] == 8 && kv.len[0] == 10);
    int one = 1;
    int32_t t0 = 0;
    int big[1] = {20};
    CHECK_ERR(rf_model_decode(m, &kv, slots, big, 1, toks, dec), RF_ERR_RANGE, "more than the cache");
    int32_t badtok = 97;
    CHECK_ERR(rf_model_decode(m, &kv, slots, &one, 1, &badtok, dec), RF_ERR_RANGE, "outside the vocabulary");
    (void)t0;
    rf_kv_cache_free(&kv, m);
    free(full);
    free(dec);
    rf_model_free(m);
}

/* A prefill of more new tokens than RF_DECODE_GROUP_TOKENS (model_internal.h) runs its
 * sequences in groups: five prompts of 300, 150, 100, 400 and 600 tokens (groups {300, 150},
 * {100, 400}, {600}), then one decoding step of all five, through the contiguous cache and the
 * paged one. Each sequence's logits must be those of the same sequence run alone: the same bits
 * where rows are batch-invariant (rf_cpu_batch_invariant_exact), else within 1e-4; and the
 * cache the groups wrote serves the next step. */
static void group_check(rf_arch arch) {
    rf_model_config c = tiny_config(arch, 1, 0);
    c.max_position_embeddings = 1024;
    rf_model *m;
    CHECK_OK(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_model_init_random(m, 9, 0.3f);
    enum { NS = 5, BS = 16, MAXB = 40 };
    const int len[NS] = {300, 150, 100, 400, 600};
    int V = c.vocab_size, T = 0, exact = rf_cpu_batch_invariant_exact();
    for (int i = 0; i < NS; i++) T += len[i];
    CHECK(T > RF_DECODE_GROUP_TOKENS && len[0] + len[1] <= RF_DECODE_GROUP_TOKENS &&
          len[0] + len[1] + len[2] > RF_DECODE_GROUP_TOKENS);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T), next[NS];
    for (int t = 0; t < T; t++) tok[t] = (int32_t)((t * 37 + 11) % V);
    for (int i = 0; i < NS; i++) next[i] = (int32_t)((i * 13 + 5) % V);
    float *all = malloc(sizeof(float) * NS * V * 4), *one = all + NS * V, *step = one + NS * V, *pstep = step + NS * V;
    double worst = 0;
    int differ = 0;
    for (int paged = 0; paged < 2; paged++) {
        rf_kv_cache kv, kv1;
        rf_kv_pool pool, pool1;
        int blocks[NS][MAXB], ones[NS];
        rf_paged_seq seqs[NS];
        if (paged) {
            CHECK_OK(rf_kv_pool_init(&pool, m, NS * MAXB, BS));
            CHECK_OK(rf_kv_pool_init(&pool1, m, MAXB, BS));
            for (int i = 0; i < NS; i++) {
                for (int b = 0; b < MAXB; b++) blocks[i][b] = i * MAXB + b;
                seqs[i] = (rf_paged_seq){blocks[i], 0, len[i]};
            }
            CHECK_OK(rf_model_decode_paged(m, &pool, seqs, NS, tok, all));
        } else {
            int slots[NS] = {4, 2, 0, 1, 3}, counts[NS];
            memcpy(counts, len, sizeof counts);
            CHECK_OK(rf_kv_cache_init(&kv, m, NS, 640));
            CHECK_OK(rf_kv_cache_init(&kv1, m, 1, 640));
            CHECK_OK(rf_model_decode(m, &kv, slots, counts, NS, tok, all));
            for (int i = 0; i < NS; i++) ones[i] = 1;
            CHECK_OK(rf_model_decode(m, &kv, slots, ones, NS, next, step));
            for (int i = 0; i < NS; i++) CHECK(kv.len[slots[i]] == len[i] + 1);
        }
        if (paged) {
            for (int i = 0; i < NS; i++) seqs[i] = (rf_paged_seq){blocks[i], len[i], 1};
            CHECK_OK(rf_model_decode_paged(m, &pool, seqs, NS, next, pstep));
        }
        /* each sequence alone: its prefill, then its step */
        for (int i = 0, off = 0; i < NS; off += len[i], i++) {
            float *sp = malloc(sizeof(float) * V);
            if (paged) {
                int b1[MAXB];
                for (int b = 0; b < MAXB; b++) b1[b] = b;
                rf_paged_seq s1 = {b1, 0, len[i]};
                CHECK_OK(rf_model_decode_paged(m, &pool1, &s1, 1, tok + off, one + (size_t)i * V));
                s1 = (rf_paged_seq){b1, len[i], 1};
                CHECK_OK(rf_model_decode_paged(m, &pool1, &s1, 1, next + i, sp));
            } else {
                int s0 = 0, n1 = len[i], o1 = 1;
                kv1.len[0] = 0;
                CHECK_OK(rf_model_decode(m, &kv1, &s0, &n1, 1, tok + off, one + (size_t)i * V));
                CHECK_OK(rf_model_decode(m, &kv1, &s0, &o1, 1, next + i, sp));
            }
            const float *st = paged ? pstep : step;
            for (int j = 0; j < V; j++) {
                double d1 = fabs(all[(size_t)i * V + j] - one[(size_t)i * V + j]), d2 = fabs(st[(size_t)i * V + j] - sp[j]);
                worst = fmax(worst, fmax(d1, d2));
                differ += d1 != 0.0 || d2 != 0.0;
            }
            free(sp);
        }
        if (paged) {
            rf_kv_pool_free(&pool);
            rf_kv_pool_free(&pool1);
        } else {
            rf_kv_cache_free(&kv, m);
            rf_kv_cache_free(&kv1, m);
        }
    }
    CHECK(exact ? differ == 0 : worst < 1e-4);
    if (exact ? differ != 0 : worst >= 1e-4) fprintf(stderr, "grouped prefill: %d logits differ, max |diff| %g\n", differ, worst);
    free(tok), free(all);
    rf_model_free(m);
}

static void config_errors(void) {
    rf_model_config c;
    const char *base = "{\"model_type\":\"qwen2\",\"hidden_size\":64,\"intermediate_size\":128,"
                       "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                       "\"vocab_size\":100";
    char buf[1024];
    snprintf(buf, sizeof buf, "%s}", base);
    CHECK_OK(rf_config_parse(&c, buf, "cfg.json"));
    CHECK(c.qkv_bias == 1 && c.o_bias == 0 && c.head_dim == 16 && c.tie_word_embeddings == 0);
    snprintf(buf, sizeof buf, "%s,\"use_sliding_window\":true,\"sliding_window\":64}", base);
    CHECK_ERR(rf_config_parse(&c, buf, "cfg.json"), RF_ERR_UNSUPPORTED, "use_sliding_window");
    snprintf(buf, sizeof buf, "%s,\"num_experts\":8}", base);
    CHECK_ERR(rf_config_parse(&c, buf, "cfg.json"), RF_ERR_UNSUPPORTED, "num_experts");
    snprintf(buf, sizeof buf, "%s,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}", base);
    CHECK_ERR(rf_config_parse(&c, buf, "cfg.json"), RF_ERR_UNSUPPORTED, "rope_scaling.rope_type");
    snprintf(buf, sizeof buf, "%s,\"hidden_act\":\"gelu\"}", base);
    CHECK_ERR(rf_config_parse(&c, buf, "cfg.json"), RF_ERR_UNSUPPORTED, "hidden_act");
    CHECK_ERR(rf_config_parse(&c, "{\"model_type\":\"gpt2\"}", "cfg.json"), RF_ERR_UNSUPPORTED,
              "model_type \"gpt2\"");
    CHECK_ERR(rf_config_parse(&c, "{\"model_type\":\"llama\"}", "cfg.json"), RF_ERR_FORMAT,
              "cfg.json: missing required field \"hidden_size\"");
    CHECK_ERR(rf_config_parse(&c, "{oops", "cfg.json"), RF_ERR_FORMAT, "cfg.json: not a valid JSON");
    CHECK_ERR(rf_config_parse(&c, "{\"model_type\":\"qwen2\",\"hidden_size\":64,\"intermediate_size\":128,"
                                  "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":3,"
                                  "\"vocab_size\":100}", "cfg.json"), RF_ERR_FORMAT, "multiple of");
    /* Mistral's sliding window larger than the context changes nothing and is accepted. */
    CHECK_OK(rf_config_parse(&c, "{\"model_type\":\"mistral\",\"hidden_size\":64,\"intermediate_size\":128,"
                                 "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,"
                                 "\"max_position_embeddings\":512,\"sliding_window\":4096}", "m.json"));
    CHECK(c.sliding_window == 0 && c.qkv_bias == 0);
    /* Llama 3.1 rope scaling: low frequencies are divided by the factor, high ones kept. */
    CHECK_OK(rf_config_parse(&c, "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
                                 "\"num_hidden_layers\":1,\"num_attention_heads\":1,\"vocab_size\":10,"
                                 "\"rope_theta\":500000,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
                                 "\"low_freq_factor\":1,\"high_freq_factor\":4,"
                                 "\"original_max_position_embeddings\":8192}}", "l3.json"));
    float inv[32];
    rf_config_inv_freq(&c, inv);
    CHECK_CLOSE(inv[0], 1.0, 0, 1e-6);
    CHECK_CLOSE(inv[31], powf(500000.0f, -62.0f / 64.0f) / 8.0f, 0, 1e-5);
}

/* rf_model_draw from the rows a decode left in the back end (logits NULL) against rf_sample_u on
 * the same rows on the host (the same decode into a fresh cache with host logits): every kind
 * of draw (greedy, temperature, top-k, top-p, both) bit for bit, captured rows equal, and the
 * errors. */
static void draw_check(rf_arch arch) {
    rf_model_config c = tiny_config(arch, 1, 0);
    rf_model *m;
    CHECK_OK(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_model_init_random(m, 7, 0.5f);
    int V = c.vocab_size;
    int slots[3] = {0, 1, 2}, counts[3] = {2, 3, 1};
    int32_t toks[6] = {3, 17, 42, 5, 90, 8};
    float *host = malloc(sizeof(float) * 3 * V), *whole = malloc(sizeof(float) * 2 * V);
    float *work = malloc(sizeof(float) * 2 * V);
    rf_kv_cache kv;
    CHECK_OK(rf_kv_cache_init(&kv, m, 3, 8));
    CHECK_OK(rf_model_decode(m, &kv, slots, counts, 3, toks, host));
    rf_kv_cache_free(&kv, m);
    CHECK_OK(rf_kv_cache_init(&kv, m, 3, 8));
    CHECK_OK(rf_model_decode(m, &kv, slots, counts, 3, toks, NULL));
    rf_draw d[6] = {
        {0, {1, 1.0f, 0, 1.0f}, 0.0},  {1, {0, 0.8f, 0, 1.0f}, 0.37}, {2, {0, 1.0f, 5, 1.0f}, 0.91},
        {1, {0, 1.3f, 0, 0.9f}, 0.12}, {0, {0, 0.6f, 7, 0.8f}, 0.55}, {2, {0, 1.0f, 0, 1.0f}, 0.999},
    };
    int capture[2] = {2, 0};
    float cap_inv_temp[2] = {1.0f / 0.7f, 1.0f}, cap_lse[2] = {NAN, NAN};
    int32_t picks[6];
    float logp[6];
    CHECK_OK(rf_model_draw(m, 3, d, 6, picks, logp, capture, 2, whole, cap_inv_temp, cap_lse));
    CHECK(memcmp(whole, host + 2 * V, sizeof(float) * V) == 0 && memcmp(whole + V, host, sizeof(float) * V) == 0);
    for (int i = 0; i < 2; i++) { /* the back end's log-sum-exp of each captured row */
        float want = rf_row_lse(host + (size_t)capture[i] * V, V, cap_inv_temp[i], NULL);
        CHECK(memcmp(&cap_lse[i], &want, sizeof want) == 0);
    }
    for (int i = 0; i < 6; i++) {
        float lp;
        int32_t want = rf_sample_u(host + (size_t)d[i].row * V, V, &d[i].s, d[i].u, &lp, work);
        CHECK(picks[i] == want && memcmp(&logp[i], &lp, sizeof lp) == 0);
        if (picks[i] != want) fprintf(stderr, "draw %d: %d, rf_sample_u %d\n", i, picks[i], want);
    }
    rf_draw bad = {3, {1, 1.0f, 0, 1.0f}, 0.0};
    CHECK_ERR(rf_model_draw(m, 3, &bad, 1, picks, logp, NULL, 0, NULL, NULL, NULL), RF_ERR_RANGE, "row 3 outside the step's 3 rows");
    CHECK_ERR(rf_model_draw(m, 4, d, 1, picks, logp, NULL, 0, NULL, NULL, NULL), RF_ERR_ARG, "the last decode left 3");
    int one = 1;
    int32_t t = 9;
    CHECK_OK(rf_model_decode(m, &kv, slots, &one, 1, &t, host)); /* rows to the host: none left */
    CHECK_ERR(rf_model_draw(m, 1, d, 1, picks, logp, NULL, 0, NULL, NULL, NULL), RF_ERR_ARG, "the last decode left 0");
    rf_kv_cache_free(&kv, m);
    free(host), free(whole), free(work);
    rf_model_free(m);
}

int main(void) {
    config_errors();
    draw_check(RF_ARCH_QWEN2);
    grad_check(RF_ARCH_QWEN2, 1, 0);
    grad_check(RF_ARCH_QWEN3, 0, 0);
    grad_check(RF_ARCH_LLAMA, 0, 0);
    grad_check(RF_ARCH_QWEN2, 0, 1);
    packing_check(RF_ARCH_QWEN3);
    packing_check(RF_ARCH_QWEN2);
    kv_cache_check(RF_ARCH_QWEN2);
    kv_cache_check(RF_ARCH_QWEN3);
    decode_reserve_check();
    group_check(RF_ARCH_QWEN2);
    group_check(RF_ARCH_QWEN3);
    share_check(RF_ARCH_QWEN3, 0, 0);
    share_check(RF_ARCH_LLAMA, 1, 0);
    share_check(RF_ARCH_QWEN2, 0, 1);
    return rf_test_finish("test_model");
}
