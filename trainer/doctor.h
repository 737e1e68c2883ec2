/* trainer/doctor.h — `spotune doctor [CONFIG.yaml] [--json]`: on the machine
 * that will train, before the real job, one line per check (PASS, WARN, FAIL
 * or SKIPPED, the measured figure and the expected one): the host (cores,
 * memory, open files, /dev/shm, MPI, the interfaces NCCL would pick), the
 * run directory's file system (free space, write throughput), the object
 * store (credentials found, a probe object written, read back, listed and
 * deleted, upload throughput, clock skew against the store's Date header),
 * the cloud's preemption notice, and with a config the model, the dataset
 * and the memory plan against the GPUs found, then the GPUs themselves
 * (SKIPPED, with the reason, where there are none). Exit 0, or 1 on any FAIL,
 * 2 on a usage or config error. Under mpirun the first rank of each host runs
 * the host and storage checks, rank 0 the rest, and rank 0 prints them all;
 * every rank returns the same code. docs/doctor.md has the checks and their
 * thresholds. */
#ifndef SPOTUNE_DOCTOR_H
#define SPOTUNE_DOCTOR_H

int cmd_doctor(int argc, char **argv);

#endif
