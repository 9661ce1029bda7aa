/* The JSON-lines event log (events.h). */
#include <stdlib.h>
#include <string.h>

#include "events.h"
#include "proc.h"

int events_open(events_t *ev, const char *path)
{
    ev->f = NULL;
    if (!path || !*path) return 0;
    ev->f = fopen(path, "a");
    return ev->f ? 0 : -1;
}

void events_emit(events_t *ev, const char *name, cJSON *fields)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) {
        cJSON_Delete(fields);
        return;
    }
    cJSON_AddStringToObject(o, "event", name);
    cJSON_AddNumberToObject(o, "t", proc_wall());
    cJSON *f = fields ? fields->child : NULL;
    while (f) { /* move the fields over, in order */
        cJSON *next = f->next;
        cJSON_AddItemToObject(o, f->string, cJSON_DetachItemViaPointer(fields, f));
        f = next;
    }
    cJSON_Delete(fields);
    char *line = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!line) return;
    if (ev->f) {
        fprintf(ev->f, "%s\n", line);
        fflush(ev->f);
    }
    fprintf(stderr, "moe_elastic: %s\n", line);
    free(line);
}

void events_close(events_t *ev)
{
    if (ev->f) fclose(ev->f);
    ev->f = NULL;
}
