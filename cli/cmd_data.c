/* `rlflow data TASK`: writes a built-in task's train.jsonl and val.jsonl (controller/tasks.h).
 *
 * For the lead, to copy into cli/cli.h:
 *     int rf_cmd_data(int argc, char **argv);
 * and into cli/main.c's table: {"data", rf_cmd_data}, with the usage line
 *     "  data        write a built-in task's train/val JSONL (arith, countdown, multiply)\n" */
#include <stdio.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "controller/tasks.h"

#define N_OPTS(a) ((int)(sizeof(a) / sizeof((a)[0])))

int rf_cmd_data(int argc, char **argv);

int rf_cmd_data(int argc, char **argv) {
    rf_task_opts o;
    rf_task_opts_default(&o);
    const char *out = NULL;
    int n_train = 20000, n_val = 500, seed = 1, help = 0;
    rf_opt opts[] = {
        {"out", RF_OPT_STR, &out, "output directory (default data/TASK)", 0},
        {"train", RF_OPT_INT, &n_train, "training examples (default 20000)", 0},
        {"val", RF_OPT_INT, &n_val, "validation examples, distinct and not in train (default 500)", 0},
        {"seed", RF_OPT_INT, &seed, "generator seed (default 1)", 0},
        {"min-digits", RF_OPT_INT, &o.min_digits, "arith, multiply: fewest digits per operand (default 1)", 0},
        {"max-digits", RF_OPT_INT, &o.max_digits, "arith, multiply: most digits per operand (default 3, at most 9)", 0},
        {"mul-percent", RF_OPT_INT, &o.mul_percent, "arith: percent of small products (default 10)", 0},
        {"numbers", RF_OPT_INT, &o.n_numbers, "countdown: numbers per problem (default 3, 2..6)", 0},
        {"max-number", RF_OPT_INT, &o.max_number, "countdown: numbers drawn from 1..N (default 50)", 0},
        {"max-target", RF_OPT_INT, &o.max_target, "countdown: targets in 1..N (default 200)", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    const char *pos[1];
    int n_pos = 0;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), pos, 1, &n_pos);
    if (s || help || n_pos != 1) {
        rf_args_usage("data", "TASK [options]   (tasks: arith, countdown, multiply)", opts, N_OPTS(opts));
        if (s) return rf_cli_usage_fail(s);
        return help ? 0 : (fprintf(stderr, "error: name a task (%s)\n", rf_task_names()), 2);
    }
    char dir[4096];
    if (!out) {
        snprintf(dir, sizeof dir, "data/%s", pos[0]);
        out = dir;
    }
    double t0 = rf_time_now();
    s = rf_task_generate_opts(pos[0], out, n_train, n_val, (uint64_t)(int64_t)seed, &o);
    if (s) return rf_cli_fail(s);
    rf_log_info("wrote %s/train.jsonl (%d examples) and %s/val.jsonl (%d) in %.2f s", out, n_train, out,
                n_val, rf_time_now() - t0);
    return 0;
}
