/* The run directory (logging.dir) between runs: a run never writes into another run's files
 * by accident. A directory "holds a run" when it has metrics.jsonl, samples.jsonl, a
 * TensorBoard event file (a name containing "tfevents") or a checkpoint (step_NNNNNN); other
 * files (a data set, a model built there) do not count.
 *
 *   neither flag  a directory holding a run is refused, naming it and the two ways out;
 *   --overwrite   removes what a run wrote there (metrics.jsonl, samples.jsonl, the event
 *                 files, the step_* checkpoints and `latest`, recipe.toml, run_status.json,
 *                 the reward_program_<i>.log of reward.programs), nothing else, and starts
 *                 afresh (--resume appends to those program logs);
 *   --resume      keeps it, and cuts the logs back to the newest checkpoint's step S: the lines
 *                 of metrics.jsonl and samples.jsonl with a step > S, and the event-file
 *                 records with a step > S, are dropped (each file rewritten atomically), so
 *                 the resumed run writes each later step once and every reader (TensorBoard
 *                 included) sees each step once. */
#ifndef RF_RUN_DIR_H
#define RF_RUN_DIR_H

#include "common/status.h"

/* Prepares dir (logging.dir for `rlflow run`; <logging.dir>/sft_checkpoints for `rlflow sft`)
 * as above (resume and overwrite exclusive); label names it in the refusal ("logging.dir =").
 * Errors: RF_ERR_ARG naming the directory and what
 * it holds; RF_ERR_IO / RF_ERR_FORMAT naming a file that could not be removed, read or
 * rewritten. */
rf_status rf_run_dir_prepare(const char *dir, const char *label, int resume, int overwrite);

/* 1 when dir holds a run (see above), 0 when not or when it does not exist. */
int rf_run_dir_has_run(const char *dir);

/* Drops the lines of the JSONL file at path whose "step" is > step (lines that do not parse
 * are kept); a missing file is no error. *dropped: lines dropped (may be NULL). */
rf_status rf_run_dir_cut_jsonl(const char *path, long step, int *dropped);

/* Drops the records of TensorBoard event file path whose Event.step is > step (the
 * file_version record and records without a step are kept; a torn last record goes too).
 * *dropped: records dropped (may be NULL). */
rf_status rf_run_dir_cut_events(const char *path, long step, int *dropped);

/* The step-0 "val/accuracy" of <dir>/metrics.jsonl (the accuracy before training), 1 when
 * found, 0 when not (no file, no step-0 validation). */
int rf_run_dir_val_before(const char *dir, double *acc);

#endif
