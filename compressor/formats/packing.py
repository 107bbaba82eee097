"""The one bit packer every format uses: a dense little-endian bit stream per row.

Element ``j`` of a row occupies bits ``j*b .. j*b+b-1`` of the row's int32 word stream
(crossing words when ``b`` does not divide 32; unused tail bits are 0). This is
compressed-tensors' ``pack_to_int32`` (0.18+, dense packing, PR #732) and AutoGPTQ's
``pack()`` (``32 // b`` values per word for 2/4/8 bits, the 10-1-10-1-10 scheme for 3
bits); see ``docs/formats.md``. AWQ's nibble interleave is a column permutation on top
(:mod:`.awq`).

Memory: rows are processed in blocks of about :data:`_CHUNK_ELEMS` values, so the
transient is a few int64 copies of one block (about 8 MiB per copy) whatever the
matrix size; no per-bit expansion.
"""

from __future__ import annotations

import sys

import torch

from ..errors import InputError

_MASK32 = 0xFFFFFFFF
_CHUNK_ELEMS = 1 << 20  # rows are packed in blocks of about this many values (bounded memory)


def n_words(n: int, num_bits: int) -> int:
    """Int32 words holding ``n`` values of ``num_bits`` bits: ``ceil(n * b / 32)``."""
    return -(-n * num_bits // 32)


def _positions(n: int, num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(n, dtype=torch.int64) * num_bits
    return pos // 32, pos % 32


def row_blocks(rows: int, n: int, elems: int = _CHUNK_ELEMS):
    """``(r0, r1)`` row ranges of about ``elems`` values each (rows of ``n`` values)."""
    step = max(1, elems // max(n, 1))
    return ((r0, min(rows, r0 + step)) for r0 in range(0, rows, step))


def count_outside(t: torch.Tensor, lo: int, hi: int) -> int:
    """Number of entries of ``t`` outside ``[lo, hi]``."""
    return int(((t < lo) | (t > hi)).sum())


@torch.no_grad()
def pack_rows(values: torch.Tensor, num_bits: int, offset: int = 0) -> torch.Tensor:
    """Pack ``u = values + offset`` (each in ``[0, 2^b)``), ``values [rows, n]`` any int dtype,
    into int32 ``[rows, ceil(n*b/32)]``.

    Element ``j`` of a row occupies bits ``j*b .. j*b+b-1`` of the row's word stream
    (little-endian, crossing words when ``b`` does not divide 32; unused tail bits are 0).
    Each value is masked to ``b`` bits, so nothing can bleed into a neighbour; callers
    validate the range first. Vectorised over blocks of rows; peak extra memory is a few
    int64 copies of one block (no per-bit expansion).
    """
    rows, n = values.shape
    words_per_row = n_words(n, num_bits)
    if 32 % num_bits == 0 and n % (32 // num_bits) == 0:
        return _pack_aligned(values, num_bits, offset)
    word, off = _positions(n, num_bits)
    spill = 32 - off
    mask = (1 << num_bits) - 1
    out = torch.empty(rows, words_per_row, dtype=torch.int32)
    for r0, r1 in row_blocks(rows, n):
        u = values[r0:r1].to(torch.int64, copy=True)
        u.add_(offset).bitwise_and_(mask)
        acc = torch.zeros(r1 - r0, words_per_row + 1, dtype=torch.int64)  # spare word for the spill index
        part = torch.bitwise_left_shift(u, off).bitwise_and_(_MASK32)
        acc.index_add_(1, word, part)
        # the high part is non-zero only for values that cross into the next word
        acc.index_add_(1, word + 1, torch.bitwise_right_shift(u, spill, out=part))
        del u, part
        acc = acc[:, :words_per_row]
        out[r0:r1] = torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)
    return out


def _pack_aligned(values: torch.Tensor, num_bits: int, offset: int) -> torch.Tensor:
    """:func:`pack_rows` when ``b`` divides 32 and the row fills whole words (2/4/8 bits): each
    word is the sum of its ``32/b`` shifted fields (no field crosses a word), the same bits as
    the general path's ``index_add``s at a fraction of their time. On a little-endian host the
    fields are or-ed into bytes (``8/b`` per byte, uint8 arithmetic, wrapping like the int32
    words) whose memory is the int32 words: one byte-sized pass instead of int64 copies."""
    rows, n = values.shape
    if sys.byteorder == "little" and num_bits == 4 and values.dtype in (torch.int8, torch.uint8) \
            and values.is_contiguous() and values.storage_offset() % 2 == 0 and rows and n:
        return _pack_nibbles(values, offset)
    if sys.byteorder == "little" and 8 % num_bits == 0:
        per_byte, mask = 8 // num_bits, (1 << num_bits) - 1
        u = values.to(torch.uint8, copy=True)  # modulo 256, as is the offset: the low b bits are those of values + offset
        u = u.add_(offset & 0xFF).bitwise_and_(mask).view(rows, n // per_byte, per_byte)
        packed = u[..., 0].contiguous()  # a copy (u's rows hold per_byte values)
        for k in range(1, per_byte):
            packed.bitwise_or_(u[..., k] << (k * num_bits))
        return packed.view(torch.int32) if rows and n else torch.zeros(rows, n // (32 // num_bits), dtype=torch.int32)
    per = 32 // num_bits
    shifts = torch.arange(per, dtype=torch.int64) * num_bits
    mask = (1 << num_bits) - 1
    out = torch.empty(rows, n // per, dtype=torch.int32)
    for r0, r1 in row_blocks(rows, n):
        u = values[r0:r1].to(torch.int64, copy=True)
        u.add_(offset).bitwise_and_(mask)
        acc = torch.bitwise_left_shift(u.view(r1 - r0, n // per, per), shifts).sum(-1)
        del u
        out[r0:r1] = torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)
    return out


def _pack_nibbles(values: torch.Tensor, offset: int) -> torch.Tensor:
    """:func:`_pack_aligned` at 4 bits for contiguous 8-bit ``values [rows, n]`` (``n`` even) on a
    little-endian host: each pair of values read as one int16 (the first in the low byte), its two
    nibbles offset without a carry between them (``(v & 15) + (offset & 15)`` fits a byte) and folded
    into the low byte, :data:`_CHUNK_ELEMS` values at a time (their temporaries stay in cache);
    about 3x faster than the byte-wise path. Returns int32 ``[rows, n / 8]``."""
    rows, n = values.shape
    pairs = values.reshape(-1).view(torch.int16).view(rows, n // 2)  # flat first: a size-1 row's stride may be odd
    out = torch.empty(rows, n // 2, dtype=torch.uint8)
    add = (offset & 0xF) * 0x0101
    for r0, r1 in row_blocks(rows, n, 1 << 18):
        y = (pairs[r0:r1] & 0x0F0F).add_(add).bitwise_and_(0x0F0F)  # (v + offset) mod 16 in each byte
        out[r0:r1] = y.bitwise_or_(y >> 4).bitwise_and_(0xFF)  # low nibble: the first value; high: the second
    return out.view(torch.int32)


@torch.no_grad()
def unpack_signed(words: torch.Tensor, num_bits: int, n: int) -> torch.Tensor:
    """:func:`unpack_rows` minus the offset ``2^(b-1)``: int32 ``[rows, ceil(n*b/32)]`` -> int8
    ``[rows, n]`` in ``[-2^(b-1), 2^(b-1))`` (compressed-tensors' ``pack-quantized`` values).

    When ``b`` divides 8 on a little-endian host (2/4/8 bits) the words' bytes are read as
    uint8 and each field shifted out of its byte (no int64 copy, no gather): about 5x faster
    than the general path at 4 bits; other widths take :func:`unpack_rows` a row block at a time.

    Raises:
        InputError: the word count does not match ``n`` values of ``num_bits`` bits.
    """
    rows, words_per_row = words.shape
    if words_per_row != n_words(n, num_bits):
        raise InputError(f"packed tensor has {words_per_row} words per row, expected {n_words(n, num_bits)} "
                         f"for {n} {num_bits}-bit values")
    out = torch.empty(rows, n, dtype=torch.int8)
    offset = 1 << (num_bits - 1)
    if sys.byteorder == "little" and 8 % num_bits == 0 and words.dtype == torch.int32:
        per_byte, mask = 8 // num_bits, (1 << num_bits) - 1
        raw = words.contiguous().view(torch.uint8)  # [rows, 4 * words]
        for r0, r1 in row_blocks(rows, n):
            b = raw[r0:r1]
            fields = torch.empty(r1 - r0, b.shape[1], per_byte, dtype=torch.int16)
            for k in range(per_byte):
                fields[..., k] = ((b >> (k * num_bits)) & mask).to(torch.int16)
            out[r0:r1] = (fields.view(r1 - r0, -1)[:, :n] - offset).to(torch.int8)
        return out
    for r0, r1 in row_blocks(rows, n):  # int64 only one block at a time
        out[r0:r1] = unpack_rows(words[r0:r1], num_bits, n) - offset
    return out


@torch.no_grad()
def unpack_rows(words: torch.Tensor, num_bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int32 ``[rows, ceil(n*b/32)]`` -> int64 ``[rows, n]`` in ``[0, 2^b)``.

    Raises:
        InputError: the word count does not match ``n`` values of ``num_bits`` bits.
    """
    rows, words_per_row = words.shape
    if words_per_row != n_words(n, num_bits):
        raise InputError(
            f"packed tensor has {words_per_row} words per row, expected {n_words(n, num_bits)} for {n} {num_bits}-bit values"
        )
    word, off = _positions(n, num_bits)
    mask = (1 << num_bits) - 1
    out = torch.empty(rows, n, dtype=torch.int64)
    for r0, r1 in row_blocks(rows, n):
        w = torch.nn.functional.pad(words[r0:r1].to(torch.int64) & _MASK32, (0, 1))
        lo = w[:, word] >> off
        hi = w[:, word + 1] << (32 - off)
        out[r0:r1] = (lo | hi) & mask
    return out
