"""``kvq serve-smoke``'s memory plan: what the runtime and the reference hold at peak, decided
before any weight is read.

The runtime serves the packed model whole: :func:`runtime_estimate` sizes it from the
safetensors headers (read without loading) and the rules the runtime builds by (measured on
the SmolLM2-135M W4 g64 artifact, CPU, bfloat16: 108.7 MiB stored, 166.4 MiB of runtime
weights; the aten int4 kernel keeps its decode pack beside nibble codes for prefill, and its
scales twice more in the activation dtype), plus its work: the preallocated KV cache of every
prompt plus ``--max-new-tokens`` (float32 per element, a bound for quantized schemes), the
prompts' logits it returns, one batch's prefill logits and activations, one linear dequantized
for prefill. :func:`plan` refuses (one line, exit 2) a runtime above the budget and names
``kvq verify --stream``, the check that reads the artifact one decoder layer at a time.

The runtime finishes its work (generation, the long generation's logits) and is released
before the reference loads; the reference is then whole (float32, :func:`compressor.commands.
common.load_reference`) or, with ``--stream`` or when whole it does not fit the budget (as
``kvq verify`` decides: :func:`compressor.commands.verify_streamed.choose`), read one decoder
layer at a time (:mod:`compressor.streamed_logits`; its peak from
:func:`compressor.streamed_eval.memory_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import console as show
from ..errors import InputError
from ..streamed_eval import BASELINE_BYTES, GIB

#: safetensors dtypes of packed codes (integers, FP8): held twice by the CPU aten kernels
_CODES = ("I8", "U8", "I16", "U16", "I32", "U32", "F8_E4M3", "F8_E5M2")
_FLOAT = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def _gib(n: int | None) -> str:
    """``n`` bytes in GiB, MiB or KiB, whichever is the largest below it (``unknown`` for None)."""
    if n is None:
        return "unknown"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


@dataclass
class RuntimeEstimate:
    """What the runtime holds, in bytes (:func:`runtime_estimate`)."""

    stored: int  #: tensor bytes in the artifact's safetensors files
    weights: int  #: the runtime's weights built from them
    kv: int  #: the preallocated KV caches (the prompts' batch; the long generation's)
    work: int  #: logits returned and of one prefill, activations, one dequantized linear
    kept: int  #: the runtime's logits kept for the comparison once it is released

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.work

    def describe(self) -> str:
        return (f"the runtime {_gib(self.total)} (packed weights {_gib(self.weights)} from {_gib(self.stored)} "
                f"stored, KV cache {_gib(self.kv)}, work {_gib(self.work)})")


def runtime_estimate(folder: Path, token_counts: list[int], opts) -> RuntimeEstimate:
    """Estimate the runtime's memory for ``folder`` serving prompts of ``token_counts`` tokens
    with ``opts.max_new_tokens`` (and ``opts.long_tokens`` after the first prompt), no weight read.

    Raises:
        InputError: a safetensors header or config.json cannot be read.
    """
    import json

    import torch

    from ..runtime.loader import compute_dtype
    from ..safetensors_io import read_header
    from ..source.resolve import load_config

    raw = json.loads((folder / "config.json").read_text())
    cfg = load_config(folder)
    cfg = getattr(cfg, "text_config", None) or cfg
    device = torch.device(opts.device)
    elem = torch.empty((), dtype=compute_dtype(raw, device, opts.dtype)).element_size()
    twice = device.type == "cpu" and opts.backend in ("auto", "aten")
    stored = weights = 0
    for f in sorted(folder.glob("*.safetensors")):
        try:
            entries = read_header(f).values()
        except InputError:  # a damaged file: the checked load names it (digests, exit 1)
            continue
        for e in entries:
            n = e.end - e.start
            stored += n
            if e.dtype in _CODES:
                weights += 2 * n if twice else n
            elif e.dtype in _FLOAT:  # scales: kept, and twice more in the activation dtype by aten
                numel = n // _FLOAT[e.dtype]
                weights += 3 * n if twice and "scale" in e.name else numel * elem
    hidden, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    width = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if getattr(cfg, "kv_lora_rank", None)
             else 2 * (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim)
    per_token = layers * width * 4
    inter = max(getattr(cfg, "intermediate_size", 0) or 0, getattr(cfg, "moe_intermediate_size", 0) or 0, hidden)
    b, t = len(token_counts), max(token_counts) + opts.max_new_tokens
    long_len = token_counts[0] + opts.long_tokens if opts.long_tokens else 0
    chat = chat_tokens(token_counts, opts)
    kv = per_token * (b * t + long_len + chat)
    # prompt logits; the long generation's and the chat's served logits
    kept = 4 * vocab * (sum(token_counts) + opts.long_tokens + chat)
    prefill = 2 * 4 * vocab * b * max(token_counts) + 4 * b * max(token_counts) * (3 * inter + 6 * hidden)
    attn = 4 * heads * b * t * t
    dequant = max(inter, heads * head_dim) * hidden * (4 + elem)
    return RuntimeEstimate(stored, weights, kv, kept + prefill + attn + dequant, kept)


@dataclass
class SmokeMemory:
    """serve-smoke's memory plan (:func:`plan`): the runtime's phase, then the reference's."""

    runtime: RuntimeEstimate
    budget: int | None  #: bytes the run may hold, process included (None: unknown)
    why: str | None  #: why the reference is streamed (None: whole)
    reference_whole: int | None  #: the reference whole in float32 with one forward's work (None: unknown)
    streamed: object = None  #: the streamed reference's compressor.streamed_eval.MemoryPlan
    lazy: object = None  #: the streamed reference (compressor.streamed_eval.LazyModel)

    @property
    def reference(self) -> int | None:
        """Bytes of the reference phase, the kept logits and the process included."""
        if self.streamed is not None:
            return self.streamed.peak + self.runtime.kept
        return None if self.reference_whole is None else BASELINE_BYTES + self.reference_whole + self.runtime.kept

    @property
    def runtime_phase(self) -> int:
        """Bytes while the runtime runs, the process included: with a streamed reference, its
        embedding (a tied head keeps it), final norm and RoPE buffers are held from the start."""
        return BASELINE_BYTES + self.runtime.total + (0 if self.streamed is None else self.streamed.outer)

    @property
    def peak(self) -> int | None:
        return None if self.reference is None else max(self.runtime_phase, self.reference)

    def describe(self) -> str:
        """One line: the peak and what makes it."""
        if self.streamed is not None:
            ref = f"the reference streamed ({self.why}): {self.streamed.describe()}"
        else:
            ref = f"the reference whole in float32 {_gib(self.reference_whole)}"
        budget = "" if self.budget is None else f"; budget {_gib(self.budget)} with the process"
        held = "" if self.streamed is None else " (beside the streamed reference's tied embedding and norms)"
        return (f"{_gib(self.peak)} at peak: {self.runtime.describe()}{held}, released, then {ref}, with the runtime's "
                f"logits kept {_gib(self.runtime.kept)}; process {_gib(BASELINE_BYTES)}{budget}")

    def as_dict(self) -> dict:
        """The plan for the report (MiB, 3 decimals, comparable with ``peak_rss_mib``; ``None``:
        unknown; ``streamed_plan``: :meth:`compressor.streamed_eval.MemoryPlan.as_dict`, in GiB)."""
        def mib(n):
            return None if n is None else round(n / 2**20, 3)

        r = self.runtime
        return {"peak_mib": mib(self.peak), "budget_mib": mib(self.budget), "process_mib": mib(BASELINE_BYTES),
                "runtime_phase_mib": mib(self.runtime_phase),
                "runtime": {"total_mib": mib(r.total), "weights_mib": mib(r.weights), "stored_mib": mib(r.stored),
                            "kv_cache_mib": mib(r.kv), "work_mib": mib(r.work), "kept_logits_mib": mib(r.kept)},
                "reference": {"streamed": self.why is not None, "why": self.why, "peak_mib": mib(self.reference),
                              "whole_mib": mib(self.reference_whole),
                              "streamed_plan": None if self.streamed is None else self.streamed.as_dict()}}


def chat_tokens(token_counts: list[int], opts) -> int:
    """The tokens of serve-smoke's chat of ``opts.turns`` turns (:func:`~compressor.commands.smoke_service.chat_length`)
    from the prompts' token counts, taken in turn as :func:`~compressor.commands.smoke_service.turn_users` takes
    the prompts: 0 without one."""
    from ..service_eval import REPLY_TOKENS
    from .smoke_service import chat_length, turn_users

    return chat_length(turn_users(token_counts, opts.turns), REPLY_TOKENS)


def _token_counts(folder: Path, prompts: list[str]) -> list[int]:
    """Each prompt's tokens by the artifact's tokenizer, plus one for a BOS (a tokenizer that does
    not load, which the checked load then names: the prompt's UTF-8 bytes plus two, a bound)."""
    from ..source.resolve import load_tokenizer

    try:
        tok = load_tokenizer(folder)
    except InputError:
        return [len(p.encode()) + 2 for p in prompts]
    return [len(tok(p, add_special_tokens=False)["input_ids"]) + 1 for p in prompts]


def _reference_whole(ref_source, longest: int) -> int | None:
    """The reference whole in float32 plus one forward's logits and activations (None: its
    configuration does not build here)."""
    from ..source.open import meta_skeleton

    model = meta_skeleton(ref_source)
    if model is None:
        return None
    cfg = model.config
    return 4 * (sum(p.numel() for p in model.parameters()) + 3 * longest * cfg.vocab_size)


def plan(folder: Path, prompts: list[str], opts, ref_spec: str, ref_source) -> SmokeMemory:
    """serve-smoke's memory plan; the streamed reference opened (layers on ``meta``, embedding
    released) when chosen.

    The runtime alone is compared with what the run may hold besides the process (``--memory-budget-gib``, as
    its help says; else the memory available less the process's :data:`BASELINE_BYTES`), and the refusal
    names those two figures.

    Raises:
        InputError: the runtime's estimate above the budget (``--memory-budget-gib``, else the
            memory available less the process): serve-smoke loads the packed model whole; a streamed
            reference whose smallest unit is above ``--memory-budget-gib``; a reference that cannot be streamed.
    """
    from .verify_streamed import budget_bytes

    counts = _token_counts(folder, prompts)
    rt = runtime_estimate(folder, counts, opts)
    budget = budget_bytes(opts)  # the process included
    where = (f"--memory-budget-gib {show.as_typed(opts.memory_budget_gib)}" if opts.memory_budget_gib is not None
             else f"the {_gib(budget)} this machine has available")
    room = None if budget is None else budget - BASELINE_BYTES  # besides the process
    if room is not None and rt.total > room:
        limit = (f"{where} ({_gib(room)}, the process's own {_gib(BASELINE_BYTES)} not counted)"
                 if opts.memory_budget_gib is not None
                 else f"the {_gib(room)} this machine has available besides the process's own {_gib(BASELINE_BYTES)}")
        raise InputError(f"serve-smoke loads the packed model whole: {rt.describe()}, more than {limit}; check this "
                         f"artifact with `kvq verify {folder} --stream`, which reads it one decoder layer at a time")
    longest = max(max(counts) + opts.max_new_tokens, counts[0] + opts.long_tokens, chat_tokens(counts, opts))
    whole = _reference_whole(ref_source, longest)
    mem = SmokeMemory(rt, budget, None, whole)
    if opts.stream:
        mem.why = "--stream"
    elif whole is not None and budget is not None and mem.reference > budget:
        mem.why = f"the reference needs about {_gib(whole)} whole, more than {where}"
    if mem.why is not None:
        _streamed(mem, opts, ref_spec, ref_source, len(counts), longest)
    return mem


def _streamed(mem: SmokeMemory, opts, ref_spec: str, ref_source, n: int, longest: int) -> None:
    """The streamed reference opened and its plan made (refused above ``--memory-budget-gib``)."""
    import torch

    from ..streamed_eval import memory_plan
    from .verify_streamed import open_reference

    lm = open_reference(ref_spec, ref_source, torch.float32)
    room = None if mem.budget is None else mem.budget - mem.runtime.kept
    mem.streamed = memory_plan(lm, None, n, longest, ["reference"], budget=room)
    lm.release_embedding()
    mem.lazy = lm
    if opts.memory_budget_gib is not None and mem.reference > mem.budget:
        raise InputError(f"--memory-budget-gib {show.as_typed(opts.memory_budget_gib)} cannot hold serve-smoke's "
                         f"streamed reference's smallest unit: {mem.describe()}; raise it, or use fewer or "
                         "shorter prompts")
