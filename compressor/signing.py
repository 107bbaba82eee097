"""Signing and signature verification of kvq artifacts through OpenSSF ``model_signing``.

kvq does no cryptography of its own: it configures the ``model_signing`` library
(https://github.com/sigstore/model-transparency, v1.x), which hashes every file of the
artifact folder (SHA-256 per file), wraps the list in an in-toto statement and signs it
as a Sigstore bundle written to ``OUT/model.sig``. The signature itself is excluded from
what is signed (recorded in the bundle's ``ignore_paths``), so the stock CLI verifies a
kvq artifact unchanged::

    model_signing verify key --signature OUT/model.sig --public_key pub.pem OUT

Because the manifest (``kvq-manifest.json``, with per-tensor digests) is one of the
signed files, a valid signature makes the manifest trustworthy, and the manifest's
per-tensor digests then name exactly which tensor changed.

Three ways to sign, matching model_signing's: an elliptic-curve private key (PEM), a
private key with its signing certificate and chain, or Sigstore keyless (needs network
and an OIDC identity). Verification mirrors them: ``public_key``, ``certificate_chain``,
or ``identity`` + ``issuer``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .errors import CheckFailed, InputError
from .manifest import SIGNATURE_NAME


@dataclass
class SignOptions:
    """How to sign: exactly one of ``private_key`` (optionally with ``signing_certificate``
    and ``certificate_chain``) or ``sigstore``."""

    private_key: Optional[Path] = None
    password: Optional[str] = None
    signing_certificate: Optional[Path] = None
    certificate_chain: Sequence[Path] = ()
    sigstore: bool = False
    sigstore_staging: bool = False
    identity_token: Optional[str] = None

    def method(self) -> str:
        if self.sigstore:
            return "sigstore"
        return "certificate" if self.signing_certificate else "key"


@dataclass
class VerifyKeys:
    """How to check a signature: ``public_key``, ``certificate_chain`` or ``identity`` + ``issuer``."""

    public_key: Optional[Path] = None
    certificate_chain: Sequence[Path] = field(default_factory=tuple)
    identity: Optional[str] = None
    issuer: Optional[str] = None
    sigstore_staging: bool = False

    def given(self) -> bool:
        return bool(self.public_key or self.certificate_chain or self.identity or self.issuer)

    def method(self) -> str:
        if self.public_key:
            return "key"
        return "certificate" if self.certificate_chain else "sigstore"


def _readable(path: Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path} not found")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror}") from None
    return path


def _check_pem(path: Path, kind: str, password: Optional[str] = None) -> None:
    """Parse a PEM file with ``cryptography`` so a wrong file is a usage error, not a crypto failure."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = path.read_bytes()
    try:
        if kind == "private":
            key = serialization.load_pem_private_key(data, password.encode() if password else None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise InputError(f"private key {path} is not an elliptic-curve key (model_signing signs with EC keys, "
                                 "e.g. `openssl ecparam -name prime256v1 -genkey -noout -out key.pem`)")
        elif kind == "public":
            key = serialization.load_pem_public_key(data)
            if not isinstance(key, ec.EllipticCurvePublicKey):
                raise InputError(f"public key {path} is not an elliptic-curve key")
        else:
            x509.load_pem_x509_certificates(data)
    except InputError:
        raise
    except TypeError as e:  # password given for an unencrypted key or missing for an encrypted one
        raise InputError(f"private key {path}: {e}") from None
    except ValueError:
        label = {"private": "a PEM private key", "public": "a PEM public key", "cert": "PEM certificates"}[kind]
        raise InputError(f"{path} is not {label}") from None


def check_sign_options(opts: SignOptions) -> None:
    """Validate the signing inputs (files exist and parse) before any work is done.

    Raises:
        InputError: no method, two methods, missing or unparseable key/certificate files.
    """
    if opts.sigstore:
        if opts.private_key or opts.signing_certificate:
            raise InputError("choose either --private-key or --sigstore, not both")
        return
    if not opts.private_key:
        raise InputError("nothing to sign with: pass --private-key KEY.pem or --sigstore")
    _check_pem(_readable(opts.private_key, "private key"), "private", opts.password)
    if opts.signing_certificate:
        _check_pem(_readable(opts.signing_certificate, "signing certificate"), "cert")
        for c in opts.certificate_chain:
            _check_pem(_readable(c, "certificate"), "cert")
    elif opts.certificate_chain:
        raise InputError("--certificate-chain needs --signing-certificate (the leaf certificate of the key)")


def _hashing_config():
    from model_signing import hashing

    # the signature is not part of what it signs; stored in the bundle, so any verifier skips it too
    return hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME], ignore_git_paths=False)


def sign_folder(folder: Path, opts: SignOptions) -> Path:
    """Sign every file of ``folder`` into ``folder/model.sig`` (Sigstore bundle, in-toto statement).

    The bundle is written to a temporary file in ``folder`` and renamed into place, so an
    interrupted signing never leaves a truncated signature.

    Raises:
        InputError: missing or unparseable key/certificate files, no signing method.
        CheckFailed: the signer failed (for Sigstore: no network or no identity).
    """
    import model_signing

    folder = Path(folder)
    check_sign_options(opts)
    cfg = model_signing.signing.Config().set_hashing_config(_hashing_config())
    if opts.sigstore:
        cfg.use_sigstore_signer(use_staging=opts.sigstore_staging, identity_token=opts.identity_token)
    elif opts.signing_certificate:
        cfg.use_certificate_signer(private_key=opts.private_key, signing_certificate=opts.signing_certificate,
                                   certificate_chain=list(opts.certificate_chain))
    else:
        cfg.use_elliptic_key_signer(private_key=opts.private_key, password=opts.password)
    with tempfile.TemporaryDirectory(prefix="kvq-sign-") as scratch:
        bundle = Path(scratch) / SIGNATURE_NAME
        try:
            cfg.sign(folder, bundle)
        except Exception as e:  # network, OIDC, key errors from the library: one line
            raise CheckFailed(f"signing failed ({opts.method()}): {type(e).__name__}: {_first_line(e)}") from None
        data = bundle.read_bytes()
    # into place atomically: an interruption never leaves a truncated model.sig
    fd, tmp = tempfile.mkstemp(prefix=f".{SIGNATURE_NAME}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / SIGNATURE_NAME)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return folder / SIGNATURE_NAME


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:400]


def verify_signature(folder: Path, keys: VerifyKeys) -> dict:
    """Check ``folder/model.sig`` with ``model_signing`` against the given key material.

    Returns ``{"checked": True, "ok": bool, "method": ..., "error": str|None,
    "differences": [...]}``; ``differences`` lists model_signing's named file differences
    (extra, missing files; hash mismatches by file) when the signature is valid but the
    folder changed.

    Raises:
        InputError: unreadable or unparseable key/certificate files; identity without issuer.
    """
    import model_signing

    folder = Path(folder)
    sig = folder / SIGNATURE_NAME
    cfg = model_signing.verifying.Config()
    if keys.public_key:
        pub = _readable(keys.public_key, "public key")
        _check_pem(pub, "public")
        cfg.use_elliptic_key_verifier(public_key=pub)
    elif keys.certificate_chain:
        chain = [_readable(c, "certificate") for c in keys.certificate_chain]
        for c in chain:
            _check_pem(c, "cert")
        cfg.use_certificate_verifier(certificate_chain=chain)
    else:
        if not (keys.identity and keys.issuer):
            raise InputError("Sigstore verification needs both --identity and --issuer")
        cfg.use_sigstore_verifier(identity=keys.identity, oidc_issuer=keys.issuer, use_staging=keys.sigstore_staging)
    result = {"checked": True, "ok": False, "method": keys.method(), "error": None, "differences": []}
    if sig.is_symlink() or not sig.is_file():
        result["error"] = f"no signature: {SIGNATURE_NAME} is missing (sign with `kvq sign`)"
        return result
    try:
        cfg.verify(folder, sig)
    except Exception as e:  # the library raises ValueError and friends; all mean "not verified"
        msg = str(e)
        if msg.startswith("Signature mismatch:"):
            import ast

            try:
                result["differences"] = [str(x) for x in ast.literal_eval(msg.split(":", 1)[1].strip())]
            except (ValueError, SyntaxError):
                result["differences"] = [msg]
            result["error"] = "signature is valid but the files differ from what was signed"
        else:
            result["error"] = f"signature does not verify ({keys.method()}): {_first_line(e)}"
        return result
    result["ok"] = True
    return result
