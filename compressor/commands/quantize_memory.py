"""``kvq quantize``'s memory plan: what a streamed run holds at peak, from the model's shapes alone,
and the refusal of a ``--memory-budget-gib`` below its smallest unit.

A streamed quantize (:mod:`compressor.source.lazy`) holds at most one decoder layer's weights at
:data:`compressor.staging.HELD_BYTES_PER_WEIGHT` bytes a weight (the float32 weight and its int8
codes). A layer whose weights exceed ``--memory-budget-gib`` and that has routed experts is read
in groups of whole experts within the budget (:meth:`compressor.staging.LayerWriter.expert_groups`)
beside its non-expert part; a layer without routed experts is held whole, whatever the budget
(its linears are not divided), and the plan says so. The smallest unit the budget divides is
one routed expert: a budget below the largest one is refused (one line, exit 2) before the
model loads, as are NVFP4 activations (W4A4) on routed experts that would be read in groups (their
``input_global_scale`` is observed on the layer's recompute, after each group is written).

What the plan counts (:func:`estimate`), per phase, besides the process's own
:data:`compressor.streamed_eval.BASELINE_BYTES`:

- *capture*: the rows of the embedding the calibration tokens use, in float32 (at most one a token:
  layer 0's inputs are made from them, :func:`compressor.layer_inputs.compact_embedding`; the table and
  the head are read only at the end) and the calibration activations;
- *each decoder layer*: its weights held (the layer whole, or its non-expert part and one group of
  experts), the calibration activations (a layer's inputs and outputs, two copies, or one copy
  when they are spilled to memory-mapped files: :func:`compressor.activations.plan_activations`;
  GPTQ's float target doubles them), for the GPTQ family the Hessians of the largest reader-set
  pass (:data:`compressor.quant.gptq_layer.HESSIAN_BYTES` x ``in_features``\\ :sup:`2` per set: a
  true-sequential stage, else every stage of the layer) or of one routed expert, whichever is
  larger, for AWQ the search's copies (a whole layer's weights before folding and its largest
  stage twice; a grouped layer's candidates' routed outputs, within the budget), one calibration
  batch's forward through the layer, and in a grouped MoE layer the recorded inputs and routed
  outputs of the experts (one copy each);
- *the end*: the embedding and the head in the artifact's dtype, a quantized head in float32 with
  its Hessian;
- a GGUF file without kvq's cache: its float32 model, whole once while it is converted.

With ``--workers N`` the plan is each process's.

It is an estimate from shapes (allocator slack, the algorithm's small buffers and the libraries
are not in it); the measured peaks it is compared with are in BENCHMARKS.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .. import console as show
from ..activations import plan_activations
from ..arch import get_arch, is_expert, layer_linears
from ..artifact import DTYPES
from ..errors import InputError
from ..quant.algorithms import get_algorithm
from ..quant.gptq_layer import HESSIAN_BYTES
from ..recipe_schemes import observes_inputs
from ..source.gguf_cache import cached_gguf_folder
from ..source.resolve import float32_bytes
from ..staging import HELD_BYTES_PER_WEIGHT
from ..streamed_eval import BASELINE_BYTES, GIB


#: sequences per calibration batch (:func:`compressor.pipeline.quantize_model`'s ``batch_size``)
CALIBRATION_BATCH = 8


def _gib(n: int) -> str:
    if n >= GIB // 10:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def smallest_budget(n: int) -> str:
    """``n`` bytes as a ``--memory-budget-gib`` value that holds them: GiB rounded *up* to four
    significant digits (a value rounded down would be refused again)."""
    gib = n / GIB
    step = 10.0 ** (math.floor(math.log10(gib)) - 3)
    return f"{math.ceil(gib / step - 1e-9) * step:.4g}"


@dataclass
class LayerHold:
    """What one decoder layer holds, in bytes (:func:`estimate`)."""

    index: int
    weights: int  #: the layer whole, or its non-expert part
    group: int  #: one group of routed experts (0: the layer is held whole)
    hessians: int  #: GPTQ family: the largest pass's Hessians over the non-expert part (whole layer: or one expert's)
    expert_hessians: int  #: GPTQ family, grouped layer: one expert's, beside its group
    search: int  #: AWQ: whole, the weights before folding and a stage's weights twice; grouped, the candidates' outputs
    experts: int  #: experts' recorded inputs and routed outputs of a grouped MoE layer
    work: int = 0  #: one calibration batch's forward through the layer (attention scores, the MLP's widths)
    per_group: int | None = None  #: experts a group; None: the layer is held whole
    of_experts: int = 0  #: routed experts in the layer
    expert_bytes: int = 0  #: one routed expert at HELD_BYTES_PER_WEIGHT

    @property
    def total(self) -> int:
        """The non-expert part's step first (its Hessians or search), then the groups with theirs."""
        if self.per_group is None:
            return self.weights + self.work + max(self.hessians, self.expert_hessians) + self.search
        return (self.weights + self.experts + self.work
                + max(self.hessians, self.group + self.expert_hessians + self.search))

    def describe(self) -> str:
        if self.per_group is None:
            what = f"layer {self.index} whole {_gib(self.weights)}"
        else:
            what = (f"layer {self.index}'s non-expert part {_gib(self.weights)} and a group of {self.per_group} of its "
                    f"{self.of_experts} experts {_gib(self.group)}")
        beside = self.per_group is not None and self.hessians > self.group + self.expert_hessians  # the held part's
        hess = max(self.hessians, self.expert_hessians) if self.per_group is None or beside else self.expert_hessians
        extra = f", Hessians {_gib(hess)}" if hess else ""
        extra += f", scale search {_gib(self.search)}" if self.search else ""
        extra += f", expert inputs and outputs {_gib(self.experts)}" if self.experts else ""
        return what + extra + (f", a batch's forward {_gib(self.work)}" if self.work else "")


@dataclass
class QuantizeMemory:
    """A streamed quantize's peak, phase by phase, in bytes (module docstring)."""

    layer: LayerHold  #: the decoder layer whose phase holds the most
    capture: int  #: the calibration tokens' embedding rows in float32 (layer 0's inputs are made from them)
    end: int  #: the tensors outside the layers written at the end
    activations: int  #: calibration activations held in memory (and the token ids)
    budget: int  #: --memory-budget-gib in bytes
    budget_gib: float  #: --memory-budget-gib as given
    undivided: list[int]  #: layers held whole although above the budget (no routed experts)
    grouped: LayerHold | None = None  #: the grouped MoE layer that holds the most, None when none is grouped
    conversion: int = 0  #: a GGUF file without kvq's cache: its float32 model, held once while it is converted
    workers: int = 1  #: --workers: processes that each hold what this plan counts

    @property
    def peak(self) -> int:
        return BASELINE_BYTES + max(self.activations + max(self.capture, self.layer.total, self.end), self.conversion)

    def describe(self) -> str:
        """One line: the estimated peak, the phase that makes it first, then the rest worth knowing."""
        phases = {"layer": self.layer.total, "capture": self.capture, "end": self.end}
        top = max(phases, key=phases.get)
        parts = {"layer": self.layer.describe(),
                 "capture": f"the calibration tokens' embedding rows in float32 {_gib(self.capture)}, at the start",
                 "end": f"the embedding and head {_gib(self.end)} for the artifact's last part, at the end"}
        said = [parts[top]]
        if self.conversion and self.conversion > self.activations + phases[top]:
            said.insert(0, f"this first run converts the GGUF file into kvq's cache, its float32 model whole "
                           f"{_gib(self.conversion)}, once")
        elif self.conversion:
            said.append(f"this first run converts the GGUF file into kvq's cache first ({_gib(self.conversion)}, once)")
        if self.grouped is not None and (top != "layer" or self.grouped is not self.layer):
            said.append(f"MoE layers read in groups of {self.grouped.per_group} of {self.grouped.of_experts} experts "
                        f"(layer {self.grouped.index}: {_gib(self.grouped.total)})")
        over = ""
        if self.undivided:
            over = (f"; layer{'s' if len(self.undivided) > 1 else ''} {_list(self.undivided)} above the budget "
                    "without routed experts: held whole")
        each = f" in each of {self.workers} worker processes and the main one" if self.workers > 1 else ""
        return (f"about {_gib(self.peak)} at peak{each}: {'; '.join(said)}; activations {_gib(self.activations)}; "
                f"process {_gib(BASELINE_BYTES)} (--memory-budget-gib {show.as_typed(self.budget_gib)}: weights held "
                f"at {HELD_BYTES_PER_WEIGHT} bytes each{over})")

    def as_dict(self) -> dict:
        """The ``--json`` summary's ``memory_plan`` (MiB)."""
        mib = lambda n: round(n / 2**20, 3)  # noqa: E731
        grouped = None if self.grouped is None else {
            "layer": self.grouped.index, "non_expert_mib": mib(self.grouped.weights),
            "group_mib": mib(self.grouped.group), "peak_mib": mib(self.grouped.total)}
        return {"peak_mib": mib(self.peak), "layer": self.layer.index, "layer_weights_mib": mib(self.layer.weights),
                "experts_per_group": self.grouped.per_group if self.grouped is not None else None,
                "grouped_layer": grouped, "hessians_mib": mib(self.layer.hessians),
                "search_mib": mib(self.layer.search), "batch_forward_mib": mib(self.layer.work),
                "expert_io_mib": mib(self.layer.experts), "capture_mib": mib(self.capture), "end_mib": mib(self.end),
                "activations_mib": mib(self.activations), "process_mib": mib(BASELINE_BYTES),
                "budget_mib": mib(self.budget), "undivided_layers": self.undivided,
                "gguf_conversion_mib": mib(self.conversion)}


def _list(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:4])) + (f" and {len(xs) - 4} more" if len(xs) > 4 else "")


def _stage_hessians(arch, names: dict[str, torch.nn.Linear], true_sequential: bool) -> int:
    """Bytes of the Hessians one GPTQ pass over the layer's non-expert linears holds: per stage of
    ``arch.sequential`` one reader set per distinct input width (linears reading one input share
    it); the largest stage when ``true_sequential``, else every stage at once."""
    per_stage = []
    for stage in arch.sequential:
        widths = {names[r].in_features for r in stage if r in names}
        per_stage.append(sum(HESSIAN_BYTES * w * w for w in widths))
    return (max(per_stage, default=0) if true_sequential else sum(per_stage))


def _experts(arch, layer) -> tuple[int, int]:
    """``(routed experts, weights of one)`` of a decoder layer built on ``meta`` (fused 3-D
    parameters or a list of expert modules); ``(0, 0)`` without routed experts."""
    if arch.moe is None:
        return 0, 0
    try:
        mod = layer.get_submodule(arch.moe.experts)
    except AttributeError:
        return 0, 0
    params = list(mod.parameters())
    fused = [p for p in params if p.ndim == 3]
    n = fused[0].shape[0] if fused else len(mod) if isinstance(mod, torch.nn.ModuleList) else 0
    return (n, sum(p.numel() for p in params) // n) if n else (0, 0)


def _layer(i: int, layer, arch, recipe, budget: int, algo: tuple[bool, bool], tokens: tuple[int, int],
           batch: tuple[int, int, int, int]) -> LayerHold:
    """What decoder layer ``i`` (built on ``meta``) holds under ``budget`` (module docstring); ``algo``:
    (GPTQ Hessians, AWQ search); ``tokens``: bytes of one float32 copy of the calibration's and of
    AWQ's loss sequences' hidden states; ``batch``: (sequences of a calibration batch, seqlen, attention
    heads, hidden size), for the forward's working set: every head's scores and the layer's widest linear three times
    (an MLP's gate, up and their product) beside six hidden-wide tensors per token, float32."""
    gptq, awq = algo
    n, one = _experts(arch, layer)
    whole = sum(p.numel() for p in layer.parameters()) * HELD_BYTES_PER_WEIGHT
    expert = one * HELD_BYTES_PER_WEIGHT
    exp_prefix = arch.moe.experts + "." if arch.moe is not None else "\0"
    linears = {r: m for r, m in layer.named_modules()
               if isinstance(m, torch.nn.Linear) and not r.startswith(exp_prefix)}
    hess = _stage_hessians(arch, linears, recipe.gptq.true_sequential) if gptq else 0
    b, t, heads, hidden = batch
    widest = max((m.out_features for m in linears.values()), default=0)
    work = b * 4 * (heads * t * t + t * (3 * widest + 6 * hidden))
    widths = sorted({p.shape[-1] for p in layer.get_submodule(arch.moe.experts).parameters()}) if n else []
    expert_hess = sum(HESSIAN_BYTES * w * w for w in widths) if gptq else 0  # gate/up's input and down's
    if not n or whole <= budget:
        stage = max((sum(linears[r].weight.numel() for r in st if r in linears) for st in arch.sequential), default=0)
        search = 4 * (whole // HELD_BYTES_PER_WEIGHT) + 2 * 4 * stage if awq else 0  # weights before folding; 2 copies
        return LayerHold(i, whole, 0, hess, expert_hess, search, 0, work, None, n, expert)
    per = min(n, max(1, budget // expert))
    search = min(budget, recipe.awq.n_grid * tokens[1]) if awq else 0
    return LayerHold(i, whole - n * expert, per * expert, hess, expert_hess, search, 2 * tokens[0], work, per, n,
                     expert)


def estimate(skeleton, arch, recipe, calib_shape: tuple[int, int] | None, spilled: bool, memory_budget_gib: float,
         gptq: bool, float_stream: bool, dtype_bytes: int, awq: bool = False, ranks: int = 1) -> QuantizeMemory:
    """A streamed quantize's memory plan from the model built on ``meta``
    (:func:`compressor.source.open.meta_skeleton`).

    Args:
        skeleton: the model on ``meta``; ``arch`` its :class:`compressor.arch.ArchSpec`.
        recipe: the effective :class:`compressor.recipe.Recipe` (its ``gptq.true_sequential``, ``head``).
        calib_shape: ``(samples, seqlen)`` of the calibration, ``None`` without one.
        spilled: the activations go to memory-mapped files (one copy in memory instead of two).
        memory_budget_gib: ``--memory-budget-gib``.
        gptq: the algorithm accumulates GPTQ Hessians; ``float_stream``: GPTQ's float target (two streams);
            ``awq``: it searches AWQ scales.
        dtype_bytes: bytes per element of the artifact's float tensors.
        ranks: ``torchrun`` processes (``WORLD_SIZE``): above 1 they own the routed experts, read in groups.

    Returns:
        A :class:`QuantizeMemory`.

    Raises:
        InputError: the budget is below one routed expert of a layer that must be read in groups
            (the smallest unit: the line names the layer and the smallest budget that holds it); NVFP4
            activations on routed experts read in groups (:func:`_refuse_observed_groups`).
    """
    cfg = skeleton.config
    hidden = cfg.hidden_size
    budget = int(memory_budget_gib * GIB)
    samples, seqlen = calib_shape or (0, 0)
    token_copy = samples * seqlen * hidden * 4
    copy = token_copy * (2 if float_stream else 1)
    activations = copy * (1 if spilled else 2) + samples * seqlen * 8
    loss = min(recipe.awq.loss_samples, samples) * seqlen * hidden * 4
    batch = (min(CALIBRATION_BATCH, samples), seqlen, cfg.num_attention_heads, hidden)
    holds = [_layer(i, layer, arch, recipe, budget, (gptq, awq), (token_copy, loss), batch)
             for i, layer in enumerate(skeleton.get_submodule(arch.layers))]
    grouped = [h for h in holds if h.per_group is not None]
    if grouped and budget < (big := max(grouped, key=lambda h: h.expert_bytes)).expert_bytes:
        raise InputError(f"--memory-budget-gib {show.as_typed(memory_budget_gib)} cannot hold one routed expert of "
                         f"decoder layer {big.index} ({big.expert_bytes:,} bytes at {HELD_BYTES_PER_WEIGHT} bytes a "
                         f"weight: float32 and its int8 codes), the smallest unit a layer is read in: give "
                         f"--memory-budget-gib {smallest_budget(big.expert_bytes)} or more")
    if observes_inputs(recipe):
        _refuse_observed_groups(skeleton, arch, recipe, holds if ranks > 1 else grouped, memory_budget_gib, ranks)
    emb = skeleton.get_submodule(arch.embed_tokens).weight.numel()
    head_mod = skeleton.get_submodule(arch.lm_head) if not getattr(cfg, "tie_word_embeddings", False) else None
    head = head_mod.weight.numel() if head_mod is not None else 0
    end = (emb + head) * dtype_bytes
    if recipe.head is not None:
        end += emb * HELD_BYTES_PER_WEIGHT + (HESSIAN_BYTES * hidden * hidden if gptq else 0)
    undivided = [h.index for h in holds if h.per_group is None and h.weights > budget]
    rows = min(emb, samples * seqlen * hidden)  # the calibration tokens' rows (layer_inputs.compact_embedding)
    return QuantizeMemory(max(holds, key=lambda h: h.total), rows * 4, end, activations, budget, memory_budget_gib,
                          undivided,
                          max(grouped, key=lambda h: h.total) if grouped else None)


def _refuse_observed_groups(skeleton, arch, recipe, holds: list[LayerHold], budget_gib: float, ranks: int) -> None:
    """Refuses NVFP4 activations (W4A4) on the targeted routed experts of a decoder layer read in groups (``holds``:
    the grouped layers, or under several ranks every layer). Each linear's ``input_global_scale`` is the absmax of
    its inputs on the layer's recompute with its quantized weights (:mod:`compressor.quant.fp4_inputs`); a grouped
    layer's recompute replays the routed output its groups added up, and each group is packed and written before
    the next is read (:mod:`compressor.moe_stream`), so no expert's input is observed before it is written, and an
    expert no token reached takes the largest scale of the layer's other experts, known only after the last group.

    Raises:
        InputError: one line naming the layer and what avoids it (a budget holding the layer whole, --no-stream, or
            one process instead of several torchrun ranks).
    """
    layers = skeleton.get_submodule(arch.layers)
    for h in holds:
        if not h.of_experts or all(not is_expert(arch, r) or recipe.is_ignored(f"{arch.layers}.{h.index}.{r}")
                                   for r in layer_linears(arch, layers[h.index])):
            continue
        why = ("NVFP4 activations (W4A4) on routed experts read in groups are not implemented (each group is "
               "written before the layer's recompute observes the inputs that give its input_global_scale)")
        if ranks > 1:
            raise InputError(f"{why}: under {ranks} torchrun ranks each reads its share of MoE decoder layer "
                             f"{h.index}'s experts in groups; quantize W4A4 in one process (without torchrun)")
        whole = h.weights + h.of_experts * h.expert_bytes
        raise InputError(f"{why}: --memory-budget-gib {show.as_typed(budget_gib)} reads MoE decoder layer {h.index} "
                         f"({whole:,} bytes whole) in groups; give --memory-budget-gib {smallest_budget(whole)} or "
                         "more (the layer whole), or --no-stream")


def _passes(recipe) -> tuple[bool, bool, bool]:
    """``(GPTQ Hessians, GPTQ's float stream beside the quantized one, AWQ search)`` of ``recipe``'s algorithm."""
    reads = get_algorithm(recipe.algorithm).reads
    return "gptq" in reads, "gptq" in reads and recipe.gptq.gptaq_alpha > 0, "awq" in reads


def check_activations(plan, opts, hidden: int | None, console) -> None:
    """The calibration activations against memory, disk and ``--activation-budget-gib``
    (:func:`compressor.activations.plan_activations`); sets ``plan.activation_budget_gib``.
    Run in the plan for a Hugging Face folder, after loading for a GGUF file (its hidden size
    is known only then).

    Raises:
        InputError: the activations cannot fit (the line says what each needs).
    """
    plan.activation_budget_gib = opts.execution.activation_budget_gib
    if plan.calib_shape is None or not hidden:
        return
    streams = 2 if _passes(plan.recipe)[1] else 1
    spill_all, note = plan_activations(*plan.calib_shape, hidden, int(plan.activation_budget_gib * 2**30),
                                       plan.out.resolve().parent, opts.execution.device, streams)
    if spill_all:
        plan.activation_budget_gib = 0.0
    if note:
        show.note(console, f"[yellow]note:[/] {note}", highlight=False)


def for_run(skeleton, plan, execution) -> QuantizeMemory:
    """:func:`estimate` for a ``kvq quantize`` run (:class:`compressor.commands.quantize._Plan`, its
    ``--activation-budget-gib`` resolved; ``execution``: the options' ``--memory-budget-gib``).

    Raises:
        InputError: see :func:`estimate`.
    """
    gptq, float_stream, awq = _passes(plan.recipe)
    samples, seqlen = plan.calib_shape or (0, 0)
    copy = samples * seqlen * skeleton.config.hidden_size * 4 * (2 if float_stream else 1)
    act_budget = (plan.activation_budget_gib if plan.activation_budget_gib is not None
                  else execution.activation_budget_gib)
    mem = estimate(skeleton, get_arch(skeleton.config.model_type), plan.recipe, plan.calib_shape,
                   copy > act_budget * GIB, execution.memory_budget_gib, gptq, float_stream,
                   DTYPES[plan.dtype].itemsize, awq, int(os.environ.get("WORLD_SIZE") or 1))
    if plan.source.kind == "gguf" and cached_gguf_folder(plan.source) is None:
        mem.conversion = float32_bytes(skeleton)
    mem.workers = execution.workers
    return mem
