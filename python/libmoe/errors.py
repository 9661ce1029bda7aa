"""libmoe.Error: a failed libmoe call, with its status and the library's message."""
from .enums import Status, as_status


class Error(Exception):
    """A libmoe call failed. status: a Status; message: moe_last_error() of the failing call
    (or the wrapper's own text for checks made before the call); call: the C function, if any."""

    def __init__(self, status, message, call=None):
        self.status = as_status(status)
        self.message = message
        self.call = call
        where = f"{call}: " if call else ""
        name = getattr(self.status, "name", f"status {status}").lower()
        super().__init__(f"{where}{name}: {message}")


class ArgumentError(Error, ValueError):
    """An argument the wrapper rejects before calling libmoe (wrong shape, dtype, device,
    layout or kind of object). Also a ValueError."""

    def __init__(self, message, call=None):
        super().__init__(Status.INVALID_ARGUMENT, message, call)


class LibraryNotFound(Error, OSError):
    """libmoe.so could not be loaded; the message lists every place tried and why it failed."""

    def __init__(self, message):
        super().__init__(Status.NOT_FOUND, message)
