/* Setting up a run from its recipe: data (generated when the recipe names a built-in task and
 * the files are missing), the policy (an SFT warm start built when asked and missing), the
 * reference and critic, tokenizer, datasets, reward rules and metrics. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/log.h"
#include "common/util.h"
#include "controller/controller.h"
#include "controller/interrupt.h"
#include "controller/programs.h"
#include "common/curve.h"
#include "controller/run_internal.h"
#include "controller/tasks.h"
#include "model/config.h"
#include "model/lora.h"
#include "resharding/layout.h"

static int dir_has_model(const char *dir) {
    char p[4096];
    rf_path_join(p, sizeof p, dir, "config.json");
    return rf_file_exists(p);
}

rf_status rf__ensure_data(const rf_recipe *r) {
    if (!r->data.task[0] || rf_file_exists(r->data.train)) return RF_OK;
    /* the task's directory is the train file's directory */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", r->data.train);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0'; else snprintf(dir, sizeof dir, ".");
    rf_task_opts o;
    rf_task_opts_default(&o);
    o.min_digits = r->data.task_min_digits, o.max_digits = r->data.task_max_digits;
    o.mul_percent = r->data.task_mul_percent;
    o.n_numbers = r->data.task_n_numbers, o.max_number = r->data.task_max_number;
    o.max_target = r->data.task_max_target;
    rf_log_info("data: generating %s into %s (%d train, %d val)", r->data.task, dir,
                r->data.task_train, r->data.task_val);
    return rf_task_generate_opts(r->data.task, dir, r->data.task_train, r->data.task_val,
                                 (uint64_t)r->data.seed, &o);
}

rf_status rf__ensure_model(const rf_recipe *r) {
    if (dir_has_model(r->model.path)) return RF_OK;
    if (!r->model.init_preset[0])
        return rf_error(RF_ERR_IO, "model.path \"%s\" holds no config.json (set model.init_preset "
                        "to create a model there)", r->model.path);
    if (r->sft.warm_start) return rf__sft_build(r, r->model.path);
    return rf__init_model(r, r->model.path);
}

rf_status rf__lora_opts(const rf_recipe *r, rf_lora_opts *o) {
    *o = (rf_lora_opts){.rank = r->lora.rank, .alpha = (float)r->lora.alpha, .dropout = (float)r->lora.dropout,
                        .init = strcmp(r->lora.init, "kaiming") == 0 ? RF_LORA_INIT_KAIMING : RF_LORA_INIT_GAUSSIAN,
                        .seed = (uint64_t)r->train.seed};
    return rf_lora_parse_targets((const char *const *)r->lora.targets.v, r->lora.targets.n, "lora.targets", &o->targets);
}

rf_status rf__lora_attach(const rf_recipe *r, rf_model *m) {
    if (!r->lora.enabled) return RF_OK;
    rf_lora_opts o;
    RF_TRY(rf__lora_opts(r, &o));
    RF_TRY(rf_model_lora_attach(m, &o));
    rf_log_info("lora: rank %d, alpha %g on %d tensors: %zu trained parameters of %zu (%.2f%%); the base is frozen",
                o.rank, o.alpha, m->lora.n_views, m->n_params - m->n_frozen, m->n_params,
                100.0 * (double)(m->n_params - m->n_frozen) / (double)m->n_params);
    return RF_OK;
}

/* The reference policy: under LoRA with no reference.path of its own, the actor's frozen base
 * weights seen through a second model without adapters (no second copy of the weights);
 * otherwise a frozen load (bf16 matrices kept as stored when running bf16). */
static rf_status load_reference(rf_run *run) {
    const rf_recipe *r = run->r;
    if (run->actor->lora.rank && !r->reference.path[0])
        return rf_model_init_borrowed(&run->ref, &run->actor->cfg, run->k, run->actor->params);
    const char *p = r->reference.path[0] ? r->reference.path : r->model.path;
    return rf_model_load_frozen(&run->ref, p, run->k, 0);
}

rf_status rf__load_roles(rf_run *run) {
    const rf_recipe *r = run->r;
    RF_TRY(rf_model_load(&run->actor, r->model.path, run->k, 0));
    RF_TRY(rf__lora_attach(r, run->actor));
    RF_TRY(rf_model_enable_training(run->actor));
    RF_TRY(rf_tokenizer_load_dir(&run->tok, r->model.path));
    if (rf_recipe_reference_enabled(r)) RF_TRY(load_reference(run));
    if (run->adv_kind == RF_ADV_GAE) {
        const char *p = r->critic.path[0] ? r->critic.path : r->model.path;
        RF_TRY(rf_model_load(&run->critic, p, run->k, 1));
        RF_TRY(rf_model_enable_training(run->critic));
    }
    return RF_OK;
}

/* Whether reward.rules lists a rule that compares with the dataset's answer. */
static int rules_need_answer(const rf_recipe *r) {
    static const char *const need[] = {"numeric", "math", "exact", "countdown"};
    for (int i = 0; i < r->reward.rules.n; i++)
        for (int k = 0; k < 4; k++)
            if (strcmp(r->reward.rules.v[i], need[k]) == 0) return 1;
    return 0;
}

/* With the countdown rule every answer present must read "NUMBERS -> TARGET": a file made
 * before the rule existed ("answer": "78") would otherwise score every sample 0. */
static rf_status check_countdown_truths(const rf_recipe *r, const rf_dataset *ds, const char *path) {
    int listed = 0;
    for (int i = 0; i < r->reward.rules.n; i++) listed |= strcmp(r->reward.rules.v[i], "countdown") == 0;
    for (int i = 0; listed && i < rf_dataset_size(ds); i++) {
        const rf_example *e = rf_dataset_get(ds, i);
        int64_t nums[64];
        int n, target;
        if (e->answer && !rf_countdown_truth_parse(e->answer, nums, 64, &n, &target))
            return rf_error(RF_ERR_FORMAT, "%s:%d: \"%s\" (data.answer_key) = \"%.80s\" is not a countdown truth "
                            "\"NUMBERS -> TARGET\" (\"3 7 25 50 -> 82\"), which the countdown rule reads; "
                            "`rlflow data countdown` writes it (a file made by an older rlflow holds the target "
                            "alone: delete it and the run makes it again)", path, e->line, r->data.answer_key,
                            e->answer);
    }
    return RF_OK;
}

/* A prompt that leaves no room for its generation budget within the model's positions fails
 * here, naming its line, rather than when the rollout meets it (hours into a run). */
static rf_status check_prompt_room(const rf_run *run, const rf_dataset *ds, const char *path) {
    const rf_recipe *r = run->r;
    int env = r->env.type[0] != '\0', positions = run->positions;
    int budget = env ? r->env.max_total_tokens : r->rollout.max_new_tokens;
    const char *key = env ? "env.max_total_tokens" : "rollout.max_new_tokens";
    for (int i = 0; run->tok && positions > 0 && i < rf_dataset_size(ds); i++) {
        const rf_example *e = rf_dataset_get(ds, i);
        if ((int64_t)e->n_prompt + budget > positions)
            return rf_error(RF_ERR_RANGE, "%s:%d: the prompt (%d tokens) + %s (%d) exceed the model's %d positions "
                            "(%s/config.json): drop such prompts at load with data.max_prompt_tokens (%d or less "
                            "here) or lower %s", path, e->line, e->n_prompt, key, budget, positions, r->model.path,
                            positions - budget, key);
    }
    return RF_OK;
}

/* run->positions from model.path's config.json, which a split run's controller and a run
 * whose warm start is built both have when the data is loaded; 0 without one. */
static rf_status read_positions(rf_run *run) {
    char p[4096];
    rf_model_config cfg;
    rf_path_join(p, sizeof p, run->r->model.path, "config.json");
    run->positions = 0;
    if (!rf_file_exists(p)) return RF_OK;
    RF_TRY(rf_config_load(&cfg, p));
    run->positions = rf_config_max_seq(&cfg);
    return RF_OK;
}

rf_status rf__load_data(rf_run *run) {
    const rf_recipe *r = run->r;
    rf_dataset_opts o = {.prompt_key = r->data.prompt_key, .answer_key = r->data.answer_key,
                         .need_answer = rules_need_answer(r),
                         .chat_template = r->data.chat_template,
                         .max_prompt_tokens = r->data.max_prompt_tokens,
                         .no_shuffle = !r->data.shuffle, .seed = (uint64_t)r->data.seed};
    RF_TRY(read_positions(run));
    RF_TRY(rf_dataset_load(&run->train, r->data.train, &o, run->tok));
    RF_TRY(check_countdown_truths(r, run->train, r->data.train));
    RF_TRY(check_prompt_room(run, run->train, r->data.train));
    if (r->data.val[0]) {
        o.no_shuffle = 1;
        RF_TRY(rf_dataset_load(&run->val, r->data.val, &o, run->tok));
        RF_TRY(check_countdown_truths(r, run->val, r->data.val));
        RF_TRY(check_prompt_room(run, run->val, r->data.val));
    }
    return RF_OK;
}

rf_status rf__rules_init(const rf_recipe *r, rf_reward_rules **out) {
    float w[16];
    if (r->reward.weights.n > 16)
        return rf_error(RF_ERR_ARG, "reward.weights: at most 16 entries");
    for (int i = 0; i < r->reward.weights.n; i++) w[i] = (float)r->reward.weights.v[i];
    rf_reward_rules_config c = {
        .names = (const char *const *)r->reward.rules.v, .n_names = r->reward.rules.n,
        .weights = w, .n_weights = r->reward.weights.n, .format_regex = r->reward.format_regex,
        .answer_regex = r->reward.answer_regex,
        .length_target = r->reward.length_target, .length_penalty = (float)r->reward.length_penalty,
        .overlong_buffer = r->algorithm.overlong_buffer,
        .overlong_penalty = (float)r->algorithm.overlong_penalty,
        .max_new_tokens = r->rollout.max_new_tokens,
        .allow_none = 1}; /* reward.rules = [] passed the recipe's check: rewards come from elsewhere */
    return rf_reward_rules_init(out, &c);
}

/* What differs between the kinds of programs rlflow starts (reward.programs, env.programs). */
typedef struct program_kind {
    const char *label;        /* log prefix: "reward", "env" */
    const char *key;          /* "reward.programs" */
    const char *restarts_key; /* "reward.program_restarts" */
    const char *var;          /* the environment variables' prefix: "RLFLOW_REWARD" */
    const char *log_prefix;   /* <logging.dir>/<log_prefix>_<i>.log */
    const char *endpoint;     /* the recipe's endpoint, "" for a loopback one made for the run */
    const char *secret_file;  /* its CURVE secret key file, "" for none */
    const char *secret_key;   /* that file's recipe key, for messages */
    const rf_argv_list *argv;
    int restarts;
} program_kind;

static program_kind reward_kind(const rf_recipe *r) {
    return (program_kind){"reward", "reward.programs", "reward.program_restarts", "RLFLOW_REWARD", "reward_program",
                          r->reward.external, r->reward.external_curve_secret, "reward.external_curve_secret",
                          &r->reward.programs, r->reward.program_restarts};
}

static program_kind env_kind(const rf_recipe *r) {
    return (program_kind){"env", "env.programs", "env.program_restarts", "RLFLOW_ENV", "env_program",
                          r->env.endpoint, r->env.curve_secret, "env.curve_secret", &r->env.programs,
                          r->env.program_restarts};
}

/* The keys the programs rlflow starts connect with (docs/reward-api.md and docs/env-api.md,
 * "Programs started by rlflow"): with no endpoint in the recipe, a server key pair and a client
 * key pair made for the run (only those programs can connect); with an endpoint and CURVE key
 * files, a client key pair added to the allowed list; with a plain endpoint, none. */
typedef struct program_keys {
    int curve;                             /* the programs use CURVE */
    rf_curve_key server_pub, server_secret; /* server_secret only for keys made for the run */
    rf_curve_key client_pub, client_secret;
} program_keys;

static rf_status make_program_keys(const program_kind *pk, program_keys *k) {
    memset(k, 0, sizeof *k);
    if (pk->endpoint[0] && !pk->secret_file[0]) return RF_OK;
    rf_status st = rf_curve_keypair(k->client_pub, k->client_secret);
    if (st == RF_ERR_UNSUPPORTED && !pk->endpoint[0]) { /* libzmq without CURVE: plain loopback */
        rf_log_warn("%s: libzmq has no CURVE: the %s programs' loopback endpoint is not authenticated", pk->label,
                    pk->label);
        return RF_OK;
    }
    RF_TRY(st);
    if (pk->endpoint[0]) { /* the server's public key from its secret key file */
        rf_curve_key secret;
        st = rf_curve_read_key(pk->secret_file, 1, secret);
        if (st == RF_OK) st = rf_curve_public(secret, k->server_pub);
        memset(secret, 0, sizeof secret);
        if (st != RF_OK) return rf_error_wrap(st, "%s", pk->secret_key);
    } else {
        RF_TRY(rf_curve_keypair(k->server_pub, k->server_secret));
    }
    k->curve = 1;
    return RF_OK;
}

/* The endpoint a program on this machine connects to: a wildcard host becomes loopback. */
static void connect_endpoint(const char *bound, char *out, size_t cap) {
    static const char *const wild[] = {"tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"};
    for (int i = 0; i < 3; i++)
        if (strncmp(bound, wild[i], strlen(wild[i])) == 0) {
            snprintf(out, cap, "tcp://127.0.0.1:%s", bound + strlen(wild[i]));
            return;
        }
    snprintf(out, cap, "%s", bound);
}

static rf_status programs_tick(void *ctx) { return rf_programs_poll(*(rf_programs **)ctx); }

/* Starts pk's programs into *out with the endpoint bound (ep) and the keys in their environment
 * (<var>_ENDPOINT, _SERVER_KEY, _PUBLIC_KEY, _SECRET_KEY, RLFLOW_RUN_DIR; <var>_RANK). */
static rf_status start_programs(const rf_recipe *r, const program_kind *pk, const program_keys *k, const char *ep,
                                rf_programs **out) {
    char env_ep[700], env_srv[80], env_pub[80], env_sec[80], env_dir[4200], rank[64];
    snprintf(env_ep, sizeof env_ep, "%s_ENDPOINT=%s", pk->var, ep);
    snprintf(env_srv, sizeof env_srv, "%s_SERVER_KEY=%s", pk->var, k->curve ? k->server_pub : "");
    snprintf(env_pub, sizeof env_pub, "%s_PUBLIC_KEY=%s", pk->var, k->curve ? k->client_pub : "");
    snprintf(env_sec, sizeof env_sec, "%s_SECRET_KEY=%s", pk->var, k->curve ? k->client_secret : "");
    snprintf(env_dir, sizeof env_dir, "RLFLOW_RUN_DIR=%s", r->logging.dir);
    snprintf(rank, sizeof rank, "%s_RANK", pk->var);
    const char *env[] = {env_ep, env_srv, env_pub, env_sec, env_dir};
    int n = pk->argv->n;
    /* rf_str_list arrays are not NULL-terminated: each argv copied with its terminator */
    const char ***terminated = rf_calloc((size_t)n, sizeof *terminated);
    const char *const **argv = rf_calloc((size_t)n, sizeof *argv);
    rf_status st = terminated && argv ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) {
        const rf_str_list *a = &pk->argv->v[i];
        if (!(terminated[i] = rf_calloc((size_t)a->n + 1, sizeof **terminated))) st = rf_error(RF_ERR_NOMEM, "out of memory");
        for (int j = 0; terminated[i] && j < a->n; j++) terminated[i][j] = a->v[j];
        argv[i] = (const char *const *)terminated[i];
    }
    rf_programs_config pc = {.key = pk->key, .restarts_key = pk->restarts_key, .argv = argv, .n = n, .env = env,
                             .n_env = 5, .rank_var = rank, .log_dir = r->logging.dir, .log_prefix = pk->log_prefix,
                             .max_restarts = pk->restarts};
    if (st == RF_OK) st = rf_programs_start(out, &pc);
    for (int i = 0; terminated && i < n; i++) free(terminated[i]);
    free(terminated), free(argv);
    memset(env_sec, 0, sizeof env_sec);
    return st;
}

/* The error of programs that did not all connect: theirs when one failed, else how many came. */
static rf_status programs_missing(const program_kind *pk, rf_programs *p, rf_status st, int came, const char *ep,
                                  double timeout, const char *timeout_key, const char *log_dir) {
    if (st != RF_ERR_IO || rf_programs_failed(p)) return st;
    int n = pk->argv->n;
    return rf_error(RF_ERR_IO, "%s: %d of the %d program%s rlflow started connected to %s within %g s (%s); a "
                    "program's output is in %s/%s_<i>.log", pk->key, came, n, n == 1 ? "" : "s", ep, timeout,
                    timeout_key, log_dir, pk->log_prefix);
}

/* reward.programs: started with the bound endpoint and the keys in their environment, then
 * waited for (all of them) as a reward program started by hand is. */
static rf_status start_reward_programs(rf_run *run, const program_keys *k) {
    const rf_recipe *r = run->r;
    program_kind pk = reward_kind(r);
    char ep[600];
    connect_endpoint(rf_external_reward_endpoint(run->ext), ep, sizeof ep);
    RF_TRY(start_programs(r, &pk, k, ep, &run->programs));
    int n = pk.argv->n;
    rf_log_info("reward: waiting up to %.0f s for the %d reward program%s rlflow started to connect to %s",
                r->reward.external_timeout, n, n == 1 ? "" : "s", ep);
    rf_status st = rf_external_reward_wait(run->ext, n, r->reward.external_timeout);
    return programs_missing(&pk, run->programs, st, rf_external_reward_programs(run->ext), ep,
                            r->reward.external_timeout, "reward.external_timeout", r->logging.dir);
}

/* The reward-program bridge of reward.external and reward.programs. */
static rf_status open_external(rf_run *run) {
    const rf_recipe *r = run->r;
    program_kind pk = reward_kind(r);
    program_keys k;
    RF_TRY(make_program_keys(&pk, &k));
    const char *client_keys[1] = {k.client_pub};
    rf_external_reward_config xc = {.endpoint = r->reward.external[0] ? r->reward.external : "tcp://127.0.0.1:*",
                                     .timeout_s = r->reward.external_timeout,
                                     .curve_secret_file = r->reward.external_curve_secret,
                                     .curve_clients_file = r->reward.external_curve_clients,
                                     .insecure = r->reward.external_insecure,
                                     .curve_secret_key = k.server_secret[0] ? k.server_secret : NULL,
                                     .curve_client_keys = client_keys, .n_curve_client_keys = k.curve,
                                     .tick = programs_tick, .tick_ctx = &run->programs, .stop = rf_interrupt_signal,
                                     .weight = r->reward.external_weight};
    rf_status st = rf_external_reward_listen_with(&run->ext, &xc);
    memset(k.server_secret, 0, sizeof k.server_secret);
    if (st == RF_OK) st = start_reward_programs(run, &k);
    memset(k.client_secret, 0, sizeof k.client_secret);
    return st;
}

/* The environment bridge's tick: env.programs restarted, then the caller's (run->env_tick). */
static rf_status env_tick(void *ctx) {
    rf_run *run = ctx;
    RF_TRY(rf_programs_poll(run->env_programs));
    return run->env_tick ? run->env_tick(run->env_tick_ctx) : RF_OK;
}

rf_status rf__env_bridge_open(rf_run *run, rf_env_bridge **x) {
    const rf_recipe *r = run->r;
    program_kind pk = env_kind(r);
    int progs = r->env.programs.n > 0;
    program_keys k = {0};
    if (progs) RF_TRY(make_program_keys(&pk, &k));
    const char *client_keys[1] = {k.client_pub};
    rf_env_bridge_config c = {.endpoint = r->env.endpoint[0] ? r->env.endpoint : "tcp://127.0.0.1:*",
                              .timeout_s = r->env.timeout, .curve_secret_file = r->env.curve_secret,
                              .curve_clients_file = r->env.curve_clients, .insecure = r->env.insecure,
                              .curve_secret_key = k.server_secret[0] ? k.server_secret : NULL,
                              .curve_client_keys = client_keys, .n_curve_client_keys = k.curve,
                              .tick = env_tick, .tick_ctx = run, .stop = rf_interrupt_signal};
    rf_status st = rf_env_bridge_listen(x, &c);
    memset(k.server_secret, 0, sizeof k.server_secret);
    char ep[600];
    if (st == RF_OK) connect_endpoint(rf_env_bridge_endpoint(*x), ep, sizeof ep);
    if (st == RF_OK && progs) st = start_programs(r, &pk, &k, ep, &run->env_programs);
    memset(k.client_secret, 0, sizeof k.client_secret);
    int want = progs ? r->env.programs.n : 1;
    if (st == RF_OK)
        rf_log_info("env: waiting up to %.0f s for %d environment program%s%s on %s", r->env.timeout, want,
                    want == 1 ? "" : "s", progs ? " rlflow started" : "", ep);
    if (st == RF_OK) st = rf_env_bridge_wait(*x, want, r->env.timeout);
    if (st != RF_OK && progs && *x)
        st = programs_missing(&pk, run->env_programs, st, rf_env_bridge_programs(*x), ep, r->env.timeout,
                              "env.timeout", r->logging.dir);
    if (st != RF_OK) rf_env_bridge_close(*x), *x = NULL;
    return st;
}

rf_status rf__load_rewards(rf_run *run) {
    const rf_recipe *r = run->r;
    RF_TRY(rf__rules_init(r, &run->rules));
    /* runs of several processes: the training worker hosts the reward model, not the controller */
    if (r->reward.model[0] && !rf_recipe_multi_process(r))
        RF_TRY(rf_reward_model_open(&run->rm, r->reward.model, run->k));
    if (r->reward.programs.n > 0) {
        RF_TRY(open_external(run));
    } else if (r->reward.external[0]) {
        rf_log_info("reward: waiting up to %.0f s for a reward program on %s", r->reward.external_timeout,
                    r->reward.external);
        rf_external_reward_config xc = {.endpoint = r->reward.external, .timeout_s = r->reward.external_timeout,
                                         .curve_secret_file = r->reward.external_curve_secret,
                                         .curve_clients_file = r->reward.external_curve_clients,
                                         .insecure = r->reward.external_insecure,
                                         .weight = r->reward.external_weight};
        RF_TRY(rf_external_reward_open_with(&run->ext, &xc));
    }
    return rf__env_open(run);
}

/* A parallel layout on CUDA needs NCCL: refused naming the key in builds without it. */
static rf_status need_nccl(const rf_recipe *r, const char *key, int value, const char *what) {
    if (strcmp(r->model.device, "cuda") != 0 || rf_comm_nccl_built()) return RF_OK;
    char where[512];
    return rf_error(RF_ERR_UNSUPPORTED, "%s: %s = %d with model.device = \"cuda\" %s over NCCL, which this build "
                    "lacks (CMake found no nccl.h and libnccl: install NCCL and rebuild)",
                    rf_recipe_where(r, key, where, sizeof where), key, value, what);
}

/* Tensor parallelism of the training roles (with data parallelism or without). */
static rf_status reject_actor_tp(const rf_recipe *r) {
    int tp = r->placement.actor.tp;
    return tp == 1 ? RF_OK : need_nccl(r, "placement.actor.tp", tp, "computes the shards");
}

/* One tensor-parallel key (placement.actor.tp or placement.rollout.tp, value tp) against the
 * model's shape: the layout's rules (resharding/layout.h). */
static rf_status check_tp_key(const rf_recipe *r, const char *key, int tp, const rf_model_config *cfg,
                              const char *path_key, const char *path) {
    rf_layout l = {tp, 1, 0, NULL};
    if (tp <= 1 || rf_layout_check(&l, cfg, tp, "tensor-parallel layout") == RF_OK) return RF_OK;
    char where[512];
    rf_recipe_where(r, key, where, sizeof where);
    if (cfg->num_attention_heads % tp != 0)
        return rf_error(RF_ERR_ARG, "%s: %s = %d does not divide the %d attention heads of %s "
                        "\"%s\" (tensor parallelism splits whole heads)", where, key, tp, cfg->num_attention_heads,
                        path_key, path);
    return rf_error(RF_ERR_ARG, "%s: %s = %d is more than the vocabulary (%d) or the intermediate size "
                    "(%d) of %s \"%s\"", where, key, tp, cfg->vocab_size, cfg->intermediate_size, path_key, path);
}

rf_status rf__check_tp_model(const rf_recipe *r, const rf_model_config *cfg) {
    RF_TRY(check_tp_key(r, "placement.actor.tp", r->placement.actor.tp, cfg, "model.path", r->model.path));
    return check_tp_key(r, "placement.rollout.tp", r->placement.rollout.tp, cfg, "model.path", r->model.path);
}

/* The models on the actor's grid (RF_ROLE_*): adjectives in messages, their keys, their own
 * model's key. */
static const struct {
    const char *adj, *section, *path_key;
} k_roles[3] = {{"reference", "placement.reference", "reference.path"},
                {"critic", "placement.critic", "critic.path"},
                {"reward-model", "placement.reward", "reward.model"}};

static const char *role_path(const rf_recipe *r, int role) {
    return role == RF_ROLE_REWARD ? r->reward.model : role == RF_ROLE_CRITIC ? r->critic.path : r->reference.path;
}

/* A split role against its own model (reference.path, critic.path, reward.model, when set). */
static rf_status check_role_tp(const rf_recipe *r, int role) {
    int dp, tp;
    rf_recipe_role_layout(r, role, &dp, &tp);
    const char *own = role_path(r, role);
    if (tp <= 1 || !own[0]) return RF_OK;
    char p[4096], key[64];
    rf_model_config cfg;
    rf_path_join(p, sizeof p, own, "config.json");
    RF_TRY(rf_config_load(&cfg, p));
    snprintf(key, sizeof key, "%s.tp", k_roles[role].section);
    return check_tp_key(r, key, tp, &cfg, k_roles[role].path_key, own);
}

rf_status rf__check_tp_model_path(const rf_recipe *r) {
    if (r->placement.actor.tp <= 1 && r->placement.rollout.tp <= 1) return RF_OK;
    char p[4096];
    rf_model_config cfg;
    rf_path_join(p, sizeof p, r->model.path, "config.json");
    RF_TRY(rf_config_load(&cfg, p));
    RF_TRY(rf__check_tp_model(r, &cfg));
    RF_TRY(check_role_tp(r, RF_ROLE_CRITIC));
    RF_TRY(check_role_tp(r, RF_ROLE_REFERENCE));
    return check_role_tp(r, RF_ROLE_REWARD);
}

/* Tensor parallelism of generation. */
static rf_status reject_rollout_tp(const rf_recipe *r) {
    if (r->placement.rollout.tp == 1) return RF_OK;
    return need_nccl(r, "placement.rollout.tp", r->placement.rollout.tp, "computes each rollout worker's shards");
}

/* Parallel layouts this build does not carry out ([placement.actor], [placement.rollout]); a
 * parallel layout makes a colocated run one of several processes (rf_recipe_colocated_ranks). */
static rf_status reject_layouts(const rf_recipe *r) {
    RF_TRY(reject_actor_tp(r));
    /* the reference, the critic and the reward model: on the first dp of the actor's replicas,
     * split over the first tp ranks of each, tp dividing the actor's (1: whole) */
    int D = r->placement.actor.dp, T = r->placement.actor.tp;
    char why[256];
    for (int role = RF_ROLE_REFERENCE; role <= RF_ROLE_REWARD; role++) {
        int dp, tp;
        rf_recipe_role_layout(r, role, &dp, &tp);
        const char *name = rf_recipe_role_name(role);
        char key[64], where[512];
        snprintf(key, sizeof key, "%s.dp", k_roles[role].section);
        if (dp > D)
            return rf_error(RF_ERR_ARG, "%s: %s = %d is more than placement.actor.dp = %d (the %s is held by the first "
                            "%s of the actor's data-parallel replicas)", rf_recipe_where(r, key, where, sizeof where),
                            key, dp, D, name, key);
        snprintf(key, sizeof key, "%s.tp", k_roles[role].section);
        if (tp < 1 || T % tp != 0) {
            snprintf(why, sizeof why, "a %s tensor-parallel size that does not divide the actor's (placement.actor.tp "
                     "= %d): the %s's shards live on the first ranks of each replica", k_roles[role].adj, T, name);
            return rf_recipe_reject_unimplemented(r, key, why);
        }
    }
    RF_TRY(reject_rollout_tp(r));
    if (r->placement.actor.zero > 1)
        return rf_recipe_reject_unimplemented(r, "placement.actor.zero", "ZeRO stages 2 and 3; stage 1 shards the "
                                              "optimizer state");
    if (r->placement.actor.dp > 1) RF_TRY(need_nccl(r, "placement.actor.dp", r->placement.actor.dp, "reduces the gradients"));
    return RF_OK;
}

/* Options that parse but that this build does not carry out are refused, naming where they
 * were set. */
rf_status rf__reject_unimplemented(const rf_recipe *r) {
    if (strcmp(r->placement.mode, "split") != 0 && r->async.max_staleness != 0) {
        char where[512];
        return rf_error(RF_ERR_UNSUPPORTED, "%s: async.max_staleness = %d needs placement.mode = \"split\" (colocated roles alternate: generation and training cannot overlap)",
                        rf_recipe_where(r, "async.max_staleness", where, sizeof where), r->async.max_staleness);
    }
    if (strcmp(r->placement.device, r->model.device) != 0)
        return rf_error(RF_ERR_ARG, "placement.device (%s) and model.device (%s) differ",
                        r->placement.device, r->model.device);
    return reject_layouts(r);
}

/* The console columns of an RL step (a metric that is not set is skipped: clip in colocated
 * runs, staleness and buffer in split runs). */
static const rf_metrics_col k_console[] = {
    {"reward/mean", "reward", "%.3f", "reward/std", NULL},
    {"reward/accuracy", "acc", "%.3f", NULL, NULL},
    {"val/accuracy", "val", "%.3f", NULL, NULL},
    {"actor/kl_ref", "kl", "%.4f", NULL, NULL},
    {"actor/entropy", "ent", "%.3f", NULL, NULL},
    {"actor/clip_frac", "clip", "%.3f", NULL, NULL},
    {"actor/grad_norm", "gnorm", "%.3f", NULL, NULL},
    {"critic/value_loss", "vloss", "%.4f", NULL, NULL},
    {"response/length_mean", "len", "%.1f", NULL, NULL},
    {"async/staleness_mean", "stale", "%.2f", NULL, NULL},
    {"async/buffer_depth", "buf", "%.0f", NULL, NULL},
    {"perf/gen_tokens_per_s", "gen", "%.0f", NULL, " tok/s"},
    {"perf/train_tokens_per_s", "train", "%.0f", NULL, " tok/s"},
};

void rf__console(const rf_run *run) {
    char line[1024];
    rf_metrics_console_line(run->metrics, run->step, run->r->train.steps, rf_time_now() - run->t_start,
                            run->step - run->start_step, k_console,
                            (int)(sizeof k_console / sizeof k_console[0]), line, sizeof line);
    rf_log_info("%s", line);
}

void rf__write_run_status(const rf_recipe *r, rf_status st) {
    char p[4200];
    snprintf(p, sizeof p, "%s/run_status.json", r->logging.dir);
    cJSON *j = cJSON_CreateObject();
    /* stopped by SIGINT / SIGTERM with its checkpoint written (controller/interrupt.h) */
    int stopped = st != RF_OK && (rf_controller_interrupted() || rf_interrupt_signal());
    cJSON_AddStringToObject(j, "status", st == RF_OK ? "ok" : stopped ? "interrupted" : "error");
    cJSON_AddStringToObject(j, "message", st == RF_OK ? "" : rf_error_message());
    if (stopped) cJSON_AddNumberToObject(j, "signal", rf_interrupt_signal());
    char *text = cJSON_PrintUnformatted(j);
    if (text && rf_mkdirs(r->logging.dir) == RF_OK) rf_write_file_atomic(p, text, strlen(text));
    free(text);
    cJSON_Delete(j);
}

rf_status rf__open_logging(rf_run *run) {
    const rf_recipe *r = run->r;
    RF_TRY(rf_mkdirs(r->logging.dir));
    RF_TRY(rf_metrics_open(&run->metrics, r->logging.dir, r->logging.jsonl, r->logging.tensorboard));
    char p[4200];
    snprintf(p, sizeof p, "%s/recipe.toml", r->logging.dir);
    FILE *f = fopen(p, "w");
    if (!f) return rf_error(RF_ERR_IO, "%s: cannot write: %s", p, strerror(errno));
    rf_recipe_dump(r, f);
    if (fclose(f) != 0) return rf_error(RF_ERR_IO, "%s: write failed", p);
    return RF_OK;
}

rf_status rf__rollout_engine(const rf_recipe *r, int colocated, rf_model *m, rf_rollout_tp *g,
                             const rf_tokenizer *tok, rf_rollout **e) {
    double fraction = r->rollout.kv_memory_fraction > 0 ? r->rollout.kv_memory_fraction : colocated ? 0.5 : 0.9;
    int prompt = r->data.max_prompt_tokens;
    int gen = r->env.type[0] ? r->env.max_total_tokens : r->rollout.max_new_tokens; /* [env]: a whole episode */
    rf_rollout_opts o = {.block_size = r->rollout.kv_block_size, .n_blocks = r->rollout.kv_blocks,
                         .max_running = r->rollout.max_running, .tok = tok, .mem_fraction = fraction,
                         .max_seq_len = prompt > 0 ? prompt + gen : 0};
    rf_status st = g ? rf_rollout_tp_engine(g, &o, e) : rf_rollout_init(e, m, &o);
    if (st == RF_ERR_NOMEM && o.n_blocks == 0)
        return rf_error_wrap(st, "rollout.kv_blocks = 0 (sized from memory), rollout.kv_memory_fraction = %g%s: raise "
                             "it, lower rollout.max_running, data.max_prompt_tokens or rollout.max_new_tokens, or set "
                             "rollout.kv_blocks", fraction, r->rollout.kv_memory_fraction > 0 ? "" : " (its default)");
    if (st == RF_ERR_NOMEM)
        return rf_error_wrap(st, "rollout.kv_blocks = %d: lower it, or set 0 to size the pool from memory", o.n_blocks);
    return st;
}

rf_status rf__rollout_pause(const rf_recipe *r, rf_rollout *e, int worker) {
    if (!rf_recipe_free_kv_cache(r) || !rf_kv_pool_held(rf_rollout_pool(e))) return RF_OK;
    RF_TRY(rf_rollout_release_cache(e));
    rf_rollout_stats s;
    rf_rollout_get_stats(e, &s);
    if (s.cache_releases > 1) return RF_OK; /* logged the first time */
    char who[32] = "rollout";
    if (worker >= 0) snprintf(who, sizeof who, "rollout worker %d", worker);
    rf_log_info("%s: KV cache given back while generation pauses (rollout.free_kv_cache = \"%s\"): %.1f MB, "
                "allocated again when it resumes", who, r->rollout.free_kv_cache,
                (double)rf_kv_pool_bytes(rf_rollout_pool(e)) / (1 << 20));
    return RF_OK;
}

rf_status rf__rollout_resume(rf_rollout *e) {
    rf_status st = rf_rollout_acquire_cache(e);
    if (st != RF_OK)
        return rf_error_wrap(st, "rollout.free_kv_cache: the KV cache given back while generation paused does not fit "
                             "the device again beside what training holds on it: lower rollout.kv_memory_fraction or "
                             "set rollout.kv_blocks");
    return RF_OK;
}

rf_status rf__start_rollout(rf_run *run) {
    return rf__rollout_engine(run->r, 1, run->actor, NULL, run->tok, &run->engine);
}

void rf__run_set_end(rf_run *run, rf_status st) {
    char why[1200];
    snprintf(why, sizeof why, "the run stopped on an error: %s", rf_error_message());
    const char *reason = st == RF_OK ? RF_MSG_SHUTDOWN_DONE : rf_controller_interrupted() ? RF_MSG_SHUTDOWN_INTERRUPTED : why;
    rf_external_reward_set_end(run->ext, reason);
    if (run->env.set_end && run->env.ctx) run->env.set_end(run->env.ctx, reason);
}

void rf__run_free(rf_run *run) {
    rf_rollout_free(run->engine);
    rf_model_free(run->actor), rf_model_free(run->ref), rf_model_free(run->critic);
    rf_tokenizer_free(run->tok);
    rf_dataset_free(run->train), rf_dataset_free(run->val);
    rf_reward_rules_free(run->rules);
    rf_reward_model_close(run->rm);
    rf_external_reward_close(run->ext); /* its Shutdown lets the programs leave on their own */
    rf_programs_stop(run->programs);
    rf_env_close(&run->env);                /* the environment programs get Shutdown first */
    rf_programs_stop(run->env_programs);
    rf_metrics_close(run->metrics);
    free(run->eos);
}
