/* Rank <-> coordinate mapping of the 4D grid. rank = ((data*Gd + depth)*Gr + row)*Gc + col. */
#include "axc/grid.h"

#include <string.h>

axc_status axc_grid_make(axc_grid *grid, int world_size, int G_data, int G_r, int G_c, int G_d,
                         int G_inter)
{
    if (G_inter != 1)
        return axc_fail(AXC_ERR_INVALID,
                        "G_inter=%d: pipeline parallelism is not supported, expected G_inter=1",
                        G_inter);
    if (G_data < 1 || G_r < 1 || G_c < 1 || G_d < 1)
        return axc_fail(AXC_ERR_INVALID,
                        "grid sizes must be >= 1, got G_data=%d G_intra_r=%d G_intra_c=%d "
                        "G_intra_d=%d",
                        G_data, G_r, G_c, G_d);
    if (world_size < 1)
        return axc_fail(AXC_ERR_INVALID, "world size must be >= 1, got %d", world_size);
    long long product = (long long)G_data * G_r * G_c * G_d;
    if (product != world_size)
        return axc_fail(AXC_ERR_INVALID,
                        "grid G_data=%d x G_intra_r=%d x G_intra_c=%d x G_intra_d=%d = %lld ranks "
                        "does not match the world size %d",
                        G_data, G_r, G_c, G_d, product, world_size);
    grid->G_data = G_data;
    grid->G_r = G_r;
    grid->G_c = G_c;
    grid->G_d = G_d;
    grid->world_size = world_size;
    return AXC_OK;
}

axc_coords axc_grid_coords(const axc_grid *g, int rank)
{
    axc_coords c;
    c.col = rank % g->G_c;
    rank /= g->G_c;
    c.row = rank % g->G_r;
    rank /= g->G_r;
    c.depth = rank % g->G_d;
    c.data = rank / g->G_d;
    return c;
}

int axc_grid_rank(const axc_grid *g, axc_coords c)
{
    return ((c.data * g->G_d + c.depth) * g->G_r + c.row) * g->G_c + c.col;
}

int axc_grid_group_size(const axc_grid *g, axc_group_kind kind)
{
    switch (kind) {
    case AXC_GROUP_COL: return g->G_c;
    case AXC_GROUP_ROW: return g->G_r;
    case AXC_GROUP_DEPTH: return g->G_d;
    case AXC_GROUP_DATA: return g->G_data;
    case AXC_GROUP_INTRA: return g->G_r * g->G_c * g->G_d;
    case AXC_GROUP_WORLD:
    case AXC_GROUP_COUNT: break;
    }
    return g->world_size;
}

int axc_grid_group_rank(const axc_grid *g, axc_group_kind kind, int rank)
{
    axc_coords c = axc_grid_coords(g, rank);
    switch (kind) {
    case AXC_GROUP_COL: return c.col;
    case AXC_GROUP_ROW: return c.row;
    case AXC_GROUP_DEPTH: return c.depth;
    case AXC_GROUP_DATA: return c.data;
    case AXC_GROUP_INTRA: return rank % (g->G_r * g->G_c * g->G_d);
    case AXC_GROUP_WORLD:
    case AXC_GROUP_COUNT: break;
    }
    return rank;
}

/* The member with group index `i` of the group of `kind` containing `rank`. */
static int member_at(const axc_grid *g, axc_group_kind kind, int rank, int i)
{
    axc_coords c = axc_grid_coords(g, rank);
    switch (kind) {
    case AXC_GROUP_COL: c.col = i; break;
    case AXC_GROUP_ROW: c.row = i; break;
    case AXC_GROUP_DEPTH: c.depth = i; break;
    case AXC_GROUP_DATA: c.data = i; break;
    case AXC_GROUP_INTRA: return c.data * (g->G_r * g->G_c * g->G_d) + i;
    case AXC_GROUP_WORLD:
    case AXC_GROUP_COUNT: return i;
    }
    return axc_grid_rank(g, c);
}

void axc_grid_group_members(const axc_grid *g, axc_group_kind kind, int rank, int *members)
{
    int n = axc_grid_group_size(g, kind);
    for (int i = 0; i < n; i++)
        members[i] = member_at(g, kind, rank, i);
}

int axc_grid_group_color(const axc_grid *g, axc_group_kind kind, int rank)
{
    return member_at(g, kind, rank, 0); /* the group's first member identifies it */
}

static const char *const group_names[AXC_GROUP_COUNT] = {"col",  "row",   "depth",
                                                         "data", "intra", "world"};

const char *axc_group_name(axc_group_kind kind)
{
    return (kind >= 0 && kind < AXC_GROUP_COUNT) ? group_names[kind] : "?";
}

axc_status axc_group_from_name(const char *name, axc_group_kind *kind)
{
    for (int k = 0; k < AXC_GROUP_COUNT; k++) {
        if (name && strcmp(name, group_names[k]) == 0) {
            *kind = (axc_group_kind)k;
            return AXC_OK;
        }
    }
    return axc_fail(AXC_ERR_INVALID,
                    "unknown group '%s', expected one of col, row, depth, data, intra, world",
                    name ? name : "(null)");
}
