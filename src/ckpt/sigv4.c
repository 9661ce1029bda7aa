/*
 * AWS Signature Version 4 for the S3 client (s3.c), on OpenSSL's libcrypto: the SHA-256
 * payload hashes sent in x-amz-content-sha256, the canonical request, the string to sign and
 * the Authorization header. s3.c signs every request here and sends exactly the headers it
 * signed, so the signature a server recomputes from what it received is the one sent, on
 * every libcurl (libcurl's own CURLOPT_AWS_SIGV4 before 8.3 lists a removed header such as
 * "Expect:" in SignedHeaders without sending it). tests/ckpt/test_ckpt_sigv4.c checks this
 * file against AWS's published test vectors.
 *
 * Canonical request (S3 flavour: the path is URI-encoded once and never normalised):
 *   METHOD \n URI-encoded path \n sorted query \n lower-case headers "name:value\n" sorted
 *   \n signed header names joined by ';' \n hex SHA-256 of the payload
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "core/error.h"
#include "ckpt_internal.h"

/* ---- SHA-256 ------------------------------------------------------------------------------- */

static void to_hex(const unsigned char *d, size_t n, char *out)
{
    static const char hx[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hx[d[i] >> 4];
        out[2 * i + 1] = hx[d[i] & 15];
    }
    out[2 * n] = 0;
}

moe_status_t ck_sha256_hex(const void *data, size_t len, char out[65])
{
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (EVP_Digest(data, len, d, &n, EVP_sha256(), NULL) != 1 || n != 32)
        return MOE_FAIL(MOE_STATUS_INTERNAL, "EVP_Digest(SHA-256) failed");
    to_hex(d, 32, out);
    return MOE_STATUS_SUCCESS;
}

moe_status_t ck_sha256_fd_hex(int fd, uint64_t off, uint64_t len, char out[65])
{
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    char *buf = malloc(1 << 20);
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!c || !buf) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "SHA-256 state");
        goto done;
    }
    if (EVP_DigestInit_ex(c, EVP_sha256(), NULL) != 1) {
        st = MOE_FAIL(MOE_STATUS_INTERNAL, "EVP_DigestInit_ex(SHA-256) failed");
        goto done;
    }
    for (uint64_t p = 0; p < len;) {
        size_t want = len - p < (1u << 20) ? (size_t)(len - p) : (1u << 20);
        ssize_t n = pread(fd, buf, want, (off_t)(off + p));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            st = n < 0 ? MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "pread at %llu",
                                        (unsigned long long)(off + p))
                       : MOE_FAIL(MOE_STATUS_IO_ERROR, "unexpected end of file at %llu",
                                  (unsigned long long)(off + p));
            goto done;
        }
        if (EVP_DigestUpdate(c, buf, (size_t)n) != 1) {
            st = MOE_FAIL(MOE_STATUS_INTERNAL, "EVP_DigestUpdate(SHA-256) failed");
            goto done;
        }
        p += (uint64_t)n;
    }
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (EVP_DigestFinal_ex(c, d, &n) != 1 || n != 32)
        st = MOE_FAIL(MOE_STATUS_INTERNAL, "EVP_DigestFinal_ex(SHA-256) failed");
    else
        to_hex(d, 32, out);
done:
    EVP_MD_CTX_free(c);
    free(buf);
    return st;
}

/* ---- a growing string ---------------------------------------------------------------------- */

typedef struct sbuf {
    char *s;
    size_t len, cap;
    bool oom;
} sbuf_t;

static void sb_add(sbuf_t *b, const char *p, size_t n)
{
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = (b->len + n + 1) * 2;
        char *s = realloc(b->s, cap);
        if (!s) {
            b->oom = true;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
    memcpy(b->s + b->len, p, n);
    b->len += n;
    b->s[b->len] = 0;
}

static void sb_str(sbuf_t *b, const char *s) { sb_add(b, s, strlen(s)); }

static bool unreserved(unsigned char c)
{
    return isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~';
}

/* AWS's URI encoding of bytes [p, p + n): unreserved characters stay, every other byte is
 * %XX (upper-case hex); '/' stays where keep_slash. */
static void sb_uri_encode(sbuf_t *b, const char *p, size_t n, bool keep_slash)
{
    static const char hx[] = "0123456789ABCDEF";
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (unreserved(c) || (keep_slash && c == '/')) {
            sb_add(b, (const char *)&c, 1);
        } else {
            char e[3] = {'%', hx[c >> 4], hx[c & 15]};
            sb_add(b, e, 3);
        }
    }
}

static int hexval(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

char *ck_uri_encode(const char *s, bool keep_slash)
{
    sbuf_t b = {0};
    sb_uri_encode(&b, s, strlen(s), keep_slash);
    sb_str(&b, "");
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

/* The canonical form of one query name or value as sent: percent-decoded, then encoded the
 * AWS way (so "%7e" and "~" agree, and a raw UTF-8 byte becomes %XX). */
static void sb_query_component(sbuf_t *b, const char *p, size_t n)
{
    char *raw = malloc(n + 1);
    if (!raw) {
        b->oom = true;
        return;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '%' && i + 2 < n && hexval(p[i + 1]) >= 0 && hexval(p[i + 2]) >= 0) {
            raw[m++] = (char)(hexval(p[i + 1]) << 4 | hexval(p[i + 2]));
            i += 2;
        } else {
            raw[m++] = p[i];
        }
    }
    sb_uri_encode(b, raw, m, false);
    free(raw);
}

/* ---- the canonical request ----------------------------------------------------------------- */

typedef struct qpair {
    char *name, *value; /* canonical (encoded) */
} qpair_t;

static int cmp_qpair(const void *a, const void *b)
{
    const qpair_t *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : strcmp(x->value, y->value);
}

/* The query's pairs, each part canonical, sorted by name then value, joined by '&'. */
static void sb_canonical_query(sbuf_t *b, const char *q)
{
    if (!q || !*q) return;
    size_t cap = 1;
    for (const char *p = q; *p; p++) cap += *p == '&';
    qpair_t *v = calloc(cap, sizeof *v);
    if (!v) {
        b->oom = true;
        return;
    }
    size_t n = 0;
    for (const char *p = q; *p && !b->oom;) {
        const char *e = strchr(p, '&');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len > 0) {
            const char *eq = memchr(p, '=', len);
            size_t nl = eq ? (size_t)(eq - p) : len;
            sbuf_t nb = {0}, vb = {0};
            sb_query_component(&nb, p, nl);
            if (eq) sb_query_component(&vb, eq + 1, len - nl - 1);
            sb_str(&nb, "");
            sb_str(&vb, "");
            v[n].name = nb.s;
            v[n].value = vb.s;
            n++;
            if (nb.oom || vb.oom) b->oom = true;
        }
        p += len + (e ? 1 : 0);
        if (!e) break;
    }
    if (!b->oom) qsort(v, n, sizeof *v, cmp_qpair);
    for (size_t i = 0; i < n; i++) {
        if (!b->oom && v[i].name && v[i].value) {
            if (i) sb_str(b, "&");
            sb_str(b, v[i].name);
            sb_str(b, "=");
            sb_str(b, v[i].value);
        }
        free(v[i].name);
        free(v[i].value);
    }
    free(v);
}

typedef struct hdr {
    char *name;        /* lower case */
    const char *value; /* as given */
    size_t order;
} hdr_t;

static int cmp_hdr(const void *a, const void *b)
{
    const hdr_t *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->order > y->order) - (x->order < y->order);
}

/* A header value trimmed, its runs of spaces collapsed to one. */
static void sb_header_value(sbuf_t *b, const char *v)
{
    while (*v == ' ' || *v == '\t') v++;
    bool space = false;
    for (; *v; v++) {
        if (*v == ' ' || *v == '\t') {
            space = true;
            continue;
        }
        if (space) sb_str(b, " ");
        space = false;
        sb_add(b, v, 1);
    }
}

moe_status_t ck_sigv4_sign(const ck_sigv4_request_t *r, char **creq_out, char **sts_out,
                           char *authz, size_t authz_len)
{
    if (creq_out) *creq_out = NULL;
    if (sts_out) *sts_out = NULL;
    if (strlen(r->amz_date) != 16)
        return MOE_FAIL(MOE_STATUS_INTERNAL, "x-amz-date \"%s\" is not YYYYMMDDTHHMMSSZ",
                        r->amz_date);
    hdr_t *h = calloc((size_t)(r->nheaders > 0 ? r->nheaders : 1), sizeof *h);
    if (!h) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "signed headers");
    moe_status_t st = MOE_STATUS_SUCCESS;
    for (int i = 0; i < r->nheaders; i++) {
        h[i].name = strdup(r->headers[i].name);
        if (!h[i].name) {
            st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "signed headers");
            goto done;
        }
        for (char *p = h[i].name; *p; p++) *p = (char)tolower((unsigned char)*p);
        h[i].value = r->headers[i].value;
        h[i].order = (size_t)i;
    }
    qsort(h, (size_t)r->nheaders, sizeof *h, cmp_hdr);

    sbuf_t cr = {0}, names = {0};
    sb_str(&cr, r->method);
    sb_str(&cr, "\n");
    sb_uri_encode(&cr, r->path, strlen(r->path), true);
    sb_str(&cr, "\n");
    sb_canonical_query(&cr, r->query);
    sb_str(&cr, "\n");
    for (int i = 0; i < r->nheaders; i++) {
        bool repeat = i > 0 && !strcmp(h[i].name, h[i - 1].name);
        if (repeat) { /* a name given twice: its values joined by ',' in their order */
            cr.len--; /* the '\n' of the previous line */
            sb_str(&cr, ",");
        } else {
            sb_str(&cr, h[i].name);
            sb_str(&cr, ":");
            if (i) sb_str(&names, ";");
            sb_str(&names, h[i].name);
        }
        sb_header_value(&cr, h[i].value);
        sb_str(&cr, "\n");
    }
    sb_str(&cr, "\n");
    sb_str(&names, "");
    if (names.s) sb_str(&cr, names.s);
    sb_str(&cr, "\n");
    sb_str(&cr, r->payload_sha256);

    char date[9], crhash[65] = "", sig[65];
    memcpy(date, r->amz_date, 8);
    date[8] = 0;
    sbuf_t sts = {0};
    if (cr.oom || names.oom) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "canonical request");
        goto free_all;
    }
    st = ck_sha256_hex(cr.s, cr.len, crhash);
    if (st != MOE_STATUS_SUCCESS) goto free_all;
    sb_str(&sts, "AWS4-HMAC-SHA256\n");
    sb_str(&sts, r->amz_date);
    sb_str(&sts, "\n");
    sb_str(&sts, date);
    sb_str(&sts, "/");
    sb_str(&sts, r->region);
    sb_str(&sts, "/");
    sb_str(&sts, r->service);
    sb_str(&sts, "/aws4_request\n");
    sb_str(&sts, crhash);
    if (sts.oom) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "string to sign");
        goto free_all;
    }
    /* signing key = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), service),
     * "aws4_request"); signature = hex(HMAC(signing key, string to sign)) */
    {
        sbuf_t k = {0};
        sb_str(&k, "AWS4");
        sb_str(&k, r->secret_key);
        const char *parts[4] = {date, r->region, r->service, "aws4_request"};
        unsigned char key[EVP_MAX_MD_SIZE], mac[EVP_MAX_MD_SIZE];
        unsigned int klen = 0, mlen = 0;
        bool ok = !k.oom;
        const unsigned char *kp = (const unsigned char *)k.s;
        size_t kl = k.len;
        for (int i = 0; ok && i < 4; i++) {
            ok = HMAC(EVP_sha256(), kp, (int)kl, (const unsigned char *)parts[i], strlen(parts[i]),
                      key, &klen) != NULL;
            kp = key;
            kl = klen;
        }
        if (ok)
            ok = HMAC(EVP_sha256(), key, (int)klen, (const unsigned char *)sts.s, sts.len, mac,
                      &mlen) != NULL &&
                 mlen == 32;
        if (k.s) {
            memset(k.s, 0, k.len);
            free(k.s);
        }
        memset(key, 0, sizeof key);
        if (!ok) {
            st = MOE_FAIL(MOE_STATUS_INTERNAL, "HMAC-SHA256 failed");
            goto free_all;
        }
        to_hex(mac, 32, sig);
    }
    int n = snprintf(authz, authz_len,
                     "AWS4-HMAC-SHA256 Credential=%s/%s/%s/%s/aws4_request, SignedHeaders=%s, "
                     "Signature=%s",
                     r->access_key, date, r->region, r->service, names.s ? names.s : "", sig);
    if (n < 0 || (size_t)n >= authz_len) {
        st = MOE_FAIL(MOE_STATUS_INTERNAL, "Authorization header longer than %zu bytes", authz_len);
        goto free_all;
    }
    if (creq_out) {
        *creq_out = cr.s;
        cr.s = NULL;
    }
    if (sts_out) {
        *sts_out = sts.s;
        sts.s = NULL;
    }
free_all:
    free(cr.s);
    free(names.s);
    free(sts.s);
done:
    for (int i = 0; i < r->nheaders; i++) free(h[i].name);
    free(h);
    return st;
}
