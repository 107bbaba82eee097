"""The weight-side parts of a recipe: the strict base model, the weight, activation, override,
LM-head and embedding schemes, and the check of the FP8 W8A8 and W4A8 combinations vLLM serves.

:mod:`compressor.recipe` builds its :class:`~compressor.recipe.Recipe` from these (and names
them there too); a field added here whose default must not change earlier recipes' digests is
left out of dumps while it holds that default (:data:`FULL_DUMP` keeps every field).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from .registry import ALGORITHMS

if TYPE_CHECKING:
    from .recipe import Recipe


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, v, info):
        """A YAML ``true``/``false`` given for a number is refused (pydantic would read it as 1/0:
        ``--set gptq.damp=true`` would otherwise be a damping of 1.0)."""
        if isinstance(v, bool):
            ann = cls.model_fields[info.field_name].annotation
            args = set(getattr(ann, "__args__", ()) or (ann,))
            if bool not in args and args & {int, float}:
                raise ValueError("Input should be a number, not a boolean")
        return v


#: ``model_dump(context=FULL_DUMP)``: every field, including those a serializer leaves out of
#: digest-stable dumps while they hold their defaults (``head: null``, GPTQ's range search off)
FULL_DUMP = {"full": True}


def _full(info) -> bool:
    return bool(info.context and info.context.get("full"))


class WeightScheme(_Strict):
    """Weight scheme. ``group_size``: 32/64/128/..., ``-1`` per channel, or ``auto``.

    ``type: int`` (the default) is an integer grid of ``num_bits``; ``type: float`` is FP8 e4m3
    (``num_bits: 8``, symmetric, :mod:`compressor.quant.fp8`), per channel (``group_size: -1``)
    or in ``block_structure: [rows, cols]`` blocks (``group_size`` = ``cols``), always with an
    ``activations`` scheme (FP8 W8A8), or FP4 e2m1 (``num_bits: 4``, symmetric, weight-only: NVFP4 with
    ``group_size: 16``, MXFP4 with ``group_size: 32``; :func:`check_fp4_scheme`). Integer weights with an
    ``activations`` scheme are W4A8 (:func:`check_int_fp8_scheme`)."""

    num_bits: int = Field(4, ge=2, le=8)
    group_size: Union[int, Literal["auto"]] = 128
    symmetric: bool = False
    type: Literal["int", "float"] = "int"
    block_structure: Optional[list[int]] = Field(None, min_length=2, max_length=2)

    @field_validator("group_size")
    @classmethod
    def _gs(cls, v):
        if v != "auto" and v != -1 and (v is None or v <= 0):
            raise ValueError("group_size must be a positive integer, -1 (per channel) or 'auto'")
        return v

    @field_validator("block_structure")
    @classmethod
    def _block(cls, v):
        if v is not None and any(x < 1 for x in v):
            raise ValueError("block_structure must be two positive integers [rows, cols]")
        return v

    @model_serializer(mode="wrap")
    def _omit_new_defaults(self, handler, info):
        """``type: int`` and ``block_structure: null`` are left out of dumps: an integer scheme
        serializes (and digests) as it did before the fields existed (:data:`FULL_DUMP` keeps them)."""
        data = handler(self)
        if isinstance(data, dict) and not _full(info) and data.get("type") == "int" \
                and data.get("block_structure", 0) is None:
            del data["type"], data["block_structure"]
        return data


class ActivationScheme(_Strict):
    """Quantization of every quantized linear's input as the serving kernel does it on each call: FP8
    e4m3 per token (``strategy: token``, with per-channel FP8 weights, or with integer weights: W4A8) or
    per token and ``group_size`` columns (``strategy: group``, with block weights: the block's columns),
    fully dynamic (:mod:`compressor.quant.fp8`); or NVFP4 (``num_bits: 4``, ``strategy: tensor_group``,
    ``group_size: 16``, ``dynamic: local``, with NVFP4 weights: W4A4): e2m1 values with e4m3 scales per 16
    inputs computed per call over a static per-linear global scale that calibration observes
    (:mod:`compressor.quant.fp4_inputs`). ``kvq verify`` and the runtime simulate either."""

    type: Literal["float"] = "float"
    num_bits: Literal[8, 4] = 8
    strategy: Literal["token", "group", "tensor_group"] = "token"
    group_size: Optional[int] = Field(None, ge=1)
    dynamic: Literal[True, "local"] = True

    @model_validator(mode="after")
    def _group(self):
        if self.num_bits == 4:
            if (self.strategy, self.group_size, self.dynamic) != ("tensor_group", 16, "local"):
                raise ValueError("4-bit activations are NVFP4's: strategy tensor_group, group_size 16, dynamic local "
                                 "(e4m3 scales per 16 inputs per call over a calibrated global scale)")
            return self
        if self.strategy == "tensor_group" or self.dynamic is not True:
            raise ValueError("fp8 activations (num_bits 8) are dynamic (dynamic true) per token or per group; "
                             "strategy tensor_group with dynamic local is NVFP4's (num_bits 4)")
        if (self.strategy == "group") != (self.group_size is not None):
            raise ValueError("group_size is set with strategy group (and only then)")
        return self


class WeightOverride(_Strict):
    """Fields of a weight scheme to change for the modules matched by ``targets``; with ``type`` (``int`` or
    ``float``) a whole :class:`WeightScheme`, the fields not given taking its defaults
    (:func:`compressor.recipe_mixed.resolve`)."""

    num_bits: Optional[int] = Field(None, ge=2, le=8)
    group_size: Optional[Union[int, Literal["auto"]]] = None
    symmetric: Optional[bool] = None
    type: Optional[Literal["int", "float"]] = None
    block_structure: Optional[list[int]] = Field(None, min_length=2, max_length=2)

    @field_validator("group_size")
    @classmethod
    def _gs(cls, v):
        return WeightScheme._gs(v) if v is not None else v

    @field_validator("block_structure")
    @classmethod
    def _block(cls, v):
        return WeightScheme._block(v)

    @model_serializer(mode="wrap")
    def _omit_new_defaults(self, handler, info):
        """``type: null`` and ``block_structure: null`` are left out of dumps: an integer override serializes
        (and digests) as it did before the fields existed (:data:`FULL_DUMP` keeps them)."""
        data = handler(self)
        if isinstance(data, dict) and not _full(info):
            for key in ("type", "block_structure"):
                if data.get(key, 0) is None:
                    del data[key]
        return data


def _row_group_size(v: int) -> int:
    if v != -1 and v <= 0:
        raise ValueError("group_size must be a positive integer or -1 (per channel)")
    return v


class HeadScheme(_Strict):
    """Integer weight-only scheme of the LM head (``lm_head``), quantized after the decoder
    layers: GPTQ on the final norm's outputs when the run has a calibration pass, else RTN.
    ``group_size``: ``-1`` per output channel (one scale
    per vocabulary row, the default: 8-bit per channel costs almost nothing) or a divisor of
    the hidden size (4-bit grouped). Stored in compressed-tensors only (its own config group;
    vLLM and transformers load it). A tied head (``tie_word_embeddings``) can only be quantized
    by untying it: the embedding stays as it is and the packed head is stored beside it, which
    adds the head's bytes to the artifact; ``untie: true`` accepts that (refused without it,
    :func:`compressor.quant.head.check_untie`)."""

    num_bits: int = Field(8, ge=2, le=8)
    group_size: int = -1
    symmetric: bool = True
    untie: bool = False

    @field_validator("group_size")
    @classmethod
    def _gs(cls, v):
        return _row_group_size(v)

    @model_serializer(mode="wrap")
    def _omit_untie(self, handler, info):
        """``untie: false`` is left out of dumps: a head scheme serializes (and digests) as it
        did before the field existed (:data:`FULL_DUMP` keeps it)."""
        data = handler(self)
        if isinstance(data, dict) and not _full(info) and data.get("untie") is False:
            del data["untie"]
        return data


class EmbeddingScheme(_Strict):
    """Integer scheme of the input embedding table (``embed_tokens``, ``[vocab, hidden]``):
    symmetric round-to-nearest per vocabulary row (``group_size: -1``, the default) or in groups
    of a divisor of the hidden size. Under ``tie_word_embeddings`` the table is also the LM
    head, so the head reads the quantized table too and the artifact stays tied. Stored as a
    compressed-tensors ``pack-quantized`` module with a config group of its own; kvq's readers
    (verify, serve-smoke, serve) load it; transformers and vLLM do not load a tied one (docs/recipes.md,
    'LM head and embedding'), which the quantize run says in a warning."""

    num_bits: int = Field(8, ge=2, le=8)
    group_size: int = -1

    @field_validator("group_size")
    @classmethod
    def _gs(cls, v):
        return _row_group_size(v)


def check_float_scheme(recipe: "Recipe") -> str | None:
    """What is wrong with a recipe's FP8 weights or activations (``None``: nothing, or integer weights
    without activations). vLLM's compressed-tensors FP8 W8A8 serves per-channel weights with
    per-token activations and ``[rows, cols]`` block weights with per-group activations of
    ``cols``; an algorithm with :attr:`~compressor.quant.algorithms.Algorithm.fp8_grid` quantizes them (RTN;
    GPTQ and AWQ are not implemented on the FP8 grid). Integer weights with activations (W4A8):
    :func:`check_int_fp8_scheme`."""
    w, a = recipe.weights, recipe.activations
    algorithm = ALGORITHMS.find(recipe.algorithm)
    if a is not None and a.num_bits == 4 and (w.type, w.num_bits) != ("float", 4):  # FP4 weights: check_fp4_scheme
        return ("4-bit activations (NVFP4 W4A4) go with NVFP4 weights (type float, num_bits 4, group_size 16): "
                "--recipe w4a4-nvfp4")
    if w.type == "int":
        if w.block_structure is not None:
            return "weights.block_structure applies to type float (FP8) weights"
        if a is not None and algorithm is not None and algorithm.quantizes_weights:
            return check_int_fp8_scheme(recipe)
        return None
    if w.num_bits == 4:
        return check_fp4_scheme(recipe)
    if w.num_bits != 8 or not w.symmetric:
        return "weights type float is FP8 e4m3 (num_bits 8) or NVFP4/MXFP4 (num_bits 4), symmetric true"
    if w.block_structure is None and w.group_size != -1:
        return ("FP8 weights are per channel (group_size -1) or in blocks (block_structure [rows, cols], "
                f"group_size cols); vLLM serves no FP8 groups (group_size {w.group_size})")
    if w.block_structure is not None and w.group_size != w.block_structure[1]:
        return (f"weights.block_structure {w.block_structure} needs group_size {w.block_structure[1]} "
                f"(got {w.group_size})")
    if algorithm is None or not algorithm.quantizes_weights:
        return None
    if not algorithm.fp8_grid:
        fits = ", ".join(n for n in ALGORITHMS.names() if ALGORITHMS.find(n).fp8_grid)
        return f"algorithm {recipe.algorithm} is not implemented on the FP8 grid; FP8 weights are quantized with {fits}"
    if a is None:
        return "weights type float (FP8) needs an activations section (FP8 W8A8); FP8 weight-only is not implemented"
    if w.block_structure is None and a.strategy != "token":
        return "per-channel FP8 weights are served with per-token activations (activations.strategy token)"
    if w.block_structure is not None and (a.strategy, a.group_size) != ("group", w.block_structure[1]):
        return (f"block FP8 weights are served with per-group activations of the block's columns "
                f"(activations.strategy group, group_size {w.block_structure[1]})")
    return None


def check_fp4_scheme(recipe: "Recipe") -> str | None:
    """What is wrong with a recipe's FP4 e2m1 weights (``type: float``, ``num_bits: 4``), ``None``: nothing.

    ``group_size 16`` is NVFP4, llm-compressor's ``NVFP4A16`` preset (compressed-tensors ``strategy: tensor_group``,
    :mod:`compressor.quant.fp4`); ``group_size 32`` is MXFP4, its ``MXFP4A16`` preset (``strategy: group``, E8M0
    scales, :mod:`compressor.quant.mxfp4`). Either is symmetric, without block structure, weight-only or (NVFP4
    only) with NVFP4 activations (W4A4, compressed-tensors' preset ``NVFP4``: :class:`ActivationScheme`),
    recipe-wide or per override (:mod:`compressor.recipe_mixed`), round-to-nearest, GPTQ/GPTAQ, AWQ or AWQ+GPTQ
    (an algorithm with :attr:`~compressor.quant.algorithms.Algorithm.fp4_grid`: AWQ's searches round on the
    format's grid; GPTQ without ``refine`` and ``gptq.clip``, which search integer grids).
    """
    w, a = recipe.weights, recipe.activations
    if not w.symmetric or w.group_size not in (16, 32) or w.block_structure is not None:
        return ("FP4 weights (type float, num_bits 4) are symmetric in groups of 16 (NVFP4) or 32 (MXFP4) "
                "(symmetric true, group_size 16 or 32, no block_structure)")
    grid = "MXFP4" if w.group_size == 32 else "NVFP4"
    if a is not None and grid == "MXFP4" and a.num_bits == 4:
        return ("MXFP4 weights with NVFP4 activations (W4A4) are not implemented: NVFP4 W4A4 takes NVFP4 weights "
                "(group_size 16: --recipe w4a4-nvfp4), MXFP4 none (W4A16: remove the activations section)")
    if a is not None and grid == "MXFP4":
        return "MXFP4 weights with fp8 activations are not implemented: MXFP4 is weight-only (W4A16, no activations)"
    if a is not None and a.num_bits != 4:
        return ("NVFP4 with fp8 activations is not implemented; NVFP4 weights take NVFP4 activations (num_bits 4, "
                "strategy tensor_group, group_size 16, dynamic local: --recipe w4a4-nvfp4) or none (W4A16)")
    algorithm = ALGORITHMS.find(recipe.algorithm)
    if algorithm is not None and algorithm.quantizes_weights and not algorithm.fp4_grid:
        fits = ", ".join(n for n in ALGORITHMS.names() if ALGORITHMS.find(n).fp4_grid)
        return (f"algorithm {recipe.algorithm} is not implemented on the {grid} grid; {grid} weights are "
                f"quantized with {fits}")
    if "gptq" in getattr(algorithm, "reads", ()) and recipe.refine is not None:
        return f"the refine section on the {grid} grid is not implemented (it searches integer grids); remove it"
    if "gptq" in getattr(algorithm, "reads", ()) and recipe.gptq.clip:
        return f"gptq.clip on the {grid} grid is not implemented (the range search is the integer grid's); set it false"
    return None


def fp4_grid_change(named: "Recipe", group_size, given: str = "group_size") -> str | None:
    """Why ``group_size`` (set by ``given``: a flag, ``--set``) may not turn the FP4 grid of the recipe ``named``
    into the other one, ``None``: it does not.

    ``group_size`` 32 is MXFP4 (E8M0 scales) and 16 NVFP4 (FP8 scales and a global scale): two formats a server
    reads differently (:func:`check_fp4_scheme`), so a changed group size is refused in one line naming the
    recipe to use instead of writing the other format silently; on NVFP4 W4A4 (NVFP4 activations) it says that
    the W4A4 recipes are NVFP4's alone (groups of 16), MXFP4 being weight-only.
    """
    w, a = named.weights, named.activations
    grids = {32: "MXFP4", 16: "NVFP4"}
    before = grids.get(w.group_size) if (w.type, w.num_bits) == ("float", 4) else None
    after = grids.get(group_size) if isinstance(group_size, int) else None
    if before is None or after is None or before == after:
        return None
    if a is not None and a.num_bits == 4:
        return (f"{given} {group_size} turns the recipe's NVFP4 W4A4 weights into MXFP4, which has no W4A4: NVFP4 "
                f"W4A4 quantizes weights and inputs in groups of 16 (the NVFP4 grid); drop {given} (MXFP4 "
                "weight-only: --recipe w4a16-mxfp4)")
    recipe = "w4a16-nvfp4" if after == "NVFP4" else "w4a16-mxfp4"
    return (f"{given} {group_size} turns the recipe's {before} weights into {after}, another format: name --recipe "
            f"{recipe} instead")


#: integer weight widths kvq writes and simulates with fp8 inputs (vLLM's W4A8 kernel serves 4)
INT_FP8_BITS = (4, 8)


def check_int_fp8_scheme(recipe: "Recipe") -> str | None:
    """What is wrong with a recipe's integer weights with quantized activations (W4A8: compressed-tensors
    ``pack-quantized`` weights whose config group carries ``input_activations``), ``None``: nothing.

    Follows what vLLM's ``CompressedTensorsW4A8Fp8`` reads (``_is_fp8_w4a8``: symmetric grouped integer
    weights, dynamic symmetric per-token 8-bit inputs): the inputs are dynamic fp8 per token
    (``strategy: token``), the weights symmetric (the W4A8 kernel has no zero points) of
    :data:`INT_FP8_BITS` bits (per module, each override stack too: :mod:`compressor.recipe_mixed`). Any
    algorithm that quantizes integer weights applies (RTN, GPTQ, GPTAQ, AWQ, AWQ+GPTQ). What vLLM's kernel further
    needs (4 bits, groups of 128, widths multiples of 128) is warned about by ``kvq quantize``, not refused
    (:func:`compressor.quant.fp8.int_fp8_misfits`).
    """
    a = recipe.activations
    if a.strategy != "token":
        return ("integer weights are served with per-token fp8 activations (activations.strategy token, vLLM's "
                "W4A8); per-group activations go with FP8 block weights")
    s = recipe.weights
    if s.num_bits not in INT_FP8_BITS:
        return (f"integer weights with fp8 activations are {' or '.join(map(str, INT_FP8_BITS))} bits "
                f"(got num_bits {s.num_bits}); W{s.num_bits}A8 is not implemented")
    if not s.symmetric:
        return ("integer weights with fp8 activations are symmetric (vLLM's W4A8 kernel has no zero points): "
                "set weights.symmetric true")
    return None


def observes_inputs(recipe: "Recipe") -> bool:
    """Whether quantizing ``recipe`` observes each quantized linear's input on a calibration pass: NVFP4
    activations (W4A4) store a static ``input_global_scale`` per linear from the absmax of its calibration
    inputs (:mod:`compressor.quant.fp4_inputs`), whatever the algorithm (RTN too)."""
    a, algorithm = recipe.activations, ALGORITHMS.find(recipe.algorithm)
    return a is not None and a.num_bits == 4 and algorithm is not None and algorithm.quantizes_weights
