/* comm: the public functions (argument checks, a failed communicator refused, dispatch to the
 * back end's table), the single-rank back end, and the helpers for bounded waits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "kernels/cuda_module.h"
#include "common/util.h"

/* ---- communicators ---- */

rf_comm *rf__comm_new(const rf_comm_ops *ops, rf_comm_kind kind, int rank, int size) {
    rf_comm *c = calloc(1, sizeof *c);
    int *w = calloc((size_t)(size > 0 ? size : 1), sizeof *w);
    if (!c || !w) {
        free(c), free(w);
        rf_error(RF_ERR_NOMEM, "out of memory for a communicator of %d ranks", size);
        return NULL;
    }
    c->ops = ops, c->kind = kind, c->rank = rank, c->size = size, c->world = w;
    return c;
}

void rf__comm_delete(rf_comm *c) {
    if (!c) return;
    free(c->world);
    free(c);
}

int rf_comm_rank(const rf_comm *c) { return c->rank; }
int rf_comm_size(const rf_comm *c) { return c->size; }
rf_comm_kind rf_comm_backend(const rf_comm *c) { return c->kind; }
const char *rf_comm_backend_name(const rf_comm *c) { return c->ops->name; }
int rf_comm_nccl_built(void) {
#ifdef RLFLOW_HAVE_NCCL
    return 1;
#else
    const char *env = getenv("RLFLOW_CUDA_MODULE"); /* a module named at run time: the CPU stand-in */
    return env && env[0];
#endif
}
rf_comm *rf_comm_host(rf_comm *c) { return c && c->ops->host ? c->ops->host(c) : c; }

int rf_comm_world_rank(const rf_comm *c, int r) {
    return r >= 0 && r < c->size ? c->world[r] : -1;
}

static int *g_nodes, g_n_nodes; /* rf_comm_set_nodes */

rf_status rf_comm_set_nodes(const int *node, int n) {
    int *copy = malloc(sizeof *copy * (size_t)(n > 0 ? n : 1));
    if (!copy) return rf_error(RF_ERR_NOMEM, "out of memory");
    if (n > 0) memcpy(copy, node, sizeof *copy * (size_t)n);
    free(g_nodes);
    g_nodes = copy, g_n_nodes = n;
    return RF_OK;
}

int rf_comm_node(const rf_comm *c, int r) {
    int w = rf_comm_world_rank(c, r);
    return w >= 0 && w < g_n_nodes ? g_nodes[w] : -1;
}

void rf_comm_free(rf_comm *c) {
    if (!c || c->owned_by_lib) return;
    c->ops->free(c);
}

rf_status rf_comm_world(int *argc, char ***argv, rf_comm **world) {
    if (rf_comm_launched_by_mpi()) return rf_comm_init(argc, argv, world);
    *world = rf_comm_single();
    return RF_OK;
}

/* ---- bounded waits ---- */

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

void rf__comm_format_ranks(const rf_comm *c, const int *ranks, int n, char *out, size_t cap) {
    int *w = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (!w) {
        snprintf(out, cap, "(out of memory)");
        return;
    }
    for (int i = 0; i < n; i++) w[i] = rf_comm_world_rank(c, ranks[i]);
    qsort(w, (size_t)n, sizeof *w, cmp_int);
    int m = 0; /* distinct */
    for (int i = 0; i < n; i++)
        if (m == 0 || w[m - 1] != w[i]) w[m++] = w[i];
    size_t len = (size_t)snprintf(out, cap, "world rank%s ", m == 1 ? "" : "s");
    for (int i = 0; i < m && len < cap;) {
        int j = i;
        while (j + 1 < m && w[j + 1] == w[j] + 1) j++;
        char item[32];
        if (j > i) snprintf(item, sizeof item, "%s%d-%d", i ? ", " : "", w[i], w[j]);
        else snprintf(item, sizeof item, "%s%d", i ? ", " : "", w[i]);
        if (len + strlen(item) + 6 >= cap) {
            snprintf(out + len, cap - len, ", ...");
            break;
        }
        len += (size_t)snprintf(out + len, cap - len, "%s", item);
        i = j + 1;
    }
    if (m == 0) snprintf(out, cap, "no other rank");
    free(w);
}

void rf__comm_mark_failed(rf_comm *c) {
    if (!c->failed[0]) snprintf(c->failed, sizeof c->failed, "%s", rf_error_message());
}

rf_status rf__comm_timeout(rf_comm *c, const int *ranks, int n, double timeout_s, const char *what) {
    char who[256];
    rf__comm_format_ranks(c, ranks, n, who, sizeof who);
    rf_status st = rf_error(RF_ERR_IO, "%s: world rank %d waited %g s for %s (a rank is gone or stuck)",
                            what, c->world[c->rank], timeout_s, who);
    rf__comm_mark_failed(c);
    return st;
}

rf_status rf__comm_timeout_all(rf_comm *c, double timeout_s, const char *what) {
    int *others = malloc(sizeof(int) * (size_t)c->size);
    if (!others) return rf_error(RF_ERR_NOMEM, "out of memory");
    int n = 0;
    for (int r = 0; r < c->size; r++)
        if (r != c->rank) others[n++] = r;
    rf_status st = rf__comm_timeout(c, others, n, timeout_s, what);
    free(others);
    return st;
}

void rf__comm_backoff(int *polls) {
    int p = (*polls)++;
    if (p < 64) return;
    /* short naps rather than spinning: on the 2-core machine this was written on, a waiting
     * rank that spun made its peer's copies about 3 times slower (1 MB messages: 0.7 against
     * 2.4 GB/s) */
    rf_sleep(p < 2000 ? 20e-6 : 100e-6);
}

/* ---- dispatch ---- */

static rf_status usable(rf_comm *c, const char *what) {
    if (!c) return rf_error(RF_ERR_ARG, "%s: no communicator", what);
    if (c->failed[0])
        return rf_error(RF_ERR_IO, "%s: this communicator failed earlier (%s)", what, c->failed);
    return RF_OK;
}

#define WHAT(w) ((w) ? (w) : "communication")

rf_status rf_comm_allreduce(rf_comm *c, const float *in, float *out, size_t n, double timeout_s,
                            const char *what) {
    what = WHAT(what);
    RF_TRY(usable(c, what));
    return c->ops->allreduce(c, in, out, n, timeout_s, what);
}

rf_status rf_comm_reduce_scatter(rf_comm *c, const float *in, float *out, size_t n,
                                 double timeout_s, const char *what) {
    what = WHAT(what);
    RF_TRY(usable(c, what));
    return c->ops->reduce_scatter(c, in, out, n, timeout_s, what);
}

rf_status rf_comm_allgather(rf_comm *c, const void *in, void *out, size_t bytes,
                            double timeout_s, const char *what) {
    what = WHAT(what);
    RF_TRY(usable(c, what));
    return c->ops->allgather(c, in, out, bytes, timeout_s, what);
}

rf_status rf_comm_agree(rf_comm *c, rf_status mine, double timeout_s, const char *what, int *failed) {
    int size = rf_comm_size(c), bad = mine != RF_OK;
    char own[1024];
    snprintf(own, sizeof own, "%s", rf_error_message());
    *failed = -1;
    int *flags = calloc((size_t)size, sizeof(int));
    if (!flags) return mine != RF_OK ? mine : rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status st = rf_comm_allgather(c, &bad, flags, sizeof bad, timeout_s, what);
    for (int q = 0; st == RF_OK && q < size && *failed < 0; q++)
        if (flags[q]) *failed = q;
    free(flags);
    if (mine != RF_OK) return rf_error(mine, "%s", own);
    return st;
}

rf_status rf_comm_bcast(rf_comm *c, void *buf, size_t bytes, int root, double timeout_s,
                        const char *what) {
    what = WHAT(what);
    RF_TRY(usable(c, what));
    if (root < 0 || root >= c->size)
        return rf_error(RF_ERR_ARG, "%s: root %d is not a rank of a communicator of %d", what, root, c->size);
    return c->ops->bcast(c, buf, bytes, root, timeout_s, what);
}

rf_status rf_comm_barrier(rf_comm *c, double timeout_s, const char *what) {
    what = WHAT(what);
    RF_TRY(usable(c, what));
    return c->ops->barrier(c, timeout_s, what);
}

rf_status rf_comm_sendrecv_start(rf_comm *c, const rf_comm_p2p *ops, int n, const char *what,
                                 rf_comm_group **out) {
    *out = NULL;
    what = WHAT(what);
    RF_TRY(usable(c, what));
    for (int i = 0; i < n; i++)
        if (ops[i].peer < 0 || ops[i].peer >= c->size)
            return rf_error(RF_ERR_ARG, "%s: peer %d is not a rank of a communicator of %d", what,
                            ops[i].peer, c->size);
    rf_comm_group *g = calloc(1, sizeof *g);
    int *peer = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (!g || !peer) {
        free(g), free(peer);
        return rf_error(RF_ERR_NOMEM, "%s: out of memory", what);
    }
    for (int i = 0; i < n; i++) peer[i] = ops[i].peer;
    g->c = c, g->n = n, g->peer = peer;
    snprintf(g->what, sizeof g->what, "%s", what);
    rf_status st = n ? c->ops->sendrecv_start(c, ops, n, g) : RF_OK;
    if (st != RF_OK) {
        free(peer), free(g);
        return st;
    }
    *out = g;
    return RF_OK;
}

rf_status rf_comm_group_wait(rf_comm_group *g, double timeout_s) {
    if (!g) return RF_OK;
    if (g->c->failed[0]) timeout_s = 0; /* it will not complete: release it at once */
    /* a started collective on one rank has no peers but may hold requests */
    rf_status st = g->n || g->impl ? g->c->ops->group_wait(g, timeout_s) : RF_OK;
    free(g->peer), free(g);
    return st;
}

rf_status rf_comm_sendrecv(rf_comm *c, const rf_comm_p2p *ops, int n, double timeout_s,
                           const char *what) {
    rf_comm_group *g = NULL;
    RF_TRY(rf_comm_sendrecv_start(c, ops, n, what, &g));
    return rf_comm_group_wait(g, timeout_s);
}

rf_status rf_comm_split(rf_comm *c, int color, int key, rf_comm **out) {
    *out = NULL;
    RF_TRY(usable(c, "splitting a communicator"));
    return c->ops->split(c, color, key, out);
}

/* ---- non-blocking collectives ---- */

/* A group for a collective over c: its peers are every other rank (for timeout messages). */
static rf_comm_group *collective_group(rf_comm *c, const char *what) {
    rf_comm_group *g = calloc(1, sizeof *g);
    int *peer = malloc(sizeof(int) * (size_t)(c->size > 1 ? c->size - 1 : 1));
    if (!g || !peer) {
        free(g), free(peer);
        rf_error(RF_ERR_NOMEM, "%s: out of memory", what);
        return NULL;
    }
    for (int r = 0; r < c->size; r++)
        if (r != c->rank) peer[g->n++] = r;
    g->c = c, g->peer = peer;
    snprintf(g->what, sizeof g->what, "%s", what);
    return g;
}

/* Starts a reduce-scatter (scatter = 1) or an allreduce; without a start slot the blocking
 * operation runs now and the group returned is already complete. */
static rf_status reduce_start(rf_comm *c, int scatter, const float *in, float *out, size_t n,
                              double timeout_s, const char *what, rf_comm_group **out_g) {
    *out_g = NULL;
    what = WHAT(what);
    RF_TRY(usable(c, what));
    rf_comm_group *g = collective_group(c, what);
    if (!g) return RF_ERR_NOMEM;
    rf_status (*start)(rf_comm *, const float *, float *, size_t, rf_comm_group *) =
        scatter ? c->ops->reduce_scatter_start : c->ops->allreduce_start;
    rf_status st;
    if (start) {
        st = start(c, in, out, n, g);
    } else {
        st = scatter ? c->ops->reduce_scatter(c, in, out, n, timeout_s, what)
                     : c->ops->allreduce(c, in, out, n, timeout_s, what);
        g->n = 0; /* complete: the wait only frees it */
    }
    if (st != RF_OK) {
        free(g->peer), free(g);
        return st;
    }
    *out_g = g;
    return RF_OK;
}

rf_status rf_comm_allreduce_start(rf_comm *c, const float *in, float *out, size_t n,
                                  double timeout_s, const char *what, rf_comm_group **g) {
    return reduce_start(c, 0, in, out, n, timeout_s, what, g);
}

rf_status rf_comm_reduce_scatter_start(rf_comm *c, const float *in, float *out, size_t n,
                                       double timeout_s, const char *what, rf_comm_group **g) {
    return reduce_start(c, 1, in, out, n, timeout_s, what, g);
}

int rf_comm_group_test(rf_comm_group *g) {
    if (!g) return 1;
    if (g->c->failed[0]) {
        rf_error(RF_ERR_IO, "%s: this communicator failed earlier (%s)", g->what, g->c->failed);
        return -1;
    }
    if ((!g->n && !g->impl) || g->c->kind == RF_COMM_SINGLE) return 1;
    return g->c->ops->group_test ? g->c->ops->group_test(g) : 0;
}

/* ---- the single-rank back end ---- */

static rf_status single_allreduce(rf_comm *c, const float *in, float *out, size_t n, double t,
                                  const char *what) {
    (void)c, (void)t, (void)what;
    if (in != out) memcpy(out, in, n * sizeof(float));
    return RF_OK;
}

static rf_status single_reduce_scatter(rf_comm *c, const float *in, float *out, size_t n, double t,
                                       const char *what) {
    return single_allreduce(c, in, out, n, t, what);
}

static rf_status single_allgather(rf_comm *c, const void *in, void *out, size_t bytes, double t,
                                  const char *what) {
    (void)c, (void)t, (void)what;
    if (in != out) memcpy(out, in, bytes);
    return RF_OK;
}

static rf_status single_bcast(rf_comm *c, void *buf, size_t bytes, int root, double t, const char *what) {
    (void)c, (void)buf, (void)bytes, (void)root, (void)t, (void)what;
    return RF_OK;
}

static rf_status single_barrier(rf_comm *c, double t, const char *what) {
    (void)c, (void)t, (void)what;
    return RF_OK;
}

/* The k-th send pairs with the k-th receive, as between two ranks; copied at the start. */
static rf_status single_sendrecv_start(rf_comm *c, const rf_comm_p2p *ops, int n, rf_comm_group *g) {
    (void)c;
    const char *what = g->what;
    int s = 0, r = 0;
    for (;;) {
        while (s < n && !ops[s].send) s++;
        while (r < n && ops[r].send) r++;
        if (s == n || r == n) break;
        if (ops[s].bytes != ops[r].bytes)
            return rf_error(RF_ERR_ARG, "%s: a send of %zu bytes to self meets a receive of %zu", what,
                            ops[s].bytes, ops[r].bytes);
        memmove(ops[r].buf, ops[s].buf, ops[s].bytes);
        s++, r++;
    }
    if (s < n || r < n)
        return rf_error(RF_ERR_ARG, "%s: a %s to self has no matching %s", what, s < n ? "send" : "receive",
                        s < n ? "receive" : "send");
    return RF_OK;
}

static rf_status single_group_wait(rf_comm_group *g, double t) {
    (void)g, (void)t;
    return RF_OK;
}

static rf_status single_split(rf_comm *c, int color, int key, rf_comm **out);

static void single_free(rf_comm *c) { rf__comm_delete(c); }

static const rf_comm_ops single_ops = {
    "single", single_allreduce, single_reduce_scatter, single_allgather, single_bcast,
    single_barrier, single_sendrecv_start, single_group_wait, single_split, single_free,
    NULL, NULL, NULL, /* non-blocking collectives: reduced at the start */
    NULL,             /* host: host memory already */
};

static rf_status single_split(rf_comm *c, int color, int key, rf_comm **out) {
    (void)c, (void)key;
    if (color < 0) return RF_OK;
    *out = rf__comm_new(&single_ops, RF_COMM_SINGLE, 0, 1);
    return *out ? RF_OK : RF_ERR_NOMEM;
}

static int g_single_world = 0;
static rf_comm g_single = {&single_ops, RF_COMM_SINGLE, 0, 1, &g_single_world, 1, "", NULL};

rf_comm *rf_comm_single(void) { return &g_single; }

/* ---- device communicators ---- */

typedef struct placed {
    char host[64];
    int32_t device;
} placed;

rf_status rf__comm_distinct_devices(rf_comm *boot, int device, double timeout_s) {
    placed me, *all = calloc((size_t)boot->size, sizeof *all);
    if (!all) return rf_error(RF_ERR_NOMEM, "out of memory");
    memset(&me, 0, sizeof me);
    gethostname(me.host, sizeof me.host - 1);
    me.device = device;
    rf_status st = rf_comm_allgather(boot, &me, all, sizeof me, timeout_s, "gathering the ranks' CUDA devices");
    for (int i = 0; st == RF_OK && i < boot->size; i++)
        for (int j = 0; st == RF_OK && j < i; j++)
            if (all[i].device == all[j].device && strcmp(all[i].host, all[j].host) == 0)
                st = rf_error(RF_ERR_ARG, "a NCCL communicator: world ranks %d and %d would both use CUDA device %d of "
                              "%.63s (NCCL needs a device per rank: give the job more GPUs or fewer ranks per machine)",
                              rf_comm_world_rank(boot, j), rf_comm_world_rank(boot, i), (int)all[i].device, all[i].host);
    free(all);
    return st;
}

rf_status rf_comm_for(rf_comm *g, const rf_kernels *k, const char *what, double timeout_s, rf_comm **dev,
                      rf_comm **out) {
    *out = g;
    if (k == rf_cpu_kernels()) return RF_OK;
    rf_status st = rf_comm_nccl(g, rf_cuda_current_device(), timeout_s, dev);
    if (st != RF_OK) return rf_error_wrap(st, "%s on CUDA", what);
    *out = *dev;
    return RF_OK;
}

/* The NCCL back end lives in the CUDA module (kernels/cuda_module.h), opened on first use. */
rf_status rf_comm_nccl(rf_comm *from, int device, double timeout_s, rf_comm **out) {
    *out = NULL;
    if (rf_comm_nccl_built()) {
        const rf_cuda_module *m = rf__cuda_module();
        if (!m) return rf_error_wrap(RF_ERR_NODEVICE, "a NCCL communicator");
        if (m->comm_nccl) return m->comm_nccl(from, device, timeout_s, out);
    }
    return rf_error(RF_ERR_UNSUPPORTED, "the NCCL back end of comm is not in this build (CUDA and NCCL were not found when it was configured)");
}
