"""``kvq sign``: check the artifact against its manifest, then sign it (OpenSSF model_signing).

:func:`run_sign` reads as its steps: plan (an artifact folder, usable key material, a
readable manifest), check every digest (an artifact that does not match its manifest is
never signed), sign (``model.sig``, replaced atomically).
"""

from __future__ import annotations

from pathlib import Path

from .. import console as show
from ..errors import CheckFailed
from ..integrity import HASH_KEYS, check_artifact_folder, check_hashes, print_hashes, refuse_uncovered
from ..manifest import load_manifest
from ..signing import SignOptions, check_sign_options, sign_folder


def run_sign(folder: Path, opts: SignOptions, console=None) -> dict:
    """``kvq sign``: check the artifact against its manifest, then sign it with model_signing.

    Returns ``{"artifact", "signature" (path of model.sig), "method", "hashes"}``.

    Raises:
        InputError: not an artifact, bad key material.
        CheckFailed: the artifact does not match its manifest, or its manifest does not cover a
            model (:func:`~compressor.integrity.coverage_problem`): nothing is signed; or signing failed.
    """
    folder = check_artifact_folder(folder)  # a symlinked artifact path is resolved once, here
    check_sign_options(opts)
    manifest = load_manifest(folder)
    refuse_uncovered(folder, manifest, "refusing to sign it", listing_only=True)
    hashes = check_hashes(folder)
    if not hashes["ok"]:
        if console:
            print_hashes(console, hashes)
        diffs = sum(len(hashes[k]) for k in HASH_KEYS)
        raise CheckFailed(f"{folder} does not match its manifest ({diffs} difference(s)); refusing to sign it")
    refuse_uncovered(folder, manifest, "refusing to sign it")
    path = sign_folder(folder, opts)
    show.note(console, f"[green]signed[/] {folder} ({opts.method()}): {path}", highlight=False)
    return {"artifact": str(folder), "signature": str(path), "method": opts.method(), "hashes": hashes}
