"""gkv's exceptions: one class per gkv status code, all subclasses of gkv.Error."""

from __future__ import annotations

__all__ = [
    "Error", "NotFound", "InvalidArgument", "NoSpace", "Unavailable", "Timeout", "IOError",
    "Corruption", "ProtocolError", "PermissionDenied", "NotSupported", "Aborted", "Internal",
    "Busy", "WrongNode",
    "from_status",
]


class Error(Exception):
    """A failed gkv call. ``code`` is gkv's status code (an int), ``code_name`` its name
    (``"not_found"``, ``"timeout"``, ...), ``message`` the text without the code."""

    code: int = -1
    code_name: str = "error"

    def __init__(self, message: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return f"{self.code_name}: {self.message}"


class NotFound(Error, KeyError):
    """The key is not in the cache (also a KeyError)."""
    code, code_name = 1, "not_found"


class InvalidArgument(Error, ValueError):
    """A bad argument: wrong size or dtype, oversize key, malformed metadata."""
    code, code_name = 2, "invalid_argument"


class NoSpace(Error):
    """No tier (or node) has room for the value."""
    code, code_name = 3, "no_space"


class Unavailable(Error, ConnectionError):
    """A node is down, or the connection to it was lost."""
    code, code_name = 4, "unavailable"


class Timeout(Error, TimeoutError):
    """The call's deadline passed."""
    code, code_name = 5, "timeout"


class IOError(Error, OSError):  # noqa: A001 (gkv.IOError; the builtin stays builtins.IOError)
    """A disk or device failure on a node."""
    code, code_name = 6, "io_error"


class Corruption(Error):
    """Stored or received bytes failed a check."""
    code, code_name = 7, "corruption"


class ProtocolError(Error):
    """A malformed or unexpected message on the wire."""
    code, code_name = 8, "protocol_error"


class PermissionDenied(Error, PermissionError):
    """Missing or wrong cluster secret."""
    code, code_name = 9, "permission_denied"


class NotSupported(Error):
    """A feature not available here (e.g. a dtype this torch/numpy lacks)."""
    code, code_name = 10, "not_supported"


class Aborted(Error):
    """The call was cancelled: the client was closed, or is used after a fork."""
    code, code_name = 11, "aborted"


class Internal(Error):
    """A bug in gkv: an invariant did not hold."""
    code, code_name = 12, "internal"


class Busy(Error):
    """The node sheds load (too many requests or bytes in flight, or its work queue is full).

    Nothing was done; retry after a pause."""
    code, code_name = 13, "busy"


class WrongNode(Error):
    """The node does not own the key in its ring: membership changed and this client's ring
    had not caught up within the call's deadline. Retry."""
    code, code_name = 14, "wrong_node"


_BY_CODE: dict[int, type[Error]] = {
    cls.code: cls
    for cls in (NotFound, InvalidArgument, NoSpace, Unavailable, Timeout, IOError, Corruption,
                ProtocolError, PermissionDenied, NotSupported, Aborted, Internal, Busy,
                WrongNode)
}


def from_status(code: int, message: str) -> Error:
    """The exception for a gkv status code (used by the compiled module)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return Error(message, code)
    return cls(message)
