/*
 * Helpers of the multi-rank fault tests: a check that counts instead of aborting, a clock,
 * and the verdict. After a peer failure MPI cannot finish (no MPI_Finalize), so these tests
 * run under mpirun --enable-recovery, whose exit code ignores the ranks': rank 0 gathers the
 * other ranks' failure counts over MPI_COMM_WORLD (point-to-point, untouched by libmoe's
 * communicators) and prints the verdict line CTest matches, then every rank leaves with
 * _exit.
 */
#ifndef MOE_TEST_FAULT_SUPPORT_H
#define MOE_TEST_FAULT_SUPPORT_H

#include <stdio.h>

extern int fault_rank, fault_size, fault_failures;

#define FCHECK(cond, ...)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "rank %d: %s:%d: check failed: %s: ", fault_rank, __FILE__, __LINE__,  \
                    #cond);                                                                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            fault_failures++;                                                                      \
        }                                                                                          \
    } while (0)

/* MPI_Init, rank and size; fails the run unless there are `np` ranks. */
void fault_init(int *argc, char ***argv, int np);
double fault_now_s(void);
/* Rank 0 collects the failure counts of every rank not in absent[0..nabsent) (ranks that
 * stalled or died), prints "VERDICT: PASS|FAIL (...)", and every caller exits with its own
 * count (0 or 1): through MPI_Finalize when `finalize` (the world is healthy), else _exit.
 * Never returns. */
void fault_verdict(const int *absent, int nabsent, int finalize) __attribute__((noreturn));

#endif /* MOE_TEST_FAULT_SUPPORT_H */
