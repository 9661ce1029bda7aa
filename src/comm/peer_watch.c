/*
 * The peer watch (see peer_watch.h): pings, answers and notices on a private duplicate of the
 * mesh's world, polled by every wait and test of a watched communicator.
 *
 * Messages are one fixed-size record (well under the eager limits, so a send completes without
 * the receiver's help): PING carries a probe number that its PONG echoes with the world ranks
 * the answering rank waits for (the ranks it asks itself while it probes, or those its wait in
 * progress needs); NOTICE carries a failure's text; LEFT says that its sender destroyed its
 * watch without a failure (its work is done). A rank answers every ping; the first notice it
 * takes becomes its failure; a rank that left is never named as dead or stalled.
 */
#include "peer_watch.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm_base.h"
#include "core/clock.h"
#include "core/error.h"
#include "mpi_support.h"

#define CTL_TAG 1
#define GRACE_MIN_MS 50
#define GRACE_MAX_MS 2000
/* Notices are small and sent eagerly; a few milliseconds usually see them out. Bounded so a
 * peer that cannot take them never holds this rank back. */
#define FLUSH_MS 200

#define WAIT_MAX 64

enum { MSG_PING = 1, MSG_PONG = 2, MSG_NOTICE = 3, MSG_LEFT = 4 };

typedef struct ctl_msg {
    int32_t kind, origin, seq, status;
    int32_t nwait; /* PONG: whom the answering rank waits for, wait[0..nwait) */
    int32_t wait[WAIT_MAX];
    char text[480]; /* NOTICE: the failure */
} ctl_msg_t;

typedef struct outgoing {
    MPI_Request req;
    ctl_msg_t *msg;
} outgoing_t;

struct moe_comm_watch {
    MPI_Comm ctl;
    int rank, size, grace_ms;
    const moe_logger_t *logger;
    ctl_msg_t *inbox;      /* the posted receive's buffer (MPI's until it completes) */
    MPI_Request inbox_req; /* MPI_REQUEST_NULL when the channel broke */
    outgoing_t *out;       /* sends not seen complete */
    int nout, cap_out;
    int32_t seq; /* the current probe */
    bool probing;
    int *asked; /* [size] pinged in the current probe, in order; nasked of them */
    int nasked;
    uint8_t *was_asked; /* [size] */
    uint8_t *answered;  /* [size] answered the current probe */
    uint8_t *left;      /* [size] left normally (its LEFT came) */
    /* the wait in progress on this rank, for the answers */
    const moe_comm_t *wait_c;
    moe_comm_req_t *wait_r;
    moe_comm_late_fn wait_late;
    moe_status_t status; /* the first failure, or SUCCESS */
    char cause[512];
};

/* ---- the channel ------------------------------------------------------------------------ */

static void post_inbox(moe_comm_watch_t *w)
{
    if (MPI_Irecv(w->inbox, (int)sizeof *w->inbox, MPI_BYTE, MPI_ANY_SOURCE, CTL_TAG, w->ctl,
                  &w->inbox_req) != MPI_SUCCESS)
        w->inbox_req = MPI_REQUEST_NULL;
}

static void send_msg(moe_comm_watch_t *w, int dest, int32_t kind, int32_t seq, moe_status_t status,
                     const char *text, const int *wait, int nwait)
{
    if (w->nout == w->cap_out) {
        int cap = w->cap_out ? 2 * w->cap_out : 16;
        outgoing_t *grown = realloc(w->out, sizeof *grown * (size_t)cap);
        if (!grown) return; /* the message is lost: the peer finds out by its own timeout */
        w->out = grown;
        w->cap_out = cap;
    }
    ctl_msg_t *m = calloc(1, sizeof *m);
    if (!m) return;
    m->kind = kind;
    m->origin = w->rank;
    m->seq = seq;
    m->status = (int32_t)status;
    if (text) snprintf(m->text, sizeof m->text, "%s", text);
    m->nwait = nwait < WAIT_MAX ? nwait : WAIT_MAX;
    for (int i = 0; i < m->nwait; i++) m->wait[i] = wait[i];
    MPI_Request req;
    if (MPI_Isend(m, (int)sizeof *m, MPI_BYTE, dest, CTL_TAG, w->ctl, &req) != MPI_SUCCESS) {
        free(m);
        return;
    }
    w->out[w->nout++] = (outgoing_t){req, m};
}

/* Forget the sends that completed (a send that failed is dropped with its buffer leaked:
 * MPI's state of it is unknown). */
static void reap_sends(moe_comm_watch_t *w)
{
    int keep = 0;
    for (int i = 0; i < w->nout; i++) {
        int flag = 0;
        int rc = moe_mpi_testall(1, &w->out[i].req, &flag, MPI_STATUSES_IGNORE);
        if (rc == MPI_SUCCESS && flag)
            free(w->out[i].msg);
        else if (rc == MPI_SUCCESS)
            w->out[keep++] = w->out[i];
    }
    w->nout = keep;
}

static void record(moe_comm_watch_t *w, moe_status_t status, const char *cause)
{
    if (w->status != MOE_STATUS_SUCCESS) return;
    w->status = status;
    snprintf(w->cause, sizeof w->cause, "%s", cause);
    moe_log(w->logger, MOE_LOG_WARN, "mesh: %s", cause);
}

static void ask(moe_comm_watch_t *w, int rank)
{
    if (rank < 0 || rank >= w->size || rank == w->rank || w->was_asked[rank]) return;
    w->was_asked[rank] = 1;
    w->asked[w->nasked++] = rank;
    send_msg(w, rank, MSG_PING, w->seq, MOE_STATUS_SUCCESS, NULL, NULL, 0);
}

/* The answer to a ping: whom this rank waits for. */
static void answer(moe_comm_watch_t *w, const ctl_msg_t *ping)
{
    int wait[WAIT_MAX], n = 0;
    if (w->probing) {
        for (; n < w->nasked && n < WAIT_MAX; n++) wait[n] = w->asked[n];
    } else if (w->wait_late) {
        n = w->wait_late(w->wait_c, w->wait_r, wait, WAIT_MAX);
    }
    send_msg(w, ping->origin, MSG_PONG, ping->seq, MOE_STATUS_SUCCESS, NULL, wait, n);
}

static void handle(moe_comm_watch_t *w, const ctl_msg_t *m)
{
    if (m->origin < 0 || m->origin >= w->size) return;
    switch (m->kind) {
    case MSG_PING: answer(w, m); break;
    case MSG_PONG:
        if (!w->probing || m->seq != w->seq) break;
        w->answered[m->origin] = 1;
        for (int i = 0; i < m->nwait && i < WAIT_MAX; i++)
            ask(w, m->wait[i]); /* follow the chain */
        break;
    case MSG_NOTICE: {
        char text[sizeof m->text];
        memcpy(text, m->text, sizeof text);
        text[sizeof text - 1] = '\0';
        record(w, MOE_STATUS_ABORTED, text);
        break;
    }
    case MSG_LEFT: w->left[m->origin] = 1; break;
    }
}

void moe_comm_watch_poll(moe_comm_watch_t *w)
{
    if (!w) return;
    /* bounded, so a flood of pings cannot hold a wait */
    for (int k = 0; k < 64 && w->inbox_req != MPI_REQUEST_NULL; k++) {
        int flag = 0;
        if (moe_mpi_testall(1, &w->inbox_req, &flag, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
            w->inbox_req = MPI_REQUEST_NULL; /* broken channel: its buffer stays MPI's */
            w->inbox = NULL;
            break;
        }
        if (!flag) break;
        ctl_msg_t m = *w->inbox;
        post_inbox(w);
        handle(w, &m);
    }
    if (w->nout) reap_sends(w);
}

static bool notices_pending(const moe_comm_watch_t *w)
{
    for (int i = 0; i < w->nout; i++)
        if (w->out[i].msg->kind == MSG_NOTICE) return true;
    return false;
}

/* Tell every rank not in skip[0..nskip) (nor this one) about the failure, and give the
 * notices a moment to leave (a ping to a stalled rank may never complete: not waited for). */
static void notify_all(moe_comm_watch_t *w, const int *skip, int nskip)
{
    for (int r = 0; r < w->size; r++) {
        bool skipped = r == w->rank;
        for (int i = 0; i < nskip && !skipped; i++) skipped = skip[i] == r;
        if (!skipped) send_msg(w, r, MSG_NOTICE, 0, w->status, w->cause, NULL, 0);
    }
    double deadline = moe_now_ms() + FLUSH_MS;
    while (notices_pending(w) && moe_now_ms() < deadline) {
        reap_sends(w);
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

/* Poll until `done` says so, a notice arrives, or ms pass. */
static void poll_for(moe_comm_watch_t *w, double ms, bool (*done)(const moe_comm_watch_t *, void *),
                     void *arg)
{
    double deadline = moe_now_ms() + ms;
    while (w->status == MOE_STATUS_SUCCESS && !(done && done(w, arg)) && moe_now_ms() < deadline) {
        moe_comm_watch_poll(w);
        struct timespec ts = {0, 500000};
        nanosleep(&ts, NULL);
    }
}

static bool all_answered(const moe_comm_watch_t *w, void *arg)
{
    (void)arg;
    for (int i = 0; i < w->nasked; i++) /* a rank that left will not answer: not waited for */
        if (!w->answered[w->asked[i]] && !w->left[w->asked[i]]) return false;
    return true;
}

/* ---- failures --------------------------------------------------------------------------- */

moe_status_t moe_comm_watch_failure(const moe_comm_watch_t *w, const char **cause)
{
    if (cause) *cause = w ? w->cause : "";
    return w ? w->status : MOE_STATUS_SUCCESS;
}

void moe_comm_watch_waiting(moe_comm_watch_t *w, const moe_comm_t *c, moe_comm_req_t *r,
                            moe_comm_late_fn late)
{
    if (!w) return;
    w->wait_c = late ? c : NULL;
    w->wait_r = late ? r : NULL;
    w->wait_late = late;
}

void moe_comm_watch_fail(moe_comm_watch_t *w, moe_status_t status, const char *cause)
{
    if (!w || w->status != MOE_STATUS_SUCCESS) return;
    record(w, status, cause);
    notify_all(w, NULL, 0);
}

void moe_comm_watch_timed_out(moe_comm_watch_t *w, const char *comm_name, const char *what,
                              int timeout_ms, const int *late, int nlate, char *text, size_t size)
{
    moe_comm_watch_poll(w);
    if (w->status != MOE_STATUS_SUCCESS) {
        snprintf(text, size, "%s", w->cause);
        return;
    }
    /* ping the ranks it waited for, and whomever they wait for in turn */
    w->seq++;
    w->probing = true;
    w->nasked = 0;
    memset(w->was_asked, 0, (size_t)w->size);
    memset(w->answered, 0, (size_t)w->size);
    for (int i = 0; i < nlate; i++) ask(w, late[i]);
    poll_for(w, w->grace_ms, all_answered, NULL);
    w->probing = false;
    if (w->status != MOE_STATUS_SUCCESS) { /* a notice came in meanwhile */
        snprintf(text, size, "%s", w->cause);
        return;
    }
    /* silent ranks: dead or stalled, unless they said they left (they finished normally) */
    int *dead = malloc(sizeof *dead * (size_t)(2 * (w->nasked > 0 ? w->nasked : 1)));
    int ndead = 0, ngone = 0, *gone = dead ? dead + (w->nasked > 0 ? w->nasked : 1) : NULL;
    for (int i = 0; dead && i < w->nasked; i++) {
        int r = w->asked[i];
        if (w->left[r])
            gone[ngone++] = r;
        else if (!w->answered[r])
            dead[ndead++] = r;
    }
    char ranks[160], cause[sizeof w->cause];
    if (ndead > 0) {
        const char *verb = ndead == 1 ? "does not answer" : "do not answer";
        moe_comm_format_ranks(ranks, sizeof ranks, dead, ndead);
        snprintf(text, size, "%s %s (dead or stalled)", ranks, verb);
        snprintf(cause, sizeof cause,
                 "%s %s (dead or stalled; found by world rank %d when %s on "
                 "the %s communicator did not complete within %d ms)",
                 ranks, verb, w->rank, what, comm_name, timeout_ms);
        record(w, MOE_STATUS_TIMEOUT, cause);
        notify_all(w, dead, ndead);
        free(dead);
        return;
    }
    if (ngone > 0) { /* no rank failed: they ran different work (steps, calls) */
        moe_comm_format_ranks(ranks, sizeof ranks, gone, ngone);
        snprintf(text, size,
                 "%s left normally (%s runtime was destroyed without a failure) "
                 "while this rank still needed %s: the ranks did not run the same operations "
                 "(a different number of steps or calls)",
                 ranks, ngone == 1 ? "its" : "their", ngone == 1 ? "it" : "them");
        snprintf(cause, sizeof cause,
                 "world rank %d: %s on the %s communicator did not complete "
                 "within %d ms; %s",
                 w->rank, what, comm_name, timeout_ms, text);
        record(w, MOE_STATUS_TIMEOUT, cause);
        notify_all(w, gone, ngone);
        free(dead);
        return;
    }
    free(dead);
    /* everyone answers: a notice from another rank may still explain it */
    poll_for(w, w->grace_ms, NULL, NULL);
    if (w->status != MOE_STATUS_SUCCESS) {
        snprintf(text, size, "%s", w->cause);
        return;
    }
    if (w->nasked > 0) {
        moe_comm_format_ranks(ranks, sizeof ranks, w->asked, w->nasked);
        snprintf(text, size,
                 "%s %s but did not take part: %s on another operation (ranks that "
                 "start collectives in different orders, or a rank busy outside libmoe)",
                 ranks, w->nasked == 1 ? "answers" : "answer",
                 w->nasked == 1 ? "it waits" : "they wait");
    } else {
        snprintf(text, size, "no peer was waited for");
    }
    snprintf(cause, sizeof cause,
             "world rank %d: %s on the %s communicator did not complete "
             "within %d ms; %s",
             w->rank, what, comm_name, timeout_ms, text);
    record(w, MOE_STATUS_TIMEOUT, cause);
    notify_all(w, NULL, 0);
}

/* ---- create / destroy ------------------------------------------------------------------- */

moe_status_t moe_comm_watch_create(const void *mpi_comm, int rank, int size, int timeout_ms,
                                   const moe_logger_t *logger, moe_comm_watch_t **out)
{
    *out = NULL;
    moe_comm_watch_t *w = calloc(1, sizeof *w);
    if (!w) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "watch");
    w->rank = rank;
    w->size = size;
    w->logger = logger;
    int g = timeout_ms / 4;
    w->grace_ms = g < GRACE_MIN_MS ? GRACE_MIN_MS : g > GRACE_MAX_MS ? GRACE_MAX_MS : g;
    w->inbox_req = MPI_REQUEST_NULL;
    w->inbox = calloc(1, sizeof *w->inbox);
    w->asked = calloc((size_t)w->size, sizeof *w->asked);
    w->was_asked = calloc((size_t)w->size, 1);
    w->answered = calloc((size_t)w->size, 1);
    w->left = calloc((size_t)w->size, 1);
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!w->inbox || !w->asked || !w->was_asked || !w->answered || !w->left) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "watch");
        goto fail;
    }
    st = moe_mpi_dup_within(*(const MPI_Comm *)mpi_comm, timeout_ms, &w->ctl);
    if (st != MOE_STATUS_SUCCESS) {
        moe_error_wrap(st, "creating the mesh's watch");
        goto fail;
    }
    post_inbox(w);
    if (w->inbox_req == MPI_REQUEST_NULL) {
        MPI_Comm_free(&w->ctl);
        st = MOE_FAIL(MOE_STATUS_COMM_ERROR, "posting the watch's receive failed");
        goto fail;
    }
    *out = w;
    return MOE_STATUS_SUCCESS;
fail:
    free(w->inbox);
    free(w->asked);
    free(w->was_asked);
    free(w->answered);
    free(w->left);
    free(w);
    return st;
}

void moe_comm_watch_destroy(moe_comm_watch_t *w)
{
    if (!w) return;
    bool healthy = w->status == MOE_STATUS_SUCCESS;
    /* a normal end: tell every peer, so that one still waiting for this rank (it runs more
     * steps) does not take its silence for a death (sent before the flush below) */
    for (int r = 0; healthy && r < w->size; r++)
        if (r != w->rank && !w->left[r])
            send_msg(w, r, MSG_LEFT, 0, MOE_STATUS_SUCCESS, NULL, NULL, 0);
    if (healthy && w->inbox_req != MPI_REQUEST_NULL) {
        MPI_Cancel(&w->inbox_req);
        int flag = 0;
        double deadline = moe_now_ms() + FLUSH_MS;
        while (!flag && moe_now_ms() < deadline &&
               moe_mpi_testall(1, &w->inbox_req, &flag, MPI_STATUSES_IGNORE) == MPI_SUCCESS) {
        }
        healthy = flag;
    }
    if (healthy) { /* answers to pings may still be on their way out */
        double deadline = moe_now_ms() + FLUSH_MS;
        while (w->nout && moe_now_ms() < deadline) reap_sends(w);
        healthy = w->nout == 0;
    }
    /* after a failure (or with something still in flight) the buffers stay MPI's: leaked.
     * The channel is never freed: peers that end later send their LEFT to it, and MPI hands
     * a message for a freed communicator to the next one that reuses its context id (a later
     * mesh's watch would take a stale LEFT, and lose that peer's first message, its sequence
     * number taken). MPI_Finalize frees it. */
    if (healthy) free(w->inbox);
    free(w->out);
    free(w->asked);
    free(w->was_asked);
    free(w->answered);
    free(w->left);
    free(w);
}
