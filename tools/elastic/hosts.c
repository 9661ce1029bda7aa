/* The leader's view of the hosts (hosts.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "hosts.h"
#include "proc.h"

static int find(const hosts_t *h, const char *name)
{
    for (int i = 0; i < h->n; i++)
        if (!strcmp(h->name[i], name)) return i;
    return -1;
}

int hosts_refresh(hosts_t *h)
{
    char pfx[300], map_key[300];
    snprintf(pfx, sizeof pfx, "/moe/%s/agents/", h->job);
    snprintf(map_key, sizeof map_key, "/moe/%s/slotmap", h->job);
    el_kv_t *kvs, *map;
    size_t n, nm;
    if (el_etcd_range_prefix(h->etcd, pfx, &kvs, &n) != MOE_STATUS_SUCCESS) return -1;
    if (el_etcd_range_prefix(h->etcd, map_key, &map, &nm) != MOE_STATUS_SUCCESS) {
        el_kvs_free(kvs, n);
        return -1;
    }
    /* the slot map first: every host ever seen keeps its range */
    cJSON *m = nm ? cJSON_Parse(map[0].value) : NULL;
    if (!m) m = cJSON_CreateObject();
    h->n = 0;
    h->total = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, m)
    {
        if (h->n == HOSTS_MAX || !cJSON_IsArray(e) || cJSON_GetArraySize(e) != 2) continue;
        snprintf(h->name[h->n], sizeof h->name[0], "%s", e->string);
        h->first[h->n] = (int)cJSON_GetArrayItem(e, 0)->valuedouble;
        h->slots[h->n] = (int)cJSON_GetArrayItem(e, 1)->valuedouble;
        h->live[h->n] = false;
        if (h->first[h->n] + h->slots[h->n] > h->total) h->total = h->first[h->n] + h->slots[h->n];
        h->n++;
    }
    bool grew = false;
    for (size_t i = 0; i < n; i++) {
        cJSON *o = cJSON_Parse(kvs[i].value);
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "host");
        const cJSON *slots = cJSON_GetObjectItemCaseSensitive(o, "slots");
        if (cJSON_IsString(name) && cJSON_IsNumber(slots)) {
            int k = find(h, name->valuestring);
            if (k < 0 && h->n < HOSTS_MAX) {
                k = h->n++;
                snprintf(h->name[k], sizeof h->name[0], "%s", name->valuestring);
                h->first[k] = h->total;
                h->slots[k] = (int)slots->valuedouble;
                h->total += h->slots[k];
                cJSON *pair = cJSON_CreateArray();
                cJSON_AddItemToArray(pair, cJSON_CreateNumber(h->first[k]));
                cJSON_AddItemToArray(pair, cJSON_CreateNumber(h->slots[k]));
                cJSON_AddItemToObject(m, h->name[k], pair);
                grew = true;
            }
            if (k >= 0) h->live[k] = true;
        }
        cJSON_Delete(o);
    }
    el_kvs_free(kvs, n);
    el_kvs_free(map, nm);
    int rc = 0;
    if (grew) {
        char *text = cJSON_PrintUnformatted(m);
        rc = text && el_etcd_put(h->etcd, map_key, text, 0) == MOE_STATUS_SUCCESS ? 0 : -1;
        free(text);
    }
    cJSON_Delete(m);
    return rc;
}

int hosts_of_slot(const hosts_t *h, int slot)
{
    for (int i = 0; i < h->n; i++)
        if (slot >= h->first[i] && slot < h->first[i] + h->slots[i]) return i;
    return -1;
}

int hosts_write_hostfile(const hosts_t *h, const int *slots, int world, const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    for (int k = 0; k < world;) {
        int host = hosts_of_slot(h, slots[k]), count = 0;
        while (k < world && hosts_of_slot(h, slots[k]) == host) k++, count++;
        fprintf(f, "%s slots=%d\n", host >= 0 ? h->name[host] : "?", count);
    }
    return fclose(f) ? -1 : 0;
}

int hosts_failed_read(hosts_t *h, bool *failed, int max)
{
    char key[300];
    snprintf(key, sizeof key, "/moe/%s/failed", h->job);
    el_kv_t *kvs;
    size_t n;
    if (el_etcd_range_prefix(h->etcd, key, &kvs, &n) != MOE_STATUS_SUCCESS) return -1;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(kvs[i].key, key)) continue;
        for (char *p = kvs[i].value; *p;) {
            long s = strtol(p, &p, 10);
            if (s >= 0 && s < max) failed[s] = true;
            if (*p != ',') break;
            p++;
        }
    }
    el_kvs_free(kvs, n);
    return 0;
}

int hosts_failed_write(hosts_t *h, const bool *failed, int max)
{
    char key[300], v[4096] = "";
    snprintf(key, sizeof key, "/moe/%s/failed", h->job);
    for (int i = 0; i < max; i++) {
        size_t l = strlen(v);
        if (failed[i]) snprintf(v + l, sizeof v - l, "%s%d", l ? "," : "", i);
    }
    return el_etcd_put(h->etcd, key, v[0] ? v : " ", 0) == MOE_STATUS_SUCCESS ? 0 : -1;
}

double hosts_end_incarnation(hosts_t *h, int inc, const int *slots, int world, double wait_s,
                             bool *lost, void (*tick)(void *), void *tick_user)
{
    double t0 = proc_now();
    char key[300];
    snprintf(key, sizeof key, "/moe/%s/inc/%d/end", h->job, inc);
    bool want[HOSTS_MAX] = {false};
    for (int k = 0; k < world; k++) {
        int i = hosts_of_slot(h, slots[k]);
        if (i >= 0) want[i] = true;
    }
    for (int i = 0; i < HOSTS_MAX; i++) lost[i] = false;
    bool put = false;
    while (proc_now() - t0 < wait_s) {
        if (tick) tick(tick_user);
        if (!put) put = el_etcd_put(h->etcd, key, "1", 0) == MOE_STATUS_SUCCESS;
        if (put && hosts_refresh(h) == 0) {
            char pfx[300];
            snprintf(pfx, sizeof pfx, "/moe/%s/inc/%d/ended/", h->job, inc);
            el_kv_t *kvs;
            size_t n;
            if (el_etcd_range_prefix(h->etcd, pfx, &kvs, &n) == MOE_STATUS_SUCCESS) {
                int waiting = 0;
                for (int i = 0; i < h->n; i++) {
                    if (!want[i]) continue;
                    bool acked = false;
                    for (size_t j = 0; j < n; j++)
                        acked |= !strcmp(kvs[j].key + strlen(pfx), h->name[i]);
                    lost[i] = !h->live[i];
                    waiting += !acked && h->live[i];
                }
                el_kvs_free(kvs, n);
                if (!waiting) break;
            }
        }
        usleep(50 * 1000);
    }
    return proc_now() - t0;
}
