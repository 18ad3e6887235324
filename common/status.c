#include "common/status.h"

#include <string.h>

static _Thread_local char rf__msg[2048];

const char *rf_strerror(rf_status s) {
    static const char *const text[] = {
#define RF__TEXT(name, t) t,
        RF_STATUS_LIST(RF__TEXT)
#undef RF__TEXT
    };
    if ((int)s < 0 || s >= RF_STATUS_COUNT) return "unknown status";
    return text[s];
}

rf_status rf_error(rf_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rf__msg, sizeof rf__msg, fmt, ap);
    va_end(ap);
    return code;
}

rf_status rf_error_wrap(rf_status code, const char *fmt, ...) {
    char prefix[512], old[sizeof rf__msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, rf__msg, sizeof old);
    snprintf(rf__msg, sizeof rf__msg, "%s: %.1500s", prefix, old);
    return code;
}

const char *rf_error_message(void) { return rf__msg; }

void rf_error_clear(void) { rf__msg[0] = '\0'; }
