/* Training data: JSONL loading (fields, chat templates, tokenization, overlong prompts, errors
 * with file:line, text that is not UTF-8), the seeded per-epoch order and resuming from a saved position, the built-in
 * task generators (deterministic, train/val disjoint, responses correct) and the countdown
 * checker. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "controller/dataset.h"
#include "controller/tasks.h"
#include "model/byte_tokenizer.h"
#include "reward/reward.h"
#include "model/tokenizer.h"
#include "test_util.h"

static char g_dir[256];
static rf_tokenizer *g_tok; /* byte-level: one token per byte, <|im_start|> = 257 */

/* Writes text to g_dir/name and returns the path (static buffer, one at a time). */
static const char *write_tmp(const char *name, const char *text) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return path;
    fputs(text, f);
    fclose(f);
    return path;
}

static char *slurp(const char *path) {
    char *d = NULL;
    if (rf_read_file(path, &d, NULL)) return NULL;
    return d;
}

static void test_load_fields(void) {
    const char *path = write_tmp("good.jsonl",
                                 "{\"prompt\": \"1+1=\", \"answer\": \"2\", \"id\": 7, \"meta\": {\"src\": \"x\"}}\n"
                                 "\n"
                                 "  \t\r\n"
                                 "{\"prompt\": \"ab\", \"answer\": 42, \"response\": \"42\"}\r\n"
                                 "{\"prompt\": \"c\", \"answer\": 2.5}\n"
                                 "{\"messages\": \"plain\"}");
    rf_dataset *ds = NULL;
    CHECK_OK(rf_dataset_load(&ds, path, NULL, g_tok));
    if (!ds) return;
    CHECK(rf_dataset_size(ds) == 4);
    const rf_example *e = rf_dataset_get(ds, 0);
    CHECK(strcmp(e->prompt_text, "1+1=") == 0 && strcmp(e->answer, "2") == 0 && !e->response);
    CHECK(e->line == 1 && e->index == 0);
    CHECK(e->n_prompt == 4 && e->prompt_ids[0] == '1' && e->prompt_ids[3] == '=');
    /* Other fields pass through; prompt and answer are taken out of extra. */
    CHECK(cJSON_GetArraySize(e->extra) == 2);
    CHECK(cJSON_GetObjectItem(e->extra, "id")->valueint == 7);
    CHECK(strcmp(cJSON_GetObjectItem(cJSON_GetObjectItem(e->extra, "meta"), "src")->valuestring, "x") == 0);
    CHECK(!cJSON_GetObjectItem(e->extra, "prompt") && !cJSON_GetObjectItem(e->extra, "answer"));
    e = rf_dataset_get(ds, 1);
    CHECK(e->line == 4 && strcmp(e->answer, "42") == 0 && strcmp(e->response, "42") == 0);
    CHECK(cJSON_IsObject(e->extra) && cJSON_GetArraySize(e->extra) == 0);
    /* what reward programs get as metadata_json (docs/reward-api.md): "{}", not "" */
    char *meta = cJSON_PrintUnformatted(e->extra);
    CHECK(meta && !strcmp(meta, "{}"));
    free(meta);
    CHECK(strcmp(rf_dataset_get(ds, 2)->answer, "2.5") == 0);
    e = rf_dataset_get(ds, 3); /* "messages" holding a string is a plain prompt */
    CHECK(e->line == 6 && strcmp(e->prompt_text, "plain") == 0 && !e->answer);
    CHECK(rf_dataset_get(ds, 4) == NULL && rf_dataset_get(ds, -1) == NULL);
    CHECK(rf_dataset_n_dropped(ds) == 0);
    rf_dataset_free(ds);

    /* Without a tokenizer: text only. */
    CHECK_OK(rf_dataset_load(&ds, path, NULL, NULL));
    if (ds) CHECK(rf_dataset_get(ds, 0)->prompt_ids == NULL && rf_dataset_get(ds, 0)->n_prompt == 0);
    rf_dataset_free(ds);
}

static void test_custom_keys(void) {
    const char *path = write_tmp("keys.jsonl",
                                 "{\"question\": \"q1\", \"solution\": \"s1\", \"target\": \"t1\", \"answer\": \"kept\"}\n");
    rf_dataset_opts o = {.prompt_key = "question", .answer_key = "solution", .response_key = "target",
                         .require_answer = 1, .require_response = 1};
    rf_dataset *ds = NULL;
    CHECK_OK(rf_dataset_load(&ds, path, &o, g_tok));
    if (!ds) return;
    const rf_example *e = rf_dataset_get(ds, 0);
    CHECK(strcmp(e->prompt_text, "q1") == 0 && strcmp(e->answer, "s1") == 0 && strcmp(e->response, "t1") == 0);
    CHECK(strcmp(cJSON_GetObjectItem(e->extra, "answer")->valuestring, "kept") == 0);
    CHECK(cJSON_GetArraySize(e->extra) == 1);
    rf_dataset_free(ds);
}

/* Loads `text` expecting an error with `code` whose message contains `needle`. */
static void expect_error(const char *text, const rf_dataset_opts *o, rf_status code, const char *needle) {
    const char *path = write_tmp("bad.jsonl", text);
    rf_dataset *ds = (rf_dataset *)1;
    CHECK_ERR(rf_dataset_load(&ds, path, o, g_tok), code, needle);
    CHECK(ds == NULL);
}

/* Text that is not UTF-8 (RFC 8259 requires it; reward and environment programs decode it as
 * such) is refused at load with the exact error naming the line, the field and the byte,
 * whichever field holds it and however deep; valid multi-byte UTF-8 loads byte for byte. */
static void test_utf8(void) {
    char needle[600];
#define AT(line, rest) (snprintf(needle, sizeof needle, "%s/bad.jsonl:%d: %s", g_dir, line, rest), needle)
#define EXACT(text, o, line, rest)                                                               \
    do {                                                                                         \
        expect_error(text, o, RF_ERR_FORMAT, AT(line, rest));                                    \
        CHECK(strcmp(rf_error_message(), needle) == 0);                                          \
    } while (0)
    EXACT("{\"prompt\": \"a\xff\"}\n", NULL, 1, "\"prompt\" is not valid UTF-8 at byte 1 of its 2");
    /* without a tokenizer too: nothing else would look at the bytes */
    rf_dataset *ds = (rf_dataset *)1;
    CHECK_ERR(rf_dataset_load(&ds, write_tmp("bad.jsonl", "{\"prompt\": \"a\xff\"}\n"), NULL, NULL), RF_ERR_FORMAT,
              AT(1, "\"prompt\" is not valid UTF-8 at byte 1 of its 2"));
    CHECK(ds == NULL);
    EXACT("{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"answer\": \"1\xc3\x28\"}\n", NULL, 2,
          "\"answer\" is not valid UTF-8 at byte 1 of its 3");
    EXACT("{\"prompt\": \"a\", \"response\": \"\xc0\xaf\"}\n", NULL, 1, /* overlong '/' */
          "\"response\" is not valid UTF-8 at byte 0 of its 2");
    EXACT("{\"prompt\": \"a\", \"meta\": {\"src\": [\"ok\", \"x\xed\xa0\x80\"]}}\n", NULL, 1, /* a surrogate */
          "\"meta\"[\"src\"][1] is not valid UTF-8 at byte 1 of its 4");
    EXACT("{\"prompt\": \"a\", \"k\xff\": 1}\n", NULL, 1, "a field name is not valid UTF-8 at byte 1 of its 2");
    EXACT("{\"prompt\": \"a\", \"meta\": {\"\xe4\xb8\": 1}}\n", NULL, 1,
          "a field name in \"meta\" is not valid UTF-8 at byte 0 of its 2");
    rf_dataset_opts chat = {.chat_template = "chatml"};
    EXACT("{\"messages\": [{\"role\": \"user\", \"content\": \"\xf0\x9f\x98\"}]}\n", &chat, 1, /* cut short */
          "\"messages\"[0][\"content\"] is not valid UTF-8 at byte 0 of its 3");
#undef EXACT
#undef AT
    /* é (2 bytes), 中 (3), 😀 (4), and the same from \u escapes: kept as they are */
    const char *path = write_tmp("utf8.jsonl", "{\"prompt\": \"caf\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80\", "
                                               "\"answer\": \"\\u00e9\\ud83d\\ude00\", \"note\": \"\xe4\xb8\xad\"}\n");
    CHECK_OK(rf_dataset_load(&ds, path, NULL, g_tok));
    if (!ds) return;
    const rf_example *e = rf_dataset_get(ds, 0);
    CHECK(strcmp(e->prompt_text, "caf\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80") == 0 && e->n_prompt == 14);
    CHECK(strcmp(e->answer, "\xc3\xa9\xf0\x9f\x98\x80") == 0);
    CHECK(strcmp(cJSON_GetObjectItem(e->extra, "note")->valuestring, "\xe4\xb8\xad") == 0);
    rf_dataset_free(ds);
}

static void test_errors(void) {
    char needle[600];
#define AT(line, rest) (snprintf(needle, sizeof needle, "%s/bad.jsonl:%d: %s", g_dir, line, rest), needle)
    expect_error("{\"prompt\": \"a\"}\n\n{\"prompt\": \"b\",}\n", NULL, RF_ERR_FORMAT, AT(3, "invalid JSON"));
    expect_error("{\"prompt\": \"a\"} trailing\n", NULL, RF_ERR_FORMAT, AT(1, "invalid JSON"));
    expect_error("[1, 2]\n", NULL, RF_ERR_FORMAT, AT(1, "not a JSON object"));
    expect_error("{\"prompt\": \"a\"}\n{\"question\": \"b\"}\n", NULL, RF_ERR_FORMAT,
                 AT(2, "missing \"prompt\" (or \"messages\")"));
    rf_dataset_opts q = {.prompt_key = "question"};
    expect_error("{\"prompt\": \"a\"}\n", &q, RF_ERR_FORMAT, AT(1, "missing \"question\" (or \"messages\")"));
    expect_error("{\"prompt\": 5}\n", NULL, RF_ERR_FORMAT,
                 AT(1, "\"prompt\" must be a string or a list of {role, content} messages"));
    expect_error("{\"prompt\": \"a\", \"answer\": true}\n", NULL, RF_ERR_FORMAT,
                 AT(1, "\"answer\" must be a string or a number"));
    expect_error("{\"prompt\": \"a\", \"response\": 3}\n", NULL, RF_ERR_FORMAT, AT(1, "\"response\" must be a string"));
    rf_dataset_opts req = {.require_answer = 1};
    expect_error("{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": \"b\"}\n", &req, RF_ERR_FORMAT,
                 AT(2, "missing \"answer\""));
    rf_dataset_opts sft = {.require_response = 1};
    expect_error("{\"prompt\": \"a\"}\n", &sft, RF_ERR_FORMAT, AT(1, "missing \"response\""));
    expect_error("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n", NULL, RF_ERR_ARG,
                 AT(1, "\"messages\" holds chat messages but no chat template was given (chatml or llama3)"));
    rf_dataset_opts chat = {.chat_template = "chatml"};
    expect_error("{\"messages\": [{\"role\": \"user\"}]}\n", &chat, RF_ERR_FORMAT,
                 AT(1, "\"messages\"[0] needs string \"role\" and \"content\""));
    expect_error("{\"prompt\": []}\n", &chat, RF_ERR_FORMAT, AT(1, "\"prompt\" is an empty list of messages"));
    snprintf(needle, sizeof needle, "%s/bad.jsonl: no examples (the file is empty or blank)", g_dir);
    expect_error("", NULL, RF_ERR_FORMAT, needle);
    expect_error("\n  \n\r\n", NULL, RF_ERR_FORMAT, needle);
    rf_dataset_opts unk = {.chat_template = "jinja"};
    snprintf(needle, sizeof needle, "%s/bad.jsonl: chat_template: chat template \"jinja\" is unknown", g_dir);
    expect_error("{\"prompt\": \"a\"}\n", &unk, RF_ERR_ARG, needle);
#undef AT
    rf_dataset *ds = NULL;
    CHECK_ERR(rf_dataset_load(&ds, "/nonexistent/x.jsonl", NULL, g_tok), RF_ERR_IO, "/nonexistent/x.jsonl");
    rf_dataset_opts lim = {.max_prompt_tokens = 4};
    const char *path = write_tmp("ok.jsonl", "{\"prompt\": \"a\"}\n");
    CHECK_ERR(rf_dataset_load(&ds, path, &lim, NULL), RF_ERR_ARG, "max_prompt_tokens needs a tokenizer");
}

/* need_answer: a file where no example has data.answer_key is an error naming the key, the file
 * and the fields the first example has; a few missing are counted (and logged). */
static void test_missing_answers(void) {
    char needle[800];
    rf_dataset_opts need = {.need_answer = 1};
    snprintf(needle, sizeof needle, "%s/bad.jsonl: no example has the field \"answer\" (data.answer_key) that the "
             "reward rules compare with; line 2 has \"prompt\", \"id\", \"solution\"", g_dir);
    expect_error("\n{\"prompt\": \"a\", \"id\": 1, \"solution\": \"4\"}\n{\"prompt\": \"b\", \"solution\": \"5\"}\n",
                 &need, RF_ERR_FORMAT, needle);
    rf_dataset_opts need_t = {.need_answer = 1, .answer_key = "target"};
    snprintf(needle, sizeof needle, "%s/bad.jsonl: no example has the field \"target\" (data.answer_key) that the "
             "reward rules compare with; line 1 has \"prompt\", \"response\", \"answer\"", g_dir);
    expect_error("{\"prompt\": \"a\", \"answer\": \"4\", \"response\": \"4\"}\n", &need_t, RF_ERR_FORMAT, needle);
    const char *path = write_tmp("some.jsonl", "{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": \"b\"}\n"
                                               "{\"prompt\": \"c\", \"answer\": 3}\n{\"prompt\": \"d\"}\n");
    rf_dataset *ds = NULL;
    CHECK_OK(rf_dataset_load(&ds, path, &need, g_tok));
    CHECK(ds && rf_dataset_size(ds) == 4 && rf_dataset_n_missing_answer(ds) == 2);
    rf_dataset_free(ds);
    /* without need_answer the same files load (SFT, a reward model), and the count is kept */
    CHECK_OK(rf_dataset_load(&ds, write_tmp("none.jsonl", "{\"prompt\": \"a\"}\n"), NULL, g_tok));
    CHECK(ds && rf_dataset_n_missing_answer(ds) == 1);
    rf_dataset_free(ds);
}

static void test_chat_template(void) {
    const char *path = write_tmp("chat.jsonl",
                                 "{\"prompt\": \"hi\", \"answer\": \"x\"}\n"
                                 "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, "
                                 "{\"role\": \"user\", \"content\": \"U\"}]}\n");
    rf_dataset_opts o = {.chat_template = "chatml"};
    rf_dataset *ds = NULL;
    CHECK_OK(rf_dataset_load(&ds, path, &o, g_tok));
    if (!ds) return;
    const rf_example *e = rf_dataset_get(ds, 0);
    const char *want0 = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    CHECK(strcmp(e->prompt_text, want0) == 0);
    /* <|im_start|> user \n h i <|im_end|> \n <|im_start|> assistant \n: special tokens are single
     * ids (257, 258) and nothing is added around the rendered text. */
    CHECK(e->n_prompt == 1 + 4 + 1 + 2 + 1 + 1 + 1 + 9 + 1);
    CHECK(e->prompt_ids[0] == 257 && e->prompt_ids[8] == 258 && e->prompt_ids[10] == 257);
    e = rf_dataset_get(ds, 1);
    CHECK(strcmp(e->prompt_text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                                 "<|im_start|>assistant\n") == 0);
    CHECK(!cJSON_GetObjectItem(e->extra, "messages"));
    rf_dataset_free(ds);
}

static void test_overlong(void) {
    /* Prompt lengths in byte tokens: 3, 5, 6, 10, 1. */
    const char *path = write_tmp("long.jsonl",
                                 "{\"prompt\": \"abc\"}\n{\"prompt\": \"abcde\"}\n{\"prompt\": \"abcdef\"}\n"
                                 "{\"prompt\": \"abcdefghij\"}\n{\"prompt\": \"z\"}\n");
    rf_dataset_opts o = {.max_prompt_tokens = 5};
    rf_dataset *ds = NULL;
    CHECK_OK(rf_dataset_load(&ds, path, &o, g_tok));
    if (!ds) return;
    CHECK(rf_dataset_size(ds) == 3 && rf_dataset_n_dropped(ds) == 2);
    CHECK(rf_dataset_get(ds, 1)->line == 2 && rf_dataset_get(ds, 2)->line == 5);
    CHECK(rf_dataset_get(ds, 2)->index == 2);
    rf_dataset_free(ds);
    o.max_prompt_tokens = 0; /* no limit */
    CHECK_OK(rf_dataset_load(&ds, path, &o, g_tok));
    if (ds) CHECK(rf_dataset_size(ds) == 5 && rf_dataset_n_dropped(ds) == 0);
    rf_dataset_free(ds);
    path = write_tmp("long2.jsonl", "{\"prompt\": \"abcdef\"}\n{\"prompt\": \"abcdefg\"}\n");
    CHECK_ERR(rf_dataset_load(&ds, path, &(rf_dataset_opts){.max_prompt_tokens = 5}, g_tok), RF_ERR_RANGE,
              "all 2 prompts are longer than max_prompt_tokens (5)");
}

/* A file of n lines {"prompt": "p<i>"}. */
static const char *numbered_file(int n) {
    size_t cap = (size_t)n * 32 + 1, len = 0;
    char *t = malloc(cap);
    t[0] = '\0';
    for (int i = 0; i < n; i++) len += (size_t)snprintf(t + len, cap - len, "{\"prompt\": \"p%d\"}\n", i);
    const char *p = write_tmp("numbered.jsonl", t);
    free(t);
    return p;
}

static int is_permutation(const int *a, int n) {
    int *seen = calloc((size_t)n, sizeof *seen), ok = 1;
    for (int i = 0; i < n; i++) {
        if (a[i] < 0 || a[i] >= n || seen[a[i]]) ok = 0;
        else seen[a[i]] = 1;
    }
    free(seen);
    return ok;
}

static void test_shuffle(void) {
    enum { N = 50 };
    const char *path = numbered_file(N);
    rf_dataset_opts o = {.seed = 3};
    rf_dataset *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    CHECK_OK(rf_dataset_load(&a, path, &o, g_tok));
    CHECK_OK(rf_dataset_load(&b, path, &o, g_tok));
    o.seed = 4;
    CHECK_OK(rf_dataset_load(&c, path, &o, g_tok));
    o.no_shuffle = 1;
    CHECK_OK(rf_dataset_load(&d, path, &o, g_tok));
    if (!a || !b || !c || !d) goto done;
    int e0[N], e1[N], same_ab = 1, same_01 = 1, same_ac = 1, identity = 1;
    for (int i = 0; i < N; i++) e0[i] = rf_dataset_index_at(a, (rf_dataset_pos){0, i});
    for (int i = 0; i < N; i++) e1[i] = rf_dataset_index_at(a, (rf_dataset_pos){1, i});
    for (int i = 0; i < N; i++) {
        same_ab &= rf_dataset_index_at(b, (rf_dataset_pos){0, i}) == e0[i];
        same_ac &= rf_dataset_index_at(c, (rf_dataset_pos){0, i}) == e0[i];
        same_01 &= e0[i] == e1[i];
        identity &= rf_dataset_index_at(d, (rf_dataset_pos){i % 3, i}) == i;
    }
    CHECK(is_permutation(e0, N) && is_permutation(e1, N));
    CHECK(same_ab);   /* same seed, same order */
    CHECK(!same_01);  /* a new order each epoch */
    CHECK(!same_ac);  /* another seed, another order */
    CHECK(identity);  /* no_shuffle: file order every epoch */
    /* Going back to epoch 0 after epoch 1 rebuilds the same order. */
    CHECK(rf_dataset_index_at(a, (rf_dataset_pos){0, 7}) == e0[7]);
    CHECK(rf_dataset_index_at(a, (rf_dataset_pos){0, N}) == -1);
    CHECK(rf_dataset_index_at(a, (rf_dataset_pos){-1, 0}) == -1);

    /* Epoch wrap: N + 3 examples from {0, 0} end at {1, 3}, and crossing uses epoch 1's order. */
    const rf_example *out[2 * N + 5];
    rf_dataset_pos pos = {0, 0};
    CHECK_OK(rf_dataset_next(a, &pos, N + 3, out));
    CHECK(pos.epoch == 1 && pos.index == 3);
    int wrap_ok = 1;
    for (int i = 0; i < N; i++) wrap_ok &= out[i]->index == e0[i];
    for (int i = 0; i < 3; i++) wrap_ok &= out[N + i]->index == e1[i];
    CHECK(wrap_ok);
    /* More than a whole epoch in one call from the middle of one. */
    pos = (rf_dataset_pos){0, N - 1};
    CHECK_OK(rf_dataset_next(a, &pos, 2 * N + 1, out));
    CHECK(pos.epoch == 3 && pos.index == 0 && out[0]->index == e0[N - 1] && out[1]->index == e1[0]);
    CHECK_OK(rf_dataset_next(a, &pos, 0, out));
    CHECK(pos.epoch == 3 && pos.index == 0);
    pos = (rf_dataset_pos){0, N};
    CHECK_ERR(rf_dataset_next(a, &pos, 1, out), RF_ERR_ARG, "outside a dataset of 50 examples");
    pos = (rf_dataset_pos){0, 0};
    CHECK_ERR(rf_dataset_next(a, &pos, -1, out), RF_ERR_ARG, "asked for -1 examples");
done:
    rf_dataset_free(a), rf_dataset_free(b), rf_dataset_free(c), rf_dataset_free(d);
}

/* A run of 9 batches of 7 over 20 examples, against the same run stopped after 4 batches and
 * resumed from its saved position in a freshly loaded dataset: the same examples in order. */
static void test_resume(void) {
    enum { N = 20, B = 7, STEPS = 9, STOP = 4 };
    const char *path = numbered_file(N);
    rf_dataset_opts o = {.seed = 11};
    rf_dataset *full = NULL, *first = NULL, *resumed = NULL;
    CHECK_OK(rf_dataset_load(&full, path, &o, g_tok));
    CHECK_OK(rf_dataset_load(&first, path, &o, g_tok));
    CHECK_OK(rf_dataset_load(&resumed, path, &o, g_tok));
    if (!full || !first || !resumed) goto done;
    int want[STEPS * B], got[STEPS * B], k = 0;
    const rf_example *out[B];
    rf_dataset_pos pos = {0, 0};
    for (int s = 0; s < STEPS; s++) {
        CHECK_OK(rf_dataset_next(full, &pos, B, out));
        for (int i = 0; i < B; i++) want[s * B + i] = out[i]->index;
    }
    CHECK(pos.epoch == STEPS * B / N && pos.index == STEPS * B % N);
    pos = (rf_dataset_pos){0, 0};
    for (int s = 0; s < STOP; s++) {
        CHECK_OK(rf_dataset_next(first, &pos, B, out));
        for (int i = 0; i < B; i++) got[k++] = out[i]->index;
    }
    rf_dataset_pos saved = pos; /* what a checkpoint would hold */
    for (int s = STOP; s < STEPS; s++) {
        CHECK_OK(rf_dataset_next(resumed, &saved, B, out));
        for (int i = 0; i < B; i++) got[k++] = out[i]->index;
    }
    CHECK(memcmp(want, got, sizeof want) == 0);
done:
    rf_dataset_free(full), rf_dataset_free(first), rf_dataset_free(resumed);
}

/* ---- tasks --------------------------------------------------------------------------- */

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

/* Every val prompt is distinct and none is a train prompt. */
static int disjoint(const rf_dataset *train, const rf_dataset *val) {
    int nv = rf_dataset_size(val), nt = rf_dataset_size(train);
    for (int i = 0; i < nv; i++) {
        const char *p = rf_dataset_get(val, i)->prompt_text;
        for (int j = i + 1; j < nv; j++)
            if (strcmp(p, rf_dataset_get(val, j)->prompt_text) == 0) return 0;
        for (int j = 0; j < nt; j++)
            if (strcmp(p, rf_dataset_get(train, j)->prompt_text) == 0) return 0;
    }
    return 1;
}

static void load_split(const char *dir, const char *name, rf_dataset **ds) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    rf_dataset_opts o = {.require_answer = 1, .require_response = 1};
    CHECK_OK(rf_dataset_load(ds, path, &o, g_tok));
}

/* "47+385=" -> 432 */
static int arith_ok(const rf_example *e) {
    long long a, b, v;
    char op, eq;
    if (sscanf(e->prompt_text, "%lld%c%lld%c", &a, &op, &b, &eq) != 4 || eq != '=') return 0;
    v = op == '+' ? a + b : op == '-' ? a - b : op == '*' ? a * b : -1;
    char want[32];
    snprintf(want, sizeof want, "%lld", v);
    return v >= 0 && strcmp(e->answer, want) == 0 && strcmp(e->response, want) == 0 &&
           (op != '*' || (b >= 2 && b <= 9)) && strlen(e->prompt_text) <= 12;
}

static int countdown_ok(const rf_example *e) {
    const cJSON *nums = cJSON_GetObjectItem(e->extra, "numbers"), *t = cJSON_GetObjectItem(e->extra, "target");
    if (!cJSON_IsArray(nums) || !cJSON_IsNumber(t) || cJSON_GetArraySize(nums) != 3) return 0;
    char *js = cJSON_PrintUnformatted(nums), want[64], prompt[96];
    int ok = rf_task_countdown_check(e->response, js, t->valueint) == RF_COUNTDOWN_CORRECT;
    ok &= t->valueint >= 1 && t->valueint <= 200;
    /* the prompt lists the numbers, ascending, then the target; the answer is the same truth
     * the countdown rule reads ("3 7 25 -> 78"), and the rule scores the response 1 */
    size_t len = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, nums) len += (size_t)snprintf(prompt + len, sizeof prompt - len, "%s%d",
                                                         len ? " " : "", it->valueint);
    snprintf(prompt + len, sizeof prompt - len, " -> %d:", t->valueint);
    ok &= strcmp(e->prompt_text, prompt) == 0;
    snprintf(want, sizeof want, "%.*s", (int)strlen(prompt) - 1, prompt);
    ok &= strcmp(e->answer, want) == 0 && rf_reward_countdown(e->response, e->answer, NULL, 0) == 1.0f;
    free(js);
    return ok;
}

static void test_task(const char *task, int (*check)(const rf_example *)) {
    char d1[300], d2[300], d3[300];
    snprintf(d1, sizeof d1, "%s/%s_a", g_dir, task);
    snprintf(d2, sizeof d2, "%s/%s_b", g_dir, task);
    snprintf(d3, sizeof d3, "%s/%s_c", g_dir, task);
    CHECK_OK(rf_task_generate(task, d1, 3000, 300, 5));
    CHECK_OK(rf_task_generate(task, d2, 3000, 300, 5));
    CHECK_OK(rf_task_generate(task, d3, 3000, 300, 6));
    const char *names[2] = {"train.jsonl", "val.jsonl"};
    for (int k = 0; k < 2; k++) {
        char p1[600], p2[600], p3[600];
        snprintf(p1, sizeof p1, "%s/%s", d1, names[k]);
        snprintf(p2, sizeof p2, "%s/%s", d2, names[k]);
        snprintf(p3, sizeof p3, "%s/%s", d3, names[k]);
        char *a = slurp(p1), *b = slurp(p2), *c = slurp(p3);
        CHECK(a && b && c);
        if (a && b && c) {
            CHECK(strcmp(a, b) == 0); /* same seed: byte for byte */
            CHECK(strcmp(a, c) != 0); /* another seed: other problems */
            CHECK(count_lines(a) == (k ? 300 : 3000));
        }
        free(a), free(b), free(c);
    }
    rf_dataset *train = NULL, *val = NULL;
    load_split(d1, "train.jsonl", &train);
    load_split(d1, "val.jsonl", &val);
    if (train && val) {
        CHECK(rf_dataset_size(train) == 3000 && rf_dataset_size(val) == 300);
        CHECK(disjoint(train, val));
        int all = 1;
        for (int i = 0; i < rf_dataset_size(train); i++) all &= check(rf_dataset_get(train, i));
        for (int i = 0; i < rf_dataset_size(val); i++) all &= check(rf_dataset_get(val, i));
        CHECK(all);
    }
    rf_dataset_free(train), rf_dataset_free(val);
}

static void test_tasks(void) {
    test_task("arith", arith_ok);
    test_task("countdown", countdown_ok);
    /* The operator mix: mostly + and -, some products. */
    char dir[300], path[600];
    snprintf(dir, sizeof dir, "%s/arith_a", g_dir);
    snprintf(path, sizeof path, "%s/train.jsonl", dir);
    char *t = slurp(path);
    int plus = 0, minus = 0, times = 0;
    for (char *p = t; p && (p = strstr(p, "\"prompt\":\"")); p++) {
        p += 10;
        plus += strchr(p, '+') < strchr(p, '"') && strchr(p, '+') != NULL;
        minus += strchr(p, '-') < strchr(p, '"') && strchr(p, '-') != NULL;
        times += strchr(p, '*') < strchr(p, '"') && strchr(p, '*') != NULL;
    }
    free(t);
    CHECK(plus + minus + times == 3000);
    CHECK(plus > 1100 && minus > 1100 && times > 150 && times < 450);

    char err_dir[300];
    snprintf(err_dir, sizeof err_dir, "%s/none", g_dir);
    CHECK_ERR(rf_task_generate("sudoku", err_dir, 10, 10, 1), RF_ERR_ARG,
              "unknown task \"sudoku\" (tasks: arith, countdown, multiply)");
    rf_task_opts o;
    rf_task_opts_default(&o);
    o.max_digits = 1, o.mul_percent = 0; /* 100 sums + 55 differences: too few for 500 distinct */
    CHECK_ERR(rf_task_generate_opts("arith", err_dir, 10, 500, 1, &o), RF_ERR_RANGE, "distinct validation");
    o.max_digits = 10;
    CHECK_ERR(rf_task_generate_opts("arith", err_dir, 10, 10, 1, &o), RF_ERR_ARG, "<= 9");
    rf_task_opts_default(&o);
    o.n_numbers = 7;
    CHECK_ERR(rf_task_generate_opts("countdown", err_dir, 10, 10, 1, &o), RF_ERR_ARG, "n_numbers");
}

static void test_countdown_check(void) {
    const char *nums = "[3, 7, 25, 50]";
    CHECK(rf_task_countdown_check("(50-25)*3+7", nums, 82) == RF_COUNTDOWN_CORRECT);
    CHECK(rf_task_countdown_check(" ( 50 - 25 ) * 3 + 7 ", nums, 82) == RF_COUNTDOWN_CORRECT);
    CHECK(rf_task_countdown_check("50+25", nums, 75) == RF_COUNTDOWN_UNUSED_NUMBER); /* every number, once */
    CHECK(rf_task_countdown_check("50+25+7-3", nums, 79) == RF_COUNTDOWN_CORRECT);
    CHECK(rf_task_countdown_check("50+25", nums, 74) == RF_COUNTDOWN_UNUSED_NUMBER); /* wins over the value */
    CHECK(rf_task_countdown_check("50/3*3", nums, 50) == RF_COUNTDOWN_BAD_NUMBER); /* 3 twice */
    CHECK(rf_task_countdown_check("50/3*3", "[3, 3, 50]", 50) == RF_COUNTDOWN_CORRECT); /* exact: no truncation */
    CHECK(rf_task_countdown_check("7/3", "[3, 7]", 2) == RF_COUNTDOWN_WRONG_VALUE); /* 7/3 is not 2 */
    CHECK(rf_task_countdown_check("3-7+50", "[3,7,50]", 46) == RF_COUNTDOWN_CORRECT); /* negative on the way */
    CHECK(rf_task_countdown_check("50-25-7", "[7,25,50]", 18) == RF_COUNTDOWN_CORRECT); /* left associative */
    CHECK(rf_task_countdown_check("50-(25-7)", "[7,25,50]", 32) == RF_COUNTDOWN_CORRECT);
    CHECK(rf_task_countdown_check("50/25/3", "[3,25,50]", 0) == RF_COUNTDOWN_WRONG_VALUE);
    CHECK(rf_task_countdown_check("(50-25)*3+7", nums, 81) == RF_COUNTDOWN_WRONG_VALUE);
    CHECK(rf_task_countdown_check("50+50", nums, 100) == RF_COUNTDOWN_BAD_NUMBER);
    CHECK(rf_task_countdown_check("50+4", nums, 54) == RF_COUNTDOWN_BAD_NUMBER);
    CHECK(rf_task_countdown_check("99999999999999999999999", nums, 1) == RF_COUNTDOWN_BAD_NUMBER);
    CHECK(rf_task_countdown_check("50/(25-25)", "[25,25,50]", 1) == RF_COUNTDOWN_DIV_ZERO);
    CHECK(rf_task_countdown_check("7/(3-3)", "[3,3,7]", 1) == RF_COUNTDOWN_DIV_ZERO);
    CHECK(rf_task_countdown_check("", nums, 1) == RF_COUNTDOWN_MALFORMED);
    CHECK(rf_task_countdown_check("50+", nums, 50) == RF_COUNTDOWN_MALFORMED);
    CHECK(rf_task_countdown_check("(50+25", nums, 75) == RF_COUNTDOWN_MALFORMED);
    CHECK(rf_task_countdown_check("50+25)", nums, 75) == RF_COUNTDOWN_MALFORMED);
    CHECK(rf_task_countdown_check("-3+50", nums, 47) == RF_COUNTDOWN_MALFORMED); /* no unary minus */
    CHECK(rf_task_countdown_check("2.5*2", "[2,5]", 5) == RF_COUNTDOWN_MALFORMED);
    CHECK(rf_task_countdown_check("50 25", nums, 75) == RF_COUNTDOWN_MALFORMED);
    CHECK(rf_task_countdown_check("50+25=75", nums, 75) == RF_COUNTDOWN_MALFORMED);
    CHECK(rf_task_countdown_check("3x7", nums, 21) == RF_COUNTDOWN_MALFORMED);
    CHECK(rf_task_countdown_check(NULL, nums, 1) == RF_COUNTDOWN_MALFORMED);
    char deep[300] = "";
    for (int i = 0; i < 100; i++) strcat(deep, "(");
    strcat(deep, "3");
    for (int i = 0; i < 100; i++) strcat(deep, ")");
    CHECK(rf_task_countdown_check(deep, nums, 3) == RF_COUNTDOWN_MALFORMED); /* nesting bound */
    CHECK(rf_task_countdown_check("((((3))))", "[3]", 3) == RF_COUNTDOWN_CORRECT);
    CHECK(rf_task_countdown_check("3000000000*3000000000*3000000000", "[3000000000,3000000000,3000000000]", 1) ==
          RF_COUNTDOWN_OVERFLOW);
    CHECK(rf_task_countdown_check("3+7", "not json", 10) == RF_COUNTDOWN_BAD_INPUT);
    CHECK(rf_task_countdown_check("3+7", "[3, 7.5]", 10) == RF_COUNTDOWN_BAD_INPUT);
    CHECK(rf_task_countdown_check("3+7", "{\"a\": 3}", 10) == RF_COUNTDOWN_BAD_INPUT);
    CHECK(rf_task_countdown_check("3+7", NULL, 10) == RF_COUNTDOWN_BAD_INPUT);
    CHECK(strcmp(rf_countdown_verdict_name(RF_COUNTDOWN_DIV_ZERO), "division by zero") == 0);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/rf_dataset_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    CHECK_OK(rf_byte_tokenizer_write(g_dir));
    CHECK_OK(rf_tokenizer_load_dir(&g_tok, g_dir));
    if (!g_tok) return rf_test_finish("test_dataset");
    test_load_fields();
    test_custom_keys();
    test_errors();
    test_utf8();
    test_chat_template();
    test_overlong();
    test_shuffle();
    test_resume();
    test_tasks();
    test_countdown_check();
    test_missing_answers();
    rf_tokenizer_free(g_tok);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return rf_test_finish("test_dataset");
}
