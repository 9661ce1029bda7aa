/*
 * A stand-in for the trainer under moe_elastic, to drive the launcher's failure paths that a
 * real run does not produce on demand. Each rank (its world rank from Open MPI's
 * OMPI_COMM_WORLD_RANK; no MPI is used) joins as a member (moe/elastic.h), reports a resume and
 * one step, then with --mode on rank --on-rank (first incarnation only: with --resume every
 * rank behaves):
 *   hang    that rank keeps its lease and sleeps; the others report a lost peer and exit 75
 *   fail    that rank reports exit code 1 with a cause and exits 1; the others sleep
 *   silent  that rank never joins and sleeps; the others sleep
 * A behaving rank reports exit 0 and exits 0 after 0.3 s. --print-config prints the config
 * JSON the launcher reads (the tiny model on ep=2 x pp=2).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <moe/elastic.h>

static void sleep_long(void)
{
    for (int i = 0; i < 600; i++) sleep(1); /* the launcher ends it long before */
}

int main(int argc, char **argv)
{
    const char *mode = "none";
    int on_rank = -1, resume = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--print-config")) {
            printf("{\"model\": {\"experts\": 4, \"ffn_hidden\": 16, \"layers\": 4}, "
                   "\"mesh\": {\"tp\": 1, \"ep\": 2, \"dp\": 1, \"pp\": 2}, "
                   "\"train\": {\"steps\": 1, \"batch\": 8, \"microbatches\": 2, "
                   "\"virtual_stages\": 1}, \"ckpt\": {\"dir\": \"unused\", \"every\": 1}}\n");
            return 0;
        }
        if (!strcmp(argv[i], "--mode") && i + 1 < argc) mode = argv[++i];
        else if (!strcmp(argv[i], "--on-rank") && i + 1 < argc) on_rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--resume")) resume = 1;
    }
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    int rank = r ? atoi(r) : 0;
    int odd = !resume && rank == on_rank;
    if (!resume && !strcmp(mode, "silent") && odd) sleep_long();
    moe_elastic_member_t *m;
    if (moe_elastic_member_create_from_env(rank, &m) != MOE_STATUS_SUCCESS || !m) {
        fprintf(stderr, "fake_rank %d: no member: %s\n", rank, moe_last_error());
        return 1;
    }
    moe_elastic_member_report(m, MOE_ELASTIC_PHASE_RESUMED, 0);
    moe_elastic_member_report(m, MOE_ELASTIC_PHASE_TRAINING, 1);
    usleep(300 * 1000);
    if (!resume && !strcmp(mode, "hang")) {
        if (odd) sleep_long();
        moe_elastic_member_report_exit(m, 75, "a peer does not answer");
        moe_elastic_member_destroy(m);
        return 75;
    }
    if (!resume && !strcmp(mode, "fail")) {
        if (!odd) sleep_long();
        moe_elastic_member_report_exit(m, 1, "training step failed: loss is NaN");
        moe_elastic_member_destroy(m);
        return 1;
    }
    if (!resume && !strcmp(mode, "silent")) sleep_long();
    moe_elastic_member_report_exit(m, 0, NULL);
    moe_elastic_member_destroy(m);
    return 0;
}
