/* Every AXONN_C_* environment setting, in one table (csrc/core/env.c): its name, what reads it,
 * its default and its meaning. docs/ARCHITECTURE.md's settings table is this table
 * (tests/test_docs.py checks that they are equal), and the core reads a setting only through
 * the accessors below, never with getenv. Settings read by Python or by setup.py are in the table
 * too, so that it is complete; the core only lists them. */
#ifndef AXC_ENV_H
#define AXC_ENV_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct axc_env_setting {
    const char *name;    /* AXONN_C_... */
    const char *read_by; /* the file(s) that read it (Markdown, as in the docs' table) */
    const char *dflt;    /* its default, in words */
    const char *meaning; /* what it does */
} axc_env_setting;

/* The table, `*n` entries. */
const axc_env_setting *axc_env_settings(size_t *n);

/* The setting called `name`, NULL when the table has none. */
const axc_env_setting *axc_env_find(const char *name);

/* The value of the setting `name` (which must be in the table: an unknown name is logged and
 * reads as unset); NULL when it is unset or empty. */
const char *axc_env_str(const char *name);

/* The setting as a number: `dflt` when unset or not a number. */
double axc_env_double(const char *name, double dflt);

#ifdef __cplusplus
}
#endif
#endif
