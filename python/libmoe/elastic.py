"""A rank's elastic membership (include/moe/elastic.h, docs/elastic.md): an etcd lease kept alive
by libmoe's own thread, with a member key saying who the rank is and how far it got, so the
moe_elastic launcher sees a rank that dies or hangs; and an exit record for a rank that fails
by itself."""
import ctypes as C
import os

from . import _native
from . import _structs as S
from ._config import fill
from ._handle import Handle
from .enums import ElasticPhase, to_enum


class Member(Handle):
    """This rank's member of the incarnation under prefix, registered (phase STARTED) once made.
    Keyword arguments are moe_elastic_member_config_t fields with the C defaults: endpoint
    (etcd's JSON gateway, http://host:port), prefix ("/moe/<job>/inc/<n>"), slot, rank, ttl_ms
    (5000), request_timeout_ms (2000). Raises Error (REMOTE_ERROR, TIMEOUT) when etcd does not
    answer. close() revokes the lease (the member key goes with it) and raises the member's
    first failure to renew, if any."""

    kind = "elastic member"

    def __init__(self, endpoint, prefix, slot, rank, **config):
        lib = _native.lib()
        cfg = fill(lib.moe_elastic_member_config_default(),
                   dict(endpoint=endpoint, prefix=prefix, slot=slot, rank=rank, **config),
                   "Member")
        ptr = C.c_void_p()
        lib.moe_elastic_member_create(C.byref(cfg), C.byref(ptr))
        self._own(lib, ptr.value)

    def _own(self, lib, ptr):
        super().__init__(ptr, lib.moe_elastic_member_destroy)
        self._lib = lib

    @classmethod
    def from_env(cls, rank):
        """The member the launcher describes in the environment (MOE_ELASTIC_ENDPOINT, _PREFIX,
        _SLOTS, _TTL_MS) for world rank `rank`; None when MOE_ELASTIC_ENDPOINT is unset (the
        program was not started by the launcher). A malformed variable raises
        Error(INVALID_ARGUMENT) naming it."""
        lib = _native.lib()
        ptr = C.c_void_p()
        lib.moe_elastic_member_create_from_env(rank, C.byref(ptr))
        if not ptr.value:
            return None
        member = cls.__new__(cls)
        member._own(lib, ptr.value)
        return member

    def report(self, phase, step):
        """Record progress: phase "started", "resumed" (step: the checkpoint's) or "training"
        (step: the last optimizer step done). libmoe's thread writes it; this never waits on
        etcd, but raises the member's first failure to renew (the lease expired)."""
        self._lib.moe_elastic_member_report(self.ptr, int(to_enum(ElasticPhase, phase)), step)

    def report_busy(self, step, busy_s):
        """Record step's busy time in seconds: its wall time minus the time blocked waiting for
        peers (Runtime.wait_stats); the member key carries the last 16, from which moe_elastic
        finds slow ranks. Never waits on etcd."""
        self._lib.moe_elastic_member_report_busy(self.ptr, int(step), float(busy_s))

    @property
    def slot(self):
        """The launcher's slot of this member (kept across incarnations, unlike the rank)."""
        out = C.c_int32()
        self._lib.moe_elastic_member_slot(self.ptr, C.byref(out))
        return out.value

    def watch_launcher(self, launcher_key, orphan_ms=60000):
        """Watch the launcher's lease key: when it is gone, or etcd stays unreachable for
        orphan_ms, the member is orphaned and the orphan handler runs."""
        self._lib.moe_elastic_member_watch_launcher(self.ptr, os.fsencode(launcher_key),
                                                    int(orphan_ms))

    def set_orphan_handler(self, fn):
        """fn(why: str), called once from libmoe's keep-alive thread when the member is
        orphaned (the program should end); None removes it."""
        cb = None if fn is None else S.ORPHAN_FN(lambda _user, why: fn(why.decode()))
        self._lib.moe_elastic_member_set_orphan_handler(self.ptr, cb, None)
        self._orphan_cb = cb  # C holds the pointer: keep the callback alive with the member

    def report_exit(self, code, cause=None):
        """Write the exit record <prefix>/exit/<slot> (it outlives the process) before the
        program exits with code: 0 done, libmoe.EXIT_PEER_LOST a peer was lost, other: this
        rank failed; cause: a short text, or None."""
        self._lib.moe_elastic_member_report_exit(
            self.ptr, code, None if cause is None else os.fsencode(cause))
