/* Split runs across two machines, simulated on this one: two network namespaces joined by a
 * veth pair, each "machine" with its own host name, PID namespace and /etc/hosts (a mount
 * namespace), so that rlflow and OpenMPI see two hosts that share no memory (rlflow's
 * shared-memory readers key on the PID namespace) and talk over TCP. mpirun starts on nodeA
 * and reaches nodeB through an rsh agent, as it would through ssh (docs/deployment.md).
 *   - data parallel (dp 2, tp 1): the controller and both training ranks on nodeA, the two
 *     rollout workers on nodeB: the rank table names each rank's host, the weights go to both
 *     through messages (nothing read in place across machines), the controller checks every
 *     version's checksum, and the run ends;
 *   - tp 2 x dp 2 with a rankfile: replica 0 and rollout worker 0 on nodeA, replica 1 and
 *     rollout worker 1 on nodeB: the weights' planner sends each rollout worker its blocks from
 *     the replica on its own machine (0.0 MB between machines; rollout worker 0 reads its shard
 *     in place), checkpoints written by rank 1 from shards on nodeA, and --resume goes on from
 *     the checkpoint with its CRC-32C as the first weights.
 * Skips (77) without root (network namespaces), ip, unshare or mpirun, and when the namespaces
 * cannot be made (a container without the privilege). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_comm_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256], ns[2][32], mpirun_opts[1024];

/* enter.sh NODE CMD...: CMD as if on machine NODE; agent.sh: OpenMPI's rsh agent, which runs
 * orted in the foreground (a daemon would die with its PID namespace's first process). */
static int write_scripts(int net) {
    char p[400];
    snprintf(p, sizeof p, "%s/hosts", dir);
    FILE *f = fopen(p, "w");
    if (!f) return -1;
    fprintf(f, "127.0.0.1 localhost\n10.213.%d.1 nodeA\n10.213.%d.2 nodeB\n", net, net);
    fclose(f);
    snprintf(p, sizeof p, "%s/enter.sh", dir);
    if (!(f = fopen(p, "w"))) return -1;
    fprintf(f, "#!/bin/sh\nnode=$1; shift\ncase $node in nodeA) ns=%s;; *) ns=%s;; esac\n"
               "exec ip netns exec $ns unshare --uts --pid --fork --mount-proc --mount sh -c "
               "'mount --bind %s/hosts /etc/hosts && hostname \"$0\" && exec \"$@\"' \"$node\" \"$@\"\n",
            ns[0], ns[1], dir);
    fclose(f);
    snprintf(p, sizeof p, "%s/agent.sh", dir);
    if (!(f = fopen(p, "w"))) return -1;
    fprintf(f, "#!/bin/sh\nwhile [ \"${1#-}\" != \"$1\" ]; do shift; done\nhost=$1; shift\n"
               "cmd=$(echo \"$*\" | sed 's/ --daemonize//')\nexec %s/enter.sh \"$host\" sh -c \"$cmd\"\n", dir);
    fclose(f);
    return rf_test_sh(NULL, "chmod +x %s/enter.sh %s/agent.sh", dir, dir);
}

/* The two machines; 0 when they exist and a command runs on each. */
static int make_machines(void) {
    int net = (int)(getpid() % 250) + 1;
    snprintf(ns[0], sizeof ns[0], "rfmA%d", (int)getpid());
    snprintf(ns[1], sizeof ns[1], "rfmB%d", (int)getpid());
    if (write_scripts(net) != 0) return -1;
    int rc = rf_test_sh(NULL,
                        "ip netns add %s && ip netns add %s && "
                        "ip link add va%d netns %s type veth peer name vb%d netns %s && "
                        "ip -n %s addr add 10.213.%d.1/24 dev va%d && ip -n %s addr add 10.213.%d.2/24 dev vb%d && "
                        "ip -n %s link set lo up && ip -n %s link set lo up && "
                        "ip -n %s link set va%d up && ip -n %s link set vb%d up && "
                        "%s/enter.sh nodeA true && %s/enter.sh nodeB true",
                        ns[0], ns[1], (int)getpid(), ns[0], (int)getpid(), ns[1], ns[0], net, (int)getpid(), ns[1],
                        net, (int)getpid(), ns[0], ns[1], ns[0], (int)getpid(), ns[1], (int)getpid(), dir, dir);
    snprintf(mpirun_opts, sizeof mpirun_opts,
             "--allow-run-as-root --oversubscribe --mca plm_rsh_agent %s/agent.sh --mca plm_rsh_no_tree_spawn 1 "
             "--mca oob_tcp_if_include 10.213.%d.0/24 --mca btl_tcp_if_include 10.213.%d.0/24",
             dir, net, net);
    return rc;
}

static void remove_machines(void) {
    rf_test_sh(NULL, "ip netns del %s; ip netns del %s", ns[0], ns[1]);
}

/* `rlflow run r.toml <args>` under mpirun on nodeA with `hosts` (mpirun's placement options),
 * logging into dir/<run>; its output into *out. */
static int run_on_machines(char **out, const char *hosts, int np, const char *run, const char *args) {
    /* sanitizer builds: the ranks without leak detection (test_comm_util.h), on nodeB too (-x) */
    return rf_test_sh(out, "cd %s && " RF_TEST_MPI_ENV "timeout 600 %s/enter.sh nodeA mpirun %s %s %s -np %d %s run r.toml %s "
                           "--set logging.dir=%s/%s",
                      dir, dir, mpirun_opts, RF_TEST_MPI_ENV[0] ? "-x ASAN_OPTIONS" : "", hosts, np, rlflow, args, dir,
                      run);
}

static void expect_all(const char *what, const char *out, const char **want, size_t n) {
    if (!rf_test_has_all(out, want, n)) fprintf(stderr, "%s: output was:\n%s\n", what, out);
}

/* Training on nodeA, generation on nodeB. */
static void data_parallel(void) {
    char *out = NULL;
    int rc = run_on_machines(&out, "-H nodeA:3,nodeB:2", 5, "dp", "--set placement.actor.dp=2 --set train.steps=10");
    CHECK(rc == 0);
    const char *want[] = {
        "  rank 0: controller (nodeA, pid ",
        "  rank 1: training worker, data-parallel rank 0 of 2 (actor) on nodeA",
        "  rank 2: training worker, data-parallel rank 1 of 2 (actor) on nodeA",
        "  rank 3: rollout worker 0 on nodeB",
        "  rank 4: rollout worker 1 on nodeB",
        "warning: weights from rank 0 come through messages: shared memory of pid ",
        "weights to 2 rollout worker(s): 0 read the stage in place (same host, one copy), 2 through messages",
        "done: 10 steps in ",
    };
    expect_all("data parallel over two machines", out, want, sizeof want / sizeof *want);
    free(out);
}

/* A replica and a rollout worker on each machine; then --resume. */
static void grid(void) {
    char rankfile[400], *out = NULL;
    snprintf(rankfile, sizeof rankfile, "%s/rankfile", dir);
    FILE *f = fopen(rankfile, "w");
    if (!f) {
        CHECK(0);
        return;
    }
    fprintf(f, "rank 0=nodeA slot=0\nrank 1=nodeA slot=0\nrank 2=nodeA slot=1\nrank 3=nodeB slot=0\n"
               "rank 4=nodeB slot=1\nrank 5=nodeA slot=1\nrank 6=nodeB slot=0\n");
    fclose(f);
    char hosts[600];
    snprintf(hosts, sizeof hosts, "-H nodeA:4,nodeB:3 --rankfile %s", rankfile);
    const char *layout = "--set placement.actor.dp=2 --set placement.actor.tp=2";
    char args[300];
    snprintf(args, sizeof args, "%s --set train.steps=10 --set checkpoint.every=5", layout);
    int rc = run_on_machines(&out, hosts, 7, "grid", args);
    CHECK(rc == 0);
    const char *want[] = {
        "  rank 1: training worker, data-parallel replica 0 of 2, tensor-parallel rank 0 of 2 (actor shard 0 of 2) on nodeA",
        "  rank 2: training worker, data-parallel replica 0 of 2, tensor-parallel rank 1 of 2 (actor shard 1 of 2) on nodeA",
        "  rank 3: training worker, data-parallel replica 1 of 2, tensor-parallel rank 0 of 2 (actor shard 0 of 2) on nodeB",
        "  rank 4: training worker, data-parallel replica 1 of 2, tensor-parallel rank 1 of 2 (actor shard 1 of 2) on nodeB",
        "  rank 5: rollout worker 0 on nodeA",
        "  rank 6: rollout worker 1 on nodeB",
        "weights: training rank 0 sends to 1 rollout rank(s): 1 read its shard in place (same host, one copy), 0 through "
        "messages; a version moves ",
        " MB of it between machines",
        "checkpoint of step 10 gathered from 2 shards (the weights sent as version 10, CRC-32C ",
        "done: 10 steps in ",
    };
    expect_all("tp x dp over two machines", out, want, sizeof want / sizeof *want);
    const char *across = out ? strstr(out, " MB between ranks, ") : NULL, *none = " MB between ranks, 0.0 MB of it between machines";
    CHECK(across && strncmp(across, none, strlen(none)) == 0);
    long saved = out ? rf_test_crc_after(out, "checkpoint of step 10 gathered from 2 shards (the weights sent as version 10, CRC-32C ") : -1;
    free(out);
    snprintf(args, sizeof args, "%s --set train.steps=12 --resume", layout);
    rc = run_on_machines(&out, hosts, 7, "grid", args);
    CHECK(rc == 0);
    long resumed = out ? rf_test_crc_after(out, "training worker: weights version 10 (CRC-32C ") : -1;
    CHECK(saved >= 0 && resumed == saved);
    const char *want2[] = {"resumed at step 10", "done: "};
    expect_all("resumed over two machines", out, want2, sizeof want2 / sizeof *want2);
    printf("tp x dp over two machines: checkpoint of step 10 CRC-32C %08lx, first weights after --resume %08lx\n",
           (unsigned long)saved, (unsigned long)resumed);
    free(out);
}

int main(void) {
    int rc = rf_test_split_start("test_split_machines", &rlflow, dir, sizeof dir);
    if (rc) return rc;
    if (geteuid() != 0 || rf_test_sh(NULL, "command -v ip && command -v unshare") != 0) {
        printf("test_split_machines: skipped: needs root, ip (iproute2) and unshare to simulate two machines\n");
        rf_remove_tree(dir);
        return 77;
    }
    if (make_machines() != 0) {
        printf("test_split_machines: skipped: could not make two network namespaces here (no privilege?)\n");
        remove_machines();
        rf_remove_tree(dir);
        return 77;
    }
    rf_test_write_recipe(dir, RF_TEST_VAL_ENDS, "[placement]\nmode = \"split\"\nrollout_ranks = 2\n");
    data_parallel();
    grid();
    remove_machines();
    if (!rf_test_failed) rf_remove_tree(dir);
    return rf_test_finish("test_split_machines");
}
