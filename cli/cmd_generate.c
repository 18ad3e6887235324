/* `rlflow generate` and `rlflow score`. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "model/chat_template.h"
#include "model/generate.h"
#include "model/lora.h"

#define N_OPTS(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define MAX_PROMPTS 4096

/* Renders one prompt value (string, or array of chat messages) into text. */
static rf_status render_prompt(const cJSON *v, const char *tmpl, const char *where, char **out) {
    if (cJSON_IsString(v)) {
        if (!tmpl) {
            *out = rf_strdup(v->valuestring);
            return RF_OK;
        }
        rf_chat_message msg = {"user", v->valuestring};
        return rf_chat_apply(tmpl, &msg, 1, 1, out);
    }
    if (!cJSON_IsArray(v))
        return rf_error(RF_ERR_FORMAT, "%s: \"prompt\" must be a string or a list of messages", where);
    if (!tmpl)
        return rf_error(RF_ERR_ARG, "%s: chat messages need --chat-template (chatml or llama3)", where);
    int n = cJSON_GetArraySize(v), i = 0;
    rf_chat_message *msgs = calloc((size_t)(n ? n : 1), sizeof *msgs);
    const cJSON *it;
    cJSON_ArrayForEach(it, v) {
        const cJSON *role = cJSON_GetObjectItem(it, "role"), *content = cJSON_GetObjectItem(it, "content");
        if (!cJSON_IsString(role) || !cJSON_IsString(content)) {
            free(msgs);
            return rf_error(RF_ERR_FORMAT, "%s: message %d needs string \"role\" and \"content\"", where, i);
        }
        msgs[i].role = role->valuestring, msgs[i++].content = content->valuestring;
    }
    rf_status s = rf_chat_apply(tmpl, msgs, n, 1, out);
    free(msgs);
    return s;
}

/* --answer-key: each prompt's answer as JSON text (a string quoted, a number bare), printed
 * with --json with the type it has in the file. */
static char *g_answers[MAX_PROMPTS];

/* The answer of line j under key (where: file:line for errors) into g_answers[i]. */
static rf_status take_answer(const cJSON *j, const char *key, const char *where, int i) {
    const cJSON *a = cJSON_GetObjectItem(j, key);
    if (!a) return rf_error(RF_ERR_FORMAT, "%s: missing \"%s\" (--answer-key)", where, key);
    if (!cJSON_IsString(a) && !cJSON_IsNumber(a))
        return rf_error(RF_ERR_FORMAT, "%s: \"%s\" must be a string or a number", where, key);
    g_answers[i] = cJSON_PrintUnformatted(a);
    return g_answers[i] ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
}

/* Reads prompts from a JSONL file: {"<key>": "..."} or {"<key>"|"messages": [...]}, key the
 * --prompt-key ("prompt"); with --answer-key, each line's answer too. */
static rf_status read_prompts_file(const char *path, const char *key, const char *akey, const char *tmpl,
                                   char **texts, int *n) {
    char *data = NULL;
    RF_TRY(rf_read_file(path, &data, NULL));
    rf_status s = RF_OK;
    int line = 0;
    *n = 0;
    for (char *p = data, *nl; s == RF_OK && p && *p; p = nl ? nl + 1 : NULL) {
        nl = strchr(p, '\n');
        if (nl) *nl = '\0';
        line++;
        if (strspn(p, " \t\r") == strlen(p)) continue;
        char where[4200];
        snprintf(where, sizeof where, "%s:%d", path, line);
        cJSON *j = cJSON_Parse(p);
        const cJSON *v = j ? cJSON_GetObjectItem(j, key) : NULL;
        if (!v && j) v = cJSON_GetObjectItem(j, "messages");
        if (!j || !cJSON_IsObject(j)) s = rf_error(RF_ERR_FORMAT, "%s: not a JSON object", where);
        else if (!v) s = rf_error(RF_ERR_FORMAT, "%s: missing \"%s\" (or \"messages\")", where, key);
        else if (*n >= MAX_PROMPTS) s = rf_error(RF_ERR_RANGE, "%s: more than %d prompts", where, MAX_PROMPTS);
        else if (!akey || (s = take_answer(j, akey, where, *n)) == RF_OK) s = render_prompt(v, tmpl, where, &texts[(*n)++]);
        cJSON_Delete(j);
    }
    free(data);
    if (s == RF_OK && *n == 0) s = rf_error(RF_ERR_FORMAT, "%s: no prompts", path);
    return s;
}

static void print_result(const rf_gen_output *o, int index, const char *prompt, int json) {
    /* Every byte of the text, NULs included (printf("%s") or a cJSON string would stop at
     * the first one). */
    if (!json) {
        if (o->text_len) fwrite(o->text, 1, o->text_len, stdout);
        putchar('\n');
        return;
    }
    cJSON *r = cJSON_CreateObject();
    cJSON_AddNumberToObject(r, "index", index);
    cJSON_AddStringToObject(r, "prompt", prompt);
    if (g_answers[index]) cJSON_AddRawToObject(r, "answer", g_answers[index]);
    char *quoted = rf_json_quote(o->text ? o->text : "", o->text_len);
    cJSON_AddRawToObject(r, "text", quoted ? quoted : "\"\"");
    free(quoted);
    cJSON_AddItemToObject(r, "tokens", cJSON_CreateIntArray(o->tokens, o->n_tokens));
    cJSON_AddItemToObject(r, "logprobs", cJSON_CreateFloatArray(o->logprobs, o->n_tokens));
    cJSON_AddStringToObject(r, "finish_reason", rf_finish_name(o->finish));
    char *s = cJSON_PrintUnformatted(r);
    printf("%s\n", s);
    free(s);
    cJSON_Delete(r);
}

typedef struct gen_args {
    const char *model, *adapter, *prompt, *file, *tmpl, *device, *precision, *prompt_key, *answer_key;
    int max_new, top_k, seed, greedy, json, help;
    float temperature, top_p;
    rf_opt_multi stop;
} gen_args;

static int run_generate(const gen_args *a, char **texts, int n) {
    rf_model *m;
    rf_tokenizer *tok;
    rf_status s = rf_cli_open(a->model, a->device, a->precision, a->adapter == NULL, &m, &tok);
    if (s) return rf_cli_fail(s);
    if (a->adapter && (s = rf_lora_load_peft(m, a->adapter))) {
        rf_tokenizer_free(tok), rf_model_free(m);
        return rf_cli_fail(s);
    }
    int32_t **ids = calloc((size_t)n, sizeof *ids), eos[8];
    int *lens = calloc((size_t)n, sizeof *lens);
    rf_gen_output *out = calloc((size_t)n, sizeof *out);
    for (int i = 0; s == RF_OK && i < n; i++)
        /* A rendered chat template already holds its special tokens (Llama 3's BOS):
         * encode it without adding them again, as transformers' apply_chat_template does. */
        s = rf_tokenizer_encode(tok, texts[i], strlen(texts[i]), a->tmpl == NULL, &ids[i], &lens[i]);
    rf_gen_params p = {{a->greedy, a->temperature, a->top_k, a->top_p}, a->max_new, (uint64_t)a->seed,
                       eos, rf_cli_eos_ids(a->model, m, tok, eos, 8), {0}, a->stop.n};
    for (int i = 0; i < a->stop.n; i++) p.stop[i] = a->stop.v[i];
    double t0 = rf_time_now();
    if (s == RF_OK) s = rf_generate(m, tok, (const int32_t *const *)ids, lens, n, &p, out, 1);
    if (s == RF_OK) {
        long total = 0;
        for (int i = 0; i < n; i++) total += out[i].n_tokens;
        double el = rf_time_now() - t0;
        for (int i = 0; i < n; i++) print_result(&out[i], i, texts[i], a->json);
        fflush(stdout); /* results before the summary on stderr */
        rf_log_info("generated %ld tokens for %d prompt(s) in %.2f s (%.1f tokens/s)", total, n, el,
                    el > 0 ? (double)total / el : 0.0);
    }
    for (int i = 0; i < n; i++) {
        free(ids[i]);
        rf_gen_output_free(&out[i]);
    }
    free(ids), free(lens), free(out);
    rf_tokenizer_free(tok);
    rf_model_free(m);
    return s ? rf_cli_fail(s) : 0;
}

int rf_cmd_generate(int argc, char **argv) {
    gen_args a = {.device = "cpu", .precision = "auto", .max_new = 64, .temperature = 1.0f, .top_p = 1.0f, .seed = 0};
    rf_opt opts[] = {
        {"model", RF_OPT_STR, &a.model, "model directory (Hugging Face layout; required)", 0},
        {"adapter", RF_OPT_STR, &a.adapter, "LoRA adapter directory in PEFT's layout (adapter_config.json, adapter_model.safetensors) applied unmerged on top of --model", 0},
        {"prompt", RF_OPT_STR, &a.prompt, "prompt text", 0},
        {"prompts-file", RF_OPT_STR, &a.file, "JSONL file of {\"prompt\": ...} lines", 0},
        {"prompt-key", RF_OPT_STR, &a.prompt_key, "--prompts-file: field of the prompt (default prompt)", 0},
        {"answer-key", RF_OPT_STR, &a.answer_key, "--prompts-file: field of an answer, printed with --json", 0},
        {"chat-template", RF_OPT_STR, &a.tmpl, "chatml | llama3: wrap prompts as a user turn", 0},
        {"max-new-tokens", RF_OPT_INT, &a.max_new, "tokens to generate at most (default 64)", 0},
        {"temperature", RF_OPT_FLOAT, &a.temperature, "sampling temperature (default 1.0)", 0},
        {"top-p", RF_OPT_FLOAT, &a.top_p, "nucleus sampling mass (default 1.0 = off)", 0},
        {"top-k", RF_OPT_INT, &a.top_k, "keep the k most likely tokens (default 0 = off)", 0},
        {"seed", RF_OPT_INT, &a.seed, "sampling seed (default 0); prompt i uses seed + i", 0},
        {"greedy", RF_OPT_FLAG, &a.greedy, "argmax decoding", 0},
        {"stop", RF_OPT_MULTI, &a.stop, "stop string (repeatable, up to 8)", 0}, /* RF_MAX_STOP */
        {"json", RF_OPT_FLAG, &a.json, "print one JSON object per prompt (tokens, logprobs)", 0},
        {"device", RF_OPT_STR, &a.device, "cpu | cuda (default cpu)", 0},
        {"precision", RF_OPT_STR, &a.precision, "auto | fp32 | bf16: operands of matrix products (default auto: bf16 where the CPU has AVX512-BF16 or AMX-BF16)", 0},
        {"help", RF_OPT_FLAG, &a.help, "show this help", 0},
    };
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), pos, 0, &n_pos);
    if (s == RF_OK && !a.help && (!a.model || !a.prompt == !a.file))
        s = rf_error(RF_ERR_ARG, "generate needs --model and exactly one of --prompt, --prompts-file");
    /* the option parser takes up to RF_OPT_MULTI_MAX values; generation holds RF_MAX_STOP */
    if (s == RF_OK && a.stop.n > RF_MAX_STOP)
        s = rf_error(RF_ERR_ARG, "--stop: at most %d stop strings, got %d", RF_MAX_STOP, a.stop.n);
    if (s == RF_OK && !a.help && !a.file && (a.prompt_key || a.answer_key))
        s = rf_error(RF_ERR_ARG, "--%s applies to --prompts-file only", a.prompt_key ? "prompt-key" : "answer-key");
    if (s || a.help) {
        rf_args_usage("generate", "--model DIR (--prompt TEXT | --prompts-file FILE) [options]", opts, N_OPTS(opts));
        return s ? rf_cli_usage_fail(s) : 0;
    }
    static char *texts[MAX_PROMPTS];
    int n = 0;
    if (a.file) {
        s = read_prompts_file(a.file, a.prompt_key ? a.prompt_key : "prompt", a.answer_key, a.tmpl, texts, &n);
    } else {
        cJSON *v = cJSON_CreateString(a.prompt);
        s = render_prompt(v, a.tmpl, "--prompt", &texts[0]);
        cJSON_Delete(v);
        n = s == RF_OK;
    }
    int rc = s ? rf_cli_fail(s) : run_generate(&a, texts, n);
    for (int i = 0; i < MAX_PROMPTS; i++) free(g_answers[i]), g_answers[i] = NULL;
    for (int i = 0; i < n; i++) free(texts[i]);
    return rc;
}

static void print_score(const rf_tokenizer *tok, const int32_t *ids, int n_prompt, int n,
                        const float *lp, const float *ent) {
    cJSON *r = cJSON_CreateObject(), *toks = cJSON_AddArrayToObject(r, "tokens");
    double sum = 0;
    for (int i = n_prompt; i < n; i++) {
        cJSON *t = cJSON_CreateObject();
        cJSON_AddNumberToObject(t, "id", ids[i]);
        const char *str = rf_tokenizer_id_to_token(tok, ids[i]);
        cJSON_AddStringToObject(t, "token", str ? str : "");
        cJSON_AddNumberToObject(t, "logprob", lp[i - 1]);
        cJSON_AddNumberToObject(t, "entropy", ent[i - 1]);
        cJSON_AddItemToArray(toks, t);
        sum += lp[i - 1];
    }
    cJSON_AddNumberToObject(r, "prompt_tokens", n_prompt);
    cJSON_AddNumberToObject(r, "response_tokens", n - n_prompt);
    cJSON_AddNumberToObject(r, "sum_logprob", sum);
    cJSON_AddNumberToObject(r, "mean_logprob", n > n_prompt ? sum / (n - n_prompt) : 0.0);
    char *s = cJSON_Print(r);
    printf("%s\n", s);
    free(s);
    cJSON_Delete(r);
}

/* Tokenizes prompt and response separately (as RL rollouts do) and concatenates. */
static rf_status score_tokens(const rf_tokenizer *tok, const char *prompt, int add_special,
                              const char *resp, int32_t **ids, int *n_prompt, int *n) {
    int32_t *a = NULL, *b = NULL;
    int na = 0, nb = 0;
    RF_TRY(rf_tokenizer_encode(tok, prompt, strlen(prompt), add_special, &a, &na));
    rf_status s = rf_tokenizer_encode(tok, resp, strlen(resp), 0, &b, &nb);
    if (s == RF_OK && (na == 0 || nb == 0))
        s = rf_error(RF_ERR_ARG, "score: prompt and response must each be at least one token");
    if (s == RF_OK) {
        *ids = realloc(a, sizeof(int32_t) * (size_t)(na + nb));
        memcpy(*ids + na, b, sizeof(int32_t) * (size_t)nb);
        a = NULL;
        *n_prompt = na, *n = na + nb;
    }
    free(a), free(b);
    return s;
}

int rf_cmd_score(int argc, char **argv) {
    const char *model = NULL, *adapter = NULL, *prompt = NULL, *resp = NULL, *tmpl = NULL, *device = "cpu", *precision = "auto";
    float temperature = 1.0f;
    int help = 0;
    rf_opt opts[] = {
        {"model", RF_OPT_STR, &model, "model directory (required)", 0},
        {"adapter", RF_OPT_STR, &adapter, "LoRA adapter directory in PEFT's layout applied on top of --model", 0},
        {"prompt", RF_OPT_STR, &prompt, "prompt text (required)", 0},
        {"response", RF_OPT_STR, &resp, "response text to score (required)", 0},
        {"chat-template", RF_OPT_STR, &tmpl, "chatml | llama3: wrap the prompt as a user turn", 0},
        {"temperature", RF_OPT_FLOAT, &temperature, "score at this temperature (default 1.0)", 0},
        {"device", RF_OPT_STR, &device, "cpu | cuda (default cpu)", 0},
        {"precision", RF_OPT_STR, &precision, "auto | fp32 | bf16: operands of matrix products (default auto: bf16 where the CPU has AVX512-BF16 or AMX-BF16)", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), pos, 0, &n_pos);
    if (s == RF_OK && !help && (!model || !prompt || !resp))
        s = rf_error(RF_ERR_ARG, "score needs --model, --prompt and --response");
    if (s == RF_OK && !(temperature > 0)) s = rf_error(RF_ERR_ARG, "--temperature must be > 0");
    if (s || help) {
        rf_args_usage("score", "--model DIR --prompt TEXT --response TEXT", opts, N_OPTS(opts));
        return s ? rf_cli_usage_fail(s) : 0;
    }
    rf_model *m;
    rf_tokenizer *tok;
    if ((s = rf_cli_open(model, device, precision, adapter == NULL, &m, &tok))) return rf_cli_fail(s);
    if (adapter && (s = rf_lora_load_peft(m, adapter))) {
        rf_tokenizer_free(tok), rf_model_free(m);
        return rf_cli_fail(s);
    }
    char *ptext = NULL;
    int32_t *ids = NULL;
    int n_prompt = 0, n = 0;
    cJSON *pv = cJSON_CreateString(prompt);
    s = render_prompt(pv, tmpl, "--prompt", &ptext);
    cJSON_Delete(pv);
    if (s == RF_OK) s = score_tokens(tok, ptext, tmpl == NULL, resp, &ids, &n_prompt, &n);
    float *lp = calloc((size_t)n + 1, sizeof(float)), *ent = calloc((size_t)n + 1, sizeof(float));
    if (s == RF_OK) {
        int32_t cu[2] = {0, n - 1};
        rf_batch b = {1, n - 1, ids, NULL, cu};
        s = rf_model_forward(m, &b);
        if (s == RF_OK) s = rf_model_logprobs(m, ids + 1, 1.0f / temperature, lp, ent);
    }
    if (s == RF_OK) print_score(tok, ids, n_prompt, n, lp, ent);
    free(lp), free(ent), free(ids), free(ptext);
    rf_tokenizer_free(tok);
    rf_model_free(m);
    return s ? rf_cli_fail(s) : 0;
}
