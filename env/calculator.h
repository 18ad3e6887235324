/* The built-in calculator tool environment (docs/env-api.md, "The calculator"; recipe
 * env.type = "calculator"). The model calls the tool by writing <calc>EXPRESSION</calc>: the
 * stop string "</calc>" ends its turn, and the environment answers <result>VALUE</result>,
 * after which the model writes on. A turn that ends without a call (an end-of-sequence token,
 * the turn's token limit, or a stop string that is not "</calc>") ends the episode. Rewards:
 * none of its own (0 per turn): the run's reward rules score the last turn's text.
 *
 * EXPRESSION: integers, + - * /, parentheses, unary minus, spaces; evaluated in 64-bit
 * integers (a product or sum that overflows answers "error: overflow"); a division that is not
 * exact answers its quotient rounded to 6 decimals ("7/2" -> "3.5"); anything else answers
 * "error: ..." (the episode goes on: the model may try again). A turn is a tool call when it
 * ended at a stop string and its text holds "<calc>": what follows the last one is evaluated. */
#ifndef RF_ENV_CALCULATOR_H
#define RF_ENV_CALCULATOR_H

#include <stddef.h>

#include "env/env.h"

/* The stop string that ends a turn with a tool call. */
#define RF_CALC_STOP "</calc>"

/* Evaluates expr into out (cap bytes): the VALUE the tool answers, or "error: <why>". Returns 1
 * for a value, 0 for an error. */
int rf_calculator_eval(const char *expr, char *out, size_t cap);

/* The calculator as an rf_env (its scratch freed by rf_env_close). */
rf_status rf_calculator_env(rf_env *e);

#endif
