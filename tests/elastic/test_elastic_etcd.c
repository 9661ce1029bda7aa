/*
 * The etcd client (src/elastic/etcd.h) and a rank's membership (moe/elastic.h) against a real
 * etcd started here on free loopback ports, its data in a temporary folder removed at the end
 * (tools/elastic/etcd_server.h). Skipped (77) when no etcd is installed (Debian: etcd-server).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <moe/elastic.h>

#include "elastic/etcd.h"
#include "etcd_server.h"
#include "proc.h"

static etcd_server_t server;
static el_etcd_t *etcd;

static char *get(const char *key)
{
    el_kv_t *kvs;
    size_t n;
    assert_int_equal(el_etcd_range_prefix(etcd, key, &kvs, &n), MOE_STATUS_SUCCESS);
    char *v = NULL;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(kvs[i].key, key)) v = strdup(kvs[i].value);
    el_kvs_free(kvs, n);
    return v;
}

/* keys and values with every padding length of base64, a prefix range, deletion */
static void test_put_range_delete(void **state)
{
    (void)state;
    const char *vals[] = {"", "a", "ab", "abc", "{\"x\": \"\xc3\xa9\"}"};
    char key[64];
    for (int i = 0; i < 5; i++) {
        snprintf(key, sizeof key, "/t/kv/%d", i);
        assert_int_equal(el_etcd_put(etcd, key, vals[i], 0), MOE_STATUS_SUCCESS);
    }
    assert_int_equal(el_etcd_put(etcd, "/t/kw", "outside the prefix", 0), MOE_STATUS_SUCCESS);
    el_kv_t *kvs;
    size_t n;
    assert_int_equal(el_etcd_range_prefix(etcd, "/t/kv/", &kvs, &n), MOE_STATUS_SUCCESS);
    assert_int_equal(n, 5);
    for (int i = 0; i < 5; i++) {
        snprintf(key, sizeof key, "/t/kv/%d", i);
        assert_string_equal(kvs[i].key, key);
        assert_string_equal(kvs[i].value, vals[i]);
        assert_true(kvs[i].mod_revision > 0);
        if (i) assert_true(kvs[i].mod_revision > kvs[i - 1].mod_revision);
    }
    el_kvs_free(kvs, n);
    int64_t deleted = 0;
    assert_int_equal(el_etcd_delete_prefix(etcd, "/t/kv/", &deleted), MOE_STATUS_SUCCESS);
    assert_int_equal(deleted, 5);
    assert_int_equal(el_etcd_range_prefix(etcd, "/t/kv/", &kvs, &n), MOE_STATUS_SUCCESS);
    assert_int_equal(n, 0);
    char *kw = get("/t/kw");
    assert_string_equal(kw, "outside the prefix");
    free(kw);
}

/* a lease kept alive holds its key; revoked, the key goes; revoking again is no error */
static void test_lease_revoke(void **state)
{
    (void)state;
    int64_t id, ttl;
    assert_int_equal(el_etcd_lease_grant(etcd, 2, &id, &ttl), MOE_STATUS_SUCCESS);
    assert_true(ttl >= 2);
    assert_int_equal(el_etcd_put(etcd, "/t/lease/a", "held", id), MOE_STATUS_SUCCESS);
    for (int i = 0; i < 4; i++) { /* 3 s: past the TTL, renewed every 0.75 s */
        usleep(750 * 1000);
        assert_int_equal(el_etcd_lease_keepalive(etcd, id), MOE_STATUS_SUCCESS);
    }
    char *v = get("/t/lease/a");
    assert_non_null(v);
    free(v);
    assert_int_equal(el_etcd_lease_revoke(etcd, id), MOE_STATUS_SUCCESS);
    assert_null(get("/t/lease/a"));
    assert_int_equal(el_etcd_lease_revoke(etcd, id), MOE_STATUS_SUCCESS);
    assert_int_equal(el_etcd_lease_keepalive(etcd, id), MOE_STATUS_NOT_FOUND);
}

/* a lease nobody renews expires within its TTL (+ etcd's expiry check) and takes its key */
static void test_lease_expires(void **state)
{
    (void)state;
    int64_t id, ttl;
    assert_int_equal(el_etcd_lease_grant(etcd, 2, &id, &ttl), MOE_STATUS_SUCCESS);
    assert_int_equal(el_etcd_put(etcd, "/t/lease/b", "abandoned", id), MOE_STATUS_SUCCESS);
    double t0 = proc_now();
    char *v;
    while ((v = get("/t/lease/b")) && proc_now() - t0 < 10) {
        free(v);
        usleep(50 * 1000);
    }
    assert_null(v);
    double gone = proc_now() - t0;
    printf("  lease of TTL %lld s expired after %.2f s\n", (long long)ttl, gone);
    assert_true(gone >= 1.0 && gone <= ttl + 1.5);
    assert_int_equal(el_etcd_lease_keepalive(etcd, id), MOE_STATUS_NOT_FOUND);
}

/* bad arguments and an endpoint where nobody listens are statuses with messages */
static void test_errors(void **state)
{
    (void)state;
    el_etcd_t *e = NULL;
    assert_int_equal(el_etcd_create("127.0.0.1:2379", 1000, &e), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "http://"));
    assert_int_equal(el_etcd_create("http://127.0.0.1:1", 500, &e), MOE_STATUS_SUCCESS);
    assert_int_equal(el_etcd_put(e, "/k", "v", 0), MOE_STATUS_REMOTE_ERROR);
    assert_non_null(strstr(moe_last_error(), "127.0.0.1:1"));
    el_etcd_destroy(e);
    assert_int_equal(el_etcd_lease_grant(etcd, 0, &(int64_t){0}, NULL),
                     MOE_STATUS_INVALID_ARGUMENT);
    /* a put on a lease that does not exist: etcd's own message */
    assert_int_equal(el_etcd_put(etcd, "/t/x", "v", 12345), MOE_STATUS_NOT_FOUND);
    assert_non_null(strstr(moe_last_error(), "lease not found"));
}

/* a member: registered with its lease, progress written by its thread, an exit record that
 * outlives it, its key gone when it leaves */
static void test_member(void **state)
{
    (void)state;
    moe_elastic_member_config_t c = moe_elastic_member_config_default();
    c.endpoint = server.endpoint;
    c.prefix = "/t/job/inc/0";
    c.slot = 5;
    c.rank = 1;
    c.ttl_ms = 2000;
    moe_elastic_member_t *m;
    assert_int_equal(moe_elastic_member_create(&c, &m), MOE_STATUS_SUCCESS);
    char *v = get("/t/job/inc/0/member/5");
    assert_non_null(v);
    assert_non_null(strstr(v, "\"phase\":\"started\""));
    assert_non_null(strstr(v, "\"rank\":1"));
    free(v);
    assert_int_equal(moe_elastic_member_report(m, MOE_ELASTIC_PHASE_RESUMED, 30),
                     MOE_STATUS_SUCCESS);
    assert_int_equal(moe_elastic_member_report(m, MOE_ELASTIC_PHASE_TRAINING, 31),
                     MOE_STATUS_SUCCESS);
    double t0 = proc_now();
    bool seen = false;
    while (!seen && proc_now() - t0 < 5) {
        v = get("/t/job/inc/0/member/5");
        seen = v && strstr(v, "\"step\":31") && strstr(v, "\"resumed_step\":30");
        free(v);
        usleep(20 * 1000);
    }
    assert_true(seen);
    usleep(3000 * 1000); /* past the TTL: the thread keeps the lease alive */
    v = get("/t/job/inc/0/member/5");
    assert_non_null(v);
    free(v);
    assert_int_equal(moe_elastic_member_report_exit(m, MOE_EXIT_PEER_LOST, "peer 3 lost"),
                     MOE_STATUS_SUCCESS);
    assert_int_equal(moe_elastic_member_destroy(m), MOE_STATUS_SUCCESS);
    assert_null(get("/t/job/inc/0/member/5"));
    v = get("/t/job/inc/0/exit/5");
    assert_non_null(v);
    assert_non_null(strstr(v, "\"code\":75"));
    assert_non_null(strstr(v, "peer 3 lost"));
    free(v);
    assert_int_equal(moe_elastic_member_destroy(NULL), MOE_STATUS_SUCCESS);
    c.prefix = "relative";
    assert_int_equal(moe_elastic_member_create(&c, &m), MOE_STATUS_INVALID_ARGUMENT);
}

/* the environment the launcher sets: no endpoint, no member; a rank without a slot named */
static void test_member_from_env(void **state)
{
    (void)state;
    moe_elastic_member_t *m = (moe_elastic_member_t *)1;
    unsetenv("MOE_ELASTIC_ENDPOINT");
    assert_int_equal(moe_elastic_member_create_from_env(0, &m), MOE_STATUS_SUCCESS);
    assert_null(m);
    setenv("MOE_ELASTIC_ENDPOINT", server.endpoint, 1);
    setenv("MOE_ELASTIC_PREFIX", "/t/env", 1);
    setenv("MOE_ELASTIC_SLOTS", "4,7", 1);
    setenv("MOE_ELASTIC_TTL_MS", "2000", 1);
    assert_int_equal(moe_elastic_member_create_from_env(2, &m), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "world rank 2"));
    assert_int_equal(moe_elastic_member_create_from_env(1, &m), MOE_STATUS_SUCCESS);
    char *v = get("/t/env/member/7");
    assert_non_null(v);
    free(v);
    assert_int_equal(moe_elastic_member_destroy(m), MOE_STATUS_SUCCESS);
    unsetenv("MOE_ELASTIC_ENDPOINT");
}

static void on_orphaned(void *user, const char *why) { snprintf((char *)user, 128, "%s", why); }

/* a rank watching its launcher's key (as from MOE_ELASTIC_LAUNCHER_KEY) is orphaned once the
 * launcher's lease is gone: its handler runs within about a renewal, with the cause */
static void test_member_orphaned(void **state)
{
    (void)state;
    moe_elastic_member_config_t c = moe_elastic_member_config_default();
    c.endpoint = server.endpoint;
    c.prefix = "/t/orphan/launcher";
    c.slot = 0;
    c.rank = 0;
    c.ttl_ms = 2000;
    moe_elastic_member_t *launcher, *rank;
    assert_int_equal(moe_elastic_member_create(&c, &launcher), MOE_STATUS_SUCCESS);
    c.prefix = "/t/orphan/inc/0";
    c.slot = 3;
    assert_int_equal(moe_elastic_member_create(&c, &rank), MOE_STATUS_SUCCESS);
    static char why[128];
    why[0] = 0;
    assert_int_equal(moe_elastic_member_watch_launcher(rank, "/t/orphan/launcher/member/0", 60000),
                     MOE_STATUS_SUCCESS);
    assert_int_equal(moe_elastic_member_set_orphan_handler(rank, on_orphaned, why),
                     MOE_STATUS_SUCCESS);
    usleep(1500 * 1000); /* renewals while the launcher lives: not orphaned */
    assert_string_equal(why, "");
    assert_int_equal(moe_elastic_member_destroy(launcher), MOE_STATUS_SUCCESS); /* revoked */
    double t0 = proc_now();
    while (!why[0] && proc_now() - t0 < 3) usleep(20 * 1000);
    assert_non_null(strstr(why, "launcher"));
    assert_int_equal(moe_elastic_member_watch_launcher(rank, NULL, 1), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_elastic_member_destroy(rank), MOE_STATUS_SUCCESS);
}

int main(void)
{
    char err[512];
    if (etcd_server_start(&server, NULL, 1, 30000, err, sizeof err)) {
        printf("skipped: %s\n", err);
        return 77;
    }
    if (el_etcd_create(server.endpoint, 2000, &etcd) != MOE_STATUS_SUCCESS) {
        etcd_server_stop(&server);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_put_range_delete), cmocka_unit_test(test_lease_revoke),
        cmocka_unit_test(test_lease_expires),    cmocka_unit_test(test_errors),
        cmocka_unit_test(test_member),           cmocka_unit_test(test_member_from_env),
        cmocka_unit_test(test_member_orphaned),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    el_etcd_destroy(etcd);
    etcd_server_stop(&server);
    return rc;
}
