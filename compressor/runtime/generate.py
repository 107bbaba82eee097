"""The serving engine behind ``kvq serve-smoke``: load an artifact, prefill, decode, time it.

:class:`Runtime` owns a :class:`~compressor.runtime.model.Decoder` and the KV scheme;
each :meth:`Runtime.generate` call allocates a KV cache for its batch (``batch x
(longest prompt + max_new_tokens)`` slots), prefills every prompt (right-padded, one
forward per ``prefill_chunk`` tokens, each sequence at its own positions) and decodes
all sequences together, one token per step, greedy or sampled.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from ..errors import InputError
from ..kv_schemes import KVSpec, make_spec
from .kv_cache import KVCache
from .loader import load_decoder
from .model import Decoder, LoadInfo


@dataclass
class GenerationResult:
    """What :meth:`Runtime.generate` returns.

    ``tokens[b]``: generated ids of sequence ``b`` (prompt excluded; up to and including
    an end-of-sequence token). ``prompt_logits[b]``: float32 ``[len_b, vocab]``, row ``t``
    predicting prompt token ``t + 1`` (None unless requested). Timings: ``prefill_seconds``
    covers every prompt token and yields the first generated token; ``decode_seconds``
    the remaining steps (``decode_tokens`` = tokens those steps produced, finished
    sequences included while the batch runs).
    """

    tokens: list[list[int]]
    prompt_logits: list[torch.Tensor] | None
    prompt_tokens: int
    decode_tokens: int
    prefill_seconds: float
    decode_seconds: float
    kv_bytes_per_token: float
    kv_cache_bytes: int
    kv_scheme: str
    kv_fixed_bytes_per_sequence: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def summary(self) -> dict:
        """JSON-ready figures (no tensors)."""
        return {
            "sequences": len(self.tokens), "prompt_tokens": self.prompt_tokens,
            "generated_tokens": sum(len(t) for t in self.tokens), "decode_tokens": self.decode_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4), "decode_seconds": round(self.decode_seconds, 4),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2), "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "kv_scheme": self.kv_scheme, "kv_bytes_per_token": round(self.kv_bytes_per_token, 2),
            "kv_fixed_bytes_per_sequence": self.kv_fixed_bytes_per_sequence, "kv_cache_bytes": self.kv_cache_bytes,
        }


@dataclass
class Runtime:
    """A loaded model plus its KV scheme. Build with :meth:`from_artifact`."""

    decoder: Decoder
    info: LoadInfo
    kv_spec: KVSpec | None = None
    kv_scales: dict | None = None
    backend: str = "auto"
    folder: Path | None = None
    integrity: dict | None = None  # the load's digest report (checking reader), see from_artifact

    @classmethod
    def from_artifact(cls, folder: str | Path, device: str = "cpu", backend: str = "auto",
                      kv: str | KVSpec | None = "artifact", dtype: torch.dtype | None = None,
                      kv_scales: dict | None = None, act_dtype: torch.dtype | None = None,
                      reads=None) -> "Runtime":
        """Load ``folder`` for serving.

        Args:
            folder: a kvq artifact (any format kvq writes) or a float safetensors model folder.
            device: ``cpu`` or ``cuda[:i]``.
            backend: ``auto`` (CPU: aten int4/int8 ops, else dequantize; CUDA: Triton
                W4A16, else dequantize), ``aten``, ``dequant`` or ``triton``.
            kv: ``"artifact"`` (the artifact's KV scheme and static scales, float when it
                has none or is a plain model folder), ``None``/``"none"`` (float cache),
                a scheme name (``fp8``, ``int8``, ``int4``, ``int2`` with default
                strategy) or a :class:`~compressor.kv_schemes.KVSpec`.
            dtype: compute dtype (default: :func:`~compressor.runtime.loader.compute_dtype`'s
                ``auto``: bfloat16 for a bfloat16 artifact, else float32 on CPU, float16 on CUDA).
            kv_scales: ``layer -> (k_scale, v_scale)`` for a static scheme the artifact
                has no scales for (default: the artifact's).
            act_dtype: activation dtype inside the aten/Triton kernels.
            reads: an open :class:`~compressor.load_integrity.ArtifactReader` of ``folder``
                (what ``kvq serve`` passes): every tensor and file is read once through
                it, hashed and compared with the manifest as it is read, and this returns
                only once every byte matched (:meth:`~compressor.load_integrity.
                ArtifactReader.finish`; the report in :attr:`integrity`). The caller keeps
                it open to read the tokenizer from its ``files_folder``, then closes it.

        Raises:
            InputError: see :func:`~compressor.runtime.loader.load_decoder`; a static KV
                scheme without scales; a bad ``kv`` value.
            ArtifactMismatch: with a checking ``reads``, any file or tensor that differs
                from the manifest (named).
        """
        from .loader import Tensors

        folder = Path(folder)
        if not folder.is_dir():
            raise InputError(f"artifact folder {folder} not found")
        decoder, info = load_decoder(folder, device, backend, dtype, act_dtype, reads)  # validates every header first
        tensors = Tensors(reads) if reads is not None else None
        manifest = reads.manifest if reads is not None else None
        spec, scales = _resolve_kv(folder, kv, kv_scales, tensors, manifest, decoder.spec.n_layers)
        rt = cls(decoder, info, spec, scales, backend, folder)
        if reads is not None:
            rt.integrity = reads.finish()
        rt.new_cache(1, 1)  # validates the KV scheme against the model's geometry now, not at the first request
        return rt

    # -- helpers ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def vocab_size(self) -> int:
        return self.decoder.spec.vocab_size

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A preallocated KV cache of this runtime's scheme for ``batch`` sequences of up to ``max_len`` tokens."""
        return self.decoder.new_cache(self.kv_spec, self.kv_scales, batch, max_len)

    def describe(self) -> dict:
        """Kernels per module kind, fallbacks with reasons, bytes: what a report prints."""
        s = self.decoder.spec
        cache = self.new_cache(1, 64)
        return {
            "folder": None if self.folder is None else str(self.folder), "device": str(self.device),
            "dtype": str(self.decoder.dtype).replace("torch.", ""), "backend": self.backend,
            "quant_method": self.info.quant_method, "kernels": dict(Counter(self.info.kernels.values())),
            # projections that share one decode call (q/k/v, gate/up: FusedDecode), counted per set
            "fused_decode_sets": len({id(lin.fused[0]) for lin in self.decoder.linears().values()
                                      if getattr(lin, "fused", None) is not None}),
            "fallbacks": dict(self.info.fallbacks), "weight_bytes": self.info.weight_bytes,
            "kv_scheme": "none" if self.kv_spec is None else self.kv_spec.describe(),
            "kv_bytes_per_token": cache.bytes_per_token(), "kv_fixed_bytes_per_sequence": cache.fixed_bytes_per_sequence(),
            "layers": s.n_layers, "kv_heads": s.n_kv_heads, "head_dim": s.head_dim, "attention": s.kv,
            **({"kv_lora_rank": s.kv_widths[0], "qk_rope_head_dim": s.kv_widths[1]} if s.kv == "mla" else {}),
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_ids(self, rows: Sequence[Sequence[int]]) -> None:
        for b, r in enumerate(rows):
            if len(r) == 0:
                raise InputError(f"prompt {b} is empty")
            lo, hi = min(r), max(r)
            if lo < 0 or hi >= self.vocab_size:
                raise InputError(f"prompt {b} has token id {lo if lo < 0 else hi} outside the vocabulary [0, {self.vocab_size})")

    def check_length(self, tokens: int) -> None:
        """Refuse a sequence of ``tokens`` tokens the runtime cannot compute exactly.

        DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) attends to the ``index_topk`` keys its
        lightning indexer picks; this runtime has no indexer and computes dense attention,
        which is the same computation while a sequence holds at most ``index_topk`` tokens.

        Raises:
            InputError: ``tokens`` exceeds that bound (names it and the model type).
        """
        limit = self.decoder.spec.dense_limit
        if limit is not None and tokens > limit:
            raise InputError(f"{self.decoder.spec.model_type}: the bundled runtime computes its sparse attention densely, "
                             f"which is exact only while a sequence holds at most index_topk = {limit} tokens; this one "
                             f"needs {tokens} (check longer contexts with kvq verify)")

    def _check_request(self, prompts, max_new_tokens: int, greedy: bool, temperature: float) -> list[list[int]]:
        """The prompts as int lists, after :meth:`generate`'s argument checks (InputError)."""
        if not prompts:
            raise InputError("no prompts given")
        rows = [list(map(int, p)) for p in prompts]
        self._check_ids(rows)
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not greedy and not temperature > 0:
            raise InputError(f"temperature must be > 0 when sampling, got {temperature}")
        return rows

    # -- API ----------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor | Sequence[Sequence[int]], chunk: int | None = None) -> torch.Tensor:
        """Logits of every position of equal-length sequences, through a fresh KV cache.

        Args:
            input_ids: int ``[B, T]`` (tensor or nested lists).
            chunk: feed ``chunk`` tokens per forward (as ``kvq verify --kv-chunk`` and a
                chunked-prefill server do); default all at once.

        Returns:
            float32 ``[B, T, vocab]``.

        Raises:
            InputError: not 2-D, empty, ids outside the vocabulary, ``chunk < 1``, longer than
                :meth:`check_length` allows.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim != 2 or ids.numel() == 0:
            raise InputError(f"input_ids must be a non-empty [batch, tokens] array, got shape {tuple(ids.shape)}")
        self._check_ids(ids.tolist())
        B, T = ids.shape
        self.check_length(T)
        chunk = T if chunk is None else int(chunk)
        if chunk < 1:
            raise InputError(f"chunk must be >= 1, got {chunk}")
        cache = self.new_cache(B, T)
        parts = [self.decoder.forward(ids[:, a:a + chunk], cache).float().cpu() for a in range(0, T, chunk)]
        return torch.cat(parts, dim=1)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, greedy: bool = True,
                 temperature: float = 1.0, seed: int = 0, eos_token_id: int | Sequence[int] | None = None,
                 prefill_chunk: int | None = None, return_prompt_logits: bool = False,
                 cancelled: Callable[[], Sequence[bool]] | None = None) -> GenerationResult:
        """Generate continuations of several prompts at once.

        Args:
            prompts: token ids, one list per sequence (lengths may differ).
            max_new_tokens: tokens to generate per sequence (0: prefill only).
            greedy: argmax decoding; otherwise sample from ``softmax(logits / temperature)``
                with a generator seeded by ``seed`` (deterministic on one device).
            eos_token_id: a sequence stops after emitting one of these (the batch stops
                when every sequence has).
            prefill_chunk: prompt tokens per prefill forward (default: the longest prompt).
            return_prompt_logits: keep float32 logits of every prompt position (for KL /
                agreement against a reference).
            cancelled: called before each decode step, one flag per sequence; a flagged
                sequence stops there (keeping the tokens it has), and the batch stops when
                every sequence has (the HTTP server drops requests whose client left).

        Raises:
            InputError: empty prompt list or prompt, ids outside the vocabulary,
                negative ``max_new_tokens``, ``temperature <= 0`` when sampling, ``prefill_chunk < 1``,
                a prompt plus ``max_new_tokens`` longer than :meth:`check_length` allows.
        """
        rows = self._check_request(prompts, max_new_tokens, greedy, temperature)
        eos = set() if eos_token_id is None else ({int(eos_token_id)} if isinstance(eos_token_id, int) else set(map(int, eos_token_id)))
        B = len(rows)
        lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
        longest = int(lens.max())
        self.check_length(longest + max_new_tokens)
        chunk = longest if prefill_chunk is None else int(prefill_chunk)
        if chunk < 1:
            raise InputError(f"prefill_chunk must be >= 1, got {chunk}")
        cache = self.new_cache(B, longest + max(max_new_tokens, 1))
        padded = torch.zeros(B, longest, dtype=torch.long)
        for b, r in enumerate(rows):
            padded[b, :len(r)] = torch.tensor(r)
        gen = None if greedy else torch.Generator(device=self.device).manual_seed(int(seed))

        def pick(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
            if greedy:
                return logits.argmax(-1)
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

        self._sync()
        t0 = time.perf_counter()
        prompt_logits = [[] for _ in range(B)] if return_prompt_logits else None
        last = torch.zeros(B, self.vocab_size, dtype=self.decoder.dtype, device=self.device)
        for a in range(0, longest, chunk):
            n_new = (lens - a).clamp(0, chunk)
            step = self.decoder.forward(padded[:, a:a + chunk], cache, n_new, last_only=not return_prompt_logits)
            ends = ((lens > a) & (lens <= a + chunk)).nonzero().flatten().tolist()  # rows whose prompt ends here
            if return_prompt_logits:
                for b in range(B):
                    if int(n_new[b]):
                        prompt_logits[b].append(step[b, :int(n_new[b])].float().cpu())
                for b in ends:
                    last[b] = step[b, int(n_new[b]) - 1]
            else:
                for b in ends:
                    last[b] = step[b]
        nxt = pick(last)
        self._sync()
        t1 = time.perf_counter()
        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        decode_tokens = 0
        ones = torch.ones(B, dtype=torch.long)
        for i in range(max_new_tokens):
            toks = nxt.tolist()
            for b in range(B):
                if not done[b]:
                    out[b].append(toks[b])
                    done[b] = toks[b] in eos
            if i == max_new_tokens - 1 or all(done):
                break
            if cancelled is not None:
                done = [d or bool(c) for d, c in zip(done, cancelled())]
                if all(done):
                    break
            nxt = pick(self.decoder.forward(nxt[:, None].cpu(), cache, ones, last_only=True))
            decode_tokens += B
        self._sync()
        t2 = time.perf_counter()
        return GenerationResult(
            tokens=out,
            prompt_logits=None if prompt_logits is None else [torch.cat(p) for p in prompt_logits],
            prompt_tokens=int(lens.sum()), decode_tokens=decode_tokens,
            prefill_seconds=t1 - t0, decode_seconds=t2 - t1,
            kv_bytes_per_token=cache.bytes_per_token(), kv_cache_bytes=cache.nbytes,
            kv_scheme="none" if self.kv_spec is None else self.kv_spec.describe(),
            kv_fixed_bytes_per_sequence=cache.fixed_bytes_per_sequence(),
        )


def _resolve_kv(folder: Path, kv, kv_scales, tensors=None, manifest=None,
                n_layers: int | None = None) -> tuple[KVSpec | None, dict | None]:
    """``(spec, scales)`` for the ``kv`` argument of :meth:`Runtime.from_artifact`; static
    scales are read from ``tensors`` (the checked reader) when given, with ``manifest``. A
    folder without a kvq manifest (another tool's artifact) is read through its
    ``config.json``: compressed-tensors' ``kv_cache_scheme`` and the ``k_scale``/``v_scale``
    tensors (:func:`compressor.artifact.foreign_manifest`).

    Raises:
        InputError: unknown scheme, a static scheme without scales, a ``kv_cache_scheme``
            kvq does not serve.
    """
    from ..artifact import foreign_manifest, read_kv_cache
    from ..manifest import MANIFEST_NAME

    if manifest is None and not (folder / MANIFEST_NAME).is_file():  # another tool's artifact: its config.json
        manifest = foreign_manifest(folder)  # compressed-tensors' kv_cache_scheme (None: a float cache)
    art = read_kv_cache(folder, manifest, tensors, n_layers)
    if kv is None or kv == "none":
        return None, None
    if kv == "artifact":
        return (None, None) if art is None else art
    if isinstance(kv, str):
        spec = make_spec(kv)
    elif isinstance(kv, KVSpec):
        spec = kv
    else:
        raise InputError(f"kv must be 'artifact', 'none', a scheme name or a KVSpec, got {kv!r}")
    if not spec.static:
        return spec, None
    if kv_scales is not None:
        return spec, kv_scales
    if art is not None and art[0].scheme == spec.scheme and art[0].strategy == spec.strategy:
        return spec, art[1]
    raise InputError(f"KV scheme {spec.describe()} needs calibrated k_scale/v_scale and {folder} has none for it; "
                     "quantize with that KV scheme (kvq quantize --kv-scheme) or choose a dynamic one (int8, int4, int2)")


class Loaded(NamedTuple):
    """What :func:`load_checked` returns."""

    runtime: Runtime
    tokenizer: object
    signature: dict  # compressor.integrity.check_signature's dict
    manifest: object  # the compressor.manifest.Manifest checked against (None: --no-manifest)


def load_checked(artifact: Path, opts, note: Callable[[str], None]) -> Loaded:
    """Load ``artifact`` for serving through one checked read (:func:`compressor.load_integrity.
    open_for_serving`: the signature first, then every file and tensor hashed from the
    bytes the runtime loads); the tokenizer comes from the checked copies of its files. ``opts`` has ``keys``, ``no_manifest``, ``device``,
    ``backend`` and ``dtype`` (``auto``, ``float32`` or ``bfloat16``). ``note`` receives the one-line outcome of each check.

    Raises:
        InputError: see :func:`~compressor.load_integrity.open_for_serving` and
            :meth:`~compressor.runtime.Runtime.from_artifact`; a tokenizer id beyond the embedding.
        SignatureFailed, ArtifactMismatch: a failed check (exit 1), before anything is served.
    """
    from transformers import AutoTokenizer

    from ..integrity import hashes_summary
    from ..load_integrity import open_for_serving
    from ..tokens import check_vocabulary

    reads, sig = open_for_serving(artifact, opts.keys, opts.no_manifest, note)
    with reads:
        dtype = None if opts.dtype == "auto" else getattr(torch, opts.dtype)
        rt = Runtime.from_artifact(artifact, device=opts.device, backend=opts.backend, kv="artifact", reads=reads,
                                   dtype=dtype)
        tok = AutoTokenizer.from_pretrained(str(reads.files_folder))
    check_vocabulary(tok, rt.vocab_size, f"{artifact}: tokenizer")  # no request may reach an id beyond the embedding
    if rt.integrity is not None:
        note(f"hashes ok, checked as loaded: {hashes_summary(rt.integrity)}")
    return Loaded(rt, tok, sig, reads.manifest)
