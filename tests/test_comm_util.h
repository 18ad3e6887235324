/* Tests that run themselves under mpirun: the program started by ctest does its single-process
 * checks, then starts itself with `mpirun -np N --oversubscribe` for each N it asks for, and
 * counts each run's exit code as a check. Under mpirun every rank runs the checks, and the
 * ranks agree on pass/fail (the number of failed checks is summed over the world), so every
 * rank exits with the same code. Include after test_util.h and _POSIX_C_SOURCE 200809L. */
#ifndef RF_TEST_COMM_UTIL_H
#define RF_TEST_COMM_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "kernels/kernels.h"
#include "test_shell.h"
#include "test_util.h"

/* 1 when mpirun is installed. */
static inline int rf_test_have_mpirun(void) { return rf_test_sh(NULL, "command -v mpirun >/dev/null") == 0; }

/* Sanitizer builds: OpenMPI's components leak at exit and are unloaded before LeakSanitizer
 * reports, so their leaks show as "<unknown module>" and cannot be suppressed by name; the ranks
 * run without leak detection (address and UB checks stay on, and the single-process parts of
 * each test keep leak detection). */
#ifdef __SANITIZE_ADDRESS__
#define RF_TEST_MPI_ENV "ASAN_OPTIONS=detect_leaks=0 "
#else
#define RF_TEST_MPI_ENV ""
#endif

/* Runs this program under mpirun with np ranks (bounded: killed after limit_s); prints its
 * output; returns the exit code. */
static inline int rf_test_mpirun_self(int np, double limit_s, const char *extra_args) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return -1;
    self[n] = '\0';
    char *out = NULL;
    int rc = rf_test_sh(&out, RF_TEST_MPI_ENV "timeout %.0f mpirun -np %d --oversubscribe %s %s %s", limit_s, np,
                        geteuid() == 0 ? "--allow-run-as-root" : "", self, extra_args ? extra_args : "");
    printf("---- mpirun -np %d: exit code %d\n%s", np, rc, out ? out : "");
    free(out);
    return rc;
}

/* The CUDA back end on device 0 for a test run outside MPI, or NULL after printing the skip
 * line with the reason (no CUDA in the build, no GPU, the module not loadable): the test then
 * exits 77. */
static inline const rf_kernels *rf_test_gpu_or_skip(const char *name) {
    const rf_kernels *gpu = rf_cuda_kernels(0);
    if (!gpu) printf("%s: skipped: %s\n", name, rf_error_message());
    return gpu;
}

/* Under mpirun: MPI's world, or NULL after printing why not (name: the test's). */
static inline rf_comm *rf_test_mpi_world(int *argc, char ***argv, const char *name) {
    rf_comm *world = NULL;
    if (rf_comm_world(argc, argv, &world) == RF_OK) return world;
    fprintf(stderr, "%s: %s\n", name, rf_error_message());
    return NULL;
}

/* The MPI part of an update test: under mpirun with np[0], np[1], ... ranks (the ranks share
 * the cores: one thread each, idle threads asleep), each run's exit code a check; skipped with
 * a note without mpirun. Returns the test's exit code (rf_test_finish). */
static inline int rf_test_mpi_part(const char *name, const int *np, int n) {
    if (!rf_test_have_mpirun()) {
        printf("%s: MPI part skipped: mpirun not found (apt-get install openmpi-bin)\n", name);
        return rf_test_finish(name);
    }
    setenv("OMP_NUM_THREADS", "1", 1);
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    for (int i = 0; i < n; i++) CHECK(rf_test_mpirun_self(np[i], 300, NULL) == 0);
    return rf_test_finish(name);
}

/* Under mpirun: sums the failed checks over c's ranks; rank 0 prints the totals. Returns the
 * exit code every rank should use (0 all passed, 1 not). */
static inline int rf_test_mpi_finish(rf_comm *c, const char *name) {
    float counts[2] = {(float)rf_test_passed, (float)rf_test_failed}, sum[2] = {0, 0};
    rf_status st = rf_comm_allreduce(c, counts, sum, 2, 60, "agreeing on the test's result");
    if (st != RF_OK) {
        fprintf(stderr, "%s: rank %d: %s\n", name, rf_comm_rank(c), rf_error_message());
        return 1;
    }
    if (rf_comm_rank(c) == 0)
        printf("%s (%d ranks): %.0f passed, %.0f failed\n", name, rf_comm_size(c), sum[0], sum[1]);
    return sum[1] > 0 ? 1 : 0;
}

#endif
