/* A TOML 1.0.0 parser (https://toml.io/en/v1.0.0) for recipes.
 *
 * Written here because Debian packages no C TOML library. It implements the whole of TOML
 * 1.0.0 and passes every 1.0.0 case of the toml-test conformance suite (tests/test_toml.c):
 * all key forms, tables, arrays of tables, inline tables, the four string forms, integers in
 * four bases, floats with inf/nan, booleans, and the four date/time kinds (kept as validated
 * strings with a type tag), with the specification's redefinition rules and UTF-8 checks.
 *
 * A parsed document is a tree of rf_toml nodes owned by its root table; every node records the
 * file, line and column (1-based, columns in characters) where its value starts, and every
 * table entry where its key starts, so that callers can report "FILE:LINE:COL: message". */
#ifndef RF_TOML_H
#define RF_TOML_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum rf_toml_type {
    RF_TOML_TABLE,
    RF_TOML_ARRAY,
    RF_TOML_STRING,
    RF_TOML_INTEGER,
    RF_TOML_FLOAT,
    RF_TOML_BOOL,
    RF_TOML_DATETIME,       /* offset date-time: 1979-05-27T07:32:00Z */
    RF_TOML_DATETIME_LOCAL, /* 1979-05-27T07:32:00 */
    RF_TOML_DATE_LOCAL,     /* 1979-05-27 */
    RF_TOML_TIME_LOCAL,     /* 07:32:00 */
} rf_toml_type;

typedef struct rf_toml rf_toml;

/* Parses `len` bytes of TOML text; `origin` (copied) names it in messages and positions.
 * On success *out is the root table, which the caller frees with rf_toml_free.
 * Errors: RF_ERR_FORMAT "ORIGIN:LINE:COL: message" at the first problem (for a duplicate key,
 * the second occurrence); RF_ERR_NOMEM. */
rf_status rf_toml_parse(rf_toml **out, const char *text, size_t len, const char *origin);

/* Reads and parses the file at `path` (which becomes the origin). Errors as rf_toml_parse,
 * plus RF_ERR_IO. */
rf_status rf_toml_parse_file(rf_toml **out, const char *path);

/* Frees a tree returned by the parse functions (NULL is fine). Only roots may be freed. */
void rf_toml_free(rf_toml *root);

/* ---- nodes: every pointer returned below is owned by the tree ---- */

rf_toml_type rf_toml_kind(const rf_toml *v);
/* "table", "array", "string", "integer", "float", "boolean", "offset date-time",
 * "local date-time", "local date", "local time". */
const char *rf_toml_type_name(rf_toml_type t);
const char *rf_toml_origin(const rf_toml *v);
int rf_toml_line(const rf_toml *v);
int rf_toml_col(const rf_toml *v);

/* Entries of a table or items of an array (0 for scalars). Table entries keep file order. */
size_t rf_toml_count(const rf_toml *v);
/* Key of table entry i; *len (optional) gets its length (quoted keys may hold NUL). */
const char *rf_toml_key(const rf_toml *t, size_t i, size_t *len);
/* Value of table entry i, and where its key was written. */
rf_toml *rf_toml_value(const rf_toml *t, size_t i);
void rf_toml_key_pos(const rf_toml *t, size_t i, int *line, int *col);
/* Item i of an array. */
rf_toml *rf_toml_at(const rf_toml *a, size_t i);

/* The value of one key of a table (NULL when absent or t is not a table). */
rf_toml *rf_toml_find(const rf_toml *t, const char *key);
/* The value at a dotted path of bare keys ("train.lr"), or NULL. */
rf_toml *rf_toml_get(const rf_toml *t, const char *path);

/* Scalar contents, for a node of the right kind (0/NULL otherwise). rf_toml_string also
 * returns the text of date/time nodes (normalized: 'T' separator, upper-case 'Z');
 * rf_toml_float accepts integers. */
const char *rf_toml_string(const rf_toml *v, size_t *len);
int64_t rf_toml_int(const rf_toml *v);
double rf_toml_float(const rf_toml *v);
int rf_toml_bool(const rf_toml *v);

/* Typed lookups by dotted path. When the path is absent they return RF_OK and leave *out
 * unchanged (so *out can hold a default); when it holds another type they return
 * RF_ERR_FORMAT "ORIGIN:LINE:COL: PATH: expected a float, got a string". Integers are accepted
 * as floats. Strings returned are owned by the tree. */
rf_status rf_toml_get_string(const rf_toml *t, const char *path, const char **out);
rf_status rf_toml_get_int(const rf_toml *t, const char *path, int64_t *out);
rf_status rf_toml_get_float(const rf_toml *t, const char *path, double *out);
rf_status rf_toml_get_bool(const rf_toml *t, const char *path, int *out);

/* "a" or "an" for a type name, for messages ("expected an integer"). */
const char *rf_toml_article(const char *type_name);

#endif
