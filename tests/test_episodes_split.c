/* Multi-turn episodes in runs of several processes, the controller's book and the training
 * worker's unpacking (controller/episodes_split.h, actor/worker_common.c), without processes:
 *  - a GenerateRequest becomes episodes (reset by the built-in calculator: no first
 *    observation); EnvTurns are answered as the one-process driver answers them: a turn that
 *    ends in a tool call <calc>12*34</calc> gets the ids of "<result>408</result>" (tokenised
 *    once), a turn without one ends the episode;
 *  - the Sample of an episode becomes the training sample exactly: tokens = prompt, turn 0,
 *    observation, turn 1; loss mask 1..1 0..0 1..1; the rules score the last turn ("408": reward
 *    1, accuracy 1); the text is the whole response decoded;
 *  - what a rollout worker may not send is refused with the exact error naming it and the field:
 *    a loss mask of the wrong length or with a value other than 0/1, tokens that disagree with
 *    the turns, a turn for a request that is no episode, a turn out of order, a wrong `used`,
 *    a Sample before its episode ended;
 *  - a first observation that leaves no room for env.max_total_tokens within the model's
 *    positions fails the request's begin with the exact error naming who answered the reset
 *    (a program, the calculator) and the episode;
 *  - the training worker refuses a TrainSample whose loss_mask has the wrong length or a value
 *    other than 0/1 with the exact error, and copies a good one. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "actor/worker_internal.h"
#include "common/util.h"
#include "controller/episodes_split.h"
#include "controller/run_internal.h"
#include "env/calculator.h"
#include "model/byte_tokenizer.h"
#include "test_util.h"

#define WHO "rollout worker 'r' (rank 0)"

static rf_tokenizer *g_tok;

/* The error st must be code with exactly text. */
static void expect(rf_status st, rf_status code, const char *text) {
    CHECK(st == code);
    CHECK(strcmp(rf_error_message(), text) == 0);
    if (st != code || strcmp(rf_error_message(), text) != 0)
        fprintf(stderr, "  want %s \"%s\"\n  got  %s \"%s\"\n", rf_strerror(code), text, rf_strerror(st), rf_error_message());
}

typedef struct ids {
    int32_t *v;
    int n;
} ids;

static ids enc(const char *text) {
    ids x = {0};
    RF_ASSERT(rf_tokenizer_encode(g_tok, text, strlen(text), 0, &x.v, &x.n) == RF_OK);
    return x;
}

/* One ended turn of request 7. */
static Rlflow__EndedTurn turn(int index, int t, ids a, const char *text, const char *finish, int used) {
    Rlflow__EndedTurn e = RLFLOW__ENDED_TURN__INIT;
    e.request_id = 7, e.index = index, e.turn = t, e.ids = a.v, e.n_ids = (size_t)a.n;
    e.text = (char *)text, e.finish = (char *)finish, e.used = used;
    return e;
}

static rf_status send_turns(rf_split_eps *x, Rlflow__EndedTurn *t, int n, Rlflow__EnvObservations *reply) {
    Rlflow__EndedTurn *p[4];
    for (int k = 0; k < n; k++) p[k] = &t[k];
    Rlflow__EnvTurns m = RLFLOW__ENV_TURNS__INIT;
    m.n_turns = (size_t)n, m.turns = p;
    return rf_split_eps_turns(x, WHO, &m, reply);
}

/* A Sample of request 7 of n tokens with mask (n_mask values). */
static Rlflow__Sample sample(int index, const int32_t *tok, int n, uint8_t *mask, int n_mask, int prompt_len) {
    static float logp[64];
    static int64_t ver[64];
    Rlflow__Sample s = RLFLOW__SAMPLE__INIT;
    s.request_id = 7, s.index = index, s.tokens = (int32_t *)tok, s.n_tokens = (size_t)n;
    s.logprobs = logp, s.n_logprobs = (size_t)n, s.versions = ver, s.n_versions = (size_t)n;
    s.prompt_len = prompt_len, s.loss_mask = (ProtobufCBinaryData){(size_t)n_mask, mask};
    return s;
}

static void book(void) {
    const char *ov[] = {"env.type=calculator", "env.max_turns=3", "env.max_total_tokens=64", "rollout.max_new_tokens=16"};
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, NULL, ov, 4));
    rf_run run = {.r = &r, .tok = g_tok};
    CHECK_OK(rf__rules_init(&r, &run.rules));
    CHECK_OK(rf_calculator_env(&run.env));
    rf_split_eps *x;
    CHECK_OK(rf_split_eps_open(&x, &run));
    ids prompt = enc("12*34=");
    cJSON *extra = cJSON_CreateObject();
    rf_example ex = {.prompt_text = "12*34=", .prompt_ids = prompt.v, .n_prompt = prompt.n, .answer = "408", .extra = extra};
    Rlflow__GenerateRequest q = RLFLOW__GENERATE_REQUEST__INIT;
    q.request_id = 7, q.n = 2;
    CHECK_OK(rf_split_eps_begin(x, &q, &ex, 2, 0));
    CHECK(q.episode == 1 && q.n_first_observations == 0);

    /* turn 0: sample 0 calls the tool, sample 1 answers at once */
    ids call = enc("<calc>12*34</calc>"), ans = enc("408"), res = enc("<result>408</result>");
    Rlflow__EndedTurn t[2] = {turn(0, 0, call, "<calc>12*34", "stop", call.n), turn(1, 0, ans, "408", "eos", ans.n)};
    Rlflow__EnvObservations reply;
    CHECK_OK(send_turns(x, t, 2, &reply));
    CHECK(reply.n_answers == 2);
    CHECK(!reply.answers[0]->end && (int)reply.answers[0]->n_observation_ids == res.n &&
          memcmp(reply.answers[0]->observation_ids, res.v, sizeof(int32_t) * (size_t)res.n) == 0);
    CHECK(reply.answers[1]->end && reply.answers[1]->n_observation_ids == 0);
    rf_split_eps_reply_free(&reply);

    /* what may not come: a turn out of order, a wrong count, an unknown request, an early Sample */
    Rlflow__EndedTurn bad = turn(0, 0, ans, "408", "eos", call.n + res.n + ans.n);
    expect(send_turns(x, &bad, 1, &reply), RF_ERR_FORMAT,
           WHO " sent EnvTurns for request 7 sample 0: turn 0, the episode expects another turn");
    bad = turn(0, 1, ans, "408", "eos", call.n + ans.n);
    char want[512];
    snprintf(want, sizeof want, WHO " sent EnvTurns for request 7 sample 0 turn 1: %d ids and used %d (expected at "
             "least 1 id and used = %d, at most env.max_total_tokens = 64)", ans.n, call.n + ans.n, call.n + res.n + ans.n);
    expect(send_turns(x, &bad, 1, &reply), RF_ERR_FORMAT, want);
    bad = turn(0, 1, ans, "408", "eos", call.n + res.n + ans.n);
    bad.request_id = 9;
    expect(send_turns(x, &bad, 1, &reply), RF_ERR_FORMAT,
           WHO " sent EnvTurns for request 9, which is not an outstanding episode");
    int32_t traj[64];
    uint8_t mask[64];
    int n = 0;
    for (int k = 0; k < call.n; k++) traj[n] = call.v[k], mask[n++] = 1;
    for (int k = 0; k < res.n; k++) traj[n] = res.v[k], mask[n++] = 0;
    for (int k = 0; k < ans.n; k++) traj[n] = ans.v[k], mask[n++] = 1;
    rf_train_sample s = {0};
    Rlflow__Sample m = sample(0, traj, n, mask, n, prompt.n);
    expect(rf_split_eps_sample(x, WHO, &m, &ex, &s), RF_ERR_FORMAT,
           WHO " sent the Sample of request 7 sample 0 before its episode ended");

    /* turn 1 of sample 0: the answer ends it */
    Rlflow__EndedTurn t1 = turn(0, 1, ans, "408", "eos", n);
    CHECK_OK(send_turns(x, &t1, 1, &reply));
    CHECK(reply.n_answers == 1 && reply.answers[0]->end);
    rf_split_eps_reply_free(&reply);

    /* malformed Samples */
    m = sample(0, traj, n, mask, n - 1, prompt.n);
    snprintf(want, sizeof want, WHO " sent a malformed Sample for request 7: loss_mask has %d values for %d tokens", n - 1, n);
    expect(rf_split_eps_sample(x, WHO, &m, &ex, &s), RF_ERR_FORMAT, want);
    mask[2] = 2;
    m = sample(0, traj, n, mask, n, prompt.n);
    expect(rf_split_eps_sample(x, WHO, &m, &ex, &s), RF_ERR_FORMAT,
           WHO " sent a malformed Sample for request 7: loss_mask[2] = 2 (0 or 1)");
    mask[2] = 1;
    mask[call.n] = 1; /* an observation token in the loss */
    m = sample(0, traj, n, mask, n, prompt.n);
    snprintf(want, sizeof want, WHO " sent a malformed Sample for request 7: %d tokens, %d in loss_mask; its 2 turns "
             "generated %d of %d tokens", n, call.n + ans.n + 1, call.n + ans.n, n);
    expect(rf_split_eps_sample(x, WHO, &m, &ex, &s), RF_ERR_FORMAT, want);
    mask[call.n] = 0;
    traj[1] ^= 1; /* turn 0's tokens changed */
    m = sample(0, traj, n, mask, n, prompt.n);
    snprintf(want, sizeof want, WHO " sent a malformed Sample for request 7: tokens or loss_mask disagree with turn 0 "
             "(%d ids ending at token %d of %d)", call.n, call.n - 1, n);
    expect(rf_split_eps_sample(x, WHO, &m, &ex, &s), RF_ERR_FORMAT, want);
    traj[1] ^= 1;
    m = sample(0, traj, n, mask, n, prompt.n + 1);
    snprintf(want, sizeof want, WHO " sent a malformed Sample for request 7: prompt_len %d, the prompt and first "
             "observation are %d tokens", prompt.n + 1, prompt.n);
    expect(rf_split_eps_sample(x, WHO, &m, &ex, &s), RF_ERR_FORMAT, want);

    /* the good one */
    m = sample(0, traj, n, mask, n, prompt.n);
    CHECK_OK(rf_split_eps_sample(x, WHO, &m, &ex, &s));
    CHECK(s.n_prompt == prompt.n && s.n_resp == n);
    CHECK(memcmp(s.tokens, prompt.v, sizeof(int32_t) * (size_t)prompt.n) == 0);
    CHECK(memcmp(s.tokens + prompt.n, traj, sizeof(int32_t) * (size_t)n) == 0);
    CHECK(s.loss_mask && memcmp(s.loss_mask, mask, (size_t)n) == 0);
    CHECK(s.reward == 1.0f && s.accuracy == 1.0f && !s.token_rewards);
    CHECK(s.text && strcmp(s.text, "<calc>12*34</calc><result>408</result>408") == 0);
    CHECK(strcmp(rf_split_eps_last_text(x, 7, 0), "408") == 0);
    rf_train_sample_free(&s);
    rf_split_eps_forget(x, 7);
    CHECK(strcmp(rf_split_eps_last_text(x, 7, 0), "") == 0);
    free(prompt.v), free(call.v), free(ans.v), free(res.v);
    rf_split_eps_close(x);
    rf_env_close(&run.env);
    rf_reward_rules_free(run.rules);
    rf_recipe_free(&r);
    cJSON_Delete(extra);
}

/* A reset answering an observation of 60 letters (60 tokens), as a program would. */
static rf_status long_reset(void *ctx, const rf_env_call *c, int n, rf_env_reply *out) {
    (void)ctx, (void)c;
    static char obs[61];
    memset(obs, 'x', 60);
    for (int i = 0; i < n; i++)
        out[i] = (rf_env_reply){obs, 0.0f, 0, "", "environment program 'long' (rank 0, pid 7) on tcp://127.0.0.1:5558"};
    return RF_OK;
}

/* With the model's positions known, a first observation that leaves no room for
 * env.max_total_tokens fails rf_split_eps_begin, before the request goes to a rollout worker,
 * with the exact error naming who answered it (a program, the calculator) and the episode;
 * one position more fits. */
static void first_too_long(void) {
    const char *ov[] = {"env.type=calculator", "env.max_total_tokens=64", "rollout.max_new_tokens=16"};
    rf_recipe r;
    CHECK_OK(rf_recipe_load(&r, NULL, ov, 3));
    rf_run run = {.r = &r, .tok = g_tok, .env = {NULL, long_reset, NULL, NULL, NULL}};
    rf_split_eps *x;
    CHECK_OK(rf_split_eps_open(&x, &run));
    rf_split_eps_set_positions(x, 2048);
    ids prompt = enc("12*34=");
    cJSON *extra = cJSON_CreateObject();
    rf_example ex = {.prompt_text = "12*34=", .prompt_ids = prompt.v, .n_prompt = prompt.n, .extra = extra};
    Rlflow__GenerateRequest q = RLFLOW__GENERATE_REQUEST__INIT;
    q.request_id = 7, q.n = 2;
    CHECK_OK(rf_split_eps_begin(x, &q, &ex, 2, 0));
    CHECK(q.n_first_observations == 2);
    rf_split_eps_forget(x, 7);
    rf_split_eps_set_positions(x, 129);
    expect(rf_split_eps_begin(x, &q, &ex, 2, 0), RF_ERR_RANGE, "episodes: the first observation of episode 0 (sample 0 "
           "of group 0) from environment program 'long' (rank 0, pid 7) on tcp://127.0.0.1:5558: the prompt (6 tokens) + "
           "the observation (60 tokens) + env.max_total_tokens (64) exceed the model's 129 positions");
    rf_split_eps_forget(x, 7);
    rf_split_eps_set_positions(x, 69); /* the calculator answers "": the prompt alone leaves no room */
    CHECK_OK(rf_calculator_env(&run.env));
    expect(rf_split_eps_begin(x, &q, &ex, 2, 0), RF_ERR_RANGE, "episodes: the first observation of episode 0 (sample 0 "
           "of group 0) from the built-in calculator: the prompt (6 tokens) + the observation (0 tokens) + "
           "env.max_total_tokens (64) exceed the model's 69 positions");
    rf_split_eps_forget(x, 7);
    rf_split_eps_set_positions(x, 70);
    CHECK_OK(rf_split_eps_begin(x, &q, &ex, 2, 0));
    free(prompt.v);
    rf_split_eps_close(x);
    rf_env_close(&run.env);
    rf_recipe_free(&r);
    cJSON_Delete(extra);
}

/* The training worker's side: TrainSample.loss_mask and versions checked and copied. */
static void unpack(void) {
    int32_t tok[6] = {1, 2, 3, 4, 5, 6};
    uint8_t mask[4] = {1, 0, 7, 1};
    Rlflow__TrainSample t = RLFLOW__TRAIN_SAMPLE__INIT, *tp = &t;
    t.tokens = tok, t.n_tokens = 6, t.n_prompt = 2;
    t.loss_mask = (ProtobufCBinaryData){3, mask};
    rf_train_sample *s = NULL;
    expect(rf__worker_unpack(&tp, 1, &s), RF_ERR_FORMAT, "sample 0: loss_mask has 3 values for 4 response tokens");
    t.loss_mask.len = 4;
    expect(rf__worker_unpack(&tp, 1, &s), RF_ERR_FORMAT, "sample 0: loss_mask[2] = 7 (0 or 1)");
    mask[2] = 0;
    CHECK_OK(rf__worker_unpack(&tp, 1, &s));
    CHECK(s && s[0].loss_mask && memcmp(s[0].loss_mask, mask, 4) == 0);
    rf__worker_samples_free(s, 1);
    t.loss_mask.len = 0; /* none: every token in the loss */
    CHECK_OK(rf__worker_unpack(&tp, 1, &s));
    CHECK(s && !s[0].loss_mask);
    rf__worker_samples_free(s, 1);
    /* the tokens' versions (actor/logprob_mismatch_* counts the tokens of the version trained) */
    int64_t vers[4] = {3, 3, 4, 4};
    t.versions = vers, t.n_versions = 3;
    expect(rf__worker_unpack(&tp, 1, &s), RF_ERR_FORMAT, "sample 0: 3 versions for 4 response tokens");
    t.n_versions = 4, vers[1] = -1;
    expect(rf__worker_unpack(&tp, 1, &s), RF_ERR_FORMAT, "sample 0: versions[1] = -1 (0 .. 2^31-1)");
    vers[1] = 3;
    CHECK_OK(rf__worker_unpack(&tp, 1, &s));
    CHECK(s && s[0].versions[0] == 3 && s[0].versions[1] == 3 && s[0].versions[2] == 4 && s[0].versions[3] == 4);
    rf__worker_samples_free(s, 1);
}

int main(void) {
    char dir[] = "/tmp/rf_test_episodes_split_XXXXXX";
    RF_ASSERT(mkdtemp(dir));
    CHECK_OK(rf_byte_tokenizer_write(dir));
    CHECK_OK(rf_tokenizer_load_dir(&g_tok, dir));
    book();
    first_too_long();
    unpack();
    rf_tokenizer_free(g_tok);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return rf_test_finish("test_episodes_split");
}
