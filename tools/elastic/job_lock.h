/*
 * One launcher per job folder: an exclusive flock on <ckpt dir>/.moe_elastic.lock, holding the
 * owner's pid. The descriptor is inherited by the incarnations' mpirun and the private etcd, so
 * the lock is free only once the last process of the job has ended: a second launcher on the
 * same folder is refused while the first runs, and after a dead launcher it waits (a bounded
 * time) for that job's processes to end instead of writing beside them.
 */
#ifndef MOE_TOOLS_JOB_LOCK_H
#define MOE_TOOLS_JOB_LOCK_H

#include <stddef.h>

/* Creates dir if missing and takes the lock; returns its descriptor, or -1 with a message in
 * err naming the holder. wait_s: how long to wait for the processes of a dead holder. */
int job_lock_take(const char *dir, double wait_s, char *err, size_t len);

#endif /* MOE_TOOLS_JOB_LOCK_H */
