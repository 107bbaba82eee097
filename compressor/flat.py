"""Results as flat tensors: nested Python values and tensors as int64 codes plus raw bytes, what
:mod:`compressor.distributed` sends between ranks instead of pickles (nothing received can run
code; every float arrives bit for bit)."""

from __future__ import annotations

import struct

import torch

__all__ = ["pack", "unpack"]

#: dtypes a packed tensor may have, by code
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
_NONE, _BOOL, _INT, _FLOAT, _STR, _TUPLE, _LIST, _DICT, _TENSOR = range(9)


def pack(obj) -> tuple[list[int], list[torch.Tensor]]:
    """``obj`` as int64 codes and byte tensors (what :func:`unpack` reads back): nested tuples,
    lists and dicts of tensors (the dtypes of :data:`_DTYPES`, any device), ``str``, ``int``
    (64-bit), ``float`` (its bits), ``bool`` and ``None``. Each tensor's bytes are its own
    uint8 tensor, on its device.

    Raises:
        TypeError: another type, an int past 64 bits or a tensor dtype not listed.
    """
    codes: list[int] = []
    chunks: list[torch.Tensor] = []

    def walk(x):
        if x is None:
            codes.append(_NONE)
        elif isinstance(x, bool):
            codes.extend((_BOOL, int(x)))
        elif isinstance(x, int):
            if not -2**63 <= x < 2**63:
                raise TypeError(f"cannot send an int past 64 bits: {x}")
            codes.extend((_INT, x))
        elif isinstance(x, float):
            codes.extend((_FLOAT, struct.unpack("<q", struct.pack("<d", x))[0]))
        elif isinstance(x, str):
            data = x.encode()
            codes.extend((_STR, len(data)))
            chunks.append(torch.tensor(list(data), dtype=torch.uint8))
        elif isinstance(x, (tuple, list)):
            codes.extend((_TUPLE if isinstance(x, tuple) else _LIST, len(x)))
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            codes.extend((_DICT, len(x)))
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, torch.Tensor):
            if x.dtype not in _DTYPES:
                raise TypeError(f"cannot send a {x.dtype} tensor")
            codes.extend((_TENSOR, _DTYPES.index(x.dtype), int(x.device.type != "cpu"), x.dim(), *x.shape))
            chunks.append(x.detach().contiguous().reshape(-1).view(torch.uint8))
        else:
            raise TypeError(f"cannot send a {type(x).__name__}")

    walk(obj)
    return codes, chunks


def unpack(codes: list[int], payload: torch.Tensor):
    """The object :func:`pack` gave ``codes`` for, its tensors and strings read in order from
    ``payload`` (the chunks joined: uint8, 1-D). Every tensor gets storage of its own, on the
    CPU or on ``payload``'s device as the packed one was."""
    pos, off = 0, 0

    def take(n: int) -> torch.Tensor:
        nonlocal off
        off += n
        return payload[off - n:off]

    def walk():
        nonlocal pos
        tag = codes[pos]
        pos += 1
        if tag == _NONE:
            return None
        if tag in (_BOOL, _INT, _FLOAT, _STR):
            v = codes[pos]
            pos += 1
            if tag == _BOOL:
                return bool(v)
            if tag == _FLOAT:
                return struct.unpack("<d", struct.pack("<q", v))[0]
            return bytes(take(v).cpu().numpy()).decode() if tag == _STR else v
        if tag in (_TUPLE, _LIST, _DICT):
            n = codes[pos]
            pos += 1
            if tag == _DICT:
                return {walk(): walk() for _ in range(n)}
            items = [walk() for _ in range(n)]
            return tuple(items) if tag == _TUPLE else items
        dtype, on_device, ndim = _DTYPES[codes[pos]], codes[pos + 1], codes[pos + 2]
        shape = codes[pos + 3:pos + 3 + ndim]
        pos += 3 + ndim
        numel = 1
        for s in shape:
            numel *= s
        t = take(numel * dtype.itemsize).clone().view(dtype).reshape(shape)
        return t if on_device or t.device.type == "cpu" else t.cpu()

    return walk()
