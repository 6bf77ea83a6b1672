/* The table of AXONN_C_* settings (csrc/core/env.c) and the library-loading helper every run-time
 * binding uses (csrc/device/dynlib.c). */
#include <stdlib.h>
#include <string.h>

#include "axc/dynlib.h"
#include "axc/env.h"
#include "axc/status.h"
#include "ctest.h"

/* (split: tests/test_docs.py takes every AXONN_C_ name in the sources for a setting) */
#define UNKNOWN_SETTING "AXONN_C_" "NOT_IN_THE_TABLE"

static void test_table(void)
{
    size_t n = 0;
    const axc_env_setting *t = axc_env_settings(&n);
    CHECK(t != NULL && n >= 15);
    for (size_t i = 0; i < n; i++) {
        CHECK(strncmp(t[i].name, "AXONN_C_", 8) == 0);
        CHECK(t[i].read_by && t[i].read_by[0] && t[i].dflt && t[i].dflt[0] && t[i].meaning &&
              t[i].meaning[0]);
        CHECK(axc_env_find(t[i].name) == &t[i]);
        for (size_t j = 0; j < i; j++) /* each name once */
            CHECK(strcmp(t[i].name, t[j].name) != 0);
    }
    CHECK(axc_env_find(UNKNOWN_SETTING) == NULL);
    CHECK(axc_env_find(NULL) == NULL);
}

static void test_accessors(void)
{
    setenv("AXONN_C_SHM_SLOT_KB", "128", 1);
    const char *v = axc_env_str("AXONN_C_SHM_SLOT_KB");
    CHECK(v && strcmp(v, "128") == 0);
    CHECK(axc_env_double("AXONN_C_SHM_SLOT_KB", 7) == 128);
    setenv("AXONN_C_SHM_SLOT_KB", "lots", 1); /* not a number: the default */
    CHECK(axc_env_double("AXONN_C_SHM_SLOT_KB", 7) == 7);
    setenv("AXONN_C_SHM_SLOT_KB", "", 1); /* empty reads as unset */
    CHECK(axc_env_str("AXONN_C_SHM_SLOT_KB") == NULL);
    CHECK(axc_env_double("AXONN_C_SHM_SLOT_KB", 7) == 7);
    unsetenv("AXONN_C_SHM_SLOT_KB");
    CHECK(axc_env_str("AXONN_C_SHM_SLOT_KB") == NULL);
    /* a name outside the table reads as unset even when the environment has it */
    setenv(UNKNOWN_SETTING, "1", 1);
    CHECK(axc_env_str(UNKNOWN_SETTING) == NULL);
    unsetenv(UNKNOWN_SETTING);
}

static int (*strlen_fn)(const char *);
static void *missing_fn, *optional_fn;

static void test_dynlib(void)
{
    char label[128], msg[768];
    /* libc is loaded: found with RTLD_NOLOAD */
    static const char *const libc_names[] = {"libc.so.6"};
    const axc_dynlib_spec libc = {"the C library", libc_names, 1, NULL, 0, "(always there)"};
    void *h = axc_dynlib_open(&libc, label, sizeof label, msg, sizeof msg);
    CHECK(h != NULL && strcmp(label, "libc.so.6 (already loaded)") == 0);
    if (h) {
        axc_dynlib_sym ok[] = {{"strlen", &strlen_fn, 1}, {"axc_no_such_fn", &optional_fn, 0}};
        optional_fn = &optional_fn;
        CHECK(axc_dynlib_resolve(h, "the C library", label, ok, 2, NULL, msg, sizeof msg) == 1);
        CHECK(strlen_fn != NULL && strlen_fn("abc") == 3);
        CHECK(optional_fn == NULL); /* an absent optional symbol is cleared */
        axc_dynlib_sym bad[] = {{"strlen", &strlen_fn, 1}, {"axc_no_such_fn", &missing_fn, 1}};
        CHECK(axc_dynlib_resolve(h, "the C library", label, bad, 2, "it is too old", msg,
                                 sizeof msg) == 0);
        CHECK(strstr(msg, "the C library libc.so.6 (already loaded) has no symbol axc_no_such_fn; "
                          "it is too old") != NULL);
    }
    /* not loaded, searched on the library path: every soname and the hint in the message */
    static const char *const none[] = {"libaxc_none.so.1", "libaxc_none.so.2"};
    const axc_dynlib_spec missing = {"Nothing", none, 2, NULL, 1, "install it"};
    CHECK(axc_dynlib_open(&missing, label, sizeof label, msg, sizeof msg) == NULL);
    CHECK(strstr(msg, "Nothing not found: libaxc_none.so.1 or libaxc_none.so.2") != NULL &&
          strstr(msg, "; install it") != NULL);
    /* a path setting: tried when nothing is loaded, and named when it fails */
    const axc_dynlib_spec by_path = {"torch's C library", none, 1, "AXONN_C_TORCH_LIB", 0, "hint"};
    const char *saved = getenv("AXONN_C_TORCH_LIB");
    char keep[1024] = "";
    if (saved)
        strncpy(keep, saved, sizeof keep - 1);
    unsetenv("AXONN_C_TORCH_LIB");
    CHECK(axc_dynlib_open(&by_path, label, sizeof label, msg, sizeof msg) == NULL);
    CHECK(strstr(msg, "is not loaded in this process and AXONN_C_TORCH_LIB is not set; hint"));
    setenv("AXONN_C_TORCH_LIB", "/nonexistent/libtorch_cpu.so", 1);
    CHECK(axc_dynlib_open(&by_path, label, sizeof label, msg, sizeof msg) == NULL);
    CHECK(strstr(msg, "could not be opened from AXONN_C_TORCH_LIB=/nonexistent/libtorch_cpu.so"));
    setenv("AXONN_C_TORCH_LIB", "libc.so.6", 1);
    CHECK(axc_dynlib_open(&by_path, label, sizeof label, msg, sizeof msg) != NULL &&
          strcmp(label, "libc.so.6") == 0);
    if (keep[0])
        setenv("AXONN_C_TORCH_LIB", keep, 1);
    else
        unsetenv("AXONN_C_TORCH_LIB");
}

int main(void)
{
    test_table();
    test_accessors();
    test_dynlib();
    return ctest_summary("test_env");
}
