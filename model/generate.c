#include "model/generate.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

const char *rf_finish_name(rf_finish f) {
    return f == RF_FINISH_EOS ? "eos" : f == RF_FINISH_STOP ? "stop" : "length";
}

void rf_gen_output_free(rf_gen_output *o) {
    if (!o) return;
    free(o->tokens);
    free(o->logprobs);
    free(o->text);
    memset(o, 0, sizeof *o);
}

static int is_eos(const rf_gen_params *p, int32_t t) {
    for (int i = 0; i < p->n_eos; i++)
        if (p->eos_ids[i] == t) return 1;
    return 0;
}

/* Decodes the output so far; when a stop string occurs, cuts the text before it and returns 1. */
static rf_status update_text(const rf_tokenizer *tok, const rf_gen_params *p, rf_gen_output *o,
                             int *stopped) {
    *stopped = 0;
    if (!tok) return RF_OK;
    char *text = NULL;
    size_t len = 0;
    /* Models pad vocab_size past the tokenizer (Qwen2.5: 151936 vs 151665); ids without a token
     * decode to nothing, as in transformers. */
    int32_t *known = malloc(sizeof(int32_t) * (size_t)(o->n_tokens + 1));
    if (!known) return rf_error(RF_ERR_NOMEM, "generate: out of memory");
    int n = 0;
    for (int i = 0; i < o->n_tokens; i++)
        if (rf_tokenizer_id_to_token(tok, o->tokens[i])) known[n++] = o->tokens[i];
    rf_status s = rf_tokenizer_decode(tok, known, n, 1, &text, &len);
    free(known);
    RF_TRY(s);
    /* The text may hold NULs (a token decoding to U+0000): search and cut by length. */
    for (int i = 0; i < p->n_stop; i++) {
        const char *hit = rf_memfind(text, len, p->stop[i], strlen(p->stop[i]));
        if (hit) {
            len = (size_t)(hit - text);
            text[len] = '\0';
            *stopped = 1;
        }
    }
    free(o->text);
    o->text = text;
    o->text_len = len;
    return RF_OK;
}

typedef struct gen_state {
    int *slots, *active;
    rf_rng *rng;
    rf_draw *draws;
    int32_t *next, *pick;
    float *pick_lp;
} gen_state;

static rf_status state_init(gen_state *g, int n) {
    g->slots = calloc((size_t)n, sizeof(int));
    g->active = calloc((size_t)n, sizeof(int));
    g->rng = calloc((size_t)n, sizeof(rf_rng));
    g->draws = calloc((size_t)n, sizeof(rf_draw));
    g->next = calloc((size_t)n, sizeof(int32_t));
    g->pick = calloc((size_t)n, sizeof(int32_t));
    g->pick_lp = calloc((size_t)n, sizeof(float));
    if (!g->slots || !g->active || !g->rng || !g->draws || !g->next || !g->pick || !g->pick_lp)
        return rf_error(RF_ERR_NOMEM, "generate: out of memory for %d sequences", n);
    return RF_OK;
}

static void state_free(gen_state *g) {
    free(g->slots);
    free(g->active);
    free(g->rng);
    free(g->draws);
    free(g->next);
    free(g->pick);
    free(g->pick_lp);
}

/* Samples one token for each sequence listed in ids (n_ids) from the rows the model's last
 * decode left on its back end (rf_model_draw; each sequence's uniform from its own generator,
 * as rf_sample takes it), appends it and retires finished sequences. Returns how many are
 * still active. */
static rf_status sample_step(rf_model *m, const rf_tokenizer *tok, const rf_gen_params *p,
                             gen_state *g, const int *ids, int n_ids, rf_gen_output *out,
                             int *n_active) {
    *n_active = 0;
    for (int r = 0; r < n_ids; r++)
        g->draws[r] = (rf_draw){r, p->sampling,
                                p->sampling.greedy ? 0.0 : (double)rf_rng_uniform(&g->rng[ids[r]])};
    RF_TRY(rf_model_draw(m, n_ids, g->draws, n_ids, g->pick, g->pick_lp, NULL, 0, NULL, NULL, NULL));
    for (int r = 0; r < n_ids; r++) {
        int i = ids[r];
        rf_gen_output *o = &out[i];
        float lp = g->pick_lp[r];
        int32_t t = g->pick[r];
        o->tokens[o->n_tokens] = t;
        o->logprobs[o->n_tokens++] = lp;
        int stopped = 0;
        if (p->n_stop) RF_TRY(update_text(tok, p, o, &stopped));
        if (is_eos(p, t)) o->finish = RF_FINISH_EOS;
        else if (stopped) o->finish = RF_FINISH_STOP;
        g->active[i] = !is_eos(p, t) && !stopped && o->n_tokens < p->max_new_tokens;
        g->next[i] = t;
        *n_active += g->active[i];
    }
    return RF_OK;
}

static rf_status run(rf_model *m, const rf_tokenizer *tok, const int32_t *const *prompts,
                     const int *lens, int n, const rf_gen_params *p, rf_gen_output *out,
                     int progress, rf_kv_cache *kv, gen_state *g) {
    int total = 0;
    for (int i = 0; i < n; i++) total += lens[i];
    int32_t *packed = malloc(sizeof(int32_t) * (size_t)(total > n ? total : n));
    int *ids = malloc(sizeof(int) * (size_t)n), *ones = malloc(sizeof(int) * (size_t)n);
    if (!packed || !ids || !ones) {
        free(packed), free(ids), free(ones);
        return rf_error(RF_ERR_NOMEM, "generate: out of memory");
    }
    for (int i = 0, off = 0; i < n; i++) {
        memcpy(packed + off, prompts[i], sizeof(int32_t) * (size_t)lens[i]);
        off += lens[i];
        g->slots[i] = ids[i] = i;
        ones[i] = 1;
        rf_rng_seed(&g->rng[i], p->seed + (uint64_t)i);
    }
    double t0 = rf_time_now();
    int n_active = 0;
    rf_status s = rf_model_decode(m, kv, g->slots, lens, n, packed, NULL);
    if (s == RF_OK) s = sample_step(m, tok, p, g, ids, n, out, &n_active);
    for (int step = 1; s == RF_OK && n_active > 0; step++) {
        int k = 0;
        for (int i = 0; i < n; i++)
            if (g->active[i]) {
                ids[k] = i;
                g->slots[k] = i;
                packed[k++] = g->next[i];
            }
        s = rf_model_decode(m, kv, g->slots, ones, k, packed, NULL);
        if (s == RF_OK) s = sample_step(m, tok, p, g, ids, k, out, &n_active);
        if (progress) rf_progress("generate", step, p->max_new_tokens - 1, t0, "steps");
    }
    free(packed), free(ids), free(ones);
    return s;
}

rf_status rf_generate(rf_model *m, const rf_tokenizer *tok, const int32_t *const *prompts,
                      const int *prompt_lens, int n, const rf_gen_params *p, rf_gen_output *out,
                      int progress) {
    RF_TRY(rf_sampling_validate(&p->sampling));
    if (p->max_new_tokens <= 0)
        return rf_error(RF_ERR_ARG, "max_new_tokens must be >= 1, got %d", p->max_new_tokens);
    if (p->n_stop && !tok) return rf_error(RF_ERR_ARG, "stop strings need a tokenizer");
    int max_prompt = 0;
    for (int i = 0; i < n; i++) {
        if (prompt_lens[i] <= 0) return rf_error(RF_ERR_ARG, "prompt %d is empty", i);
        max_prompt = prompt_lens[i] > max_prompt ? prompt_lens[i] : max_prompt;
    }
    int limit = rf_config_max_seq(&m->cfg);
    if (max_prompt + p->max_new_tokens > limit)
        return rf_error(RF_ERR_RANGE, "prompt (%d tokens) + max_new_tokens (%d) exceeds the model's "
                        "limit of %d positions", max_prompt, p->max_new_tokens, limit);
    memset(out, 0, sizeof *out * (size_t)n);
    for (int i = 0; i < n; i++) {
        out[i].tokens = malloc(sizeof(int32_t) * (size_t)p->max_new_tokens);
        out[i].logprobs = malloc(sizeof(float) * (size_t)p->max_new_tokens);
        if (!out[i].tokens || !out[i].logprobs) return rf_error(RF_ERR_NOMEM, "generate: out of memory");
    }
    rf_kv_cache kv;
    gen_state g = {0};
    rf_status s = rf_kv_cache_init(&kv, m, n, max_prompt + p->max_new_tokens);
    if (s == RF_OK) s = state_init(&g, n);
    if (s == RF_OK) s = run(m, tok, prompts, prompt_lens, n, p, out, progress, &kv, &g);
    for (int i = 0; s == RF_OK && i < n; i++) {
        int stopped;
        if (!p->n_stop || !out[i].text) s = update_text(tok, p, &out[i], &stopped);
    }
    state_free(&g);
    rf_kv_cache_free(&kv, m);
    return s;
}
