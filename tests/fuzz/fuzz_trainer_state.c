/* A checkpoint's trainer_state.json (trainer/checkpoint.c), what --resume reads, on arbitrary
 * text: a state that loads must hold counters >= 0 and a finite KL coefficient >= 0. */
#include <math.h>

#include "trainer/checkpoint.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char run[300];
    if (!run[0]) { /* run/latest names run/step_000001, whose trainer_state.json is the input */
        char step[400];
        snprintf(run, sizeof run, "%s/run", rf_fuzz_dir());
        snprintf(step, sizeof step, "%s/step_000001", run);
        mkdir(run, 0700), mkdir(step, 0700);
        rf_fuzz_file("run/latest", "step_000001\n", 12);
    }
    rf_fuzz_file("run/step_000001/trainer_state.json", data, size);
    rf_ckpt_state st;
    memset(&st, 0, sizeof st);
    rf_status s = rf_checkpoint_load(run, NULL, NULL, &st);
    rf_fuzz_check_error(s);
    if (s == RF_OK && (st.step < 0 || st.actor_opt_steps < 0 || st.critic_opt_steps < 0 ||
                       st.pos.epoch < 0 || st.pos.index < 0 || st.admitted < 0 ||
                       !(st.kl_beta >= 0 && isfinite(st.kl_beta))))
        abort();
    rf_error_clear();
    return 0;
}
