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
from .files import read_limited
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
        """``sigstore``, ``certificate`` or ``key``."""
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
        """Whether any key material was given (otherwise the signature is only noted, not checked)."""
        return bool(self.public_key or self.certificate_chain or self.identity or self.issuer)

    def conflict(self) -> Optional[str]:
        """Why this key material is ambiguous (more than one way given), or None."""
        if sum(bool(x) for x in (self.public_key, self.certificate_chain, self.identity or self.issuer)) > 1:
            return "choose one of --public-key, --certificate-chain, --identity/--issuer"
        return None

    def method(self) -> str:
        """``key``, ``certificate`` or ``sigstore``."""
        if self.public_key:
            return "key"
        return "certificate" if self.certificate_chain else "sigstore"


def _readable(path: Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {path} not found")
    if not path.is_file():
        raise InputError(f"{what} {path} is not a file (a PEM file is expected)")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror}") from None
    return path


#: the largest key or certificate file kvq reads (a CA bundle such as certifi's is about 300 KB)
MAX_PEM_BYTES = 16 << 20
_CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}  # what model_signing accepts


def _pem_is_encrypted(data: bytes) -> bool:
    return b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in data or b"Proc-Type: 4,ENCRYPTED" in data


def _check_curve(key, path: Path, what: str) -> None:
    if key.curve.name not in _CURVES:
        raise InputError(f"{what} {path} uses curve {key.curve.name}; model_signing supports "
                         f"{', '.join(_CURVES.values())} (e.g. `openssl ecparam -name prime256v1 -genkey`)")


def _check_pem(path: Path, kind: str, password: Optional[str] = None):
    """Parse a PEM file with ``cryptography`` so a wrong file is a usage error, not a crypto failure.

    ``kind`` is ``private``, ``public`` or ``cert``; returns the key, or the list of
    certificates. A password problem (encrypted key without ``password``, wrong password,
    a password for a key that is not encrypted) is told apart from a file that is not PEM.

    Raises:
        InputError: not PEM, not an elliptic-curve key on a curve model_signing supports,
            a password problem, not a regular file or above :data:`MAX_PEM_BYTES`.
    """
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = read_limited(path, {"private": "private key", "public": "public key", "cert": "certificate file"}[kind],
                        MAX_PEM_BYTES)
    encrypted = kind == "private" and _pem_is_encrypted(data)
    try:
        if kind == "private":
            key = serialization.load_pem_private_key(data, password.encode("utf-8") if password else None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise InputError(f"private key {path} is not an elliptic-curve key (model_signing signs with EC keys, "
                                 "e.g. `openssl ecparam -name prime256v1 -genkey -noout -out key.pem`)")
            _check_curve(key, path, "private key")
            return key
        if kind == "public":
            key = serialization.load_pem_public_key(data)
            if not isinstance(key, ec.EllipticCurvePublicKey):
                raise InputError(f"public key {path} is not an elliptic-curve key")
            _check_curve(key, path, "public key")
            return key
        return x509.load_pem_x509_certificates(data)
    except InputError:
        raise
    except TypeError:  # cryptography: password given for an unencrypted key, or missing for an encrypted one
        if password:
            raise InputError(f"private key {path} is not encrypted, but a password was given: drop --password "
                             "(and KVQ_SIGN_PASSWORD)") from None
        raise InputError(f"private key {path} is encrypted and no password was given (kvq sign --password, "
                         "kvq quantize --sign-password, or the KVQ_SIGN_PASSWORD environment variable)") from None
    except UnsupportedAlgorithm:
        raise InputError(f"{path}: unsupported key or encryption algorithm") from None
    except ValueError as e:
        if encrypted or (password and "password" in str(e).lower()):
            raise InputError(f"private key {path}: wrong password (cannot decrypt it)") from None
        label = {"private": "a PEM private key", "public": "a PEM public key", "cert": "PEM certificates"}[kind]
        raise InputError(f"{path} is not {label}") from None


def check_sign_options(opts: SignOptions) -> None:
    """Validate the signing inputs (files exist and parse) before any work is done.

    For certificate signing the certificate's public key must be the private key's, and
    the private key must be unencrypted (model_signing's certificate signer takes no
    password). ``kvq quantize --sign-key`` calls this before quantizing.

    Raises:
        InputError: no method, two methods, missing or unparseable key/certificate files,
            password problems, a signing certificate that does not belong to the key or
            that grants no signing usage (:func:`_check_signing_usage`), a signing or chain
            certificate that is not valid now (expired, or not valid yet: :func:`validity_problem`).
    """
    if opts.sigstore:
        if opts.private_key or opts.signing_certificate:
            raise InputError("choose either --private-key or --sigstore, not both")
        return
    if not opts.private_key:
        raise InputError("nothing to sign with: pass --private-key KEY.pem or --sigstore")
    key = _check_pem(_readable(opts.private_key, "private key"), "private", opts.password)
    if opts.signing_certificate:
        if opts.password:
            raise InputError("certificate signing needs an unencrypted private key: model_signing's certificate "
                             "signer takes no password (decrypt it, e.g. `openssl ec -in enc.pem -out key.pem`)")
        leaf = _check_pem(_readable(opts.signing_certificate, "signing certificate"), "cert")[0]
        if leaf.public_key() != key.public_key():
            raise InputError(f"signing certificate {opts.signing_certificate} does not match private key "
                             f"{opts.private_key} (the certificate is for another key)")
        _check_signing_usage(leaf, opts.signing_certificate)
        problem = validity_problem(leaf, f"signing certificate {opts.signing_certificate}")
        for c in opts.certificate_chain:
            for cert in _check_pem(_readable(c, "certificate"), "cert"):
                problem = problem or validity_problem(cert, f"certificate {_subject(cert)} in {c}")
        if problem is not None:
            raise InputError(f"{problem}: a {SIGNATURE_NAME} made with it would not verify; sign with a certificate "
                             "that is valid now")
    elif opts.certificate_chain:
        raise InputError("--certificate-chain needs --signing-certificate (the leaf certificate of the key)")


def _subject(cert) -> str:
    """A certificate's subject as RFC 4514 text (``CN=kvq CA``), or its serial number when empty."""
    text = cert.subject.rfc4514_string()
    return text or f"serial {cert.serial_number:x}"


def validity_problem(cert, what: str, now=None) -> Optional[str]:
    """Why ``cert`` is not valid at ``now`` (default: the current time, UTC) -- not valid yet, or
    expired, with the dates -- else ``None``; ``what`` names the certificate in the line."""
    from datetime import datetime, timezone

    now = now or datetime.now(timezone.utc)
    before, after = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now < before:
        return f"{what} is not valid yet (valid from {before:%Y-%m-%d %H:%M} UTC to {after:%Y-%m-%d %H:%M} UTC)"
    if now > after:
        return f"{what} expired on {after:%Y-%m-%d %H:%M} UTC (valid from {before:%Y-%m-%d %H:%M} UTC)"
    return None


def _bundle_chain_problem(sig: Path, anchors: Sequence[Path]) -> Optional[str]:
    """The first certificate that is not valid now among a certificate bundle's chain (the
    signing certificate first, then the others it carries) and the ``--certificate-chain``
    certificates that issued one of them, named; ``None`` when every one is valid (or the
    bundle carries no chain: model_signing then says what is wrong).

    model_signing checks the chain at the signing certificate's start of validity, not now,
    and the signing time of a key-signed bundle is not attested, so a certificate that has
    expired (or is not valid yet) cannot vouch for a signature: this is checked here."""
    import base64
    import json

    from cryptography import x509

    try:
        material = json.loads(sig.read_text(encoding="utf-8"))["verificationMaterial"]
        chain = [x509.load_der_x509_certificate(base64.b64decode(c["rawBytes"]))
                 for c in material["x509CertificateChain"]["certificates"]]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    for k, cert in enumerate(chain):
        what = (f"the signing certificate ({_subject(cert)})" if k == 0
                else f"certificate {k + 1} of {SIGNATURE_NAME}'s chain ({_subject(cert)})")
        problem = validity_problem(cert, what)
        if problem is not None:
            return problem
    issuers = {c.issuer for c in chain}
    for path in anchors:
        for cert in _check_pem(_readable(path, "certificate"), "cert"):
            if cert.subject in issuers:
                problem = validity_problem(cert, f"certificate {_subject(cert)} in {path}")
                if problem is not None:
                    return problem
    return None


def _check_signing_usage(cert, path: Path) -> None:
    """Refuse a signing certificate that model_signing's certificate verifier never accepts:
    one whose KeyUsage lacks ``digitalSignature`` (or that has none) and whose
    ExtendedKeyUsage lacks ``codeSigning`` (or that has none) -- a CA certificate with only
    ``keyCertSign``, say. The rule is the verifier's own, so what is refused here is exactly
    what ``kvq verify --certificate-chain`` (and the stock ``model_signing verify``) would fail.

    Raises:
        InputError: neither usage is granted, or the certificate's extensions cannot be parsed.
    """
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    def granted(kind, test) -> bool:
        try:
            return test(cert.extensions.get_extension_for_class(kind).value)
        except x509.ExtensionNotFound:
            return False
        except ValueError as e:  # a duplicate or malformed extension
            raise InputError(f"signing certificate {path}: cannot read its extensions ({e})") from None

    if granted(x509.KeyUsage, lambda u: u.digital_signature) or \
            granted(x509.ExtendedKeyUsage, lambda u: ExtendedKeyUsageOID.CODE_SIGNING in u):
        return
    raise InputError(f"signing certificate {path} is not for signing: it grants neither the key usage digitalSignature "
                     "nor the extended key usage codeSigning, so no verifier (model_signing) would accept a model.sig "
                     "made with it; use a leaf certificate issued for code signing")


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
    try:  # constructing a signer can fail too: Sigstore fetches its trust root (TUF) over the network
        if opts.sigstore:
            cfg.use_sigstore_signer(use_staging=opts.sigstore_staging, identity_token=opts.identity_token)
        elif opts.signing_certificate:
            # model_signing cannot load an empty chain; a leaf issued directly by the verifier's
            # root (or a self-signed one) legitimately has none: the leaf itself stands in for
            # it (an extra copy of the leaf among the untrusted certificates changes nothing)
            chain = list(opts.certificate_chain) or [opts.signing_certificate]
            cfg.use_certificate_signer(private_key=opts.private_key, signing_certificate=opts.signing_certificate,
                                       certificate_chain=chain)
        else:
            cfg.use_elliptic_key_signer(private_key=opts.private_key,
                                        password=opts.password.encode("utf-8") if opts.password else None)
    except Exception as e:
        raise CheckFailed(f"signing failed ({opts.method()}): {_library_error(e)}") from None
    with tempfile.TemporaryDirectory(prefix="kvq-sign-") as scratch:
        bundle = Path(scratch) / SIGNATURE_NAME
        try:
            cfg.sign(folder, bundle)
        except Exception as e:  # network, OIDC, key errors from the library: one line
            raise CheckFailed(f"signing failed ({opts.method()}): {_library_error(e)}") from None
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


def _offline(e: BaseException) -> bool:
    """Sigstore's trust root (TUF) or its services could not be reached."""
    name, mod = type(e).__name__, type(e).__module__ or ""
    return name == "TUFError" or (mod.startswith(("requests", "urllib3")) and ("Connection" in name or "Timeout" in name))


def _library_error(e: BaseException) -> str:
    """One line for an exception raised inside model_signing or sigstore."""
    if _offline(e):
        return f"cannot reach Sigstore (offline?): {_first_line(e)}"
    return f"{type(e).__name__}: {_first_line(e)}"


# what each kind of bundle was made with, and the verify option that checks it
_MADE_WITH = {"key": "a private key (no certificate)", "certificate": "a signing certificate",
              "sigstore": "Sigstore (keyless)"}
_CHECK_WITH = {"key": "--public-key", "certificate": "--certificate-chain", "sigstore": "--identity/--issuer"}


def _bundle_kind(sig: Path) -> tuple[Optional[str], Optional[str]]:
    """``(kind, None)`` with kind ``key``/``certificate``/``sigstore`` from the bundle's
    verification material, or ``(None, error)`` when ``sig`` is not a Sigstore bundle."""
    import json

    invalid = f"{SIGNATURE_NAME} is not a valid Sigstore bundle"
    try:
        data = json.loads(sig.read_text(encoding="utf-8"))
    except OSError as e:
        return None, f"cannot read {SIGNATURE_NAME}: {e.strerror}"
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, f"{invalid} (not JSON)"
    material = data.get("verificationMaterial") if isinstance(data, dict) else None
    if not isinstance(material, dict):
        return None, f"{invalid} (no verificationMaterial)"
    if not isinstance(data.get("dsseEnvelope"), dict):
        return None, f"{invalid} (no dsseEnvelope)"
    if "publicKey" in material:
        return "key", None
    if "x509CertificateChain" in material:
        return "certificate", None
    if "certificate" in material:
        return "sigstore", None
    return None, f"{invalid} (no key or certificate in its verificationMaterial)"


def _difference(line: str) -> str:
    """model_signing's difference lines, shortened (digest reprs dropped)."""
    import re

    for pattern, label in ((r"Extra files found in model '.*?': (.*)", "added since signing"),
                           (r"Missing files in model '.*?': (.*)", "removed since signing"),
                           (r"Hash mismatch for '(.*?)': Expected '.*", "changed since signing")):
        m = re.fullmatch(pattern, line, re.S)
        if m:
            return f"{label}: {m.group(1)}"
    return line.splitlines()[0][:400] if line.strip() else line


def _verify_error(e: BaseException, method: str) -> str:
    """One clear line for a failed ``model_signing`` verification (not a file difference)."""
    import binascii
    import json

    from cryptography.exceptions import InvalidSignature
    from pydantic import ValidationError

    msg = _first_line(e)
    if _offline(e):
        return f"cannot reach Sigstore (offline?): {msg}"
    if method == "key" and (isinstance(e, InvalidSignature) or msg.startswith("Key mismatch")):
        return "signature does not verify with this public key" + (
            f" ({SIGNATURE_NAME} names another key)" if msg.startswith("Key mismatch") else "")
    if isinstance(e, InvalidSignature):
        return f"signature does not verify ({method}): the signature does not match the signed statement"
    if type(e).__name__ == "X509StoreContextError":
        return f"signature does not verify (certificate): the signing certificate does not chain to --certificate-chain ({msg})"
    if isinstance(e, (binascii.Error, json.JSONDecodeError, ValidationError, KeyError, AttributeError, TypeError,
                      IndexError, UnicodeDecodeError)):
        return f"{SIGNATURE_NAME} is not a valid Sigstore bundle (model_signing cannot read it)"
    if isinstance(e, ValueError):  # model_signing's own checks: media type, payload type, certificate usage
        return f"signature does not verify ({method}): {msg}"
    return f"signature does not verify ({method}): {type(e).__name__}: {msg}"


def verify_signature(folder: Path, keys: VerifyKeys) -> dict:
    """Check ``folder/model.sig`` with ``model_signing`` against the given key material.

    Returns ``{"checked": True, "ok": bool, "method": ..., "error": str|None,
    "differences": [...], "signed_files": {...}}``. ``differences`` names the files that
    differ when the signature is valid but the folder changed, one short line each:
    ``added since signing: a, b``, ``removed since signing: ...``, ``changed since
    signing: x``. ``error`` is one line: the signature is missing, a symlink, not a
    Sigstore bundle, made with another kind of key material (key vs certificate vs
    Sigstore), does not verify with the given key or chain, carries a certificate that is not
    valid now (expired or not valid yet, the certificate named), or Sigstore cannot be reached.
    ``signed_files`` (when ``ok``): ``{file name: SHA-256}`` from the statement of the very
    bundle that verified (it is read once and checked from a private copy), so a caller
    can bind the bytes it reads afterwards (the manifest) to what was signed.

    Raises:
        InputError: unreadable or unparseable key/certificate files; identity without issuer.
    """
    folder = Path(folder)
    sig = folder / SIGNATURE_NAME
    method = keys.method()
    if keys.public_key:
        _check_pem(_readable(keys.public_key, "public key"), "public")
    elif keys.certificate_chain:
        for c in keys.certificate_chain:
            _check_pem(_readable(c, "certificate"), "cert")
    elif not (keys.identity and keys.issuer):
        raise InputError("Sigstore verification needs both --identity and --issuer")
    result = {"checked": True, "ok": False, "method": method, "error": None, "differences": [], "signed_files": {}}
    if sig.is_symlink():
        result["error"] = f"{SIGNATURE_NAME} is a symlink (refused)"
        return result
    if sig.exists() and not sig.is_file():
        result["error"] = f"{SIGNATURE_NAME} is not a regular file (refused)"
        return result
    if not sig.exists():
        result["error"] = f"no signature: {SIGNATURE_NAME} is missing (sign with `kvq sign`)"
        return result
    try:
        data = sig.read_bytes()
    except OSError as e:
        result["error"] = f"cannot read {SIGNATURE_NAME}: {e.strerror}"
        return result
    with tempfile.TemporaryDirectory(prefix="kvq-verify-") as scratch:
        copy = Path(scratch) / SIGNATURE_NAME
        copy.write_bytes(data)
        _run_verifier(folder, copy, keys, result)
    if result["ok"]:
        result["signed_files"] = signed_files(data)
    return result


def _run_verifier(folder: Path, sig: Path, keys: VerifyKeys, result: dict) -> None:
    """:func:`verify_signature`'s model_signing step on the bundle ``sig``; fills ``result``."""
    import model_signing

    method = result["method"]
    kind, error = _bundle_kind(sig)
    if error is None and kind != method and not (method == "sigstore" and kind == "certificate"):
        error = (f"{SIGNATURE_NAME} was made with {_MADE_WITH[kind]}, not the kind of key material given "
                 f"(key vs certificate vs Sigstore): check it with {_CHECK_WITH[kind]}, not {_CHECK_WITH[method]}")
    if error is None and method == "certificate":
        problem = _bundle_chain_problem(sig, keys.certificate_chain)
        error = None if problem is None else f"signature does not verify (certificate): {problem}"
    if error is not None:
        result["error"] = error
        return
    cfg = model_signing.verifying.Config()
    try:  # the Sigstore verifier fetches its trust root (TUF) when it is made: network
        if method == "key":
            cfg.use_elliptic_key_verifier(public_key=Path(keys.public_key))
        elif method == "certificate":
            cfg.use_certificate_verifier(certificate_chain=[Path(c) for c in keys.certificate_chain])
        else:
            cfg.use_sigstore_verifier(identity=keys.identity, oidc_issuer=keys.issuer,
                                      use_staging=keys.sigstore_staging)
    except Exception as e:
        result["error"] = (f"cannot reach Sigstore (offline?): {_first_line(e)}" if _offline(e)
                           else f"cannot set up the {method} verifier: {_library_error(e)}")
        return
    try:
        cfg.verify(folder, sig)
    except Exception as e:  # the library raises ValueError and friends; all mean "not verified"
        msg = str(e)
        if isinstance(e, ValueError) and msg.startswith("Signature mismatch:"):
            import ast

            try:
                diffs = [str(x) for x in ast.literal_eval(msg.split(":", 1)[1].strip())]
            except (ValueError, SyntaxError, RecursionError):
                diffs = [msg]
            result["differences"] = [_difference(d) for d in diffs]
            result["error"] = "signature is valid but the files differ from what was signed"
        else:
            result["error"] = _verify_error(e, method)
        return
    result["ok"] = True


def signed_files(bundle: bytes) -> dict[str, str]:
    """``{file name: SHA-256 hex}`` listed by a model_signing bundle's in-toto statement
    (``predicate.resources``); empty when the bundle has no such list. Trust it only for a
    bundle that verified."""
    import base64
    import json

    try:
        statement = json.loads(base64.b64decode(json.loads(bundle)["dsseEnvelope"]["payload"]))
        resources = statement["predicate"]["resources"]
        return {r["name"]: r["digest"] for r in resources if r.get("algorithm") == "sha256"}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}
