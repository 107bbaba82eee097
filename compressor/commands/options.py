"""Options of the kvq commands: a few typed sub-configs per command, validated here only.

Each command's options object (:class:`QuantizeOptions`, :class:`VerifyOptions`,
:class:`SmokeOptions`) groups its settings into sub-configs (what to quantize, the
calibration, the artifact to write, how to run; or the evaluation, the KV cache, the
gates). Ranges, finiteness and combinations of options are checked when the object is
built, so the command line and library callers get the same refusals; ``kvq``'s click
options take their ranges from here (:func:`bounds`).

Callers may pass the sub-configs' fields as flat keywords, as the command line names
them (``QuantizeOptions(model=..., output=..., calib_samples=8, group_size=32)``); each
class's ``FLAT`` table says where each one goes.

Every invalid value or combination raises :class:`OptionError` (an
:class:`~compressor.errors.InputError`, exit code 2) naming the option. This module
imports neither torch nor transformers (``kvq verify --hashes-only`` starts in a second).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Annotated, Any, ClassVar, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, InstanceOf, ValidationError, field_validator, model_validator

from ..errors import InputError
from ..gates import gates_of
from ..signing import SignOptions, VerifyKeys


class OptionError(InputError):
    """An option value, or a combination of options, that a command refuses (exit code 2).

    Attributes:
        reason: what is wrong (``must be a finite number``).
        option: the option's flat keyword (``max_kl``), ``None`` for a combination.
        hint: how the message names the culprit, as written (``--group-size``);
            ``None``: the option's flag, quoted as click quotes it (or nothing, for a combination).
    """

    def __init__(self, reason: str, option: Optional[str] = None, hint: Optional[str] = None):
        self.reason, self.option, self.hint = reason, option, hint
        where = hint or option
        super().__init__(f"{where}: {reason}" if where else reason)


def _text(value):
    """Paths given for text options (model, calibration file, ...) become strings."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


#: a text option that may be given as a path (model, calibration file, prompts, ...)
Text = Annotated[str, BeforeValidator(_text)]


#: the largest memory budget an option accepts, in GiB (1 PiB: larger numbers are typos)
MAX_GIB = float(1 << 20)


def _finite(default, **bounds):
    """A float option that must be a finite number (NaN/Inf would poison gates and arithmetic)."""
    return Field(default, allow_inf_nan=False, **bounds)


class _Section(BaseModel):
    """A sub-config: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class _Options(_Section):
    """A command's options: sub-configs, flat keywords nested, every error an :class:`OptionError`."""

    #: flat keyword -> (sub-config field, its field)
    FLAT: ClassVar[dict[str, tuple[str, str]]] = {}

    @model_validator(mode="wrap")
    @classmethod
    def _nest_and_name_errors(cls, data: Any, handler):
        if isinstance(data, dict):
            data = cls._nest(data)
        try:
            return handler(data)
        except ValidationError as e:
            raise cls._option_error(e) from None

    @classmethod
    def _nest(cls, data: dict) -> dict:
        out = {k: v for k, v in data.items() if k not in cls.FLAT}
        for key, value in data.items():
            if key in cls.FLAT:
                section, name = cls.FLAT[key]
                given = out.get(section)
                if isinstance(given, BaseModel):
                    given = {f: getattr(given, f) for f in type(given).model_fields}
                out[section] = {**(given or {}), name: value}
        return out

    @classmethod
    def _option_error(cls, e: ValidationError) -> OptionError:
        first = e.errors()[0]
        loc = tuple(str(x) for x in first["loc"])
        flat = {v: k for k, v in cls.FLAT.items()}
        option = flat.get(loc[:2]) or ".".join(loc)
        reason = "must be a finite number" if first["type"] == "finite_number" else first["msg"]
        return OptionError(reason, option)


def bounds(options: type[_Options], flat: str) -> dict:
    """Range of option ``flat`` of ``options`` as ``{min, max, min_open, max_open}``
    (``None``: unbounded), for the command line's range types."""
    section, name = options.FLAT.get(flat, (None, flat))
    model = options if section is None else options.model_fields[section].annotation
    out = {"min": None, "max": None, "min_open": False, "max_open": False}
    for m in model.model_fields[name].metadata:
        for attr, key, is_open in (("ge", "min", False), ("gt", "min", True), ("le", "max", False), ("lt", "max", True)):
            if getattr(m, attr, None) is not None:
                out[key] = getattr(m, attr)
                out[f"{key}_open"] = is_open
    return out


# ---------------------------------------------------------------------------------------
# kvq quantize

#: the recipe ``kvq quantize`` uses without ``--recipe`` (marked in ``kvq recipes``)
DEFAULT_RECIPE = "w4a16-awq"


class SchemeOptions(_Section):
    """What to quantize: recipes (later ones override earlier ones) and flag overrides
    (``None`` keeps the recipe's value)."""

    recipes: tuple[str, ...] = (DEFAULT_RECIPE,)
    kv_scheme: Optional[str] = None  # shortcut: adds kv_cache {scheme: ...} with its defaults
    algorithm: Optional[str] = None
    bits: Optional[int] = Field(None, ge=2, le=8)
    group_size: Optional[Union[int, str]] = None  # an integer, -1 (per channel) or "auto"
    symmetric: Optional[bool] = None
    act_order: Optional[bool] = None
    settings: tuple[tuple[str, Any], ...] = ()  # (dotted recipe key, value) pairs from --set

    @field_validator("recipes", mode="before")
    @classmethod
    def _one_or_several(cls, v):
        return (_text(v),) if isinstance(v, (str, os.PathLike)) else tuple(_text(x) for x in v)

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_size(cls, v):
        if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        try:
            return int(v)
        except (TypeError, ValueError):
            raise OptionError("must be an integer, -1 or 'auto'", "group_size", hint="--group-size") from None


class CalibrationOptions(_Section):
    """Calibration text and how it is sampled."""

    source: Text = "embedded"  # file, 'embedded', named set, or a .safetensors of token ids
    field: str = "text"  # text column of a .jsonl/.parquet file
    samples: int = Field(128, ge=1, le=1_000_000)
    seqlen: int = Field(512, ge=2, le=1_048_576)
    seed: int = Field(0, ge=0, le=2**63 - 1)  # torch's generators take a 64-bit seed


class WriteOptions(_Section):
    """The artifact written: on-disk format, storage dtype, digests, shards, signature."""

    format: str = "compressed-tensors"
    #: storage and declared dtype; ``auto`` follows the source (compressor.source.resolve.storage_dtype)
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    #: keep --dtype float16 although a layer's activations exceed float16's range (said in the manifest)
    allow_float16_overflow: bool = False
    overwrite: bool = False
    digest_algorithm: str = "sha256"  # manifest digests: sha256 | blake3
    shard_bytes: int = Field(5 * 10**9, ge=1)  # maximum data bytes per output shard (the CLI asks >= 1 MB)
    sign: Optional[InstanceOf[SignOptions]] = None  # sign the artifact (model_signing) as the last step

    @field_validator("digest_algorithm")
    @classmethod
    def _known_digest(cls, v):
        from ..safetensors_io import HASH_ALGORITHMS

        if v not in HASH_ALGORITHMS:
            raise OptionError(f"unknown digest algorithm {v!r} (choose from {', '.join(HASH_ALGORITHMS)})")
        return v


class ExecutionOptions(_Section):
    """How the run proceeds: device, streamed source, resume, activation memory."""

    device: str = "cpu"
    #: the calibration pass's CPU matmuls (compressor.precision): auto is bfloat16 where the CPU multiplies it in hardware
    matmul_precision: Literal["auto", "float32", "bfloat16"] = "auto"
    threads: Optional[int] = Field(None, ge=1, le=4096)  # torch's intra-op threads; None: one per usable CPU
    stream: bool = True  # read a safetensors source one decoder layer at a time (compressor.source.lazy)
    resume: bool = False  # continue an interrupted run from its staging folder
    activation_budget_gib: float = _finite(8.0, ge=0, le=MAX_GIB)  # activations above this go to memory-mapped files
    #: bytes of one decoder layer's weights held at once (float32 + int8 codes) by a streamed run: a larger MoE layer's
    #: routed experts are read, quantized, written and released in groups (AWQ holds the layer: compressor.moe_stream)
    memory_budget_gib: float = _finite(4.0, gt=0, le=MAX_GIB)
    #: processes converting the layers at once: data-free recipes only (compressor.data_free)
    workers: int = Field(1, ge=1, le=256)


class QuantizeOptions(_Options):
    """Options of ``kvq quantize`` (see its ``--help``).

    Raises:
        OptionError: a value out of range, a group size that is not an integer or
            ``auto``, an unknown digest algorithm.
    """

    FLAT: ClassVar[dict[str, tuple[str, str]]] = {
        "recipe": ("scheme", "recipes"), "kv_scheme": ("scheme", "kv_scheme"), "algorithm": ("scheme", "algorithm"),
        "bits": ("scheme", "bits"), "group_size": ("scheme", "group_size"), "symmetric": ("scheme", "symmetric"),
        "act_order": ("scheme", "act_order"), "settings": ("scheme", "settings"),
        "calib": ("calibration", "source"), "calib_field": ("calibration", "field"),
        "calib_samples": ("calibration", "samples"), "calib_seqlen": ("calibration", "seqlen"),
        "seed": ("calibration", "seed"),
        "format": ("write", "format"), "dtype": ("write", "dtype"), "overwrite": ("write", "overwrite"),
        "allow_float16_overflow": ("write", "allow_float16_overflow"),
        "digest_algorithm": ("write", "digest_algorithm"), "shard_bytes": ("write", "shard_bytes"),
        "sign": ("write", "sign"),
        "device": ("execution", "device"), "stream": ("execution", "stream"), "resume": ("execution", "resume"),
        "matmul_precision": ("execution", "matmul_precision"), "threads": ("execution", "threads"),
        "activation_budget_gib": ("execution", "activation_budget_gib"),
        "memory_budget_gib": ("execution", "memory_budget_gib"), "workers": ("execution", "workers"),
    }

    model: Text
    output: Path
    scheme: SchemeOptions = Field(default_factory=SchemeOptions)
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    write: WriteOptions = Field(default_factory=WriteOptions)
    execution: ExecutionOptions = Field(default_factory=ExecutionOptions)


# ---------------------------------------------------------------------------------------
# kvq verify

class EvalOptions(_Section):
    """The evaluation text, its windows, and the greedy-drift prompts."""

    text: Text = "embedded"
    seqlen: int = Field(2048, ge=2)
    max_windows: Optional[int] = Field(None, ge=1)
    hidden_batches: int = Field(2, ge=1, le=64)
    prompts: Optional[Text] = None  # greedy-drift prompt file (default: built-in set)
    max_new_tokens: int = Field(32, ge=1, le=4096)
    long_tokens: int = Field(256, ge=0, le=32768)  # long greedy generation, float vs quantized KV cache (0: none)
    turns: int = Field(4, ge=0, le=64)  # multi-turn chat through the chat template (0: none)
    #: ``auto``: evaluate the artifact in the dtype its config.json declares (what users load); ``float32`` on request
    dtype: Literal["auto", "float32"] = "auto"


class KVEvalOptions(_Section):
    """The KV cache verify evaluates with (``scheme``: instead of the artifact's) and its accounting."""

    scheme: Optional[str] = None
    budget_gib: float = _finite(16.0, gt=0, le=MAX_GIB)
    chunk: int = Field(128, ge=1)
    calib: Text = "embedded"
    calib_samples: int = Field(16, ge=1)


class VerifyGateOptions(_Section):
    """Gate thresholds given as flags (``None``: the recipe's, see :mod:`compressor.gates`)."""

    max_ppl_increase: Optional[float] = _finite(None, ge=0)
    max_mean_kl: Optional[float] = _finite(None, ge=0)
    max_p99_kl: Optional[float] = _finite(None, ge=0)
    min_top1: Optional[float] = _finite(None, ge=0, le=100)
    min_sqnr_db: Optional[float] = _finite(None)
    max_hidden_error: Optional[float] = _finite(None, ge=0)
    min_median_divergence: Optional[int] = Field(None, ge=0)
    min_long_agreement: Optional[float] = _finite(None, ge=0, le=100)


class VerifyOptions(_Options):
    """Options of ``kvq verify`` (see its ``--help``).

    Raises:
        OptionError: a value out of range; two signature methods; ``hashes_only`` with
            ``weights_only``, with ``no_manifest`` or with a gate flag; ``no_manifest``
            without ``reference``.
    """

    FLAT: ClassVar[dict[str, tuple[str, str]]] = {
        "eval_text": ("evaluation", "text"), "seqlen": ("evaluation", "seqlen"),
        "max_windows": ("evaluation", "max_windows"), "hidden_batches": ("evaluation", "hidden_batches"),
        "prompts": ("evaluation", "prompts"), "max_new_tokens": ("evaluation", "max_new_tokens"),
        "eval_dtype": ("evaluation", "dtype"), "long_tokens": ("evaluation", "long_tokens"),
        "turns": ("evaluation", "turns"),
        "kv_scheme": ("kv", "scheme"), "kv_budget_gib": ("kv", "budget_gib"), "kv_chunk": ("kv", "chunk"),
        "kv_calib": ("kv", "calib"), "kv_calib_samples": ("kv", "calib_samples"),
        **{g.option: ("gates", g.option) for g in gates_of("verify", configurable=True)},
    }

    artifact: Path
    reference: Optional[Text] = None
    device: str = "cpu"
    keys: Optional[InstanceOf[VerifyKeys]] = None  # check model.sig with these first
    hashes_only: bool = False  # signature and digests only
    weights_only: bool = False  # weight statistics only: no eval text, no perplexity
    no_manifest: bool = False  # a foreign artifact (another tool's): no digests to check; reference required
    threads: Optional[int] = Field(None, ge=1, le=4096)  # torch's intra-op threads; None: one per usable CPU
    #: both models one decoder layer at a time (compressor.streamed_eval); also chosen when they do not fit whole
    stream: bool = False
    #: memory verify may hold besides the process itself (GiB): above it the models are streamed, an MoE layer in
    #: groups of routed experts; a streamed plan whose smallest unit is above it is refused
    memory_budget_gib: Optional[float] = _finite(None, gt=0, le=MAX_GIB)
    evaluation: EvalOptions = Field(default_factory=EvalOptions)
    kv: KVEvalOptions = Field(default_factory=KVEvalOptions)
    gates: VerifyGateOptions = Field(default_factory=VerifyGateOptions)

    @property
    def mode(self) -> str:
        """``hashes-only``, ``weights-only`` or ``full``."""
        return "hashes-only" if self.hashes_only else ("weights-only" if self.weights_only else "full")

    @model_validator(mode="after")
    def _combinations(self):
        _check_keys(self.keys)
        if self.hashes_only and self.weights_only:
            raise OptionError("choose one of --hashes-only and --weights-only")
        if self.no_manifest and self.hashes_only:
            raise OptionError("--no-manifest has no digests to check: --hashes-only does not apply")
        if self.no_manifest and not self.reference:
            raise OptionError("--no-manifest needs --reference (a foreign artifact records no source model)")
        if self.kv.scheme is not None and self.mode != "full":
            raise OptionError(f"--kv-scheme applies to the evaluation, which --{self.mode} does not run")
        if self.hashes_only and (self.stream or self.memory_budget_gib is not None):
            raise OptionError("--hashes-only loads no model: --stream and --memory-budget-gib do not apply")
        if self.hashes_only:
            given = [g.flag for g in gates_of("verify", configurable=True) if getattr(self.gates, g.option) is not None]
            if given:
                raise OptionError(f"{given[0]} cannot be evaluated with --hashes-only (no statistics are computed)")
        return self


def _check_keys(keys: Optional[VerifyKeys]) -> None:
    """Raises OptionError when more than one way to check ``model.sig`` is given."""
    if keys is not None and keys.conflict():
        raise OptionError(keys.conflict())


# ---------------------------------------------------------------------------------------
# kvq serve-smoke

class SmokeGateOptions(_Section):
    """serve-smoke gate thresholds given as flags (``None``: the recipe's, else the defaults)."""

    min_top1: Optional[float] = _finite(None, ge=0, le=100)  # percent, over generated positions
    max_kl: Optional[float] = _finite(None, ge=0)  # nats, mean over prompt positions
    min_first_divergence: Optional[int] = Field(None, ge=0)  # median first differing generated position


class SmokeOptions(_Options):
    """Options of ``kvq serve-smoke`` (see its ``--help``).

    Raises:
        OptionError: a value out of range; more than one way to check ``model.sig``;
            ``no_manifest`` without ``reference``.
    """

    FLAT: ClassVar[dict[str, tuple[str, str]]] = {
        g.option: ("gates", g.option) for g in gates_of("serve-smoke", configurable=True)}

    artifact: Path
    prompts: Optional[Text] = None
    max_new_tokens: int = Field(32, ge=1, le=4096)
    long_tokens: int = Field(0, ge=0, le=32768)  # long greedy generation of the first prompt vs the reference (0: none)
    turns: int = Field(0, ge=0, le=64)  # user turns of a chat through the runtime, its cache kept (0: none)
    reference: Optional[Text] = None
    device: str = "cpu"
    backend: str = "auto"
    #: compute dtype; ``auto``: the artifact's declared bfloat16, else float32 on CPU (compressor.runtime.loader.compute_dtype)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    http: bool = False
    http_requests: int = Field(8, ge=1, le=256)
    threads: Optional[int] = Field(None, ge=1, le=4096)  # torch's intra-op threads; None: one per usable CPU
    keys: Optional[InstanceOf[VerifyKeys]] = None  # check model.sig with these first
    no_manifest: bool = False  # another tool's artifact: nothing to check digests against; reference required
    #: the reference read one decoder layer at a time (compressor.streamed_logits); also chosen when it does not fit whole
    stream: bool = False
    #: memory serve-smoke may hold besides the process itself (GiB; default: what the machine has available): a
    #: runtime above it is refused, a reference above it streamed
    memory_budget_gib: Optional[float] = _finite(None, gt=0, le=MAX_GIB)
    gates: SmokeGateOptions = Field(default_factory=SmokeGateOptions)

    @model_validator(mode="after")
    def _combinations(self):
        _check_keys(self.keys)
        if self.no_manifest and not self.reference:
            raise OptionError("--no-manifest needs --reference (a foreign artifact records no source model)")
        return self
