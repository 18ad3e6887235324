/* The loss mask of multi-turn episodes (rf_train_sample.loss_mask, rf_adv_seq.mask): tokens of an
 * environment's observations are out of the loss and of the advantages.
 *  - GAE and REINFORCE++ over a masked sequence equal, at the tokens of mask 1, the same
 *    estimators over the sequence with the masked tokens removed (an independent run of
 *    rf_advantages), bit for bit, and give 0 at the masked ones; whitening counts mask-1 tokens;
 *    GRPO's per-episode reward adds the turn rewards (token_rewards) to the sequence reward;
 *  - the actor's gradient with a mask equals the gradient without one where the masked tokens
 *    have advantage 0 and, under token-mean, the others are scaled by all / unmasked tokens (at
 *    the first step the ratio is 1 and the clipped surrogate's gradient is linear in the
 *    advantage): within 1e-5 of the largest gradient (fp32 order), seq-mean-token-sum exactly
 *    the same up to the same noise; the token count excludes masked tokens;
 *  - a sample whose mask is all 0 is refused. */
#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "controller/advantages.h"
#include "test_util.h"
#include "train_util.h"

enum { T = 9 };
static const uint8_t MASK[T] = {1, 1, 0, 0, 0, 1, 1, 0, 1};

static void advantages_skip_masked(rf_adv_kind kind) {
    float kl[T], val[T], tr[T], adv[T], ret[T];
    float ckl[T], cval[T], ctr[T], cadv[T], cret[T];
    int m = 0;
    for (int t = 0; t < T; t++) {
        kl[t] = 0.01f * (float)(t + 1), val[t] = 0.1f * (float)(t % 4) - 0.2f, tr[t] = t == 1 ? 0.5f : t == 6 ? 0.25f : 0;
        if (MASK[t]) ckl[m] = kl[t], cval[m] = val[t], ctr[m] = tr[t], m++;
    }
    rf_adv_seq s = {T, 0, 1.5f, kl, val, adv, ret, tr, MASK};
    rf_adv_seq c = {m, 0, 1.5f, ckl, cval, cadv, cret, ctr, NULL};
    rf_adv_opts o = {kind, 0.9f, 0.8f, 0.1f, 1, 1e-6f};
    CHECK_OK(rf_advantages(&o, &s, 1));
    CHECK_OK(rf_advantages(&o, &c, 1));
    int ok = 1;
    for (int t = 0, k = 0; t < T; t++) {
        if (MASK[t]) ok &= adv[t] == cadv[k] && ret[t] == cret[k], k++;
        else ok &= adv[t] == 0.0f && ret[t] == 0.0f;
    }
    CHECK(ok);
    printf("%s with a mask = on the unmasked tokens alone, exact\n", kind == RF_ADV_GAE ? "GAE" : "REINFORCE++");
}

static void grpo_sums_turn_rewards(void) {
    float tr0[3] = {0.5f, 0, 0.25f}, adv[2][3], ret[2][3];
    uint8_t m[3] = {1, 0, 1};
    rf_adv_seq s[2] = {{3, 0, 1.0f, NULL, NULL, adv[0], ret[0], tr0, m}, {3, 0, 0.0f, NULL, NULL, adv[1], ret[1], NULL, m}};
    rf_adv_opts o = {RF_ADV_DR_GRPO, 1, 1, 0, 0, 1e-6f};
    CHECK_OK(rf_advantages(&o, s, 2));
    /* episode rewards 1.75 and 0: Dr. GRPO advantages +-0.875 */
    CHECK(adv[0][0] == 0.875f && adv[1][2] == -0.875f && ret[0][0] == 1.75f);
}

#define NS 4
static void make_samples(rf_train_sample *s, int masked) {
    for (int i = 0; i < NS; i++) {
        memset(&s[i], 0, sizeof s[i]);
        s[i].n_prompt = 2 + i % 2, s[i].n_resp = T;
        int len = s[i].n_prompt + T;
        s[i].tokens = malloc(sizeof(int32_t) * (size_t)len);
        for (int t = 0; t < len; t++) s[i].tokens[t] = (i * 7 + t * 3) % 50;
        RF_ASSERT(rf_train_sample_alloc(&s[i]) == RF_OK);
        for (int t = 0; t < T; t++) s[i].adv[t] = (i % 2 ? 1.0f : -1.0f) * (0.5f + 0.1f * t);
        if (masked) {
            s[i].loss_mask = malloc(T);
            memcpy(s[i].loss_mask, MASK, T);
        }
    }
}

/* The gradient of a masked batch against its unmasked equivalent under agg. */
static void actor_mask(rf_loss_agg agg) {
    rf_model *a = rf_test_tiny_model(3, 0), *b = rf_test_tiny_model(3, 0);
    rf_train_sample sa[NS], sb[NS];
    make_samples(sa, 1), make_samples(sb, 0);
    int in = 0;
    for (int t = 0; t < T; t++) in += MASK[t];
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < T; t++)
            sb[i].adv[t] = !MASK[t] ? 0.0f : agg == RF_AGG_TOKEN_MEAN ? sb[i].adv[t] * (float)T / (float)in : sb[i].adv[t];
    rf_optim_opts oo = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    rf_update_opts uo = {.pg = {0.2f, 0.2f, 0, 0, 5, 0, RF_KL_K3, 0}, .agg = agg, .max_resp_len = T, .epochs = 1,
                         .mini_batches = 1, .micro_tokens = 1000, .inv_temp = 1.0f, .shuffle_seed = 1,
                         .prox_from_forward = 1};
    rf_update_stats xa = {0}, xb = {0};
    CHECK_OK(rf_actor_update(a, &oo, &uo, sa, NS, &xa));
    CHECK_OK(rf_actor_update(b, &oo, &uo, sb, NS, &xb));
    double maxd = 0, maxg = 0;
    for (size_t i = 0; i < a->n_params; i++) {
        maxd = fmax(maxd, fabs(a->grads[i] - b->grads[i]));
        maxg = fmax(maxg, fabs(a->grads[i]));
    }
    CHECK(maxg > 0 && maxd < 1e-5 * maxg);
    CHECK(xa.tokens == NS * in && xa.pg.tokens == NS * in && xb.tokens == NS * T);
    printf("actor, %s: masked gradient = unmasked with those advantages 0 (max diff %.3g of %.3g)\n",
           agg == RF_AGG_TOKEN_MEAN ? "token-mean" : "seq-mean-token-sum", maxd, maxg);
    memset(sa[0].loss_mask, 0, T);
    CHECK_ERR(rf_actor_update(a, &oo, &uo, sa, NS, &xa), RF_ERR_ARG, "sample 0 has no token in the loss");
    for (int i = 0; i < NS; i++) rf_train_sample_free(&sa[i]), rf_train_sample_free(&sb[i]);
    rf_model_free(a), rf_model_free(b);
}

int main(void) {
    advantages_skip_masked(RF_ADV_GAE);
    advantages_skip_masked(RF_ADV_REINFORCE_PP);
    grpo_sums_turn_rewards();
    actor_mask(RF_AGG_TOKEN_MEAN);
    actor_mask(RF_AGG_SEQ_MEAN_TOKEN_SUM);
    return rf_test_finish("test_loss_mask");
}
