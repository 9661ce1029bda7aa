/* Helpers of the multi-rank fault tests (fault_support.h). */
#include "fault_support.h"

#include <mpi.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int fault_rank, fault_size, fault_failures;

void fault_init(int *argc, char ***argv, int np)
{
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &fault_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &fault_size);
    if (fault_size != np) {
        fprintf(stderr, "run with %d ranks, not %d\n", np, fault_size);
        printf("VERDICT: FAIL (wrong world size)\n");
        fflush(stdout);
        _exit(1);
    }
}

double fault_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int is_absent(int r, const int *absent, int nabsent)
{
    for (int i = 0; i < nabsent; i++)
        if (absent[i] == r) return 1;
    return 0;
}

void fault_verdict(const int *absent, int nabsent, int finalize)
{
    fprintf(stderr, "rank %d: %d failures\n", fault_rank, fault_failures);
    if (fault_rank != 0 && !is_absent(fault_rank, absent, nabsent))
        MPI_Send(&fault_failures, 1, MPI_INT, 0, 99, MPI_COMM_WORLD);
    if (fault_rank == 0) {
        int total = fault_failures;
        for (int r = 1; r < fault_size; r++) {
            if (is_absent(r, absent, nabsent)) continue;
            int other = 0;
            MPI_Recv(&other, 1, MPI_INT, r, 99, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            total += other;
        }
        printf("VERDICT: %s (%d failures)\n", total ? "FAIL" : "PASS", total);
    }
    fflush(stdout);
    fflush(stderr);
    if (finalize) {
        MPI_Finalize();
        exit(fault_failures ? 1 : 0);
    }
    _exit(fault_failures ? 1 : 0);
}
