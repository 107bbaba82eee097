"""Integer weights of one Linear, read from an artifact's packed tensors (no float copy).

The readers live with the formats (:mod:`compressor.formats`: one object per on-disk
format with its writer, reader, config and checks); this module re-exports what the
runtime uses, so the import direction stays runtime -> formats. See
:class:`compressor.formats.base.QuantWeight` for the record's fields and shapes.
"""

from __future__ import annotations

from ..formats import MARKER, PACKED_LEAVES, QuantWeight, read_quant_weight

__all__ = ["MARKER", "PACKED_LEAVES", "QuantWeight", "read_quant_weight"]
