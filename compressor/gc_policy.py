"""When Python's cyclic garbage collector runs in a kvq process (standard library only).

A full collection walks every live object: after torch, transformers and a model's modules
are imported that is about 10^6 objects and 0.1 s a walk. Python starts one whenever the
objects that survived earlier collections have grown by a quarter, so importing the
libraries and building a model set off a full walk after every few hundred thousand new
objects (0.37 s in an RTN run on SmolLM2 that takes 5 s; another 0.11 s in a full
collection after the layer loop). Objects that live until the process ends are frozen
(:func:`gc.freeze`) instead: collections no longer look at them, and they are unfrozen
just before the interpreter exits. Tensors are freed by their reference count, not by the
collector, so memory is returned as before.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def settled_gc():
    """No automatic collection inside the block (library imports: they make objects that live
    as long as the process, and little garbage); what is alive at its end is frozen."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.freeze()


@contextmanager
def frozen_gc():
    """Within the block, the objects alive on entry are left out of garbage collection
    (:func:`gc.freeze`): the collection :func:`compressor.source.lazy.to_meta` runs before each
    heap trim then only looks at what the layer loop made (on SmolLM2 0.29 s a call otherwise,
    8.5 of an RTN run's 9.4 s of quantization). On exit the loop's own garbage is collected
    (a short walk: the rest is frozen), then the objects are unfrozen -- unless something was
    frozen before the block (the CLI's :func:`settled_gc`): its owner unfreezes them
    (:func:`release_frozen`)."""
    outer = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        if not outer:
            gc.unfreeze()


def release_frozen() -> None:
    """Unfreeze everything before the interpreter exits: its last collection then frees the
    frozen objects too (extension modules such as Triton's report objects left alive at exit
    as leaks)."""
    gc.unfreeze()
