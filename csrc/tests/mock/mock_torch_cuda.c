/* A CPU mock of the CUDA part of torch's C shim (libtorch_cuda.so) for the mock tests: the
 * stream guard and the caching allocator's raw_alloc/raw_delete. It behaves as torch's allocator
 * does where ordering matters: a block belongs to the stream current at its allocation, a freed
 * block goes straight back to that stream's free list and the next allocation on that stream
 * that fits gets it (the most recently freed first), with nothing waited for. Its memory comes
 * from the mock libcudart's stream-order checker (loaded first, found by symbol), and handing
 * a block out counts as a write on its stream: a block freed while a reader on another stream
 * was not yet ordered before that stream is reported as a violation when it is handed out
 * again.
 * Counters (read by test_sched_mock): blocks handed out, freed, alive, reused; the stream of the
 * last one handed out; while mock_torch_alloc_err is nonzero raw_alloc fails with it. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "mock_stream_order.h"

#define MOCK_TORCH_BLOCKS 256

typedef struct block {
    void *p;
    size_t bytes;
    void *stream;
    int in_use;
    unsigned long long freed_at; /* when it was last freed (the newest is reused first) */
} block;

static block blocks_[MOCK_TORCH_BLOCKS];
static int nblocks_;
static unsigned long long frees_;
static pthread_mutex_t mu_ = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local void *current_stream_; /* NULL: the default stream */

int mock_torch_allocs, mock_torch_deletes, mock_torch_live, mock_torch_reuses;
int mock_torch_alloc_err, mock_torch_guards_live;
void *mock_torch_last_alloc_stream;

typedef struct guard {
    void *prev;
} guard;

int32_t aoti_torch_create_cuda_stream_guard(void *stream, int32_t device, void **ret)
{
    (void)device;
    guard *g = malloc(sizeof *g);
    if (!g)
        return 1;
    g->prev = current_stream_;
    current_stream_ = stream;
    __atomic_add_fetch(&mock_torch_guards_live, 1, __ATOMIC_SEQ_CST);
    *ret = g;
    return 0;
}

/* the stream the innermost guard made current (what torch.cuda.current_stream() would say) */
int32_t aoti_torch_get_current_cuda_stream(int32_t device, void **ret)
{
    (void)device;
    *ret = current_stream_;
    return 0;
}

int32_t aoti_torch_delete_cuda_stream_guard(void *g)
{
    if (!g)
        return 1;
    current_stream_ = ((guard *)g)->prev;
    free(g);
    __atomic_sub_fetch(&mock_torch_guards_live, 1, __ATOMIC_SEQ_CST);
    return 0;
}

int32_t aoti_torch_cuda_caching_allocator_raw_alloc(uint64_t nbytes, void **ret)
{
    *ret = NULL;
    if (mock_torch_alloc_err)
        return mock_torch_alloc_err;
    void *s = current_stream_;
    pthread_mutex_lock(&mu_);
    block *b = NULL;
    for (int i = 0; i < nblocks_; i++)
        if (!blocks_[i].in_use && blocks_[i].stream == s && blocks_[i].bytes >= nbytes &&
            (!b || blocks_[i].freed_at > b->freed_at))
            b = &blocks_[i];
    if (b) {
        __atomic_add_fetch(&mock_torch_reuses, 1, __ATOMIC_SEQ_CST);
        mock_order_access(b->p, s, 1); /* the new owner's work on s may write it at once */
    } else if (nblocks_ < MOCK_TORCH_BLOCKS) {
        void *p = mock_order_malloc_async(nbytes ? nbytes : 1, s);
        if (p) {
            b = &blocks_[nblocks_++];
            *b = (block){p, nbytes ? nbytes : 1, s, 0, 0};
        }
    }
    if (!b) {
        pthread_mutex_unlock(&mu_);
        return 2;
    }
    b->in_use = 1;
    *ret = b->p;
    mock_torch_last_alloc_stream = s;
    __atomic_add_fetch(&mock_torch_allocs, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&mock_torch_live, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&mu_);
    return 0;
}

int32_t aoti_torch_cuda_caching_allocator_raw_delete(void *p)
{
    pthread_mutex_lock(&mu_);
    int found = 0;
    for (int i = 0; i < nblocks_ && !found; i++)
        if (blocks_[i].p == p && blocks_[i].in_use) {
            blocks_[i].in_use = 0; /* its stream's next allocation may take it */
            blocks_[i].freed_at = ++frees_;
            found = 1;
        }
    pthread_mutex_unlock(&mu_);
    if (!found)
        return 1; /* not ours, or freed twice */
    __atomic_add_fetch(&mock_torch_deletes, 1, __ATOMIC_SEQ_CST);
    __atomic_sub_fetch(&mock_torch_live, 1, __ATOMIC_SEQ_CST);
    return 0;
}
