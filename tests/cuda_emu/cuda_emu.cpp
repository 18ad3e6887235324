/* The CUDA runtime and cuBLAS on the CPU, for the emulated CUDA module (include/cuda_runtime.h
 * says what it is and is not; docs/cuda.md, "Running the CUDA kernels on the CPU").
 *
 * Threads of a block are fibers on stacks of their own, switched by rf_emu_switch (x86-64: the
 * callee-saved registers and the stack pointer). The block's scheduler runs every runnable
 * fiber in turn until it waits at a barrier or returns. The thread that completes a barrier
 * releases it: a warp's lanes waiting at __syncwarp or a shuffle once every lane of their masks
 * waits, the whole block once every thread still running waits at __syncthreads. A pass that
 * finds nothing to run before every thread has returned is a deadlock, reported with the
 * kernel's name and the threads' states. Launches are serialised (one lock): kernels'
 * __shared__ arrays are plain statics, threadIdx and the rest plain globals.
 *
 * Settings (environment, read once): RF_EMU_ORDER=forward|reverse (the order threads run between
 * barriers and blocks run in a grid), RF_EMU_SM (compute capability, 90: limits of dynamic
 * shared memory as the hardware's), RF_EMU_GPUS (8: a device per rank of a data- or tensor-parallel
 * test), RF_EMU_GPU_MEMORY (bytes, 4 GiB); RF_MOCK_GPUS, RF_MOCK_GPU_MEMORY and RF_MOCK_GPU_STRICT
 * of the stand-in module where those are not set. */
#include <errno.h>
#include <deque>
#include <map>
#include <mutex>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unordered_map>
#include <vector>

#include "cublas_v2.h"
#include "cuda_bf16.h"
#include "cuda_runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define RF_EMU_ASAN 1
#else
#define RF_EMU_ASAN 0
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

/* ---- settings ---- */
namespace {
struct settings {
    int reverse, sm, gpus, strict;
    size_t memory;
};
settings g_set;
std::once_flag g_set_once;
const settings &cfg(void) {
    std::call_once(g_set_once, [] {
        const char *o = getenv("RF_EMU_ORDER"), *sm = getenv("RF_EMU_SM");
        const char *n = getenv("RF_EMU_GPUS"), *mem = getenv("RF_EMU_GPU_MEMORY");
        /* the stand-in module's settings, where a test sets those (tests/mock_cuda_module.c):
         * there a device's memory bounds allocations only under RF_MOCK_GPU_STRICT */
        g_set.strict = 1;
        if (!n) n = getenv("RF_MOCK_GPUS");
        if (!mem && (mem = getenv("RF_MOCK_GPU_MEMORY"))) g_set.strict = getenv("RF_MOCK_GPU_STRICT") != NULL;
        g_set.reverse = o && !strcmp(o, "reverse");
        g_set.sm = sm ? atoi(sm) : 90;
        g_set.gpus = n ? atoi(n) : 8;
        g_set.memory = mem ? strtoull(mem, NULL, 10) : (size_t)4 << 30;
    });
    return g_set;
}
thread_local cudaError_t t_last = cudaSuccess;
thread_local int t_device = 0;
cudaError_t fail(cudaError_t e) {
    t_last = e;
    return e;
}
} // namespace

/* ---- fibers ---- */
#if defined(__x86_64__)
extern "C" void rf_emu_switch(void **save_sp, void *load_sp);
__asm__(".text\n"
        ".globl rf_emu_switch\n"
        ".hidden rf_emu_switch\n"
        ".type rf_emu_switch,@function\n"
        "rf_emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size rf_emu_switch, .-rf_emu_switch\n");
#else
#error "the CUDA emulation switches fibers with x86-64 code"
#endif

namespace {
enum { F_RUN, F_SYNC, F_WARP, F_DONE };
const size_t STACK = 512 << 10; /* a fiber's stack; a guard page below it */

struct fiber {
    void *sp;
    char *base; /* mapping: guard page, then the stack */
    int state;
    unsigned mask; /* F_WARP: the lanes it waits for */
    int parity;    /* which slot its next whole-warp shuffle writes */
    uint3 tid;
    void *fake; /* AddressSanitizer's fake stack while switched out */
};

struct block_run {
    const char *name;
    void (*body)(void *);
    void *ctx;
    int n;   /* threads */
    int cur; /* running fiber */
    int n_sync, n_done;
    unsigned warp_wait[32]; /* lanes of each warp waiting at a warp barrier */
    int partial[32];        /* of those, how many wait for only some lanes */
    void *sched_sp;
    void *sched_fake;
    const void *sched_bottom;
    size_t sched_size;
    void *smem;
    uint64_t xch[3][1024]; /* shuffles: two alternating slots per lane for whole warps, one else */
    uint32_t mma[2][1024][6]; /* rf_emu_mma_m16n8k16: each lane's a (4) and b (2) registers,
                                 two alternating slots as the shuffles' */
};

std::mutex g_launch_lock; /* one launch at a time in the process */
std::deque<fiber> g_pool; /* a deque: a suspended fiber keeps a reference to its own */
block_run *g_run;

void fiber_main(void);

/* Fiber i's stack starts (i % 64) * 80 bytes below its mapping's top: at one offset in their
 * pages, 256 threads' frames would fall in the same few cache sets. */
void fiber_init(fiber &f, size_t i) {
    size_t page = 4096;
    void *m = mmap(NULL, STACK + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        fprintf(stderr, "cuda emulation: no memory for a thread's stack: %s\n", strerror(errno));
        abort();
    }
    mprotect(m, page, PROT_NONE);
    f.base = (char *)m;
    uintptr_t top = ((uintptr_t)m + STACK + page - i % 64 * 80) & ~(uintptr_t)15;
    void **sp = (void **)(top - 64);
    for (int i = 0; i < 6; i++) sp[i] = NULL;
    sp[6] = (void *)fiber_main;
    sp[7] = NULL;
    f.sp = sp;
    f.state = F_DONE;
    f.fake = NULL;
}

/* From the running fiber to the scheduler. */
void yield_to_scheduler(void) {
    block_run *r = g_run;
    fiber &f = g_pool[r->cur];
#if RF_EMU_ASAN
    __sanitizer_start_switch_fiber(&f.fake, r->sched_bottom, r->sched_size);
#endif
    rf_emu_switch(&f.sp, r->sched_sp);
#if RF_EMU_ASAN
    __sanitizer_finish_switch_fiber(f.fake, NULL, NULL);
#endif
}

/* Every thread still running waits at __syncthreads: all go on. */
void release_sync(block_run *r) {
    if (!r->n_sync || r->n_sync + r->n_done < r->n) return;
    for (int i = 0; i < r->n; i++)
        if (g_pool[i].state == F_SYNC) g_pool[i].state = F_RUN;
    r->n_sync = 0;
}

void fiber_main(void) {
#if RF_EMU_ASAN
    __sanitizer_finish_switch_fiber(NULL, &g_run->sched_bottom, &g_run->sched_size);
#endif
    for (;;) {
        block_run *r = g_run;
        r->body(r->ctx);
        g_pool[r->cur].state = F_DONE;
        r->n_done++;
        release_sync(r);
        yield_to_scheduler();
    }
}

void switch_to(block_run *r, int i) {
    fiber &f = g_pool[i];
    r->cur = i;
    threadIdx = f.tid;
#if RF_EMU_ASAN
    __sanitizer_start_switch_fiber(&r->sched_fake, f.base + 4096, STACK);
#endif
    rf_emu_switch(&r->sched_sp, f.sp);
#if RF_EMU_ASAN
    __sanitizer_finish_switch_fiber(r->sched_fake, &r->sched_bottom, &r->sched_size);
#endif
}

block_run *running(const char *what) {
    if (!g_run) {
        fprintf(stderr, "cuda emulation: %s called outside a kernel\n", what);
        abort();
    }
    return g_run;
}

[[noreturn]] void deadlock(block_run *r) {
    int c[4] = {0, 0, 0, 0};
    for (int i = 0; i < r->n; i++) c[g_pool[i].state]++;
    fprintf(stderr,
            "cuda emulation: kernel %s, block (%u, %u, %u) deadlocks: %d threads at __syncthreads, %d at "
            "a warp barrier, %d returned\n",
            r->name, blockIdx.x, blockIdx.y, blockIdx.z, c[F_SYNC], c[F_WARP], c[F_DONE]);
    abort();
}

/* Runs one block to its end. */
void run_block(block_run *r) {
    int n = r->n, rev = cfg().reverse;
    for (int i = 0; i < n; i++) g_pool[i].state = F_RUN, g_pool[i].parity = 0;
    r->n_sync = r->n_done = 0;
    memset(r->warp_wait, 0, sizeof r->warp_wait);
    memset(r->partial, 0, sizeof r->partial);
    while (r->n_done < n) {
        int ran = 0;
        for (int k = 0; k < n; k++) {
            int i = rev ? n - 1 - k : k;
            if (g_pool[i].state == F_RUN) switch_to(r, i), ran = 1;
        }
        if (!ran && r->n_done < n) deadlock(r);
    }
}

std::mutex g_attr_lock;
std::unordered_map<const void *, int> g_smem_attr; /* kernel -> MaxDynamicSharedMemorySize */

int optin_smem(void) {
    int sm = cfg().sm;
    return sm >= 90 ? 232448 : sm == 80 || sm == 87 ? 166912 : sm >= 86 ? 101376 : 65536;
}
} // namespace

void __syncthreads(void) {
    block_run *r = running("__syncthreads");
    g_pool[r->cur].state = F_SYNC;
    r->n_sync++;
    release_sync(r);
    if (g_pool[r->cur].state != F_RUN) yield_to_scheduler();
}

void __syncwarp(unsigned mask) {
    block_run *r = running("__syncwarp");
    int t = r->cur, w = t / 32, lane = t % 32, lanes = r->n - w * 32 < 32 ? r->n - w * 32 : 32;
    unsigned all = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    if (!(mask >> lane & 1) || (mask & ~all)) {
        fprintf(stderr, "cuda emulation: kernel %s: lane %d of a warp of %d calls a warp barrier with mask 0x%08x\n",
                r->name, lane, lanes, mask);
        abort();
    }
    fiber &f = g_pool[t];
    f.state = F_WARP;
    f.mask = mask;
    if (mask != all) r->partial[w]++;
    unsigned wait = r->warp_wait[w] |= 1u << lane, go = 0;
    if (!r->partial[w]) { /* every lane waiting waits for the whole warp */
        if (wait != all) return yield_to_scheduler();
        go = all;
    } else {
        for (unsigned m = wait; m; m &= m - 1) { /* lanes whose masks have all arrived */
            int l = __builtin_ctz(m);
            if ((g_pool[w * 32 + l].mask & ~wait) == 0) go |= 1u << l;
        }
    }
    for (unsigned m = go; m; m &= m - 1) {
        fiber &g = g_pool[w * 32 + __builtin_ctz(m)];
        g.state = F_RUN;
        if (g.mask != all) r->partial[w]--;
    }
    r->warp_wait[w] = wait & ~go;
    if (f.state != F_RUN) yield_to_scheduler();
}

uint64_t rf_emu_warp_exchange(unsigned mask, uint64_t mine, int src) {
    block_run *r = running("a warp shuffle");
    int t = r->cur, base = t - t % 32;
    if (src >= 0 && (!(mask >> src & 1) || base + src >= r->n)) {
        fprintf(stderr, "cuda emulation: kernel %s: lane %d reads lane %d outside the mask 0x%08x\n", r->name,
                t % 32, src, mask);
        abort();
    }
    int whole = mask == 0xffffffffu && base + 32 <= r->n;
    /* A whole warp's exchanges alternate between two slots per lane: a lane can be at most one
     * exchange ahead of the others (the next one's barrier waits for them). Others: a slot of
     * their own and a second barrier before it may be written again. */
    uint64_t *slot = whole ? r->xch[g_pool[t].parity ^= 1] : r->xch[2];
    slot[t] = mine;
    __syncwarp(mask);
    uint64_t got = src >= 0 ? slot[base + src] : mine;
    if (!whole) __syncwarp(mask);
    return got;
}

/* PTX mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 on the lanes of a whole warp
 * (kernels/cuda/cuda_mma.cuh gives the fragments' layout): every lane offers its registers at
 * one barrier and computes its four results from all of them (exact products, added in order
 * over k in fp32). The offers alternate between two slots, as the
 * shuffles' do: a lane can be at most one mma ahead of the others. */
static float bf16_half(uint32_t w, int hi) {
    uint32_t bits = (hi ? w >> 16 : w & 0xffffu) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void rf_emu_mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    block_run *r = running("an mma");
    int t = r->cur, base = t - t % 32, lane = t % 32, g = lane / 4, q = lane % 4;
    if (base + 32 > r->n) {
        fprintf(stderr, "cuda emulation: kernel %s: an mma in a warp of fewer than 32 threads\n", r->name);
        abort();
    }
    uint32_t(*slot)[6] = r->mma[g_pool[t].parity ^= 1];
    memcpy(slot[t], a, 4 * sizeof(uint32_t));
    memcpy(slot[t] + 4, b, 2 * sizeof(uint32_t));
    __syncwarp();
    /* A (16 x 16): row i, k = 2 u + h (+ 8): register (i >= 8) + 2 (k >= 8) of lane (i % 8) 4 + u;
     * B (16 x 8): column j, k = 2 u + h (+ 8): register 4 + (k >= 8) of lane 4 j + u */
    float A[2][16], B[2][16];
    for (int k = 0; k < 16; k++) {
        int u = (k % 8) / 2, hi = k % 2, k8 = k >= 8;
        A[0][k] = bf16_half(slot[base + g * 4 + u][2 * k8], hi);
        A[1][k] = bf16_half(slot[base + g * 4 + u][1 + 2 * k8], hi);
        B[0][k] = bf16_half(slot[base + 2 * q * 4 + u][4 + k8], hi);
        B[1][k] = bf16_half(slot[base + (2 * q + 1) * 4 + u][4 + k8], hi);
    }
    for (int e = 0; e < 4; e++) {
        float acc = d[e];
        for (int k = 0; k < 16; k++) acc += A[e >> 1][k] * B[e & 1][k];
        d[e] = acc;
    }
}

void __trap(void) {
    block_run *r = g_run;
    fprintf(stderr, "cuda emulation: kernel %s, block (%u, %u, %u), thread (%u, %u, %u): __trap()\n",
            r ? r->name : "?", blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    abort();
}

void *rf_emu_dynamic_smem(void) { return running("extern __shared__")->smem; }

cudaError_t rf_emu_func_set_attribute(const void *fn, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > optin_smem())
        return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> g(g_attr_lock);
    g_smem_attr[fn] = value;
    return cudaSuccess;
}

void rf_emu_launch_body(const char *name, const void *fn, void (*body)(void *), void *ctx, dim3 grid,
                        dim3 block, size_t smem, cudaStream_t stream) {
    (void)stream;
    size_t n = (size_t)block.x * block.y * block.z;
    if (n == 0 || n > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.y > 65535 || grid.z > 65535 || grid.x > 0x7fffffffu) {
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    int limit = 49152;
    {
        std::lock_guard<std::mutex> g(g_attr_lock);
        auto it = g_smem_attr.find(fn);
        if (it != g_smem_attr.end()) limit = it->second;
    }
    if (smem > (size_t)limit) {
        fail(cudaErrorInvalidValue);
        return;
    }
    static thread_local int in_kernel;
    if (in_kernel) {
        fprintf(stderr, "cuda emulation: kernel %s launched from a kernel\n", name);
        abort();
    }
    std::lock_guard<std::mutex> serial(g_launch_lock);
    in_kernel = 1;
    while (g_pool.size() < n) {
        g_pool.emplace_back();
        fiber_init(g_pool.back(), g_pool.size() - 1);
    }
    for (size_t i = 0; i < n; i++)
        g_pool[i].tid = uint3{(unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                              (unsigned)(i / ((size_t)block.x * block.y))};
    block_run r;
    memset(&r, 0, sizeof r);
    r.name = name;
    r.body = body;
    r.ctx = ctx;
    r.n = (int)n;
    if (smem && posix_memalign(&r.smem, 128, smem)) {
        fprintf(stderr, "cuda emulation: no memory for %zu bytes of shared memory\n", smem);
        abort();
    }
    gridDim = grid;
    blockDim = block;
    g_run = &r;
    size_t blocks = (size_t)grid.x * grid.y * grid.z;
    for (size_t b = 0; b < blocks; b++) {
        size_t o = cfg().reverse ? blocks - 1 - b : b;
        blockIdx = uint3{(unsigned)(o % grid.x), (unsigned)(o / grid.x % grid.y),
                         (unsigned)(o / ((size_t)grid.x * grid.y))};
        if (smem) memset(r.smem, 0xff, smem);
        run_block(&r);
    }
    g_run = NULL;
    in_kernel = 0;
    free(r.smem);
}

/* ---- memory ---- */
namespace {
std::mutex g_mem_lock;
std::map<uintptr_t, size_t> g_blocks; /* device allocations: start -> bytes */
size_t g_used;

} // namespace

int rf_emu_on_device(const void *p, size_t bytes) {
    std::lock_guard<std::mutex> g(g_mem_lock);
    auto it = g_blocks.upper_bound((uintptr_t)p);
    if (it == g_blocks.begin()) return 0;
    --it;
    return (uintptr_t)p + bytes <= it->first + it->second;
}

namespace {
cudaError_t not_device(const char *call, const void *p, size_t bytes) {
    fprintf(stderr, "cuda emulation: %s given %zu bytes at %p that are not device memory\n", call, bytes, p);
    return fail(cudaErrorInvalidValue);
}
} // namespace

cudaError_t cudaMalloc(void **p, size_t bytes) {
    *p = NULL;
    size_t n = bytes ? bytes : 1;
    {
        std::lock_guard<std::mutex> g(g_mem_lock);
        if (cfg().strict && g_used + n > cfg().memory) return fail(cudaErrorMemoryAllocation);
        g_used += n;
    }
    void *m = NULL;
    if (posix_memalign(&m, 256, n)) {
        std::lock_guard<std::mutex> g(g_mem_lock);
        g_used -= n;
        return fail(cudaErrorMemoryAllocation);
    }
    memset(m, 0xff, n); /* never written reads as NaN */
    std::lock_guard<std::mutex> g(g_mem_lock);
    g_blocks[(uintptr_t)m] = n;
    *p = m;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    {
        std::lock_guard<std::mutex> g(g_mem_lock);
        auto it = g_blocks.find((uintptr_t)p);
        if (it == g_blocks.end()) {
            fprintf(stderr, "cuda emulation: cudaFree of %p, not an allocation\n", p);
            return fail(cudaErrorInvalidValue);
        }
        g_used -= it->second;
        g_blocks.erase(it);
    }
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return cudaFree(p); }

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    if (!bytes) return cudaSuccess;
    bool dd = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost;
    bool sd = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost;
    if (!dd && !rf_emu_on_device(dst, bytes)) return not_device("cudaMemcpy's destination", dst, bytes);
    if (!sd && !rf_emu_on_device(src, bytes)) return not_device("cudaMemcpy's source", src, bytes);
    if (kind == cudaMemcpyHostToDevice && rf_emu_on_device(src, bytes))
        return not_device("cudaMemcpy (host to device) from device memory:", src, bytes);
    if (kind == cudaMemcpyDeviceToHost && rf_emu_on_device(dst, bytes))
        return not_device("cudaMemcpy (device to host) into device memory:", dst, bytes);
    memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
    return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t) {
    if (!bytes) return cudaSuccess;
    if (!rf_emu_on_device(p, bytes)) return not_device("cudaMemsetAsync", p, bytes);
    memset(p, value, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    std::lock_guard<std::mutex> g(g_mem_lock);
    *total_bytes = cfg().memory;
    *free_bytes = g_used < cfg().memory ? cfg().memory - g_used : 0;
    return cudaSuccess;
}

/* ---- device, streams ---- */
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unknown error";
}
cudaError_t cudaGetLastError(void) {
    cudaError_t e = t_last;
    t_last = cudaSuccess;
    return e;
}
cudaError_t cudaGetDeviceCount(int *n) {
    *n = cfg().gpus;
    return *n > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}
cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= cfg().gpus) return fail(cudaErrorInvalidDevice);
    t_device = device;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    if (device < 0 || device >= cfg().gpus) return fail(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = cfg().sm / 10; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = cfg().sm % 10; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = optin_smem(); return cudaSuccess;
    }
    return fail(cudaErrorInvalidValue);
}
struct rf_emu_stream {
    int unused;
};
struct rf_emu_pool {
    size_t threshold;
};
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = new rf_emu_stream();
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    delete s;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; } /* everything is done at once */
struct rf_emu_event {
    int unused;
};
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) {
    *e = new rf_emu_event();
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device) {
    static rf_emu_pool pools[64];
    if (device < 0 || device >= cfg().gpus || device >= 64) return fail(cudaErrorInvalidDevice);
    *pool = &pools[device];
    return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value) {
    if (attr != cudaMemPoolAttrReleaseThreshold) return fail(cudaErrorInvalidValue);
    pool->threshold = (size_t) * (uint64_t *)value;
    return cudaSuccess;
}

/* ---- cuBLAS ---- */
struct rf_emu_blas {
    cudaStream_t stream;
};
cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new rf_emu_blas();
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

namespace {
float tf32(float f) { /* to nearest, ties away from zero, 10 mantissa bits */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    memcpy(&f, &u, 4);
    return f;
}
/* op(X) as rows x k, row-major, in float: element (i, p) of op(X), X column-major (ld). */
std::vector<float> pack(const void *X, cudaDataType t, int trans, int rows, int k, int ld, bool round) {
    std::vector<float> out((size_t)rows * k);
    for (int i = 0; i < rows; i++)
        for (int p = 0; p < k; p++) {
            size_t at = trans ? (size_t)i * ld + p : (size_t)p * ld + i;
            float v = t == CUDA_R_16BF ? __bfloat162float(((const __nv_bfloat16 *)X)[at]) : ((const float *)X)[at];
            out[(size_t)i * k + p] = round ? tf32(v) : v;
        }
    return out;
}
} // namespace

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B,
                            cudaDataType bt, int ldb, const void *beta, void *C, cudaDataType ct, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0 || ldc < (m > 1 ? m : 1) || ct != CUDA_R_32F ||
        (at != CUDA_R_32F && at != CUDA_R_16BF) || (bt != CUDA_R_32F && bt != CUDA_R_16BF))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (lda < ((ta ? k : m) > 1 ? (ta ? k : m) : 1) || ldb < ((tb ? n : k) > 1 ? (tb ? n : k) : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    size_t asz = ta ? (size_t)(m - 1) * lda + k : (size_t)(k - 1) * lda + m;
    size_t bsz = tb ? (size_t)(k - 1) * ldb + n : (size_t)(n - 1) * ldb + k;
    size_t esz = at == CUDA_R_16BF ? 2 : 4, fsz = bt == CUDA_R_16BF ? 2 : 4;
    if ((k && (!rf_emu_on_device(A, asz * esz) || !rf_emu_on_device(B, bsz * fsz))) || !rf_emu_on_device(C, ((size_t)(n - 1) * ldc + m) * 4)) {
        fprintf(stderr, "cuda emulation: cublasGemmEx given an operand outside device memory\n");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    bool round = compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    float a = *(const float *)alpha, b = *(const float *)beta;
    std::vector<float> Ap = k ? pack(A, at, ta == CUBLAS_OP_T, m, k, lda, round && at == CUDA_R_32F) : std::vector<float>();
    std::vector<float> Bp = k ? pack(B, bt, tb == CUBLAS_OP_N, n, k, ldb, round && bt == CUDA_R_32F) : std::vector<float>();
    float *c = (float *)C;
#pragma omp parallel for schedule(static)
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            const float *x = k ? &Ap[(size_t)i * k] : NULL, *y = k ? &Bp[(size_t)j * k] : NULL;
            float s = 0.0f;
            for (int p = 0; p < k; p++) s += x[p] * y[p];
            float *o = &c[(size_t)j * ldc + i];
            *o = b == 0.0f ? a * s : a * s + b * *o;
        }
    return CUBLAS_STATUS_SUCCESS;
}
