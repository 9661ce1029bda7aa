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
 * message sent in tick t can be received from tick t+1, sends never block): every send meets
 * the receive of the same kind, microbatch and chunk, in order per pair of stages (so even an
 * untagged transport matches them), nothing is left over, no tick passes without progress (no
 * deadlock), and with unit costs the batch takes exactly 2(m+p-1) ticks, i.e. the bubble is
 * (p-1)/(m+p-1). Broken lists (swapped receives, a receive before the send it waits for)
 * fail the simulation, so it is not vacuous.
 *
 * Interleaved (p in 2..8, v in 2..4, m a multiple of p up to 32): the Megatron-LM unit order
 * and warm-up count, 2mv computes, forward before backward per (chunk, microbatch), peak
 * units held = warm-up + 1, wrap-around transfers between stage p-1 and stage 0, the same
 * simulation, and exactly 2(mv+p-1) ticks: bubble (p-1)/(mv+p-1).
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

#include "pipeline/pipeline_internal.h"

#define MAX_P 8
#define MAX_M 32

typedef struct stage_list {
    int32_t n;
    moe_pipeline_action_t *a;
} stage_list_t;

/* Forward actions before the first backward of a list: what moe_pipeline_schedule_info
 * reports as warmup. */
static int32_t forwards_before_backward(const stage_list_t *L)
{
    int32_t n = 0;
    for (int32_t i = 0; i < L->n && L->a[i].op != MOE_PIPELINE_BACKWARD; i++)
        n += L->a[i].op == MOE_PIPELINE_FORWARD;
    return n;
}

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
    assert_int_equal(iw, forwards_before_backward(out));
    assert_int_equal(moe_pipeline_schedule_destroy(sc), MOE_STATUS_SUCCESS);
}

static bool is_compute(moe_pipeline_op_t op)
{
    return op == MOE_PIPELINE_FORWARD || op == MOE_PIPELINE_BACKWARD;
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
        case MOE_PIPELINE_FORWARD:
            assert_int_equal(fwd_at[mb], -1);
            fwd_at[mb] = computes++;
            assert_int_equal(a->peer, -1);
            if (++held > peak) peak = held;
            break;
        case MOE_PIPELINE_BACKWARD:
            assert_int_equal(bwd_at[mb], -1);
            assert_true(fwd_at[mb] >= 0); /* forward first */
            if (first_b < 0) first_b = computes;
            bwd_at[mb] = computes++;
            assert_int_equal(a->peer, -1);
            held--;
            break;
        case MOE_PIPELINE_RECV_ACT:
            assert_true(s > 0);
            assert_int_equal(a->peer, s - 1);
            assert_true(i + 1 < L->n);
            assert_int_equal(L->a[i + 1].op, MOE_PIPELINE_FORWARD);
            assert_int_equal(L->a[i + 1].microbatch, mb);
            break;
        case MOE_PIPELINE_SEND_ACT:
            assert_true(s < p - 1);
            assert_int_equal(a->peer, s + 1);
            assert_true(i > 0);
            assert_int_equal(L->a[i - 1].op, MOE_PIPELINE_FORWARD);
            assert_int_equal(L->a[i - 1].microbatch, mb);
            break;
        case MOE_PIPELINE_RECV_GRAD:
            assert_true(s < p - 1);
            assert_int_equal(a->peer, s + 1);
            assert_true(i + 1 < L->n);
            assert_int_equal(L->a[i + 1].op, MOE_PIPELINE_BACKWARD);
            assert_int_equal(L->a[i + 1].microbatch, mb);
            break;
        case MOE_PIPELINE_SEND_GRAD:
            assert_true(s > 0);
            assert_int_equal(a->peer, s - 1);
            assert_true(i > 0);
            assert_int_equal(L->a[i - 1].op, MOE_PIPELINE_BACKWARD);
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
        if (c < w)
            want = MOE_PIPELINE_FORWARD;
        else if (nf < m)
            want = ((c - w) % 2 == 0) ? MOE_PIPELINE_FORWARD : MOE_PIPELINE_BACKWARD;
        else
            want = MOE_PIPELINE_BACKWARD;
        assert_int_equal(L->a[i].op, want);
        /* microbatches in order within each kind */
        assert_int_equal(L->a[i].microbatch, want == MOE_PIPELINE_FORWARD ? nf : nb);
        if (want == MOE_PIPELINE_FORWARD)
            nf++;
        else
            nb++;
        c++;
    }
    /* transfers: one per compute that has a peer */
    int sends = 0, recvs = 0;
    for (int32_t i = 0; i < L->n; i++) {
        if (L->a[i].op == MOE_PIPELINE_SEND_ACT || L->a[i].op == MOE_PIPELINE_SEND_GRAD) sends++;
        if (L->a[i].op == MOE_PIPELINE_RECV_ACT || L->a[i].op == MOE_PIPELINE_RECV_GRAD) recvs++;
    }
    assert_int_equal(sends, (s > 0 ? m : 0) + (s < p - 1 ? m : 0));
    assert_int_equal(recvs, sends);
    assert_int_equal(L->n, 2 * m + sends + recvs);
}

/* ---- simulation of all stages ---------------------------------------------------------- */

#define MAX_MSG 512

/* One FIFO channel per ordered pair of stages, as an untagged transport (NCCL) matches:
 * activations go to stage s+1 and gradients to s-1 (mod p with interleaving); with p = 2
 * both go to the same peer and share the channel. A message holds its kind, the microbatch
 * and the chunk it is for on the receiving stage, and the tick from which it can be
 * received. */
typedef struct channel {
    int32_t kind[MAX_MSG], mb[MAX_MSG], chunk[MAX_MSG], arrive[MAX_MSG];
    int head, tail;
} channel_t;

static channel_t chans[2][MAX_P];

/* the channel of a sender: 0 towards s+1, 1 towards s-1 (the same peer when p = 2) */
static int pair_key(int kind, int32_t p) { return p == 2 ? 0 : kind; }

enum { SIM_MISMATCH = -1, SIM_DEADLOCK = -2, SIM_LEFTOVER = -3 };

/* Run every stage's list at once: one compute per stage per tick, a message sent in tick t can
 * be received from tick t+1, sends never block, receives must match the head of their channel
 * (in order per pair of stages: what an untagged transport such as NCCL needs; MPI tags are
 * more lenient). Returns the makespan in ticks, or a negative SIM_* code. */
static int simulate(int32_t p, int32_t m, int32_t v, stage_list_t *L)
{
    (void)m;
    memset(chans, 0, sizeof chans);
    int pc[MAX_P] = {0};
    int done = 0, tick = 0, last_compute_tick = -1;
    int in_flight = 0;
    for (int s = 0; s < p; s++)
        if (L[s].n == 0) done++;
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
                } else if (a->op == MOE_PIPELINE_SEND_ACT || a->op == MOE_PIPELINE_SEND_GRAD) {
                    int kind = a->op == MOE_PIPELINE_SEND_GRAD;
                    if (a->peer != (kind ? (s + p - 1) % p : (s + 1) % p)) return SIM_MISMATCH;
                    channel_t *c = &chans[pair_key(kind, p)][s];
                    assert_true(c->tail < MAX_MSG);
                    int dest_chunk = a->chunk;
                    if (!kind && s == p - 1) dest_chunk++; /* wrap to the next chunk */
                    if (kind && s == 0) dest_chunk--;
                    if (dest_chunk < 0 || dest_chunk >= v) return SIM_MISMATCH;
                    c->kind[c->tail] = kind;
                    c->mb[c->tail] = a->microbatch;
                    c->chunk[c->tail] = dest_chunk;
                    c->arrive[c->tail++] = tick + 1;
                    in_flight++;
                } else {
                    int kind = a->op == MOE_PIPELINE_RECV_GRAD;
                    int from = a->peer;
                    if (from != (kind ? (s + 1) % p : (s + p - 1) % p)) return SIM_MISMATCH;
                    channel_t *c = &chans[pair_key(kind, p)][from];
                    if (c->head == c->tail || c->arrive[c->head] > tick) break; /* blocked */
                    if (c->kind[c->head] != kind || c->mb[c->head] != a->microbatch ||
                        c->chunk[c->head] != a->chunk)
                        return SIM_MISMATCH;
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
                                moe_pipeline_op_string(L[s].a[pc[s]].op), L[s].a[pc[s]].microbatch);
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
            int makespan = simulate(p, m, 1, L);
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

/* ---- interleaved 1F1B --------------------------------------------------------------------- */

#define MAX_V 4

static void load_interleaved(int32_t p, int32_t m, int32_t v, int32_t s, stage_list_t *out,
                             int32_t *warmup)
{
    moe_pipeline_schedule_t *sc = NULL;
    assert_int_equal(moe_pipeline_schedule_create_interleaved(p, m, s, v, &sc), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_pipeline_schedule_length(sc, &out->n), MOE_STATUS_SUCCESS);
    out->a = calloc((size_t)out->n, sizeof *out->a);
    for (int32_t i = 0; i < out->n; i++)
        assert_int_equal(moe_pipeline_schedule_action(sc, i, &out->a[i]), MOE_STATUS_SUCCESS);
    int32_t iv = 0;
    assert_int_equal(moe_pipeline_schedule_virtual_stages(sc, &iv), MOE_STATUS_SUCCESS);
    assert_int_equal(iv, v);
    assert_int_equal(moe_pipeline_schedule_info(sc, NULL, NULL, NULL, warmup), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_pipeline_schedule_destroy(sc), MOE_STATUS_SUCCESS);
}

/* Per-stage invariants of an interleaved list: units are (chunk, microbatch). */
static void check_stage_interleaved(int32_t p, int32_t m, int32_t v, int32_t s,
                                    const stage_list_t *L, int32_t info_warmup)
{
    int32_t units = m * v;
    int32_t w = m == p ? units : 2 * (p - s - 1) + (v - 1) * p; /* warm-up forward units */
    if (w > units) w = units;
    assert_int_equal(info_warmup, forwards_before_backward(L));
    static int fwd_at[MAX_V * MAX_M], bwd_at[MAX_V * MAX_M];
    for (int u = 0; u < units; u++) fwd_at[u] = bwd_at[u] = -1;
    int computes = 0, held = 0, peak = 0, nf = 0, nb = 0;
    for (int32_t i = 0; i < L->n; i++) {
        const moe_pipeline_action_t *a = &L->a[i];
        assert_true(a->microbatch >= 0 && a->microbatch < m);
        assert_true(a->chunk >= 0 && a->chunk < v);
        int u = a->chunk * m + a->microbatch, vs = a->chunk * p + s;
        switch (a->op) {
        case MOE_PIPELINE_FORWARD: {
            /* forward unit k: microbatch (k/(p v)) p + k%p of chunk (k/p)%v */
            assert_int_equal(a->microbatch, (nf / (p * v)) * p + nf % p);
            assert_int_equal(a->chunk, (nf / p) % v);
            nf++;
            assert_int_equal(fwd_at[u], -1);
            fwd_at[u] = computes++;
            if (++held > peak) peak = held;
            break;
        }
        case MOE_PIPELINE_BACKWARD:
            assert_int_equal(a->microbatch, (nb / (p * v)) * p + nb % p);
            assert_int_equal(a->chunk, v - 1 - (nb / p) % v);
            nb++;
            assert_true(fwd_at[u] >= 0); /* forward first */
            assert_int_equal(bwd_at[u], -1);
            bwd_at[u] = computes++;
            held--;
            break;
        case MOE_PIPELINE_RECV_ACT:
            assert_true(vs > 0);
            assert_int_equal(L->a[i + 1].op, MOE_PIPELINE_FORWARD);
            assert_int_equal(L->a[i + 1].microbatch, a->microbatch);
            assert_int_equal(L->a[i + 1].chunk, a->chunk);
            break;
        case MOE_PIPELINE_SEND_ACT:
            assert_true(vs < p * v - 1);
            assert_int_equal(L->a[i - 1].op, MOE_PIPELINE_FORWARD);
            assert_int_equal(L->a[i - 1].chunk, a->chunk);
            break;
        case MOE_PIPELINE_RECV_GRAD:
            assert_true(vs < p * v - 1);
            assert_int_equal(L->a[i + 1].op, MOE_PIPELINE_BACKWARD);
            assert_int_equal(L->a[i + 1].chunk, a->chunk);
            break;
        case MOE_PIPELINE_SEND_GRAD:
            assert_true(vs > 0);
            assert_int_equal(L->a[i - 1].op, MOE_PIPELINE_BACKWARD);
            assert_int_equal(L->a[i - 1].chunk, a->chunk);
            break;
        }
    }
    assert_int_equal(computes, 2 * units);
    for (int u = 0; u < units; u++) assert_true(fwd_at[u] >= 0 && bwd_at[u] > fwd_at[u]);
    assert_int_equal(held, 0);
    assert_int_equal(peak, w < units ? w + 1 : units);
}

static void test_interleaved_all_shapes(void **state)
{
    (void)state;
    int shapes = 0, exact = 0;
    for (int32_t p = 2; p <= MAX_P; p++) {
        for (int32_t v = 2; v <= MAX_V; v++) {
            for (int32_t m = p; m <= MAX_M; m += p) {
                stage_list_t L[MAX_P];
                for (int32_t s = 0; s < p; s++) {
                    int32_t w = 0;
                    load_interleaved(p, m, v, s, &L[s], &w);
                    check_stage_interleaved(p, m, v, s, &L[s], w);
                }
                int makespan = simulate(p, m, v, L);
                if (makespan < 0)
                    fail_msg("interleaved p=%d v=%d m=%d: simulation failed (%d)", p, v, m,
                             makespan);
                /* a chunk costs one tick: 2 m v busy ticks per stage; the interleaved bubble
                 * is 2 (p - 1) chunk-ticks, i.e. (p-1)/(m v + p - 1) of the batch */
                int ideal = 2 * (m * v + p - 1);
                if (makespan == ideal) exact++;
                if (makespan > ideal)
                    fail_msg("interleaved p=%d v=%d m=%d: makespan %d ticks > %d", p, v, m,
                             makespan, ideal);
                for (int32_t s = 0; s < p; s++) free(L[s].a);
                shapes++;
            }
        }
    }
    printf("interleaved: %d shapes (p 2..%d, v 2..%d, m multiple of p up to %d), %d of them "
           "exactly at 2(mv+p-1) ticks\n",
           shapes, MAX_P, MAX_V, MAX_M, exact);
    assert_int_equal(exact, shapes);
}

static void test_interleaved_print_and_arguments(void **state)
{
    (void)state;
    moe_pipeline_schedule_t *sc = NULL;
    char buf[1024];
    assert_int_equal(moe_pipeline_schedule_create_interleaved(2, 2, 0, 2, &sc), MOE_STATUS_SUCCESS);
    moe_pipeline_schedule_to_string(sc, buf, sizeof buf, NULL);
    printf("%s\n", buf);
    /* m = p: every forward first; chunk 1 of stage 0 receives from stage 1 (wrap-around) */
    assert_string_equal(buf, "stage 0/2 m=2 v=2: F0.0 >act0.0@1 F1.0 >act1.0@1 <act0.1@1 "
                             "F0.1 >act0.1@1 <act1.1@1 F1.1 >act1.1@1 <grad0.1@1 B0.1 "
                             ">grad0.1@1 <grad1.1@1 B1.1 >grad1.1@1 <grad0.0@1 B0.0 "
                             "<grad1.0@1 B1.0");
    moe_pipeline_schedule_destroy(sc);
    assert_int_equal(moe_pipeline_schedule_create_interleaved(2, 3, 0, 2, &sc),
                     MOE_STATUS_INVALID_ARGUMENT); /* m % p != 0 */
    assert_non_null(strstr(moe_last_error(), "divisible"));
    assert_int_equal(moe_pipeline_schedule_create_interleaved(1, 2, 0, 2, &sc),
                     MOE_STATUS_INVALID_ARGUMENT); /* one stage */
    assert_int_equal(moe_pipeline_schedule_create_interleaved(2, 2, 0, 0, &sc),
                     MOE_STATUS_INVALID_ARGUMENT);
    /* v = 1 is plain 1F1B, any m */
    assert_int_equal(moe_pipeline_schedule_create_interleaved(3, 5, 1, 1, &sc), MOE_STATUS_SUCCESS);
    moe_pipeline_schedule_to_string(sc, buf, sizeof buf, NULL);
    assert_null(strstr(buf, "v="));
    moe_pipeline_schedule_destroy(sc);
}

/* ---- issue order for in-order transports ----------------------------------------------------
 * The strictest model of a transport that runs each rank's operations in call order on one
 * stream without tags (NCCL): a stage's transfers complete one after another in the order it
 * issued them, and a send completes only together with the receive at the head of its peer's
 * stream. Each stage issues its transfers in moe_pipeline_issue_order's order (a receive at
 * once, a send when its action was reached); computes wait for their receives. Every shape
 * must finish with every pair matched (same kind, microbatch, chunk). The preposting order
 * (receives before the sends that precede them) must deadlock in this model, and the plain
 * list order must too (p = 2, m = 2): the issue order is what makes it work. */

typedef struct strict_stage {
    moe_pipeline_schedule_t *sc;
    int host, head, issued;
    uint8_t *ready, *done;
    const int32_t *order; /* issue order used by this simulation */
    int32_t norder;
} strict_stage_t;

/* The message a transfer action carries: kind, sender, receiving unit. */
static void message_of(const moe_pipeline_schedule_t *sc, const moe_pipeline_action_t *a, int *kind,
                       int *sender, int *unit)
{
    bool send = a->op == MOE_PIPELINE_SEND_ACT || a->op == MOE_PIPELINE_SEND_GRAD;
    *kind = a->op == MOE_PIPELINE_SEND_GRAD || a->op == MOE_PIPELINE_RECV_GRAD;
    int chunk = a->chunk;
    if (send && !*kind && sc->stage == sc->stages - 1) chunk++;
    if (send && *kind && sc->stage == 0) chunk--;
    *sender = send ? sc->stage : a->peer;
    *unit = chunk * sc->microbatches + a->microbatch;
}

/* 0: finished; SIM_DEADLOCK or SIM_MISMATCH otherwise. */
static int simulate_strict(int32_t p, strict_stage_t *st)
{
    for (;;) {
        bool progress = false, finished = true;
        for (int s = 0; s < p; s++) {
            strict_stage_t *x = &st[s];
            while (x->host < x->sc->count) {
                const moe_pipeline_action_t *a = &x->sc->actions[x->host];
                if (a->op == MOE_PIPELINE_RECV_ACT || a->op == MOE_PIPELINE_RECV_GRAD) {
                    if (!x->done[x->host]) break;
                } else if (a->op == MOE_PIPELINE_SEND_ACT || a->op == MOE_PIPELINE_SEND_GRAD) {
                    x->ready[x->host] = 1;
                }
                x->host++;
                progress = true;
            }
            while (x->issued < x->norder) {
                int i = x->order[x->issued];
                const moe_pipeline_action_t *a = &x->sc->actions[i];
                bool send = a->op == MOE_PIPELINE_SEND_ACT || a->op == MOE_PIPELINE_SEND_GRAD;
                if (send && !x->ready[i]) break;
                x->issued++;
                progress = true;
            }
        }
        for (int s = 0; s < p; s++) {
            strict_stage_t *x = &st[s];
            if (x->head >= x->issued) continue;
            int i = x->order[x->head];
            const moe_pipeline_action_t *a = &x->sc->actions[i];
            int q = a->peer;
            strict_stage_t *y = &st[q];
            if (y->head >= y->issued) continue;
            int j = y->order[y->head];
            const moe_pipeline_action_t *b = &y->sc->actions[j];
            if (b->peer != s) continue;
            bool a_send = a->op == MOE_PIPELINE_SEND_ACT || a->op == MOE_PIPELINE_SEND_GRAD;
            bool b_send = b->op == MOE_PIPELINE_SEND_ACT || b->op == MOE_PIPELINE_SEND_GRAD;
            if (a_send == b_send) continue; /* both send (or receive) towards each other */
            int k1, s1, u1, k2, s2, u2;
            message_of(x->sc, a, &k1, &s1, &u1);
            message_of(y->sc, b, &k2, &s2, &u2);
            if (k1 != k2 || s1 != s2 || u1 != u2) return SIM_MISMATCH; /* untagged: wrong data */
            x->done[i] = y->done[j] = 1;
            x->head++;
            y->head++;
            progress = true;
        }
        for (int s = 0; s < p; s++)
            if (st[s].host < st[s].sc->count || st[s].head < st[s].norder) finished = false;
        if (finished) return 0;
        if (!progress) return SIM_DEADLOCK;
    }
}

/* Run the strict model for (p, m, v) with the given order: 0 = issue order, 1 = list order
 * (transfers in action order), 2 = list order with receives moved `pre` transfers earlier. */
static int strict_run(int32_t p, int32_t m, int32_t v, int mode)
{
    strict_stage_t st[MAX_P];
    memset(st, 0, sizeof st);
    int32_t *own[MAX_P] = {0};
    for (int s = 0; s < p; s++) {
        assert_int_equal(moe_pipeline_schedule_build(p, m, s, v, &st[s].sc), MOE_STATUS_SUCCESS);
        moe_pipeline_schedule_t *sc = st[s].sc;
        st[s].ready = calloc((size_t)sc->count, 1);
        st[s].done = calloc((size_t)sc->count, 1);
        if (mode == 0) {
            assert_int_equal(moe_pipeline_issue_order(sc), MOE_STATUS_SUCCESS);
            st[s].order = sc->issue;
            st[s].norder = sc->nissue;
        } else {
            own[s] = calloc((size_t)sc->count, sizeof(int32_t));
            int n = 0;
            for (int i = 0; i < sc->count; i++)
                if (!is_compute(sc->actions[i].op)) own[s][n++] = i;
            if (mode == 2) /* prepost: each receive issued before the transfer ahead of it */
                for (int t = 1; t < n; t++) {
                    const moe_pipeline_action_t *a = &sc->actions[own[s][t]];
                    if ((a->op == MOE_PIPELINE_RECV_ACT || a->op == MOE_PIPELINE_RECV_GRAD)) {
                        int32_t tmp = own[s][t - 1];
                        own[s][t - 1] = own[s][t];
                        own[s][t] = tmp;
                    }
                }
            st[s].order = own[s];
            st[s].norder = n;
        }
    }
    int rc = simulate_strict(p, st);
    for (int s = 0; s < p; s++) {
        free(st[s].ready);
        free(st[s].done);
        free(own[s]);
        moe_pipeline_schedule_free(st[s].sc);
    }
    return rc;
}

static void test_issue_order_in_order_transport(void **state)
{
    (void)state;
    int shapes = 0;
    for (int32_t p = 1; p <= MAX_P; p++)
        for (int32_t m = 1; m <= MAX_M; m++) {
            int rc = strict_run(p, m, 1, 0);
            if (rc != 0) fail_msg("issue order p=%d m=%d: %d", p, m, rc);
            shapes++;
        }
    for (int32_t p = 2; p <= MAX_P; p++)
        for (int32_t v = 2; v <= MAX_V; v++)
            for (int32_t m = p; m <= MAX_M; m += p) {
                int rc = strict_run(p, m, v, 0);
                if (rc != 0) fail_msg("issue order p=%d v=%d m=%d: %d", p, v, m, rc);
                shapes++;
            }
    printf("issue order: %d shapes finish on a strict in-order, untagged transport\n", shapes);
    /* the alternatives do not: the model can fail */
    assert_int_equal(strict_run(2, 2, 1, 1), SIM_DEADLOCK); /* list order */
    assert_int_equal(strict_run(2, 2, 1, 2), SIM_DEADLOCK); /* receives posted ahead */
    assert_int_equal(strict_run(4, 8, 1, 1), SIM_DEADLOCK);
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
        if (L[1].a[i].op == MOE_PIPELINE_RECV_ACT) {
            if (first < 0)
                first = i;
            else
                second = i;
        }
    L[1].a[first].microbatch = 1;
    L[1].a[second].microbatch = 0;
    assert_int_equal(simulate(2, 2, 1, L), SIM_MISMATCH);
    for (int s = 0; s < 2; s++) free(L[s].a);

    /* stage 0 waits for grad 0 before sending act 0: a deadlock */
    for (int s = 0; s < 2; s++) load(2, 1, s, &L[s]);
    /* stage 0 of p=2, m=1: F0 >act0@1 <grad0@1 B0 -> F0 <grad0@1 >act0@1 B0 */
    assert_int_equal(L[0].a[1].op, MOE_PIPELINE_SEND_ACT);
    assert_int_equal(L[0].a[2].op, MOE_PIPELINE_RECV_GRAD);
    moe_pipeline_action_t t = L[0].a[1];
    L[0].a[1] = L[0].a[2];
    L[0].a[2] = t;
    assert_int_equal(simulate(2, 1, 1, L), SIM_DEADLOCK);

    /* a send nobody receives is left over */
    L[0].a[2] = L[0].a[1];
    L[0].a[1] = t;
    L[1].n = 2; /* stage 1 stops after <act0 F0: grad never sent, stage 0 then deadlocks */
    assert_true(simulate(2, 1, 1, L) < 0);
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
    assert_string_equal(moe_pipeline_op_string(MOE_PIPELINE_RECV_GRAD), "recv_grad");
    assert_string_equal(moe_pipeline_op_string((moe_pipeline_op_t)99), "unknown");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invariants_all_shapes),
        cmocka_unit_test(test_simulation_detects_errors),
        cmocka_unit_test(test_interleaved_all_shapes),
        cmocka_unit_test(test_interleaved_print_and_arguments),
        cmocka_unit_test(test_issue_order_in_order_transport),
        cmocka_unit_test(test_to_string),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
