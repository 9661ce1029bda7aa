/*
 * The straggler policy during one incarnation's watch (straggler.h has the rule): the busy
 * times of every member key the watch reads go to a tracker; a rank it finds slow is reported
 * (a `straggler` event); under the replace policy, with a spare slot free, the watch is told to
 * end the incarnation as soon as a checkpoint newer than the one committed at the finding has
 * committed, with the straggler's slot to evict (the launcher relaunches on the spare and
 * resumes from that checkpoint, so only the steps since it are run again).
 */
#ifndef MOE_TOOLS_STRAGGLER_WATCH_H
#define MOE_TOOLS_STRAGGLER_WATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "events.h"
#include "straggler.h"

typedef struct straggler_watch {
    straggler_tracker_t tracker;
    straggler_policy_t policy;
    bool spare;           /* a healthy slot outside the incarnation can take a straggler's */
    const char *ckpt_dir; /* where checkpoints commit */
    int evict;            /* the rank to evict at the next checkpoint, -1: none */
    int64_t committed;    /* the newest committed checkpoint when it was found */
    straggler_finding_t finding;
} straggler_watch_t;

/* For an incarnation of `ranks` ranks. Returns 0, or -1 when out of memory. */
int straggler_watch_init(straggler_watch_t *w, const straggler_config_t *c, int ranks, bool spare,
                         const char *ckpt_dir);
void straggler_watch_free(straggler_watch_t *w);
/* The busy times in rank r's member key value (moe/elastic.h). */
void straggler_watch_take(straggler_watch_t *w, int rank, const cJSON *member);
/* After each poll: judges the new steps and emits a `straggler` event for each rank found
 * (slots: the slot of each rank). Returns true when the incarnation is to end now to evict
 * *rank's slot for a spare, with the failure's detail. */
bool straggler_watch_poll(straggler_watch_t *w, events_t *ev, int incarnation, const int *slots,
                          int *rank, char *detail, size_t len);

#endif /* MOE_TOOLS_STRAGGLER_WATCH_H */
