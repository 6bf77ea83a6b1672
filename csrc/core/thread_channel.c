/* The calling thread's channel (see axc/thread_channel.h). */
#include "axc/thread_channel.h"

static _Thread_local int channel_of_thread;

int axc_thread_channel(void) { return channel_of_thread; }

void axc_thread_channel_set(int channel) { channel_of_thread = channel; }
