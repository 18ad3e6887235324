#include "cli/args.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static rf_status set_value(rf_opt *o, const char *v) {
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case RF_OPT_STR:
        *(const char **)o->dst = v;
        return RF_OK;
    case RF_OPT_INT: {
        long x = strtol(v, &end, 10);
        if (!*v || *end || errno || x < -2147483647L || x > 2147483647L)
            return rf_error(RF_ERR_ARG, "--%s: expected an integer, got \"%s\"", o->name, v);
        *(int *)o->dst = (int)x;
        return RF_OK;
    }
    case RF_OPT_FLOAT: {
        float x = strtof(v, &end);
        if (!*v || *end || errno)
            return rf_error(RF_ERR_ARG, "--%s: expected a number, got \"%s\"", o->name, v);
        *(float *)o->dst = x;
        return RF_OK;
    }
    case RF_OPT_MULTI: {
        rf_opt_multi *m = o->dst;
        if (m->n >= RF_OPT_MULTI_MAX)
            return rf_error(RF_ERR_ARG, "--%s: at most %d values", o->name, RF_OPT_MULTI_MAX);
        m->v[m->n++] = v;
        return RF_OK;
    }
    case RF_OPT_FLAG:
        break;
    }
    return rf_error(RF_ERR_INTERNAL, "--%s: bad option kind", o->name);
}

rf_status rf_args_parse(int argc, char **argv, rf_opt *opts, int n, const char **pos,
                        int max_pos, int *n_pos) {
    *n_pos = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0 || a[2] == '\0') {
            if (*n_pos >= max_pos) return rf_error(RF_ERR_ARG, "unexpected argument \"%s\"", a);
            pos[(*n_pos)++] = a;
            continue;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        rf_opt *o = NULL;
        for (int j = 0; j < n; j++)
            if (strlen(opts[j].name) == len && strncmp(opts[j].name, name, len) == 0) o = &opts[j];
        if (!o) return rf_error(RF_ERR_ARG, "unknown option \"--%.*s\" (see --help)", (int)len, name);
        o->seen = 1;
        if (o->kind == RF_OPT_FLAG) {
            if (eq) return rf_error(RF_ERR_ARG, "--%s takes no value", o->name);
            *(int *)o->dst = 1;
            continue;
        }
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!v) return rf_error(RF_ERR_ARG, "--%s needs a value", o->name);
        RF_TRY(set_value(o, v));
    }
    return RF_OK;
}

void rf_args_usage(const char *cmd, const char *synopsis, const rf_opt *opts, int n) {
    fprintf(stderr, "usage: rlflow %s %s\n", cmd, synopsis);
    for (int i = 0; i < n; i++)
        fprintf(stderr, "  --%-18s %s\n", opts[i].name, opts[i].help);
}
