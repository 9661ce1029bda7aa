/* Local tier of the checkpointer on the host backend: bitwise round trip (with the state
 * larger than the pinned budget, so save_async double-buffers), snapshot semantics (the
 * caller overwrites its tensors as soon as moe_ckpt_fence returns), expert reshard by global id,
 * dtype conversion, corruption (flipped byte, truncated file, path escape) detected and
 * fallen back from, retention, and bad inputs (unwritable directory, duplicate names, missing
 * tensors, mismatched shapes, disk full on a small tmpfs when the test may mount one); and
 * what include/moe/ckpt.h promises about the step directory and MPI holds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt_common.h"

static char g_dir[256];
static moe_runtime_t *g_rt;

static int setup(void **st)
{
    (void)st;
    ct_up(g_dir, sizeof g_dir, "local", &g_rt);
    return 0;
}

static int teardown(void **st)
{
    (void)st;
    ct_down(g_dir, g_rt);
    return 0;
}

static moe_ckpt_t *open_ck(int keep_last)
{
    moe_ckpt_config_t c = ct_config(g_dir);
    c.keep_last = keep_last;
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck));
    return ck;
}

static void save_steps(moe_ckpt_t *ck, ct_state_t *s, int64_t from, int64_t to)
{
    for (int64_t step = from; step <= to; step++) {
        TEST_OK(moe_ckpt_fence(ck)); /* the previous save may still copy s */
        ct_fill(s, step);
        TEST_OK(moe_ckpt_save_async(ck, step, s->t, 3));
    }
    TEST_OK(moe_ckpt_wait(ck, 1, 60000));
}

static void step_file(int64_t step, const char *name, char *buf, size_t n)
{
    snprintf(buf, n, "%s/step-%012lld/%s", g_dir, (long long)step, name);
}

static void test_round_trip(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(0);
    ct_state_t s;
    ct_init(&s);
    ct_fill(&s, 10);
    TEST_OK(moe_ckpt_save_async(ck, 10, s.t, 3));
    /* the snapshot is the state at the call: after the fence, overwrite the tensors at once */
    TEST_OK(moe_ckpt_fence(ck));
    ct_fill(&s, 999);
    TEST_OK(moe_ckpt_wait(ck, 1, 60000));
    moe_ckpt_status_t status = {.struct_size = sizeof status};
    TEST_OK(moe_ckpt_status(ck, &status));
    assert_int_equal(status.last_committed_step, 10);
    assert_int_equal(status.pending_saves, 0);
    assert_int_equal(status.state, MOE_CKPT_IDLE);
    /* file: a 16 KiB-aligned a, b (420000 -> 421888), experts as 4 pieces of 2 KiB -> 4 KiB */
    assert_true(status.bytes_written >= (uint64_t)(CT_A_N * 4 + CT_B_N * 2 + CT_E_N * 4));
    assert_true(status.bytes_written % 4096 == 0);
    memset(s.a, 0, CT_A_N * 4);
    memset(s.b, 0, CT_B_N * 2);
    memset(s.e, 0, CT_E_N * 4);
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &step));
    assert_int_equal(step, 10);
    assert_true(ct_check(&s, 10));
    int64_t steps[4];
    int32_t n = 0;
    TEST_OK(moe_ckpt_list(ck, MOE_CKPT_TIER_LOCAL, steps, 4, &n));
    assert_int_equal(n, 1);
    assert_int_equal(steps[0], 10);
    char path[512];
    step_file(10, "manifest.json", path, sizeof path);
    assert_int_equal(access(path, R_OK), 0);
    step_file(10, "rank-00000.bin.tmp", path, sizeof path);
    assert_int_not_equal(access(path, F_OK), 0); /* no temporary left behind */
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

static void test_round_trip_pwrite(void **st)
{
    setenv("MOE_CKPT_NO_URING", "1", 1);
    test_round_trip(st);
    unsetenv("MOE_CKPT_NO_URING");
    assert_true(ct_log_has("pwrite instead"));
}

static void test_round_trip_buffered(void **st)
{
    (void)st;
    moe_ckpt_config_t c = ct_config(g_dir);
    c.use_direct_io = 0;
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck));
    ct_state_t s;
    ct_init(&s);
    ct_fill(&s, 4);
    TEST_OK(moe_ckpt_save_async(ck, 4, s.t, 3));
    TEST_OK(moe_ckpt_fence(ck));
    ct_fill(&s, 5);
    TEST_OK(moe_ckpt_wait(ck, 1, 60000));
    moe_ckpt_status_t status = {.struct_size = sizeof status};
    TEST_OK(moe_ckpt_status(ck, &status));
    assert_int_equal(status.direct_io, 0);
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &step));
    assert_int_equal(step, 4);
    assert_true(ct_check(&s, 4));
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

/* Experts saved as global ids 1,3,5,7; loaded by other placements. */
static void test_reshard_experts(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(0);
    ct_state_t s;
    ct_init(&s);
    save_steps(ck, &s, 3, 3);
    /* a rank owning experts {7, 1} (another round-robin order) */
    float got[2 * 8 * 16];
    int64_t shp[3] = {2, 8, 16};
    moe_tensor_t t;
    TEST_OK(moe_tensor_view(got, MOE_DTYPE_F32, MOE_DEVICE_HOST, 3, shp, &t));
    moe_ckpt_tensor_t e = moe_ckpt_tensor_whole("experts.w", &t);
    e.global_shape[0] = 8, e.global_shape[1] = 8, e.global_shape[2] = 16;
    e.expert_dim = 0;
    int32_t ids[2] = {7, 1};
    e.expert_ids = ids;
    TEST_OK(moe_ckpt_load_step(ck, 3, &e, 1));
    for (int i = 0; i < 128; i++) {
        assert_true(got[i] == s.e[3 * 128 + i]); /* global 7 = local 3 of the saver */
        assert_true(got[128 + i] == s.e[0 * 128 + i]);
    }
    /* contiguous experts [5, 7) hold 5 (saved) and 6 (never saved): not covered */
    e.expert_ids = NULL;
    e.offset[0] = 5;
    assert_int_equal(moe_ckpt_load_step(ck, 3, &e, 1), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "does not hold all of tensor experts.w"));
    /* a tensor-parallel style slice: expert 3, rows 2..5 of dimension 1 */
    float part[1 * 3 * 16];
    int64_t ps[3] = {1, 3, 16};
    TEST_OK(moe_tensor_view(part, MOE_DTYPE_F32, MOE_DEVICE_HOST, 3, ps, &t));
    e = moe_ckpt_tensor_whole("experts.w", &t);
    e.global_shape[0] = 8, e.global_shape[1] = 8, e.global_shape[2] = 16;
    e.offset[0] = 3, e.offset[1] = 2;
    e.expert_dim = 0;
    TEST_OK(moe_ckpt_load_step(ck, 3, &e, 1));
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 16; c++)
            assert_true(part[r * 16 + c] == s.e[1 * 128 + (2 + r) * 16 + c]);
    /* f32 saved, bf16 wanted: converted (round to nearest even) */
    uint16_t a16[CT_A_N];
    int64_t sa[2] = {37, 129};
    TEST_OK(moe_tensor_view(a16, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 2, sa, &t));
    e = moe_ckpt_tensor_whole("dense.a", &t);
    TEST_OK(moe_ckpt_load_step(ck, 3, &e, 1));
    for (int i = 0; i < CT_A_N; i++) {
        uint32_t bits;
        memcpy(&bits, &s.a[i], 4);
        bits += 0x7fffu + ((bits >> 16) & 1u);
        assert_int_equal(a16[i], (uint16_t)(bits >> 16));
    }
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

static void flip_byte(const char *path, off_t at)
{
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char c;
    assert_int_equal(pread(fd, &c, 1, at), 1);
    c ^= 0x10;
    assert_int_equal(pwrite(fd, &c, 1, at), 1);
    close(fd);
}

static void test_flipped_byte_falls_back(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(0);
    ct_state_t s;
    ct_init(&s);
    save_steps(ck, &s, 1, 2);
    char path[512];
    step_file(2, "rank-00000.bin", path, sizeof path);
    flip_byte(path, 20000 + 4096 * 5); /* inside dense.b */
    memset(s.a, 0, CT_A_N * 4);
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &step));
    assert_int_equal(step, 1);
    assert_true(ct_check(&s, 1));
    assert_true(ct_log_has("local step 2 unusable"));
    assert_true(ct_log_has("checksum mismatch"));
    /* the same step explicitly: CORRUPT, not silently another step */
    assert_int_equal(moe_ckpt_load_step(ck, 2, s.t, 3), MOE_STATUS_CORRUPT);
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

static void test_truncated_file_falls_back(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(0);
    ct_state_t s;
    ct_init(&s);
    save_steps(ck, &s, 1, 2);
    char path[512];
    step_file(2, "rank-00000.bin", path, sizeof path);
    assert_int_equal(truncate(path, 100000), 0);
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &step));
    assert_int_equal(step, 1);
    assert_true(ct_check(&s, 1));
    assert_true(ct_log_has("is truncated"));
    /* a missing shard too */
    save_steps(ck, &s, 3, 3);
    step_file(3, "rank-00000.bin", path, sizeof path);
    assert_int_equal(unlink(path), 0);
    TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &step));
    assert_int_equal(step, 1);
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

static void replace_in_file(const char *path, const char *from, const char *to)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char buf[1 << 20], out[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    size_t o = 0;
    for (char *p = buf; *p;) {
        if (!strncmp(p, from, strlen(from))) {
            o += (size_t)sprintf(out + o, "%s", to);
            p += strlen(from);
        } else {
            out[o++] = *p++;
        }
    }
    f = fopen(path, "w");
    fwrite(out, 1, o, f);
    fclose(f);
}

static void test_path_escape_rejected(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(0);
    ct_state_t s;
    ct_init(&s);
    save_steps(ck, &s, 1, 2);
    char path[512];
    step_file(2, "manifest.json", path, sizeof path);
    replace_in_file(path, "\"rank-00000.bin\"", "\"../step-000000000001/rank-00000.bin\"");
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &step));
    assert_int_equal(step, 1);
    assert_true(ct_log_has("is not a plain file name inside the checkpoint directory"));
    /* an absolute path too */
    replace_in_file(path, "\"../step-000000000001/rank-00000.bin\"", "\"/etc/passwd\"");
    assert_int_equal(moe_ckpt_load_step(ck, 2, s.t, 3), MOE_STATUS_CORRUPT);
    assert_non_null(strstr(moe_last_error(), "rejected"));
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

/* A global shape whose element count is past 2^53 (each entry within it): the manifest is
 * corrupt, so the loader falls back to the older step rather than trusting its sizes. */
static void test_oversized_shape_rejected(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(0);
    ct_state_t s;
    ct_init(&s);
    save_steps(ck, &s, 1, 2);
    char path[512];
    step_file(2, "manifest.json", path, sizeof path);
    replace_in_file(path, "\"global_shape\":\t[37, 129]",
                    "\"global_shape\":\t[37, 1125899906842624]");
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &step));
    assert_int_equal(step, 1);
    assert_true(ct_log_has("more than 2^53 elements"));
    assert_int_equal(moe_ckpt_load_step(ck, 2, s.t, 3), MOE_STATUS_CORRUPT);
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

static void test_retention(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(2);
    ct_state_t s;
    ct_init(&s);
    /* an incomplete leftover of a crashed run: swept once newer checkpoints exist */
    char junk[512];
    snprintf(junk, sizeof junk, "%s/step-000000000000", g_dir);
    assert_int_equal(mkdir(junk, 0755), 0);
    save_steps(ck, &s, 1, 5);
    int64_t steps[8];
    int32_t n = 0;
    TEST_OK(moe_ckpt_list(ck, MOE_CKPT_TIER_LOCAL, steps, 8, &n));
    assert_int_equal(n, 2);
    assert_int_equal(steps[0], 4);
    assert_int_equal(steps[1], 5);
    assert_int_not_equal(access(junk, F_OK), 0);
    char path[512];
    snprintf(path, sizeof path, "%s/step-000000000003", g_dir);
    assert_int_not_equal(access(path, F_OK), 0);
    /* capacity smaller than the count: the newest are returned */
    TEST_OK(moe_ckpt_list(ck, MOE_CKPT_TIER_LOCAL, steps, 1, &n));
    assert_int_equal(n, 2);
    assert_int_equal(steps[0], 5);
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

static void test_bad_inputs(void **st)
{
    (void)st;
    ct_state_t s;
    ct_init(&s);
    /* unwritable directory: below a regular file (works as root too) */
    char file[300], bad[400];
    snprintf(file, sizeof file, "%s/plainfile", g_dir);
    FILE *f = fopen(file, "w");
    fclose(f);
    snprintf(bad, sizeof bad, "%s/sub", file);
    moe_ckpt_config_t c = ct_config(bad);
    moe_ckpt_t *ck = NULL;
    assert_int_equal(moe_ckpt_create(g_rt, &c, &ck), MOE_STATUS_IO_ERROR);
    assert_null(ck);
    assert_non_null(strstr(moe_last_error(), "plainfile"));
    /* config errors name the numbers */
    c = ct_config(g_dir);
    c.chunk_bytes = 1000;
    assert_int_equal(moe_ckpt_create(g_rt, &c, &ck), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "1000"));
    c = ct_config(g_dir);
    c.dir = NULL;
    assert_int_equal(moe_ckpt_create(g_rt, &c, &ck), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_ckpt_create(NULL, &c, &ck), MOE_STATUS_INVALID_HANDLE);
    c = ct_config(g_dir);
    c.s3_bucket = "Bad_Bucket";
    assert_int_equal(moe_ckpt_create(g_rt, &c, &ck), MOE_STATUS_INVALID_ARGUMENT);

    ck = open_ck(0);
    int64_t step;
    assert_int_equal(moe_ckpt_load_latest(ck, s.t, 3, &step), MOE_STATUS_NOT_FOUND);
    /* duplicate names */
    moe_ckpt_tensor_t dup[2] = {s.t[0], s.t[0]};
    assert_int_equal(moe_ckpt_save_async(ck, 1, dup, 2), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "dense.a"));
    /* invalid names, NULL data, shards outside the global shape */
    moe_ckpt_tensor_t one = s.t[0];
    one.name = "../evil";
    assert_int_equal(moe_ckpt_save_async(ck, 1, &one, 1), MOE_STATUS_INVALID_ARGUMENT);
    one = s.t[0];
    one.tensor.data = NULL;
    assert_int_equal(moe_ckpt_save_async(ck, 1, &one, 1), MOE_STATUS_INVALID_ARGUMENT);
    one = s.t[0];
    one.global_shape[0] = 37, one.global_shape[1] = 129, one.offset[0] = 1;
    assert_int_equal(moe_ckpt_save_async(ck, 1, &one, 1), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "exceeds global"));
    assert_int_equal(moe_ckpt_save_async(ck, -1, s.t, 3), MOE_STATUS_INVALID_ARGUMENT);
    save_steps(ck, &s, 5, 5);
    assert_int_equal(moe_ckpt_save_async(ck, 5, s.t, 3), MOE_STATUS_INVALID_ARGUMENT);
    /* missing tensor on load: an error naming it, no fallback */
    float extra[4];
    int64_t four = 4;
    moe_tensor_t te;
    TEST_OK(moe_tensor_view(extra, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &four, &te));
    moe_ckpt_tensor_t req[2] = {s.t[0], moe_ckpt_tensor_whole("not.saved", &te)};
    assert_int_equal(moe_ckpt_load_latest(ck, req, 2, &step), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "not.saved"));
    /* mismatched shape */
    float wrong[36 * 129];
    int64_t sw[2] = {36, 129};
    TEST_OK(moe_tensor_view(wrong, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sw, &te));
    req[0] = moe_ckpt_tensor_whole("dense.a", &te);
    assert_int_equal(moe_ckpt_load_latest(ck, req, 1, &step), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "[36,129]"));
    assert_non_null(strstr(moe_last_error(), "[37,129]"));
    /* handles */
    assert_int_equal(moe_ckpt_poll(NULL, 0), MOE_STATUS_INVALID_HANDLE);
    assert_int_equal(moe_ckpt_destroy(NULL), MOE_STATUS_SUCCESS);
    TEST_OK(moe_ckpt_destroy(ck));
    moe_ckpt_abort(NULL);
    ct_free(&s);
}

static void test_disk_full(void **st)
{
    (void)st;
    char mnt[300];
    snprintf(mnt, sizeof mnt, "%s/small", g_dir);
    assert_int_equal(mkdir(mnt, 0755), 0);
    if (mount("tmpfs", mnt, "tmpfs", 0, "size=300k") != 0) {
        print_message("cannot mount a small tmpfs here (not root?): disk-full test skipped\n");
        skip();
    }
    moe_ckpt_config_t c = ct_config(mnt);
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck));
    ct_state_t s;
    ct_init(&s);
    ct_fill(&s, 1);
    TEST_OK(moe_ckpt_save_async(ck, 1, s.t, 3)); /* 460 KB into 300 KiB */
    moe_status_t r = moe_ckpt_wait(ck, 1, 60000);
    assert_int_equal(r, MOE_STATUS_IO_ERROR);
    assert_non_null(strstr(moe_last_error(), "No space left on device"));
    int64_t step;
    assert_int_equal(moe_ckpt_load_latest(ck, s.t, 3, &step), MOE_STATUS_NOT_FOUND);
    char tmp[400];
    snprintf(tmp, sizeof tmp, "%s/step-000000000001/rank-00000.bin.tmp", mnt);
    assert_int_not_equal(access(tmp, F_OK), 0); /* the temporary is removed */
    TEST_OK(moe_ckpt_destroy(ck));
    umount(mnt);
    ct_free(&s);
}

static void test_poll_and_abort(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(0);
    ct_state_t s;
    ct_init(&s);
    ct_fill(&s, 1);
    TEST_OK(moe_ckpt_save_async(ck, 1, s.t, 3));
    moe_status_t p = moe_ckpt_poll(ck, 1);
    assert_true(p == MOE_STATUS_IN_PROGRESS || p == MOE_STATUS_SUCCESS);
    TEST_OK(moe_ckpt_wait(ck, 1, -1));
    assert_int_equal(moe_ckpt_poll(ck, 1), MOE_STATUS_SUCCESS);
    char msg[64];
    assert_int_equal(moe_ckpt_get_async_error(ck, msg, sizeof msg), MOE_STATUS_SUCCESS);
    ct_fill(&s, 2);
    TEST_OK(moe_ckpt_save_async(ck, 2, s.t, 3));
    moe_ckpt_abort(ck); /* step 2 may or may not have committed; 1 must stay loadable */
    ck = open_ck(0);
    int64_t step;
    TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &step));
    assert_true(step == 1 || step == 2);
    assert_true(ct_check(&s, step));
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
}

/* Every `rank-<R>.<ext>` the public header names is a file a save writes, the header names
 * the thread level libmoe initialises MPI with (the checkpointer calls MPI on the calling
 * thread only), and no stronger one. */
static void test_header_matches_the_code(void **st)
{
    (void)st;
    moe_ckpt_t *ck = open_ck(0);
    ct_state_t s;
    ct_init(&s);
    save_steps(ck, &s, 1, 1);
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&s);
    char dir[400];
    snprintf(dir, sizeof dir, "%s/step-000000000001", g_dir);
    FILE *f = fopen(MOE_CKPT_HEADER, "r");
    assert_non_null(f);
    static char h[1 << 16];
    size_t n = fread(h, 1, sizeof h - 1, f);
    fclose(f);
    h[n] = 0;
    int named = 0;
    for (const char *p = h; (p = strstr(p, "`rank-<R>.")) != NULL; p++) {
        char ext[16] = "";
        sscanf(p + 10, "%15[a-z]", ext);
        bool found = false;
        DIR *d = opendir(dir);
        assert_non_null(d);
        for (struct dirent *e; (e = readdir(d)) != NULL;) {
            const char *dot = strrchr(e->d_name, '.');
            if (!strncmp(e->d_name, "rank-", 5) && dot && !strcmp(dot + 1, ext)) found = true;
        }
        closedir(d);
        if (!found)
            fail_msg("include/moe/ckpt.h names rank-<R>.%s, which a save never writes", ext);
        named++;
    }
    assert_true(named >= 1);
    assert_non_null(strstr(h, "MPI_THREAD_SERIALIZED"));
    assert_null(strstr(h, "MPI_THREAD_MULTIPLE"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_round_trip_pwrite, setup, teardown),
        cmocka_unit_test_setup_teardown(test_round_trip_buffered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reshard_experts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_flipped_byte_falls_back, setup, teardown),
        cmocka_unit_test_setup_teardown(test_truncated_file_falls_back, setup, teardown),
        cmocka_unit_test_setup_teardown(test_path_escape_rejected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_oversized_shape_rejected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retention, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_inputs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_disk_full, setup, teardown),
        cmocka_unit_test_setup_teardown(test_poll_and_abort, setup, teardown),
        cmocka_unit_test_setup_teardown(test_header_matches_the_code, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
