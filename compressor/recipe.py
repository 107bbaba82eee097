"""Recipes: what to quantize and how, as validated data (YAML in ``recipes/``).

A recipe is a pydantic model with ``extra="forbid"``, so an unknown or misspelt key is
an error naming the key. Bundled recipes are looked up by name (``w4a16-awq-g64``) or a
path to a YAML file is given; command-line flags override fields afterwards and the
*effective* recipe is stored in the artifact's manifest.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InputError

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
STANDARD_GROUP_SIZES = (128, 64, 32)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WeightScheme(_Strict):
    """Integer weight-only scheme. ``group_size``: 32/64/128/..., ``-1`` per channel, or ``auto``."""

    num_bits: int = Field(4, ge=2, le=8)
    group_size: Union[int, Literal["auto"]] = 128
    symmetric: bool = False

    @field_validator("group_size")
    @classmethod
    def _gs(cls, v):
        if v != "auto" and v != -1 and (v is None or v <= 0):
            raise ValueError("group_size must be a positive integer, -1 (per channel) or 'auto'")
        return v


class AWQOptions(_Strict):
    """AWQ knobs (Lin et al., 2023). ``loss_samples``: calibration sequences used for the
    grid-search loss (activation statistics always use all samples); ``clip_tokens``:
    tokens sampled for the weight-clipping search."""

    n_grid: int = Field(20, ge=1, le=100)
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = Field(20, ge=2, le=100)
    clip_max_shrink: float = Field(0.5, gt=0.0, lt=1.0)
    clip_tokens: int = Field(512, ge=16)
    loss_samples: int = Field(8, ge=1)


class Gates(_Strict):
    """Verification thresholds used by ``kvq verify`` when no flag overrides them."""

    max_ppl_increase_pct: float = Field(20.0, ge=0.0)


class Recipe(_Strict):
    """A complete quantization recipe."""

    name: str = "custom"
    description: str = ""
    algorithm: Literal["rtn", "awq"] = "awq"
    weights: WeightScheme = WeightScheme()
    ignore: list[str] = Field(default_factory=list, description="module names or 're:' regexes left in float")
    awq: AWQOptions = AWQOptions()
    gates: Gates = Gates()

    @field_validator("ignore")
    @classmethod
    def _regexes(cls, v):
        for item in v:
            if item.startswith("re:"):
                try:
                    re.compile(item[3:])
                except re.error as e:
                    raise ValueError(f"bad regex {item!r}: {e}") from None
        return v

    def is_ignored(self, module_name: str) -> bool:
        """True when ``module_name`` matches an entry of ``ignore`` (exact name or ``re:`` regex)."""
        for item in self.ignore:
            if item.startswith("re:"):
                if re.fullmatch(item[3:], module_name):
                    return True
            elif item == module_name:
                return True
        return False


def bundled_recipes() -> dict[str, Path]:
    """Names and paths of the recipes shipped in ``recipes/``."""
    return {p.stem: p for p in sorted(RECIPE_DIR.glob("*.yaml"))}


def _format_validation(err: ValidationError, where: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "<root>"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    return f"{where}: {loc}: {msg}"


def load_recipe(name_or_path: str | None) -> Recipe:
    """Load a bundled recipe by name or a YAML file by path (``None``: the default AWQ W4 recipe).

    Raises:
        InputError: unknown name, unreadable file, bad YAML, unknown keys or bad values.
    """
    if name_or_path is None:
        name_or_path = "w4a16-awq-g64"
    path = Path(name_or_path)
    bundled = bundled_recipes()
    if not path.exists():
        if name_or_path in bundled:
            path = bundled[name_or_path]
        else:
            raise InputError(
                f"recipe '{name_or_path}' is neither a file nor a bundled recipe ({', '.join(bundled)})"
            )
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"cannot read recipe {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise InputError(f"recipe {path} must be a YAML mapping")
    data.setdefault("name", path.stem)
    return parse_recipe(data, str(path))


def parse_recipe(data: dict, where: str = "recipe") -> Recipe:
    """Validate a recipe mapping; raises :class:`InputError` naming the bad key."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise InputError(_format_validation(e, where)) from None


def with_overrides(recipe: Recipe, **overrides) -> Recipe:
    """Return a copy of ``recipe`` with dotted-key overrides (``weights.num_bits=3``); ``None`` values are skipped."""
    data = recipe.model_dump()
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value
    return parse_recipe(data, "command-line options")


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
        raise InputError(f"no standard group size (128/64/32) divides every in_features {sorted(sizes)}; use -1")
    if gs == -1:
        return -1
    bad = sorted(name for name, n in in_features.items() if n % gs)
    if bad:
        fits = [c for c in STANDARD_GROUP_SIZES if all(n % c == 0 for n in sizes)]
        hint = f"use --group-size {fits[0]}" if fits else "use --group-size -1 (per channel)"
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise InputError(
            f"group_size {gs} does not divide in_features of {shown} "
            f"(in_features {sorted({in_features[b] for b in bad})}); {hint}"
        )
    return gs
