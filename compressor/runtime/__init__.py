"""The bundled runtime behind ``kvq serve-smoke``: a compact llama-family decoder over an
artifact's packed weights, with a preallocated (optionally quantized) KV cache.

=====================  ==================================================================
module                 contents
=====================  ==================================================================
``generate``           :class:`Runtime` (``from_artifact``, ``logits``, ``generate``),
                       :class:`GenerationResult`
``model``              :class:`~compressor.runtime.model.Decoder`, ``load_decoder``
``linear``             weight-only Linear kernels (float, dequant, aten int4/int8, Triton)
                       and the backend rule
``weights``            :class:`~compressor.runtime.weights.QuantWeight`, artifact readers
``kv_cache``           preallocated KV caches: float, fp8, int8 (head/token), KIVI int4/int2
``triton_kernels``     W4A16 Triton GEMV/GEMM, launcher, layout, torch reference
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
