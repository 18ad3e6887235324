/* `rlflow init-model` and `rlflow inspect`. */
#include <stdio.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "model/byte_tokenizer.h"
#include "model/lora.h"
#include "model/safetensors.h"
#include "trainer/checkpoint.h"

#define N_OPTS(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* A model directory already at `out` (config.json or model weights) is kept unless --force: a
 * mistyped --out must not replace a trained model. */
static rf_status refuse_overwrite(const char *out, int force) {
    static const char *const files[] = {"config.json", "model.safetensors", "model.safetensors.index.json"};
    for (size_t i = 0; !force && i < sizeof files / sizeof files[0]; i++) {
        char p[4200];
        rf_path_join(p, sizeof p, out, files[i]);
        if (rf_file_exists(p))
            return rf_error(RF_ERR_ARG, "%s: a model is there already (%s); pass --force to replace it", out, files[i]);
    }
    return RF_OK;
}

int rf_cmd_init_model(int argc, char **argv) {
    const char *preset = "tiny", *out = NULL, *arch = "qwen2";
    int seed = 1, help = 0, bf16 = 0, force = 0;
    float std = 0.02f;
    rf_opt opts[] = {
        {"preset", RF_OPT_STR, &preset, "tiny | small | 25m (default tiny)", 0},
        {"arch", RF_OPT_STR, &arch, "qwen2 | qwen3 | llama (default qwen2)", 0},
        {"out", RF_OPT_STR, &out, "output directory (required)", 0},
        {"seed", RF_OPT_INT, &seed, "initialisation seed (default 1)", 0},
        {"init-std", RF_OPT_FLOAT, &std, "std of the normal init (default 0.02)", 0},
        {"bf16", RF_OPT_FLAG, &bf16, "store weights as BF16 (default F32)", 0},
        {"force", RF_OPT_FLAG, &force, "replace a model already in --out", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), pos, 0, &n_pos);
    if (s || help || !out) {
        rf_args_usage("init-model", "--out DIR [options]", opts, N_OPTS(opts));
        if (s) return rf_cli_usage_fail(s);
        return help ? 0 : (fprintf(stderr, "error: --out is required\n"), 2);
    }
    rf_model_config cfg;
    if ((s = rf_config_preset(&cfg, preset, RF_BYTE_TOKENIZER_VOCAB))) return rf_cli_fail(s);
    if (strcmp(arch, "qwen3") == 0) {
        cfg.arch = RF_ARCH_QWEN3, cfg.qkv_bias = 0, cfg.qk_norm = 1;
    } else if (strcmp(arch, "llama") == 0) {
        cfg.arch = RF_ARCH_LLAMA, cfg.qkv_bias = 0;
    } else if (strcmp(arch, "qwen2") != 0) {
        return rf_cli_usage_fail(rf_error(RF_ERR_ARG, "--arch: expected qwen2, qwen3 or llama, got \"%s\"", arch));
    }
    if ((s = refuse_overwrite(out, force))) return rf_cli_fail(s);
    snprintf(cfg.model_type, sizeof cfg.model_type, "%s", arch);
    cfg.eos_token_ids[0] = RF_BYTE_TOKENIZER_EOS, cfg.n_eos = 1;
    rf_model *m = NULL;
    if ((s = rf_model_init(&m, &cfg, rf_cpu_kernels()))) return rf_cli_fail(s);
    rf_model_init_random(m, (uint64_t)seed, std);
    s = rf_model_save(m, out, bf16, 0);
    if (s == RF_OK) s = rf_byte_tokenizer_write(out);
    if (s == RF_OK)
        rf_log_info("wrote %s: %s preset, %zu parameters (%.2f M), vocab %d", out, preset,
                    m->n_params, (double)m->n_params / 1e6, cfg.vocab_size);
    rf_model_free(m);
    return s ? rf_cli_fail(s) : 0;
}

static void print_config(const rf_model_config *c) {
    printf("model_type            %s%s\n", c->model_type, c->value_head ? " (value head: score.weight)" : "");
    printf("hidden_size           %d\nintermediate_size     %d\nnum_hidden_layers     %d\n",
           c->hidden_size, c->intermediate_size, c->num_hidden_layers);
    printf("attention heads       %d (kv %d, head_dim %d)\n", c->num_attention_heads,
           c->num_key_value_heads, c->head_dim);
    printf("vocab_size            %d\nrms_norm_eps          %g\nrope_theta            %g\n",
           c->vocab_size, c->rms_norm_eps, c->rope_theta);
    printf("rope_scaling          %s\n", c->rope_scaling_type == 2 ? "llama3" : c->rope_scaling_type == 1 ? "linear" : "none");
    printf("max positions         %d\ntied embeddings       %s\nqkv bias              %s\nqk norm               %s\n",
           rf_config_max_seq(c), c->tie_word_embeddings ? "yes" : "no", c->qkv_bias ? "yes" : "no",
           c->qk_norm ? "yes" : "no");
}

static void print_tensors(const rf_safetensors *st) {
    int n = rf_st_count(st);
    printf("tensors               %d\n", n);
    for (int i = 0; i < n; i++) {
        const rf_st_tensor *t = rf_st_at(st, i);
        printf("  %-52s %-5s [", t->name, rf_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) printf("%s%lld", d ? ", " : "", (long long)t->shape[d]);
        printf("]\n");
    }
}

int rf_cmd_inspect(int argc, char **argv) {
    int help = 0;
    rf_opt opts[] = {{"help", RF_OPT_FLAG, &help, "show this help", 0}};
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), pos, 1, &n_pos);
    if (s == RF_OK && !help && n_pos != 1) s = rf_error(RF_ERR_ARG, "inspect needs a model directory");
    if (s || help) {
        rf_args_usage("inspect", "DIR", opts, N_OPTS(opts));
        return s ? rf_cli_usage_fail(s) : 0;
    }
    rf_model *m = NULL;
    rf_tokenizer *tok = NULL;
    if ((s = rf_model_load(&m, pos[0], rf_cpu_kernels(), 0))) return rf_cli_fail(s);
    rf_safetensors *st = NULL;
    if ((s = rf_st_open_dir(&st, pos[0]))) {
        rf_model_free(m);
        return rf_cli_fail(s);
    }
    printf("directory             %s\n", pos[0]);
    print_config(&m->cfg);
    printf("parameters            %zu (%.2f M)\n", m->n_params, (double)m->n_params / 1e6);
    print_tensors(st);
    s = rf_tokenizer_load_dir(&tok, pos[0]);
    if (s == RF_OK)
        printf("tokenizer             %s BPE, %d tokens, bos %d, eos %d\n", rf_tokenizer_family(tok),
               rf_tokenizer_vocab_size(tok), rf_tokenizer_bos_id(tok), rf_tokenizer_eos_id(tok));
    else
        printf("tokenizer             unavailable: %s\n", rf_error_message());
    int32_t eos[8];
    int n_eos = rf_cli_eos_ids(pos[0], m, tok, eos, 8);
    printf("generation stops at   ");
    for (int i = 0; i < n_eos; i++) printf("%s%d", i ? ", " : "", eos[i]);
    printf("%s\n", n_eos ? "" : "(no EOS id known)");
    rf_tokenizer_free(tok);
    rf_st_close(st);
    rf_model_free(m);
    return 0;
}

int rf_cmd_merge_lora(int argc, char **argv) {
    const char *model = NULL, *adapter = NULL, *out = NULL;
    int help = 0, bf16 = 0;
    rf_opt opts[] = {
        {"model", RF_OPT_STR, &model, "base model directory (Hugging Face layout; required)", 0},
        {"adapter", RF_OPT_STR, &adapter, "LoRA adapter directory in PEFT's layout (required)", 0},
        {"out", RF_OPT_STR, &out, "output model directory (required)", 0},
        {"bf16", RF_OPT_FLAG, &bf16, "write BF16 tensors (default F32)", 0},
        {"help", RF_OPT_FLAG, &help, "show this help", 0},
    };
    const char *pos[1];
    int n_pos;
    rf_status s = rf_args_parse(argc, argv, opts, N_OPTS(opts), pos, 0, &n_pos);
    if (s == RF_OK && !help && (!model || !adapter || !out))
        s = rf_error(RF_ERR_ARG, "merge-lora needs --model, --adapter and --out");
    if (s || help) {
        rf_args_usage("merge-lora", "--model DIR --adapter DIR --out DIR [--bf16]", opts, N_OPTS(opts));
        return s ? rf_cli_usage_fail(s) : 0;
    }
    rf_model *m = NULL;
    s = rf_model_load(&m, model, rf_cpu_kernels(), 0);
    if (s == RF_OK) s = rf_lora_load_peft(m, adapter);
    if (s == RF_OK) s = rf_lora_merge(m);
    if (s == RF_OK) s = rf_model_save(m, out, bf16, 0);
    if (s == RF_OK) s = rf_copy_tokenizer_files(model, out);
    if (s == RF_OK) rf_log_info("merge-lora: wrote %s (%s + %s)", out, model, adapter);
    rf_model_free(m);
    return s ? rf_cli_fail(s) : 0;
}
