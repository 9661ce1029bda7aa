/* mpirun's output relayed without Open MPI's known noise (relay.h). */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "relay.h"

/* Lines Open MPI 4.1 prints after a rank is lost under --enable-recovery, which say nothing the
 * launcher's failure event does not say better. */
static const char *const noise[] = {"PMIX ERROR: BAD-PARAM", "] Read -1, expected"};

bool relay_is_noise(const char *line)
{
    for (size_t i = 0; i < sizeof noise / sizeof *noise; i++)
        if (strstr(line, noise[i])) return true;
    return false;
}

void relay_open(relay_t *r, const char *path)
{
    memset(r, 0, sizeof *r);
    r->path = path;
    struct stat st;
    if (path && stat(path, &st) == 0) r->offset = st.st_size;
}

static void emit(const char *line, size_t n)
{
    char buf[4097];
    if (n > sizeof buf - 1) n = sizeof buf - 1;
    memcpy(buf, line, n);
    buf[n] = 0;
    if (!relay_is_noise(buf)) fprintf(stdout, "%s\n", buf);
}

void relay_pump(relay_t *r, bool final)
{
    if (!r->path) return;
    int fd = open(r->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char buf[8192];
    ssize_t n;
    while ((n = pread(fd, buf, sizeof buf, r->offset)) > 0) {
        r->offset += n;
        for (ssize_t i = 0; i < n; i++) {
            if (buf[i] != '\n' && r->n_partial < sizeof r->partial) {
                r->partial[r->n_partial++] = buf[i];
                continue;
            }
            if (buf[i] == '\n') {
                emit(r->partial, r->n_partial);
                r->n_partial = 0;
            }
        }
    }
    close(fd);
    if (final && r->n_partial) {
        emit(r->partial, r->n_partial);
        r->n_partial = 0;
    }
    fflush(stdout);
}
