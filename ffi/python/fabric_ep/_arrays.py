"""Array handling: numpy arrays and torch CPU tensors in, their data addresses and fep dtype
codes out (``fabric_ep._core`` builds the ``fep_tensor`` descriptors from them).

Accepted element types (per ``fep_tensor.dtype``):

===========  =======================================  ==========================================
fep dtype    numpy                                    torch (CPU)
===========  =======================================  ==========================================
bf16         ``uint16``/``int16`` (raw bf16 bits),    ``bfloat16``, ``int16``/``uint16`` (bits)
             ``ml_dtypes.bfloat16`` when installed
fp8 (e4m3)   ``uint8`` (raw bytes),                   ``float8_e4m3fn``, ``uint8`` (bytes)
             ``ml_dtypes.float8_e4m3fn`` if installed
f32          ``float32``                              ``float32``
i64          ``int64``                                ``int64``
i32          ``int32``                                ``int32``
bool         ``bool``                                 ``bool``
===========  =======================================  ==========================================

Outputs are allocated with the same library (and, for token data, the same dtype) as the input
they correspond to, so a caller that passes ``torch.bfloat16`` gets ``torch.bfloat16`` back.
Every check raises with a message that starts with the argument's name.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ._ext import (
    FEP_DTYPE_BF16,
    FEP_DTYPE_BOOL,
    FEP_DTYPE_F32,
    FEP_DTYPE_FP8_E4M3,
    FEP_DTYPE_I32,
    FEP_DTYPE_I64,
    core,
)

DTYPE_NAMES = {
    FEP_DTYPE_BF16: "bf16 (numpy uint16/int16 bits or ml_dtypes.bfloat16; torch.bfloat16)",
    FEP_DTYPE_FP8_E4M3: "fp8 e4m3 (numpy uint8 bytes or ml_dtypes.float8_e4m3fn; "
    "torch.float8_e4m3fn or uint8)",
    FEP_DTYPE_F32: "float32",
    FEP_DTYPE_I64: "int64",
    FEP_DTYPE_I32: "int32",
    FEP_DTYPE_BOOL: "bool",
}

_NP_CODES: Dict[Any, int] = {
    np.dtype(np.uint16): FEP_DTYPE_BF16,
    np.dtype(np.int16): FEP_DTYPE_BF16,
    np.dtype(np.uint8): FEP_DTYPE_FP8_E4M3,
    np.dtype(np.float32): FEP_DTYPE_F32,
    np.dtype(np.int64): FEP_DTYPE_I64,
    np.dtype(np.int32): FEP_DTYPE_I32,
    np.dtype(np.bool_): FEP_DTYPE_BOOL,
}
try:  # optional: real bf16 / fp8 element types for numpy
    import ml_dtypes  # type: ignore

    _NP_CODES[np.dtype(ml_dtypes.bfloat16)] = FEP_DTYPE_BF16
    _NP_CODES[np.dtype(ml_dtypes.float8_e4m3fn)] = FEP_DTYPE_FP8_E4M3
except ImportError:  # pragma: no cover - depends on the environment
    pass

_NP_DEFAULT = {
    FEP_DTYPE_F32: np.dtype(np.float32),
    FEP_DTYPE_I64: np.dtype(np.int64),
    FEP_DTYPE_I32: np.dtype(np.int32),
    FEP_DTYPE_BOOL: np.dtype(np.bool_),
    FEP_DTYPE_BF16: np.dtype(np.uint16),
    FEP_DTYPE_FP8_E4M3: np.dtype(np.uint8),
}

_torch_codes: Optional[Dict[Any, int]] = None
_torch_default: Optional[Dict[int, Any]] = None


def _torch_tables(torch: Any) -> Tuple[Dict[Any, int], Dict[int, Any]]:
    global _torch_codes, _torch_default
    if _torch_codes is None:
        codes = {
            torch.bfloat16: FEP_DTYPE_BF16,
            torch.int16: FEP_DTYPE_BF16,
            torch.uint8: FEP_DTYPE_FP8_E4M3,
            torch.float32: FEP_DTYPE_F32,
            torch.int64: FEP_DTYPE_I64,
            torch.int32: FEP_DTYPE_I32,
            torch.bool: FEP_DTYPE_BOOL,
        }
        for name in ("uint16",):
            if hasattr(torch, name):
                codes[getattr(torch, name)] = FEP_DTYPE_BF16
        if hasattr(torch, "float8_e4m3fn"):
            codes[torch.float8_e4m3fn] = FEP_DTYPE_FP8_E4M3
        _torch_default = {
            FEP_DTYPE_F32: torch.float32,
            FEP_DTYPE_I64: torch.int64,
            FEP_DTYPE_I32: torch.int32,
            FEP_DTYPE_BOOL: torch.bool,
            FEP_DTYPE_BF16: torch.bfloat16,
            FEP_DTYPE_FP8_E4M3: torch.uint8,
        }
        _torch_codes = codes
    assert _torch_default is not None
    return _torch_codes, _torch_default


class Arr:
    """A checked input: its data address, fep dtype code, shape, and how to allocate siblings."""

    __slots__ = ("obj", "ptr", "code", "shape", "is_torch")

    def __init__(self, obj: Any, ptr: int, code: int, shape: Tuple[int, ...], is_torch: bool):
        self.obj = obj
        self.ptr = ptr
        self.code = code
        self.shape = shape
        self.is_torch = is_torch

    def empty(self, shape: Sequence[int], code: Optional[int] = None) -> Any:
        """A new array from the same library; same element type when ``code`` is None."""
        if self.is_torch:
            torch = sys.modules["torch"]
            if code is None:
                return torch.empty(tuple(shape), dtype=self.obj.dtype)
            return torch.empty(tuple(shape), dtype=_torch_tables(torch)[1][code])
        if code is None:
            return np.empty(shape, dtype=self.obj.dtype)
        return np.empty(shape, dtype=_NP_DEFAULT[code])

    def zeros(self, shape: Sequence[int], code: Optional[int] = None) -> Any:
        if self.is_torch:
            torch = sys.modules["torch"]
            dt = self.obj.dtype if code is None else _torch_tables(torch)[1][code]
            return torch.zeros(tuple(shape), dtype=dt)
        return np.zeros(shape, dtype=self.obj.dtype if code is None else _NP_DEFAULT[code])


_address = core.address
_BUF_ERRORS = (TypeError, ValueError, BufferError, NotImplementedError)


def np_ptr(a: np.ndarray) -> int:
    """Data address of a C-contiguous numpy array.

    NOTES: ``a.ctypes.data`` and ``a.__array_interface__`` build helper objects and cost a
    microsecond or more per call; the buffer protocol read in ``_core.address`` costs a tenth of
    that. It refuses non-contiguous arrays and dtypes without a buffer format (ml_dtypes'),
    which take the slow path."""
    try:
        return _address(a)
    except _BUF_ERRORS:
        return a.__array_interface__["data"][0]


def data_ptr(a: Any) -> int:
    """Address of a freshly allocated (contiguous, CPU) array from :meth:`Arr.empty`."""
    if type(a) is np.ndarray:
        return np_ptr(a)
    return a.data_ptr()


def _dtype_error(name: str, got: Any, want: int) -> TypeError:
    return TypeError(f"{name}: dtype {got}, expected {DTYPE_NAMES[want]}")


def _shape_error(name: str, got: Sequence[int], want: Sequence[Optional[int]]) -> ValueError:
    w = "[" + ", ".join("*" if d is None else str(d) for d in want) + "]"
    return ValueError(f"{name}: shape {list(got)}, expected {w}")


def _torch_in(name: str, a: Any, code: Optional[int]) -> Tuple[int, int, Tuple[int, ...]]:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(a, torch.Tensor):
        raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(a).__name__}")
    if a.device.type != "cpu":
        raise ValueError(
            f"{name}: tensor is on {a.device}; this fabric_ep build's C ABI has only the host "
            "backend (CPU threads over host memory): pass CPU tensors or numpy arrays. CUDA "
            "tensors need the GPU backend in the C ABI (not there yet)."
        )
    c = _torch_tables(torch)[0].get(a.dtype)
    if c is None or (code is not None and c != code):
        if code is None:
            raise TypeError(f"{name}: dtype {a.dtype} is not one fabric_ep accepts")
        raise _dtype_error(name, a.dtype, code)
    if not a.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (use .contiguous())")
    return a.data_ptr(), c, tuple(a.shape)


def arr(
    name: str,
    a: Any,
    code: Optional[int],
    shape: Sequence[Optional[int]],
) -> Arr:
    """Checks ``a`` (numpy array or torch CPU tensor): element type ``code`` (None: any the table
    above lists), ``len(shape)`` dimensions with each non-None extent equal, C-contiguous, on the
    host. Returns its :class:`Arr`."""
    if isinstance(a, np.ndarray):
        c = _NP_CODES.get(a.dtype)
        if c is None or (code is not None and c != code):
            if code is None:
                raise TypeError(f"{name}: dtype {a.dtype} is not one fabric_ep accepts")
            raise _dtype_error(name, a.dtype, code)
        shp = a.shape
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous (use numpy.ascontiguousarray)")
        if len(shp) != len(shape):
            raise _shape_error(name, shp, shape)
        for g, w in zip(shp, shape):
            if w is not None and w != g:
                raise _shape_error(name, shp, shape)
        return Arr(a, np_ptr(a), c, shp, False)
    ptr, c, shp = _torch_in(name, a, code)
    if len(shp) != len(shape):
        raise _shape_error(name, shp, shape)
    for g, w in zip(shp, shape):
        if w is not None and w != g:
            raise _shape_error(name, shp, shape)
    return Arr(a, ptr, c, shp, True)


def in2(
    name: str, a: Any, code: Optional[int], d0: Optional[int], d1: int
) -> Tuple[int, int, int, bool]:
    """:func:`arr` for the hot path: a 2-D input ``[d0 (None: any), d1]``. Returns ``(data
    address, fep dtype code, rows, is_torch)`` without building an :class:`Arr`."""
    if type(a) is np.ndarray:
        c = _NP_CODES.get(a.dtype)
        if c is None or (code is not None and c != code):
            if code is None:
                raise TypeError(f"{name}: dtype {a.dtype} is not one fabric_ep accepts")
            raise _dtype_error(name, a.dtype, code)
        shp = a.shape
        if len(shp) != 2 or shp[1] != d1 or (d0 is not None and shp[0] != d0):
            raise _shape_error(name, shp, (d0, d1))
        try:
            # Refuses non-contiguous arrays itself (checked below, on the slow path).
            return _address(a), c, shp[0], False
        except _BUF_ERRORS:
            if not a.flags.c_contiguous:
                raise ValueError(
                    f"{name}: must be C-contiguous (use numpy.ascontiguousarray)"
                ) from None
            return a.__array_interface__["data"][0], c, shp[0], False
    r = arr(name, a, code, (d0, d1))
    return r.ptr, r.code, r.shape[0], r.is_torch


def alloc(like: Any, shape: Tuple[int, ...]) -> Tuple[Any, int]:
    """A new array of ``like``'s library and dtype, and its data address (hot path)."""
    if type(like) is np.ndarray:
        a = np.empty(shape, like.dtype)
        return a, np_ptr(a)
    torch = sys.modules["torch"]
    a = torch.empty(shape, dtype=like.dtype)
    return a, a.data_ptr()


def empty_like_kind(like: Any, shape: Tuple[int, ...], code: Optional[int] = None) -> Any:
    """A new array of ``like``'s library: ``like``'s dtype when ``code`` is None."""
    if type(like) is np.ndarray:
        return np.empty(shape, like.dtype if code is None else _NP_DEFAULT[code])
    torch = sys.modules["torch"]
    return torch.empty(shape, dtype=like.dtype if code is None else _torch_tables(torch)[1][code])


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(f: np.ndarray) -> np.ndarray:
    """Round to nearest even (the GPU's and torch's rounding); NaN stays NaN."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        r[nan] = 0x7FC0
    return r


def add_bf16_inplace(out: Any, biases: Tuple[Any, ...]) -> None:
    """``out += sum(biases)`` for bf16 arrays of the host backend (numpy bits or ml_dtypes,
    torch CPU), in float32, rounded once."""
    if type(out) is np.ndarray:
        for b in biases:
            if type(b) is not np.ndarray or b.dtype != out.dtype:
                raise TypeError(f"bias: expected a numpy array of {out.dtype}, got "
                                f"{type(b).__name__} {getattr(b, 'dtype', '')}")
        if out.dtype.kind in "ui":
            s = _bf16_bits_to_f32(out.view(np.uint16))
            for b in biases:
                s = s + _bf16_bits_to_f32(b.view(np.uint16))
            out.view(np.uint16)[...] = _f32_to_bf16_bits(s)
        else:
            s = out.astype(np.float32)
            for b in biases:
                s = s + b.astype(np.float32)
            out[...] = s.astype(out.dtype)
        return
    acc = out.float()
    for b in biases:
        acc += b.float()
    out.copy_(acc)
