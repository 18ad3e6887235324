#include "controller/dataset.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/rng.h"
#include "common/util.h"
#include "model/chat_template.h"

struct rf_dataset {
    rf_example *ex; /* (n) in file order */
    int n, cap;
    int n_dropped;
    int n_missing_answer; /* kept examples without the answer key */
    uint64_t seed;
    int no_shuffle;
    int *perm;      /* (n) order of epoch perm_epoch; NULL until first needed */
    int perm_epoch;
};

/* Resolved options and the context of the line being read. */
typedef struct load_ctx {
    const char *path, *prompt_key, *answer_key, *response_key, *tmpl;
    int line;
    const rf_tokenizer *tok;
    int max_tokens;
    int require_answer, require_response, need_answer;
} load_ctx;

static const char *or_default(const char *s, const char *d) { return s && *s ? s : d; }

/* ---- one line ---------------------------------------------------------------------- */

/* Renders an array of {role, content} messages with the template. */
static rf_status render_messages(const load_ctx *c, const char *key, const cJSON *v, char **out) {
    if (!c->tmpl)
        return rf_error(RF_ERR_ARG, "%s:%d: \"%s\" holds chat messages but no chat template was given "
                        "(chatml or llama3)", c->path, c->line, key);
    int n = cJSON_GetArraySize(v), i = 0;
    if (n == 0) return rf_error(RF_ERR_FORMAT, "%s:%d: \"%s\" is an empty list of messages", c->path, c->line, key);
    rf_chat_message *msgs = rf_calloc((size_t)n, sizeof *msgs);
    if (!msgs) return RF_ERR_NOMEM;
    const cJSON *it;
    cJSON_ArrayForEach(it, v) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        if (!cJSON_IsString(role) || !cJSON_IsString(content)) {
            free(msgs);
            return rf_error(RF_ERR_FORMAT, "%s:%d: \"%s\"[%d] needs string \"role\" and \"content\"",
                            c->path, c->line, key, i);
        }
        msgs[i].role = role->valuestring, msgs[i++].content = content->valuestring;
    }
    rf_status s = rf_chat_apply(c->tmpl, msgs, n, 1, out);
    free(msgs);
    return s ? rf_error_wrap(s, "%s:%d: \"%s\"", c->path, c->line, key) : RF_OK;
}

/* The prompt text the model sees: a string as is, or one user turn / a conversation rendered
 * with the template and ending in the assistant generation prompt. */
static rf_status render_prompt(const load_ctx *c, const char *key, const cJSON *v, char **out) {
    if (cJSON_IsString(v)) {
        if (!c->tmpl) {
            *out = rf_strdup(v->valuestring);
            return *out ? RF_OK : rf_error(RF_ERR_NOMEM, "%s:%d: out of memory", c->path, c->line);
        }
        rf_chat_message msg = {"user", v->valuestring};
        return rf_chat_apply(c->tmpl, &msg, 1, 1, out);
    }
    if (cJSON_IsArray(v)) return render_messages(c, key, v, out);
    return rf_error(RF_ERR_FORMAT, "%s:%d: \"%s\" must be a string or a list of {role, content} messages",
                    c->path, c->line, key);
}

/* A JSON number as the shortest text that reads back to the same double ("42", "2.5"). */
static char *number_text(double v) {
    char buf[64];
    if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        snprintf(buf, sizeof buf, "%lld", (long long)v);
    } else {
        snprintf(buf, sizeof buf, "%.15g", v);
        if (strtod(buf, NULL) != v) snprintf(buf, sizeof buf, "%.17g", v);
    }
    return rf_strdup(buf);
}

/* Takes the optional answer or response field out of obj into *out (NULL when absent). */
static rf_status take_text(const load_ctx *c, cJSON *obj, const char *key, int allow_number,
                           int required, char **out) {
    *out = NULL;
    cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v) return required ? rf_error(RF_ERR_FORMAT, "%s:%d: missing \"%s\"", c->path, c->line, key) : RF_OK;
    if (cJSON_IsString(v)) *out = rf_strdup(v->valuestring);
    else if (allow_number && cJSON_IsNumber(v)) *out = number_text(v->valuedouble);
    else if (allow_number)
        return rf_error(RF_ERR_FORMAT, "%s:%d: \"%s\" must be a string or a number", c->path, c->line, key);
    else return rf_error(RF_ERR_FORMAT, "%s:%d: \"%s\" must be a string", c->path, c->line, key);
    if (!*out) return RF_ERR_NOMEM;
    cJSON_DeleteItemFromObjectCaseSensitive(obj, key);
    return RF_OK;
}

static void example_clear(rf_example *e) {
    free((char *)e->prompt_text);
    free(e->prompt_ids);
    free((char *)e->answer);
    free((char *)e->response);
    cJSON_Delete((cJSON *)e->extra);
    memset(e, 0, sizeof *e);
}

/* JSON text is UTF-8 (RFC 8259, section 8.1), and a line's strings go on to programs that
 * decode them as such (protobuf string fields: reward and environment programs refuse them
 * later, far from the line): every key and string of it must be UTF-8. `at` (len bytes of cap)
 * names v: "" for the line, then "prompt", "messages"[1]["content"]; restored on return. */
static rf_status check_utf8(const load_ctx *c, const cJSON *v, char *at, size_t len, size_t cap) {
    if (cJSON_IsString(v)) {
        size_t n = strlen(v->valuestring), bad = rf_utf8_invalid_at(v->valuestring, n);
        if (bad < n)
            return rf_error(RF_ERR_FORMAT, "%s:%d: %s is not valid UTF-8 at byte %zu of its %zu", c->path, c->line,
                            at, bad, n);
        return RF_OK;
    }
    if (!cJSON_IsArray(v) && !cJSON_IsObject(v)) return RF_OK;
    int i = 0;
    for (const cJSON *it = v->child; it; it = it->next, i++) {
        if (cJSON_IsObject(v)) {
            size_t n = strlen(it->string), bad = rf_utf8_invalid_at(it->string, n);
            if (bad < n)
                return rf_error(RF_ERR_FORMAT, "%s:%d: a field name%s%s is not valid UTF-8 at byte %zu of its %zu",
                                c->path, c->line, len ? " in " : "", at, bad, n);
            if (len) snprintf(at + len, cap - len, "[\"%s\"]", it->string);
            else snprintf(at, cap, "\"%s\"", it->string);
        } else {
            snprintf(at + len, cap - len, "[%d]", i);
        }
        rf_status s = check_utf8(c, it, at, strlen(at), cap);
        at[len] = '\0';
        RF_TRY(s);
    }
    return RF_OK;
}

/* Parses one non-blank line into e (which owns everything it points to, also on error). */
static rf_status parse_line(const load_ctx *c, const char *text, rf_example *e) {
    memset(e, 0, sizeof *e);
    e->line = c->line;
    cJSON *obj = cJSON_ParseWithOpts(text, NULL, 1);
    if (!obj) return rf_error(RF_ERR_FORMAT, "%s:%d: invalid JSON", c->path, c->line);
    e->extra = obj;
    if (!cJSON_IsObject(obj)) return rf_error(RF_ERR_FORMAT, "%s:%d: not a JSON object", c->path, c->line);
    char at[256] = "";
    RF_TRY(check_utf8(c, obj, at, 0, sizeof at));
    const char *key = c->prompt_key;
    cJSON *p = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!p) p = cJSON_GetObjectItemCaseSensitive(obj, key = "messages");
    if (!p)
        return rf_error(RF_ERR_FORMAT, "%s:%d: missing \"%s\" (or \"messages\")", c->path, c->line, c->prompt_key);
    char *prompt = NULL;
    RF_TRY(render_prompt(c, key, p, &prompt));
    e->prompt_text = prompt;
    cJSON_DeleteItemFromObjectCaseSensitive(obj, key);
    char *answer = NULL, *response = NULL;
    rf_status s = take_text(c, obj, c->answer_key, 1, c->require_answer, &answer);
    e->answer = answer;
    if (s == RF_OK) s = take_text(c, obj, c->response_key, 0, c->require_response, &response);
    e->response = response;
    return s;
}

/* ---- the file ---------------------------------------------------------------------- */

static rf_status push_example(rf_dataset *ds, rf_example *e) {
    if (ds->n == ds->cap) {
        int cap = ds->cap ? 2 * ds->cap : 256;
        rf_example *ex = realloc(ds->ex, (size_t)cap * sizeof *ex);
        if (!ex) return rf_error(RF_ERR_NOMEM, "dataset: out of memory");
        ds->ex = ex, ds->cap = cap;
    }
    e->index = ds->n;
    ds->ex[ds->n++] = *e;
    return RF_OK;
}

/* Reads one line; on success it is kept, dropped as overlong, or skipped as blank. */
static rf_status load_line(rf_dataset *ds, const load_ctx *c, char *text) {
    size_t len = strlen(text);
    if (len && text[len - 1] == '\r') text[--len] = '\0';
    if (strspn(text, " \t\r") == len) return RF_OK;
    rf_example e;
    rf_status s = parse_line(c, text, &e);
    if (s == RF_OK && c->tok) {
        /* A rendered template already holds its special tokens (Llama 3's BOS). */
        s = rf_tokenizer_encode(c->tok, e.prompt_text, strlen(e.prompt_text), c->tmpl == NULL,
                                &e.prompt_ids, &e.n_prompt);
        if (s) s = rf_error_wrap(s, "%s:%d: tokenizing the prompt", c->path, c->line);
    }
    if (s == RF_OK && c->max_tokens > 0 && e.n_prompt > c->max_tokens) {
        ds->n_dropped++;
        example_clear(&e);
        return RF_OK;
    }
    if (s == RF_OK) s = push_example(ds, &e);
    if (s) example_clear(&e);
    return s;
}

static rf_status load_lines(rf_dataset *ds, const load_ctx *c0, char *data, size_t len) {
    load_ctx c = *c0;
    c.line = 0;
    char *p = data, *end = data + len;
    while (p < end) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl) *nl = '\0';
        c.line++;
        RF_TRY(load_line(ds, &c, p));
        p = nl ? nl + 1 : end;
    }
    if (ds->n == 0 && ds->n_dropped == 0)
        return rf_error(RF_ERR_FORMAT, "%s: no examples (the file is empty or blank)", c.path);
    if (ds->n == 0)
        return rf_error(RF_ERR_RANGE, "%s: all %d prompts are longer than max_prompt_tokens (%d)", c.path,
                        ds->n_dropped, c.max_tokens);
    if (ds->n_dropped)
        rf_log_warn("%s: dropped %d of %d prompts longer than max_prompt_tokens (%d)", c.path,
                    ds->n_dropped, ds->n + ds->n_dropped, c.max_tokens);
    return RF_OK;
}

/* The fields of example e as the file had them, for messages: "prompt", "id", "solution". */
static void field_list(const load_ctx *c, const rf_example *e, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "\"%s\"", c->prompt_key);
    if (e->response && n < cap) n += (size_t)snprintf(buf + n, cap - n, ", \"%s\"", c->response_key);
    const cJSON *it;
    cJSON_ArrayForEach(it, e->extra) {
        if (n >= cap) break;
        n += (size_t)snprintf(buf + n, cap - n, ", \"%s\"", it->string ? it->string : "?");
    }
}

/* need_answer: none of the examples has the answer field is an error (every correctness
 * reward would be 0); some without it are counted and logged. */
static rf_status check_answers(rf_dataset *ds, const load_ctx *c) {
    for (int i = 0; i < ds->n; i++) ds->n_missing_answer += ds->ex[i].answer == NULL;
    if (!c->need_answer || ds->n_missing_answer == 0) return RF_OK;
    if (ds->n_missing_answer == ds->n) {
        char fields[512];
        field_list(c, &ds->ex[0], fields, sizeof fields);
        return rf_error(RF_ERR_FORMAT, "%s: no example has the field \"%s\" (data.answer_key) that the "
                        "reward rules compare with; line %d has %s", c->path, c->answer_key, ds->ex[0].line,
                        fields);
    }
    rf_log_warn("%s: %d of %d examples have no \"%s\" (data.answer_key): their correctness rewards are 0",
                c->path, ds->n_missing_answer, ds->n, c->answer_key);
    return RF_OK;
}

static rf_status check_opts(const load_ctx *c) {
    if (c->max_tokens > 0 && !c->tok)
        return rf_error(RF_ERR_ARG, "%s: max_prompt_tokens needs a tokenizer", c->path);
    if (c->max_tokens < 0)
        return rf_error(RF_ERR_ARG, "%s: max_prompt_tokens must be >= 0, got %d", c->path, c->max_tokens);
    if (c->tmpl) { /* an unknown template fails here once, not on every line */
        rf_chat_message m = {"user", "x"};
        char *t = NULL;
        rf_status s = rf_chat_apply(c->tmpl, &m, 1, 1, &t);
        free(t);
        if (s) return rf_error_wrap(s, "%s: chat_template", c->path);
    }
    return RF_OK;
}

rf_status rf_dataset_load(rf_dataset **out, const char *path, const rf_dataset_opts *o,
                          const rf_tokenizer *tok) {
    static const rf_dataset_opts defaults;
    if (!o) o = &defaults;
    *out = NULL;
    load_ctx c = {
        .path = path,
        .prompt_key = or_default(o->prompt_key, "prompt"),
        .answer_key = or_default(o->answer_key, "answer"),
        .response_key = or_default(o->response_key, "response"),
        .tmpl = o->chat_template && *o->chat_template ? o->chat_template : NULL,
        .tok = tok,
        .max_tokens = o->max_prompt_tokens,
        .require_answer = o->require_answer,
        .require_response = o->require_response,
        .need_answer = o->need_answer,
    };
    RF_TRY(check_opts(&c));
    char *data = NULL;
    size_t len = 0;
    RF_TRY(rf_read_file(path, &data, &len));
    rf_dataset *ds = rf_calloc(1, sizeof *ds);
    if (!ds) {
        free(data);
        return RF_ERR_NOMEM;
    }
    ds->seed = o->seed, ds->no_shuffle = o->no_shuffle, ds->perm_epoch = -1;
    rf_status s = load_lines(ds, &c, data, len);
    if (s == RF_OK) s = check_answers(ds, &c);
    free(data);
    if (s) {
        rf_dataset_free(ds);
        return s;
    }
    *out = ds;
    return RF_OK;
}

void rf_dataset_free(rf_dataset *ds) {
    if (!ds) return;
    for (int i = 0; i < ds->n; i++) example_clear(&ds->ex[i]);
    free(ds->ex);
    free(ds->perm);
    free(ds);
}

int rf_dataset_size(const rf_dataset *ds) { return ds->n; }

int rf_dataset_n_dropped(const rf_dataset *ds) { return ds->n_dropped; }

int rf_dataset_n_missing_answer(const rf_dataset *ds) { return ds->n_missing_answer; }

const rf_example *rf_dataset_get(const rf_dataset *ds, int i) {
    return i >= 0 && i < ds->n ? &ds->ex[i] : NULL;
}

/* ---- order ------------------------------------------------------------------------- */

/* Epoch e's order: Fisher-Yates (Knuth, TAOCP vol. 2, 3.4.2, algorithm P) over the identity,
 * with a generator seeded from (seed, epoch) only, so that any epoch can be rebuilt alone.
 * The modulo bias of rf_rng_u64() % (i + 1) is below n / 2^64: negligible. */
static rf_status build_order(rf_dataset *ds, int epoch) {
    if (ds->perm_epoch == epoch) return RF_OK;
    if (!ds->perm && !(ds->perm = rf_calloc((size_t)ds->n, sizeof *ds->perm))) return RF_ERR_NOMEM;
    for (int i = 0; i < ds->n; i++) ds->perm[i] = i;
    if (!ds->no_shuffle) {
        rf_rng r;
        rf_rng_seed(&r, ds->seed ^ 0x5851F42D4C957F2Dull);
        uint64_t base = rf_rng_u64(&r);
        rf_rng_seed(&r, base + 0x9E3779B97F4A7C15ull * (uint64_t)epoch);
        for (int i = ds->n - 1; i > 0; i--) {
            int j = (int)(rf_rng_u64(&r) % (uint64_t)(i + 1));
            int t = ds->perm[i];
            ds->perm[i] = ds->perm[j], ds->perm[j] = t;
        }
    }
    ds->perm_epoch = epoch;
    return RF_OK;
}

static int pos_valid(const rf_dataset *ds, rf_dataset_pos p) {
    return p.epoch >= 0 && p.index >= 0 && p.index < ds->n;
}

int rf_dataset_index_at(rf_dataset *ds, rf_dataset_pos pos) {
    if (!pos_valid(ds, pos) || build_order(ds, pos.epoch)) return -1;
    return ds->perm[pos.index];
}

rf_status rf_dataset_next(rf_dataset *ds, rf_dataset_pos *pos, int n, const rf_example **out) {
    if (n < 0) return rf_error(RF_ERR_ARG, "dataset: asked for %d examples", n);
    if (!pos_valid(ds, *pos))
        return rf_error(RF_ERR_ARG, "dataset: position {epoch %d, index %d} outside a dataset of %d examples",
                        pos->epoch, pos->index, ds->n);
    rf_dataset_pos p = *pos;
    for (int k = 0; k < n; k++) {
        RF_TRY(build_order(ds, p.epoch));
        out[k] = &ds->ex[ds->perm[p.index]];
        if (++p.index == ds->n) p.epoch++, p.index = 0;
    }
    *pos = p;
    return RF_OK;
}
