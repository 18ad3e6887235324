#include "controller/tasks.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"

void rf_task_opts_default(rf_task_opts *o) {
    *o = (rf_task_opts){.min_digits = 1, .max_digits = 3, .mul_percent = 10,
                        .n_numbers = 3, .max_number = 50, .max_target = 200};
}

const char *rf_task_names(void) { return "arith, countdown, multiply"; }

/* Uniform in [lo, hi]; the modulo bias is below (hi - lo) / 2^64. */
static int64_t rand_range(rf_rng *r, int64_t lo, int64_t hi) {
    return lo + (int64_t)(rf_rng_u64(r) % (uint64_t)(hi - lo + 1));
}

/* ---- arith ------------------------------------------------------------------------- */

static int64_t pow10i(int d) {
    int64_t p = 1;
    while (d-- > 0) p *= 10;
    return p;
}

/* A number with exactly d digits (d = 1: 0..9). */
static int64_t rand_digits(rf_rng *r, int d) {
    return rand_range(r, d == 1 ? 0 : pow10i(d - 1), pow10i(d) - 1);
}

static cJSON *arith_make(rf_rng *r, const rf_task_opts *o) {
    int64_t a, b, v;
    char op;
    if ((int)(rf_rng_u64(r) % 100) < o->mul_percent) { /* small products: k digits times 2..9 */
        int top = o->max_digits > o->min_digits ? o->max_digits - 1 : o->min_digits;
        a = rand_digits(r, (int)rand_range(r, o->min_digits, top));
        b = rand_range(r, 2, 9), op = '*', v = a * b;
    } else {
        a = rand_digits(r, (int)rand_range(r, o->min_digits, o->max_digits));
        b = rand_digits(r, (int)rand_range(r, o->min_digits, o->max_digits));
        if (rf_rng_u64(r) & 1) {
            op = '+', v = a + b;
        } else {
            if (a < b) { int64_t t = a; a = b, b = t; }
            op = '-', v = a - b;
        }
    }
    char prompt[64], answer[32];
    snprintf(prompt, sizeof prompt, "%lld%c%lld=", (long long)a, op, (long long)b);
    snprintf(answer, sizeof answer, "%lld", (long long)v);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "prompt", prompt);
    cJSON_AddStringToObject(j, "answer", answer);
    cJSON_AddStringToObject(j, "response", answer);
    return j;
}

/* ---- multiply: a task for the calculator tool ---------------------------------------- */

static cJSON *multiply_make(rf_rng *r, const rf_task_opts *o) {
    int64_t a = rand_digits(r, (int)rand_range(r, o->min_digits, o->max_digits));
    int64_t b = rand_digits(r, (int)rand_range(r, o->min_digits, o->max_digits));
    char prompt[64], answer[32], response[160];
    snprintf(prompt, sizeof prompt, "%lld*%lld=", (long long)a, (long long)b);
    snprintf(answer, sizeof answer, "%lld", (long long)(a * b));
    /* the tool call, the calculator's answer, then the answer copied (env/calculator.h) */
    snprintf(response, sizeof response, "<calc>%lld*%lld</calc><result>%s</result>%s", (long long)a, (long long)b,
             answer, answer);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "prompt", prompt);
    cJSON_AddStringToObject(j, "answer", answer);
    cJSON_AddStringToObject(j, "response", response);
    return j;
}

/* ---- countdown --------------------------------------------------------------------- */

/* A partial expression while combining numbers: value, text, and the precedence of its top
 * operator (3 a number, 2 * or /, 1 + or -) to place parentheses only where needed. */
typedef struct cd_item {
    int64_t v;
    int prec;
    char s[160];
} cd_item;

/* Combines a and b with op into *out when the step stays in positive integers; 0 otherwise. */
static int cd_combine(const cd_item *a, const cd_item *b, char op, cd_item *out) {
    int64_t v = 0;
    if (op == '+' && __builtin_add_overflow(a->v, b->v, &v)) return 0;
    if (op == '-' && (v = a->v - b->v) <= 0) return 0;
    if (op == '*' && __builtin_mul_overflow(a->v, b->v, &v)) return 0;
    if (op == '/' && (b->v <= 1 || a->v % b->v != 0)) return 0;
    if (op == '/') v = a->v / b->v;
    int prec = op == '+' || op == '-' ? 1 : 2;
    /* a+(b-c) = a+b-c, but a-(b+c), a*(b+c) and a/(b*c) need their parentheses. */
    int pa = a->prec < prec, pb = b->prec < prec || (b->prec == prec && (op == '-' || op == '/'));
    out->v = v, out->prec = prec;
    int n = snprintf(out->s, sizeof out->s, "%s%s%s%c%s%s%s", pa ? "(" : "", a->s, pa ? ")" : "", op,
                     pb ? "(" : "", b->s, pb ? ")" : "");
    return n > 0 && (size_t)n < sizeof out->s;
}

/* Combines all the numbers in a random order with random operations; 0 when it gets stuck. */
static int cd_solve(rf_rng *r, const int64_t *nums, int n, cd_item *out) {
    cd_item it[6];
    for (int i = 0; i < n; i++) {
        it[i].v = nums[i], it[i].prec = 3;
        snprintf(it[i].s, sizeof it[i].s, "%lld", (long long)nums[i]);
    }
    for (int count = n; count > 1; count--) {
        int done = 0;
        for (int tries = 0; tries < 32 && !done; tries++) {
            int i = (int)rand_range(r, 0, count - 1), j = (int)rand_range(r, 0, count - 2);
            if (j >= i) j++;
            cd_item c;
            if (cd_combine(&it[i], &it[j], "+-*/"[rf_rng_u64(r) % 4], &c)) {
                it[i] = c, it[j] = it[count - 1], done = 1;
            }
        }
        if (!done) return 0;
    }
    *out = it[0];
    return 1;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* NULL when this draw has no solution in range (the caller draws again). */
static cJSON *countdown_make(rf_rng *r, const rf_task_opts *o) {
    int64_t nums[6];
    int n = o->n_numbers;
    for (int i = 0; i < n; i++) nums[i] = rand_range(r, 1, o->max_number);
    cd_item sol;
    if (!cd_solve(r, nums, n, &sol) || sol.v < 1 || sol.v > o->max_target) return NULL;
    qsort(nums, (size_t)n, sizeof nums[0], cmp_i64);
    /* the answer is the countdown rule's truth "NUMBERS -> TARGET" (reward/countdown.h): the
     * target alone would let a rule reward the bare number */
    char prompt[96], answer[128];
    size_t len = 0;
    for (int i = 0; i < n; i++)
        len += (size_t)snprintf(prompt + len, sizeof prompt - len, "%s%lld", i ? " " : "", (long long)nums[i]);
    snprintf(answer, sizeof answer, "%s -> %lld", prompt, (long long)sol.v);
    snprintf(prompt + len, sizeof prompt - len, " -> %lld:", (long long)sol.v);
    cJSON *j = cJSON_CreateObject(), *arr = cJSON_CreateArray();
    cJSON_AddStringToObject(j, "prompt", prompt);
    cJSON_AddStringToObject(j, "answer", answer);
    cJSON_AddStringToObject(j, "response", sol.s);
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber((double)nums[i]));
    cJSON_AddItemToObject(j, "numbers", arr);
    cJSON_AddNumberToObject(j, "target", (double)sol.v);
    return j;
}

/* ---- generation -------------------------------------------------------------------- */

typedef cJSON *(*task_make_fn)(rf_rng *r, const rf_task_opts *o);

/* A set of prompt hashes (FNV-1a 64): a collision could only reject a good training prompt,
 * never let a validation prompt through, so hashes are enough. Open addressing, 0 = empty. */
typedef struct hash_set {
    uint64_t *slot;
    size_t cap, n;
} hash_set;

static uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h ? h : 1;
}

static int set_has(const hash_set *h, uint64_t k) {
    for (size_t i = k & (h->cap - 1); h->slot[i]; i = (i + 1) & (h->cap - 1))
        if (h->slot[i] == k) return 1;
    return 0;
}

static void set_add(hash_set *h, uint64_t k) {
    size_t i = k & (h->cap - 1);
    while (h->slot[i] && h->slot[i] != k) i = (i + 1) & (h->cap - 1);
    if (!h->slot[i]) h->slot[i] = k, h->n++;
}

/* A growing text buffer of JSON lines. */
typedef struct text_buf {
    char *p;
    size_t len, cap;
} text_buf;

static rf_status buf_add_line(text_buf *b, const char *s) {
    size_t n = strlen(s);
    if (b->len + n + 2 > b->cap) {
        size_t cap = b->cap ? b->cap : 1 << 16;
        while (b->len + n + 2 > cap) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return rf_error(RF_ERR_NOMEM, "task: out of memory");
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len++] = '\n';
    b->p[b->len] = '\0';
    return RF_OK;
}

/* Makes `count` lines into b. Validation (is_val): distinct prompts, each added to `val`.
 * Training: any prompt not in `val`. Gives up after a bounded number of draws. */
static rf_status make_split(task_make_fn make, const char *task, const rf_task_opts *o, uint64_t seed,
                            int count, int is_val, hash_set *val, text_buf *b) {
    rf_rng r;
    rf_rng_seed(&r, seed);
    long long max_draws = 50LL * count + 100000;
    int made = 0;
    rf_status s = RF_OK;
    for (long long d = 0; s == RF_OK && made < count && d < max_draws; d++) {
        cJSON *j = make(&r, o);
        if (!j) continue;
        uint64_t k = fnv1a(cJSON_GetObjectItem(j, "prompt")->valuestring);
        if (!set_has(val, k)) {
            if (is_val) set_add(val, k);
            char *line = cJSON_PrintUnformatted(j);
            s = line ? buf_add_line(b, line) : rf_error(RF_ERR_NOMEM, "task: out of memory");
            free(line);
            made++;
        }
        cJSON_Delete(j);
    }
    if (s == RF_OK && made < count)
        s = rf_error(RF_ERR_RANGE, "task %s: made only %d of %d %s prompts%s: the task has too few distinct "
                     "problems with these options (allow more digits or numbers)", task, made, count,
                     is_val ? "distinct validation" : "training", is_val ? "" : " outside the validation set");
    return s;
}

static rf_status check_task_opts(const char *task, const rf_task_opts *o) {
    if (strcmp(task, "multiply") == 0) {
        if (o->min_digits < 1 || o->max_digits > 9 || o->min_digits > o->max_digits)
            return rf_error(RF_ERR_ARG, "multiply: digits must satisfy 1 <= min (%d) <= max (%d) <= 9",
                            o->min_digits, o->max_digits);
    } else if (strcmp(task, "arith") == 0) {
        if (o->min_digits < 1 || o->max_digits > 9 || o->min_digits > o->max_digits)
            return rf_error(RF_ERR_ARG, "arith: digits must satisfy 1 <= min (%d) <= max (%d) <= 9",
                            o->min_digits, o->max_digits);
        if (o->mul_percent < 0 || o->mul_percent > 100)
            return rf_error(RF_ERR_ARG, "arith: mul_percent must be in 0..100, got %d", o->mul_percent);
    } else {
        if (o->n_numbers < 2 || o->n_numbers > 6)
            return rf_error(RF_ERR_ARG, "countdown: n_numbers must be in 2..6, got %d", o->n_numbers);
        if (o->max_number < 2 || o->max_number > 9999)
            return rf_error(RF_ERR_ARG, "countdown: max_number must be in 2..9999, got %d", o->max_number);
        if (o->max_target < 1)
            return rf_error(RF_ERR_ARG, "countdown: max_target must be >= 1, got %d", o->max_target);
    }
    return RF_OK;
}

static rf_status write_split(const char *dir, const char *name, const text_buf *b) {
    char path[4096];
    rf_path_join(path, sizeof path, dir, name);
    return rf_write_file_atomic(path, b->p ? b->p : "", b->len);
}

rf_status rf_task_generate_opts(const char *task, const char *out_dir, int n_train, int n_val,
                                uint64_t seed, const rf_task_opts *opts) {
    rf_task_opts def;
    rf_task_opts_default(&def);
    const rf_task_opts *o = opts ? opts : &def;
    task_make_fn make = strcmp(task, "arith") == 0 ? arith_make
                      : strcmp(task, "countdown") == 0 ? countdown_make
                      : strcmp(task, "multiply") == 0 ? multiply_make : NULL;
    if (!make) return rf_error(RF_ERR_ARG, "unknown task \"%s\" (tasks: %s)", task, rf_task_names());
    if (n_train < 0 || n_val < 0)
        return rf_error(RF_ERR_ARG, "task %s: negative example count (train %d, val %d)", task, n_train, n_val);
    RF_TRY(check_task_opts(task, o));
    RF_TRY(rf_mkdirs(out_dir));
    /* Two independent streams, so that the validation set does not depend on n_train. */
    rf_rng master;
    rf_rng_seed(&master, seed);
    uint64_t val_seed = rf_rng_u64(&master), train_seed = rf_rng_u64(&master);
    hash_set val = {0};
    for (val.cap = 1024; val.cap < 2 * (size_t)n_val + 2; val.cap *= 2) {}
    text_buf bv = {0}, bt = {0};
    rf_status s = (val.slot = rf_calloc(val.cap, sizeof *val.slot)) ? RF_OK : RF_ERR_NOMEM;
    if (s == RF_OK) s = make_split(make, task, o, val_seed, n_val, 1, &val, &bv);
    if (s == RF_OK) s = make_split(make, task, o, train_seed, n_train, 0, &val, &bt);
    if (s == RF_OK) s = write_split(out_dir, "val.jsonl", &bv);
    if (s == RF_OK) s = write_split(out_dir, "train.jsonl", &bt);
    free(val.slot), free(bv.p), free(bt.p);
    return s;
}

rf_status rf_task_generate(const char *task, const char *out_dir, int n_train, int n_val,
                           uint64_t seed) {
    return rf_task_generate_opts(task, out_dir, n_train, n_val, seed, NULL);
}
