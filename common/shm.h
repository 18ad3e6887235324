/* Host memory that other processes of the same machine can map: the single-copy path of
 * resharding between ranks of one host (resharding/reshard.h), the CPU counterpart of CUDA IPC
 * handles.
 *
 * An allocation is an anonymous memory file (memfd_create) mapped into this process. Another
 * process of the same user on the same host maps it read-only by opening
 * /proc/<pid>/fd/<fd> of the owner, so nothing is left behind in /dev/shm when a process dies,
 * and the size is bounded by memory, not by the /dev/shm mount. The owner describes a range of
 * one of its allocations with rf_shm_lookup (a small plain-data rf_shm_ref to send over
 * messages); the other process maps it with rf_shm_map, which checks that the file it opened is
 * the one described (inode), so a reused fd number is never mistaken for the allocation.
 *
 * Where memory files or /proc are not available, rf_shm_alloc falls back to plain memory
 * (rf_shm_lookup then finds nothing and resharding copies through messages). */
#ifndef RF_SHM_H
#define RF_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* A range of a shared allocation, as its owner describes it to another process. */
typedef struct rf_shm_ref {
    uint64_t host;   /* rf_shm_host_key() of the owner */
    uint64_t inode;  /* the memory file's inode: checked after opening */
    uint64_t region; /* bytes of the whole allocation */
    uint64_t offset; /* of the range, from the allocation's start */
    int32_t pid, fd; /* of the owner */
} rf_shm_ref;

/* `bytes` (> 0) of zeroed memory, page aligned, shareable when the system allows (plain memory
 * otherwise). `what` names the use in errors. RF_ERR_NOMEM. Free with rf_shm_free. */
rf_status rf_shm_alloc(void **out, size_t bytes, const char *what);

/* Frees memory from rf_shm_alloc; NULL is ignored. Mappings in other processes stay valid
 * until they unmap. */
void rf_shm_free(void *p);

/* 1 and *ref filled when [p, p + bytes) lies inside one shareable allocation of this process;
 * 0 otherwise. */
int rf_shm_lookup(const void *p, size_t bytes, rf_shm_ref *ref);

/* A key equal for processes that can map each other's allocations: same kernel boot and same
 * PID namespace (so /proc/<pid> names the owner). 0 when unknown. */
uint64_t rf_shm_host_key(void);

/* A read-only mapping of another process's allocation. */
typedef struct rf_shm_map {
    const void *base; /* the allocation's start; the range is at base + ref.offset */
    size_t bytes;
    rf_shm_ref ref;
} rf_shm_map;

/* Maps the allocation `ref` describes (whole, read-only, pages populated). RF_ERR_IO naming the
 * owner's pid when it cannot be opened or is not the allocation described (the owner exited,
 * another user, another PID namespace). */
rf_status rf_shm_map_open(rf_shm_map *m, const rf_shm_ref *ref);
void rf_shm_map_close(rf_shm_map *m);

/* Keeps m when it already maps the allocation `ref` describes (same owner, file and size; the
 * range's offset may differ), else closes it and maps that one (rf_shm_map_open). For
 * receivers that map a peer's buffer once and reuse it every transfer. */
rf_status rf_shm_map_keep(rf_shm_map *m, const rf_shm_ref *ref);

#endif
