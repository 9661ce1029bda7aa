/*
 * A stand-in for the trainer under moe_elastic, to drive the launcher's failure paths that a
 * real run does not produce on demand. Each rank (its world rank from Open MPI's
 * OMPI_COMM_WORLD_RANK; no MPI is used) joins as a member (moe/elastic.h), reports a resume and
 * one step, then with --mode on rank --on-rank (first incarnation only, MOE_ELASTIC_PREFIX
 * ending in /inc/0: later every rank behaves):
 *   hang    that rank keeps its lease and sleeps; the others report a lost peer and exit 75
 *   fail    that rank reports exit code 1 with a cause and exits 1; the others sleep
 *   silent  that rank never joins and sleeps; the others sleep
 *   early   that rank exits 1 a second after it started, before it joins; the others sleep
 *   sleep   every rank sleeps after its step (the test kills mpirun, etcd or the launcher)
 *   etcd    every rank waits --wait-s seconds after its step, then exits 0 (the test kills
 *           etcd meanwhile)
 * A behaving rank reports exit 0 and exits 0 after 0.3 s. --print-config prints the config
 * JSON the launcher reads (the tiny model on ep=2 x pp=2, and three of its valid meshes).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <moe/elastic.h>

/* As the trainer does (examples/trainer/membership.c): a rank of a dead launcher ends. */
static void on_orphaned(void *user, const char *why)
{
    (void)user, (void)why;
    _exit(1);
}

static void sleep_long(void)
{
    for (int i = 0; i < 600; i++) sleep(1); /* the launcher ends it long before */
}

int main(int argc, char **argv)
{
    const char *mode = "none";
    int print_config = 0;
    int on_rank = -1, wait_s = 3;
    const char *ckpt_dir = "unused";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--print-config")) {
            print_config = 1;
            continue;
        }
        if (!strcmp(argv[i], "--mode") && i + 1 < argc)
            mode = argv[++i];
        else if (!strcmp(argv[i], "--on-rank") && i + 1 < argc)
            on_rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--wait-s") && i + 1 < argc)
            wait_s = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ckpt-dir") && i + 1 < argc)
            ckpt_dir = argv[++i];
    }
    if (print_config) {
        printf("{\"model\": {\"experts\": 4, \"ffn_hidden\": 16, \"layers\": 4}, "
               "\"mesh\": {\"tp\": 1, \"ep\": 2, \"dp\": 1, \"pp\": 2}, "
               "\"train\": {\"steps\": 1, \"batch\": 8, \"microbatches\": 2, "
               "\"virtual_stages\": 1}, \"ckpt\": {\"dir\": \"%s\", \"every\": 1}, "
               "\"meshes\": [[1, 1, 1, 1, 2], [1, 2, 1, 1, 2], [1, 2, 1, 2, 2]]}\n",
               ckpt_dir);
        return 0;
    }
    const char *prefix = getenv("MOE_ELASTIC_PREFIX");
    size_t pl = prefix ? strlen(prefix) : 0;
    int first = pl >= 6 && !strcmp(prefix + pl - 6, "/inc/0");
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    int rank = r ? atoi(r) : 0;
    int odd = first && rank == on_rank;
    if (first && !strcmp(mode, "silent") && odd) sleep_long();
    if (first && !strcmp(mode, "early") && odd) {
        sleep(1); /* lost while starting (MPI, data), after Open MPI started it */
        return 1;
    }
    moe_elastic_member_t *m;
    if (moe_elastic_member_create_from_env(rank, &m) != MOE_STATUS_SUCCESS || !m) {
        fprintf(stderr, "fake_rank %d: no member: %s\n", rank, moe_last_error());
        return 1;
    }
    moe_elastic_member_set_orphan_handler(m, on_orphaned, NULL);
    moe_elastic_member_report(m, MOE_ELASTIC_PHASE_RESUMED, 0);
    moe_elastic_member_report(m, MOE_ELASTIC_PHASE_TRAINING, 1);
    usleep(300 * 1000);
    if (first && (!strcmp(mode, "sleep") || !strcmp(mode, "early"))) sleep_long();
    if (first && !strcmp(mode, "etcd")) sleep((unsigned)wait_s);
    if (first && !strcmp(mode, "hang")) {
        if (odd) sleep_long();
        moe_elastic_member_report_exit(m, 75, "a peer does not answer");
        moe_elastic_member_destroy(m);
        return 75;
    }
    if (first && !strcmp(mode, "fail")) {
        if (!odd) sleep_long();
        moe_elastic_member_report_exit(m, 1, "training step failed: loss is NaN");
        moe_elastic_member_destroy(m);
        return 1;
    }
    if (first && !strcmp(mode, "silent")) sleep_long();
    moe_elastic_member_report_exit(m, 0, NULL);
    moe_elastic_member_destroy(m);
    return 0;
}
