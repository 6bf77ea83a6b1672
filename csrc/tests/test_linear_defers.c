/* Which backward of a Linear defers its dW (axc_linear_defers): decided by the knobs, the grid
 * and the per-call facts (chunk pipelining, micro-batches), for every grid factorisation. */
#include "axc/grid.h"
#include "axc/linear.h"
#include "ctest.h"

/* The rule, written out: a depth reduce-scatter, a data-parallel bucket or a deferred dW GEMM
 * (overlap_all_reduce, tensor-parallel, no depth) runs after the call */
static int expected(const axc_grid *g, const axc_linear_desc *d)
{
    if (d->overlap_reduce_scatter && g->G_d > 1)
        return 1;
    if (d->overlap_data && g->G_data > 1)
        return 1;
    return d->defer_dw_gemm && d->overlap_all_reduce && g->G_d == 1 && g->G_r * g->G_c > 1;
}

int main(void)
{
    static const int sizes[][4] = {{1, 1, 1, 1}, {2, 1, 1, 1}, {1, 2, 1, 1}, {1, 1, 2, 1},
                                   {1, 1, 1, 2}, {2, 2, 1, 2}, {1, 2, 2, 1}, {2, 1, 2, 2}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        const int *z = sizes[i];
        axc_grid g;
        CHECK_OK(axc_grid_make(&g, z[0] * z[1] * z[2] * z[3], z[0], z[1], z[2], z[3], 1));
        for (int k = 0; k < 16; k++) {
            axc_linear_desc d = {.in_features = 8, .out_features = 8, .dtype = AXC_DT_F32,
                                 .overlap_all_reduce = k & 1, .overlap_reduce_scatter = k >> 1 & 1,
                                 .overlap_data = k >> 2 & 1, .defer_dw_gemm = k >> 3 & 1,
                                 .fwd_chunks = 1};
            CHECK(axc_linear_defers(&g, &d, 0) == expected(&g, &d));
            /* chunk calls always complete later (one gradient for the pass's chunks), micro-batch
             * calls never (autograd sums them); chunk pipelining decides first */
            CHECK(axc_linear_defers(&g, &d, AXC_LINEAR_HOLD) == 1);
            CHECK(axc_linear_defers(&g, &d, AXC_LINEAR_MICROBATCH) == 0);
            CHECK(axc_linear_defers(&g, &d, AXC_LINEAR_HOLD | AXC_LINEAR_MICROBATCH) == 1);
        }
    }
    /* a knob without the grid dimension it acts on defers nothing */
    axc_grid g;
    CHECK_OK(axc_grid_make(&g, 2, 1, 2, 1, 1, 1));
    axc_linear_desc d = {.overlap_reduce_scatter = 1, .overlap_data = 1, .defer_dw_gemm = 1};
    CHECK(axc_linear_defers(&g, &d, 0) == 0);
    d.overlap_all_reduce = 1;
    CHECK(axc_linear_defers(&g, &d, 0) == 1);
    return ctest_summary("test_linear_defers");
}
