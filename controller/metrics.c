#define _POSIX_C_SOURCE 200809L
#include "controller/metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "controller/tb_writer.h"

typedef struct rf__metric {
    char *name;
    double value;
} rf__metric;

struct rf_metrics {
    rf__metric *items;  // (n) in order of first set within the step
    int n, cap;
    int jsonl_fd;       // -1 when off
    char jsonl_path[4096];
    rf_tb_writer *tb;   // NULL when off
    char dir[4096];     // the sinks' directory ("" when none)
    int samples_fd;     // <dir>/samples.jsonl, -1 until the first samples are written
    char samples_path[4200];
    int tb_started;     // the SessionLog START of this open is written
};

rf_status rf_metrics_open(rf_metrics **out, const char *dir, int jsonl, int tensorboard) {
    *out = NULL;
    if ((jsonl || tensorboard) && (!dir || !*dir))
        return rf_error(RF_ERR_ARG, "metrics: a directory is needed for jsonl/tensorboard output");
    rf_metrics *m = rf_calloc(1, sizeof *m);
    if (!m) return RF_ERR_NOMEM;
    m->jsonl_fd = -1, m->samples_fd = -1;
    if (dir) snprintf(m->dir, sizeof m->dir, "%s", dir);
    rf_status s = RF_OK;
    if (jsonl) {
        s = rf_mkdirs(dir);
        if (s == RF_OK) {
            rf_path_join(m->jsonl_path, sizeof m->jsonl_path, dir, "metrics.jsonl");
            m->jsonl_fd = open(m->jsonl_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (m->jsonl_fd < 0)
                s = rf_error(RF_ERR_IO, "%s: cannot open: %s", m->jsonl_path, strerror(errno));
        }
    }
    if (s == RF_OK && tensorboard) s = rf_tb_writer_open(&m->tb, dir);
    if (s != RF_OK) {
        rf_metrics_close(m);
        return s;
    }
    *out = m;
    return RF_OK;
}

static rf__metric *rf__find(const rf_metrics *m, const char *name) {
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->items[i].name, name) == 0) return &m->items[i];
    return NULL;
}

rf_status rf_metrics_set(rf_metrics *m, const char *name, double value) {
    if (!name || !*name) return rf_error(RF_ERR_ARG, "metrics: empty metric name");
    if (strcmp(name, "step") == 0 || strcmp(name, "time") == 0)
        return rf_error(RF_ERR_ARG, "metrics: \"%s\" is a reserved metric name", name);
    rf__metric *it = rf__find(m, name);
    if (it) {
        it->value = value;
        return RF_OK;
    }
    if (m->n == m->cap) {
        int cap = m->cap ? 2 * m->cap : 32;
        rf__metric *p = realloc(m->items, (size_t)cap * sizeof *p);
        if (!p) return rf_error(RF_ERR_NOMEM, "metrics: out of memory adding \"%s\"", name);
        m->items = p;
        m->cap = cap;
    }
    char *copy = rf_strdup(name);
    if (!copy) return rf_error(RF_ERR_NOMEM, "metrics: out of memory adding \"%s\"", name);
    m->items[m->n++] = (rf__metric){copy, value};
    return RF_OK;
}

int rf_metrics_get(const rf_metrics *m, const char *name, double *value) {
    const rf__metric *it = rf__find(m, name);
    if (it && value) *value = it->value;
    return it != NULL;
}

int rf_metrics_count(const rf_metrics *m) { return m->n; }

const char *rf_metrics_at(const rf_metrics *m, int i, double *value) {
    if (i < 0 || i >= m->n) return NULL;
    *value = m->items[i].value;
    return m->items[i].name;
}

/* ---- JSON line ---- */

/* A string builder whose only failure, out of memory, is sticky and checked once at the end. */
typedef struct rf__sb {
    char *p;
    size_t n, cap;
    int oom;
} rf__sb;

static void rf__sb_printf(rf__sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rf__sb_printf(rf__sb *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        size_t cap = b->cap ? b->cap : 512;
        while (cap <= b->n + (size_t)k) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
}

/* A JSON string literal (RFC 8259 section 7): quote, backslash and control characters escaped;
 * other bytes, UTF-8 included, pass through. */
static void rf__sb_json_string(rf__sb *b, const char *s) {
    rf__sb_printf(b, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\')
            rf__sb_printf(b, "\\%c", *c);
        else if (*c < 0x20)
            rf__sb_printf(b, "\\u%04x", *c);
        else
            rf__sb_printf(b, "%c", *c);
    }
    rf__sb_printf(b, "\"");
}

/* The shortest of %.15g, %.16g, %.17g that reads back as the same double; null for NaN and
 * infinities, which JSON cannot represent. */
static void rf__sb_json_number(rf__sb *b, double v) {
    if (!isfinite(v)) {
        rf__sb_printf(b, "null");
        return;
    }
    char tmp[40];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, v);
        if (strtod(tmp, NULL) == v) break;
    }
    rf__sb_printf(b, "%s", tmp);
}

static rf_status rf__write_jsonl(rf_metrics *m, int64_t step, double now) {
    rf__sb b = {0};
    rf__sb_printf(&b, "{\"step\": %lld, \"time\": %.3f", (long long)step, now);
    for (int i = 0; i < m->n; i++) {
        rf__sb_printf(&b, ", ");
        rf__sb_json_string(&b, m->items[i].name);
        rf__sb_printf(&b, ": ");
        rf__sb_json_number(&b, m->items[i].value);
    }
    rf__sb_printf(&b, "}\n");
    rf_status s = RF_OK;
    if (b.oom) s = rf_error(RF_ERR_NOMEM, "%s: out of memory formatting step %lld",
                            m->jsonl_path, (long long)step);
    const char *p = b.p;
    size_t left = b.oom ? 0 : b.n;
    while (left > 0) {
        ssize_t w = write(m->jsonl_fd, p, left);
        if (w < 0) {
            if (errno == EINTR) continue;
            s = rf_error(RF_ERR_IO, "%s: write failed: %s", m->jsonl_path, strerror(errno));
            break;
        }
        p += w;
        left -= (size_t)w;
    }
    free(b.p);
    return s;
}

/* Writes all of b to fd (path for errors). */
static rf_status rf__write_all(int fd, const char *path, const char *p, size_t left) {
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w < 0) {
            if (errno == EINTR) continue;
            return rf_error(RF_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        }
        p += w;
        left -= (size_t)w;
    }
    return RF_OK;
}

/* One sample as a JSON line (field order as documented in docs/metrics.md). */
/* An episode's trajectory: "response_ids": [...], "loss_mask": "1110011", "versions": [...]. */
static void rf__sample_trajectory(rf__sb *b, const rf_sample_log *x) {
    int n = x->response_tokens;
    rf__sb_printf(b, ", \"response_ids\": [");
    for (int t = 0; t < n; t++) rf__sb_printf(b, "%s%d", t ? ", " : "", (int)x->response_ids[t]);
    rf__sb_printf(b, "], \"loss_mask\": \"");
    for (int t = 0; t < n; t++) rf__sb_printf(b, "%c", x->loss_mask[t] ? '1' : '0');
    rf__sb_printf(b, "\", \"versions\": [");
    for (int t = 0; t < n; t++) rf__sb_printf(b, "%s%d", t ? ", " : "", x->versions[t]);
    rf__sb_printf(b, "]");
}

static void rf__sample_json(rf__sb *b, int64_t step, double now, const rf_sample_log *x) {
    rf__sb_printf(b, "{\"step\": %lld, \"time\": %.3f, \"group\": %d, \"index\": %d, \"prompt\": ", (long long)step,
                  now, x->group, x->index);
    rf__sb_json_string(b, x->prompt ? x->prompt : "");
    rf__sb_printf(b, ", \"response\": ");
    rf__sb_json_string(b, x->response ? x->response : "");
    rf__sb_printf(b, ", \"answer\": ");
    if (x->answer) rf__sb_json_string(b, x->answer);
    else rf__sb_printf(b, "null");
    rf__sb_printf(b, ", \"reward\": ");
    rf__sb_json_number(b, x->reward);
    rf__sb_printf(b, ", \"accuracy\": ");
    rf__sb_json_number(b, x->accuracy);
    rf__sb_printf(b, ", \"advantage\": ");
    rf__sb_json_number(b, x->advantage);
    rf__sb_printf(b, ", \"response_tokens\": %d, \"components\": {", x->response_tokens);
    for (int k = 0; k < x->n_components && k < RF_SAMPLE_MAX_COMPONENTS; k++) {
        rf__sb_printf(b, "%s", k ? ", " : "");
        rf__sb_json_string(b, x->component_names[k]);
        rf__sb_printf(b, ": ");
        rf__sb_json_number(b, x->components[k]);
    }
    rf__sb_printf(b, "}");
    if (x->response_ids && x->loss_mask && x->versions) rf__sample_trajectory(b, x);
    rf__sb_printf(b, "}\n");
}

/* Text between Markdown code fences: a fence inside the text is broken up so it cannot close
 * the block early. */
static void rf__sb_fenced(rf__sb *b, const char *t) {
    rf__sb_printf(b, "\n\n```\n");
    for (const char *c = t ? t : ""; *c; c++) {
        if (c[0] == '`' && c[1] == '`' && c[2] == '`') rf__sb_printf(b, "`\u200b");
        else rf__sb_printf(b, "%c", *c);
    }
    rf__sb_printf(b, "\n```\n\n");
}

/* One sample as the Markdown of its TensorBoard text summary. */
static void rf__sample_markdown(rf__sb *b, const rf_sample_log *x) {
    rf__sb_printf(b, "**reward** %.4g", x->reward);
    if (!isnan(x->accuracy)) rf__sb_printf(b, " | **accuracy** %.4g", x->accuracy);
    rf__sb_printf(b, " | **advantage** %.4g | **tokens** %d", x->advantage, x->response_tokens);
    for (int k = 0; k < x->n_components && k < RF_SAMPLE_MAX_COMPONENTS; k++)
        rf__sb_printf(b, " | %s %.4g", x->component_names[k], x->components[k]);
    rf__sb_printf(b, "\n\n**prompt**");
    rf__sb_fenced(b, x->prompt);
    rf__sb_printf(b, "**response**");
    rf__sb_fenced(b, x->response);
    if (x->answer) {
        rf__sb_printf(b, "**answer**");
        rf__sb_fenced(b, x->answer);
    }
}

static rf_status rf__samples_tb(rf_metrics *m, int64_t step, double now, const rf_sample_log *s, int n) {
    char **texts = calloc((size_t)n, sizeof *texts), **tags = calloc((size_t)n, sizeof *tags);
    rf_status st = texts && tags ? RF_OK : rf_error(RF_ERR_NOMEM, "metrics: out of memory writing samples");
    for (int i = 0; st == RF_OK && i < n; i++) {
        rf__sb b = {0};
        rf__sample_markdown(&b, &s[i]);
        texts[i] = b.p;
        tags[i] = malloc(32);
        if (b.oom || !b.p || !tags[i]) st = rf_error(RF_ERR_NOMEM, "metrics: out of memory writing samples");
        else snprintf(tags[i], 32, "samples/%d", i);
    }
    if (st == RF_OK && !m->tb_started) {
        st = rf_tb_writer_session_start(m->tb, step, now);
        m->tb_started = st == RF_OK;
    }
    if (st == RF_OK) st = rf_tb_writer_text(m->tb, step, now, n, (const char *const *)tags, (const char *const *)texts);
    for (int i = 0; i < n && texts && tags; i++) free(texts[i]), free(tags[i]);
    free(texts), free(tags);
    return st;
}

rf_status rf_metrics_samples(rf_metrics *m, int64_t step, const rf_sample_log *s, int n) {
    if (n <= 0) return RF_OK;
    double now = rf_tb_wall_time();
    rf_status st = RF_OK;
    if (m->jsonl_fd >= 0) {
        if (m->samples_fd < 0) {
            rf_path_join(m->samples_path, sizeof m->samples_path, m->dir, "samples.jsonl");
            m->samples_fd = open(m->samples_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (m->samples_fd < 0) return rf_error(RF_ERR_IO, "%s: cannot open: %s", m->samples_path, strerror(errno));
        }
        rf__sb b = {0};
        for (int i = 0; i < n; i++) rf__sample_json(&b, step, now, &s[i]);
        st = b.oom ? rf_error(RF_ERR_NOMEM, "%s: out of memory formatting step %lld", m->samples_path, (long long)step)
                   : rf__write_all(m->samples_fd, m->samples_path, b.p, b.n);
        free(b.p);
    }
    if (m->tb) {
        rf_status t = rf__samples_tb(m, step, now, s, n);
        if (st == RF_OK) st = t;
    }
    return st;
}

const char *rf_metrics_samples_path(const rf_metrics *m) { return m->samples_fd >= 0 ? m->samples_path : NULL; }

static rf_status rf__write_tb(rf_metrics *m, int64_t step, double now) {
    const char **tags = malloc((size_t)m->n * sizeof *tags);
    double *values = malloc((size_t)m->n * sizeof *values);
    rf_status s;
    if (!tags || !values) {
        s = rf_error(RF_ERR_NOMEM, "metrics: out of memory writing step %lld", (long long)step);
    } else {
        for (int i = 0; i < m->n; i++) {
            tags[i] = m->items[i].name;
            values[i] = m->items[i].value;
        }
        if (!m->tb_started) {
            s = rf_tb_writer_session_start(m->tb, step, now);
            m->tb_started = s == RF_OK;
        } else {
            s = RF_OK;
        }
        if (s == RF_OK) s = rf_tb_writer_scalars(m->tb, step, now, m->n, tags, values);
    }
    free(tags);
    free(values);
    return s;
}

static void rf__clear(rf_metrics *m) {
    for (int i = 0; i < m->n; i++) free(m->items[i].name);
    m->n = 0;
}

rf_status rf_metrics_commit(rf_metrics *m, int64_t step) {
    rf_status s = RF_OK;
    if (m->n > 0) {
        double now = rf_tb_wall_time();
        if (m->jsonl_fd >= 0) s = rf__write_jsonl(m, step, now);
        if (m->tb) {
            rf_status t = rf__write_tb(m, step, now);
            if (s == RF_OK) s = t;
        }
    }
    rf__clear(m);
    return s;
}

void rf_metrics_close(rf_metrics *m) {
    if (!m) return;
    rf__clear(m);
    free(m->items);
    if (m->jsonl_fd >= 0) close(m->jsonl_fd);
    if (m->samples_fd >= 0) close(m->samples_fd);
    rf_tb_writer_close(m->tb);
    free(m);
}

const char *rf_metrics_jsonl_path(const rf_metrics *m) {
    return m->jsonl_fd >= 0 ? m->jsonl_path : NULL;
}

const char *rf_metrics_tb_path(const rf_metrics *m) { return m->tb ? rf_tb_writer_path(m->tb) : NULL; }

/* ---- console ---- */

size_t rf_metrics_format_duration(double t, char *out, size_t cap) {
    if (!isfinite(t) || t < 0) return (size_t)snprintf(out, cap, "?");
    if (t > 1e9) t = 1e9;  // keeps the casts below in range; ~31 years is "forever" enough
    long s = (long)(t + 0.5);
    int k;
    if (s < 60)
        k = snprintf(out, cap, "%lds", s);
    else if (s < 3600)
        k = snprintf(out, cap, "%ldm%02lds", s / 60, s % 60);
    else if (s < 86400)
        k = snprintf(out, cap, "%ldh%02ldm", s / 3600, s % 3600 / 60);
    else
        k = snprintf(out, cap, "%ldd%02ldh", s / 86400, s % 86400 / 3600);
    return (size_t)k;
}

/* Appends to a fixed buffer like snprintf at an offset: counts the full length, never
 * overflows, keeps the NUL. */
static void rf__cat(char *out, size_t cap, size_t *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void rf__cat(char *out, size_t cap, size_t *len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    size_t off = *len < cap ? *len : cap;
    int k = vsnprintf(out ? out + off : NULL, cap - off, fmt, ap);
    va_end(ap);
    if (k > 0) *len += (size_t)k;
}

/* Formats a metric value with the column's format. The format comes from our own caller, not
 * from input, hence the pragma for the non-literal format string. */
static void rf__cat_value(char *out, size_t cap, size_t *len, const char *fmt, double v) {
    char tmp[64];
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
    snprintf(tmp, sizeof tmp, fmt ? fmt : "%.3g", v);
#pragma GCC diagnostic pop
    rf__cat(out, cap, len, "%s", tmp);
}

size_t rf_metrics_console_line(const rf_metrics *m, int64_t step, int64_t total,
                               double elapsed_s, int64_t steps_timed,
                               const rf_metrics_col *cols, int n_cols, char *out, size_t cap) {
    size_t len = 0;
    if (cap > 0) out[0] = '\0';
    if (total > 0)
        rf__cat(out, cap, &len, "step %lld/%lld", (long long)step, (long long)total);
    else
        rf__cat(out, cap, &len, "step %lld", (long long)step);
    for (int i = 0; i < n_cols; i++) {
        const rf_metrics_col *c = &cols[i];
        double v, pm;
        if (!rf_metrics_get(m, c->name, &v)) continue;
        rf__cat(out, cap, &len, " | %s%s", c->label ? c->label : "", c->label ? " " : "");
        rf__cat_value(out, cap, &len, c->fmt, v);
        if (c->pm_name && rf_metrics_get(m, c->pm_name, &pm)) {
            rf__cat(out, cap, &len, "\xC2\xB1");  // U+00B1 PLUS-MINUS SIGN in UTF-8
            rf__cat_value(out, cap, &len, c->fmt, pm);
        }
        if (c->unit) rf__cat(out, cap, &len, "%s", c->unit);
    }
    if (total > 0 && steps_timed > 0 && elapsed_s >= 0) {
        int64_t left = total > step ? total - step : 0;
        char eta[32];
        rf_metrics_format_duration(elapsed_s / (double)steps_timed * (double)left, eta, sizeof eta);
        rf__cat(out, cap, &len, " | ETA %s", eta);
    }
    return len;
}
