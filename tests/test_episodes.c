/* Multi-turn episodes: the rollout engine's turns (rf_rollout_continue / rf_rollout_end) and the
 * episode driver (controller/episodes.h) with environments in process and over the message API.
 *  - engine: a turn's tokens and log-probs are rf_generate's (greedy) from the prompt; after an
 *    observation, the next turn's are rf_generate's from prompt + turn + observation (tokens
 *    exact, log-probs within 1e-4: the prefix comes from the cache, not a fresh prefill); only
 *    the observation is prefilled (the prefix stays in the KV cache, its blocks held between
 *    turns); the trajectory is exactly turn, observation, turn with mask 1..1 0..0 1..1; each
 *    token keeps the version current when it was sampled (a version change mid-turn shows), an
 *    observation token the version of the token before it; the same when the continued
 *    episode finds the running batch full (recomputed on admission); errors name the case;
 *  - driver, in process: ids are exactly the turns' ids and the observations' ids (tokenised
 *    once) in order, mask and per-token versions exact (the environment bumps the version at
 *    each call), each turn's reward at its last generated token, max_turns and max_total_tokens
 *    end an episode as truncated (the last step says `last`);
 *  - driver over the bridge with the scripted C program (examples/env/env_script.c): the same
 *    episodes as the in-process environment with the same rules, bit for bit, and again when a
 *    second program dies, hangs, sends garbage or replies out of order mid-episode (its requests
 *    re-sent: nothing lost, nothing doubled);
 *  - a reset whose first observation leaves no room for max_total_tokens within the model's
 *    positions fails the run with the exact error naming who answered it (the in-process
 *    environment, the program over the bridge) and the episode.
 * The bridge part is skipped without RF_ENV_SCRIPT. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "controller/episodes.h"
#include "env/bridge.h"
#include "model/byte_tokenizer.h"
#include "model/generate.h"
#include "spawn_util.h"
#include "test_util.h"

static rf_model *g_m;
static rf_tokenizer *g_tok;

static rf_model *tiny_model(void) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", RF_BYTE_TOKENIZER_VOCAB) == RF_OK);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, 4, 0.5f);
    return m;
}

/* ---- engine ------------------------------------------------------------------------------ */

typedef struct got {
    int n_calls, turn_end, turn, turn_start, n;
    int32_t tokens[64];
    float logp[64];
    int versions[64];
    uint8_t mask[64];
    uint64_t req[8];
    int index[8];
} got;

static void collect(void *ctx, const rf_rollout_sample *s) {
    got *g = ctx;
    g->req[g->n_calls % 8] = s->request_id, g->index[g->n_calls % 8] = s->index;
    g->n_calls++;
    g->turn_end = s->turn_end, g->turn = s->turn, g->turn_start = s->turn_start, g->n = s->n_tokens;
    memcpy(g->tokens, s->tokens, sizeof(int32_t) * (size_t)s->n_tokens);
    memcpy(g->logp, s->logprobs, sizeof(float) * (size_t)s->n_tokens);
    memcpy(g->versions, s->versions, sizeof(int) * (size_t)s->n_tokens);
    if (s->mask) memcpy(g->mask, s->mask, (size_t)s->n_tokens);
}

static const int32_t P[5] = {72, 101, 108, 108, 111};
static const int32_t OBS[3] = {60, 111, 62};
enum { TURN = 6 };

/* rf_generate, greedy, TURN tokens from prompt (n). */
static rf_gen_output reference(const int32_t *prompt, int n) {
    rf_gen_params gp = {.sampling = {1, 1.0f, 0, 1.0f}, .max_new_tokens = TURN, .seed = 1};
    rf_gen_output out = {0};
    const int32_t *ps[1] = {prompt};
    CHECK_OK(rf_generate(g_m, NULL, ps, &n, 1, &gp, &out, 0));
    return out;
}

static int close_to(const float *a, const float *b, int n, double tol) {
    for (int i = 0; i < n; i++)
        if (fabs((double)a[i] - b[i]) > tol) return 0;
    return 1;
}

static rf_rollout_request episode_req(void) {
    return (rf_rollout_request){.prompt = P, .prompt_len = 5, .n = 1, .sampling = {1, 1.0f, 0, 1.0f},
                                .max_new_tokens = TURN, .seed = 1, .episode = 1, .max_total_tokens = 40};
}

/* Turn 2 of the episode checked against the references; full = the whole trajectory. */
static void check_turn2(const got *g, const rf_gen_output *t1, int v_first, int v_rest) {
    rf_gen_output t2;
    int32_t pre[5 + TURN + 3];
    memcpy(pre, P, sizeof P), memcpy(pre + 5, t1->tokens, sizeof(int32_t) * TURN), memcpy(pre + 5 + TURN, OBS, sizeof OBS);
    t2 = reference(pre, 5 + TURN + 3);
    CHECK(g->turn_end == 1 && g->turn == 2 && g->turn_start == TURN + 3 && g->n == 2 * TURN + 3);
    CHECK(memcmp(g->tokens + TURN + 3, t2.tokens, sizeof(int32_t) * TURN) == 0);
    CHECK(close_to(g->logp + TURN + 3, t2.logprobs, TURN, 1e-4));
    CHECK(memcmp(g->tokens, t1->tokens, sizeof(int32_t) * TURN) == 0 && memcmp(g->tokens + TURN, OBS, sizeof OBS) == 0);
    int ok = 1;
    for (int t = 0; t < g->n; t++) {
        int obs = t >= TURN && t < TURN + 3;
        ok &= g->mask[t] == !obs;
        ok &= g->versions[t] == (t < TURN + 3 ? 2 : t == TURN + 3 ? v_first : v_rest);
        if (obs) ok &= g->logp[t] == 0.0f;
    }
    CHECK(ok);
    rf_gen_output_free(&t2);
}

static void engine_turns(void) {
    rf_rollout *e;
    rf_rollout_opts o = {.block_size = 4, .n_blocks = 64};
    CHECK_OK(rf_rollout_init(&e, g_m, &o));
    got g = {0};
    rf_rollout_set_callback(e, collect, &g);
    rf_rollout_set_version(e, 2);
    rf_rollout_request q = episode_req();
    uint64_t id;
    CHECK_OK(rf_rollout_submit(e, &q, NULL, &id));
    CHECK_OK(rf_rollout_run_until_idle(e));
    rf_gen_output t1 = reference(P, 5);
    CHECK(g.n_calls == 1 && g.turn_end == 1 && g.turn == 1 && g.turn_start == 0 && g.n == TURN);
    CHECK(memcmp(g.tokens, t1.tokens, sizeof(int32_t) * TURN) == 0 && memcmp(g.logp, t1.logprobs, sizeof(float) * TURN) == 0);
    CHECK(rf_rollout_waiting_turns(e) == 1 && rf_rollout_idle(e));
    CHECK(rf_kv_pool_used(rf_rollout_pool(e)) == 3); /* 5 + 5 cached positions: the blocks stay */
    CHECK_ERR(rf_rollout_release_cache(e), RF_ERR_ARG, "released while 1 episodes wait between turns");
    rf_rollout_stats a, b;
    rf_rollout_get_stats(e, &a);
    CHECK_ERR(rf_rollout_continue(e, id, 1, OBS, 3), RF_ERR_ARG, "sample 1 of request 0 is not waiting between turns");
    int32_t big[40] = {0}, bad[1] = {9999};
    CHECK_ERR(rf_rollout_continue(e, id, 0, big, 34), RF_ERR_RANGE, "an observation of 34 tokens after 6 leaves no "
              "room for a turn within max_total_tokens (40)");
    CHECK_ERR(rf_rollout_continue(e, id, 0, bad, 1), RF_ERR_RANGE, "observation token 9999 at position 0 is outside");
    CHECK_OK(rf_rollout_continue(e, id, 0, OBS, 3));
    rf_rollout_set_version(e, 3);
    CHECK_OK(rf_rollout_step(e)); /* the observation and the turn's first token */
    rf_rollout_set_version(e, 4);
    CHECK_OK(rf_rollout_run_until_idle(e));
    rf_rollout_get_stats(e, &b);
    CHECK(b.prefill_tokens - a.prefill_tokens == 3 && b.decode_tokens - a.decode_tokens == TURN);
    check_turn2(&g, &t1, 3, 4);
    CHECK_OK(rf_rollout_end(e, id, 0));
    CHECK(g.n_calls == 3 && g.turn_end == 0 && g.n == 2 * TURN + 3);
    CHECK(rf_kv_pool_used(rf_rollout_pool(e)) == 0 && rf_rollout_waiting_turns(e) == 0);
    CHECK_ERR(rf_rollout_end(e, id, 0), RF_ERR_ARG, "is not waiting between turns");
    rf_rollout_free(e);
    rf_gen_output_free(&t1);
    printf("engine: turn, observation (3 tokens prefilled, the prefix cached), turn: ids, mask, versions exact\n");
}

/* The continued episode finds the running batch full: its prefix is recomputed on admission
 * and the turn is the same. */
static void engine_turn_recomputed(void) {
    rf_rollout *e;
    rf_rollout_opts o = {.block_size = 4, .n_blocks = 64, .max_running = 1};
    CHECK_OK(rf_rollout_init(&e, g_m, &o));
    got g = {0};
    rf_rollout_set_callback(e, collect, &g);
    rf_rollout_set_version(e, 2);
    rf_rollout_request q = episode_req();
    uint64_t a, b;
    CHECK_OK(rf_rollout_submit(e, &q, NULL, &a));
    CHECK_OK(rf_rollout_run_until_idle(e));
    q.prompt = OBS, q.prompt_len = 3;
    CHECK_OK(rf_rollout_submit(e, &q, NULL, &b));
    CHECK_OK(rf_rollout_step(e)); /* b runs: the batch is full */
    CHECK_OK(rf_rollout_continue(e, a, 0, OBS, 3));
    rf_rollout_set_version(e, 3);
    CHECK_OK(rf_rollout_run_until_idle(e)); /* b's turn, then a's */
    CHECK(g.req[2] == a && g.turn == 2);
    rf_gen_output t1 = reference(P, 5);
    check_turn2(&g, &t1, 3, 3);
    CHECK_OK(rf_rollout_end(e, a, 0));
    CHECK_OK(rf_rollout_end(e, b, 0));
    CHECK(rf_kv_pool_used(rf_rollout_pool(e)) == 0);
    rf_rollout_free(e);
    rf_gen_output_free(&t1);
    printf("engine: an episode continued into a full batch is recomputed, same turn\n");
}

/* ---- driver --------------------------------------------------------------------------------- */

/* The scripted program's rules in process (env_script.c): observation "<o t>", reward
 * 0.5 (t + 1) + 0.01 n_action_ids, done after `turns`; records what it saw. */
typedef struct fake_env {
    int turns, calls;
    const char *first;     /* the reset's observation; NULL: "" */
    rf_rollout *bump;      /* set: the version becomes the number of calls made */
    char obs[64][16];
    int n_obs;
    int32_t actions[16][64];
    int n_action[16], last[16], n_steps;
    char last_action[256];
} fake_env;

static rf_status fake_call(void *ctx, const rf_env_call *c, int n, rf_env_reply *out) {
    fake_env *f = ctx;
    f->calls++;
    if (f->bump) rf_rollout_set_version(f->bump, f->calls);
    for (int i = 0; i < n; i++) {
        out[i] = (rf_env_reply){f->first ? f->first : "", 0.0f, 0, "", "the test's environment"};
        if (!c[i].is_step) continue;
        if (c[i].n_history != c[i].turn) return rf_error(RF_ERR_FORMAT, "history %d at turn %d", c[i].n_history, c[i].turn);
        char *o = f->obs[f->n_obs++ % 64];
        snprintf(o, 16, "<o%d>", c[i].turn);
        out[i] = (rf_env_reply){o, 0.5f * (float)(c[i].turn + 1) + 0.01f * (float)c[i].n_action_ids,
                                c[i].turn + 1 >= f->turns, "", "the test's environment"};
        if (f->n_steps < 16) {
            memcpy(f->actions[f->n_steps], c[i].action_ids, sizeof(int32_t) * (size_t)c[i].n_action_ids);
            f->n_action[f->n_steps] = c[i].n_action_ids, f->last[f->n_steps++] = c[i].last;
        }
        snprintf(f->last_action, sizeof f->last_action, "%s", c[i].action);
    }
    return RF_OK;
}

static rf_env fake(fake_env *f) { return (rf_env){f, fake_call, NULL, NULL, NULL}; }

static rf_reward_item g_ex[2];
static int32_t g_prompt2[4] = {49, 50, 42, 51};

static rf_rollout_request sampled_req(void) {
    static const int32_t eos[1] = {10};
    return (rf_rollout_request){.sampling = {0, 1.0f, 0, 1.0f}, .max_new_tokens = TURN, .stop_ids = eos,
                                .n_stop_ids = 1};
}

/* One episode, the environment bumping the version at each call: exact trajectory. */
static void driver_one_episode(int max_turns, int max_total) {
    rf_rollout *e;
    rf_rollout_opts o = {.block_size = 4, .n_blocks = 64, .tok = g_tok};
    CHECK_OK(rf_rollout_init(&e, g_m, &o));
    fake_env f = {.turns = 3, .bump = e};
    rf_env env = fake(&f);
    rf_episode_opts eo = {max_turns, max_total, g_tok};
    rf_rollout_request q = sampled_req();
    rf_episode ep;
    CHECK_OK(rf_episodes_run(e, &env, &eo, g_ex, 1, 1, &q, 77, 5, &ep));
    int want_turns = max_turns < 3 ? max_turns : 3, ok = f.n_steps == ep.turns;
    /* rebuild the trajectory from what the environment saw */
    int32_t want[128];
    int n = 0, end[16];
    uint8_t mask[128];
    int vers[128];
    for (int t = 0; ok && t < ep.turns; t++) {
        for (int k = 0; k < f.n_action[t]; k++) mask[n] = 1, vers[n] = t + 1, want[n++] = f.actions[t][k];
        end[t] = n - 1;
        if (t + 1 == ep.turns) break;
        int32_t *ids;
        int n_ids;
        char obs[16];
        snprintf(obs, sizeof obs, "<o%d>", t);
        CHECK_OK(rf_tokenizer_encode(g_tok, obs, strlen(obs), 0, &ids, &n_ids));
        for (int k = 0; k < n_ids; k++) mask[n] = 0, vers[n] = t + 1, want[n++] = ids[k];
        free(ids);
    }
    ok &= ep.n == n && memcmp(ep.ids, want, sizeof(int32_t) * (size_t)n) == 0;
    ok &= memcmp(ep.mask, mask, (size_t)n) == 0 && memcmp(ep.versions, vers, sizeof(int) * (size_t)n) == 0;
    double sum = 0;
    for (int t = 0; ok && t < ep.turns; t++) {
        float r = 0.5f * (float)(t + 1) + 0.01f * (float)f.n_action[t];
        ok &= ep.turn_rewards[end[t]] == r;
        sum += r;
    }
    int nonzero = 0;
    for (int k = 0; k < ep.n; k++) nonzero += ep.turn_rewards[k] != 0.0f;
    ok &= nonzero == ep.turns && ep.env_reward == sum;
    CHECK(ok);
    CHECK(ep.turns == want_turns || (max_total < 40 && ep.turns <= want_turns));
    CHECK(ep.n_prompt == 4 && memcmp(ep.prompt, g_prompt2, sizeof g_prompt2) == 0);
    CHECK(strcmp(ep.last_text, f.last_action) == 0);
    if (max_turns < 3) CHECK(ep.truncated == 1 && f.last[ep.turns - 1] == 1 && f.last[0] == 0);
    if (max_turns >= 3 && max_total >= 40) CHECK(ep.truncated == 0 && f.last[2] == 0);
    if (max_total < 40) CHECK(ep.truncated == 1 && ep.n <= max_total);
    printf("driver: %d turns (max_turns %d, max_total_tokens %d, truncated %d): ids, mask, versions, turn rewards exact\n",
           ep.turns, max_turns, max_total, ep.truncated);
    rf_episode_free(&ep);
    rf_rollout_free(e);
}

/* The error st must be code with exactly text. */
static void expect(rf_status st, rf_status code, const char *text) {
    CHECK(st == code && strcmp(rf_error_message(), text) == 0);
    if (st != code || strcmp(rf_error_message(), text) != 0)
        fprintf(stderr, "  want %s \"%s\"\n  got  %s \"%s\"\n", rf_strerror(code), text, rf_strerror(st), rf_error_message());
}

/* A first observation of n_x bytes 'x' (one token each): static, one at a time. */
static const char *long_first(int n_x) {
    static char s[4096];
    RF_ASSERT(n_x < (int)sizeof s);
    memset(s, 'x', (size_t)n_x), s[n_x] = '\0';
    return s;
}

/* Group 1's two episodes (7 and 8, prompt P) through env with max_total_tokens 40. */
static rf_status run_long_first(rf_env *env) {
    rf_rollout *e;
    rf_rollout_opts o = {.block_size = 4, .n_blocks = 64, .tok = g_tok};
    RF_TRY(rf_rollout_init(&e, g_m, &o));
    rf_episode_opts eo = {4, 40, g_tok};
    rf_rollout_request q = sampled_req();
    rf_episode out[2];
    rf_status st = rf_episodes_run(e, env, &eo, &g_ex[1], 1, 2, &q, 1, 7, out);
    for (int i = 0; st == RF_OK && i < 2; i++) rf_episode_free(&out[i]);
    rf_rollout_free(e);
    return st;
}

/* A reset whose first observation leaves no room for max_total_tokens within the model's
 * 2048 positions fails the run (not a rejection) with the exact error naming who answered it,
 * the episode and every count; one token less fits (rf_ep_check_room at the boundary). */
static void driver_first_too_long(void) {
    fake_env f = {.turns = 3, .first = long_first(2004)};
    rf_env env = fake(&f);
    expect(run_long_first(&env), RF_ERR_RANGE, "episodes: the first observation of episode 7 (sample 0 of group 1) "
           "from the test's environment: the prompt (5 tokens) + the observation (2004 tokens) + "
           "env.max_total_tokens (40) exceed the model's 2048 positions");
    CHECK(f.calls == 1); /* the reset only: nothing generated, no step */
    rf_ep ep = {.ex = g_ex[1], .id = 7, .first_from = (char *)"x"};
    CHECK_OK(rf_ep_check_room(&ep, 2003, 40, 2048));
    CHECK(rf_ep_check_room(&ep, 2004, 40, 2048) == RF_ERR_RANGE);
    CHECK_OK(rf_ep_check_room(&ep, 2004, 40, 0)); /* positions not known */
    printf("driver: a first observation too long fails the run naming the environment and the episode\n");
}

/* 2 groups x 2 samples through env (n_programs over the bridge, or in process). */
static rf_status run_four(rf_env *env, rf_episode *out) {
    rf_rollout *e;
    rf_rollout_opts o = {.block_size = 4, .n_blocks = 128, .tok = g_tok};
    RF_TRY(rf_rollout_init(&e, g_m, &o));
    rf_episode_opts eo = {4, 40, g_tok};
    rf_rollout_request q = sampled_req();
    rf_status st = rf_episodes_run(e, env, &eo, g_ex, 2, 2, &q, 1234, 0, out);
    rf_rollout_free(e);
    return st;
}

static int same_episodes(const rf_episode *a, const rf_episode *b, int n) {
    int ok = 1;
    for (int i = 0; i < n; i++) {
        ok &= a[i].n == b[i].n && a[i].turns == b[i].turns && a[i].n_prompt == b[i].n_prompt;
        if (!ok) return 0;
        ok &= memcmp(a[i].ids, b[i].ids, sizeof(int32_t) * (size_t)a[i].n) == 0;
        ok &= memcmp(a[i].logp, b[i].logp, sizeof(float) * (size_t)a[i].n) == 0;
        ok &= memcmp(a[i].versions, b[i].versions, sizeof(int) * (size_t)a[i].n) == 0;
        ok &= memcmp(a[i].mask, b[i].mask, (size_t)a[i].n) == 0;
        ok &= memcmp(a[i].turn_rewards, b[i].turn_rewards, sizeof(float) * (size_t)a[i].n) == 0;
    }
    return ok;
}

/* The same over the bridge: the error names the program that answered the reset. */
static void first_too_long_over_bridge(const char *script, const char *log_path) {
    rf_env_bridge *x = NULL;
    rf_env_bridge_config c = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 2};
    CHECK_OK(rf_env_bridge_listen(&x, &c));
    if (!x) return;
    char *argv[] = {(char *)script, "--connect", (char *)rf_env_bridge_endpoint(x), "--name", "long", "--first",
                    (char *)long_first(2004), NULL};
    pid_t p = rf_test_spawn(argv, log_path);
    CHECK_OK(rf_env_bridge_wait(x, 1, 10));
    rf_env env;
    rf_env_bridge_as_env(x, &env);
    char want[512];
    snprintf(want, sizeof want, "episodes: the first observation of episode 7 (sample 0 of group 1) from environment "
             "program 'long' (rank 0, pid %d) on %s: the prompt (5 tokens) + the observation (2004 tokens) + "
             "env.max_total_tokens (40) exceed the model's 2048 positions", (int)p, rf_env_bridge_endpoint(x));
    expect(run_long_first(&env), RF_ERR_RANGE, want);
    rf_env_stats s = env.take_stats(env.ctx);
    CHECK(s.accepted == 2 && s.rejected == 0); /* a failure of the run, not a rejection */
    rf_env_close(&env);
    CHECK(rf_test_wait(p, 5) == 0);
    printf("driver over the bridge: a first observation too long fails the run naming the program and the episode\n");
}

static void driver_over_bridge(const char *script) {
    fake_env f = {.turns = 3};
    rf_env in = fake(&f);
    rf_episode want[4], got4[4];
    CHECK_OK(run_four(&in, want));
    int multi = 0;
    for (int i = 0; i < 4; i++) multi += want[i].turns > 1;
    CHECK(multi >= 2); /* the case is worth having: several episodes take several turns */
    if (!script) {
        printf("skipped: the bridge part (RF_ENV_SCRIPT not set)\n");
        for (int i = 0; i < 4; i++) rf_episode_free(&want[i]);
        return;
    }
    char log_path[] = "/tmp/rf_episodes_XXXXXX";
    int fd = mkstemp(log_path);
    RF_ASSERT(fd >= 0);
    close(fd);
    first_too_long_over_bridge(script, log_path);
    static const char *modes[] = {NULL, "die", "silent", "garbage", "swap"}; /* mid-episode faults */
    for (int f = 0; f < 5; f++) {
        int faulty = f > 0, lost = f == 1 || f == 2, rejected = f == 3;
        rf_env_bridge *x = NULL;
        rf_env_bridge_config c = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 2};
        CHECK_OK(rf_env_bridge_listen(&x, &c));
        if (!x) break;
        char *good[] = {(char *)script, "--connect", (char *)rf_env_bridge_endpoint(x), "--name", "good", NULL};
        char *bad[] = {(char *)script, "--connect", (char *)rf_env_bridge_endpoint(x), "--name", "faulty", "--mode",
                       (char *)(faulty ? modes[f] : "ok"), "--after", "7", "--every", f == 4 ? "1" : "0",
                       "--capacity", "2", NULL};
        pid_t pb = faulty ? rf_test_spawn(bad, log_path) : -1;
        if (faulty) CHECK_OK(rf_env_bridge_wait(x, 1, 10));
        pid_t pg = rf_test_spawn(good, log_path);
        CHECK_OK(rf_env_bridge_wait(x, 1 + faulty, 10));
        rf_env env;
        rf_env_bridge_as_env(x, &env);
        rf_status st = run_four(&env, got4);
        CHECK_OK(st);
        rf_env_stats s = env.take_stats(env.ctx);
        int calls = 4;
        for (int i = 0; st == RF_OK && i < 4; i++) calls += got4[i].turns;
        CHECK(s.accepted == calls && s.rejected == rejected && s.lost == lost);
        if (s.accepted != calls || s.rejected != rejected || s.lost != lost)
            fprintf(stderr, "%s: accepted %d of %d, rejected %d, lost %d\n", faulty ? modes[f] : "clean", s.accepted,
                    calls, s.rejected, s.lost);
        if (st == RF_OK) CHECK(same_episodes(want, got4, 4));
        for (int i = 0; st == RF_OK && i < 4; i++) rf_episode_free(&got4[i]);
        rf_env_close(&env);
        CHECK(rf_test_wait(pg, 5) == 0);
        rf_test_kill(pb);
        printf("driver over the bridge%s%s: 4 episodes equal the in-process ones, %d requests answered once each\n",
               faulty ? ", a second program answering mid-episode: " : "", faulty ? modes[f] : "", calls);
    }
    if (rf_test_failed) {
        char *text = rf_test_slurp(log_path);
        fprintf(stderr, "programs said:\n%s\n", text);
        free(text);
    }
    unlink(log_path);
    for (int i = 0; i < 4; i++) rf_episode_free(&want[i]);
}

int main(void) {
    alarm(300);
    char dir[] = "/tmp/rf_episodes_tok_XXXXXX";
    RF_ASSERT(mkdtemp(dir));
    CHECK_OK(rf_byte_tokenizer_write(dir));
    CHECK_OK(rf_tokenizer_load_dir(&g_tok, dir));
    g_m = tiny_model();
    g_ex[0] = (rf_reward_item){"12*3", NULL, g_prompt2, 4, NULL, 0, "36", "", 0, 0};
    g_ex[1] = (rf_reward_item){"Hello", NULL, P, 5, NULL, 0, "", "", 0, 1};
    engine_turns();
    engine_turn_recomputed();
    driver_one_episode(4, 40);
    driver_one_episode(2, 40);
    driver_one_episode(4, 12);
    driver_first_too_long();
    const char *script = getenv("RF_ENV_SCRIPT");
    driver_over_bridge(script && access(script, X_OK) == 0 ? script : NULL);
    rf_model_free(g_m);
    rf_tokenizer_free(g_tok);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    return rf_test_finish("test_episodes");
}
