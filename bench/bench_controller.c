/* Throughput of the split-run controller (controller/controller.c, rf_controller_main) at
 * thousands of workers, printed as JSON lines: is the controller the bottleneck?
 *
 * The real controller runs in a thread of this process on a real message server (a ROUTER on
 * tcp://127.0.0.1). A load generator in the main thread plays every worker over the real
 * protocol (proto/rlflow.proto, common/msg.h framing), one DEALER connection per worker, all
 * served by one epoll loop:
 *  - a training worker that announces version 0 (WeightsUpdate) after its Hello, answers each
 *    TrainBatch v at once with WeightsUpdate v+1 and TrainStats, and the final
 *    CheckpointRequest with CheckpointDone;
 *  - N rollout workers that take each announced version at once (WeightsLoaded: a weight
 *    transfer that takes no time; the controller checks a WeightsLoaded that overtakes its
 *    WeightsUpdate when the announcement arrives) and answer each GenerateRequest at once with
 *    its n Samples (the arithmetic answer for half of them, a wrong one for the others, so
 *    that groups carry reward variance);
 *  - every connection answers the controller's heartbeats.
 * So the controller does all its real per-sample work (decode, checks, reward rules, buffer,
 * advantages, metrics, TrainBatch encoding) with no model in the way.
 *
 * Per configuration (N rollout connections), measured in the steady state between the first
 * and the last TrainBatch the training worker receives:
 *   samples_per_s      Samples delivered to the controller per second
 *   batches_per_s      TrainBatches it formed per second (prompts_per_step x n samples each)
 *   messages_per_s     every message delivered to it (Samples, WeightsLoaded, heartbeats, ...)
 *   controller_cpu     seconds per second the controller thread ran on a core,
 *   controller_runq    ... was runnable but waited for a core (schedstat; contention), and
 *   controller_idle    ... was blocked waiting for messages: near 0, the controller is the
 *                      bottleneck (cpu + runq near 1); large, the workers or the transport are
 *   generator_cpu, other_cpu  the load generator thread, and the rest of the process (the two
 *                      ZeroMQ I/O threads); the machine's cores bound the sum of the CPU shares
 * and a baseline measured in the same run with the same N connections and the same Sample
 * frames: a bare ROUTER in a thread that only reads and discards frames (zmq_echo_msgs_per_s,
 * frames per second), so ratio_vs_zmq_echo = messages_per_s / zmq_echo_msgs_per_s says how
 * close the controller comes to the transport's own limit.
 *
 * Recipe: GRPO without KL (no ScoreRequests), rollout.n = 8, prompts_per_step =
 * max(64, N / 4), max_staleness 2, reward rule "numeric", arithmetic prompts (controller/
 * tasks.h) and the byte-level tokenizer, no validation, a checkpoint request only at the end;
 * train.steps sized from the previous configuration's rate for about --seconds per run.
 *
 * Usage: bench_controller [--quick] [--workers 1,100,1000,2000] [--seconds S] [--steps N]
 *                         [--staleness K] [--resp-tokens T] [--echo-seconds S] [--keep]
 * Progress goes to stderr; the controller's own log to <work dir>/controller_N.log. Not a
 * test: nothing is asserted about times. */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/msg.h"
#include "common/util.h"
#include "controller/controller.h"
#include "controller/recipe.h"
#include "controller/tasks.h"
#include "model/byte_tokenizer.h"

#define MAX_CONFIGS 16
#define GROUP_N 8             /* rollout.n */
#define WATCHDOG_S 60.0       /* no TrainBatch for this long: stop the controller */

typedef struct opts {
    int quick, keep, steps, staleness, resp_tokens;
    int workers[MAX_CONFIGS], n_configs;
    double seconds, echo_seconds;
} opts;

static FILE *g_log; /* progress: the original stderr (fd 2 holds the controller's log) */

/* SIGTERM: the controller installs its own handler while it runs (it ends the run); outside
 * that, this one stops the bench after the current configuration. */
static volatile sig_atomic_t g_term;
static void on_term(int sig) { g_term = sig; }

static void progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void progress(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(g_log, fmt, ap);
    va_end(ap);
    fputc('\n', g_log);
    fflush(g_log);
}

static double cpu_seconds(clockid_t clock) {
    struct timespec ts;
    if (clock_gettime(clock, &ts) != 0) return NAN;
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The checksum the fake training worker announces for weights version v (any function of v
 * works: the controller only compares it with what the rollout workers report). */
static uint32_t weights_crc(int64_t v) { return 0x9E3779B1u * (uint32_t)(v + 1) ^ 0x5bd1e995u; }

/* Thousands of connections need twice as many descriptors (a TCP socket on each side, plus a
 * mailbox per DEALER): raise the soft limit to the hard one. */
static void raise_fd_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    rlim_t before = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (rl.rlim_cur != before && setrlimit(RLIMIT_NOFILE, &rl) != 0)
        progress("warning: cannot raise the open-file limit from %llu", (unsigned long long)before);
    getrlimit(RLIMIT_NOFILE, &rl);
    progress("open-file limit: %llu", (unsigned long long)rl.rlim_cur);
}

/* The answer of an arithmetic prompt ("47+385=", byte-level token ids); 0 when it is not one. */
static long prompt_answer(const int32_t *ids, size_t n) {
    char text[64];
    size_t len = 0;
    for (size_t i = 0; i < n && len + 1 < sizeof text; i++)
        if (ids[i] >= 0 && ids[i] < 256) text[len++] = (char)ids[i];
    text[len] = '\0';
    long a, b;
    char op;
    if (sscanf(text, "%ld%c%ld", &a, &op, &b) != 3) return 0;
    return op == '+' ? a + b : op == '-' ? a - b : op == '*' ? a * b : 0;
}

/* ---- one fake Sample ----------------------------------------------------------------------- */

typedef struct sample_buf {
    int n;             /* response tokens per sample */
    int32_t *tokens;   /* (n) */
    float *logprobs;   /* (n) */
    int64_t *versions; /* (n) */
} sample_buf;

static int sample_buf_init(sample_buf *b, int n) {
    b->n = n;
    b->tokens = malloc(sizeof *b->tokens * (size_t)n);
    b->logprobs = malloc(sizeof *b->logprobs * (size_t)n);
    b->versions = malloc(sizeof *b->versions * (size_t)n);
    return b->tokens && b->logprobs && b->versions ? 0 : -1;
}

static void sample_buf_free(sample_buf *b) { free(b->tokens), free(b->logprobs), free(b->versions); }

/* A Sample with response `text` generated at weights `version`: its tokens are the text's
 * bytes, padded with spaces to b->n. The caller sets request_id, index, group_id, prompt_len.
 * s points into b. */
static void sample_fill(Rlflow__Sample *s, sample_buf *b, const char *text, int64_t version) {
    size_t len = strlen(text);
    for (int t = 0; t < b->n; t++) {
        b->tokens[t] = (size_t)t < len ? (unsigned char)text[t] : ' ';
        b->logprobs[t] = -0.5f;
        b->versions[t] = version;
    }
    rlflow__sample__init(s);
    s->n_tokens = (size_t)b->n, s->tokens = b->tokens;
    s->n_logprobs = (size_t)b->n, s->logprobs = b->logprobs;
    s->n_versions = (size_t)b->n, s->versions = b->versions;
    s->text = (char *)text, s->finish = RLFLOW__FINISH_REASON__FINISH_STOP;
    s->weights_checksum = weights_crc(version);
}

/* ---- the load generator: every fake worker, one thread ------------------------------------ */

typedef struct fake {
    void *sock;      /* DEALER connected to the controller */
    int rollout;     /* 1: rollout worker; 0: the training worker */
    int joined;      /* HelloAck received */
    int shut;        /* Shutdown received */
    int queued;      /* in gen.dirty */
    int64_t version; /* weights it serves (rollout), or its policy version (training) */
} fake;

/* Counters at one instant, for the steady-state window. */
typedef struct snap {
    double t, cpu_ctl, runq_ctl, cpu_gen, cpu_proc;
    int64_t samples, msgs_in, msgs_out;
} snap;

typedef struct gen {
    void *ctx;
    char endpoint[256];
    fake *f;             /* (n_f) f[0] is the training worker */
    int n_f, cap_f;
    int *dirty, n_dirty; /* fakes whose ZMQ_EVENTS must be read (a ZMQ_FD edge, or a send) */
    int epfd;
    sample_buf sb;
    double t_start;
    clockid_t ctl_clock;
    int ctl_sched;       /* /proc/self/task/<controller>/schedstat, -1 when unreadable */
    int64_t samples, msgs_in, msgs_out; /* Samples and messages sent to / received from it */
    int64_t batches, n_shut;
    snap first, last;                    /* at the first and the last TrainBatch */
    int failed;
    char why[1024];
} gen;

static void gen_fail(gen *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void gen_fail(gen *g, const char *fmt, ...) {
    if (g->failed) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->why, sizeof g->why, fmt, ap);
    va_end(ap);
    g->failed = 1;
}

static void mark_dirty(gen *g, int i) {
    if (g->f[i].queued) return;
    g->f[i].queued = 1;
    g->dirty[g->n_dirty++] = i;
}

/* Seconds the controller thread spent runnable but waiting for a core (the second field of
 * schedstat): on a busy machine, CPU time alone cannot tell waiting for work from waiting for
 * a core. */
static double runq_seconds(int fd) {
    char buf[128];
    ssize_t n = fd >= 0 ? pread(fd, buf, sizeof buf - 1, 0) : -1;
    unsigned long long on_cpu, waiting;
    if (n <= 0) return NAN;
    buf[n] = '\0';
    return sscanf(buf, "%llu %llu", &on_cpu, &waiting) == 2 ? 1e-9 * (double)waiting : NAN;
}

static void take_snap(gen *g, snap *s) {
    s->t = rf_time_now();
    s->runq_ctl = runq_seconds(g->ctl_sched);
    s->cpu_ctl = cpu_seconds(g->ctl_clock);
    s->cpu_gen = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    s->cpu_proc = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
    s->samples = g->samples, s->msgs_in = g->msgs_in, s->msgs_out = g->msgs_out;
}

/* Sends one message from fake i (a sent message may let ZeroMQ consume the socket's read
 * signal, so the fake is queued for a ZMQ_EVENTS check). */
static void gen_send(gen *g, int i, rf_msg_type type, const ProtobufCMessage *m) {
    uint8_t *buf;
    size_t len;
    if (g->failed) return;
    if (rf_msg_encode(type, m, &buf, &len) != RF_OK) {
        gen_fail(g, "encoding a %s: %s", rf_msg_type_name(type), rf_error_message());
        return;
    }
    if (zmq_send(g->f[i].sock, buf, len, ZMQ_DONTWAIT) < 0)
        gen_fail(g, "fake worker %d: sending a %s: %s", i, rf_msg_type_name(type), zmq_strerror(zmq_errno()));
    free(buf);
    g->msgs_in++;
    mark_dirty(g, i);
}

static void send_hello(gen *g, int i) {
    Rlflow__Hello h = RLFLOW__HELLO__INIT;
    h.protocol_version = RF_PROTOCOL_VERSION;
    h.role = g->f[i].rollout ? RLFLOW__ROLE__ROLE_ROLLOUT : RLFLOW__ROLE__ROLE_ACTOR;
    h.rank = g->f[i].rollout ? i - 1 : 0, h.pid = (int32_t)getpid();
    h.name = g->f[i].rollout ? "bench-rollout" : "bench-train", h.capacity = 64;
    h.hostname = "localhost";
    gen_send(g, i, RF_MSG_HELLO, &h.base);
}

/* Adds fake worker number g->n_f (the training worker first): a DEALER with unbounded queues
 * (the protocol bounds what is in flight), registered with epoll, Hello queued. */
static int gen_add(gen *g, int rollout) {
    int i = g->n_f;
    if (i == g->cap_f) return gen_fail(g, "more fake workers than planned"), -1;
    fake *f = &g->f[i];
    memset(f, 0, sizeof *f);
    f->rollout = rollout, f->version = -1;
    f->sock = zmq_socket(g->ctx, ZMQ_DEALER);
    if (!f->sock) return gen_fail(g, "zmq_socket: %s", zmq_strerror(zmq_errno())), -1;
    g->n_f++;
    int zero = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(f->sock, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(f->sock, ZMQ_RCVHWM, &zero, sizeof zero);
    int fd;
    size_t fl = sizeof fd;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
    if (zmq_connect(f->sock, g->endpoint) != 0 || zmq_getsockopt(f->sock, ZMQ_FD, &fd, &fl) != 0 ||
        epoll_ctl(g->epfd, EPOLL_CTL_ADD, fd, &ev) != 0)
        return gen_fail(g, "connecting fake worker %d to %s: %s", i, g->endpoint, strerror(errno)), -1;
    send_hello(g, i);
    return 0;
}

static void weights_loaded(gen *g, int i, int64_t v) {
    Rlflow__WeightsLoaded wl = RLFLOW__WEIGHTS_LOADED__INIT;
    g->f[i].version = v;
    wl.version = v, wl.checksum = weights_crc(v), wl.rank = i - 1;
    wl.busy_s = 0, wl.wall_s = rf_time_now() - g->t_start, wl.load_s = 0;
    gen_send(g, i, RF_MSG_WEIGHTS_LOADED, &wl.base);
}

static void announce(gen *g, int64_t v) {
    Rlflow__WeightsUpdate wu = RLFLOW__WEIGHTS_UPDATE__INIT;
    wu.version = v, wu.checksum = weights_crc(v), wu.n_bytes = 1u << 20;
    g->f[0].version = v;
    gen_send(g, 0, RF_MSG_WEIGHTS_UPDATE, &wu.base);
}

/* The whole group at once, half of it right. */
static void on_generate(gen *g, int i, const Rlflow__GenerateRequest *q) {
    long answer = prompt_answer(q->prompt_ids, q->n_prompt_ids);
    for (int k = 0; k < q->n && !g->failed; k++) {
        char text[32];
        snprintf(text, sizeof text, "%ld", k % 2 ? answer + 1 : answer);
        Rlflow__Sample s;
        sample_fill(&s, &g->sb, text, g->f[i].version);
        s.request_id = q->request_id, s.index = k, s.group_id = q->group_id;
        s.prompt_len = (int32_t)q->n_prompt_ids;
        gen_send(g, i, RF_MSG_SAMPLE, &s.base);
        g->samples++;
    }
}

/* Trains instantly: version v + 1, its stats, and the new weights on every rollout worker. */
static void on_train_batch(gen *g, const Rlflow__TrainBatch *b) {
    int64_t v = b->policy_version;
    if (v != g->f[0].version)
        gen_fail(g, "TrainBatch for version %lld, the training worker is at %lld", (long long)v,
                 (long long)g->f[0].version);
    take_snap(g, g->batches++ == 0 ? &g->first : &g->last);
    announce(g, v + 1);
    Rlflow__TrainStats ts = RLFLOW__TRAIN_STATS__INIT;
    ts.batch_id = b->batch_id, ts.policy_version = v + 1, ts.seconds = 1e-6;
    gen_send(g, 0, RF_MSG_TRAIN_STATS, &ts.base);
    for (int i = 1; i < g->n_f; i++) weights_loaded(g, i, v + 1);
}

static void on_message(gen *g, int i, const rf_msg *m) {
    fake *f = &g->f[i];
    switch (m->type) {
    case RF_MSG_HELLO_ACK: {
        const Rlflow__HelloAck *a = (const Rlflow__HelloAck *)m->pb;
        if (!a->accepted) gen_fail(g, "fake worker %d refused: %s", i, a->reason);
        f->joined = 1;
        if (!f->rollout) announce(g, 0);
        else weights_loaded(g, i, 0); /* the initial weights, whichever joined first */
        break;
    }
    case RF_MSG_HEARTBEAT: {
        Rlflow__Heartbeat hb = RLFLOW__HEARTBEAT__INIT;
        hb.seq = ((const Rlflow__Heartbeat *)m->pb)->seq;
        gen_send(g, i, RF_MSG_HEARTBEAT, &hb.base);
        break;
    }
    case RF_MSG_GENERATE_REQUEST:
        if (f->rollout) on_generate(g, i, (const Rlflow__GenerateRequest *)m->pb);
        else gen_fail(g, "the training worker got a GenerateRequest");
        break;
    case RF_MSG_TRAIN_BATCH: on_train_batch(g, (const Rlflow__TrainBatch *)m->pb); break;
    case RF_MSG_CHECKPOINT_REQUEST: {
        Rlflow__CheckpointDone d = RLFLOW__CHECKPOINT_DONE__INIT;
        d.step = ((const Rlflow__CheckpointRequest *)m->pb)->step, d.error = "";
        gen_send(g, i, RF_MSG_CHECKPOINT_DONE, &d.base);
        break;
    }
    case RF_MSG_SHUTDOWN: {
        const char *why = ((const Rlflow__Shutdown *)m->pb)->reason;
        if (!why || strcmp(why, RF_MSG_SHUTDOWN_DONE) != 0)
            gen_fail(g, "the controller stopped: %s", why ? why : "");
        f->shut = 1, g->n_shut++;
        break;
    }
    case RF_MSG_ERROR:
        gen_fail(g, "the controller sent fake worker %d an Error: %s", i,
                 ((const Rlflow__Error *)m->pb)->message);
        break;
    default: gen_fail(g, "fake worker %d got an unexpected %s", i, rf_msg_type_name(m->type));
    }
}

/* Reads everything fake i has (ZMQ_FD is edge-like: ZMQ_EVENTS says what is really there). */
static void service(gen *g, int i) {
    fake *f = &g->f[i];
    f->queued = 0;
    while (!f->shut && !g->failed) {
        int ev = 0;
        size_t el = sizeof ev;
        if (zmq_getsockopt(f->sock, ZMQ_EVENTS, &ev, &el) != 0 || !(ev & ZMQ_POLLIN)) return;
        zmq_msg_t z;
        zmq_msg_init(&z);
        if (zmq_msg_recv(&z, f->sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&z);
            return;
        }
        rf_msg m;
        rf_status st = rf_msg_decode(zmq_msg_data(&z), zmq_msg_size(&z), &m);
        zmq_msg_close(&z);
        g->msgs_out++;
        if (st != RF_OK) {
            gen_fail(g, "fake worker %d: %s", i, rf_error_message());
            return;
        }
        on_message(g, i, &m);
        rf_msg_free(&m);
    }
}

/* One round: every queued fake serviced, then at most wait_s for socket signals. */
static void pump(gen *g, double wait_s) {
    while (g->n_dirty > 0 && !g->failed) service(g, g->dirty[--g->n_dirty]);
    struct epoll_event ev[256];
    int n = epoll_wait(g->epfd, ev, 256, (int)(wait_s * 1000));
    for (int k = 0; k < n; k++) mark_dirty(g, (int)ev[k].data.u32);
}

/* A generator for 1 training and n_rollout rollout workers sending resp_tokens-token Samples
 * to the controller at `endpoint`; its own ZeroMQ context allows that many sockets. */
static int gen_init(gen *g, const char *endpoint, int n_rollout, int resp_tokens) {
    memset(g, 0, sizeof *g);
    g->epfd = g->ctl_sched = -1;
    if (sample_buf_init(&g->sb, resp_tokens) != 0) return -1;
    snprintf(g->endpoint, sizeof g->endpoint, "%s", endpoint);
    g->cap_f = n_rollout + 1;
    g->f = calloc((size_t)g->cap_f, sizeof *g->f);
    g->dirty = malloc(sizeof *g->dirty * (size_t)g->cap_f);
    g->ctx = zmq_ctx_new();
    g->epfd = epoll_create1(0);
    g->t_start = rf_time_now();
    if (!g->f || !g->dirty || !g->ctx || g->epfd < 0) return -1;
    zmq_ctx_set(g->ctx, ZMQ_MAX_SOCKETS, g->cap_f + 16);
    return 0;
}

static void gen_free(gen *g) {
    for (int i = 0; i < g->n_f; i++) zmq_close(g->f[i].sock);
    if (g->ctx) zmq_ctx_term(g->ctx);
    if (g->epfd >= 0) close(g->epfd);
    if (g->ctl_sched >= 0) close(g->ctl_sched);
    free(g->f), free(g->dirty);
    sample_buf_free(&g->sb);
}

/* ---- the controller run ---------------------------------------------------------------- */

typedef struct result {
    int ok, n_rollout, P, steps;
    char error[3000];
    double setup_s, seconds, samples_per_s, batches_per_s, msgs_in_per_s, msgs_out_per_s;
    double cpu_ctl, runq_ctl, cpu_gen, cpu_other;
    double echo_per_s, echo_sink_cpu;
} result;

typedef struct ctl_job {
    const rf_recipe *r;
    rf_msg_server *srv;  /* handed to the thread, which closes it */
    int n_rollout;
    rf_status st;
    char why[1200];
    atomic_int tid;      /* the thread's kernel id, for its schedstat */
    atomic_int returned; /* rf_controller_main has returned (its signal handler is gone) */
    atomic_int done;     /* ... and the server is closed */
} ctl_job;

/* The controller's thread: the run, then Shutdown to every worker, as controller/launch.c. */
static void *ctl_main(void *arg) {
    ctl_job *j = arg;
    atomic_store(&j->tid, (int)gettid());
    j->st = rf_controller_main(j->r, 0, j->srv, j->n_rollout);
    atomic_store(&j->returned, 1);
    if (j->st != RF_OK) snprintf(j->why, sizeof j->why, "the run stopped on an error: %s", rf_error_message());
    rf_msg_server_close(j->srv, j->st == RF_OK ? RF_MSG_SHUTDOWN_DONE : j->why);
    j->srv = NULL;
    atomic_store(&j->done, 1);
    return NULL;
}

/* The recipe of the top of the file, through the same path as `--set` overrides. */
static rf_status make_recipe(rf_recipe *r, const char *work, int P, int steps, const opts *o) {
    enum { MAX_SET = 32 };
    static char set[MAX_SET][4200]; /* 134 KB: static rather than on the stack */
    const char *p[MAX_SET];
    int n = 0;
#define SET(...) (snprintf(set[n], sizeof set[n], __VA_ARGS__), p[n] = set[n], n++)
    SET("model.path=\"%s/model\"", work);
    SET("data.train=\"%s/data/train.jsonl\"", work);
    SET("data.val=\"\"");
    SET("placement.mode=\"split\"");
    SET("algorithm.name=\"grpo\"");
    SET("algorithm.kl_coef=0.0");
    SET("rollout.n=%d", GROUP_N);
    SET("rollout.prompts_per_step=%d", P);
    SET("rollout.max_new_tokens=%d", o->resp_tokens > 16 ? o->resp_tokens : 16);
    SET("reward.rules=[\"numeric\"]");
    SET("async.max_staleness=%d", o->staleness);
    SET("async.peer_timeout=60.0");
    SET("async.startup_timeout=300.0");
    SET("train.steps=%d", steps);
    SET("logging.dir=\"%s/run\"", work);
    SET("logging.every=1000000");
    SET("logging.val_every=0");
    SET("logging.val_size=0");
    SET("logging.tensorboard=false");
    SET("logging.jsonl=false");
    SET("checkpoint.every=0");
#undef SET
    return rf_recipe_load(r, NULL, p, n);
}

/* Stops the controller the way it documents: a signal ends its loop with an error. */
static void stop_controller(ctl_job *j, const char *why) {
    if (atomic_load(&j->returned)) return;
    progress("  stopping the controller: %s", why);
    raise(SIGTERM);
}

/* Connects every fake worker; returns when all have joined, or on failure (a controller that
 * stopped during its setup included). */
static void connect_all(gen *g, ctl_job *j, int n_rollout) {
    gen_add(g, 0);
    for (int i = 0; i < n_rollout && !g->failed; i++) {
        gen_add(g, 1);
        if (i % 64 == 63) pump(g, 0); /* answer HelloAcks while connecting */
    }
    int joined = 0;
    double t = rf_time_now();
    while (!g->failed && joined < g->n_f && !atomic_load(&j->returned) && rf_time_now() - t < 120) {
        pump(g, 0.01);
        joined = 0;
        for (int i = 0; i < g->n_f; i++) joined += g->f[i].joined;
    }
    if (joined < g->n_f) gen_fail(g, "only %d of %d fake workers joined", joined, g->n_f);
}

/* Serves the run until every fake worker got its Shutdown or the controller ended. */
static void serve(gen *g, ctl_job *j) {
    double last_batch_at = rf_time_now(), last_sweep = 0, done_at = 0;
    int64_t seen = -1;
    while (!g->failed && g->n_shut < g->n_f) {
        pump(g, 0.005);
        if (g_term) gen_fail(g, "stopped by signal %d", (int)g_term);
        double now = rf_time_now();
        if (now - last_sweep > 0.1) { /* a safety net under the ZMQ_FD edges */
            for (int i = 0; i < g->n_f; i++) mark_dirty(g, i);
            last_sweep = now;
        }
        if (g->batches != seen) seen = g->batches, last_batch_at = now;
        if (now - last_batch_at > WATCHDOG_S && !done_at) {
            gen_fail(g, "no TrainBatch for %.0f s", WATCHDOG_S);
            break;
        }
        if (!done_at && atomic_load(&j->done)) done_at = now;
        if (done_at && now - done_at > 5) {
            gen_fail(g, "%lld of %d fake workers got no Shutdown", (long long)(g->n_f - g->n_shut), g->n_f);
            break;
        }
    }
}

static void fill_result(const gen *g, result *res) {
    const snap *a = &g->first, *b = &g->last;
    double dt = b->t - a->t;
    res->seconds = dt;
    if (g->batches < 2 || !(dt > 0)) return;
    res->samples_per_s = (double)(b->samples - a->samples) / dt;
    res->batches_per_s = (double)(g->batches - 1) / dt;
    res->msgs_in_per_s = (double)(b->msgs_in - a->msgs_in) / dt;
    res->msgs_out_per_s = (double)(b->msgs_out - a->msgs_out) / dt;
    res->cpu_ctl = (b->cpu_ctl - a->cpu_ctl) / dt;
    res->runq_ctl = (b->runq_ctl - a->runq_ctl) / dt;
    res->cpu_gen = (b->cpu_gen - a->cpu_gen) / dt;
    res->cpu_other = (b->cpu_proc - a->cpu_proc) / dt - res->cpu_ctl - res->cpu_gen;
}

/* The controller with n_rollout fake rollout workers for `steps` steps, into res. */
static void run_controller(const opts *o, const char *work, int steps, result *res) {
    rf_recipe r;
    rf_msg_server *srv = NULL;
    gen g;
    ctl_job j = {.n_rollout = res->n_rollout};
    if (make_recipe(&r, work, res->P, steps, o) != RF_OK) {
        snprintf(res->error, sizeof res->error, "recipe: %s", rf_error_message());
        return;
    }
    rf_msg_server_config sc = {.peer_timeout_s = r.async.peer_timeout};
    if (rf_msg_server_open(&srv, "tcp://127.0.0.1:*", &sc) != RF_OK) {
        snprintf(res->error, sizeof res->error, "%s", rf_error_message());
        rf_recipe_free(&r);
        return;
    }
    int init = gen_init(&g, rf_msg_server_endpoint(srv), res->n_rollout, o->resp_tokens);
    /* the controller's log (a line per worker that joins) goes to a file */
    char log[4300];
    snprintf(log, sizeof log, "%s/controller_%d.log", work, res->n_rollout);
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    fflush(stderr);
    if (fd >= 0) dup2(fd, 2), close(fd);
    j.r = &r, j.srv = srv;
    pthread_t th;
    int started = init == 0 && pthread_create(&th, NULL, ctl_main, &j) == 0;
    if (!started) rf_msg_server_close(srv, NULL), gen_fail(&g, "cannot set up the load generator or the controller thread");
    if (started && pthread_getcpuclockid(th, &g.ctl_clock) != 0) g.ctl_clock = CLOCK_THREAD_CPUTIME_ID;
    if (started) pthread_setname_np(th, "rf-controller"); /* for perf --comm */
    if (started) {
        connect_all(&g, &j, res->n_rollout);
        char p[64];
        snprintf(p, sizeof p, "/proc/self/task/%d/schedstat", atomic_load(&j.tid));
        g.ctl_sched = open(p, O_RDONLY);
        res->setup_s = rf_time_now() - g.t_start;
        progress("  %d workers joined in %.1f s; running %d steps", g.n_f, res->setup_s, steps);
        if (!g.failed) serve(&g, &j);
        if (g.failed) stop_controller(&j, g.why);
        /* keep answering until the controller has ended (its own timeouts bound this) */
        while (!atomic_load(&j.done)) pump(&g, 0.01);
        pthread_join(th, NULL);
    }
    fflush(stderr);
    dup2(fileno(g_log), 2);
    fill_result(&g, res);
    res->ok = started && !g.failed && j.st == RF_OK && g.batches >= 2;
    if (!res->ok)
        snprintf(res->error, sizeof res->error, "%.1000s%s%.1200s (controller log: %.600s)", g.why,
                 j.why[0] ? "; " : "", j.why, log);
    gen_free(&g);
    rf_recipe_free(&r);
}

/* ---- the baseline: a ROUTER that reads and discards --------------------------------------- */

typedef struct sink {
    void *sock;
    atomic_llong frames; /* payload frames read */
    atomic_int stop;
} sink;

static void *sink_main(void *arg) {
    sink *s = arg;
    while (!atomic_load_explicit(&s->stop, memory_order_relaxed)) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->sock, 0) >= 0 && !zmq_msg_more(&m))
            atomic_fetch_add_explicit(&s->frames, 1, memory_order_relaxed);
        zmq_msg_close(&m);
    }
    return NULL;
}

/* Pushes frames in groups of GROUP_N round robin over the connections, skipping the ones whose
 * queue is full (ZeroMQ's default high-water mark), for `seconds`; the sink's rate. */
static double push_frames(void **socks, int n, const uint8_t *frame, size_t len, sink *s,
                          double seconds) {
    double t0 = rf_time_now(), t = t0;
    long long c0 = atomic_load(&s->frames);
    while (t - t0 < seconds) {
        int sent = 0;
        for (int i = 0; i < n; i++)
            for (int k = 0; k < GROUP_N && zmq_send(socks[i], frame, len, ZMQ_DONTWAIT) >= 0; k++) sent++;
        if (!sent) usleep(50); /* every queue full: leave the cores to the sink */
        t = rf_time_now();
    }
    return (double)(atomic_load(&s->frames) - c0) / (t - t0);
}

/* One Sample frame as the fake rollout workers send it. */
static rf_status sample_frame(int resp_tokens, uint8_t **frame, size_t *len) {
    sample_buf b;
    rf_status st = sample_buf_init(&b, resp_tokens) == 0 ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    if (st == RF_OK) {
        Rlflow__Sample smp;
        sample_fill(&smp, &b, "432", 3);
        smp.request_id = 123456, smp.index = 5, smp.group_id = 1234, smp.prompt_len = 8;
        st = rf_msg_encode(RF_MSG_SAMPLE, &smp.base, frame, len);
    }
    sample_buf_free(&b);
    return st;
}

/* The baseline with res->n_rollout connections: res->echo_per_s and the sink thread's CPU. */
static void run_echo(const opts *o, result *res) {
    int n = res->n_rollout;
    sink s = {0};
    void *sctx = zmq_ctx_new(), *gctx = zmq_ctx_new();
    void **socks = calloc((size_t)n, sizeof *socks);
    uint8_t *frame = NULL;
    size_t len = 0;
    char ep[256] = "";
    size_t epl = sizeof ep;
    int zero = 0, rcvtimeo = 100;
    if (!sctx || !gctx || !socks || sample_frame(o->resp_tokens, &frame, &len) != RF_OK) goto done;
    zmq_ctx_set(gctx, ZMQ_MAX_SOCKETS, n + 16);
    s.sock = zmq_socket(sctx, ZMQ_ROUTER);
    zmq_setsockopt(s.sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s.sock, ZMQ_RCVTIMEO, &rcvtimeo, sizeof rcvtimeo);
    if (zmq_bind(s.sock, "tcp://127.0.0.1:*") != 0 || zmq_getsockopt(s.sock, ZMQ_LAST_ENDPOINT, ep, &epl) != 0)
        goto done;
    for (int i = 0; i < n; i++) {
        socks[i] = zmq_socket(gctx, ZMQ_DEALER);
        if (!socks[i]) goto done;
        zmq_setsockopt(socks[i], ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_connect(socks[i], ep) != 0) goto done;
    }
    pthread_t th;
    if (pthread_create(&th, NULL, sink_main, &s) != 0) goto done;
    pthread_setname_np(th, "rf-echo-sink");
    clockid_t clk;
    if (pthread_getcpuclockid(th, &clk) != 0) clk = CLOCK_PROCESS_CPUTIME_ID;
    /* one frame per connection first: all connections are up when all have arrived */
    for (int i = 0; i < n; i++) zmq_send(socks[i], frame, len, 0);
    double t = rf_time_now();
    while (atomic_load(&s.frames) < n && rf_time_now() - t < 120) usleep(1000);
    double cpu0 = cpu_seconds(clk), t0 = rf_time_now();
    res->echo_per_s = push_frames(socks, n, frame, len, &s, o->echo_seconds);
    res->echo_sink_cpu = (cpu_seconds(clk) - cpu0) / (rf_time_now() - t0);
    atomic_store(&s.stop, 1);
    pthread_join(th, NULL);
done:
    for (int i = 0; socks && i < n; i++)
        if (socks[i]) zmq_close(socks[i]);
    if (s.sock) zmq_close(s.sock);
    if (gctx) zmq_ctx_term(gctx);
    if (sctx) zmq_ctx_term(sctx);
    free(socks), free(frame);
}

/* ---- main ------------------------------------------------------------------------------ */

static void print_result(const opts *o, const result *res) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "bench", "controller");
    cJSON_AddNumberToObject(j, "rollout_workers", res->n_rollout);
    cJSON_AddBoolToObject(j, "ok", res->ok);
    cJSON_AddNumberToObject(j, "prompts_per_step", res->P);
    cJSON_AddNumberToObject(j, "n", GROUP_N);
    cJSON_AddNumberToObject(j, "max_staleness", o->staleness);
    cJSON_AddNumberToObject(j, "resp_tokens", o->resp_tokens);
    cJSON_AddNumberToObject(j, "steps", res->steps);
    cJSON_AddNumberToObject(j, "seconds", round(res->seconds * 1000) / 1000);
    cJSON_AddNumberToObject(j, "samples_per_s", round(res->samples_per_s));
    cJSON_AddNumberToObject(j, "batches_per_s", round(res->batches_per_s * 100) / 100);
    cJSON_AddNumberToObject(j, "messages_per_s", round(res->msgs_in_per_s));
    cJSON_AddNumberToObject(j, "messages_out_per_s", round(res->msgs_out_per_s));
    cJSON_AddNumberToObject(j, "zmq_echo_msgs_per_s", round(res->echo_per_s));
    cJSON_AddNumberToObject(j, "ratio_vs_zmq_echo",
                            res->echo_per_s > 0 ? round(res->msgs_in_per_s / res->echo_per_s * 1000) / 1000 : 0);
    cJSON_AddNumberToObject(j, "controller_cpu", round(res->cpu_ctl * 100) / 100);
    if (!isnan(res->runq_ctl)) {
        cJSON_AddNumberToObject(j, "controller_runq", round(res->runq_ctl * 100) / 100);
        cJSON_AddNumberToObject(j, "controller_idle", round((1 - res->cpu_ctl - res->runq_ctl) * 100) / 100);
    }
    cJSON_AddNumberToObject(j, "generator_cpu", round(res->cpu_gen * 100) / 100);
    cJSON_AddNumberToObject(j, "other_cpu", round(res->cpu_other * 100) / 100);
    cJSON_AddNumberToObject(j, "zmq_echo_sink_cpu", round(res->echo_sink_cpu * 100) / 100);
    cJSON_AddNumberToObject(j, "setup_s", round(res->setup_s * 10) / 10);
    cJSON_AddNumberToObject(j, "cores", (double)sysconf(_SC_NPROCESSORS_ONLN));
    if (!res->ok) cJSON_AddStringToObject(j, "error", res->error);
    char *text = cJSON_PrintUnformatted(j);
    if (text) printf("%s\n", text);
    fflush(stdout);
    free(text);
    cJSON_Delete(j);
}

static int parse_args(int argc, char **argv, opts *o) {
    *o = (opts){.staleness = 2, .resp_tokens = 4, .seconds = 8, .echo_seconds = 3,
                .workers = {1, 100, 1000, 2000}, .n_configs = 4};
    int workers_given = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quick")) o->quick = 1;
        else if (!strcmp(a, "--keep")) o->keep = 1;
        else if (!strcmp(a, "--seconds") && v) o->seconds = atof(v), i++;
        else if (!strcmp(a, "--echo-seconds") && v) o->echo_seconds = atof(v), i++;
        else if (!strcmp(a, "--steps") && v) o->steps = atoi(v), i++;
        else if (!strcmp(a, "--staleness") && v) o->staleness = atoi(v), i++;
        else if (!strcmp(a, "--resp-tokens") && v) o->resp_tokens = atoi(v), i++;
        else if (!strcmp(a, "--workers") && v) {
            o->n_configs = 0, workers_given = 1, i++;
            for (const char *p = v; *p && o->n_configs < MAX_CONFIGS; p += strcspn(p, ",") + (p[strcspn(p, ",")] == ','))
                o->workers[o->n_configs++] = atoi(p);
        } else {
            fprintf(stderr, "usage: %s [--quick] [--workers 1,100,1000,2000] [--seconds S] [--steps N] "
                            "[--staleness K] [--resp-tokens T] [--echo-seconds S] [--keep]\n", argv[0]);
            return -1;
        }
    }
    if (o->quick) {
        if (!workers_given) o->workers[0] = 1, o->workers[1] = 100, o->n_configs = 2;
        o->seconds = fmin(o->seconds, 1.5), o->echo_seconds = fmin(o->echo_seconds, 1.0);
    }
    for (int i = 0; i < o->n_configs; i++)
        if (o->workers[i] < 1 || o->workers[i] > 4096) return fprintf(stderr, "--workers: 1 to 4096 each\n"), -1;
    if (o->staleness < 0) return fprintf(stderr, "--staleness must be >= 0\n"), -1;
    if (o->resp_tokens < 1) return fprintf(stderr, "--resp-tokens must be >= 1\n"), -1;
    return 0;
}

/* The byte-level tokenizer and arithmetic prompts: all the controller reads. */
static rf_status prepare(const char *work) {
    char p[4200];
    snprintf(p, sizeof p, "%s/model", work);
    RF_TRY(rf_mkdirs(p));
    RF_TRY(rf_byte_tokenizer_write(p));
    snprintf(p, sizeof p, "%s/data", work);
    return rf_task_generate("arith", p, 4096, 16, 1);
}

int main(int argc, char **argv) {
    opts o;
    if (parse_args(argc, argv, &o) != 0) return 2;
    int fd = dup(2);
    g_log = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!g_log) return perror("dup"), 1;
    raise_fd_limit();
    struct sigaction sa = {.sa_handler = on_term};
    sigaction(SIGTERM, &sa, NULL);
    char work[] = "/tmp/rf_bench_controller_XXXXXX";
    if (!mkdtemp(work)) return perror("mkdtemp"), 1;
    if (prepare(work) != RF_OK) {
        progress("error: %s", rf_error_message());
        return 1;
    }
    double est = 100000; /* samples/s, for the first run's step count; then the last one's */
    int failures = 0;
    for (int c = 0; c < o.n_configs && !g_term; c++) {
        result res = {.n_rollout = o.workers[c]};
        res.P = res.n_rollout / 4 > 64 ? res.n_rollout / 4 : 64;
        double per_step = (double)res.P * GROUP_N;
        res.steps = o.steps > 0 ? o.steps : (int)fmin(100000, fmax(5, ceil(est * o.seconds / per_step) + 2));
        progress("%d rollout connections: baseline (bare ROUTER) for %.1f s", res.n_rollout, o.echo_seconds);
        run_echo(&o, &res);
        progress("  %.0f frames/s; controller, %d prompts x %d samples per step", res.echo_per_s, res.P, GROUP_N);
        run_controller(&o, work, res.steps, &res);
        if (res.ok) {
            /* the rate falls with the connections: a rough scaling for the next size */
            int next = c + 1 < o.n_configs ? o.workers[c + 1] : res.n_rollout;
            est = res.samples_per_s * pow((double)res.n_rollout / next, 0.35);
            progress("  %.0f samples/s, %.1f batches/s over %.1f s (controller thread: %.0f%% on a "
                     "core, %.0f%% waiting for one)", res.samples_per_s, res.batches_per_s,
                     res.seconds, 100 * res.cpu_ctl, 100 * res.runq_ctl);
        } else {
            failures++;
            progress("  failed: %s", res.error);
        }
        print_result(&o, &res);
    }
    if (!o.keep && !failures) rf_remove_tree(work);
    else progress("work directory kept: %s", work);
    fclose(g_log);
    return failures ? 1 : 0;
}
