/* The countdown checker (TinyZero's task: reach a target from given numbers with + - * / and
 * parentheses), shared by the `countdown` reward rule (reward/rules.c) and the task generator's
 * tests. Exact rational arithmetic, so no floating-point rounding can make a wrong expression
 * right or a right one wrong. docs/rewards.md states the rule. */
#ifndef RF_COUNTDOWN_H
#define RF_COUNTDOWN_H

#include <stddef.h>
#include <stdint.h>

typedef enum rf_countdown_verdict {
    RF_COUNTDOWN_CORRECT = 0,   /* valid, every number used once, and equal to the target */
    RF_COUNTDOWN_WRONG_VALUE,   /* valid and every number used, but another value */
    RF_COUNTDOWN_BAD_NUMBER,    /* uses a number not given, or more often than given */
    RF_COUNTDOWN_UNUSED_NUMBER, /* leaves a given number unused */
    RF_COUNTDOWN_DIV_ZERO,      /* divides by zero somewhere */
    RF_COUNTDOWN_OVERFLOW,      /* an intermediate value does not fit 64-bit rationals */
    RF_COUNTDOWN_MALFORMED,     /* not an expression of the grammar below (also: empty) */
    RF_COUNTDOWN_BAD_INPUT,     /* numbers_json is not an array of non-negative integers */
} rf_countdown_verdict;

/* Checks a countdown answer. Grammar (spaces and tabs allowed between tokens):
 *   expr := term (('+' | '-') term)*    term := factor (('*' | '/') factor)*
 *   factor := NUMBER | '(' expr ')'     NUMBER := [0-9]+
 * No unary minus, no decimals, no other operator ("**", "^", "x", "=" are malformed), nesting
 * at most 64 deep. Each NUMBER must match an unused entry of numbers_json (a JSON array such as
 * "[3,7,25,50]"; a number listed twice is used twice), and every entry must be used: exactly
 * the given numbers, each once. Arithmetic is exact over rationals (8/3*3 is 8; 7/2 is not 3).
 * The first problem met reading left to right decides the verdict; an unused number is found
 * after the whole expression has been read and wins over a wrong value. Pure, thread-safe. */
rf_countdown_verdict rf_task_countdown_check(const char *expr, const char *numbers_json, int target);

/* Short name of a verdict ("correct", "wrong value", ...). */
const char *rf_countdown_verdict_name(rf_countdown_verdict v);

/* Reads a countdown ground truth "N1 N2 ... Nk -> T" (the numbers separated by spaces or
 * commas, optionally inside [ ], then "->", then the target; spaces anywhere between tokens):
 * the numbers into nums (at most cap), their count into *n and the target into *target.
 * Numbers in 0..2^53, the target in 0..2^31-1. Returns 1 when the whole string reads so, else
 * 0. */
int rf_countdown_truth_parse(const char *truth, int64_t *nums, int cap, int *n, int *target);

/* Checks an expression against numbers (n of them) and a target: rf_task_countdown_check
 * without the JSON. n at most 64, else RF_COUNTDOWN_BAD_INPUT. */
rf_countdown_verdict rf_countdown_check_nums(const char *expr, const int64_t *nums, int n,
                                             int target);

#endif
