/*
 * Stragglers: ranks that keep running, but slowly (a throttled GPU, a bad link, a busy host).
 * In lock-step training every rank's wall step time is the slowest one's, so the launcher
 * judges each rank by its busy time: the step's wall time minus the time it spent blocked
 * waiting for its peers (moe_runtime_wait_stats), which every rank reports per step in its
 * member key ("busy": [[step, seconds], ...], moe_elastic_member_report_busy).
 *
 * The rule, for every step that all ranks reported (R ranks, docs/elastic.md "Stragglers"):
 *   b_r     = rank r's median busy time over its last `window` reported steps (a moving median:
 *             one slow step of a descheduled process is not a straggler);
 *   median  = the median of b_r over the ranks;
 *   sigma   = 1.4826 x the median absolute deviation of the b_r (a robust standard deviation:
 *             the straggler itself does not inflate it), at least 5% of the median;
 *   limit   = median + k x sigma (--straggler-sigma k, default 3), or ratio x median when
 *             --straggler-ratio is set; never below median + --straggler-min-gap-ms;
 *   a rank whose b_r is above the limit for `steps` judged steps in a row is a straggler.
 * The policy says what follows: warn (a `straggler` event), replace (also: once a spare slot is
 * free, the incarnation ends right after the next checkpoint commits, and the straggler's slot is
 * evicted for the spare, so the steps since that checkpoint are all that is replayed), or off.
 * With two ranks the sigma rule cannot tell which one is slow (both sit one deviation from their
 * median): use the ratio.
 */
#ifndef MOE_TOOLS_STRAGGLER_H
#define MOE_TOOLS_STRAGGLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cjson/cJSON.h>

typedef enum straggler_policy {
    STRAGGLER_OFF = 0,
    STRAGGLER_WARN = 1,
    STRAGGLER_REPLACE = 2
} straggler_policy_t;

typedef struct straggler_config {
    straggler_policy_t policy; /* default warn */
    double sigma;              /* k of median + k sigma, default 3 */
    double ratio;              /* > 0: the limit is ratio x median instead; default 0 */
    int steps;                 /* judged steps in a row above the limit, default 5 */
    int window;                /* steps of each rank's moving median, default 5 */
    double min_gap_s;          /* the limit is at least this far above the median, default 0.01 */
} straggler_config_t;

void straggler_config_default(straggler_config_t *c);
/* Takes option `a` with its value `v` when it is a --straggler-* option: returns 1 (v used),
 * 0 (not one of them), or -1 with a message naming the option in err. */
int straggler_parse_option(straggler_config_t *c, const char *a, const char *v, char *err,
                           size_t len);
void straggler_usage(FILE *f);

/* One step's judgement over R ranks' moving medians b[0..R): the median, the robust sigma and
 * the limit; over[r] says whether b[r] is above the limit. A pure function (the unit test's). */
typedef struct straggler_verdict {
    double median, sigma, limit;
} straggler_verdict_t;

void straggler_judge(const straggler_config_t *c, const double *b, int ranks, bool *over,
                     straggler_verdict_t *v);

/* A rank found slow. */
typedef struct straggler_finding {
    int rank;
    int64_t step;  /* the step whose judgement made it a straggler */
    int steps;     /* judged steps in a row above the limit */
    double busy_s; /* its moving median at that step */
    double median_s, limit_s;
} straggler_finding_t;

#define STRAGGLER_HISTORY 64    /* steps of busy times kept per rank */
#define STRAGGLER_MAX_WINDOW 32 /* the longest moving median */

/* The busy times of one incarnation's ranks, judged step by step. */
typedef struct straggler_tracker {
    straggler_config_t cfg;
    int ranks;
    int64_t next;    /* the next step to judge */
    int64_t *step;   /* [ranks][STRAGGLER_HISTORY]: the step held in each place (-1) */
    double *busy;    /* [ranks][STRAGGLER_HISTORY]: its busy time */
    int64_t *latest; /* [ranks] the newest step reported */
    int *run;        /* [ranks] judged steps in a row above the limit */
    bool *found;     /* [ranks] already reported */
} straggler_tracker_t;

/* Returns 0, or -1 when out of memory. */
int straggler_tracker_init(straggler_tracker_t *t, const straggler_config_t *c, int ranks);
void straggler_tracker_free(straggler_tracker_t *t);
/* Rank r's busy time of `step`. */
void straggler_tracker_add(straggler_tracker_t *t, int rank, int64_t step, double busy_s);
/* Every "busy" pair of a member key's value (moe/elastic.h). */
void straggler_tracker_take(straggler_tracker_t *t, int rank, const cJSON *member);
/* Judges, in order, the steps that every rank has reported since the last call (a step some
 * rank's key no longer holds is skipped); returns true with the first new straggler in *f. */
bool straggler_tracker_judge(straggler_tracker_t *t, straggler_finding_t *f);

/* The newest committed checkpoint step in dir (a step-<N>/ folder with its commit marker
 * manifest.json, docs/checkpoint-format.md), -1 when none. */
int64_t straggler_committed_step(const char *dir);

#endif /* MOE_TOOLS_STRAGGLER_H */
