/* Compressed collectives on the shm backend across forked ranks (plain and ASan/UBSan): results
 * equal to a serial emulation with the codec functions and bit-identical on every rank, error
 * feedback that telescopes (results + residuals = exact sums), wire and logical byte counters,
 * a codec mismatch failing as out of step, and the checks of bad calls. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/comm.h"
#include "axc/compress.h"
#include "ctest.h"
#include "fork_ranks.h"

/* rank r's input: gradient-like magnitudes varying per 64 elements, a few zeros */
static float xval(int rank, int step, size_t i)
{
    unsigned h = (unsigned)(i * 2654435761u) ^ (unsigned)(rank * 40503 + step * 9973);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    float mag = powf(10.0f, -(float)((i / 64 + (size_t)rank) % 4));
    return h % 50 == 0 ? 0.0f : mag * ((float)(h % 20001) / 10000.0f - 1.0f);
}

static axc_status run(axc_comm *comm, axc_group_kind kind, axc_coll *c)
{
    axc_work *w;
    AXC_TRY(axc_comm_start(comm, kind, c, &w));
    axc_status st = axc_work_wait(w);
    axc_work_free(w);
    return st;
}

/* the serial all_reduce of G inputs (emulation of the transport's algorithm) */
static void emulate_all_reduce(axc_codec codec, int block, int G, size_t n, float *const *xs,
                               int avg, float *out)
{
    size_t piece = (n + (size_t)G - 1) / (size_t)G, bytes;
    axc_codec_encoded_bytes(codec, piece, block, &bytes);
    unsigned char *enc = malloc(bytes + 1);
    float *sum = malloc((piece + 1) * sizeof *sum);
    for (int k = 0; k < G; k++) {
        size_t lo = (size_t)k * piece < n ? (size_t)k * piece : n;
        size_t len = n - lo < piece ? n - lo : piece;
        for (int r = 0; r < G; r++) {
            axc_codec_encode(codec, block, xs[r] + lo, len, enc);
            axc_codec_decode(codec, block, enc, len, sum, r > 0);
        }
        if (avg)
            axc_codec_div(sum, len, (float)G);
        axc_codec_encode(codec, block, sum, len, enc);
        axc_codec_decode(codec, block, enc, len, out + lo, 0);
    }
    free(enc);
    free(sum);
}

/* every rank of the world holds the same n floats (bitwise) */
static int same_everywhere(axc_comm *comm, const float *x, size_t n, int G)
{
    float *all = malloc(n * (size_t)G * sizeof *all);
    axc_coll c = {.kind = AXC_COLL_ALL_GATHER, .send = x, .recv = all, .count = n,
                  .dtype = AXC_DT_F32, .device = -1};
    int ok = run(comm, AXC_GROUP_WORLD, &c) == AXC_OK;
    for (int k = 0; k < G && ok; k++)
        ok = memcmp(all + (size_t)k * n, x, n * sizeof *x) == 0;
    free(all);
    return ok;
}

static void compress_main(int rank, int world, const int dims[4], double timeout)
{
    axc_comm_config cfg;
    axc_comm *comm = NULL;
    if (fork_ranks_config(&cfg, rank, world, dims, "compress", timeout) != AXC_OK ||
        axc_comm_create(&comm, &cfg) != AXC_OK) {
        fprintf(stderr, "rank %d: create: %s\n", rank, axc_last_error());
        fails++;
        return;
    }
    const int G = world;
    enum { N = 70001 }; /* several rounds of 64 KiB slots */
    float *xs[8], *got = malloc(N * sizeof(float)), *want = malloc(N * sizeof(float));
    for (int r = 0; r < G; r++)
        xs[r] = malloc(N * sizeof(float));
    static const axc_codec codecs[] = {AXC_CODEC_BF16, AXC_CODEC_FP8, AXC_CODEC_INT8,
                                       AXC_CODEC_INT4};
    for (size_t ci = 0; ci < 4; ci++) {
        axc_codec codec = codecs[ci];
        int block = codec == AXC_CODEC_FP8 ? 64 : 0;
        for (int avg = 0; avg < 2; avg++) {
            for (int r = 0; r < G; r++)
                for (size_t i = 0; i < N; i++)
                    xs[r][i] = xval(r, (int)ci, i);
            memcpy(got, xs[rank], N * sizeof(float));
            axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = got, .recv = got, .count = N,
                          .dtype = AXC_DT_F32, .op = avg ? AXC_RED_AVG : AXC_RED_SUM,
                          .device = -1, .codec = codec, .block = block};
            axc_comm_reset_counters(comm);
            EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_OK);
            emulate_all_reduce(codec, block, G, N, xs, avg, want);
            EXPECT(memcmp(got, want, N * sizeof(float)) == 0);
            EXPECT(same_everywhere(comm, got, N, G));
            /* counters: the all_reduce, then the check's exact all_gather */
            axc_counters ctr;
            axc_comm_counters(comm, AXC_GROUP_WORLD, &ctr);
            size_t piece = (N + (size_t)G - 1) / (size_t)G, E;
            axc_codec_encoded_bytes(codec, piece, block, &E);
            uint64_t mine = N / (uint64_t)G + ((uint64_t)rank < N % (uint64_t)G);
            uint64_t gather = (uint64_t)(G - 1) * N * 4;
            EXPECT(ctr.bytes_sent == 2 * (uint64_t)(G - 1) * E + gather);
            EXPECT(ctr.logical_bytes_sent == 2 * (N - mine) * 4 + gather);
            EXPECT(ctr.compressed_calls == 1 && ctr.calls == 2);
        }
    }
    /* error feedback over steps: sum of results + all residuals = exact sum of inputs */
    {
        enum { T = 6 };
        float *res = calloc(N, sizeof(float));
        double *exact = calloc(N, sizeof(double)), *acc = calloc(N, sizeof(double));
        for (int t = 0; t < T; t++) {
            for (size_t i = 0; i < N; i++) {
                got[i] = xval(rank, 100 + t, i);
                for (int r = 0; r < G; r++)
                    exact[i] += xval(r, 100 + t, i);
            }
            axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = got, .recv = got, .count = N,
                          .dtype = AXC_DT_F32, .device = -1, .codec = AXC_CODEC_INT4,
                          .residual = res};
            EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_OK);
            for (size_t i = 0; i < N; i++)
                acc[i] += got[i];
        }
        axc_coll s = {.kind = AXC_COLL_ALL_REDUCE, .send = res, .recv = res, .count = N,
                      .dtype = AXC_DT_F32, .device = -1};
        EXPECT(run(comm, AXC_GROUP_WORLD, &s) == AXC_OK); /* the residuals' sum, exact */
        double err = 0, err_plain = 0, norm = 0;
        for (size_t i = 0; i < N; i++) {
            err = fmax(err, fabs(acc[i] + res[i] - exact[i]));
            err_plain = fmax(err_plain, fabs(acc[i] - exact[i]));
            norm = fmax(norm, fabs(exact[i]));
        }
        EXPECT(err <= 1e-5 * norm);     /* telescoped, up to fp32 roundings */
        EXPECT(err_plain > 100 * err);  /* and the residuals hold what int4 lost */
        free(res);
        free(exact);
        free(acc);
    }
    /* reduce_scatter (avg) and all_gather */
    {
        float *in = malloc((size_t)G * 1000 * sizeof(float)), out[1000 * 8];
        for (size_t i = 0; i < (size_t)G * 1000; i++)
            in[i] = xval(rank, 7, i);
        axc_coll c = {.kind = AXC_COLL_REDUCE_SCATTER, .send = in, .recv = out, .count = 1000,
                      .dtype = AXC_DT_F32, .op = AXC_RED_AVG, .device = -1,
                      .codec = AXC_CODEC_INT8};
        EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_OK);
        int bad = 0;
        for (size_t i = 0; i < 1000; i++) {
            double e = 0, bound = 0;
            for (int r = 0; r < G; r++) {
                e += xval(r, 7, (size_t)rank * 1000 + i);
                bound += 1.0 / 254 / G * 1.001; /* |x| <= 1: scale <= 1/127 */
            }
            bad += fabs(out[i] - e / G) > bound;
        }
        EXPECT(bad == 0);
        c = (axc_coll){.kind = AXC_COLL_ALL_GATHER, .send = in, .recv = out, .count = 999,
                       .dtype = AXC_DT_F32, .device = -1, .codec = AXC_CODEC_BF16};
        EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_OK);
        for (int r = 0; r < G; r++)
            for (size_t i = 0; i < 999; i += 37)
                EXPECT(fabsf(out[(size_t)r * 999 + i] - xval(r, 7, i)) <=
                       fabsf(xval(r, 7, i)) / 256);
        free(in);
    }
    /* bad calls are refused before anything runs */
    {
        float x[4] = {0};
        axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = x, .recv = x, .count = 4,
                      .dtype = AXC_DT_F32, .op = AXC_RED_MAX, .device = -1,
                      .codec = AXC_CODEC_INT8};
        EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_ERR_INVALID);
        c.op = AXC_RED_SUM;
        c.dtype = AXC_DT_BF16;
        EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_ERR_INVALID);
        c.dtype = AXC_DT_F32;
        c.kind = AXC_COLL_BROADCAST;
        EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_ERR_INVALID);
        c.kind = AXC_COLL_ALL_REDUCE;
        c.block = 100;
        EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_ERR_INVALID);
        c.block = 0;
        c.device = 0;
        EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_ERR_INVALID);
    }
    /* another codec on one rank: out of step on every rank, naming the codecs */
    {
        float x[100] = {0};
        axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = x, .recv = x, .count = 100,
                      .dtype = AXC_DT_F32, .device = -1,
                      .codec = rank == 1 ? AXC_CODEC_INT4 : AXC_CODEC_INT8};
        EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_ERR_PEER);
        EXPECT(strstr(axc_last_error(), "out of step") != NULL);
        if (rank == 1)
            EXPECT(strstr(axc_last_error(), "compressed int4/0") != NULL);
    }
    for (int r = 0; r < G; r++)
        free(xs[r]);
    free(got);
    free(want);
    axc_comm_destroy(comm);
}

int main(void)
{
    fork_ranks_init();
    setenv("AXONN_C_SHM_SLOT_KB", "64", 1);
    static const int g2[4] = {1, 1, 2, 1}, g3[4] = {1, 1, 3, 1};
    CHECK(fork_ranks_spawn(2, compress_main, g2, 30.0, 0) == 0);
    CHECK(fork_ranks_spawn(3, compress_main, g3, 30.0, 0) == 0);
    return ctest_summary("test_shm_compress");
}
