/* The stream-order checker of the mock libcudart (mock_stream_order.c) on sequences that are
 * wrong on purpose, each next to the same sequence made right: it must report exactly the
 * wrong ones (this test fails when the checker is broken, so that the other mock tests' "no
 * violation" means something). Two fake streams S1, S2. Run by run_mock_test.sh. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/cuda_rt.h"
#include "../ctest.h"
#include "mock_order_check.h"

static order_checker oc;
static const axc_cuda_api *cu;
static char s1_, s2_; /* any distinct non-NULL handles: the mock never dereferences them */
#define S1 ((void *)&s1_)
#define S2 ((void *)&s2_)

static int mark; /* violations before the step being checked */
static int reported; /* violations of the steps checked so far (each step resets the checker) */

/* The step since the last expect() made exactly `n` violations, the last of them (if any)
 * described with `needle` in it. */
static void expect(int n, const char *needle, const char *step)
{
    int got = *oc.violations - mark;
    int ok = got == n;
    if (ok && n > 0 && needle) {
        /* the description of violation number *oc.violations (one per line), if kept */
        const char *line = oc.text;
        for (int i = 1; i < *oc.violations && line; i++) {
            line = strchr(line, '\n');
            line = line ? line + 1 : NULL;
        }
        if (!line || !*line) {
            ok = 0;
            fprintf(stderr, "%s: the violation's description was not kept\n", step);
        } else {
            const char *end = strchr(line, '\n');
            size_t len = end ? (size_t)(end - line) : strlen(line);
            char buf[512];
            snprintf(buf, sizeof buf, "%.*s", (int)len, line);
            ok = strstr(buf, needle) != NULL;
            if (!ok)
                fprintf(stderr, "%s: described as \"%s\", expected it to mention \"%s\"\n", step,
                        buf, needle);
        }
    }
    if (got != n)
        fprintf(stderr, "%s: %d violation(s), expected %d\n", step, got, n);
    else
        printf("%s: %d violation(s), as expected\n", step, got);
    CHECK(ok);
    /* start over, so that every step's descriptions are among the ones kept */
    reported += *oc.violations;
    oc.reset();
    mark = 0;
}

static void *malloc_async(size_t n, void *s)
{
    void *p = NULL;
    CHECK(cu->MallocAsync(&p, n, s) == 0 && p);
    return p;
}

static void *event(void)
{
    void *e = NULL;
    CHECK(cu->EventCreateWithFlags(&e, AXC_CUDA_EVENT_DISABLE_TIMING) == 0 && e);
    return e;
}

int main(void)
{
    const char *rt = getenv("AXC_TEST_CUDART");
    CHECK(rt && dlopen(rt, RTLD_NOW | RTLD_GLOBAL));
    int found = order_checker_find(&oc);
    CHECK(found);
    CHECK_OK(axc_cuda_load(&cu));
    if (!found || !cu || !cu->MallocAsync || !cu->FreeAsync)
        return ctest_summary("test_order_mock");
    oc.name_stream(S1, "S1");
    oc.name_stream(S2, "S2");
    oc.reset();
    mark = 0;
    void *e = event(), *f = event();

    /* 1. allocated on S1, read on S2 with nothing in between */
    void *p = malloc_async(64, S1);
    oc.access(p, S2, 0);
    expect(1, "not ordered after its write by cudaMallocAsync on S1", "read on S2 of S1's new "
                                                                      "buffer, no wait");
    CHECK(cu->StreamSynchronize(S1) == 0);
    CHECK(cu->FreeAsync(p, S2) == 0); /* S2 read it; the host saw S1's allocation */
    expect(0, NULL, "freed on S2 after a host wait for S1");

    /* 2. the same, ordered by an event */
    p = malloc_async(64, S1);
    CHECK(cu->EventRecord(e, S1) == 0);
    CHECK(cu->StreamWaitEvent(S2, e, 0) == 0);
    oc.access(p, S2, 0);
    expect(0, NULL, "read on S2 after S2 waited for S1's event");
    /* ... and by a host wait */
    void *q = malloc_async(64, S1);
    CHECK(cu->StreamSynchronize(S1) == 0);
    oc.access(q, S2, 0);
    expect(0, NULL, "read on S2 after cudaStreamSynchronize(S1)");

    /* 3. a wait on an event recorded before the write does not order it */
    void *r = malloc_async(64, S2);
    CHECK(cu->EventRecord(f, S1) == 0);
    oc.access(r, S1, 1);
    CHECK(cu->StreamWaitEvent(S2, f, 0) == 0);
    oc.access(r, S2, 0);
    expect(2, "not ordered after its write by a test kernel writing on S1",
           "write on S1 of S2's buffer, then a read on S2 waiting for an older event");

    /* 4. freed on S1 while S2 may still read it */
    CHECK(cu->FreeAsync(p, S1) == 0);
    expect(1, "not ordered after its read by a test kernel reading on S2",
           "cudaFreeAsync on S1 of a buffer S2 reads, no wait");
    /* ... made right: S1 waits for S2's reads first */
    CHECK(cu->EventRecord(e, S2) == 0);
    CHECK(cu->StreamWaitEvent(S1, e, 0) == 0);
    CHECK(cu->FreeAsync(q, S1) == 0);
    expect(0, NULL, "cudaFreeAsync on S1 after S1 waited for S2's reads");

    /* 5. use after free (on the freeing stream too), and a double free */
    oc.access(p, S1, 0);
    expect(1, "use after free", "read on S1 of a buffer freed on S1");
    oc.access(q, S2, 1);
    expect(1, "use after free", "write on S2 of a buffer freed on S1");
    CHECK(cu->FreeAsync(q, S1) == 0);
    expect(1, "double free", "cudaFreeAsync twice");

    /* 6. two streams writing a cudaMalloc buffer; cudaFree waits for everything */
    void *m = NULL, *n = NULL;
    CHECK(cu->Malloc(&m, 256) == 0 && cu->Malloc(&n, 256) == 0);
    oc.access(m, S1, 1);
    expect(0, NULL, "a first write of a cudaMalloc buffer");
    oc.access(m, S2, 1);
    expect(1, "not ordered after its write by a test kernel writing on S1",
           "writes on S1 and S2, no wait");
    CHECK(cu->Free(m) == 0);
    expect(0, NULL, "cudaFree (it synchronises the device)");

    /* 7. copies: read the source, write the destination (host memory is not tracked) */
    static float host[64];
    CHECK(cu->MemcpyAsync(n, host, sizeof host, AXC_CUDA_MEMCPY_H2D, S1) == 0);
    CHECK(cu->MemcpyAsync(host, n, sizeof host, AXC_CUDA_MEMCPY_D2H, S2) == 0);
    expect(1, "cudaMemcpyAsync on S2: read", "D2H on S2 of what an H2D on S1 wrote");
    CHECK(cu->EventRecord(e, S1) == 0);
    CHECK(cu->EventSynchronize(e) == 0);
    CHECK(cu->MemcpyAsync(host, n, sizeof host, AXC_CUDA_MEMCPY_D2H, S2) == 0);
    expect(0, NULL, "the same after cudaEventSynchronize");
    CHECK(cu->MemcpyAsync(n, host, sizeof host, AXC_CUDA_MEMCPY_H2D, S1) == 0);
    expect(1, "not ordered after its read by cudaMemcpyAsync on S2",
           "H2D on S1 over what S2 still copies out");
    CHECK(cu->EventRecord(f, S1) == 0);
    CHECK(cu->EventQuery(f) == 0); /* fired: the host saw it */
    oc.access(n, S2, 0);
    expect(0, NULL, "read on S2 after a successful cudaEventQuery");
    CHECK(cu->Free(n) == 0);

    /* 8. everything left is freed in order; the counter starts over for the final check */
    CHECK(cu->StreamSynchronize(S1) == 0);
    CHECK(cu->FreeAsync(r, S2) == 0);
    expect(0, NULL, "cudaFreeAsync on S2 after a host wait for S1");
    cu->EventDestroy(e);
    cu->EventDestroy(f);
    int total = reported + *oc.violations;
    oc.reset();
    printf("%d violations reported on purpose; reset\n", total);
    CHECK(*oc.violations == 0 && oc.text[0] == '\0');
    CHECK(order_violations(&oc, "test_order_mock") == 0);
    return ctest_summary("test_order_mock");
}
