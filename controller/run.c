/* `rlflow run` in one process: the run set up (models, data, rewards, the rollout engine,
 * --resume) and the in-process roles over it driven by the one RL loop (controller/controller.c,
 * the loop of split runs too). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/controller.h"
#include "controller/interrupt.h"
#include "controller/run_internal.h"
#include "model/lora.h"
#include "trainer/checkpoint.h"

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

rf_status rf_run_main(const rf_recipe *r, int resume) {
    rf_run run;
    rf_status s = setup(&run, r, resume);
    /* from here on a Ctrl-C stops at the next step's end with a checkpoint (set-up, the SFT
     * warm start included, stops at once as before) */
    rf_roles roles = {0};
    if (s == RF_OK) s = rf_roles_inproc_init(&roles, &run);
    if (s == RF_OK) {
        rf_interrupt_install();
        s = rf_controller_run(&run, roles);
        rf_interrupt_restore();
    }
    rf_roles_inproc_free(&roles);
    rf__run_set_end(&run, s);
    rf__run_free(&run);
    rf__write_run_status(r, s);
    return s;
}
