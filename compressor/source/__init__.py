"""Where a model source is opened: the one home of reading a model kvq did not write.

* :mod:`.open` -- the entry point: :func:`~.open.open_lazy` (decoder layers on ``meta``, read a
  layer at a time) and :func:`~.open.load_model` (the whole float model), each from a
  :class:`~.resolve.ModelSource`;
* :mod:`.resolve` -- :func:`~.resolve.resolve_source` (a folder, a GGUF file or an alias, located
  and checked), configs, tokenizers, storage dtypes;
* :mod:`.lazy` -- :class:`~.lazy.LazyCheckpoint` and the model on ``meta`` (what :mod:`.open` streams);
* :mod:`.config_check`, :mod:`.layout_check` -- ``config.json`` against the checkpoint's tensors;
* :mod:`.gguf_cache` -- kvq's authenticated cache of converted GGUF files.

Inside the package imports run ``open`` -> ``lazy`` -> ``resolve`` -> the checks and the cache.
"""
