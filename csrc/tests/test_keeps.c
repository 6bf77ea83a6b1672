/* Keep-alive lists (csrc/grads/keeps.c): release in order once the number is done, per kind. */
#include <string.h>

#include "axc/keeps.h"
#include "ctest.h"

static int released[64], nreleased;

static void note_release(void *ctx, void *owner)
{
    (void)ctx;
    released[nreleased++ % 64] = (int)(intptr_t)owner;
}

#define OWNER(i) ((void *)(intptr_t)(i))

int main(void)
{
    axc_keeps *k = NULL;
    CHECK_OK(axc_keeps_create(&k, note_release, NULL));
    CHECK_OK(axc_keeps_add(k, AXC_KEEP_TASK, 1, OWNER(11)));
    CHECK_OK(axc_keeps_add(k, AXC_KEEP_TASK, 2, OWNER(12)));
    CHECK_OK(axc_keeps_add(k, AXC_KEEP_RESULT, 1, OWNER(21)));
    CHECK_OK(axc_keeps_add(k, AXC_KEEP_OUTPUT, 3, OWNER(31)));
    CHECK(axc_keeps_count(k, AXC_KEEP_TASK) == 2 && axc_keeps_count(k, AXC_KEEP_OUTPUT) == 1);

    /* task 1 ran, no result done: only owner 11 goes */
    axc_keeps_release_done(k, 1, 0);
    CHECK(nreleased == 1 && released[0] == 11 && axc_keeps_count(k, AXC_KEEP_TASK) == 1);
    /* results up to 2: result 1 goes, the output of result 3 stays */
    axc_keeps_release_done(k, 1, 2);
    CHECK(nreleased == 2 && released[1] == 21 && axc_keeps_count(k, AXC_KEEP_OUTPUT) == 1);
    axc_keeps_release_done(k, 5, 3);
    CHECK(nreleased == 4 && released[2] == 12 && released[3] == 31);
    CHECK(axc_keeps_count(k, AXC_KEEP_TASK) == 0 && axc_keeps_count(k, AXC_KEEP_RESULT) == 0);

    /* in order: an entry behind one that is not done waits */
    CHECK_OK(axc_keeps_add(k, AXC_KEEP_TASK, 9, OWNER(40)));
    CHECK_OK(axc_keeps_add(k, AXC_KEEP_TASK, 6, OWNER(41)));
    axc_keeps_release_done(k, 7, 0);
    CHECK(nreleased == 4 && axc_keeps_count(k, AXC_KEEP_TASK) == 2);

    /* many entries, released part-way and added again (the FIFO slides and grows) */
    for (int i = 0; i < 100; i++)
        CHECK_OK(axc_keeps_add(k, AXC_KEEP_RESULT, (uint64_t)(10 + i), OWNER(100 + i)));
    axc_keeps_release_done(k, 0, 59);
    CHECK(axc_keeps_count(k, AXC_KEEP_RESULT) == 50);
    for (int i = 0; i < 40; i++)
        CHECK_OK(axc_keeps_add(k, AXC_KEEP_RESULT, (uint64_t)(200 + i), OWNER(300 + i)));
    CHECK(axc_keeps_count(k, AXC_KEEP_RESULT) == 90);
    int before = nreleased;
    axc_keeps_clear(k);
    CHECK(nreleased - before == 92 && axc_keeps_count(k, AXC_KEEP_TASK) == 0);

    /* names, and a bad kind releases what it was given */
    axc_keep_kind kind;
    CHECK_OK(axc_keep_kind_from_name("output", &kind));
    CHECK(kind == AXC_KEEP_OUTPUT);
    CHECK(axc_keep_kind_from_name("tasks", &kind) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "task, result or output") != NULL);
    before = nreleased;
    CHECK(axc_keeps_add(k, (axc_keep_kind)7, 1, OWNER(5)) == AXC_ERR_INVALID);
    CHECK(nreleased == before + 1);
    CHECK_OK(axc_keeps_add(k, AXC_KEEP_TASK, 1, OWNER(6)));
    axc_keeps_destroy(k); /* releases what is left */
    CHECK(nreleased == before + 2);
    axc_keeps_destroy(NULL);
    return ctest_summary("test_keeps");
}
