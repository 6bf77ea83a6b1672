/* The stream-order checker of the CPU mock libcudart (mock_stream_order.c), as the tests see
 * it: found with dlsym, so a test run against a real runtime (or none) has nothing to check.
 * Include after ctest.h. */
#ifndef AXC_TESTS_MOCK_ORDER_CHECK_H
#define AXC_TESTS_MOCK_ORDER_CHECK_H

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef struct order_checker {
    int *violations, *saturated;
    const char *text;
    void (*reset)(void);
    void (*access)(const void *p, void *stream, int is_write);
    void (*name_stream)(const void *stream, const char *name);
} order_checker;

/* The checker of the mock runtime loaded in this process; 0 when there is none. */
static inline int order_checker_find(order_checker *oc)
{
    oc->violations = dlsym(RTLD_DEFAULT, "mock_order_violations");
    oc->saturated = dlsym(RTLD_DEFAULT, "mock_order_saturated");
    oc->text = dlsym(RTLD_DEFAULT, "mock_order_text");
    void *r = dlsym(RTLD_DEFAULT, "mock_order_reset");
    void *a = dlsym(RTLD_DEFAULT, "mock_order_access");
    void *n = dlsym(RTLD_DEFAULT, "mock_order_name_stream");
    /* object to function pointers through memcpy, as POSIX sanctions (no -Wpedantic cast) */
    memcpy(&oc->reset, &r, sizeof r);
    memcpy(&oc->access, &a, sizeof a);
    memcpy(&oc->name_stream, &n, sizeof n);
    return oc->violations && oc->saturated && oc->text && r && a && n;
}

/* Violations the checker found since its last reset (printed when there are any); 0 without
 * a checker. `who` names the test (and rank) in the output. */
static inline int order_violations(const order_checker *oc, const char *who)
{
    if (!oc->violations)
        return 0;
    int v = __atomic_load_n(oc->violations, __ATOMIC_SEQ_CST);
    if (v)
        fprintf(stderr, "%s: the stream-order checker found %d violation(s); the first:\n%s", who,
                v, oc->text);
    if (*oc->saturated)
        printf("%s: note: %d stream(s) beyond the stream-order checker's capacity (it checked "
               "less)\n",
               who, *oc->saturated);
    return v;
}

#endif
