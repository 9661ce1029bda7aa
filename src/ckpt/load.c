/*
 * Load with reshard: for every tensor a rank asks for (global shape + the box of it this rank
 * holds, split per expert when the expert ids are not contiguous), find the pieces of every
 * rank file that intersect the box, read only the checksum chunks covering the intersection,
 * verify them (XXH3-64), and copy the intersection into place (converting F32 <-> BF16 when
 * the saved dtype differs). Any mesh can read any checkpoint this way: experts are found by
 * global expert id because that is the coordinate along the expert dimension.
 *
 * Every file named by the manifest is checked for existence, type (a regular file: a FIFO
 * would block) and size before anything is read, so a truncated or missing shard fails the
 * whole step (the caller falls back). Pieces that overlap (replicas) are compared where they
 * meet; a difference makes the step CORRUPT.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "core/bf16.h"
#include "core/error.h"
#include "runtime/runtime.h"
#include "ckpt_internal.h"

typedef struct box {
    int64_t gstart[MOE_MAX_DIMS]; /* in the global tensor */
    int64_t ext[MOE_MAX_DIMS];
    int64_t lstart[MOE_MAX_DIMS]; /* where it sits in the local tensor */
} box_t;

static void convert_run(void *dst, moe_dtype_t ddt, const void *src, moe_dtype_t sdt, int64_t n)
{
    if (ddt == sdt) {
        memcpy(dst, src, (size_t)n * moe_dtype_size(ddt));
    } else if (ddt == MOE_DTYPE_F32) { /* bf16 -> f32 */
        const uint16_t *s = src;
        float *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = moe_bf16_to_f32(s[i]);
    } else { /* f32 -> bf16 */
        const float *s = src;
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = moe_f32_to_bf16(s[i]);
    }
}

static void strides(const int64_t *shape, int nd, int64_t *st)
{
    st[nd - 1] = 1;
    for (int d = nd - 2; d >= 0; d--) st[d] = st[d + 1] * shape[d + 1];
}

/* Where the rows of a piece's intersection go: the caller's tensor (converted to its dtype)
 * when no two pieces overlap in the box; otherwise a staging copy of the box in the saved
 * dtype, where a cell already filled by another piece is compared instead (replicas must hold
 * identical bytes: a conflict is damage, whichever piece comes first). */
typedef struct sink {
    const box_t *b;
    int nd;
    /* direct */
    uint8_t *dst;
    moe_dtype_t ddt;
    const int64_t *lshape;
    /* staged (overlapping pieces) */
    uint8_t *raw, *bits;
    moe_dtype_t sdt;
    size_t es;
    bool conflict;
} sink_t;

/* n elements of src (saved dtype sdt) at global coordinates idx (a run along the last
 * dimension) */
static void sink_row(sink_t *k, const int64_t *idx, const uint8_t *src, moe_dtype_t sdt, int64_t n)
{
    const box_t *b = k->b;
    int nd = k->nd;
    if (!k->raw) {
        int64_t lst[MOE_MAX_DIMS], t = 0;
        strides(k->lshape, nd, lst);
        for (int d = 0; d < nd; d++) t += (idx[d] - b->gstart[d] + b->lstart[d]) * lst[d];
        convert_run(k->dst + (size_t)t * moe_dtype_size(k->ddt), k->ddt, src, sdt, n);
        return;
    }
    int64_t bst[MOE_MAX_DIMS], o = 0;
    strides(b->ext, nd, bst);
    for (int d = 0; d < nd; d++) o += (idx[d] - b->gstart[d]) * bst[d];
    for (int64_t i = 0; i < n; i++, o++) {
        uint8_t *cell = k->raw + (size_t)o * k->es;
        const uint8_t *v = src + (size_t)i * k->es;
        if (k->bits[o >> 3] >> (o & 7) & 1) {
            if (memcmp(cell, v, k->es) != 0) k->conflict = true;
        } else {
            memcpy(cell, v, k->es);
            k->bits[o >> 3] |= (uint8_t)(1u << (o & 7));
        }
    }
}

/* Read and verify the chunks of piece p covering the box [lo, hi), hand its rows to k. */
static moe_status_t read_intersection(int fd, const char *fname, uint64_t chunk,
                                      const ck_piece_t *p, const int64_t *lo, const int64_t *hi,
                                      sink_t *k)
{
    int nd = p->ndim;
    size_t es = moe_dtype_size(p->dtype);
    int64_t pst[MOE_MAX_DIMS];
    strides(p->extent, nd, pst);
    int64_t first = 0, last = 0;
    for (int d = 0; d < nd; d++) {
        first += (lo[d] - p->start[d]) * pst[d];
        last += (hi[d] - 1 - p->start[d]) * pst[d];
    }
    uint64_t b0 = (uint64_t)first * es, b1 = (uint64_t)(last + 1) * es;
    uint64_t c0 = b0 / chunk, c1 = (b1 - 1) / chunk;
    uint64_t r0 = c0 * chunk, r1 = (c1 + 1) * chunk < p->length ? (c1 + 1) * chunk : p->length;
    uint8_t *buf = malloc((size_t)(r1 - r0));
    if (!buf)
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "read buffer of %" PRIu64 " bytes", r1 - r0);
    size_t got = 0, want = (size_t)(r1 - r0);
    while (got < want) {
        ssize_t n = pread(fd, buf + got, want - got, (off_t)(p->offset + r0 + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            moe_status_t st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "pread(%s)", fname);
            free(buf);
            return st;
        }
        if (n == 0) {
            free(buf);
            return MOE_FAIL(MOE_STATUS_CORRUPT, "%s is truncated (tensor %s)", fname, p->name);
        }
        got += (size_t)n;
    }
    for (uint64_t c = c0; c <= c1; c++) {
        uint64_t a = c * chunk - r0,
                 len = (c + 1) * chunk < p->length ? chunk : p->length - c * chunk;
        uint64_t h = XXH3_64bits(buf + a, (size_t)len);
        if (h != p->xxh[c]) {
            free(buf);
            return MOE_FAIL(MOE_STATUS_CORRUPT,
                            "checksum mismatch in %s: tensor %s chunk %" PRIu64 " (bytes %" PRIu64
                            "..%" PRIu64 " of the piece): xxh3 %016" PRIx64
                            ", manifest %016" PRIx64,
                            fname, p->name, c, c * chunk, c * chunk + len, h, p->xxh[c]);
        }
    }
    /* rows along the last dimension */
    int64_t idx[MOE_MAX_DIMS];
    for (int d = 0; d < nd; d++) idx[d] = lo[d];
    int64_t run = hi[nd - 1] - lo[nd - 1];
    for (;;) {
        int64_t s = 0;
        for (int d = 0; d < nd; d++) s += (idx[d] - p->start[d]) * pst[d];
        sink_row(k, idx, buf + ((uint64_t)s * es - r0), p->dtype, run);
        int d = nd - 2;
        for (; d >= 0; d--) {
            if (++idx[d] < hi[d]) break;
            idx[d] = lo[d];
        }
        if (d < 0) break;
    }
    free(buf);
    return MOE_STATUS_SUCCESS;
}

/* The part [lo, hi) of the requested box that one piece holds. */
typedef struct span {
    int64_t lo[MOE_MAX_DIMS], hi[MOE_MAX_DIMS];
    int32_t piece;
} span_t;

static bool spans_overlap(const span_t *a, const span_t *b, int nd)
{
    for (int d = 0; d < nd; d++)
        if (a->hi[d] <= b->lo[d] || b->hi[d] <= a->lo[d]) return false;
    return true;
}

/* Staged box (overlapping pieces): into the caller's tensor, converted, row by row. */
static void unstage(const sink_t *k, int64_t vol)
{
    const box_t *b = k->b;
    int nd = k->nd;
    int64_t run = b->ext[nd - 1], idx[MOE_MAX_DIMS];
    sink_t direct = *k;
    direct.raw = NULL;
    for (int d = 0; d < nd; d++) idx[d] = b->gstart[d];
    for (int64_t o = 0; o < vol; o += run) {
        sink_row(&direct, idx, k->raw + (size_t)o * k->es, k->sdt, run);
        int d = nd - 2;
        for (; d >= 0; d--) {
            if (++idx[d] < b->gstart[d] + b->ext[d]) break;
            idx[d] = b->gstart[d];
        }
    }
}

/* Every piece of `name` that intersects the box is read into dst; the pieces must agree with
 * the request's dimensions and global shape gshape (a manifest where they do not is corrupt),
 * and with each other where they overlap. */
static moe_status_t load_box(const ck_manifest_t *m, const int *fds, const char *stepdir,
                             const char *name, const box_t *b, int nd, const int64_t *gshape,
                             uint8_t *dst, moe_dtype_t ddt, const int64_t *lshape, int64_t step)
{
    int64_t vol = 1;
    for (int d = 0; d < nd; d++) vol *= b->ext[d];
    if (vol == 0) return MOE_STATUS_SUCCESS;
    span_t *sp = malloc(sizeof *sp * (size_t)(m->npieces > 0 ? m->npieces : 1));
    if (!sp) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "piece spans");
    int32_t n = 0;
    int64_t covered = 0;
    moe_status_t st = MOE_STATUS_SUCCESS;
    sink_t k = {.b = b, .nd = nd, .dst = dst, .ddt = ddt, .lshape = lshape};
    for (int32_t i = 0; i < m->npieces; i++) {
        const ck_piece_t *p = &m->pieces[i];
        if (strcmp(p->name, name) != 0) continue;
        bool agrees = p->ndim == nd;
        for (int d = 0; d < nd && agrees; d++) agrees = p->global_shape[d] == gshape[d];
        if (!agrees) {
            st = MOE_FAIL(MOE_STATUS_CORRUPT,
                          "checkpoint step %" PRId64 ": the pieces of tensor %s disagree on its "
                          "global shape",
                          step, name);
            goto done;
        }
        span_t span = {.piece = i};
        int64_t v = 1;
        for (int d = 0; d < nd; d++) {
            span.lo[d] = b->gstart[d] > p->start[d] ? b->gstart[d] : p->start[d];
            int64_t e1 = b->gstart[d] + b->ext[d], e2 = p->start[d] + p->extent[d];
            span.hi[d] = e1 < e2 ? e1 : e2;
            v *= span.hi[d] > span.lo[d] ? span.hi[d] - span.lo[d] : 0;
        }
        if (v == 0) continue;
        sp[n++] = span;
        covered += v;
    }
    bool overlap = false;
    for (int32_t i = 0; i < n && !overlap; i++)
        for (int32_t j = i + 1; j < n && !overlap; j++) overlap = spans_overlap(&sp[i], &sp[j], nd);
    if (overlap) { /* replicas: stage the box, compare where pieces meet */
        k.sdt = m->pieces[sp[0].piece].dtype; /* one dtype per tensor (manifest.c) */
        k.es = moe_dtype_size(k.sdt);
        k.raw = malloc((size_t)vol * k.es);
        k.bits = calloc((size_t)(vol + 7) / 8, 1);
        if (!k.raw || !k.bits) {
            st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "staging of tensor %s", name);
            goto done;
        }
    }
    for (int32_t i = 0; i < n; i++) {
        const ck_piece_t *p = &m->pieces[sp[i].piece];
        char fname[PATH_MAX];
        snprintf(fname, sizeof fname, "%s/%s", stepdir, m->files[p->file].path);
        st = read_intersection(fds[p->file], fname, m->chunk_bytes, p, sp[i].lo, sp[i].hi, &k);
        if (st != MOE_STATUS_SUCCESS) goto done;
        if (k.conflict) {
            st = MOE_FAIL(MOE_STATUS_CORRUPT,
                          "checkpoint step %" PRId64 ": overlapping pieces of tensor %s hold "
                          "different values (the piece at offset %" PRIu64 " of %s disagrees)",
                          step, name, p->offset, m->files[p->file].path);
            goto done;
        }
    }
    bool full = covered == vol;
    if (overlap) {
        int64_t set = 0;
        for (int64_t i = 0; i < vol; i++) set += (k.bits[i >> 3] >> (i & 7)) & 1;
        full = set == vol;
        if (full) unstage(&k, vol);
    }
    if (!full) {
        char desc[256];
        int len = 0;
        for (int d = 0; d < nd; d++)
            len += snprintf(desc + len, sizeof desc - (size_t)len, "%s%" PRId64 ":%" PRId64,
                            d ? "," : "", b->gstart[d], b->gstart[d] + b->ext[d]);
        st = MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                      "checkpoint step %" PRId64 " does not hold all of tensor %s[%s]", step, name,
                      desc);
    }
done:
    free(k.raw);
    free(k.bits);
    free(sp);
    return st;
}

static moe_status_t load_tensor(moe_runtime_t *rt, const ck_manifest_t *m, const int *fds,
                                const char *stepdir, int64_t step, const moe_ckpt_tensor_t *e)
{
    const moe_tensor_t *x = &e->tensor;
    int nd = x->ndim;
    const ck_piece_t *any = NULL;
    for (int32_t i = 0; i < m->npieces && !any; i++)
        if (!strcmp(m->pieces[i].name, e->name)) any = &m->pieces[i];
    if (!any)
        return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "tensor %s is not in checkpoint step %" PRId64,
                        e->name, step);
    int64_t gs[MOE_MAX_DIMS], go[MOE_MAX_DIMS];
    ck_tensor_box(e, gs, go);
    char want[128], have[128];
    int nw = 0, nh = 0;
    bool same = any->ndim == nd;
    for (int d = 0; d < nd; d++) {
        int64_t g = gs[d];
        nw += snprintf(want + nw, sizeof want - (size_t)nw, "%s%" PRId64, d ? "," : "", g);
        if (d < any->ndim && any->global_shape[d] != g) same = false;
    }
    for (int d = 0; d < any->ndim; d++)
        nh += snprintf(have + nh, sizeof have - (size_t)nh, "%s%" PRId64, d ? "," : "",
                       any->global_shape[d]);
    if (!same)
        return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                        "tensor %s: requested global shape [%s] but checkpoint step %" PRId64
                        " has [%s]",
                        e->name, want, step, have);
    int64_t numel = moe_tensor_numel(x);
    size_t bytes = (size_t)numel * moe_dtype_size(x->dtype);
    if (numel == 0) return MOE_STATUS_SUCCESS;
    uint8_t *dst = x->data;
    bool staged = x->device != MOE_DEVICE_HOST;
    if (staged) {
        dst = malloc(bytes);
        if (!dst) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "staging %zu bytes", bytes);
    }
    moe_status_t st = MOE_STATUS_SUCCESS;
    box_t b;
    for (int d = 0; d < nd; d++) {
        b.gstart[d] = go[d];
        b.ext[d] = x->shape[d];
        b.lstart[d] = 0;
    }
    if (e->expert_ids) {
        int ed = e->expert_dim;
        for (int64_t k = 0; k < x->shape[ed] && st == MOE_STATUS_SUCCESS; k++) {
            box_t bk = b;
            bk.gstart[ed] = e->expert_ids[k];
            bk.ext[ed] = 1;
            bk.lstart[ed] = k;
            st = load_box(m, fds, stepdir, e->name, &bk, nd, gs, dst, x->dtype, x->shape, step);
        }
    } else {
        st = load_box(m, fds, stepdir, e->name, &b, nd, gs, dst, x->dtype, x->shape, step);
    }
    if (staged) {
        if (st == MOE_STATUS_SUCCESS) {
            if (x->device != rt->backend.ops->device)
                st = MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                              "tensor %s is on a device the "
                              "runtime's backend (%s) cannot reach",
                              e->name, rt->backend.ops->name);
            else
                st = MOE_OPS(rt)->copy(MOE_CTX(rt), x->data, dst, bytes);
        }
        free(dst);
    }
    return st;
}

moe_status_t ck_load_dir(moe_runtime_t *rt, const char *stepdir, int64_t step,
                         const moe_ckpt_tensor_t *t, int32_t count)
{
    ck_manifest_t m;
    MOE_TRY(ck_manifest_read(stepdir, &m));
    moe_status_t st = MOE_STATUS_SUCCESS;
    int *fds = malloc(sizeof *fds * (size_t)(m.nfiles ? m.nfiles : 1));
    int opened = 0;
    if (!fds) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "file table");
        goto out;
    }
    if (m.step != step) {
        st = MOE_FAIL(MOE_STATUS_CORRUPT, "%s/%s says step %" PRId64, stepdir, CK_MANIFEST, m.step);
        goto out;
    }
    for (; opened < m.nfiles; opened++) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", stepdir, m.files[opened].path);
        st = ck_open_regular(path, &fds[opened]);
        if (st != MOE_STATUS_SUCCESS) {
            if (st == MOE_STATUS_NOT_FOUND) /* named by the manifest: the step is damaged */
                st = MOE_FAIL(MOE_STATUS_CORRUPT, "%s is missing", path);
            goto out;
        }
        struct stat sb;
        if (fstat(fds[opened], &sb) != 0 || (uint64_t)sb.st_size < m.files[opened].bytes) {
            st = MOE_FAIL(MOE_STATUS_CORRUPT,
                          "%s is truncated: %lld bytes, the manifest says %" PRIu64, path,
                          (long long)sb.st_size, m.files[opened].bytes);
            opened++;
            goto out;
        }
    }
    for (int32_t i = 0; i < count && st == MOE_STATUS_SUCCESS; i++)
        st = load_tensor(rt, &m, fds, stepdir, step, &t[i]);
out:
    for (int i = 0; i < opened; i++) close(fds[i]);
    free(fds);
    ck_manifest_free(&m);
    return st;
}
