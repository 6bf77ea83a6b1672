/* Calls per API name in the CPU mocks (libcudart, libnccl, libcublasLt): every mock entry point
 * counts itself with MOCK_API() (the function's own name). The mock libraries built from the
 * same sources all bind to the first loaded copy (libcudart, loaded RTLD_GLOBAL before the
 * others), so they share one table. Tests find it with dlsym (see mock_api_counts.h):
 *   int  mock_api_calls(const char *api)     calls of `api` since the last reset
 *   int  mock_api_count_n(void)              APIs seen since the process began
 *   const char *mock_api_count_name(int i)   the i-th of them (in order of first call)
 *   void mock_api_counts_reset(void)         zeroes every count (the names stay) */
#ifndef MOCK_API_COUNT_H
#define MOCK_API_COUNT_H

void mock_api_count(const char *api);
int mock_api_calls(const char *api);
int mock_api_count_n(void);
const char *mock_api_count_name(int i);
void mock_api_counts_reset(void);

#define MOCK_API() mock_api_count(__func__)

#endif
