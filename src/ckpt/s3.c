/*
 * The S3 tier: a small S3 client over libcurl.
 *   - Signing: AWS Signature V4 computed here (sigv4.c) over exactly the headers sent: Host,
 *     x-amz-content-sha256 (the payload's SHA-256, so S3 checks the body), x-amz-date and
 *     x-amz-security-token; path-style URLs. Not libcurl's CURLOPT_AWS_SIGV4: before 8.3 it
 *     signs a removed header ("Expect:", removed here to spare a round trip) that it then
 *     does not send, and every verifying server refuses the request.
 *   - Objects up to s3_part_bytes: one PUT; larger: multipart upload with s3_parallel_parts
 *     threads, each PUTting parts read straight from the local file, then Complete (or Abort).
 *   - Retries with exponential backoff (s3_retry_base_ms doubling up to s3_retry_max_ms,
 *     +-25 % jitter) on 5xx, 429, connection failures,
 *     resets and timeouts; other 4xx fail at once with S3's own error code and message
 *     (from the XML error body, also for downloads).
 *   - TLS verification stays on. The secret key only enters the signature: no message, log
 *     line or URL ever contains it.
 * Keys: <prefix>/<step-dir>/<file>.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>

#include "core/env.h"
#include "core/error.h"
#include "ckpt_internal.h"

/* ---- the client -------------------------------------------------------------------------- */

struct ck_s3 {
    char *endpoint, *bucket, *prefix, *region, *ak, *sk, *token;
    char *host; /* the endpoint's authority: the Host header sent and signed */
    size_t part_bytes;
    int parallel, max_retries, base_ms, max_ms, timeout_ms;
    const moe_logger_t *log;
    atomic_int cancelled;
};

typedef struct body { /* request body: memory or a range of a file */
    const char *mem;
    int fd;
    uint64_t off, len, pos;
} body_t;

typedef struct resp {
    char *data;
    size_t len, cap;
    int fd;     /* >= 0: a 2xx body goes to this file (an error body to data) */
    CURL *curl; /* the transfer, for its status in on_write */
    uint64_t written;
    bool write_failed;
    char etag[128];
} resp_t;

static char *env_dup(const char *cfg, moe_env_id_t a, int b, const moe_logger_t *log)
{
    if (cfg) return strdup(cfg);
    const char *v = moe_env_string(a, log);
    if (!v && b >= 0) v = moe_env_string((moe_env_id_t)b, log);
    return v ? strdup(v) : NULL;
}

moe_status_t ck_s3_create(const moe_ckpt_config_t *c, const moe_logger_t *log, ck_s3_t **out)
{
    MOE_CHECK_CURL(curl_global_init(CURL_GLOBAL_DEFAULT), MOE_STATUS_INTERNAL);
    ck_s3_t *s = calloc(1, sizeof *s);
    if (!s) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "S3 client");
    s->log = log;
    s->region = env_dup(c->s3_region, MOE_ENV_AWS_REGION, MOE_ENV_AWS_DEFAULT_REGION, log);
    if (!s->region) s->region = strdup("us-east-1");
    s->bucket = strdup(c->s3_bucket);
    const char *pfx = c->s3_prefix ? c->s3_prefix : "";
    size_t pl = strlen(pfx);
    while (pl > 0 && pfx[pl - 1] == '/') pl--;
    while (pl > 0 && *pfx == '/') pfx++, pl--;
    s->prefix = strndup(pfx, pl);
    if (c->s3_endpoint) {
        s->endpoint = strdup(c->s3_endpoint);
    } else if (s->region) {
        size_t n = strlen(s->region) + 40;
        s->endpoint = malloc(n);
        if (s->endpoint) snprintf(s->endpoint, n, "https://s3.%s.amazonaws.com", s->region);
    }
    if (s->endpoint) {
        size_t el = strlen(s->endpoint);
        while (el > 0 && s->endpoint[el - 1] == '/') s->endpoint[--el] = 0;
    }
    s->ak = env_dup(c->s3_access_key, MOE_ENV_AWS_ACCESS_KEY_ID, -1, log);
    s->sk = env_dup(c->s3_secret_key, MOE_ENV_AWS_SECRET_ACCESS_KEY, -1, log);
    s->token = env_dup(c->s3_session_token, MOE_ENV_AWS_SESSION_TOKEN, -1, log);
    s->part_bytes = c->s3_part_bytes;
    s->parallel = c->s3_parallel_parts;
    s->max_retries = c->s3_max_retries;
    s->base_ms = c->s3_retry_base_ms;
    s->max_ms = c->s3_retry_max_ms;
    s->timeout_ms = c->s3_timeout_ms;
    if (!s->region || !s->bucket || !s->prefix || !s->endpoint) {
        ck_s3_destroy(s);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "S3 client strings");
    }
    if (strncmp(s->endpoint, "http://", 7) != 0 && strncmp(s->endpoint, "https://", 8) != 0) {
        moe_status_t st = MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                                   "s3_endpoint must start with http:// or https://");
        ck_s3_destroy(s);
        return st;
    }
    const char *auth = strstr(s->endpoint, "://") + 3;
    s->host = strndup(auth, strcspn(auth, "/?#"));
    if (!s->host || !*s->host || strchr(s->host, '@')) {
        moe_status_t st = s->host ? MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                                             "s3_endpoint \"%s\" "
                                             "needs a host (and no user name)",
                                             s->endpoint)
                                  : MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "S3 client strings");
        ck_s3_destroy(s);
        return st;
    }
    if (!s->ak || !s->sk)
        moe_log(log, MOE_LOG_WARN,
                "checkpoint: no S3 credentials (config or AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY); requests are sent unsigned");
    *out = s;
    return MOE_STATUS_SUCCESS;
}

void ck_s3_destroy(ck_s3_t *s)
{
    if (!s) return;
    free(s->endpoint);
    free(s->host);
    free(s->bucket);
    free(s->prefix);
    free(s->region);
    if (s->sk) memset(s->sk, 0, strlen(s->sk));
    free(s->ak);
    free(s->sk);
    free(s->token);
    free(s);
    curl_global_cleanup();
}

void ck_s3_cancel(ck_s3_t *s) { atomic_store(&s->cancelled, 1); }

static void make_key(const ck_s3_t *s, const char *stepdir, const char *name, char *buf, size_t n)
{
    if (*s->prefix)
        snprintf(buf, n, "%s/%s/%s", s->prefix, stepdir, name);
    else
        snprintf(buf, n, "%s/%s", stepdir, name);
}

/* ---- one request, with retries ---------------------------------------------------------------- */

static size_t on_read(char *out, size_t size, size_t nmemb, void *ud)
{
    body_t *b = ud;
    size_t want = size * nmemb;
    uint64_t left = b->len - b->pos;
    if (want > left) want = (size_t)left;
    if (want == 0) return 0;
    if (b->mem) {
        memcpy(out, b->mem + b->pos, want);
    } else {
        ssize_t n = pread(b->fd, out, want, (off_t)(b->off + b->pos));
        if (n <= 0) return CURL_READFUNC_ABORT;
        want = (size_t)n;
    }
    b->pos += want;
    return want;
}

static size_t on_write(char *in, size_t size, size_t nmemb, void *ud)
{
    resp_t *r = ud;
    size_t n = size * nmemb;
    long code = 0;
    if (r->fd >= 0) curl_easy_getinfo(r->curl, CURLINFO_RESPONSE_CODE, &code);
    if (r->fd >= 0 && code >= 200 && code < 300) {
        size_t done = 0;
        while (done < n) {
            ssize_t w = write(r->fd, in + done, n - done);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                r->write_failed = true;
                return 0;
            }
            done += (size_t)w;
        }
        r->written += n;
        return n;
    }
    if (r->len + n + 1 > r->cap) {
        size_t cap = (r->len + n + 1) * 2;
        if (cap > (64u << 20)) return 0; /* responses we parse are small */
        char *d = realloc(r->data, cap);
        if (!d) return 0;
        r->data = d;
        r->cap = cap;
    }
    memcpy(r->data + r->len, in, n);
    r->len += n;
    r->data[r->len] = 0;
    return n;
}

static size_t on_header(char *in, size_t size, size_t nmemb, void *ud)
{
    resp_t *r = ud;
    size_t n = size * nmemb;
    if (n > 5 && strncasecmp(in, "etag:", 5) == 0) {
        const char *v = in + 5;
        while (*v == ' ') v++;
        size_t l = (size_t)(in + n - v);
        while (l > 0 && (v[l - 1] == '\r' || v[l - 1] == '\n' || v[l - 1] == ' ')) l--;
        if (l < sizeof r->etag) {
            memcpy(r->etag, v, l);
            r->etag[l] = 0;
        }
    }
    return n;
}

static int on_progress(void *ud, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d)
{
    (void)a, (void)b, (void)c, (void)d;
    return atomic_load(&((ck_s3_t *)ud)->cancelled) ? 1 : 0;
}

static bool retryable_curl(CURLcode rc)
{
    switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_COULDNT_RESOLVE_HOST: return true;
    default: return false;
    }
}

/* Text between <tag> and </tag> in an XML body, or "" */
static void xml_value(const char *xml, const char *tag, char *out, size_t n)
{
    out[0] = 0;
    if (!xml) return;
    char open[64], close[64];
    snprintf(open, sizeof open, "<%s>", tag);
    snprintf(close, sizeof close, "</%s>", tag);
    const char *a = strstr(xml, open);
    if (!a) return;
    a += strlen(open);
    const char *b = strstr(a, close);
    if (!b) return;
    size_t l = (size_t)(b - a) < n - 1 ? (size_t)(b - a) : n - 1;
    memcpy(out, a, l);
    out[l] = 0;
}

static void backoff_sleep(const ck_s3_t *s, int attempt, unsigned *seed)
{
    double ms = (double)s->base_ms * (double)(1u << (attempt < 16 ? attempt : 16));
    if (ms > s->max_ms) ms = s->max_ms;
    ms *= 0.75 + 0.5 * ((double)rand_r(seed) / RAND_MAX);
    for (double left = ms; left > 0 && !atomic_load(&s->cancelled); left -= 50) {
        struct timespec ts = {0, (long)((left < 50 ? left : 50) * 1e6)};
        nanosleep(&ts, NULL);
    }
}

/* The headers of one attempt: Host, the payload hash, the date, the session token and their
 * signature (when there are credentials), and no Expect (a round trip less per PUT). */
static moe_status_t signed_headers(const ck_s3_t *s, const char *method, const char *path,
                                   const char *query, const char *hash, struct curl_slist **out)
{
    char date[32], h_host[600], h_hash[100], h_date[64], h_tok[4200], h_auth[1024];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y%m%dT%H%M%SZ", &tm);
    snprintf(h_host, sizeof h_host, "Host: %s", s->host);
    snprintf(h_hash, sizeof h_hash, "x-amz-content-sha256: %s", hash);
    snprintf(h_date, sizeof h_date, "x-amz-date: %s", date);
    ck_sigv4_header_t signed_hdrs[4] = {{"host", s->host},
                                        {"x-amz-content-sha256", hash},
                                        {"x-amz-date", date},
                                        {"x-amz-security-token", s->token}};
    int nsigned = s->token ? 4 : 3;
    h_auth[0] = 0;
    if (s->ak && s->sk) {
        char authz[900];
        ck_sigv4_request_t req = {.method = method,
                                  .path = path,
                                  .query = query,
                                  .headers = signed_hdrs,
                                  .nheaders = nsigned,
                                  .payload_sha256 = hash,
                                  .amz_date = date,
                                  .region = s->region,
                                  .service = "s3",
                                  .access_key = s->ak,
                                  .secret_key = s->sk};
        MOE_TRY(ck_sigv4_sign(&req, NULL, NULL, authz, sizeof authz));
        snprintf(h_auth, sizeof h_auth, "Authorization: %s", authz);
    }
    const char *lines[6] = {h_host, h_hash, h_date, "Expect:", NULL, NULL};
    int n = 4;
    if (s->token) {
        snprintf(h_tok, sizeof h_tok, "x-amz-security-token: %s", s->token);
        lines[n++] = h_tok;
    }
    if (h_auth[0]) lines[n++] = h_auth;
    struct curl_slist *l = NULL;
    for (int i = 0; i < n; i++) {
        struct curl_slist *t = curl_slist_append(l, lines[i]);
        if (!t) {
            curl_slist_free_all(l);
            return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "request headers");
        }
        l = t;
    }
    *out = l;
    return MOE_STATUS_SUCCESS;
}

/* method key [query] [body] -> response. `retries` < 0 uses the configured count. On failure
 * the in-memory response body is freed (r->data NULL). */
static moe_status_t s3_req(ck_s3_t *s, const char *method, const char *key, const char *query,
                           body_t *body, resp_t *r, int retries)
{
    if (retries < 0) retries = s->max_retries;
    char hash[65];
    moe_status_t hst = !body       ? ck_sha256_hex("", 0, hash)
                       : body->mem ? ck_sha256_hex(body->mem, (size_t)body->len, hash)
                                   : ck_sha256_fd_hex(body->fd, body->off, body->len, hash);
    if (hst != MOE_STATUS_SUCCESS) return moe_error_wrap(hst, "hashing the body of %s", key);
    size_t pl = strlen(s->bucket) + strlen(key) + 3;
    char *path = malloc(pl);
    if (!path) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "URL");
    snprintf(path, pl, "/%s/%s", s->bucket, key);
    char *epath = ck_uri_encode(path, true);
    size_t ul = strlen(s->endpoint) + (epath ? strlen(epath) : 0) + (query ? strlen(query) : 0) + 4;
    char *url = epath ? malloc(ul) : NULL;
    if (!url) {
        free(path);
        free(epath);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "URL");
    }
    snprintf(url, ul, "%s%s%s%s", s->endpoint, epath, query ? "?" : "", query ? query : "");
    free(epath);
    struct curl_slist *hdrs = NULL;
    unsigned seed = (unsigned)time(NULL) ^ (unsigned)(uintptr_t)r;
    moe_status_t st = MOE_STATUS_SUCCESS;
    char errbuf[CURL_ERROR_SIZE];
    for (int attempt = 0;; attempt++) {
        if (atomic_load(&s->cancelled)) {
            st = MOE_FAIL(MOE_STATUS_ABORTED, "S3 %s %s cancelled", method, key);
            break;
        }
        r->len = 0;
        if (r->data) r->data[0] = 0;
        r->etag[0] = 0;
        r->write_failed = false;
        if (r->fd >= 0) {
            if (ftruncate(r->fd, 0) != 0 || lseek(r->fd, 0, SEEK_SET) < 0) {
                st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "truncating the download of %s", key);
                break;
            }
            r->written = 0;
        }
        if (body) body->pos = 0;
        curl_slist_free_all(hdrs); /* signed anew: the date is part of the signature */
        hdrs = NULL;
        st = signed_headers(s, method, path, query, hash, &hdrs);
        if (st != MOE_STATUS_SUCCESS) break;
        CURL *c = curl_easy_init();
        if (!c) {
            st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "curl_easy_init failed");
            break;
        }
        r->curl = c;
        errbuf[0] = 0;
        curl_easy_setopt(c, CURLOPT_URL, url);
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
        curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
        curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 1L);
        curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 2L);
        curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)s->timeout_ms);
        curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS,
                         (long)(s->timeout_ms < 10000 ? s->timeout_ms : 10000));
        curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_write);
        curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
        curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
        curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
        curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
        curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(c, CURLOPT_XFERINFODATA, s);
        if (!strcmp(method, "PUT")) {
            curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
            curl_easy_setopt(c, CURLOPT_READFUNCTION, on_read);
            curl_easy_setopt(c, CURLOPT_READDATA, body);
            curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, (curl_off_t)(body ? body->len : 0));
        } else if (!strcmp(method, "POST")) {
            curl_easy_setopt(c, CURLOPT_POST, 1L);
            curl_easy_setopt(c, CURLOPT_POSTFIELDS, body ? body->mem : "");
            curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)(body ? body->len : 0));
        } else if (!strcmp(method, "HEAD")) {
            curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
        } else if (strcmp(method, "GET") != 0) {
            curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
        }
        CURLcode rc = curl_easy_perform(c);
        long code = 0;
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
        curl_easy_cleanup(c);
        r->curl = NULL;
        bool last = attempt >= retries;
        if (rc == CURLE_ABORTED_BY_CALLBACK) {
            st = MOE_FAIL(MOE_STATUS_ABORTED, "S3 %s %s cancelled", method, key);
            break;
        }
        if (rc == CURLE_WRITE_ERROR && r->write_failed) {
            st = MOE_FAIL(MOE_STATUS_IO_ERROR, "writing the download of %s failed", key);
            break;
        }
        if (rc != CURLE_OK) {
            if (retryable_curl(rc) && !last) {
                moe_log(s->log, MOE_LOG_WARN, "checkpoint: S3 %s %s: %s (%s); retry %d of %d",
                        method, key, curl_easy_strerror(rc), errbuf, attempt + 1, retries);
                backoff_sleep(s, attempt, &seed);
                continue;
            }
            st = MOE_FAIL(retryable_curl(rc) ? MOE_STATUS_TIMEOUT : MOE_STATUS_REMOTE_ERROR,
                          "S3 %s %s/%s/%s failed after %d attempt%s: %s (%s)", method, s->endpoint,
                          s->bucket, key, attempt + 1, attempt ? "s" : "", curl_easy_strerror(rc),
                          errbuf);
            break;
        }
        if ((code >= 500 || code == 429) && !last) {
            char ecode[128] = "";
            xml_value(r->data, "Code", ecode, sizeof ecode);
            moe_log(s->log, MOE_LOG_WARN, "checkpoint: S3 %s %s: HTTP %ld%s%s; retry %d of %d",
                    method, key, code, *ecode ? " " : "", ecode, attempt + 1, retries);
            backoff_sleep(s, attempt, &seed);
            continue;
        }
        if (code < 200 || code >= 300) {
            char ecode[128] = "", emsg[256] = "";
            xml_value(r->data, "Code", ecode, sizeof ecode);
            xml_value(r->data, "Message", emsg, sizeof emsg);
            moe_status_t kind = MOE_STATUS_REMOTE_ERROR;
            if (code == 404 &&
                (!strcmp(ecode, "NoSuchKey") || (!*ecode && strcmp(method, "HEAD") == 0)))
                kind = MOE_STATUS_NOT_FOUND;
            if (code == 404 && !strcmp(ecode, "NoSuchBucket"))
                st = MOE_FAIL(kind, "S3 bucket \"%s\" does not exist at %s (HTTP 404 NoSuchBucket)",
                              s->bucket, s->endpoint);
            else
                st = MOE_FAIL(kind, "S3 %s %s/%s/%s: HTTP %ld%s%s%s%s", method, s->endpoint,
                              s->bucket, key, code, *ecode ? " " : "", ecode, *emsg ? ": " : "",
                              emsg);
            break;
        }
        /* CompleteMultipartUpload may answer 200 with an error inside */
        if (r->fd < 0 && r->data && strstr(r->data, "<Error>")) {
            char ecode[128] = "";
            xml_value(r->data, "Code", ecode, sizeof ecode);
            if (!last && (!strcmp(ecode, "InternalError") || !strcmp(ecode, "SlowDown"))) {
                backoff_sleep(s, attempt, &seed);
                continue;
            }
            st = MOE_FAIL(MOE_STATUS_REMOTE_ERROR, "S3 %s %s: error %s in a 200 answer", method,
                          key, ecode);
            break;
        }
        break;
    }
    curl_slist_free_all(hdrs);
    free(url);
    free(path);
    if (st != MOE_STATUS_SUCCESS) { /* the body served the message: callers may just return */
        free(r->data);
        r->data = NULL;
        r->len = r->cap = 0;
    }
    return st;
}

/* ---- objects --------------------------------------------------------------------------------- */

moe_status_t ck_s3_check_bucket(ck_s3_t *s)
{
    resp_t r = {.fd = -1};
    char key[8] = "";
    /* GET /bucket/?list-type=2&max-keys=1 */
    moe_status_t st = s3_req(s, "GET", key, "list-type=2&max-keys=1", NULL, &r, 1);
    free(r.data);
    return st;
}

typedef struct mp {
    ck_s3_t *s;
    const char *key, *upload_id_enc;
    int fd;
    uint64_t size;
    int nparts;
    atomic_int next;
    char (*etags)[128];
    pthread_mutex_t mu;
    moe_status_t st;
    char msg[512];
    atomic_ullong sent;
} mp_t;

static void *part_worker(void *arg)
{
    mp_t *m = arg;
    for (;;) {
        int i = atomic_fetch_add(&m->next, 1);
        if (i >= m->nparts) break;
        pthread_mutex_lock(&m->mu);
        bool failed = m->st != MOE_STATUS_SUCCESS;
        pthread_mutex_unlock(&m->mu);
        if (failed) break;
        uint64_t off = (uint64_t)i * m->s->part_bytes;
        uint64_t len = m->size - off < m->s->part_bytes ? m->size - off : m->s->part_bytes;
        body_t b = {.fd = m->fd, .off = off, .len = len};
        resp_t r = {.fd = -1};
        char q[1024];
        snprintf(q, sizeof q, "partNumber=%d&uploadId=%s", i + 1, m->upload_id_enc);
        moe_status_t st = s3_req(m->s, "PUT", m->key, q, &b, &r, -1);
        if (st == MOE_STATUS_SUCCESS && !r.etag[0])
            st = MOE_FAIL(MOE_STATUS_REMOTE_ERROR, "S3 part %d of %s: no ETag", i + 1, m->key);
        if (st == MOE_STATUS_SUCCESS) {
            memcpy(m->etags[i], r.etag, sizeof r.etag);
            atomic_fetch_add(&m->sent, len);
        } else {
            pthread_mutex_lock(&m->mu);
            if (m->st == MOE_STATUS_SUCCESS) {
                m->st = st;
                snprintf(m->msg, sizeof m->msg, "%s", moe_last_error());
            }
            pthread_mutex_unlock(&m->mu);
        }
        free(r.data);
    }
    return NULL;
}

static moe_status_t multipart(ck_s3_t *s, const char *key, int fd, uint64_t size, uint64_t *sent)
{
    resp_t r = {.fd = -1};
    MOE_TRY(s3_req(s, "POST", key, "uploads=", NULL, &r, -1));
    char uid[512];
    xml_value(r.data, "UploadId", uid, sizeof uid);
    free(r.data);
    if (!uid[0])
        return MOE_FAIL(MOE_STATUS_REMOTE_ERROR, "S3 multipart start for %s: no UploadId", key);
    CURL *c = curl_easy_init();
    char *enc = c ? curl_easy_escape(c, uid, 0) : NULL;
    if (c) curl_easy_cleanup(c);
    if (!enc) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "upload id");
    mp_t m = {.s = s, .key = key, .upload_id_enc = enc, .fd = fd, .size = size};
    m.nparts = (int)((size + s->part_bytes - 1) / s->part_bytes);
    m.etags = calloc((size_t)m.nparts, sizeof *m.etags);
    pthread_mutex_init(&m.mu, NULL);
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!m.etags) st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "part table");
    if (st == MOE_STATUS_SUCCESS) {
        int nth = s->parallel < m.nparts ? s->parallel : m.nparts;
        pthread_t th[64];
        int started = 0;
        for (; started < nth; started++)
            if (pthread_create(&th[started], NULL, part_worker, &m) != 0) break;
        if (started == 0) part_worker(&m);
        for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
        st = m.st;
        if (st != MOE_STATUS_SUCCESS) MOE_FAIL(st, "%s", m.msg);
    }
    if (st == MOE_STATUS_SUCCESS) {
        size_t cap = (size_t)m.nparts * 200 + 128, n = 0;
        char *xml = malloc(cap);
        if (!xml) {
            st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "complete body");
        } else {
            n += (size_t)snprintf(xml + n, cap - n, "<CompleteMultipartUpload>");
            for (int i = 0; i < m.nparts; i++)
                n += (size_t)snprintf(xml + n, cap - n,
                                      "<Part><PartNumber>%d</PartNumber><ETag>%s</ETag></Part>",
                                      i + 1, m.etags[i]);
            n += (size_t)snprintf(xml + n, cap - n, "</CompleteMultipartUpload>");
            body_t b = {.mem = xml, .len = n};
            char q[1024];
            snprintf(q, sizeof q, "uploadId=%s", enc);
            resp_t r2 = {.fd = -1};
            st = s3_req(s, "POST", key, q, &b, &r2, -1);
            free(r2.data);
            free(xml);
        }
    }
    if (st != MOE_STATUS_SUCCESS) { /* best effort: do not leave the parts billed */
        char q[1024], keep[1024];
        snprintf(keep, sizeof keep, "%s", moe_last_error());
        snprintf(q, sizeof q, "uploadId=%s", enc);
        resp_t r3 = {.fd = -1};
        s3_req(s, "DELETE", key, q, NULL, &r3, 0);
        free(r3.data);
        MOE_FAIL(st, "%s", keep);
    }
    *sent = atomic_load(&m.sent);
    pthread_mutex_destroy(&m.mu);
    free(m.etags);
    curl_free(enc);
    return st;
}

moe_status_t ck_s3_put_file(ck_s3_t *s, const char *stepdir, const char *name,
                            const char *local_path, uint64_t *bytes_sent)
{
    char key[2048];
    make_key(s, stepdir, name, key, sizeof key);
    int fd;
    MOE_CHECK_ERRNO_MSG(fd = open(local_path, O_RDONLY | O_CLOEXEC), MOE_STATUS_IO_ERROR,
                        "open(%s)", local_path);
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        moe_status_t st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "fstat(%s)", local_path);
        close(fd);
        return st;
    }
    uint64_t size = (uint64_t)sb.st_size, sent = 0;
    moe_status_t st;
    if (size > s->part_bytes) {
        st = multipart(s, key, fd, size, &sent);
    } else {
        body_t b = {.fd = fd, .off = 0, .len = size};
        resp_t r = {.fd = -1};
        st = s3_req(s, "PUT", key, NULL, &b, &r, -1);
        free(r.data);
        if (st == MOE_STATUS_SUCCESS) sent = size;
    }
    close(fd);
    if (bytes_sent) *bytes_sent = sent;
    return st;
}

moe_status_t ck_s3_get_file(ck_s3_t *s, const char *stepdir, const char *name,
                            const char *local_path)
{
    char key[2048];
    make_key(s, stepdir, name, key, sizeof key);
    int fd;
    MOE_CHECK_ERRNO_MSG(fd = open(local_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                        MOE_STATUS_IO_ERROR, "open(%s)", local_path);
    resp_t r = {.fd = fd};
    moe_status_t st = s3_req(s, "GET", key, NULL, NULL, &r, -1);
    if (st == MOE_STATUS_SUCCESS && fsync(fd) != 0)
        st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "fsync(%s)", local_path);
    close(fd);
    free(r.data);
    return st;
}

/* Every key under <prefix>/<sub> (sub may be ""), calling fn for each. */
static moe_status_t list_keys(ck_s3_t *s, const char *sub, void (*fn)(const char *, void *),
                              void *ud, int retries)
{
    char pfx[2048];
    if (*s->prefix)
        snprintf(pfx, sizeof pfx, "%s/%s", s->prefix, sub);
    else
        snprintf(pfx, sizeof pfx, "%s", sub);
    CURL *c = curl_easy_init();
    if (!c) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "curl handle");
    char *epfx = curl_easy_escape(c, pfx, 0);
    char token[2048] = "";
    moe_status_t st = MOE_STATUS_SUCCESS;
    for (int page = 0; page < 100000; page++) {
        char q[4096];
        if (token[0]) {
            char *et = curl_easy_escape(c, token, 0);
            snprintf(q, sizeof q, "continuation-token=%s&list-type=2&prefix=%s", et ? et : "",
                     epfx ? epfx : "");
            curl_free(et);
        } else {
            snprintf(q, sizeof q, "list-type=2&prefix=%s", epfx ? epfx : "");
        }
        resp_t r = {.fd = -1};
        st = s3_req(s, "GET", "", q, NULL, &r, retries);
        if (st != MOE_STATUS_SUCCESS) {
            free(r.data);
            break;
        }
        for (const char *p = r.data; p && (p = strstr(p, "<Key>")) != NULL;) {
            p += 5;
            const char *e = strstr(p, "</Key>");
            if (!e) break;
            char key[2048];
            size_t l = (size_t)(e - p) < sizeof key - 1 ? (size_t)(e - p) : sizeof key - 1;
            memcpy(key, p, l);
            key[l] = 0;
            fn(key, ud);
            p = e;
        }
        char trunc[16];
        xml_value(r.data, "IsTruncated", trunc, sizeof trunc);
        xml_value(r.data, "NextContinuationToken", token, sizeof token);
        free(r.data);
        if (strcmp(trunc, "true") != 0 || !token[0]) break;
    }
    curl_free(epfx);
    curl_easy_cleanup(c);
    return st;
}

typedef struct steps_acc {
    const char *prefix;
    int64_t *v;
    int32_t n, cap;
    bool oom;
} steps_acc_t;

static void collect_step(const char *key, void *ud)
{
    steps_acc_t *a = ud;
    size_t pl = strlen(a->prefix);
    if (pl) {
        if (strncmp(key, a->prefix, pl) != 0 || key[pl] != '/') return;
        key += pl + 1;
    }
    const char *slash = strchr(key, '/');
    if (!slash || strcmp(slash + 1, CK_MANIFEST) != 0) return;
    char dir[64];
    size_t l = (size_t)(slash - key);
    if (l >= sizeof dir) return;
    memcpy(dir, key, l);
    dir[l] = 0;
    int64_t step;
    char canonical[64];
    if (!ck_parse_step_dirname(dir, &step)) return;
    ck_step_dirname(step, canonical, sizeof canonical);
    if (strcmp(dir, canonical) != 0) return; /* only what a load can fetch is listed */
    if (a->n == a->cap) {
        int32_t cap = a->cap ? a->cap * 2 : 16;
        int64_t *v = realloc(a->v, sizeof *v * (size_t)cap);
        if (!v) {
            a->oom = true;
            return;
        }
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = step;
}

moe_status_t ck_s3_list_steps(ck_s3_t *s, int64_t **steps, int32_t *count, int retries)
{
    steps_acc_t a = {.prefix = s->prefix};
    moe_status_t st = list_keys(s, "step-", collect_step, &a, retries);
    if (st == MOE_STATUS_SUCCESS && a.oom) st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "step list");
    if (st != MOE_STATUS_SUCCESS) {
        free(a.v);
        return st;
    }
    if (a.n) qsort(a.v, (size_t)a.n, sizeof *a.v, ck_cmp_i64);
    *steps = a.v;
    *count = a.n;
    return MOE_STATUS_SUCCESS;
}

typedef struct keys_acc {
    char **k;
    int n, cap;
} keys_acc_t;

static void collect_key(const char *key, void *ud)
{
    keys_acc_t *a = ud;
    if (a->n == a->cap) {
        int cap = a->cap ? a->cap * 2 : 16;
        char **k = realloc(a->k, sizeof *k * (size_t)cap);
        if (!k) return;
        a->k = k;
        a->cap = cap;
    }
    a->k[a->n] = strdup(key);
    if (a->k[a->n]) a->n++;
}

moe_status_t ck_s3_delete_step(ck_s3_t *s, const char *stepdir)
{
    char key[2048], sub[128];
    make_key(s, stepdir, CK_MANIFEST, key, sizeof key);
    resp_t r = {.fd = -1};
    MOE_TRY(s3_req(s, "DELETE", key, NULL, NULL, &r, -1)); /* un-commit first */
    free(r.data);
    snprintf(sub, sizeof sub, "%s/", stepdir);
    keys_acc_t a = {0};
    moe_status_t st = list_keys(s, sub, collect_key, &a, -1);
    for (int i = 0; i < a.n; i++) {
        if (st == MOE_STATUS_SUCCESS) {
            resp_t r2 = {.fd = -1};
            st = s3_req(s, "DELETE", a.k[i], NULL, NULL, &r2, -1);
            free(r2.data);
        }
        free(a.k[i]);
    }
    free(a.k);
    return st;
}
