"""The gate table: every pass/fail threshold kvq checks, one row each.

A gate compares one statistic of a command's report with a threshold: ``max`` gates
pass when ``value <= threshold``, ``min`` gates when ``value >= threshold``; a missing
value (``None``) fails. ``kvq verify`` reads its thresholds from the recipe's ``gates``
block (stored in the manifest) overridden by flags; ``kvq serve-smoke`` likewise, with
defaults of its own. The configurable rows are exactly the fields of
:class:`compressor.recipe.Gates`; ``finite_weights`` and ``http_answers`` always run.

======================  ===========  =====  ================================  ==========================
gate                    command      dir.   statistic (report path)           needs
======================  ===========  =====  ================================  ==========================
finite_weights          verify       max    nonfinite_tensors (count)         -
max_ppl_increase_pct    verify       max    perplexity.increase_pct           full evaluation
max_mean_kl             verify       max    distribution.kl.mean              full evaluation
max_p99_kl              verify       max    distribution.kl.p99               full evaluation
min_top1_agreement_pct  verify       min    distribution.top1_agreement_pct   full evaluation
min_sqnr_db             verify       min    weights.min_sqnr_db               quantized weights
max_hidden_error        verify       max    hidden_state_error.last           quantized weights, full
min_median_divergence   verify       min    drift.median                      full evaluation
min_long_agreement_pct  verify       min    long_generation.top1_agreem._pct  a KV scheme, --long-tokens
serve_min_top1_pct      serve-smoke  min    comparison.top1_agreement_pct     -
serve_max_prompt_kl     serve-smoke  max    comparison.prompt_kl.mean         -
serve_min_median_div.   serve-smoke  min    comparison.median_first_diverg.   -
http_answers            serve-smoke  min    http.ok (threshold: requests)     --http
======================  ===========  =====  ================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

VERIFY = "verify"
SERVE_SMOKE = "serve-smoke"


@dataclass(frozen=True)
class GateSpec:
    """One gate.

    Attributes:
        name: the gate's name in reports and in the recipe's ``gates`` block.
        command: ``verify`` or ``serve-smoke``.
        direction: ``max`` (pass when value <= threshold) or ``min`` (value >= threshold).
        unit: display unit, with its leading space (``" %"``).
        scale: display multiplier (``max_hidden_error`` is a fraction shown in percent).
        statistic: dotted path of the value in the command's report.
        option: the command's option (and flag stem, ``min_top1`` -> ``--min-top1``) that
            overrides the recipe's threshold; ``None`` for gates without one.
        needs_full: the statistic exists only in a full evaluation (not ``--weights-only``).
        needs_quantized: the statistic exists only for an artifact with quantized weights.
        measured_on: fixed ``measured_on`` of the gate in the verify report; ``None``: the
            configuration the evaluation served (weights, KV or both).
        default: threshold when neither a flag nor the recipe sets one (``None``: ungated).
    """

    name: str
    command: Literal["verify", "serve-smoke"]
    direction: Literal["max", "min"]
    unit: str
    statistic: str
    option: Optional[str] = None
    scale: float = 1
    needs_full: bool = False
    needs_quantized: bool = False
    measured_on: Optional[str] = None
    default: Optional[float] = None

    @property
    def symbol(self) -> str:
        """``<=`` for a max gate, ``>=`` for a min gate."""
        return "<=" if self.direction == "max" else ">="

    @property
    def flag(self) -> Optional[str]:
        """The command-line flag that sets the threshold (``--min-top1``), if any."""
        return None if self.option is None else "--" + self.option.replace("_", "-")

    def passes(self, value, threshold: float) -> bool:
        """Whether ``value`` passes ``threshold`` (a missing value never does)."""
        if value is None:
            return False
        return bool(value <= threshold if self.direction == "max" else value >= threshold)

    def unavailable(self, mode: str, weights_quantized: bool) -> Optional[str]:
        """Why verify in ``mode`` cannot evaluate this gate, or ``None`` when it can."""
        if self.needs_quantized and not weights_quantized:
            return "the artifact has no quantized weights"
        if self.needs_full and mode != "full":
            return f"--{mode} does not compute it"
        return None


#: every gate; the configurable ones in the order of :class:`compressor.recipe.Gates`' fields
GATES: tuple[GateSpec, ...] = (
    GateSpec("finite_weights", VERIFY, "max", " tensors", "nonfinite_tensors", measured_on="artifact tensors"),
    GateSpec("max_ppl_increase_pct", VERIFY, "max", " %", "perplexity.increase_pct", "max_ppl_increase",
             needs_full=True, default=20.0),
    GateSpec("max_mean_kl", VERIFY, "max", " nats", "distribution.kl.mean", "max_mean_kl", needs_full=True),
    GateSpec("max_p99_kl", VERIFY, "max", " nats", "distribution.kl.p99", "max_p99_kl", needs_full=True),
    GateSpec("min_top1_agreement_pct", VERIFY, "min", " %", "distribution.top1_agreement_pct", "min_top1",
             needs_full=True),
    GateSpec("min_sqnr_db", VERIFY, "min", " dB", "weights.min_sqnr_db", "min_sqnr_db", needs_quantized=True,
             measured_on="weights only"),
    GateSpec("max_hidden_error", VERIFY, "max", " %", "hidden_state_error.last", "max_hidden_error", scale=100,
             needs_full=True, needs_quantized=True, measured_on="weights only"),
    GateSpec("min_median_divergence", VERIFY, "min", " tokens", "drift.median", "min_median_divergence",
             needs_full=True),
    GateSpec("min_long_agreement_pct", VERIFY, "min", " %", "long_generation.top1_agreement_pct",
             "min_long_agreement", needs_full=True, measured_on="KV only"),
    GateSpec("serve_min_top1_pct", SERVE_SMOKE, "min", " %", "comparison.top1_agreement_pct", "min_top1",
             default=70.0),
    GateSpec("serve_max_prompt_kl", SERVE_SMOKE, "max", " nats", "comparison.prompt_kl.mean", "max_kl", default=0.5),
    GateSpec("serve_min_median_divergence", SERVE_SMOKE, "min", " tokens", "comparison.median_first_divergence",
             "min_first_divergence"),
    GateSpec("http_answers", SERVE_SMOKE, "min", " requests", "http.ok"),
)

BY_NAME: dict[str, GateSpec] = {g.name: g for g in GATES}


def gate(name: str) -> GateSpec:
    """The row of gate ``name``.

    Raises:
        KeyError: no such gate.
    """
    return BY_NAME[name]


def gates_of(command: str, configurable: bool = False) -> tuple[GateSpec, ...]:
    """The rows of ``command`` in table order; ``configurable``: only those with an option."""
    return tuple(g for g in GATES if g.command == command and (g.option is not None or not configurable))


def recipe_gate_names() -> tuple[str, ...]:
    """Names a recipe's ``gates`` block may set (the fields of :class:`compressor.recipe.Gates`)."""
    return tuple(g.name for g in GATES if g.option is not None)


def statistic(report: dict, spec: GateSpec):
    """The value ``spec`` reads from ``report`` (``None`` where the path is missing)."""
    node = report
    for key in spec.statistic.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def choose_thresholds(command: str, flags: dict, stored: dict) -> dict[str, Optional[float]]:
    """Threshold of each configurable gate of ``command``: its flag (``flags[option]``), else
    the recipe's value (``stored[name]``), else the table's default; ``None``: ungated."""
    out = {}
    for g in gates_of(command, configurable=True):
        value = flags.get(g.option)
        if value is None:
            value = stored.get(g.name)
        if value is None:
            value = g.default
        out[g.name] = value
    return out


def result(name: str, threshold: float, value, **extra) -> dict:
    """One gate's result: ``{"name", "threshold", "value", "passed", **extra}``."""
    return {"name": name, "threshold": threshold, "value": value, "passed": gate(name).passes(value, threshold),
            **extra}
