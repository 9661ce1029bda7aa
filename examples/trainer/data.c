/* The trainer's corpus and its deterministic batches (data.h). */
#include "data.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int fail(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
    return -1;
}

/* A file named in data.paths is read whatever it holds; one found in a folder only when it is
 * text: no NUL byte in its first 8000 bytes (git's test), so a folder's images are skipped. */
static int append_file(corpus_t *c, const char *path, int top, int verbose, char *err, size_t len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, len, "data.paths: %s: %s", path, strerror(errno));
    uint8_t buf[65536];
    size_t n, total = 0;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
        if (total == 0 && !top && memchr(buf, 0, n < 8000 ? n : 8000)) {
            fclose(f);
            if (verbose) printf("data: %s skipped (binary)\n", path);
            return 0;
        }
        uint8_t *grown = realloc(c->bytes, c->size + n);
        if (!grown) {
            fclose(f);
            return fail(err, len, "data.paths: %s: out of memory", path);
        }
        c->bytes = grown;
        memcpy(c->bytes + c->size, buf, n);
        c->size += n;
        total += n;
    }
    fclose(f);
    c->files++;
    if (verbose) printf("data: %s (%zu bytes)\n", path, total);
    return 0;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int append_path(corpus_t *c, const char *path, int top, int verbose, char *err, size_t len)
{
    struct stat st;
    if (lstat(path, &st) != 0) return fail(err, len, "data.paths: %s: %s", path, strerror(errno));
    if (S_ISLNK(st.st_mode) && !top) return 0; /* the target is read under its own name */
    if (stat(path, &st) != 0) return fail(err, len, "data.paths: %s: %s", path, strerror(errno));
    if (S_ISREG(st.st_mode)) return append_file(c, path, top, verbose, err, len);
    if (!S_ISDIR(st.st_mode)) return 0;
    DIR *d = opendir(path);
    if (!d) return fail(err, len, "data.paths: %s: %s", path, strerror(errno));
    char **names = NULL;
    size_t n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char **grown = realloc(names, sizeof *names * (n + 1));
        if (!grown) break;
        names = grown;
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp_names);
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        char full[4096];
        snprintf(full, sizeof full, "%s/%s", path, names[i]);
        if (!rc) rc = append_path(c, full, 0, verbose, err, len);
        free(names[i]);
    }
    free(names);
    return rc;
}

int corpus_load(corpus_t *c, char *const *paths, int n, double val_fraction, int verbose, char *err,
                size_t len)
{
    *c = (corpus_t){0};
    for (int i = 0; i < n; i++)
        if (append_path(c, paths[i], 1, verbose, err, len)) return -1;
    size_t val = (size_t)((double)c->size * val_fraction);
    c->train_size = c->size - val;
    if (c->train_size < 4096 || val < 1024) {
        /* the smallest corpus with 4096 training and 1024 validation bytes at this fraction */
        size_t need = (size_t)ceil(1024 / val_fraction);
        if ((double)need * (1 - val_fraction) < 4096)
            need = (size_t)ceil(4096 / (1 - val_fraction));
        return fail(err, len,
                    "data.paths: %zu bytes in %d files give %zu training and %zu "
                    "validation bytes (data.val_fraction %g); the trainer needs at least 4096 "
                    "and 1024: at this fraction at least %zu bytes",
                    c->size, c->files, c->train_size, val, val_fraction, need + 1);
    }
    double hist[256] = {0};
    for (size_t i = 0; i < c->train_size; i++) hist[c->bytes[i]]++;
    double h = 0;
    for (int b = 0; b < 256; b++)
        if (hist[b] > 0) {
            double p = hist[b] / (double)c->train_size;
            h -= p * log2(p);
        }
    c->unigram_bits = h;
    return 0;
}

void corpus_free(corpus_t *c)
{
    free(c->bytes);
    *c = (corpus_t){0};
}

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void copy_window(const uint8_t *src, int64_t T, uint8_t *tokens, uint8_t *targets)
{
    memcpy(tokens, src, (size_t)T);
    memcpy(targets, src + 1, (size_t)T);
}

void corpus_train_sequence(const corpus_t *c, uint64_t seed, int64_t step, int64_t index, int64_t T,
                           uint8_t *tokens, uint8_t *targets)
{
    uint64_t r = mix64(mix64(seed ^ 0x5eedda7aull) ^
                       mix64((uint64_t)step * 0x9e3779b97f4a7c15ull + (uint64_t)index));
    size_t span = c->train_size - (size_t)T; /* starts whose T + 1 bytes are all training bytes */
    copy_window(c->bytes + r % span, T, tokens, targets);
}

void corpus_val_sequence(const corpus_t *c, int64_t index, int64_t count, int64_t T,
                         uint8_t *tokens, uint8_t *targets)
{
    size_t span = c->size - c->train_size - (size_t)T;
    size_t at = c->train_size + (size_t)((double)span * (double)index / (double)count);
    copy_window(c->bytes + at, T, tokens, targets);
}
