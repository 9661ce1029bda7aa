/*
 * A small etcd v3 client over its JSON gateway (POST /v3/..., keys and values base64), spoken
 * with libcurl and cJSON: the lease calls and the few key-value calls the elastic layer needs.
 * One client serialises its requests (a mutex around its curl handle), so a keep-alive thread
 * and the caller's thread may share it. Every request has a deadline (timeout_ms) per member
 * tried. A client knows every member of a cluster and fails over between them (etcd.c).
 */
#ifndef MOE_ELASTIC_ETCD_H
#define MOE_ELASTIC_ETCD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <moe/core.h>

typedef struct el_etcd el_etcd_t;

typedef struct el_kv {
    char *key, *value;    /* decoded, NUL-terminated */
    int64_t mod_revision; /* the store's revision of the last write: a total order */
    int64_t lease;        /* 0: none */
} el_kv_t;

/* endpoints: one member "http://127.0.0.1:2379" or a comma-separated list of a cluster's
 * members "http://a:2379,http://b:2379,http://c:2379" (no path; at most 16). Requests go to
 * the member that answered last and fail over to the others in list order. */
moe_status_t el_etcd_create(const char *endpoints, int32_t timeout_ms, el_etcd_t **out);
void el_etcd_destroy(el_etcd_t *e);

/* A lease of ttl_s seconds (etcd may grant a longer one: its minimum); [out] id, granted_ttl_s. */
moe_status_t el_etcd_lease_grant(el_etcd_t *e, int64_t ttl_s, int64_t *id, int64_t *granted_ttl_s);
/* Renews the lease; NOT_FOUND when it has already expired or was revoked. */
moe_status_t el_etcd_lease_keepalive(el_etcd_t *e, int64_t id);
/* Ends the lease and deletes its keys; an unknown lease is not an error. */
moe_status_t el_etcd_lease_revoke(el_etcd_t *e, int64_t id);

/* Writes key = value, attached to lease (0: none). */
moe_status_t el_etcd_put(el_etcd_t *e, const char *key, const char *value, int64_t lease);
/* [out] kvs (owned by the caller: el_kvs_free), n: every key starting with prefix, key order. */
moe_status_t el_etcd_range_prefix(el_etcd_t *e, const char *prefix, el_kv_t **kvs, size_t *n);
/* Deletes every key starting with prefix; [out] deleted (may be NULL). */
moe_status_t el_etcd_delete_prefix(el_etcd_t *e, const char *prefix, int64_t *deleted);
void el_kvs_free(el_kv_t *kvs, size_t n);
/* One transaction: writes key = value (on lease, 0: none) only if the key does not exist. [out]
 * created: whether this call wrote it; holder (may be NULL; free it): otherwise, the value
 * that is there (a leader key's holder). The election of moe_elastic's leader. */
moe_status_t el_etcd_create_key(el_etcd_t *e, const char *key, const char *value, int64_t lease,
                                bool *created, char **holder);

#endif /* MOE_ELASTIC_ETCD_H */
