/* axonn_c.Sequential's chunk order (axc/chunk_plan.h). */
#include <stdlib.h>

#include "axc/chunk_plan.h"

struct axc_chunk_plan {
    int chunks, layers;
    int running;         /* the chunk of the call handed out (-1: none) */
    uint64_t ticket;     /* the last place handed out in the order of waits */
    int *next;           /* [chunks]: the next child of each chunk */
    uint64_t *held;      /* [chunks]: a waiting chunk's place in the order of waits (0: not) */
    uint64_t *number;    /* [chunks]: ... and the result it awaits (0: nothing was held) */
    unsigned char *holds; /* [layers] */
};

axc_status axc_chunk_plan_new(int chunks, int layers, const unsigned char *holds,
                              axc_chunk_plan **out)
{
    *out = NULL;
    if (chunks < 1 || layers < 0 || (layers > 0 && !holds))
        return axc_fail(AXC_ERR_INVALID, "chunk plan: %d chunks and %d children (expected at "
                                         "least 1 chunk, 0 or more children)", chunks, layers);
    axc_chunk_plan *p = calloc(1, sizeof *p);
    if (p) {
        p->next = calloc((size_t)chunks, sizeof *p->next);
        p->held = calloc((size_t)chunks, sizeof *p->held);
        p->number = calloc((size_t)chunks, sizeof *p->number);
        p->holds = calloc((size_t)layers + 1, 1);
    }
    if (!p || !p->next || !p->held || !p->number || !p->holds) {
        axc_chunk_plan_free(p);
        return axc_fail(AXC_ERR_NOMEM, "chunk plan: out of memory for %d chunks", chunks);
    }
    for (int l = 0; l < layers; l++)
        p->holds[l] = holds[l] != 0;
    p->chunks = chunks;
    p->layers = layers;
    p->running = -1;
    *out = p;
    return AXC_OK;
}

void axc_chunk_plan_free(axc_chunk_plan *p)
{
    if (!p)
        return;
    free(p->next);
    free(p->held);
    free(p->number);
    free(p->holds);
    free(p);
}

axc_chunk_step axc_chunk_plan_next(axc_chunk_plan *p, int *chunk, int *layer, uint64_t *number)
{
    *chunk = *layer = -1;
    *number = 0;
    p->running = -1;
    int oldest = -1;
    for (int c = 0; c < p->chunks; c++) {
        if (p->next[c] < p->layers && !p->held[c]) {
            *chunk = p->running = c;
            *layer = p->next[c];
            return AXC_CHUNK_RUN;
        }
        if (p->held[c] && (oldest < 0 || p->held[c] < p->held[oldest]))
            oldest = c;
    }
    if (oldest < 0)
        return AXC_CHUNK_DONE;
    *number = p->number[oldest];
    p->held[oldest] = p->number[oldest] = 0;
    return AXC_CHUNK_AWAIT;
}

int axc_chunk_plan_ran(axc_chunk_plan *p, uint64_t number)
{
    int c = p->running;
    if (c < 0)
        return 0;
    p->running = -1;
    int l = p->next[c]++;
    p->number[c] = number;
    if (p->holds[l] || number)
        p->held[c] = ++p->ticket;
    return p->held[c] != 0;
}
