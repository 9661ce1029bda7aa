/*
 * Issue order of one stage's transfers for stream-ordered communicators (see
 * pipeline_internal.h for why it cannot deadlock).
 *
 * Legend: p stages, m microbatches, v chunks per stage; a message is identified by its sender
 * stage, its kind (activation or gradient) and the unit (chunk * m + microbatch) it is for on
 * the receiving stage. A unit-cost run of all p action lists (one compute per stage per tick,
 * a message sent in tick t receivable from tick t+1) gives each message its send tick; the
 * key (send tick, sender, kind, unit) is then the same on both ends of the message.
 */
#include "pipeline_internal.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"

typedef struct msg_key {
    int32_t tick, sender, kind, unit;
    int32_t action; /* index in this stage's list */
} msg_key_t;

static int cmp_key(const void *a, const void *b)
{
    const msg_key_t *x = a, *y = b;
    if (x->tick != y->tick) return x->tick < y->tick ? -1 : 1;
    if (x->sender != y->sender) return x->sender < y->sender ? -1 : 1;
    if (x->kind != y->kind) return x->kind < y->kind ? -1 : 1;
    return x->unit < y->unit ? -1 : x->unit > y->unit;
}

moe_status_t moe_pipeline_issue_order(moe_pipeline_schedule_t *mine)
{
    if (mine->issue) return MOE_STATUS_SUCCESS;
    int32_t p = mine->stages, m = mine->microbatches, v = mine->virtual_stages;
    size_t units = (size_t)m * (size_t)v;
    moe_status_t st = MOE_STATUS_SUCCESS;
    moe_pipeline_schedule_t **all = calloc((size_t)p, sizeof *all);
    int32_t *pc = calloc((size_t)p, sizeof *pc);
    int32_t *sent = malloc(sizeof(int32_t) * (size_t)p * 2 * units); /* send tick, -1 */
    msg_key_t *keys = NULL;
    if (!all || !pc || !sent) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "issue order for %d stages", p);
        goto fail;
    }
    for (size_t i = 0; i < (size_t)p * 2 * units; i++) sent[i] = -1;
    for (int32_t s = 0; s < p; s++)
        MOE_TRY_GOTO(st, moe_pipeline_schedule_build(p, m, s, v, &all[s]));

    /* unit-cost run of every stage */
    int32_t done = 0;
    for (int32_t tick = 0; done < p; tick++) {
        bool progress = false;
        for (int32_t s = 0; s < p; s++) {
            moe_pipeline_schedule_t *sc = all[s];
            bool computed = false;
            while (pc[s] < sc->count) {
                const moe_pipeline_action_t *a = &sc->actions[pc[s]];
                if (a->op == MOE_PIPELINE_FORWARD || a->op == MOE_PIPELINE_BACKWARD) {
                    if (computed) break;
                    computed = true;
                } else if (moe_pipe_is_send(a->op)) {
                    sent[((size_t)s * 2 + (size_t)moe_pipe_kind(a->op)) * units +
                         (size_t)moe_pipe_dest_unit(sc, a)] = tick;
                } else {
                    int32_t u = a->chunk * m + a->microbatch;
                    int32_t t = sent[((size_t)a->peer * 2 + (size_t)moe_pipe_kind(a->op)) * units +
                                     (size_t)u];
                    if (t < 0 || t >= tick) break; /* not sent yet, or sent this tick */
                }
                progress = true;
                if (++pc[s] == sc->count) done++;
            }
        }
        if (!progress && done < p) {
            /* a tick without progress can only be a message in flight; two in a row would be
             * a deadlock of the schedule itself */
            bool in_flight = false;
            for (int32_t s = 0; s < p && !in_flight; s++) {
                if (pc[s] >= all[s]->count) continue;
                const moe_pipeline_action_t *a = &all[s]->actions[pc[s]];
                if (moe_pipe_is_recv(a->op)) {
                    int32_t u = a->chunk * m + a->microbatch;
                    in_flight = sent[((size_t)a->peer * 2 + (size_t)moe_pipe_kind(a->op)) * units +
                                     (size_t)u] >= 0;
                }
            }
            if (!in_flight) {
                st = MOE_FAIL(MOE_STATUS_INTERNAL, "the schedule of p=%d m=%d v=%d deadlocks", p, m,
                              v);
                goto fail;
            }
        }
    }

    /* this stage's transfers, by key */
    int32_t n = 0;
    for (int32_t i = 0; i < mine->count; i++)
        if (moe_pipe_is_send(mine->actions[i].op) || moe_pipe_is_recv(mine->actions[i].op)) n++;
    keys = malloc(sizeof *keys * (size_t)(n > 0 ? n : 1));
    mine->issue = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    if (!keys || !mine->issue) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "issue order of %d transfers", n);
        goto fail;
    }
    n = 0;
    for (int32_t i = 0; i < mine->count; i++) {
        const moe_pipeline_action_t *a = &mine->actions[i];
        msg_key_t k = {.kind = moe_pipe_kind(a->op), .action = i};
        if (moe_pipe_is_send(a->op)) {
            k.sender = mine->stage;
            k.unit = moe_pipe_dest_unit(mine, a);
        } else if (moe_pipe_is_recv(a->op)) {
            k.sender = a->peer;
            k.unit = a->chunk * m + a->microbatch;
        } else {
            continue;
        }
        k.tick = sent[((size_t)k.sender * 2 + (size_t)k.kind) * units + (size_t)k.unit];
        keys[n++] = k;
    }
    qsort(keys, (size_t)n, sizeof *keys, cmp_key);
    for (int32_t i = 0; i < n; i++) mine->issue[i] = keys[i].action;
    mine->nissue = n;
fail:
    if (st != MOE_STATUS_SUCCESS) {
        free(mine->issue);
        mine->issue = NULL;
    }
    if (all)
        for (int32_t s = 0; s < p; s++) moe_pipeline_schedule_free(all[s]);
    free(all);
    free(pc);
    free(sent);
    free(keys);
    return st;
}
