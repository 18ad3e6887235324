/* Back-end selection. The CUDA back end is a module opened at run time (kernels/cuda_module.h):
 * this file finds and opens it on the first request for CUDA and forwards to it. In a build
 * without CUDA every request says so plainly, so that callers (tests, `--device cuda`) can
 * skip or refuse with a clear message, unless RLFLOW_CUDA_MODULE names a module (the CPU
 * stand-in of tests/mock_cuda_module.c runs in any build). */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/cuda_module.h"

static int g_selected; /* rf_cuda_select_device: where RF_CUDA_ANY starts */

void rf_cuda_select_device(int device) { g_selected = device; }

static const rf_cuda_module *g_module;
static int g_tried;
static char g_why[1024]; /* why no module could be opened (repeated on later calls) */

/* Opens path and checks the module's table; NULL with the reason in g_why. */
static const rf_cuda_module *open_module(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(g_why, sizeof g_why, "cannot open %s: %s", path, e ? e : "unknown error");
        return NULL;
    }
    rf_cuda_module_entry_fn entry;
    *(void **)&entry = dlsym(h, "rf__cuda_module_entry");
    const rf_cuda_module *m = entry ? entry() : NULL;
    if (!m || m->abi != RF_CUDA_MODULE_ABI) {
        snprintf(g_why, sizeof g_why, "%s is not rlflow's CUDA module of this version (%s)", path,
                 !entry ? "no rf__cuda_module_entry" : !m ? "no table" : "another ABI");
        dlclose(h);
        return NULL;
    }
    return m; /* stays open for the life of the process */
}

/* $RLFLOW_CUDA_MODULE, else (builds with CUDA) one next to the running program (the build
 * tree's) or in ../<libdir> (an installed tree: bin/rlflow, lib/librlflow_cuda.so), else the
 * build's own path (a program elsewhere, the tests' helpers). */
static const rf_cuda_module *find_module(void) {
    const char *env = getenv("RLFLOW_CUDA_MODULE");
    if (env && env[0]) return open_module(env);
#ifdef RF_CUDA_MODULE_PATH
    static const char *const beside[] = {"librlflow_cuda.so", "../" RF_INSTALL_LIBDIR "/librlflow_cuda.so"};
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 64);
    char *slash = n > 0 ? (self[n] = '\0', strrchr(self, '/')) : NULL;
    for (size_t i = 0; slash && i < sizeof beside / sizeof *beside; i++) {
        strcpy(slash + 1, beside[i]);
        if (access(self, F_OK) == 0) return open_module(self); /* present: its own reason if it fails */
    }
    return open_module(RF_CUDA_MODULE_PATH);
#else
    snprintf(g_why, sizeof g_why, "rlflow was built without the CUDA back end (RLFLOW_CUDA=OFF or nvcc not found)");
    return NULL;
#endif
}

const rf_cuda_module *rf__cuda_module(void) {
    if (!g_tried) g_tried = 1, g_module = find_module();
    if (g_module) return g_module;
#ifdef RF_CUDA_MODULE_PATH
    rf_error(RF_ERR_NODEVICE, "cuda: the CUDA back end module could not be loaded: %s (set RLFLOW_CUDA_MODULE to "
             "its path)", g_why);
#else
    const char *env = getenv("RLFLOW_CUDA_MODULE");
    if (env && env[0]) rf_error(RF_ERR_NODEVICE, "cuda: the CUDA back end module could not be loaded: %s", g_why);
    else rf_error(RF_ERR_NODEVICE, "%s", g_why);
#endif
    return NULL;
}

const rf_kernels *rf_cuda_kernels(int device) {
    const rf_cuda_module *m = rf__cuda_module();
    if (!m) return NULL;
    if (device == RF_CUDA_ANY) device = m->current_device() >= 0 ? m->current_device() : g_selected;
    return m->kernels(device);
}

int rf_cuda_device_count(void) {
    const rf_cuda_module *m = rf__cuda_module();
    if (!m) {
        rf_error_clear();
        return 0;
    }
    return m->device_count();
}

/* Neither opens the module: before it is open the back end has not started. */
int rf_cuda_current_device(void) { return g_module ? g_module->current_device() : -1; }
void *rf_cuda_stream(void) { return g_module ? g_module->stream() : NULL; }

const rf_kernels *rf_kernels_for(const char *device) {
    if (!device || strcmp(device, "cpu") == 0) return rf_cpu_kernels();
    if (strcmp(device, "cuda") == 0) return rf_cuda_kernels(RF_CUDA_ANY);
    rf_error(RF_ERR_ARG, "expected \"cpu\" or \"cuda\", got \"%s\"", device);
    return NULL;
}
