/* A tensor-parallel shard read straight from a Hugging Face checkpoint (model/model_tp.h):
 * each rank maps the safetensors files and converts only the blocks it holds
 * (rf_st_read_block_f32), so no rank ever holds the whole model to start from it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "model/model_internal.h"
#include "model/model_tp.h"
#include "model/safetensors.h"

/* Reads every parameter's block from st into host (the shard's local layout). */
static rf_status read_blocks(const rf_model_tp *tp, const rf_safetensors *st, float *host, const char *dir,
                             const char *suffix) {
    for (int i = 0; i < tp->n_full_views; i++) {
        const rf_param_view *v = &tp->full_views[i];
        const rf_shard *sh = &tp->shards[i];
        char name[RF_MAX_NAME + 32];
        snprintf(name, sizeof name, "%s%s", v->name, suffix ? suffix : "");
        if (!suffix && strcmp(v->name, "score.weight") == 0 && !rf_st_find(st, name)) {
            /* a fresh critic from a policy checkpoint, as rf_model_load starts one */
            if (tp->t == 0) rf_log_info("%s: no score.weight; the value head starts at zero", dir);
            memset(host + sh->offset, 0, (size_t)(sh->r1 - sh->r0) * (size_t)(sh->c1 - sh->c0) * sizeof(float));
            continue;
        }
        RF_TRY(rf_st_read_block_f32(st, name, host + sh->offset, v->shape, v->ndim, sh->r0, sh->r1, sh->c0,
                                    sh->c1));
    }
    return RF_OK;
}

rf_status rf_model_tp_load(rf_model_tp *tp, const char *dir, float *dst, const char *suffix) {
    rf_safetensors *st = NULL;
    RF_TRY(rf_st_open_dir(&st, dir));
    size_t n = tp->m->n_params;
    float *host = NULL, *to = dst ? dst : tp->m->params;
    rf_status s = rf__host_staging(tp->m->k, to, n, &host, dir); /* the CPU's: straight into place */
    if (s == RF_OK && !suffix) s = rf_model_check_unused(tp->m, st, dir);
    if (s == RF_OK) s = read_blocks(tp, st, host, dir, suffix);
    rf__host_staging_done(tp->m->k, to, n, host, s == RF_OK);
    rf_st_close(st);
    return s;
}
