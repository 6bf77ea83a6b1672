/* The channel of the calling thread: which copy of a group's communicator its collectives use
 * (concurrent micro-batches each run on their own channel). The communicator sets it
 * (axc_comm_set_thread_channel, which checks it against the communicator) and reads it; the
 * timeline tags the spans a thread records with it. It lives here, below both, so that the
 * timeline does not call back into the communicator. */
#ifndef AXC_THREAD_CHANNEL_H
#define AXC_THREAD_CHANNEL_H

#ifdef __cplusplus
extern "C" {
#endif

int axc_thread_channel(void);          /* 0 until set on this thread */
void axc_thread_channel_set(int channel); /* unchecked: axc_comm_set_thread_channel checks */

#ifdef __cplusplus
}
#endif
#endif
