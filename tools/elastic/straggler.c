/*
 * Straggler statistics (straggler.h): the options, the judgement of one step over the ranks'
 * moving medians, and the tracker that feeds it every step all ranks have reported. Pure
 * functions of the busy times, apart from reading the checkpoint folder's commit markers.
 */
#include "straggler.h"

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAD_TO_SIGMA 1.4826 /* sigma of a normal distribution per median absolute deviation */
#define SIGMA_FLOOR 0.05    /* sigma is at least this share of the median */

void straggler_config_default(straggler_config_t *c)
{
    *c = (straggler_config_t){.policy = STRAGGLER_WARN,
                              .sigma = 3.0,
                              .ratio = 0,
                              .steps = 5,
                              .window = 5,
                              .min_gap_s = 0.010};
}

void straggler_usage(FILE *f)
{
    fprintf(f,
            "  --straggler-policy P  off | warn (default: a straggler event) | replace (also:\n"
            "                       a spare takes the slow rank's slot after the next checkpoint)\n"
            "  --straggler-sigma K  slow: a rank's busy time above median + K sigma, default 3\n"
            "  --straggler-ratio R  slow: above R x median instead (R > 1), default off\n"
            "  --straggler-steps M  for M judged steps in a row, default 5\n"
            "  --straggler-window W  a rank's busy time: its median over W steps, default 5\n"
            "  --straggler-min-gap-ms G  and at least G ms above the median, default 10\n");
}

static int number_arg(const char *flag, const char *v, double lo, double hi, double *out, char *err,
                      size_t len)
{
    char *end;
    double x = v ? strtod(v, &end) : 0;
    if (!v || !*v || *end || !(x >= lo && x <= hi)) {
        snprintf(err, len, "%s: \"%s\" is not a number in [%g, %g]", flag, v ? v : "", lo, hi);
        return -1;
    }
    *out = x;
    return 1;
}

int straggler_parse_option(straggler_config_t *c, const char *a, const char *v, char *err,
                           size_t len)
{
    if (strncmp(a, "--straggler-", 12)) return 0;
    double x = 0;
    int rc;
    if (!strcmp(a, "--straggler-policy")) {
        static const char *const names[] = {"off", "warn", "replace"};
        for (int p = 0; v && p < 3; p++)
            if (!strcmp(v, names[p])) {
                c->policy = (straggler_policy_t)p;
                return 1;
            }
        snprintf(err, len, "%s: \"%s\" is not off, warn or replace", a, v ? v : "");
        return -1;
    }
    if (!strcmp(a, "--straggler-sigma")) {
        if ((rc = number_arg(a, v, 0.5, 100, &x, err, len)) > 0) c->sigma = x;
    } else if (!strcmp(a, "--straggler-ratio")) {
        if ((rc = number_arg(a, v, 1.01, 1000, &x, err, len)) > 0) c->ratio = x;
    } else if (!strcmp(a, "--straggler-steps")) {
        if ((rc = number_arg(a, v, 1, 1000, &x, err, len)) > 0) c->steps = (int)x;
    } else if (!strcmp(a, "--straggler-window")) {
        if ((rc = number_arg(a, v, 1, STRAGGLER_MAX_WINDOW, &x, err, len)) > 0) c->window = (int)x;
    } else if (!strcmp(a, "--straggler-min-gap-ms")) {
        if ((rc = number_arg(a, v, 0, 3.6e6, &x, err, len)) > 0) c->min_gap_s = x / 1e3;
    } else {
        snprintf(err, len, "%s: unknown option (see --help)", a);
        return -1;
    }
    if (rc > 0 && x != floor(x) &&
        (!strcmp(a, "--straggler-steps") || !strcmp(a, "--straggler-window"))) {
        snprintf(err, len, "%s: \"%s\" is not a whole number", a, v);
        return -1;
    }
    return rc;
}

/* ---- one step's judgement ------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0..n) (n >= 1); v is sorted in place. */
static double median_of(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void straggler_judge(const straggler_config_t *c, const double *b, int ranks, bool *over,
                     straggler_verdict_t *v)
{
    double tmp[ranks > 0 ? ranks : 1];
    memcpy(tmp, b, sizeof(double) * (size_t)ranks);
    double median = ranks > 0 ? median_of(tmp, ranks) : 0;
    for (int r = 0; r < ranks; r++) tmp[r] = fabs(b[r] - median);
    double sigma = ranks > 0 ? MAD_TO_SIGMA * median_of(tmp, ranks) : 0;
    if (sigma < SIGMA_FLOOR * median) sigma = SIGMA_FLOOR * median;
    double limit = c->ratio > 0 ? c->ratio * median : median + c->sigma * sigma;
    if (limit < median + c->min_gap_s) limit = median + c->min_gap_s;
    for (int r = 0; r < ranks; r++) over[r] = b[r] > limit;
    *v = (straggler_verdict_t){median, sigma, limit};
}

/* ---- the tracker ----------------------------------------------------------------------------- */

int straggler_tracker_init(straggler_tracker_t *t, const straggler_config_t *c, int ranks)
{
    memset(t, 0, sizeof *t);
    t->cfg = *c;
    t->ranks = ranks;
    size_t cells = (size_t)ranks * STRAGGLER_HISTORY;
    t->step = malloc(cells * sizeof *t->step);
    t->busy = calloc(cells, sizeof *t->busy);
    t->latest = malloc((size_t)ranks * sizeof *t->latest);
    t->run = calloc((size_t)ranks, sizeof *t->run);
    t->found = calloc((size_t)ranks, sizeof *t->found);
    if (!t->step || !t->busy || !t->latest || !t->run || !t->found) {
        straggler_tracker_free(t);
        return -1;
    }
    for (size_t i = 0; i < cells; i++) t->step[i] = -1;
    for (int r = 0; r < ranks; r++) t->latest[r] = -1;
    return 0;
}

void straggler_tracker_free(straggler_tracker_t *t)
{
    free(t->step);
    free(t->busy);
    free(t->latest);
    free(t->run);
    free(t->found);
    memset(t, 0, sizeof *t);
}

void straggler_tracker_add(straggler_tracker_t *t, int rank, int64_t step, double busy_s)
{
    if (rank < 0 || rank >= t->ranks || step < 0 || !(busy_s >= 0)) return;
    size_t at = (size_t)rank * STRAGGLER_HISTORY + (size_t)(step % STRAGGLER_HISTORY);
    t->step[at] = step;
    t->busy[at] = busy_s;
    if (step > t->latest[rank]) t->latest[rank] = step;
}

void straggler_tracker_take(straggler_tracker_t *t, int rank, const cJSON *member)
{
    const cJSON *busy = cJSON_GetObjectItemCaseSensitive(member, "busy");
    const cJSON *pair;
    cJSON_ArrayForEach(pair, busy)
    {
        const cJSON *s = cJSON_GetArrayItem(pair, 0), *b = cJSON_GetArrayItem(pair, 1);
        if (cJSON_IsNumber(s) && cJSON_IsNumber(b))
            straggler_tracker_add(t, rank, (int64_t)s->valuedouble, b->valuedouble);
    }
}

/* Rank r's busy time of `step`, if held. */
static bool held(const straggler_tracker_t *t, int r, int64_t step, double *busy)
{
    size_t at = (size_t)r * STRAGGLER_HISTORY + (size_t)(step % STRAGGLER_HISTORY);
    if (t->step[at] != step) return false;
    *busy = t->busy[at];
    return true;
}

/* Rank r's moving median at `step`: over the last `window` steps it holds up to `step`. */
static double moving_median(const straggler_tracker_t *t, int r, int64_t step)
{
    double v[STRAGGLER_MAX_WINDOW];
    int n = 0;
    for (int64_t s = step; s >= 0 && s > step - STRAGGLER_HISTORY && n < t->cfg.window; s--)
        if (held(t, r, s, &v[n])) n++;
    return n ? median_of(v, n) : 0;
}

bool straggler_tracker_judge(straggler_tracker_t *t, straggler_finding_t *f)
{
    if (t->ranks <= 0) return false;
    int64_t complete = t->latest[0];
    for (int r = 1; r < t->ranks; r++)
        if (t->latest[r] < complete) complete = t->latest[r];
    if (complete < 0) return false;
    if (t->next < complete - STRAGGLER_HISTORY + 1) t->next = complete - STRAGGLER_HISTORY + 1;
    double b[t->ranks];
    bool over[t->ranks];
    for (; t->next <= complete; t->next++) {
        int64_t s = t->next;
        bool all = true;
        for (int r = 0; r < t->ranks && all; r++) all = held(t, r, s, &b[r]);
        if (!all) continue; /* a key that moved past it: neither above nor below */
        for (int r = 0; r < t->ranks; r++) b[r] = moving_median(t, r, s);
        straggler_verdict_t v;
        straggler_judge(&t->cfg, b, t->ranks, over, &v);
        for (int r = 0; r < t->ranks; r++) t->run[r] = over[r] ? t->run[r] + 1 : 0;
        for (int r = 0; r < t->ranks; r++) {
            if (t->run[r] < t->cfg.steps || t->found[r]) continue;
            t->found[r] = true;
            *f = (straggler_finding_t){.rank = r,
                                       .step = s,
                                       .steps = t->run[r],
                                       .busy_s = b[r],
                                       .median_s = v.median,
                                       .limit_s = v.limit};
            t->next++;
            return true;
        }
    }
    return false;
}

int64_t straggler_committed_step(const char *dir)
{
    DIR *d = dir ? opendir(dir) : NULL;
    if (!d) return -1;
    int64_t newest = -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        if (strncmp(e->d_name, "step-", 5)) continue;
        long long step = strtoll(e->d_name + 5, &end, 10);
        if (*end || step <= newest) continue;
        char path[4096];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s/manifest.json", dir, e->d_name);
        if (stat(path, &st) == 0) newest = step;
    }
    closedir(d);
    return newest;
}
