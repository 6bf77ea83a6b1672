/* Binding a shared library at run time: the one pattern behind libcudart (device/cuda_rt.c),
 * libnccl (comm/nccl_load.c), libcublasLt (device/cublaslt.c) and torch's C shim
 * (device/torch_shim.c).
 *
 * Nothing is linked: the library torch already loaded is found with RTLD_NOLOAD (so the core
 * shares its CUDA context, streams and thread pools), else a file named by an AXONN_C_* setting,
 * else (where the library may come from the system) the library path. Then a table of symbols is
 * resolved, each into a function pointer of pointer size; a missing required symbol makes the
 * library unavailable with a message naming the library and the symbol. Each user runs this once
 * (pthread_once) and replays the outcome to every caller. */
#ifndef AXC_DYNLIB_H
#define AXC_DYNLIB_H

#include <stddef.h>

/* What to open. */
typedef struct axc_dynlib_spec {
    const char *what;          /* the library in messages: "the CUDA runtime", "NCCL", ... */
    const char *const *names;  /* its sonames, the preferred first */
    size_t n_names;
    const char *path_setting;  /* an AXONN_C_* setting naming the file to open when none of
                                * `names` is loaded (NULL: none) */
    int search;                /* 1: when none is loaded, dlopen `names` on the library path */
    const char *hint;          /* ends the "not found" message: how to get the library */
} axc_dynlib_spec;

/* One symbol of the table: its name, where its address goes (a function pointer), and whether the
 * library is unusable without it (an optional one is left NULL). */
typedef struct axc_dynlib_sym {
    const char *name;
    void *field;
    int required;
} axc_dynlib_sym;

/* Opens the library. On success returns the handle and writes into `label` the file and how it
 * was found ("libcudart.so.13 (already loaded)"); on failure returns NULL and writes into `msg`
 * why ("<what> not found: ... (<dlerror>); <hint>"). */
void *axc_dynlib_open(const axc_dynlib_spec *spec, char *label, size_t label_cap, char *msg,
                      size_t msg_cap);

/* Resolves `syms` in `h`; returns 1 when every required symbol was found. Otherwise returns 0
 * with `msg` naming the library and the first missing symbol ("<what> <label> has no symbol
 * <name>"); `why` (may be NULL) adds what that means ("NCCL >= 2.18 is required"). */
int axc_dynlib_resolve(void *h, const char *what, const char *label, const axc_dynlib_sym *syms,
                       size_t n, const char *why, char *msg, size_t msg_cap);

#endif
