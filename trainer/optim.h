/* The optimizer step: learning-rate schedule (linear warmup, then constant or cosine decay),
 * global gradient-norm clipping, AdamW over every parameter view (no weight decay on norms and
 * biases), on the model's back end. */
#ifndef RF_OPTIM_H
#define RF_OPTIM_H

#include "model/model.h"
#include "model/model_tp.h"

typedef struct rf_optim_opts {
    float lr, min_lr_ratio;
    int warmup_steps, total_steps;
    int cosine;              /* 0 constant after warmup, 1 cosine to lr * min_lr_ratio */
    float beta1, beta2, eps, weight_decay;
    float grad_clip;         /* max global norm; <= 0 disables clipping */
} rf_optim_opts;

/* Learning rate at optimizer step `step` (0-based). */
float rf_lr_at(const rf_optim_opts *o, int step);

/* Scales m->grads so the global L2 norm is at most grad_clip and applies one AdamW step at the
 * scheduled rate (m->opt_step counts steps). Returns the norm before clipping in *grad_norm.
 * A non-finite norm applies no update and returns RF_ERR_RANGE (gradients are left as they are;
 * the run stops with that error, which says so). */
rf_status rf_optim_step(rf_model *m, const rf_optim_opts *o, double *grad_norm, float *lr_used);

/* rf_optim_step with the global gradient norm given instead of computed from m->grads: for a
 * model that holds one shard of the parameters (tensor parallelism: the norm is the whole
 * model's, rf_model_tp_grad_sumsq), so that every shard clips by the same factor. Same
 * errors. */
rf_status rf_optim_step_norm(rf_model *m, const rf_optim_opts *o, double norm, float *lr_used);

/* rf_optim_step on this rank's shard tp->m of a tensor-parallel model: the norm is the whole
 * model's (rf_model_tp_grad_sumsq, one allgather over the group; every rank of the group calls
 * it), AdamW runs on the shard. Same errors, and comm's. */
rf_status rf_optim_step_tp(rf_model_tp *tp, const rf_optim_opts *o, double *grad_norm, float *lr_used);

#endif
