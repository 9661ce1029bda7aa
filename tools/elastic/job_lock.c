/* The job folder's lock (job_lock.h). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "job_lock.h"
#include "proc.h"

/* mkdir -p */
static int make_dirs(const char *dir)
{
    char p[4096];
    snprintf(p, sizeof p, "%s", dir);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) return -1;
        *s = '/';
    }
    return mkdir(p, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

int job_lock_take(const char *dir, double wait_s, char *err, size_t len)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/.moe_elastic.lock", dir);
    if (make_dirs(dir) != 0) {
        snprintf(err, len, "cannot create the checkpoint folder %s: %s", dir, strerror(errno));
        return -1;
    }
    int fd = open(path, O_RDWR | O_CREAT, 0644); /* no O_CLOEXEC: the job's processes hold it */
    if (fd < 0) {
        snprintf(err, len, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    double end = proc_now() + wait_s;
    for (;;) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) break;
        char buf[32] = "";
        ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
        long holder = n > 0 ? strtol(buf, NULL, 10) : 0;
        if (holder > 0 && kill((pid_t)holder, 0) == 0) {
            snprintf(err, len,
                     "the job folder %s is in use by moe_elastic (pid %ld): two jobs "
                     "cannot write one folder",
                     dir, holder);
            close(fd);
            return -1;
        }
        if (proc_now() >= end) {
            snprintf(err, len,
                     "the job folder %s is still held by the processes of a launcher "
                     "that is gone (pid %ld) after %.0f s; end them first",
                     dir, holder, wait_s);
            close(fd);
            return -1;
        }
        usleep(200 * 1000);
    }
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n) {
        snprintf(err, len, "cannot write %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}
