/*
 * The launcher's mesh choice (src/elastic/mesh_choice.h) on the tiny model of the chaos tests
 * (E=4, F=16, L=4, B=8, m=2, the job's mesh ep=2 x pp=2) and on shapes whose answer is worked
 * out by hand below: the largest valid world, the mesh nearest the job's, the global batch kept.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "elastic/mesh_choice.h"

static const el_model_shape_t tiny = {.experts = 4, .ffn_hidden = 16, .layers = 4,
                                      .virtual_stages = 1, .batch = 8,
                                      .job = {.tp = 1, .ep = 2, .dp = 1, .pp = 2,
                                              .microbatches = 2}};

static void expect(const el_model_shape_t *s, int64_t max_world, el_mesh_t want)
{
    el_mesh_t got;
    assert_int_equal(el_choose_mesh(s, max_world, 1, &got), MOE_STATUS_SUCCESS);
    assert_int_equal(got.tp, want.tp);
    assert_int_equal(got.ep, want.ep);
    assert_int_equal(got.dp, want.dp);
    assert_int_equal(got.pp, want.pp);
    assert_int_equal(got.microbatches, want.microbatches);
    assert_true(el_mesh_valid(s, &got));
}

/* the job's own world gives the job's own mesh */
static void test_full_world_keeps_the_mesh(void **state)
{
    (void)state;
    expect(&tiny, 4, (el_mesh_t){1, 2, 1, 2, 2});
}

/* 3 ranks: tp=3 (F=16), ep=3 (E=4), dp=3 (B=8) and pp=3 (L=4) are all invalid, so the world is
 * 2; ep=2 is kept (distance 0 on ep, 1 on pp) over pp=2 (1 on ep, weighted higher) */
static void test_three_ranks_give_two(void **state)
{
    (void)state;
    expect(&tiny, 3, (el_mesh_t){1, 2, 1, 1, 2});
}

/* one rank: everything on it, the microbatches kept */
static void test_one_rank(void **state)
{
    (void)state;
    expect(&tiny, 1, (el_mesh_t){1, 1, 1, 1, 2});
}

/* B=12, m=4, job dp=4 x ep=2 (8 ranks); on 6 ranks ep=2 x dp=3 needs B % (2*3*m) == 0: m=2
 * (m=4 and m=3 do not divide), the nearest valid count to 4 */
static void test_microbatches_change_to_keep_the_batch(void **state)
{
    (void)state;
    el_model_shape_t s = {.experts = 8, .ffn_hidden = 8, .layers = 2, .virtual_stages = 1,
                          .batch = 12, .job = {.tp = 1, .ep = 2, .dp = 4, .pp = 1,
                                               .microbatches = 4}};
    expect(&s, 6, (el_mesh_t){1, 2, 3, 1, 2});
}

/* tp is kept first: job tp=2 x ep=2 x pp=2 on 4 ranks keeps tp=2 and ep=2, drops pp */
static void test_tp_is_kept(void **state)
{
    (void)state;
    el_model_shape_t s = {.experts = 4, .ffn_hidden = 16, .layers = 4, .virtual_stages = 1,
                          .batch = 8, .job = {.tp = 2, .ep = 2, .dp = 1, .pp = 2,
                                              .microbatches = 2}};
    expect(&s, 4, (el_mesh_t){2, 2, 1, 1, 2});
}

/* interleaved 1F1B (v=2) needs pp >= 2 and m % pp == 0; L=8, v=2: pp in {2, 4} */
static void test_virtual_stages(void **state)
{
    (void)state;
    el_model_shape_t s = {.experts = 2, .ffn_hidden = 8, .layers = 8, .virtual_stages = 2,
                          .batch = 8, .job = {.tp = 1, .ep = 1, .dp = 1, .pp = 4,
                                              .microbatches = 4}};
    expect(&s, 3, (el_mesh_t){1, 1, 1, 2, 4});
}

/* nothing valid in the range: NOT_FOUND naming the shape */
static void test_no_mesh(void **state)
{
    (void)state;
    el_model_shape_t s = tiny;
    s.virtual_stages = 2; /* needs pp >= 2: no world of one */
    el_mesh_t got;
    assert_int_equal(el_choose_mesh(&s, 1, 1, &got), MOE_STATUS_NOT_FOUND);
    assert_non_null(strstr(moe_last_error(), "v=2"));
    assert_int_equal(el_choose_mesh(NULL, 4, 1, &got), MOE_STATUS_INVALID_ARGUMENT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_world_keeps_the_mesh),
        cmocka_unit_test(test_three_ranks_give_two),
        cmocka_unit_test(test_one_rank),
        cmocka_unit_test(test_microbatches_change_to_keep_the_batch),
        cmocka_unit_test(test_tp_is_kept),
        cmocka_unit_test(test_virtual_stages),
        cmocka_unit_test(test_no_mesh),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
