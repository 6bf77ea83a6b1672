/* The CUDA GEMMs: cuBLASLt bound at run time (the libcublasLt that torch already loaded).
 *
 * Row-major to column-major: a row-major M x N matrix with row stride ld is the column-major
 * N x M matrix with leading dimension ld, i.e. its transpose. So C = op(A) op(B) (row-major) is
 * C^T = op(B)^T op(A)^T (column-major): cuBLASLt gets B first and A second, each with the user's
 * transpose flag unchanged, and D = C^T is N x M. The bias vector [N] then runs along D's rows,
 * which is what CUBLASLT_EPILOGUE_BIAS adds (D = alpha*AB + beta*C + bias, one rounding).
 *
 * Per device: one cuBLASLt handle; one 32 MiB workspace per stream (so GEMMs on two streams never
 * share scratch memory; a stream is told apart from a destroyed one at the same address by
 * cudaStreamGetId; after AXC_LT_MAX_STREAMS streams, further ones run without workspace);
 * device-resident ones/zeros vectors for the bias gradient (a GEMV against ones) and for K == 0.
 * Plans are cached: per key (device, types, transposes, m/n/k, leading dimensions, epilogue,
 * pointer alignments, workspace size) the matmul descriptor, the three layouts and the
 * heuristic's algorithm, built once, so that a warmed-up GEMM costs a bias-pointer attribute
 * (with a bias) and the launch. The cache is bounded (64 sets x 8 ways, 512 plans; the least
 * recently used plan of a full set is evicted and destroyed), thread-safe (a plan serves one
 * GEMM at a time, see lt_entry), and emptied by axc_cublaslt_release.
 *
 * Everything else about CUDA (the runtime, device switching) comes from cuda_rt.c. Compiled only
 * against real cublasLt.h + CUDA runtime headers; otherwise every entry reports
 * AXC_ERR_UNAVAILABLE. */
#include "axc/gemm.h"

#if defined(AXC_HAVE_CUBLASLT_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <cublasLt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/cuda_rt.h"
#include "axc/dynlib.h"

int axc_gemm_cuda_compiled(void) { return 1; }

/* ------------------------------------------------------------------ the library */

#define AXC_LT_SYMBOLS(X)                                                                        \
    X(Create, cublasLtCreate)                                                                    \
    X(GetStatusString, cublasLtGetStatusString)                                                  \
    X(GetVersion, cublasLtGetVersion)                                                            \
    X(Matmul, cublasLtMatmul)                                                                    \
    X(MatmulDescCreate, cublasLtMatmulDescCreate)                                                \
    X(MatmulDescDestroy, cublasLtMatmulDescDestroy)                                              \
    X(MatmulDescSetAttribute, cublasLtMatmulDescSetAttribute)                                    \
    X(MatrixLayoutCreate, cublasLtMatrixLayoutCreate)                                            \
    X(MatrixLayoutDestroy, cublasLtMatrixLayoutDestroy)                                          \
    X(MatmulPreferenceCreate, cublasLtMatmulPreferenceCreate)                                    \
    X(MatmulPreferenceDestroy, cublasLtMatmulPreferenceDestroy)                                  \
    X(MatmulPreferenceSetAttribute, cublasLtMatmulPreferenceSetAttribute)                        \
    X(MatmulAlgoGetHeuristic, cublasLtMatmulAlgoGetHeuristic)

/* Each pointer has exactly the type of the header's function (GNU __typeof__, also in -std=c11). */
typedef struct lt_api {
#define AXC_LT_FIELD(field, fn) __typeof__(fn) *field;
    AXC_LT_SYMBOLS(AXC_LT_FIELD)
#undef AXC_LT_FIELD
} lt_api;

static pthread_once_t lt_once_ = PTHREAD_ONCE_INIT;
static lt_api lt_;
static axc_status lt_status_ = AXC_ERR_UNAVAILABLE;
static char lt_msg_[768];
static char lt_name_[64];

static void lt_load(void)
{
    static const char *const names[] = {"libcublasLt.so.13", "libcublasLt.so.12"};
    static const axc_dynlib_spec spec = {"cuBLASLt", names, 2, NULL, 1,
                                         "a CUDA build of torch loads it"};
    void *h = axc_dynlib_open(&spec, lt_name_, sizeof lt_name_, lt_msg_, sizeof lt_msg_);
    if (!h)
        return;
    lt_api api;
    memset(&api, 0, sizeof api);
    const axc_dynlib_sym syms[] = {
#define AXC_LT_SYM(field, fn) {#fn, &api.field, 1},
        AXC_LT_SYMBOLS(AXC_LT_SYM)
#undef AXC_LT_SYM
    };
    if (!axc_dynlib_resolve(h, "cuBLASLt", lt_name_, syms, sizeof syms / sizeof syms[0], NULL,
                            lt_msg_, sizeof lt_msg_))
        return;
    lt_ = api;
    lt_status_ = AXC_OK;
    lt_msg_[0] = '\0';
}

static axc_status lt_get(void)
{
    if (pthread_once(&lt_once_, lt_load) != 0)
        return axc_fail(AXC_ERR_SYSTEM, "pthread_once failed while loading cuBLASLt");
    if (lt_status_ != AXC_OK)
        return axc_fail(lt_status_, "%s", lt_msg_);
    return AXC_OK;
}

static axc_status lt_check(cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return AXC_OK;
    const char *desc = lt_.GetStatusString ? lt_.GetStatusString(s) : NULL;
    return axc_fail(AXC_ERR_BACKEND, "%s failed: %s (cublasStatus %d)", what,
                    desc ? desc : "unknown status", (int)s);
}

/* ------------------------------------------------------------------ per-device state */

enum {
    AXC_LT_MAX_DEVICES = 64,
    AXC_LT_MAX_STREAMS = 16,
    AXC_LT_CACHE_SETS = 64, /* the plan cache: 64 sets of 8 ways, at most 512 plans */
    AXC_LT_CACHE_WAYS = 8,
    AXC_LT_MIN_CONST = 65536 /* elements of the first ones/zeros vector */
};
#define AXC_LT_WORKSPACE_BYTES ((size_t)32 << 20)

typedef struct lt_stream_ws {
    void *stream;
    unsigned long long id; /* cudaStreamGetId: a handle can be reused after cudaStreamDestroy */
    int has_id;
    int captured;    /* handed to a GEMM under CUDA-graph capture: never freed (replays use it) */
    void *ws;        /* NULL when the allocation failed: that stream runs without workspace */
    size_t ws_bytes;
} lt_stream_ws;

typedef struct lt_device {
    int has_handle;
    cublasLtHandle_t handle;
    lt_stream_ws ws[AXC_LT_MAX_STREAMS];
    int n_ws;
    /* constant vectors (under lt_const_mu_); older (smaller) ones are kept alive, never
     * freed, because work queued on other streams may still read them */
    void *ones[3];
    int64_t ones_len[3];
    void *zeros;
    size_t zeros_bytes;
} lt_device;

static pthread_mutex_t lt_mu_ = PTHREAD_MUTEX_INITIALIZER;
/* the constant vectors only: growing one synchronises a stream, which must not stall every
 * other thread's GEMMs (they take lt_mu_) */
static pthread_mutex_t lt_const_mu_ = PTHREAD_MUTEX_INITIALIZER;
static lt_device devs_[AXC_LT_MAX_DEVICES];

static int dt_index(axc_dtype dt) { return dt == AXC_DT_F32 ? 0 : dt == AXC_DT_BF16 ? 1 : 2; }

static cudaDataType_t dt_cuda(axc_dtype dt)
{
    return dt == AXC_DT_F32 ? CUDA_R_32F : dt == AXC_DT_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

/* The handle of `device` (the caller made it current). */
static axc_status lt_handle(int device, cublasLtHandle_t *out)
{
    if (device >= AXC_LT_MAX_DEVICES)
        return axc_fail(AXC_ERR_INVALID, "axc_gemm: CUDA device %d is beyond the %d supported",
                        device, AXC_LT_MAX_DEVICES);
    axc_status st = AXC_OK;
    pthread_mutex_lock(&lt_mu_);
    lt_device *d = &devs_[device];
    if (!d->has_handle) {
        st = lt_check(lt_.Create(&d->handle), "cublasLtCreate");
        d->has_handle = st == AXC_OK;
    }
    *out = d->handle;
    pthread_mutex_unlock(&lt_mu_);
    return st;
}

/* Whether `stream` is being captured into a CUDA graph (0 when the runtime cannot tell). */
static int lt_capturing(const axc_cuda_api *api, void *stream)
{
    int status = AXC_CUDA_CAPTURE_NONE;
    return api->StreamIsCapturing && api->StreamIsCapturing(stream, &status) == AXC_CUDA_SUCCESS &&
           status != AXC_CUDA_CAPTURE_NONE;
}

/* The workspace of (device, stream): allocated on first use (the caller made `device` current).
 * A stream being captured into a CUDA graph (torch.cuda.graph captures on a stream of its own)
 * gets one too, allocated with this thread in the relaxed capture mode (cudaMalloc in the
 * global mode would invalidate the capture; torch's allocator does the same), so the GEMM takes
 * the algorithm its warm-up took. Such a workspace is never freed (replays use it). Where the
 * mode cannot be switched, the GEMM runs without workspace. */
static int lt_malloc_capturing(const axc_cuda_api *api, void **p, size_t bytes)
{
    int mode = AXC_CUDA_CAPTURE_MODE_RELAXED;
    if (!api->ThreadExchangeStreamCaptureMode ||
        api->ThreadExchangeStreamCaptureMode(&mode) != AXC_CUDA_SUCCESS)
        return -1;
    int err = api->Malloc(p, bytes);
    if (api->ThreadExchangeStreamCaptureMode(&mode) != AXC_CUDA_SUCCESS) /* back to the caller's */
        axc_log(2, "axonn_c: restoring the CUDA stream-capture mode failed");
    return err;
}

static void lt_workspace(const axc_cuda_api *api, int device, void *stream, void **ws,
                         size_t *bytes)
{
    pthread_mutex_lock(&lt_mu_);
    lt_device *d = &devs_[device];
    *ws = NULL;
    *bytes = 0;
    /* cudaStreamGetId is not permitted on a stream being captured: it returns
     * cudaErrorStreamCaptureUnsupported and invalidates the capture (the cause of the failed
     * GEMM launches seen on the H100 and H200, found with CUDA_LOG_FILE). Under capture the
     * stream is matched by its handle alone (a capture stream is alive by definition). */
    int capturing = lt_capturing(api, stream);
    unsigned long long id = 0;
    int has_id = !capturing && api->StreamGetId && api->StreamGetId(stream, &id) == AXC_CUDA_SUCCESS;
    /* cudaStreamPerThread is one handle for a different stream on each thread: an entry each */
    int per_thread = stream == (void *)cudaStreamPerThread;
    int i;
    for (i = 0; i < d->n_ws; i++)
        if (d->ws[i].stream == stream &&
            (!per_thread || !has_id || !d->ws[i].has_id || d->ws[i].id == id))
            break;
    int fresh = i == d->n_ws && d->n_ws < AXC_LT_MAX_STREAMS;
    if (i < d->n_ws && has_id && !d->ws[i].has_id) {
        d->ws[i].id = id; /* (made when the id could not be read) */
        d->ws[i].has_id = 1;
    } else if (i < d->n_ws && has_id && d->ws[i].id != id) {
        /* a new stream at a destroyed one's address: that one's GEMMs may still use the
         * workspace. cudaFree waits for them; one a CUDA graph captured is kept (its replays
         * use it); under capture (no cudaFree) the GEMM runs without. */
        if (capturing) {
            pthread_mutex_unlock(&lt_mu_);
            return;
        }
        if (d->ws[i].ws && !d->ws[i].captured) {
            int err = api->Free(d->ws[i].ws);
            if (err != AXC_CUDA_SUCCESS)
                axc_log(2, "axonn_c: cudaFree of a cuBLASLt workspace on device %d failed "
                           "(cudaError %d)", device, err);
        }
        d->ws[i].ws = NULL;
        d->ws[i].ws_bytes = 0;
        d->ws[i].captured = 0;
        fresh = 1;
    }
    if (fresh) {
        void *p = NULL;
        int err = capturing ? lt_malloc_capturing(api, &p, AXC_LT_WORKSPACE_BYTES)
                            : api->Malloc(&p, AXC_LT_WORKSPACE_BYTES);
        if (err != AXC_CUDA_SUCCESS && capturing) { /* without one; an entry comes later */
            pthread_mutex_unlock(&lt_mu_);
            return;
        }
        if (err != AXC_CUDA_SUCCESS) {
            axc_log(2, "axonn_c: cudaMalloc of a %zu-byte cuBLASLt workspace on device %d failed "
                       "(cudaError %d); GEMMs on this stream run without workspace",
                    AXC_LT_WORKSPACE_BYTES, device, err);
            p = NULL;
        }
        d->ws[i].stream = stream;
        d->ws[i].id = id;
        d->ws[i].has_id = has_id;
        d->ws[i].captured = 0;
        d->ws[i].ws = p;
        d->ws[i].ws_bytes = p ? AXC_LT_WORKSPACE_BYTES : 0;
        if (i == d->n_ws)
            d->n_ws++;
    }
    if (i < d->n_ws) {
        *ws = d->ws[i].ws;
        *bytes = d->ws[i].ws_bytes;
        if (capturing && *ws)
            d->ws[i].captured = 1;
    }
    pthread_mutex_unlock(&lt_mu_);
}

/* A device vector of at least `n` elements of `dt` equal to 1 (ones = 1) or 0 (ones = 0), ready
 * for use on any stream. Growing it synchronises `stream` once (rare: sizes double). */
static axc_status lt_const_vector(const axc_cuda_api *api, int device, void *stream, axc_dtype dt,
                                  int ones, int64_t n, const void **out)
{
    size_t esz = axc_dtype_size(dt);
    axc_status st = AXC_OK;
    pthread_mutex_lock(&lt_const_mu_);
    lt_device *d = &devs_[device];
    int di = dt_index(dt);
    void **slot = ones ? &d->ones[di] : &d->zeros;
    size_t have = ones ? (size_t)d->ones_len[di] * esz : d->zeros_bytes;
    size_t need = (size_t)n * esz;
    if (*slot && have >= need) {
        *out = *slot;
        pthread_mutex_unlock(&lt_const_mu_);
        return AXC_OK;
    }
    if (lt_capturing(api, stream)) { /* growing it allocates and synchronises */
        pthread_mutex_unlock(&lt_const_mu_);
        return axc_fail(AXC_ERR_STATE,
                        "axc_gemm: a bias gradient over %lld rows needs a larger constant vector, "
                        "which cannot be allocated while the stream is captured into a CUDA "
                        "graph; run the same step once before capturing (warm-up)",
                        (long long)n);
    }
    size_t len = (size_t)AXC_LT_MIN_CONST;
    while (len < (size_t)n)
        len *= 2;
    if (have / esz * 2 > len)
        len = have / esz * 2;
    size_t bytes = len * esz;
    void *p = NULL, *host = NULL;
    st = axc_cuda_check(api->Malloc(&p, bytes), "cudaMalloc (constant vector for axc_gemm)");
    if (st == AXC_OK && ones) {
        host = malloc(bytes);
        if (!host) {
            st = axc_fail(AXC_ERR_NOMEM, "axc_gemm: out of host memory (%zu bytes)", bytes);
        } else {
            uint32_t one32 = 0x3f800000u;
            uint16_t one16 = dt == AXC_DT_BF16 ? 0x3f80u : 0x3c00u;
            for (size_t i = 0; i < len; i++) {
                if (esz == 4)
                    memcpy((char *)host + i * 4, &one32, 4);
                else
                    memcpy((char *)host + i * 2, &one16, 2);
            }
            st = axc_cuda_check(api->MemcpyAsync(p, host, bytes, AXC_CUDA_MEMCPY_H2D, stream),
                                "cudaMemcpyAsync (ones vector)");
        }
    } else if (st == AXC_OK) {
        if (!api->MemsetAsync)
            st = axc_fail(AXC_ERR_UNAVAILABLE, "the CUDA runtime has no cudaMemsetAsync");
        else
            st = axc_cuda_check(api->MemsetAsync(p, 0, bytes, stream),
                                "cudaMemsetAsync (zeros vector)");
    }
    if (st == AXC_OK) /* the vector is complete before any stream can see it */
        st = axc_cuda_check(api->StreamSynchronize(stream), "cudaStreamSynchronize");
    free(host);
    if (st != AXC_OK) {
        if (p)
            (void)api->Free(p); /* best effort: the first error is the one reported */
        pthread_mutex_unlock(&lt_const_mu_);
        return st;
    }
    /* the old vector stays allocated (work queued on other streams may still read it) */
    *slot = p;
    if (ones)
        d->ones_len[di] = (int64_t)len;
    else
        d->zeros_bytes = bytes;
    *out = p;
    pthread_mutex_unlock(&lt_const_mu_);
    return AXC_OK;
}

/* ------------------------------------------------------------------ one column-major matmul */

/* D[m x n] = alpha * op_a(A) op_b(B) + beta * D (+ bias[m]), column-major, D also serving as C. */
typedef struct lt_call {
    int device;
    void *stream;
    cudaDataType_t ab_type, cd_type;
    int op_a, op_b;             /* 0: N, 1: T */
    uint64_t m, n, k;
    const void *A; int64_t lda; /* stored (op_a ? k x m : m x k) */
    const void *B; int64_t ldb; /* stored (op_b ? n x k : k x n) */
    void *D; int64_t ldd;
    float alpha, beta;
    const void *bias;           /* [m] of cd_type, or NULL */
    const char *what;           /* names the caller in messages */
} lt_call;

/* ------------------------------------------------------------------ the plan cache */

/* Everything that decides a GEMM's descriptors and the heuristic's choice. The device stands for
 * the handle (one per device, never destroyed). No pointer is part of it: A, B, C/D and the
 * workspace go to cublasLtMatmul per call and the bias pointer is set on the descriptor per call
 * (a plan serves one GEMM at a time); their alignments, which the heuristic is told, are, and
 * so is the workspace size it may use (ws_bytes: 0 for a stream without one). alpha and beta
 * are host scalars passed per call (the default host pointer mode, never changed; the
 * heuristic does not see them); the compute and scale types are fp32 for every GEMM. */
typedef struct lt_key {
    int32_t device, ab_type, cd_type, op_a, op_b, epilogue;
    uint32_t align_a, align_b, align_c, align_bias;
    uint64_t m, n, k, ws_bytes;
    int64_t lda, ldb, ldd;
} lt_key;

/* A key's descriptors and the algorithm the heuristic chose for them. */
typedef struct lt_plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    size_t algo_ws;
} lt_plan;

/* A slot of the cache. Checked out (busy) by one GEMM at a time, because the GEMM sets the bias
 * pointer on the descriptor; a second thread running the same key meanwhile builds a plan of
 * its own (with the first one's algorithm, no heuristic) in another way of the set. */
typedef struct lt_entry {
    int used;
    int busy;
    int dropped; /* released while busy: destroyed when its GEMM checks it in */
    uint64_t last_use;
    lt_key key;
    lt_plan plan;
} lt_entry;

/* set-associative: a key's set by its hash, the least recently used plan not in use is evicted
 * (and destroyed) when all of the set's ways are taken */
static lt_entry cache_[AXC_LT_CACHE_SETS][AXC_LT_CACHE_WAYS];
static uint64_t cache_clock_;
static pthread_mutex_t lt_cache_mu_ = PTHREAD_MUTEX_INITIALIZER;

static uint64_t key_hash(const lt_key *k)
{
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

static uint32_t ptr_align(const void *p)
{
    uintptr_t v = (uintptr_t)p;
    uint32_t a = 256;
    while (a > 1 && (v & (a - 1)) != 0)
        a >>= 1;
    return a;
}

static void key_of(const lt_call *c, size_t ws_bytes, lt_key *key)
{
    memset(key, 0, sizeof *key); /* padding bytes take part in the hash and the compare */
    key->device = c->device;
    key->ab_type = (int32_t)c->ab_type;
    key->cd_type = (int32_t)c->cd_type;
    key->op_a = c->op_a;
    key->op_b = c->op_b;
    key->epilogue = (int32_t)(c->bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
    key->align_a = ptr_align(c->A);
    key->align_b = ptr_align(c->B);
    key->align_c = ptr_align(c->D);
    key->align_bias = c->bias ? ptr_align(c->bias) : 0;
    key->m = c->m;
    key->n = c->n;
    key->k = c->k;
    key->ws_bytes = ws_bytes;
    key->lda = c->lda;
    key->ldb = c->ldb;
    key->ldd = c->ldd;
}

/* *st = the first failure: a cuBLASLt call's status counts only while none came before (so the
 * last error's message stays the first failure's). The call itself is made either way: for
 * teardown, where everything is destroyed whatever failed. */
static void keep_first(axc_status *st, cublasStatus_t r, const char *what)
{
    if (*st == AXC_OK)
        *st = lt_check(r, what);
}

/* Destroys what `p` holds; returns `prior` when it is a failure, else the first failure here. */
static axc_status plan_destroy(const lt_plan *p, axc_status prior)
{
    axc_status st = prior;
    if (p->ld)
        keep_first(&st, lt_.MatrixLayoutDestroy(p->ld), "cublasLtMatrixLayoutDestroy");
    if (p->lb)
        keep_first(&st, lt_.MatrixLayoutDestroy(p->lb), "cublasLtMatrixLayoutDestroy");
    if (p->la)
        keep_first(&st, lt_.MatrixLayoutDestroy(p->la), "cublasLtMatrixLayoutDestroy");
    if (p->desc)
        keep_first(&st, lt_.MatmulDescDestroy(p->desc), "cublasLtMatmulDescDestroy");
    return st;
}

/* The heuristic's algorithm for the plan's descriptors, within the key's workspace size and
 * pointer alignments. */
static axc_status plan_algo(cublasLtHandle_t handle, const lt_call *c, const lt_key *key,
                            lt_plan *p)
{
    cublasLtMatmulPreference_t pref = NULL;
    axc_status st = lt_check(lt_.MatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    if (st != AXC_OK)
        return st;
    uint64_t max_ws = key->ws_bytes;
    st = lt_check(lt_.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &max_ws, sizeof max_ws),
                  "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
    const struct {
        cublasLtMatmulPreferenceAttributes_t attr;
        uint32_t value;
    } aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key->align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key->align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key->align_c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key->align_c},
    };
    for (size_t i = 0; st == AXC_OK && i < sizeof aligns / sizeof aligns[0]; i++)
        st = lt_check(lt_.MatmulPreferenceSetAttribute(pref, aligns[i].attr, &aligns[i].value,
                                                       sizeof aligns[i].value),
                      "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)");
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int found = 0;
    if (st == AXC_OK)
        st = lt_check(lt_.MatmulAlgoGetHeuristic(handle, p->desc, p->la, p->lb, p->ld, p->ld,
                                                 pref, 1, &res, &found),
                      "cublasLtMatmulAlgoGetHeuristic");
    if (st == AXC_OK && (found < 1 || res.state != CUBLAS_STATUS_SUCCESS))
        st = axc_fail(AXC_ERR_BACKEND,
                      "%s: cuBLASLt has no algorithm for m=%llu n=%llu k=%llu (column-major), "
                      "types %d/%d, op %d/%d, ld %lld/%lld/%lld, alignments %u/%u/%u, %s bias",
                      c->what, (unsigned long long)c->m, (unsigned long long)c->n,
                      (unsigned long long)c->k, (int)c->ab_type, (int)c->cd_type, c->op_a,
                      c->op_b, (long long)c->lda, (long long)c->ldb, (long long)c->ldd,
                      key->align_a, key->align_b, key->align_c, c->bias ? "with" : "no");
    if (st == AXC_OK) {
        p->algo = res.algo;
        p->algo_ws = res.workspaceSize;
    }
    keep_first(&st, lt_.MatmulPreferenceDestroy(pref), "cublasLtMatmulPreferenceDestroy");
    return st;
}

/* Builds the plan of `key` (c's descriptors; the algorithm from `twin`, a plan of the same key,
 * or from the heuristic). On failure everything made is destroyed and *p is empty. */
static axc_status plan_create(cublasLtHandle_t handle, const lt_call *c, const lt_key *key,
                              const lt_plan *twin, lt_plan *p)
{
    memset(p, 0, sizeof *p);
    cublasLtMatmulDesc_t desc = NULL;
    axc_status st = lt_check(lt_.MatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                             "cublasLtMatmulDescCreate");
    if (st != AXC_OK)
        return st;
    p->desc = desc;
    int32_t op_a = c->op_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = c->op_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    uint32_t epi = (uint32_t)key->epilogue;
    int32_t bias_type = (int32_t)c->cd_type;
    st = lt_check(lt_.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a),
                  "cublasLtMatmulDescSetAttribute(TRANSA)");
    if (st == AXC_OK)
        st = lt_check(lt_.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                                 sizeof op_b),
                      "cublasLtMatmulDescSetAttribute(TRANSB)");
    if (st == AXC_OK && c->bias) {
        st = lt_check(lt_.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                 sizeof epi),
                      "cublasLtMatmulDescSetAttribute(EPILOGUE)");
        if (st == AXC_OK)
            st = lt_check(lt_.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                     &bias_type, sizeof bias_type),
                          "cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE)");
        /* this call's pointer, for the heuristic (each GEMM sets its own before its launch) */
        if (st == AXC_OK)
            st = lt_check(lt_.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &c->bias, sizeof c->bias),
                          "cublasLtMatmulDescSetAttribute(BIAS_POINTER)");
    }
    const struct {
        cudaDataType_t type;
        uint64_t rows, cols;
        int64_t ld;
        cublasLtMatrixLayout_t *out;
        const char *what;
    } layouts[] = {
        {c->ab_type, c->op_a ? c->k : c->m, c->op_a ? c->m : c->k, c->lda, &p->la,
         "cublasLtMatrixLayoutCreate(A)"},
        {c->ab_type, c->op_b ? c->n : c->k, c->op_b ? c->k : c->n, c->ldb, &p->lb,
         "cublasLtMatrixLayoutCreate(B)"},
        {c->cd_type, c->m, c->n, c->ldd, &p->ld, "cublasLtMatrixLayoutCreate(C/D)"},
    };
    for (size_t i = 0; st == AXC_OK && i < sizeof layouts / sizeof layouts[0]; i++) {
        cublasLtMatrixLayout_t l = NULL;
        st = lt_check(lt_.MatrixLayoutCreate(&l, layouts[i].type, layouts[i].rows,
                                             layouts[i].cols, layouts[i].ld),
                      layouts[i].what);
        if (st == AXC_OK)
            *layouts[i].out = l;
    }
    if (st == AXC_OK && twin) {
        p->algo = twin->algo;
        p->algo_ws = twin->algo_ws;
    } else if (st == AXC_OK) {
        st = plan_algo(handle, c, key, p);
    }
    if (st != AXC_OK) {
        st = plan_destroy(p, st);
        memset(p, 0, sizeof *p);
    }
    return st;
}

/* Checks out a cached plan of `key` (NULL when none is free). *has_twin: whether a plan of the
 * key is in use by another GEMM; its algorithm is then in *twin. */
static lt_entry *cache_checkout(const lt_key *key, lt_plan *twin, int *has_twin)
{
    lt_entry *set = cache_[key_hash(key) % AXC_LT_CACHE_SETS], *got = NULL;
    *has_twin = 0;
    pthread_mutex_lock(&lt_cache_mu_);
    for (int w = 0; w < AXC_LT_CACHE_WAYS; w++) {
        lt_entry *e = &set[w];
        if (!e->used || e->dropped || memcmp(&e->key, key, sizeof *key) != 0)
            continue;
        if (!e->busy) {
            got = e;
            got->busy = 1;
            break;
        }
        twin->algo = e->plan.algo;
        twin->algo_ws = e->plan.algo_ws;
        *has_twin = 1;
    }
    pthread_mutex_unlock(&lt_cache_mu_);
    return got;
}

/* Caches `p` as `key`'s plan, checked out to the caller: in a free way of the key's set, or in
 * place of its least recently used plan not in use, which goes to *evicted (*has_evicted = 1)
 * for the caller to destroy. NULL when every way is in use: the caller keeps and destroys p. */
static lt_entry *cache_insert(const lt_key *key, const lt_plan *p, lt_plan *evicted,
                              int *has_evicted)
{
    lt_entry *set = cache_[key_hash(key) % AXC_LT_CACHE_SETS], *slot = NULL;
    *has_evicted = 0;
    pthread_mutex_lock(&lt_cache_mu_);
    for (int w = 0; w < AXC_LT_CACHE_WAYS; w++) {
        lt_entry *e = &set[w];
        if (!e->used) {
            slot = e;
            break;
        }
        if (!e->busy && (!slot || e->last_use < slot->last_use))
            slot = e;
    }
    if (slot) {
        if (slot->used) {
            *evicted = slot->plan;
            *has_evicted = 1;
        }
        slot->used = 1;
        slot->busy = 1;
        slot->dropped = 0;
        slot->last_use = ++cache_clock_;
        slot->key = *key;
        slot->plan = *p;
    }
    pthread_mutex_unlock(&lt_cache_mu_);
    return slot;
}

/* Returns a checked-out plan to the cache (or destroys it, when the cache was released
 * meanwhile). `prior`: the GEMM's status, kept when it is a failure. */
static axc_status cache_checkin(lt_entry *e, axc_status prior)
{
    lt_plan dead;
    int drop = 0;
    pthread_mutex_lock(&lt_cache_mu_);
    if (e->dropped) {
        dead = e->plan;
        drop = 1;
        memset(e, 0, sizeof *e);
    } else {
        e->busy = 0;
        e->last_use = ++cache_clock_;
    }
    pthread_mutex_unlock(&lt_cache_mu_);
    return drop ? plan_destroy(&dead, prior) : prior;
}

int axc_cublaslt_cached_plans(int *capacity)
{
    if (capacity)
        *capacity = AXC_LT_CACHE_SETS * AXC_LT_CACHE_WAYS;
    int n = 0;
    pthread_mutex_lock(&lt_cache_mu_);
    for (int s = 0; s < AXC_LT_CACHE_SETS; s++)
        for (int w = 0; w < AXC_LT_CACHE_WAYS; w++)
            n += cache_[s][w].used && !cache_[s][w].dropped;
    pthread_mutex_unlock(&lt_cache_mu_);
    return n;
}

axc_status axc_cublaslt_release(void)
{
    axc_status st = AXC_OK;
    pthread_mutex_lock(&lt_cache_mu_);
    for (int s = 0; s < AXC_LT_CACHE_SETS; s++)
        for (int w = 0; w < AXC_LT_CACHE_WAYS; w++) {
            lt_entry *e = &cache_[s][w];
            if (!e->used || e->dropped) {
                continue;
            } else if (e->busy) { /* its GEMM destroys it when done */
                e->dropped = 1;
            } else {
                st = plan_destroy(&e->plan, st); /* (host objects: quick under the lock) */
                memset(e, 0, sizeof *e);
            }
        }
    pthread_mutex_unlock(&lt_cache_mu_);
    return st;
}

static axc_status lt_matmul_on_device(const axc_cuda_api *api, const lt_call *c)
{
    cublasLtHandle_t handle = NULL;
    AXC_TRY(lt_handle(c->device, &handle));
    void *ws;
    size_t ws_bytes;
    lt_workspace(api, c->device, c->stream, &ws, &ws_bytes);
    lt_key key;
    key_of(c, ws_bytes, &key);

    /* the key's plan: cached, else built (and cached once complete) */
    lt_plan twin, own = {0};
    int has_twin = 0, has_evicted = 0;
    lt_entry *e = cache_checkout(&key, &twin, &has_twin);
    axc_status st = AXC_OK;
    if (!e) {
        AXC_TRY(plan_create(handle, c, &key, has_twin ? &twin : NULL, &own));
        lt_plan evicted;
        e = cache_insert(&key, &own, &evicted, &has_evicted);
        if (has_evicted)
            st = plan_destroy(&evicted, AXC_OK);
    }
    const lt_plan *p = e ? &e->plan : &own;
    if (st == AXC_OK && c->bias) /* the plan is this GEMM's alone until it is checked in */
        st = lt_check(lt_.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                 &c->bias, sizeof c->bias),
                      "cublasLtMatmulDescSetAttribute(BIAS_POINTER)");
    if (st == AXC_OK && p->algo_ws > ws_bytes) /* cannot happen: the preference capped it */
        st = axc_fail(AXC_ERR_BACKEND, "%s: cuBLASLt algorithm wants %zu workspace bytes, %zu "
                                       "available",
                      c->what, p->algo_ws, ws_bytes);
    if (st == AXC_OK) {
        cublasStatus_t r = lt_.Matmul(handle, p->desc, &c->alpha, c->A, p->la, c->B, p->lb,
                                      &c->beta, c->D, p->ld, c->D, p->ld, &p->algo, ws, ws_bytes,
                                      (cudaStream_t)c->stream);
        /* a launch that fails inside a capture invalidated it: say so plainly */
        if (r != CUBLAS_STATUS_SUCCESS && lt_capturing(api, c->stream))
            st = axc_fail(AXC_ERR_STATE,
                          "%s: cuBLASLt could not launch its GEMM inside a CUDA-graph capture "
                          "(cublasStatus %d; the capture is invalid now: an earlier call on the "
                          "capturing stream that CUDA does not permit during capture, see "
                          "CUDA_LOG_FILE=stderr)",
                          c->what, (int)r);
        else
            st = lt_check(r, "cublasLtMatmul");
    }
    /* a plan whose launch failed stays cached: it was built and chosen without error */
    return e ? cache_checkin(e, st) : plan_destroy(&own, st);
}

/* ------------------------------------------------------------------ entry points */

axc_status axc_cublaslt_gemm(const axc_gemm_args *g)
{
    AXC_TRY(lt_get());
    const axc_cuda_api *api;
    int prev;
    AXC_TRY(axc_cuda_device_enter(g->device, &api, &prev, "axc_gemm"));
    lt_call c;
    memset(&c, 0, sizeof c);
    c.device = g->device;
    c.stream = g->stream;
    c.ab_type = c.cd_type = dt_cuda(g->dtype);
    c.m = (uint64_t)g->N;
    c.n = (uint64_t)g->M;
    c.D = g->C;
    c.ldd = g->ldc;
    c.alpha = g->alpha;
    c.beta = g->beta;
    c.bias = g->bias;
    c.what = "axc_gemm";
    axc_status st = AXC_OK;
    if (g->K > 0) {
        /* C^T (N x M) = op(B)^T op(A)^T: B first, A second, flags unchanged */
        c.k = (uint64_t)g->K;
        c.op_a = g->trans_b != 0;
        c.A = g->B;
        c.lda = g->ldb;
        c.op_b = g->trans_a != 0;
        c.B = g->A;
        c.ldb = g->lda;
    } else {
        /* K == 0: C = beta*C (+ bias) as a rank-1 product of zeros, exact and on the stream */
        const void *z = NULL;
        int64_t len = g->M > g->N ? g->M : g->N;
        st = lt_const_vector(api, g->device, g->stream, g->dtype, 0, len, &z);
        c.k = 1;
        c.A = z; /* N x 1, ld N */
        c.lda = g->N;
        c.B = z; /* 1 x M, ld 1 */
        c.ldb = 1;
    }
    if (st == AXC_OK)
        st = lt_matmul_on_device(api, &c);
    return axc_cuda_device_leave(api, g->device, prev, st);
}

axc_status axc_cublaslt_bias_grad(int device, void *stream, axc_dtype dt, const void *dY,
                                  int64_t M, int64_t N, int64_t ld, void *db, int accumulate)
{
    AXC_TRY(lt_get());
    const axc_cuda_api *api;
    int prev;
    AXC_TRY(axc_cuda_device_enter(device, &api, &prev, "axc_bias_grad"));
    axc_status st = AXC_OK;
    if (M == 0) {
        if (!accumulate) {
            if (!api->MemsetAsync)
                st = axc_fail(AXC_ERR_UNAVAILABLE, "the CUDA runtime has no cudaMemsetAsync");
            else
                st = axc_cuda_check(api->MemsetAsync(db, 0, (size_t)N * axc_dtype_size(dt), stream),
                                    "cudaMemsetAsync");
        }
        return axc_cuda_device_leave(api, device, prev, st);
    }
    /* a few rows: one kernel launch costs the host less than the GEMV below */
    int kernel = M <= AXC_BIAS_GRAD_KERNEL_MAX_ROWS ? axc_bias_grad_kernel_ready(0) : 0;
    if (kernel < 0) /* (first use: loaded on a stream that is not capturing) */
        kernel = lt_capturing(api, stream) ? 0 : axc_bias_grad_kernel_ready(1);
    if (kernel == 1) {
        st = axc_bias_grad_kernel(stream, dt, dY, M, N, ld, db, accumulate);
        return axc_cuda_device_leave(api, device, prev, st);
    }
    /* db (N x 1) = dY^T (the column-major view of dY: N x M, ld) @ ones (M x 1) [+ db] */
    const void *ones = NULL;
    st = lt_const_vector(api, device, stream, dt, 1, M, &ones);
    if (st == AXC_OK) {
        lt_call c;
        memset(&c, 0, sizeof c);
        c.device = device;
        c.stream = stream;
        c.ab_type = c.cd_type = dt_cuda(dt);
        c.m = (uint64_t)N;
        c.n = 1;
        c.k = (uint64_t)M;
        c.A = dY;
        c.lda = ld;
        c.B = ones;
        c.ldb = M;
        c.D = db;
        c.ldd = N;
        c.alpha = 1.0f;
        c.beta = accumulate ? 1.0f : 0.0f;
        c.what = "axc_bias_grad";
        st = lt_matmul_on_device(api, &c);
    }
    return axc_cuda_device_leave(api, device, prev, st);
}

#else /* no cuBLASLt headers at build time */

int axc_gemm_cuda_compiled(void) { return 0; }

static axc_status lt_missing(const char *fn)
{
    return axc_fail(AXC_ERR_UNAVAILABLE,
                    "%s on CUDA: this build of axonn_c has no cuBLASLt support (cublasLt.h and the "
                    "CUDA runtime headers were not found at build time; install nvidia-cublas and "
                    "nvidia-cuda-runtime, or the CUDA toolkit, and rebuild)",
                    fn);
}

axc_status axc_cublaslt_gemm(const axc_gemm_args *g)
{
    (void)g;
    return lt_missing("axc_gemm");
}

axc_status axc_cublaslt_bias_grad(int device, void *stream, axc_dtype dt, const void *dY,
                                  int64_t M, int64_t N, int64_t ld, void *db, int accumulate)
{
    (void)device, (void)stream, (void)dt, (void)dY, (void)M, (void)N, (void)ld, (void)db,
        (void)accumulate;
    return lt_missing("axc_bias_grad");
}

int axc_cublaslt_cached_plans(int *capacity)
{
    if (capacity)
        *capacity = 0;
    return 0;
}

axc_status axc_cublaslt_release(void) { return AXC_OK; }

#endif
