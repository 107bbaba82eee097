"""The bundled runtime behind ``kvq serve-smoke``: a compact decoder for every row of the
architecture table over an artifact's packed weights, with a preallocated (optionally
quantized) KV cache.

=====================  ==================================================================
module                 contents
=====================  ==================================================================
``generate``           :class:`Runtime` (``from_artifact``, ``logits``, ``generate``),
                       :class:`GenerationResult`
``model``              :class:`~compressor.runtime.model.Decoder`, ``DecoderLayer``,
                       ``DecoderSpec``, the norm layouts, ``check_servable``
``loader``             ``load_decoder``: config + shards -> Decoder (modules by arch row)
``blocks``             RMSNorm (Llama / Gemma ``1 + w``), rotary embeddings and layouts,
                       gated MLPs, per-row traits
``attention``          GQA attention (q/k norms, biases, partial rotary, sliding windows)
``mla``                multi-head latent attention and its latent + RoPE-key cache
``moe``                routers (softmax top-k; sigmoid group-limited), MoE block, grouped
                       W4A16 experts
``linear``             weight-only Linear kernels (float, dequant, aten int4/int8, Triton)
                       and the backend rule
``kv_cache``           preallocated KV caches: float, fp8, int8 (head/token), KIVI int4/int2
``triton_kernels``     W4A16 Triton GEMV/GEMM and grouped MoE kernel, launchers, layout,
                       torch references
``engine``             :class:`~compressor.runtime.engine.Engine`: bounded queue, batching,
                       cancellation (``kvq serve``)
``server``             the OpenAI-compatible HTTP server, its pydantic request models,
                       ``run_server`` (``kvq serve``)
=====================  ==================================================================

Triton is optional and imported only when a Triton kernel is first used.

Example::

    from compressor.runtime import Runtime
    rt = Runtime.from_artifact("out/smollm2-w4", device="cpu", backend="auto", kv="artifact")
    res = rt.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)
    res.tokens, res.summary()["decode_tokens_per_s"]
"""

from .generate import GenerationResult, Runtime

__all__ = ["GenerationResult", "Runtime"]
