/* End-to-end checks of the rlflow command as a user runs it: init-model, inspect, generate
 * (greedy determinism, seeded sampling, JSON output) and score, whose log-probs must equal the
 * behaviour log-probs that generation reported for the same tokens; plus the exact errors for
 * bad input, and an installed tree (cmake --install) that runs where it is moved. */
#define _GNU_SOURCE /* memmem */
#include <cjson/cJSON.h>
#include <stdarg.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "test_shell.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];



/* First line of output that starts with '{' parsed as JSON (generate --json prints one per
 * prompt; progress goes to stderr but is merged here). */
static cJSON *json_line(const char *out, int index) {
    const char *p = out;
    for (int seen = 0; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (*p == '{' && seen++ == index) {
            const char *e = strchr(p, '\n');
            char *line = strndup(p, e ? (size_t)(e - p) : strlen(p));
            cJSON *j = cJSON_Parse(line);
            free(line);
            return j;
        }
    }
    return NULL;
}

static void init_and_inspect(void) {
    char *out;
    CHECK(rf_test_sh(&out, "%s init-model --preset tiny --out %s/tiny --seed 3", rlflow, dir) == 0);
    free(out);
    char p[512];
    snprintf(p, sizeof p, "%s/tiny/model.safetensors", dir);
    CHECK(rf_file_exists(p));
    snprintf(p, sizeof p, "%s/tiny/tokenizer.json", dir);
    CHECK(rf_file_exists(p));
    CHECK(rf_test_sh(&out, "%s inspect %s/tiny", rlflow, dir) == 0);
    CHECK(strstr(out, "model.layers.1.mlp.down_proj.weight") != NULL);
    CHECK(strstr(out, "byte_level BPE, 259 tokens") != NULL);
    free(out);
}

static void generate_and_score(void) {
    char *a, *b;
    CHECK(rf_test_sh(&a, "%s generate --model %s/tiny --prompt Hello --max-new-tokens 12 --greedy --json", rlflow, dir) == 0);
    CHECK(rf_test_sh(&b, "%s generate --model %s/tiny --prompt Hello --max-new-tokens 12 --greedy --json", rlflow, dir) == 0);
    cJSON *ja = json_line(a, 0), *jb = json_line(b, 0);
    CHECK(ja && jb);
    if (!ja || !jb) return;
    char *ta = cJSON_PrintUnformatted(cJSON_GetObjectItem(ja, "tokens"));
    char *tb = cJSON_PrintUnformatted(cJSON_GetObjectItem(jb, "tokens"));
    CHECK(strcmp(ta, tb) == 0); /* greedy decoding is deterministic */
    free(ta), free(tb), free(a), free(b);
    cJSON_Delete(jb);
    /* Seeded sampling: same seed, same tokens. */
    CHECK(rf_test_sh(&a, "%s generate --model %s/tiny --prompt Hi --max-new-tokens 16 --temperature 0.7 --top-p 0.9 --seed 1 --json", rlflow, dir) == 0);
    CHECK(rf_test_sh(&b, "%s generate --model %s/tiny --prompt Hi --max-new-tokens 16 --temperature 0.7 --top-p 0.9 --seed 1 --json", rlflow, dir) == 0);
    jb = json_line(b, 0);
    cJSON *jc = json_line(a, 0);
    CHECK(jb && jc && cJSON_Compare(cJSON_GetObjectItem(jb, "tokens"), cJSON_GetObjectItem(jc, "tokens"), 1));
    free(a), free(b);
    cJSON_Delete(jb), cJSON_Delete(jc);

    /* score the greedy text: per-token log-probs equal generation's behaviour log-probs when the
     * text re-tokenizes to the same ids (byte-level tokenizer: one token per byte). */
    const char *text = cJSON_GetObjectItem(ja, "text")->valuestring;
    cJSON *lps = cJSON_GetObjectItem(ja, "logprobs");
    int ntok = cJSON_GetArraySize(cJSON_GetObjectItem(ja, "tokens"));
    if (strlen(text) == (size_t)ntok && ntok > 0 && !strchr(text, '\'')) {
        char *s;
        CHECK(rf_test_sh(&s, "%s score --model %s/tiny --prompt Hello --response '%s'", rlflow, dir, text) == 0);
        cJSON *js = cJSON_Parse(strchr(s, '{'));
        CHECK(js != NULL);
        if (js) {
            cJSON *toks = cJSON_GetObjectItem(js, "tokens");
            CHECK(cJSON_GetArraySize(toks) == ntok);
            for (int i = 0; i < ntok && i < cJSON_GetArraySize(toks); i++) {
                double g = cJSON_GetArrayItem(lps, i)->valuedouble;
                double sc = cJSON_GetObjectItem(cJSON_GetArrayItem(toks, i), "logprob")->valuedouble;
                /* one path is a KV-cache decode, the other a packed forward: fp32, 1e-4 */
                CHECK_CLOSE(sc, g, 1e-4, 1e-4);
                CHECK(cJSON_GetObjectItem(cJSON_GetArrayItem(toks, i), "entropy")->valuedouble >= 0);
            }
            cJSON_Delete(js);
        }
        free(s);
    }
    cJSON_Delete(ja);
}

static void prompts_file(void) {
    char path[512], *out;
    snprintf(path, sizeof path, "%s/prompts.jsonl", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"prompt\": \"What is 2+2?\"}\n\n{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n", f);
    fclose(f);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompts-file %s --chat-template chatml --greedy --max-new-tokens 4 --json", rlflow, dir, path) == 0);
    cJSON *j0 = json_line(out, 0), *j1 = json_line(out, 1);
    CHECK(j0 && j1);
    if (j1) CHECK(strcmp(cJSON_GetObjectItem(j1, "prompt")->valuestring,
                         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") == 0);
    cJSON_Delete(j0), cJSON_Delete(j1);
    free(out);
    f = fopen(path, "w");
    fputs("{\"prompt\": \"ok\"}\n{\"text\": 3}\n", f);
    fclose(f);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompts-file %s --greedy", rlflow, dir, path) == 1);
    CHECK(strstr(out, "prompts.jsonl:2: missing \"prompt\"") != NULL);
    free(out);
}

static void errors(void) {
    char *out;
    CHECK(rf_test_sh(&out, "%s generate --model %s/none --prompt x", rlflow, dir) == 1);
    CHECK(strstr(out, "none/config.json: cannot open") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --temprature 1", rlflow, dir) == 2);
    CHECK(strstr(out, "unknown option \"--temprature\"") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --temperature 0", rlflow, dir) == 1);
    CHECK(strstr(out, "temperature must be > 0") != NULL);
    free(out);
    /* --precision: any other value refused naming the option, on each command that has it */
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --precision fp16", rlflow, dir) == 1);
    CHECK(strstr(out, "--precision = \"fp16\": expected \"auto\", \"fp32\" or \"bf16\"") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "%s score --model %s/tiny --prompt x --response y --precision bf8", rlflow, dir) == 1);
    CHECK(strstr(out, "--precision = \"bf8\": expected \"auto\", \"fp32\" or \"bf16\"") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --precision bf16 --greedy --max-new-tokens 2", rlflow,
                     dir) == 0);
    CHECK(strstr(out, "precision: bf16 (--precision)") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --device tpu", rlflow, dir) == 1);
    CHECK(strstr(out, "--device: expected \"cpu\" or \"cuda\"") != NULL);
    free(out);
    /* the CUDA back end is a module opened on demand (docs/cuda.md): a CPU command never opens
     * it (the dynamic loader's log), a CUDA one does, and one that is not there is named */
    CHECK(rf_test_sh(&out, "LD_DEBUG=files %s generate --model %s/tiny --prompt x --max-new-tokens 2 2>&1 | "
                     "grep -c 'file=[^ ]*librlflow_cuda'", rlflow, dir) == 1);
    CHECK(out && atoi(out) == 0);
    free(out);
#ifdef RLFLOW_HAVE_CUDA
    rf_test_sh(&out, "LD_DEBUG=files %s generate --model %s/tiny --prompt x --device cuda 2>&1 | "
               "grep -c 'file=[^ ]*librlflow_cuda'", rlflow, dir);
    CHECK(out && atoi(out) >= 1);
    free(out);
#endif
    CHECK(rf_test_sh(&out, "RLFLOW_CUDA_MODULE=%s/no_such_module.so %s generate --model %s/tiny --prompt x --device cuda",
                     dir, rlflow, dir) == 1);
    CHECK(strstr(out, "--device cuda: cuda: the CUDA back end module could not be loaded: cannot open ") != NULL &&
          strstr(out, "no_such_module.so") != NULL);
    free(out);
#ifndef RLFLOW_HAVE_CUDA
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --device cuda", rlflow, dir) == 1);
    CHECK(strstr(out, "--device cuda: rlflow was built without the CUDA back end") != NULL);
    free(out);
#endif
    /* --stop: 8 stop strings are what generation holds; a 9th is a usage error (it overflowed
     * the 8 slots once: exit 139) */
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --max-new-tokens 2 --stop a --stop b --stop c "
                     "--stop d --stop e --stop f --stop g --stop h", rlflow, dir) == 0);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --max-new-tokens 2 --stop a --stop b --stop c "
                     "--stop d --stop e --stop f --stop g --stop h --stop i --stop j", rlflow, dir) == 2);
    CHECK(out && strstr(out, "error: --stop: at most 8 stop strings, got 10"));
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompt x --max-new-tokens 5000", rlflow, dir) == 1);
    CHECK(strstr(out, "exceeds the model's limit of 2048") != NULL);
    free(out);
    /* an architecture we do not implement is refused, naming the field */
    CHECK(rf_test_sh(&out, "mkdir -p %s/moe && sed 's/\"model_type\":/\"num_experts\": 4, \"model_type\":/' %s/tiny/config.json > %s/moe/config.json && cp %s/tiny/*.safetensors %s/tiny/tokenizer.json %s/moe/",
              dir, dir, dir, dir, dir, dir) == 0);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/moe --prompt x", rlflow, dir) == 1);
    CHECK(strstr(out, "\"num_experts\": mixture-of-experts models are not supported") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "%s frobnicate", rlflow) == 2);
    CHECK(strstr(out, "unknown command \"frobnicate\"") != NULL);
    free(out);
}

/* Exit status 2 for every usage error (docs/cli.md), each with its message. */
static void usage_errors(void) {
    static const struct { const char *args, *want; } cases[] = {
        {"run", "error: run needs a recipe file"},
        {"sft", "error: sft needs a recipe file"},
        {"run r.toml --frobnicate", "unknown option \"--frobnicate\" (see --help)"},
        {"run r.toml --set train.steps", "--set train.steps: expected section.key=value"},
        {"run r.toml --set =3", "--set =3: expected section.key=value"},
        {"sft r.toml --set x", "--set x: expected section.key=value"},
        {"run r.toml --resume --overwrite", "--resume and --overwrite exclude each other"},
        {"run a.toml b.toml", "unexpected argument \"b.toml\""},
        {"eval --model m", "eval needs --model and --data"},
        {"eval --model m --data d --n x", "--n: expected an integer, got \"x\""},
        {"eval --model m --data d --n -3", "--n: expected a count >= 1, got -3"},
        {"eval --model m --data d --n 0", "--n: expected a count >= 1, got 0"},
        {"data", "error: name a task"},
        {"data arith --train many", "--train: expected an integer, got \"many\""},
        {"generate --prompt x", "generate needs --model and exactly one of --prompt, --prompts-file"},
        {"generate --model m --prompt x --prompt-key q", "--prompt-key applies to --prompts-file only"},
        {"generate --model m --prompt x --max-new-tokens", "--max-new-tokens needs a value"},
        /* generation holds 8 stop strings (RF_MAX_STOP); a 9th is refused, not copied past them */
        {"generate --model m --prompt x --stop 1 --stop 2 --stop 3 --stop 4 --stop 5 --stop 6 --stop 7 --stop 8 --stop 9",
         "--stop: at most 8 stop strings, got 9"},
        {"score --model m", "score needs --model, --prompt and --response"},
        {"init-model", "error: --out is required"},
        {"init-model --out x --arch gpt5", "--arch: expected qwen2, qwen3 or llama, got \"gpt5\""},
        {"init-model --out x --bf16=1", "--bf16 takes no value"},
        {"inspect", "error: inspect needs a model directory"},
        {"merge-lora --bogus", "unknown option \"--bogus\" (see --help)"},
        {"merge-lora --model a", "merge-lora needs --model, --adapter and --out"},
        {"merge-lora --model a --adapter b --out c --bf16=1", "--bf16 takes no value"},
        {"keygen", "error: --out PREFIX is required"},
        {"frobnicate", "unknown command \"frobnicate\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        int rc = rf_test_sh(&out, "cd %s && %s %s", dir, rlflow, cases[i].args);
        int ok = rc == 2 && out && strstr(out, cases[i].want);
        CHECK(ok);
        if (!ok) fprintf(stderr, "rlflow %s: exit %d, want 2 and \"%s\" in:\n%s\n", cases[i].args, rc, cases[i].want, out ? out : "");
        free(out);
    }
}

/* rlflow --version prints the project version of CMakeLists.txt. */
static void version(void) {
    const char *src = getenv("RF_SOURCE_DIR");
    char p[512], *cm = NULL, *out = NULL, want[64] = "";
    snprintf(p, sizeof p, "%s/CMakeLists.txt", src ? src : ".");
    if (rf_read_file(p, &cm, NULL) == RF_OK) {
        const char *v = strstr(cm, "project(rlflow VERSION ");
        if (v) sscanf(v + strlen("project(rlflow VERSION "), "%30[0-9.]", want);
    }
    free(cm);
    CHECK(want[0] != '\0');
    CHECK(rf_test_sh(&out, "%s --version", rlflow) == 0);
    char line[96];
    snprintf(line, sizeof line, "rlflow %s\n", want);
    CHECK(out && strcmp(out, line) == 0);
    free(out);
}

/* init-model keeps a model already at --out unless --force. */
static void init_model_force(void) {
    char *out = NULL;
    CHECK(rf_test_sh(&out, "cp %s/tiny/model.safetensors %s/before.st && %s init-model --preset tiny --out %s/tiny --seed 4",
                     dir, dir, rlflow, dir) == 1);
    char want[512];
    snprintf(want, sizeof want, "error: %s/tiny: a model is there already (config.json); pass --force to replace it", dir);
    CHECK(out && strstr(out, want));
    free(out);
    CHECK(rf_test_sh(NULL, "cmp -s %s/before.st %s/tiny/model.safetensors", dir, dir) == 0); /* untouched */
    CHECK(rf_test_sh(&out, "%s init-model --preset tiny --out %s/tiny2 --seed 4 && %s init-model --preset tiny --out %s/tiny2 "
                     "--seed 5 --force", rlflow, dir, rlflow, dir) == 0);
    free(out);
}

/* eval and generate --prompts-file read other field names with --prompt-key / --answer-key. */
static void prompt_keys(void) {
    char path[512], *out = NULL;
    snprintf(path, sizeof path, "%s/qa.jsonl", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"question\": \"1+1=\", \"solution\": \"2\"}\n{\"question\": \"2+2=\", \"solution\": 4}\n", f);
    fclose(f);
    CHECK(rf_test_sh(&out, "%s eval --model %s/tiny --data %s --prompt-key question --answer-key solution --max-new-tokens 2",
                     rlflow, dir, path) == 0);
    cJSON *j = json_line(out, 0);
    CHECK(j && cJSON_GetObjectItem(j, "n")->valueint == 2 && cJSON_IsNumber(cJSON_GetObjectItem(j, "accuracy")));
    cJSON_Delete(j);
    free(out);
    CHECK(rf_test_sh(&out, "%s eval --model %s/tiny --data %s --max-new-tokens 2", rlflow, dir, path) == 1);
    CHECK(out && strstr(out, "qa.jsonl:1: missing \"prompt\" (or \"messages\")"));
    free(out);
    /* --answer-regex: PCRE2's refusal names the option; a pattern two tokens cannot match scores 0 */
    CHECK(rf_test_sh(&out, "%s eval --model %s/tiny --data %s --prompt-key question --answer-key solution "
                     "--answer-regex '(' --max-new-tokens 2", rlflow, dir, path) == 2);
    CHECK(out && strstr(out, "--answer-regex \"(\": PCRE2 error at offset 1: missing closing parenthesis"));
    free(out);
    CHECK(rf_test_sh(&out, "%s eval --model %s/tiny --data %s --prompt-key question --answer-key solution "
                     "--answer-regex '<answer>(.*?)</answer>' --max-new-tokens 2 --rule exact", rlflow, dir, path) == 0);
    j = json_line(out, 0);
    CHECK(j && cJSON_GetObjectItem(j, "accuracy")->valuedouble == 0.0);
    cJSON_Delete(j);
    free(out);
    /* countdown answers under a rule that reads only the target: refused, naming the line */
    char cd[512];
    snprintf(cd, sizeof cd, "%s/cd.jsonl", dir);
    f = fopen(cd, "w");
    fputs("{\"prompt\": \"3 5 7 to 22:\", \"answer\": \"3 5 7 -> 22\"}\n", f);
    fclose(f);
    CHECK(rf_test_sh(&out, "%s eval --model %s/tiny --data %s --max-new-tokens 2", rlflow, dir, cd) == 1);
    CHECK(out && strstr(out, "--rule numeric cannot check countdown answers (") &&
          strstr(out, "cd.jsonl:1: \"3 5 7 -> 22\"): it would reward the bare target number, not an expression that "
                      "reaches it; use --rule countdown"));
    free(out);
    CHECK(rf_test_sh(&out, "%s eval --model %s/tiny --data %s --max-new-tokens 2 --rule countdown", rlflow, dir, cd) == 0);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompts-file %s --prompt-key question --answer-key solution "
                     "--greedy --max-new-tokens 2 --json", rlflow, dir, path) == 0);
    cJSON *j0 = json_line(out, 0), *j1 = json_line(out, 1);
    CHECK(j0 && j1 && strcmp(cJSON_GetObjectItem(j0, "prompt")->valuestring, "1+1=") == 0 &&
          cJSON_IsString(cJSON_GetObjectItem(j0, "answer")) &&
          strcmp(cJSON_GetObjectItem(j0, "answer")->valuestring, "2") == 0 && /* the file's types kept */
          cJSON_IsNumber(cJSON_GetObjectItem(j1, "answer")) && cJSON_GetObjectItem(j1, "answer")->valueint == 4);
    cJSON_Delete(j0), cJSON_Delete(j1);
    free(out);
    CHECK(rf_test_sh(&out, "%s generate --model %s/tiny --prompts-file %s --prompt-key question --answer-key answer --greedy",
                     rlflow, dir, path) == 1);
    CHECK(out && strstr(out, "qa.jsonl:1: missing \"answer\" (--answer-key)"));
    free(out);
}

/* docs/cli.md documents every option each command's --help lists, in that command's section. */
static void docs_cover_help(void) {
    const char *src = getenv("RF_SOURCE_DIR");
    char p[512], *doc = NULL;
    snprintf(p, sizeof p, "%s/docs/cli.md", src ? src : ".");
    if (!src || rf_read_file(p, &doc, NULL) != RF_OK) {
        printf("docs check skipped: RF_SOURCE_DIR not set\n");
        return;
    }
    static const char *cmds[] = {"run", "sft", "eval", "data", "init-model", "inspect", "generate", "score", "keygen"};
    int checked = 0;
    for (size_t c = 0; c < sizeof cmds / sizeof cmds[0]; c++) {
        char head[64], *out = NULL;
        snprintf(head, sizeof head, "\n## rlflow %s", cmds[c]);
        char *sec = strstr(doc, head), *end = sec ? strstr(sec + 1, "\n## ") : NULL;
        CHECK(sec != NULL);
        if (!sec) fprintf(stderr, "docs/cli.md has no section \"## rlflow %s\"\n", cmds[c]);
        size_t len = sec ? (end ? (size_t)(end - sec) : strlen(sec)) : 0;
        rf_test_sh(&out, "%s %s --help", rlflow, cmds[c]);
        for (char *save = NULL, *line = out ? strtok_r(out, "\n", &save) : NULL; line; line = strtok_r(NULL, "\n", &save)) {
            char name[64], want[80];
            if (sscanf(line, "  --%63[a-z0-9-]", name) != 1 || strcmp(name, "help") == 0) continue; /* said once, at the top */
            snprintf(want, sizeof want, "`--%s", name);
            int has = sec && memmem(sec, len, want, strlen(want)) != NULL;
            CHECK(has);
            if (!has) fprintf(stderr, "docs/cli.md, rlflow %s: no %s`\n", cmds[c], want);
            checked++;
        }
        free(out);
    }
    printf("docs/cli.md: %d options of %zu commands checked\n", checked, sizeof cmds / sizeof cmds[0]);
    CHECK(checked > 40);
    free(doc);
}

/* cmake --install into a prefix, the tree then moved: the installed rlflow loads the
 * installed librlflow_core (a RUNPATH relative to itself) and, with CUDA, the installed CUDA
 * module, not the build tree's; the examples and the Python reward client are installed; the
 * installed C example reward program builds against the moved tree alone (cc with the
 * installed pkg-config file) and runs: with no rlflow to answer, it exits 3 naming the wait. */
static void installed(void) {
    const char *cmake = getenv("RF_CMAKE"), *build = getenv("RF_BUILD_DIR");
    if (!cmake || !build) {
        printf("installed: skipped: RF_CMAKE and RF_BUILD_DIR not set\n");
        return;
    }
    char *out = NULL;
    int rc = rf_test_sh(&out, "'%s' --install '%s' --prefix %s/inst >/dev/null && mv %s/inst %s/moved", cmake, build, dir,
                        dir, dir);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    CHECK(rf_test_sh(&out, "LD_DEBUG=libs %s/moved/bin/rlflow generate --model %s/tiny --prompt x --max-new-tokens 2 "
                     "2>&1 | grep -c 'calling init: %s/moved/bin/../lib/librlflow_core.so$'", dir, dir, dir) == 0);
    CHECK(out && atoi(out) >= 1);
    free(out);
    CHECK(rf_test_sh(&out, "ls %s/moved/share/rlflow/examples/grpo.toml %s/moved/share/rlflow/reward/clients/python/rlflow_reward.py "
                     "%s/moved/share/doc/rlflow/recipes.md %s/moved/share/rlflow/proto/rlflow.proto", dir, dir, dir, dir) == 0);
    free(out);
    if (rf_test_sh(NULL, "command -v cc >/dev/null && command -v pkg-config >/dev/null") != 0) {
        printf("installed: the C reward client not built: cc or pkg-config missing\n");
        return;
    }
    rc = rf_test_sh(&out, "cd %s && cc -o judge moved/share/rlflow/examples/reward/length_judge.c "
                    "$(PKG_CONFIG_PATH=%s/moved/lib/pkgconfig pkg-config --cflags --libs rlflow-reward-client) "
                    "-Wl,-rpath,%s/moved/lib 2>&1 && ./judge --connect tcp://127.0.0.1:9 --timeout 0.5 2>&1", dir, dir, dir);
    CHECK(rc == 3 && out && strstr(out, "length_judge: rlflow at tcp://127.0.0.1:9 did not answer Hello within 0.5 s"));
    if (rc != 3) fprintf(stderr, "installed C reward client (exit %d):\n%s\n", rc, out ? out : "");
    free(out);
#ifdef RLFLOW_HAVE_CUDA
    rf_test_sh(&out, "env -u RLFLOW_CUDA_MODULE LD_DEBUG=files %s/moved/bin/rlflow generate --model %s/tiny --prompt x "
               "--device cuda 2>&1 | grep -c 'file=%s/moved/bin/../lib/librlflow_cuda.so '", dir, dir, dir);
    CHECK(out && atoi(out) >= 1);
    free(out);
#endif
}

int main(void) {
    rlflow = getenv("RF_RLFLOW");
    if (!rlflow) {
        printf("test_cli: skipped: RF_RLFLOW (path of the rlflow binary) not set\n");
        return 77;
    }
    snprintf(dir, sizeof dir, "/tmp/rf_cli_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    init_and_inspect();
    generate_and_score();
    prompts_file();
    errors();
    usage_errors();
    version();
    init_model_force();
    prompt_keys();
    docs_cover_help();
    installed();
    char *out;
    rf_test_sh(&out, "rm -rf %s", dir);
    free(out);
    return rf_test_finish("test_cli");
}
