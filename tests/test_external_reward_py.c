/* examples/reward/length_judge.py, the documented Python reward program, against
 * reward/external.c: it connects over loopback TCP, scores a batch of 50 with
 * 1 - |len - target| / target (checked to 1e-6: the program computes in double and sends a
 * float, so the only error is the float rounding, < 6e-8 relative), sends its info strings,
 * and exits 0 on Shutdown. A second instance claiming another protocol is impossible to make
 * from outside, so the mismatch path is covered in C (test_msg, test_external_reward).
 * Skipped (77) when no python3 with pyzmq is found. */
#define _POSIX_C_SOURCE 200809L
#include <unistd.h>

#include "common/util.h"
#include "reward/external.h"
#include "spawn_util.h"
#include "test_shell.h"
#include "test_util.h"

#define N_ITEMS 50
#define TARGET 8

/* A python3 that imports zmq: the one in PATH, else Debian's. */
static const char *find_python(void) {
    static const char *cands[] = {"python3", "/usr/bin/python3"};
    for (int i = 0; i < 2; i++)
        if (rf_test_sh(NULL, "%s -c 'import zmq' >/dev/null", cands[i]) == 0) return cands[i];
    return NULL;
}

int main(void) {
    alarm(60);
    const char *src = getenv("RF_SOURCE_DIR"), *py = find_python();
    if (!src || !py) {
        printf("test_external_reward_py: %s; skipped\n",
               !src ? "RF_SOURCE_DIR not set (run through ctest)" : "no python3 with pyzmq");
        return 77;
    }
    char script[1024], log[256];
    snprintf(script, sizeof script, "%s/examples/reward/length_judge.py", src);
    snprintf(log, sizeof log, "/tmp/rf_test_ext_py_%d.log", (int)getpid());

    rf_external_reward *x = NULL;
    CHECK_OK(rf_external_reward_listen(&x, "tcp://127.0.0.1:*", 10));
    if (!x) return rf_test_finish("test_external_reward_py");
    char *argv[] = {(char *)py, script, "--connect", (char *)rf_external_reward_endpoint(x),
                    "--target", "8", "--capacity", "4", NULL};
    pid_t pid = rf_test_spawn(argv, log);
    CHECK(pid > 0);
    CHECK_OK(rf_external_reward_wait(x, 1, 15));

    static int32_t ids[N_ITEMS][20];
    rf_reward_item it[N_ITEMS];
    for (int i = 0; i < N_ITEMS; i++) {
        int n = i % 17;
        for (int j = 0; j < n; j++) ids[i][j] = -5 + 70000 * j;  /* negative and multi-byte ids */
        it[i] = (rf_reward_item){.prompt = "say something", .response = "\xc3\xa9t\xc3\xa9",
                                 .response_ids = ids[i], .n_response_ids = n, .index = i % 4,
                                 .group = i / 4};
    }
    float r[N_ITEMS];
    double t0 = rf_time_now();
    CHECK_OK(rf_external_reward_score(x, it, N_ITEMS, r));
    printf("50 rewards from length_judge.py in %.2f s\n", rf_time_now() - t0);
    for (int i = 0; i < N_ITEMS; i++) {
        int len = i % 17 ? i % 17 : 3;  /* no token ids: "été" counts 3 characters */
        CHECK_CLOSE(r[i], 1.0 - fabs((double)len - TARGET) / TARGET, 1e-6, 0);
    }
    CHECK(!strcmp(rf_external_reward_info(x, 3), "len 3, target 8"));
    /* a second batch on the same connection */
    CHECK_OK(rf_external_reward_score(x, it + 16, 2, r));
    CHECK_CLOSE(r[0], 1.0 - 8.0 / 8.0, 1e-6, 0);
    CHECK_CLOSE(r[1], 1.0 - 5.0 / 8.0, 1e-6, 0);

    rf_external_reward_close(x);
    CHECK(rf_test_wait(pid, 5) == 0);
    char *out = rf_test_slurp(log);
    CHECK(strstr(out, "shutdown") != NULL);
    if (rf_test_failed) fprintf(stderr, "length_judge.py said:\n%s\n", out);
    free(out);
    unlink(log);
    return rf_test_finish("test_external_reward_py");
}
