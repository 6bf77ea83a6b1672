/* The per-API call counts of the CPU mocks (see mock_api_count.h). Thread-safe: the shm
 * backend's progress threads and the tests' own threads call the mocks too. */
#include "mock_api_count.h"

#include <pthread.h>
#include <string.h>

#define MOCK_API_MAX 128 /* distinct API names; more are counted under the last slot's name */

static pthread_mutex_t mu_ = PTHREAD_MUTEX_INITIALIZER;
static const char *names_[MOCK_API_MAX];
static int counts_[MOCK_API_MAX];
static int n_;

static int slot(const char *api) /* under mu_ */
{
    for (int i = 0; i < n_; i++)
        if (strcmp(names_[i], api) == 0)
            return i;
    if (n_ == MOCK_API_MAX)
        return MOCK_API_MAX - 1;
    names_[n_] = api; /* __func__ of a mock entry point: lives as long as its library */
    return n_++;
}

void mock_api_count(const char *api)
{
    pthread_mutex_lock(&mu_);
    counts_[slot(api)]++;
    pthread_mutex_unlock(&mu_);
}

int mock_api_calls(const char *api)
{
    int c = 0;
    pthread_mutex_lock(&mu_);
    for (int i = 0; i < n_; i++)
        if (strcmp(names_[i], api) == 0)
            c = counts_[i];
    pthread_mutex_unlock(&mu_);
    return c;
}

int mock_api_count_n(void)
{
    pthread_mutex_lock(&mu_);
    int n = n_;
    pthread_mutex_unlock(&mu_);
    return n;
}

const char *mock_api_count_name(int i)
{
    pthread_mutex_lock(&mu_);
    const char *s = i >= 0 && i < n_ ? names_[i] : NULL;
    pthread_mutex_unlock(&mu_);
    return s;
}

void mock_api_counts_reset(void)
{
    pthread_mutex_lock(&mu_);
    memset(counts_, 0, sizeof counts_);
    pthread_mutex_unlock(&mu_);
}
