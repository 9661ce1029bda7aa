/*
 * Processes for the launcher: start a program as the leader of its own session, find and
 * signal everything in that session (mpirun's ranks and their children keep its session id
 * wherever they are reparented), wait with a deadline, read a process's state.
 */
#ifndef MOE_TOOLS_PROC_H
#define MOE_TOOLS_PROC_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

double proc_now(void);  /* monotonic seconds */
double proc_wall(void); /* Unix time, seconds */

/* fork + setsid + exec argv[0] (searched on PATH) with this process's environment; stdout and
 * stderr to log_path (appended) when not NULL. The child gets SIGTERM when the launcher dies
 * (PR_SET_PDEATHSIG). Returns the pid (= the session id) or -1. */
pid_t proc_spawn_session(char *const argv[], const char *log_path);
/* Runs argv in its own session with stdout into out (NUL-terminated, truncated to len) and
 * stderr inherited; killed (the whole session) after timeout_s. Returns the wait status, or -1
 * when it could not start or ran out of time. */
int proc_run_capture(char *const argv[], double timeout_s, char *out, size_t len);
/* Reaps pid within timeout_s: true and *status (may be NULL) when it has exited. */
bool proc_wait(pid_t pid, double timeout_s, int *status);
/* The live (not yet reaped) processes of session sid, up to max; returns how many. */
size_t proc_session(pid_t sid, pid_t *pids, size_t max);
/* Sends sig to every process of session sid; returns how many were signalled. */
size_t proc_kill_session(pid_t sid, int sig);
/* Reaps the zombies of session sid that are this process's children (orphans reparented to
 * it: the launcher is their subreaper). */
void proc_reap_session(pid_t sid);
/* pids[k]: the live process of session sid whose OMPI_COMM_WORLD_RANK is k (0: none seen), for
 * k < world. Open MPI gives every rank that variable before it runs the program, so a rank is
 * found before it registers anywhere. */
void proc_session_ranks(pid_t sid, pid_t *pids, int world);
/* pids[k]: the live process on this machine whose environment has MOE_ELASTIC_PREFIX=prefix
 * (one incarnation of one job) and OMPI_COMM_WORLD_RANK=k (0: none), for k < world; sid != 0
 * keeps only that session's (simulated hosts share one machine: each is a session). An
 * agent's ranks, whoever started them (orted under ssh, or a local mpirun). */
void proc_job_ranks(const char *prefix, pid_t sid, pid_t *pids, int world);
/* Reaps every exited child of this process (the launcher is the subreaper of its incarnations'
 * orphans) except the pids in keep, whose exit status the caller reads itself. */
void proc_reap_children(const pid_t *keep, int n_keep);
/* The state letter of /proc/<pid>/stat (R, S, D, T stopped, Z zombie), 0 when gone. */
char proc_state(pid_t pid);
/* True when pid is gone, a zombie, or has a SIGKILL pending: a killed process can stay in
 * uninterruptible sleep (D, an fsync or O_DIRECT write in flight) until its I/O ends, yet it is
 * already lost (the OOM killer's kill and a host's loss look alike from here). */
bool proc_gone(pid_t pid);

#endif /* MOE_TOOLS_PROC_H */
