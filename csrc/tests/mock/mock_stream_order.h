/* A happens-before checker for the CPU mock of libcudart (mock_stream_order.c): the mock runs
 * every "kernel" at once on the host, so it cannot see a stream-ordering bug by its results;
 * this model of CUDA's ordering rules (vector clocks per stream, per event and for the host)
 * can. The mock's entry points report what they enqueue; accesses to device memory (cudaMalloc,
 * cudaMallocAsync) that are not ordered after the accesses they conflict with, and accesses to
 * freed device memory, are counted and described, never aborted on.
 *
 * Every function below is exported: the mock libraries built from the same sources (libcudart,
 * libnccl, libcublasLt) all bind to the first loaded copy (libcudart, loaded RTLD_GLOBAL before
 * the others), so they share one checker. Tests find the results with dlsym:
 *   int  mock_order_violations          violations since the last reset
 *   char mock_order_text[]              the first MOCK_ORDER_KEEP of them, one per line
 *   void mock_order_reset(void)         zeroes both (the model's clocks and memory stay)
 *   void mock_order_access(p, s, w)     a test's own "kernel" on stream s reads (w = 0) or
 *                                       writes (w = 1) the device memory at p
 *   void mock_order_name_stream(s, n)   a name for s in the descriptions (e.g. "S1") */
#ifndef MOCK_STREAM_ORDER_H
#define MOCK_STREAM_ORDER_H

#include <stddef.h>

#define MOCK_ORDER_KEEP 8        /* violations described in mock_order_text */
#define MOCK_ORDER_MSG 400       /* bytes per description, at most */

/* one memory access of an op: `n` bytes at `p` read (write = 0) or written (write = 1) */
typedef struct mock_span {
    const void *p;
    size_t n;
    int write;
} mock_span;

extern int mock_order_violations;
extern int mock_order_saturated; /* streams seen beyond the checker's capacity (it checks less) */
extern char mock_order_text[MOCK_ORDER_KEEP * MOCK_ORDER_MSG];

/* streams and events */
void mock_order_stream_created(void *s);
void mock_order_stream_destroyed(void *s);
unsigned long long mock_order_stream_id(const void *s); /* distinct for every stream ever seen */
void mock_order_event_record(void *e, void *s);
void mock_order_event_destroyed(void *e);
void mock_order_stream_waits(void *s, void *e);
/* the host saw work complete */
void mock_order_host_waits_stream(void *s);
void mock_order_host_waits_event(void *e);
void mock_order_host_waits_all(void);

/* device memory: the checker owns it (a freed block is kept a while, so that its range is not
 * handed out again as untracked host memory while later accesses to it are still reported) */
void *mock_order_malloc(size_t n);                  /* cudaMalloc */
void *mock_order_malloc_async(size_t n, void *s);   /* cudaMallocAsync: a write on s */
void mock_order_free(void *p);                      /* cudaFree: the host waits for everything */
void mock_order_free_async(void *p, void *s);       /* cudaFreeAsync: a write on s, then dead */

/* one op enqueued on stream s with these accesses (untracked pointers are ignored) */
void mock_order_op(const char *op, void *s, const mock_span *spans, int nspans);
/* the common case: reads r[0, rn) and writes w[0, wn) (NULL or 0: none) */
void mock_order_rw(const char *op, void *s, const void *r, size_t rn, const void *w, size_t wn);

/* for tests */
void mock_order_access(const void *p, void *s, int is_write);
void mock_order_name_stream(const void *s, const char *name);
void mock_order_reset(void);

#endif
