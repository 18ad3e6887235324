/* A stand-in for the CUDA module (kernels/cuda_module.h) that runs on the CPU, so that the
 * host side of rlflow's CUDA paths runs where there is no GPU: the choice of devices, the
 * NCCL communicators and which buffers go over them, the staging of weights, checkpoints and
 * optimizer state between device and host memory. Loaded with RLFLOW_CUDA_MODULE=<path of
 * librlflow_mockcuda.so>; tests only (docs/cuda.md, "Running the CUDA paths on the CPU").
 *
 *   kernels       the CPU kernels under the name "cuda", with memory of their own ("device
 *                 memory": host memory the module allocates and tracks). An op reads and
 *                 writes that memory as the CPU back end would; to_device/to_host/copy are
 *                 memcpy. So a value that never crossed to or from the "device" (a missing
 *                 upload or download) shows as a wrong result, as it would on a GPU.
 *                 mem_info reports RF_MOCK_GPU_MEMORY bytes (default 16 GiB) less those
 *                 allocated.
 *   devices       RF_MOCK_GPUS of them (default 8); one per process, as the real back end.
 *   NCCL          a communicator of kind RF_COMM_NCCL over a duplicate of the MPI (or single)
 *                 one it is made from: every buffer handed to it must lie in "device" memory
 *                 (else the operation fails naming it: host memory given to NCCL), and
 *                 rf_comm_host gives the duplicate. Two ranks of one machine on one device
 *                 are refused as by the real back end.
 * What it cannot show: anything about the GPU itself (kernels, streams, NCCL's own
 * behaviour), and a device buffer read directly by host code (both are host memory here). */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "kernels/cuda_module.h"

/* ---- "device" memory: host blocks this module allocated, tracked ---- */

typedef struct block {
    char *p;
    size_t n;
} block;

static block *g_blocks;
static size_t g_n_blocks, g_cap_blocks;
/* the table is shared by a colocated process's two threads (training and rollout ranks) */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static size_t g_used; /* bytes in g_blocks, and reserved by allocations under way */

/* The device's memory: $RF_MOCK_GPU_MEMORY bytes (default 16 GiB). */
static size_t dev_total(void) {
    const char *env = getenv("RF_MOCK_GPU_MEMORY");
    return env ? (size_t)strtoull(env, NULL, 10) : (size_t)16 << 30;
}

/* With RF_MOCK_GPU_STRICT=1, fails as cudaMalloc does when the blocks allocated and this one
 * would exceed the device's memory (dev_total); without, only the free memory reported drops
 * (a tight RF_MOCK_GPU_MEMORY then sizes a rollout device's KV cache without starving the
 * other processes' devices). */
static void *dev_alloc(size_t bytes) {
    size_t n = bytes ? bytes : 1;
    pthread_mutex_lock(&g_mu);
    const char *strict = getenv("RF_MOCK_GPU_STRICT");
    int fits = !(strict && strcmp(strict, "1") == 0) || g_used + n <= dev_total();
    if (fits) g_used += n; /* reserved */
    pthread_mutex_unlock(&g_mu);
    if (!fits) return NULL;
    void *p = rf_cpu_kernels()->alloc(n); /* aligned and zeroed */
    pthread_mutex_lock(&g_mu);
    if (p && g_n_blocks == g_cap_blocks) {
        size_t cap = g_cap_blocks ? 2 * g_cap_blocks : 256;
        block *b = realloc(g_blocks, cap * sizeof *b);
        if (b) g_blocks = b, g_cap_blocks = cap;
        else rf_cpu_kernels()->free(p), p = NULL;
    }
    if (p) g_blocks[g_n_blocks++] = (block){p, n};
    else g_used -= n;
    pthread_mutex_unlock(&g_mu);
    return p;
}

static void dev_free(void *p) {
    if (!p) return;
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n_blocks; i++)
        if (g_blocks[i].p == p) {
            g_used -= g_blocks[i].n;
            g_blocks[i] = g_blocks[--g_n_blocks];
            pthread_mutex_unlock(&g_mu);
            rf_cpu_kernels()->free(p);
            return;
        }
    pthread_mutex_unlock(&g_mu);
    fprintf(stderr, "mock cuda: free of %p, which is not device memory\n", p);
    abort();
}

/* That less the blocks allocated (a real device's free memory drops the same way as buffers
 * are made). */
static int dev_mem_info(size_t *free_bytes, size_t *total_bytes) {
    size_t total = dev_total();
    pthread_mutex_lock(&g_mu);
    size_t used = g_used;
    pthread_mutex_unlock(&g_mu);
    *total_bytes = total, *free_bytes = used < total ? total - used : 0;
    return 0;
}

/* 1 when [p, p + bytes) lies inside one device block. */
static int on_device(const void *p, size_t bytes) {
    const char *c = p;
    if (bytes == 0) return 1;
    int found = 0;
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n_blocks && !found; i++)
        found = c >= g_blocks[i].p && c + bytes <= g_blocks[i].p + g_blocks[i].n;
    pthread_mutex_unlock(&g_mu);
    return found;
}

/* ---- kernels and devices ---- */

static rf_kernels g_table;
static int g_device = -1;

/* As the real CUDA back end (kernels/cuda/cuda_backend.cu): fp32 only, so that model.precision
 * = "auto" takes its fp32 fallback on the stand-in as on a GPU. */
static rf_status mock_set_precision(rf_precision p) {
    if (p != RF_PRECISION_FP32)
        return rf_error(RF_ERR_UNSUPPORTED, "cuda: bf16 matrix products are not built yet");
    return rf_cpu_kernels()->set_precision(p);
}

static const rf_kernels *mock_kernels(int device) {
    if (g_device >= 0 && device != g_device) {
        rf_error(RF_ERR_UNSUPPORTED, "cuda: the back end already runs on device %d; one device per process "
                 "(asked for device %d)", g_device, device);
        return NULL;
    }
    const char *env = getenv("RF_MOCK_GPUS");
    int n = env ? atoi(env) : 8;
    if (device < 0 || device >= n) {
        rf_error(RF_ERR_NODEVICE, "cuda: device %d out of range (%d GPUs visible)", device, n);
        return NULL;
    }
    if (g_device < 0) {
        g_table = *rf_cpu_kernels();
        g_table.name = "cuda";
        g_table.alloc = dev_alloc, g_table.free = dev_free, g_table.mem_info = dev_mem_info;
        g_table.set_precision = mock_set_precision;
        g_device = device;
    }
    return &g_table;
}

static int mock_device_count(void) {
    const char *env = getenv("RF_MOCK_GPUS");
    return env ? atoi(env) : 8;
}

static int mock_current_device(void) { return g_device; }
static void *mock_stream(void) { return NULL; }

/* ---- "NCCL": forwarding to a duplicate of the MPI communicator, device buffers only ---- */

typedef struct mock_nccl {
    rf_comm *inner; /* owned */
} mock_nccl;

static rf_comm *inner_of(rf_comm *c) { return ((mock_nccl *)c->impl)->inner; }

static rf_status not_device(rf_comm *c, const char *what, const void *p, size_t bytes) {
    return rf_error(RF_ERR_ARG, "%s: mock NCCL on world rank %d was given %zu bytes at %p that are not device memory",
                    what, c->world[c->rank], bytes, p);
}

#define NEED_DEVICE(c, what, p, bytes) \
    do { if (!on_device((p), (bytes))) return not_device((c), (what), (p), (bytes)); } while (0)

static rf_status m_allreduce(rf_comm *c, const float *in, float *out, size_t n, double t, const char *what) {
    NEED_DEVICE(c, what, in, n * sizeof(float));
    NEED_DEVICE(c, what, out, n * sizeof(float));
    return rf_comm_allreduce(inner_of(c), in, out, n, t, what);
}

static rf_status m_reduce_scatter(rf_comm *c, const float *in, float *out, size_t n, double t, const char *what) {
    NEED_DEVICE(c, what, in, n * sizeof(float) * (size_t)c->size);
    NEED_DEVICE(c, what, out, n * sizeof(float));
    return rf_comm_reduce_scatter(inner_of(c), in, out, n, t, what);
}

static rf_status m_allgather(rf_comm *c, const void *in, void *out, size_t bytes, double t, const char *what) {
    NEED_DEVICE(c, what, in, bytes);
    NEED_DEVICE(c, what, out, bytes * (size_t)c->size);
    return rf_comm_allgather(inner_of(c), in, out, bytes, t, what);
}

static rf_status m_bcast(rf_comm *c, void *buf, size_t bytes, int root, double t, const char *what) {
    NEED_DEVICE(c, what, buf, bytes);
    return rf_comm_bcast(inner_of(c), buf, bytes, root, t, what);
}

static rf_status m_barrier(rf_comm *c, double t, const char *what) { return rf_comm_barrier(inner_of(c), t, what); }

static rf_status m_sendrecv_start(rf_comm *c, const rf_comm_p2p *ops, int n, rf_comm_group *g) {
    for (int i = 0; i < n; i++) NEED_DEVICE(c, g->what, ops[i].buf, ops[i].bytes);
    rf_comm_group *inner = NULL;
    RF_TRY(rf_comm_sendrecv_start(inner_of(c), ops, n, g->what, &inner));
    g->impl = inner;
    return RF_OK;
}

static rf_status m_group_wait(rf_comm_group *g, double t) {
    rf_comm_group *inner = g->impl;
    g->impl = NULL;
    return rf_comm_group_wait(inner, t);
}

static rf_status wrap(rf_comm *inner, rf_comm **out);

static rf_status m_split(rf_comm *c, int color, int key, rf_comm **out) {
    rf_comm *sub = NULL;
    RF_TRY(rf_comm_split(inner_of(c), color, key, &sub));
    return sub ? wrap(sub, out) : RF_OK;
}

static void m_free(rf_comm *c) {
    rf_comm_free(inner_of(c));
    free(c->impl);
    rf__comm_delete(c);
}

static rf_comm *m_host(rf_comm *c) { return inner_of(c); }

static const rf_comm_ops mock_ops = {
    "nccl", m_allreduce, m_reduce_scatter, m_allgather, m_bcast, m_barrier, m_sendrecv_start,
    m_group_wait, m_split, m_free, NULL, NULL, NULL, m_host,
};

/* A mock NCCL communicator over inner (which it then owns). */
static rf_status wrap(rf_comm *inner, rf_comm **out) {
    mock_nccl *s = calloc(1, sizeof *s);
    rf_comm *c = s ? rf__comm_new(&mock_ops, RF_COMM_NCCL, rf_comm_rank(inner), rf_comm_size(inner)) : NULL;
    if (!c) {
        free(s);
        rf_comm_free(inner);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    for (int r = 0; r < c->size; r++) c->world[r] = rf_comm_world_rank(inner, r);
    s->inner = inner, c->impl = s;
    *out = c;
    return RF_OK;
}

static rf_status mock_comm_nccl(rf_comm *from, int device, double timeout_s, rf_comm **out) {
    *out = NULL;
    if (!from || rf_comm_backend(from) == RF_COMM_NCCL)
        return rf_error(RF_ERR_ARG, "a NCCL communicator is made from an MPI or single one");
    if (device < 0 || device >= mock_device_count())
        return rf_error(RF_ERR_NODEVICE, "world rank %d: CUDA device %d does not exist (%d found)",
                        rf_comm_world_rank(from, rf_comm_rank(from)), device, mock_device_count());
    rf_comm *dup = NULL;
    RF_TRY(rf_comm_split(from, 0, rf_comm_rank(from), &dup));
    rf_status st = rf__comm_distinct_devices(dup, device, timeout_s);
    if (st != RF_OK) {
        rf_comm_free(dup);
        return st;
    }
    return wrap(dup, out);
}

static const rf_cuda_module g_module = {
    RF_CUDA_MODULE_ABI, mock_kernels, mock_device_count, mock_current_device, mock_stream, mock_comm_nccl,
};

__attribute__((visibility("default"))) const rf_cuda_module *rf__cuda_module_entry(void) { return &g_module; }
