/* `rlflow keygen --out PREFIX`: a CURVE key pair for reward endpoints and reward programs
 * (common/curve.h; docs/reward-api.md, "CURVE"). PREFIX.key holds the secret key (mode 0600),
 * PREFIX.pub the public key; the public key is also printed on stdout, so that
 * `rlflow keygen --out judge >> allowed_clients` works. */
#include <stdio.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/curve.h"
#include "common/log.h"

#define N_OPTS(a) ((int)(sizeof(a) / sizeof((a)[0])))

int rf_cmd_keygen(int argc, char **argv) {
    const char *out = NULL;
    int force = 0, help = 0;
    rf_opt opts[] = {
        {"out", RF_OPT_STR, &out, "write PREFIX.key (secret, mode 600) and PREFIX.pub (public)", 0},
        {"force", RF_OPT_FLAG, &force, "replace an existing key pair", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    int n_pos = 0;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), NULL, 0, &n_pos);
    if (s || help || !out) {
        rf_args_usage("keygen", "--out PREFIX [--force]", opts, N_OPTS(opts));
        if (s) return rf_cli_usage_fail(s);
        return help ? 0 : (fprintf(stderr, "error: --out PREFIX is required\n"), 2);
    }
    rf_curve_key pub;
    s = rf_curve_write_keypair(out, force, pub);
    if (s) return rf_cli_fail(s);
    rf_log_info("wrote %s.key (secret: keep it private) and %s.pub (public)", out, out);
    printf("%s\n", pub);
    return 0;
}
