"""Recipes: what to quantize and how, as validated data (YAML in ``compressor/recipes/``).

A recipe is a pydantic model with ``extra="forbid"``, so an unknown or misspelt key is
an error naming the key. Bundled recipes are looked up by name (``w4a16-awq``) or a
path to a YAML file is given; command-line flags override fields afterwards and the
*effective* recipe is stored in the artifact's manifest.

The bundled YAML files are package data (``compressor/recipes/*.yaml``, listed in
``pyproject.toml``) read through :mod:`importlib.resources`, so a built wheel, an
editable install and a source checkout all find them.
"""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

import yaml
from pydantic import Field, ValidationError, field_validator, model_serializer, model_validator

from .errors import InputError
from .files import read_limited
from .suggest import did_you_mean, dotted_keys, format_validation
from .kv_schemes import make_spec, scheme_names, strategy_names
from .recipe_mixed import Pair, check_schemes, resolve
from .recipe_schemes import (FULL_DUMP, ActivationScheme, EmbeddingScheme, HeadScheme, WeightOverride,  # noqa: F401
                             WeightScheme, _full, _Strict, check_float_scheme, fp4_grid_change)
from .registry import ALGORITHMS

if TYPE_CHECKING:  # importlib.resources.abc is 3.11+; the annotations are strings at run time
    from importlib.resources.abc import Traversable

#: the bundled recipes: package data inside ``compressor`` (a directory on disk for any
#: ordinary install; a :class:`~importlib.resources.abc.Traversable` in general)
RECIPE_DIR: Traversable = files(__package__) / "recipes"
STANDARD_GROUP_SIZES = (128, 64, 32)


def _one_of(value: str, names) -> str:
    """``value`` when it is one of the registered ``names``, else pydantic's Literal message (ValueError)."""
    names = list(names)
    if value not in names:
        quoted = [f"'{n}'" for n in names]
        listed = ", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0]
        raise ValueError("Input should be " + listed)
    return value


class AWQOptions(_Strict):
    """AWQ knobs (Lin et al., 2023). ``loss_samples``: calibration sequences used for the
    grid-search loss, the first ones (at most all of them; activation statistics always use all
    samples; under several ranks, more than the first batch holds are not divided); ``clip_tokens``:
    tokens sampled for the weight-clipping search."""

    n_grid: int = Field(20, ge=1, le=100)
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = Field(20, ge=2, le=100)
    clip_max_shrink: float = Field(0.5, gt=0.0, lt=1.0, allow_inf_nan=False)
    clip_tokens: int = Field(512, ge=16)
    loss_samples: int = Field(8, ge=1)


class GPTQOptions(_Strict):
    """GPTQ knobs (Frantar et al., 2022). ``damp``: dampening relative to mean(diag(H));
    ``damp_increment``: added on each retry when H is not positive definite;
    ``act_order``: visit columns by descending diag(H); ``static_groups``: fix group
    qparams before reordering (no g_idx; the only act-order compressed-tensors 0.20 stores);
    ``true_sequential``: q/k/v, then o, then gate/up, then down, each Hessian taken from
    inputs produced by the already-quantized sub-layers; ``clip``: each group's range from a
    grid search (shrinks ``1 - k/clip_grid`` below ``clip_max_shrink``) scored by the group's
    output error under the Hessian, instead of min-max (:func:`compressor.quant.primitives.search_qparams`);
    ``gptaq_alpha``: how far each linear's target moves from its own output on the quantized
    model's inputs towards the float model's output on the float inputs (0: GPTQ as published;
    asymmetric calibration as GPTAQ, Li et al., 2025; :func:`compressor.quant.gptq.float_target`)."""

    block_size: int = Field(128, ge=1, strict=True)
    damp: float = Field(0.01, gt=0.0, lt=1.0, allow_inf_nan=False)
    damp_increment: float = Field(0.01, gt=0.0, lt=1.0, allow_inf_nan=False)
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    clip: bool = False
    clip_grid: int = Field(100, ge=2, le=1000, strict=True)
    clip_max_shrink: float = Field(0.25, gt=0.0, lt=1.0, allow_inf_nan=False)
    gptaq_alpha: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)

    @model_serializer(mode="wrap")
    def _omit_new_defaults(self, handler, info):
        """The range search's knobs (``clip*``) and ``gptaq_alpha`` are left out of dumps while
        they hold their defaults (search off, no float target): a recipe without them
        serializes (and digests) as it did before the fields existed, so earlier manifests
        keep their bytes (:data:`FULL_DUMP` keeps them)."""
        data = handler(self)
        if isinstance(data, dict) and not _full(info) and \
                (data.get("clip"), data.get("clip_grid"), data.get("clip_max_shrink")) == (False, 100, 0.25):
            for k in ("clip", "clip_grid", "clip_max_shrink"):
                del data[k]
        if isinstance(data, dict) and not _full(info) and data.get("gptaq_alpha") == 0.0:
            del data["gptaq_alpha"]
        return data


class RefineOptions(_Strict):
    """Block-wise refinement of each decoder layer's GPTQ result (AutoRound's sign-gradient descent, Cheng et al.,
    2023, arXiv:2309.05516; :mod:`compressor.quant.refine`): ``iters`` steps per layer on ``batch`` calibration
    sequences each, step sizes decaying linearly to 0 from ``lr`` for the rounding offsets (null: ``1 / iters``)
    and ``range_lr`` for the group ranges' factors (null: ``lr / 10``). ``null`` section: off."""

    iters: int = Field(200, ge=1, le=100_000, strict=True)
    lr: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    range_lr: Optional[float] = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    batch: int = Field(8, ge=1, le=4096, strict=True)


class MoEOptions(_Strict):
    """Mixture-of-experts calibration. Every routed expert is quantized; an expert that the
    calibration data routed fewer than ``min_tokens`` (token, slot) pairs to is quantized
    with RTN (min-max, no clipping; with AWQ inside the layer's shared input scaling) instead
    of AWQ's clipping search / GPTQ's Hessian, and flagged in the manifest
    (``quality.moe.fallback``). Routers stay in float."""

    min_tokens: int = Field(128, ge=0)


class Override(_Strict):
    """Per-module override of the scheme; when several match a module, later ones win
    (:func:`compressor.recipe_mixed.resolve`). ``weights`` with a ``type`` are a whole weight scheme (int, FP8,
    NVFP4, MXFP4), without one they change the fields given; ``activations`` given (a scheme, or ``null`` for
    16-bit inputs) replace the module's, left out they are kept (and left out of dumps: earlier recipes'
    digests stay)."""

    targets: list[str] = Field(min_length=1, description="module names or 're:' regexes")
    weights: WeightOverride = Field(default_factory=WeightOverride)
    activations: Optional[ActivationScheme] = None

    @field_validator("targets")
    @classmethod
    def _regexes(cls, v):
        return _check_patterns(v)

    @model_serializer(mode="wrap")
    def _omit_unset_activations(self, handler, info):
        """``activations`` not given is left out of every dump (:data:`FULL_DUMP` too: a dump read back keeps
        the module's activations, where ``null`` would make them 16-bit)."""
        data = handler(self)
        if isinstance(data, dict) and "activations" not in self.model_fields_set:
            data.pop("activations", None)
        return data

    def applies_to(self, module_name: str) -> bool:
        """True when ``module_name`` is one of ``targets`` or fully matches an ``re:`` entry (:func:`matches`)."""
        return matches(self.targets, module_name)


class KVCacheOptions(_Strict):
    """KV-cache scheme (see :mod:`compressor.kv_schemes`): ``fp8`` (strategy ``tensor`` or
    ``head``, static scales), ``int8`` (``token``: dynamic asymmetric per token; ``head``:
    static per head), ``int4``/``int2`` (``kivi``: keys per channel in groups of
    ``group_size`` tokens, values per token, ``residual_length`` recent tokens in full precision).

    ``scale_search`` (static schemes): ``absmax`` (scale = absmax / 448 or / 127),
    ``attention`` (the multiple of absmax, within one binade, whose scales give the smallest
    error of each layer's attention output on ``scale_search_samples`` calibration sequences;
    :mod:`compressor.quant.kv_search`; refused on an MLA cache and on dynamic schemes) or
    ``auto`` (``attention`` for static scales on a cache with KV heads, else nothing or absmax).

    ``key_rotation`` (static schemes searched on the attention output): ``pairs`` changes each
    layer's key basis by one exact complex factor per RoPE pair (an angle, then a scale) in
    ``q_proj``/``k_proj``'s rows, chosen for the cache's rounding
    (:mod:`compressor.quant.kv_rotation`; refused where the layout does not commute with it),
    ``auto`` (``pairs`` for fp8 where it applies, else ``none``) or ``none``."""

    scheme: str  # a registered scheme (compressor.kv_schemes.scheme_names)
    strategy: Optional[str] = None  # a registered strategy of it (compressor.kv_schemes.strategies)
    group_size: int = Field(32, ge=1)
    residual_length: int = Field(128, ge=0)
    scale_search: Literal["absmax", "attention", "auto"] = "absmax"
    scale_search_samples: int = Field(4, ge=1, le=1024, strict=True)
    key_rotation: Literal["none", "pairs", "auto"] = "none"

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        return _one_of(v, scheme_names())

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: Optional[str]) -> Optional[str]:
        return v if v is None else _one_of(v, strategy_names())

    @model_validator(mode="after")
    def _valid(self):
        try:
            spec = make_spec(self.scheme, self.strategy, self.group_size, self.residual_length)
        except InputError as e:
            raise ValueError(str(e)) from None
        self.strategy = spec.strategy
        if self.scale_search == "attention" and not spec.static:
            raise ValueError(f"scale_search {self.scale_search} applies to static scales (fp8, int8 head), "
                             f"not {spec.describe()}")
        if self.key_rotation == "pairs" and not spec.static:
            raise ValueError(f"key_rotation pairs applies to static scales (fp8, int8 head), not {spec.describe()}")
        if self.key_rotation == "pairs" and self.scale_search == "absmax":
            raise ValueError("key_rotation pairs needs the scales searched on the attention output: "
                             "set scale_search attention or auto")
        return self

    @model_serializer(mode="wrap")
    def _omit_new_defaults(self, handler, info):
        """``scale_search*`` are left out of dumps while they hold their defaults (absmax):
        earlier recipes serialize (and digest) as before (:data:`FULL_DUMP` keeps them)."""
        data = handler(self)
        if isinstance(data, dict) and not _full(info) and \
                (data.get("scale_search"), data.get("scale_search_samples")) == ("absmax", 4):
            del data["scale_search"], data["scale_search_samples"]
        if isinstance(data, dict) and not _full(info) and data.get("key_rotation") == "none":
            del data["key_rotation"]
        return data

    def spec(self):
        """The resolved :class:`compressor.kv_schemes.KVSpec`."""
        return make_spec(self.scheme, self.strategy, self.group_size, self.residual_length)


class Gates(_Strict):
    """Verification thresholds used by ``kvq verify`` when no flag overrides them.
    ``None``: ungated (still reported). KL in nats per token, KL(P_reference || P_artifact); top-1 agreement in
    percent of predicted positions; SQNR in dB (minimum over quantized tensors); hidden-state error relative, after
    the last layer; divergence the median first differing position of greedy generations, a prompt that never
    diverged counted as the tokens generated (:mod:`compressor.stats`);
    long agreement the top-1 % of the quantized KV cache teacher-forced on the float cache's long generation."""

    max_ppl_increase_pct: float = Field(20.0, ge=0.0, allow_inf_nan=False)
    max_mean_kl: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    max_p99_kl: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    min_top1_agreement_pct: Optional[float] = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    min_sqnr_db: Optional[float] = None
    max_hidden_error: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    min_median_divergence: Optional[int] = Field(None, ge=0)
    min_long_agreement_pct: Optional[float] = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    # kvq serve-smoke (runtime vs reference; None: the command's defaults 70 % / 0.5 nats / ungated)
    serve_min_top1_pct: Optional[float] = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    serve_max_prompt_kl: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    serve_min_median_divergence: Optional[int] = Field(None, ge=0)

    @model_serializer(mode="wrap")
    def _omit_new_gates(self, handler, info):
        """``min_long_agreement_pct: null`` left out of dumps: digests as before the gate existed."""
        data = handler(self)
        if isinstance(data, dict) and not _full(info) and data.get("min_long_agreement_pct", 0) is None:
            del data["min_long_agreement_pct"]
        return data


class Recipe(_Strict):
    """A complete quantization recipe."""

    name: str = "custom"
    description: str = ""
    algorithm: str = "awq"  # a registered algorithm (compressor.registry.ALGORITHMS)
    weights: WeightScheme = WeightScheme()
    targets: list[str] = Field(default_factory=lambda: ["re:.*"], description="decoder linears to quantize: names or 're:' regexes")
    ignore: list[str] = Field(default_factory=list, description="module names or 're:' regexes left in float")
    overrides: list[Override] = Field(default_factory=list,
                                      description="per-module schemes (mixed precision, mixed formats)")
    awq: AWQOptions = AWQOptions()
    gptq: GPTQOptions = GPTQOptions()
    moe: MoEOptions = MoEOptions()
    kv_cache: Optional[KVCacheOptions] = Field(None, description="KV-cache scheme; null keeps the cache in float")
    activations: Optional[ActivationScheme] = Field(None, description="activation quantization (FP8 W8A8, "
                                                    "W4A8, NVFP4 W4A4); null keeps activations 16-bit")
    head: Optional[HeadScheme] = Field(None, description="LM-head scheme; null keeps lm_head in float")
    embedding: Optional[EmbeddingScheme] = Field(None, description="input embedding scheme; null keeps it in float")
    refine: Optional[RefineOptions] = Field(None, description="GPTQ's layers refined on their outputs; null: off")
    gates: Gates = Gates()

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, v: str) -> str:
        return _one_of(v, ALGORITHMS.names())

    @model_serializer(mode="wrap")
    def _omit_float_head(self, handler, info):
        """``head``, ``embedding`` and ``refine`` are left out of dumps while null: a recipe without
        them serializes (and digests) as it did before the fields existed, so earlier manifests keep
        their bytes (:data:`FULL_DUMP` keeps them)."""
        data = handler(self)
        for key in ("head", "embedding", "activations", "refine"):
            if isinstance(data, dict) and not _full(info) and data.get(key, 0) is None:
                del data[key]
        return data

    @model_validator(mode="after")
    def _float_weights(self, info):
        """The FP8 W8A8, W4A8 and FP4 combinations vLLM serves, per override too
        (:func:`compressor.recipe_mixed.check_schemes`); not under :data:`PARTIAL` (a recipe of a stack, or one
        ``--set`` and the flags are still to change: only the final recipe is checked)."""
        problem = None if info.context and info.context.get("partial") else check_schemes(self)
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("targets", "ignore")
    @classmethod
    def _regexes(cls, v):
        return _check_patterns(v)

    def is_ignored(self, module_name: str) -> bool:
        """True when ``module_name`` is not quantized: it matches ``ignore`` or no entry of ``targets``."""
        return matches(self.ignore, module_name) or not matches(self.targets, module_name)

    def scheme_for(self, module_name: str) -> WeightScheme:
        """The weight scheme of ``module_name``: ``weights`` updated by every matching override, in order."""
        return self.pair_for(module_name)[0]

    def pair_for(self, module_name: str) -> Pair:
        """``(weights, activations)`` of ``module_name``: the recipe's, with every matching override applied in
        order (:func:`compressor.recipe_mixed.resolve`)."""
        return resolve(self.weights, self.activations,
                       [ov for ov in self.overrides if matches(ov.targets, module_name)])

    @property
    def is_mixed(self) -> bool:
        """True when overrides exist (the artifact may hold several weight schemes)."""
        return bool(self.overrides)


def _check_patterns(v: list[str]) -> list[str]:
    for item in v:
        if item.startswith("re:"):
            try:
                re.compile(item[3:])
            except re.error as e:
                raise ValueError(f"bad regex {item}: {e}") from None
    return v


def matches(patterns: list[str], module_name: str) -> bool:
    """True when ``module_name`` equals an entry or fully matches an ``re:`` regex entry."""
    for item in patterns:
        if item.startswith("re:"):
            if re.fullmatch(item[3:], module_name):
                return True
        elif item == module_name:
            return True
    return False


def bundled_recipes() -> dict[str, Traversable]:
    """Names (file stems, sorted) and resources of the recipes shipped in ``compressor/recipes/``.

    The values are :class:`~importlib.resources.abc.Traversable` (``pathlib.Path`` for an
    installed or editable package); read them with ``.read_text()``. An install without the
    package data yields ``{}`` (every name is then an unknown recipe, an input error).
    """
    if not RECIPE_DIR.is_dir():
        return {}
    found = [p for p in RECIPE_DIR.iterdir() if p.name.endswith(".yaml") and p.is_file()]
    return dict(sorted((p.name[: -len(".yaml")], p) for p in found))  # sorted by name, as documented


#: the largest recipe file kvq reads (the bundled ones are under 2 KiB)
MAX_RECIPE_BYTES = 1 << 20


def _read_recipe(name_or_path: str) -> tuple[dict, Path | Traversable]:
    path: Path | Traversable = Path(name_or_path)
    bundled = bundled_recipes()
    if not path.exists():
        if name_or_path in bundled:
            path = bundled[name_or_path]
        else:
            raise InputError(f"recipe '{name_or_path}' is neither a file nor a bundled recipe ({', '.join(bundled)})"
                             + did_you_mean(name_or_path, bundled))
    try:  # a file the user names is read bounded (a FIFO or /dev/zero is refused, not waited on)
        data = yaml.safe_load(read_limited(path, "recipe", MAX_RECIPE_BYTES).decode("utf-8")
                              if isinstance(path, Path) else path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise InputError(f"cannot read recipe {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise InputError(f"recipe {path} must be a YAML mapping")
    return data, path


def _stem(path: Path | Traversable) -> str:
    """The file name without its last suffix (``Path.stem``; any Traversable has ``.name``)."""
    return Path(path.name).stem


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_recipes(names: list[str] | tuple[str, ...], check: bool = True) -> Recipe:
    """Combine several recipes: later ones add to or override earlier ones (mappings merge
    key by key, lists and scalars are replaced). When no recipe sets ``algorithm`` or
    ``weights`` (e.g. only ``kv-fp8``), the weights stay in float (``algorithm: none``). Each file's keys
    and values are checked on their own, the combination of schemes (FP8, W4A8, FP4) on the merged recipe
    only, and not at all with ``check=False`` (:data:`PARTIAL`: ``--set`` and the flags are still to apply).

    Raises:
        InputError: as :func:`load_recipe`, naming the file with the bad key.
    """
    if not names:
        return load_recipe(None)
    merged: dict = {}
    stems = []
    for n in names:
        data, path = _read_recipe(n)
        parse_recipe({**data, "name": data.get("name", _stem(path))}, str(path), partial=True)  # keys and values
        data.pop("name", None)
        data.pop("description", None)
        if isinstance(data.get("kv_cache"), dict) and "scheme" in data["kv_cache"]:
            merged.pop("kv_cache", None)  # a new KV scheme replaces the previous one whole
        merged = _deep_merge(merged, data)
        stems.append(_stem(path))
    if "algorithm" not in merged and "weights" not in merged:
        merged["algorithm"] = "none"
    merged["name"] = "+".join(stems)
    descs = [(_read_recipe(n)[0].get("description") or "") for n in names]
    merged["description"] = "; ".join(d for d in descs if d)
    return parse_recipe(merged, " + ".join(str(n) for n in names), partial=not check)


def load_recipe(name_or_path: str | None) -> Recipe:
    """Load a bundled recipe by name or a YAML file by path (``None``: the default AWQ W4 recipe).

    Raises:
        InputError: unknown name, unreadable file, bad YAML, unknown keys or bad values.
    """
    if name_or_path is None:
        name_or_path = "w4a16-awq"
    data, path = _read_recipe(name_or_path)
    data.setdefault("name", _stem(path))
    return parse_recipe(data, str(path))


#: validation context of a recipe not yet final: keys and values are checked, not the schemes' combination
PARTIAL = {"partial": True}


def parse_recipe(data: dict, where: str = "recipe", partial: bool = False) -> Recipe:
    """Validate a recipe mapping (``partial``: not the schemes' combination, :data:`PARTIAL`); raises
    :class:`InputError` naming the bad key."""
    try:
        return Recipe.model_validate(data, context=PARTIAL if partial else None)
    except ValidationError as e:
        raise InputError(format_validation(e.errors(), where)) from None


def with_overrides(recipe: Recipe, partial: bool = False, **overrides) -> Recipe:
    """Return a copy of ``recipe`` with dotted-key overrides (``weights.num_bits=3``); ``None``
    values are skipped (a flag not given). See :func:`apply_settings` (``None`` is a value there).

    Raises:
        InputError: a key that is not a recipe field, or a value the field rejects.
    """
    return apply_settings(recipe, {k: v for k, v in overrides.items() if v is not None}, partial)


#: optional sections a dotted ``--set`` key creates with their defaults (``--set head.num_bits=4``)
_SECTIONS = {"head": HeadScheme, "embedding": EmbeddingScheme, "refine": RefineOptions}


#: how to give a null section before a dotted ``--set`` key inside it (a mapping value is YAML, quoted for the shell)
_SET_FIRST = {"kv_cache": "set it first (--kv-scheme fp8, or --set 'kv_cache={scheme: fp8}')",
              "activations": "set it whole first (--set 'activations={type: float, num_bits: 8, strategy: token}')"}


def apply_settings(recipe: Recipe, settings, partial: bool = False) -> Recipe:
    """Return a copy of ``recipe`` with dotted-key settings (``--set``: ``weights.num_bits=3``,
    ``head=null``), a dict or ``(key, value)`` pairs applied in their order (a key given twice:
    the last wins, where it stands); a ``None`` value sets the field to null, which only
    optional sections (``kv_cache``, ``head``, ``embedding``, ``refine``) accept; a key inside a null
    ``head``, ``embedding`` or ``refine`` section creates it with its defaults first. ``partial``: the result's
    schemes are not checked together (:data:`PARTIAL`; more settings follow).

    Raises:
        InputError: a key that is not a recipe field, or a value the field rejects.
    """
    data = recipe.model_dump(context=FULL_DUMP)
    for key, value in (settings.items() if isinstance(settings, dict) else settings):
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            if p in _SECTIONS and node is data and node[p] is None:  # head.* on a float head: the section's
                node[p] = _SECTIONS[p]().model_dump(context=FULL_DUMP)  # defaults (8 bit per channel), then the key
            if p in node and node[p] is None:
                raise InputError(f"command-line options: {key}: the recipe has no {p} section (null); "
                                 + _SET_FIRST.get(p, f"set it whole first (--set '{p}={{KEY: VALUE, ...}}')"))
            node = node.get(p)
            if not isinstance(node, dict):
                break
        if not isinstance(node, dict) or parts[-1] not in node:
            raise InputError(f"command-line options: {key}: unknown recipe key" + did_you_mean(key, dotted_keys(data)))
        node[parts[-1]] = value
    return parse_recipe(data, "command-line options", partial)


#: the flags of ``kvq quantize`` that set a recipe key (``SchemeOptions`` field -> recipe key)
_FLAGS = {"algorithm": "algorithm", "bits": "weights.num_bits", "group_size": "weights.group_size",
          "symmetric": "weights.symmetric", "act_order": "gptq.act_order"}
_NEGATED = {"symmetric": "--asymmetric", "act_order": "--no-act-order"}  # the flag that sets False


def effective_recipe(s) -> Recipe:
    """The recipe ``kvq quantize`` runs (``s``: its ``SchemeOptions``): the recipes ``s.recipes`` merged
    (:func:`load_recipes`), then the ``--kv-scheme`` section (so ``--set kv_cache.*`` can refine it), then
    ``--set``, then the dedicated flags (an explicit flag wins over ``--set`` of the same key); the schemes'
    combination is checked on that final recipe only (:func:`check_final`), so ``--set`` and the flags can fix it.

    Raises:
        InputError: a bad recipe key or value, a changed FP4 grid, a refused final recipe.
    """
    recipe = named = load_recipes(s.recipes, check=False)
    sets = [("--set weights.group_size", v) for k, v in s.settings or () if k == "weights.group_size"]
    given, size = ("--group-size", s.group_size) if s.group_size is not None else (sets or [("", None)])[-1]
    if why := fp4_grid_change(named, size, given):  # before the changed recipe is checked (its message is vaguer)
        raise InputError(why)
    if s.kv_scheme is not None:
        search = make_spec(s.kv_scheme).codec.flag_scale_search
        options = KVCacheOptions(scheme=s.kv_scheme, scale_search=search).model_dump()
        recipe = with_overrides(recipe, partial=True, kv_cache=options)
    if s.settings:
        if s.kv_scheme is not None and any(k == "kv_cache" and v is None for k, v in s.settings):
            raise InputError(f"--kv-scheme {s.kv_scheme} and --set kv_cache=null contradict each other; drop one")
        recipe = apply_settings(recipe, s.settings, partial=True)
    flags = {key: getattr(s, f) for f, key in _FLAGS.items()}
    final = with_overrides(recipe, partial=True, **flags)
    if (final.weights.type, final.weights.num_bits) == ("float", 4) and \
            (why := fp4_grid_change(named, final.weights.group_size)):
        raise InputError(why)
    changed = [f"--set {k}" for k, _ in s.settings or ()] + \
        [_NEGATED[f] if flags[key] is False and f in _NEGATED else f"--{f.replace('_', '-')}"
         for f, key in _FLAGS.items() if flags[key] is not None]
    return check_final(final, s.recipes, changed)


def check_final(recipe: Recipe, names, changed=()) -> Recipe:
    """``recipe`` (the recipes ``names`` merged, then ``changed``: the ``--set`` keys and flags given) when its
    schemes go together (:func:`compressor.recipe_mixed.check_schemes`).

    Raises:
        InputError: one line naming the recipes and options, and where a stack's activations came from when
            16-bit inputs would fix it (``--set activations=null``).
    """
    problem = check_schemes(recipe)
    if problem is None:
        return recipe
    where = " + ".join(map(str, names)) + (f" with {', '.join(changed)}" if changed else "")
    givers = [n for n in names if _read_recipe(n)[0].get("activations") is not None]
    inputs = recipe.activations is not None and "--set activations" not in changed and len(names) > 1
    if inputs and givers and check_schemes(recipe.model_copy(update={"activations": None})) is None:
        problem += f"; the activations come from {givers[-1]}: give it `activations: null` (--set activations=null)"
    raise InputError(f"{where or 'recipe'}: {problem}")


def resolve_group_size(recipe: Recipe, in_features: dict[str, int]) -> int:
    """The group size to use for the targeted modules (``name -> in_features``).

    ``auto`` picks the largest of 128/64/32 dividing every in_features.

    Raises:
        InputError: a fixed group size does not divide some module's in_features (names
            them and suggests a size that fits), or no standard size fits (``auto``).
    """
    gs = recipe.weights.group_size
    sizes = set(in_features.values())
    if gs == "auto":
        for cand in STANDARD_GROUP_SIZES:
            if all(n % cand == 0 for n in sizes):
                return cand
        raise InputError(f"no standard group size (128/64/32) divides every in_features "
                         f"({', '.join(map(str, sorted(sizes)))}); use -1")
    if gs == -1:
        return -1
    bad = sorted(name for name, n in in_features.items() if n % gs)
    if bad:
        fits = [c for c in STANDARD_GROUP_SIZES if all(n % c == 0 for n in sizes)]
        fp4 = recipe.weights.type == "float" and recipe.weights.num_bits == 4  # MXFP4 / NVFP4: groups of 32 / 16 only
        hint = ("FP4 weights need every quantized linear's in_features to be a multiple of the group (NVFP4: 16, "
                "MXFP4: 32): list those linears under the recipe's ignore:, or use an integer recipe" if fp4
                else f"use --group-size {fits[0]}" if fits else "use --group-size -1 (per channel)")
        if recipe.activations is not None and recipe.weights.type == "int":  # W4A8: vLLM's kernel serves 128 only
            hint += " (kvq simulates it; vLLM's W4A8 kernel serves groups of 128 only, so not on this model)"
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise InputError(
            f"group_size {gs} does not divide in_features of {shown} "
            f"(in_features {', '.join(map(str, sorted({in_features[b] for b in bad})))}); {hint}"
        )
    return gs
