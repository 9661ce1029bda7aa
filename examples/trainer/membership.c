/*
 * The trainer's elastic membership (membership.h). One member per process, so it is kept in
 * this file; a failed report is printed once and training goes on: the launcher judges a
 * rank by its lease, and a rank that cannot renew it is ended by the launcher.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "membership.h"

static moe_elastic_member_t *member;
static int warned;

static void check(moe_status_t st, const char *what)
{
    if (st != MOE_STATUS_SUCCESS && !warned) {
        warned = 1;
        fprintf(stderr, "moe_train: elastic %s: %s\n", what, moe_last_error());
    }
}

/* The launcher is gone (or gave this rank up): nobody will end this rank, so it ends itself
 * at once, from the member's thread, whatever the training thread is blocked in. */
static void on_orphaned(void *user, const char *why)
{
    (void)user;
    char msg[256];
    int n = snprintf(msg, sizeof msg, "moe_train: elastic: %s; ending this rank\n", why);
    ssize_t w = write(STDERR_FILENO, msg, n > 0 && (size_t)n < sizeof msg ? (size_t)n : 0);
    (void)w; /* nothing left to tell if stderr is gone */
    _exit(1);
}

int membership_join(int rank)
{
    if (moe_elastic_member_create_from_env(rank, &member) != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "moe_train: elastic member of rank %d: %s\n", rank, moe_last_error());
        return -1;
    }
    if (member) moe_elastic_member_set_orphan_handler(member, on_orphaned, NULL);
    return 0;
}

void membership_resumed(int64_t step)
{
    if (member) check(moe_elastic_member_report(member, MOE_ELASTIC_PHASE_RESUMED, step), "report");
}

void membership_step(int64_t step, double busy_s)
{
    if (!member) return;
    check(moe_elastic_member_report_busy(member, step, busy_s), "report");
    check(moe_elastic_member_report(member, MOE_ELASTIC_PHASE_TRAINING, step), "report");
}

int membership_slot(void)
{
    int32_t slot = -1;
    if (member) check(moe_elastic_member_slot(member, &slot), "slot");
    return (int)slot;
}

void membership_leave(int code, const char *cause)
{
    if (!member) return;
    check(moe_elastic_member_report_exit(member, code, cause), "exit record");
    check(moe_elastic_member_destroy(member), "leave");
    member = NULL;
}
