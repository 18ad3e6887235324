/* Reading and writing Hugging Face safetensors checkpoints, single file or sharded.
 *
 * Format (https://github.com/huggingface/safetensors, README "Format"): an 8-byte little-endian
 * u64 N, then N bytes of UTF-8 JSON (possibly padded with trailing spaces), then the byte
 * buffer. The JSON object maps each tensor name to {"dtype", "shape", "data_offsets": [begin,
 * end]}, offsets relative to the start of the byte buffer; an optional "__metadata__" maps
 * strings to strings. A sharded checkpoint adds model.safetensors.index.json:
 * {"metadata": {...}, "weight_map": {tensor name: shard file name}} (transformers'
 * save_pretrained layout).
 *
 * Reading maps each file read-only and validates every header before handing out tensors;
 * tensor data are views into the mappings. Only F32, BF16 and F16 tensors are accepted. */
#ifndef RF_SAFETENSORS_H
#define RF_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "model/dtype.h"

#define RF_ST_MAX_DIMS 8

typedef struct rf_st_tensor {
    const char *name;       /* owned by the rf_safetensors */
    rf_dtype dtype;
    int ndim;
    int64_t shape[RF_ST_MAX_DIMS];
    const void *data;       /* (shape) in dtype, little-endian; points into the mmap, may be unaligned */
    size_t nbytes;
    const char *file;       /* path of the shard holding it; owned by the rf_safetensors */
} rf_st_tensor;

typedef struct rf_safetensors rf_safetensors;

/* Opens one .safetensors file (mmap, read-only) and validates its header: size, JSON, every
 * entry's dtype / shape / data_offsets, offsets inside the buffer and matching the shape,
 * no overlapping tensors, no duplicate names. On success *out owns the mapping; free it with
 * rf_st_close. Errors: RF_ERR_IO (cannot open or map), RF_ERR_FORMAT (malformed header),
 * RF_ERR_UNSUPPORTED (a valid safetensors dtype other than F32/BF16/F16), each with a message
 * naming the file and, where relevant, the tensor. *out is NULL on error. */
rf_status rf_st_open_file(rf_safetensors **out, const char *path);

/* Opens a model directory: dir/model.safetensors if present (transformers prefers it too),
 * otherwise dir/model.safetensors.index.json and every shard it names, each opened and
 * validated as by rf_st_open_file. The index and the shards must agree: a tensor listed in
 * weight_map must be in the shard named for it, and every tensor in a shard must be listed;
 * a tensor in two shards is an error naming both. Neither file present: RF_ERR_IO naming the
 * directory. Ownership as for rf_st_open_file. */
rf_status rf_st_open_dir(rf_safetensors **out, const char *dir);

/* Unmaps every file and frees st; tensor pointers into it become invalid. Accepts NULL. */
void rf_st_close(rf_safetensors *st);

/* Number of tensors; rf_st_at(st, i) for 0 <= i < count (files in name order, tensors in
 * offset order within a file). The returned tensor is owned by st. */
int rf_st_count(const rf_safetensors *st);
const rf_st_tensor *rf_st_at(const rf_safetensors *st, int i);

/* The tensor called `name`, or NULL if absent (hash lookup). Owned by st. */
const rf_st_tensor *rf_st_find(const rf_safetensors *st, const char *name);

/* Copies tensor `name` into dst (numel floats) as f32, converting BF16/F16 exactly.
 * expect_shape[expect_ndim] is the shape the caller requires (expect_shape NULL: any shape;
 * the caller must then size dst from rf_st_find). Errors: RF_ERR_FORMAT when the tensor is
 * missing (naming it and the file or directory) or its shape differs (naming the file, the
 * tensor, and both shapes). The tensor's pages of the mapping are released afterwards
 * (madvise MADV_DONTNEED: clean pages, still in the page cache), so reading a model costs the
 * memory of what was converted, not of the files as well. Threads: st is read-only here, so
 * concurrent calls are safe. */
rf_status rf_st_read_f32(const rf_safetensors *st, const char *name, float *dst,
                         const int64_t *expect_shape, int expect_ndim);

/* Copies BF16 tensor `name` into dst (numel bf16 values) as stored, bit for bit. Shape check
 * and errors as rf_st_read_f32, and RF_ERR_FORMAT naming the file and tensor when it is stored
 * in another type. Threads: as rf_st_read_f32. */
rf_status rf_st_read_bf16(const rf_safetensors *st, const char *name, uint16_t *dst,
                          const int64_t *expect_shape, int expect_ndim);

/* Copies the block rows [r0, r1) x cols [c0, c1) of tensor `name`, seen as a matrix (shape[0],
 * product of the other dimensions; a 1-D tensor is (n, 1)), into dst ((r1 - r0) x (c1 - c0)
 * floats, row-major) as f32: one rank's shard of a tensor without reading the rest. Shape
 * check and errors as rf_st_read_f32; RF_ERR_ARG (naming the file and tensor) for a block
 * outside the tensor. Threads: as rf_st_read_f32. */
rf_status rf_st_read_block_f32(const rf_safetensors *st, const char *name, float *dst,
                               const int64_t *expect_shape, int expect_ndim, int64_t r0, int64_t r1,
                               int64_t c0, int64_t c1);

/* One tensor to write: data is f32 in host memory, (shape) row-major; the caller owns it. */
typedef struct rf_st_entry {
    const char *name;
    const float *data;      /* (shape) */
    int ndim;
    int64_t shape[RF_ST_MAX_DIMS];
} rf_st_entry;

/* Writes entries converted to `dtype` (F32, BF16 or F16) into `dir` (created if needed) the
 * way transformers' save_pretrained does: dir/model.safetensors when the tensors fit in
 * max_shard_bytes (0 = never shard), otherwise model-0000i-of-0000N.safetensors, tensors
 * assigned greedily in the given order (a tensor larger than the limit gets its own shard),
 * plus model.safetensors.index.json ({"metadata": {"total_parameters", "total_size"},
 * "weight_map"}, keys sorted, indent 2). Within a file tensors are laid out sorted by name and
 * the header carries "__metadata__": {"format": "pt"}, byte for byte what the Python
 * safetensors library writes. Each file is streamed to a temporary name in dir, fsynced and
 * renamed. Afterwards files of an earlier save with another layout are removed (the index
 * and shards when writing one file; model.safetensors and shards of another count when
 * writing shards). Errors: RF_ERR_ARG (bad entry, duplicate name), RF_ERR_IO. */
rf_status rf_st_write_dir(const char *dir, const rf_st_entry *entries, int n, rf_dtype dtype,
                          size_t max_shard_bytes);

/* Produces entry i's data (its numel floats, row-major) into dst when the writer reaches it. */
typedef rf_status (*rf_st_fill_fn)(void *ctx, int i, float *dst);

/* rf_st_write_dir with the data made on demand: entries' data are ignored (may be NULL), and
 * fill(ctx, i, dst) is called once for every non-empty entry i, in the order the files are
 * written (by shard, then by name), with a scratch buffer the size of the largest entry: the
 * only copy of tensor data the writer holds, so a model gathered tensor by tensor (from shards
 * on other ranks) is written without ever being whole in memory. An error from fill stops
 * the write (no partial file is left under its final name) and is returned. */
rf_status rf_st_write_dir_fill(const char *dir, const rf_st_entry *entries, int n, rf_dtype dtype,
                               size_t max_shard_bytes, rf_st_fill_fn fill, void *ctx);

#endif
