/* The straggler policy during an incarnation's watch (straggler_watch.h). */
#include "straggler_watch.h"

#include <stdio.h>
#include <string.h>

int straggler_watch_init(straggler_watch_t *w, const straggler_config_t *c, int ranks, bool spare,
                         const char *ckpt_dir)
{
    memset(w, 0, sizeof *w);
    w->policy = c->policy;
    w->spare = spare;
    w->ckpt_dir = ckpt_dir;
    w->evict = -1;
    return straggler_tracker_init(&w->tracker, c, c->policy == STRAGGLER_OFF ? 0 : ranks);
}

void straggler_watch_free(straggler_watch_t *w) { straggler_tracker_free(&w->tracker); }

void straggler_watch_take(straggler_watch_t *w, int rank, const cJSON *member)
{
    if (w->policy != STRAGGLER_OFF) straggler_tracker_take(&w->tracker, rank, member);
}

static void straggler_event(const straggler_watch_t *w, events_t *ev, int incarnation,
                            const int *slots, const straggler_finding_t *f, const char *action)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "incarnation", incarnation);
    cJSON_AddNumberToObject(o, "rank", f->rank);
    cJSON_AddNumberToObject(o, "slot", slots[f->rank]);
    cJSON_AddNumberToObject(o, "step", (double)f->step);
    cJSON_AddNumberToObject(o, "busy_s", f->busy_s);
    cJSON_AddNumberToObject(o, "median_s", f->median_s);
    cJSON_AddNumberToObject(o, "limit_s", f->limit_s);
    cJSON_AddNumberToObject(o, "slowdown", f->median_s > 0 ? f->busy_s / f->median_s : 0);
    cJSON_AddNumberToObject(o, "steps", f->steps);
    cJSON_AddStringToObject(o, "policy", w->policy == STRAGGLER_REPLACE ? "replace" : "warn");
    cJSON_AddStringToObject(o, "action", action);
    events_emit(ev, "straggler", o);
}

bool straggler_watch_poll(straggler_watch_t *w, events_t *ev, int incarnation, const int *slots,
                          int *rank, char *detail, size_t len)
{
    if (w->policy == STRAGGLER_OFF) return false;
    straggler_finding_t f;
    while (straggler_tracker_judge(&w->tracker, &f)) {
        const char *action = "none (policy warn)";
        if (w->policy == STRAGGLER_REPLACE && w->evict >= 0)
            action = "none (a straggler is already being replaced)";
        else if (w->policy == STRAGGLER_REPLACE && !w->spare)
            action = "none (no spare slot to replace it)";
        else if (w->policy == STRAGGLER_REPLACE) {
            action = "replace after the next checkpoint";
            w->evict = f.rank;
            w->finding = f;
            w->committed = straggler_committed_step(w->ckpt_dir);
        }
        straggler_event(w, ev, incarnation, slots, &f, action);
    }
    if (w->evict < 0) return false;
    int64_t now = straggler_committed_step(w->ckpt_dir);
    if (now <= w->committed) return false;
    const straggler_finding_t *g = &w->finding;
    *rank = w->evict;
    snprintf(detail, len,
             "slot %d (rank %d) busy %.4f s a step against the ranks' median "
             "%.4f s (limit %.4f s) for %d steps; checkpoint step %lld committed: its slot "
             "goes to a spare",
             slots[g->rank], g->rank, g->busy_s, g->median_s, g->limit_s, g->steps, (long long)now);
    return true;
}
