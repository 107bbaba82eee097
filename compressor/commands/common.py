"""Helpers shared by the commands: the reference model, peak memory."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (one decimal)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def load_reference(spec: str, source, artifact_dtype=None):
    """The reference model of ``verify`` / ``serve-smoke``, as a float model on the CPU.

    Args:
        spec: what the user named (``--reference`` or the manifest's source spec).
        source: ``spec`` resolved by :func:`compressor.models.resolve_source`.

    Returns:
        A ``PreTrainedModel``: a kvq artifact (a folder with a manifest) or another
        tool's packed artifact (``quantization_config.quant_method`` compressed-tensors,
        awq or gptq: the source of an artifact whose weights kvq carried unchanged)
        dequantized by kvq's readers to ``artifact_dtype`` (default float32; verify passes
        the dtype it evaluates the artifact in, so an artifact compared with itself shows
        no difference); anything else loaded as the original, in float32.

    Raises:
        InputError: the source cannot be read (from the loaders).
    """
    from ..artifact import load_artifact
    from ..manifest import MANIFEST_NAME
    from ..models import load_model
    from .kv_only import packed_method

    if Path(spec).is_dir() and ((Path(spec) / MANIFEST_NAME).is_file() or packed_method(Path(spec)) is not None):
        return load_artifact(spec, **({} if artifact_dtype is None else {"dtype": artifact_dtype}))[0]
    return load_model(source)[0]
