/*
 * Agreement on a configuration (comm.h): ranks that must hold the same settings compare them
 * with one all-reduce, and a difference becomes an error naming the field, the ranks and the
 * values on every rank.
 *
 * Round 1: one MAX all-reduce of [rejected, v_1..v_n, ~rejected, ~v_1..~v_n] gives every
 * field's largest and (through the order-reversing ~) smallest value, and whether some rank
 * rejected its own configuration. Only when something differs, round 2 finds the ranks: a MIN
 * all-reduce of "my rank if I hold that value", and for a rejection a broadcast of the
 * rejecting rank's message. The messages go through moe_comm_allreduce_copy and
 * moe_comm_broadcast_copy, whose heap copies stay MPI's when an operation fails.
 */
#include "comm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"

#define REJECT_TEXT 512

moe_agree_field_t moe_agree_int(const char *name, int64_t value)
{
    return (moe_agree_field_t){name, MOE_AGREE_INT, value};
}

moe_agree_field_t moe_agree_u64(const char *name, uint64_t value)
{
    int64_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (moe_agree_field_t){name, MOE_AGREE_U64, bits};
}

moe_agree_field_t moe_agree_f32(const char *name, float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (moe_agree_field_t){name, MOE_AGREE_F32, (int64_t)bits};
}

static void format_value(char *out, size_t size, moe_agree_kind_t kind, int64_t v)
{
    if (kind == MOE_AGREE_U64) {
        uint64_t u;
        memcpy(&u, &v, sizeof u);
        snprintf(out, size, "%llu", (unsigned long long)u);
    } else if (kind == MOE_AGREE_F32) {
        uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, sizeof f);
        snprintf(out, size, "%.9g", (double)f);
    } else {
        snprintf(out, size, "%lld", (long long)v);
    }
}

/* The lowest comm rank for which `mine` holds, as a world rank. */
static moe_status_t first_rank_where(moe_comm_t *c, const bool *mine, int n, int *world)
{
    int64_t *who = malloc(sizeof *who * (size_t)n);
    if (!who) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "agreement table");
    for (int i = 0; i < n; i++) who[i] = mine[i] ? c->rank : INT64_MAX;
    moe_status_t st = moe_comm_allreduce_copy(c, who, who, (size_t)n, MOE_COMM_I64, MOE_REDUCE_MIN);
    for (int i = 0; st == MOE_STATUS_SUCCESS && i < n; i++)
        world[i] = who[i] >= 0 && who[i] < c->size ? c->world_ranks[who[i]] : -1;
    free(who);
    return st;
}

/* Some rank rejected its own configuration: every rank learns the first one's message. */
static moe_status_t report_rejection(moe_comm_t *c, const char *what, moe_status_t local,
                                     const char *local_msg)
{
    bool mine = local != MOE_STATUS_SUCCESS;
    int who = -1;
    MOE_TRY(first_rank_where(c, &mine, 1, &who));
    int root = 0;
    for (int i = 0; i < c->size; i++)
        if (c->world_ranks[i] == who) root = i;
    char text[REJECT_TEXT] = "";
    if (c->rank == root) snprintf(text, sizeof text, "%s", local_msg);
    MOE_TRY(moe_comm_broadcast_copy(c, text, sizeof text, MOE_COMM_U8, root));
    text[sizeof text - 1] = '\0';
    if (mine) return local; /* this rank's own message stands */
    return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "%s: world rank %d refused it (%s): %s", what, who,
                    c->members, text);
}

moe_status_t moe_comm_agree(moe_comm_t *c, const char *what, const moe_agree_field_t *fields, int n,
                            moe_status_t local)
{
    MOE_CHECK_ARG(!c->device_buffers, "agreement needs a communicator on host buffers");
    char local_msg[REJECT_TEXT] = "";
    if (local != MOE_STATUS_SUCCESS) snprintf(local_msg, sizeof local_msg, "%s", moe_last_error());
    int w = n + 1;
    int64_t *v = malloc(sizeof *v * 2 * (size_t)w);
    if (!v) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "agreement table");
    v[0] = local != MOE_STATUS_SUCCESS;
    for (int i = 0; i < n; i++) v[1 + i] = fields[i].value;
    for (int i = 0; i < w; i++) v[w + i] = ~v[i];
    int64_t *mine = malloc(sizeof *mine * (size_t)w);
    if (!mine) {
        free(v);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "agreement table");
    }
    memcpy(mine, v, sizeof *mine * (size_t)w);
    moe_status_t st = moe_comm_allreduce_copy(c, v, v, 2 * (size_t)w, MOE_COMM_I64, MOE_REDUCE_MAX);
    if (st != MOE_STATUS_SUCCESS) {
        free(v);
        free(mine);
        return moe_error_wrap(st, "comparing %s across %s", what, c->members);
    }
    if (v[0]) {
        free(v);
        free(mine);
        return report_rejection(c, what, local, local_msg);
    }
    /* fields whose smallest and largest values differ, and who holds those */
    int nd = 0;
    int *diff = malloc(sizeof *diff * (size_t)(n > 0 ? n : 1));
    bool *holds = malloc(sizeof *holds * 2 * (size_t)(n > 0 ? n : 1));
    int *who = malloc(sizeof *who * 2 * (size_t)(n > 0 ? n : 1));
    if (!diff || !holds || !who) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "agreement table");
        goto done;
    }
    for (int i = 1; i < w; i++) {
        int64_t hi = v[i], lo = ~v[w + i];
        if (hi == lo) continue;
        holds[2 * nd] = mine[i] == lo;
        holds[2 * nd + 1] = mine[i] == hi;
        diff[nd++] = i - 1;
    }
    if (nd == 0) goto done;
    st = first_rank_where(c, holds, 2 * nd, who);
    if (st != MOE_STATUS_SUCCESS) goto done;
    char text[768];
    size_t len = (size_t)snprintf(text, sizeof text,
                                  "%s differs between the ranks that share it "
                                  "(%s):",
                                  what, c->members);
    for (int d = 0; d < nd && len < sizeof text; d++) {
        const moe_agree_field_t *f = &fields[diff[d]];
        char lo[32], hi[32];
        format_value(lo, sizeof lo, f->kind, ~v[w + 1 + diff[d]]);
        format_value(hi, sizeof hi, f->kind, v[1 + diff[d]]);
        len += (size_t)snprintf(text + len, sizeof text - len,
                                "%s %s is %s on world rank %d and "
                                "%s on world rank %d",
                                d ? ";" : "", f->name, lo, who[2 * d], hi, who[2 * d + 1]);
    }
    st = MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "%s", text);
done:
    free(v);
    free(mine);
    free(diff);
    free(holds);
    free(who);
    return st;
}
