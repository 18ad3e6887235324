/* The TOML parser against the official toml-test suite (every TOML 1.0.0 case listed in
 * files-toml-1.0.0: valid files must parse to exactly the expected tagged JSON, invalid files
 * must be refused without crashing), then built-in cases that pin error messages and their
 * positions, node positions and the typed getters. The suite is found at
 * $RF_SHARED_DIR/data/toml-test; without it that part is skipped with a note. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <stdint.h>

#include "common/toml.h"
#include "common/util.h"
#include "test_util.h"

/* ---- toml-test: compare a parsed tree with the expected tagged JSON ---- */

static const char *tag_of(rf_toml_type t) {
    static const char *const tags[] = {"", "", "string", "integer", "float", "bool", "datetime",
                                       "datetime-local", "date-local", "time-local"};
    return tags[t];
}

/* Date/times compare by meaning: 'T'/'t'/' ' separators and 'z'/'Z' are the same, and
 * trailing zeros of fractional seconds do not matter. */
static void norm_datetime(const char *s, char *out, size_t cap) {
    size_t n = 0;
    for (; *s && n + 1 < cap; s++) out[n++] = (char)toupper((unsigned char)*s);
    out[n] = '\0';
    if (n > 10 && out[10] == ' ') out[10] = 'T';
    char *dot = strchr(out, '.');
    if (!dot) return;
    char *end = dot + 1;
    while (isdigit((unsigned char)*end)) end++;
    char *z = end;
    while (z > dot + 1 && z[-1] == '0') z--;
    if (z == dot + 1) z = dot;
    memmove(z, end, strlen(end) + 1);
}

static int float_equal(const char *want, double got) {
    const char *w = want + (want[0] == '+' || want[0] == '-');
    if (strcmp(w, "nan") == 0) return isnan(got);
    if (strcmp(w, "inf") == 0) return isinf(got) && (got < 0) == (want[0] == '-');
    double e = strtod(want, NULL);
    return e == got || fabs(e - got) <= 1e-15 * fabs(e);
}

/* cJSON cannot hold U+0000 inside a string, which the suite's JSON writes as \u0000: both
 * sides spell it U+F8FF (private use, in no file of the suite) before they are compared. */
#define NUL_STANDIN "\xef\xa3\xbf"

static char *json_without_nul(const char *text) {
    size_t n = strlen(text), o = 0;
    char *out = malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        if (text[i] == '\\' && strncmp(text + i + 1, "u0000", 5) == 0) {
            memcpy(out + o, "\\uF8FF", 6);
            o += 6;
            i += 5;
            continue;
        }
        out[o++] = text[i];
        if (text[i] == '\\' && i + 1 < n) out[o++] = text[++i]; /* keep "\\\\" whole */
    }
    out[o] = '\0';
    return out;
}

/* The string with each NUL replaced by NUL_STANDIN; the caller frees it. */
static char *without_nul(const char *s, size_t len) {
    char *out = malloc(3 * len + 1);
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i]) out[o++] = s[i];
        else memcpy(out + o, NUL_STANDIN, 3), o += 3;
    }
    out[o] = '\0';
    return out;
}

static int leaf_equal(const cJSON *e, const rf_toml *v) {
    const char *type = cJSON_GetObjectItemCaseSensitive(e, "type")->valuestring;
    const char *want = cJSON_GetObjectItemCaseSensitive(e, "value")->valuestring;
    rf_toml_type t = rf_toml_kind(v);
    if (t == RF_TOML_TABLE || t == RF_TOML_ARRAY || strcmp(type, tag_of(t)) != 0) return 0;
    if (t == RF_TOML_INTEGER) return strtoll(want, NULL, 10) == rf_toml_int(v);
    if (t == RF_TOML_FLOAT) return float_equal(want, rf_toml_float(v));
    if (t == RF_TOML_BOOL) return strcmp(want, rf_toml_bool(v) ? "true" : "false") == 0;
    size_t len;
    const char *got = rf_toml_string(v, &len);
    if (t == RF_TOML_STRING) {
        char *g = without_nul(got, len);
        int eq = strcmp(want, g) == 0;
        free(g);
        return eq;
    }
    char a[128], b[128];
    norm_datetime(want, a, sizeof a);
    norm_datetime(got, b, sizeof b);
    return strcmp(a, b) == 0;
}

static int is_leaf(const cJSON *e) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(e, "type");
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(e, "value");
    return cJSON_GetArraySize(e) == 2 && cJSON_IsString(t) && cJSON_IsString(v);
}

static int tree_equal(const cJSON *e, const rf_toml *v) {
    if (cJSON_IsObject(e) && is_leaf(e)) return leaf_equal(e, v);
    if (cJSON_IsArray(e)) {
        if (rf_toml_kind(v) != RF_TOML_ARRAY || rf_toml_count(v) != (size_t)cJSON_GetArraySize(e))
            return 0;
        size_t i = 0;
        for (const cJSON *c = e->child; c; c = c->next, i++)
            if (!tree_equal(c, rf_toml_at(v, i))) return 0;
        return 1;
    }
    if (!cJSON_IsObject(e) || rf_toml_kind(v) != RF_TOML_TABLE ||
        rf_toml_count(v) != (size_t)cJSON_GetArraySize(e))
        return 0;
    for (size_t i = 0; i < rf_toml_count(v); i++) {
        size_t len;
        const char *key = rf_toml_key(v, i, &len);
        char *k = without_nul(key, len);
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, k);
        free(k);
        if (!c || !tree_equal(c, rf_toml_value(v, i))) return 0;
    }
    return 1;
}

static int valid_case(const char *dir, const char *rel) {
    char path[4096], jpath[4200];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    snprintf(jpath, sizeof jpath, "%.*s.json", (int)(strlen(path) - 5), path);
    rf_toml *doc;
    if (rf_toml_parse_file(&doc, path) != RF_OK) {
        fprintf(stderr, "valid case refused: %s\n", rf_error_message());
        return 0;
    }
    char *text;
    cJSON *want = NULL;
    if (rf_read_file(jpath, &text, NULL) == RF_OK) {
        char *clean = json_without_nul(text);
        want = cJSON_Parse(clean);
        free(clean);
        free(text);
    }
    int ok = want && tree_equal(want, doc);
    if (!ok) fprintf(stderr, "valid case differs from %s\n", jpath);
    cJSON_Delete(want);
    rf_toml_free(doc);
    return ok;
}

static int invalid_case(const char *dir, const char *rel) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    rf_toml *doc;
    rf_status st = rf_toml_parse_file(&doc, path);
    if (st == RF_OK) {
        fprintf(stderr, "invalid case accepted: %s\n", path);
        rf_toml_free(doc);
        return 0;
    }
    /* A refusal names the file and a 1-based position. */
    return st == RF_ERR_FORMAT && strncmp(rf_error_message(), path, strlen(path)) == 0;
}

static void toml_test_suite(void) {
    const char *shared = rf_test_shared_dir();
    char dir[2048], list[2100];
    snprintf(dir, sizeof dir, "%s/data/toml-test", shared ? shared : "");
    snprintf(list, sizeof list, "%s/files-toml-1.0.0", dir);
    FILE *f = shared ? fopen(list, "r") : NULL;
    if (!f) {
        printf("note: toml-test suite not found (RF_SHARED_DIR/data/toml-test); skipping it\n");
        return;
    }
    char line[1024];
    int vp = 0, vn = 0, ip = 0, in = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = '\0';
        size_t n = strlen(line);
        if (n < 5 || strcmp(line + n - 5, ".toml") != 0) continue;
        if (strncmp(line, "valid/", 6) == 0) vn++, vp += valid_case(dir, line);
        else if (strncmp(line, "invalid/", 8) == 0) in++, ip += invalid_case(dir, line);
    }
    fclose(f);
    printf("toml-test 1.0.0: valid %d/%d, invalid %d/%d\n", vp, vn, ip, in);
    CHECK(vn > 0 && vp == vn);
    CHECK(in > 0 && ip == in);
}

/* ---- built-in cases ---- */

static rf_status parse(rf_toml **doc, const char *text) {
    return rf_toml_parse(doc, text, strlen(text), "t.toml");
}

/* Expects `text` to be refused with a message that contains `needle` (which includes the
 * position, "t.toml:L:C: ..."). */
static void refused(const char *text, const char *needle) {
    rf_toml *doc = NULL;
    CHECK_ERR(parse(&doc, text), RF_ERR_FORMAT, needle);
    CHECK(doc == NULL);
}

static void error_positions(void) {
    refused("a = 1\nb = 2\na = 3\n", "t.toml:3:1: duplicate key \"a\"");
    refused("[x]\nk = 1\n [x]\n", "t.toml:3:3: table \"x\" is defined twice");
    refused("x.y = 1\nx.y.z = 2\n", "t.toml:2:3: key \"x.y\" is already defined as an integer");
    refused("a = hello\n", "t.toml:1:5: invalid value \"hello\" (strings must be quoted)");
    refused("a = \"abc\nb = 1\n", "t.toml:1:5: unterminated string");
    refused("a = \"\xff\"\n", "t.toml:1:6: invalid UTF-8");
    /* columns count characters, not bytes */
    refused("\xc3\xa9 = 1\n", "t.toml:1:1: invalid character in a bare key");
    refused("b = \"\xc3\xa9\" x\n", "t.toml:1:9: expected a newline after a value");
    refused("a = {b = 1}\na.c = 2\n", "t.toml:2:1: cannot add keys to inline table \"a\"");
    refused("[a.b]\nx = 1\n[a]\nb.y = 2\n", "t.toml:4:1: cannot add keys to table \"b\" with dotted keys");
    refused("a = []\n[[a]]\n", "t.toml:2:3: key \"a\" is already defined as a static array");
    refused("[[a]]\n[a]\n", "t.toml:2:2: key \"a\" is already defined as an array of tables");
    refused("[a]\nb.c = 1\n[a.b]\n", "t.toml:3:4: table \"a.b\" is defined twice");
    refused("i = 9223372036854775808\n", "t.toml:1:5: integer 9223372036854775808 does not fit");
    refused("s = \"\\x\"\n", "t.toml:1:6: invalid escape sequence");
    refused("s = \"\\uD800\"\n", "t.toml:1:6: escape is not a Unicode scalar value");
    refused("d = 2021-02-29\n", "t.toml:1:5: invalid number or date \"2021-02-29\"");
    refused("t = {a = 1,}\n", "t.toml:1:11: trailing comma in an inline table");
    refused("a = 1 # bell \x07\n", "t.toml:1:14: control character in a comment");
    refused("a = 1\r\rb = 2\n", "t.toml:1:6: expected a newline");
}

static void deep_nesting_is_refused(void) {
    char text[4096] = "a = ";
    memset(text + 4, '[', 2000);
    text[2004] = '\0';
    refused(text, "nested too deeply");
    refused("a = [[[[", "unterminated array");
}

static void nodes_and_getters(void) {
    rf_toml *doc;
    const char *text = "# recipe\n[model]\npath = \"x\"  # the policy\n"
                       "[train]\nlr = 3e-4\nsteps = 10\nmix = [1, \"a\", 2.5]\n"
                       "when = 1979-05-27 07:32:00z\n";
    CHECK_OK(parse(&doc, text));
    if (!doc) return;
    const rf_toml *path = rf_toml_get(doc, "model.path");
    CHECK(path && rf_toml_line(path) == 3 && rf_toml_col(path) == 8);
    CHECK(strcmp(rf_toml_origin(path), "t.toml") == 0);
    const rf_toml *model = rf_toml_find(doc, "model");
    int line, col;
    rf_toml_key_pos(model, 0, &line, &col);
    CHECK(line == 3 && col == 1 && strcmp(rf_toml_key(model, 0, NULL), "path") == 0);
    CHECK(rf_toml_line(model) == 2 && rf_toml_col(model) == 1);
    CHECK(rf_toml_get(doc, "model.nope") == NULL && rf_toml_get(doc, "model.path.x") == NULL);
    const char *s = NULL;
    double lr = 0;
    int64_t steps = 0, missing = 7;
    CHECK_OK(rf_toml_get_string(doc, "model.path", &s));
    CHECK(s && strcmp(s, "x") == 0);
    CHECK_OK(rf_toml_get_float(doc, "train.lr", &lr));
    CHECK(lr == 3e-4);
    CHECK_OK(rf_toml_get_float(doc, "train.steps", &lr)); /* integers are floats too */
    CHECK(lr == 10.0);
    CHECK_OK(rf_toml_get_int(doc, "train.steps", &steps));
    CHECK(steps == 10);
    CHECK_OK(rf_toml_get_int(doc, "train.missing", &missing));
    CHECK(missing == 7);
    CHECK_ERR(rf_toml_get_int(doc, "model.path", &steps), RF_ERR_FORMAT,
              "t.toml:3:8: model.path: expected an integer, got a string");
    const rf_toml *mix = rf_toml_get(doc, "train.mix");
    CHECK(rf_toml_count(mix) == 3 && rf_toml_kind(rf_toml_at(mix, 1)) == RF_TOML_STRING);
    CHECK(rf_toml_col(rf_toml_at(mix, 2)) == 16);
    const rf_toml *when = rf_toml_get(doc, "train.when");
    CHECK(rf_toml_kind(when) == RF_TOML_DATETIME &&
          strcmp(rf_toml_string(when, NULL), "1979-05-27T07:32:00Z") == 0);
    rf_toml_free(doc);
}

static void strings_and_numbers(void) {
    rf_toml *doc;
    const char *text = "a = \"\"\"\n  one \\\n    two\"\"\"\"\"\nb = '''x\r\ny'''\n"
                       "c = \"\\u00e9\\U0001F600\"\nd = 0xDEAD_beef\n";
    CHECK_OK(parse(&doc, text));
    if (!doc) return;
    CHECK(strcmp(rf_toml_string(rf_toml_find(doc, "a"), NULL), "  one two\"\"") == 0);
    CHECK(strcmp(rf_toml_string(rf_toml_find(doc, "b"), NULL), "x\ny") == 0);
    CHECK(strcmp(rf_toml_string(rf_toml_find(doc, "c"), NULL), "\xc3\xa9\xf0\x9f\x98\x80") == 0);
    CHECK(rf_toml_int(rf_toml_find(doc, "d")) == 0xDEADBEEF);
    rf_toml_free(doc);
    refused("e = -0o17\n", "t.toml:1:5: invalid number"); /* no sign on octal */
    CHECK_OK(parse(&doc, "f = 0b101\ng = -inf\nh = 1_000.5e-3\n\"quoted.key\" = 1\n"));
    if (!doc) return;
    CHECK(rf_toml_int(rf_toml_find(doc, "f")) == 5);
    CHECK(isinf(rf_toml_float(rf_toml_find(doc, "g"))) && rf_toml_float(rf_toml_find(doc, "g")) < 0);
    CHECK(rf_toml_float(rf_toml_find(doc, "h")) == 1000.5e-3);
    CHECK(rf_toml_int(rf_toml_find(doc, "quoted.key")) == 1);
    rf_toml_free(doc);
}

int main(void) {
    toml_test_suite();
    error_positions();
    deep_nesting_is_refused();
    nodes_and_getters();
    strings_and_numbers();
    return rf_test_finish("test_toml");
}
