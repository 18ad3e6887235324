/* Built-in verifiable tasks: generators of train/val JSONL so that the default recipes need no
 * downloads. The countdown answer checker lives in reward/countdown.h.
 *
 *  "arith":     {"prompt": "47+385=", "answer": "432", "response": "432"}
 *               + and - of operands with min_digits..max_digits digits (a - b with a >= b, so
 *               results are never negative), and a share of small products (up to
 *               max_digits - 1 digits times one digit 2..9).
 *  "multiply":  {"prompt": "4821*3907=", "answer": "18835647", "response":
 *               "<calc>4821*3907</calc><result>18835647</result>18835647"}
 *               products of two operands with min_digits..max_digits digits each: a task the
 *               calculator tool (env/calculator.h) makes easy and a small model cannot do in its
 *               head; "response" shows the tool call, the calculator's answer and the copy.
 *  "countdown": {"prompt": "3 7 25 50 -> 78:", "answer": "3 7 25 50 -> 78",
 *               "response": "(50-25)*3+3", "numbers": [3, 7, 25, 50], "target": 78}
 *               reach the target with + - * / and parentheses, using each number exactly once;
 *               the target is made by combining all the numbers with exact integer steps, so
 *               every problem is solvable, and "response" is one solution. "answer" is the
 *               truth the countdown reward rule reads (reward/countdown.h).
 * Prompts are short on purpose: the default model reads bytes, one token per character.
 * Every line carries "response", a correct answer in the format the reward checks, for an SFT
 * warm start. See docs/data.md. */
#ifndef RF_TASKS_H
#define RF_TASKS_H

#include <stdint.h>

#include "common/status.h"
#include "reward/countdown.h" /* the checker the countdown reward rule uses */

/* Task knobs; rf_task_opts_default fills the defaults given after each field. */
typedef struct rf_task_opts {
    int min_digits, max_digits; /* arith, multiply: digits per operand (1, 3); 1 <= min <= max <= 9 */
    int mul_percent;            /* arith: percent of problems that are products (10); 0..100 */
    int n_numbers;              /* countdown: numbers per problem (3); 2..6 */
    int max_number;             /* countdown: numbers drawn from 1..max_number (50); 2..9999 */
    int max_target;             /* countdown: targets in 1..max_target (200); >= 1 */
} rf_task_opts;

void rf_task_opts_default(rf_task_opts *o);

/* "arith, countdown, multiply": the task names, for messages. */
const char *rf_task_names(void);

/* Writes out_dir/train.jsonl (n_train lines) and out_dir/val.jsonl (n_val lines), creating
 * out_dir. The output depends only on (task, n_train, n_val, seed, opts): byte for byte the same
 * for the same arguments. Validation prompts are distinct; no training prompt is a validation
 * prompt (training prompts may repeat). opts NULL: defaults.
 * Errors: RF_ERR_ARG (unknown task, listing the tasks; bad counts or opts), RF_ERR_RANGE (the
 * task's space of problems is too small for n_val distinct prompts plus training prompts outside
 * them), RF_ERR_IO (writing). */
rf_status rf_task_generate_opts(const char *task, const char *out_dir, int n_train, int n_val,
                                uint64_t seed, const rf_task_opts *opts);

/* rf_task_generate_opts with the default options. */
rf_status rf_task_generate(const char *task, const char *out_dir, int n_train, int n_val,
                           uint64_t seed);

#endif
