/*
 * The etcd v3 JSON gateway client (etcd.h). Each call is one POST of a JSON body to
 * <endpoint>/v3/<service>/<method>; keys and values travel base64-encoded (libcrypto's
 * EVP_EncodeBlock / EVP_DecodeBlock), 64-bit integers as JSON strings. A prefix is the range
 * [prefix, prefix with its last byte incremented), etcd's own rule for "every key under".
 * The gateway answers an error either as {"error", "code", "message"} (unary calls, HTTP
 * status >= 400) or inside {"error": {...}} (the keep-alive stream): both become a status
 * naming the method and etcd's message.
 *
 * Endpoints: a client holds a list (one etcd member each, "http://a:2379,http://b:2379") and
 * sends each request to the member that answered last. When that member cannot be reached
 * (a transport error: refused, reset, timed out) or answers that it cannot serve the request
 * now (gRPC Unavailable or DeadlineExceeded: no leader, lost quorum, still starting), the same
 * request goes to the next member, in list order, until one answers or all were tried; the one
 * that answered is used from then on. Every call the elastic layer makes is safe to repeat (a
 * put writes the same value, a keep-alive or revoke of the same lease, a range read); a lease
 * grant repeated after a lost answer leaves an unused lease that expires by its TTL. So one
 * member lost costs at most one request's timeout, once; a cluster without quorum fails every
 * request, each naming the last member tried.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <openssl/evp.h>

#include "core/error.h"
#include "etcd.h"

/* gRPC's NotFound, which etcd returns for an unknown or expired lease; DeadlineExceeded and
 * Unavailable, which a member returns when it cannot serve now (no leader, no quorum) */
#define GRPC_NOT_FOUND 5
#define GRPC_DEADLINE_EXCEEDED 4
#define GRPC_UNAVAILABLE 14
#define MAX_ENDPOINTS 16

struct el_etcd {
    char *endpoints[MAX_ENDPOINTS]; /* without trailing '/' */
    int n_endpoints;
    int current; /* the member that answered last (under lock) */
    int32_t timeout_ms;
    CURL *curl;
    pthread_mutex_t lock;
};

typedef struct buf {
    char *data;
    size_t len;
} buf_t;

/* ---- base64 ------------------------------------------------------------------------------ */

static char *b64_encode(const char *s, size_t n)
{
    char *out = malloc(4 * ((n + 2) / 3) + 1);
    if (out) EVP_EncodeBlock((unsigned char *)out, (const unsigned char *)s, (int)n);
    return out;
}

/* NULL on malformed input or no memory; the result is NUL-terminated. */
static char *b64_decode(const char *s)
{
    size_t n = strlen(s);
    if (n % 4) return NULL;
    char *out = malloc(3 * (n / 4) + 1);
    if (!out) return NULL;
    int len = n ? EVP_DecodeBlock((unsigned char *)out, (const unsigned char *)s, (int)n) : 0;
    if (len < 0) {
        free(out);
        return NULL;
    }
    /* DecodeBlock counts the padding's bytes as zeros */
    for (size_t i = n; i > 0 && s[i - 1] == '='; i--) len--;
    out[len] = 0;
    return out;
}

/* ---- transport --------------------------------------------------------------------------- */

static size_t on_write(char *p, size_t size, size_t nmemb, void *user)
{
    buf_t *b = user;
    size_t n = size * nmemb;
    char *d = realloc(b->data, b->len + n + 1);
    if (!d) return 0;
    memcpy(d + b->len, p, n);
    b->data = d;
    b->len += n;
    d[b->len] = 0;
    return n;
}

/* An int64 that the gateway writes as a string (or, from other encoders, a number); 0 when
 * absent, as proto3 omits zero fields. */
static int64_t json_i64(const cJSON *obj, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (cJSON_IsString(v)) return strtoll(v->valuestring, NULL, 10);
    if (cJSON_IsNumber(v)) return (int64_t)v->valuedouble;
    return 0;
}

/* The gateway's error object, if any: [out] grpc code; returns a status with its message. */
static moe_status_t gateway_error(const char *method, long http, const cJSON *root, int *code)
{
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(root, "error");
    const cJSON *src = cJSON_IsObject(err) ? err : root;
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(src, "message");
    if (!cJSON_IsString(msg) && cJSON_IsString(err)) msg = err;
    *code = (int)json_i64(src, cJSON_IsObject(err) ? "grpc_code" : "code");
    return MOE_FAIL(*code == GRPC_NOT_FOUND ? MOE_STATUS_NOT_FOUND : MOE_STATUS_REMOTE_ERROR,
                    "etcd %s: HTTP %ld: %s", method, http,
                    cJSON_IsString(msg) ? msg->valuestring : "(no message)");
}

/* One POST of text to <endpoint>/v3/<method> (under e->lock). [out] reply, grpc_code;
 * *try_next when another member may serve the request. */
static moe_status_t post_once(el_etcd_t *e, const char *endpoint, const char *method,
                              const char *text, cJSON **reply, int *grpc_code, bool *try_next)
{
    char url[1024];
    snprintf(url, sizeof url, "%s/v3/%s", endpoint, method);
    buf_t b = {0};
    moe_status_t st = MOE_STATUS_SUCCESS;
    *try_next = false;
    struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_reset(e->curl);
    MOE_CHECK_CURL_GOTO(st, curl_easy_setopt(e->curl, CURLOPT_URL, url));
    MOE_CHECK_CURL_GOTO(st, curl_easy_setopt(e->curl, CURLOPT_POSTFIELDS, text));
    MOE_CHECK_CURL_GOTO(st, curl_easy_setopt(e->curl, CURLOPT_HTTPHEADER, hdr));
    MOE_CHECK_CURL_GOTO(st, curl_easy_setopt(e->curl, CURLOPT_TIMEOUT_MS, (long)e->timeout_ms));
    MOE_CHECK_CURL_GOTO(st, curl_easy_setopt(e->curl, CURLOPT_NOSIGNAL, 1L));
    MOE_CHECK_CURL_GOTO(st, curl_easy_setopt(e->curl, CURLOPT_WRITEFUNCTION, on_write));
    MOE_CHECK_CURL_GOTO(st, curl_easy_setopt(e->curl, CURLOPT_WRITEDATA, &b));
    CURLcode rc = curl_easy_perform(e->curl);
    long http = 0;
    curl_easy_getinfo(e->curl, CURLINFO_RESPONSE_CODE, &http);
    if (rc != CURLE_OK) {
        *try_next = true;
        st = MOE_FAIL(rc == CURLE_OPERATION_TIMEDOUT ? MOE_STATUS_TIMEOUT : MOE_STATUS_REMOTE_ERROR,
                      "etcd %s at %s: %s", method, endpoint, curl_easy_strerror(rc));
        goto fail;
    }
    cJSON *root = b.data ? cJSON_Parse(b.data) : NULL;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        *try_next = http >= 500;
        st = MOE_FAIL(MOE_STATUS_REMOTE_ERROR,
                      "etcd %s at %s: HTTP %ld and no JSON object in "
                      "the answer (%.200s)",
                      method, endpoint, http, b.data ? b.data : "");
        goto fail;
    }
    if (http >= 400 || cJSON_GetObjectItemCaseSensitive(root, "error")) {
        st = gateway_error(method, http, root, grpc_code);
        *try_next = *grpc_code == GRPC_UNAVAILABLE || *grpc_code == GRPC_DEADLINE_EXCEEDED;
        cJSON_Delete(root);
        goto fail;
    }
    *reply = root;
fail:
    curl_slist_free_all(hdr);
    free(b.data);
    return st;
}

/* POST body (consumed) to /v3/<method> on the member that answered last, then on the others
 * while they cannot serve it; [out] reply: the parsed answer (cJSON_Delete it). */
static moe_status_t call(el_etcd_t *e, const char *method, cJSON *body, cJSON **reply,
                         int *grpc_code)
{
    *reply = NULL;
    *grpc_code = 0;
    char *text = body ? cJSON_PrintUnformatted(body) : NULL;
    cJSON_Delete(body);
    if (!text) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd %s: request body", method);
    moe_status_t st = MOE_STATUS_SUCCESS;
    pthread_mutex_lock(&e->lock);
    for (int i = 0; i < e->n_endpoints; i++) {
        int at = (e->current + i) % e->n_endpoints;
        bool try_next;
        *grpc_code = 0;
        st = post_once(e, e->endpoints[at], method, text, reply, grpc_code, &try_next);
        if (!try_next) {
            if (st == MOE_STATUS_SUCCESS || *grpc_code) e->current = at; /* it answered */
            break;
        }
    }
    pthread_mutex_unlock(&e->lock);
    free(text);
    return st;
}

/* ---- the client -------------------------------------------------------------------------- */

void el_etcd_destroy(el_etcd_t *e)
{
    if (!e) return;
    if (e->curl) curl_easy_cleanup(e->curl);
    pthread_mutex_destroy(&e->lock);
    for (int i = 0; i < e->n_endpoints; i++) free(e->endpoints[i]);
    free(e);
}

moe_status_t el_etcd_create(const char *endpoints, int32_t timeout_ms, el_etcd_t **out)
{
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(endpoints && *endpoints, "etcd endpoint list is empty");
    MOE_CHECK_ARG(timeout_ms > 0, "etcd request timeout %d ms must be > 0", (int)timeout_ms);
    MOE_CHECK_GEN(CURLcode, curl_global_init(CURL_GLOBAL_DEFAULT), rc_ == CURLE_OK,
                  MOE_STATUS_INTERNAL, curl_easy_strerror);
    el_etcd_t *e = calloc(1, sizeof *e);
    if (!e) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd client");
    pthread_mutex_init(&e->lock, NULL);
    e->timeout_ms = timeout_ms;
    e->curl = curl_easy_init();
    moe_status_t st = e->curl ? MOE_STATUS_SUCCESS
                              : MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd client");
    for (const char *p = endpoints; st == MOE_STATUS_SUCCESS && *p;) {
        size_t n = strcspn(p, ",");
        if (n && (!strncmp(p, "http://", 7) || !strncmp(p, "https://", 8)) && n > 8 &&
            e->n_endpoints < MAX_ENDPOINTS) {
            char *one = strndup(p, n);
            while (one && n > 0 && one[n - 1] == '/') one[--n] = 0;
            if (!one)
                st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd client");
            else
                e->endpoints[e->n_endpoints++] = one;
        } else {
            st = MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "etcd endpoint \"%.*s\" in \"%s\": %s",
                          (int)n, p, endpoints,
                          e->n_endpoints == MAX_ENDPOINTS ? "too many (at most 16)"
                                                          : "must start with http:// or https://");
        }
        p += n;
        if (*p == ',') p++;
    }
    if (st == MOE_STATUS_SUCCESS && !e->n_endpoints)
        st = MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "etcd endpoint list \"%s\" names none",
                      endpoints);
    if (st != MOE_STATUS_SUCCESS) {
        el_etcd_destroy(e);
        return st;
    }
    *out = e;
    return MOE_STATUS_SUCCESS;
}

static cJSON *obj_i64(const char *name, int64_t v)
{
    char s[32];
    snprintf(s, sizeof s, "%lld", (long long)v);
    cJSON *o = cJSON_CreateObject();
    if (o) cJSON_AddStringToObject(o, name, s);
    return o;
}

moe_status_t el_etcd_lease_grant(el_etcd_t *e, int64_t ttl_s, int64_t *id, int64_t *granted_ttl_s)
{
    MOE_CHECK_ARG(e && id, "etcd lease grant: NULL argument");
    MOE_CHECK_ARG(ttl_s >= 1, "etcd lease TTL %lld s must be >= 1", (long long)ttl_s);
    cJSON *r;
    int code;
    MOE_TRY(call(e, "lease/grant", obj_i64("TTL", ttl_s), &r, &code));
    *id = json_i64(r, "ID");
    if (granted_ttl_s) *granted_ttl_s = json_i64(r, "TTL");
    cJSON_Delete(r);
    if (*id == 0) return MOE_FAIL(MOE_STATUS_REMOTE_ERROR, "etcd lease/grant: no lease ID");
    return MOE_STATUS_SUCCESS;
}

moe_status_t el_etcd_lease_keepalive(el_etcd_t *e, int64_t id)
{
    MOE_CHECK_ARG(e != NULL, "etcd client is NULL");
    cJSON *r;
    int code;
    MOE_TRY(call(e, "lease/keepalive", obj_i64("ID", id), &r, &code));
    /* a stream: {"result": {...}}; an expired lease comes back with TTL 0 (omitted) */
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(r, "result");
    int64_t ttl = json_i64(res ? res : r, "TTL");
    cJSON_Delete(r);
    if (ttl <= 0)
        return MOE_FAIL(MOE_STATUS_NOT_FOUND, "etcd lease %llx has expired",
                        (unsigned long long)id);
    return MOE_STATUS_SUCCESS;
}

moe_status_t el_etcd_lease_revoke(el_etcd_t *e, int64_t id)
{
    MOE_CHECK_ARG(e != NULL, "etcd client is NULL");
    cJSON *r;
    int code;
    moe_status_t st = call(e, "lease/revoke", obj_i64("ID", id), &r, &code);
    cJSON_Delete(r);
    if (st == MOE_STATUS_NOT_FOUND) {
        moe_error_clear();
        return MOE_STATUS_SUCCESS;
    }
    return st;
}

/* body["key"] = base64(key) and, for a prefix, body["range_end"] = base64(prefix + 1). */
static cJSON *key_body(const char *key, bool prefix)
{
    cJSON *o = cJSON_CreateObject();
    char *k = b64_encode(key, strlen(key));
    char *end = NULL;
    if (prefix) {
        size_t n = strlen(key);
        char *p = malloc(n + 1);
        if (p) {
            memcpy(p, key, n + 1);
            while (n > 0 && (unsigned char)p[n - 1] == 0xff) n--; /* drop trailing 0xff bytes */
            if (n > 0) p[n - 1] = (char)((unsigned char)p[n - 1] + 1);
            end = n > 0 ? b64_encode(p, n) : strdup("AA=="); /* "\0": to the end of the keys */
            free(p);
        }
    }
    bool ok = o && k && (!prefix || end) && cJSON_AddStringToObject(o, "key", k) &&
              (!prefix || cJSON_AddStringToObject(o, "range_end", end));
    free(k);
    free(end);
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

moe_status_t el_etcd_put(el_etcd_t *e, const char *key, const char *value, int64_t lease)
{
    MOE_CHECK_ARG(e && key && *key && value, "etcd put: NULL or empty argument");
    cJSON *body = key_body(key, false);
    char *v = b64_encode(value, strlen(value));
    char ls[32];
    snprintf(ls, sizeof ls, "%lld", (long long)lease);
    if (!body || !v || !cJSON_AddStringToObject(body, "value", v) ||
        (lease && !cJSON_AddStringToObject(body, "lease", ls))) {
        cJSON_Delete(body);
        free(v);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd put %s", key);
    }
    free(v);
    cJSON *r;
    int code;
    MOE_TRY(call(e, "kv/put", body, &r, &code));
    cJSON_Delete(r);
    return MOE_STATUS_SUCCESS;
}

void el_kvs_free(el_kv_t *kvs, size_t n)
{
    for (size_t i = 0; kvs && i < n; i++) {
        free(kvs[i].key);
        free(kvs[i].value);
    }
    free(kvs);
}

moe_status_t el_etcd_range_prefix(el_etcd_t *e, const char *prefix, el_kv_t **kvs, size_t *n)
{
    MOE_CHECK_ARG(e && prefix && *prefix && kvs && n, "etcd range: NULL or empty argument");
    *kvs = NULL;
    *n = 0;
    cJSON *body = key_body(prefix, true);
    if (!body) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd range %s", prefix);
    cJSON *r;
    int code;
    MOE_TRY(call(e, "kv/range", body, &r, &code));
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(r, "kvs");
    int count = cJSON_IsArray(arr) ? cJSON_GetArraySize(arr) : 0;
    el_kv_t *out = count ? calloc((size_t)count, sizeof *out) : NULL;
    if (count && !out) {
        cJSON_Delete(r);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd range %s: %d keys", prefix, count);
    }
    int i = 0;
    const cJSON *kv;
    cJSON_ArrayForEach(kv, arr)
    {
        const cJSON *k = cJSON_GetObjectItemCaseSensitive(kv, "key");
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(kv, "value");
        out[i].key = cJSON_IsString(k) ? b64_decode(k->valuestring) : NULL;
        out[i].value = cJSON_IsString(v) ? b64_decode(v->valuestring) : strdup("");
        out[i].mod_revision = json_i64(kv, "mod_revision");
        out[i].lease = json_i64(kv, "lease");
        if (!out[i].key || !out[i].value) {
            el_kvs_free(out, (size_t)i + 1);
            cJSON_Delete(r);
            return MOE_FAIL(MOE_STATUS_REMOTE_ERROR,
                            "etcd range %s: a key or value is not "
                            "base64",
                            prefix);
        }
        i++;
    }
    cJSON_Delete(r);
    *kvs = out;
    *n = (size_t)count;
    return MOE_STATUS_SUCCESS;
}

moe_status_t el_etcd_delete_prefix(el_etcd_t *e, const char *prefix, int64_t *deleted)
{
    MOE_CHECK_ARG(e && prefix && *prefix, "etcd delete: NULL or empty prefix");
    cJSON *body = key_body(prefix, true);
    if (!body) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd delete %s", prefix);
    cJSON *r;
    int code;
    MOE_TRY(call(e, "kv/deleterange", body, &r, &code));
    if (deleted) *deleted = json_i64(r, "deleted");
    cJSON_Delete(r);
    return MOE_STATUS_SUCCESS;
}

moe_status_t el_etcd_create_key(el_etcd_t *e, const char *key, const char *value, int64_t lease,
                                bool *created, char **holder)
{
    MOE_CHECK_ARG(e && key && *key && value && created, "etcd create: NULL or empty argument");
    *created = false;
    if (holder) *holder = NULL;
    char *k = b64_encode(key, strlen(key)), *v = b64_encode(value, strlen(value));
    char ls[32];
    snprintf(ls, sizeof ls, "%lld", (long long)lease);
    cJSON *body = cJSON_CreateObject(), *cmp = cJSON_CreateObject(), *put = cJSON_CreateObject(),
          *get = cJSON_CreateObject();
    cJSON *cmps = cJSON_AddArrayToObject(body, "compare");
    cJSON *ok = cJSON_AddArrayToObject(body, "success");
    cJSON *no = cJSON_AddArrayToObject(body, "failure");
    cJSON *put_req = cJSON_AddObjectToObject(put, "request_put");
    cJSON *get_req = cJSON_AddObjectToObject(get, "request_range");
    bool built = k && v && cmps && ok && no && put_req && get_req &&
                 /* the key's creation revision is 0 while it does not exist */
                 cJSON_AddStringToObject(cmp, "target", "CREATE") &&
                 cJSON_AddStringToObject(cmp, "key", k) &&
                 cJSON_AddStringToObject(cmp, "create_revision", "0") &&
                 cJSON_AddStringToObject(put_req, "key", k) &&
                 cJSON_AddStringToObject(put_req, "value", v) &&
                 (!lease || cJSON_AddStringToObject(put_req, "lease", ls)) &&
                 cJSON_AddStringToObject(get_req, "key", k);
    free(k);
    free(v);
    if (built) {
        cJSON_AddItemToArray(cmps, cmp);
        cJSON_AddItemToArray(ok, put);
        cJSON_AddItemToArray(no, get);
    } else {
        cJSON_Delete(cmp);
        cJSON_Delete(put);
        cJSON_Delete(get);
        cJSON_Delete(body);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "etcd create %s", key);
    }
    cJSON *r;
    int code;
    MOE_TRY(call(e, "kv/txn", body, &r, &code));
    *created = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "succeeded"));
    if (!*created && holder) {
        /* responses[0].response_range.kvs[0].value: what the holder wrote */
        const cJSON *res = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r, "responses"), 0);
        const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(res, "response_range"), "kvs");
        const cJSON *val = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(kvs, 0), "value");
        *holder = cJSON_IsString(val) ? b64_decode(val->valuestring) : strdup("");
    }
    cJSON_Delete(r);
    return MOE_STATUS_SUCCESS;
}
