/* The CPU mocks' calls per API name (mock_api_count.c), as the tests see them: found with
 * dlsym, so a test run against a real runtime (or none) finds nothing. */
#ifndef AXC_TESTS_MOCK_API_COUNTS_H
#define AXC_TESTS_MOCK_API_COUNTS_H

#include <dlfcn.h>
#include <string.h>

typedef struct api_counts {
    int (*calls)(const char *api); /* since the last reset */
    int (*n)(void);                /* APIs seen so far */
    const char *(*name)(int i);
    void (*reset)(void);
} api_counts;

/* 1 when the mock libcudart loaded in this process counts its calls. */
static inline int api_counts_find(api_counts *ac)
{
    void *c = dlsym(RTLD_DEFAULT, "mock_api_calls"), *n = dlsym(RTLD_DEFAULT, "mock_api_count_n");
    void *nm = dlsym(RTLD_DEFAULT, "mock_api_count_name");
    void *r = dlsym(RTLD_DEFAULT, "mock_api_counts_reset");
    /* object to function pointers through memcpy, as POSIX sanctions */
    memcpy(&ac->calls, &c, sizeof c);
    memcpy(&ac->n, &n, sizeof n);
    memcpy(&ac->name, &nm, sizeof nm);
    memcpy(&ac->reset, &r, sizeof r);
    return c && n && nm && r;
}

#endif
