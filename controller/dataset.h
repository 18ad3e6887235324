/* Training prompts read from JSONL, and the seeded order in which a run visits them.
 *
 * One JSON object per line (blank lines skipped): a prompt (a string, or chat messages
 * [{role, content}]), an optional ground-truth answer for rule rewards, an optional response
 * for SFT, and any other fields, kept as a cJSON object that is handed to rewards unchanged.
 * Prompts are rendered with a built-in chat template when one is named and tokenized at load;
 * prompts longer than max_prompt_tokens are dropped then (as verl does), and counted.
 *
 * The visiting order is a Fisher-Yates shuffle per epoch whose generator is seeded from
 * (seed, epoch) alone, so that a position {epoch, index} names the same example in every run:
 * a run resumed from a saved position continues exactly where the first one stopped.
 * See docs/data.md. */
#ifndef RF_DATASET_H
#define RF_DATASET_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/status.h"
#include "model/tokenizer.h"

/* All zero is the default. */
typedef struct rf_dataset_opts {
    const char *prompt_key;    /* NULL: "prompt"; "messages" is read when this key is absent */
    const char *answer_key;    /* NULL: "answer" */
    const char *response_key;  /* NULL: "response" */
    const char *chat_template; /* NULL or "": none; else a name rf_chat_apply knows */
    int max_prompt_tokens;     /* > 0: drop longer prompts at load (needs a tokenizer); 0: keep all */
    int require_answer;        /* 1: a line without the answer key is an error (rule rewards) */
    int require_response;      /* 1: a line without the response key is an error (SFT) */
    int need_answer;           /* 1: a file where no example has the answer key is an error
                                  naming data.answer_key; some without it are counted
                                  (rf_dataset_n_missing_answer) and logged as a warning */
    int no_shuffle;            /* 1: every epoch visits the file order */
    uint64_t seed;             /* shuffle seed */
} rf_dataset_opts;

/* One example. Everything is owned by the dataset and lives until rf_dataset_free. */
typedef struct rf_example {
    const char *prompt_text; /* what the model sees: rendered by the chat template when one is given */
    int32_t *prompt_ids;     /* (n_prompt) token ids; NULL when loaded without a tokenizer */
    int n_prompt;            /* 0 when loaded without a tokenizer */
    const char *answer;      /* ground truth (a JSON number is kept as its text), NULL when absent */
    const char *response;    /* SFT target, NULL when absent */
    const cJSON *extra;      /* every other field of the line: an object, possibly empty, never NULL */
    int line;                /* 1-based line in the file, for messages */
    int index;               /* position in the dataset (0-based, after dropping overlong prompts) */
} rf_example;

/* A place in the stream of examples: example `index` of epoch `epoch`'s order. {0, 0} starts
 * a run. Plain data: checkpoint it as two integers. */
typedef struct rf_dataset_pos {
    int epoch;
    int index; /* 0 <= index < rf_dataset_size */
} rf_dataset_pos;

typedef struct rf_dataset rf_dataset;

/* Loads `path`. `o` may be NULL (defaults). `tok` may be NULL: then no ids are made and
 * max_prompt_tokens must be 0. A string prompt is used as is without a template (encoded with
 * add_special = 1) and as one user turn plus the assistant generation prompt with one (encoded
 * with add_special = 0: a rendered template already carries its special tokens). The caller
 * owns *out (rf_dataset_free). `tok` is only used during the call.
 * Errors (messages name "path:line" and the field): RF_ERR_IO (unreadable file),
 * RF_ERR_FORMAT (invalid JSON, not an object, a key or string anywhere in the line that is
 * not UTF-8 (RFC 8259): "PATH:3: "meta"["src"] is not valid UTF-8 at byte 4 of its 9", missing
 * or mistyped prompt/answer/response, a file with no examples, need_answer and no example with
 * the answer key: "PATH: no example has the field "answer" (data.answer_key) that the reward
 * rules compare with; line 1 has "prompt", "solution""), RF_ERR_ARG (chat messages without a
 * template, unknown template, max_prompt_tokens without a tokenizer), RF_ERR_RANGE (every
 * prompt too long). */
rf_status rf_dataset_load(rf_dataset **out, const char *path, const rf_dataset_opts *o,
                          const rf_tokenizer *tok);

/* Accepts NULL. */
void rf_dataset_free(rf_dataset *ds);

/* Examples kept (overlong prompts excluded). */
int rf_dataset_size(const rf_dataset *ds);

/* Prompts dropped at load for exceeding max_prompt_tokens. */
int rf_dataset_n_dropped(const rf_dataset *ds);

/* Kept examples without the answer key (counted whatever need_answer says). */
int rf_dataset_n_missing_answer(const rf_dataset *ds);

/* Example i in file order (0 <= i < size), NULL when out of range. Thread-safe. */
const rf_example *rf_dataset_get(const rf_dataset *ds, int i);

/* Dataset index of the example at `pos` in the shuffled order; -1 when pos is invalid.
 * Not thread-safe (caches one epoch's order in ds). */
int rf_dataset_index_at(rf_dataset *ds, rf_dataset_pos pos);

/* Writes the next n examples from *pos to out[0..n) and advances *pos, wrapping into the next
 * epoch (and its new order) as often as needed, n > size included. The same starting pos
 * always yields the same examples. Not thread-safe (caches one epoch's order in ds).
 * Errors: RF_ERR_ARG for n < 0 or a pos outside [0, size). */
rf_status rf_dataset_next(rf_dataset *ds, rf_dataset_pos *pos, int n, const rf_example **out);

#endif
