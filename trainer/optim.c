#include "trainer/optim.h"

#include <math.h>

#include "model/lora.h"

float rf_lr_at(const rf_optim_opts *o, int step) {
    if (o->warmup_steps > 0 && step < o->warmup_steps)
        return o->lr * (float)(step + 1) / (float)o->warmup_steps;
    if (!o->cosine || o->total_steps <= o->warmup_steps) return o->lr;
    double p = (double)(step - o->warmup_steps) / (double)(o->total_steps - o->warmup_steps);
    p = p > 1.0 ? 1.0 : p;
    double min_lr = o->lr * o->min_lr_ratio;
    return (float)(min_lr + 0.5 * (o->lr - min_lr) * (1.0 + cos(M_PI * p)));
}

rf_status rf_optim_step(rf_model *m, const rf_optim_opts *o, double *grad_norm, float *lr_used) {
    double norm = sqrt(m->k->sum_squares(m->grads, m->n_params - m->n_frozen));
    *grad_norm = norm;
    return rf_optim_step_norm(m, o, norm, lr_used);
}

rf_status rf_optim_step_tp(rf_model_tp *tp, const rf_optim_opts *o, double *grad_norm, float *lr_used) {
    double sumsq = 0;
    RF_TRY(rf_model_tp_grad_sumsq(tp, &sumsq));
    *grad_norm = sqrt(sumsq);
    return rf_optim_step_norm(tp->m, o, *grad_norm, lr_used);
}

rf_status rf_optim_step_norm(rf_model *m, const rf_optim_opts *o, double norm, float *lr_used) {
    const rf_kernels *k = m->k;
    if (!isfinite(norm))
        return rf_error(RF_ERR_RANGE, "gradient norm is %g (a non-finite loss, advantage or reward): the update "
                        "is not applied and training stops", norm);
    /* clipping is folded into the AdamW pass (grad_scale), not a pass of its own */
    float gs = o->grad_clip > 0 && norm > o->grad_clip ? (float)(o->grad_clip / (norm + 1e-6)) : 1.0f;
    float lr = rf_lr_at(o, m->opt_step);
    int step = ++m->opt_step;
    int n_views;
    const rf_param_view *views = rf_model_train_views(m, &n_views); /* the adapters under LoRA */
    for (int i = 0; i < n_views; i++) {
        const rf_param_view *v = &views[i];
        size_t g = v->offset - m->n_frozen; /* grads and moments start at the first trained float */
        k->adamw(m->params + v->offset, m->grads + g, m->opt_m + g, m->opt_v + g, v->numel, lr,
                 o->beta1, o->beta2, o->eps,
                 v->no_decay ? 0.0f : o->weight_decay, step, gs);
    }
    k->weights_updated();
    if (lr_used) *lr_used = lr;
    return RF_OK;
}
