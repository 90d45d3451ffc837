"""epd: the Python client of epd, the expert-parallel MoE dispatch daemon (wire protocol v1 of
DESIGN.md sections 4 and 4b over the rank's Unix socket). numpy only; torch tensors (CPU, and
CUDA through device regions) when torch is installed.

    import epd
    with epd.Client("/run/epd/epd-0.sock") as c:
        y = c.submit(x, topk_ids, topk_weights)     # x bf16 [N, H] -> y bf16 [N, H]
"""
from . import bf16, frame
from .aio import AsyncClient, AsyncPrepared
from .client import DEFAULT_SOCKET, Client, Prepared
from .errors import (CLIENT_ERRORS, WIRE_ERRORS, BadHeader, BadJson, BadMagic, BadRegion,
                     BadTensor, BadType, BadVersion, Busy, ClientError, ConnectError,
                     ConnectionClosed, DaemonError, EpdError, ExpertOutOfRange,
                     ExpertsUnavailable, FrameTooLarge, FramingError, Internal, InvalidArgument,
                     InvalidTopk, NonFiniteInput, ProtocolError, RequestError, ShapeMismatch,
                     ShuttingDown, Timeout, TooManyTokens, UnknownLayer, UnknownOp,
                     UnsupportedDtype, error_from_meta)
from .group import Group, GroupPrepared
from .regions import HostRegion
from ._session import Pending

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncPrepared", "BadHeader", "BadJson", "BadMagic", "BadRegion", "BadTensor",
    "BadType", "BadVersion", "Busy", "CLIENT_ERRORS", "Client", "ClientError", "ConnectError",
    "ConnectionClosed", "DEFAULT_SOCKET", "DaemonError", "EpdError", "ExpertOutOfRange",
    "ExpertsUnavailable", "FrameTooLarge", "FramingError", "Group", "GroupPrepared", "HostRegion",
    "Internal", "InvalidArgument", "InvalidTopk", "NonFiniteInput", "Pending", "Prepared",
    "ProtocolError", "RequestError", "ShapeMismatch", "ShuttingDown", "Timeout", "TooManyTokens",
    "UnknownLayer", "UnknownOp", "UnsupportedDtype", "WIRE_ERRORS", "bf16", "error_from_meta",
    "frame",
]
