/* The work record's life (axc_work_wait / axc_work_free) over a fake backend: a work whose wait
 * timed out while the backend still owns it is never freed under the backend and never waited
 * for a second time (a dead peer costs one timeout, not two); once it finished it is freed. */
#include <stdatomic.h>
#include <stdlib.h>

#include "axc/comm.h"
#include "ctest.h"

static int waits; /* calls of the fake backend's wait */

/* a backend whose collectives never finish by themselves: every wait times out */
static axc_status fake_wait(axc_backend *be, axc_work *w)
{
    (void)be;
    (void)w;
    waits++;
    return axc_fail(AXC_ERR_TIMEOUT, "fake: did not finish");
}

static axc_work *new_work(axc_backend *be)
{
    axc_work *w = calloc(1, sizeof *w);
    w->backend = be;
    w->coll.kind = AXC_COLL_ALL_REDUCE;
    w->coll.device = -1;
    w->group.kind = AXC_GROUP_DATA;
    w->group.size = 2;
    atomic_store(&w->state, AXC_WORK_PENDING);
    return w;
}

int main(void)
{
    axc_backend be = {.name = "fake", .wait = fake_wait};

    /* a) timed out, still owned: free leaks it at once, without a second wait */
    axc_work *w = new_work(&be);
    CHECK(axc_work_wait(w) == AXC_ERR_TIMEOUT);
    CHECK(waits == 1 && w->timed_out && !w->waited);
    axc_work_free(w);
    CHECK(waits == 1);
    /* (the record is still there: the backend finishes it later) */
    axc_work_complete(w, AXC_OK, NULL);
    CHECK(axc_work_done(w));
    free(w);

    /* b) timed out, then finished before the free: freed without waiting again (ASan would
     * report a leak or a use after free otherwise) */
    waits = 0;
    w = new_work(&be);
    CHECK(axc_work_wait(w) == AXC_ERR_TIMEOUT);
    axc_work_complete(w, AXC_ERR_PEER, "fake: the peer went away");
    axc_work_free(w); /* (waits again: the backend's wait reports the finished work) */

    /* c) never waited and never finishing: free waits once, then leaks it */
    waits = 0;
    w = new_work(&be);
    axc_work_free(w);
    CHECK(waits == 1 && w->timed_out);
    axc_work_free(w); /* (a second free of the leaked record waits no more) */
    CHECK(waits == 1);
    free(w);
    return ctest_summary("test_work");
}
