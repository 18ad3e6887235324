/* Split runs: starting mpirun, taking a role from the rank, wiring ZeroMQ and MPI. */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/worker.h"
#include "comm/comm.h"
#include "common/log.h"
#include "common/msg.h"
#include "common/util.h"
#include "controller/advantages.h"
#include "controller/controller.h"
#include "controller/interrupt.h"
#include "controller/launch.h"
#include "controller/run_internal.h"
#include "kernels/kernels.h"
#include "rollout/worker.h"

#define HOST_LEN 256

/* <logging.dir>/run_status.json: how the split run ended, for the process that launched
 * mpirun (whose exit code does not carry it reliably). */
static int g_status_written;

static void write_status(const rf_recipe *r, rf_status st) {
    g_status_written = 1;
    rf__write_run_status(r, st);
}

static rf_status read_status(const rf_recipe *r, int mpirun_rc) {
    char p[4200], *text = NULL;
    snprintf(p, sizeof p, "%s/run_status.json", r->logging.dir);
    if (rf_read_file(p, &text, NULL) != RF_OK)
        return rf_error(RF_ERR_IO, "the split run ended without a result (mpirun exit status %d); the messages above say why",
                        mpirun_rc);
    cJSON *j = cJSON_Parse(text);
    free(text);
    const cJSON *s = cJSON_GetObjectItem(j, "status"), *m = cJSON_GetObjectItem(j, "message");
    rf_status st = RF_OK;
    const cJSON *sig = cJSON_GetObjectItem(j, "signal");
    if (!cJSON_IsString(s)) {
        st = rf_error(RF_ERR_FORMAT, "%s: no status", p);
    } else if (!strcmp(s->valuestring, "interrupted")) {
        /* rank 0 said where the checkpoint is; the exit status tells the signal */
        rf_interrupt_note(cJSON_IsNumber(sig) ? sig->valueint : SIGINT);
        rf_error_clear();
        st = RF_ERR_IO;
    } else if (strcmp(s->valuestring, "ok") != 0)
        st = rf_error(RF_ERR_IO, "%s", cJSON_IsString(m) ? m->valuestring : "the split run failed");
    cJSON_Delete(j);
    return st;
}

static void exit_now(int sig) {
    (void)sig;
    _exit(1);
}

/* The launcher's side of a graceful stop (controller/interrupt.h): mpirun runs in a process
 * group of its own, so a Ctrl-C at the terminal reaches this process only (mpirun would kill
 * the job on SIGINT); the first SIGINT / SIGTERM goes on to mpirun as SIGUSR1 / SIGUSR2, which
 * it forwards to every rank (the controller rank then stops the run with a checkpoint), a
 * second as SIGTERM (mpirun then kills the job; the ranks, signalled twice, end at once). */
static pid_t g_child;
static volatile sig_atomic_t g_forwarded;
static void forward_signal(int sig) {
    if (g_child <= 0) return;
    if (g_forwarded++) {
        kill(g_child, SIGTERM);
        return;
    }
    rf_interrupt_note(sig);
    kill(g_child, sig == SIGTERM ? SIGUSR2 : SIGUSR1);
}

/* Training worker processes: dp data-parallel replicas of tp tensor-parallel ranks each. */
static int train_ranks(const rf_recipe *r) { return r->placement.actor.dp * r->placement.actor.tp; }

/* Rollout processes: placement.rollout.tp ranks per rollout worker; none in a colocated run,
 * whose rollout ranks are threads of the training ranks' processes. */
static int rollout_procs(const rf_recipe *r) {
    return rf_recipe_colocated_ranks(r) ? 0 : r->placement.rollout_ranks * r->placement.rollout.tp;
}

static rf_status relaunch(const rf_recipe *r, int argc, char **argv) {
    int np = 1 + train_ranks(r) + rollout_procs(r);
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return rf_error(RF_ERR_IO, "cannot find the rlflow program (/proc/self/exe)");
    self[n] = '\0';
    char **av = calloc((size_t)argc + 16, sizeof *av);
    if (!av) return rf_error(RF_ERR_NOMEM, "out of memory");
    char nps[16];
    snprintf(nps, sizeof nps, "%d", np);
    int k = 0;
    av[k++] = r->placement.mpirun;
    av[k++] = "-np", av[k++] = nps;
    av[k++] = "--oversubscribe";
    av[k++] = "--bind-to", av[k++] = "none";
    if (geteuid() == 0) av[k++] = "--allow-run-as-root";
    av[k++] = self;
    for (int i = 1; i < argc; i++) av[k++] = argv[i];
    av[k] = NULL;
    /* OpenMP threads sleep when idle: the processes share the cores (a spin rlflow chose for an
     * idle machine, cli/main.c, each rank drops in rf_run_split) */
    setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
    /* a rank that dies does not take the others down at once: the controller notices the lost
     * worker itself (heartbeats, failed sends), names it, and stops the run cleanly */
    setenv("OMPI_MCA_orte_enable_recovery", "1", 0);
    /* (mpirun then prints "PMIX ERROR: BAD-PARAM" when a rank exits non-zero; exiting 0
     * instead was tried: it lost the notice that stops the other ranks sooner, and a killed
     * rank's run stopped in 21-27 s instead of 16.5) */
    char line[8192];
    size_t off = 0;
    for (int i = 0; av[i] && off < sizeof line - 1; i++)
        off += (size_t)snprintf(line + off, sizeof line - off, "%s%s", i ? " " : "", av[i]);
    if (rf_recipe_colocated_ranks(r))
        rf_log_info("colocated run: %d processes (controller, and %d training ranks (placement.actor.dp x placement.actor.tp "
                    "= %d x %d), one per device, each also running a rank of the %d rollout workers%s, taking turns): %s",
                    np, train_ranks(r), r->placement.actor.dp, r->placement.actor.tp, r->placement.rollout_ranks,
                    r->placement.rollout.tp > 1 ? " of several tensor-parallel ranks" : "", line);
    else if (r->placement.actor.dp > 1 && r->placement.actor.tp > 1)
        rf_log_info("split run: %d processes (controller, %d training workers: %d data-parallel replicas of %d "
                    "tensor-parallel ranks, %d rollout workers%s): %s", np, train_ranks(r), r->placement.actor.dp,
                    r->placement.actor.tp, r->placement.rollout_ranks, r->placement.rollout.tp > 1 ? " of several tensor-parallel ranks" : "", line);
    else if (r->placement.rollout.tp > 1)
        rf_log_info("split run: %d processes (controller, %d training workers, %d rollout workers of %d tensor-parallel ranks): %s",
                    np, train_ranks(r), r->placement.rollout_ranks, r->placement.rollout.tp, line);
    else if (r->placement.actor.dp > 1)
        rf_log_info("split run: %d processes (controller, %d data-parallel training workers, %d rollout workers): %s",
                    np, r->placement.actor.dp, r->placement.rollout_ranks, line);
    else if (r->placement.actor.tp > 1)
        rf_log_info("split run: %d processes (controller, %d tensor-parallel training workers, %d rollout workers): %s",
                    np, r->placement.actor.tp, r->placement.rollout_ranks, line);
    else
        rf_log_info("split run: %d processes (controller, training worker, %d rollout workers): %s",
                    np, r->placement.rollout_ranks, line);
    fflush(stdout), fflush(stderr);
    char sp[4200];
    snprintf(sp, sizeof sp, "%s/run_status.json", r->logging.dir);
    unlink(sp);
    int fds[2];
    if (pipe(fds) != 0) {
        free(av);
        return rf_error(RF_ERR_IO, "pipe: %s", strerror(errno));
    }
    fcntl(fds[1], F_SETFD, FD_CLOEXEC);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        setpgid(0, 0); /* out of the terminal's process group: Ctrl-C reaches the launcher only */
        sigset_t none; /* mpirun takes the signals a stop is passed on with (interrupt.c blocks them) */
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        int null = open("/dev/null", O_RDONLY); /* a background group must not read the terminal */
        if (null >= 0) dup2(null, 0), close(null);
        execvp(av[0], av);
        int e = errno;
        ssize_t w = write(fds[1], &e, sizeof e);
        (void)w;
        _exit(127);
    }
    close(fds[1]);
    free(av);
    if (pid < 0) {
        close(fds[0]);
        return rf_error(RF_ERR_IO, "fork: %s", strerror(errno));
    }
    int exec_err = 0;
    ssize_t got = read(fds[0], &exec_err, sizeof exec_err);
    close(fds[0]);
    g_child = pid, g_forwarded = 0;
    struct sigaction sa = {0}, oi, ot;
    sa.sa_handler = forward_signal;
    sigaction(SIGINT, &sa, &oi);
    sigaction(SIGTERM, &sa, &ot);
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
    }
    sigaction(SIGINT, &oi, NULL);
    sigaction(SIGTERM, &ot, NULL);
    g_child = 0;
    if (got == (ssize_t)sizeof exec_err)
        return rf_error(RF_ERR_IO, "placement.mpirun: cannot start \"%s\": %s (install openmpi-bin)",
                        r->placement.mpirun, strerror(exec_err));
    return read_status(r, WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws));
}

/* Default threads: the training workers (dp or tp of them) an even share of the machine's cores,
 * all of them when there is one, each rollout worker an even share with the training workers
 * (OMP_WAIT_POLICY=PASSIVE: idle threads sleep, so a rollout worker waiting for prompts leaves
 * its cores to training). Colocated (the two kinds take turns): each an even share among its
 * own kind. */
static int default_threads(const rf_recipe *r, int n_rollout, int dp, int train) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int share = train || rf_recipe_colocated_ranks(r) ? (int)(cores / dp) : (int)(cores / (dp + n_rollout));
    return share < 1 ? 1 : share;
}

/* The communicators of a split run, every rank taking part in each split. Training rank
 * i = world rank - 1 (1 .. dp x tp) is TP rank i % tp of DP replica i / tp: tp varies fastest,
 * Megatron-LM's order, so a replica's TP group is consecutive ranks. Weights go between the
 * training worker (world rank 1) and the rollout workers, ranked as with one training worker
 * (it is rank 0, the rollout ranks after it); with tp > 1 every training rank sends weights
 * (its shard; the planner spreads each rollout rank's blocks over the replicas): the weights
 * communicator holds world ranks 1..dp x tp (ranks 0..dp x tp - 1 there) and the rollout ranks
 * after them. With dp > 1 each TP position has a DP group (one rank per replica; with tp = 1 all
 * training ranks), with tp > 1 each replica a TP group. With gtp > 1 (placement.rollout.tp)
 * every rollout rank receives its shard (rollout worker i's ranks together in the weights
 * communicator), and each rollout worker's gtp ranks have a communicator of their own. */
static rf_status split_comms(rf_comm *world, int dp, int tp, int gtp, int colo, rf_comm **wcomm, rf_comm **dpc,
                             rf_comm **tpc, rf_comm **gcomm) {
    int rank = rf_comm_rank(world), n_train = dp * tp, train = rank >= 1 && rank <= n_train;
    *wcomm = *dpc = *tpc = *gcomm = NULL;
    /* colocated: the rollout ranks are threads of the training ranks' processes, the weights
     * go between the training ranks alone (resharded in place), and rollout worker i's gtp
     * ranks are training ranks 1 + i x gtp .. */
    int in_weights = colo ? train : (rank >= 1 && rank <= (tp > 1 ? n_train : 1)) || rank > n_train;
    int rollout_worker = colo ? (train ? (rank - 1) / gtp : -1) : rank > n_train ? (rank - 1 - n_train) / gtp : -1;
    RF_TRY(rf_comm_split(world, in_weights ? 1 : -1, rank, wcomm));
    rf_status st = RF_OK;
    if (dp > 1) st = rf_comm_split(world, train ? (rank - 1) % tp : -1, rank, dpc);
    if (st == RF_OK && tp > 1) st = rf_comm_split(world, train ? (rank - 1) / tp : -1, rank, tpc);
    if (st == RF_OK && gtp > 1) st = rf_comm_split(world, rollout_worker >= 0 ? 1 + rollout_worker : -1, rank, gcomm);
    if (st != RF_OK) {
        rf_comm_free(*wcomm), rf_comm_free(*dpc), rf_comm_free(*tpc);
        *wcomm = *dpc = *tpc = NULL;
    }
    return st;
}

/* Every rank's machine from the host names gathered over world: a machine's number is its
 * first rank's (rf_comm_set_nodes, for the weights' planner); *one_host when all are rank 0's.
 * Several machines: *hosts_out keeps the names (HOST_LEN each, by rank; the caller frees). */
static rf_status number_machines(const rf_recipe *r, rf_comm *world, int *one_host, char **hosts_out) {
    int n = rf_comm_size(world), *node = calloc((size_t)n, sizeof *node);
    char *hosts = calloc((size_t)n, HOST_LEN), me[HOST_LEN] = "";
    rf_status st = hosts && node ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    gethostname(me, sizeof me - 1);
    if (st == RF_OK) st = rf_comm_allgather(world, me, hosts, HOST_LEN, r->async.startup_timeout, "gathering host names");
    *one_host = 1;
    for (int i = 0; st == RF_OK && i < n; i++) {
        node[i] = i;
        for (int j = 0; j < i && node[i] == i; j++)
            if (strcmp(hosts + (size_t)i * HOST_LEN, hosts + (size_t)j * HOST_LEN) == 0) node[i] = node[j];
        *one_host &= node[i] == 0;
    }
    if (st == RF_OK) st = rf_comm_set_nodes(node, n);
    if (st == RF_OK && !*one_host) *hosts_out = hosts, hosts = NULL;
    free(node), free(hosts);
    return st;
}

/* The controller's endpoint: the recipe's, or tcp on loopback (one machine) or on rank 0's
 * host name (several), with a free port. */
static rf_status pick_endpoint(const rf_recipe *r, rf_comm *world, char *bind_ep, char **hosts) {
    int one_host;
    rf_status st = number_machines(r, world, &one_host, hosts);
    if (st == RF_OK) {
        if (r->placement.endpoint[0]) {
            snprintf(bind_ep, HOST_LEN, "%s", r->placement.endpoint);
        } else if (one_host) {
            snprintf(bind_ep, HOST_LEN, "tcp://127.0.0.1:*");
        } else {
            snprintf(bind_ep, HOST_LEN, "tcp://*:*");
        }
    }
    return st;
}

/* The endpoint workers should dial: the bound one, with rank 0's host name for "*". */
static void advertised(const char *bound, char *out) {
    const char *star = strstr(bound, "://0.0.0.0:");
    if (star) {
        char host[128] = "localhost";
        gethostname(host, sizeof host - 1);
        snprintf(out, HOST_LEN, "tcp://%.127s:%.100s", host, star + strlen("://0.0.0.0:"));
    } else {
        snprintf(out, HOST_LEN, "%s", bound);
    }
}

/* Rank 0: the controller's endpoint, with CURVE keys made for this run alone (ZeroMQ RFC 26):
 * a key pair for the controller and one that every worker presents, handed to the ranks over
 * MPI (never written anywhere), the only client key the endpoint admits. Any other client (no
 * CURVE, another key) is refused by the handshake and logged (docs/deployment.md, "Trust"). */
static rf_status open_controller(const rf_recipe *r, const char *bind_ep, rf_msg_server **srv, rf_msg_dial *dial) {
    rf_curve_key server_secret;
    rf_status st = rf_curve_keypair(dial->server_key, server_secret);
    if (st == RF_OK) st = rf_curve_keypair(dial->public_key, dial->secret_key);
    if (st != RF_OK) return rf_error_wrap(st, "making the run's CURVE keys for the workers' endpoint");
    const char *clients[1] = {dial->public_key};
    rf_msg_server_config sc = {.accept_role = 0, .peer_timeout_s = r->async.peer_timeout,
                               .curve_secret_key = server_secret, .curve_clients = clients, .n_curve_clients = 1};
    st = rf_msg_server_open(srv, bind_ep, &sc);
    memset(server_secret, 0, sizeof server_secret);
    if (st == RF_OK) advertised(rf_msg_server_endpoint(*srv), dial->endpoint);
    return st;
}

/* The world size against the recipe's layout: controller, dp (or tp) training workers, rollout
 * workers of placement.rollout.tp ranks each. Under a user's mpirun, when
 * placement.rollout_ranks is not set, every rank past the training workers is a rollout rank. */
static rf_status check_size(const rf_recipe *r, int size) {
    int dp = r->placement.actor.dp, n_train = train_ranks(r), gtp = r->placement.rollout.tp;
    int want = 1 + n_train + rollout_procs(r);
    if (rf_recipe_colocated_ranks(r))
        return size == want ? RF_OK
                            : rf_error(RF_ERR_ARG, "this MPI job has %d ranks; the colocated recipe needs %d (controller and %d "
                                       "training ranks, one per device, each also running a rollout rank)", size, want, n_train);
    char where[512];
    int fixed = strcmp(rf_recipe_where(r, "placement.rollout_ranks", where, sizeof where), "(default)") != 0;
    if (size >= 1 + n_train + gtp && (size - 1 - n_train) % gtp == 0 && (!fixed || size == want)) return RF_OK;
    int need = fixed ? want : 1 + n_train + gtp, workers = fixed ? r->placement.rollout_ranks : 1;
    if (gtp > 1)
        return rf_error(RF_ERR_ARG, "this MPI job has %d ranks; the recipe needs %d (controller, %d training workers and placement.rollout_ranks = %d rollout workers of placement.rollout.tp = %d ranks each)",
                        size, need, n_train, workers, gtp);
    if (r->placement.actor.tp > 1 && dp > 1)
        return rf_error(RF_ERR_ARG, "this MPI job has %d ranks; the recipe needs %d (controller, placement.actor.dp x placement.actor.tp = %d x %d training workers and placement.rollout_ranks = %d rollout workers)",
                        size, need, dp, r->placement.actor.tp, workers);
    if (r->placement.actor.tp > 1)
        return rf_error(RF_ERR_ARG, "this MPI job has %d ranks; the recipe needs %d (controller, placement.actor.tp = %d training workers and placement.rollout_ranks = %d rollout workers)",
                        size, need, r->placement.actor.tp, workers);
    if (dp == 1)
        return rf_error(RF_ERR_ARG, "this MPI job has %d ranks; the recipe needs %d (controller, training worker and placement.rollout_ranks = %d rollout workers)",
                        size, need, workers);
    return rf_error(RF_ERR_ARG, "this MPI job has %d ranks; the recipe needs %d (controller, placement.actor.dp = %d training workers and placement.rollout_ranks = %d rollout workers)",
                    size, need, dp, workers);
}

/* The reference, the critic and the reward model held by training rank (replica d, TP rank
 * t): ", critic" or ", critic shard t of T" and the same for the others (rf_recipe_role_layout). */
static const char *roles_at(const rf_recipe *r, int d, int t, char *buf, size_t cap) {
    rf_adv_kind kind;
    int critic = rf_adv_kind_parse(r->algorithm.name, &kind) == RF_OK && kind == RF_ADV_GAE;
    int held[3] = {rf_recipe_reference_enabled(r), critic, r->reward.model[0] != '\0'};
    size_t n = 0;
    buf[0] = 0;
    for (int role = RF_ROLE_REFERENCE; role <= RF_ROLE_REWARD; role++) {
        int dp, tp;
        rf_recipe_role_layout(r, role, &dp, &tp);
        if (!held[role] || d >= dp || t >= tp || n >= cap) continue; /* on the first tp ranks of a replica */
        if (tp > 1) n += (size_t)snprintf(buf + n, cap - n, ", %s shard %d of %d", rf_recipe_role_name(role), t, tp);
        else n += (size_t)snprintf(buf + n, cap - n, ", %s", rf_recipe_role_name(role));
    }
    return buf;
}

/* " on HOST" for rank i when the ranks are on several machines (hosts: their names), else "". */
static const char *on_host(const char *hosts, int i, char *buf, size_t cap) {
    if (!hosts) return "";
    snprintf(buf, cap, " on %.200s", hosts + (size_t)i * HOST_LEN);
    return buf;
}

/* The rank table the controller prints (ranks 1 .. n_train, then the rollout workers); with
 * hosts (several machines) each line ends with the rank's host. */
static void log_layout(const rf_recipe *r, int size, const char *hosts) {
    int dp = r->placement.actor.dp, tp = r->placement.actor.tp, n_train = train_ranks(r);
    char roles[128], at[220];
    for (int i = 1; i <= n_train; i++) {
        int d = (i - 1) / tp, t = (i - 1) % tp;
        roles_at(r, d, t, roles, sizeof roles);
        const char *on = on_host(hosts, i, at, sizeof at);
        if (tp > 1 && dp > 1)
            rf_log_info("  rank %d: training worker, data-parallel replica %d of %d, tensor-parallel rank %d of %d (actor "
                        "shard %d of %d%s)%s", i, d, dp, t, tp, t, tp, roles, on);
        else if (tp > 1)
            rf_log_info("  rank %d: training worker, tensor-parallel rank %d of %d (actor shard %d of %d%s)%s", i, t, tp, t,
                        tp, roles, on);
        else if (dp > 1) rf_log_info("  rank %d: training worker, data-parallel rank %d of %d (actor%s)%s", i, d, dp, roles, on);
        else rf_log_info("  rank %d: training worker (actor%s)%s", i, roles, on);
    }
    int gtp = r->placement.rollout.tp, colo = rf_recipe_colocated_ranks(r);
    /* colocated: rank i's second thread; else the ranks after the training ones */
    for (int i = colo ? 1 : 1 + n_train; i < (colo ? 1 + n_train : size); i++) {
        int j = colo ? i - 1 : i - 1 - n_train; /* this rank's place among the rollout ranks */
        char who[64], how[128] = "";
        snprintf(who, sizeof who, colo ? "rank %d, its rollout thread" : "rank %d", i);
        if (colo)
            snprintf(how, sizeof how, gtp == tp ? " (zero-copy: generates with this rank's actor %s)"
                                                : " (its weights resharded in place from the training ranks)",
                     tp > 1 ? "shard" : "weights");
        if (gtp > 1)
            rf_log_info("  %s: rollout worker %d, tensor-parallel rank %d of %d%s%s%s", who, j / gtp, j % gtp, gtp,
                        j % gtp == 0 ? " (engine, talks to the controller)" : "", how, on_host(hosts, i, at, sizeof at));
        else
            rf_log_info("  %s: rollout worker %d%s%s", who, j, how, on_host(hosts, i, at, sizeof at));
    }
}

/* model.device = "cuda": the device this rank's roles start on. Each machine's worker ranks
 * (not the controller, rank 0, which uses none) take its visible devices in turn, by world
 * rank; more ranks than devices share them (a NCCL communicator over two of them is then
 * refused: rf_comm_nccl). A colocated run's rollout ranks are threads of the training ranks. */
int rf_launch_gpu_of(const int *node, int rank, int n_devices) {
    if (rank <= 0 || n_devices < 1) return -1;
    int slot = 0;
    for (int j = 1; j < rank; j++) slot += node[j] == node[rank];
    return slot % n_devices;
}

static void select_gpu(const rf_recipe *r, rf_comm *world, const char *host) {
    int rank = rf_comm_rank(world), size = rf_comm_size(world);
    if (rank == 0 || strcmp(r->model.device, "cuda") != 0) return; /* CPU runs never open the CUDA module */
    int n = rf_cuda_device_count();
    if (n <= 0) return;
    int *node = malloc(sizeof(int) * (size_t)size);
    if (!node) return; /* the back end then starts on device 0 */
    for (int j = 0; j < size; j++) node[j] = rf_comm_node(world, j);
    int gpu = rf_launch_gpu_of(node, rank, n);
    free(node);
    rf_cuda_select_device(gpu);
    rf_log_info("  rank %d (%s): CUDA device %d of %d", rank, host, gpu, n);
}

/* World rank `rank`'s training role (1 .. dp x tp): the training worker (rank 1), a data-parallel
 * replica's first rank, or a tensor-parallel peer. ho: colocated (rf_train_worker_main). */
static rf_status training_rank(const rf_recipe *r, int resume, const rf_msg_dial *ep, int rank, const char *host, int n_rollout,
                               rf_comm *wcomm, rf_comm *dpc, rf_comm *tpc, rf_handover *ho) {
    int dp = r->placement.actor.dp, tp = r->placement.actor.tp, gtp = r->placement.rollout.tp;
    rf_status st;
    if (rank == 1) {
        int *dst = malloc(sizeof(int) * (size_t)n_rollout);
        st = dst ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
        int n_wtrain = tp > 1 ? train_ranks(r) : 1; /* training ranks in wcomm */
        for (int i = 0; dst && i < n_rollout; i++) dst[i] = n_wtrain + i * gtp; /* rollout workers' first ranks in wcomm */
        if (st == RF_OK) st = rf_train_worker_main(r, ep, resume, wcomm, dst, n_rollout, dpc, tpc, ho);
        free(dst);
        return st != RF_OK ? rf_error_wrap(st, "training worker (rank 1 on %s)", host) : st;
    }
    int d = (rank - 1) / tp, t = (rank - 1) % tp;
    if (t == 0) {
        st = rf_train_peer_main(r, dpc, tpc, wcomm, ho);
        return st != RF_OK ? rf_error_wrap(st, "training worker, data-parallel rank %d (rank %d on %s)", d, rank, host) : st;
    }
    st = rf_train_tp_peer_main(r, tpc, wcomm, dpc, ho);
    if (st != RF_OK && dp > 1)
        return rf_error_wrap(st, "training worker, tensor-parallel rank %d of data-parallel replica %d (rank %d on %s)", t,
                             d, rank, host);
    if (st != RF_OK) return rf_error_wrap(st, "training worker, tensor-parallel rank %d (rank %d on %s)", t, rank, host);
    return st;
}

/* A colocated process's rollout rank, run in a thread of its own. */
typedef struct rollout_thread {
    const rf_recipe *r;
    const rf_msg_dial *ep;
    int index, threads;
    rf_comm *gcomm;
    rf_handover *ho;
    rf_status st;
    char msg[1200];
} rollout_thread;

static void *rollout_thread_main(void *arg) {
    rollout_thread *t = arg;
    omp_set_num_threads(t->threads); /* OpenMP's thread count is per thread */
    t->st = rf_rollout_worker_main(t->r, t->ep, t->index, NULL, t->gcomm, 0, t->ho);
    if (t->st != RF_OK) {
        snprintf(t->msg, sizeof t->msg, "%s", rf_error_message());
        rf_handover_fail(t->ho, "the rollout rank of this process");
    }
    return NULL;
}

/* Colocated on several devices: training rank `rank` with a rollout rank of rollout worker
 * (rank - 1) / gtp in a second thread of this process, the weights handed over between them
 * (resharding/handover.h). Either one's failure wakes the other; the first error is returned. */
static rf_status colocated_rank(const rf_recipe *r, int resume, const rf_msg_dial *ep, int rank, const char *host,
                                int n_rollout, rf_comm *wcomm, rf_comm *dpc, rf_comm *tpc, rf_comm *gcomm) {
    rf_handover ho;
    RF_TRY(rf_handover_init(&ho));
    int gtp = r->placement.rollout.tp;
    rollout_thread t = {.r = r, .ep = ep, .index = (rank - 1) / gtp, .gcomm = gcomm, .ho = &ho,
                        .threads = r->placement.rollout_threads > 0 ? r->placement.rollout_threads
                                                                    : default_threads(r, n_rollout * gtp, train_ranks(r), 0)};
    pthread_t th;
    if (pthread_create(&th, NULL, rollout_thread_main, &t) != 0) {
        rf_handover_free(&ho);
        return rf_error(RF_ERR_INTERNAL, "rank %d on %s: cannot start the rollout rank's thread", rank, host);
    }
    rf_status st = training_rank(r, resume, ep, rank, host, n_rollout, wcomm, dpc, tpc, &ho);
    if (st != RF_OK) rf_handover_fail(&ho, "the training rank of this process");
    char keep[1200];
    snprintf(keep, sizeof keep, "%s", st != RF_OK ? rf_error_message() : "");
    pthread_join(th, NULL);
    rf_handover_free(&ho);
    if (st != RF_OK) {
        if (t.st != RF_OK && !strstr(t.msg, "weights handover: the training rank"))
            rf_log_warn("rank %d on %s, its rollout thread: %s", rank, host, t.msg);
        return rf_error(st, "%s", keep);
    }
    if (t.st != RF_OK) return rf_error(t.st, "%s", t.msg);
    return RF_OK;
}

static rf_status run_rank(const rf_recipe *r, int resume, rf_comm *world) {
    int rank = rf_comm_rank(world), size = rf_comm_size(world), dp = r->placement.actor.dp;
    int tp = r->placement.actor.tp, n_train = train_ranks(r), gtp = r->placement.rollout.tp;
    RF_TRY(check_size(r, size));
    int colo = rf_recipe_colocated_ranks(r);
    int n_rollout = (colo ? n_train : size - 1 - n_train) / gtp; /* rollout workers (gtp ranks each) */
    char bind_ep[HOST_LEN];
    rf_msg_dial dial; /* rank 0 fills it, every rank receives it */
    memset(&dial, 0, sizeof dial);
    rf_status st = RF_OK;
    rf_msg_server *srv = NULL;
    if (rank == 0) {
        /* under a user's mpirun, data and model are prepared here while the others wait */
        st = rf__ensure_data(r);
        if (st == RF_OK) st = rf__ensure_model(r);
        if (st == RF_OK) st = rf__check_tp_model_path(r);
    }
    char *hosts = NULL; /* several machines: every rank's host name */
    rf_status st2 = pick_endpoint(r, world, bind_ep, &hosts);
    if (st == RF_OK) st = st2;
    if (rank == 0 && st == RF_OK) st = open_controller(r, bind_ep, &srv, &dial);
    /* rank 0 sends the endpoint and the keys, or "" when it failed (every rank then stops) */
    if (rank == 0 && st != RF_OK) memset(&dial, 0, sizeof dial);
    rf_status bst = rf_comm_bcast(world, &dial, sizeof dial, 0, r->async.startup_timeout,
                                  "receiving the controller's endpoint and keys");
    char host[HOST_LEN] = "";
    gethostname(host, sizeof host - 1);
    if (rank == 0 && st == RF_OK && bst == RF_OK) {
        rf_log_info("%s run on %d ranks, controller at %s (CURVE: only this run's ranks may connect)",
                    rf_recipe_colocated_ranks(r) ? "colocated" : "split", size, dial.endpoint);
        rf_log_info("  rank 0: controller (%s, pid %d)", host, (int)getpid());
        log_layout(r, size, hosts);
    }
    free(hosts);
    if (st != RF_OK) {
        rf_msg_server_close(srv, NULL);
        return st;
    }
    if (bst != RF_OK) return bst;
    if (!dial.endpoint[0]) return rf_error(RF_ERR_IO, "the controller (rank 0) could not start; its message says why");
    select_gpu(r, world, host);
    /* weights travel between the training worker and the rollout workers only; gradients
     * between the training workers */
    rf_comm *wcomm = NULL, *dpc = NULL, *tpc = NULL, *gcomm = NULL;
    RF_TRY(split_comms(world, dp, tp, gtp, colo, &wcomm, &dpc, &tpc, &gcomm));
    int threads = r->placement.train_threads > 0 ? r->placement.train_threads : default_threads(r, n_rollout * gtp, n_train, 1);
    if (rank == 0) {
        st = rf_controller_main(r, resume, srv, n_rollout);
        if (st != RF_OK) {
            char why[1200];
            snprintf(why, sizeof why, "the run stopped on an error: %s", rf_error_message());
            rf_msg_server_close(srv, rf_controller_interrupted() ? RF_MSG_SHUTDOWN_INTERRUPTED : why);
        } else {
            rf_msg_server_close(srv, RF_MSG_SHUTDOWN_DONE);
        }
        write_status(r, st);
    } else if (rank <= n_train && colo) {
        omp_set_num_threads(threads);
        st = colocated_rank(r, resume, &dial, rank, host, n_rollout, wcomm, dpc, tpc, gcomm);
    } else if (rank <= n_train) {
        omp_set_num_threads(threads);
        st = training_rank(r, resume, &dial, rank, host, n_rollout, wcomm, dpc, tpc, NULL);
    } else {
        omp_set_num_threads(r->placement.rollout_threads > 0 ? r->placement.rollout_threads
                                                              : default_threads(r, n_rollout * gtp, n_train, 0));
        st = rf_rollout_worker_main(r, &dial, (rank - 1 - n_train) / gtp, wcomm, gcomm, 0, NULL);
    }
    rf_comm_free(gcomm);
    rf_comm_free(wcomm);
    rf_comm_free(dpc);
    rf_comm_free(tpc);
    return st;
}

rf_status rf_run_split(const rf_recipe *r, int resume, int argc, char **argv) {
    RF_TRY(rf__reject_unimplemented(r));
    if (!rf_comm_launched_by_mpi()) {
        RF_TRY(rf__ensure_data(r));
        RF_TRY(rf__ensure_model(r));
        RF_TRY(rf__check_tp_model_path(r));
        return relaunch(r, argc, argv);
    }
    if (!getenv("OMP_WAIT_POLICY") || getenv("RLFLOW_SPIN_AUTO")) {
        /* under mpirun (ours or a user's): OpenMP reads its wait policy when the program loads,
         * so start again with idle threads that sleep at once, without the spin rlflow gives
         * them on an idle machine (ranks share cores; cli/main.c) */
        setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
        unsetenv("GOMP_SPINCOUNT"), unsetenv("RLFLOW_SPIN_AUTO");
        execv("/proc/self/exe", argv);
    }
    /* every rank: a SIGINT / SIGTERM (or SIGUSR1 / SIGUSR2 forwarded by mpirun) asks for a
     * stop; the controller rank makes it, the others wait for its Shutdown */
    rf_interrupt_install();
    rf_comm *world;
    /* colocated with rollout tensor parallelism: the rollout thread's group talks over MPI too */
    RF_TRY(rf_comm_init_threads(&argc, &argv, rf_recipe_colocated_ranks(r) && r->placement.rollout.tp > 1, &world));
    rf_status st = run_rank(r, resume, world);
    if (st != RF_OK && rf_comm_rank(world) == 0 && !g_status_written) write_status(r, st); /* failed before the controller ran */
    if (st != RF_OK && rf_comm_rank(world) == 0 && rf_controller_interrupted()) {
        /* stopped on a signal with the checkpoint written: the workers end cleanly too */
        rf_log_warn("%s", rf_error_message());
        rf_error_clear();
        fflush(stdout), fflush(stderr);
    } else if (st != RF_OK) {
        /* report now, naming the rank. The ranks that failed meet at a barrier, bounded: when
         * the controller's run failed, a rank still busy 5 s later (waiting for the controller
         * that stopped, say, or gone) would keep the job alive, so the controller then aborts
         * the job (the ranks' errors reach it before it fails, or are printed by then); another
         * rank goes on to MPI_Finalize, bounded too */
        rf_log_status(st);
        rf_error_clear(); /* reported */
        fflush(stdout), fflush(stderr);
        if (rf_comm_barrier(world, 5.0, "the ranks ending the run on an error") != RF_OK && rf_comm_rank(world) == 0) {
            rf_log_warn("not every rank ended within 5 s of the run's error (one is gone or still busy); stopping the "
                        "MPI job");
            rf_comm_abort(1);
        }
        rf_error_clear();
        signal(SIGALRM, exit_now);
        alarm(5);
    }
    rf_comm_finalize();
    return st;
}
