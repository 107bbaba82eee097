"""Library entry points behind the CLI: one options object in, one summary dict out.

A façade over :mod:`compressor.commands` (one module per command); import from here or
from there.
"""

from __future__ import annotations

from .commands.common import load_reference
from .commands.options import OptionError, QuantizeOptions, SmokeOptions, VerifyOptions
from .commands.quantize import run_quantize
from .commands.serve_smoke import run_serve_smoke
from .commands.sign import run_sign
from .commands.verify import run_verify

__all__ = ["OptionError", "QuantizeOptions", "SmokeOptions", "VerifyOptions", "load_reference", "run_quantize",
           "run_serve_smoke", "run_sign", "run_verify"]
