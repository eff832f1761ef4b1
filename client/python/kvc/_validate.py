"""Argument checks shared by kvc.Client and kvc.aio.Client.

Every refusal is a KvcError with INVALID_ARGUMENT whose message starts with the argument's name,
like the server's and the C++ client's.
"""

import math
import numbers

from .errors import invalid

TENSOR_KINDS = ("numpy", "torch", "auto")
_U32_MAX = (1 << 32) - 1


def cache_id(value, field="cache_id"):
    """A cache id as str: str as is, bytes decoded as UTF-8 (the wire type); anything else, an
    empty id or bytes that are not UTF-8 are refused."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise invalid(f"{field}: byte {e.start} is not valid UTF-8") from None
    if not isinstance(value, str):
        raise invalid(f"{field}: expected str or bytes, got {type(value).__name__}")
    if not value:
        raise invalid(f"{field}: empty")
    return value


def prefix(value, field="prefix"):
    """Like cache_id, but empty is allowed (every id)."""
    if isinstance(value, (bytes, bytearray, memoryview, str)) and len(value) == 0:
        return ""
    return cache_id(value, field)


def uint32(value, field, low=0):
    """An int in [low, 2^32 - 1] (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise invalid(f"{field}: expected an int, got {type(value).__name__}")
    if not low <= value <= _U32_MAX:
        raise invalid(f"{field}: {value} is outside [{low}, {_U32_MAX}]")
    return int(value)


def seconds(value, field, positive=True):
    """A finite number of seconds, > 0 (or >= 0 when not `positive`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise invalid(f"{field}: expected a number of seconds, got {type(value).__name__}")
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise invalid(f"{field}: {value} must be finite and {'> 0' if positive else '>= 0'}")
    return float(value)


def tensor_kind(value):
    if value not in TENSOR_KINDS:
        raise invalid(f"tensors: {value!r} is not 'numpy', 'torch' or 'auto'")
    return value
