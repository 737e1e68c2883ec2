/* trainer/signals.h — SIGTERM, SIGINT and SIGUSR1 (which mpirun forwards to
 * every rank, and which scripts/spot-run.sh sends on a spot-termination
 * notice) become a request to stop: the training loop sees it at the next
 * micro-batch (or validation batch), all ranks agree, write a checkpoint
 * of the last step done and exit 75. A second
 * signal during that save changes nothing. The handler's counter (with the
 * first signal and its time) is the process's one piece of global mutable
 * state: a signal handler can reach nothing else. */
#ifndef SPOTUNE_SIGNALS_H
#define SPOTUNE_SIGNALS_H

/* Installs the handler on the three signals and unblocks them (one held
 * by signals_hold, even across an exec, is delivered to it then). main
 * calls it first of all, so a signal that comes while the process starts
 * is a request too, not the default action. */
void signals_install(void);
/* Blocks the three signals in the calling thread (the mask survives exec,
 * and threads created later inherit it): before main re-executes itself. */
void signals_hold(void);
/* For the commands that do not train: the default actions again, and a
 * signal already received acts as it would have (the process ends). */
void signals_default(void);
/* Signals received so far, and the name of the first. */
int signals_received(void);
const char *signals_first_name(void);
/* When the first arrived (sp_now()'s clock), or -1 before any. */
double signals_first_time(void);

#endif
