"""A CUDA device faked on the CPU, to find device-placement faults of kvq's CUDA paths in CI.

CI has no GPU, and a CPU run of ``--device cuda`` code cannot show a tensor left on the
wrong device: every tensor is on the CPU. Under :func:`fake_cuda`, ``"cuda"`` tensors are
:class:`FakeCudaTensor` wrappers (their data on the CPU, ``.device`` ``cuda:0``), made by
factory functions given a CUDA device, ``Tensor.to``/``Tensor.cuda`` and ``Module.to``;
every torch function that mixes a fake CUDA tensor with a CPU tensor of one or more dimensions
raises CUDA's own error (``Expected all tensors to be on the same device``), as a real GPU
would. CPU scalars (0-dim tensors) mix as CUDA allows, and the cross-device ops CUDA allows
(copies, indexing a CUDA tensor with CPU indices) pass. ``torch.cuda``'s queries answer as
one device would (``is_available``, memory figures, ``synchronize``).

It checks placement only: kernels (Triton) cannot run on it (:func:`reference_triton_kernels`),
timings mean nothing, and it covers the calling thread only (a torch function mode is
thread-local: ``serve-smoke --http`` generates in the server's threads, outside it).
Written after the first real GPU run (2026-12-04, an H200) failed every ``--device cuda``
quantize at its first layer (CPU accumulators in AWQ's clip search, the KV scale search and
the MoE routed-token counts; the W4 packing's CPU shift table): it reproduces each of them.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)


class FakeCudaTensor(torch.Tensor):
    """A tensor that reports ``cuda:0`` and holds its data in ``elem``, a CPU tensor."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype, device=CUDA,
                                                requires_grad=elem.requires_grad, storage_offset=elem.storage_offset())
        t.elem = elem
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"FakeCudaTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        # inside fake_cuda() every torch function on these tensors is served by the mode; one that
        # reaches the dispatcher ran outside it (another thread, or after the with block)
        raise RuntimeError(f"fake CUDA tensor used outside fake_cuda() (in {func}): the mode is thread-local")


def _unwrap(t):
    return t.elem if isinstance(t, FakeCudaTensor) else t


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


def _wrap(t):
    if isinstance(t, FakeCudaTensor) or not isinstance(t, torch.Tensor):
        return t
    if isinstance(t, torch.nn.Parameter):
        t = t.data
    return FakeCudaTensor(t)


def _to(t: torch.Tensor, args, kwargs):
    """``t.to(*args, **kwargs)`` on the fake device: the target from torch's own parser."""
    if args and isinstance(args[0], torch.Tensor):  # .to(other): other's device and dtype
        device, dtype = args[0].device, args[0].dtype
        memory_format, copy = None, kwargs.get("copy", False)
    else:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **{k: v for k, v in kwargs.items() if k != "copy"})
        copy = kwargs.get("copy", False) or (len(args) > 3 and args[3])
    src = _unwrap(t)
    kw = {"dtype": dtype} if dtype is not None else {}
    if memory_format is not None:
        kw["memory_format"] = memory_format
    if device is None:
        out = src.to(copy=bool(copy), **kw)
        return _wrap(out) if isinstance(t, FakeCudaTensor) else out
    if _is_cuda(device):
        if isinstance(t, FakeCudaTensor):
            return t if not kw and not copy else _wrap(src.to(copy=bool(copy), **kw))
        return _wrap(src.to(copy=True, **kw))  # a host-to-device copy
    return src.to(copy=True, **kw) if isinstance(t, FakeCudaTensor) else src.to(device, copy=bool(copy), **kw)


#: functions CUDA runs with a CPU tensor beside a CUDA one (copies, CPU index tensors)
_CROSS_DEVICE_FUNCS = {"copy_", "__getitem__", "__setitem__", "index_put_", "index_put", "to"}


#: what a CUDA tensor answers (the data underneath would answer cpu)
_DEVICE_QUERIES = {torch.Tensor.device.__get__: CUDA, torch.Tensor.is_cuda.__get__: True,
                   torch.Tensor.is_cpu.__get__: False, torch.Tensor.get_device: 0}


def _rewrap(out, inputs: dict):
    """Wrap an op's CPU results again: an input returned as is (in place, ``self``) gets its own wrapper back."""
    def one(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeCudaTensor):
            return t
        w = inputs.get(id(t))
        return w if w is not None else FakeCudaTensor(t)
    return tree_map(one, out)


class _Mode(TorchFunctionMode):
    """Every torch function that touches a fake CUDA tensor runs on the data underneath (so no
    CUDA kernel, device guard or allocator is ever reached), after CUDA's device check.
    ``ops`` counts those calls (a test can check the code under test used the device at all)."""

    ops = 0

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            return _to(args[0], args[1:], kwargs)
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0] if isinstance(args[0], FakeCudaTensor) else _wrap(_unwrap(args[0]).clone())
        if name == "cpu" and args and isinstance(args[0], FakeCudaTensor):
            return args[0].elem.clone()
        if name == "pin_memory":
            return args[0]
        if name == "is_pinned":
            return False
        if args and isinstance(args[0], FakeCudaTensor) and func in _DEVICE_QUERIES:
            return _DEVICE_QUERIES[func]
        flat, _ = tree_flatten((args, kwargs))
        fakes = {id(t.elem): t for t in flat if isinstance(t, FakeCudaTensor)}
        if fakes:
            self.ops += 1
            if name == "numpy":
                raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                                "to host memory first. (fake CUDA)")
            if name not in _CROSS_DEVICE_FUNCS:
                cpu = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, FakeCudaTensor) and t.dim() > 0]
                if cpu:
                    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                       f"cuda:0 and cpu! (fake CUDA: {name}, CPU operand of shape {tuple(cpu[0].shape)})")
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            uargs, ukwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
            if name == "histc" and not uargs[0].is_floating_point():  # CUDA's histc takes integers, the CPU's not
                uargs = (uargs[0].float(), *uargs[1:])
            out = func(*uargs, **ukwargs)
            if name == "__setitem__":
                return out
            return _rewrap(out, fakes)
        if _is_cuda(kwargs.get("device")):  # a factory function given the CUDA device
            kwargs["device"] = "cpu"
            return tree_map(_wrap, func(*args, **kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda(total_memory: int = 80 * 2**30):
    """Fake one CUDA device for the ``with`` block (``torch.cuda``'s queries and ``torch.Generator``
    are patched until it ends); yields the mode, whose ``ops`` counts the calls on the device.
    See the module docstring for what it checks."""
    with pytest.MonkeyPatch.context() as monkeypatch, _Mode() as mode:
        _patch(monkeypatch, total_memory)
        yield mode


def _patch(monkeypatch, total_memory: int) -> None:
    cuda = torch.cuda
    props = types.SimpleNamespace(name="fake CUDA (CPU)", total_memory=total_memory, major=9, minor=0,
                                  multi_processor_count=1, L2_cache_size=64 * 2**20)
    for attr, value in {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "synchronize": lambda *a, **k: None, "empty_cache": lambda: None, "set_device": lambda *a: None,
        "get_device_name": lambda *a: props.name, "get_device_properties": lambda *a: props,
        "get_device_capability": lambda *a: (9, 0), "is_bf16_supported": lambda *a, **k: True,
        "mem_get_info": lambda *a: (total_memory, total_memory), "memory_allocated": lambda *a: 0,
        "max_memory_allocated": lambda *a: 0, "memory_reserved": lambda *a: 0, "max_memory_reserved": lambda *a: 0,
        "reset_peak_memory_stats": lambda *a: None, "manual_seed": lambda *a: None, "manual_seed_all": lambda *a: None,
        "is_initialized": lambda: True, "init": lambda: None,
    }.items():
        monkeypatch.setattr(cuda, attr, value)
    monkeypatch.setattr(torch, "Generator", _Generator)
    real_compatible = torch._has_compatible_shallow_copy_type
    monkeypatch.setattr(torch, "_has_compatible_shallow_copy_type",  # Module.to: a new Parameter, not param.data =
                        lambda a, b: type(a) is type(b) and real_compatible(a, b))


_RealGenerator = torch.Generator


class _FakeGenerator(_RealGenerator):
    """``torch.Generator(device="cuda")``: a CPU generator that says it is on CUDA."""

    @property
    def device(self):
        return CUDA


class _Generator(_RealGenerator):
    """``torch.Generator`` under the fake: a CUDA one is a :class:`_FakeGenerator`, others are real."""

    def __new__(cls, device="cpu"):
        return _FakeGenerator("cpu") if _is_cuda(device) else _RealGenerator(device)


def reference_triton_kernels(monkeypatch) -> None:
    """Triton cannot launch on the fake device: the runtime's two kernel entry points run their
    launch checks, then the pure-torch references of their numerics (the kernels themselves are
    tested under ``TRITON_INTERPRET=1``)."""
    from compressor.runtime import triton_kernels as tk

    def w4a16_matmul(x, qweight, scales, zeros, group_size, config=None):
        tk.check_launch(x, qweight, scales, zeros, group_size)
        return tk.w4a16_reference(x.contiguous(), qweight, scales, zeros, group_size).to(x.dtype)

    def moe_w4a16(x, idx, qweight, scales, zeros, group_size, rows_per_token=1, block_n=None):
        tk.check_launch(x, qweight[0], scales[0], zeros[0], group_size)
        tk.moe_align(idx, qweight.shape[0], tk.moe_block_m(idx.numel(), qweight.shape[0]))  # its placement too
        return tk.moe_w4a16_reference(x, idx, qweight, scales, zeros, group_size, rows_per_token).to(x.dtype)

    monkeypatch.setattr(tk, "w4a16_matmul", w4a16_matmul)
    monkeypatch.setattr(tk, "moe_w4a16", moe_w4a16)
