/* trainer/bench.h — `spotune bench`: a model of a preset built with random
 * weights directly on the backend (no files), timed training steps (LoRA
 * and/or full), tokens/s, peak memory and MFU. Under mpirun the gradients
 * are all-reduced as in training and tokens/s counts every rank. */
#ifndef SPOTUNE_BENCH_H
#define SPOTUNE_BENCH_H

#include "../comm/comm.h"

int bench_main(int argc, char **argv, comm_t *comm, sp_err *err);

#endif
