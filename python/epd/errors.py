"""The exceptions of the epd client: one class per wire error code of DESIGN.md section 4 (the
daemon's ERROR frames), and the client's own failures (connect, timeout, closed, protocol,
invalid_argument, the local codes libepd uses too). Every one is an EpdError with .code,
.message and .id (the request id, None for an error about no particular request)."""


class EpdError(Exception):
    """Base of every epd error. code: snake_case code; message: a sentence; id: the request's id
    or None."""

    code = "error"

    def __init__(self, message="", id=None, code=None):
        if code is not None:
            self.code = code
        self.message = message
        self.id = id
        super().__init__(message)

    def __str__(self):
        where = "" if self.id is None else " (id %d)" % self.id
        return "%s%s: %s" % (self.code, where, self.message)

    def __repr__(self):
        return "%s(code=%r, message=%r, id=%r)" % (type(self).__name__, self.code, self.message,
                                                   self.id)


class DaemonError(EpdError):
    """The daemon answered ERROR. A code this client does not know is raised as DaemonError
    itself, with that code."""


class FramingError(DaemonError):
    """A framing error: the daemon answered ERROR and closed the connection."""


class RequestError(DaemonError):
    """A request-level error: the connection stays open."""


class BadMagic(FramingError):
    code = "bad_magic"


class BadVersion(FramingError):
    code = "bad_version"


class BadType(FramingError):
    code = "bad_type"


class BadHeader(FramingError):
    code = "bad_header"


class FrameTooLarge(FramingError):
    code = "frame_too_large"


class BadJson(FramingError):
    code = "bad_json"


class BadTensor(RequestError):
    code = "bad_tensor"


class UnsupportedDtype(RequestError):
    code = "unsupported_dtype"


class ShapeMismatch(RequestError):
    code = "shape_mismatch"


class ExpertOutOfRange(RequestError):
    code = "expert_out_of_range"


class InvalidTopk(RequestError):
    code = "invalid_topk"


class NonFiniteInput(RequestError):
    code = "non_finite_input"


class TooManyTokens(RequestError):
    code = "too_many_tokens"


class UnknownLayer(RequestError):
    code = "unknown_layer"


class BadRegion(RequestError):
    code = "bad_region"


class ExpertsUnavailable(RequestError):
    code = "experts_unavailable"


class Busy(RequestError):
    """Backpressure (queue full, too many clients, buffers over the limit): try again later."""
    code = "busy"


class ShuttingDown(RequestError):
    code = "shutting_down"


class UnknownOp(RequestError):
    code = "unknown_op"


class Internal(RequestError):
    code = "internal"


class ClientError(EpdError):
    """A failure found by the client itself (nothing was answered by the daemon)."""


class ConnectError(ClientError, ConnectionError):
    code = "connect"


class Timeout(ClientError, TimeoutError):
    code = "timeout"


class ConnectionClosed(ClientError, ConnectionError):
    """The daemon closed the connection (or the client was closed) before the answer came."""
    code = "closed"


class ProtocolError(ClientError):
    """The daemon sent something that is not valid protocol v1."""
    code = "protocol"


class InvalidArgument(ClientError, ValueError):
    code = "invalid_argument"


#: Every wire code of DESIGN.md section 4, in its order, with its class.
WIRE_ERRORS = {cls.code: cls for cls in (
    BadMagic, BadVersion, BadType, BadHeader, FrameTooLarge, BadJson,
    BadTensor, UnsupportedDtype, ShapeMismatch, ExpertOutOfRange, InvalidTopk, NonFiniteInput,
    TooManyTokens, UnknownLayer, BadRegion, ExpertsUnavailable, Busy, ShuttingDown, UnknownOp,
    Internal)}

#: The client's own codes.
CLIENT_ERRORS = {cls.code: cls for cls in (
    ConnectError, Timeout, ConnectionClosed, ProtocolError, InvalidArgument)}


def error_from_meta(meta):
    """The exception for an ERROR frame's meta {"id", "code", "message"}."""
    code = meta.get("code")
    message = meta.get("message")
    req_id = meta.get("id")
    if not isinstance(message, str):
        message = ""
    if not isinstance(req_id, int) or isinstance(req_id, bool):
        req_id = None
    if not isinstance(code, str) or not code:
        return ProtocolError("ERROR frame without a code: %r" % (meta,), id=req_id)
    cls = WIRE_ERRORS.get(code)
    if cls is None:
        return DaemonError(message, id=req_id, code=code)
    return cls(message, id=req_id)
