/* The work record's life (axc_work_wait / axc_work_free) over a fake backend: a work whose wait
 * timed out while the backend still runs it is never waited out a second time (a dead peer costs
 * one timeout, not two); freeing it aborts the backend's collectives, and it is freed once the
 * backend let it go, or leaked (never freed under the backend) when the backend is stuck. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "axc/comm.h"
#include "ctest.h"

static int waits, aborts; /* calls of the fake backend's wait and abort */
static int abort_lets_go; /* whether the fake's abort ends the pending work (else it is stuck) */
static axc_work *running; /* the work the fake backend runs */

/* a backend whose collectives never finish by themselves: every wait times out */
static axc_status fake_wait(axc_backend *be, axc_work *w)
{
    (void)be;
    (void)w;
    waits++;
    return axc_fail(AXC_ERR_TIMEOUT, "fake: did not finish");
}

static void fake_abort(axc_backend *be, axc_status st, const char *msg)
{
    (void)be;
    aborts++;
    if (abort_lets_go && running)
        axc_work_complete(running, st, msg);
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
    waits = aborts = 0;
    return running = w;
}

int main(void)
{
    axc_backend be = {.name = "fake", .wait = fake_wait, .abort = fake_abort};

    /* a) timed out, still running: the free aborts, the backend lets it go, it is freed (ASan
     * reports a leak otherwise) after one more wait that returns at once */
    abort_lets_go = 1;
    axc_work *w = new_work(&be);
    CHECK(axc_work_wait(w) == AXC_ERR_TIMEOUT);
    CHECK(waits == 1 && w->timed_out && !w->waited);
    CHECK(axc_work_free(w) == 1);
    CHECK(waits == 2 && aborts == 1);

    /* b) timed out, then ended before the free: freed without an abort */
    w = new_work(&be);
    CHECK(axc_work_wait(w) == AXC_ERR_TIMEOUT);
    axc_work_complete(w, AXC_ERR_PEER, "fake: the peer went away");
    CHECK(axc_work_free(w) == 1);
    CHECK(waits == 2 && aborts == 0);

    /* c) never waited, and stuck: the free's own wait times out, the abort does not end it,
     * and after the grace the record is leaked, not freed under the backend */
    abort_lets_go = 0;
    w = new_work(&be);
    CHECK(axc_work_free(w) == 0);
    CHECK(waits == 1 && aborts == 1 && w->timed_out);
    axc_work_complete(w, AXC_OK, NULL); /* (the backend would end it later) */
    free(w);

    /* d) a wait timed out earlier, and stuck: the free waits no more than the grace, leaks it,
     * and leaves the caller's last error as it was */
    w = new_work(&be);
    CHECK(axc_work_wait(w) == AXC_ERR_TIMEOUT);
    axc_set_last_error("the caller's error");
    CHECK(axc_work_free(w) == 0);
    CHECK(waits == 1 && aborts == 1);
    CHECK(strcmp(axc_last_error(), "the caller's error") == 0);
    axc_work_complete(w, AXC_OK, NULL);
    free(w);
    return ctest_summary("test_work");
}
