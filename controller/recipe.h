/* Recipes: the TOML file that says what a run does (model, data, rollout, algorithm, training,
 * rewards, logging, checkpoints, placement), read into an rf_recipe struct through one schema
 * table. Every key has a section, a name, a type, a default, a field of rf_recipe and a line of
 * documentation; docs/recipes.md is generated from that table (rf_recipe_doc_markdown) and a
 * test keeps it in step.
 *
 * Where a value comes from is recorded per key (the file position, "--set", or the default)
 * so that later checks can point at it: "recipe.toml:12:1: placement.mode = "split" is not
 * implemented yet (...)". */
#ifndef RF_RECIPE_H
#define RF_RECIPE_H

#include <stdio.h>

#include "common/status.h"

#define RF_RECIPE_MAX_KEYS 160

typedef struct rf_str_list {
    char **v; /* (n) owned strings */
    int n;
} rf_str_list;

/* A list of argument vectors: reward.programs = [["python3", "judge.py"], ...]. */
typedef struct rf_argv_list {
    rf_str_list *v; /* (n) each one program's argv (n >= 1 words) */
    int n;
} rf_argv_list;

typedef struct rf_float_list {
    double *v; /* (n) */
    int n;
} rf_float_list;

/* Enum-valued keys are `const char *` pointing at the schema's static spelling of the value
 * (compare with strcmp, or hand to rf_adv_kind_parse / rf_loss_agg_parse / rf_kl_est_parse).
 * Strings (`char *`) and lists are owned by the recipe. Booleans are 0/1 ints. */
typedef struct rf_recipe {
    struct {
        char *path;        /* HF model dir of the policy */
        char *init_preset; /* "", "tiny", "small", "25m": random init when path is missing */
        const char *device; /* "cpu" | "cuda" */
        const char *precision; /* "auto" | "fp32" | "bf16": operands of matrix products */
    } model;
    struct {
        char *train, *val; /* JSONL files */
        char *prompt_key, *answer_key;
        const char *chat_template; /* "" | "chatml" | "llama3" */
        int shuffle, seed, max_prompt_tokens;
        const char *task; /* "" | "arith" | "countdown": generate train/val when missing */
        int task_train, task_val;                            /* examples to generate */
        int task_min_digits, task_max_digits, task_mul_percent; /* arith knobs */
        int task_n_numbers, task_max_number, task_max_target;   /* countdown knobs */
    } data;
    struct {
        int n, prompts_per_step;
        double temperature, top_p;
        int top_k, max_new_tokens;
        rf_str_list stop;
        int max_running, kv_block_size, kv_blocks;
        double kv_memory_fraction;
        const char *free_kv_cache; /* "auto" | "on" | "off": rf_recipe_free_kv_cache */
    } rollout;
    struct {
        const char *name; /* "ppo" | "grpo" | "dr_grpo" | "rloo" | "reinforce_pp" */
        double gamma, lam, clip_low, clip_high, dual_clip, value_clip;
        const char *loss_agg; /* "token-mean" | "seq-mean-token-sum" | ... */
        int norm_adv_by_std, whiten_advantages;
        double kl_coef;
        int kl_in_reward;
        const char *kl_estimator; /* "k1" | "k2" | "k3" */
        int adaptive_kl;
        double kl_target;
        int kl_horizon;
        double entropy_coef;
        int dynamic_sampling, max_resample_rounds, overlong_buffer;
        double overlong_penalty;
        int decoupled;
        double is_cap;
        const char *policy_loss;        /* "clip" | "gspo" | "cispo" */
        const char *rollout_correction; /* "none" | "tis" | "mis-token" | "mis-seq" */
        double rollout_is_low, rollout_is_high;
    } algorithm;
    struct {
        int steps;
        double lr;
        int warmup_steps;
        const char *schedule; /* "constant" | "cosine" */
        double min_lr_ratio, weight_decay, beta1, beta2, eps, grad_clip;
        int ppo_epochs, mini_batches, micro_batch_tokens, seed;
    } train;
    struct {
        int epochs;
        double lr;
        int batch_size, max_steps;
        double target_accuracy; /* stop once greedy accuracy on the check set reaches it; 0 = off */
        int check_every, check_size;
        char *out; /* output model dir ("" = <logging.dir>/sft) */
        int warm_start; /* rlflow run: build a missing model.path by SFT first */
    } sft;
    struct {
        int enabled;          /* train LoRA adapters on the frozen policy (model/lora.h) */
        int rank;
        double alpha, dropout;
        rf_str_list targets;  /* of "q" "k" "v" "o" "gate" "up" "down" */
        const char *init;     /* "gaussian" | "kaiming" */
    } lora;
    struct {
        rf_str_list rules;      /* of "numeric", "math", "exact", "countdown", "format", "length", "overlong" */
        rf_float_list weights;  /* one per rule, or empty = all 1.0 */
        char *format_regex;
        char *answer_regex;
        int length_target;
        double length_penalty;
        char *model; /* ForSequenceClassification dir, "" = none */
        double model_weight;
        char *external; /* endpoint for reward programs, "" = none */
        double external_weight, external_timeout;
        char *external_curve_secret;  /* file: rlflow's Z85 CURVE secret key, "" = no CURVE */
        char *external_curve_clients; /* file: allowed program public keys, one per line */
        int external_insecure;        /* allow a non-loopback endpoint without CURVE */
        rf_argv_list programs;        /* reward programs rlflow starts (controller/programs.h) */
        int program_restarts;         /* restarts allowed per program over the run */
    } reward;
    struct {
        const char *type;   /* "" (single-turn) | "calculator" (built in) | "external" (programs) */
        char *endpoint;     /* env.type = "external": the endpoint environment programs connect to */
        int max_turns;      /* turns per episode at most */
        int max_total_tokens; /* tokens after the prompt (generated and observations) at most */
        double timeout;     /* seconds: connect wait, silence and per-call deadline */
        char *curve_secret, *curve_clients; /* CURVE key files, "" = none */
        int insecure;       /* allow a non-loopback endpoint without CURVE */
        rf_argv_list programs; /* environment programs rlflow starts (controller/programs.h) */
        int program_restarts;  /* restarts allowed per program over the run */
    } env;
    struct {
        const char *enabled; /* "auto" | "true" | "false"; see rf_recipe_reference_enabled */
        char *path;          /* "" = the initial policy */
    } reference;
    struct {
        char *path; /* "" = the initial policy with a fresh value head */
        double lr;
        int warmup_steps;
    } critic;
    struct {
        char *dir;
        int every, val_every, val_size, tensorboard, jsonl;
        int samples_every, samples_per_step;
    } logging;
    struct {
        int every, keep, save_optimizer;
    } checkpoint;
    struct {
        int max_staleness, buffer_groups;
        double peer_timeout, startup_timeout, progress_timeout;
    } async;
    struct {
        const char *mode;   /* "colocated" | "split" */
        const char *device; /* "cpu" | "cuda" */
        int rollout_ranks, rollout_threads, train_threads;
        char *endpoint, *mpirun;
        struct {
            int dp, tp; /* training layout: data-parallel ranks x tensor-parallel ranks */
            int zero;   /* ZeRO stage of the optimizer state: 0 or 1 */
        } actor;        /* [placement.actor] */
        struct {
            int tp;       /* tensor-parallel ranks per rollout worker */
            int replicas; /* rollout workers; 0: placement.rollout_ranks (the same count: when
                             set, the recipe's loader copies it there) */
        } rollout;        /* [placement.rollout] */
        struct {
            int dp, tp;   /* 0: the actor's (placement.actor); see rf_recipe_role_layout */
        } critic, reference; /* [placement.critic], [placement.reference] */
        struct {
            int dp;       /* 0: the actor's; see rf_recipe_role_layout */
            int tp;       /* tensor-parallel ranks of each replica holding it (1: whole) */
        } reward;         /* [placement.reward] */
    } placement;

    /* Provenance, for messages: the file read (NULL when none) and, per schema key, where its
     * value came from. Use rf_recipe_where rather than reading these. */
    char *source;
    struct {
        signed char from; /* 0 default, 1 file, 2 --set */
        int line, col;
    } where_[RF_RECIPE_MAX_KEYS];
} rf_recipe;

/* Fills r with the defaults. r owns what it holds afterwards: release with rf_recipe_free. */
rf_status rf_recipe_init(rf_recipe *r);

/* Defaults, then the TOML file at `path` (NULL: none), then each override "section.key=value"
 * (the value is read as a TOML value; text that is not one, or any value given to a string
 * key, is taken as a string, so "model.path=models/x" works), then rf_recipe_validate. On failure r holds nothing to free.
 * Errors: RF_ERR_FORMAT (TOML syntax, "FILE:LINE:COL: ..."), RF_ERR_ARG for unknown keys
 * ("FILE:LINE:COL: unknown key "algorithm.kl_coeff" (did you mean "algorithm.kl_coef"?)"), wrong
 * types ("...: algorithm.kl_coef: expected a float, got a string"), values outside an enum
 * (listing the allowed ones) and impossible values; overrides are located as "--set". */
rf_status rf_recipe_load(rf_recipe *r, const char *path, const char *const *overrides,
                         int n_overrides);

/* Checks values that parse but cannot work (negative lr, n < 1, top_p outside (0, 1], ...);
 * the message names the key and where it was set. Errors: RF_ERR_ARG. */
rf_status rf_recipe_validate(const rf_recipe *r);

/* Releases what r owns and zeroes it (NULL is fine). */
void rf_recipe_free(rf_recipe *r);

/* Writes the effective recipe as TOML, every key of every section, so that it can be saved
 * next to a checkpoint and loaded back to an equal rf_recipe. Errors: RF_ERR_IO. */
rf_status rf_recipe_dump(const rf_recipe *r, FILE *f);

/* Writes docs/recipes.md: every section and key with its type, default and meaning. */
void rf_recipe_doc_markdown(FILE *f);

/* Where `key` ("placement.mode") got its value: "FILE:LINE:COL", "--set" or "(default)".
 * Writes into buf (cap bytes) and returns it. */
const char *rf_recipe_where(const rf_recipe *r, const char *key, char *buf, size_t cap);

/* For an option that parses but whose feature does not exist yet: returns RF_ERR_UNSUPPORTED
 * "WHERE: placement.mode = "split" is not implemented yet (WHY)". RF_ERR_ARG for a key that is
 * not in the schema. */
rf_status rf_recipe_reject_unimplemented(const rf_recipe *r, const char *key, const char *why);

/* The models that sit on the actor's grid beside it ([placement.reference], [placement.critic],
 * [placement.reward]). */
enum { RF_ROLE_REFERENCE = 0, RF_ROLE_CRITIC = 1, RF_ROLE_REWARD = 2 };

/* The layout of `role` (RF_ROLE_*) on the training ranks, zeros resolved to the actor's: *dp
 * replicas of the actor's hold it (replicas 0 .. *dp - 1), each split over *tp ranks (1: whole
 * on the replica's first rank; the reward model's tp defaults to 1, the others' to the actor's).
 * Which layouts a build carries out is checked when a run starts (controller/run_setup.c). */
void rf_recipe_role_layout(const rf_recipe *r, int role, int *dp, int *tp);

/* The name of `role` (RF_ROLE_*) in messages: "reference", "critic", "reward model". */
const char *rf_recipe_role_name(int role);

/* placement.mode = "colocated" with a parallel layout (placement.actor.dp x placement.actor.tp
 * or placement.rollout.tp above 1): training ranks and as many rollout ranks run as processes
 * under mpirun, the rollout ranks on the training ranks' devices, taking turns with them
 * (docs/deployment.md, "Colocated on several devices"). */
int rf_recipe_colocated_ranks(const rf_recipe *r);
/* The run is the message-driven controller and its workers under mpirun: split, or colocated
 * on several ranks. */
int rf_recipe_multi_process(const rf_recipe *r);

/* rollout.free_kv_cache resolved: "auto" means on in colocated runs (one process or several)
 * on CUDA. */
int rf_recipe_free_kv_cache(const rf_recipe *r);

/* reference.enabled resolved: "auto" means on when algorithm.kl_coef > 0. */
int rf_recipe_reference_enabled(const rf_recipe *r);

#endif
