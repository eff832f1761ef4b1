"""Tensors in and out: numpy arrays or torch tensors (torch is optional) <-> wire bytes.

bf16 travels as its 16 bits: a torch.bfloat16 tensor goes as is; a numpy array of bf16 bits is a
uint16 array with dtype="bf16" given. Contiguous CPU buffers are read in place (the only copy is
into the gRPC message); anything else is made contiguous first.
"""

import sys

import numpy as np

from .errors import invalid
from ._pb import pb

DTYPES = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
ELEM_BYTES = {pb.DTYPE_F32: 4, pb.DTYPE_F16: 2, pb.DTYPE_BF16: 2}
_NP = {pb.DTYPE_F32: np.float32, pb.DTYPE_F16: np.float16, pb.DTYPE_BF16: np.uint16}


def _torch():
    return sys.modules.get("torch")


def is_torch(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _describe(x):
    """'numpy float32', 'torch torch.int32', ...: the element type of `x`, for messages."""
    if is_torch(x):
        return f"torch {x.dtype}"
    return f"numpy {np.asarray(x).dtype}"


# What each wire dtype accepts: numpy dtypes and torch dtype names.
_ACCEPTS = {pb.DTYPE_F32: ((np.float32,), ("float32",)),
            pb.DTYPE_F16: ((np.float16,), ("float16",)),
            pb.DTYPE_BF16: ((np.uint16, np.int16), ("bfloat16",))}
_NEEDS = {pb.DTYPE_F32: "float32", pb.DTYPE_F16: "float16",
          pb.DTYPE_BF16: "torch.bfloat16, or bf16 bits as numpy uint16"}


def wire_dtype(x, dtype=None, name="tensor"):
    """The DType of tensor `x` (named `name` in messages); `dtype` ("f32", "f16", "bf16" or a
    DType) overrides it, and `x` must then hold that type."""
    if dtype is not None:
        d = DTYPES.get(dtype, dtype) if isinstance(dtype, (str, int)) else None
        if d not in ELEM_BYTES:
            raise invalid(f"dtype: {dtype!r} is not f32, f16 or bf16")
        check_dtype(x, d, name, f"dtype={dtype!r}")
        return d
    if is_torch(x):
        t = _torch()
        found = {t.float32: pb.DTYPE_F32, t.float16: pb.DTYPE_F16, t.bfloat16: pb.DTYPE_BF16}
        if x.dtype in found:
            return found[x.dtype]
        raise invalid(f"{name}: torch {x.dtype} is not float32, float16 or bfloat16")
    a = np.asarray(x)
    if a.dtype == np.float32:
        return pb.DTYPE_F32
    if a.dtype == np.float16:
        return pb.DTYPE_F16
    if a.dtype == np.uint16:
        raise invalid(f"{name}: a uint16 array needs dtype='bf16' (numpy has no bfloat16)")
    raise invalid(f"{name}: numpy {a.dtype} is not float32 or float16 (bf16: uint16 + dtype)")


def check_dtype(x, wire, name, source):
    """Refuses `x` (named `name`) unless its elements are of wire dtype `wire`, which came from
    `source` (e.g. "dtype='f16'" or "layers[0].k"): integers are never taken for floats."""
    np_types, torch_names = _ACCEPTS[wire]
    if is_torch(x):
        ok = str(x.dtype).replace("torch.", "") in torch_names
    else:
        ok = np.asarray(x).dtype.type in np_types
    if not ok:
        raise invalid(f"{name}: {_describe(x)} elements do not match {source} "
                      f"({pb.DType.Name(wire)} needs {_NEEDS[wire]})")


def stats_bytes(x, name):
    """q_stats as float32 bytes: float16/32/64 (numpy or torch) are converted; integers and
    anything else are refused (their bits would be read as floats)."""
    if is_torch(x):
        if not x.dtype.is_floating_point:
            raise invalid(f"{name}: torch {x.dtype} is not a float type (q_stats are float32)")
        t = _torch()
        x = x.detach().cpu().to(t.float32).contiguous()
        return memoryview(x.numpy().reshape(-1).view(np.uint8))
    a = np.asarray(x)
    if a.dtype.kind != "f":
        raise invalid(f"{name}: numpy {a.dtype} is not a float type (q_stats are float32)")
    a = np.ascontiguousarray(a, dtype=np.float32)
    return memoryview(a.reshape(-1).view(np.uint8))


def shape_of(x):
    return tuple(int(s) for s in x.shape)


def as_bytes(x, dtype):
    """A flat byte view of `x` (copied only when not contiguous, on a GPU or of another dtype)."""
    if is_torch(x):
        t = _torch()
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.contiguous()
        if x.dtype == t.bfloat16:
            x = x.view(t.int16)
        a = x.numpy()
    else:
        a = np.ascontiguousarray(x)
    want = _NP[dtype]
    if a.dtype.itemsize != np.dtype(want).itemsize:
        raise invalid(f"tensor: {a.dtype} elements do not match dtype {pb.DType.Name(dtype)}")
    return memoryview(a.reshape(-1).view(np.uint8))


def from_bytes(buf, dtype, shape, kind="auto"):
    """Wraps `buf` (a writable uint8 array, not copied) as `shape` of `dtype`.

    kind: "numpy", "torch", or "auto" (numpy, except bf16 as torch.bfloat16 when torch imports;
    bf16 in numpy is uint16 bits).
    """
    if kind not in ("numpy", "torch", "auto"):
        raise invalid(f"tensors: {kind!r} is not 'numpy', 'torch' or 'auto'")
    a = buf.view(_NP[dtype]).reshape(shape)
    if kind == "numpy":
        return a
    if kind == "auto" and dtype != pb.DTYPE_BF16:
        return a
    try:
        import torch
    except ImportError:
        if kind == "torch":
            raise invalid("tensors='torch': torch is not installed")
        return a
    if dtype == pb.DTYPE_BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
