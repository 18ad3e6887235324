/* The stop signals (controller/interrupt.c):
 *  1. A SIGINT that lands while the back end runs a product must not touch the heap. oneDNN's
 *     AVX-512 fp32 gemm (the backward's dW products, K = tokens over 2048) points the stack
 *     pointer at a heap workspace, and the signal frame a handler gets is written below the
 *     stack pointer of the thread it interrupts: with the handler taking SIGINT on the computing
 *     threads, 300 trials (one SIGINT each, 0-3 ms into a stream of such products) ended in
 *     "corrupted size vs. prev_size" and an abort, every time it was tried on an AVX-512 CPU.
 *     Now the signals are taken by a thread of interrupt.c's own; each trial must see the stop
 *     noted (SIGINT, exit code 130), the products' result unchanged, and the heap intact.
 *  2. After rf_interrupt_restore the signals are unblocked again in the thread and its OpenMP
 *     team, and the previous handlers are back.
 *  3. SIGUSR1 / SIGUSR2 (what mpirun passes a stop on as) read as SIGINT / SIGTERM; a second
 *     signal ends the process as the signal would (a child, killed by SIGTERM); installing
 *     twice returns 0. */
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "controller/interrupt.h"
#include "kernels/kernels.h"
#include "test_util.h"

static void nap_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void *send_one(void *arg) {
    long us = *(long *)arg;
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
    kill(getpid(), SIGINT);
    return NULL;
}

static int blocked_here(int sig) {
    sigset_t cur;
    pthread_sigmask(SIG_BLOCK, NULL, &cur);
    return sigismember(&cur, sig) == 1;
}

/* Whether sig is blocked in any thread of the calling thread's OpenMP team. */
static int blocked_in_team(int sig) {
    int any = 0;
#pragma omp parallel reduction(| : any)
    any |= blocked_here(sig);
    return any;
}

static void stop_during_products(void) {
    const rf_kernels *k = rf_cpu_kernels();
    CHECK_OK(k->set_precision(RF_PRECISION_FP32));
    enum { T = 4096, C = 64, OC = 64, TRIALS = 300 };
    float *dout = malloc(sizeof(float) * T * OC), *inp = malloc(sizeof(float) * T * C);
    float *dw = calloc(OC * C, sizeof(float)), *w = calloc(OC * C, sizeof(float));
    float *ref = calloc(OC * C, sizeof(float));
    for (int i = 0; i < T * OC; i++) dout[i] = (float)(i % 7) * 0.125f;
    for (int i = 0; i < T * C; i++) inp[i] = (float)(i % 5) * 0.25f;
    k->matmul_backward(NULL, ref, NULL, dout, inp, w, T, C, OC); /* one product's result */
    unsigned seed = 7;
    int noted = 0, same = 0, products = 0;
    for (int t = 0; t < TRIALS; t++) {
        CHECK(rf_interrupt_install() == 1);
        long us = (long)(rand_r(&seed) % 3000);
        pthread_t th;
        CHECK(pthread_create(&th, NULL, send_one, &us) == 0);
        int mine = 0, ok = 1;
        while (!rf_interrupt_signal() && mine < 100000) { /* dw = the product, again and again */
            memset(dw, 0, sizeof(float) * OC * C);
            k->matmul_backward(NULL, dw, NULL, dout, inp, w, T, C, OC);
            ok &= memcmp(dw, ref, sizeof(float) * OC * C) == 0;
            mine++;
        }
        pthread_join(th, NULL);
        rf_interrupt_restore();
        noted += rf_interrupt_signal() == SIGINT && rf_interrupt_exit_code() == 130;
        same += ok;
        products += mine;
        void *p = malloc(1 << 20); /* the heap after each trial */
        CHECK(p != NULL);
        free(p);
    }
    printf("stops during products: %d trials, %d products, the stop noted in %d, results unchanged in %d\n", TRIALS,
           products, noted, same);
    CHECK(noted == TRIALS);
    CHECK(same == TRIALS);
    CHECK(!blocked_here(SIGINT) && !blocked_here(SIGTERM) && !blocked_here(SIGUSR1) && !blocked_here(SIGUSR2));
    CHECK(!blocked_in_team(SIGINT) && !blocked_in_team(SIGUSR2));
    free(dout), free(inp), free(dw), free(w), free(ref);
}

static volatile sig_atomic_t g_old_handler_ran;
static void old_handler(int sig) { g_old_handler_ran = sig; }

static void handlers_and_signals(void) {
    /* the previous handler back after restore */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = old_handler;
    sigaction(SIGUSR1, &sa, NULL);
    CHECK(rf_interrupt_install() == 1);
    CHECK(rf_interrupt_install() == 0); /* installed already */
    CHECK(blocked_here(SIGINT) && blocked_in_team(SIGTERM));
    kill(getpid(), SIGUSR1);
    for (int i = 0; i < 200 && !rf_interrupt_signal(); i++) nap_ms(5);
    CHECK(rf_interrupt_signal() == SIGINT); /* SIGUSR1 reads as SIGINT */
    rf_interrupt_restore();
    CHECK(g_old_handler_ran == 0);
    raise(SIGUSR1);
    CHECK(g_old_handler_ran == SIGUSR1);
    signal(SIGUSR1, SIG_DFL);

    CHECK(rf_interrupt_install() == 1);
    CHECK(rf_interrupt_signal() == 0); /* a fresh install asks for no stop */
    kill(getpid(), SIGUSR2);
    for (int i = 0; i < 200 && !rf_interrupt_signal(); i++) nap_ms(5);
    CHECK(rf_interrupt_signal() == SIGTERM && rf_interrupt_exit_code() == 143);
    rf_interrupt_restore();

    /* a second signal ends the process as SIGTERM would: this program again, fresh (a forked
     * copy of a process that ran OpenMP must not start a parallel region) */
    pid_t pid = fork();
    if (pid == 0) {
        execl("/proc/self/exe", "test_interrupt", "second", (char *)NULL);
        _exit(126);
    }
    int ws = 0;
    CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid);
    CHECK(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGTERM);
}

/* The child of handlers_and_signals: a stop, then a second signal; exits 0 only if it lives. */
static int second_signal(void) {
    rf_interrupt_install();
    kill(getpid(), SIGTERM);
    for (int i = 0; i < 200 && !rf_interrupt_signal(); i++) nap_ms(5);
    kill(getpid(), SIGTERM);
    nap_ms(5000);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "second") == 0) return second_signal();
    alarm(180); /* a corrupted heap can also hang malloc: end it (SIGALRM) rather than wait */
    stop_during_products();
    handlers_and_signals();
    return rf_test_finish("test_interrupt");
}
