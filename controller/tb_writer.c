#define _POSIX_C_SOURCE 200809L
#include "controller/tb_writer.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "common/util.h"

struct rf_tb_writer {
    int fd;
    char path[4096];
};

/* ---- a growable byte buffer for building one record ---- */

typedef struct rf__buf {
    unsigned char *p;
    size_t n, cap;
    int oom;  // sticky: set once an allocation failed; checked when the record is finished
} rf__buf;

static void rf__buf_put(rf__buf *b, const void *src, size_t n) {
    if (b->oom || n == 0) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

/* ---- protobuf wire format (https://protobuf.dev/programming-guides/encoding/) ---- */

enum { RF__WIRE_VARINT = 0, RF__WIRE_I64 = 1, RF__WIRE_LEN = 2, RF__WIRE_I32 = 5 };

static void rf__pb_varint(rf__buf *b, uint64_t v) {
    unsigned char tmp[10];
    size_t n = 0;
    do {
        tmp[n] = (unsigned char)(v & 0x7F);
        v >>= 7;
        if (v) tmp[n] |= 0x80;
        n++;
    } while (v);
    rf__buf_put(b, tmp, n);
}

static void rf__pb_key(rf__buf *b, unsigned field, unsigned wire) {
    rf__pb_varint(b, ((uint64_t)field << 3) | wire);
}

static void rf__pb_fixed(rf__buf *b, uint64_t v, int bytes) {
    unsigned char tmp[8];
    for (int i = 0; i < bytes; i++) tmp[i] = (unsigned char)(v >> (8 * i));
    rf__buf_put(b, tmp, (size_t)bytes);
}

static void rf__pb_double(rf__buf *b, unsigned field, double v) {
    uint64_t u;
    memcpy(&u, &v, 8);
    rf__pb_key(b, field, RF__WIRE_I64);
    rf__pb_fixed(b, u, 8);
}

static void rf__pb_float(rf__buf *b, unsigned field, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    rf__pb_key(b, field, RF__WIRE_I32);
    rf__pb_fixed(b, u, 4);
}

static void rf__pb_bytes(rf__buf *b, unsigned field, const void *p, size_t n) {
    rf__pb_key(b, field, RF__WIRE_LEN);
    rf__pb_varint(b, n);
    rf__buf_put(b, p, n);
}

/* ---- TFRecord framing ---- */

size_t rf_tb_record_frame(const void *data, size_t n, unsigned char *out) {
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)n >> (8 * i));
    uint32_t lcrc = rf_crc32c_mask(rf_crc32c(len, 8));
    uint32_t dcrc = rf_crc32c_mask(rf_crc32c(data, n));
    memcpy(out, len, 8);
    for (int i = 0; i < 4; i++) out[8 + i] = (unsigned char)(lcrc >> (8 * i));
    memcpy(out + 12, data, n);
    for (int i = 0; i < 4; i++) out[12 + n + i] = (unsigned char)(dcrc >> (8 * i));
    return n + 16;
}

double rf_tb_wall_time(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static rf_status rf__write_all(int fd, const unsigned char *p, size_t n, const char *path) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return rf_error(RF_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        }
        p += w;
        n -= (size_t)w;
    }
    return RF_OK;
}

/* Frames the Event in `ev` and writes it with a single write(2). */
static rf_status rf__write_event(rf_tb_writer *w, const rf__buf *ev) {
    if (ev->oom) return rf_error(RF_ERR_NOMEM, "%s: out of memory building an event", w->path);
    unsigned char *rec = malloc(ev->n + 16);
    if (!rec) return rf_error(RF_ERR_NOMEM, "%s: out of memory framing an event", w->path);
    size_t n = rf_tb_record_frame(ev->p, ev->n, rec);
    rf_status s = rf__write_all(w->fd, rec, n, w->path);
    free(rec);
    return s;
}

/* Creates a fresh event file: events.out.tfevents.<secs>.<host>[.N], never an existing one. */
static rf_status rf__create_event_file(rf_tb_writer *w, const char *logdir, double now) {
    char host[256] = "localhost";
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = '\0';
    for (char *c = host; *c; c++)
        if (*c == '/') *c = '_';
    for (int k = 0; k < 1000; k++) {
        char name[512];
        if (k == 0)
            snprintf(name, sizeof name, "events.out.tfevents.%lld.%s", (long long)now, host);
        else
            snprintf(name, sizeof name, "events.out.tfevents.%lld.%s.%d", (long long)now, host, k);
        rf_path_join(w->path, sizeof w->path, logdir, name);
        w->fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND, 0644);
        if (w->fd >= 0) return RF_OK;
        if (errno != EEXIST)
            return rf_error(RF_ERR_IO, "%s: cannot create: %s", w->path, strerror(errno));
    }
    return rf_error(RF_ERR_IO, "%s: too many event files for one second", logdir);
}

rf_status rf_tb_writer_open(rf_tb_writer **out, const char *logdir) {
    *out = NULL;
    if (!logdir || !*logdir) return rf_error(RF_ERR_ARG, "tensorboard: empty log directory");
    RF_TRY(rf_mkdirs(logdir));
    rf_tb_writer *w = rf_calloc(1, sizeof *w);
    if (!w) return RF_ERR_NOMEM;
    w->fd = -1;
    double now = rf_tb_wall_time();
    rf_status s = rf__create_event_file(w, logdir, now);
    if (s == RF_OK) {
        rf__buf ev = {0};
        rf__pb_double(&ev, 1, now);
        rf__pb_bytes(&ev, 3, RF_TB_FILE_VERSION, strlen(RF_TB_FILE_VERSION));
        s = rf__write_event(w, &ev);
        free(ev.p);
    }
    if (s != RF_OK) {
        rf_tb_writer_close(w);
        return s;
    }
    *out = w;
    return RF_OK;
}

rf_status rf_tb_writer_scalars(rf_tb_writer *w, int64_t step, double wall_time, int n,
                               const char *const *tags, const double *values) {
    for (int i = 0; i < n; i++)
        if (!tags[i] || !*tags[i])
            return rf_error(RF_ERR_ARG, "%s: scalar %d has an empty tag", w->path, i);
    rf__buf summary = {0}, value = {0}, ev = {0};
    for (int i = 0; i < n; i++) {
        value.n = 0;
        rf__pb_bytes(&value, 1, tags[i], strlen(tags[i]));  // Value.tag
        rf__pb_float(&value, 2, (float)values[i]);          // Value.simple_value
        rf__pb_bytes(&summary, 1, value.p, value.n);        // Summary.value (repeated)
    }
    rf__pb_double(&ev, 1, wall_time > 0 ? wall_time : rf_tb_wall_time());  // Event.wall_time
    if (step != 0) {  // proto3 leaves default values out; so do we, byte for byte
        rf__pb_key(&ev, 2, RF__WIRE_VARINT);  // Event.step
        rf__pb_varint(&ev, (uint64_t)step);   // int64: a negative step takes 10 bytes
    }
    rf__pb_bytes(&ev, 5, summary.p, summary.n);                             // Event.summary
    ev.oom |= summary.oom | value.oom;
    rf_status s = rf__write_event(w, &ev);
    free(summary.p);
    free(value.p);
    free(ev.p);
    return s;
}

rf_status rf_tb_writer_text(rf_tb_writer *w, int64_t step, double wall_time, int n, const char *const *tags,
                            const char *const *texts) {
    for (int i = 0; i < n; i++)
        if (!tags[i] || !*tags[i]) return rf_error(RF_ERR_ARG, "%s: text %d has an empty tag", w->path, i);
    static const char plugin[] = "text";
    rf__buf summary = {0}, value = {0}, tensor = {0}, meta = {0}, pd = {0}, ev = {0};
    rf__pb_bytes(&pd, 1, plugin, sizeof plugin - 1);  // PluginData.plugin_name
    rf__pb_bytes(&meta, 1, pd.p, pd.n);                // SummaryMetadata.plugin_data
    for (int i = 0; i < n; i++) {
        tensor.n = value.n = 0;
        rf__pb_key(&tensor, 1, RF__WIRE_VARINT);              // TensorProto.dtype
        rf__pb_varint(&tensor, 7);                            // DT_STRING
        rf__pb_bytes(&tensor, 2, NULL, 0);                    // TensorProto.tensor_shape: {} (a scalar)
        rf__pb_bytes(&tensor, 8, texts[i], strlen(texts[i])); // TensorProto.string_val
        rf__pb_bytes(&value, 1, tags[i], strlen(tags[i]));    // Value.tag
        rf__pb_bytes(&value, 8, tensor.p, tensor.n);          // Value.tensor
        rf__pb_bytes(&value, 9, meta.p, meta.n);              // Value.metadata
        rf__pb_bytes(&summary, 1, value.p, value.n);          // Summary.value (repeated)
    }
    rf__pb_double(&ev, 1, wall_time > 0 ? wall_time : rf_tb_wall_time());
    if (step != 0) {
        rf__pb_key(&ev, 2, RF__WIRE_VARINT);
        rf__pb_varint(&ev, (uint64_t)step);
    }
    rf__pb_bytes(&ev, 5, summary.p, summary.n);
    ev.oom |= summary.oom | value.oom | tensor.oom | meta.oom | pd.oom;
    rf_status s = rf__write_event(w, &ev);
    free(summary.p), free(value.p), free(tensor.p), free(meta.p), free(pd.p), free(ev.p);
    return s;
}

rf_status rf_tb_writer_session_start(rf_tb_writer *w, int64_t step, double wall_time) {
    rf__buf session = {0}, ev = {0};
    rf__pb_key(&session, 1, RF__WIRE_VARINT);  // SessionLog.status
    rf__pb_varint(&session, 1);                // START
    rf__pb_double(&ev, 1, wall_time > 0 ? wall_time : rf_tb_wall_time());
    if (step != 0) {
        rf__pb_key(&ev, 2, RF__WIRE_VARINT);
        rf__pb_varint(&ev, (uint64_t)step);
    }
    rf__pb_bytes(&ev, 7, session.p, session.n);  // Event.session_log
    ev.oom |= session.oom;
    rf_status s = rf__write_event(w, &ev);
    free(session.p);
    free(ev.p);
    return s;
}

const char *rf_tb_writer_path(const rf_tb_writer *w) { return w->path; }

void rf_tb_writer_close(rf_tb_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    free(w);
}
