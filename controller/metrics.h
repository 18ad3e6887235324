/* Metrics of a training run: a per-step collection of named scalars ("reward/mean" -> 0.41),
 * written when the step is committed to
 *   <dir>/metrics.jsonl   one JSON object per line: {"step": N, "time": T, "<name>": v, ...}
 *   <dir>/events.out.tfevents.*   TensorBoard scalars, tag = name (controller/tb_writer.h)
 * either or both, and a compact console line per step built from chosen metrics.
 *
 * JSON has no NaN or infinity: such values are written as null in metrics.jsonl (TensorBoard
 * gets the float NaN/inf itself). Names keep the order of their first rf_metrics_set in a step,
 * which is the key order of the JSON line. Opening never rewrites: metrics.jsonl is appended
 * to and a new event file started. A resumed run's directory has been cut back to the
 * checkpoint's step first (controller/run_dir.h), so each step is written once; the first
 * commit of each open still marks a session start in the event file, which TensorBoard takes
 * as a restart point (docs/metrics.md).
 *
 * An rf_metrics belongs to one thread (the controller's): no call is thread-safe. */
#ifndef RF_METRICS_H
#define RF_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct rf_metrics rf_metrics;

/* Opens the sinks in `dir` (created when needed): metrics.jsonl for appending when `jsonl`, a
 * new TensorBoard event file when `tensorboard`. With both 0, `dir` may be NULL and the
 * collection serves only the console line. The caller owns *m (rf_metrics_close).
 * Errors: RF_ERR_ARG (no dir while a sink is asked for), RF_ERR_IO naming the path. */
rf_status rf_metrics_open(rf_metrics **m, const char *dir, int jsonl, int tensorboard);

/* Sets metric `name` for the current step (copied); setting it again replaces the value in
 * place. Errors: RF_ERR_ARG for an empty name or the reserved names "step" and "time". */
rf_status rf_metrics_set(rf_metrics *m, const char *name, double value);

/* Reads metric `name` of the current step: 1 and *value when set, 0 otherwise. */
int rf_metrics_get(const rf_metrics *m, const char *name, double *value);

/* Number of metrics set in the current step. */
int rf_metrics_count(const rf_metrics *m);

/* The name and value of the i-th metric set in this step (0 <= i < count), in the order of
 * first setting; NULL outside the range. */
const char *rf_metrics_at(const rf_metrics *m, int i, double *value);

/* Writes the current step's metrics to every open sink, each as one write(2) so a crash
 * loses at most the step in flight, then clears them (also on error, so a failed write does
 * not leak values into the next step). Nothing is written for a step with no metrics. The
 * first commit after rf_metrics_open also writes a TensorBoard SessionLog START at `step`:
 * after a resume, TensorBoard then drops the points of earlier event files with step >= `step`,
 * which the run is about to redo.
 * Errors: RF_ERR_IO from a sink (both sinks are attempted; the first error is returned). */
rf_status rf_metrics_commit(rf_metrics *m, int64_t step);

/* Closes the sinks and frees m; NULL is accepted. */
void rf_metrics_close(rf_metrics *m);

/* Path of metrics.jsonl / of the current event file, or NULL when that sink is off. */
const char *rf_metrics_jsonl_path(const rf_metrics *m);
const char *rf_metrics_tb_path(const rf_metrics *m);

/* ---- per-sample logs (logging.samples_every) ---- */

#define RF_SAMPLE_MAX_COMPONENTS 8

/* One logged sample: the prompt as the model saw it, the decoded response, the reference
 * answer (NULL: none), its whole reward and that reward's parts. */
typedef struct rf_sample_log {
    const char *prompt, *response, *answer;
    int group, index;       /* prompt's group in the batch, sample's place in its group */
    int response_tokens;
    double reward;          /* the whole reward the advantages used (sequence + per-token) */
    double accuracy;        /* the rules' correctness, NAN when no rule judges it */
    double advantage;       /* the advantage of the response's first token */
    int n_components;
    const char *component_names[RF_SAMPLE_MAX_COMPONENTS];
    double components[RF_SAMPLE_MAX_COMPONENTS];
    /* multi-turn episodes ([env]): the trajectory as trained on, NULL otherwise */
    const int32_t *response_ids; /* (response_tokens) generated and observation ids in order */
    const uint8_t *loss_mask;    /* (response_tokens) 1 generated, 0 observation */
    const int *versions;         /* (response_tokens) policy version of each token */
} rf_sample_log;

/* Writes n samples of `step`: one JSON object per sample appended to <dir>/samples.jsonl (when
 * the jsonl sink is on; opened at the first call) with the fields step, time, group, index,
 * prompt, response, answer, reward, accuracy, advantage, response_tokens, components
 * (docs/metrics.md), and for an episode response_ids, loss_mask and versions, and, when the TensorBoard sink is on, one text summary per sample (tag
 * "samples/<i>", Markdown) in the event file. Each sink gets one write(2) per call.
 * Errors: RF_ERR_IO naming the file; RF_ERR_NOMEM. */
rf_status rf_metrics_samples(rf_metrics *m, int64_t step, const rf_sample_log *s, int n);

/* Path of samples.jsonl (NULL before the first rf_metrics_samples or without the jsonl sink). */
const char *rf_metrics_samples_path(const rf_metrics *m);

/* ---- console ---- */

/* One field of the console line: "<label> <value>[±<pm>]<unit>". */
typedef struct rf_metrics_col {
    const char *name;    /* metric to show, e.g. "reward/mean"; skipped when not set */
    const char *label;   /* short label, e.g. "reward"; NULL: no label */
    const char *fmt;     /* printf format of one double, e.g. "%.2f"; NULL: "%.3g" */
    const char *pm_name; /* metric shown after "±" in the same format (e.g. "reward/std"), or NULL */
    const char *unit;    /* appended after the value, e.g. " tok/s", or NULL */
} rf_metrics_col;

/* Formats the console line of the current (uncommitted) step into out (capacity cap, always
 * NUL-terminated when cap > 0, truncated if short):
 *   step 12/200 | reward 0.41±0.32 | kl 0.002 | gen 850 tok/s | ETA 3m12s
 * `total` <= 0 omits "/total" and the ETA. The ETA is elapsed_s / steps_timed * (total - step):
 * steps_timed is the number of steps that elapsed_s covers (since start, or since a resume);
 * no ETA when it is <= 0. Returns the length the full line has (as snprintf). Call it before
 * rf_metrics_commit, which clears the values. */
size_t rf_metrics_console_line(const rf_metrics *m, int64_t step, int64_t total,
                               double elapsed_s, int64_t steps_timed,
                               const rf_metrics_col *cols, int n_cols, char *out, size_t cap);

/* Formats a duration compactly: "45s", "3m12s", "1h05m", "2d03h" ("?" for a negative or
 * non-finite value). Returns the length as snprintf does. */
size_t rf_metrics_format_duration(double seconds, char *out, size_t cap);

#endif
