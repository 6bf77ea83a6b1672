/* The 4D grid: global rank <-> (data, depth, row, col) coordinates and the groups. Pure math. */
#ifndef AXC_GRID_H
#define AXC_GRID_H

#include "axc/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Group kinds. Column varies fastest, then row, then depth, then data
 * (docs/ARCHITECTURE.md#the-grid-and-its-groups). */
typedef enum axc_group_kind {
    AXC_GROUP_COL = 0,   /* fixed (data, depth, row); splits input features */
    AXC_GROUP_ROW = 1,   /* fixed (data, depth, col); splits output features */
    AXC_GROUP_DEPTH = 2, /* fixed (data, row, col); shards weights and tokens */
    AXC_GROUP_DATA = 3,  /* fixed (depth, row, col) */
    AXC_GROUP_INTRA = 4, /* all r*c*d ranks of one data replica */
    AXC_GROUP_WORLD = 5,
    AXC_GROUP_COUNT = 6
} axc_group_kind;

typedef struct axc_grid {
    int G_data, G_r, G_c, G_d; /* sizes */
    int world_size;
} axc_grid;

typedef struct axc_coords {
    int data, depth, row, col;
} axc_coords;

/* Validates sizes (all >= 1, product == world_size, G_inter == 1) and fills `grid`. */
axc_status axc_grid_make(axc_grid *grid, int world_size, int G_data, int G_r, int G_c, int G_d,
                         int G_inter);

axc_coords axc_grid_coords(const axc_grid *grid, int rank);
int axc_grid_rank(const axc_grid *grid, axc_coords coords);

/* Size of the group `kind` and this rank's index inside it. */
int axc_grid_group_size(const axc_grid *grid, axc_group_kind kind);
int axc_grid_group_rank(const axc_grid *grid, axc_group_kind kind, int rank);

/* Global ranks of the group of `kind` that contains `rank`, in group-rank order.
 * `members` must hold axc_grid_group_size() entries. */
void axc_grid_group_members(const axc_grid *grid, axc_group_kind kind, int rank, int *members);

/* A colour identifying which group of `kind` `rank` belongs to (equal for all members). */
int axc_grid_group_color(const axc_grid *grid, axc_group_kind kind, int rank);

const char *axc_group_name(axc_group_kind kind);
/* Returns AXC_ERR_INVALID naming the accepted names when `name` is unknown. */
axc_status axc_group_from_name(const char *name, axc_group_kind *kind);

#ifdef __cplusplus
}
#endif
#endif
