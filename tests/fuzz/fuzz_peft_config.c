/* PEFT's adapter_config.json (model/lora_io.c rf_lora_read_peft_config), the file a user points
 * rlflow at to load or start from a LoRA adapter, on arbitrary text; options that read back
 * are then checked against a model config (rf_lora_check), as loading does. */
#include "model/config.h"
#include "model/lora.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    (void)rf_fuzz_file("adapter_config.json", data, size);
    rf_lora_opts o;
    memset(&o, 0, sizeof o);
    rf_status st = rf_lora_read_peft_config(rf_fuzz_dir(), &o);
    rf_fuzz_check_error(st);
    if (st == RF_OK) {
        rf_model_config cfg;
        if (rf_config_preset(&cfg, "tiny", 256) != RF_OK) abort();
        rf_fuzz_check_error(rf_lora_check(&o, &cfg));
    }
    rf_error_clear();
    return 0;
}
