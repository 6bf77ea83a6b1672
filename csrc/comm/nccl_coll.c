/* The nccl backend's collectives: issuing them on the group's comm stream (plain and
 * compressed), ordering them after other groups' works, waiting (joining) and querying. */
#include "nccl_internal.h"

#if defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <stdio.h>

static int map_dtype(axc_dtype dt, ncclDataType_t *out)
{
    switch (dt) {
    case AXC_DT_F32: *out = ncclFloat32; return 1;
    case AXC_DT_BF16: *out = ncclBfloat16; return 1;
    case AXC_DT_F16: *out = ncclFloat16; return 1;
    case AXC_DT_I8: *out = ncclInt8; return 1;
    case AXC_DT_U8: *out = ncclUint8; return 1;
    case AXC_DT_I32: *out = ncclInt32; return 1;
    case AXC_DT_I64: *out = ncclInt64; return 1;
    case AXC_DT_F64: *out = ncclFloat64; return 1;
    case AXC_DT_COUNT: break;
    }
    return 0;
}

static int map_op(axc_redop op, ncclRedOp_t *out)
{
    switch (op) {
    case AXC_RED_SUM: *out = ncclSum; return 1;
    case AXC_RED_AVG: *out = ncclAvg; return 1;
    case AXC_RED_MAX: *out = ncclMax; return 1;
    }
    return 0;
}

/* One NCCL call of a sequence on a non-blocking communicator: the next may be issued only once
 * this one is enqueued (ncclInProgress polled to completion). */
static ncclResult_t settle(nccl_backend *be, nccl_group *g, ncclResult_t r, int *aborted)
{
    if (r == ncclInProgress)
        r = axc_nccl_poll_comm(be, g->comm, axc_nccl_deadline_after(be->timeout_s), aborted);
    return r;
}

/* A compressed collective (axc_coll.codec; the shm backend's run_compressed has the algorithm)
 * on the comm stream: codec kernels around a grouped send/recv all-to-all and an all-gather of
 * bytes, so every rank decodes the same bytes. A kernel that cannot be launched fails the call
 * with ncclUnhandledCudaError and its message logged. */
static ncclResult_t issue_compressed_locked(nccl_backend *be, nccl_group *g, const axc_coll *c,
                                            int *aborted)
{
    const nccl_api *nc = be->nc;
    void *s = g->stream;
    int G = g->size, me = g->rank;
    int ar = c->kind == AXC_COLL_ALL_REDUCE, ag = c->kind == AXC_COLL_ALL_GATHER;
    size_t piece = ar ? (c->count + (size_t)G - 1) / (size_t)G : c->count;
    size_t n_in = c->kind == AXC_COLL_REDUCE_SCATTER ? c->count * (size_t)G : c->count, E = 0;
    const float *send = c->send ? (const float *)c->send : (const float *)c->recv;
    float *recv = c->recv;
    if (G == 1) /* nothing to exchange: an exact copy, as on shm */
        return send == recv || !c->count
                   ? ncclSuccess
                   : (be->cu->MemcpyAsync(recv, send, c->count * 4, AXC_CUDA_MEMCPY_D2D, s) ==
                              AXC_CUDA_SUCCESS
                          ? ncclSuccess
                          : ncclUnhandledCudaError);
    if (axc_codec_encoded_bytes(c->codec, piece, c->block, &E) != AXC_OK)
        return ncclInvalidArgument;
    size_t n_send = ag ? 1 : (size_t)G, sum_off = (n_send * E + (size_t)G * E + 255) / 256 * 256;
    size_t need = sum_off + (ar ? piece * 4 : 0) + 256;
    if (g->cbuf_bytes < need) { /* (cudaFree waits for the device: earlier users are done) */
        if (g->cbuf)
            be->cu->Free(g->cbuf);
        g->cbuf = NULL;
        g->cbuf_bytes = 0;
        if (be->cu->Malloc(&g->cbuf, need) != AXC_CUDA_SUCCESS)
            return ncclSystemError;
        g->cbuf_bytes = need;
    }
    unsigned char *enc = g->cbuf, *got = enc + n_send * E;
    float *sum = (float *)(void *)(enc + sum_off);
    axc_status st = AXC_OK;
    ncclResult_t r = ncclSuccess;
#define AXC_PIECE(k, lo, len)                                                                 \
    size_t lo = (size_t)(k) * piece < n_in ? (size_t)(k) * piece : n_in;                    \
    size_t len = n_in - lo < piece ? n_in - lo : piece
    for (size_t k = 0; k < n_send && st == AXC_OK; k++) {
        AXC_PIECE(k, lo, len);
        st = axc_codec_cuda_encode(c->codec, c->block, send + lo,
                                   c->residual ? c->residual + lo : NULL, len, enc + k * E, s);
    }
    if (st == AXC_OK) {
        if (ag) {
            r = settle(be, g, nc->AllGather(enc, got, E, ncclUint8, g->comm, s), aborted);
        } else {
            r = nc->GroupStart();
            for (int p = 0; p < G && (r == ncclSuccess || r == ncclInProgress); p++) {
                r = nc->Send(enc + (size_t)p * E, E, ncclUint8, p, g->comm, s);
                if (r == ncclSuccess || r == ncclInProgress)
                    r = nc->Recv(got + (size_t)p * E, E, ncclUint8, p, g->comm, s);
            }
            ncclResult_t end = nc->GroupEnd();
            r = settle(be, g, r == ncclSuccess || r == ncclInProgress ? end : r, aborted);
        }
    }
    if (st == AXC_OK && r == ncclSuccess && !ag) {
        AXC_PIECE(me, lo, len);
        float *out = ar ? sum : recv;
        if (!ar)
            len = c->count;
        (void)lo;
        for (int k = 0; k < G && st == AXC_OK; k++)
            st = axc_codec_cuda_decode(c->codec, c->block, got + (size_t)k * E, len, out, k > 0,
                                       s);
        if (st == AXC_OK && c->op == AXC_RED_AVG)
            st = axc_codec_cuda_div(out, len, (float)G, s);
        if (st == AXC_OK && ar)
            st = axc_codec_cuda_encode(c->codec, c->block, sum, NULL, len, enc, s);
        if (st == AXC_OK && ar)
            r = settle(be, g, nc->AllGather(enc, got, E, ncclUint8, g->comm, s), aborted);
    }
    if (st == AXC_OK && r == ncclSuccess && (ar || ag)) {
        for (int k = 0; k < G && st == AXC_OK; k++) {
            AXC_PIECE(k, lo, len);
            if (ag) {
                lo = (size_t)k * c->count;
                len = c->count;
            }
            st = axc_codec_cuda_decode(c->codec, c->block, got + (size_t)k * E, len, recv + lo, 0,
                                       s);
            if (st == AXC_OK && ar && k == me && c->residual)
                st = axc_codec_cuda_feedback(c->codec, c->block, sum, recv + lo, len,
                                             c->op == AXC_RED_AVG ? (float)G : 1.0f,
                                             c->residual + lo, s);
        }
    }
#undef AXC_PIECE
    if (st != AXC_OK) {
        axc_log(2, "nccl: compressed %s on the %s group: %s", axc_coll_name(c->kind),
                axc_group_name(g->kind), axc_last_error());
        return ncclUnhandledCudaError;
    }
    return r;
}

/* Enqueues the NCCL call(s) of `c` on the group's comm stream (issue_mu held). May return
 * ncclInProgress (non-blocking communicator): the caller polls. */
static ncclResult_t issue_locked(nccl_backend *be, nccl_group *g, const axc_coll *c,
                                 ncclDataType_t dt, ncclRedOp_t op, int *aborted)
{
    const nccl_api *nc = be->nc;
    cudaStream_t s = (cudaStream_t)g->stream;
    ncclComm_t comm = g->comm;
    const void *send = c->send ? c->send : c->recv; /* NULL send: in place */
    size_t n = c->count;
    if (c->codec != AXC_CODEC_NONE)
        return issue_compressed_locked(be, g, c, aborted);
    switch (c->kind) {
    case AXC_COLL_ALL_REDUCE: return nc->AllReduce(send, c->recv, n, dt, op, comm, s);
    case AXC_COLL_ALL_GATHER: return nc->AllGather(send, c->recv, n, dt, comm, s);
    case AXC_COLL_REDUCE_SCATTER: return nc->ReduceScatter(send, c->recv, n, dt, op, comm, s);
    case AXC_COLL_BROADCAST: return nc->Broadcast(send, c->recv, n, dt, c->root, comm, s);
    case AXC_COLL_BARRIER:
        return nc->AllReduce(g->barrier_buf, g->barrier_buf, 1, ncclInt32, ncclSum, comm, s);
    case AXC_COLL_ALL_TO_ALL: {
        size_t piece = n * axc_dtype_size(c->dtype);
        ncclResult_t r = nc->GroupStart();
        if (r != ncclSuccess)
            return r;
        ncclResult_t first = ncclSuccess;
        for (int p = 0; p < g->size && (first == ncclSuccess || first == ncclInProgress); p++) {
            first = nc->Send((const char *)send + (size_t)p * piece, n, dt, p, comm, s);
            if (first == ncclSuccess || first == ncclInProgress)
                first = nc->Recv((char *)c->recv + (size_t)p * piece, n, dt, p, comm, s);
        }
        ncclResult_t end = nc->GroupEnd(); /* always closes the group, also after an error */
        if (first != ncclSuccess && first != ncclInProgress)
            return first;
        return end;
    }
    case AXC_COLL_COUNT: break;
    }
    return ncclInvalidArgument;
}

/* Orders group g's comm stream after the works `w` must follow (axc_comm_start_after: e.g. the
 * depth reduce-scatters that wrote the bucket a data-parallel sum reads), without the caller's
 * stream or the host waiting. A group's works finish in order on its stream, so one stream wait
 * on the `done` event of its latest pending work in the list covers them all (none for works of
 * g itself: its stream is in order already). A work already waited was joined into the stream
 * it was started on; when that is not this collective's stream, the point is marked there
 * (`slot->follow`) and waited for. Other backends' works were waited for by the caller. */
static axc_status follow_after(nccl_backend *be, nccl_group *g, nccl_slot *slot,
                               const axc_work *w)
{
    enum { MAX_LATEST = 16 };
    const nccl_slot *latest[MAX_LATEST]; /* per other group, its newest pending work here */
    int nlatest = 0;
    axc_status st = AXC_OK;
    pthread_mutex_lock(&be->mu); /* a concurrent wait() detaches the slot under mu */
    for (size_t i = 0; i < w->n_after && st == AXC_OK; i++) {
        const axc_work *a = w->after[i];
        if (a->backend != &be->base || a->coll.kind == AXC_COLL_BARRIER)
            continue; /* (a barrier is waited on the host) */
        const nccl_slot *s = a->backend_data;
        if (s) {
            if (s->group == g)
                continue;
            int k = 0;
            while (k < nlatest && latest[k]->group != s->group)
                k++;
            if (k < nlatest) {
                if (s->seq > latest[k]->seq)
                    latest[k] = s;
            } else if (nlatest < MAX_LATEST) {
                latest[nlatest++] = s;
            } else { /* (more groups than fit: waited for on its own) */
                st = axc_cuda_check(be->cu->StreamWaitEvent(g->stream, s->done, 0),
                                    "cudaStreamWaitEvent (nccl comm stream waits for another "
                                    "group's collective)");
            }
            continue;
        }
        if (!a->waited || a->coll.device < 0 || a->coll.stream == w->coll.stream)
            continue; /* (the same stream: the fork orders this collective after the join) */
        int capture = AXC_CUDA_CAPTURE_NONE;
        if (be->cu->StreamIsCapturing &&
            be->cu->StreamIsCapturing(a->coll.stream, &capture) == AXC_CUDA_SUCCESS &&
            capture != AXC_CUDA_CAPTURE_NONE) {
            st = axc_fail(AXC_ERR_INVALID,
                          "nccl: %s on the %s group follows a collective joined on a stream "
                          "that is being captured into a CUDA graph; axonn_c's NCCL collectives "
                          "cannot be captured",
                          axc_coll_name(w->coll.kind), axc_group_name(g->kind));
            break;
        }
        if (!slot->follow)
            st = axc_cuda_check(
                be->cu->EventCreateWithFlags(&slot->follow, AXC_CUDA_EVENT_DISABLE_TIMING),
                "cudaEventCreateWithFlags (nccl follow event)");
        if (st == AXC_OK)
            st = axc_cuda_check(be->cu->EventRecord(slot->follow, a->coll.stream),
                                "cudaEventRecord (where another stream joined a followed work)");
        if (st == AXC_OK)
            st = axc_cuda_check(be->cu->StreamWaitEvent(g->stream, slot->follow, 0),
                                "cudaStreamWaitEvent (nccl comm stream waits for a followed "
                                "work joined on another stream)");
    }
    for (int k = 0; k < nlatest && st == AXC_OK; k++)
        st = axc_cuda_check(be->cu->StreamWaitEvent(g->stream, latest[k]->done, 0),
                            "cudaStreamWaitEvent (nccl comm stream waits for another group's "
                            "collective)");
    pthread_mutex_unlock(&be->mu);
    return st;
}

axc_status axc_nccl_start(axc_backend *base, void *group, axc_work *w)
{
    nccl_backend *be = (nccl_backend *)base;
    nccl_group *g = group;
    const axc_coll *c = &w->coll;
    w->backend_data = NULL;
    if (!g)
        return axc_fail(AXC_ERR_STATE, "nccl: %s on a group that is not open",
                        axc_coll_name(c->kind));
    /* a barrier carries no tensor (device -1, the legacy default stream): it runs on this
     * rank's device with the backend's own buffer */
    if (c->device != be->device && c->kind != AXC_COLL_BARRIER) {
        if (c->device < 0)
            return axc_fail(AXC_ERR_INVALID,
                            "nccl: %s on the %s group got host (CPU) buffers; NCCL needs CUDA "
                            "tensors on cuda:%d",
                            axc_coll_name(c->kind), axc_group_name(g->kind), be->device);
        return axc_fail(AXC_ERR_INVALID,
                        "nccl: %s on the %s group got buffers on cuda:%d, but this rank's NCCL "
                        "communicators use cuda:%d",
                        axc_coll_name(c->kind), axc_group_name(g->kind), c->device, be->device);
    }
    ncclDataType_t dt = ncclFloat32;
    ncclRedOp_t op = ncclSum;
    if (c->kind != AXC_COLL_BARRIER && !map_dtype(c->dtype, &dt))
        return axc_fail(AXC_ERR_INVALID, "nccl: unsupported dtype code %d", (int)c->dtype);
    if (!map_op(c->op, &op))
        return axc_fail(AXC_ERR_INVALID, "nccl: unsupported reduction code %d", (int)c->op);
    if (c->kind == AXC_COLL_ALL_TO_ALL && g->size > 1 && c->count > 0 &&
        (const void *)c->send == (const void *)c->recv)
        return axc_fail(AXC_ERR_INVALID,
                        "nccl: all_to_all on the %s group cannot run in place (input and output "
                        "are the same buffer)",
                        axc_group_name(g->kind));
    if (atomic_load(&be->failed))
        return axc_nccl_failure_status(be);
    /* Refused under CUDA-graph capture: the slot's events are polled by the watchdog and by
     * reap(), and an event recorded inside a capture can never be queried (the graph would
     * fail the whole job at its first replay check), nor be waited on by an uncaptured wait. */
    int capture = AXC_CUDA_CAPTURE_NONE;
    if (be->cu->StreamIsCapturing && c->kind != AXC_COLL_BARRIER &&
        be->cu->StreamIsCapturing(c->stream, &capture) == AXC_CUDA_SUCCESS &&
        capture != AXC_CUDA_CAPTURE_NONE)
        return axc_fail(AXC_ERR_INVALID,
                        "nccl: %s of %zu x %s on the %s group was issued on a stream that is "
                        "being captured into a CUDA graph; axonn_c's NCCL collectives cannot be "
                        "captured: capture only work without them (a grid of one rank has none)",
                        axc_coll_name(c->kind), c->count, axc_dtype_name(c->dtype),
                        axc_group_name(g->kind));

    dev_guard dg;
    AXC_TRY(axc_nccl_dev_enter(be, &dg));
    nccl_slot *slot = NULL;
    axc_status st = axc_nccl_slot_get(be, &slot);
    if (st != AXC_OK) {
        axc_nccl_dev_leave(be, &dg);
        return st;
    }
    /* fork: the comm stream starts after everything already queued on the caller's stream */
    st = axc_cuda_check(be->cu->EventRecord(slot->ready, c->stream),
                        "cudaEventRecord (nccl fork, caller's stream)");
    if (st == AXC_OK)
        st = axc_cuda_check(be->cu->StreamWaitEvent(g->stream, slot->ready, 0),
                            "cudaStreamWaitEvent (nccl comm stream waits for the caller)");
    if (st == AXC_OK)
        st = follow_after(be, g, slot, w);
    if (st != AXC_OK) {
        axc_nccl_slot_put_unused(be, slot);
        axc_nccl_dev_leave(be, &dg);
        return st;
    }

    pthread_mutex_lock(&be->issue_mu);
    if (atomic_load(&be->failed) || !g->comm) {
        pthread_mutex_unlock(&be->issue_mu);
        axc_nccl_slot_put_unused(be, slot);
        axc_nccl_dev_leave(be, &dg);
        st = axc_nccl_failure_status(be);
        return st != AXC_OK ? st
                            : axc_fail(AXC_ERR_STATE, "nccl: the %s group's communicator is gone",
                                       axc_group_name(g->kind));
    }
    int skip = c->count == 0 && c->kind != AXC_COLL_BARRIER; /* nothing to move; keep ordering */
    uint64_t group_seq = ++g->issued;
    int aborted = 0;
    ncclResult_t r = skip ? ncclSuccess : issue_locked(be, g, c, dt, op, &aborted);
    if (r == ncclInProgress && !aborted)
        r = axc_nccl_poll_comm(be, g->comm, axc_nccl_deadline_after(be->timeout_s), &aborted);
    if (r != ncclSuccess) {
        char msg[512], what[200];
        axc_status fs;
        axc_nccl_describe_coll(what, sizeof what, c->kind, c->op, c->count, c->dtype, g->kind,
                               group_seq);
        if (aborted) {
            pthread_mutex_unlock(&be->issue_mu);
            axc_nccl_slot_put_unused(be, slot);
            axc_nccl_dev_leave(be, &dg);
            return axc_nccl_failure_status(be);
        }
        ncclResult_t async = ncclSuccess, ar = ncclSuccess;
        if (r != ncclInProgress)
            ar = be->nc->CommGetAsyncError(g->comm, &async);
        if (r == ncclInProgress) {
            fs = AXC_ERR_TIMEOUT;
            snprintf(msg, sizeof msg,
                     "%s could not be enqueued within %.1f s (job %s, rank %d): a peer is "
                     "missing; all NCCL communicators were aborted",
                     what, be->timeout_s, be->job, be->rank);
        } else if (ar != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
            fs = AXC_ERR_PEER; /* the communicator itself is broken */
            snprintf(msg, sizeof msg,
                     "%s failed (job %s, rank %d): %s: %s; all NCCL communicators were aborted",
                     what, be->job, be->rank, axc_nccl_str(be->nc, r),
                     axc_nccl_last(be->nc, g->comm));
        } else { /* a usage error: the communicator is still fine */
            st = axc_nccl_fail(be, r, g->comm, "enqueueing the NCCL call", what);
            pthread_mutex_unlock(&be->issue_mu);
            axc_nccl_slot_put_unused(be, slot);
            axc_nccl_dev_leave(be, &dg);
            return st;
        }
        axc_nccl_fail_all(be, fs, msg, 1);
        pthread_mutex_unlock(&be->issue_mu);
        axc_nccl_slot_put_unused(be, slot);
        axc_nccl_dev_leave(be, &dg);
        return axc_fail(fs, "%s", msg);
    }
    pthread_mutex_unlock(&be->issue_mu);

    /* join point: `done` fires when the NCCL kernel (and the fork) finished */
    st = axc_cuda_check(be->cu->EventRecord(slot->done, g->stream),
                        "cudaEventRecord (nccl join, comm stream)");
    if (st != AXC_OK) {
        /* the op is queued but cannot be joined: the CUDA context is broken, stop everything */
        char msg[768];
        snprintf(msg, sizeof msg, "%s; all NCCL communicators were aborted", axc_last_error());
        axc_nccl_fail_all(be, AXC_ERR_BACKEND, msg, 0);
        axc_nccl_slot_put_unused(be, slot);
        axc_nccl_dev_leave(be, &dg);
        return axc_fail(AXC_ERR_BACKEND, "%s", msg);
    }

    pthread_mutex_lock(&be->mu);
    slot->work = w;
    slot->group = g;
    slot->coll_kind = c->kind;
    slot->group_kind = g->kind;
    slot->count = c->count;
    slot->dtype = c->dtype;
    slot->op = c->op;
    slot->group_seq = group_seq;
    slot->start_ns = axc_now_ns();
    slot->seq = ++be->slot_seq;
    slot->completed = slot->reported = 0;
    g->inflight++;
    axc_nccl_inflight_append(be, slot);
    w->backend_data = slot;
    int failed = atomic_load(&be->failed);
    if (failed) { /* fail_all ran since issue_mu was released and did not see this slot: its
                   * kernel was aborted; wait() must not take it for one finished before */
        slot->reported = 1;
        axc_work_complete(w, (axc_status)failed, be->fail_msg);
    }
    pthread_mutex_unlock(&be->mu);
    axc_nccl_dev_leave(be, &dg);
    return AXC_OK;
}

/* Joins `w` into the caller's stream (a barrier waits on the host). Afterwards the work is detached
 * from its slot; the slot stays watched until `done` fires, then returns to the pool. */
axc_status axc_nccl_wait(axc_backend *base, axc_work *w)
{
    nccl_backend *be = (nccl_backend *)base;
    nccl_slot *slot = w->backend_data;
    if (!slot)
        return axc_fail(AXC_ERR_STATE, "nccl: wait on a work that was never started");
    int host_wait = w->coll.kind == AXC_COLL_BARRIER;
    dev_guard dg;
    axc_status dst = axc_nccl_dev_enter(be, &dg);
    if (dst != AXC_OK) { /* detach anyway: the generic layer frees `w` after an error */
        char m[512];
        snprintf(m, sizeof m, "%s", axc_last_error());
        pthread_mutex_lock(&be->mu);
        slot->work = NULL;
        w->backend_data = NULL;
        int reported = slot->reported;
        pthread_mutex_unlock(&be->mu);
        if (!reported)
            axc_work_complete(w, dst, m);
        return axc_fail(dst, "%s", m);
    }
    int64_t deadline = slot->start_ns + (int64_t)((be->timeout_s + 1.0) * 1e9);
    axc_status st = AXC_OK;
    char msg[512] = "";
    int report = 0; /* call axc_work_complete after detaching */
    unsigned spins = 0;
    for (;;) {
        pthread_mutex_lock(&be->mu);
        if (slot->reported) { /* failed by fail_all: the status and message are in the work */
            st = w->status != AXC_OK ? w->status : AXC_ERR_PEER;
            snprintf(msg, sizeof msg, "%s", w->message);
            break;
        }
        if (atomic_load(&be->failed) && !be->fail_done) {
            /* fail_all is deciding which works finished before the abort: ask again shortly */
            pthread_mutex_unlock(&be->mu);
            axc_nccl_backoff(&spins);
            continue;
        }
        /* healthy, or failed after this collective had finished (its result stands) */
        if (!host_wait) {
            int e = be->cu->StreamWaitEvent(w->coll.stream, slot->done, 0);
            if (e != AXC_CUDA_SUCCESS) {
                st = axc_cuda_check(e, "cudaStreamWaitEvent (joining an NCCL collective)");
                snprintf(msg, sizeof msg, "%s", axc_last_error());
            }
            report = 1;
            break;
        }
        int q = slot->completed ? AXC_CUDA_SUCCESS : be->cu->EventQuery(slot->done);
        if (q != AXC_CUDA_ERROR_NOT_READY) {
            if (q == AXC_CUDA_SUCCESS) {
                slot->completed = 1;
            } else {
                st = axc_cuda_check(q, "cudaEventQuery (NCCL barrier)");
                snprintf(msg, sizeof msg, "%s", axc_last_error());
            }
            report = 1;
            break;
        }
        pthread_mutex_unlock(&be->mu);
        if (axc_now_ns() >= deadline) {
            char m[512], what[200];
            axc_nccl_describe_coll(what, sizeof what, AXC_COLL_BARRIER, AXC_RED_SUM, 0,
                                   AXC_DT_F32, w->group.kind, slot->group_seq);
            snprintf(m, sizeof m,
                     "%s did not complete within %.1f s (job %s, rank %d): a peer died or is "
                     "stuck; all NCCL communicators were aborted",
                     what, be->timeout_s, be->job, be->rank);
            axc_nccl_fail_all(be, AXC_ERR_TIMEOUT, m, 0); /* the next round sees slot->reported */
            continue;
        }
        axc_nccl_backoff(&spins);
    }
    /* every break above holds mu: detach (the generic layer frees `w` after we return) */
    slot->work = NULL;
    w->backend_data = NULL;
    if (slot->completed && !atomic_load(&be->failed))
        axc_nccl_slot_recycle(be, slot);
    pthread_mutex_unlock(&be->mu);
    if (report)
        axc_work_complete(w, st, msg);
    axc_nccl_dev_leave(be, &dg);
    if (st != AXC_OK)
        return axc_fail(st, "%s", msg);
    return AXC_OK;
}

int axc_nccl_query(axc_backend *base, axc_work *w)
{
    nccl_backend *be = (nccl_backend *)base;
    if (atomic_load_explicit(&w->state, memory_order_acquire) != AXC_WORK_PENDING)
        return 1;
    nccl_slot *slot = w->backend_data;
    if (!slot)
        return 1;
    int q = be->cu->EventQuery(slot->done);
    return q != AXC_CUDA_ERROR_NOT_READY; /* finished, or an error that wait() reports */
}

#endif
