/* Graceful stop on SIGINT / SIGTERM (see controller/interrupt.h).
 *
 * Where the signals are taken. A handler runs on the stack of the thread the signal interrupts,
 * and the kernel writes the signal frame (the registers and the vector state: 2.7 KB with
 * AVX-512, 11 KB with AMX's tiles) below that thread's stack pointer. Some compute kernels use
 * the stack pointer for data: oneDNN 2.6's AVX-512 sgemm kernel (gemm:jit, which runs the
 * backward's fp32 products) points it at a heap workspace when K exceeds 2048, so a Ctrl-C that
 * lands on a thread inside it wrote the frame over the heap ("corrupted size vs. prev_size"
 * and an abort instead of a checkpoint, 1 run in 3 of test_run_stop on an AVX-512 CPU in fp32,
 * 2026-11-30). So while the handlers are installed the signals are blocked in the thread that
 * installs them and in its OpenMP team (threads it creates later inherit the mask), and a
 * thread of our own takes them with sigtimedwait, where no kernel runs. The handler stays
 * installed for any thread that does not block them (another library's, created earlier); such
 * a thread runs no compute kernel. */
#define _POSIX_C_SOURCE 200809L
#include "controller/interrupt.h"

#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

static volatile sig_atomic_t g_sig;       /* SIGINT / SIGTERM of the first stop; 0: none */
static volatile sig_atomic_t g_installed;
static struct sigaction g_old[4];
static const int g_sigs[4] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
static sigset_t g_set;           /* the four */
static sigset_t g_caller_mask;   /* the installing thread's mask before */
static pthread_t g_waiter;       /* the thread that takes them */
static int g_waiter_up;
static atomic_int g_quit;

static int as_stop(int sig) { return sig == SIGUSR1 ? SIGINT : sig == SIGUSR2 ? SIGTERM : sig; }

/* The first signal sets the flag; a second ends the process as the signal's default action
 * would (the shell then reports it as killed by that signal). */
static void on_signal(int sig) {
    if (g_sig) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    g_sig = as_stop(sig);
}

/* The waiting thread: the signals stay blocked in it, so a second one is unblocked here to
 * meet its default action. */
static void *waiter_main(void *arg) {
    (void)arg;
    while (!atomic_load(&g_quit)) {
        struct timespec ts = {0, 20 * 1000 * 1000}; /* restore waits at most this long */
        int sig = sigtimedwait(&g_set, NULL, &ts);
        if (sig <= 0) continue;
        if (!g_sig) {
            g_sig = as_stop(sig);
            continue;
        }
        signal(sig, SIG_DFL);
        sigset_t one;
        sigemptyset(&one);
        sigaddset(&one, sig);
        pthread_sigmask(SIG_UNBLOCK, &one, NULL);
        raise(sig);
    }
    return NULL;
}

/* The four blocked (how = SIG_BLOCK) or unblocked in the calling thread's OpenMP team, the
 * threads oneDNN and the kernels run on (the calling thread's own mask is set by the caller). */
static void team_mask(int how) {
    if (omp_in_parallel()) return;
#pragma omp parallel
    {
        if (omp_get_thread_num() != 0) pthread_sigmask(how, &g_set, NULL);
    }
}

int rf_interrupt_install(void) {
    if (g_installed) return 0;
    g_sig = 0;
    sigemptyset(&g_set);
    for (int i = 0; i < 4; i++) sigaddset(&g_set, g_sigs[i]);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 4; i++) sigaction(g_sigs[i], &sa, &g_old[i]);
    pthread_sigmask(SIG_BLOCK, &g_set, &g_caller_mask);
    team_mask(SIG_BLOCK);
    atomic_store(&g_quit, 0);
    g_waiter_up = pthread_create(&g_waiter, NULL, waiter_main, NULL) == 0;
    if (!g_waiter_up) { /* no thread: the handler takes them on whichever thread they land */
        team_mask(SIG_UNBLOCK);
        pthread_sigmask(SIG_SETMASK, &g_caller_mask, NULL);
    }
    g_installed = 1;
    return 1;
}

void rf_interrupt_restore(void) {
    if (!g_installed) return;
    if (g_waiter_up) {
        atomic_store(&g_quit, 1);
        pthread_join(g_waiter, NULL);
        g_waiter_up = 0;
        /* one that came after the waiter's last look is noted, not left to the old handler */
        struct timespec zero = {0, 0};
        int sig;
        while ((sig = sigtimedwait(&g_set, NULL, &zero)) > 0) rf_interrupt_note(sig);
        team_mask(SIG_UNBLOCK);
        pthread_sigmask(SIG_SETMASK, &g_caller_mask, NULL);
    }
    for (int i = 0; i < 4; i++) sigaction(g_sigs[i], &g_old[i], NULL);
    g_installed = 0;
}

int rf_interrupt_signal(void) { return g_sig; }

void rf_interrupt_note(int sig) {
    if (!g_sig) g_sig = as_stop(sig);
}

int rf_interrupt_exit_code(void) { return g_sig ? 128 + g_sig : 0; }
