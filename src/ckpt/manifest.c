/*
 * The checkpoint format (docs/checkpoint-format.md is the normative spec): the layout of a
 * rank's data file, manifest.json written with cJSON, and its parser, which rejects anything
 * malformed — above all file paths that could leave the step directory — and any piece whose
 * binding (an XXH3-64 over the piece's step, name, box, place and chunk checksums) does not
 * match, so an edit that keeps the data checksums consistent (a piece renamed, two pieces'
 * offsets swapped) is still found: damage is CORRUPT, never data loaded under a wrong name.
 *
 * Layout of rank R's data file `rank-<R>.bin`: pieces one after another in the order given,
 * each starting at a multiple of 4096 bytes (so O_DIRECT can write straight from staging
 * buffers); gaps and the tail up to the next multiple of 4096 are zero.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/error.h"
#include "ckpt_internal.h"

/* ---- freeing --------------------------------------------------------------------------- */

void ck_pieces_free(ck_piece_t *p, int32_t n)
{
    if (!p) return;
    for (int32_t i = 0; i < n; i++) {
        free(p[i].name);
        free(p[i].xxh);
    }
    free(p);
}

void ck_manifest_free(ck_manifest_t *m)
{
    if (!m) return;
    for (int32_t i = 0; i < m->nfiles; i++) free(m->files[i].path);
    free(m->files);
    ck_pieces_free(m->pieces, m->npieces);
    memset(m, 0, sizeof *m);
}

/* ---- layout of a save -------------------------------------------------------------------- */

static uint64_t align_up(uint64_t x) { return (x + CK_ALIGN - 1) / CK_ALIGN * CK_ALIGN; }

moe_status_t ck_layout(const moe_ckpt_tensor_t *t, int32_t count, uint64_t chunk_bytes,
                       int32_t file_index, ck_piece_t **pieces, int32_t *npieces,
                       uint64_t *file_bytes)
{
    MOE_TRY(ck_check_request(t, count));
    /* one piece per tensor, or per run of consecutive expert ids */
    int64_t n = 0;
    for (int32_t i = 0; i < count; i++) {
        if (!t[i].expert_ids) {
            n++;
            continue;
        }
        int ed = t[i].expert_dim;
        for (int64_t k = 0; k < t[i].tensor.shape[ed]; k++)
            if (k == 0 || t[i].expert_ids[k] != t[i].expert_ids[k - 1] + 1) n++;
    }
    ck_piece_t *p = calloc((size_t)(n ? n : 1), sizeof *p);
    if (!p) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "piece table");
    int32_t np = 0;
    uint64_t off = 0;
    moe_status_t st = MOE_STATUS_SUCCESS;
    for (int32_t i = 0; i < count; i++) {
        const moe_ckpt_tensor_t *e = &t[i];
        const moe_tensor_t *x = &e->tensor;
        size_t es = moe_dtype_size(x->dtype);
        int ed = e->expert_ids ? e->expert_dim : -1;
        int64_t runs_end = ed >= 0 ? x->shape[ed] : 1;
        /* bytes per index of the expert dimension */
        uint64_t stride = es;
        if (ed >= 0)
            for (int d = ed + 1; d < x->ndim; d++) stride *= (uint64_t)x->shape[d];
        for (int64_t k = 0; k < runs_end;) {
            int64_t k1 = k + 1;
            if (ed >= 0)
                while (k1 < runs_end && e->expert_ids[k1] == e->expert_ids[k1 - 1] + 1) k1++;
            else
                k1 = runs_end;
            ck_piece_t *q = &p[np++];
            q->name = strdup(e->name);
            if (!q->name) {
                st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "piece name");
                goto fail;
            }
            q->dtype = x->dtype;
            q->ndim = x->ndim;
            uint64_t numel = 1;
            ck_tensor_box(e, q->global_shape, q->start);
            for (int d = 0; d < x->ndim; d++) q->extent[d] = x->shape[d];
            if (ed >= 0) {
                q->start[ed] = e->expert_ids[k];
                q->extent[ed] = k1 - k;
            }
            for (int d = 0; d < x->ndim; d++) numel *= (uint64_t)q->extent[d];
            q->length = numel * es;
            q->offset = off;
            q->file = file_index;
            q->nchunks = (uint32_t)((q->length + chunk_bytes - 1) / chunk_bytes);
            q->xxh = calloc(q->nchunks ? q->nchunks : 1, sizeof *q->xxh);
            if (!q->xxh) {
                st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "checksum table");
                goto fail;
            }
            q->src = (const uint8_t *)x->data + (ed >= 0 ? (uint64_t)k * stride : 0);
            q->src_device = x->device;
            off = align_up(off + q->length);
            k = k1;
        }
    }
    *pieces = p;
    *npieces = np;
    *file_bytes = off;
    return MOE_STATUS_SUCCESS;
fail:
    ck_pieces_free(p, np);
    return st;
}

/* ---- the piece binding ----------------------------------------------------------------------- */

static void append(char **p, size_t *left, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void append(char **p, size_t *left, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(*p, *left, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    size_t m = (size_t)n < *left ? (size_t)n : *left;
    *p += m;
    *left -= m;
}

/* XXH3-64 of the text "<step>|<chunk_bytes>|<name>|<dtype>|<global_shape>|<slice_start>|
 * <slice_shape>|<file>|<offset>|<length>|<xxh3_64>", numbers in decimal, lists joined by ','
 * (checksums as their 16 hex digits): the spec's "binding" of a piece. */
static moe_status_t piece_binding(int64_t step, uint64_t chunk_bytes, const ck_piece_t *q,
                                  const char *file, uint64_t *out)
{
    size_t cap = strlen(q->name) + strlen(file) + 17 * (size_t)q->nchunks + 512;
    char *buf = malloc(cap), *p = buf;
    if (!buf) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "piece binding");
    size_t left = cap;
    append(&p, &left, "%" PRId64 "|%" PRIu64 "|%s|%s|", step, chunk_bytes, q->name,
           moe_dtype_name(q->dtype));
    const int64_t *dims[3] = {q->global_shape, q->start, q->extent};
    for (int k = 0; k < 3; k++) {
        for (int d = 0; d < q->ndim; d++) append(&p, &left, "%s%" PRId64, d ? "," : "", dims[k][d]);
        append(&p, &left, "|");
    }
    append(&p, &left, "%s|%" PRIu64 "|%" PRIu64 "|", file, q->offset, q->length);
    for (uint32_t c = 0; c < q->nchunks; c++)
        append(&p, &left, "%s%016" PRIx64, c ? "," : "", q->xxh[c]);
    *out = XXH3_64bits(buf, (size_t)(p - buf));
    free(buf);
    return MOE_STATUS_SUCCESS;
}

/* ---- JSON out ------------------------------------------------------------------------------ */

static cJSON *int_array(const int64_t *v, int n)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((double)v[i]));
    return a;
}

char *ck_pieces_to_json(int64_t step, uint64_t chunk_bytes, const ck_piece_t *p, int32_t n)
{
    cJSON *arr = cJSON_CreateArray();
    if (!arr) return NULL;
    char rankfile[64], hex[17];
    for (int32_t i = 0; i < n; i++) {
        const ck_piece_t *q = &p[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToArray(arr, o);
        cJSON_AddStringToObject(o, "name", q->name);
        cJSON_AddStringToObject(o, "dtype", moe_dtype_name(q->dtype));
        cJSON_AddItemToObject(o, "global_shape", int_array(q->global_shape, q->ndim));
        cJSON_AddItemToObject(o, "slice_start", int_array(q->start, q->ndim));
        cJSON_AddItemToObject(o, "slice_shape", int_array(q->extent, q->ndim));
        ck_rank_filename(q->file, rankfile, sizeof rankfile);
        cJSON_AddStringToObject(o, "file", rankfile);
        cJSON_AddNumberToObject(o, "offset", (double)q->offset);
        cJSON_AddNumberToObject(o, "length", (double)q->length);
        cJSON *cs = cJSON_AddArrayToObject(o, "xxh3_64");
        for (uint32_t c = 0; c < q->nchunks; c++) {
            snprintf(hex, sizeof hex, "%016" PRIx64, q->xxh[c]);
            cJSON_AddItemToArray(cs, cJSON_CreateString(hex));
        }
        uint64_t b;
        if (piece_binding(step, chunk_bytes, q, rankfile, &b) != MOE_STATUS_SUCCESS) {
            cJSON_Delete(arr);
            return NULL;
        }
        snprintf(hex, sizeof hex, "%016" PRIx64, b);
        cJSON_AddStringToObject(o, "binding_xxh3_64", hex);
    }
    char *s = cJSON_PrintUnformatted(arr);
    cJSON_Delete(arr);
    return s;
}

char *ck_manifest_build(int64_t step, uint64_t chunk_bytes, int32_t world, const int32_t mesh[4],
                        char *const *rank_pieces_json, const uint64_t *rank_file_bytes)
{
    cJSON *m = cJSON_CreateObject();
    if (!m) return NULL;
    cJSON_AddStringToObject(m, "format", CK_FORMAT_NAME);
    cJSON_AddNumberToObject(m, "format_version", CK_FORMAT_VERSION);
    cJSON_AddNumberToObject(m, "step", (double)step);
    cJSON_AddStringToObject(m, "library_version", moe_version_string());
    cJSON_AddStringToObject(m, "checksum", "xxh3_64");
    cJSON_AddNumberToObject(m, "chunk_bytes", (double)chunk_bytes);
    cJSON *mo = cJSON_AddObjectToObject(m, "mesh");
    cJSON_AddNumberToObject(mo, "world", world);
    const char *axes[4] = {"tp", "ep", "dp", "pp"};
    for (int a = 0; a < 4; a++) cJSON_AddNumberToObject(mo, axes[a], mesh[a]);
    cJSON *files = cJSON_AddArrayToObject(m, "files");
    cJSON *tensors = cJSON_AddArrayToObject(m, "tensors");
    char name[64];
    for (int32_t r = 0; r < world; r++) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddItemToArray(files, f);
        ck_rank_filename(r, name, sizeof name);
        cJSON_AddStringToObject(f, "path", name);
        cJSON_AddNumberToObject(f, "rank", r);
        cJSON_AddNumberToObject(f, "bytes", (double)rank_file_bytes[r]);
        cJSON *arr = cJSON_Parse(rank_pieces_json[r]);
        if (!arr) {
            cJSON_Delete(m);
            return NULL;
        }
        cJSON *it;
        while ((it = cJSON_DetachItemFromArray(arr, 0)) != NULL) cJSON_AddItemToArray(tensors, it);
        cJSON_Delete(arr);
    }
    cJSON_AddNumberToObject(m, "piece_count", cJSON_GetArraySize(tensors));
    char *s = cJSON_Print(m);
    cJSON_Delete(m);
    return s;
}

/* ---- JSON in ------------------------------------------------------------------------------- */

#define BAD(...) MOE_FAIL(MOE_STATUS_CORRUPT, "manifest: " __VA_ARGS__)

/* JSON numbers are doubles: integers up to 2^53 are exact. Sizes, offsets, shape entries and
 * a tensor's element count stay within it. */
#define MAX_EXACT 9007199254740992.0

static bool get_u64(const cJSON *o, const char *key, uint64_t *v)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(x)) return false;
    double d = x->valuedouble;
    if (!(d >= 0 && d <= MAX_EXACT) || floor(d) != d) return false;
    *v = (uint64_t)d;
    return true;
}

static int get_shape(const cJSON *o, const char *key, int64_t *v)
{
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsArray(a)) return -1;
    int n = cJSON_GetArraySize(a);
    if (n < 1 || n > MOE_MAX_DIMS) return -1;
    int i = 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, a)
    {
        double d = cJSON_IsNumber(x) ? x->valuedouble : -1;
        if (!(d >= 0 && d <= MAX_EXACT) || floor(d) != d) return -1;
        v[i++] = (int64_t)d;
    }
    return n;
}

static bool parse_dtype(const char *s, moe_dtype_t *dt)
{
    if (!s) return false;
    if (!strcmp(s, "f32"))
        *dt = MOE_DTYPE_F32;
    else if (!strcmp(s, "bf16"))
        *dt = MOE_DTYPE_BF16;
    else
        return false;
    return true;
}

static bool parse_hex64(const char *s, uint64_t *v)
{
    if (!s || strlen(s) != 16) return false;
    uint64_t r = 0;
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return false;
        r = r << 4 | (uint64_t)d;
    }
    *v = r;
    return true;
}

/* A NUL in the text, raw or escaped as \u0000, would cut a C string short (a file name
 * "rank-00000.bin\u0000x" read as "rank-00000.bin"): no valid manifest has one. */
static bool has_nul(const char *text, size_t len)
{
    if (memchr(text, 0, len)) return true;
    for (size_t i = 0; i + 1 < len; i++) {
        if (text[i] != '\\') continue;
        if (text[i + 1] == 'u' && i + 6 <= len && !memcmp(text + i + 2, "0000", 4)) return true;
        i++; /* the escaped character */
    }
    return false;
}

/* The header: format, version, library version, checksum kind, step, chunk size, mesh and
 * (version 3) the piece count. */
static moe_status_t parse_header(const cJSON *m, ck_manifest_t *out, uint64_t *npieces)
{
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(m, "format");
    uint64_t ver, step, chunk;
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, CK_FORMAT_NAME)) {
        return BAD("\"format\" is not \"%s\"", CK_FORMAT_NAME);
    }
    if (!get_u64(m, "format_version", &ver) || ver < 2 || ver > CK_FORMAT_VERSION) {
        return BAD("unsupported format_version (this library reads 2 and %d: version 1 has no "
                   "piece bindings)",
                   CK_FORMAT_VERSION);
    }
    /* version 3 counts its pieces, so a piece entry removed is damage, not a missing tensor */
    *npieces = UINT64_MAX;
    if (ver >= 3 && !get_u64(m, "piece_count", npieces)) {
        return BAD("\"piece_count\" is missing or invalid");
    }
    const cJSON *lib = cJSON_GetObjectItemCaseSensitive(m, "library_version");
    const cJSON *sum = cJSON_GetObjectItemCaseSensitive(m, "checksum");
    if (!cJSON_IsString(lib)) {
        return BAD("\"library_version\" (a string) is missing");
    }
    if (!cJSON_IsString(sum) || strcmp(sum->valuestring, "xxh3_64") != 0) {
        bool named = cJSON_IsString(sum);
        return BAD("\"checksum\" is %s%.40s%s; this library knows \"xxh3_64\"", named ? "\"" : "",
                   named ? sum->valuestring : "missing", named ? "\"" : "");
    }
    if (!get_u64(m, "step", &step) || !get_u64(m, "chunk_bytes", &chunk) || chunk == 0) {
        return BAD("missing or invalid step / chunk_bytes");
    }
    out->step = (int64_t)step;
    out->chunk_bytes = chunk;
    const cJSON *mesh = cJSON_GetObjectItemCaseSensitive(m, "mesh");
    const char *axes[4] = {"tp", "ep", "dp", "pp"};
    uint64_t w = 0;
    if (!cJSON_IsObject(mesh) || !get_u64(mesh, "world", &w) || w < 1 || w > (1u << 20)) {
        return BAD("missing or invalid mesh");
    }
    out->world = (int32_t)w;
    for (int a = 0; a < 4; a++) {
        uint64_t v = 1;
        if (!get_u64(mesh, axes[a], &v) || v < 1 || v > w) {
            return BAD("mesh.%s is missing or invalid", axes[a]);
        }
        out->mesh[a] = (int32_t)v;
    }
    return MOE_STATUS_SUCCESS;
}

/* The "files" array: plain names inside the step directory, each once. */
static moe_status_t parse_files(const cJSON *files, ck_manifest_t *out)
{
    const cJSON *x;
    cJSON_ArrayForEach(x, files)
    {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(x, "path");
        uint64_t bytes, rank;
        if (!cJSON_IsString(p) || !get_u64(x, "bytes", &bytes) || !get_u64(x, "rank", &rank)) {
            return BAD("files[%d] lacks path / bytes / rank", out->nfiles);
        }
        if (!ck_valid_file_name(p->valuestring)) {
            return BAD("files[%d].path \"%.80s\" is not a plain file name inside the checkpoint "
                       "directory (rejected)",
                       out->nfiles, p->valuestring);
        }
        for (int32_t j = 0; j < out->nfiles; j++)
            if (!strcmp(out->files[j].path, p->valuestring)) {
                return BAD("file \"%s\" listed twice", p->valuestring);
            }
        ck_file_t *f = &out->files[out->nfiles++];
        f->path = strdup(p->valuestring);
        f->bytes = bytes;
        if (!f->path) {
            return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "manifest path");
        }
    }
    return MOE_STATUS_SUCCESS;
}

/* One entry of "tensors" as piece q (index idx): name, dtype, box, place in its file, chunk
 * checksums and the binding over all of them. */
static moe_status_t parse_piece(const cJSON *x, int idx, ck_manifest_t *out, ck_piece_t *q)
{
    uint64_t chunk = out->chunk_bytes;
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(x, "name");
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(x, "dtype");
    const cJSON *fl = cJSON_GetObjectItemCaseSensitive(x, "file");
    const cJSON *cs = cJSON_GetObjectItemCaseSensitive(x, "xxh3_64");
    if (!cJSON_IsString(nm) || !ck_valid_name(nm->valuestring)) {
        return BAD("tensors[%d].name is missing or invalid", idx);
    }
    q->name = strdup(nm->valuestring);
    if (!q->name) {
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "manifest name");
    }
    if (!cJSON_IsString(dt) || !parse_dtype(dt->valuestring, &q->dtype)) {
        return BAD("tensor %s: dtype missing or not f32/bf16", q->name);
    }
    int n1 = get_shape(x, "global_shape", q->global_shape);
    int n2 = get_shape(x, "slice_start", q->start);
    int n3 = get_shape(x, "slice_shape", q->extent);
    if (n1 < 0 || n1 != n2 || n1 != n3) {
        return BAD("tensor %s: global_shape / slice_start / slice_shape malformed", q->name);
    }
    q->ndim = n1;
    uint64_t numel = 1, gnumel = 1;
    for (int d = 0; d < q->ndim; d++) {
        if (q->start[d] + q->extent[d] > q->global_shape[d]) {
            return BAD("tensor %s: slice exceeds the global shape in dimension %d", q->name, d);
        }
        if (__builtin_mul_overflow(numel, (uint64_t)q->extent[d], &numel) ||
            __builtin_mul_overflow(gnumel, (uint64_t)q->global_shape[d], &gnumel) ||
            (double)gnumel > MAX_EXACT) {
            return BAD("tensor %s: global shape has more than 2^53 elements", q->name);
        }
    }
    if (!cJSON_IsString(fl)) {
        return BAD("tensor %s: file missing", q->name);
    }
    if (!ck_valid_file_name(fl->valuestring)) {
        return BAD("tensor %s: file \"%.80s\" is not a plain file name inside the checkpoint "
                   "directory (rejected)",
                   q->name, fl->valuestring);
    }
    q->file = -1;
    for (int32_t j = 0; j < out->nfiles; j++)
        if (!strcmp(out->files[j].path, fl->valuestring)) q->file = j;
    if (q->file < 0) {
        return BAD("tensor %s: file \"%s\" is not in \"files\"", q->name, fl->valuestring);
    }
    if (!get_u64(x, "offset", &q->offset) || !get_u64(x, "length", &q->length) ||
        q->length != numel * moe_dtype_size(q->dtype) ||
        q->offset + q->length > out->files[q->file].bytes) {
        return BAD("tensor %s: offset/length invalid or outside its file", q->name);
    }
    if (q->offset % CK_ALIGN != 0) {
        return BAD("tensor %s: offset %" PRIu64 " is not a multiple of %u", q->name, q->offset,
                   CK_ALIGN);
    }
    uint64_t want = (q->length + chunk - 1) / chunk;
    if (!cJSON_IsArray(cs) || (uint64_t)cJSON_GetArraySize(cs) != want) {
        return BAD("tensor %s: expected %" PRIu64 " xxh3_64 checksums", q->name, want);
    }
    q->nchunks = (uint32_t)want;
    q->xxh = calloc(want ? want : 1, sizeof *q->xxh);
    if (!q->xxh) {
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "checksums");
    }
    uint32_t c = 0;
    const cJSON *h;
    cJSON_ArrayForEach(h, cs)
    {
        if (!cJSON_IsString(h) || !parse_hex64(h->valuestring, &q->xxh[c++])) {
            return BAD("tensor %s: checksum %u is not 16 lower-case hex digits", q->name, c - 1);
        }
    }
    const cJSON *bd = cJSON_GetObjectItemCaseSensitive(x, "binding_xxh3_64");
    uint64_t want_b, have_b;
    if (!cJSON_IsString(bd) || !parse_hex64(bd->valuestring, &have_b)) {
        return BAD("tensor %s: binding_xxh3_64 missing or not 16 lower-case hex digits", q->name);
    }
    MOE_TRY(piece_binding(out->step, chunk, q, out->files[q->file].path, &want_b));
    if (want_b != have_b) {
        return BAD("tensor %s: the piece at offset %" PRIu64 " of %s does not match its binding "
                   "(%016" PRIx64 ", computed %016" PRIx64 "): the manifest was altered",
                   q->name, q->offset, out->files[q->file].path, have_b, want_b);
    }
    return MOE_STATUS_SUCCESS;
}

/* The pieces of one tensor describe one tensor: the same dtype and global shape. */
static moe_status_t check_tensors_agree(const ck_manifest_t *out)
{
    for (int32_t i = 0; i < out->npieces; i++)
        for (int32_t j = 0; j < i; j++) {
            const ck_piece_t *a = &out->pieces[j], *b = &out->pieces[i];
            if (strcmp(a->name, b->name) != 0) continue;
            bool same = a->dtype == b->dtype && a->ndim == b->ndim;
            for (int d = 0; same && d < a->ndim; d++)
                same = a->global_shape[d] == b->global_shape[d];
            if (!same)
                return BAD("the pieces of tensor %s disagree on its dtype or global shape",
                           a->name);
            break; /* b agrees with an earlier piece, which agrees with the first */
        }
    return MOE_STATUS_SUCCESS;
}

moe_status_t ck_manifest_parse(const char *text, size_t len, ck_manifest_t *out)
{
    memset(out, 0, sizeof *out);
    if (has_nul(text, len)) return BAD("contains a NUL character (raw or \\u0000)");
    cJSON *m = cJSON_ParseWithLength(text, len);
    if (!m) return BAD("not valid JSON");
    uint64_t npieces = UINT64_MAX; /* set by parse_header */
    moe_status_t st = parse_header(m, out, &npieces);
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(m, "files");
    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(m, "tensors");
    if (st == MOE_STATUS_SUCCESS && (!cJSON_IsArray(files) || !cJSON_IsArray(tensors)))
        st = BAD("\"files\" and \"tensors\" must be arrays");
    if (st != MOE_STATUS_SUCCESS) goto fail;
    int nf = cJSON_GetArraySize(files), nt = cJSON_GetArraySize(tensors);
    if (npieces != UINT64_MAX && npieces != (uint64_t)nt) {
        st = BAD("\"tensors\" has %d entries where \"piece_count\" says %" PRIu64
                 ": a piece entry was removed or added",
                 nt, npieces);
        goto fail;
    }
    out->files = calloc((size_t)(nf ? nf : 1), sizeof *out->files);
    out->pieces = calloc((size_t)(nt ? nt : 1), sizeof *out->pieces);
    if (!out->files || !out->pieces) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "manifest tables");
        goto fail;
    }
    MOE_TRY_GOTO(st, parse_files(files, out));
    const cJSON *x;
    cJSON_ArrayForEach(x, tensors)
    {
        int idx = out->npieces++;
        MOE_TRY_GOTO(st, parse_piece(x, idx, out, &out->pieces[idx]));
    }
    MOE_TRY_GOTO(st, check_tensors_agree(out));
    cJSON_Delete(m);
    return MOE_STATUS_SUCCESS;
fail:
    cJSON_Delete(m);
    ck_manifest_free(out);
    return st;
}

moe_status_t ck_open_regular(const char *path, int *fd_out)
{
    /* O_NONBLOCK: opening a FIFO (or a device) never waits for a writer */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return MOE_FAIL_ERRNO(errno == ENOENT ? MOE_STATUS_NOT_FOUND : MOE_STATUS_IO_ERROR,
                              "open(%s)", path);
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        moe_status_t st = MOE_FAIL(MOE_STATUS_CORRUPT, "%s is not a regular file", path);
        close(fd);
        return st;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl != -1) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    *fd_out = fd;
    return MOE_STATUS_SUCCESS;
}

moe_status_t ck_manifest_read(const char *stepdir, ck_manifest_t *out)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", stepdir, CK_MANIFEST);
    int fd;
    MOE_TRY(ck_open_regular(path, &fd));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || sb.st_size <= 0 || (uint64_t)sb.st_size > CK_MAX_MANIFEST_BYTES) {
        close(fd);
        return MOE_FAIL(MOE_STATUS_CORRUPT, "%s: empty, unreadable or larger than %u bytes", path,
                        CK_MAX_MANIFEST_BYTES);
    }
    size_t n = (size_t)sb.st_size;
    char *buf = malloc(n + 1);
    if (!buf) {
        close(fd);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "manifest buffer");
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (got != n) {
        free(buf);
        return MOE_FAIL(MOE_STATUS_IO_ERROR, "read(%s): short read", path);
    }
    buf[n] = 0;
    moe_status_t st = ck_manifest_parse(buf, n, out);
    free(buf);
    if (st != MOE_STATUS_SUCCESS) return moe_error_wrap(st, "in %s", path);
    return st;
}
