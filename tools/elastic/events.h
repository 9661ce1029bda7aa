/*
 * The launcher's events as JSON lines (docs/elastic.md lists them): one object per line with
 * "event" and "t" (Unix time, s), flushed at once so a watcher sees each as it happens; a
 * one-line summary of each goes to stderr.
 */
#ifndef MOE_TOOLS_EVENTS_H
#define MOE_TOOLS_EVENTS_H

#include <stdio.h>

#include <cjson/cJSON.h>

typedef struct events {
    FILE *f;
} events_t;

/* Opens path for appending (NULL or "": stderr only). Returns 0 or -1 with errno. */
int events_open(events_t *ev, const char *path);
/* Writes {"event": name, "t": now, ...fields}; fields (may be NULL) is consumed. */
void events_emit(events_t *ev, const char *name, cJSON *fields);
void events_close(events_t *ev);

#endif /* MOE_TOOLS_EVENTS_H */
