/* Built-in chat templates (see chat_template.h for the exact formats and their sources). */
#include "model/chat_template.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char *s; size_t n, cap; } rf__sb;

static rf_status rf__sb_add(rf__sb *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) return rf_error(RF_ERR_NOMEM, "chat template: out of memory");
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
    return RF_OK;
}

static rf_status rf__sb_str(rf__sb *b, const char *s) { return rf__sb_add(b, s, strlen(s)); }

/* Length of the Python str.isspace() character at s (what Jinja's trim strips), else 0. */
static int rf__space_len(const unsigned char *s, size_t n) {
    if (n >= 1 && ((s[0] >= 9 && s[0] <= 13) || (s[0] >= 0x1C && s[0] <= 0x20))) return 1;
    if (n >= 2 && s[0] == 0xC2 && (s[1] == 0x85 || s[1] == 0xA0)) return 2;
    if (n < 3) return 0;
    uint32_t cp = (uint32_t)(s[0] & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
    if ((s[0] & 0xF0) != 0xE0) return 0;
    int sp = cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
             cp == 0x202F || cp == 0x205F || cp == 0x3000;
    return sp ? 3 : 0;
}

/* Jinja `| trim`: strips leading and trailing Unicode whitespace. */
static void rf__trim(const char *s, size_t *start, size_t *end) {
    size_t a = 0, b = strlen(s);
    int k;
    while (a < b && (k = rf__space_len((const unsigned char *)s + a, b - a)) > 0) a += (size_t)k;
    while (b > a) {
        size_t p = b - 1; /* start of the last character */
        while (p > a && ((unsigned char)s[p] & 0xC0) == 0x80) p--;
        if (rf__space_len((const unsigned char *)s + p, b - p) != (int)(b - p)) break;
        b = p;
    }
    *start = a;
    *end = b;
}

static rf_status rf__chatml(const rf_chat_message *m, int n, int gen, rf__sb *b) {
    for (int i = 0; i < n; i++) {
        RF_TRY(rf__sb_str(b, "<|im_start|>"));
        RF_TRY(rf__sb_str(b, m[i].role));
        RF_TRY(rf__sb_str(b, "\n"));
        RF_TRY(rf__sb_str(b, m[i].content));
        RF_TRY(rf__sb_str(b, "<|im_end|>\n"));
    }
    return gen ? rf__sb_str(b, "<|im_start|>assistant\n") : RF_OK;
}

static rf_status rf__llama3(const rf_chat_message *m, int n, int gen, rf__sb *b) {
    RF_TRY(rf__sb_str(b, "<|begin_of_text|>"));
    for (int i = 0; i < n; i++) {
        size_t a, e;
        rf__trim(m[i].content, &a, &e);
        RF_TRY(rf__sb_str(b, "<|start_header_id|>"));
        RF_TRY(rf__sb_str(b, m[i].role));
        RF_TRY(rf__sb_str(b, "<|end_header_id|>\n\n"));
        RF_TRY(rf__sb_add(b, m[i].content + a, e - a));
        RF_TRY(rf__sb_str(b, "<|eot_id|>"));
    }
    return gen ? rf__sb_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n") : RF_OK;
}

rf_status rf_chat_apply(const char *template_name, const rf_chat_message *msgs, int n,
                        int add_generation_prompt, char **out) {
    *out = NULL;
    if (n < 0 || (n > 0 && !msgs)) return rf_error(RF_ERR_ARG, "chat template: bad message list");
    for (int i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return rf_error(RF_ERR_ARG, "chat template: message %d has no %s", i,
                            msgs[i].role ? "content" : "role");
    rf__sb b = {0};
    rf_status st;
    if (template_name && strcmp(template_name, "chatml") == 0)
        st = rf__chatml(msgs, n, add_generation_prompt, &b);
    else if (template_name && strcmp(template_name, "llama3") == 0)
        st = rf__llama3(msgs, n, add_generation_prompt, &b);
    else
        return rf_error(RF_ERR_ARG, "chat template \"%s\" is unknown (valid: chatml, llama3)",
                        template_name ? template_name : "(null)");
    if (st == RF_OK) st = rf__sb_add(&b, "", 0); /* a NUL even for no messages */
    if (st != RF_OK) {
        free(b.s);
        return st;
    }
    *out = b.s;
    return RF_OK;
}
