/* spotune: the command-line entry point. */
#include "../checkpoint/ckpt.h"
#include "cli.h"

int main(int argc, char **argv)
{
    ckpt_hdf5_setup(); /* before any other HDF5 call: see checkpoint/ckpt.h */
    int rc = cli_main(argc, argv);
    ckpt_hdf5_shutdown();
    return rc;
}
