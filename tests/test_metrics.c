/* Metrics logging: CRC-32C against published vectors, TFRecord masking, the TensorBoard event
 * file read back by an independent decoder written here (framing, both CRCs, Event/Summary
 * protobuf fields) and byte for byte against TensorBoard's own serializer, corruption
 * detection, metrics.jsonl parsed with cJSON, resume behaviour, and the console line. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdint.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "common/util.h"
#include "controller/metrics.h"
#include "controller/run_dir.h"
#include "controller/tb_writer.h"
#include "tests/test_util.h"

/* ---- CRC-32C ---- */

/* Vectors: "123456789" is the CRC catalogue's check value; the 32-byte patterns and the iSCSI
 * read PDU are RFC 3720 appendix B.4. */
static void test_crc32c_known_answers(void) {
    unsigned char buf[48];
    CHECK(rf_crc32c("123456789", 9) == 0xE3069283u);
    CHECK(rf_crc32c("", 0) == 0);
    memset(buf, 0, 32);
    CHECK(rf_crc32c(buf, 32) == 0x8A9136AAu);
    memset(buf, 0xFF, 32);
    CHECK(rf_crc32c(buf, 32) == 0x62A8AB43u);
    for (int i = 0; i < 32; i++) buf[i] = (unsigned char)i;
    CHECK(rf_crc32c(buf, 32) == 0x46DD794Eu);
    for (int i = 0; i < 32; i++) buf[i] = (unsigned char)(31 - i);
    CHECK(rf_crc32c(buf, 32) == 0x113FDB5Cu);
    static const unsigned char pdu[48] = {
        0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
        0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    CHECK(rf_crc32c(pdu, 48) == 0xD9963A56u);
}

/* Slice-by-8 must agree with a bit-at-a-time CRC for every length and start alignment, and
 * extending a CRC must equal the CRC of the concatenation at every split point. */
static uint32_t crc32c_bitwise(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
}

static void test_crc32c_slicing_and_extend(void) {
    unsigned char buf[300];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof buf; i++) {
        x = x * 1103515245u + 12345u;
        buf[i] = (unsigned char)(x >> 16);
    }
    int bad = 0;
    for (size_t off = 0; off < 8; off++)
        for (size_t n = 0; n + off <= 100; n++)
            bad += rf_crc32c(buf + off, n) != crc32c_bitwise(buf + off, n);
    CHECK(bad == 0);
    uint32_t whole = rf_crc32c(buf, sizeof buf);
    bad = 0;
    for (size_t k = 0; k <= sizeof buf; k++)
        bad += rf_crc32c_extend(rf_crc32c(buf, k), buf + k, sizeof buf - k) != whole;
    CHECK(bad == 0);
}

/* Masked values computed by TensorBoard's own masked_crc32c
 * (tensorboard.compat.tensorflow_stub.pywrap_tensorflow). */
static void test_crc32c_mask(void) {
    unsigned char zeros[32] = {0};
    CHECK(rf_crc32c_mask(rf_crc32c("123456789", 9)) == 0xc78ab0e5u);
    CHECK(rf_crc32c_mask(rf_crc32c("", 0)) == 0xa282ead8u);
    CHECK(rf_crc32c_mask(rf_crc32c(zeros, 32)) == 0x0fd7fffau);
    int bad = 0;
    for (uint32_t v = 1; v < 0xF0000000u; v = v * 3 + 7)
        bad += rf_crc32c_unmask(rf_crc32c_mask(v)) != v;
    CHECK(bad == 0);
}

/* ---- an independent TFRecord + Event reader ---- */

enum { REC_OK = 0, REC_EOF, REC_TRUNCATED, REC_BAD_LEN_CRC, REC_BAD_DATA_CRC };

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Reads the record at *off, verifying both masked CRCs; data and len point into buf. */
static int read_record(const unsigned char *buf, size_t size, size_t *off,
                       const unsigned char **data, size_t *len) {
    if (*off == size) return REC_EOF;
    if (size - *off < 12) return REC_TRUNCATED;
    const unsigned char *p = buf + *off;
    uint64_t n = le(p, 8);
    if (rf_crc32c_mask(rf_crc32c(p, 8)) != (uint32_t)le(p + 8, 4)) return REC_BAD_LEN_CRC;
    if (size - *off - 12 < n + 4) return REC_TRUNCATED;
    if (rf_crc32c_mask(rf_crc32c(p + 12, n)) != (uint32_t)le(p + 12 + n, 4))
        return REC_BAD_DATA_CRC;
    *data = p + 12;
    *len = n;
    *off += 16 + n;
    return REC_OK;
}

typedef struct event {
    double wall_time;
    int64_t step;
    char file_version[64];
    int session_status;  // SessionLog.status (1 = START), 0 when absent
    int n;  // summary values
    char tags[8][64];
    float values[8];
} event;

/* Protobuf field cursor: returns 1 with the field number, wire type and payload, 0 at end,
 * -1 on malformed input. */
typedef struct pb_field {
    unsigned num, wire;
    uint64_t v;                // varint value, or the fixed32/fixed64 bits
    const unsigned char *ptr;  // length-delimited payload
    size_t len;
} pb_field;

static int pb_varint(const unsigned char **p, const unsigned char *end, uint64_t *v) {
    *v = 0;
    for (int shift = 0; *p < end && shift < 64; shift += 7) {
        unsigned char b = *(*p)++;
        *v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) return 0;
    }
    return -1;
}

static int pb_next(const unsigned char **p, const unsigned char *end, pb_field *f) {
    if (*p == end) return 0;
    uint64_t key;
    if (pb_varint(p, end, &key)) return -1;
    f->num = (unsigned)(key >> 3);
    f->wire = (unsigned)(key & 7);
    switch (f->wire) {
    case 0: return pb_varint(p, end, &f->v) ? -1 : 1;
    case 1:
        if (end - *p < 8) return -1;
        f->v = le(*p, 8), *p += 8;
        return 1;
    case 5:
        if (end - *p < 4) return -1;
        f->v = le(*p, 4), *p += 4;
        return 1;
    case 2:
        if (pb_varint(p, end, &f->v) || (uint64_t)(end - *p) < f->v) return -1;
        f->ptr = *p, f->len = (size_t)f->v, *p += f->len;
        return 1;
    default: return -1;
    }
}

static void copy_str(char *dst, size_t cap, const pb_field *f) {
    size_t n = f->len < cap - 1 ? f->len : cap - 1;
    memcpy(dst, f->ptr, n);
    dst[n] = '\0';
}

static int decode_value(const unsigned char *p, const unsigned char *end, event *e) {
    if (e->n == 8) return -1;
    pb_field f;
    int r;
    while ((r = pb_next(&p, end, &f)) == 1) {
        if (f.num == 1 && f.wire == 2) copy_str(e->tags[e->n], sizeof e->tags[0], &f);
        else if (f.num == 2 && f.wire == 5) {
            uint32_t u = (uint32_t)f.v;
            memcpy(&e->values[e->n], &u, 4);
        } else return -1;
    }
    e->n++;
    return r;
}

static int decode_event(const unsigned char *p, size_t n, event *e) {
    memset(e, 0, sizeof *e);
    const unsigned char *end = p + n;
    pb_field f;
    int r;
    while ((r = pb_next(&p, end, &f)) == 1) {
        if (f.num == 1 && f.wire == 1) memcpy(&e->wall_time, &f.v, 8);
        else if (f.num == 2 && f.wire == 0) e->step = (int64_t)f.v;
        else if (f.num == 3 && f.wire == 2) copy_str(e->file_version, sizeof e->file_version, &f);
        else if (f.num == 5 && f.wire == 2) {
            const unsigned char *s = f.ptr, *send = f.ptr + f.len;
            pb_field v;
            int rv;
            while ((rv = pb_next(&s, send, &v)) == 1)
                if (v.num != 1 || v.wire != 2 || decode_value(v.ptr, v.ptr + v.len, e)) return -1;
            if (rv < 0) return -1;
        } else if (f.num == 7 && f.wire == 2) {
            const unsigned char *s = f.ptr;
            pb_field v;
            if (pb_next(&s, f.ptr + f.len, &v) != 1 || v.num != 1 || v.wire != 0) return -1;
            e->session_status = (int)v.v;
        } else return -1;
    }
    return r;
}

/* ---- helpers ---- */

static char g_tmp[256];

/* Finds the event files in dir (sorted names), returns how many. */
static int find_event_files(const char *dir, char paths[][512], int max) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < max)
        if (strncmp(de->d_name, "events.out.tfevents.", 20) == 0)
            snprintf(paths[n++], 512, "%s/%s", dir, de->d_name);
    closedir(d);
    for (int i = 1; i < n; i++)  // insertion sort: TensorBoard reads files in name order
        for (int j = i; j > 0 && strcmp(paths[j - 1], paths[j]) > 0; j--) {
            char t[512];
            memcpy(t, paths[j], 512), memcpy(paths[j], paths[j - 1], 512), memcpy(paths[j - 1], t, 512);
        }
    return n;
}

static const char *const k_tags[2] = {"reward/mean", "loss/policy"};
static double value_at(int step, int k) { return k == 0 ? 0.25 * step - 1.0 : 1.0 / (step + 3); }

/* Writes steps first..3 (x10) x 2 scalars through rf_metrics into dir; value_at(step) + bias. */
static void write_steps(const char *dir, int first, double bias, rf_metrics **out_m) {
    rf_metrics *m = NULL;
    CHECK_OK(rf_metrics_open(&m, dir, 1, 1));
    if (!m) return;
    for (int step = first; step <= 3; step++) {
        for (int k = 0; k < 2; k++)
            CHECK_OK(rf_metrics_set(m, k_tags[k], value_at(step, k) + bias));
        CHECK(rf_metrics_count(m) == 2);
        CHECK_OK(rf_metrics_commit(m, step * 10));
        CHECK(rf_metrics_count(m) == 0);
    }
    *out_m = m;
}

/* ---- event file ---- */

static void test_event_file_roundtrip(void) {
    char dir[300];
    snprintf(dir, sizeof dir, "%s/run1", g_tmp);
    rf_metrics *m = NULL;
    write_steps(dir, 1, 0.0, &m);
    if (!m) return;
    char host[256] = "";
    gethostname(host, sizeof host);
    char expect_prefix[512];
    snprintf(expect_prefix, sizeof expect_prefix, "%s/events.out.tfevents.", dir);
    char path[4096];  // copied: the writer owns its path
    snprintf(path, sizeof path, "%s", rf_metrics_tb_path(m));
    CHECK(strncmp(path, expect_prefix, strlen(expect_prefix)) == 0);
    CHECK(strstr(path + strlen(expect_prefix), host) != NULL);
    rf_metrics_close(m);

    char *buf = NULL;
    size_t size = 0;
    CHECK_OK(rf_read_file(path, &buf, &size));
    if (!buf) return;
    size_t off = 0;
    const unsigned char *data;
    size_t len;
    event e;
    double now = rf_tb_wall_time();
    CHECK(read_record((unsigned char *)buf, size, &off, &data, &len) == REC_OK);
    CHECK(decode_event(data, len, &e) == 0);
    CHECK(strcmp(e.file_version, "brain.Event:2") == 0);
    CHECK(e.wall_time > now - 600 && e.wall_time <= now);
    CHECK(read_record((unsigned char *)buf, size, &off, &data, &len) == REC_OK);
    CHECK(decode_event(data, len, &e) == 0);
    CHECK(e.session_status == 1 && e.step == 10 && e.n == 0);  // session start: first commit
    for (int step = 1; step <= 3; step++) {
        CHECK(read_record((unsigned char *)buf, size, &off, &data, &len) == REC_OK);
        CHECK(decode_event(data, len, &e) == 0);
        CHECK(e.step == step * 10);
        CHECK(e.file_version[0] == '\0' && e.session_status == 0);
        CHECK(e.wall_time > now - 600 && e.wall_time <= now);
        CHECK(e.n == 2);
        for (int k = 0; k < 2 && k < e.n; k++) {
            CHECK(strcmp(e.tags[k], k_tags[k]) == 0);
            CHECK(e.values[k] == (float)value_at(step, k));  // exact: stored as float
        }
    }
    CHECK(read_record((unsigned char *)buf, size, &off, &data, &len) == REC_EOF);
    free(buf);
}

/* The bytes TensorBoard's own Python writer produces for Event(wall_time=1.5, step=7,
 * summary={value: [{tag: "a/b", simple_value: 0.25}]}) (event_pb2 + RecordWriter). */
static void test_event_bytes_match_tensorboard(void) {
    static const unsigned char golden[] = {
        0x19, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x8b, 0xf1, 0x08, 0x28, 0x09,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x3f, 0x10, 0x07, 0x2a, 0x0c, 0x0a,
        0x0a, 0x0a, 0x03, 0x61, 0x2f, 0x62, 0x15, 0x00, 0x00, 0x80, 0x3e, 0x6b, 0x4d,
        0xbd, 0x8e};
    char dir[300];
    snprintf(dir, sizeof dir, "%s/golden", g_tmp);
    rf_tb_writer *w = NULL;
    CHECK_OK(rf_tb_writer_open(&w, dir));
    if (!w) return;
    const char *tag = "a/b";
    double v = 0.25;
    CHECK_OK(rf_tb_writer_scalars(w, 7, 1.5, 1, &tag, &v));
    char path[4096];
    snprintf(path, sizeof path, "%s", rf_tb_writer_path(w));
    rf_tb_writer_close(w);
    char *buf = NULL;
    size_t size = 0;
    CHECK_OK(rf_read_file(path, &buf, &size));
    if (!buf) return;
    size_t first = 16 + (size_t)le((unsigned char *)buf, 8);
    CHECK(size == first + sizeof golden);
    CHECK(size == first + sizeof golden && memcmp(buf + first, golden, sizeof golden) == 0);
    unsigned char framed[64];
    CHECK(rf_tb_record_frame(golden + 12, 25, framed) == sizeof golden);
    CHECK(memcmp(framed, golden, sizeof golden) == 0);
    free(buf);

    /* Event(wall_time=1.5, step=7, session_log={status: START}), also from event_pb2. */
    static const unsigned char start[] = {0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8,
                                          0x3f, 0x10, 0x07, 0x3a, 0x02, 0x08, 0x01};
    w = NULL;
    CHECK_OK(rf_tb_writer_open(&w, dir));
    if (!w) return;
    CHECK_OK(rf_tb_writer_session_start(w, 7, 1.5));
    snprintf(path, sizeof path, "%s", rf_tb_writer_path(w));
    rf_tb_writer_close(w);
    buf = NULL;
    CHECK_OK(rf_read_file(path, &buf, &size));
    if (!buf) return;
    first = 16 + (size_t)le((unsigned char *)buf, 8);
    CHECK(size == first + 16 + sizeof start);
    CHECK(size == first + 16 + sizeof start && memcmp(buf + first + 12, start, sizeof start) == 0);
    free(buf);
}

static void test_corruption_detected(void) {
    char dir[300], paths[4][512];
    snprintf(dir, sizeof dir, "%s/run1", g_tmp);
    if (find_event_files(dir, paths, 4) != 1) {
        CHECK(!"one event file in run1");
        return;
    }
    char *buf = NULL;
    size_t size = 0;
    CHECK_OK(rf_read_file(paths[0], &buf, &size));
    if (!buf) return;
    unsigned char *b = (unsigned char *)buf;
    size_t off, len, first = 16 + (size_t)le(b, 8);
    const unsigned char *data;
    /* One flipped bit in each part of the second record (length, length CRC, data) and in the
     * data CRC of the last one. */
    size_t at[4] = {first + 3, first + 9, first + 20, size - 2};
    int want[4] = {REC_BAD_LEN_CRC, REC_BAD_LEN_CRC, REC_BAD_DATA_CRC, REC_BAD_DATA_CRC};
    for (int i = 0; i < 4; i++) {
        b[at[i]] ^= 0x10;
        off = first;
        int r = read_record(b, size, &off, &data, &len);
        if (at[i] == size - 2) {  // the last record: skip to it
            off = first;
            while ((r = read_record(b, size, &off, &data, &len)) == REC_OK) {}
        }
        CHECK(r == want[i]);
        b[at[i]] ^= 0x10;
    }
    off = 0;
    int n = 0;
    while (read_record(b, size, &off, &data, &len) == REC_OK) n++;
    CHECK(n == 5 && off == size);
    off = 0, n = 0;  // a torn last record (crash mid-write) reads as truncated, not corrupt
    while (read_record(b, size - 5, &off, &data, &len) == REC_OK) n++;
    CHECK(n == 4 && read_record(b, size - 5, &off, &data, &len) == REC_TRUNCATED);
    free(buf);
}

/* ---- metrics.jsonl ---- */

static void test_jsonl(void) {
    char path[400];
    snprintf(path, sizeof path, "%s/run1/metrics.jsonl", g_tmp);
    char *buf = NULL;
    CHECK_OK(rf_read_file(path, &buf, NULL));
    if (!buf) return;
    int lines = 0;
    double now = rf_tb_wall_time();
    for (char *line = buf, *nl; (nl = strchr(line, '\n')); line = nl + 1) {
        *nl = '\0';
        lines++;
        cJSON *j = cJSON_Parse(line);
        CHECK(j != NULL);
        if (!j) continue;
        const cJSON *c = j->child;
        CHECK(c && strcmp(c->string, "step") == 0 && c->valuedouble == lines * 10);
        c = c ? c->next : NULL;
        CHECK(c && strcmp(c->string, "time") == 0 && c->valuedouble > now - 600 &&
              c->valuedouble <= now + 1);
        for (int k = 0; k < 2; k++) {
            c = c ? c->next : NULL;
            CHECK(c && strcmp(c->string, k_tags[k]) == 0 &&
                  c->valuedouble == value_at(lines, k));  // exact: shortest round-trip digits
        }
        CHECK(c && c->next == NULL);
        cJSON_Delete(j);
    }
    CHECK(lines == 3);
    free(buf);
}

/* NaN and infinities become null; names are JSON-escaped; replaced values stay in place. */
static void test_jsonl_special_values(void) {
    char dir[300], path[400];
    snprintf(dir, sizeof dir, "%s/special", g_tmp);
    rf_metrics *m = NULL;
    CHECK_OK(rf_metrics_open(&m, dir, 1, 0));
    if (!m) return;
    CHECK(rf_metrics_tb_path(m) == NULL);
    CHECK_OK(rf_metrics_set(m, "a", 1.0));
    CHECK_OK(rf_metrics_set(m, "nan", NAN));
    CHECK_OK(rf_metrics_set(m, "inf", -INFINITY));
    CHECK_OK(rf_metrics_set(m, "q\"uo\\te\n", 0.1));
    CHECK_OK(rf_metrics_set(m, "a", 2.0));
    CHECK_ERR(rf_metrics_set(m, "step", 1.0), RF_ERR_ARG, "reserved");
    CHECK_ERR(rf_metrics_set(m, "", 1.0), RF_ERR_ARG, "empty");
    CHECK_OK(rf_metrics_commit(m, 5));
    CHECK_OK(rf_metrics_commit(m, 6));  // empty step: nothing written
    rf_metrics_close(m);
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    char *buf = NULL;
    CHECK_OK(rf_read_file(path, &buf, NULL));
    if (!buf) return;
    CHECK(strchr(buf, '\n') == buf + strlen(buf) - 1);  // one line
    cJSON *j = cJSON_Parse(buf);
    CHECK(j != NULL);
    if (j) {
        const cJSON *c = j->child->next->next;
        CHECK(strcmp(c->string, "a") == 0 && c->valuedouble == 2.0);
        CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(j, "nan")));
        CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(j, "inf")));
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(j, "q\"uo\\te\n");
        CHECK(q && q->valuedouble == 0.1);
        cJSON_Delete(j);
    }
    free(buf);
}

/* A run resumed at step 20 appends to metrics.jsonl and starts a second event file (sorted
 * after the first) whose second record is a SessionLog START at step 20, the first step it
 * commits; a console-only
 * collection needs no directory; a sink that cannot be created is an I/O error. */
static void test_resume_and_errors(void) {
    char dir[300], paths[4][512], path[400];
    snprintf(dir, sizeof dir, "%s/run1", g_tmp);
    rf_metrics *m = NULL;
    write_steps(dir, 2, 100.0, &m);
    char second[4096] = "";
    if (m) snprintf(second, sizeof second, "%s", rf_metrics_tb_path(m));
    rf_metrics_close(m);
    CHECK(find_event_files(dir, paths, 4) == 2);
    CHECK(strcmp(paths[1], second) == 0);
    char *buf = NULL;
    size_t size = 0, off = 0, len;
    const unsigned char *data;
    event e;
    CHECK_OK(rf_read_file(second, &buf, &size));
    if (buf) {
        int r = read_record((unsigned char *)buf, size, &off, &data, &len);
        r |= read_record((unsigned char *)buf, size, &off, &data, &len);
        CHECK(r == REC_OK && decode_event(data, len, &e) == 0);
        CHECK(e.session_status == 1 && e.step == 20 && e.n == 0);
    }
    free(buf);
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    buf = NULL;
    CHECK_OK(rf_read_file(path, &buf, NULL));
    int lines = 0;
    for (char *p = buf; p && (p = strchr(p, '\n')); p++) lines++;
    CHECK(lines == 5);
    free(buf);

    m = NULL;
    CHECK_OK(rf_metrics_open(&m, NULL, 0, 0));
    if (m) {
        CHECK_OK(rf_metrics_set(m, "x", 1));
        CHECK_OK(rf_metrics_commit(m, 1));
    }
    rf_metrics_close(m);
    rf_metrics_close(NULL);
    rf_tb_writer_close(NULL);
    CHECK_ERR(rf_metrics_open(&m, NULL, 1, 0), RF_ERR_ARG, "directory");
    snprintf(dir, sizeof dir, "%s/run1/metrics.jsonl/sub", g_tmp);  // under a regular file
    CHECK_ERR(rf_metrics_open(&m, dir, 0, 1), RF_ERR_IO, "metrics.jsonl");
    CHECK(m == NULL);
}

/* ---- console ---- */

static void test_console_line(void) {
    rf_metrics *m = NULL;
    CHECK_OK(rf_metrics_open(&m, NULL, 0, 0));
    if (!m) return;
    rf_metrics_set(m, "reward/mean", 0.4123);
    rf_metrics_set(m, "reward/std", 0.3187);
    rf_metrics_set(m, "acc", 0.38);
    rf_metrics_set(m, "kl", 0.0021);
    rf_metrics_set(m, "perf/gen_tok_s", 850.2);
    const rf_metrics_col cols[] = {
        {"reward/mean", "reward", "%.2f", "reward/std", NULL},
        {"acc", "acc", "%.2f", NULL, NULL},
        {"kl", "kl", "%.3f", NULL, NULL},
        {"entropy", "ent", "%.2f", NULL, NULL},  // not set: skipped
        {"perf/gen_tok_s", "gen", "%.0f", NULL, " tok/s"},
    };
    char line[256];
    /* 12 of 200 steps done, 12 timed in 12 s: 188 s left. */
    size_t n = rf_metrics_console_line(m, 12, 200, 12.0, 12, cols, 5, line, sizeof line);
    const char *want = "step 12/200 | reward 0.41\xC2\xB1" "0.32 | acc 0.38 | kl 0.002 | "
                       "gen 850 tok/s | ETA 3m08s";
    CHECK(strcmp(line, want) == 0);
    CHECK(n == strlen(want));
    if (strcmp(line, want) != 0) fprintf(stderr, "got: %s\n", line);
    char small[10];  // truncation: NUL-terminated, full length reported
    CHECK(rf_metrics_console_line(m, 12, 200, 12.0, 12, cols, 5, small, sizeof small) == n);
    CHECK(strcmp(small, "step 12/2") == 0);
    rf_metrics_console_line(m, 3, 0, 5.0, 3, cols, 1, line, sizeof line);
    CHECK(strcmp(line, "step 3 | reward 0.41\xC2\xB1" "0.32") == 0);
    rf_metrics_close(m);

    char d[32];
    rf_metrics_format_duration(44.6, d, sizeof d);
    CHECK(strcmp(d, "45s") == 0);
    rf_metrics_format_duration(192, d, sizeof d);
    CHECK(strcmp(d, "3m12s") == 0);
    rf_metrics_format_duration(3900, d, sizeof d);
    CHECK(strcmp(d, "1h05m") == 0);
    rf_metrics_format_duration(2 * 86400 + 3 * 3600 + 59, d, sizeof d);
    CHECK(strcmp(d, "2d03h") == 0);
    rf_metrics_format_duration(NAN, d, sizeof d);
    CHECK(strcmp(d, "?") == 0);
}

/* rf_tb_writer_text writes, byte for byte, the Event worked out by hand from the protobuf
 * encoding rules (tb_writer.h: TensorBoard's text-plugin layout), framed and CRC-checked. */
static void test_text_summary_bytes(void) {
    char dir[300], paths[2][512];
    snprintf(dir, sizeof dir, "%s/text", g_tmp);
    rf_tb_writer *w = NULL;
    CHECK_OK(rf_tb_writer_open(&w, dir));
    if (!w) return;
    const char *tags[1] = {"t"}, *texts[1] = {"hi"};
    CHECK_OK(rf_tb_writer_text(w, 3, 1.0, 1, tags, texts));
    rf_tb_writer_close(w);
    static const unsigned char want[] = {
        0x09, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f, /* wall_time = 1.0 (field 1, fixed64) */
        0x10, 0x03,                         /* step = 3 */
        0x2a, 25,                           /* summary (field 5), 25 bytes */
        0x0a, 23,                           /*   value (field 1), 23 bytes */
        0x0a, 1, 't',                       /*     tag */
        0x42, 8,                            /*     tensor (field 8) */
        0x08, 0x07, 0x12, 0x00, 0x42, 2, 'h', 'i', /* dtype DT_STRING, shape {}, string_val "hi" */
        0x4a, 8,                            /*     metadata (field 9) */
        0x0a, 6, 0x0a, 4, 't', 'e', 'x', 't', /* plugin_data { plugin_name "text" } */
    };
    CHECK(find_event_files(dir, paths, 2) == 1);
    char *buf = NULL;
    size_t size = 0, off = 0, len = 0;
    const unsigned char *data = NULL;
    CHECK_OK(rf_read_file(paths[0], &buf, &size));
    if (!buf) return;
    CHECK(read_record((unsigned char *)buf, size, &off, &data, &len) == REC_OK); /* file_version */
    CHECK(read_record((unsigned char *)buf, size, &off, &data, &len) == REC_OK);
    CHECK(len == sizeof want && memcmp(data, want, sizeof want) == 0);
    free(buf);
}

/* --resume cuts a run's logs back to the checkpoint's step: JSONL lines and event records with
 * a later step go (the file_version and SessionLog START records of step 0/10 stay), a torn
 * last line or record goes too, and a file with nothing to cut is left untouched. */
static void test_cut_back(void) {
    char dir[300], paths[2][512], p[400];
    snprintf(dir, sizeof dir, "%s/cut", g_tmp);
    rf_metrics *m = NULL;
    write_steps(dir, 1, 0.0, &m); /* steps 10, 20, 30 */
    rf_metrics_close(m);
    snprintf(p, sizeof p, "%s/metrics.jsonl", dir);
    FILE *f = fopen(p, "a");
    if (f) fputs("{\"step\": 40, \"ti", f), fclose(f); /* torn */
    CHECK(find_event_files(dir, paths, 2) == 1);
    f = fopen(paths[0], "a");
    if (f) fputs("\x20\x00\x00", f), fclose(f); /* a torn record */
    int dropped = -1;
    CHECK_OK(rf_run_dir_cut_jsonl(p, 20, &dropped));
    CHECK(dropped == 2);
    char *text = NULL;
    CHECK_OK(rf_read_file(p, &text, NULL));
    CHECK(text && strstr(text, "\"step\": 10,") && strstr(text, "\"step\": 20,") && !strstr(text, "\"step\": 30") &&
          !strstr(text, "\"step\": 40") && text[strlen(text) - 1] == '\n');
    free(text);
    CHECK_OK(rf_run_dir_cut_events(paths[0], 20, &dropped));
    CHECK(dropped == 2); /* step 30's scalars and the torn record */
    char *buf = NULL;
    size_t size = 0, off = 0, len = 0;
    const unsigned char *data = NULL;
    CHECK_OK(rf_read_file(paths[0], &buf, &size));
    int64_t steps[8];
    int n = 0, r;
    while (buf && n < 8 && (r = read_record((unsigned char *)buf, size, &off, &data, &len)) == REC_OK) {
        event e;
        CHECK(decode_event(data, len, &e) == 0);
        steps[n++] = e.step;
    }
    CHECK(off == size);
    /* file_version (0), SessionLog START (10), scalars of 10 and 20 */
    CHECK(n == 4 && steps[0] == 0 && steps[1] == 10 && steps[2] == 10 && steps[3] == 20);
    free(buf);
    CHECK_OK(rf_run_dir_cut_jsonl(p, 20, &dropped));
    CHECK(dropped == 0);
    CHECK_OK(rf_run_dir_cut_events(paths[0], 20, &dropped));
    CHECK(dropped == 0);
    CHECK(rf_run_dir_has_run(dir) == 1);
    snprintf(p, sizeof p, "%s/none", g_tmp);
    CHECK(rf_run_dir_has_run(p) == 0);
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/rf_metrics_XXXXXX");
    if (!mkdtemp(g_tmp)) return 1;
    test_crc32c_known_answers();
    test_crc32c_slicing_and_extend();
    test_crc32c_mask();
    test_event_file_roundtrip();
    test_event_bytes_match_tensorboard();
    test_corruption_detected();
    test_jsonl();
    test_jsonl_special_values();
    test_resume_and_errors();
    test_console_line();
    test_text_summary_bytes();
    test_cut_back();
    if (!getenv("RF_KEEP_TMP")) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_tmp);
    } else {
        printf("kept %s\n", g_tmp);
    }
    return rf_test_finish("test_metrics");
}
