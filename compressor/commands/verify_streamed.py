"""``kvq verify`` on models that do not fit whole: steps 3 and 4 of :mod:`compressor.commands.verify`
with both models read one decoder layer at a time (:mod:`compressor.streamed_eval`).

:func:`choose` decides before any model loads: ``--stream``, or the two models whole above
``--memory-budget-gib`` (default: the memory this machine has available). :meth:`Streamed.run`
then builds both models with their decoder layers on ``meta``, prints the memory plan (and
refuses one ``--memory-budget-gib`` cannot hold), and fills the same report sections as the
whole-model path: weight statistics a layer at a time, perplexity / KL / top-1 per window,
hidden-state error per layer, KV accounting. Greedy drift needs generation, which would run
every layer once per new token: it is skipped, and the report (``evaluated_in.streamed``, a
warning) says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .. import console as show
from ..errors import CheckFailed, InputError
from ..streamed_eval import GIB, BASELINE_BYTES

#: why greedy drift is missing from a streamed report
DRIFT_SKIPPED = "skipped: greedy generation runs every decoder layer once per new token, so it needs the models whole"


def _available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, ``None`` where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _whole_bytes(plan, opts) -> int | None:
    """About what the whole-model path holds besides the process itself: the reference in
    float32 and the artifact dequantized to its evaluation dtype (parameter count from the
    reference's shard headers), ``None`` for a source that is not a safetensors folder."""
    import torch

    from ..source.lazy import LazyCheckpoint
    from .verify_common import eval_dtype

    if plan.ref_source.kind != "hf":
        return None
    ckpt = LazyCheckpoint(plan.ref_source.path, block_fp8=None)
    n = sum(int(torch.Size(e.shape).numel()) for name, (_, e) in ckpt.where.items() if not name.endswith("_scale_inv"))
    dtype = eval_dtype(plan.folder, opts.evaluation.dtype)[0]
    return n * (4 + torch.empty((), dtype=dtype).element_size())


def budget_bytes(opts) -> int | None:
    """Bytes a streamed verify may hold, the process's own :data:`BASELINE_BYTES` included:
    ``--memory-budget-gib`` (what the evaluation holds besides the process, as quantize's budget
    counts weights, not the interpreter) plus the baseline, else ``MemAvailable``; ``None``
    where neither is known."""
    if opts.memory_budget_gib is not None:
        return int(opts.memory_budget_gib * GIB) + BASELINE_BYTES
    return _available_bytes()


def choose(plan, opts, report: dict, console) -> "Streamed | None":
    """The streamed evaluation when ``--stream`` asks for it or the models do not fit whole
    (``--memory-budget-gib``, else ``MemAvailable``), else ``None`` (the whole-model path)."""
    if opts.mode == "hashes-only":
        return None
    if opts.stream:
        return Streamed(plan, opts, report, console, "--stream")
    need = _whole_bytes(plan, opts)
    budget = budget_bytes(opts)
    if need is None or budget is None or need + BASELINE_BYTES <= budget:
        return None
    where = (f"--memory-budget-gib {show.as_typed(opts.memory_budget_gib)}" if opts.memory_budget_gib is not None
             else f"the {budget / GIB:.1f} GiB this machine has available")
    return Streamed(plan, opts, report, console, f"the two models need about {need / GIB:.1f} GiB whole, more than {where}")


def _reader(folder: Path):
    """The tensor reader of a kvq (or packed) artifact folder: packed linears dequantized per
    tensor, float tensors as stored."""
    from ..source.lazy import LazyCheckpoint
    from .kv_only import PackedCheckpoint, find_packed

    packed = find_packed(str(folder))
    return PackedCheckpoint(packed) if packed is not None else LazyCheckpoint(folder, block_fp8=None)


def open_reference(spec: str, source, artifact_dtype):
    """The reference as a :class:`compressor.streamed_eval.LazyModel`, read one decoder layer at a
    time: as :func:`compressor.commands.common.load_reference` loads it whole, a kvq (or another
    tool's packed) artifact serving as the reference is read dequantized in ``artifact_dtype``,
    anything else in float32.

    Raises:
        InputError: the model cannot be read a layer at a time (:func:`compressor.streamed_eval.open_model`).
    """
    import torch

    from ..manifest import MANIFEST_NAME
    from ..streamed_eval import open_model
    from .kv_only import packed_method

    path = Path(spec)
    is_artifact = path.is_dir() and ((path / MANIFEST_NAME).is_file() or packed_method(path) is not None)
    return open_model(source, artifact_dtype if is_artifact else torch.float32, "reference",
                      _reader(path) if is_artifact else None)[0]


def _quantize_inputs(model, reader) -> None:
    """FP8 W8A8: each packed linear's input quantized as the serving kernel does (what
    :func:`compressor.artifact.load_artifact` does for the whole model), on the model's modules
    before any layer is loaded (the hooks stay as the layers' weights come and go)."""
    from ..arch import get_arch, memory_name
    from ..quant.fp8_inputs import install_activation_quant

    acts = reader.activations() if hasattr(reader, "activations") else {}
    if acts:
        arch = get_arch(model.config.model_type)
        install_activation_quant(model, arch, {memory_name(arch, n): a for n, a in acts.items()})


@dataclass
class Streamed:
    """A streamed ``kvq verify`` run (:func:`choose`); ``why``: what chose it (for the report)."""

    plan: object  # compressor.commands.verify._Plan
    opts: object  # VerifyOptions
    report: dict
    console: object
    why: str
    #: several ranks (:class:`compressor.verify_ranks.Share`): windows dealt, weight statistics by layer
    share: object = None

    def run(self) -> tuple[str, dict]:
        """Load (a layer at a time), evaluate, and fill the report's sections.

        Returns:
            ``(served, results)`` as :func:`compressor.commands.verify._evaluate` returns them
            (``("weights only", {})`` in ``--weights-only`` mode).

        Raises:
            InputError: ``--min-median-divergence`` (drift is not computed), ``--no-manifest``,
                ``--kv-scheme`` with static scales the artifact lacks, a model that cannot be read
                a layer at a time, another architecture, router fields or a tokenizer the artifact's
                tensors contradict, a plan above ``--memory-budget-gib``.
            CheckFailed: a KV-only artifact's q/k rows are not the reference's changed per RoPE pair.
        """
        from ..source.config_check import check_routing, text_config
        from ..source.resolve import ModelSource
        from ..streamed_eval import memory_plan, open_model
        from ..tokens import check_vocabulary
        from ..activations import peak_rss_mib
        from .verify_common import check_same_architecture, eval_dtype

        plan, opts, report = self.plan, self.opts, self.report
        self._refusals()
        dtype, report["evaluated_in"] = eval_dtype(plan.folder, opts.evaluation.dtype)
        reader = _reader(plan.folder)
        art, tokenizer = open_model(ModelSource(str(plan.folder), "hf", plan.folder), dtype, "artifact", reader)
        _quantize_inputs(art.model, reader)
        # as load_artifact: a router its experts contradict, a tokenizer id beyond the embedding
        check_routing(text_config(art.model.config.to_dict()), f"{plan.folder}/config.json")
        check_vocabulary(tokenizer, art.model.config.vocab_size, f"{plan.folder}: tokenizer")
        ref = open_reference(plan.ref_spec, plan.ref_source, dtype)
        check_same_architecture(art.model, ref.model, plan.ref_spec)
        self.art, self.ref, self.tokenizer = art, ref, tokenizer
        wins, candidates, served, make_cache = self._windows_and_candidates() if opts.mode == "full" else (None, {}, "weights only", None)
        owners = [] if wins is None else ["reference", *[o for o, _ in candidates.values()]]
        held = 0 if wins is None else int(wins.shape[0])  # this rank's windows: its block under several ranks
        if self.share is not None and wins is not None:
            held = self.share.block(held)[1] - self.share.block(held)[0]
        mem = memory_plan(ref, art, held, 0 if wins is None else wins.shape[1], owners,
                          weight_stats=plan.weights_quantized, budget=budget_bytes(opts))
        budget = opts.memory_budget_gib
        if budget is not None and mem.peak > budget * GIB + BASELINE_BYTES:  # the budget leaves the process out
            from .quantize_memory import smallest_budget

            need = smallest_budget(mem.peak - BASELINE_BYTES)
            raise InputError(f"--memory-budget-gib {show.as_typed(budget)} cannot hold streamed verify's smallest unit: "
                             + mem.describe(f"{need} GiB at peak besides the process's own {BASELINE_BYTES / GIB:.2f} "
                                            "GiB, which the budget does not count")
                             + f"; give --memory-budget-gib {need} or more, or lower --max-windows / --seqlen")
        self.expert_group = mem.expert_group_limit
        show.note(self.console, f"streamed verify ({self.why}): {mem.describe()}", highlight=False)
        if opts.device != "cpu":
            show.note(self.console, f"note: streamed verify runs on the CPU (--device {opts.device} applies to the whole-model path)",
                      highlight=False)
        out = self._evaluate(wins, candidates)
        report["nonfinite_tensors"] = out["nonfinite_tensors"]
        if out["nonfinite_tensors"]:
            show.note(self.console, f"[red]NaN or Inf[/] in {len(out['nonfinite_tensors'])} artifact tensor(s): "
                                    f"{', '.join(out['nonfinite_tensors'][:5])}", highlight=False)
        report["evaluated_in"]["streamed"] = {
            "why": self.why, "device": "cpu", "memory_plan": mem.as_dict(), "greedy_drift": DRIFT_SKIPPED,
            "seconds": out["seconds"], "peak_rss_mib": peak_rss_mib()}
        if wins is None or out["results"] is None:  # weights only, or a rank other than 0 (rank 0 reports)
            return served, {}
        self._sections(out, wins, served, make_cache)
        return served, out["results"]

    def _refusals(self) -> None:
        """What the streamed path cannot do, refused (or, for a recipe's drift gate, warned) before a model loads."""
        plan, opts = self.plan, self.opts
        if opts.no_manifest:
            raise InputError("streamed verify needs the artifact's manifest (its recipe's algorithm decides how weight "
                             "statistics undo AWQ scales); --no-manifest artifacts are verified whole, without --stream")
        if "min_median_divergence" in plan.thresholds:
            if opts.gates.min_median_divergence is not None:
                raise InputError(f"--min-median-divergence cannot be evaluated by streamed verify ({self.why}): greedy drift "
                                 f"is {DRIFT_SKIPPED}")
            del plan.thresholds["min_median_divergence"]
            self.report["warnings"].append(f"recipe gate min_median_divergence not evaluated: streamed verify's greedy drift is "
                                           f"{DRIFT_SKIPPED}")
        if "min_long_agreement_pct" in plan.thresholds:  # the long generation runs on the whole model only
            if opts.gates.min_long_agreement is not None:
                raise InputError(f"--min-long-agreement cannot be evaluated by streamed verify ({self.why}): the long "
                                 "generation needs the whole model")
            del plan.thresholds["min_long_agreement_pct"]
            self.report["warnings"].append("recipe gate min_long_agreement_pct not evaluated: streamed verify runs no "
                                           "long generation")
        kv = plan.kv_info
        if opts.mode == "full" and kv is not None and kv[0].static and kv[1] is None:
            raise InputError(f"--kv-scheme {kv[0].describe()} needs static scales calibrated on the whole model, which "
                             "streamed verify does not run; use an artifact quantized with its KV scheme, or a dynamic one")

    def _windows_and_candidates(self):
        """``(windows, {label: (role, make_cache)}, served, make_cache)`` as the whole-model path chooses them."""
        from ..calib import tokenize
        from ..evaluate import windows
        from ..tokens import bos_rule
        from .verify_common import Models, cache_factory, candidate_rows, measured_rows

        plan, ev, report = self.plan, self.opts.evaluation, self.report
        self.rule = bos_rule(self.tokenizer)
        wins = windows(tokenize(self.tokenizer, plan.text.text), ev.seqlen, ev.max_windows, bos_id=self.rule["bos_token_id"])
        if self.share is not None and len(wins) < self.share.world:
            raise InputError(f"{len(wins)} evaluation window(s) for {self.share.world} ranks: each rank needs one; "
                             "raise --max-windows or use fewer ranks")
        make_cache = cache_factory(self.art.model, plan.kv_info, ev.seqlen, report)
        self.basis: dict = {}  # the k_proj pair factors, filled layer by layer before the layer's windows run
        ref_cache = make_cache
        if make_cache is not None and self._key_pairs and plan.weights_quantized and plan.kv_info[0].static:
            ref_cache = lambda: make_cache(self.basis)  # noqa: E731
        models = Models(self.art.model, self.tokenizer, self.ref.model)
        found, served = candidate_rows(models, plan.weights_quantized, make_cache, ref_cache)
        report["evaluated_in"]["rows"] = measured_rows(models, found, plan.kv_info)
        roles = {label: ("artifact" if m is self.art.model else "reference", mc) for label, (m, mc) in found.items()}
        return wins, roles, served, make_cache

    @property
    def _key_pairs(self) -> bool:
        return (self.plan.manifest.kv_cache or {}).get("key_rotation") == "pairs"

    def _evaluate(self, wins, candidates: dict) -> dict:
        """:func:`compressor.streamed_eval.streamed_compare` with the weight statistics (and the
        key-pair check of a KV-only artifact) computed on each layer pair as it is read."""
        from ..arch import checkpoint_name, expert_index, layer_linears
        from ..quality import KEY_PAIRS_TOLERANCE, key_pairs_residual, weight_report, weight_summary
        from ..streamed_eval import streamed_compare
        from .verify_common import head_is_packed

        plan, report = self.plan, self.report
        ref, art = self.ref, self.art
        algorithm = plan.manifest.quantization.get("source_algorithm") or plan.manifest.recipe.get("algorithm", "")
        tensors: list[dict] = []
        undone = [False]
        worst = [0.0, ""]
        basis = getattr(self, "basis", {})
        order: dict[int, dict[str, int]] = {}  # MoE layers read in groups: each linear's place in the layer
        share, n_layers = self.share, len(ref.layers)
        # several ranks: each takes the weight statistics of its block of layers (the last one the head), rank 0
        # joins them; a key-pairs artifact's statistics fit the key basis every rank's windows need: on every rank
        dealt = share is not None and plan.weights_quantized and not self._key_pairs

        def mine(i):
            return not dealt or share.mine(i, n_layers)

        def on_layer(i, lr, la):
            if plan.weights_quantized and mine(i):
                r = weight_report(ref.model, art.model, algorithm, key_pairs=self._key_pairs, basis=basis, layers=[(i, lr, la)])
                tensors.extend(r["tensors"])
                undone[0] = undone[0] or r["awq_scales_undone"]
            elif not plan.weights_quantized and self._key_pairs:  # KV-only: q/k rows the reference's changed per pair
                w, name = key_pairs_residual(ref.model, art.model, [(i, lr, la)])
                if not w <= KEY_PAIRS_TOLERANCE:
                    raise CheckFailed(f"{name} is not the reference's rows changed per RoPE pair (relative residual {w:.3g} > "
                                      f"{KEY_PAIRS_TOLERANCE:g}): the artifact is not its source with kv_cache.key_rotation pairs")
                worst[:] = max(worst, [w, name])

        def on_experts(i, lr, la, experts):  # a group of routed experts of an MoE layer read in groups
            if plan.weights_quantized and mine(i):
                chosen = set(experts)
                r = weight_report(ref.model, art.model, algorithm, layers=[(i, lr, la)],
                                  select=lambda rel: expert_index(ref.arch, rel) in chosen)
                tensors.extend(r["tensors"])
                undone[0] = undone[0] or r["awq_scales_undone"]
            if plan.weights_quantized:
                order.setdefault(i, {f"{checkpoint_name(ref.arch, f'{ref.arch.layers}.{i}.{rel}')}.weight": k
                                     for k, rel in enumerate(layer_linears(ref.arch, lr))})

        def on_heads(rm, am):
            last = not dealt or share.rank == share.world - 1  # dealt: the head after the last rank's layers
            if plan.weights_quantized and last and head_is_packed(plan.folder, am):
                tensors.extend(weight_report(rm, am, algorithm, quantized_head=True, layers=[])["tensors"])

        ev = self.opts.evaluation
        with show.progress(self.console, "steps") as bar:
            task = bar.add_task(f"decoder layers, then logits (reference + {len(candidates)} configuration(s))",
                                total=len(ref.layers) + 1)
            t0 = time.perf_counter()

            def progress(i, n):
                bar.update(task, completed=i)
                if self.console is not None and not self.console.is_terminal:
                    show.step(self.console, f"streamed step {i}/{n} done ({time.perf_counter() - t0:.0f} s)")

            out = streamed_compare(ref, art, candidates, wins, self.opts.kv.chunk,
                                   hidden_of="weights only" if plan.weights_quantized and wins is not None else None,
                                   hidden_rows=(ev.hidden_batches, min(ev.seqlen, 512)), on_layer=on_layer,
                                   on_heads=on_heads, on_progress=progress, expert_group=self.expert_group,
                                   on_experts=on_experts, share=share)
        if share is not None and share.rank != 0:
            if dealt:
                share.gather([(tensors, undone[0])])  # to rank 0, in layer order
            return out
        if dealt:  # every rank's, in rank order: the layers in order, the head last, as one process lists them
            parts = share.gather([(tensors, undone[0])])
            tensors, undone[0] = [t for ts, _ in parts for t in ts], any(u for _, u in parts)
        if plan.weights_quantized:  # the whole layer's order: its non-expert linears were reported before its experts
            tensors.sort(key=lambda t: (t["layer"], order.get(t["layer"], {}).get(t["name"], 0)))
            report["weights"] = weight_summary(tensors, undone[0], self._key_pairs)
        elif self._key_pairs:
            show.note(self.console, f"key pairs: q_proj/k_proj are the reference's rows changed per RoPE pair (largest "
                                    f"relative residual {worst[0]:.2g}, {worst[1]})", highlight=False)
        return out

    def _sections(self, out: dict, wins, served: str, make_cache) -> None:
        """The report's evaluation sections from the streamed results (drift: ``None``, said in a warning)."""
        from ..positions import window_buckets
        from .verify_common import distribution_sections, kv_report

        plan, ev, report = self.plan, self.opts.evaluation, self.report
        distribution_sections(report, out["results"], served, wins, plan.text, ev.seqlen)
        report["eval"]["bos_token_id"] = self.rule["bos_token_id"]
        report["eval"]["bos_rule"] = self.rule["rule"] + ("; evaluation windows follow it (llama.cpp's perplexity "
                                                          "convention); streamed: no drift prompts")
        per_layer = out["hidden_state_error"]
        if per_layer is not None:
            report["hidden_state_error"] = {"batches": min(ev.hidden_batches, int(wins.shape[0])),
                                            "seqlen": min(ev.seqlen, 512), "per_layer": per_layer, "last": per_layer[-1]}
        report["drift"] = None
        report["warnings"].append(f"greedy drift not measured ({self.why}): {DRIFT_SKIPPED}")
        report["by_position"] = window_buckets(out["results"], served)
        if ev.long_tokens or ev.turns:
            report["warnings"].append(f"long generation and multi-turn not measured ({self.why}): they need the whole "
                                      "model")
        if plan.kv_info is not None:
            report["kv_cache"] = kv_report(plan.kv_info[0], plan.kv_source, plan.ref_source, self.opts)
