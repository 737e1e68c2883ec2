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

void signals_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
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
