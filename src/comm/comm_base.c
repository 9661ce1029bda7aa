/* The rank-list text of messages and the pause between polls (comm_base.h). */
#include "comm_base.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

void moe_comm_format_ranks(char *out, size_t size, const int *ranks, int n)
{
    size_t len = (size_t)snprintf(out, size, "world rank%s ", n == 1 ? "" : "s");
    for (int i = 0; i < n && len < size; i++) {
        int room = (int)(size - len);
        int w = snprintf(out + len, (size_t)room, "%s%d", i ? "," : "", ranks[i]);
        if (w >= room) { /* truncated: end with an ellipsis */
            if (size >= 4) strcpy(out + size - 4, "...");
            break;
        }
        len += (size_t)w;
    }
}

void moe_comm_backoff(unsigned spin)
{
    if (spin > 64) {
        struct timespec ts = {0, spin > 4096 ? 200000 : 20000};
        nanosleep(&ts, NULL);
    }
}
