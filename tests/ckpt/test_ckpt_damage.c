/* Damaged and crafted checkpoints: damage is CORRUPT and falls back to the intact older step,
 * INVALID_ARGUMENT stays for the caller's request, and no manifest loads wrong data.
 *
 * The state (host backend, 64 KiB chunks), saved as steps 1 and 2 (values a function of the
 * step, checked bitwise):
 *   "opt/m", "opt/v"  f32 [1000] each           equal sizes, so their pieces can be swapped
 *   "experts.w"       f32 [4, 8] of global [8, 8], local experts = global ids 1, 3, 5, 7
 *                     (round-robin): 4 pieces, slice_start[0] = 1, 3, 5, 7
 * Edits of step 2's manifest, each on a fresh copy of the original (issue 32's items):
 *   - 5: a renamed tensor, a changed shape, a changed expert slice, and random single-byte
 *     damages (1000): load_latest gives step 1 (or step 2 where the byte did not matter), never
 *     INVALID_ARGUMENT, always the step's exact values; a duplicate piece with another
 *     global shape, before or after the original;
 *   - 6: a copy of opt/v's piece renamed opt/m (before or after opt/m's own), the offsets and
 *     checksums of opt/m and opt/v swapped, two expert slice_starts swapped;
 *   - 7: manifest.json or a data file as a FIFO (the load must not block);
 *   - 8: "checksum" or "library_version" missing, a checksum name other than xxh3_64, an
 *     offset off the 4096 grid (its checksum recomputed), a \u0000 inside a file name, an
 *     unpadded step directory "step-4" (listed, and loadable).
 *   - 43: one piece's entry deleted (opt/v's, or one expert slice of experts.w), and the
 *     "piece_count" that would show it deleted too: CORRUPT and a fallback, where it used to
 *     read as a request for a tensor never saved (INVALID_ARGUMENT, no fallback).
 * Where an edit could only be caught by the binding, the test re-binds the edited piece by
 * the spec's rule (docs/checkpoint-format.md), so the loader's own check must catch it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>
#include <xxhash.h>

#include "ckpt_common.h"

#define N_OPT 1000

static char g_dir[256];
static moe_runtime_t *g_rt;
static float g_m[N_OPT], g_v[N_OPT], g_w[4 * 8];
static const int32_t g_ids[4] = {1, 3, 5, 7};
static moe_ckpt_tensor_t g_t[3];

static float val(int64_t step, int t, int i)
{
    return ct_f32(ct_hash((uint64_t)step, (uint64_t)t, (uint64_t)i));
}

static void fill(int64_t step)
{
    for (int i = 0; i < N_OPT; i++) g_m[i] = val(step, 0, i), g_v[i] = val(step, 1, i);
    for (int i = 0; i < 32; i++) g_w[i] = val(step, 2, i);
}

static bool check(int64_t step)
{
    for (int i = 0; i < N_OPT; i++)
        if (g_m[i] != val(step, 0, i) || g_v[i] != val(step, 1, i)) return false;
    for (int i = 0; i < 32; i++)
        if (g_w[i] != val(step, 2, i)) return false;
    return true;
}

static void clear(void)
{
    memset(g_m, 0, sizeof g_m);
    memset(g_v, 0, sizeof g_v);
    memset(g_w, 0, sizeof g_w);
}

static moe_ckpt_t *g_ck;
static char *g_orig; /* step 2's manifest as written */

static void path_of(int64_t step, const char *file, char *buf, size_t n)
{
    snprintf(buf, n, "%s/step-%012" PRId64 "/%s", g_dir, step, file);
}

static char *read_text(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = 0;
    fclose(f);
    if (len) *len = (size_t)n;
    return s;
}

static void write_text(const char *path, const char *s, size_t len)
{
    unlink(path); /* it may be a FIFO */
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(s, 1, len, f), len);
    fclose(f);
}

static void restore_manifest(void)
{
    char p[400];
    path_of(2, "manifest.json", p, sizeof p);
    write_text(p, g_orig, strlen(g_orig));
}

static int setup(void **st)
{
    (void)st;
    ct_up(g_dir, sizeof g_dir, "damage", &g_rt);
    int64_t n = N_OPT, sw[2] = {4, 8};
    moe_tensor_t tm, tv, tw;
    TEST_OK(moe_tensor_view(g_m, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &n, &tm));
    TEST_OK(moe_tensor_view(g_v, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &n, &tv));
    TEST_OK(moe_tensor_view(g_w, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sw, &tw));
    g_t[0] = moe_ckpt_tensor_whole("opt/m", &tm);
    g_t[1] = moe_ckpt_tensor_whole("opt/v", &tv);
    g_t[2] = moe_ckpt_tensor_whole("experts.w", &tw);
    g_t[2].global_shape[0] = 8, g_t[2].global_shape[1] = 8;
    g_t[2].expert_dim = 0;
    g_t[2].expert_ids = g_ids;
    moe_ckpt_config_t c = ct_config(g_dir);
    TEST_OK(moe_ckpt_create(g_rt, &c, &g_ck));
    for (int64_t step = 1; step <= 2; step++) {
        fill(step);
        TEST_OK(moe_ckpt_save_async(g_ck, step, g_t, 3));
        TEST_OK(moe_ckpt_wait(g_ck, 1, 60000));
    }
    char p[400];
    path_of(2, "manifest.json", p, sizeof p);
    g_orig = read_text(p, NULL);
    return 0;
}

static int teardown(void **st)
{
    (void)st;
    TEST_OK(moe_ckpt_destroy(g_ck));
    free(g_orig);
    ct_down(g_dir, g_rt);
    return 0;
}

/* load_latest after an edit of step 2: never INVALID_ARGUMENT, never wrong data; returns the
 * step loaded. */
static int64_t load_latest_checked(void)
{
    clear();
    int64_t step = -1;
    moe_status_t r = moe_ckpt_load_latest(g_ck, g_t, 3, &step);
    if (r != MOE_STATUS_SUCCESS)
        fail_msg("load_latest: %s (%s)", moe_status_string(r), moe_last_error());
    if (!check(step)) fail_msg("load_latest returned step %lld with other values", (long long)step);
    return step;
}

/* The edited step 2 is refused as CORRUPT (a fallback to step 1), with `why` in the log. */
static void expect_fallback(const char *why)
{
    ct_log_clear();
    assert_int_equal(load_latest_checked(), 1);
    if (why && !ct_log_has(why)) fail_msg("the log does not say \"%s\":\n%s", why, ct_log_buf.text);
    clear();
    moe_status_t r = moe_ckpt_load_step(g_ck, 2, g_t, 3);
    if (r != MOE_STATUS_CORRUPT)
        fail_msg("load_step(2): %s (%s)", moe_status_string(r), moe_last_error());
    restore_manifest();
}

static void replace_once(const char *from, const char *to)
{
    const char *at = strstr(g_orig, from);
    if (!at) fail_msg("\"%s\" is not in the manifest", from);
    size_t n = strlen(g_orig) + strlen(to) + 1;
    char *s = malloc(n);
    snprintf(s, n, "%.*s%s%s", (int)(at - g_orig), g_orig, to, at + strlen(from));
    char p[400];
    path_of(2, "manifest.json", p, sizeof p);
    write_text(p, s, strlen(s));
    free(s);
}

/* ---- cJSON edits, and the spec's binding --------------------------------------------------- */

static cJSON *manifest_json(void) { return cJSON_Parse(g_orig); }

static void write_json(cJSON *m)
{
    char *s = cJSON_Print(m);
    char p[400];
    path_of(2, "manifest.json", p, sizeof p);
    write_text(p, s, strlen(s));
    free(s);
    cJSON_Delete(m);
}

static cJSON *piece(cJSON *m, const char *name, int k)
{
    cJSON *x;
    cJSON_ArrayForEach(
        x, cJSON_GetObjectItem(
               m, "tensors")) if (!strcmp(cJSON_GetObjectItem(x, "name")->valuestring, name) &&
                                  k-- == 0) return x;
    fail_msg("no piece %d of %s", k, name);
    return NULL;
}

static void cat_ints(char *buf, size_t n, const cJSON *a)
{
    const cJSON *x;
    size_t l = strlen(buf);
    int i = 0;
    cJSON_ArrayForEach(x, a)
        l += (size_t)snprintf(buf + l, n - l, "%s%.0f", i++ ? "," : "", x->valuedouble);
    snprintf(buf + l, n - l, "|");
}

/* docs/checkpoint-format.md: binding_xxh3_64 = XXH3-64 of "<step>|<chunk_bytes>|<name>|
 * <dtype>|<global_shape>|<slice_start>|<slice_shape>|<file>|<offset>|<length>|<xxh3_64>" */
static void rebind(const cJSON *m, cJSON *p)
{
    char t[8192];
    snprintf(t, sizeof t, "%.0f|%.0f|%s|%s|", cJSON_GetObjectItem(m, "step")->valuedouble,
             cJSON_GetObjectItem(m, "chunk_bytes")->valuedouble,
             cJSON_GetObjectItem(p, "name")->valuestring,
             cJSON_GetObjectItem(p, "dtype")->valuestring);
    cat_ints(t, sizeof t, cJSON_GetObjectItem(p, "global_shape"));
    cat_ints(t, sizeof t, cJSON_GetObjectItem(p, "slice_start"));
    cat_ints(t, sizeof t, cJSON_GetObjectItem(p, "slice_shape"));
    size_t l = strlen(t);
    l += (size_t)snprintf(t + l, sizeof t - l, "%s|%.0f|%.0f|",
                          cJSON_GetObjectItem(p, "file")->valuestring,
                          cJSON_GetObjectItem(p, "offset")->valuedouble,
                          cJSON_GetObjectItem(p, "length")->valuedouble);
    const cJSON *h;
    int i = 0;
    cJSON_ArrayForEach(h, cJSON_GetObjectItem(p, "xxh3_64"))
        l += (size_t)snprintf(t + l, sizeof t - l, "%s%s", i++ ? "," : "", h->valuestring);
    char hex[17];
    snprintf(hex, sizeof hex, "%016" PRIx64, (uint64_t)XXH3_64bits(t, l));
    cJSON_DeleteItemFromObject(p, "binding_xxh3_64");
    cJSON_AddStringToObject(p, "binding_xxh3_64", hex);
}

static void swap_items(cJSON *a, cJSON *b, const char *key)
{
    cJSON *x = cJSON_DetachItemFromObject(a, key), *y = cJSON_DetachItemFromObject(b, key);
    cJSON_AddItemToObject(a, key, y);
    cJSON_AddItemToObject(b, key, x);
}

/* ---- the tests ----------------------------------------------------------------------------- */

/* The binding written is the spec's, so a reader in another language can check it. */
static void test_binding_follows_the_spec(void **st)
{
    (void)st;
    cJSON *m = manifest_json();
    cJSON *x;
    int n = 0;
    cJSON_ArrayForEach(x, cJSON_GetObjectItem(m, "tensors"))
    {
        char was[17];
        const cJSON *b = cJSON_GetObjectItem(x, "binding_xxh3_64");
        assert_true(cJSON_IsString(b));
        snprintf(was, sizeof was, "%s", b->valuestring);
        rebind(m, x);
        assert_string_equal(cJSON_GetObjectItem(x, "binding_xxh3_64")->valuestring, was);
        n++;
    }
    assert_int_equal(n, 6);
    cJSON_Delete(m);
    assert_int_equal(load_latest_checked(), 2);
}

/* Issue item 5: damage to a name, a shape or an expert slice used to give INVALID_ARGUMENT. */
static void test_damage_is_corrupt(void **st)
{
    (void)st;
    replace_once("\"opt/m\"", "\"opt/n\"");
    expect_fallback("does not match its binding");
    replace_once("\"global_shape\":\t[1000]", "\"global_shape\":\t[1001]");
    expect_fallback(NULL);
    replace_once("\"slice_start\":\t[5, 0]", "\"slice_start\":\t[4, 0]");
    expect_fallback("does not match its binding");
    /* a request for a tensor that is not saved is still the caller's error */
    float x[4];
    int64_t four = 4;
    moe_tensor_t tx;
    TEST_OK(moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &four, &tx));
    moe_ckpt_tensor_t req = moe_ckpt_tensor_whole("opt/other", &tx);
    int64_t step;
    assert_int_equal(moe_ckpt_load_latest(g_ck, &req, 1, &step), MOE_STATUS_INVALID_ARGUMENT);
}

static void test_random_single_byte_damage(void **st)
{
    (void)st;
    test_rng_t rng = {test_seed()};
    size_t len = strlen(g_orig);
    char *s = malloc(len + 1);
    char p[400];
    path_of(2, "manifest.json", p, sizeof p);
    int fell_back = 0, trials = 1000;
    for (int i = 0; i < trials; i++) {
        memcpy(s, g_orig, len + 1);
        size_t at = (size_t)test_rng_int(&rng, 0, (int64_t)len - 1);
        unsigned char was = (unsigned char)s[at], now;
        do now = (unsigned char)test_rng_int(&rng, 0, 255);
        while (now == was);
        s[at] = (char)now;
        write_text(p, s, len);
        clear();
        int64_t step = -1;
        moe_status_t r = moe_ckpt_load_latest(g_ck, g_t, 3, &step);
        if (r != MOE_STATUS_SUCCESS || !check(step))
            fail_msg("byte %zu 0x%02x -> 0x%02x: %s, step %lld (%s)", at, was, now,
                     moe_status_string(r), (long long)step, moe_last_error());
        fell_back += step == 1;
    }
    print_message("%d of %d single-byte damages fell back to step 1, the others loaded step 2 "
                  "exactly\n",
                  fell_back, trials);
    free(s);
    restore_manifest();
}

/* Issue items 5 and 6, with every edited piece re-bound and the piece count raised to match:
 * only the loader's checks of the pieces themselves remain. */
static void insert_piece(cJSON *m, cJSON *p, int order)
{
    rebind(m, p);
    cJSON *tensors = cJSON_GetObjectItem(m, "tensors");
    if (order == 0)
        cJSON_InsertItemInArray(tensors, 0, p);
    else
        cJSON_AddItemToArray(tensors, p);
    cJSON_ReplaceItemInObject(m, "piece_count", cJSON_CreateNumber(cJSON_GetArraySize(tensors)));
}

/* a copy of opt/v's piece renamed opt/m, before or after opt/m's own */
static void test_overlapping_copy_detected(void **st)
{
    (void)st;
    for (int order = 0; order < 2; order++) {
        cJSON *m = manifest_json();
        cJSON *copy = cJSON_Duplicate(piece(m, "opt/v", 0), 1);
        cJSON_ReplaceItemInObject(copy, "name", cJSON_CreateString("opt/m"));
        insert_piece(m, copy, order);
        write_json(m);
        expect_fallback("overlapping pieces of tensor opt/m hold different values");
    }
}

/* a duplicate of opt/m's piece with another global shape, before or after */
static void test_conflicting_duplicate_detected(void **st)
{
    (void)st;
    for (int order = 0; order < 2; order++) {
        cJSON *m = manifest_json();
        cJSON *copy = cJSON_Duplicate(piece(m, "opt/m", 0), 1);
        cJSON_ReplaceItemInObject(copy, "global_shape", cJSON_CreateIntArray((int[]){2000}, 1));
        insert_piece(m, copy, order);
        write_json(m);
        expect_fallback("disagree on its dtype or global shape");
    }
}

/* Issue item 8: opt/v's piece 4 bytes further into the file, its checksum that of the bytes
 * there, re-bound */
static void test_offset_off_the_grid(void **st)
{
    (void)st;
    cJSON *m = manifest_json();
    cJSON *pv = piece(m, "opt/v", 0);
    double off = cJSON_GetObjectItem(pv, "offset")->valuedouble + 4;
    char data[400];
    path_of(2, "rank-00000.bin", data, sizeof data);
    size_t flen;
    char *bytes = read_text(data, &flen);
    char hex[17];
    snprintf(hex, sizeof hex, "%016" PRIx64, (uint64_t)XXH3_64bits(bytes + (size_t)off, N_OPT * 4));
    free(bytes);
    cJSON_ReplaceItemInObject(pv, "offset", cJSON_CreateNumber(off));
    cJSON_ReplaceItemInObject(pv, "xxh3_64", cJSON_CreateStringArray((const char *[]){hex}, 1));
    rebind(m, pv);
    write_json(m);
    expect_fallback("is not a multiple of 4096");
}

/* Issue item 6: edits that keep every data checksum consistent but were made to the pieces
 * only (their bindings as written). */
static void test_swapped_pieces_detected(void **st)
{
    (void)st;
    cJSON *m = manifest_json();
    cJSON *a = piece(m, "opt/m", 0), *b = piece(m, "opt/v", 0);
    swap_items(a, b, "offset");
    swap_items(a, b, "xxh3_64");
    write_json(m);
    expect_fallback("does not match its binding");
    m = manifest_json();
    swap_items(piece(m, "experts.w", 0), piece(m, "experts.w", 1), "slice_start");
    write_json(m);
    expect_fallback("does not match its binding");
}

/* Issue 43: a manifest counts its pieces, so a deleted entry is damage (a fallback), while a
 * tensor never saved is still the request's error (test_damage_is_corrupt). */
static void test_deleted_piece_is_corrupt(void **st)
{
    (void)st;
    const char *victims[2] = {"opt/v", "experts.w"};
    for (int v = 0; v < 2; v++) {
        cJSON *m = manifest_json();
        cJSON *tensors = cJSON_GetObjectItem(m, "tensors"), *x;
        int i = 0;
        cJSON_ArrayForEach(x, tensors)
        {
            if (!strcmp(cJSON_GetObjectItem(x, "name")->valuestring, victims[v])) break;
            i++;
        }
        cJSON_DeleteItemFromArray(tensors, i);
        write_json(m);
        expect_fallback("a piece entry was removed or added");
    }
    cJSON *m = manifest_json();
    cJSON_DeleteItemFromArray(cJSON_GetObjectItem(m, "tensors"), 1);
    cJSON_DeleteItemFromObject(m, "piece_count");
    write_json(m);
    expect_fallback("\"piece_count\" is missing");
}

/* Issue item 8: the spec's required keys and value rules. */
static void test_required_keys(void **st)
{
    (void)st;
    cJSON *m = manifest_json();
    cJSON_DeleteItemFromObject(m, "checksum");
    write_json(m);
    expect_fallback("\"checksum\" is missing");
    m = manifest_json();
    cJSON_DeleteItemFromObject(m, "library_version");
    write_json(m);
    expect_fallback("\"library_version\" (a string) is missing");
}

static void test_unknown_checksum_name(void **st)
{
    (void)st;
    cJSON *m = manifest_json();
    cJSON_ReplaceItemInObject(m, "checksum", cJSON_CreateString("sha1"));
    write_json(m);
    expect_fallback("this library knows \"xxh3_64\"");
}

/* a NUL escaped inside the data file's name, in "files" and in every piece */
static void test_nul_in_a_file_name(void **st)
{
    (void)st;
    char p[400];
    path_of(2, "manifest.json", p, sizeof p);
    size_t n = strlen(g_orig) * 2 + 1, o = 0;
    char *out = malloc(n);
    for (const char *q = g_orig; *q;) {
        if (!strncmp(q, "\"rank-00000.bin\"", 16)) {
            o += (size_t)snprintf(out + o, n - o, "\"rank-00000.bin\\u0000.evil\"");
            q += 16;
        } else {
            out[o++] = *q++;
        }
    }
    write_text(p, out, o);
    free(out);
    expect_fallback("contains a NUL character");
}

static void test_fifo_does_not_block(void **st)
{
    (void)st;
    alarm(60); /* a blocking open would hang here: SIGALRM ends the test as failed */
    char p[400];
    path_of(2, "manifest.json", p, sizeof p);
    unlink(p);
    assert_int_equal(mkfifo(p, 0644), 0);
    expect_fallback("is not a regular file");
    char d[400], keep[420];
    path_of(2, "rank-00000.bin", d, sizeof d);
    snprintf(keep, sizeof keep, "%s.keep", d);
    assert_int_equal(rename(d, keep), 0);
    assert_int_equal(mkfifo(d, 0644), 0);
    expect_fallback("is not a regular file");
    unlink(d);
    assert_int_equal(rename(keep, d), 0);
    assert_int_equal(load_latest_checked(), 2);
    alarm(0);
}

/* Issue item 8: readers parse the number; "step-4" is a checkpoint of step 4. */
static void test_unpadded_step_directory(void **st)
{
    (void)st;
    fill(4);
    TEST_OK(moe_ckpt_save_async(g_ck, 4, g_t, 3));
    TEST_OK(moe_ckpt_wait(g_ck, 1, 60000));
    char from[400], to[400];
    snprintf(from, sizeof from, "%s/step-000000000004", g_dir);
    snprintf(to, sizeof to, "%s/step-4", g_dir);
    assert_int_equal(rename(from, to), 0);
    int64_t steps[8];
    int32_t n;
    TEST_OK(moe_ckpt_list(g_ck, MOE_CKPT_TIER_LOCAL, steps, 8, &n));
    assert_int_equal(n, 3);
    assert_int_equal(steps[2], 4);
    clear();
    TEST_OK(moe_ckpt_load_step(g_ck, 4, g_t, 3));
    assert_true(check(4));
    assert_int_equal(load_latest_checked(), 4);
}

/* Steps a load passed over are set aside under a hidden name (moe_ckpt_set_aside_newer):
 * listed and loaded no more, kept on disk, and a later run saves those steps again, which it
 * could not while they were in place. Step 3 is written unpadded ("step-3"). */
static void test_damaged_steps_set_aside(void **st)
{
    (void)st;
    fill(3);
    TEST_OK(moe_ckpt_save_async(g_ck, 3, g_t, 3));
    TEST_OK(moe_ckpt_wait(g_ck, 1, 60000));
    char from[400], to[400];
    snprintf(from, sizeof from, "%s/step-000000000003", g_dir);
    snprintf(to, sizeof to, "%s/step-3", g_dir);
    assert_int_equal(rename(from, to), 0);
    snprintf(to, sizeof to, "%s/step-3/manifest.json", g_dir);
    write_text(to, "{}", 2);
    replace_once("\"opt/m\"", "\"opt/n\"");
    assert_int_equal(load_latest_checked(), 1);
    /* a new run (its own checkpointer) cannot save step 2 over the bad copy */
    TEST_OK(moe_ckpt_destroy(g_ck));
    moe_ckpt_config_t c = ct_config(g_dir);
    c.keep_last = 0;
    TEST_OK(moe_ckpt_create(g_rt, &c, &g_ck));
    fill(2);
    assert_int_equal(moe_ckpt_save_async(g_ck, 2, g_t, 3), MOE_STATUS_INVALID_ARGUMENT);

    ct_log_clear();
    int32_t n = -1;
    TEST_OK(moe_ckpt_set_aside_newer(g_ck, 1, &n));
    assert_int_equal(n, 2);
    if (!ct_log_has("step 2 set aside as") || !ct_log_has("step 3 set aside as"))
        fail_msg("the log does not name the steps set aside:\n%s", ct_log_buf.text);
    int64_t steps[8];
    int32_t count;
    TEST_OK(moe_ckpt_list(g_ck, MOE_CKPT_TIER_LOCAL, steps, 8, &count));
    assert_int_equal(count, 1);
    assert_int_equal(steps[0], 1);
    TEST_OK(moe_ckpt_set_aside_newer(g_ck, 1, &n)); /* nothing newer left */
    assert_int_equal(n, 0);
    /* both kept, each with its manifest, under .rejected-step-<N>-<time> */
    int found[4] = {0};
    DIR *d = opendir(g_dir);
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        long long k = -1;
        if (sscanf(e->d_name, ".rejected-step-%lld-", &k) != 1 || k < 0 || k > 3) continue;
        char kept[700];
        snprintf(kept, sizeof kept, "%s/%s/manifest.json", g_dir, e->d_name);
        if (access(kept, F_OK) == 0) found[k]++;
    }
    closedir(d);
    assert_int_equal(found[2], 1);
    assert_int_equal(found[3], 1);

    TEST_OK(moe_ckpt_save_async(g_ck, 2, g_t, 3));
    TEST_OK(moe_ckpt_wait(g_ck, 1, 60000));
    assert_int_equal(load_latest_checked(), 2);

    assert_int_equal(moe_ckpt_set_aside_newer(g_ck, -2, &n), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_ckpt_set_aside_newer(NULL, 1, &n), MOE_STATUS_INVALID_HANDLE);
    TEST_OK(moe_ckpt_set_aside_newer(g_ck, -1, NULL)); /* every step, count not wanted */
    TEST_OK(moe_ckpt_list(g_ck, MOE_CKPT_TIER_LOCAL, steps, 8, &count));
    assert_int_equal(count, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_binding_follows_the_spec, setup, teardown),
        cmocka_unit_test_setup_teardown(test_damage_is_corrupt, setup, teardown),
        cmocka_unit_test_setup_teardown(test_random_single_byte_damage, setup, teardown),
        cmocka_unit_test_setup_teardown(test_overlapping_copy_detected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_conflicting_duplicate_detected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_swapped_pieces_detected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_offset_off_the_grid, setup, teardown),
        cmocka_unit_test_setup_teardown(test_required_keys, setup, teardown),
        cmocka_unit_test_setup_teardown(test_deleted_piece_is_corrupt, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_checksum_name, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nul_in_a_file_name, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fifo_does_not_block, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unpadded_step_directory, setup, teardown),
        cmocka_unit_test_setup_teardown(test_damaged_steps_set_aside, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
