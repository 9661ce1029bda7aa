/*
 * Checkpointer internals shared by the files of src/ckpt/:
 *   manifest.c  the on-disk format: layout of a rank's data file, manifest.json in and out,
 *               name/path validation (docs/checkpoint-format.md is the spec)
 *   writer.c    one data file written from pinned segments: io_uring + O_DIRECT, registered
 *               buffers, several requests in flight; pwrite fallback
 *   load.c      verify + read + reshard (box intersection) into the caller's tensors
 *   s3.c        the S3 client: SigV4 via libcurl, multipart, retries
 *   ckpt.c      the public API, the snapshot, the writer and S3 threads, retention
 *
 * Vocabulary: a *piece* is one contiguous region of a data file holding a box of a global
 * tensor (slice_start, slice_shape); a *segment* is one pinned staging buffer of chunk_bytes
 * that carries a range of a data file from save_async to the writer; a *chunk* is the
 * checksum unit: successive chunk_bytes of a piece's bytes, each with an XXH3-64.
 */
#ifndef MOE_CKPT_INTERNAL_H
#define MOE_CKPT_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include <moe/ckpt.h>

#include "../core/log.h"

#define CK_FORMAT_NAME "libmoe-checkpoint"
#define CK_FORMAT_VERSION 1
#define CK_ALIGN 4096u
#define CK_MANIFEST "manifest.json"
#define CK_MAX_NAME 255
#define CK_MAX_MANIFEST_BYTES (256u << 20)

typedef struct ck_piece {
    char *name;
    moe_dtype_t dtype;
    int32_t ndim;
    int64_t global_shape[MOE_MAX_DIMS];
    int64_t start[MOE_MAX_DIMS];
    int64_t extent[MOE_MAX_DIMS];
    int32_t file;             /* index into the manifest's files */
    uint64_t offset, length;  /* bytes in that file; offset is CK_ALIGN-aligned */
    uint32_t nchunks;
    uint64_t *xxh;            /* [nchunks] */
    /* save side only: where the bytes come from (contiguous) */
    const uint8_t *src;
    moe_device_kind_t src_device;
} ck_piece_t;

typedef struct ck_file {
    char *path;               /* plain file name inside the step directory */
    uint64_t bytes;           /* file size (a multiple of CK_ALIGN) */
} ck_file_t;

typedef struct ck_manifest {
    int64_t step;
    uint64_t chunk_bytes;
    int32_t world, mesh[4];   /* tp, ep, dp, pp */
    int32_t nfiles;
    ck_file_t *files;
    int32_t npieces;
    ck_piece_t *pieces;
} ck_manifest_t;

/* ---- manifest.c ---- */
bool ck_valid_name(const char *s);       /* tensor names */
bool ck_valid_file_name(const char *s);  /* a plain file name: no '/', not . or .. */
bool ck_valid_prefix(const char *s);     /* S3 prefix: [A-Za-z0-9._/-], no .. component */
void ck_step_dirname(int64_t step, char *buf, size_t len); /* "step-000000000012" */
void ck_rank_filename(int32_t rank, char *buf, size_t len); /* "rank-00003.bin" */
/* qsort comparator of int64_t, ascending. */
int ck_cmp_i64(const void *a, const void *b);
bool ck_parse_step_dirname(const char *s, int64_t *step);
void ck_manifest_free(ck_manifest_t *m);
/* The tensor's box in its global tensor: global_shape and offset as given, or, where no global
 * shape was given (all zero), the local shape at offset 0. */
void ck_tensor_box(const moe_ckpt_tensor_t *e, int64_t *global, int64_t *offset);
void ck_pieces_free(ck_piece_t *p, int32_t n);
/* Pieces of a save: validate the user's tensors and cut expert-split pieces; offsets in the
 * rank file assigned (aligned), returns the file size. */
moe_status_t ck_layout(const moe_ckpt_tensor_t *t, int32_t count, uint64_t chunk_bytes,
                       int32_t file_index, ck_piece_t **pieces, int32_t *npieces,
                       uint64_t *file_bytes);
/* JSON array of this rank's pieces (checksums filled), as text (malloc'd). */
char *ck_pieces_to_json(const ck_piece_t *p, int32_t n);
/* Full manifest text from per-rank piece arrays (JSON texts) and file sizes. */
char *ck_manifest_build(int64_t step, uint64_t chunk_bytes, int32_t world, const int32_t mesh[4],
                        char *const *rank_pieces_json, const uint64_t *rank_file_bytes);
/* Parse + validate a manifest text (every structural rule of the spec). */
moe_status_t ck_manifest_parse(const char *text, size_t len, ck_manifest_t *out);
/* Read <dir>/manifest.json and parse it. */
moe_status_t ck_manifest_read(const char *stepdir, ck_manifest_t *out);

/* ---- writer.c ---- */
typedef struct ck_writer ck_writer_t;
moe_status_t ck_writer_create(int queue_depth, size_t io_block, bool direct,
                              const moe_logger_t *log, ck_writer_t **out);
void ck_writer_destroy(ck_writer_t *w);
/* Register a segment buffer under slot index `slot` (best effort). */
void ck_writer_register(ck_writer_t *w, int slot, void *buf, size_t len);
moe_status_t ck_writer_open(ck_writer_t *w, const char *path);
/* Queue `len` bytes of buf (registered as `slot`, or -1) at `offset`; completions of earlier
 * segments are reaped meanwhile, calling done(cookie) for each finished segment. */
moe_status_t ck_writer_write(ck_writer_t *w, int slot, const void *buf, size_t len,
                             uint64_t offset, void *cookie, void (*done)(void *, void *),
                             void *done_ctx);
/* Requests in flight? Then wait for at least one completion (segments come back through
 * their done callbacks). */
bool ck_writer_pending(const ck_writer_t *w);
void ck_writer_reap_one(ck_writer_t *w);
/* Wait for all in flight, fsync and close. */
moe_status_t ck_writer_finish(ck_writer_t *w);
/* Abandon the current file (close without fsync), reaping what is in flight. */
void ck_writer_cancel(ck_writer_t *w);
bool ck_writer_direct(const ck_writer_t *w);

/* ---- fs helpers (writer.c) ---- */
moe_status_t ck_fsync_dir(const char *dir);
moe_status_t ck_mkdir_p(const char *dir);
moe_status_t ck_write_file_atomic(const char *dir, const char *name, const void *data,
                                  size_t len);
moe_status_t ck_rmtree(const char *dir);

/* ---- s3.c ---- */
typedef struct ck_s3 ck_s3_t;
moe_status_t ck_s3_create(const moe_ckpt_config_t *c, const moe_logger_t *log, ck_s3_t **out);
void ck_s3_destroy(ck_s3_t *s);
void ck_s3_cancel(ck_s3_t *s);   /* make in-flight and later requests fail quickly */
/* HEAD-like check that the bucket exists; UNREACHABLE is reported as TIMEOUT. */
moe_status_t ck_s3_check_bucket(ck_s3_t *s);
/* Upload a local file as <prefix>/<stepdir>/<name> (multipart above the part size). */
moe_status_t ck_s3_put_file(ck_s3_t *s, const char *stepdir, const char *name,
                            const char *local_path, uint64_t *bytes_sent);
moe_status_t ck_s3_get_file(ck_s3_t *s, const char *stepdir, const char *name,
                            const char *local_path);
/* Steps with a manifest.json object, ascending (malloc'd). retries < 0: the configured count. */
moe_status_t ck_s3_list_steps(ck_s3_t *s, int64_t **steps, int32_t *count, int retries);
/* Delete manifest first, then every other object of the step. */
moe_status_t ck_s3_delete_step(ck_s3_t *s, const char *stepdir);
void ck_sha256_hex(const void *data, size_t len, char out[65]);

/* ---- load.c ---- */
/* Load from one complete local step directory. Returns CORRUPT / IO_ERROR / NOT_FOUND for
 * problems of the checkpoint (fall back) and INVALID_ARGUMENT for problems of the request. */
struct moe_runtime;
moe_status_t ck_load_dir(struct moe_runtime *rt, const char *stepdir, int64_t step,
                         const moe_ckpt_tensor_t *t, int32_t count);
/* Validate a load request (names, shapes) without a checkpoint. */
moe_status_t ck_check_request(const moe_ckpt_tensor_t *t, int32_t count);

#endif /* MOE_CKPT_INTERNAL_H */
