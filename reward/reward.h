/* Rewards: built-in rule rewards (reward/rules.c, reward/math_answer.c) and reward-model
 * scoring (reward/reward_model.c). docs/rewards.md states every rule precisely.
 *
 * Rule rewards are pure functions of (response text, ground-truth string, sample metadata such
 * as the response's token count) returning a float, plus an optional short `info` string that
 * says why, for debugging and sample logs. They are combined into one scalar reward by an
 * rf_reward_rules object: a weighted sum of named rules, validated once at init and read-only
 * afterwards, so any number of threads may score with one object at the same time.
 *
 * A reward model is a Llama / Qwen-family ...ForSequenceClassification checkpoint with a
 * scalar head (score.weight); it scores whole token sequences (prompt + response). */
#ifndef RF_REWARD_H
#define RF_REWARD_H

#include <stddef.h>
#include <stdint.h>

#include "comm/comm.h"
#include "common/status.h"
#include "kernels/kernels.h"
#include "model/tokenizer.h"

/* ---- single rules --------------------------------------------------------------------------
 * `info` (info_cap bytes, may be NULL / 0) receives a NUL-terminated one-line explanation,
 * truncated to fit, e.g. "pred 1234 (after ####) == truth 1234". */

/* 1.0 when the final number of `response` equals the number in `truth`, else 0.0.
 * Which number is "final" (first match wins): the content of the last \boxed{} / \fbox{};
 * else the first number after the last "####"; else the first number after the last
 * "answer is" (any case); else the last number anywhere. A marker with no number after it
 * falls through to the next rule. Numbers: optional sign (-, +, U+2212), thousands commas
 * ("1,234,567"), decimals, integer fractions "a/b", trailing "%" or "\%". Integers compare
 * exactly (any length; "3.0" and "6/2" are the integer 3); otherwise by value with relative
 * tolerance 1e-9. A '%' on the response is ignored, except that when `truth` carries '%',
 * "0.25" also matches "25%". `truth` may be a bare number or a whole solution (a GSM8K answer
 * "... #### 72"): it goes through the same extraction. Empty / NULL response: 0. */
float rf_reward_numeric(const char *response, const char *truth, char *info, size_t info_cap);

/* 1.0 when the final answer of `response` equals `truth` after LaTeX normalisation, else 0.0.
 * Final answer: the last \boxed{...} (nested braces, "\boxed {x}", "\boxed x", \fbox{}); else
 * the rest of the line after the last "####"; else the rest of the line after the last
 * "answer is". No box and no marker: 0 (no last-number fallback; that is the numeric rule).
 * `truth` is taken from its own last \boxed{} or "####" when it has one, else whole.
 * Normalisation (both sides): see rf_reward_math_normalize. Two answers that both read as
 * numbers (integers, decimals, a/b, \frac{a}{b}, with thousands commas) compare as numbers
 * exactly like rf_reward_numeric; otherwise the normalised strings must be equal. */
float rf_reward_math(const char *response, const char *truth, char *info, size_t info_cap);

/* The final-answer string rf_reward_math compares: the last \boxed{} / \fbox{} content, else
 * the line after "####", else the line after "answer is"; NULL when there is none. Caller
 * frees. */
char *rf_reward_math_extract(const char *text);

/* Normalises a math answer, a fresh string the caller frees (NULL only out of memory):
 * drops $ and \( \) \[ \], \left / \right, spacing commands (\, \; \: \! "\ " ~), ^\circ and
 * ^{\circ}, \% and %, "\text{..}" / "\textbf" / "\mathrm" / "\mbox" groups (units; unwrapped
 * instead when the group is the whole answer), a leading "x=" for a single-letter variable;
 * maps \dfrac / \tfrac to \frac, "\frac12" to "\frac{1}{2}", "\sqrt2" to "\sqrt{2}";
 * removes all whitespace and a trailing period; strips thousands commas from a plain number. */
char *rf_reward_math_normalize(const char *answer);

/* The part of a response the `exact` and `countdown` rules read (without answer_regex): the
 * content of the last "<answer>...</answer>" when a closing tag follows the last "<answer>",
 * else the last line that is not blank; leading and trailing whitespace (space, \t, \n, \r,
 * \v, \f) trimmed. Returns a pointer into response (or into "" when response is NULL) and its
 * length in *len. */
const char *rf_reward_answer_span(const char *response, size_t *len);

/* 1.0 when the answer (rf_reward_answer_span) equals `truth` after normalisation, else 0.0.
 * Normalisation, both sides: leading and trailing whitespace dropped, every run of whitespace
 * inside made one space, ASCII letters lower-cased (other bytes compared as they are: no
 * Unicode case folding, no punctuation or number handling: "3.0" is not "3"). An empty answer
 * scores 0 whatever the truth; NULL truth: 0. */
float rf_reward_exact(const char *response, const char *truth, char *info, size_t info_cap);

/* 1.0 when the answer (rf_reward_answer_span) is, as a whole, a countdown expression that uses
 * exactly the truth's numbers, each once, with + - * / and parentheses only, and equals the
 * truth's target in exact rational arithmetic (reward/countdown.h: rf_countdown_check_nums);
 * else 0.0 (division by zero, a bare number, a reused or missing number, "**", "=", unbalanced
 * parentheses, overflow). `truth`: "N1 N2 ... Nk -> TARGET" (rf_countdown_truth_parse), the
 * "answer" that `rlflow data countdown` writes; a truth that does not read so scores 0 with
 * info saying so. */
float rf_reward_countdown(const char *response, const char *truth, char *info, size_t info_cap);

/* Compiles `pattern` with the options of rf_reward_format to check it, and frees it. Errors:
 * RF_ERR_ARG naming `label`, the pattern, the offset and PCRE2's message:
 * `reward.answer_regex "(": PCRE2 error at offset 1: missing closing parenthesis`. */
rf_status rf_reward_regex_check(const char *label, const char *pattern);

/* 1.0 when `pattern` (PCRE2) matches anywhere in `response`, else 0.0. The pattern is
 * compiled per call with PCRE2_DOTALL (so '.' crosses newlines), PCRE2_UTF and
 * PCRE2_MATCH_INVALID_UTF (a response cut mid-character still matches byte-safely); anchor it
 * with \A ... \z to demand the whole response. An rf_reward_rules object compiles once
 * instead. Errors: RF_ERR_ARG for a pattern PCRE2 refuses, naming the pattern, the error
 * offset and PCRE2's message; RF_ERR_INTERNAL when matching fails (e.g. the match limit). */
rf_status rf_reward_format(const char *response, const char *pattern, float *reward, char *info,
                           size_t info_cap);

/* Length penalty: -penalty * |len - target| / target, unclipped (len in tokens, target > 0). */
float rf_reward_length(int len, int target, float penalty);

/* DAPO overlong reward shaping (Yu et al. 2025, "DAPO", eq. 13), with Lmax = max_len and
 * Lc = buffer: 0 when len <= Lmax - Lc; -(len - (Lmax - Lc)) / Lc * penalty_factor when
 * Lmax - Lc < len < Lmax; -penalty_factor when len >= Lmax. Needs 0 < buffer <= max_len. */
float rf_reward_overlong(int len, int max_len, int buffer, float penalty_factor);

/* ---- weighted combination ---------------------------------------------------------------- */

#define RF_REWARD_MAX_RULES 8

/* Valid rule names: "numeric", "math", "exact", "countdown" (the correctness rules), "format",
 * "length", "overlong". The caller owns every pointer; rf_reward_rules_init copies what it
 * keeps. */
typedef struct rf_reward_rules_config {
    const char *const *names;  /* (n_names) rule names, each at most once */
    int n_names;
    const float *weights;      /* (n_weights); n_weights == 0 (or NULL): every weight is 1 */
    int n_weights;
    const char *format_regex;  /* "format": the pattern, as for rf_reward_format */
    const char *answer_regex;  /* NULL or "": none. Else a PCRE2 pattern (options as for
                                  rf_reward_format) whose LAST match in the response gives the
                                  answer the correctness rules read: its first capture group
                                  (empty when that group took no part), or the whole match when
                                  it has no group. No match: every correctness rule scores 0.
                                  numeric and math then read the capture as their response;
                                  exact and countdown read the capture, trimmed, instead of
                                  rf_reward_answer_span. The other rules see the whole response. */
    int length_target;         /* "length": target length in tokens, > 0 */
    float length_penalty;      /* "length": penalty per unit of relative deviation, >= 0 */
    int overlong_buffer;       /* "overlong": Lc, 0 < Lc <= max_new_tokens */
    float overlong_penalty;    /* "overlong": penalty_factor, >= 0 */
    int max_new_tokens;        /* "overlong": Lmax, the generation limit */
    int allow_none;            /* 1: n_names == 0 is allowed (every response scores 0 with no
                                  accuracy; the rewards come from reward programs or a reward
                                  model). 0: no rules is an error */
} rf_reward_rules_config;

typedef struct rf_reward_rules rf_reward_rules;

/* Validates cfg and builds a rules object (compiling the format regex once, JIT when PCRE2
 * has it). Caller owns *out (rf_reward_rules_free). Errors, all RF_ERR_ARG: an unknown rule
 * name (the message lists the valid names), a duplicate name, no rules, more than
 * RF_REWARD_MAX_RULES, a weight count that differs from the name count, a non-finite weight,
 * a bad or missing parameter of a listed rule (format without a regex or with a regex PCRE2
 * refuses; length_target <= 0; overlong buffer outside (0, max_new_tokens]; negative
 * penalties), an answer_regex PCRE2 refuses (rf_reward_regex_check's message, labelled
 * "reward.answer_regex"). *out is NULL on error. */
rf_status rf_reward_rules_init(rf_reward_rules **out, const rf_reward_rules_config *cfg);
void rf_reward_rules_free(rf_reward_rules *r);

/* reward = sum_i weight_i * rule_i(response, response_tokens, truth). accuracy (may be NULL)
 * = the raw 0/1 of the first correctness rule listed (numeric, math, exact, countdown), NAN when none is
 * listed. truth may be NULL when no correctness rule is listed (a correctness rule scores 0
 * against a NULL truth). Threads: r is read-only; PCRE2 match data is made per call.
 * Errors: RF_ERR_INTERNAL when the regex engine fails (e.g. its match limit). */
rf_status rf_reward_rules_score(const rf_reward_rules *r, const char *response,
                                int response_tokens, const char *truth, float *reward,
                                float *accuracy);

/* As rf_reward_rules_score, also writing each rule's raw value and info into `info`
 * ("math=1 [pred 1/2 == truth 0.5]; format=0 [no match]"), truncated to info_cap. */
rf_status rf_reward_rules_explain(const rf_reward_rules *r, const char *response,
                                  int response_tokens, const char *truth, float *reward,
                                  float *accuracy, char *info, size_t info_cap);

/* ---- reward model ------------------------------------------------------------------------ */

typedef struct rf_reward_model rf_reward_model;

/* Opens a reward model directory: config.json whose "architectures" names a
 * ...ForSequenceClassification with num_labels 1, safetensors that contain score.weight (a
 * checkpoint without it is refused: rf_model_load would start the head at zero, right for a
 * fresh critic and wrong for a reward model), and tokenizer.json (+ tokenizer_config.json).
 * pad_token_id from config.json (when set) drives the pooling of rf_reward_model_score.
 * Caller owns *rm (rf_reward_model_close). Errors name the directory: RF_ERR_FORMAT for a
 * config that is not a sequence classifier or a checkpoint without score.weight, plus
 * whatever rf_model_load / rf_tokenizer_load_dir report. *rm is NULL on error. */
rf_status rf_reward_model_open(rf_reward_model **rm, const char *dir, const rf_kernels *k);
void rf_reward_model_close(rf_reward_model *rm);

/* The same reward model split over the ranks of `group` (tensor parallel, model/model_tp.h:
 * each rank reads its shard of the files; the communicator's memory the kernels'). Every rank
 * of the group then calls rf_reward_model_score with the same sequences, and each gets every
 * score. rf_model_tp_init's errors besides rf_reward_model_open's (a tp that does not divide
 * the heads). Collective over group. */
rf_status rf_reward_model_open_tp(rf_reward_model **rm, const char *dir, const rf_kernels *k,
                                  rf_comm *group, double timeout_s);

/* The tensor-parallel ranks rm is split over; 0 when whole. */
int rf_reward_model_split(const rf_reward_model *rm);

/* The model's own tokenizer (owned by rm): responses from a policy with another vocabulary
 * must be decoded and re-encoded with it. */
const rf_tokenizer *rf_reward_model_tokenizer(const rf_reward_model *rm);

/* The model (owned by rm), e.g. for its config; NULL when split (rf_reward_model_open_tp). */
const struct rf_model *rf_reward_model_model(const rf_reward_model *rm);

/* Scores n full token sequences (prompt + response; seqs[i] has lens[i] >= 1 tokens) into
 * scores (n): the head's value at each sequence's last token, as transformers'
 * ...ForSequenceClassification pools it: the last token whose id is not pad_token_id (so
 * trailing pad tokens are skipped; a sequence of pad tokens only uses its first token). No
 * pad_token_id in config.json: the last token. Sequences are packed (no padding) and run in
 * forward passes of at most 8192 tokens (a longer sequence runs alone). Threads: one thread
 * at a time per rm. Errors: RF_ERR_ARG for n < 0 or an empty sequence (naming its index),
 * and rf_model_forward's errors (token id out of range, sequence over the length limit). */
rf_status rf_reward_model_score(rf_reward_model *rm, const int32_t *const *seqs,
                                const int *lens, int n, float *scores);

#endif
