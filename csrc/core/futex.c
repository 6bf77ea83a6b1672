/* Linux futex wrappers: the waiting primitive of the shm backend and of work completion. */
#include "axc/futex.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int64_t axc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int axc_futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t timeout_ns, int shared)
{
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000LL);
        ts.tv_nsec = (long)(timeout_ns % 1000000000LL);
        tsp = &ts;
    }
    int op = shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE;
    long r = syscall(SYS_futex, (uint32_t *)word, op, expected, tsp, NULL, 0);
    if (r == -1 && errno == ETIMEDOUT)
        return ETIMEDOUT;
    return 0; /* woken, value changed (EAGAIN) or interrupted (EINTR): caller re-checks */
}

void axc_futex_wake_all(_Atomic uint32_t *word, int shared)
{
    int op = shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE;
    syscall(SYS_futex, (uint32_t *)word, op, 0x7fffffff, NULL, NULL, 0);
}
