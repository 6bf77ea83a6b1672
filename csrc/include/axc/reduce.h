/* Element-wise reductions and the 16-bit float conversions used by host-side collectives. */
#ifndef AXC_REDUCE_H
#define AXC_REDUCE_H

#include <stddef.h>
#include <stdint.h>

#include "axc/comm.h"

float axc_bf16_to_f32(uint16_t h);
uint16_t axc_f32_to_bf16(float f); /* round to nearest even; NaN stays NaN */
float axc_f16_to_f32(uint16_t h);
uint16_t axc_f32_to_f16(float f); /* round to nearest even; overflow to inf */

/* dst[x] = op over k = 0..nsrc-1 of srcs[k][x], accumulated in fixed source order in fp32 (fp64
 * for float64, int64 for integers) and rounded once. `avg` divides by `avg_div`; integers
 * truncate toward zero and integer sums wrap modulo the type's range. `dst` may alias srcs[k]. */
void axc_reduce(axc_dtype dt, axc_redop op, void *dst, const void *const *srcs, int nsrc,
                size_t n, int avg_div);

#endif
