/*
 * The 1F1B schedule generator, without communication.
 *
 * For every p in 1..8 and m in 1..32 and every stage s:
 *  - 2m compute actions: one forward and one backward of each microbatch, forward first;
 *  - the first min(p-s-1, m) computes are forwards (warm-up), then forwards and backwards
 *    alternate, then backwards (cool-down);
 *  - the activations held (forwards done minus backwards done) peak at exactly min(p-s, m);
 *  - every receive comes right before the compute that consumes it, every send right after
 *    the compute that produced it, with the adjacent stage as peer.
 * Then all p stages run together in a tick simulation (one compute per stage per tick, a
 * message sent in tick t can be received from tick t+1, sends never block): every send meets a
 * receive of the same microbatch and kind in order on its channel, nothing is left over, no
 * tick passes without progress (no deadlock), and with unit costs the batch takes exactly
 * 2(m+p-1) ticks, i.e. the bubble is (p-1)/(m+p-1).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <moe/moe.h>

#define MAX_P 8
#define MAX_M 32

typedef struct stage_list {
    int32_t n;
    moe_pipeline_action_t *a;
} stage_list_t;

static void load(int32_t p, int32_t m, int32_t s, stage_list_t *out)
{
    moe_pipeline_schedule_t *sc = NULL;
    assert_int_equal(moe_pipeline_schedule_create(p, m, s, &sc), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_pipeline_schedule_length(sc, &out->n), MOE_STATUS_SUCCESS);
    out->a = calloc((size_t)out->n, sizeof *out->a);
    for (int32_t i = 0; i < out->n; i++)
        assert_int_equal(moe_pipeline_schedule_action(sc, i, &out->a[i]), MOE_STATUS_SUCCESS);
    int32_t ip, im, is, iw;
    assert_int_equal(moe_pipeline_schedule_info(sc, &ip, &im, &is, &iw), MOE_STATUS_SUCCESS);
    assert_int_equal(ip, p);
    assert_int_equal(im, m);
    assert_int_equal(is, s);
    assert_int_equal(iw, (p - s - 1) < m ? (p - s - 1) : m);
    assert_int_equal(moe_pipeline_schedule_destroy(sc), MOE_STATUS_SUCCESS);
}

static bool is_compute(moe_pipeline_op_t op)
{
    return op == MOE_PIPE_FORWARD || op == MOE_PIPE_BACKWARD;
}

/* Per-stage invariants. */
static void check_stage(int32_t p, int32_t m, int32_t s, const stage_list_t *L)
{
    int32_t w = (p - s - 1) < m ? (p - s - 1) : m;
    int fwd_at[MAX_M], bwd_at[MAX_M];
    for (int i = 0; i < m; i++) fwd_at[i] = bwd_at[i] = -1;
    int computes = 0, held = 0, peak = 0, first_b = -1;
    for (int32_t i = 0; i < L->n; i++) {
        const moe_pipeline_action_t *a = &L->a[i];
        assert_true(a->microbatch >= 0 && a->microbatch < m);
        int mb = a->microbatch;
        switch (a->op) {
        case MOE_PIPE_FORWARD:
            assert_int_equal(fwd_at[mb], -1);
            fwd_at[mb] = computes++;
            assert_int_equal(a->peer, -1);
            if (++held > peak) peak = held;
            break;
        case MOE_PIPE_BACKWARD:
            assert_int_equal(bwd_at[mb], -1);
            assert_true(fwd_at[mb] >= 0); /* forward first */
            if (first_b < 0) first_b = computes;
            bwd_at[mb] = computes++;
            assert_int_equal(a->peer, -1);
            held--;
            break;
        case MOE_PIPE_RECV_ACT:
            assert_true(s > 0);
            assert_int_equal(a->peer, s - 1);
            assert_true(i + 1 < L->n);
            assert_int_equal(L->a[i + 1].op, MOE_PIPE_FORWARD);
            assert_int_equal(L->a[i + 1].microbatch, mb);
            break;
        case MOE_PIPE_SEND_ACT:
            assert_true(s < p - 1);
            assert_int_equal(a->peer, s + 1);
            assert_true(i > 0);
            assert_int_equal(L->a[i - 1].op, MOE_PIPE_FORWARD);
            assert_int_equal(L->a[i - 1].microbatch, mb);
            break;
        case MOE_PIPE_RECV_GRAD:
            assert_true(s < p - 1);
            assert_int_equal(a->peer, s + 1);
            assert_true(i + 1 < L->n);
            assert_int_equal(L->a[i + 1].op, MOE_PIPE_BACKWARD);
            assert_int_equal(L->a[i + 1].microbatch, mb);
            break;
        case MOE_PIPE_SEND_GRAD:
            assert_true(s > 0);
            assert_int_equal(a->peer, s - 1);
            assert_true(i > 0);
            assert_int_equal(L->a[i - 1].op, MOE_PIPE_BACKWARD);
            assert_int_equal(L->a[i - 1].microbatch, mb);
            break;
        default: fail_msg("unknown op %d", (int)a->op);
        }
    }
    assert_int_equal(computes, 2 * m);
    for (int i = 0; i < m; i++) assert_true(fwd_at[i] >= 0 && bwd_at[i] > fwd_at[i]);
    assert_int_equal(held, 0);
    assert_int_equal(peak, p - s < m ? p - s : m); /* never more than p - s held */
    assert_int_equal(first_b, w < m ? w + 1 : m);  /* warm-up forwards, then a first F */
    /* exact shape: w forwards, then alternating F/B while forwards remain, then backwards */
    int c = 0, nf = 0, nb = 0;
    for (int32_t i = 0; i < L->n; i++) {
        if (!is_compute(L->a[i].op)) continue;
        moe_pipeline_op_t want;
        if (c < w) want = MOE_PIPE_FORWARD;
        else if (nf < m) want = ((c - w) % 2 == 0) ? MOE_PIPE_FORWARD : MOE_PIPE_BACKWARD;
        else want = MOE_PIPE_BACKWARD;
        assert_int_equal(L->a[i].op, want);
        /* microbatches in order within each kind */
        assert_int_equal(L->a[i].microbatch, want == MOE_PIPE_FORWARD ? nf : nb);
        if (want == MOE_PIPE_FORWARD) nf++; else nb++;
        c++;
    }
    /* transfers: one per compute that has a peer */
    int sends = 0, recvs = 0;
    for (int32_t i = 0; i < L->n; i++) {
        if (L->a[i].op == MOE_PIPE_SEND_ACT || L->a[i].op == MOE_PIPE_SEND_GRAD) sends++;
        if (L->a[i].op == MOE_PIPE_RECV_ACT || L->a[i].op == MOE_PIPE_RECV_GRAD) recvs++;
    }
    assert_int_equal(sends, (s > 0 ? m : 0) + (s < p - 1 ? m : 0));
    assert_int_equal(recvs, sends);
    assert_int_equal(L->n, 2 * m + sends + recvs);
}

/* ---- simulation of all stages ---------------------------------------------------------- */

/* A FIFO channel per (from, to, kind) with microbatch and arrival tick. */
typedef struct channel {
    int32_t mb[MAX_M], arrive[MAX_M];
    int head, tail;
} channel_t;

/* channel index: kind 0 = act (s -> s+1), 1 = grad (s -> s-1), keyed by sender */
static channel_t chans[2][MAX_P];

enum { SIM_MISMATCH = -1, SIM_DEADLOCK = -2, SIM_LEFTOVER = -3 };

/* Returns the makespan in ticks, or a negative SIM_* code. */
static int simulate(int32_t p, int32_t m, stage_list_t *L)
{
    memset(chans, 0, sizeof chans);
    int pc[MAX_P] = {0};
    int done = 0, tick = 0, last_compute_tick = -1;
    int in_flight = 0;
    while (done < p) {
        bool progress = false;
        for (int s = 0; s < p; s++) {
            bool computed = false;
            while (pc[s] < L[s].n) {
                const moe_pipeline_action_t *a = &L[s].a[pc[s]];
                if (is_compute(a->op)) {
                    if (computed) break; /* one compute per stage per tick */
                    computed = true;
                    last_compute_tick = tick;
                } else if (a->op == MOE_PIPE_SEND_ACT || a->op == MOE_PIPE_SEND_GRAD) {
                    channel_t *c = &chans[a->op == MOE_PIPE_SEND_GRAD][s];
                    assert_true(c->tail < MAX_M);
                    c->mb[c->tail] = a->microbatch;
                    c->arrive[c->tail++] = tick + 1;
                    in_flight++;
                } else {
                    /* receive from the peer's channel towards us */
                    int kind = a->op == MOE_PIPE_RECV_GRAD;
                    int from = a->peer;
                    if (from != (kind ? s + 1 : s - 1)) return SIM_MISMATCH;
                    channel_t *c = &chans[kind][from];
                    if (c->head == c->tail || c->arrive[c->head] > tick) break; /* blocked */
                    if (c->mb[c->head] != a->microbatch) return SIM_MISMATCH; /* in order */
                    c->head++;
                    in_flight--;
                }
                progress = true;
                if (++pc[s] == L[s].n) done++;
            }
        }
        if (!progress && in_flight == 0 && done < p) {
            for (int s = 0; s < p; s++)
                if (pc[s] < L[s].n)
                    print_error("deadlock: stage %d stuck at action %d (%s mb %d)\n", s, pc[s],
                                moe_pipeline_op_string(L[s].a[pc[s]].op),
                                L[s].a[pc[s]].microbatch);
            print_error("deadlock at p=%d m=%d tick %d\n", p, m, tick);
            return SIM_DEADLOCK;
        }
        tick++;
        assert_true(tick < 100000);
    }
    for (int k = 0; k < 2; k++)
        for (int s = 0; s < p; s++)
            if (chans[k][s].head != chans[k][s].tail) return SIM_LEFTOVER;
    return last_compute_tick + 1;
}

static void test_invariants_all_shapes(void **state)
{
    (void)state;
    int shapes = 0;
    for (int32_t p = 1; p <= MAX_P; p++) {
        for (int32_t m = 1; m <= MAX_M; m++) {
            stage_list_t L[MAX_P];
            for (int32_t s = 0; s < p; s++) {
                load(p, m, s, &L[s]);
                check_stage(p, m, s, &L[s]);
            }
            int makespan = simulate(p, m, L);
            if (makespan < 0) fail_msg("p=%d m=%d: simulation failed (%d)", p, m, makespan);
            /* unit forward and backward: 2m busy ticks per stage, 2(p-1) bubble ticks */
            if (makespan != 2 * (m + p - 1))
                fail_msg("p=%d m=%d: makespan %d ticks, expected %d", p, m, makespan,
                         2 * (m + p - 1));
            for (int32_t s = 0; s < p; s++) free(L[s].a);
            shapes++;
        }
    }
    assert_int_equal(shapes, MAX_P * MAX_M);
}

/* The simulation is not vacuous: broken schedules fail it. */
static void test_simulation_detects_errors(void **state)
{
    (void)state;
    stage_list_t L[2];
    /* stage 1 consumes act 1 before act 0: a mismatch on the channel */
    for (int s = 0; s < 2; s++) load(2, 2, s, &L[s]);
    int first = -1, second = -1;
    for (int i = 0; i < L[1].n; i++)
        if (L[1].a[i].op == MOE_PIPE_RECV_ACT) {
            if (first < 0) first = i; else second = i;
        }
    L[1].a[first].microbatch = 1;
    L[1].a[second].microbatch = 0;
    assert_int_equal(simulate(2, 2, L), SIM_MISMATCH);
    for (int s = 0; s < 2; s++) free(L[s].a);

    /* stage 0 waits for grad 0 before sending act 0: a deadlock */
    for (int s = 0; s < 2; s++) load(2, 1, s, &L[s]);
    /* stage 0 of p=2, m=1: F0 >act0@1 <grad0@1 B0 -> F0 <grad0@1 >act0@1 B0 */
    assert_int_equal(L[0].a[1].op, MOE_PIPE_SEND_ACT);
    assert_int_equal(L[0].a[2].op, MOE_PIPE_RECV_GRAD);
    moe_pipeline_action_t t = L[0].a[1];
    L[0].a[1] = L[0].a[2];
    L[0].a[2] = t;
    assert_int_equal(simulate(2, 1, L), SIM_DEADLOCK);

    /* a send nobody receives is left over */
    L[0].a[2] = L[0].a[1];
    L[0].a[1] = t;
    L[1].n = 2; /* stage 1 stops after <act0 F0: grad never sent, stage 0 then deadlocks */
    assert_true(simulate(2, 1, L) < 0);
    for (int s = 0; s < 2; s++) free(L[s].a);
}

static void test_to_string(void **state)
{
    (void)state;
    moe_pipeline_schedule_t *sc = NULL;
    char buf[512];
    size_t need = 0;
    assert_int_equal(moe_pipeline_schedule_create(2, 2, 0, &sc), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_pipeline_schedule_to_string(sc, buf, sizeof buf, &need),
                     MOE_STATUS_SUCCESS);
    assert_string_equal(buf, "stage 0/2 m=2: F0 >act0@1 F1 >act1@1 <grad0@1 B0 <grad1@1 B1");
    assert_int_equal(need, strlen(buf) + 1);
    /* truncation: not an error, NUL-terminated, `needed` unchanged */
    char small[10];
    size_t need2 = 0;
    assert_int_equal(moe_pipeline_schedule_to_string(sc, small, sizeof small, &need2),
                     MOE_STATUS_SUCCESS);
    assert_int_equal(need2, need);
    assert_string_equal(small, "stage 0/2");
    assert_int_equal(moe_pipeline_schedule_to_string(sc, NULL, 0, &need2), MOE_STATUS_SUCCESS);
    assert_int_equal(need2, need);
    moe_pipeline_schedule_destroy(sc);

    assert_int_equal(moe_pipeline_schedule_create(2, 2, 1, &sc), MOE_STATUS_SUCCESS);
    moe_pipeline_schedule_to_string(sc, buf, sizeof buf, NULL);
    assert_string_equal(buf, "stage 1/2 m=2: <act0@0 F0 B0 >grad0@0 <act1@0 F1 B1 >grad1@0");
    moe_pipeline_schedule_destroy(sc);

    /* p=4, m=4: print every stage (the documented example in docs/pipeline.md) */
    for (int s = 0; s < 4; s++) {
        assert_int_equal(moe_pipeline_schedule_create(4, 4, s, &sc), MOE_STATUS_SUCCESS);
        moe_pipeline_schedule_to_string(sc, buf, sizeof buf, NULL);
        printf("%s\n", buf);
        moe_pipeline_schedule_destroy(sc);
    }
    assert_int_equal(moe_pipeline_schedule_create(4, 4, 1, &sc), MOE_STATUS_SUCCESS);
    moe_pipeline_schedule_to_string(sc, buf, sizeof buf, NULL);
    assert_string_equal(buf, "stage 1/4 m=4: <act0@0 F0 >act0@2 <act1@0 F1 >act1@2 "
                             "<act2@0 F2 >act2@2 <grad0@2 B0 >grad0@0 <act3@0 F3 >act3@2 "
                             "<grad1@2 B1 >grad1@0 <grad2@2 B2 >grad2@0 <grad3@2 B3 >grad3@0");
    moe_pipeline_schedule_destroy(sc);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    moe_pipeline_schedule_t *sc = NULL;
    assert_int_equal(moe_pipeline_schedule_create(0, 4, 0, &sc), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "stages"));
    assert_int_equal(moe_pipeline_schedule_create(4, 0, 0, &sc), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_pipeline_schedule_create(4, 4, 4, &sc), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_pipeline_schedule_create(4, 4, -1, &sc), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_pipeline_schedule_create(4, 4, 0, NULL), MOE_STATUS_INVALID_ARGUMENT);
    assert_null(sc);
    int32_t n;
    moe_pipeline_action_t a;
    assert_int_equal(moe_pipeline_schedule_length(NULL, &n), MOE_STATUS_INVALID_HANDLE);
    assert_int_equal(moe_pipeline_schedule_create(3, 2, 1, &sc), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_pipeline_schedule_action(sc, -1, &a), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_pipeline_schedule_length(sc, &n), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_pipeline_schedule_action(sc, n, &a), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_pipeline_schedule_to_string(sc, NULL, 5, NULL),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_pipeline_schedule_destroy(sc), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_pipeline_schedule_destroy(NULL), MOE_STATUS_SUCCESS);
    assert_string_equal(moe_pipeline_op_string(MOE_PIPE_RECV_GRAD), "recv_grad");
    assert_string_equal(moe_pipeline_op_string((moe_pipeline_op_t)99), "unknown");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invariants_all_shapes),
        cmocka_unit_test(test_simulation_detects_errors),
        cmocka_unit_test(test_to_string),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
