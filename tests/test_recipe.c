/* Recipes: defaults, values from a file, --set overrides (which win), every error message
 * with the position it names, validation of impossible values, rejection of unimplemented
 * options (the parallel layouts of [placement.actor] / [placement.rollout] among them), dump ->
 * reload giving the same recipe, and docs/recipes.md matching the schema.
 * `test_recipe --write-doc PATH` regenerates the reference page. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common/util.h"
#include "controller/recipe.h"
#include "controller/run_internal.h"
#include "test_util.h"

static char tmp_path[256];

/* Writes text to a fresh temporary recipe file, whose path is tmp_path. */
static const char *recipe_file(const char *text) {
    if (tmp_path[0]) unlink(tmp_path);
    snprintf(tmp_path, sizeof tmp_path, "/tmp/rf_recipe_XXXXXX");
    int fd = mkstemp(tmp_path);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (f) {
        fputs(text, f);
        fclose(f);
    }
    return tmp_path;
}

/* Expects loading `text` (with overrides) to fail with `code` and a message that contains
 * "TMPFILE" + needle when needle starts with ':', or needle itself otherwise. */
static void load_fails(const char *text, const char *const *ov, int n_ov, rf_status code,
                       const char *needle) {
    rf_recipe r;
    const char *path = text ? recipe_file(text) : NULL;
    char want[1024];
    snprintf(want, sizeof want, "%s%s", needle[0] == ':' ? path : "", needle);
    CHECK_ERR(rf_recipe_load(&r, path, ov, n_ov), code, want);
}

static void defaults(void) {
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, NULL, NULL, 0));
    CHECK(r.rollout.n == 8 && r.rollout.prompts_per_step == 16 && r.rollout.kv_blocks == 0 && r.rollout.kv_memory_fraction == 0);
    CHECK(strcmp(r.algorithm.name, "grpo") == 0 && strcmp(r.algorithm.kl_estimator, "k3") == 0);
    CHECK(r.train.lr == 1e-5 && r.train.eps == 1e-8 && r.train.beta2 == 0.999);
    CHECK(r.model.path && strcmp(r.model.path, "") == 0 && strcmp(r.model.device, "cpu") == 0);
    CHECK(strcmp(r.data.prompt_key, "prompt") == 0 && r.data.shuffle == 1);
    CHECK(r.reward.rules.n == 1 && strcmp(r.reward.rules.v[0], "numeric") == 0);
    CHECK(r.reward.weights.n == 0 && r.rollout.stop.n == 0);
    CHECK(strcmp(r.logging.dir, "runs/default") == 0 && r.checkpoint.keep == 2);
    CHECK(strcmp(r.placement.mode, "colocated") == 0 && r.async.max_staleness == 0);
    CHECK(strcmp(r.reference.enabled, "auto") == 0 && !rf_recipe_reference_enabled(&r));
    /* the KV cache goes back between phases in colocated runs on GPUs only, unless said */
    CHECK(strcmp(r.rollout.free_kv_cache, "auto") == 0 && !rf_recipe_free_kv_cache(&r));
    r.model.device = "cuda";
    CHECK(rf_recipe_free_kv_cache(&r));
    r.placement.mode = "split";
    CHECK(!rf_recipe_free_kv_cache(&r));
    r.rollout.free_kv_cache = "on";
    CHECK(rf_recipe_free_kv_cache(&r));
    r.placement.mode = "colocated", r.rollout.free_kv_cache = "off";
    CHECK(!rf_recipe_free_kv_cache(&r));
    char where[64];
    CHECK(strcmp(rf_recipe_where(&r, "train.lr", where, sizeof where), "(default)") == 0);
    rf_recipe_free(&r);
    rf_recipe_free(NULL);
}

static const char *FILE_TEXT =
    "# a recipe\n"
    "[model]\n"
    "path = \"models/tiny\"\n"
    "[algorithm]\n"
    "name = \"ppo\"\n"
    "kl_coef = 1   # an integer where a float is expected\n"
    "[rollout]\n"
    "stop = [\"</s>\", \"\\n\\n\"]\n"
    "[reward]\n"
    "rules = [\"numeric\", \"format\"]\n"
    "weights = [1, 0.5]\n"
    "[train]\n"
    "lr = 3e-4\n";

static void file_values_and_overrides(void) {
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, recipe_file(FILE_TEXT), NULL, 0));
    CHECK(strcmp(r.model.path, "models/tiny") == 0 && strcmp(r.algorithm.name, "ppo") == 0);
    CHECK(r.algorithm.kl_coef == 1.0 && rf_recipe_reference_enabled(&r));
    CHECK(r.rollout.stop.n == 2 && strcmp(r.rollout.stop.v[1], "\n\n") == 0);
    CHECK(r.reward.rules.n == 2 && r.reward.weights.n == 2 && r.reward.weights.v[1] == 0.5);
    char where[512], want[512];
    snprintf(want, sizeof want, "%s:5:1", tmp_path);
    CHECK(strcmp(rf_recipe_where(&r, "algorithm.name", where, sizeof where), want) == 0);
    rf_recipe_free(&r);

    const char *ov[] = {"model.path=models/x", "algorithm.kl_coef=0.05", "rollout.stop=[\"a\"]",
                        "data.shuffle=false", "train.lr=1e-3", "data.val=  spaced out  ",
                        "reference.enabled=false", "logging.dir=2024"};
    rf_error_clear();
    CHECK_OK(rf_recipe_load(&r, recipe_file(FILE_TEXT), ov, 8));
    /* unquoted strings read as strings leave no complaint behind */
    CHECK(rf_error_message()[0] == '\0');
    if (rf_error_message()[0]) fprintf(stderr, "left in the error buffer: %s\n", rf_error_message());
    CHECK(strcmp(r.logging.dir, "2024") == 0);
    CHECK(strcmp(r.model.path, "models/x") == 0 && r.algorithm.kl_coef == 0.05);
    CHECK(r.rollout.stop.n == 1 && strcmp(r.rollout.stop.v[0], "a") == 0);
    CHECK(r.data.shuffle == 0 && r.train.lr == 1e-3 && strcmp(r.algorithm.name, "ppo") == 0);
    CHECK(strcmp(r.data.val, "  spaced out  ") == 0 && !rf_recipe_reference_enabled(&r));
    CHECK(strcmp(rf_recipe_where(&r, "train.lr", where, sizeof where), "--set") == 0);
    rf_recipe_free(&r);
}

static void unknown_keys(void) {
    load_fails("[algorithm]\nkl_coeff = 0.1\n", NULL, 0, RF_ERR_ARG,
               ":2:1: unknown key \"algorithm.kl_coeff\" (did you mean \"algorithm.kl_coef\"?)");
    load_fails("[train]\nkl_coef = 0.1\n", NULL, 0, RF_ERR_ARG,
               ":2:1: unknown key \"train.kl_coef\" (did you mean \"algorithm.kl_coef\"?)");
    load_fails("steps = 3\n", NULL, 0, RF_ERR_ARG,
               ":1:1: unknown key \"steps\" (did you mean \"train.steps\"?)");
    load_fails("[rollout]\nzzzzzzzz = 1\n", NULL, 0, RF_ERR_ARG, ":2:1: unknown key \"rollout.zzzzzzzz\"");
    load_fails("\n[algorith]\nname = \"ppo\"\n", NULL, 0, RF_ERR_ARG,
               ":2:2: unknown section [algorith] (did you mean [algorithm]?)");
    load_fails("algorithm.kl.coef = 1\n", NULL, 0, RF_ERR_ARG, ":1:11: unknown key \"algorithm.kl\"");
    const char *ov[] = {"algorithm.kl_coeff=1"};
    load_fails(NULL, ov, 1, RF_ERR_ARG,
               "--set: unknown key \"algorithm.kl_coeff\" (did you mean \"algorithm.kl_coef\"?)");
    const char *bad[] = {"nonsense"};
    load_fails(NULL, bad, 1, RF_ERR_ARG, "--set nonsense: expected section.key=value");
}

static void wrong_types(void) {
    load_fails("[algorithm]\nkl_coef = \"big\"\n", NULL, 0, RF_ERR_ARG,
               ":2:11: algorithm.kl_coef: expected a float, got a string");
    load_fails("[rollout]\nn = 2.5\n", NULL, 0, RF_ERR_ARG,
               ":2:5: rollout.n: expected an integer, got a float");
    load_fails("[rollout]\nstop = \"x\"\n", NULL, 0, RF_ERR_ARG,
               ":2:8: rollout.stop: expected a string array, got a string");
    load_fails("[rollout]\nstop = [\"x\", 1]\n", NULL, 0, RF_ERR_ARG,
               ":2:14: rollout.stop: expected a string, got an integer");
    load_fails("[data]\nshuffle = 1\n", NULL, 0, RF_ERR_ARG,
               ":2:11: data.shuffle: expected a boolean, got an integer");
    load_fails("[rollout]\nn = 4294967296\n", NULL, 0, RF_ERR_ARG, ":2:5: rollout.n: 4294967296 is out of range");
    load_fails("[algorithm]\nname = \"grpoo\"\n", NULL, 0, RF_ERR_ARG,
               ":2:8: algorithm.name: \"grpoo\" is not allowed (allowed: \"ppo\", \"grpo\", "
               "\"dr_grpo\", \"rloo\", \"reinforce_pp\")");
    load_fails("[rollout]\nfree_kv_cache = true\n", NULL, 0, RF_ERR_ARG,
               ":2:17: rollout.free_kv_cache: expected a string, got a boolean");
    load_fails("[rollout]\nfree_kv_cache = \"yes\"\n", NULL, 0, RF_ERR_ARG,
               ":2:17: rollout.free_kv_cache: \"yes\" is not allowed (allowed: \"auto\", \"on\", \"off\")");
    load_fails("[reward]\nrules = [\"numeric\", \"vibes\"]\n", NULL, 0, RF_ERR_ARG,
               ":2:21: reward.rules: \"vibes\" is not allowed (allowed: \"numeric\", \"math\", "
               "\"exact\", \"countdown\", \"format\", \"length\", \"overlong\")");
    load_fails("[model]\npath = models/x\n", NULL, 0, RF_ERR_FORMAT,
               ":2:8: invalid value \"models/x\" (strings must be quoted)");
    const char *ov[] = {"algorithm.kl_coef=abc"};
    load_fails(NULL, ov, 1, RF_ERR_ARG, "--set: algorithm.kl_coef: expected a float, got a string");
    rf_recipe r;
    CHECK_ERR(rf_recipe_load(&r, "/nonexistent/recipe.toml", NULL, 0), RF_ERR_IO,
              "/nonexistent/recipe.toml");
}

static void impossible_values(void) {
    load_fails("[train]\nlr = -1\n", NULL, 0, RF_ERR_ARG, ":2:1: train.lr = -1.0: must be >= 0");
    load_fails("[rollout]\nn = 0\n", NULL, 0, RF_ERR_ARG, ":2:1: rollout.n = 0: must be >= 1");
    load_fails("[rollout]\ntop_p = 1.5\n", NULL, 0, RF_ERR_ARG,
               ":2:1: rollout.top_p = 1.5: must be in (0, 1]");
    load_fails("[rollout]\ntop_p = 0\n", NULL, 0, RF_ERR_ARG, "rollout.top_p = 0.0: must be in (0, 1]");
    load_fails("[algorithm]\nclip_low = -0.1\n", NULL, 0, RF_ERR_ARG,
               ":2:1: algorithm.clip_low = -0.1: must be >= 0");
    load_fails("[algorithm]\ndual_clip = 0.5\n", NULL, 0, RF_ERR_ARG,
               ":2:1: algorithm.dual_clip = 0.5: must be 0 (off) or > 1");
    load_fails("[reward]\nweights = [1, 2]\n", NULL, 0, RF_ERR_ARG,
               ":2:1: reward.weights = [1.0, 2.0]: needs one weight per rule");
    load_fails("[sft]\ntarget_accuracy = 1.5\n", NULL, 0, RF_ERR_ARG,
               ":2:1: sft.target_accuracy = 1.5: must be in [0, 1]");
    load_fails("[sft]\ncheck_every = 0\n", NULL, 0, RF_ERR_ARG, ":2:1: sft.check_every = 0: must be >= 1");
    const char *ov[] = {"rollout.n=0"};
    load_fails(NULL, ov, 1, RF_ERR_ARG, "--set: rollout.n = 0: must be >= 1");
    /* a projection named twice in lora.targets is a slip, not a second adapter */
    load_fails("[lora]\nenabled = true\ntargets = [\"q\", \"v\", \"q\"]\n", NULL, 0, RF_ERR_ARG,
               ":3:1: lora.targets = [\"q\", \"v\", \"q\"]: names \"q\" twice");
    const char *lt[] = {"lora.enabled=true", "lora.targets=[\"up\",\"up\"]"};
    load_fails(NULL, lt, 2, RF_ERR_ARG, "--set: lora.targets = [\"up\", \"up\"]: names \"up\" twice");
    /* rollout.stop: 8 stop strings fit a request (RF_MAX_STOP), 7 beside the calculator's own;
     * one more was dropped without a word */
    const char *st8[] = {"rollout.stop=[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\"]"};
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, NULL, st8, 1));
    rf_recipe_free(&r);
    load_fails("[rollout]\nstop = [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\"]\n", NULL, 0, RF_ERR_ARG,
               ":2:1: rollout.stop = [\"1\", \"2\", \"3\", \"4\", \"5\", \"6\", \"7\", \"8\", \"9\"]: holds 9 "
               "strings, at most 8 fit");
    const char *st8c[] = {st8[0], "env.type=calculator"};
    load_fails(NULL, st8c, 2, RF_ERR_ARG, "holds 8 strings, at most 7 fit (env.type = \"calculator\" adds \"</calc>\")");
    const char *st8l[] = {"rollout.stop=[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"</calc>\"]",
                          "env.type=calculator"};
    CHECK_OK(rf_recipe_load(&r, NULL, st8l, 2));
    rf_recipe_free(&r);
}

/* logging.val_every = N > 0 validates step 0 (before training), every N-th step and the last;
 * 0 validates nothing (it validated step 0 and the last once). */
static void val_schedule(void) {
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, NULL, NULL, 0));
    r.train.steps = 10;
    r.logging.val_every = 4;
    char due[16] = "";
    for (int s = 0; s <= 10; s++) due[s] = rf__val_due(&r, s) ? 'v' : '.';
    CHECK(strcmp(due, "v...v...v.v") == 0);
    r.logging.val_every = 0;
    for (int s = 0; s <= 10; s++) due[s] = rf__val_due(&r, s) ? 'v' : '.';
    CHECK(strcmp(due, "...........") == 0);
    rf_recipe_free(&r);
}

static void unimplemented_options(void) {
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, recipe_file("\n[placement]\n  mode = \"split\"\n"), NULL, 0));
    char want[512];
    snprintf(want, sizeof want, "%s:3:3: placement.mode = \"split\" is not implemented yet (one "
             "device pool only)", tmp_path);
    CHECK_ERR(rf_recipe_reject_unimplemented(&r, "placement.mode", "one device pool only"),
              RF_ERR_UNSUPPORTED, want);
    CHECK_ERR(rf_recipe_reject_unimplemented(&r, "placement.device", "x"), RF_ERR_UNSUPPORTED,
              "(default): placement.device = \"cpu\" is not implemented yet (x)");
    CHECK_ERR(rf_recipe_reject_unimplemented(&r, "placement.nope", "x"), RF_ERR_ARG, "placement.nope");
    rf_recipe_free(&r);
    const char *ov[] = {"algorithm.dynamic_sampling=true"};
    CHECK_OK(rf_recipe_load(&r, NULL, ov, 1));
    CHECK_ERR(rf_recipe_reject_unimplemented(&r, "algorithm.dynamic_sampling", "later"),
              RF_ERR_UNSUPPORTED, "--set: algorithm.dynamic_sampling = true is not implemented yet (later)");
    rf_recipe_free(&r);
}

/* [placement.actor] and [placement.rollout]: nested sections read from a file and by --set,
 * impossible values, and the layouts this build does not carry out refused naming the key and
 * where it was set (never ignored). */
static void parallel_layouts(void) {
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.actor]\ndp = 2\nzero = 1\n"),
                            NULL, 0));
    CHECK(r.placement.actor.dp == 2 && r.placement.actor.zero == 1 && r.placement.actor.tp == 1);
    CHECK(strcmp(r.placement.mode, "split") == 0 && r.placement.rollout.tp == 1);
    CHECK_OK(rf__reject_unimplemented(&r));
    rf_recipe_free(&r);
    const char *ov[] = {"placement.actor.dp=4", "placement.mode=split"};
    CHECK_OK(rf_recipe_load(&r, recipe_file("placement.actor.dp = 2\n"), ov, 2));
    CHECK(r.placement.actor.dp == 4);
    rf_recipe_free(&r);
    /* colocated with a parallel layout: one rollout rank on each training rank's device */
    struct { const char *text; int ranks; } colo[] = {
        {"[placement.actor]\ntp = 2\n", 2}, {"[placement.actor]\ntp = 2\ndp = 2\n", 4},
        {"[placement.actor]\ndp = 2\n", 2}, {"[placement.actor]\ndp = 4\n[placement.rollout]\ntp = 2\n", 2}};
    for (size_t i = 0; i < sizeof colo / sizeof colo[0]; i++) {
        CHECK_OK(rf_recipe_load(&r, recipe_file(colo[i].text), NULL, 0));
        CHECK(rf_recipe_colocated_ranks(&r) && rf_recipe_multi_process(&r) && r.placement.rollout_ranks == colo[i].ranks);
        CHECK_OK(rf__reject_unimplemented(&r));
        rf_recipe_free(&r);
    }
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"colocated\"\n"), NULL, 0));
    CHECK(!rf_recipe_colocated_ranks(&r) && !rf_recipe_multi_process(&r));
    rf_recipe_free(&r);
    load_fails("[placement.rollout]\ntp = 4\n", NULL, 0, RF_ERR_ARG,
               ":2:1: placement.rollout.tp = 4 does not divide the 1 training ranks (placement.actor.dp x "
               "placement.actor.tp) of a colocated run, whose rollout ranks are on their devices");
    load_fails("[placement]\nrollout_ranks = 1\n[placement.actor]\ndp = 2\n", NULL, 0, RF_ERR_ARG,
               ":2:1: placement.rollout_ranks = 1, but a colocated run has one rollout rank on each of its 2 training "
               "ranks' devices: 2 rollout workers of placement.rollout.tp = 1 ranks (leave it unset)");
    load_fails("[placement.actor]\ndpp = 2\n", NULL, 0, RF_ERR_ARG,
               ":2:1: unknown key \"placement.actor.dpp\" (did you mean \"placement.actor.dp\"?)");
    load_fails("[placement.actor]\ndp = 0\n", NULL, 0, RF_ERR_ARG, ":2:1: placement.actor.dp = 0: must be in [1, 1024]");
    load_fails("[placement.actor]\nzero = 1\n", NULL, 0, RF_ERR_ARG,
               ":2:1: placement.actor.zero = 1: shards the optimizer state across data-parallel ranks and needs placement.actor.dp > 1");
    struct { const char *text, *want; } refused[] = {
        {"[placement]\nmode = \"split\"\n[placement.actor]\ntp = 4\ndp = 2\n[placement.critic]\ntp = 3\n",
         ":7:1: placement.critic.tp = 3 is not implemented yet (a critic tensor-parallel size that does not divide the "
         "actor's (placement.actor.tp = 4): the critic's shards live on the first ranks of each replica)"},
        {"[placement]\nmode = \"split\"\n[placement.actor]\ntp = 2\n[placement.reference]\ntp = 4\n",
         ":6:1: placement.reference.tp = 4 is not implemented yet (a reference tensor-parallel size that does not divide "
         "the actor's (placement.actor.tp = 2): the reference's shards live on the first ranks of each replica)"},
        {"[placement]\nmode = \"split\"\n[placement.actor]\ntp = 2\ndp = 2\nzero = 2\n",
         ":6:1: placement.actor.zero = 2 is not implemented yet (ZeRO stages 2 and 3"},
        {"[placement.actor]\ndp = 2\nzero = 2\n", ":3:1: placement.actor.zero = 2 is not implemented yet (ZeRO stages 2 and 3"},
        {"[placement.reference]\ntp = 2\n", ":2:1: placement.reference.tp = 2 is not implemented yet (a reference "
         "tensor-parallel size that does not divide the actor's (placement.actor.tp = 1): the reference's shards live on "
         "the first ranks of each replica)"},
        {"[placement]\nmode = \"split\"\n[placement.actor]\ntp = 4\n[placement.reward]\ntp = 3\n",
         ":6:1: placement.reward.tp = 3 is not implemented yet (a reward-model tensor-parallel size that does not divide "
         "the actor's (placement.actor.tp = 4): the reward model's shards live on the first ranks of each replica)"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        CHECK_OK(rf_recipe_load(&r, recipe_file(refused[i].text), NULL, 0));
        char want[512], *tmp;
        snprintf(want, sizeof want, "%s%s", tmp_path, refused[i].want);
        while ((tmp = strstr(want, "TMP:")) != NULL) { /* a second position in the same file */
            char rest[512];
            snprintf(rest, sizeof rest, "%s", tmp + 3);
            snprintf(tmp, sizeof want - (size_t)(tmp - want), "%s%s", tmp_path, rest);
        }
        CHECK_ERR(rf__reject_unimplemented(&r), RF_ERR_UNSUPPORTED, want);
        rf_recipe_free(&r);
    }
    /* data and tensor parallelism on CUDA: over NCCL where the build has it, else refused saying
     * so, naming the key */
    struct { const char *layout, *want; } on_cuda[] = {
        {"[placement.actor]\ndp = 2\nzero = 1\n", ":7:1: placement.actor.dp = 2 with model.device = \"cuda\" reduces "
         "the gradients over NCCL, which this build lacks"},
        {"[placement.actor]\ntp = 2\n", ":7:1: placement.actor.tp = 2 with model.device = \"cuda\" computes the shards "
         "over NCCL, which this build lacks"},
        {"[placement.actor]\ndp = 2\ntp = 2\n", ":8:1: placement.actor.tp = 2 with model.device = \"cuda\" computes the "
         "shards over NCCL, which this build lacks"},
        {"[placement.rollout]\ntp = 2\n", ":7:1: placement.rollout.tp = 2 with model.device = \"cuda\" computes each "
         "rollout worker's shards over NCCL, which this build lacks"},
    };
    for (size_t i = 0; i < sizeof on_cuda / sizeof on_cuda[0]; i++) {
        char text[512], want[512];
        snprintf(text, sizeof text, "[model]\ndevice = \"cuda\"\n[placement]\nmode = \"split\"\ndevice = \"cuda\"\n%s",
                 on_cuda[i].layout);
        CHECK_OK(rf_recipe_load(&r, recipe_file(text), NULL, 0));
        if (rf_comm_nccl_built()) {
            CHECK_OK(rf__reject_unimplemented(&r));
        } else {
            snprintf(want, sizeof want, "%s%s", tmp_path, on_cuda[i].want);
            CHECK_ERR(rf__reject_unimplemented(&r), RF_ERR_UNSUPPORTED, want);
        }
        rf_recipe_free(&r);
    }
    /* a role on more replicas than the actor has: a wrong value, not a missing feature */
    struct { const char *text, *want; } too_many[] = {
        {"[placement]\nmode = \"split\"\n[placement.critic]\ndp = 2\n", ":4:1: placement.critic.dp = 2 is more than "
         "placement.actor.dp = 1 (the critic is held by the first placement.critic.dp of the actor's data-parallel replicas)"},
        {"[placement]\nmode = \"split\"\n[placement.actor]\ndp = 2\ntp = 2\n[placement.reference]\ndp = 3\n",
         ":7:1: placement.reference.dp = 3 is more than placement.actor.dp = 2 (the reference is held by the first "
         "placement.reference.dp of the actor's data-parallel replicas)"},
    };
    for (size_t i = 0; i < sizeof too_many / sizeof too_many[0]; i++) {
        CHECK_OK(rf_recipe_load(&r, recipe_file(too_many[i].text), NULL, 0));
        char want[512];
        snprintf(want, sizeof want, "%s%s", tmp_path, too_many[i].want);
        CHECK_ERR(rf__reject_unimplemented(&r), RF_ERR_ARG, want);
        rf_recipe_free(&r);
    }
    /* the critic and the reference on some of the actor's replicas (the first dp), the critic
     * on the first replica alone split over its tensor-parallel ranks */
    const char *fewer[] = {
        "[placement]\nmode = \"split\"\n[placement.actor]\ndp = 4\n[placement.critic]\ndp = 2\n[placement.reference]\ndp = 3\n",
        "[placement]\nmode = \"split\"\n[placement.actor]\ndp = 3\ntp = 2\n[placement.critic]\ndp = 2\n",
        "[placement]\nmode = \"split\"\n[placement.actor]\ndp = 2\ntp = 2\n[placement.critic]\ndp = 1\n",
    };
    for (size_t i = 0; i < sizeof fewer / sizeof fewer[0]; i++) {
        CHECK_OK(rf_recipe_load(&r, recipe_file(fewer[i]), NULL, 0));
        CHECK_OK(rf__reject_unimplemented(&r));
        rf_recipe_free(&r);
    }
    /* tensor and data parallelism together in a split run on the CPU, with ZeRO-1 */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.actor]\ntp = 2\ndp = 2\nzero = 1\n"),
                            NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    rf_recipe_free(&r);
    /* the critic's and reference's layouts: whole on the replicas' first ranks or split like the
     * actor (or over fewer of its ranks, below), the reference on the first replica or all;
     * zeros are the actor's */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.actor]\ndp = 2\ntp = 2\n"
                                            "[placement.critic]\ndp = 2\ntp = 1\n[placement.reference]\ndp = 1\n"), NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    int ldp, ltp;
    rf_recipe_role_layout(&r, 1, &ldp, &ltp);
    CHECK(ldp == 2 && ltp == 1);
    rf_recipe_role_layout(&r, 0, &ldp, &ltp);
    CHECK(ldp == 1 && ltp == 2);
    rf_recipe_free(&r);
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.actor]\ndp = 2\ntp = 2\n"
                                            "[placement.critic]\ntp = 2\n[placement.reference]\ndp = 2\ntp = 1\n"), NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    rf_recipe_role_layout(&r, 1, &ldp, &ltp);
    CHECK(ldp == 2 && ltp == 2);
    rf_recipe_role_layout(&r, 0, &ldp, &ltp);
    CHECK(ldp == 2 && ltp == 1);
    rf_recipe_free(&r);
    /* the critic on the first replica alone: whole there */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.actor]\ndp = 2\ntp = 2\n"
                                            "[placement.critic]\ndp = 1\ntp = 1\n"), NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    rf_recipe_free(&r);
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.actor]\ndp = 2\n"
                                            "[placement.critic]\ndp = 1\n"), NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    rf_recipe_free(&r);
    /* on the first ranks of each replica: a tp dividing the actor's */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.actor]\ntp = 4\n"
                                            "[placement.critic]\ntp = 2\n[placement.reference]\ntp = 1\n"), NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    rf_recipe_role_layout(&r, 1, &ldp, &ltp);
    CHECK(ldp == 1 && ltp == 2);
    rf_recipe_free(&r);
    /* placement.rollout.replicas is placement.rollout_ranks by another name */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.rollout]\nreplicas = 3\n"), NULL, 0));
    CHECK(r.placement.rollout_ranks == 3);
    char where[600];
    CHECK(strstr(rf_recipe_where(&r, "placement.rollout_ranks", where, sizeof where), ":4:1") != NULL);
    rf_recipe_free(&r);
    const char *rep[] = {"placement.rollout.replicas=2"};
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nrollout_ranks = 2\n"), rep, 1));
    CHECK(r.placement.rollout_ranks == 2);
    rf_recipe_free(&r);
    const char *rep3[] = {"placement.rollout.replicas=3"};
    char want_rep[1024];
    const char *path = recipe_file("[placement]\nrollout_ranks = 2\n");
    snprintf(want_rep, sizeof want_rep, "--set: placement.rollout.replicas = 3 and %s:2:1: placement.rollout_ranks = 2 "
             "name the same count (rollout workers) and differ", path);
    CHECK_ERR(rf_recipe_load(&r, path, rep3, 1), RF_ERR_ARG, want_rep);
    /* split runs on the CPU train with tp ranks; tp must divide the model's heads */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.actor]\ntp = 2\n"), NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    rf_model_config c;
    CHECK_OK(rf_config_preset(&c, "tiny", 100)); /* 4 attention heads */
    CHECK_OK(rf__check_tp_model(&r, &c));
    rf_recipe_free(&r);
    const char *ov3[] = {"placement.actor.tp=3"};
    CHECK_OK(rf_recipe_load(&r, recipe_file("[model]\npath = \"m\"\n[placement]\nmode = \"split\"\n"), ov3, 1));
    CHECK_OK(rf__reject_unimplemented(&r));
    CHECK_ERR(rf__check_tp_model(&r, &c), RF_ERR_ARG,
              "--set: placement.actor.tp = 3 does not divide the 4 attention heads of model.path \"m\" (tensor "
              "parallelism splits whole heads)");
    rf_recipe_free(&r);
    /* generation's tp: split runs on the CPU, with the same rules against the model */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[placement]\nmode = \"split\"\n[placement.rollout]\ntp = 4\n"), NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    CHECK_OK(rf__check_tp_model(&r, &c));
    rf_recipe_free(&r);
    const char *gpath = recipe_file("[model]\npath = \"m\"\n[placement]\nmode = \"split\"\n[placement.rollout]\ntp = 3\n");
    CHECK_OK(rf_recipe_load(&r, gpath, NULL, 0));
    CHECK_OK(rf__reject_unimplemented(&r));
    char want_g[1024];
    snprintf(want_g, sizeof want_g, "%s:6:1: placement.rollout.tp = 3 does not divide the 4 attention heads of model.path "
             "\"m\" (tensor parallelism splits whole heads)", gpath);
    CHECK_ERR(rf__check_tp_model(&r, &c), RF_ERR_ARG, want_g);
    rf_recipe_free(&r);
    load_fails("[placement.rollout]\ntp = 0\n", NULL, 0, RF_ERR_ARG, ":2:1: placement.rollout.tp = 0: must be in [1, 1024]");
}

/* The dump without its comment lines, into a new string. */
static char *dump_text(const rf_recipe *r) {
    char *s = NULL;
    size_t n = 0;
    FILE *m = open_memstream(&s, &n);
    CHECK_OK(rf_recipe_dump(r, m));
    fclose(m);
    char *o = s;
    for (char *line = strtok(s, "\n"), *w = s; line; line = strtok(NULL, "\n")) {
        if (line[0] == '#') continue;
        size_t len = strlen(line);
        memmove(w, line, len);
        w[len] = '\n';
        w += len + 1;
        *w = '\0';
    }
    return o;
}

/* The built-in task decides the default correctness rule; a rule that cannot check the task is
 * refused naming both keys; answer_regex and the new algorithm keys are checked at load. */
static void task_rules_and_new_keys(void) {
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, recipe_file("[data]\ntask = \"countdown\"\n"), NULL, 0));
    CHECK(r.reward.rules.n == 1 && strcmp(r.reward.rules.v[0], "countdown") == 0);
    rf_recipe_free(&r);
    const char *ov[] = {"data.task=countdown"};
    CHECK_OK(rf_recipe_load(&r, NULL, ov, 1)); /* --set chooses too */
    CHECK(r.reward.rules.n == 1 && strcmp(r.reward.rules.v[0], "countdown") == 0);
    rf_recipe_free(&r);
    CHECK_OK(rf_recipe_load(&r, recipe_file("[data]\ntask = \"countdown\"\n[reward]\nrules = [\"countdown\", \"format\"]\n"
                                            "format_regex = \"x\"\n"), NULL, 0));
    CHECK(r.reward.rules.n == 2 && strcmp(r.reward.rules.v[1], "format") == 0);
    rf_recipe_free(&r);
    CHECK_OK(rf_recipe_load(&r, recipe_file("[data]\ntask = \"arith\"\n"), NULL, 0));
    CHECK(r.reward.rules.n == 1 && strcmp(r.reward.rules.v[0], "numeric") == 0);
    CHECK(strcmp(r.algorithm.policy_loss, "clip") == 0 && strcmp(r.algorithm.rollout_correction, "none") == 0);
    CHECK(r.algorithm.rollout_is_low == 0.5 && r.algorithm.rollout_is_high == 2.0 && !r.reward.answer_regex[0]);
    rf_recipe_free(&r);
    const char *path = recipe_file("[data]\ntask = \"countdown\"\n[reward]\nrules = [\"numeric\"]\n");
    char want[1024];
    snprintf(want, sizeof want, "%s:4:1: reward.rules = [\"numeric\"]: \"numeric\" cannot check data.task = "
             "\"countdown\" (%s:2:1): it would reward the bare target number, not an expression that reaches "
             "it; use \"countdown\" (or leave reward.rules unset)", path, path);
    CHECK_ERR(rf_recipe_load(&r, path, NULL, 0), RF_ERR_ARG, want);
    load_fails("[data]\ntask = \"countdown\"\n[reward]\nrules = [\"format\", \"exact\"]\nformat_regex = \"x\"\n",
               NULL, 0, RF_ERR_ARG, "\"exact\" cannot check data.task = \"countdown\"");
    const char *ov2[] = {"reward.rules=[\"math\"]"};
    load_fails("[data]\ntask = \"countdown\"\n", ov2, 1, RF_ERR_ARG,
               "--set: reward.rules = [\"math\"]: \"math\" cannot check data.task = \"countdown\"");
    load_fails("[data]\ntask = \"arith\"\n[reward]\nrules = [\"countdown\"]\n", NULL, 0, RF_ERR_ARG,
               ":4:1: reward.rules = [\"countdown\"]: \"countdown\" cannot check data.task = \"arith\" (");
    load_fails("[reward]\nanswer_regex = \"<answer>(.*\"\n", NULL, 0, RF_ERR_ARG,
               ":2:1: reward.answer_regex \"<answer>(.*\": PCRE2 error at offset 11: missing closing parenthesis");
    load_fails("[algorithm]\npolicy_loss = \"ppo\"\n", NULL, 0, RF_ERR_ARG,
               ":2:15: algorithm.policy_loss: \"ppo\" is not allowed (allowed: \"clip\", \"gspo\", \"cispo\")");
    load_fails("[algorithm]\nrollout_correction = \"is\"\n", NULL, 0, RF_ERR_ARG,
               "(allowed: \"none\", \"tis\", \"mis-token\", \"mis-seq\")");
    load_fails("[algorithm]\nrollout_is_low = 1.0\nrollout_is_high = 1.0\n", NULL, 0, RF_ERR_ARG,
               ":2:1: algorithm.rollout_is_low = 1.0: must be below algorithm.rollout_is_high");
    load_fails("[algorithm]\nrollout_is_high = 0.9\n", NULL, 0, RF_ERR_ARG,
               ":2:1: algorithm.rollout_is_high = 0.9: must be >= 1");
}

static void dump_round_trip(void) {
    const char *ov[] = {"model.path=dir with \"quotes\" \\ and \xc3\xa9",
                        "rollout.stop=[\"\\n\", \"\\t\\u0001\", \"</s>\"]",
                        "train.lr=0.1", "train.eps=1e-12", "algorithm.kl_coef=3",
                        "algorithm.gamma=0.3333333333333333", "reward.weights=[0.1, 2]",
                        "reward.rules=[\"math\", \"length\"]", "data.chat_template=chatml",
                        "rollout.top_k=-0", "data.seed=-7", "placement.actor.dp=3"};
    rf_recipe a, b;
    CHECK_OK(rf_recipe_load(&a, NULL, ov, 12));
    char *path = (char *)recipe_file("");
    FILE *f = fopen(path, "w");
    CHECK_OK(rf_recipe_dump(&a, f));
    fclose(f);
    CHECK_OK(rf_recipe_load(&b, path, NULL, 0));
    CHECK(strcmp(b.model.path, "dir with \"quotes\" \\ and \xc3\xa9") == 0);
    CHECK(b.rollout.stop.n == 3 && strcmp(b.rollout.stop.v[1], "\t\x01") == 0);
    CHECK(b.algorithm.gamma == a.algorithm.gamma && b.train.eps == 1e-12 && b.data.seed == -7);
    CHECK(strcmp(b.data.chat_template, "chatml") == 0 && b.reward.weights.v[0] == 0.1);
    CHECK(b.placement.actor.dp == 3);
    char *ta = dump_text(&a), *tb = dump_text(&b);
    CHECK(strcmp(ta, tb) == 0);
    free(ta);
    free(tb);
    rf_recipe_free(&a);
    rf_recipe_free(&b);
}

static char *doc_text(void) {
    char *s = NULL;
    size_t n = 0;
    FILE *m = open_memstream(&s, &n);
    rf_recipe_doc_markdown(m);
    fclose(m);
    return s;
}

/* [env]: defaults, the calculator, and what cannot work refused naming the key. */
static void env_section(void) {
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, recipe_file("[env]\ntype = \"calculator\"\n"), NULL, 0));
    CHECK(strcmp(r.env.type, "calculator") == 0 && r.env.max_turns == 4 && r.env.max_total_tokens == 256 &&
          r.env.timeout == 30.0 && !r.env.endpoint[0] && !r.env.insecure);
    rf_recipe_free(&r);
    CHECK_OK(rf_recipe_load(&r, recipe_file("[env]\ntype = \"external\"\nendpoint = \"tcp://127.0.0.1:5558\"\n"),
                            NULL, 0));
    rf_recipe_free(&r);
    load_fails("[env]\nturns = 3\n", NULL, 0, RF_ERR_ARG, "unknown key \"env.turns\"");
    load_fails("[env]\ntype = \"gym\"\n", NULL, 0, RF_ERR_ARG,
               "env.type: \"gym\" is not allowed (allowed: \"\", \"calculator\", \"external\")");
    load_fails("[env]\ntype = \"external\"\n", NULL, 0, RF_ERR_ARG, "env.endpoint = \"\": is needed with env.type = "
               "\"external\" (or env.programs, which rlflow starts on an endpoint of its own)");
    load_fails("[env]\nendpoint = \"tcp://127.0.0.1:5558\"\n", NULL, 0, RF_ERR_ARG,
               "env.endpoint = \"tcp://127.0.0.1:5558\": is set but env.type is not \"external\"");
    load_fails("[env]\ntype = \"external\"\nendpoint = \"tcp://0.0.0.0:5558\"\n", NULL, 0, RF_ERR_ARG,
               "can be reached from other machines, and without CURVE");
    load_fails("[env]\ntype = \"calculator\"\nmax_total_tokens = 8\n[rollout]\nmax_new_tokens = 16\n", NULL, 0,
               RF_ERR_ARG, ":3:1: env.max_total_tokens = 8: must be >= rollout.max_new_tokens (a turn's limit)");
    load_fails("[env]\nmax_turns = 0\n", NULL, 0, RF_ERR_ARG, "env.max_turns = 0: must be in [1, 1000]");
    load_fails("[env]\ntimeout = 0.0\n", NULL, 0, RF_ERR_ARG, "env.timeout = 0.0: must be > 0");
    /* episodes run in every deployment (docs/env-api.md, "Episodes in split and multi-device runs") */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[env]\ntype = \"calculator\"\n[placement]\nmode = \"split\"\n"), NULL, 0));
    rf_recipe_free(&r);
    /* env.programs: rlflow starts them on an endpoint of its own (none needed), external only */
    CHECK_OK(rf_recipe_load(&r, recipe_file("[env]\ntype = \"external\"\nprograms = [[\"python3\", \"my_env.py\"]]\n"
                                            "program_restarts = 5\n"), NULL, 0));
    CHECK(r.env.programs.n == 1 && r.env.programs.v[0].n == 2 && strcmp(r.env.programs.v[0].v[1], "my_env.py") == 0 &&
          r.env.program_restarts == 5 && !r.env.endpoint[0]);
    rf_recipe_free(&r);
    load_fails("[env]\ntype = \"calculator\"\nprograms = [[\"python3\", \"my_env.py\"]]\n", NULL, 0, RF_ERR_ARG,
               "env.programs = [[\"python3\", \"my_env.py\"]]: needs env.type = \"external\" (environment programs "
               "answer the episodes)");
    load_fails("[env]\ntype = \"external\"\nprograms = [[]]\n", NULL, 0, RF_ERR_ARG, "env.programs[0]: is empty");
    load_fails("[env]\nprogram_restarts = -1\n", NULL, 0, RF_ERR_ARG, "env.program_restarts = -1: must be >= 0");
}

static void docs_are_current(void) {
    const char *src = getenv("RF_SOURCE_DIR");
    if (!src || !*src) {
        printf("note: RF_SOURCE_DIR not set; skipping the docs/recipes.md check\n");
        return;
    }
    char path[1024], *have = NULL;
    snprintf(path, sizeof path, "%s/docs/recipes.md", src);
    CHECK_OK(rf_read_file(path, &have, NULL));
    char *want = doc_text();
    int same = have && strcmp(have, want) == 0;
    CHECK(same);
    if (!same)
        fprintf(stderr, "%s is stale: regenerate with `test_recipe --write-doc %s`\n", path, path);
    free(have);
    free(want);
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--write-doc") == 0) {
        char *text = doc_text();
        rf_status st = rf_write_file_atomic(argv[2], text, strlen(text));
        free(text);
        if (st != RF_OK) fprintf(stderr, "%s\n", rf_error_message());
        return st == RF_OK ? 0 : 1;
    }
    defaults();
    file_values_and_overrides();
    unknown_keys();
    wrong_types();
    impossible_values();
    val_schedule();
    unimplemented_options();
    parallel_layouts();
    task_rules_and_new_keys();
    dump_round_trip();
    env_section();
    docs_are_current();
    if (tmp_path[0]) unlink(tmp_path);
    return rf_test_finish("test_recipe");
}
