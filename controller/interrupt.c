/* Graceful stop on SIGINT / SIGTERM (see controller/interrupt.h). */
#define _POSIX_C_SOURCE 200809L
#include "controller/interrupt.h"

#include <signal.h>
#include <string.h>

static volatile sig_atomic_t g_sig;       /* SIGINT / SIGTERM of the first stop; 0: none */
static volatile sig_atomic_t g_installed;
static struct sigaction g_old[4];
static const int g_sigs[4] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

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

int rf_interrupt_install(void) {
    if (g_installed) return 0;
    g_sig = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 4; i++) sigaction(g_sigs[i], &sa, &g_old[i]);
    g_installed = 1;
    return 1;
}

void rf_interrupt_restore(void) {
    if (!g_installed) return;
    for (int i = 0; i < 4; i++) sigaction(g_sigs[i], &g_old[i], NULL);
    g_installed = 0;
}

int rf_interrupt_signal(void) { return g_sig; }

void rf_interrupt_note(int sig) {
    if (!g_sig) g_sig = as_stop(sig);
}

int rf_interrupt_exit_code(void) { return g_sig ? 128 + g_sig : 0; }
