/* The environment interface's shared helpers (env/env.h). */
#include "env/env.h"

void rf_env_close(rf_env *e) {
    if (!e) return;
    if (e->close && e->ctx) e->close(e->ctx);
    *e = (rf_env){0};
}
