/* Validation: greedy generation on held-out prompts, scored by the reward rules' accuracy
 * (rf_eval_accuracy: `rlflow eval`, the SFT's checks) or, in an RL run, by the same reward
 * definition as training (rf__val_score: rules, reward model, reward programs). */
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "controller/run_internal.h"
#include "model/generate.h"

/* Greedy responses to the first n examples of ds (file order: the same set every time) into
 * out (n) and ex (n). */
static rf_status greedy(rf_model *m, const rf_tokenizer *tok, rf_dataset *ds, int n, int max_new_tokens,
                        const int32_t *eos, int n_eos, rf_gen_output *out, const rf_example **ex) {
    const int32_t **prompts = calloc((size_t)(n ? n : 1), sizeof *prompts);
    int *lens = calloc((size_t)(n ? n : 1), sizeof *lens);
    rf_status s = prompts && lens ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for validation");
    for (int i = 0; s == RF_OK && i < n; i++) {
        ex[i] = rf_dataset_get(ds, i);
        prompts[i] = ex[i]->prompt_ids;
        lens[i] = ex[i]->n_prompt;
    }
    rf_gen_params gp = {.sampling = {.greedy = 1}, .max_new_tokens = max_new_tokens,
                        .eos_ids = eos, .n_eos = n_eos};
    if (s == RF_OK) s = rf_generate(m, tok, prompts, lens, n, &gp, out, 0);
    free(prompts), free(lens);
    return s;
}

rf_status rf_eval_accuracy(rf_model *m, const rf_tokenizer *tok, rf_dataset *ds, int n,
                           const rf_reward_rules *rules, int max_new_tokens, const int32_t *eos,
                           int n_eos, double *acc, double *mean_len) {
    int size = rf_dataset_size(ds);
    n = n <= 0 || n > size ? size : n;
    rf_gen_output *out = calloc((size_t)(n ? n : 1), sizeof *out);
    const rf_example **ex = calloc((size_t)(n ? n : 1), sizeof *ex);
    rf_status s = out && ex ? greedy(m, tok, ds, n, max_new_tokens, eos, n_eos, out, ex)
                            : rf_error(RF_ERR_NOMEM, "out of memory for validation");
    double correct = 0, len = 0;
    for (int i = 0; s == RF_OK && i < n; i++) {
        float reward, a;
        s = rf_reward_rules_score(rules, out[i].text ? out[i].text : "", out[i].n_tokens,
                                  ex[i]->answer, &reward, &a);
        correct += rf__val_credit(reward, a);
        len += out[i].n_tokens;
    }
    for (int i = 0; out && i < n; i++) rf_gen_output_free(&out[i]);
    *acc = n ? correct / n : 0, *mean_len = n ? len / n : 0;
    free(out), free(ex);
    return s;
}

/* The prompt response v was generated after: v->prompt_ids, or its example's. */
static const int32_t *val_prompt(const rf_val_response *v, int *n) {
    if (v->prompt_ids) return *n = v->n_prompt, v->prompt_ids;
    return *n = v->ex->n_prompt, v->ex->prompt_ids;
}

/* The reward model's score of each (prompt + response), weighted, added to total (n): the
 * sequence training's reward model scores (an episode's first observation included). */
static rf_status add_model(rf_run *run, const rf_val_response *v, int n, double *total) {
    int32_t **seqs = calloc((size_t)n, sizeof *seqs);
    int *lens = calloc((size_t)n, sizeof *lens);
    float *sc = calloc((size_t)n, sizeof *sc);
    rf_status st = seqs && lens && sc ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) {
        int np;
        const int32_t *p = val_prompt(&v[i], &np);
        lens[i] = np + v[i].n_ids;
        if (!(seqs[i] = malloc(sizeof(int32_t) * (size_t)(lens[i] ? lens[i] : 1)))) {
            st = rf_error(RF_ERR_NOMEM, "out of memory");
            break;
        }
        memcpy(seqs[i], p, sizeof(int32_t) * (size_t)np);
        memcpy(seqs[i] + np, v[i].ids, sizeof(int32_t) * (size_t)v[i].n_ids);
    }
    if (st == RF_OK) st = rf_reward_model_score(run->rm, (const int32_t *const *)seqs, lens, n, sc);
    for (int i = 0; st == RF_OK && i < n; i++) total[i] += run->r->reward.model_weight * sc[i];
    for (int i = 0; seqs && i < n; i++) free(seqs[i]);
    free(seqs), free(lens), free(sc);
    return st;
}

/* The reward programs' scores (and per-token rewards), weighted, added to total (n). The
 * requests carry group_id -1 and sample_index i: a program can tell validation apart. */
static rf_status add_external(rf_run *run, const rf_val_response *v, int n, double *total) {
    rf_reward_item *items = calloc((size_t)n, sizeof *items);
    char **meta = calloc((size_t)n, sizeof *meta);
    float *sc = calloc((size_t)n, sizeof *sc);
    rf_status st = items && meta && sc ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) {
        const rf_example *e = v[i].ex;
        int np;
        const int32_t *p = val_prompt(&v[i], &np);
        meta[i] = cJSON_PrintUnformatted(e->extra);
        items[i] = (rf_reward_item){e->prompt_text, v[i].text ? v[i].text : "", p, np,
                                    v[i].ids, v[i].n_ids, e->answer, meta[i], i, -1};
    }
    if (st == RF_OK) st = rf_external_reward_score(run->ext, items, n, sc);
    double w = run->r->reward.external_weight;
    for (int i = 0; st == RF_OK && i < n; i++) {
        const float *tok;
        int nt = rf_external_reward_token_rewards(run->ext, i, &tok);
        double t = 0;
        for (int k = 0; k < nt; k++) t += (float)w * tok[k];
        total[i] += (float)w * sc[i] + t;
    }
    for (int i = 0; meta && i < n; i++) free(meta[i]);
    free(items), free(meta), free(sc);
    return st;
}

rf_status rf__val_score(rf_run *run, const rf_val_response *v, int n, double *acc_sum, double *reward_sum) {
    double *total = calloc((size_t)(n ? n : 1), sizeof *total);
    float *acc = calloc((size_t)(n ? n : 1), sizeof *acc);
    rf_status st = total && acc ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for validation");
    for (int i = 0; st == RF_OK && i < n; i++) {
        float r;
        const char *text = v[i].rules_text ? v[i].rules_text : v[i].text ? v[i].text : "";
        st = rf_reward_rules_score(run->rules, text, v[i].n_ids, v[i].ex->answer, &r, &acc[i]);
        total[i] = r;
        for (int k = 0; v[i].turn_rewards && k < v[i].n_ids; k++) total[i] += v[i].turn_rewards[k];
    }
    if (st == RF_OK && run->rm && n) st = add_model(run, v, n, total);
    for (int i = 0; st == RF_OK && !run->rm && i < n; i++)
        if (v[i].rm_score) total[i] += run->r->reward.model_weight * v[i].rm_score[0];
    if (st == RF_OK && run->ext && n) st = add_external(run, v, n, total);
    for (int i = 0; st == RF_OK && i < n; i++) {
        *reward_sum += total[i];
        *acc_sum += rf__val_credit(total[i], acc[i]);
    }
    free(total), free(acc);
    return st;
}
