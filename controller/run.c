/* `rlflow run`: the loop that drives the roles, with validation, console and metrics logging,
 * and checkpoints. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/run_dir.h"
#include "controller/interrupt.h"
#include "controller/run_internal.h"
#include "model/lora.h"
#include "trainer/checkpoint.h"

static rf_status validate_now(rf_run *run, double *acc) {
    const rf_recipe *r = run->r;
    if (!run->val) return RF_OK;
    double len, reward = 0;
    if (run->env.call) RF_TRY(rf__eval_episodes(run, acc, &reward, &len)); /* [env]: the same episodes, greedy */
    else RF_TRY(rf__validate(run, r->logging.val_size, acc, &reward, &len));
    rf__val_metrics(run, *acc, reward, len);
    return RF_OK;
}

static rf_status save(rf_run *run) {
    const rf_recipe *r = run->r;
    rf_ckpt_state st = rf__run_ckpt_state(run, run->pos);
    double t = rf_time_now();
    /* with LoRA the checkpoint holds the adapters in PEFT's layout too (step_N/adapter) */
    RF_TRY(rf_checkpoint_save(r->logging.dir, run->actor, run->critic, r->model.path, &st, r->checkpoint.keep));
    rf_log_info("checkpoint: %s/step_%06d (%.2f s)", r->logging.dir, run->step, rf_time_now() - t);
    return RF_OK;
}

static rf_status setup(rf_run *run, const rf_recipe *r, int resume) {
    memset(run, 0, sizeof *run);
    run->r = r;
    RF_TRY(rf__reject_unimplemented(r));
    RF_TRY(rf__run_state_init(run, r));
    run->k = rf_kernels_for(r->model.device);
    if (!run->k) return rf_error_wrap(RF_ERR_NODEVICE, "model.device = \"%s\"", r->model.device);
    RF_TRY(rf_kernels_apply_precision(run->k, r->model.precision, "model.precision", NULL));
    RF_TRY(rf__ensure_data(r));
    RF_TRY(rf__ensure_model(r));
    RF_TRY(rf__load_roles(run));
    RF_TRY(rf__load_data(run));
    RF_TRY(rf__load_rewards(run));
    RF_TRY(rf__eos_ids(r->model.path, run->actor, run->tok, &run->eos, &run->n_eos));
    RF_TRY(rf__start_rollout(run));
    if (resume) RF_TRY(rf__run_resume(run, run->actor, run->critic));
    return rf__open_logging(run);
}

/* A stop asked for by SIGINT / SIGTERM (controller/interrupt.h), seen between two steps: the
 * checkpoint of the step reached (unless it was just written), and the error that says so. */
static rf_status stop_interrupted(rf_run *run, int saved) {
    if (!saved) RF_TRY(save(run));
    return rf_error(RF_ERR_IO, "interrupted at step %d: checkpoint written to %s/step_%06d; resume with --resume",
                    run->step, run->r->logging.dir, run->step);
}

static rf_status loop(rf_run *run) {
    const rf_recipe *r = run->r;
    double acc0 = NAN, acc = NAN;
    if (run->val && run->step == 0) {
        RF_TRY(validate_now(run, &acc0));
        rf_log_info("validation before training: accuracy %.3f on %d prompts", acc0,
                    r->logging.val_size < rf_dataset_size(run->val) ? r->logging.val_size : rf_dataset_size(run->val));
        RF_TRY(rf_metrics_commit(run->metrics, 0));
    }
    run->t_start = rf_time_now();
    run->start_step = run->step;
    while (run->step < r->train.steps) {
        if (rf_interrupt_signal()) return stop_interrupted(run, 0);
        RF_TRY(rf__rl_step(run));
        run->step++;
        int last = run->step == r->train.steps;
        if (run->val && rf__val_due(r, run->step)) {
            RF_TRY(validate_now(run, &acc));
            if (acc > run->best_val) run->best_val = acc;
        }
        if (rf__console_due(r, run->step)) rf__console(run);
        RF_TRY(rf_metrics_commit(run->metrics, run->step));
        int saved = rf__ckpt_due(r, run->step);
        if (saved) RF_TRY(save(run));
        if (!last && rf_interrupt_signal()) return stop_interrupted(run, saved);
    }
    /* resumed: the accuracy before training is the first run's step-0 validation */
    if (isnan(acc0) && run->start_step > 0 && !rf_run_dir_val_before(r->logging.dir, &acc0)) acc0 = NAN;
    if (!isnan(acc) && !isnan(acc0))
        rf_log_info("validation accuracy: %.3f -> %.3f after %d steps (%.1f s)", acc0, acc, r->train.steps,
                    rf_time_now() - run->t_start);
    else if (!isnan(acc))
        rf_log_info("validation accuracy: %.3f after %d steps (%.1f s; the accuracy before training is not in "
                    "%s/metrics.jsonl)", acc, r->train.steps, rf_time_now() - run->t_start, r->logging.dir);
    return RF_OK;
}

rf_status rf_run_main(const rf_recipe *r, int resume) {
    rf_run run;
    rf_status s = setup(&run, r, resume);
    /* from here on a Ctrl-C stops at the next step's end with a checkpoint (set-up, the SFT
     * warm start included, stops at once as before) */
    if (s == RF_OK) {
        rf_interrupt_install();
        s = loop(&run);
        rf_interrupt_restore();
    }
    rf__run_free(&run);
    rf__write_run_status(r, s);
    return s;
}
