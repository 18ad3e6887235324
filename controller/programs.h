/* Programs started by rlflow: a small supervisor for the helper processes a recipe names
 * (reward.programs today; environment programs can use it the same way), so that a user's
 * reward function in Python needs no second terminal.
 *
 * Each program is started with fork + execve in rlflow's working directory, in a process group
 * of its own (a Ctrl-C at the terminal reaches rlflow only, which finishes its step with the
 * programs' help and then stops them), with stdin from /dev/null, stdout and stderr appended to
 * a log file of its own, and the environment of rlflow plus the variables the caller gives
 * (the endpoint and keys it needs: docs/reward-api.md, "Programs started by rlflow"). On Linux
 * it also gets SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG), so an rlflow
 * killed at once (a second Ctrl-C, SIGKILL) leaves no program behind.
 *
 * rf_programs_poll restarts a program that exited (whatever its status: a program started by
 * rlflow runs until rlflow stops it), after a back-off that doubles each time (0.5 s, 1 s, 2 s,
 * ... at most 8 s), at most max_restarts times per program over the run; one more exit is an
 * error naming the program, its exit status and its log. rf_programs_stop ends them all:
 * a short wait for those already asked to leave (a reward program exits after rlflow's
 * Shutdown), then SIGTERM to each process group, SIGKILL after a grace period, and every
 * child reaped.
 *
 * Use (reward programs, controller/run_setup.c; an environment bridge would do the same with
 * its own key, log prefix and variables):
 *     const char *env[] = {"RLFLOW_REWARD_ENDPOINT=tcp://127.0.0.1:40123", ...};
 *     rf_programs_config pc = {.key = "reward.programs", .restarts_key = "reward.program_restarts",
 *         .argv = argvs, .n = n, .env = env, .n_env = 1, .rank_var = "RLFLOW_REWARD_RANK",
 *         .log_dir = run_dir, .log_prefix = "reward_program", .max_restarts = 3};
 *     rf_programs_start(&p, &pc);          // all started, or an error naming the one that failed
 *     ... rf_programs_poll(p) every fraction of a second while waiting on the programs
 *         (the reward bridge calls it through rf_external_reward_config.tick) ...
 *     rf_programs_stop(p);                 // at the end, on error and after Ctrl-C alike
 *
 * Threads: one thread at a time per object, and the thread that starts the programs should
 * outlive them (PR_SET_PDEATHSIG follows the starting thread). The module reaps only its own
 * children, by pid (waitpid(pid, ...)), never with waitpid(-1). */
#ifndef RF_PROGRAMS_H
#define RF_PROGRAMS_H

#include <sys/types.h>

#include "common/status.h"

typedef struct rf_programs rf_programs;

typedef struct rf_programs_config {
    const char *key;          /* the recipe key, for messages: "reward.programs" */
    const char *restarts_key; /* the key of max_restarts, for messages: "reward.program_restarts" */
    const char *const *const *argv; /* (n) each program's argv, NULL-terminated; argv[0] is
                                       searched in PATH unless it holds a '/' */
    int n;
    const char *const *env;   /* (n_env) "NAME=value" set in every program's environment */
    int n_env;
    const char *rank_var;     /* NULL, or a variable set to the program's index ("0", "1", ...) */
    const char *log_dir;      /* directory of the logs (made when missing) */
    const char *log_prefix;   /* program i writes <log_dir>/<log_prefix>_<i>.log */
    int max_restarts;         /* restarts allowed per program over the run (>= 0) */
    double backoff_s;         /* the first restart's delay; 0: 0.5 s (doubles, at most 8 s) */
    double grace_s;           /* SIGTERM to SIGKILL in rf_programs_stop; 0: 5 s */
} rf_programs_config;

/* Starts every program of cfg (its pointers are copied: the caller may free them afterwards).
 * Caller owns *p (rf_programs_stop). Errors, *p NULL and every program already started
 * stopped: RF_ERR_ARG (no argv, an empty argv[0]: "reward.programs[1]: ..."), RF_ERR_IO (the
 * log cannot be opened; argv[0] not found in PATH or not executable: `reward.programs[0]
 * ("pythn3 x.py"): cannot run "pythn3": not found in PATH`; fork or exec failed). */
rf_status rf_programs_start(rf_programs **p, const rf_programs_config *cfg);

/* Reaps programs that exited and starts again those whose back-off has passed. Does not
 * block. Errors: RF_ERR_IO when a program exited with its restarts spent ("reward.programs[0]
 * (python3 judge.py, pid 4242) exited with status 3 after 3 restarts, the limit
 * (reward.program_restarts = 3); its output is in run/reward_program_0.log, last line:
 * ..."), or a restart failed. NULL p: RF_OK. */
rf_status rf_programs_poll(rf_programs *p);

/* 1 once rf_programs_poll has failed (a program past its restarts, a failed restart): a
 * caller that sees an error from a wait that polled can tell the programs' error from its own. */
int rf_programs_failed(const rf_programs *p);

/* A pointer for rf_external_reward_config.tick: rf_programs_poll(ctx). */
rf_status rf_programs_tick(void *ctx);

/* The pid of program i now (0 while it waits for its restart or after stop; -1 for a bad i). */
pid_t rf_programs_pid(const rf_programs *p, int i);

/* How many times program i was restarted so far. */
int rf_programs_restarts(const rf_programs *p, int i);

/* The log file of program i (owned by p), or NULL for a bad i. */
const char *rf_programs_log(const rf_programs *p, int i);

/* Stops every program (header comment: a short wait, SIGTERM to the process group, SIGKILL
 * after grace_s), reaps them, and frees p. NULL is fine. */
void rf_programs_stop(rf_programs *p);

#endif
