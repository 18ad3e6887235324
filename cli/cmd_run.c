/* `rlflow run`, `rlflow sft` and `rlflow eval`. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/log.h"
#include "comm/comm.h"
#include "controller/interrupt.h"
#include "controller/launch.h"
#include "controller/run_dir.h"
#include "controller/run.h"
#include "reward/countdown.h"
#include "reward/reward.h"

#define N_OPTS(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* Every --set is section.key=value: one without "=" (or with an empty key) is a usage error,
 * caught before the recipe is read. */
static rf_status check_sets(const rf_opt_multi *sets) {
    for (int i = 0; i < sets->n; i++) {
        const char *eq = strchr(sets->v[i], '=');
        if (!eq || eq == sets->v[i])
            return rf_error(RF_ERR_ARG, "--set %s: expected section.key=value", sets->v[i]);
    }
    return RF_OK;
}

/* What `rlflow run` takes beyond the recipe: --resume, --overwrite. */
typedef struct run_flags {
    int resume, overwrite;
} run_flags;

/* Parses RECIPE [--set k=v]... [--resume | --overwrite] into a loaded recipe. Returns -1 when
 * loaded, else the exit code. */
static int load_recipe(const char *cmd, int argc, char **argv, rf_recipe *r, run_flags *flags) {
    rf_opt_multi sets = {0};
    int help = 0, res = 0, over = 0, sft = strcmp(cmd, "sft") == 0;
    rf_opt opts[] = {
        {"set", RF_OPT_MULTI, &sets, "override a recipe key: --set section.key=value (repeatable, up to 64)", 0},
        {"resume", RF_OPT_FLAG, &res, sft ? "continue from the newest checkpoint in <logging.dir>/sft_checkpoints"
                                          : "continue from the newest checkpoint in logging.dir", 0},
        {"overwrite", RF_OPT_FLAG, &over, sft ? "start afresh: remove the checkpoints in <logging.dir>/sft_checkpoints"
                                              : "start afresh in a logging.dir that holds a run: remove its metrics, "
                                                "samples, event files and checkpoints first", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    int n_opts = N_OPTS(opts);
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, n_opts, pos, 1, &n_pos);
    if (s == RF_OK && !help && n_pos != 1) s = rf_error(RF_ERR_ARG, "%s needs a recipe file", cmd);
    if (s == RF_OK && res && over) s = rf_error(RF_ERR_ARG, "--resume and --overwrite exclude each other");
    if (s == RF_OK) s = check_sets(&sets);
    if (s || help) {
        rf_args_usage(cmd, "RECIPE.toml [--set section.key=value]...", opts, n_opts);
        return s ? rf_cli_usage_fail(s) : 0;
    }
    s = rf_recipe_load(r, pos[0], sets.v, sets.n);
    if (s) return rf_cli_fail(s);
    flags->resume = res, flags->overwrite = over;
    return -1; /* loaded: go on */
}

/* logging.dir made ready once per run (controller/run_dir.h): by the command the user typed,
 * before a split run starts its ranks (they inherit RLFLOW_RUN_DIR_READY), or, under the
 * user's own mpirun, by world rank 0 alone (the controller's). */
static rf_status prepare_dir(const rf_recipe *r, const run_flags *f) {
    if (getenv("RLFLOW_RUN_DIR_READY")) return RF_OK;
    if (rf_comm_launched_by_mpi()) {
        const char *rank = getenv("OMPI_COMM_WORLD_RANK");
        if (!rank) rank = getenv("PMIX_RANK");
        if (!rank) rank = getenv("PMI_RANK");
        if (rank && strcmp(rank, "0") != 0) return RF_OK;
    }
    RF_TRY(rf_run_dir_prepare(r->logging.dir, "logging.dir =", f->resume, f->overwrite));
    setenv("RLFLOW_RUN_DIR_READY", "1", 1);
    return RF_OK;
}

int rf_cmd_run(int argc, char **argv) {
    rf_recipe r;
    run_flags f = {0};
    int rc = load_recipe("run", argc, argv, &r, &f);
    if (rc >= 0) return rc;
    rf_status s = prepare_dir(&r, &f);
    if (s) {
        rf_recipe_free(&r);
        return rf_cli_fail(s);
    }
    if (rf_recipe_multi_process(&r)) {
        /* argv - 2: the whole command line (main passes what follows "rlflow run") */
        s = rf_run_split(&r, f.resume, argc + 2, argv - 2);
        if (s && !rf_error_message()[0]) { /* already reported by the rank */
            rf_recipe_free(&r);
            return rf_interrupt_signal() ? rf_interrupt_exit_code() : 1;
        }
    } else {
        if (getenv("RLFLOW_SPIN_AUTO")) /* cli/main.c */
            rf_log_info("OpenMP: idle threads spin %s times (about 10 us) before they sleep: the machine was idle at the "
                        "start (set OMP_WAIT_POLICY or GOMP_SPINCOUNT to choose)", getenv("GOMP_SPINCOUNT"));
        s = rf_run_main(&r, f.resume);
    }
    rf_recipe_free(&r);
    /* stopped by SIGINT / SIGTERM: 130 / 143, the shell's convention */
    if (s && rf_interrupt_signal()) return rf_cli_fail(s), rf_interrupt_exit_code();
    return s ? rf_cli_fail(s) : 0;
}

int rf_cmd_sft(int argc, char **argv) {
    rf_recipe r;
    run_flags f = {0};
    int rc = load_recipe("sft", argc, argv, &r, &f);
    if (rc >= 0) return rc;
    rf_status s = rf_sft_main(&r, f.resume, f.overwrite);
    rf_recipe_free(&r);
    return s ? rf_cli_fail(s) : 0;
}

/* A countdown data set ("N1 N2 ... -> TARGET" answers, `rlflow data countdown`) checked by a rule
 * other than countdown would reward the bare target number: refused, as the recipe refuses
 * data.task = "countdown" with those rules. Judged by the first example with an answer. */
static rf_status eval_rules_fit(const rf_dataset *ds, const char *path, const rf_reward_rules_config *rc) {
    const rf_example *e = NULL;
    for (int i = 0; i < rf_dataset_size(ds) && !(e && e->answer); i++) e = rf_dataset_get(ds, i);
    int64_t nums[64];
    int n, target;
    if (!e || !e->answer || !rf_countdown_truth_parse(e->answer, nums, 64, &n, &target)) return RF_OK;
    for (int i = 0; i < rc->n_names; i++)
        if (!strcmp(rc->names[i], "numeric") || !strcmp(rc->names[i], "math") || !strcmp(rc->names[i], "exact"))
            return rf_error(RF_ERR_ARG,
                            "--rule %s cannot check countdown answers (%s:%d: \"%s\"): it would reward the bare target "
                            "number, not an expression that reaches it; use --rule countdown",
                            rc->names[i], path, e->line, e->answer);
    return RF_OK;
}

int rf_cmd_eval(int argc, char **argv) {
    const char *model = NULL, *data = NULL, *tmpl = "", *device = "cpu", *precision = "auto", *pkey = "prompt",
               *akey = "answer", *aregex = "";
    int n = 0, max_new = 64, help = 0;
    rf_opt_multi rules = {0};
    rf_opt opts[] = {
        {"model", RF_OPT_STR, &model, "model directory (required)", 0},
        {"data", RF_OPT_STR, &data, "JSONL with prompt and answer fields (required)", 0},
        {"prompt-key", RF_OPT_STR, &pkey, "field of the prompt in each line (default prompt)", 0},
        {"answer-key", RF_OPT_STR, &akey, "field of the reference answer (default answer)", 0},
        {"n", RF_OPT_INT, &n, "evaluate the first N prompts (default all)", 0},
        {"max-new-tokens", RF_OPT_INT, &max_new, "generation limit (default 64)", 0},
        {"rule", RF_OPT_MULTI, &rules, "correctness rule: numeric (default), math, exact or countdown", 0},
        {"answer-regex", RF_OPT_STR, &aregex, "PCRE2 pattern whose last match (its first group) is the answer the rule reads, as reward.answer_regex (default: the rule's own)", 0},
        {"chat-template", RF_OPT_STR, &tmpl, "chatml | llama3 (default none)", 0},
        {"device", RF_OPT_STR, &device, "cpu | cuda (default cpu)", 0},
        {"precision", RF_OPT_STR, &precision, "auto | fp32 | bf16: operands of matrix products (default auto: bf16 where the CPU has AVX512-BF16 or AMX-BF16)", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), pos, 0, &n_pos);
    if (s == RF_OK && !help && (!model || !data)) s = rf_error(RF_ERR_ARG, "eval needs --model and --data");
    for (int i = 0; s == RF_OK && i < N_OPTS(opts); i++) /* --n absent: all; given: a count */
        if (opts[i].dst == &n && opts[i].seen && n < 1) s = rf_error(RF_ERR_ARG, "--n: expected a count >= 1, got %d", n);
    if (s == RF_OK && !help && aregex[0]) s = rf_reward_regex_check("--answer-regex", aregex);
    if (s || help) {
        rf_args_usage("eval", "--model DIR --data FILE [options]", opts, N_OPTS(opts));
        return s ? rf_cli_usage_fail(s) : 0;
    }
    rf_model *m = NULL;
    rf_tokenizer *tok = NULL;
    rf_dataset *ds = NULL;
    rf_reward_rules *rr = NULL;
    int32_t eos[8];
    double acc = 0, len = 0;
    const char *def_rule[] = {"numeric"};
    rf_reward_rules_config rc = {.names = rules.n ? rules.v : def_rule, .n_names = rules.n ? rules.n : 1,
                                 .answer_regex = aregex};
    rf_dataset_opts o = {.prompt_key = pkey, .answer_key = akey, .chat_template = tmpl, .require_answer = 1,
                         .no_shuffle = 1};
    s = rf_cli_open(model, device, precision, 1, &m, &tok);
    if (s == RF_OK) s = rf_dataset_load(&ds, data, &o, tok);
    if (s == RF_OK) s = eval_rules_fit(ds, data, &rc);
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
