"""GPTQ's true-sequential passes replay the outputs of a decoder layer's finished children
(compressor.quant.replay): the same artifact as running every child again, fewer forwards."""

from __future__ import annotations

import pytest
import torch

from compressor.pipeline import quantize_model  # first: it imports the algorithm handlers in their order
from compressor.quant import gptq_layer as gl
from compressor.quant import replay as rp
from compressor.quant.replay import ModuleReplay
from compressor.recipe import load_recipe, with_overrides

from tiny_models import tiny_llama


def _model(seed=0):
    return tiny_llama(seed, num_hidden_layers=3)


def _recipe(alg="gptq", **kw):
    return with_overrides(load_recipe("w4a16-gptq"), **{"algorithm": alg, "weights.group_size": 32,
                                                          "awq.loss_samples": 4, **kw})


def _run(monkeypatch, replay: bool, recipe, kv=False):
    """quantize_model on a fresh tiny Llama; returns (result, the replays made, logits on fixed ids)."""
    made: list[ModuleReplay] = []

    class Spy(ModuleReplay):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(gl, "ModuleReplay", Spy)
    if not replay:
        monkeypatch.setattr(gl, "layer_replay", lambda layer, passes, ctx: (None, {}))
    if kv:
        recipe = with_overrides(recipe, kv_cache=load_recipe("kv-fp8").kv_cache)
    m = _model()
    ids = torch.randint(0, 320, (6, 40), generator=torch.Generator().manual_seed(3))
    res = quantize_model(m, recipe, ids, batch_size=2)
    monkeypatch.undo()
    return res, made, m(ids[:2]).logits


def _same(a, b):
    assert a.modules.keys() == b.modules.keys()
    for n in a.modules:
        x, y = a.modules[n], b.modules[n]
        assert torch.equal(x.q, y.q) and torch.equal(x.scale, y.scale), n
        assert (x.zero_point is None) == (y.zero_point is None)
        assert x.zero_point is None or torch.equal(x.zero_point, y.zero_point), n
    strip = lambda f: {k: v for k, v in f.items() if k not in ("seconds", "phase_seconds")}  # noqa: E731
    assert [strip(f) for f in a.layers] == [strip(f) for f in b.layers]  # output error, peak activation included


@pytest.mark.parametrize("alg", ["gptq", "awq-gptq"])
@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_replay_gives_the_same_quantization_and_figures(monkeypatch, alg):
    on, made, logits_on = _run(monkeypatch, True, _recipe(alg))
    off, none, logits_off = _run(monkeypatch, False, _recipe(alg))
    _same(on, off)
    assert torch.equal(logits_on, logits_off)
    assert not none and len(made) == 3
    # per layer, 3 batches: q/k/v kept in the o_proj pass, replayed while the attention is kept
    # in the gate/up pass (9), then released; the attention replayed in the down_proj pass and
    # the recompute (3 + 3); gate/up kept in the down_proj pass, replayed by the recompute (6)
    for r in made:
        assert r.final == ["self_attn", "mlp.gate_proj", "mlp.up_proj"]
        assert r.released == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
        assert set(r.kept["self_attn"]) == {(0, 0), (1, 0), (2, 0)}
        assert r.replayed == 9 + 3 + 3 + 6
        assert r.peak > 0


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_replay_with_kv_observers_leaves_the_attention_to_the_recompute(monkeypatch):
    """The KV observers read the attention's keys and values in the recompute: it runs there."""
    on, made, _ = _run(monkeypatch, True, _recipe(), kv=True)
    off, _, _ = _run(monkeypatch, False, _recipe(), kv=True)
    _same(on, off)
    assert on.kv_scales.keys() == off.kv_scales.keys() and on.kv_scales
    for i in on.kv_scales:
        assert all(torch.equal(x, y) for x, y in zip(on.kv_scales[i], off.kv_scales[i]))
    assert all(r.replayed == 9 + 3 for r in made)  # q/k/v in the gate/up pass, the attention in the down_proj pass


def test_replay_budget_keeps_nothing_it_cannot_hold(monkeypatch):
    """A budget below one batch's attention output: nothing kept, nothing replayed, same result."""
    real = gl.layer_replay

    def small(layer, passes, ctx):
        r, last = real(layer, passes, ctx)
        r.budget = 100
        return r, last

    monkeypatch.setattr(gl, "layer_replay", small)
    made: list[ModuleReplay] = []
    orig_init = ModuleReplay.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(ModuleReplay, "__init__", init)
    m = _model()
    ids = torch.randint(0, 320, (6, 40), generator=torch.Generator().manual_seed(3))
    small_res = quantize_model(m, _recipe(), ids, batch_size=2)
    monkeypatch.undo()
    off, _, _ = _run(monkeypatch, False, _recipe())
    _same(small_res, off)
    assert made and all(r.held == 0 and r.replayed == 0 for r in made)


def test_what_is_kept_and_from_which_pass():
    """Llama's 4 passes; DeepSeek-V3's 5 (MLA: q_a/kv_a, q_b/kv_b, o, then the MLP's two);
    one pass (no true_sequential) or a zero budget keeps nothing."""
    ctx = type("C", (), {"replay_budget": None})()
    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    llama = [qkv, ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    r, final_from = gl.layer_replay(torch.nn.Module(), llama, ctx)
    assert final_from == {"self_attn": 2, **dict.fromkeys(qkv, 1), "mlp.gate_proj": 3, "mlp.up_proj": 3}
    assert r.budget is None
    mla = [["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"], ["self_attn.q_b_proj", "self_attn.kv_b_proj"],
           ["self_attn.o_proj"], ["mlp.experts.0.gate_proj", "mlp.shared_experts.up_proj"],
           ["mlp.experts.0.down_proj", "mlp.shared_experts.down_proj"]]
    _, final_from = gl.layer_replay(torch.nn.Module(), mla, ctx)
    assert final_from == {"self_attn": 3, "self_attn.q_a_proj": 1, "self_attn.kv_a_proj_with_mqa": 1,
                          "self_attn.q_b_proj": 2, "self_attn.kv_b_proj": 2,
                          "mlp.experts.0.gate_proj": 4, "mlp.shared_experts.up_proj": 4}
    assert gl.layer_replay(None, [qkv + ["mlp.down_proj"]], ctx) == (None, {})
    ctx.replay_budget = 0
    assert gl.layer_replay(None, llama, ctx) == (None, {})


def test_replayed_output_is_a_copy():
    """A caller changing the returned output in place changes neither the kept copy nor the next replay."""
    layer = torch.nn.Module()
    layer.child = torch.nn.Linear(4, 4)
    r = ModuleReplay(layer, None)
    r.finalize(["child"])
    assert r.final == ["child"]
    x = torch.randn(2, 4)
    with torch.no_grad(), r.active():
        r.start_batch(0)
        first = layer.child(x)
        first.add_(100.0)
        second_call = layer.child(2 * x)  # a second call in the same forward is kept on its own
        r.start_batch(0)
        again, again2 = layer.child(x), layer.child(2 * x)
    ref = torch.nn.functional.linear(x, layer.child.weight, layer.child.bias)
    assert r.replayed == 2 and torch.allclose(again, ref) and torch.equal(again2, second_call)
    assert "forward" not in vars(layer.child)  # the class's forward is back
    assert rp._nbytes((again, None, [again])) == 2 * again.numel() * 4
    assert r.complete("child", 1) and not r.complete("child", 2) and r.held == 2 * again.numel() * 4
    r.release(["child"])
    r.finalize(["child"])  # released stays released
    assert r.final == [] and r.held == 0 and r.released == {"child"}
