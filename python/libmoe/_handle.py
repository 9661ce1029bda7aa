"""Lifetime of libmoe handles: each Python object owns one C handle and destroys it exactly once,
on close(), at the end of a `with` block, when its parent is destroyed, or when it is garbage
collected (weakref.finalize, which also runs at interpreter exit).

The C API requires every object made on a runtime (layers, optimizers, checkpointers, tensors)
to be destroyed before the runtime, and an optimizer before the layers it updates. The
collector gives no such order (a layer and its parameter views form a cycle, collected with
the runtime they reach, and weakref callbacks of one garbage cycle run in any order), so each
handle's destroy first runs the destroys of the handles made on it: a parent's finalizer holds
its children's finalizers, each of which runs once, whichever comes first.
"""
import weakref

from .enums import Status
from .errors import Error

_live = [0]  # handles created and not yet destroyed, for leak tests


def live_handles():
    """How many libmoe handles this process holds (created and not yet destroyed)."""
    return _live[0]


def _destroy(destroy, ptr, _keep, children):
    """Children first (newest first), then the handle. Returns the first error instead of
    raising it: close() raises it, the collector drops it."""
    first = None
    for child in reversed(children):
        exc = child()
        first = first or exc
    children.clear()
    _live[0] -= 1
    try:
        destroy(ptr)
    except Error as exc:
        first = first or exc
    return first


class Handle:
    """Base of every handle-owning wrapper. destroy: the C destroy function, or None for a
    handle the parent owns (a view, a pipeline's schedule), which is closed with the parent.
    keep: objects the C handle points into (callbacks, configs), held until destroy."""

    kind = "handle"

    def __init__(self, ptr, destroy, parent=None, keep=()):
        self._ptr = ptr
        self._parent = parent  # a child keeps its parent alive
        self._children = []    # finalizers of the handles made on this one
        self._closed_here = False  # close() was called on this handle, not on a parent
        if destroy is None:
            self._finalizer = parent._finalizer if parent is not None else None
            return
        _live[0] += 1
        self._finalizer = weakref.finalize(self, _destroy, destroy, ptr, keep, self._children)
        if parent is not None:
            parent._adopt(self._finalizer)

    def _adopt(self, finalizer):
        """Destroy finalizer's handle before this one."""
        self._children[:] = [f for f in self._children if f.alive]
        self._children.append(finalizer)

    @property
    def ptr(self):
        """The C handle; raises Error(INVALID_HANDLE) once closed."""
        if self.closed:
            raise Error(Status.INVALID_HANDLE, self._closed_message())
        return self._ptr

    def _closed_message(self):
        """Names the handle whose close closed this one: the outermost closed parent, unless
        this one was closed itself first."""
        closer, parent = None, self._parent
        while parent is not None:
            if parent.closed:
                closer = parent
            parent = parent._parent
        if closer is None or self._closed_here:
            return f"the {self.kind} is closed"
        return (f"the {self.kind} is closed: its {closer.kind} was closed, which closes "
                f"everything made on it")

    @property
    def closed(self):
        return self._finalizer is not None and not self._finalizer.alive

    def close(self):
        """Destroy the handle (children first). A second close is a no-op. Raises Error when
        a destroy reports one (e.g. a checkpointer's unreported background failure)."""
        if self._finalizer is None or not self._finalizer.alive:
            return
        self._closed_here = True
        exc = self._finalizer()
        if exc is not None:
            raise exc

    def _close_with(self, destroy):
        """Close through another C function than the usual destroy (e.g. an abort); returns
        the first error instead of raising it, as _destroy does."""
        detached = self._finalizer.detach() if self._finalizer is not None else None
        if detached is None:
            return None
        self._closed_here = True
        _, _, (_, ptr, keep, children), _ = detached
        return _destroy(destroy, ptr, keep, children)

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"0x{self._ptr:x}"
        return f"<libmoe.{type(self).__name__} {state}>"
