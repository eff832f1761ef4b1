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


def wire_dtype(x, dtype=None):
    """The DType of tensor `x`; `dtype` ("f32", "f16", "bf16" or a DType) overrides it."""
    if dtype is not None:
        d = DTYPES.get(dtype, dtype)
        if d not in ELEM_BYTES:
            raise invalid(f"dtype: {dtype!r} is not f32, f16 or bf16")
        return d
    if is_torch(x):
        t = _torch()
        found = {t.float32: pb.DTYPE_F32, t.float16: pb.DTYPE_F16, t.bfloat16: pb.DTYPE_BF16}
        if x.dtype in found:
            return found[x.dtype]
        raise invalid(f"dtype: torch {x.dtype} is not float32, float16 or bfloat16")
    a = np.asarray(x)
    if a.dtype == np.float32:
        return pb.DTYPE_F32
    if a.dtype == np.float16:
        return pb.DTYPE_F16
    if a.dtype == np.uint16:
        raise invalid("dtype: a uint16 array needs dtype='bf16' (numpy has no bfloat16)")
    raise invalid(f"dtype: numpy {a.dtype} is not float32 or float16 (bf16: uint16 + dtype)")


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
