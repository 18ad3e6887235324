/* Shareable host memory: memory files mapped here, opened by other processes through /proc. */
#define _GNU_SOURCE
#include "common/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct shm_block {
    void *base;
    size_t bytes;
    int fd; /* -1: plain memory */
    uint64_t inode;
} shm_block;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static shm_block *g_blocks;
static int g_n, g_cap;

static size_t page_round(size_t bytes) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + pg - 1) / pg * pg;
}

/* A memory file of `bytes` mapped read-write, or -1 (errno set). */
static int map_memfd(size_t bytes, const char *what, void **base, uint64_t *inode) {
    char name[64];
    snprintf(name, sizeof name, "rlflow-%s", what);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return -1;
    struct stat s;
    if (ftruncate(fd, (off_t)bytes) != 0 || fstat(fd, &s) != 0) {
        close(fd);
        return -1;
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return -1;
    }
    *base = p, *inode = (uint64_t)s.st_ino;
    return fd;
}

static rf_status remember(shm_block b) {
    pthread_mutex_lock(&g_lock);
    if (g_n == g_cap) {
        int cap = g_cap ? 2 * g_cap : 16;
        shm_block *nb = realloc(g_blocks, sizeof(shm_block) * (size_t)cap);
        if (!nb) {
            pthread_mutex_unlock(&g_lock);
            return rf_error(RF_ERR_NOMEM, "out of memory");
        }
        g_blocks = nb, g_cap = cap;
    }
    g_blocks[g_n++] = b;
    pthread_mutex_unlock(&g_lock);
    return RF_OK;
}

rf_status rf_shm_alloc(void **out, size_t bytes, const char *what) {
    *out = NULL;
    if (bytes == 0) bytes = 1;
    size_t len = page_round(bytes);
    shm_block b = {NULL, len, -1, 0};
    b.fd = map_memfd(len, what, &b.base, &b.inode);
    if (b.fd < 0) { /* no memory files here: plain memory, never shared */
        if (posix_memalign(&b.base, (size_t)sysconf(_SC_PAGESIZE), len) != 0)
            return rf_error(RF_ERR_NOMEM, "%s: out of memory (%zu bytes)", what, bytes);
        memset(b.base, 0, len);
    }
    rf_status st = remember(b);
    if (st != RF_OK) {
        if (b.fd >= 0) munmap(b.base, len), close(b.fd);
        else free(b.base);
        return st;
    }
    *out = b.base;
    return RF_OK;
}

void rf_shm_free(void *p) {
    if (!p) return;
    shm_block b = {NULL, 0, -2, 0};
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_n; i++)
        if (g_blocks[i].base == p) {
            b = g_blocks[i];
            g_blocks[i] = g_blocks[--g_n];
            break;
        }
    pthread_mutex_unlock(&g_lock);
    if (b.fd == -2) abort(); /* not from rf_shm_alloc: a programming error */
    if (b.fd >= 0) munmap(b.base, b.bytes), close(b.fd);
    else free(b.base);
}

int rf_shm_lookup(const void *p, size_t bytes, rf_shm_ref *ref) {
    uint64_t host = rf_shm_host_key();
    const char *c = p;
    int found = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_n && !found; i++) {
        const shm_block *b = &g_blocks[i];
        const char *base = b->base;
        if (b->fd < 0 || c < base || c + bytes > base + b->bytes) continue;
        *ref = (rf_shm_ref){host, b->inode, b->bytes, (uint64_t)(c - base), (int32_t)getpid(), b->fd};
        found = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return found && host != 0;
}

/* FNV-1a. */
static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

static uint64_t g_key;

/* boot id (same kernel) and the PID namespace (so /proc/<pid> names the same process). */
static void init_key(void) {
    char boot[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) return;
    size_t n = fread(boot, 1, sizeof boot - 1, f);
    fclose(f);
    struct stat s;
    if (n == 0 || stat("/proc/self/ns/pid", &s) != 0) return;
    uint64_t h = hash_bytes(1469598103934665603ull, boot, n);
    h = hash_bytes(h, &s.st_ino, sizeof s.st_ino);
    h = hash_bytes(h, &s.st_dev, sizeof s.st_dev);
    g_key = h ? h : 1;
}

uint64_t rf_shm_host_key(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_key);
    return g_key;
}

rf_status rf_shm_map_open(rf_shm_map *m, const rf_shm_ref *ref) {
    memset(m, 0, sizeof *m);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)ref->pid, (int)ref->fd);
    if (ref->host == 0 || ref->host != rf_shm_host_key())
        return rf_error(RF_ERR_IO, "shared memory of pid %d: on another host or PID namespace", (int)ref->pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return rf_error(RF_ERR_IO, "shared memory of pid %d: cannot open %s: %s", (int)ref->pid, path, strerror(errno));
    struct stat s;
    if (fstat(fd, &s) != 0 || (uint64_t)s.st_ino != ref->inode || (uint64_t)s.st_size < ref->region) {
        close(fd);
        return rf_error(RF_ERR_IO, "shared memory of pid %d: %s is not the allocation described (inode %llu, expected %llu)",
                        (int)ref->pid, path, (unsigned long long)s.st_ino, (unsigned long long)ref->inode);
    }
    void *p = mmap(NULL, ref->region, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return rf_error(RF_ERR_IO, "shared memory of pid %d: cannot map %llu bytes: %s", (int)ref->pid,
                        (unsigned long long)ref->region, strerror(errno));
    m->base = p, m->bytes = ref->region, m->ref = *ref;
    return RF_OK;
}

rf_status rf_shm_map_keep(rf_shm_map *m, const rf_shm_ref *ref) {
    const rf_shm_ref *had = &m->ref;
    if (m->base && had->host == ref->host && had->inode == ref->inode && had->pid == ref->pid && had->fd == ref->fd &&
        had->region == ref->region)
        return RF_OK;
    rf_shm_map_close(m);
    return rf_shm_map_open(m, ref);
}

void rf_shm_map_close(rf_shm_map *m) {
    if (m->base) munmap((void *)m->base, m->bytes);
    memset(m, 0, sizeof *m);
}
