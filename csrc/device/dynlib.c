/* Binding a shared library at run time: see axc/dynlib.h. */
#include "axc/dynlib.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "axc/env.h"

/* Every field a symbol goes into is a function pointer of the same size as void *, so a dlsym
 * result can be stored through memcpy (the POSIX-sanctioned way to turn an object pointer into a
 * function pointer). */
_Static_assert(sizeof(int (*)(int *)) == sizeof(void *), "function pointers are not pointer-sized");

/* "a, b or c" */
static void join_names(const axc_dynlib_spec *spec, char *out, size_t cap)
{
    out[0] = '\0';
    for (size_t i = 0; i < spec->n_names; i++) {
        size_t used = strlen(out);
        const char *sep = i == 0 ? "" : (i + 1 == spec->n_names ? " or " : ", ");
        snprintf(out + used, cap - used, "%s%s", sep, spec->names[i]);
    }
}

void *axc_dynlib_open(const axc_dynlib_spec *spec, char *label, size_t label_cap, char *msg,
                      size_t msg_cap)
{
    label[0] = msg[0] = '\0';
    /* 1. the copy torch (or anyone) already loaded */
    for (size_t i = 0; i < spec->n_names; i++) {
        void *h = dlopen(spec->names[i], RTLD_NOW | RTLD_NOLOAD);
        if (h) {
            snprintf(label, label_cap, "%s (already loaded)", spec->names[i]);
            return h;
        }
    }
    char names[256];
    join_names(spec, names, sizeof names);
    /* 2. the file a setting names */
    const char *path = spec->path_setting ? axc_env_str(spec->path_setting) : NULL;
    if (path && path[0]) {
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h) {
            snprintf(label, label_cap, "%s", path);
            return h;
        }
        const char *e = dlerror();
        snprintf(msg, msg_cap, "%s could not be opened from %s=%s: %s", spec->what,
                 spec->path_setting, path, e ? e : "dlopen failed");
        return NULL;
    }
    /* 3. a normal search (LD_LIBRARY_PATH, system paths) */
    if (!spec->search) {
        snprintf(msg, msg_cap, "%s (%s) is not loaded in this process%s%s%s; %s", spec->what,
                 names, spec->path_setting ? " and " : "",
                 spec->path_setting ? spec->path_setting : "",
                 spec->path_setting ? " is not set" : "", spec->hint);
        return NULL;
    }
    char errs[512] = "";
    for (size_t i = 0; i < spec->n_names; i++) {
        void *h = dlopen(spec->names[i], RTLD_NOW | RTLD_LOCAL);
        if (h) {
            snprintf(label, label_cap, "%s", spec->names[i]);
            return h;
        }
        const char *e = dlerror();
        size_t used = strlen(errs);
        snprintf(errs + used, sizeof errs - used, "%s%s", used ? "; " : "",
                 e ? e : spec->names[i]);
    }
    snprintf(msg, msg_cap,
             "%s not found: %s is not loaded in this process nor on the library path (%s); %s",
             spec->what, names, errs, spec->hint);
    return NULL;
}

int axc_dynlib_resolve(void *h, const char *what, const char *label, const axc_dynlib_sym *syms,
                       size_t n, const char *why, char *msg, size_t msg_cap)
{
    for (size_t i = 0; i < n; i++) {
        void *sym = dlsym(h, syms[i].name);
        if (!sym && syms[i].required) {
            snprintf(msg, msg_cap, "%s %s has no symbol %s%s%s", what, label, syms[i].name,
                     why ? "; " : "", why ? why : "");
            return 0;
        }
        if (sym)
            memcpy(syms[i].field, &sym, sizeof sym);
        else
            memset(syms[i].field, 0, sizeof sym);
    }
    return 1;
}
