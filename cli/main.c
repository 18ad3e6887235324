/* The rlflow command: dispatches to subcommands. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"

static void usage(void) {
    fputs("usage: rlflow <command> [options]\n"
          "commands:\n"
          "  run         post-train a policy with a recipe (PPO, GRPO, ...)\n"
          "  sft         supervised fine-tuning with a recipe\n"
          "  eval        greedy accuracy of a model on a JSONL data set\n"
          "  init-model  write a randomly initialised model directory in Hugging Face layout\n"
          "  inspect     show a model directory's config, parameters, tensors and tokenizer\n"
          "  generate    sample text from a model (KV cache, batched)\n"
          "  merge-lora  merge a LoRA adapter (PEFT layout) into its base model, as a plain model directory\n"
          "  score       per-token log-probs and entropy of a response, as JSON\n"
          "  data        write a built-in task's train/val JSONL (arith, countdown, multiply)\n"
          "  keygen      write a CURVE key pair for reward endpoints and programs\n"
          "run `rlflow <command> --help` for a command's options; `rlflow --version` for the version\n",
          stderr);
}

/* The jiffies of all CPUs (busy: all but idle and iowait) from /proc/stat's first line; 0 when
 * unreadable. */
static int cpu_jiffies(unsigned long long *busy, unsigned long long *total) {
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return 0;
    unsigned long long v[8] = {0};
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                   &v[6], &v[7]);
    fclose(f);
    if (n < 5) return 0;
    *total = 0;
    for (int i = 0; i < 8; i++) *total += v[i];
    *busy = *total - v[3] - v[4];
    return 1;
}

/* 1 when the machine looks idle now: its CPUs busy less than a quarter of 50 ms (a load average
 * lags by a minute: a build just before would count). */
static int machine_idle(void) {
    const char *force = getenv("RF_TEST_MACHINE_IDLE"); /* test hook: the answer, "1" or "0" */
    if (force && *force) return strcmp(force, "0") != 0;
    unsigned long long b0, t0, b1, t1;
    if (!cpu_jiffies(&b0, &t0)) return 0;
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    if (!cpu_jiffies(&b1, &t1) || t1 <= t0) return 0;
    return (double)(b1 - b0) < 0.25 * (double)(t1 - t0);
}

/* 1 for the commands that compute with the model (the others skip the 50 ms idle check). */
static int computes(int argc, char **argv) {
    static const char *const cmds[] = {"run", "sft", "eval", "generate", "score"};
    for (size_t i = 0; argc >= 2 && i < sizeof cmds / sizeof cmds[0]; i++)
        if (strcmp(argv[1], cmds[i]) == 0) return 1;
    return 0;
}

int main(int argc, char **argv) {
    /* OpenMP's idle threads spin by default. When anything else runs on the machine (a reward
     * program, another job, the processes of a split run) spinning threads take the cores
     * from the threads doing the work: measured on 2 cores at load 5.5, 150 GRPO steps took
     * 383 s spinning, 31 s sleeping (docs/training.md). Idle threads sleep unless the user
     * chose; but waking a sleeping thread is a system call per parallel region, which on a
     * machine that runs nothing else cost a small model's run a quarter of its time. So where
     * the machine is idle when rlflow starts, a thread first spins GOMP_SPINCOUNT = 1000 times
     * (about 10 us) before it sleeps; split runs' ranks, which share the cores, do not
     * (controller/launch.c, RLFLOW_SPIN_AUTO). libgomp reads both when the program loads, so
     * start again with them set. */
    if (!getenv("OMP_WAIT_POLICY") && setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0) {
        if (!getenv("GOMP_SPINCOUNT") && computes(argc, argv) && machine_idle()) {
            setenv("GOMP_SPINCOUNT", "1000", 1);
            setenv("RLFLOW_SPIN_AUTO", "1", 1);
        }
        execv("/proc/self/exe", argv); /* returns only on failure: go on as we are */
    }
    if (argc >= 2 && strcmp(argv[1], "--version") == 0) {
        printf("rlflow %s\n", RLFLOW_VERSION);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    static const struct { const char *name; int (*fn)(int, char **); } cmds[] = {
        {"init-model", rf_cmd_init_model}, {"inspect", rf_cmd_inspect},
        {"generate", rf_cmd_generate},     {"score", rf_cmd_score},
        {"data", rf_cmd_data},             {"run", rf_cmd_run},
        {"sft", rf_cmd_sft},               {"eval", rf_cmd_eval},
        {"keygen", rf_cmd_keygen},         {"merge-lora", rf_cmd_merge_lora}};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (strcmp(argv[1], cmds[i].name) == 0) return cmds[i].fn(argc - 2, argv + 2);
    fprintf(stderr, "error: unknown command \"%s\"\n", argv[1]);
    usage();
    return 2;
}
