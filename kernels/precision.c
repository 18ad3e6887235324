/* model.precision / --precision: resolving "auto" | "fp32" | "bf16" for a back end, setting it
 * and saying at start what was chosen and why. */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_level.h"
#include "kernels/kernels.h"

rf_status rf_precision_parse(const char *s, const char *key, int *is_auto, rf_precision *p) {
    *is_auto = 0;
    *p = RF_PRECISION_FP32;
    if (s && strcmp(s, "auto") == 0) *is_auto = 1;
    else if (s && strcmp(s, "bf16") == 0) *p = RF_PRECISION_BF16;
    else if (!s || strcmp(s, "fp32") != 0)
        return rf_error(RF_ERR_ARG, "%s = \"%s\": expected \"auto\", \"fp32\" or \"bf16\"", key,
                        s ? s : "");
    return RF_OK;
}

rf_status rf_kernels_apply_precision(const rf_kernels *k, const char *setting, const char *key,
                                     rf_precision *chosen) {
    int is_auto;
    rf_precision p;
    RF_TRY(rf_precision_parse(setting, key, &is_auto, &p));
    int cpu = strcmp(k->name, "cpu") == 0;
    if (!is_auto) {
        rf_status s = k->set_precision(p);
        if (s != RF_OK) return rf_error_wrap(s, "%s = \"%s\" on the %s back end", key, setting, k->name);
        rf_log_info("precision: %s (%s)%s", p == RF_PRECISION_BF16 ? "bf16" : "fp32", key,
                    cpu && p == RF_PRECISION_BF16 && !rf_cpu_isa_has_bf16()
                        ? ": this CPU has no bf16 instructions, products emulated at fp32 speed"
                        : "");
    } else if (cpu) {
        int has = rf_cpu_isa_has_bf16();
        RF_TRY(k->set_precision(has ? RF_PRECISION_BF16 : RF_PRECISION_FP32));
        rf_log_info("precision: %s (auto: this CPU %s)", has ? "bf16" : "fp32",
                    has ? "has AVX512-BF16 or AMX-BF16" : "has neither AVX512-BF16 nor AMX-BF16");
    } else if (k->set_precision(RF_PRECISION_BF16) == RF_OK) {
        rf_log_info("precision: bf16 (auto: the %s back end)", k->name);
    } else {
        RF_TRY(k->set_precision(RF_PRECISION_FP32));
        rf_log_info("precision: fp32 (auto: the %s back end has no bf16 products yet)", k->name);
    }
    if (cpu && rf_cpu_level() != RF_CPU_LEVEL_BUILD)
        rf_log_info("CPU kernels: the %s copies (a build for any x86-64; one for this CPU alone: "
                    "cmake -DRLFLOW_NATIVE=ON, Release)", rf_cpu_level_name());
    if (chosen) *chosen = k->get_precision();
    return RF_OK;
}
