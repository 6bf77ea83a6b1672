/* Records of pending gradients and summed-over marks (csrc/grads/records.c). Owners are heap
 * ints freed by the release function, so ASan reports one released twice or never. */
#include <stdlib.h>
#include <string.h>

#include "axc/records.h"
#include "ctest.h"

static int nreleased, last_released;
static axc_grad_records *g_reenter; /* a release that calls back in (as a Python __del__ may) */

static void release_owner(void *ctx, void *owner)
{
    (void)ctx;
    nreleased++;
    last_released = *(int *)owner;
    free(owner);
    if (g_reenter) { /* forgetting a mark from inside a release must not break the tables */
        axc_grad_records *r = g_reenter;
        g_reenter = NULL;
        CHECK_OK(axc_records_mark(r, 999, NULL, NULL));
    }
}

static void *own(int v)
{
    int *p = malloc(sizeof *p);
    *p = v;
    return p;
}

static int val(const void *p) { return p ? *(const int *)p : -1; }

static axc_groups groups(int n, axc_group_kind a, axc_group_kind b)
{
    axc_groups g = {.n = n};
    g.g[0] = a;
    g.g[1] = b;
    return g;
}

static axc_grad_record rec(uintptr_t key, int dw, int replace, axc_groups g)
{
    axc_grad_record r = {.key = key, .param = own((int)key), .dw = own(dw), .keep = NULL,
                         .replace = replace, .groups = g};
    return r;
}

int main(void)
{
    axc_grad_records *r = NULL;
    CHECK(axc_records_create(&r, NULL, NULL) == AXC_ERR_INVALID);
    CHECK_OK(axc_records_create(&r, release_owner, NULL));
    const axc_groups data = groups(1, AXC_GROUP_DATA, 0);
    const axc_groups none = groups(0, 0, 0);

    /* groups union: in order, without repeats */
    axc_groups u = groups(2, AXC_GROUP_DEPTH, AXC_GROUP_DATA), w = groups(2, AXC_GROUP_DATA, AXC_GROUP_ROW);
    axc_groups_union(&u, &w);
    CHECK(u.n == 3 && u.g[0] == AXC_GROUP_DEPTH && u.g[1] == AXC_GROUP_DATA && u.g[2] == AXC_GROUP_ROW);

    /* marks: set, replace (old stamp released), read, forget */
    CHECK_OK(axc_records_mark(r, 1, own(101), &data));
    CHECK(axc_records_marks(r) == 1);
    CHECK_OK(axc_records_mark(r, 1, own(102), &u));
    CHECK(nreleased == 1 && last_released == 101 && axc_records_marks(r) == 1);
    void *stamp = NULL;
    axc_groups got;
    CHECK(axc_records_marked(r, 1, &stamp, &got) && val(stamp) == 102 && got.n == 3);
    CHECK(!axc_records_marked(r, 2, NULL, NULL));
    CHECK_OK(axc_records_mark(r, 1, own(103), &none)); /* forgets; the new stamp goes too */
    CHECK(nreleased == 3 && axc_records_marks(r) == 0 && !axc_records_marked(r, 1, NULL, NULL));
    /* a synced mark: its scale (0 for a plain mark); its groups may be none */
    CHECK(axc_records_synced(r, 1, NULL) == 0);
    CHECK_OK(axc_records_mark_synced(r, 1, own(110), &none, 0.25, 7));
    CHECK(axc_records_marks(r) == 1 && axc_records_synced(r, 1, NULL) == 0.25 &&
          axc_records_marked(r, 1, &stamp, &got) && val(stamp) == 110 && got.n == 0);
    CHECK_OK(axc_records_mark_synced(r, 1, own(111), &data, 0.5, 9));
    unsigned long long gen = 0;
    CHECK(axc_records_synced(r, 1, &gen) == 0.5 && gen == 9);
    CHECK(nreleased == 4 && last_released == 110 && axc_records_synced(r, 1, NULL) == 0.5 &&
          axc_records_marked(r, 1, &stamp, &got) && val(stamp) == 111 && got.n == 1);
    CHECK_OK(axc_records_mark_synced(r, 2, own(120), &data, 1.0, 7));
    uintptr_t keys[2] = {0, 0};
    CHECK(axc_records_dated_keys(r, NULL, 0) == 2 && axc_records_dated_keys(r, keys, 1) == 2 &&
          (keys[0] == 1 || keys[0] == 2) && axc_records_dated_count(r) == 2);
    CHECK_OK(axc_records_mark(r, 2, NULL, NULL));
    CHECK(nreleased == 5 && axc_records_dated_keys(r, keys, 2) == 1 && keys[0] == 1 &&
          axc_records_dated_count(r) == 1);
    nreleased = 4;
    CHECK_OK(axc_records_mark(r, 1, own(112), &data)); /* a plain mark again: not synced */
    CHECK(nreleased == 5 && axc_records_synced(r, 1, NULL) == 0 && axc_records_marks(r) == 1 &&
          axc_records_dated_count(r) == 0);
    CHECK(axc_records_mark_synced(r, 1, own(113), &data, 0, 7) == AXC_ERR_INVALID && nreleased == 6);
    CHECK_OK(axc_records_mark(r, 1, NULL, NULL));
    CHECK(nreleased == 7 && axc_records_marks(r) == 0);
    /* the scale a .grad carries: 1 without a mark or for a plain one, a scaled mark's (not
     * synced), a synced mark's */
    CHECK(axc_records_scale(r, 1) == 1.0);
    CHECK_OK(axc_records_mark_scaled(r, 1, own(114), &data, 0.5, 12));
    CHECK(axc_records_scale(r, 1) == 0.5 && axc_records_synced(r, 1, NULL) == 0 &&
          axc_records_marked(r, 1, NULL, &got) && got.n == 1);
    /* a mark a sync made has a generation (a plain one none); init forgets every dated one */
    CHECK(axc_records_dated(r, 1, &gen) && gen == 12);
    CHECK(axc_records_dated_keys(r, keys, 2) == 1 && keys[0] == 1 &&
          axc_records_dated_count(r) == 1);
    CHECK_OK(axc_records_mark_synced(r, 1, own(115), &data, 0.25, 3));
    CHECK(axc_records_dated_count(r) == 1); /* (replaced: still one) */
    CHECK(axc_records_scale(r, 1) == 0.25 && nreleased == 8);
    CHECK(axc_records_dated(r, 1, &gen) && gen == 3);
    CHECK_OK(axc_records_mark(r, 1, own(116), &data));
    CHECK(axc_records_scale(r, 1) == 1.0 && nreleased == 9 && !axc_records_dated(r, 1, &gen) &&
          gen == 0 && axc_records_dated_keys(r, keys, 2) == 0 && axc_records_dated_count(r) == 0);
    CHECK(axc_records_mark_scaled(r, 1, own(117), &data, -1, 1) == AXC_ERR_INVALID &&
          nreleased == 10);
    /* unscaled (sync_gradients_depth_parallel(mean=False)): dated all the same */
    CHECK_OK(axc_records_mark_scaled(r, 1, own(119), &data, 1.0, 5));
    CHECK(axc_records_scale(r, 1) == 1.0 && axc_records_dated(r, 1, &gen) && gen == 5 &&
          nreleased == 11);
    nreleased = 10;
    /* a scaled mark without groups is kept (the .grad still carries the scale) */
    CHECK_OK(axc_records_mark_scaled(r, 1, own(118), &none, 0.5, 1));
    CHECK(nreleased == 11 && axc_records_scale(r, 1) == 0.5 && axc_records_marks(r) == 1);
    CHECK_OK(axc_records_mark(r, 1, NULL, NULL));
    CHECK(nreleased == 12 && axc_records_marks(r) == 0 && axc_records_scale(r, 1) == 1.0);
    nreleased = 3;
    axc_groups seven = {.n = AXC_GROUP_COUNT + 1};
    CHECK(axc_records_mark(r, 1, own(104), &seven) == AXC_ERR_INVALID && nreleased == 4);

    /* many marks (the table grows), removed in another order (backward-shift deletion) */
    for (uintptr_t k = 1000; k < 1300; k++)
        CHECK_OK(axc_records_mark(r, k * 64, own((int)k), &data));
    CHECK(axc_records_marks(r) == 300);
    for (uintptr_t k = 1000; k < 1300; k += 2)
        CHECK_OK(axc_records_mark(r, k * 64, NULL, NULL));
    int all_found = 1;
    for (uintptr_t k = 1001; k < 1300; k += 2)
        all_found &= axc_records_marked(r, k * 64, &stamp, NULL) && val(stamp) == (int)k;
    CHECK(all_found && axc_records_marks(r) == 150 && !axc_records_marked(r, 1000 * 64, NULL, NULL));

    /* records: in order, pending per key, the last one per key */
    nreleased = 0;
    CHECK(!axc_records_pending(r, 7) && axc_records_last(r, 7) == NULL);
    CHECK_OK(axc_records_add(r, &(axc_grad_record){.key = 7, .param = own(7), .dw = own(70),
                                                   .keep = own(700), .replace = 1, .groups = data}));
    axc_grad_record second = rec(8, 80, 0, none);
    CHECK_OK(axc_records_add(r, &second));
    CHECK(axc_records_pending(r, 7) && axc_records_pending(r, 8) && axc_records_count(r) == 2);
    /* (_add_after_pending: another gradient of key 7 after its pending record) */
    const axc_grad_record *last = axc_records_last(r, 7);
    CHECK(last && last->replace == 1 && last->groups.n == 1 && val(last->dw) == 70);
    CHECK_OK(axc_records_take(r, &(axc_taken_grad){7, own(7), own(71), own(72)}));
    CHECK(axc_records_take(r, &(axc_taken_grad){7, own(7), NULL, own(73)}) == AXC_ERR_STATE);
    CHECK(nreleased == 2 && axc_records_is_taken(r, 7) && axc_records_taken(r) == 1);
    axc_grad_record third = rec(7, 74, 0, last->groups);
    CHECK_OK(axc_records_add(r, &third));
    CHECK(axc_records_last(r, 7)->replace == 0);
    /* a taken .grad without a record (put back at the end) */
    CHECK_OK(axc_records_take(r, &(axc_taken_grad){9, own(9), NULL, own(92)}));
    CHECK(axc_records_add(r, &(axc_grad_record){.key = 5, .param = own(5)}) == AXC_ERR_INVALID);
    CHECK(nreleased == 3);

    /* finishing: records in order; key 7's taken .grad is dropped, key 9's is put back */
    axc_records_pass p;
    nreleased = 0;
    CHECK_OK(axc_records_detach(r, 1, &p));
    CHECK(p.nrecs == 3 && val(p.recs[0].dw) == 70 && val(p.recs[1].dw) == 80 && val(p.recs[2].dw) == 74);
    CHECK(p.nrestore == 1 && p.restore[0].key == 9 && p.restore[0].prev == NULL && p.ndrop == 3);
    CHECK(axc_records_count(r) == 0 && axc_records_taken(r) == 0 && !axc_records_pending(r, 7));
    CHECK(axc_records_marks(r) == 150 && nreleased == 0); /* (marks stay) */
    axc_records_pass_release(r, &p);
    CHECK(nreleased == 3 * 2 + 1 /* keep */ + 2 /* restore: param, scratch */ + 3 && p.nrecs == 0);

    /* abandoned: every taken .grad is put back, also one with a record */
    CHECK_OK(axc_records_add(r, &(axc_grad_record){.key = 7, .param = own(7), .dw = own(75), .replace = 1}));
    CHECK_OK(axc_records_take(r, &(axc_taken_grad){7, own(7), own(76), own(77)}));
    CHECK_OK(axc_records_detach(r, 0, &p));
    CHECK(p.nrecs == 1 && p.nrestore == 1 && val(p.restore[0].prev) == 76 && p.ndrop == 0);
    axc_records_pass_release(r, &p);

    /* chunk records: count calls, open with the count, complete after the last call */
    CHECK_OK(axc_records_expect_chunk(r, 20, own(20)));
    CHECK_OK(axc_records_expect_chunk(r, 20, own(20)));
    CHECK_OK(axc_records_expect_chunk(r, 21, own(21)));
    /* a forward run ahead counts into its own table, handed over after the pass */
    axc_chunk_counts *ahead = NULL;
    CHECK_OK(axc_chunk_counts_create(&ahead));
    CHECK(axc_records_count_into(r, ahead) == NULL);
    CHECK_OK(axc_records_expect_chunk(r, 20, own(20)));
    CHECK(axc_records_count_into(r, NULL) == ahead);
    CHECK(axc_records_chunk_open(r, 20, 3, 2) == AXC_ERR_STATE); /* no record yet */
    CHECK_OK(axc_records_add(r, &(axc_grad_record){.key = 20, .param = own(20), .dw = own(200),
                                                   .replace = 1, .groups = data}));
    long left = axc_records_take_count(r, 20);
    CHECK(left == 2 && axc_records_take_count(r, 20) == 0);
    CHECK_OK(axc_records_chunk_open(r, 20, 3, left));
    CHECK(axc_records_chunk_open(r, 20, 3, left) == AXC_ERR_STATE);
    CHECK(val(axc_records_chunk_dw(r, 20)) == 200 && axc_records_chunk_dw(r, 21) == NULL);
    CHECK(axc_records_chunks_open(r) == 1);
    int64_t bucket = -7;
    CHECK(axc_records_chunk_done(r, 20, &bucket) == 0 && bucket == -7);
    CHECK(axc_records_chunk_done(r, 20, &bucket) == 1 && bucket == 3);
    CHECK(axc_records_chunks_open(r) == 0 && axc_records_chunk_dw(r, 20) == NULL);
    CHECK(axc_records_chunk_done(r, 20, &bucket) == 0 && axc_records_pending(r, 20));
    /* an unknown count (0): open until the end of the pass */
    CHECK_OK(axc_records_add(r, &(axc_grad_record){.key = 22, .param = own(22), .dw = own(220)}));
    CHECK_OK(axc_records_chunk_open(r, 22, -1, axc_records_take_count(r, 22)));
    CHECK(axc_records_chunk_done(r, 22, &bucket) == 0 && axc_records_chunks_open(r) == 1);
    CHECK_OK(axc_records_detach(r, 1, &p)); /* also forgets key 21's count */
    CHECK(p.nrecs == 2 && axc_records_chunks_open(r) == 0 && axc_records_take_count(r, 21) == 0);
    axc_records_pass_release(r, &p);
    CHECK_OK(axc_records_add_counts(r, ahead));
    CHECK(axc_records_take_count(r, 20) == 1);
    axc_chunk_counts_destroy(ahead, r);

    /* the pass */
    CHECK(axc_records_pass_task(r) == AXC_NO_PASS && axc_records_pass_owner(r) == NULL);
    axc_records_set_pass(r, 4, own(400));
    axc_records_set_pass(r, 5, own(500));
    CHECK(axc_records_pass_task(r) == 5 && val(axc_records_pass_owner(r)) == 500 && last_released == 400);
    axc_records_set_task(r, AXC_NO_PASS); /* (the owner stays) */
    CHECK(axc_records_pass_task(r) == AXC_NO_PASS && val(axc_records_pass_owner(r)) == 500);

    /* a release that calls back in while a mark is replaced */
    CHECK_OK(axc_records_mark(r, 999, own(9990), &data));
    CHECK_OK(axc_records_mark(r, 998, own(9980), &data));
    g_reenter = r;
    CHECK_OK(axc_records_mark(r, 998, own(9981), &data)); /* releases 9980, which forgets 999 */
    CHECK(!axc_records_marked(r, 999, NULL, NULL) && axc_records_marked(r, 998, &stamp, NULL)
          && val(stamp) == 9981);

    /* clear forgets what is pending and the pass, not the marks */
    CHECK_OK(axc_records_add(r, &(axc_grad_record){.key = 30, .param = own(30), .dw = own(300)}));
    CHECK_OK(axc_records_expect_chunk(r, 31, own(31)));
    axc_records_clear(r);
    CHECK(axc_records_count(r) == 0 && axc_records_pass_task(r) == AXC_NO_PASS && axc_records_pass_owner(r) == NULL
          && axc_records_marks(r) == 151);
    axc_records_destroy(r); /* releases the marks (ASan: nothing leaks) */
    axc_records_destroy(NULL);
    return ctest_summary("test_records");
}
