/* Back-end selection. In a build without CUDA, rf_cuda_kernels reports that plainly so that
 * callers (tests, `--device cuda`) can skip or refuse with a clear message. */
#include "kernels/kernels.h"

#ifndef RLFLOW_HAVE_CUDA
const rf_kernels *rf_cuda_kernels(int device) {
    (void)device;
    rf_error(RF_ERR_NODEVICE, "rlflow was built without the CUDA back end (RLFLOW_CUDA=OFF or nvcc not found)");
    return NULL;
}

void rf_cuda_select_device(int device) { (void)device; }
void *rf_cuda_stream(void) { return NULL; }
int rf_cuda_device_count(void) { return 0; }
int rf_cuda_current_device(void) { return -1; }
#endif
