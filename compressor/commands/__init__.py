"""The kvq commands, one module each: an options object in, a result dict out.

* :mod:`.quantize` -- :func:`~.quantize.run_quantize` (``kvq quantize``)
* :mod:`.verify` -- :func:`~.verify.run_verify` (``kvq verify``)
* :mod:`.serve_smoke` -- :func:`~.serve_smoke.run_serve_smoke` (``kvq serve-smoke``)
* :mod:`.sign` -- :func:`~.sign.run_sign` (``kvq sign``)
* :mod:`.options` -- the options objects, validated in one place

Each entry point reads as a screen of named steps: plan (every refusal up front), load,
run, write. Rendering lives in :mod:`compressor.console`, gates in :mod:`compressor.gates`.
Submodules are imported on use: ``kvq sign`` and ``kvq verify --hashes-only`` never load torch.
"""
