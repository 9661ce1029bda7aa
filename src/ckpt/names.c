/*
 * The names a checkpoint is made of, below the manifest and the request checks that both use
 * them: tensor names, plain file names, S3 prefixes, and the step and rank file names (with
 * the parse of a step folder's name). docs/checkpoint-format.md states the rules.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "ckpt_internal.h"

static bool name_char(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
}

bool ck_valid_name(const char *s)
{
    if (!s || !*s) return false;
    size_t n = strlen(s);
    if (n > CK_MAX_NAME) return false;
    for (size_t i = 0; i < n; i++)
        if (!name_char(s[i]) && s[i] != '/') return false;
    /* '/' separates components; none may be empty, "." or ".." */
    for (const char *p = s;;) {
        const char *e = strchr(p, '/');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == 0 || (len == 1 && p[0] == '.') || (len == 2 && p[0] == '.' && p[1] == '.'))
            return false;
        if (!e) break;
        p = e + 1;
    }
    return true;
}

bool ck_valid_file_name(const char *s)
{
    if (!s || !*s || strlen(s) > CK_MAX_NAME) return false;
    if (!strcmp(s, ".") || !strcmp(s, "..")) return false;
    for (const char *p = s; *p; p++)
        if (!name_char(*p)) return false; /* no '/', no '\\', no NUL tricks */
    return true;
}

bool ck_valid_prefix(const char *s)
{
    if (!s) return true;
    size_t n = strlen(s);
    if (n > 512) return false;
    for (size_t i = 0; i < n; i++)
        if (!name_char(s[i]) && s[i] != '/') return false;
    /* no "." or ".." component, no empty component in the middle */
    const char *p = s;
    while (*p) {
        const char *e = strchr(p, '/');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if ((len == 1 && p[0] == '.') || (len == 2 && p[0] == '.' && p[1] == '.')) return false;
        if (!e) break;
        p = e + 1;
    }
    return true;
}

void ck_step_dirname(int64_t step, char *buf, size_t len)
{
    snprintf(buf, len, "step-%012" PRId64, step);
}

void ck_rank_filename(int32_t rank, char *buf, size_t len)
{
    snprintf(buf, len, "rank-%05d.bin", rank);
}

int ck_cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

bool ck_parse_step_dirname(const char *s, int64_t *step)
{
    if (strncmp(s, "step-", 5) != 0) return false;
    const char *d = s + 5;
    if (!*d || strlen(d) > 18) return false;
    int64_t v = 0;
    for (; *d; d++) {
        if (*d < '0' || *d > '9') return false;
        v = v * 10 + (*d - '0');
    }
    *step = v;
    return true;
}
