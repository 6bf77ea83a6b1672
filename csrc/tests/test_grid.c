/* Grid math: rank <-> coordinates, group sizes, members and colours for every factorisation. */
#include <string.h>

#include "axc/grid.h"
#include "ctest.h"

static void check_grid(int Gdata, int Gr, int Gc, int Gd)
{
    axc_grid g;
    int world = Gdata * Gr * Gc * Gd;
    CHECK_OK(axc_grid_make(&g, world, Gdata, Gr, Gc, Gd, 1));
    for (int rank = 0; rank < world; rank++) {
        axc_coords c = axc_grid_coords(&g, rank);
        CHECK(axc_grid_rank(&g, c) == rank);
        /* column fastest, then row, depth, data */
        CHECK(c.col == rank % Gc);
        CHECK(c.row == (rank / Gc) % Gr);
        CHECK(c.depth == (rank / (Gc * Gr)) % Gd);
        CHECK(c.data == rank / (Gc * Gr * Gd));
        for (int k = 0; k < AXC_GROUP_WORLD + 1; k++) {
            axc_group_kind kind = (axc_group_kind)k;
            int n = axc_grid_group_size(&g, kind), members[64];
            axc_grid_group_members(&g, kind, rank, members);
            int me = axc_grid_group_rank(&g, kind, rank);
            CHECK(me >= 0 && me < n);
            CHECK(members[me] == rank);
            for (int i = 0; i < n; i++) {
                /* every member agrees on the member list, colour and its own index */
                int other[64];
                axc_grid_group_members(&g, kind, members[i], other);
                CHECK(memcmp(other, members, sizeof(int) * (size_t)n) == 0);
                CHECK(axc_grid_group_rank(&g, kind, members[i]) == i);
                CHECK(axc_grid_group_color(&g, kind, members[i]) ==
                      axc_grid_group_color(&g, kind, rank));
                axc_coords m = axc_grid_coords(&g, members[i]);
                /* members differ only in the group's own coordinate(s) */
                if (kind == AXC_GROUP_COL)
                    CHECK(m.data == c.data && m.depth == c.depth && m.row == c.row && m.col == i);
                if (kind == AXC_GROUP_ROW)
                    CHECK(m.data == c.data && m.depth == c.depth && m.col == c.col && m.row == i);
                if (kind == AXC_GROUP_DEPTH)
                    CHECK(m.data == c.data && m.row == c.row && m.col == c.col && m.depth == i);
                if (kind == AXC_GROUP_DATA)
                    CHECK(m.depth == c.depth && m.row == c.row && m.col == c.col && m.data == i);
                if (kind == AXC_GROUP_INTRA)
                    CHECK(m.data == c.data);
            }
        }
    }
}

int main(void)
{
    static const int worlds[] = {1, 2, 3, 4, 6, 8, 12};
    for (size_t w = 0; w < sizeof worlds / sizeof worlds[0]; w++) {
        int n = worlds[w];
        for (int a = 1; a <= n; a++)
            for (int b = 1; a * b <= n; b++)
                for (int c = 1; a * b * c <= n; c++)
                    if (n % (a * b * c) == 0)
                        check_grid(a, b, c, n / (a * b * c));
    }
    /* the paper's ordering on a concrete case: Gdata=2, Gr=2, Gc=2, Gd=2; rank 13 = 1101b */
    axc_grid g;
    CHECK_OK(axc_grid_make(&g, 16, 2, 2, 2, 2, 1));
    axc_coords c = axc_grid_coords(&g, 13);
    CHECK(c.data == 1 && c.depth == 1 && c.row == 0 && c.col == 1);
    int m[16];
    axc_grid_group_members(&g, AXC_GROUP_DEPTH, 13, m);
    CHECK(m[0] == 9 && m[1] == 13);
    axc_grid_group_members(&g, AXC_GROUP_DATA, 13, m);
    CHECK(m[0] == 5 && m[1] == 13);
    axc_grid_group_members(&g, AXC_GROUP_INTRA, 13, m);
    CHECK(m[0] == 8 && m[7] == 15);

    /* errors name the numbers */
    CHECK(axc_grid_make(&g, 8, 2, 2, 2, 2, 1) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "16") && strstr(axc_last_error(), "world size 8"));
    CHECK(axc_grid_make(&g, 4, 0, 2, 2, 1, 1) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "G_data=0") != NULL);
    CHECK(axc_grid_make(&g, 4, -1, 2, 2, 1, 1) == AXC_ERR_INVALID);
    CHECK(axc_grid_make(&g, 4, 1, 2, 2, 1, 2) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "G_inter=2") != NULL);
    axc_group_kind k;
    CHECK_OK(axc_group_from_name("depth", &k));
    CHECK(k == AXC_GROUP_DEPTH);
    CHECK(axc_group_from_name("rows", &k) == AXC_ERR_INVALID);
    return ctest_summary("test_grid");
}
