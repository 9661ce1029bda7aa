/*
 * mpirun's output, relayed: each incarnation's mpirun writes to the launcher's mpirun log (all
 * of it, kept for diagnosis); the relay reads the new lines of that file at every poll and
 * copies them to the launcher's stdout, except Open MPI's known noise after a rank loss (the
 * PMIx "BAD-PARAM" and "Read -1" lines, which name no cause and follow every recovery).
 */
#ifndef MOE_TOOLS_RELAY_H
#define MOE_TOOLS_RELAY_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

typedef struct relay {
    const char *path;
    off_t offset;       /* bytes of the file already read */
    char partial[4096]; /* a line not yet ended */
    size_t n_partial;
} relay_t;

/* Follows path from its current end (earlier runs' lines are not repeated). */
void relay_open(relay_t *r, const char *path);
/* Copies the lines written since the last call (the last line too when final). */
void relay_pump(relay_t *r, bool final);
/* 1 when the line is Open MPI's known noise. */
bool relay_is_noise(const char *line);

#endif /* MOE_TOOLS_RELAY_H */
