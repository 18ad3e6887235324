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
    /* the parameters: the base's floats alone (under LoRA the adapters after them stay as they
     * are: a device staging buffer of the whole would write zeros over them) */
    size_t n = !dst && tp->m->n_frozen ? tp->m->n_frozen : tp->m->n_params;
    float *host = NULL, *to = dst ? dst : tp->m->params;
    rf_status s = rf__host_staging(tp->m->k, to, n, &host, dir); /* the CPU's: straight into place */
    if (s == RF_OK && !suffix) s = rf_model_check_unused(tp->m, st, dir);
    if (s == RF_OK) s = read_blocks(tp, st, host, dir, suffix);
    rf__host_staging_done(tp->m->k, to, n, host, s == RF_OK);
    rf_st_close(st);
    return s;
}

/* View i's place in the buffer: its offset, and the block it holds, (r0, c0) and width w, of
 * its tensor seen as a matrix (rows, cols) as rf_st_read_block_f32 sees it; *count floats. */
static void view_block(const rf_param_view *v, const rf_shard *sh, size_t *offset, size_t *count, int64_t *r0,
                       int64_t *c0, int64_t *w) {
    if (sh) {
        *offset = sh->offset, *r0 = sh->r0, *c0 = sh->c0, *w = sh->c1 - sh->c0;
        *count = (size_t)(sh->r1 - sh->r0) * (size_t)*w;
        return;
    }
    *offset = v->offset, *count = v->numel, *r0 = 0, *c0 = 0, *w = v->ndim > 1 ? v->shape[1] : 1;
}

rf_status rf_model_read_range(const rf_param_view *views, int n_views, const rf_shard *shards, const rf_safetensors *st,
                              const char *suffix, size_t a, size_t n, float *dst) {
    size_t end = 0, off, cnt;
    int64_t r0, c0, w;
    for (int i = 0; i < n_views; i++) {
        view_block(&views[i], shards ? &shards[i] : NULL, &off, &cnt, &r0, &c0, &w);
        if (off + cnt > end) end = off + cnt;
    }
    if (a + n > end || a + n < a) return rf_error(RF_ERR_ARG, "floats [%zu, %zu) of a buffer of %zu", a, a + n, end);
    for (int i = 0; i < n_views; i++) {
        const rf_param_view *v = &views[i];
        view_block(v, shards ? &shards[i] : NULL, &off, &cnt, &r0, &c0, &w);
        size_t lo = off > a ? off : a, hi = off + cnt < a + n ? off + cnt : a + n;
        if (lo >= hi || w <= 0) continue;
        char name[RF_MAX_NAME + 32];
        snprintf(name, sizeof name, "%s%s", v->name, suffix ? suffix : "");
        /* elements [e, f) of the block (row-major, w wide): a partial first row, whole rows,
         * a partial last row */
        int64_t e = (int64_t)(lo - off), f = (int64_t)(hi - off);
        float *out = dst + (lo - a);
        while (e < f) {
            int64_t r = e / w, c = e % w, r1, c1;
            if (c != 0 || f - e < w) r1 = r + 1, c1 = f - r * w < w ? f - r * w : w; /* within row r */
            else r1 = f / w, c1 = w;                                                 /* whole rows */
            RF_TRY(rf_st_read_block_f32(st, name, out, v->shape, v->ndim, r0 + r, r0 + r1, c0 + c, c0 + c1));
            int64_t got = (r1 - r) * (c1 - c);
            out += got, e += got;
        }
    }
    return RF_OK;
}
