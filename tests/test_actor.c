/* The actor's updates on a tiny model: gradient accumulation over micro-batches equals one big
 * batch under every loss aggregation mode (same parameters after the step, within fp32
 * summation-order noise); ratio = 1 at the first step (prox = current policy) so the clip
 * fraction is 0; SFT lowers the response loss; the critic's value loss falls. */
#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "test_util.h"
#include "train_util.h"


#define NS 6
static void make_samples(rf_train_sample *s) {
    for (int i = 0; i < NS; i++) {
        memset(&s[i], 0, sizeof s[i]);
        s[i].n_prompt = 2 + i % 3, s[i].n_resp = 1 + (i * 5) % 4;
        int len = s[i].n_prompt + s[i].n_resp;
        s[i].tokens = malloc(sizeof(int32_t) * (size_t)len);
        for (int t = 0; t < len; t++) s[i].tokens[t] = (i * 7 + t * 3) % 50;
        RF_ASSERT(rf_train_sample_alloc(&s[i]) == RF_OK);
        for (int t = 0; t < s[i].n_resp; t++) {
            s[i].adv[t] = (i % 2 ? 1.0f : -1.0f) * (0.5f + 0.1f * t);
            s[i].returns[t] = 0.3f * i;
        }
        s[i].group = i / 3;
    }
}

static void accumulation(rf_loss_agg agg) {
    rf_model *a = rf_test_tiny_model(3, 0), *b = rf_test_tiny_model(3, 0);
    rf_train_sample s[NS];
    make_samples(s);
    float *prox[NS], *ent[NS];
    for (int i = 0; i < NS; i++) prox[i] = s[i].prox_logp, ent[i] = s[i].entropy;
    CHECK_OK(rf_actor_logprobs(a, s, NS, 1000, 1.0f, prox, ent));
    for (int i = 0; i < NS; i++) memcpy(s[i].behav_logp, s[i].prox_logp, sizeof(float) * (size_t)s[i].n_resp);
    rf_optim_opts oo = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .grad_clip = 0};
    rf_update_opts uo = {.pg = {0.2f, 0.2f, 0, 0, 5, 0, RF_KL_K3, 0.01f}, .agg = agg, .max_resp_len = 4,
                         .epochs = 1, .mini_batches = 1, .micro_tokens = 1000, .inv_temp = 1.0f, .shuffle_seed = 1};
    rf_update_stats sa = {0}, sb = {0};
    CHECK_OK(rf_actor_update(a, &oo, &uo, s, NS, &sa));
    uo.micro_tokens = 1; /* every sample in its own micro-batch */
    CHECK_OK(rf_actor_update(b, &oo, &uo, s, NS, &sb));
    /* Compare the accumulated gradients (left in m->grads by the step): Adam's first step is
     * ~lr * sign(g), which would amplify noise on near-zero gradients. fp32 summation order:
     * 1e-5 of the largest gradient. */
    double maxd = 0, maxg = 0;
    for (size_t i = 0; i < a->n_params; i++) {
        maxd = fmax(maxd, fabs(a->grads[i] - b->grads[i]));
        maxg = fmax(maxg, fabs(a->grads[i]));
    }
    CHECK(maxg > 0 && maxd < 1e-5 * maxg);
    if (!(maxd < 1e-5 * maxg)) fprintf(stderr, "agg %d: max grad diff %g of %g\n", agg, maxd, maxg);
    CHECK_CLOSE(sa.grad_norm, sb.grad_norm, 1e-6, 1e-4);
    CHECK(sa.pg.clipped == 0); /* prox = current: ratio 1 */
    CHECK_CLOSE(sa.pg.ratio / sa.pg.tokens, 1.0, 1e-6, 0);
    for (int i = 0; i < NS; i++) rf_train_sample_free(&s[i]);
    rf_model_free(a), rf_model_free(b);
}

static void sft_and_critic(void) {
    rf_model *m = rf_test_tiny_model(5, 0), *c = rf_test_tiny_model(6, 1);
    rf_train_sample s[NS];
    make_samples(s);
    rf_optim_opts oo = {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .grad_clip = 1.0f};
    double first = 0, loss = 0, gn;
    for (int step = 0; step < 30; step++) {
        CHECK_OK(rf_sft_update(m, &oo, 64, s, NS, &loss, &gn));
        if (step == 0) first = loss;
    }
    CHECK(loss < 0.5 * first);
    float *vals[NS];
    for (int i = 0; i < NS; i++) vals[i] = s[i].values;
    rf_update_opts uo = {.agg = RF_AGG_TOKEN_MEAN, .epochs = 1, .mini_batches = 1, .micro_tokens = 64,
                         .value_clip = 100.0f, .shuffle_seed = 2};
    double v0 = 0;
    for (int step = 0; step < 30; step++) {
        CHECK_OK(rf_critic_values(c, s, NS, 64, vals));
        rf_update_stats st = {0};
        CHECK_OK(rf_critic_update(c, &oo, &uo, s, NS, &st));
        if (step == 0) v0 = st.value_loss;
        if (step == 29) CHECK(st.value_loss < 0.2 * v0);
    }
    for (int i = 0; i < NS; i++) rf_train_sample_free(&s[i]);
    rf_model_free(m), rf_model_free(c);
}

int main(void) {
    accumulation(RF_AGG_TOKEN_MEAN);
    accumulation(RF_AGG_SEQ_MEAN_TOKEN_SUM);
    accumulation(RF_AGG_SEQ_MEAN_TOKEN_MEAN);
    accumulation(RF_AGG_SEQ_MEAN_TOKEN_SUM_NORM);
    sft_and_critic();
    return rf_test_finish("test_actor");
}
