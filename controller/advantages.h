/* Advantage estimators and reward shaping, exactly as ../shared/ALGORITHMS.md defines them:
 * GAE (PPO), GRPO, Dr. GRPO, RLOO, REINFORCE++, mask-aware whitening, k1 KL penalty in the
 * reward with a fixed or adaptive coefficient. The controller runs these on host arrays; they do
 * no tensor math beyond that. */
#ifndef RF_ADVANTAGES_H
#define RF_ADVANTAGES_H

#include <stdint.h>

#include "common/status.h"

typedef enum rf_adv_kind {
    RF_ADV_GAE,          /* PPO with a critic */
    RF_ADV_GRPO,         /* (r - mean_g) / (std_g + eps) */
    RF_ADV_DR_GRPO,      /* r - mean_g */
    RF_ADV_RLOO,         /* r - mean of the other G-1 */
    RF_ADV_REINFORCE_PP, /* discounted return of token rewards, whitened over the batch */
} rf_adv_kind;

/* Parses "ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp". */
rf_status rf_adv_kind_parse(const char *name, rf_adv_kind *out);

/* One response in the batch, host arrays of its n response tokens. */
typedef struct rf_adv_seq {
    int n;                 /* response tokens */
    int group;             /* samples of one prompt share a group id */
    float reward;          /* sequence reward (on the last token) */
    const float *kl;       /* (n) k1 = logp_old - logp_ref per token, or NULL */
    const float *values;   /* (n) critic values V_t (GAE only) */
    float *adv;            /* (n) out */
    float *returns;        /* (n) out (GAE, REINFORCE++: targets for the critic / logging) */
    const float *token_rewards; /* (n) rewards at each token (reward programs), or NULL: GAE and
                                   REINFORCE++ add them to r_t; the group estimators add their
                                   sum to the sequence reward */
    const uint8_t *mask;   /* (n) 0: an environment's observation inside a multi-turn episode,
                              or NULL (every token 1). GAE and REINFORCE++ run over the tokens of
                              mask 1 only, as if the others were not there (the sequence reward
                              on the last of them; 0 advantage and return at the others);
                              whitening counts them only */
} rf_adv_seq;

typedef struct rf_adv_opts {
    rf_adv_kind kind;
    float gamma, lam;       /* GAE / REINFORCE++ discount; GAE lambda */
    float kl_coef;          /* beta of the k1 penalty in the token rewards (0 = none) */
    int whiten;             /* GAE: whiten advantages over the batch (mask-aware) */
    float eps;              /* GRPO std epsilon (1e-6) */
} rf_adv_opts;

/* Computes advantages (and returns) for n sequences. Groups are identified by `group`; every
 * sequence of a group must be present. */
rf_status rf_advantages(const rf_adv_opts *o, rf_adv_seq *seqs, int n);

/* Whitens x over all tokens of all sequences: (x - mean) / sqrt(var_unbiased + 1e-8). */
void rf_whiten(rf_adv_seq *seqs, int n, int use_returns);

/* Adaptive KL controller (Ziegler et al. 2019, as in verl/OpenRLHF): after a step with observed
 * KL `kl` over `n_steps` samples, beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon. */
typedef struct rf_kl_ctl {
    float beta, target;
    int horizon;
    int adaptive;
} rf_kl_ctl;
void rf_kl_ctl_update(rf_kl_ctl *c, float kl, int n_steps);

#endif
