/* A TensorBoard event-file writer: scalar summaries in the exact on-disk format TensorBoard
 * reads, with no TensorFlow or protobuf library.
 *
 * File: <logdir>/events.out.tfevents.<unix seconds>.<hostname>. TensorBoard reads every file
 * whose name contains "tfevents" in a run directory, in name order, so each open starts a new
 * file and a resumed run simply adds one beside the old ones.
 *
 * Framing (TFRecord, tensorflow/core/lib/io/record_writer.cc), per record:
 *   uint64 length (little-endian) | uint32 masked_crc32c(length bytes) |
 *   data[length]                  | uint32 masked_crc32c(data)
 * Each record's data is a serialized tensorflow.Event (tensorboard/compat/proto/event.proto):
 *   double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
 *   SessionLog session_log = 7;   (SessionLog { SessionStatus status = 1; }, START = 1)
 * with Summary { repeated Value value = 1; } and Value { string tag = 1; float simple_value = 2; }
 * (tensorboard/compat/proto/summary.proto). The first record carries file_version
 * "brain.Event:2"; every later one a Summary with the scalars of one step.
 *
 * Why the protobuf is written by hand: we emit three messages with six fields in all, and
 * protobuf-c would need TensorFlow's .proto files (and their imports: tensor, types, ...)
 * compiled into the project, plus a runtime library, for that. The wire format of those
 * fields (varint, fixed64, fixed32, length-delimited) is a stable, documented encoding
 * (https://protobuf.dev/programming-guides/encoding/). */
#ifndef RF_TB_WRITER_H
#define RF_TB_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct rf_tb_writer rf_tb_writer;

/* The file_version string of the first record. */
#define RF_TB_FILE_VERSION "brain.Event:2"

/* Creates `logdir` (mkdir -p) and a new event file in it, and writes the file_version record.
 * When a file of that name exists already (two opens in the same second), a ".N" suffix is
 * added: TensorBoard only needs "tfevents" in the name. The caller owns *w and frees it with
 * rf_tb_writer_close. Errors: RF_ERR_IO naming the path. */
rf_status rf_tb_writer_open(rf_tb_writer **w, const char *logdir);

/* Writes one Event at `step` with n scalar values (tags[i] -> values[i], stored as float as
 * TensorBoard's simple_value is) and wall time `wall_time` (unix seconds; <= 0 means now).
 * The record goes to the file with one write(2) before this returns: a crash of the process
 * loses at most the step being written (a torn last record, which TensorBoard skips).
 * Errors: RF_ERR_IO; RF_ERR_ARG for an empty tag. Not thread-safe: one writer, one thread. */
rf_status rf_tb_writer_scalars(rf_tb_writer *w, int64_t step, double wall_time, int n,
                               const char *const *tags, const double *values);

/* Writes one Event at `step` with n text summaries (tags[i] -> texts[i], UTF-8, Markdown as
 * TensorBoard's text dashboard renders it): Summary.Value { tag = 1; TensorProto tensor = 8
 * { dtype = DT_STRING (7); tensor_shape = {} (a scalar); string_val = texts[i] };
 * SummaryMetadata metadata = 9 { plugin_data { plugin_name: "text" } } }, the layout of
 * tensorboard/plugins/text/summary_v2.py (tensorboard/compat/proto/tensor.proto, summary.proto).
 * One write(2), as rf_tb_writer_scalars. Errors: RF_ERR_IO; RF_ERR_ARG for an empty tag. */
rf_status rf_tb_writer_text(rf_tb_writer *w, int64_t step, double wall_time, int n, const char *const *tags,
                            const char *const *texts);

/* Writes a SessionLog START event (Event.session_log = 7, SessionLog.status = 1) at `step`,
 * the first step this process will write. On a resumed run, TensorBoard's loaders then drop
 * every point with a step >= `step` read from earlier files of the directory: without it, the
 * points of the steps being redone would show twice. Write it once per open, before the first
 * scalars, on fresh runs too: the Python loader takes the first START of a run as the initial
 * one and purges only on later ones. `wall_time` <= 0 means now. Errors: RF_ERR_IO. */
rf_status rf_tb_writer_session_start(rf_tb_writer *w, int64_t step, double wall_time);

/* The path of the event file (owned by the writer). */
const char *rf_tb_writer_path(const rf_tb_writer *w);

/* Closes the file and frees the writer; NULL is accepted. */
void rf_tb_writer_close(rf_tb_writer *w);

/* Frames `data` as one TFRecord into `out` (capacity at least n + 16); returns the bytes
 * written (n + 16). Exposed for tests and for other record writers. */
size_t rf_tb_record_frame(const void *data, size_t n, unsigned char *out);

/* Current wall-clock time in unix seconds (CLOCK_REALTIME, fractional). */
double rf_tb_wall_time(void);

#endif
