/* The nccl backend's slots: one per in-flight (or pooled) collective, holding its fork/join
 * events; the in-flight list in start order, the free pool, and reaping finished ones. */
#include "nccl_internal.h"

#if defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <stdlib.h>

/* ---------------------------------------------------------------- in-flight list (mu held) */

void axc_nccl_inflight_remove(nccl_backend *be, nccl_slot *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        be->head = s->next;
    if (s->next)
        s->next->prev = s->prev;
    else
        be->tail = s->prev;
    s->prev = s->next = NULL;
}

void axc_nccl_inflight_append(nccl_backend *be, nccl_slot *s)
{
    s->prev = be->tail;
    s->next = NULL;
    if (be->tail)
        be->tail->next = s;
    else
        be->head = s;
    be->tail = s;
}

/* Returns a finished, detached slot to the pool. */
void axc_nccl_slot_recycle(nccl_backend *be, nccl_slot *s)
{
    axc_nccl_inflight_remove(be, s);
    if (s->group)
        s->group->inflight--;
    s->group = NULL;
    s->work = NULL;
    s->completed = s->reported = 0;
    s->next = be->free_slots;
    be->free_slots = s;
}

/* Polls the done events of detached slots and recycles the finished ones (at most `budget`
 * queries, so start() stays cheap with many ops in flight). */
static void reap(nccl_backend *be, int budget)
{
    nccl_slot *s = be->head;
    while (s && budget > 0) {
        nccl_slot *next = s->next;
        if (!s->work) {
            if (!s->completed) {
                budget--;
                if (be->cu->EventQuery(s->done) == AXC_CUDA_SUCCESS)
                    s->completed = 1;
            }
            if (s->completed)
                axc_nccl_slot_recycle(be, s);
        }
        s = next;
    }
}

/* Takes a pooled slot or makes one (its events belong to be->device: call inside
 * axc_nccl_dev_enter). */
axc_status axc_nccl_slot_get(nccl_backend *be, nccl_slot **out)
{
    *out = NULL;
    pthread_mutex_lock(&be->mu);
    reap(be, 4);
    nccl_slot *s = be->free_slots;
    if (s)
        be->free_slots = s->next;
    pthread_mutex_unlock(&be->mu);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s)
            return axc_fail(AXC_ERR_NOMEM, "out of memory for an NCCL event pair");
        axc_status st = axc_cuda_check(
            be->cu->EventCreateWithFlags(&s->ready, AXC_CUDA_EVENT_DISABLE_TIMING),
            "cudaEventCreateWithFlags (nccl fork event)");
        if (st == AXC_OK)
            st = axc_cuda_check(
                be->cu->EventCreateWithFlags(&s->done, AXC_CUDA_EVENT_DISABLE_TIMING),
                "cudaEventCreateWithFlags (nccl join event)");
        if (st != AXC_OK) {
            if (s->ready)
                be->cu->EventDestroy(s->ready);
            free(s);
            return st;
        }
    }
    s->next = s->prev = NULL;
    s->work = NULL;
    s->group = NULL;
    s->completed = s->reported = 0;
    *out = s;
    return AXC_OK;
}

/* A slot that never went in flight goes straight back to the pool. */
void axc_nccl_slot_put_unused(nccl_backend *be, nccl_slot *s)
{
    pthread_mutex_lock(&be->mu);
    s->next = be->free_slots;
    be->free_slots = s;
    pthread_mutex_unlock(&be->mu);
}

void axc_nccl_slot_free(nccl_backend *be, nccl_slot *s)
{
    if (s->ready)
        be->cu->EventDestroy(s->ready);
    if (s->done)
        be->cu->EventDestroy(s->done);
    if (s->follow)
        be->cu->EventDestroy(s->follow);
    free(s);
}

#endif
