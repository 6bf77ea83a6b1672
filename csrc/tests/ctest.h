/* A minimal unit-test harness for the C core: CHECK records failures, ctest_summary prints the
 * "N passed, N failed" line and gives the exit code. */
#ifndef AXC_CTEST_H
#define AXC_CTEST_H

#include <stdio.h>

static int ctest_passed_ = 0, ctest_failed_ = 0;

#define CHECK(cond)                                                                      \
    do {                                                                                 \
        if (cond) {                                                                      \
            ctest_passed_++;                                                             \
        } else {                                                                         \
            ctest_failed_++;                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);     \
        }                                                                                \
    } while (0)

#define CHECK_OK(expr)                                                                   \
    do {                                                                                 \
        axc_status ctest_s_ = (expr);                                                    \
        if (ctest_s_ == AXC_OK) {                                                        \
            ctest_passed_++;                                                             \
        } else {                                                                         \
            ctest_failed_++;                                                             \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr,         \
                    axc_last_error());                                                   \
        }                                                                                \
    } while (0)

static inline int ctest_summary(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, ctest_passed_, ctest_failed_);
    return ctest_failed_ ? 1 : 0;
}

#endif
