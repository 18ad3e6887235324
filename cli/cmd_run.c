/* `rlflow run`, `rlflow sft` and `rlflow eval`. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/log.h"
#include "controller/launch.h"
#include "controller/run.h"

#define N_OPTS(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* Parses RECIPE [--set k=v]... [--resume] into a loaded recipe. */
static int load_recipe(const char *cmd, int argc, char **argv, rf_recipe *r, int *resume) {
    rf_opt_multi sets = {0};
    int help = 0, res = 0;
    rf_opt opts[] = {
        {"set", RF_OPT_MULTI, &sets, "override a recipe key: --set section.key=value (repeatable, up to 64)", 0},
        {"resume", RF_OPT_FLAG, &res, "continue from the newest checkpoint in logging.dir", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    int n_opts = N_OPTS(opts);
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, n_opts, pos, 1, &n_pos);
    if (s == RF_OK && !help && n_pos != 1) s = rf_error(RF_ERR_ARG, "%s needs a recipe file", cmd);
    if (s == RF_OK && res && !resume) s = rf_error(RF_ERR_ARG, "--resume applies to `rlflow run` only");
    if (s || help) {
        rf_args_usage(cmd, "RECIPE.toml [--set section.key=value]...", opts, n_opts);
        return s ? rf_cli_fail(s) : 0;
    }
    s = rf_recipe_load(r, pos[0], sets.v, sets.n);
    if (s) return rf_cli_fail(s);
    if (resume) *resume = res;
    return -1; /* loaded: go on */
}

int rf_cmd_run(int argc, char **argv) {
    rf_recipe r;
    int resume = 0, rc = load_recipe("run", argc, argv, &r, &resume);
    if (rc >= 0) return rc;
    rf_status s;
    if (rf_recipe_multi_process(&r)) {
        /* argv - 2: the whole command line (main passes what follows "rlflow run") */
        s = rf_run_split(&r, resume, argc + 2, argv - 2);
        if (s && !rf_error_message()[0]) { /* already reported by the rank */
            rf_recipe_free(&r);
            return 1;
        }
    } else {
        s = rf_run_main(&r, resume);
    }
    rf_recipe_free(&r);
    return s ? rf_cli_fail(s) : 0;
}

int rf_cmd_sft(int argc, char **argv) {
    rf_recipe r;
    int rc = load_recipe("sft", argc, argv, &r, NULL);
    if (rc >= 0) return rc;
    rf_status s = rf_sft_main(&r);
    rf_recipe_free(&r);
    return s ? rf_cli_fail(s) : 0;
}

int rf_cmd_eval(int argc, char **argv) {
    const char *model = NULL, *data = NULL, *tmpl = "", *device = "cpu", *precision = "auto";
    int n = 0, max_new = 64, help = 0;
    rf_opt_multi rules = {0};
    rf_opt opts[] = {
        {"model", RF_OPT_STR, &model, "model directory (required)", 0},
        {"data", RF_OPT_STR, &data, "JSONL with prompt and answer fields (required)", 0},
        {"n", RF_OPT_INT, &n, "evaluate the first N prompts (default all)", 0},
        {"max-new-tokens", RF_OPT_INT, &max_new, "generation limit (default 64)", 0},
        {"rule", RF_OPT_MULTI, &rules, "correctness rule: numeric (default) or math", 0},
        {"chat-template", RF_OPT_STR, &tmpl, "chatml | llama3 (default none)", 0},
        {"device", RF_OPT_STR, &device, "cpu | cuda (default cpu)", 0},
        {"precision", RF_OPT_STR, &precision, "auto | fp32 | bf16: operands of matrix products (default auto: bf16 where the CPU has AVX512-BF16 or AMX-BF16)", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), pos, 0, &n_pos);
    if (s == RF_OK && !help && (!model || !data)) s = rf_error(RF_ERR_ARG, "eval needs --model and --data");
    if (s || help) {
        rf_args_usage("eval", "--model DIR --data FILE [options]", opts, N_OPTS(opts));
        return s ? rf_cli_fail(s) : 0;
    }
    rf_model *m = NULL;
    rf_tokenizer *tok = NULL;
    rf_dataset *ds = NULL;
    rf_reward_rules *rr = NULL;
    int32_t eos[8];
    double acc = 0, len = 0;
    const char *def_rule[] = {"numeric"};
    rf_reward_rules_config rc = {.names = rules.n ? rules.v : def_rule, .n_names = rules.n ? rules.n : 1};
    rf_dataset_opts o = {.chat_template = tmpl, .require_answer = 1, .no_shuffle = 1};
    s = rf_cli_open(model, device, precision, &m, &tok);
    if (s == RF_OK) s = rf_dataset_load(&ds, data, &o, tok);
    if (s == RF_OK) s = rf_reward_rules_init(&rr, &rc);
    int n_eos = m ? rf_cli_eos_ids(model, m, tok, eos, 8) : 0;
    if (s == RF_OK) s = rf_eval_accuracy(m, tok, ds, n, rr, max_new, eos, n_eos, &acc, &len);
    if (s == RF_OK) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "model", model);
        cJSON_AddStringToObject(j, "data", data);
        cJSON_AddNumberToObject(j, "n", n > 0 && n < rf_dataset_size(ds) ? n : rf_dataset_size(ds));
        cJSON_AddNumberToObject(j, "accuracy", acc);
        cJSON_AddNumberToObject(j, "mean_response_tokens", len);
        char *t = cJSON_PrintUnformatted(j);
        printf("%s\n", t);
        free(t);
        cJSON_Delete(j);
    }
    rf_reward_rules_free(rr);
    rf_dataset_free(ds);
    rf_tokenizer_free(tok);
    rf_model_free(m);
    return s ? rf_cli_fail(s) : 0;
}
