/* The order of axonn_c.Sequential's pipelined forward (axonn_c/chunking.py): which chunk calls
 * its next child, and when the oldest held reduction must be awaited because every chunk waits.
 * It depends only on which children hold a result (the grid and the knobs decide), so it is
 * the same on every rank, as collective matching requires. No locking: one forward owns it. */
#ifndef AXC_CHUNK_PLAN_H
#define AXC_CHUNK_PLAN_H

#include <stdint.h>

#include "axc/status.h"

typedef struct axc_chunk_plan axc_chunk_plan;

typedef enum axc_chunk_step {
    AXC_CHUNK_DONE = 0,  /* every chunk passed every child, nothing is held */
    AXC_CHUNK_RUN = 1,   /* chunk *chunk calls child *layer, then axc_chunk_plan_ran */
    AXC_CHUNK_AWAIT = 2, /* await the held results up to *number (0: none), then ask again */
} axc_chunk_step;

/* `chunks` pieces of the batch through `layers` children; holds[l]: child l is planned to hold
 * a result that a later call awaits (its chunk then waits even when the call held nothing) */
axc_status axc_chunk_plan_new(int chunks, int layers, const unsigned char *holds,
                              axc_chunk_plan **out);
void axc_chunk_plan_free(axc_chunk_plan *p);

/* The next step: the first chunk that can go on runs its next child; when all wait, the one
 * that waits longest stops waiting (AXC_CHUNK_AWAIT with its result's number). */
axc_chunk_step axc_chunk_plan_next(axc_chunk_plan *p, int *chunk, int *layer, uint64_t *number);

/* The call axc_chunk_plan_next handed out returned; `number`: the result it left held (0:
 * none). Returns whether its chunk now waits. */
int axc_chunk_plan_ran(axc_chunk_plan *p, uint64_t number);

#endif
