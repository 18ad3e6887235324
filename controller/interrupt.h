/* Graceful stop on SIGINT / SIGTERM (Ctrl-C, `kill`, a batch scheduler's stop): the first
 * signal asks the run to stop at the next clean point (the current step finishes or is
 * abandoned, a checkpoint is written, the run says so and exits 128 + the signal: 130 for
 * SIGINT, 143 for SIGTERM); a second one ends the process at once, as the signal would have.
 *
 * Split runs: rlflow's launcher keeps mpirun out of the terminal's process group and passes a
 * stop on as SIGUSR1 (for SIGINT) or SIGUSR2 (for SIGTERM), which mpirun forwards to every
 * rank; every rank treats SIGUSR1 as SIGINT and SIGUSR2 as SIGTERM. The controller rank stops
 * the run and tells the workers (Shutdown RF_MSG_SHUTDOWN_INTERRUPTED); the worker ranks only
 * note the signal and go on until the controller's Shutdown, so none dies before the
 * checkpoint. docs/training.md, "Stopping a run".
 *
 * Threads: the flag is a sig_atomic_t; every function may be called from any thread. While
 * installed, the four signals are blocked in the installing thread and its OpenMP team (and so
 * in the threads they start) and taken by a thread of the module's own (interrupt.c: a signal
 * frame written where a compute kernel keeps its stack pointer corrupted the heap); the
 * handler takes them on any other thread that does not block them. Install and restore from
 * the same thread, outside a parallel region. */
#ifndef RF_INTERRUPT_H
#define RF_INTERRUPT_H

/* Installs the handlers (SIGINT, SIGTERM, SIGUSR1, SIGUSR2), with no stop asked for yet, and
 * returns 1; returns 0 (and changes nothing) when they are installed already. */
int rf_interrupt_install(void);

/* Puts the previous handlers and signal masks back (the flag keeps its value; a signal that
 * arrived meanwhile is noted). */
void rf_interrupt_restore(void);

/* SIGINT or SIGTERM once a stop was asked for (SIGUSR1 / SIGUSR2 read as those); 0 before. */
int rf_interrupt_signal(void);

/* Records a stop that arrived another way (the launcher, from the run's status file). */
void rf_interrupt_note(int sig);

/* The exit status of a command that stopped on a signal: 128 + the signal (130, 143); 0 when
 * no stop was asked for. */
int rf_interrupt_exit_code(void);

#endif
