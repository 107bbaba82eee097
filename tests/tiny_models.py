"""Every tiny model the tests build, in one place: the table of tiny configs for the rows of
compressor/arch.py's ARCHITECTURES, and the builders (random init, folders saved as transformers
writes them or as the releases lay them out, block-FP8 copies, Kimi's tiktoken tokenizer, the Kimi
K2.5 wrapper, a Llama GGUF file). Random init only, no downloads; each builder seeds torch itself, so a test gets
the same model whichever test ran before it.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import torch

# ---------------------------------------------------------------------------------------
# the table

#: the fields every row's tiny model starts from: hidden 64, 2 decoder layers, 4 query heads over 2 KV heads
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
_TOP2 = dict(num_experts_per_tok=2)
#: DeepSeek-V3-style latent attention (one KV head a query head) and MoE: 4 routed experts, 1 shared, dense layer 0
_MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, norm_topk_prob=True, **_TOP2)
_DSA = dict(_MLA, index_topk=16, index_head_dim=16, index_n_heads=4)  # top-16 of 48 tokens: sparse
#: ARCHITECTURES row -> (the transformers model_type that builds it, its tiny config fields over BASE);
#: every in_features a multiple of 32
CONFIGS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", dict(head_dim=16)),  # q/k norms
    "mistral": ("mistral", dict(sliding_window=32)),  # calibration windows of 48 tokens cross the window
    "gemma3_text": ("gemma3_text", dict(head_dim=16, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"],
                                        final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                                        tie_word_embeddings=True)),
    "glm4": ("glm4", dict(head_dim=16)),  # fused gate_up_proj, partial rotary, post-sublayer norms
    # the releases carry one multi-token-prediction layer (transformers' default; make_published stores it)
    "glm4_moe": ("glm4_moe", dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True,
                                  num_nextn_predict_layers=1, **_TOP2)),
    "deepseek_v3": ("deepseek_v3", dict(_MLA, n_group=2, num_nextn_predict_layers=1)),
    "mixtral": ("mixtral", dict(intermediate_size=64, num_local_experts=4, **_TOP2)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, moe_intermediate_size=32, num_experts=4, mlp_only_layers=[0],
                                    **_TOP2)),
    # Kimi K2: DeepSeek-V3 fields under model_type kimi_k2 with custom code (auto_map), no MTP, YaRN
    "kimi_k2": ("deepseek_v3", dict(_MLA, routed_scaling_factor=2.827, num_nextn_predict_layers=0,
                                    rope_theta=50000.0,
                                    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                                      beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
    "glm4_moe_lite": ("glm4_moe_lite", dict(_MLA, routed_scaling_factor=1.8, num_nextn_predict_layers=1)),
    "deepseek_v32": ("deepseek_v32", dict(_DSA, n_group=2, num_nextn_predict_layers=1)),
    "glm_moe_dsa": ("glm_moe_dsa", dict(_DSA, num_nextn_predict_layers=1)),
}
#: rows whose tiny folder is saved as transformers writes it (make_dir; tests/test_arch.py's table)
ARCH_ROWS = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "glm4", "glm4_moe", "deepseek_v3", "mixtral",
             "qwen3_moe")
#: rows saved as their release lays them out (make_published; tests/test_frontier.py): published
#: config.json, the MTP layer, a router score-correction bias that is not zero
PUBLISHED = ("kimi_k2", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "deepseek_v3", "glm4_moe")
#: the rows that exist only as published layouts (Kimi K2, GLM-4.7-Flash, DeepSeek-V3.2, GLM-5; issue #15)
NEW = ("kimi_k2", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
#: rows built as a wrapper around another row's text model (make_k25)
WRAPPED = ("kimi_k25",)
#: quantize settings for the row models: W4 g32, 4 calibration windows of 48 tokens (longer than index_topk 16)
ROW_FAST = dict(group_size=32, calib_samples=4, calib_seqlen=48)

KIMI_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
K25_AUTO_MAP = {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}
#: a tiny MoonViT: hidden 32, 2 blocks, 2 heads, MLP 64, 4 x 4 patches, 2 x 2 merge
VISION = {"model_type": "kimi_k25_vision", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "intermediate_size": 64, "patch_size": 4, "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 2,
          "merge_kernel_size": [2, 2]}


# ---------------------------------------------------------------------------------------
# in memory


def tiny(row: str, seed: int = 0, vocab_size: int = 320, **kw):
    """A random-init model of ``row`` (``kw``: config fields over the table's); norms and routers
    get spread so AWQ and routing have work. The router score-correction bias stays at zero
    (see :func:`spread_router_bias`)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    builds, fields = CONFIGS[row]
    cfg = CONFIG_MAPPING[builds](**{**BASE, "vocab_size": vocab_size, **fields, **kw})
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):  # Gemma's norms are (1 + weight): keep the factor positive
                p.uniform_(-0.5, 0.5) if builds.startswith("gemma") else p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):  # routers: random, not transformers' zero init
                p.normal_(0, 0.5)
            elif p.ndim == 3:  # fused experts
                p.normal_(0, 0.05)
    return m


def spread_router_bias(model, normal: bool = False):
    """``model`` with its routers' ``e_score_correction_bias`` buffers (zero after random init)
    drawn from torch's generator, so a lost or misread buffer shows: uniform on [-0.2, 0.2) (the
    published rows), or N(0, 0.3) with ``normal``. Returns ``model``."""
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3) if normal else b.uniform_(-0.2, 0.2)
    return model


def tiny_published(row: str, seed: int = 0, vocab_size: int = 320, **kw):
    """:func:`tiny` with the router bias a release has (uniform on [-0.2, 0.2))."""
    return spread_router_bias(tiny(row, seed, vocab_size, **kw))


def tiny_config(**kw):
    """The small Llama config most tests start from: vocab 320, hidden 64, 2 layers, 4 heads over 2 KV heads,
    tied embeddings (``kw``: fields over these)."""
    from transformers import LlamaConfig

    base = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    )
    base.update(kw)
    return LlamaConfig(**base)


def tiny_llama(seed: int = 0, **kw):
    """A random-init LlamaForCausalLM of :func:`tiny_config` (``kw``), in eval mode without gradients; the
    norms drawn from [0.5, 1.5) so AWQ has something to fold."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(tiny_config(**kw)).eval().requires_grad_(False)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def tiny_lm(vocab: int, seed: int, model_type: str = "llama", **kw):
    """A one-layer model (hidden 32, 2 heads over 1 KV head, tied embeddings) of ``model_type`` with a
    ``vocab``-row embedding, as transformers initializes it: for what depends on the vocabulary's size."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = CONFIG_MAPPING[model_type](
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True, **kw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


# ---------------------------------------------------------------------------------------
# saved folders


def make_model_dir(path: Path, tokenizer, seed: int = 0, **cfg_kw) -> Path:
    """:func:`tiny_llama` with ``tokenizer``'s vocabulary and the tokenizer saved in ``path``."""
    tiny_llama(seed, vocab_size=len(tokenizer), **cfg_kw).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_dir(path, tokenizer, row, seed=0, prepare=lambda m: m, **kw):
    """``tiny(row)`` (passed through ``prepare``) and ``tokenizer`` saved in ``path``, with
    an embedding row for every id the tokenizer gives as the row's folder loads it (Qwen2's
    class adds ``<|endoftext|>`` after the tokenizer's 320 ids; kvq refuses a tokenizer beyond
    the embedding)."""
    from compressor.source.resolve import load_tokenizer

    prepare(tiny(row, seed, len(tokenizer), **kw)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    loaded = len(load_tokenizer(path))
    if loaded > len(tokenizer):
        prepare(tiny(row, seed, loaded, **kw)).save_pretrained(path)
    return path


def mtp_tensors(state: dict, n_layers: int, seed: int) -> dict:
    """A DeepSeek-V3 / GLM multi-token-prediction layer ``n_layers``: a copy of the last
    decoder layer's tensor names (random values) plus enorm, hnorm, eh_proj, shared_head
    and its own embed_tokens, as the releases store it."""
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{n_layers - 1}.", f"model.layers.{n_layers}."
    out = {}
    for k, v in state.items():
        if k.startswith(last):
            k = mtp + k[len(last):]
            out[k] = (torch.rand(v.shape, generator=g) + 0.5 if "norm" in k
                      else torch.randn(v.shape, generator=g) * 0.05)
    h, vocab = state["model.embed_tokens.weight"].shape[1], state["model.embed_tokens.weight"].shape[0]
    out.update({mtp + "enorm.weight": torch.ones(h), mtp + "hnorm.weight": torch.ones(h),
                mtp + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.05,
                mtp + "shared_head.norm.weight": torch.ones(h),
                mtp + "shared_head.head.weight": torch.randn(vocab, h, generator=g) * 0.05,
                mtp + "embed_tokens.weight": torch.randn(vocab, h, generator=g) * 0.05})
    return out


def make_published(path, tokenizer, row: str, seed: int = 0, vocab_size: int | None = None, **kw):
    """:func:`tiny_published` saved as its release lays it out: the published config.json
    (model_type, auto_map, architectures) and the MTP layer after the decoder layers; the
    embedding has ``vocab_size`` rows (default: the tokenizer's)."""
    from safetensors.torch import load_file, save_file

    m = tiny_published(row, seed, vocab_size or len(tokenizer), **kw)
    m.save_pretrained(path)
    tokenizer.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    if row == "kimi_k2":
        cfg.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], auto_map=KIMI_AUTO_MAP)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if cfg.get("num_nextn_predict_layers"):
        state = load_file(str(path / "model.safetensors"))
        state.update(mtp_tensors(state, cfg["num_hidden_layers"], seed + 1))
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiktoken_folder(path, text: str):
    """A Kimi-style tokenizer folder: tiktoken.model (256 byte ranks + merges learned from
    ``text``), tokenizer_config.json naming tokenization_kimi.TikTokenTokenizer (auto_map)
    with added_tokens_decoder for the first reserved ids, a chat template. Returns the ranks
    (bytes -> id)."""
    ranks = {bytes([b]): b for b in range(256)}
    data = text.encode()
    for _ in range(60):  # greedy pair merges: enough multi-byte tokens to exercise merging
        counts = {}
        for a, b in zip(data, data[1:]):
            counts[(a, b)] = counts.get((a, b), 0) + 1
        pair = max(counts, key=counts.get)
        tok = bytes(pair)
        if tok in ranks:
            break
        ranks[tok] = len(ranks)
        data = data.replace(tok, b"\x00")  # crude: only used to pick the next pair
    for word in ("中文", "模型", " the", "ing", "量化"):
        ranks.setdefault(word.encode(), len(ranks))
    path.mkdir()
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    added = {str(n): {"content": "[BOS]", "special": True}, str(n + 1): {"content": "[EOS]", "special": True},
             str(n + 2): {"content": "<|im_end|>", "special": True}}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": added,
        "chat_template": "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"}))
    (path / "tokenization_kimi.py").write_text("raise SystemExit('repository code must not run')\n")
    return ranks


# ---------------------------------------------------------------------------------------
# Kimi K2.5: the vision-language wrapper around Kimi K2


def vision_tensors(text_hidden: int, seed: int = 5) -> dict[str, torch.Tensor]:
    """The vision tower and projector under the release's names (the names transformers'
    kimi_k25 conversion mapping reads: ``encoder.blocks.<i>.wqkv/wo/norm0/norm1/mlp.fc0/fc1``,
    ``patch_embed.pos_emb.weight``, ``mm_projector.proj.0/2``): the tower in bfloat16, the
    projector in float32, so a cast would show."""
    g = torch.Generator().manual_seed(seed)
    h, inter, p = VISION["hidden_size"], VISION["intermediate_size"], VISION["patch_size"]

    def r(*shape, dtype=torch.bfloat16, base=0.0):
        return (torch.randn(*shape, generator=g) * 0.05 + base).to(dtype)

    out = {"vision_tower.patch_embed.proj.weight": r(h, 3, p, p), "vision_tower.patch_embed.proj.bias": r(h),
           "vision_tower.patch_embed.pos_emb.weight": r(VISION["pos_emb_height"], VISION["pos_emb_width"], h),
           "vision_tower.encoder.final_layernorm.weight": r(h, base=1.0),
           "vision_tower.encoder.final_layernorm.bias": r(h)}
    for i in range(VISION["num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            out.update({f"{b}{norm}.weight": r(h, base=1.0), f"{b}{norm}.bias": r(h)})
        for name, shape in (("wqkv", (3 * h, h)), ("wo", (h, h)), ("mlp.fc0", (inter, h)), ("mlp.fc1", (h, inter))):
            out.update({f"{b}{name}.weight": r(*shape), f"{b}{name}.bias": r(shape[0])})
    merged = 4 * h  # 2 x 2 merge kernel
    out.update({"mm_projector.pre_norm.weight": r(h, dtype=torch.float32, base=1.0),
                "mm_projector.pre_norm.bias": r(h, dtype=torch.float32),
                "mm_projector.proj.0.weight": r(merged, merged, dtype=torch.float32),
                "mm_projector.proj.0.bias": r(merged, dtype=torch.float32),
                "mm_projector.proj.2.weight": r(text_hidden, merged, dtype=torch.float32),
                "mm_projector.proj.2.bias": r(text_hidden, dtype=torch.float32)})
    return out


def make_k25(path, tokenizer, seed: int = 0):
    """A tiny Kimi K2.5 release: the tiny Kimi K2 (published config, auto_map) as the text
    model under ``language_model.``, the vision tower and projector beside it, and the
    wrapper's config.json (``KimiK25ForConditionalGeneration``, its auto_map, vision_config,
    text_config with ``model_type: kimi_k2``)."""
    from safetensors.torch import load_file, save_file

    k2 = make_published(path.parent / f"{path.name}-k2", tokenizer, "kimi_k2", seed)
    shutil.copytree(k2, path)
    text = json.loads((path / "config.json").read_text())
    state = {"language_model." + k: v for k, v in load_file(str(path / "model.safetensors")).items()}
    state.update(vision_tensors(text["hidden_size"], seed + 5))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "auto_map": K25_AUTO_MAP, "model_type": "kimi_k25",
        "text_config": text, "vision_config": VISION, "projection_hidden_size": VISION["hidden_size"],
        "media_placeholder_token_id": 300, "image_token_id": 300, "video_token_id": 301, "tie_word_embeddings": False,
        "dtype": "float32"}, indent=2))
    return path


# ---------------------------------------------------------------------------------------
# block-FP8 releases


def quantize_block_fp8(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [out, in] float32 as float8_e4m3fn codes and a float32 ``weight_scale_inv`` per
    ``block`` = (rows, columns) block (ragged last blocks allowed), ``scale = blockmax / 448``."""
    bo, bi = block
    rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            scale[r, c] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / scale[r, c]).to(torch.float8_e4m3fn)
    return q, scale


def to_block_fp8(src, dst, block=(16, 24), prefix: str = "", also: tuple[str, ...] = (), where: str = "top"):
    """``src`` copied to ``dst`` as a block-FP8 release: every decoder-layer projection under
    ``prefix`` (``{prefix}model.layers.*_proj.weight``; not routers, norms, embeddings, head) and the
    tensors named in ``also`` stored float8_e4m3fn with a float32 ``weight_scale_inv`` per block
    (:func:`quantize_block_fp8`); ``quantization_config`` at the top of config.json, or with
    ``where="text_config"`` in its ``text_config``. Returns the exact float values a reader must give back."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    exact = {}
    for k in list(state):
        v = state[k]
        layer = k.startswith(prefix + "model.layers.") and k.endswith("_proj.weight") and v.ndim == 2
        if not (layer or k in also):
            continue
        q, scale = quantize_block_fp8(v.float(), block)
        state[k], state[k + "_scale_inv"] = q, scale
        per_element = scale.repeat_interleave(block[0], 0)[: v.shape[0]].repeat_interleave(block[1], 1)
        exact[k] = q.float() * per_element[:, : v.shape[1]]
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (cfg if where == "top" else cfg["text_config"])["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return exact


def to_block_fp8_k25(src, dst, where: str = "top", block=(16, 24)):
    """A Kimi K2.5 folder ``src`` with the text model's projections and one vision weight
    (``vision_tower.encoder.blocks.0.mlp.fc0.weight``) stored block-FP8 (:func:`to_block_fp8`)."""
    return to_block_fp8(src, dst, block, prefix="language_model.",
                        also=("vision_tower.encoder.blocks.0.mlp.fc0.weight",), where=where)


def tiny_gguf(path: Path, tokenizer, seed: int = 0) -> Path:
    """A tiny Llama GGUF file (float32 tensors, a GPT-2 style BPE tokenizer: the test tokenizer's
    tokens and merges) that transformers' GGUF loader converts as it converts SmolLM2's."""
    import gguf
    import numpy as np

    cfg = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = cfg["model"]["vocab"]
    # the special token named as GPT-2's: transformers' GGUF converter adds an <|endoftext|> when none is there
    tokens = ["<|endoftext|>" if t == "<eos>" else t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in cfg["model"]["merges"]]
    hidden, inter, layers, heads, kv = 64, 128, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<eos>"])
    w.add_bos_token_id(vocab["<eos>"])
    w.add_add_bos_token(False)
    rng = np.random.default_rng(seed)

    def t(name, *shape, norm=False):
        w.add_tensor(name, (rng.uniform(0.5, 1.5, shape) if norm else rng.normal(0, 0.05, shape)).astype(np.float32))

    t("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", hidden, norm=True)
        t(f"blk.{i}.attn_q.weight", hidden, hidden)
        t(f"blk.{i}.attn_k.weight", kv * hidden // heads, hidden)
        t(f"blk.{i}.attn_v.weight", kv * hidden // heads, hidden)
        t(f"blk.{i}.attn_output.weight", hidden, hidden)
        t(f"blk.{i}.ffn_norm.weight", hidden, norm=True)
        t(f"blk.{i}.ffn_gate.weight", inter, hidden)
        t(f"blk.{i}.ffn_up.weight", inter, hidden)
        t(f"blk.{i}.ffn_down.weight", hidden, inter)
    t("output_norm.weight", hidden, norm=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
