/* Stop requests from signals. */
#define _POSIX_C_SOURCE 200809L
#include "signals.h"

#include <signal.h>
#include <string.h>
#include <time.h>

static volatile sig_atomic_t received;
static volatile sig_atomic_t first_signal;
static struct timespec first_at; /* written before received becomes 1, read after */

static void on_signal(int sig)
{
    if (!received) {
        first_signal = sig;
        clock_gettime(CLOCK_MONOTONIC, &first_at); /* async-signal-safe */
    }
    if (received < 1000)
        received++;
}

static const int stop_signals[] = {SIGTERM, SIGINT, SIGUSR1};

static void stop_set(sigset_t *set)
{
    sigemptyset(set);
    for (int i = 0; i < 3; i++)
        sigaddset(set, stop_signals[i]);
}

void signals_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int i = 0; i < 3; i++)
        sigaction(stop_signals[i], &sa, NULL);
    sigset_t set; /* one held across an exec (signals_hold) arrives now */
    stop_set(&set);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
}

void signals_hold(void)
{
    sigset_t set;
    stop_set(&set);
    sigprocmask(SIG_BLOCK, &set, NULL);
}

void signals_default(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 3; i++)
        sigaction(stop_signals[i], &sa, NULL);
    if (received)
        raise(first_signal);
}

int signals_received(void)
{
    return received;
}

const char *signals_first_name(void)
{
    switch (first_signal) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    default: return "none";
    }
}

double signals_first_time(void)
{
    if (!received)
        return -1.0;
    return (double)first_at.tv_sec + 1e-9 * (double)first_at.tv_nsec;
}
