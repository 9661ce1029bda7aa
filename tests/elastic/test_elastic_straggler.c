/*
 * The launcher's straggler rule (tools/elastic/straggler.h) on tables of busy times worked out
 * by hand: one step's judgement (the median, the robust sigma with its floor, the ratio and the
 * minimum gap), then the tracker over whole runs (a rank that turns slow is found at the step
 * its moving median and the run of steps say; a spike of one step is not; steps a rank's key
 * no longer holds are skipped), the busy pairs of a member key, the option parser and the
 * committed checkpoint of a folder.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "straggler.h"

static straggler_config_t config(double sigma, double ratio, int steps, int window,
                                 double min_gap_s)
{
    straggler_config_t c;
    straggler_config_default(&c);
    c.sigma = sigma;
    c.ratio = ratio;
    c.steps = steps;
    c.window = window;
    c.min_gap_s = min_gap_s;
    return c;
}

/* 5 ranks, one at 0.180 s: median 0.101; deviations 0.001 0.001 0.003 0 0.079, their median
 * 0.001, so sigma 1.4826e-3, below its floor 5% x 0.101 = 0.00505; limit 0.101 + 3 x 0.00505
 * = 0.11615 (above the 10 ms gap's 0.111): only the last rank is over. */
static void test_judge_sigma_with_its_floor(void **state)
{
    (void)state;
    straggler_config_t c = config(3, 0, 5, 5, 0.010);
    const double b[] = {0.100, 0.102, 0.098, 0.101, 0.180};
    bool over[5];
    straggler_verdict_t v;
    straggler_judge(&c, b, 5, over, &v);
    assert_float_equal(v.median, 0.101, 1e-12);
    assert_float_equal(v.sigma, 0.00505, 1e-12);
    assert_float_equal(v.limit, 0.11615, 1e-12);
    for (int r = 0; r < 5; r++) assert_int_equal(over[r], r == 4);
}

/* A wide spread: 4 ranks 1.0 1.2 0.8 1.1 and a fifth at 2.0: median 1.1, deviations 0.1 0.1
 * 0.3 0 0.9, their median 0.1: sigma 0.14826 (above the floor 0.055), limit 1.1 + 3 x 0.14826
 * = 1.54478: the fifth is over; with k = 7 (limit 2.13782) nobody is. */
static void test_judge_sigma_from_the_spread(void **state)
{
    (void)state;
    const double b[] = {1.0, 1.2, 0.8, 1.1, 2.0};
    bool over[5];
    straggler_verdict_t v;
    straggler_config_t c = config(3, 0, 5, 5, 0);
    straggler_judge(&c, b, 5, over, &v);
    assert_float_equal(v.sigma, 0.14826, 1e-9);
    assert_float_equal(v.limit, 1.54478, 1e-9);
    for (int r = 0; r < 5; r++) assert_int_equal(over[r], r == 4);
    c.sigma = 7;
    straggler_judge(&c, b, 5, over, &v);
    for (int r = 0; r < 5; r++) assert_false(over[r]);
}

/* The ratio replaces the sigma rule: 1.4 is under 1.5 x 1.0, 1.6 over. */
static void test_judge_ratio(void **state)
{
    (void)state;
    straggler_config_t c = config(3, 1.5, 5, 5, 0);
    bool over[4];
    straggler_verdict_t v;
    const double under[] = {1.0, 1.0, 1.0, 1.4};
    straggler_judge(&c, under, 4, over, &v);
    assert_float_equal(v.limit, 1.5, 1e-12);
    for (int r = 0; r < 4; r++) assert_false(over[r]);
    const double above[] = {1.0, 1.0, 1.0, 1.6};
    straggler_judge(&c, above, 4, over, &v);
    for (int r = 0; r < 4; r++) assert_int_equal(over[r], r == 3);
}

/* Short steps: 9 ms against 2 ms is 4.5x, but within the 10 ms minimum gap (limit 12 ms); with
 * no gap the sigma rule (floor 0.1 ms) flags it. */
static void test_judge_minimum_gap(void **state)
{
    (void)state;
    const double b[] = {0.002, 0.002, 0.002, 0.009};
    bool over[4];
    straggler_verdict_t v;
    straggler_config_t c = config(3, 0, 5, 5, 0.010);
    straggler_judge(&c, b, 4, over, &v);
    assert_float_equal(v.limit, 0.012, 1e-12);
    assert_false(over[3]);
    c.min_gap_s = 0;
    straggler_judge(&c, b, 4, over, &v);
    assert_true(over[3]);
}

/* Two ranks: each sits one deviation from their median, so the sigma rule flags neither (the
 * documented limit); the ratio does. */
static void test_judge_two_ranks(void **state)
{
    (void)state;
    const double b[] = {1.0, 3.0};
    bool over[2];
    straggler_verdict_t v;
    straggler_config_t c = config(3, 0, 5, 5, 0);
    straggler_judge(&c, b, 2, over, &v);
    assert_false(over[0] || over[1]);
    c.ratio = 1.4; /* limit 2.8 */
    straggler_judge(&c, b, 2, over, &v);
    assert_true(!over[0] && over[1]);
}

/* A run of 4 ranks over 40 steps: busy 10 ms with a deterministic +-0.5 ms wobble, rank 2 at
 * 30 ms from step 11 on. Rank 2's moving median (window 5) is above the limit from step 13 (3
 * of its last 5 steps slow), so its fifth step in a row above it is step 17. */
static double wobble(int r, int64_t s)
{
    return 0.010 + 0.00025 * (double)((r * 7 + s * 3) % 5 - 2);
}

/* Feeds that run step by step, rank 1 missing steps [gap_from, gap_to] (its key moved past
 * them), judging after each; returns the only finding. */
static straggler_finding_t turned_slow(int64_t gap_from, int64_t gap_to)
{
    straggler_config_t c = config(3, 0, 5, 5, 0.005);
    straggler_tracker_t t;
    assert_int_equal(straggler_tracker_init(&t, &c, 4), 0);
    straggler_finding_t f, found = {.rank = -1};
    for (int64_t s = 1; s <= 40; s++) {
        for (int r = 0; r < 4; r++)
            if (r != 1 || s < gap_from || s > gap_to)
                straggler_tracker_add(&t, r, s, r == 2 && s >= 11 ? 0.030 : wobble(r, s));
        if (straggler_tracker_judge(&t, &f)) {
            assert_int_equal(found.rank, -1); /* reported once */
            found = f;
        }
    }
    straggler_tracker_free(&t);
    return found;
}

static void test_tracker_finds_a_rank_turned_slow(void **state)
{
    (void)state;
    straggler_finding_t f = turned_slow(0, -1);
    assert_int_equal(f.rank, 2);
    assert_int_equal(f.step, 17);
    assert_int_equal(f.steps, 5);
    assert_float_equal(f.busy_s, 0.030, 1e-12);
    assert_true(f.median_s > 0.0095 && f.median_s < 0.0105);
}

/* The same, fed as the launcher reads it: every 7 steps, each rank's key holding its last 16
 * (moe/elastic.h); the finding is the same step. */
static void test_tracker_fed_in_batches(void **state)
{
    (void)state;
    straggler_config_t c = config(3, 0, 5, 5, 0.005);
    straggler_tracker_t t;
    assert_int_equal(straggler_tracker_init(&t, &c, 4), 0);
    straggler_finding_t f;
    int findings = 0;
    for (int64_t now = 7; now <= 42; now += 7) {
        for (int r = 0; r < 4; r++)
            for (int64_t s = now - 15 > 1 ? now - 15 : 1; s <= now; s++)
                straggler_tracker_add(&t, r, s, r == 2 && s >= 11 ? 0.030 : wobble(r, s));
        while (straggler_tracker_judge(&t, &f)) {
            findings++;
            assert_int_equal(f.rank, 2);
            assert_int_equal(f.step, 17);
        }
    }
    assert_int_equal(findings, 1);
    straggler_tracker_free(&t);
}

/* One slow step in every 3 on rotating ranks (a descheduled process): a moving median of 5
 * never holds more than 2 of them, so nobody is found. */
static void test_tracker_ignores_spikes(void **state)
{
    (void)state;
    straggler_config_t c = config(3, 0, 5, 5, 0.005);
    straggler_tracker_t t;
    assert_int_equal(straggler_tracker_init(&t, &c, 4), 0);
    straggler_finding_t f;
    for (int64_t s = 1; s <= 200; s++) {
        for (int r = 0; r < 4; r++)
            straggler_tracker_add(&t, r, s, s % 3 == 0 && r == (int)(s / 3) % 4 ? 0.5 : 0.010);
        assert_false(straggler_tracker_judge(&t, &f));
    }
    straggler_tracker_free(&t);
}

/* A step one rank's key has moved past (it was never read) is skipped, neither above nor
 * below the limit: rank 1 misses steps 14..16, so the slow rank's run of judged steps is 13,
 * 17, 18, 19, 20 and it is found at step 20 (17 with every step). */
static void test_tracker_skips_steps_not_held(void **state)
{
    (void)state;
    straggler_finding_t f = turned_slow(14, 16);
    assert_int_equal(f.rank, 2);
    assert_int_equal(f.step, 20);
}

/* The busy pairs of a member key's value. */
static void test_take_member_value(void **state)
{
    (void)state;
    straggler_config_t c = config(3, 0, 1, 1, 0.005);
    straggler_tracker_t t;
    assert_int_equal(straggler_tracker_init(&t, &c, 2), 0);
    const char *values[2] = {
        "{\"slot\":0,\"rank\":0,\"step\":2,\"busy\":[[1,0.01],[2,0.01]]}",
        "{\"slot\":3,\"rank\":1,\"step\":2,\"busy\":[[1,0.01],[2,\"x\"],[\"y\",1]]}"};
    for (int r = 0; r < 2; r++) {
        cJSON *o = cJSON_Parse(values[r]);
        assert_non_null(o);
        straggler_tracker_take(&t, r, o);
        cJSON_Delete(o);
    }
    assert_int_equal(t.latest[0], 2);
    assert_int_equal(t.latest[1], 1); /* the malformed pairs are ignored */
    straggler_finding_t f;
    assert_false(straggler_tracker_judge(&t, &f));
    assert_int_equal(t.next, 2); /* step 1 judged; step 2 waits for rank 1 */
    straggler_tracker_free(&t);
}

static void test_options(void **state)
{
    (void)state;
    straggler_config_t c;
    straggler_config_default(&c);
    assert_int_equal(c.policy, STRAGGLER_WARN);
    char err[256];
    assert_int_equal(straggler_parse_option(&c, "--slots", "4", err, sizeof err), 0);
    assert_int_equal(straggler_parse_option(&c, "--straggler-policy", "replace", err, sizeof err),
                     1);
    assert_int_equal(c.policy, STRAGGLER_REPLACE);
    assert_int_equal(straggler_parse_option(&c, "--straggler-ratio", "2.5", err, sizeof err), 1);
    assert_float_equal(c.ratio, 2.5, 0);
    assert_int_equal(straggler_parse_option(&c, "--straggler-min-gap-ms", "20", err, sizeof err),
                     1);
    assert_float_equal(c.min_gap_s, 0.020, 1e-15);
    assert_int_equal(straggler_parse_option(&c, "--straggler-steps", "3", err, sizeof err), 1);
    assert_int_equal(c.steps, 3);
    assert_int_equal(straggler_parse_option(&c, "--straggler-policy", "kill", err, sizeof err), -1);
    assert_non_null(strstr(err, "--straggler-policy"));
    assert_int_equal(straggler_parse_option(&c, "--straggler-steps", "2.5", err, sizeof err), -1);
    assert_int_equal(straggler_parse_option(&c, "--straggler-window", "33", err, sizeof err), -1);
    assert_int_equal(straggler_parse_option(&c, "--straggler-ratio", "1", err, sizeof err), -1);
    assert_int_equal(straggler_parse_option(&c, "--straggler-sigma", NULL, err, sizeof err), -1);
    assert_int_equal(straggler_parse_option(&c, "--straggler-bogus", "1", err, sizeof err), -1);
}

/* The newest step-<N>/ with its commit marker; a step without one is not committed. */
static void test_committed_step(void **state)
{
    (void)state;
    char dir[] = "/tmp/moe-straggler-XXXXXX", path[512];
    assert_non_null(mkdtemp(dir));
    assert_int_equal(straggler_committed_step(dir), -1);
    const char *steps[] = {"step-000000000010", "step-000000000020", "step-000000000030"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, steps[i]);
        assert_int_equal(mkdir(path, 0700), 0);
        if (i == 2) continue; /* written, not committed */
        snprintf(path, sizeof path, "%s/%s/manifest.json", dir, steps[i]);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fclose(f);
    }
    assert_int_equal(straggler_committed_step(dir), 20);
    assert_int_equal(straggler_committed_step("/nonexistent/moe"), -1);
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s/manifest.json", dir, steps[i]);
        unlink(path);
        snprintf(path, sizeof path, "%s/%s", dir, steps[i]);
        rmdir(path);
    }
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_judge_sigma_with_its_floor),
        cmocka_unit_test(test_judge_sigma_from_the_spread),
        cmocka_unit_test(test_judge_ratio),
        cmocka_unit_test(test_judge_minimum_gap),
        cmocka_unit_test(test_judge_two_ranks),
        cmocka_unit_test(test_tracker_finds_a_rank_turned_slow),
        cmocka_unit_test(test_tracker_fed_in_batches),
        cmocka_unit_test(test_tracker_ignores_spikes),
        cmocka_unit_test(test_tracker_skips_steps_not_held),
        cmocka_unit_test(test_take_member_value),
        cmocka_unit_test(test_options),
        cmocka_unit_test(test_committed_step),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
