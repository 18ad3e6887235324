/* Shared pieces of the rlflow command: subcommand entry points and model opening. */
#ifndef RF_CLI_H
#define RF_CLI_H

#include "kernels/kernels.h"
#include "model/model.h"
#include "model/tokenizer.h"

int rf_cmd_init_model(int argc, char **argv);
int rf_cmd_inspect(int argc, char **argv);
/* rlflow merge-lora: a base model plus a PEFT adapter written as one plain model directory. */
int rf_cmd_merge_lora(int argc, char **argv);
int rf_cmd_generate(int argc, char **argv);
int rf_cmd_score(int argc, char **argv);
int rf_cmd_data(int argc, char **argv);
int rf_cmd_run(int argc, char **argv);
int rf_cmd_sft(int argc, char **argv);
int rf_cmd_eval(int argc, char **argv);
int rf_cmd_keygen(int argc, char **argv);

/* "cpu" or "cuda" (device 0) -> back end; errors say why CUDA is unavailable. */
rf_status rf_cli_backend(const char *device, const rf_kernels **out);

/* Loads model and tokenizer from a Hugging Face directory on back end `device`, its products at
 * `precision` ("auto" | "fp32" | "bf16"; errors name --precision; the choice is logged). frozen:
 * the weights will not change (no adapter to attach): rf_model_load_frozen, which keeps a bf16
 * checkpoint's matrices in bf16 when running bf16. */
rf_status rf_cli_open(const char *dir, const char *device, const char *precision, int frozen, rf_model **m,
                      rf_tokenizer **tok);

/* EOS ids: generation_config.json, then config.json, then the tokenizer's. Returns count. */
int rf_cli_eos_ids(const char *dir, const rf_model *m, const rf_tokenizer *tok, int32_t *ids, int cap);

/* Prints a failed status and returns exit code 1. */
int rf_cli_fail(rf_status s);

/* Prints a usage error (the command line itself is wrong: an unknown option, a missing or
 * malformed value, a missing required argument) and returns exit code 2 (docs/cli.md). */
int rf_cli_usage_fail(rf_status s);

#endif
