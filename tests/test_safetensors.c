/* Safetensors reading and writing, and the f32 <-> bf16 / f16 conversions behind them.
 *
 * Proves: exact round trips (F32 bit for bit; BF16/F16 equal to round-to-nearest-even of the
 * input, checked on hand-picked ties, NaN, infinities and subnormals and exhaustively over all
 * 65536 half-width codes); sharded writes split and name files like transformers and load
 * back; stale files of an earlier layout are removed; every malformed header is refused with
 * a message naming the file, the tensor and the problem; random header corruption never
 * crashes. Conversions are exact, so every numeric check here is bitwise (tolerance 0). */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "model/dtype.h"
#include "model/safetensors.h"
#include "tests/test_util.h"

static char g_tmp[256];

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t g_rng = 12345u;
static uint32_t rnd(void) { /* fixed-seed xorshift: failures reproduce */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 17;
    g_rng ^= g_rng << 5;
    return g_rng;
}

static void path_in(char *out, size_t cap, const char *sub) { rf_path_join(out, cap, g_tmp, sub); }

static void rm_tree(const char *path) {
    DIR *d = opendir(path);
    if (!d) {
        unlink(path);
        return;
    }
    struct dirent *de;
    char p[1024];
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        rf_path_join(p, sizeof p, path, de->d_name);
        rm_tree(p);
    }
    closedir(d);
    rmdir(path);
}

static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    if (!d) return -1;
    for (struct dirent *de; (de = readdir(d));) n += de->d_name[0] != '.';
    closedir(d);
    return n;
}

/* Writes a file: 8-byte length of `header`, the header text, then `data_len` bytes 0..255. */
static void write_raw(const char *path, const char *header, size_t data_len) {
    FILE *f = fopen(path, "wb");
    uint64_t n = strlen(header);
    fwrite(&n, 8, 1, f);
    fwrite(header, 1, n, f);
    for (size_t i = 0; i < data_len; i++) fputc((int)(i & 0xff), f);
    fclose(f);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    fputs(text, f);
    fclose(f);
}

/* ------------------------------------------------------------ conversions */

static void test_bf16_rounding(void) {
    static const struct { uint32_t in; uint16_t out; } cases[] = {
        {0x3f800000u, 0x3f80}, /* 1.0 exact */
        {0x3f808000u, 0x3f80}, /* tie, 0x3f80 even: down */
        {0x3f818000u, 0x3f82}, /* tie, 0x3f81 odd: up */
        {0x3f808001u, 0x3f81}, /* just above the tie */
        {0x3f807fffu, 0x3f80}, /* just below the tie */
        {0xbf818000u, 0xbf82}, /* negative tie rounds the magnitude */
        {0x7f800000u, 0x7f80}, /* +inf */
        {0xff800000u, 0xff80}, /* -inf */
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds up to inf */
        {0x7f7f7fffu, 0x7f7f}, /* largest value that stays finite */
        {0x00010000u, 0x0001}, /* smallest bf16 subnormal */
        {0x00008000u, 0x0000}, /* tie to even at zero */
        {0x00018000u, 0x0002}, /* subnormal tie, odd: up */
        {0x80008001u, 0x8001}, /* negative subnormal above the tie */
        {0x80000000u, 0x8000}, /* -0 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        CHECK(rf_f32_to_bf16(from_bits(cases[i].in)) == cases[i].out);
    /* NaN stays NaN, even one whose payload sits only in the dropped low bits. */
    uint16_t q = rf_f32_to_bf16(from_bits(0x7fc00000u)), lo = rf_f32_to_bf16(from_bits(0x7f800001u));
    CHECK(q == 0x7fc0);
    CHECK((lo & 0x7f80) == 0x7f80 && (lo & 0x7f) != 0);
    CHECK(isnan(rf_bf16_to_f32(lo)));
    /* Every bf16 code is exactly representable: bf16 -> f32 -> bf16 is the identity. */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = rf_bf16_to_f32((uint16_t)h);
        if (bits(f) != h << 16) bad++;
        if (!isnan(f) && rf_f32_to_bf16(f) != h) bad++;
    }
    CHECK(bad == 0);
}

/* Reference value of an f16 code by its definition, in double. */
static double f16_value(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return h & 0x8000 ? -v : v;
}

static void test_f16_conversion(void) {
    static const struct { float in; uint16_t out; } cases[] = {
        {1.0f, 0x3c00},
        {-2.0f, 0xc000},
        {65504.0f, 0x7bff},          /* largest finite */
        {65519.99f, 0x7bff},         /* below the midpoint to inf */
        {65520.0f, 0x7c00},          /* the midpoint rounds to inf (even) */
        {1e10f, 0x7c00},
        {0x1p-24f, 0x0001},          /* smallest subnormal */
        {0x1p-25f, 0x0000},          /* tie at zero: even */
        {0x1.000002p-25f, 0x0001},   /* just above it */
        {0x3p-25f, 0x0002},          /* 1.5 ulp: tie, odd 1 rounds to 2 */
        {0x5p-25f, 0x0002},          /* 2.5 ulp: tie, even 2 stays */
        {0x3ffp-24f, 0x03ff},        /* largest subnormal */
        {0x7ffp-25f, 0x0400},        /* tie between 0x3ff and the smallest normal: even */
        {0x1p-14f, 0x0400},          /* smallest normal */
        {0x1.002p0f, 0x3c00},        /* 1 + 2^-11: tie, even */
        {0x1.006p0f, 0x3c02},        /* 1 + 3 * 2^-11: tie, odd rounds up */
        {-0.0f, 0x8000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        uint16_t got = rf_f32_to_f16(cases[i].in);
        CHECK(got == cases[i].out);
        if (got != cases[i].out)
            fprintf(stderr, "  f16(%a) = 0x%04x, expected 0x%04x\n", cases[i].in, got, cases[i].out);
    }
    CHECK(rf_f32_to_f16(INFINITY) == 0x7c00 && rf_f32_to_f16(-INFINITY) == 0xfc00);
    CHECK(isnan(rf_f16_to_f32(rf_f32_to_f16(NAN))));
    CHECK(isnan(rf_f16_to_f32(rf_f32_to_f16(from_bits(0x7f800001u)))));
    /* Every f16 code decodes to its defined value and encodes back to itself. */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = rf_f16_to_f32((uint16_t)h);
        double want = f16_value((uint16_t)h);
        if (isnan(want) ? !isnan(f) : (double)f != want || !signbit(f) != !signbit(want)) bad++;
        if (!isnan(f) && rf_f32_to_f16(f) != h) bad++;
    }
    CHECK(bad == 0);
    /* Random f32 values: the result is the nearest f16 (ties checked above). */
    bad = 0;
    for (int i = 0; i < 100000; i++) {
        float f = from_bits(rnd() & 0xc7ffffffu); /* |x| < 2^17, covers subnormal..overflow */
        uint16_t h = rf_f32_to_f16(f);
        double v = f16_value(h), err = fabs(v - (double)f);
        uint16_t up = (uint16_t)(h + 1), dn = (uint16_t)(h - 1);
        if ((h & 0x7fff) != 0x7c00 && (h & 0x7fff) < 0x7bff && fabs(f16_value(up) - f) < err) bad++;
        if ((h & 0x7fff) > 0 && (h & 0x7fff) != 0x7c00 && fabs(f16_value(dn) - f) < err) bad++;
    }
    CHECK(bad == 0);
}

/* ------------------------------------------------------------ round trips */

static void fill(float *x, size_t n, uint32_t seed) {
    g_rng = seed;
    for (size_t i = 0; i < n; i++) x[i] = (float)((double)(int32_t)rnd() / 2147483648.0) * 3.0f;
}

static void test_round_trip(rf_dtype dtype) {
    char dir[512];
    path_in(dir, sizeof dir, rf_dtype_name(dtype));
    float a[6], b[5], c[1] = {7.25f}, special[8] = {0x1p-130f, -0x1p-140f, INFINITY, -INFINITY,
                                                    NAN, 0x1.818p0f, 1e-40f, -0.0f};
    fill(a, 6, 1), fill(b, 5, 2);
    /* Given out of name order: the file must be sorted by name regardless. */
    rf_st_entry e[] = {
        {"zeta.weight", a, 2, {2, 3}},
        {"alpha", b, 1, {5}},
        {"scalar", c, 0, {0}},
        {"empty", NULL, 2, {0, 4}},
        {"special", special, 1, {8}},
    };
    CHECK_OK(rf_st_write_dir(dir, e, 5, dtype, 0));
    rf_safetensors *st = NULL;
    CHECK_OK(rf_st_open_dir(&st, dir));
    if (!st) return;
    CHECK(rf_st_count(st) == 5);
    /* Tensors come back in file order, which is name order. */
    static const char *order[] = {"alpha", "empty", "scalar", "special", "zeta.weight"};
    for (int i = 0; i < 5 && i < rf_st_count(st); i++) CHECK(!strcmp(rf_st_at(st, i)->name, order[i]));
    for (int i = 0; i < 5; i++) {
        const rf_st_tensor *t = rf_st_find(st, e[i].name);
        CHECK(t && t->dtype == dtype && t->ndim == e[i].ndim);
        if (!t) continue;
        size_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            numel *= (size_t)e[i].shape[d];
            CHECK(t->shape[d] == e[i].shape[d]);
        }
        CHECK(t->nbytes == numel * rf_dtype_size(dtype));
        float got[8];
        CHECK_OK(rf_st_read_f32(st, e[i].name, got, e[i].shape, e[i].ndim));
        int bad = 0;
        for (size_t k = 0; k < numel; k++) {
            float want = dtype == RF_DTYPE_F32  ? e[i].data[k]
                       : dtype == RF_DTYPE_BF16 ? rf_bf16_to_f32(rf_f32_to_bf16(e[i].data[k]))
                                                : rf_f16_to_f32(rf_f32_to_f16(e[i].data[k]));
            if (isnan(want) ? !isnan(got[k]) : bits(got[k]) != bits(want)) bad++;
        }
        CHECK(bad == 0);
    }
    CHECK(rf_st_find(st, "nope") == NULL);
    rf_st_close(st);
}

/* rf_st_read_block_f32: blocks of a 3-D F16 tensor (seen as 4 x 6) and of a 1-D one equal the
 * same elements of the whole read; a block outside the tensor and a wrong shape are refused. */
static void test_read_block(void) {
    char dir[512];
    path_in(dir, sizeof dir, "block");
    float a[24], v[5];
    fill(a, 24, 3), fill(v, 5, 4);
    rf_st_entry e[] = {{"a", a, 3, {4, 2, 3}}, {"v", v, 1, {5}}};
    CHECK_OK(rf_st_write_dir(dir, e, 2, RF_DTYPE_F16, 0));
    rf_safetensors *st = NULL;
    CHECK_OK(rf_st_open_dir(&st, dir));
    if (!st) return;
    float whole[24], got[24];
    CHECK_OK(rf_st_read_f32(st, "a", whole, e[0].shape, 3));
    CHECK_OK(rf_st_read_block_f32(st, "a", got, e[0].shape, 3, 1, 3, 2, 5));
    int bad = 0;
    for (int r = 1; r < 3; r++)
        for (int c = 2; c < 5; c++) bad += bits(got[(r - 1) * 3 + (c - 2)]) != bits(whole[r * 6 + c]);
    CHECK(bad == 0);
    CHECK_OK(rf_st_read_f32(st, "v", whole, NULL, 0));
    CHECK_OK(rf_st_read_block_f32(st, "v", got, NULL, 0, 2, 5, 0, 1));
    CHECK(bits(got[0]) == bits(whole[2]) && bits(got[2]) == bits(whole[4]));
    CHECK_ERR(rf_st_read_block_f32(st, "a", got, NULL, 0, 0, 5, 0, 1), RF_ERR_ARG,
              "tensor \"a\" is (4, 6): no block rows [0, 5) x cols [0, 1) in it");
    CHECK_ERR(rf_st_read_block_f32(st, "v", got, NULL, 0, 0, 1, 1, 2), RF_ERR_ARG, "no block");
    int64_t wrong[1] = {6};
    CHECK_ERR(rf_st_read_block_f32(st, "v", got, wrong, 1, 0, 1, 0, 1), RF_ERR_FORMAT, "does not match the expected [6]");
    CHECK_ERR(rf_st_read_block_f32(st, "w", got, NULL, 0, 0, 1, 0, 1), RF_ERR_FORMAT, "tensor \"w\" not found");
    rf_st_close(st);
}

/* The byte layout the Python library writes, spelled out for a tiny file. */
static void test_exact_bytes(void) {
    char dir[512], path[600];
    path_in(dir, sizeof dir, "bytes");
    float x[2] = {1.0f, -2.0f}, y[1] = {0.5f};
    rf_st_entry e[] = {{"b", x, 1, {2}}, {"a\"\\", y, 1, {1}}};
    CHECK_OK(rf_st_write_dir(dir, e, 2, RF_DTYPE_F32, 0));
    rf_path_join(path, sizeof path, dir, "model.safetensors");
    char *buf = NULL;
    size_t len = 0;
    CHECK_OK(rf_read_file(path, &buf, &len));
    if (!buf) return;
    const char *want = "{\"__metadata__\":{\"format\":\"pt\"},\"a\\\"\\\\\":{\"dtype\":\"F32\",\"shape\":[1],"
                       "\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}";
    uint64_t n;
    memcpy(&n, buf, 8);
    CHECK(n % 8 == 0 && n >= strlen(want) && n < strlen(want) + 8);
    CHECK(len == 8 + n + 12);
    CHECK(strncmp(buf + 8, want, strlen(want)) == 0);
    int pad_ok = 1;
    for (size_t i = 8 + strlen(want); i < 8 + n; i++) pad_ok &= buf[i] == ' ';
    CHECK(pad_ok);
    CHECK(memcmp(buf + 8 + n, y, 4) == 0 && memcmp(buf + 8 + n + 4, x, 8) == 0);
    free(buf);
}

static int exists_in(const char *dir, const char *name) {
    char p[600];
    rf_path_join(p, sizeof p, dir, name);
    return rf_file_exists(p);
}

static void test_sharded(void) {
    char dir[512], path[600];
    path_in(dir, sizeof dir, "sharded");
    enum { N = 5 };
    static float data[N][64];
    for (int i = 0; i < N; i++) fill(data[i], 64, 100u + (uint32_t)i);
    /* Sizes 48, 48, 200, 48, 16 bytes (F32) with a 100-byte limit give 3 shards: the
     * oversized "embed" alone, numbered first (huggingface_hub appends it when met, before the
     * shard being filled), then [layers.0.w layers.0.b], then [layers.1.w norm]. */
    rf_st_entry e[N] = {
        {"layers.0.w", data[0], 2, {3, 4}},
        {"layers.0.b", data[1], 1, {12}},
        {"embed", data[2], 2, {5, 10}},
        {"layers.1.w", data[3], 2, {4, 3}},
        {"norm", data[4], 1, {4}},
    };
    /* Stale single-file checkpoint from an earlier save must be removed. */
    CHECK_OK(rf_st_write_dir(dir, e, 2, RF_DTYPE_F32, 0));
    CHECK(exists_in(dir, "model.safetensors"));
    CHECK_OK(rf_st_write_dir(dir, e, N, RF_DTYPE_F32, 100));
    CHECK(!exists_in(dir, "model.safetensors"));
    CHECK(exists_in(dir, "model-00001-of-00003.safetensors"));
    CHECK(exists_in(dir, "model-00002-of-00003.safetensors"));
    CHECK(exists_in(dir, "model-00003-of-00003.safetensors"));
    CHECK(count_files(dir) == 4);
    rf_safetensors *st = NULL;
    CHECK_OK(rf_st_open_dir(&st, dir));
    if (st) {
        CHECK(rf_st_count(st) == N);
        const rf_st_tensor *big = rf_st_find(st, "embed"), *l0 = rf_st_find(st, "layers.0.w");
        const rf_st_tensor *nm = rf_st_find(st, "norm");
        CHECK(big && strstr(big->file, "model-00001-of-00003"));
        CHECK(l0 && strstr(l0->file, "model-00002-of-00003"));
        CHECK(nm && strstr(nm->file, "model-00003-of-00003"));
        for (int i = 0; i < N; i++) {
            float got[64];
            CHECK_OK(rf_st_read_f32(st, e[i].name, got, e[i].shape, e[i].ndim));
            size_t numel = (size_t)e[i].shape[0] * (e[i].ndim > 1 ? (size_t)e[i].shape[1] : 1);
            CHECK(memcmp(got, data[i], numel * 4) == 0);
        }
        rf_st_close(st);
    }
    /* The index, byte for byte as json.dumps(indent=2, sort_keys=True) + "\n" writes it. */
    rf_path_join(path, sizeof path, dir, "model.safetensors.index.json");
    char *idx = NULL;
    CHECK_OK(rf_read_file(path, &idx, NULL));
    const char *want =
        "{\n  \"metadata\": {\n    \"total_parameters\": 90,\n    \"total_size\": 360\n  },\n"
        "  \"weight_map\": {\n    \"embed\": \"model-00001-of-00003.safetensors\",\n"
        "    \"layers.0.b\": \"model-00002-of-00003.safetensors\",\n"
        "    \"layers.0.w\": \"model-00002-of-00003.safetensors\",\n"
        "    \"layers.1.w\": \"model-00003-of-00003.safetensors\",\n"
        "    \"norm\": \"model-00003-of-00003.safetensors\"\n  }\n}\n";
    CHECK(idx && strcmp(idx, want) == 0);
    free(idx);
    /* Re-shard into 2 files: the 3-shard files go. Then a single file: index and shards go. */
    CHECK_OK(rf_st_write_dir(dir, e, N, RF_DTYPE_BF16, 150));
    CHECK(exists_in(dir, "model-00002-of-00002.safetensors") && count_files(dir) == 3);
    CHECK_OK(rf_st_write_dir(dir, e, N, RF_DTYPE_BF16, 0));
    CHECK(exists_in(dir, "model.safetensors") && count_files(dir) == 1);
}

/* Thousands of tensors over several shards: the hash table grows across files. */
static void test_many(void) {
    char dir[512], name[64];
    path_in(dir, sizeof dir, "many");
    enum { N = 3000 };
    static float vals[N];
    static char names[N][32];
    static rf_st_entry e[N];
    for (int i = 0; i < N; i++) {
        vals[i] = (float)i;
        snprintf(names[i], sizeof names[i], "model.layers.%d.x", i);
        e[i] = (rf_st_entry){names[i], &vals[i], 1, {1}};
    }
    CHECK_OK(rf_st_write_dir(dir, e, N, RF_DTYPE_F32, 4 * 700));
    CHECK(exists_in(dir, "model-00005-of-00005.safetensors"));
    rf_safetensors *st = NULL;
    CHECK_OK(rf_st_open_dir(&st, dir));
    int bad = 0;
    for (int i = 0; i < N && st; i++) {
        snprintf(name, sizeof name, "model.layers.%d.x", i);
        float v = -1;
        int64_t shape[1] = {1};
        if (rf_st_read_f32(st, name, &v, shape, 1) != RF_OK || v != (float)i) bad++;
    }
    CHECK(bad == 0 && rf_st_count(st) == N);
    rf_st_close(st);
}

/* ------------------------------------------------------------ malformed input */

static rf_status open_raw(const char *header, size_t data_len) {
    char path[512];
    path_in(path, sizeof path, "bad.safetensors");
    write_raw(path, header, data_len);
    rf_safetensors *st = NULL;
    rf_status s = rf_st_open_file(&st, path);
    CHECK((s == RF_OK) == (st != NULL));
    rf_st_close(st);
    return s;
}

#define T4(name, off) "\"" name "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":" off "}"

static void test_malformed_files(void) {
    char path[512];
    path_in(path, sizeof path, "bad.safetensors");
    rf_safetensors *st = NULL;
    write_text(path, "abcde");
    CHECK_ERR(rf_st_open_file(&st, path), RF_ERR_FORMAT, "bad.safetensors: file is 5 bytes, too short");
    FILE *f = fopen(path, "wb");
    uint64_t n = 1000;
    fwrite(&n, 8, 1, f);
    fwrite("{}        ", 1, 10, f);
    fclose(f);
    CHECK_ERR(rf_st_open_file(&st, path), RF_ERR_FORMAT, "header length 1000 exceeds the 10 bytes");
    CHECK(st == NULL);
    path_in(path, sizeof path, "does-not-exist.safetensors");
    CHECK_ERR(rf_st_open_file(&st, path), RF_ERR_IO, "does-not-exist.safetensors: cannot open");

    CHECK_ERR(open_raw("{\"a\": ", 0), RF_ERR_FORMAT, "bad.safetensors: header is not valid JSON");
    CHECK_ERR(open_raw("[1, 2]", 0), RF_ERR_FORMAT, "header is not a JSON object");
    CHECK_ERR(open_raw("{}  x", 0), RF_ERR_FORMAT, "trailing bytes after the JSON object");
    CHECK_ERR(open_raw("{\"\xff\":1}", 0), RF_ERR_FORMAT, "header is not valid UTF-8");
    CHECK_ERR(open_raw("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4), RF_ERR_FORMAT,
              "bad.safetensors: tensor \"a\": missing \"dtype\"");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4), RF_ERR_FORMAT,
              "tensor \"a\": missing \"shape\"");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4), RF_ERR_FORMAT,
              "tensor \"a\": missing \"data_offsets\"");
    CHECK_ERR(open_raw("{\"a\":[1]}", 4), RF_ERR_FORMAT, "tensor \"a\": entry is not a JSON object");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4),
              RF_ERR_FORMAT, "tensor \"a\": unknown dtype \"F33\"");
    CHECK_ERR(open_raw("{\"ids\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8),
              RF_ERR_UNSUPPORTED, "bad.safetensors: tensor \"ids\": dtype I64 is not supported");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4),
              RF_ERR_FORMAT, "tensor \"a\": data_offsets [0, 8] lie outside the 4-byte data buffer");
    CHECK_ERR(open_raw("{\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,12]}}", 16),
              RF_ERR_FORMAT, "bad.safetensors: tensor \"model.norm.weight\": data_offsets [0, 12] "
              "do not match shape [4] x F32 (16 bytes)");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"BF16\",\"shape\":[4294967296,4294967296,4],"
                       "\"data_offsets\":[0,4]}}", 4),
              RF_ERR_FORMAT, "do not match shape [4294967296, 4294967296, 4] x BF16 (more than 2^64 bytes)");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4),
              RF_ERR_FORMAT, "tensor \"a\": \"shape\" dimension 0 is not a non-negative integer");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0.5,4]}}", 4),
              RF_ERR_FORMAT, "\"data_offsets\" is not a pair [begin, end]");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8),
              RF_ERR_FORMAT, "\"data_offsets\" is not a pair [begin, end]");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4),
              RF_ERR_FORMAT, "data_offsets [4, 0] end before they begin");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4),
              RF_ERR_UNSUPPORTED, "tensor \"a\": 9 dimensions, more than the 8 supported");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12),
              RF_ERR_FORMAT, "bad.safetensors: tensors \"a\" [0, 8] and \"b\" [4, 12] overlap");
    CHECK_ERR(open_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                       "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]}}", 16),
              RF_ERR_FORMAT, "tensors \"a\" [0, 16] and \"z\" [8, 8] overlap");
    CHECK_ERR(open_raw("{" T4("a", "[0,4]") "," T4("a", "[4,8]") "}", 8), RF_ERR_FORMAT,
              "bad.safetensors: duplicate tensor name \"a\"");
    CHECK_ERR(open_raw("{\"__metadata__\":{\"format\":1}," T4("a", "[0,4]") "}", 4), RF_ERR_FORMAT,
              "\"__metadata__\" value \"format\" is not a string");
    /* Valid oddities: no tensors; a gap between tensors; padding with spaces. */
    CHECK_OK(open_raw("{}", 0));
    CHECK_OK(open_raw("{\"__metadata__\":{\"format\":\"pt\"}," T4("a", "[0,4]") "," T4("b", "[8,12]") "}   ", 12));
}

static void write_shard(const char *dir, const char *name, const char *header, size_t data_len) {
    char p[600];
    rf_path_join(p, sizeof p, dir, name);
    write_raw(p, header, data_len);
}

static void test_malformed_index(void) {
    char dir[512], p[600];
    rf_safetensors *st = NULL;
    path_in(dir, sizeof dir, "idx");
    CHECK_OK(rf_mkdirs(dir));
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_IO, "idx: neither model.safetensors nor "
              "model.safetensors.index.json found");
    rf_path_join(p, sizeof p, dir, "model.safetensors.index.json");
    write_text(p, "{\"weight_map\": {\"a\": \"s1.safetensors\",");
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_FORMAT, "model.safetensors.index.json: not a JSON object");
    write_text(p, "{\"metadata\": {}}");
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_FORMAT, "no \"weight_map\" object");
    write_text(p, "{\"weight_map\": {\"a\": \"../x.safetensors\"}}");
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_FORMAT, "weight_map entry \"a\" is not a shard file name");

    write_shard(dir, "s1.safetensors", "{" T4("a", "[0,4]") "," T4("b", "[4,8]") "}", 8);
    write_text(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"c\": \"s2.safetensors\"}}");
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_IO, "weight_map names shard ");
    CHECK(strstr(rf_error_message(), "s2.safetensors, which does not exist") != NULL);

    write_shard(dir, "s2.safetensors", "{" T4("c", "[0,4]") "}", 4);
    write_text(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"b\": \"s1.safetensors\", "
                  "\"c\": \"s2.safetensors\", \"d\": \"s2.safetensors\"}}");
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_FORMAT, "tensor \"d\" is listed in weight_map for ");
    CHECK(strstr(rf_error_message(), "s2.safetensors but is missing from that shard") != NULL);
    write_text(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"b\": \"s2.safetensors\", "
                  "\"c\": \"s2.safetensors\"}}");
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_FORMAT, "s1.safetensors)");
    write_text(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"c\": \"s2.safetensors\"}}");
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_FORMAT, "tensor \"b\" in ");
    CHECK(strstr(rf_error_message(), "is not listed in weight_map") != NULL);

    write_shard(dir, "s2.safetensors", "{" T4("a", "[0,4]") "," T4("c", "[4,8]") "}", 8);
    write_text(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"b\": \"s1.safetensors\", "
                  "\"c\": \"s2.safetensors\"}}");
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_FORMAT, "tensor \"a\" is present in two shards: ");
    CHECK(strstr(rf_error_message(), "s1.safetensors and ") && strstr(rf_error_message(), "s2.safetensors"));

    /* A malformed shard is reported with the shard's own path. */
    write_shard(dir, "s2.safetensors", "{\"c\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4);
    CHECK_ERR(rf_st_open_dir(&st, dir), RF_ERR_FORMAT, "s2.safetensors: tensor \"c\": data_offsets [0, 4]");

    write_shard(dir, "s2.safetensors", "{" T4("c", "[0,4]") "}", 4);
    CHECK_OK(rf_st_open_dir(&st, dir));
    CHECK(rf_st_count(st) == 3);
    rf_st_close(st);
    CHECK(st != NULL);
}

static void test_read_errors(void) {
    char dir[512];
    path_in(dir, sizeof dir, "readerr");
    float w[6] = {0};
    rf_st_entry e[] = {{"model.norm.weight", w, 2, {2, 3}}};
    CHECK_OK(rf_st_write_dir(dir, e, 1, RF_DTYPE_BF16, 0));
    rf_safetensors *st = NULL;
    CHECK_OK(rf_st_open_dir(&st, dir));
    float out[6];
    int64_t want[2] = {3, 2}, want1[1] = {6};
    CHECK_ERR(rf_st_read_f32(st, "model.norm.weight", out, want, 2), RF_ERR_FORMAT,
              "model.safetensors: tensor \"model.norm.weight\": shape [2, 3] (BF16) does not match "
              "the expected [3, 2]");
    CHECK_ERR(rf_st_read_f32(st, "model.norm.weight", out, want1, 1), RF_ERR_FORMAT,
              "does not match the expected [6]");
    CHECK_ERR(rf_st_read_f32(st, "lm_head.weight", out, want, 2), RF_ERR_FORMAT,
              "readerr/model.safetensors: tensor \"lm_head.weight\" not found");
    /* rf_st_read_bf16: the same shape check and messages; the stored bits as they are */
    uint16_t raw[6];
    int64_t have[2] = {2, 3};
    CHECK_ERR(rf_st_read_bf16(st, "model.norm.weight", raw, want, 2), RF_ERR_FORMAT,
              "model.safetensors: tensor \"model.norm.weight\": shape [2, 3] (BF16) does not match "
              "the expected [3, 2]");
    CHECK_ERR(rf_st_read_bf16(st, "lm_head.weight", raw, want, 2), RF_ERR_FORMAT,
              "readerr/model.safetensors: tensor \"lm_head.weight\" not found");
    memset(raw, 0xff, sizeof raw);
    CHECK_OK(rf_st_read_bf16(st, "model.norm.weight", raw, have, 2));
    CHECK(raw[0] == 0 && raw[5] == 0);
    rf_st_close(st);
    path_in(dir, sizeof dir, "readerr32");
    float v[3] = {1.0f, -2.5f, 3.0f};
    rf_st_entry e32[] = {{"w", v, 1, {3}}};
    CHECK_OK(rf_st_write_dir(dir, e32, 1, RF_DTYPE_F32, 0));
    CHECK_OK(rf_st_open_dir(&st, dir));
    int64_t three[1] = {3};
    CHECK_ERR(rf_st_read_bf16(st, "w", raw, three, 1), RF_ERR_FORMAT,
              "readerr32/model.safetensors: tensor \"w\" is F32, not BF16");
    rf_st_close(st);
    rf_st_entry e16[] = {{"w", v, 1, {3}}};
    path_in(dir, sizeof dir, "readbf16");
    CHECK_OK(rf_st_write_dir(dir, e16, 1, RF_DTYPE_BF16, 0));
    CHECK_OK(rf_st_open_dir(&st, dir));
    CHECK_OK(rf_st_read_bf16(st, "w", raw, three, 1));
    CHECK(raw[0] == 0x3f80 && raw[1] == 0xc020 && raw[2] == 0x4040); /* 1, -2.5, 3 */
    rf_st_close(st);
    rf_st_close(NULL);
    rf_st_entry dup[] = {{"a", w, 1, {1}}, {"a", w, 1, {1}}};
    CHECK_ERR(rf_st_write_dir(dir, dup, 2, RF_DTYPE_F32, 0), RF_ERR_ARG, "duplicate tensor name \"a\"");
    rf_st_entry neg[] = {{"a", w, 1, {-1}}};
    CHECK_ERR(rf_st_write_dir(dir, neg, 1, RF_DTYPE_F32, 0), RF_ERR_ARG, "negative dimension");
}

/* Flips bytes of a valid header 200 times: every open succeeds or fails with a message, and
 * whatever opens can be read in full (ASan / the mapping bounds catch stray reads). */
static void test_random_corruption(void) {
    char dir[512], src[600], dst[600];
    path_in(dir, sizeof dir, "fuzz");
    float a[12], b[3];
    fill(a, 12, 7), fill(b, 3, 8);
    rf_st_entry e[] = {{"a.weight", a, 2, {3, 4}}, {"b", b, 1, {3}}, {"c", b, 2, {1, 2}}};
    CHECK_OK(rf_st_write_dir(dir, e, 3, RF_DTYPE_BF16, 0));
    rf_path_join(src, sizeof src, dir, "model.safetensors");
    path_in(dst, sizeof dst, "fuzz.safetensors");
    char *orig = NULL;
    size_t len = 0;
    CHECK_OK(rf_read_file(src, &orig, &len));
    if (!orig) return;
    uint64_t hlen;
    memcpy(&hlen, orig, 8);
    char *buf = malloc(len);
    int opened = 0, silent = 0;
    g_rng = 2024u;
    for (int it = 0; it < 200; it++) {
        memcpy(buf, orig, len);
        int flips = 1 + (int)(rnd() % 4);
        for (int k = 0; k < flips; k++) {
            size_t pos = rnd() % (8 + hlen);
            if (it % 2 == 0) { /* a random byte, or one bit flipped */
                buf[pos] = (rnd() & 1) ? (char)(rnd() & 0xff) : (char)(buf[pos] ^ (1 << (rnd() % 8)));
                continue;
            }
            /* Odd rounds change a digit of the JSON: still parses, shapes and offsets move. */
            while (pos < 8 + hlen && (buf[pos] < '0' || buf[pos] > '9')) pos++;
            if (pos < 8 + hlen) buf[pos] = (char)('0' + rnd() % 10);
        }
        FILE *f = fopen(dst, "wb");
        fwrite(buf, 1, len, f);
        fclose(f);
        rf_safetensors *st = NULL;
        rf_error_clear();
        rf_status s = rf_st_open_file(&st, dst);
        if (s != RF_OK) {
            silent += rf_error_message()[0] == '\0';
            continue;
        }
        opened++;
        for (int i = 0; i < rf_st_count(st); i++) {
            const rf_st_tensor *t = rf_st_at(st, i);
            float *tmp = malloc(t->nbytes / rf_dtype_size(t->dtype) * sizeof(float) + 1);
            CHECK_OK(rf_st_read_f32(st, t->name, tmp, NULL, 0));
            free(tmp);
        }
        rf_st_close(st);
    }
    CHECK(silent == 0);
    printf("random corruption: %d of 200 corrupted files still opened\n", opened);
    free(buf);
    free(orig);
}

/* ------------------------------------------------------------ interop (by hand, not in ctest)
 * With RF_ST_INTEROP_DIR set, writes c_f32, c_bf16, c_f16 and c_sharded there for
 * tests/tools/check_safetensors.py to load with the Python library, and reads what that
 * script wrote (py, py_sharded) back, checking every value. Both sides use interop_val. */

enum { N_INTEROP = 5 };
static const char *const interop_names[N_INTEROP] = {
    "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight",
    "special", "lm_head.weight"};
static const int64_t interop_shapes[N_INTEROP][2] = {{7, 5}, {4, 6}, {5, 0}, {10, 0}, {3, 5}};
static const int interop_ndim[N_INTEROP] = {2, 2, 1, 1, 2};
/* Zero signs, infinities, an f32 subnormal, bf16 and f16 ties, f16 overflow and subnormals. */
static const float interop_special[10] = {0.0f, -0.0f, INFINITY, -INFINITY, 1e-40f,
                                          0x1.018p0f, 0x1.002p0f, 65520.0f, 0x3p-25f, -0x1p-20f};

static float interop_val(int k, int i) {
    if (k == 3) return interop_special[i];
    return (float)(((i * 37 + k * 11) % 101) - 50) / 7.0f;
}

static void interop_entries(rf_st_entry *e, float (*buf)[64]) {
    for (int k = 0; k < N_INTEROP; k++) {
        e[k] = (rf_st_entry){interop_names[k], buf[k], interop_ndim[k], {0}};
        int64_t n = 1;
        for (int d = 0; d < interop_ndim[k]; d++) n *= e[k].shape[d] = interop_shapes[k][d];
        for (int i = 0; i < n; i++) buf[k][i] = interop_val(k, i);
    }
}

/* The Python side stores tensor k as F32, BF16, F16 for k % 3 = 0, 1, 2. */
static void interop_read(const char *dir, int mixed) {
    rf_safetensors *st = NULL;
    CHECK_OK(rf_st_open_dir(&st, dir));
    if (!st) return;
    CHECK(rf_st_count(st) == N_INTEROP);
    static float buf[N_INTEROP][64];
    rf_st_entry e[N_INTEROP];
    interop_entries(e, buf);
    for (int k = 0; k < N_INTEROP; k++) {
        float got[64];
        rf_dtype d = mixed ? (rf_dtype)(k % 3) : RF_DTYPE_F32;
        const rf_st_tensor *t = rf_st_find(st, e[k].name);
        CHECK(t && t->dtype == d);
        CHECK_OK(rf_st_read_f32(st, e[k].name, got, e[k].shape, e[k].ndim));
        int bad = 0;
        for (int i = 0; i < (int)(t ? t->nbytes / rf_dtype_size(t->dtype) : 0); i++) {
            float v = buf[k][i];
            float want = d == RF_DTYPE_BF16 ? rf_bf16_to_f32(rf_f32_to_bf16(v))
                       : d == RF_DTYPE_F16  ? rf_f16_to_f32(rf_f32_to_f16(v)) : v;
            bad += bits(want) != bits(got[i]);
        }
        CHECK(bad == 0);
    }
    rf_st_close(st);
}

static void interop(const char *root) {
    static float buf[N_INTEROP][64];
    rf_st_entry e[N_INTEROP];
    interop_entries(e, buf);
    char dir[600];
    static const char *const sub[3] = {"c_f32", "c_bf16", "c_f16"};
    for (int d = 0; d < 3; d++) {
        rf_path_join(dir, sizeof dir, root, sub[d]);
        CHECK_OK(rf_st_write_dir(dir, e, N_INTEROP, (rf_dtype)d, 0));
    }
    rf_path_join(dir, sizeof dir, root, "c_sharded");
    CHECK_OK(rf_st_write_dir(dir, e, N_INTEROP, RF_DTYPE_F32, 100));
    rf_path_join(dir, sizeof dir, root, "py");
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        printf("interop: wrote C files to %s; no Python files to read yet\n", root);
        return;
    }
    interop_read(dir, 1);
    rf_path_join(dir, sizeof dir, root, "py_sharded");
    interop_read(dir, 0);
    printf("interop: wrote C files to %s and checked the Python files there\n", root);
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/rf_st_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 1;
    }
    test_bf16_rounding();
    test_f16_conversion();
    test_round_trip(RF_DTYPE_F32);
    test_round_trip(RF_DTYPE_BF16);
    test_round_trip(RF_DTYPE_F16);
    test_read_block();
    test_exact_bytes();
    test_sharded();
    test_many();
    test_malformed_files();
    test_malformed_index();
    test_read_errors();
    test_random_corruption();
    const char *interop_dir = getenv("RF_ST_INTEROP_DIR");
    if (interop_dir && *interop_dir) interop(interop_dir);
    rm_tree(g_tmp);
    return rf_test_finish("test_safetensors");
}
