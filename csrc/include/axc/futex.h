/* Futex waits on 32-bit words, process-shared (for shm segments) or private. */
#ifndef AXC_FUTEX_H
#define AXC_FUTEX_H

#include <stdint.h>

/* Waits while *word == expected, at most timeout_ns (< 0: forever). Returns 0 when woken or the
 * value changed, ETIMEDOUT on timeout. Spurious wake-ups are possible: callers loop. */
int axc_futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t timeout_ns, int shared);
void axc_futex_wake_all(_Atomic uint32_t *word, int shared);

/* Monotonic clock in nanoseconds. */
int64_t axc_now_ns(void);

#endif
