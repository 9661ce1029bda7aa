/*
 * The etcd client's endpoint list against a private three-member etcd cluster on loopback
 * (tools/elastic/etcd_server.h): a dead endpoint first in the list is passed over; one member
 * killed changes nothing for the client or for a member's lease; two members stopped (the
 * quorum lost) make every request fail within its deadlines, naming a member, and requests
 * work again once they continue; a leader key taken in a transaction by one candidate only. Skipped (77) when no etcd is installed (Debian: etcd-server).
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <moe/elastic.h>

#include "elastic/etcd.h"
#include "etcd_server.h"
#include "proc.h"

static etcd_server_t server;

/* 1: the key is there, 0: it is not, -1: no member answered */
static int key_state(el_etcd_t *e, const char *key)
{
    el_kv_t *kvs;
    size_t n;
    if (el_etcd_range_prefix(e, key, &kvs, &n) != MOE_STATUS_SUCCESS) return -1;
    el_kvs_free(kvs, n);
    return n > 0;
}

static bool has_key(el_etcd_t *e, const char *key) { return key_state(e, key) == 1; }

/* a list that starts with an endpoint where nobody listens: the next member answers */
static void test_dead_endpoint_first(void **state)
{
    (void)state;
    char list[sizeof server.endpoint + 64];
    snprintf(list, sizeof list, "http://127.0.0.1:1,%s", server.endpoint);
    el_etcd_t *e;
    assert_int_equal(el_etcd_create(list, 1000, &e), MOE_STATUS_SUCCESS);
    assert_int_equal(el_etcd_put(e, "/c/first", "1", 0), MOE_STATUS_SUCCESS);
    assert_true(has_key(e, "/c/first"));
    el_etcd_destroy(e);
    assert_int_equal(el_etcd_create("http://127.0.0.1:1,127.0.0.1:2", 1000, &e),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "\"127.0.0.1:2\""));
    assert_int_equal(el_etcd_create("http://127.0.0.1:1,,", 1000, &e), MOE_STATUS_INVALID_ARGUMENT);
}

/* member 0 (first in every list) killed: the client's writes and a member's lease go on */
static void test_one_member_lost(void **state)
{
    (void)state;
    el_etcd_t *e;
    assert_int_equal(el_etcd_create(server.endpoint, 1000, &e), MOE_STATUS_SUCCESS);
    moe_elastic_member_config_t c = moe_elastic_member_config_default();
    c.endpoint = server.endpoint;
    c.prefix = "/c/job/inc/0";
    c.slot = 2;
    c.rank = 0;
    c.ttl_ms = 2000;
    moe_elastic_member_t *m;
    assert_int_equal(moe_elastic_member_create(&c, &m), MOE_STATUS_SUCCESS);
    assert_true(has_key(e, "/c/job/inc/0/member/2"));
    kill(server.m[0].pid, SIGKILL); /* reaped below, by the supervision that restarts it */
    usleep(200 * 1000);
    /* when member 0 was the raft leader, writes wait for the next election (about a second,
     * longer on a loaded machine): retried as the members' renewals are */
    double t0 = proc_now();
    while (el_etcd_put(e, "/c/after", "1", 0) != MOE_STATUS_SUCCESS && proc_now() - t0 < 15)
        usleep(100 * 1000);
    printf("  a write with member 0 dead: %.2f s\n", proc_now() - t0);
    assert_true(has_key(e, "/c/after"));
    /* 3 TTLs: the member's thread renewed its lease through the other members */
    int answered = 0;
    for (int i = 0; i < 30; i++) {
        usleep(200 * 1000);
        int st = key_state(e, "/c/job/inc/0/member/2");
        assert_int_not_equal(st, 0);
        answered += st == 1;
    }
    assert_true(answered > 0);
    assert_int_equal(moe_elastic_member_report_exit(m, 0, NULL), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_elastic_member_destroy(m), MOE_STATUS_SUCCESS);
    assert_false(has_key(e, "/c/job/inc/0/member/2"));
    /* started again on its folder, member 0 rejoins and serves alone what it is asked */
    int member = -1, status = 0;
    assert_int_equal(etcd_server_supervise(&server, &member, &status), 1);
    assert_int_equal(member, 0);
    assert_true(WIFSIGNALED(status));
    el_etcd_t *zero;
    assert_int_equal(el_etcd_create(server.m[0].client, 1000, &zero), MOE_STATUS_SUCCESS);
    t0 = proc_now();
    while (!has_key(zero, "/c/after") && proc_now() - t0 < 20) usleep(100 * 1000);
    printf("  member 0 serves again %.2f s after its restart\n", proc_now() - t0);
    assert_true(has_key(zero, "/c/after"));
    el_etcd_destroy(zero);
    el_etcd_destroy(e);
}

/* a leader key created in one transaction: one of two candidates wins, the other reads the
 * holder; once the winner's lease is revoked the key is free and the other wins */
static void test_election(void **state)
{
    (void)state;
    el_etcd_t *a, *b;
    assert_int_equal(el_etcd_create(server.endpoint, 1000, &a), MOE_STATUS_SUCCESS);
    assert_int_equal(el_etcd_create(server.endpoint, 1000, &b), MOE_STATUS_SUCCESS);
    int64_t la, lb;
    assert_int_equal(el_etcd_lease_grant(a, 5, &la, NULL), MOE_STATUS_SUCCESS);
    assert_int_equal(el_etcd_lease_grant(b, 5, &lb, NULL), MOE_STATUS_SUCCESS);
    bool won = false;
    char *holder = NULL;
    assert_int_equal(el_etcd_create_key(a, "/c/leader", "host-a", la, &won, &holder),
                     MOE_STATUS_SUCCESS);
    assert_true(won);
    assert_null(holder);
    assert_int_equal(el_etcd_create_key(b, "/c/leader", "host-b", lb, &won, &holder),
                     MOE_STATUS_SUCCESS);
    assert_false(won);
    assert_string_equal(holder, "host-a");
    free(holder);
    assert_int_equal(el_etcd_lease_revoke(a, la), MOE_STATUS_SUCCESS); /* host a lost */
    assert_int_equal(el_etcd_create_key(b, "/c/leader", "host-b", lb, &won, NULL),
                     MOE_STATUS_SUCCESS);
    assert_true(won);
    assert_int_equal(el_etcd_lease_revoke(b, lb), MOE_STATUS_SUCCESS);
    assert_false(has_key(a, "/c/leader"));
    el_etcd_destroy(a);
    el_etcd_destroy(b);
}

/* two of three stopped: no quorum, every request fails within its deadlines naming a member;
 * continued: requests work again */
static void test_quorum_lost(void **state)
{
    (void)state;
    el_etcd_t *e;
    assert_int_equal(el_etcd_create(server.endpoint, 500, &e), MOE_STATUS_SUCCESS);
    kill(server.m[1].pid, SIGSTOP);
    kill(server.m[2].pid, SIGSTOP);
    double t0 = proc_now();
    moe_status_t st = el_etcd_put(e, "/c/noquorum", "1", 0);
    double took = proc_now() - t0;
    printf("  a write without quorum: %s after %.2f s (%s)\n", moe_status_string(st), took,
           moe_last_error());
    assert_int_not_equal(st, MOE_STATUS_SUCCESS);
    assert_non_null(strstr(moe_last_error(), "http://127.0.0.1:"));
    assert_true(took < 3 * 0.5 + 1.0); /* one deadline per member */
    kill(server.m[1].pid, SIGCONT);
    kill(server.m[2].pid, SIGCONT);
    t0 = proc_now();
    while (el_etcd_put(e, "/c/back", "1", 0) != MOE_STATUS_SUCCESS && proc_now() - t0 < 20)
        usleep(100 * 1000);
    printf("  writes again %.2f s after the members continued\n", proc_now() - t0);
    assert_true(has_key(e, "/c/back"));
    el_etcd_destroy(e);
}

int main(void)
{
    char err[512];
    if (etcd_server_start(&server, NULL, 3, 30000, err, sizeof err)) {
        printf("skipped: %s\n", err);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dead_endpoint_first),
        cmocka_unit_test(test_one_member_lost),
        cmocka_unit_test(test_election),
        cmocka_unit_test(test_quorum_lost),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    etcd_server_stop(&server);
    return rc;
}
