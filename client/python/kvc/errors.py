"""The one exception type of the kvc client."""

import grpc


class KvcError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's (or client's) message.

    Client-side validation raises it with INVALID_ARGUMENT naming the offending argument, as the
    C++ client does; a malformed server stream raises INTERNAL.
    """

    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def invalid(details):
    return KvcError(grpc.StatusCode.INVALID_ARGUMENT, details)


def from_rpc_error(err):
    """grpc.RpcError (sync or aio) -> KvcError with the same code and message."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return KvcError(code or grpc.StatusCode.UNKNOWN, details or "")
