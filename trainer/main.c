/* spotune: the command-line entry point. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <unistd.h>

#include "../checkpoint/ckpt.h"
#include "../kernels/backend.h"
#include "cli.h"
#include "signals.h"

/* OpenBLAS picks its kernels when it loads, before main, and on a CPU model
 * it does not know it falls back to generic ones that run several times
 * slower (backend.h, backend_cpu_blas_better). The choice can only be
 * changed through OPENBLAS_CORETYPE before it loads: so when the CPU has the
 * vector units of a better kernel set and nobody set the variable, spotune
 * sets it and runs itself again (same process, same pid, before MPI or any
 * thread of its own starts). SPOTUNE_BLAS_FALLBACK keeps OpenBLAS's own
 * choice for the log. A variable set by the user is always left as it is. */
static void blas_kernels(char **argv)
{
    if (getenv("OPENBLAS_CORETYPE"))
        return;
    const char *better = backend_cpu_blas_better();
    if (!better)
        return;
    const char *core = backend_cpu_blas_core();
    if (setenv("SPOTUNE_BLAS_FALLBACK", core && *core ? core : "unknown", 1) ||
        setenv("OPENBLAS_CORETYPE", better, 1))
        return;
    /* by its path, not /proc/self/exe: the process name (ps, pkill, the
     * tests that find ranks among mpirun's children) comes from it */
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = 0;
        signals_hold(); /* a stop signal during the exec waits for the new image's handler */
        execv(self, argv);
        signals_install();
    }
    /* not re-executed: run on with OpenBLAS's choice, which doctor reports */
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv("SPOTUNE_BLAS_FALLBACK");
}

int main(int argc, char **argv)
{
    signals_install(); /* first: a stop signal while starting is a request (signals.h) */
    blas_kernels(argv);
    ckpt_hdf5_setup(); /* before any other HDF5 call: see checkpoint/ckpt.h */
    int rc = cli_main(argc, argv);
    ckpt_hdf5_shutdown();
    return rc;
}
