"""The staging folder of ``kvq quantize``: per-layer part files, resume checkpoints, spilled
activations, and the :class:`LayerWriter` the pipeline hands each finished layer to.

Resume: the staging folder ``.<OUT>.kvq-partial`` beside the output holds the finished
layers' part files and ``resume.json`` (what was done, the SHA-256 of every part and of
the saved activations, and a key over the source files, recipe, calibration and output
options); after each layer the next layer's input activations are saved too. A resumed
run rehashes the parts and refuses any that changed, so a damaged checkpoint never
reaches the manifest. ``kvq quantize ... --resume`` continues after the last
finished layer when the key matches; without ``--resume`` a stale staging folder is
replaced. kvq marks each staging folder it creates (:data:`MARKER_NAME`), so one killed
before its first checkpoint is recognised and started over rather than refused.
Activations above the budget move to memory-mapped files here
(:func:`compressor.activations.spill`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import interrupts
from .distributed import share
from .errors import InputError, KvqError
from .moe_ranks import ExpertShare, GroupMail, split_layer
from .quant.primitives import Scheme
from .safetensors_io import file_digest
from .source.lazy import (ARTIFACT_DIR, HIDDEN_PREFIX, ROUTED_EXPERT, LazyCheckpoint, RESUME_NAME, layer_names,
                          load_into, to_meta)


def _tensor(model, name: str) -> torch.Tensor:
    module, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(module), leaf)


#: bytes a quantized weight holds until its group is written: the float32 weight and its int8 codes
HELD_BYTES_PER_WEIGHT = 5

#: a routed expert's tensors in kvq's (unfused) names, relative to the decoder layer
_EXPERT = ROUTED_EXPERT


@contextmanager
def _atomic_write(path: Path):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Staging:
    """The staging folder of one quantize run: part files, resume state, spilled activations."""

    path: Path
    key: str
    parts: list[Path] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    #: flags inside the key that a refused resume names ({"--threads": 2, ...}), kept in resume.json
    named: dict = field(default_factory=dict)
    #: the open marker file whose exclusive lock says a run is using the folder (:func:`_claim`)
    lock: object = None
    #: each input's own digest (:func:`input_digests`), kept in resume.json
    inputs: dict = field(default_factory=dict)

    def part(self, name: str) -> Path:
        return self.path / f"part-{name}.safetensors"

    def save_part(self, name: str, tensors: dict[str, torch.Tensor]) -> Path:
        """Write one part (atomically) and remember it."""
        from safetensors.torch import save_file

        p = self.part(name)
        tmp = p.with_name(p.name + ".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, p)
        if p not in self.parts:
            self.parts.append(p)
        return p

    def checkpoint(self, layers_done: int, state: dict, hidden: list[torch.Tensor] | None,
                   float_hidden: list[torch.Tensor] | None = None) -> None:
        """Record that layers ``< layers_done`` are written; ``hidden`` are the next layer's inputs
        (``float_hidden``: the float model's, for GPTQ's float target; kept in the same file)."""
        from safetensors.torch import save_file

        # Crash-consistent: the previous checkpoint's files stay valid until resume.json is
        # replaced (atomically) by one naming the new files; only then is the old hidden file removed.
        old_hidden = self.state.get("hidden")
        digests = {k: v for k, v in self.state.get("digests", {}).items() if k != old_hidden}
        for p in self.parts:  # each part is hashed once, when it is new
            if p.name not in digests:
                digests[p.name] = file_digest(p)
        hidden_name = None
        if hidden is not None:
            hidden_name = f"{HIDDEN_PREFIX}{layers_done:05d}.safetensors"
            tmp = self.path / (hidden_name + ".tmp")
            tensors = {f"b{j}": h.contiguous() for j, h in enumerate(hidden)}
            tensors.update({f"f{j}": h.contiguous() for j, h in enumerate(float_hidden or [])})
            save_file(tensors, str(tmp))
            digests[hidden_name] = file_digest(tmp)
            os.replace(tmp, self.path / hidden_name)
        self.state = {"key": self.key, "layers_done": layers_done, "parts": [p.name for p in self.parts],
                      "hidden": hidden_name, "digests": digests, "named": self.named, "inputs": self.inputs, **state}
        with _atomic_write(self.path / RESUME_NAME) as f:
            json.dump(self.state, f)
        if old_hidden and old_hidden != hidden_name:
            (self.path / old_hidden).unlink(missing_ok=True)

    def load_hidden(self, device: str) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """The checkpoint's activations: ``(hidden, float_hidden)`` (``float_hidden`` None when
        the run kept no float stream; both None without a calibration pass)."""
        from safetensors.torch import load_file

        name = self.state.get("hidden")
        if not name:
            return None, None
        p = self.path / name
        try:
            d = load_file(str(p))
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise InputError(f"--resume: {p} is damaged ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                             "rerun without --resume to start over") from None
        hidden = [d[f"b{j}"].to(device) for j in range(sum(k.startswith("b") for k in d))]
        floats = [d[f"f{j}"].to(device) for j in range(sum(k.startswith("f") for k in d))]
        return hidden, floats or None

    @property
    def artifact_dir(self) -> Path:
        """Where the artifact is assembled; the staging folder's parts and checkpoint stay
        beside it until the artifact is renamed into place, so an interruption while it is
        being written (joining parts, hashing, signing) can still be resumed."""
        return self.path / ARTIFACT_DIR


def staging_path(out: Path) -> Path:
    return out.resolve().parent / f".{out.name}.kvq-partial"


def resume_key(parts: dict) -> str:
    """SHA-256 over the canonical JSON of what determines the output (source digests,
    recipe, calibration provenance, format and dtype)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def input_digests(parts: dict) -> dict[str, str]:
    """:func:`resume_key` of each of ``parts`` on its own (kept in ``resume.json``), so that a
    refused ``--resume`` names the inputs that changed."""
    return {name: resume_key({name: value}) for name, value in parts.items()}


#: how a refused --resume names each input of :func:`input_digests`
INPUT_NAMES = {"source": "the source model's files", "recipe": "the recipe (with its flag overrides)",
               "calibration": "the calibration input", "format": "--format", "dtype": "--dtype",
               "kvq": "the kvq version"}


#: written into a staging folder when kvq creates it, before any part: a folder holding it is
#: kvq's even when a kill -9 came before the first checkpoint (``resume.json``)
MARKER_NAME = "kvq-staging.json"


def _claim(path: Path, out: Path):
    """An exclusive, non-blocking ``flock`` on ``path``'s marker file (created if missing), held
    while the returned file stays open: the run that holds it owns the staging folder.

    Raises:
        InputError: another process (a second ``kvq quantize`` of the same output) holds it.
    """
    import fcntl

    f = open(path / MARKER_NAME, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise _in_use(out, path) from None
    return f


def _in_use(out: Path, path: Path) -> InputError:
    return InputError(f"another kvq quantize is writing {out} (its staging folder {path} is in use); "
                      "wait for it to finish or write to another folder")


def refuse_if_in_use(out: Path) -> None:
    """Refuse at once, before the source loads, when another run holds ``out``'s staging folder
    (:func:`open_staging` claims it for good once the run's key is known).

    Under torchrun only rank 0 checks (the other ranks write no staging folder, and rank 0's
    own claim may already be held when they plan).

    Raises:
        InputError: another ``kvq quantize`` of ``out`` is running.
    """
    if os.environ.get("RANK", "0") not in ("", "0"):  # torchrun: only rank 0 writes (and claims) the folder
        return
    path = staging_path(out)
    if path.is_dir() and (path / MARKER_NAME).is_file():
        _claim(path, out).close()


def open_staging(out: Path, key: str, resume: bool, console=None, named: dict | None = None,
                 inputs: dict | None = None) -> Staging:
    """The staging folder for ``out``: resumed when ``resume`` and its key matches, else new.
    ``named``: flags the key covers whose values a refused resume names (``{"--threads": 2}``);
    ``inputs``: :func:`input_digests` of the key's parts, so that a refused resume names what changed.

    A staging folder kvq made (its :data:`MARKER_NAME`, or a ``resume.json``) but that holds
    no checkpoint -- killed after the first part was written, before the first checkpoint --
    is started over, with a note; with ``resume`` the note says there was nothing to resume
    (no layer was finished, so starting over loses nothing).

    Raises:
        InputError: ``resume`` asked but no staging folder exists, or its run was made from
            other inputs (its key differs), or a checkpointed file changed; the staging path
            exists and is not kvq's.
    """
    path = staging_path(out)
    state_file = path / RESUME_NAME
    if path.exists() and not path.is_dir():
        raise InputError(f"{path} exists and is not a folder; remove it")
    ours = path.is_dir() and ((path / MARKER_NAME).is_file() or state_file.is_file())
    held = _claim(path, out) if ours else None  # refused while another run uses it
    if resume and state_file.is_file():
        try:
            staging = _resume(path, out, key, console, named or {}, inputs or {})
        except BaseException:
            held.close()
            raise
        staging.lock = held  # held from the check through the resume: no second run slips in between
        return staging
    if held is not None:
        held.close()  # this run replaces the folder and claims the new one
    if resume and not ours:
        raise InputError(f"--resume: no interrupted run to resume for {out} (no {path}/{RESUME_NAME})")
    if path.exists():
        if not ours and any(path.iterdir()):
            raise InputError(f"{path} exists and was not written by an interrupted kvq quantize; remove it")
        if resume:
            show_note = (f"[yellow]note:[/] --resume: the interrupted run in {path} stopped before its first layer was "
                         "checkpointed: nothing to resume; starting over")
        elif state_file.is_file():
            show_note = f"[yellow]note:[/] replacing the interrupted run in {path} (pass --resume to continue it)"
        else:
            show_note = (f"[yellow]note:[/] replacing {path}, an interrupted run that finished no layer"
                         if ours else None)
        if console and show_note:
            console.print(show_note, highlight=False)
        shutil.rmtree(path)
    try:
        path.mkdir(parents=True)
    except FileExistsError:  # another run made it between the check above and here
        raise _in_use(out, path) from None
    lock = _claim(path, out)
    lock.write(json.dumps({"tool": "kvq", "output": str(out)}))  # its presence is what counts
    lock.flush()
    return Staging(path, key, named=named or {}, lock=lock, inputs=inputs or {})


def _resume(path: Path, out: Path, key: str, console, named: dict, inputs: dict) -> Staging:
    """The checkpointed run in ``path``, every recorded file rehashed (see :func:`open_staging`)."""
    state_file = path / RESUME_NAME
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--resume: cannot read {state_file}: {e}") from None
    if state.get("key") != key:
        before = state.get("named") or {}
        changed = [f for f in named if f in before and before[f] != named[f]]
        if changed:
            raise InputError(f"--resume: the interrupted run in {path} ran with "
                             + ", ".join(f"{f} {before[f]}" for f in changed) + " (this run: "
                             + ", ".join(f"{f} {named[f]}" for f in changed) + "); its layers would not match: "
                             "rerun with those, or without --resume to start over")
        recorded = state.get("inputs") or {}
        differ = [INPUT_NAMES.get(n, n) for n in inputs if n in recorded and recorded[n] != inputs[n]]
        what = (" and ".join(differ) + " differ" + ("s" if len(differ) == 1 else "") if differ
                else "source, recipe, calibration or output options differ")
        raise InputError(f"--resume: the interrupted run in {path} was made from other inputs ({what}); "
                         "rerun without --resume to start over")
    parts = [path / n for n in state.get("parts", [])]
    lost = [p.name for p in parts if not p.is_file()]
    if lost:
        raise InputError(f"--resume: {path} lacks {lost[0]}; rerun without --resume to start over")
    recorded = state.get("digests") or {}
    for name in [p.name for p in parts] + ([state["hidden"]] if state.get("hidden") else []):
        f = path / name
        if name not in recorded or not f.is_file() or file_digest(f) != recorded[name]:
            raise InputError(f"--resume: {f} changed since it was checkpointed (its SHA-256 differs from "
                             f"{RESUME_NAME}); rerun without --resume to start over")
    shutil.rmtree(path / ARTIFACT_DIR, ignore_errors=True)  # an interrupted final write
    if console:
        console.print(f"resuming: {state['layers_done']} layer(s) already done in {path}", highlight=False)
    return Staging(path, key, parts, state, named, inputs=inputs)


def checkpointed_layers(out: Path) -> int:
    """How many layers the staging folder of ``out`` has checkpointed (0: none, or no folder)."""
    try:
        return int(json.loads((staging_path(out) / RESUME_NAME).read_text()).get("layers_done") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


@contextmanager
def name_kept_checkpoint(out: Path, resume: bool):
    """Around the steps of a ``--resume`` run before its staging folder is opened (loading the
    source, hashing it): an interruption or crash there leaves the folder as it was, so name
    it on stderr, as :func:`keep_checkpoint` does once the layers run. Input errors (exit 2)
    stay one line."""
    try:
        yield
    except KvqError:
        raise
    except BaseException:
        done = checkpointed_layers(out) if resume else 0
        if done:
            print(f"kvq: the {done} finished layer(s) of the interrupted run are kept in {staging_path(out)}: "
                  "rerun the same command with --resume to continue", file=sys.stderr)
        raise


@contextmanager
def keep_checkpoint(staging: Staging | None, n_layers: int, drop_on_error: bool):
    """On the way out of a failed or interrupted block: keep the staging folder (and say so
    on stderr) when at least one layer is checkpointed, else remove it; with
    ``drop_on_error`` a kvq error (bad input, numerical fault) removes it anyway."""
    try:
        yield
    except BaseException as e:
        if staging is None or not staging.path.exists():
            _release(staging)
            raise
        done = staging.state.get("layers_done") or 0
        if (drop_on_error and isinstance(e, KvqError)) or not done:
            shutil.rmtree(staging.path, ignore_errors=True)
        else:
            where = f"after {done} of {n_layers} layers; the finished layers are kept in {staging.path}"
            if isinstance(e, KeyboardInterrupt):  # said in the interruption's one line (compressor.interrupts)
                interrupts.kept.append(where)
            else:
                print(f"kvq: stopped {where}: rerun the same command with --resume to continue", file=sys.stderr)
        _release(staging)  # a later --resume (in this process too) claims it again
        raise
    if staging is not None and not staging.path.exists():  # written and moved into place
        _release(staging)


def kept_note(staging: Staging, n_layers: int) -> str:
    """What a run stopped by a lost torchrun rank keeps (appended to its one line): the
    finished layers and how to continue, or that none was finished."""
    done = staging.state.get("layers_done") or 0
    if not done:
        return "; no layer was finished"
    return (f"; {done} of {n_layers} layers are kept in {staging.path}: rerun the same command with --resume "
            "(with any number of ranks) to continue")


def _release(staging: Staging | None) -> None:
    """Close the staging folder's claim (:func:`_claim`), if held."""
    if staging is not None and staging.lock is not None:
        staging.lock.close()
        staging.lock = None


class LayerWriter:
    """The per-layer hooks of :func:`compressor.pipeline.quantize_model` (the protocol of
    :class:`compressor.pipeline.LayerHooks`): load, write, checkpoint and release one
    decoder layer at a time.

    :meth:`load` reads decoder layer ``i``'s tensors from a streamed source (``ckpt``;
    ``None``: the model is already whole). :meth:`done` pops the layer's packed modules
    from the result (their schemes kept in :attr:`schemes`), writes them with the layer's
    float tensors to the part ``layer-<i>`` of ``staging`` (``None`` on torchrun ranks other
    than 0: nothing is written), returns the layer's weights to ``meta`` and records the
    resume state (figures, MoE records, KV statistics, the next layer's inputs).
    :meth:`restore` takes up an interrupted run from ``staging``.

    Attributes the pipeline reads: ``start`` (first layer to process), ``hidden`` (its
    inputs on resume), ``kv_absmax``, ``activation_budget`` (bytes; larger activations are
    spilled to ``spill_dir``), ``layers``, ``moe``, ``moe_fallback`` (results of the layers
    done before an interruption).

    Layers larger than ``memory_budget_gib`` (:data:`HELD_BYTES_PER_WEIGHT` per weight: the
    float32 weight and its int8 codes): :meth:`load_groups`
    materializes a streamed layer in bounded groups of routed experts instead of
    :meth:`load`, for steps that quantize each linear on its own (RTN, float weights) and for
    calibrated steps that quantize each routed expert from its own tokens (GPTQ, GPTAQ, static
    KV scales: :mod:`compressor.moe_stream`); AWQ reads the groups before that with
    :meth:`read_groups` (:mod:`compressor.moe_stream_awq`).
    """

    def __init__(self, model, arch, ckpt: LazyCheckpoint | None, staging: Staging | None, fmt: str,
                 dtype: torch.dtype, rename, activation_budget_gib: float, memory_budget_gib: float = 4.0):
        self.model, self.arch, self.ckpt, self.staging = model, arch, ckpt, staging
        self.fmt, self.dtype, self.rename = fmt, dtype, rename
        self.schemes: dict[str, Scheme] = {}  # module name -> its scheme, layers written
        self.start = 0
        self.hidden: list[torch.Tensor] | None = None
        #: the float model's activations beside ``hidden`` (GPTQ's float target): restored on
        #: resume, and set by the driver before each :meth:`done` so the checkpoint keeps them
        self.float_hidden: list[torch.Tensor] | None = None
        self.kv_absmax: dict = {}
        self.activation_budget = int(activation_budget_gib * 2**30)
        self.spill_dir = staging.path if staging is not None else Path(tempfile.gettempdir())
        self.layers: list = []
        self.moe: list = []
        self.moe_fallback: list = []
        self.memory_budget = int(memory_budget_gib * 2**30)
        self._written: set[str] = set()  # tensors of the current layer already written by expert groups
        self._mail: GroupMail | None = None  # ranks own the layer's experts: the groups go to rank 0

    def release_outer(self) -> None:
        """Return the embedding and an untied head to ``meta`` (streamed sources only): once
        layer 0's inputs are captured nothing reads them until :meth:`load_outer`. For a
        Kimi K2-size vocabulary (163,840 x 7,168) that is 4.7 GB of float32 each."""
        if self.ckpt is None:
            return
        from .arch import get_module

        to_meta(get_module(self.model, self.arch.embed_tokens))
        head = get_module(self.model, self.arch.lm_head)
        if head is not None:
            to_meta(head)

    def load_outer(self) -> None:
        """Read the tensors outside the decoder layers again, in the storage dtype (streamed
        sources only), for the artifact's last part; the same values as read in float32 and
        cast, as both are one rounding of the source's value."""
        if self.ckpt is None:
            return
        from .source.lazy import outer_names

        meta = [n for n in outer_names(self.model, self.arch) if _tensor(self.model, n).is_meta]
        load_into(self.model, self.ckpt, self.arch, meta, self.dtype)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()

    def restore(self, device: str) -> None:
        """Take up the interrupted run recorded in the staging folder, if any: layers before
        ``start`` are done (their weights go to ``meta`` and are never loaded again)."""
        from .arch import get_module

        st = self.staging.state if self.staging is not None else {}
        hidden, floats = self.staging.load_hidden(device) if st.get("layers_done") else (None, None)
        st, hidden, floats = share((st, hidden, floats))  # torchrun: rank 0's checkpoint, to every rank
        if not st.get("layers_done"):
            return
        self.start = int(st["layers_done"])
        self.layers, self.moe, self.moe_fallback = st["layers"], st["moe"], st["moe_fallback"]
        self._add_schemes(st["schemes"])
        self.kv_absmax = {int(j): (torch.tensor(k), torch.tensor(v)) for j, (k, v) in st["kv_absmax"].items()}
        self.hidden = None if hidden is None else [h.to(device) for h in hidden]
        self.float_hidden = None if floats is None else [h.to(device) for h in floats]
        for i in range(self.start):
            to_meta(get_module(self.model, self.arch.layers)[i])

    def load(self, i: int, layer: torch.nn.Module) -> None:
        """Materialize decoder layer ``i`` (streamed sources only)."""
        if self.ckpt is not None:
            load_into(self.model, self.ckpt, self.arch, layer_names(self.model, self.arch, i))

    def expert_groups(self, i: int, divided: bool = False) -> list[list[str]] | None:
        """Decoder layer ``i``'s tensor names in groups (:func:`compressor.moe_ranks.expert_groups`, ``memory_budget``
        bytes a group at :data:`HELD_BYTES_PER_WEIGHT` per weight). ``None`` when the layer is
        not streamed, or has no routed experts, or fits the budget whole (it is then loaded at
        once) and ``divided`` is False. With ``divided`` (several ranks own the experts:
        :mod:`compressor.moe_ranks`) only this rank's experts are grouped, whatever the budget."""
        self._mail = None
        if self.ckpt is None:
            return None
        rest, experts, sizes = self._experts = split_layer(self.model, self.arch, i, HELD_BYTES_PER_WEIGHT)
        if (sum(sizes.values()) <= self.memory_budget and not divided) or not experts:
            return None
        share = ExpertShare(len(experts), divided)
        groups, counts = share.groups(experts, sizes, self.memory_budget)
        self._mail = GroupMail(counts, self.memory_budget // 2) if share.size > 1 else None  # to rank 0
        return [rest] + groups

    def load_groups(self, i: int, result, groups: list[list[str]]):
        """Materialize streamed decoder layer ``i`` group by group (``groups``, from :meth:`expert_groups`),
        yielding each group's module names after it is read; once the caller has quantized
        a group of experts (its records in ``result.modules``), that group is packed,
        written to the part ``layer-<i>-e<its first expert>`` and returned to ``meta`` before
        the next is read. The non-expert group stays loaded for :meth:`done`. With experts
        owned per rank, rank 0 writes the other ranks' groups after its own (:class:`~compressor.moe_ranks.GroupMail`).

        Raises:
            InputError: a tensor holds NaN or Inf (named).
        """
        self._written, self._pending, k = set(), list(groups), 0  # the expert groups: see rebalance
        while k < len(self._pending):
            names = self._pending[k]
            load_into(self.model, self.ckpt, self.arch, names)
            modules = sorted({n.rsplit(".", 1)[0] for n in names})
            yield modules
            if k:
                self._write_group(i, names, modules, result)
            k += 1
        if self._mail is not None:  # the other ranks' groups, once this rank's are written
            self._save_parts(self._mail.collect())

    def rebalance(self, share) -> None:
        """Read this rank's experts of ``share`` (weighed by their routing) instead, before the first is read."""
        _rest, experts, sizes = self._experts  # the layer's split, from expert_groups
        self._pending[1:], counts = share.groups(experts, sizes, self.memory_budget)
        self._mail = GroupMail(counts, self.memory_budget // 2)

    def read_groups(self, groups: list[list[str]] | None = None):
        """Materialize routed-expert ``groups`` (default: those :meth:`load_groups` reads) one at a time,
        yielding each group's module names after it is read and returning its weights to ``meta``
        before the next is read; nothing is written (AWQ's statistics and scale search before
        :meth:`load_groups` quantizes the layer: :mod:`compressor.moe_stream_awq`).

        Raises:
            InputError: a tensor holds NaN or Inf (named).
        """
        for names in self._pending[1:] if groups is None else groups:
            load_into(self.model, self.ckpt, self.arch, names)
            modules = sorted({n.rsplit(".", 1)[0] for n in names})
            try:
                yield modules
            finally:
                self._release(modules)

    def _release(self, modules: list[str]) -> None:
        """Return the experts holding ``modules`` (``...experts.<e>.gate_proj``) to ``meta``."""
        for m in sorted({m.rsplit(".", 1)[0] for m in modules}):
            to_meta(self.model.get_submodule(m))

    def _write_group(self, i: int, names: list[str], modules: list[str], result) -> None:
        """Pack and write one group of routed experts (under several ranks, rank 0 writes every
        rank's: :class:`compressor.moe_ranks.GroupMail`), then return its experts to ``meta``."""
        from .artifact import state_tensors
        from .formats import get_format

        recs = {n: result.modules.pop(n) for n in modules if n in result.modules}
        schemes = {n: r.scheme for n, r in recs.items()}
        self.schemes.update(schemes)
        if self.staging is not None or self._mail is not None:
            packed = {self.rename(n): t for n, t in get_format(self.fmt).pack_all(recs, self.dtype).items()}
            first = min(int(_EXPERT.search(n[len(f"{self.arch.layers}.{i}."):]).group(1)) for n in names)
            group = (f"layer-{i:05d}-e{first:04d}", state_tensors(self.model, packed, self.dtype, rename=self.rename,
                                                                  names=set(names)),
                     {n: list(v) for n, v in schemes.items()}, names)  # schemes as the checkpoint keeps them
            self._save_parts(self._mail.send(group) if self._mail is not None else [group])
        self._written.update(names)
        self._release(modules)

    def _save_parts(self, groups) -> None:
        """Rank 0: write each ``(part name, tensors, schemes, tensor names)`` of ``groups`` (an iterable)."""
        for g in groups:
            self.staging.save_part(g[0], g[1])
            self._add_schemes(g[2])
            self._written.update(g[3])

    def _add_schemes(self, schemes: dict[str, list]) -> None:
        """Module schemes kept as lists (the resume checkpoint, another rank; 3 entries: an integer scheme)."""
        self.schemes.update({n: Scheme(*v) for n, v in schemes.items()})

    def done(self, i: int, layer: torch.nn.Module, result, hidden: list[torch.Tensor] | None) -> None:
        """Write decoder layer ``i`` (``result``: the pipeline's ``QuantizeResult`` so far;
        ``hidden``: the next layer's inputs, ``None`` without a calibration pass)."""
        from .artifact import state_tensors
        from .formats import get_format

        prefix = f"{self.arch.layers}.{i}."
        recs = {n: result.modules.pop(n) for n in [n for n in result.modules if n.startswith(prefix)]}
        self.schemes.update({n: r.scheme for n, r in recs.items()})
        if self.staging is None:  # not rank 0: nothing to write
            to_meta(layer)
            return
        packed = {self.rename(n): t for n, t in get_format(self.fmt).pack_all(recs, self.dtype).items()}
        self.staging.save_part(f"layer-{i:05d}", state_tensors(self.model, packed, self.dtype, rename=self.rename,
                                                               prefix=prefix, exclude=self._written))
        self._written = set()
        to_meta(layer)
        self.checkpoint(i, result, hidden)

    def checkpoint(self, i: int, result, hidden: list[torch.Tensor] | None) -> None:
        """Record layers ``<= i`` as written in the resume checkpoint (``result``'s figures, MoE records, KV statistics)."""
        self.staging.checkpoint(i + 1, {
            "layers": result.layers, "moe": result.moe, "moe_fallback": result.moe_fallback,
            "schemes": {n: list(v) for n, v in self.schemes.items()},
            "kv_absmax": {str(j): [k.tolist(), v.tolist()] for j, (k, v) in result.kv_absmax.items()},
        }, hidden, self.float_hidden)
