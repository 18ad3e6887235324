/* Command-line option parsing for the rlflow subcommands: each command declares a table of
 * options; anything not in the table is an error naming it (no option is silently ignored). */
#ifndef RF_CLI_ARGS_H
#define RF_CLI_ARGS_H

#include "common/status.h"

typedef enum { RF_OPT_STR, RF_OPT_INT, RF_OPT_FLOAT, RF_OPT_FLAG, RF_OPT_MULTI } rf_opt_kind;

typedef struct rf_opt {
    const char *name;     /* without the leading "--" */
    rf_opt_kind kind;
    void *dst;            /* const char **, int *, float *, int * (flag), rf_opt_multi * */
    const char *help;
    int seen;
} rf_opt;

#define RF_OPT_MULTI_MAX 64

typedef struct rf_opt_multi {
    const char *v[RF_OPT_MULTI_MAX];
    int n;
} rf_opt_multi;

/* Parses argv[0..argc) against opts (n). Positional arguments go to pos (up to max_pos).
 * Errors name the option. */
rf_status rf_args_parse(int argc, char **argv, rf_opt *opts, int n, const char **pos,
                        int max_pos, int *n_pos);

/* Prints the option table as usage. */
void rf_args_usage(const char *cmd, const char *synopsis, const rf_opt *opts, int n);

#endif
