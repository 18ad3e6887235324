/* Validation: greedy generation on held-out prompts, scored by the reward rules' accuracy. */
#include <stdlib.h>
#include <string.h>

#include "controller/run_internal.h"
#include "model/generate.h"

rf_status rf_eval_accuracy(rf_model *m, const rf_tokenizer *tok, rf_dataset *ds, int n,
                           const rf_reward_rules *rules, int max_new_tokens, const int32_t *eos,
                           int n_eos, double *acc, double *mean_len) {
    int size = rf_dataset_size(ds);
    n = n <= 0 || n > size ? size : n;
    const int32_t **prompts = calloc((size_t)n, sizeof *prompts);
    int *lens = calloc((size_t)n, sizeof *lens);
    rf_gen_output *out = calloc((size_t)n, sizeof *out);
    const rf_example **ex = calloc((size_t)n, sizeof *ex);
    if (!prompts || !lens || !out || !ex) {
        free(prompts), free(lens), free(out), free(ex);
        return rf_error(RF_ERR_NOMEM, "out of memory for validation");
    }
    /* the first n examples in file order: the same set at every validation */
    rf_status s = RF_OK;
    for (int i = 0; i < n; i++) {
        ex[i] = rf_dataset_get(ds, i);
        prompts[i] = ex[i]->prompt_ids;
        lens[i] = ex[i]->n_prompt;
    }
    rf_gen_params gp = {.sampling = {.greedy = 1}, .max_new_tokens = max_new_tokens,
                        .eos_ids = eos, .n_eos = n_eos};
    s = rf_generate(m, tok, prompts, lens, n, &gp, out, 0);
    double correct = 0, len = 0;
    for (int i = 0; s == RF_OK && i < n; i++) {
        float reward, a;
        s = rf_reward_rules_score(rules, out[i].text ? out[i].text : "", out[i].n_tokens,
                                  ex[i]->answer, &reward, &a);
        correct += rf__val_credit(reward, a);
        len += out[i].n_tokens;
    }
    for (int i = 0; i < n; i++) rf_gen_output_free(&out[i]);
    *acc = n ? correct / n : 0, *mean_len = n ? len / n : 0;
    free(prompts), free(lens), free(out), free(ex);
    return s;
}
