/*
 * The launcher's mesh choice (src/elastic/mesh_choice.h) among the meshes a trainer lists as
 * valid. The lists below are what moe_train --print-config --print-meshes prints for the
 * shapes named (its own trainer_config_validate decides; the chaos trials run that end to
 * end); each test works its answer out by hand: the largest world with a valid mesh, the mesh
 * nearest the job's, the microbatches nearest the job's.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "elastic/mesh_choice.h"

#define N(a) (sizeof(a) / sizeof *(a))

/* The tiny model of the chaos trials (E=4, F=16, L=4, B=8, v=1), worlds 1..4, as moe_train
 * lists it: no world of 3 (E, F, L and B are powers of two). */
static const el_mesh_t tiny_valid[] = {
    {1, 1, 1, 1, 1}, {1, 1, 1, 1, 2}, {1, 1, 1, 1, 4}, {1, 1, 1, 1, 8}, {1, 1, 2, 1, 1},
    {1, 1, 2, 1, 2}, {1, 1, 2, 1, 4}, {1, 1, 1, 2, 1}, {1, 1, 1, 2, 2}, {1, 1, 1, 2, 4},
    {1, 1, 1, 2, 8}, {1, 2, 1, 1, 1}, {1, 2, 1, 1, 2}, {1, 2, 1, 1, 4}, {2, 1, 1, 1, 1},
    {2, 1, 1, 1, 2}, {2, 1, 1, 1, 4}, {2, 1, 1, 1, 8}, {1, 1, 4, 1, 1}, {1, 1, 4, 1, 2},
    {1, 1, 2, 2, 1}, {1, 1, 2, 2, 2}, {1, 1, 2, 2, 4}, {1, 1, 1, 4, 1}, {1, 1, 1, 4, 2},
    {1, 1, 1, 4, 4}, {1, 1, 1, 4, 8}, {1, 2, 2, 1, 1}, {1, 2, 2, 1, 2}, {1, 2, 1, 2, 1},
    {1, 2, 1, 2, 2}, {1, 2, 1, 2, 4}, {1, 4, 1, 1, 1}, {1, 4, 1, 1, 2}, {2, 1, 2, 1, 1},
    {2, 1, 2, 1, 2}, {2, 1, 2, 1, 4}, {2, 1, 1, 2, 1}, {2, 1, 1, 2, 2}, {2, 1, 1, 2, 4},
    {2, 1, 1, 2, 8}, {2, 2, 1, 1, 1}, {2, 2, 1, 1, 2}, {2, 2, 1, 1, 4}, {4, 1, 1, 1, 1},
    {4, 1, 1, 1, 2}, {4, 1, 1, 1, 4}, {4, 1, 1, 1, 8}};

static el_model_shape_t tiny(el_mesh_t job)
{
    return (el_model_shape_t){.job = job, .valid = tiny_valid, .n_valid = N(tiny_valid)};
}

static void expect(const el_model_shape_t *s, int64_t max_world, el_mesh_t want)
{
    el_mesh_t got;
    assert_int_equal(el_choose_mesh(s, max_world, 1, &got), MOE_STATUS_SUCCESS);
    assert_int_equal(got.tp, want.tp);
    assert_int_equal(got.ep, want.ep);
    assert_int_equal(got.dp, want.dp);
    assert_int_equal(got.pp, want.pp);
    assert_int_equal(got.microbatches, want.microbatches);
}

/* the job's own world gives the job's own mesh */
static void test_full_world_keeps_the_mesh(void **state)
{
    (void)state;
    el_model_shape_t s = tiny((el_mesh_t){1, 2, 1, 2, 2});
    expect(&s, 4, (el_mesh_t){1, 2, 1, 2, 2});
}

/* 3 ranks: none listed, so the world is 2; ep=2 is kept (distance 0 on ep, 1 on pp) over pp=2
 * (1 on ep, weighted higher) */
static void test_three_ranks_give_two(void **state)
{
    (void)state;
    el_model_shape_t s = tiny((el_mesh_t){1, 2, 1, 2, 2});
    expect(&s, 3, (el_mesh_t){1, 2, 1, 1, 2});
}

/* one rank: everything on it, the microbatches kept */
static void test_one_rank(void **state)
{
    (void)state;
    el_model_shape_t s = tiny((el_mesh_t){1, 2, 1, 2, 2});
    expect(&s, 1, (el_mesh_t){1, 1, 1, 1, 2});
}

/* tp is kept first: job tp=2 x ep=2 x pp=2 on 4 ranks keeps tp=2 and ep=2, drops pp */
static void test_tp_is_kept(void **state)
{
    (void)state;
    el_model_shape_t s = tiny((el_mesh_t){2, 2, 1, 2, 2});
    expect(&s, 4, (el_mesh_t){2, 2, 1, 1, 2});
}

/* B=12, m=4, job ep=2 x dp=4 (8 ranks); on 6 ranks ep=2 x dp=3 lists m in {1, 2} (B % (2*3*m)):
 * m=2 is the nearest to 4; ep=1 x dp=6 (m in {1, 2}) is further on ep */
static void test_microbatches_change_to_keep_the_batch(void **state)
{
    (void)state;
    static const el_mesh_t valid[] = {
        {1, 1, 6, 1, 1}, {1, 1, 6, 1, 2}, {1, 2, 3, 1, 1}, {1, 2, 3, 1, 2}, {1, 2, 4, 1, 1}};
    el_model_shape_t s = {.job = {1, 2, 4, 1, 4}, .valid = valid, .n_valid = N(valid)};
    expect(&s, 6, (el_mesh_t){1, 2, 3, 1, 2});
}

/* a tie on the microbatches' distance (1 and 4 are both a factor of two from 2): the larger */
static void test_microbatch_tie_takes_the_larger(void **state)
{
    (void)state;
    static const el_mesh_t valid[] = {{1, 1, 2, 1, 1}, {1, 1, 2, 1, 4}};
    el_model_shape_t s = {.job = {1, 1, 2, 1, 2}, .valid = valid, .n_valid = N(valid)};
    expect(&s, 2, (el_mesh_t){1, 1, 2, 1, 4});
}

/* nothing listed in the range: NOT_FOUND; bad arguments: INVALID_ARGUMENT */
static void test_no_mesh(void **state)
{
    (void)state;
    el_model_shape_t s = tiny((el_mesh_t){1, 2, 1, 2, 2});
    el_mesh_t got;
    assert_int_equal(el_choose_mesh(&s, 3, 3, &got), MOE_STATUS_NOT_FOUND);
    assert_non_null(strstr(moe_last_error(), "3..3"));
    assert_int_equal(el_choose_mesh(NULL, 4, 1, &got), MOE_STATUS_INVALID_ARGUMENT);
    el_mesh_t bad = {1, 0, 1, 1, 1};
    s.valid = &bad;
    s.n_valid = 1;
    assert_int_equal(el_choose_mesh(&s, 4, 1, &got), MOE_STATUS_INVALID_ARGUMENT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_world_keeps_the_mesh),
        cmocka_unit_test(test_three_ranks_give_two),
        cmocka_unit_test(test_one_rank),
        cmocka_unit_test(test_tp_is_kept),
        cmocka_unit_test(test_microbatches_change_to_keep_the_batch),
        cmocka_unit_test(test_microbatch_tie_takes_the_larger),
        cmocka_unit_test(test_no_mesh),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
