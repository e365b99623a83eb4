"""Signing a published model directory with OpenSSF ``model-signing``, and verifying it wherever the model is used.

``published_model`` signs the whole directory it publishes (merged model, adapter, every GGUF, the
eval report, ``lineage.json``) when ``FT_SIGNING_KEY`` names a PEM private key, and writes the
signature to ``model.sig`` at the directory's root: a Sigstore bundle (DSSE envelope, in-toto
statement) listing every file with its sha256, which ``model_signing verify key DIR --signature
DIR/model.sig --public_key PUB`` checks without ft-assets. ``FT_SIGNING_CERT`` (the signing
certificate, then its chain, in one PEM file) signs with a certificate instead, for a team's PKI.

The lineage manifest already proves that files match their manifests, but whoever can write the
bucket can rewrite both; the signature needs the private key, which never goes to the store. Two
files are left out of the signature, and the signed statement itself says so (its ``ignore_paths``,
honoured by the library's verifier): ``model.sig`` and the store's ``manifest.json``, which is
written after the signature as the artifact's commit point.

The trade-off is one more pass over every byte: sha256 of each file, in parallel threads (the store's
manifest hashes them once more on upload), seconds per GB (docs/validation/planner-calibration.md). On a
failure the files are hashed a second time to name what changed.

model-signing and cryptography are imported only when a key or a signature is at hand (function-local
imports): without the ``signing`` extra ft-assets publishes unsigned, and importing model-signing pulls
in sigstore (~0.7 s here).

Verification takes a PEM public key (``FT_SIGNING_PUBLIC_KEY`` or ``ft-assets lineage --public-key``)
or, for a certificate-signed model, the PEM root(s) of trust; a failure is one line naming the
changed, missing or extra file, or the key that does not match.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ft_assets.manifests import MANIFEST
from ft_assets.storage import LocalStore, ObjectStore, check_key, join_key, sha256_file

SIGNATURE_FILE = "model.sig"
UNSIGNED_FILES = (SIGNATURE_FILE, MANIFEST)  # the signature itself; the store's manifest, written after it
KEY_ENV = "FT_SIGNING_KEY"  # path to the PEM private key (EC P-256/384/521: what model-signing signs with)
PASSWORD_ENV = "FT_SIGNING_KEY_PASSWORD"  # its password, when the PEM is encrypted
CERT_ENV = "FT_SIGNING_CERT"  # the signing certificate of that key, then its chain, in one PEM file
PUBLIC_KEY_ENV = "FT_SIGNING_PUBLIC_KEY"  # what verifies: a PEM public key, or the PEM root certificate(s)
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # the curves model-signing 1.1 accepts (Sigstore's specs)
UNSIGNED = {"signed": False, "method": None, "file": None, "sha256": None, "signer": None, "files": 0}


class SigningError(ValueError):
    """A key that cannot sign, or a model whose signature does not verify: one line saying what, where, what to do."""


@dataclass(frozen=True)
class SigningKey:
    """What ``published_model`` signs with: a private key, its password, and optionally its certificate chain."""

    private_key: Path
    password: str | None = None
    certificate: Path | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> SigningKey | None:
        """``FT_SIGNING_KEY`` (+ ``FT_SIGNING_KEY_PASSWORD``, ``FT_SIGNING_CERT``); None when no key is set: publish unsigned."""
        key = environ.get(KEY_ENV, "").strip()
        cert = environ.get(CERT_ENV, "").strip()
        if not key:
            if cert:
                raise SigningError(
                    f"{CERT_ENV} is set but {KEY_ENV} is not: set {KEY_ENV} to the PEM private key of that certificate"
                )
            return None
        return cls(Path(key).expanduser(), environ.get(PASSWORD_ENV) or None, Path(cert).expanduser() if cert else None)


def signing_key(environ: Mapping[str, str] = os.environ) -> SigningKey | None:
    """The key ``published_model`` signs with, loaded once to check it before any work; None: publish unsigned."""
    key = SigningKey.from_env(environ)
    if key is not None:
        _library()
        _check_private_key(key)
    return key


def _library():
    """model-signing, or one line saying how to install it."""
    try:
        import model_signing
    except ImportError as exc:
        raise SigningError(
            f"signing or verifying a model needs model-signing: pip install 'ft-assets[signing]' ({exc})"
        ) from exc
    return model_signing


def trusted_key_from_env(environ: Mapping[str, str] = os.environ) -> Path | None:
    """``FT_SIGNING_PUBLIC_KEY``: what verifies published models before they are used; None: not checked."""
    value = environ.get(PUBLIC_KEY_ENV, "").strip()
    return Path(value).expanduser() if value else None


def _read(path: Path, what: str, env: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SigningError(f"cannot read the {what} {path} ({env}): {exc.strerror}; point {env} at a PEM file") from exc


def _check_private_key(key: SigningKey) -> None:
    """Load the key as the library will, so that a wrong password or key type is one line here, not a trace there."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = _read(key.private_key, "private key", KEY_ENV)
    try:
        private = serialization.load_pem_private_key(data, key.password.encode() if key.password else None)
    except TypeError as exc:  # cryptography: a password for a plain key, or none for an encrypted one
        need = "is encrypted: set its password in" if key.password is None else "is not encrypted: unset"
        raise SigningError(f"the private key {key.private_key} ({KEY_ENV}) {need} {PASSWORD_ENV}") from exc
    except ValueError as exc:
        raise SigningError(
            f"cannot load the private key {key.private_key} ({KEY_ENV}): {exc}; check {PASSWORD_ENV} and that the file is a PEM private key"
        ) from exc
    if not isinstance(private, ec.EllipticCurvePrivateKey) or private.curve.name not in CURVES:
        kind = private.curve.name if isinstance(private, ec.EllipticCurvePrivateKey) else type(private).__name__
        raise SigningError(
            f"the private key {key.private_key} ({KEY_ENV}) is {kind}; model-signing signs with an EC key on {', '.join(CURVES)} "
            "(make one: openssl ecparam -name prime256v1 -genkey -noout -out key.pem)"
        )
    if key.certificate is not None and _certificates(key.certificate)[0].public_key() != private.public_key():
        raise SigningError(
            f"the first certificate in {key.certificate} ({CERT_ENV}) is not that of {key.private_key} ({KEY_ENV}): "
            "put the key's own certificate first, then its chain"
        )
    if key.certificate is not None and key.password:
        raise SigningError(
            f"{CERT_ENV} with an encrypted key: model-signing 1.1.1 loads a certificate's key without a password; "
            f"use an unencrypted key file readable by the publisher only, or sign with the key alone (unset {CERT_ENV})"
        )


def _certificates(certificate: Path) -> list:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(_read(certificate, "certificate chain", CERT_ENV))
    except ValueError as exc:
        raise SigningError(f"{certificate} ({CERT_ENV}) holds no PEM certificate: {exc}") from exc


def _split_chain(certificate: Path, work: Path) -> tuple[Path, list[Path]]:
    """``FT_SIGNING_CERT`` (signing certificate first, then its chain) as the library wants it: two files."""
    from cryptography.hazmat.primitives import serialization

    pem = [c.public_bytes(serialization.Encoding.PEM) for c in _certificates(certificate)]
    (work / "signing.pem").write_bytes(pem[0])
    (work / "chain.pem").write_bytes(b"".join(pem[1:]))
    return work / "signing.pem", [work / "chain.pem"] if len(pem) > 1 else []


def sign_directory(directory: Path, key: SigningKey) -> dict:
    """Sign every file under ``directory`` but ``UNSIGNED_FILES`` into ``directory/model.sig``; returns ``describe(...)``."""
    model_signing = _library()
    _check_private_key(key)
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=list(UNSIGNED_FILES))
    config = model_signing.signing.Config().set_hashing_config(hashing)
    with tempfile.TemporaryDirectory(prefix="ft-signing-") as work:
        if key.certificate is None:
            # model-signing 1.1.1 hands the password to cryptography as given, which wants bytes (its CLI's --password fails)
            config.use_elliptic_key_signer(
                private_key=key.private_key, password=key.password.encode() if key.password else None
            )
        else:
            leaf, chain = _split_chain(key.certificate, Path(work))
            config.use_certificate_signer(
                private_key=key.private_key, signing_certificate=leaf, certificate_chain=chain
            )
        config.sign(directory, directory / SIGNATURE_FILE)
    return describe(directory / SIGNATURE_FILE)


def _bundle(signature: Path) -> tuple[dict, dict]:
    """The signature file's bundle and the in-toto statement it carries (read, not verified)."""
    try:
        bundle = json.loads(signature.read_text())
        return bundle, json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SigningError(
            f"{signature} is not a model-signing signature ({type(exc).__name__}: {exc}); sign the model again"
        ) from exc


def describe(signature: Path) -> dict:
    """What a ``model.sig`` says about itself: key or certificate, who (key id or certificate subject), how many files."""
    bundle, statement = _bundle(signature)
    material = bundle.get("verificationMaterial", {})
    if "x509CertificateChain" in material:
        from cryptography import x509

        leaf = x509.load_der_x509_certificate(
            base64.b64decode(material["x509CertificateChain"]["certificates"][0]["rawBytes"])
        )
        method, signer = "certificate", leaf.subject.rfc4514_string()
    else:
        method, signer = (
            "key",
            "sha256:" + material.get("publicKey", {}).get("hint", "?"),
        )  # sha256 of the public key's PEM
    files = len(statement.get("predicate", {}).get("resources", []))
    return {
        "signed": True,
        "method": method,
        "file": SIGNATURE_FILE,
        "sha256": sha256_file(signature),
        "signer": signer,
        "files": files,
    }


def _differences(directory: Path, statement: dict) -> str:
    """Changed, missing and extra files of ``directory`` against the signed statement; empty when they match."""
    model_signing = _library()
    serialization = statement["predicate"]["serialization"]
    signed = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=serialization.get("ignore_paths", []))
    hashing.use_file_serialization(hashing_algorithm=serialization["hash_type"])
    actual = {r.identifier: r.digest.digest_hex for r in hashing.hash(directory).resource_descriptors()}
    found = [
        ("changed", sorted(name for name in signed.keys() & actual.keys() if signed[name] != actual[name])),
        ("missing", sorted(signed.keys() - actual.keys())),
        ("extra", sorted(actual.keys() - signed.keys())),
    ]
    return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in found if names)


def verify_directory(directory: Path, trusted: Path) -> dict:
    """Check ``directory/model.sig`` against ``trusted`` (a PEM public key, or PEM root certificates) and every file.

    Returns ``describe(...)`` of the signature; raises ``SigningError`` with one line naming the changed,
    missing or extra file, or saying that the key does not match.
    """
    model_signing = _library()
    signature = directory / SIGNATURE_FILE
    if not signature.is_file():
        raise SigningError(
            f"{directory} is unsigned (no {SIGNATURE_FILE}) but {trusted} is given to verify it: publish it with {KEY_ENV} set"
        )
    pem = _read(trusted, "public key", PUBLIC_KEY_ENV)
    config = model_signing.verifying.Config().set_hashing_config(
        model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE])
    )  # the rest of what was left out is in the signed statement, which the verifier adds
    try:
        if b"BEGIN CERTIFICATE" in pem:
            config.use_certificate_verifier(certificate_chain=[trusted])
        else:
            config.use_elliptic_key_verifier(public_key=trusted)
    except ValueError as exc:
        raise SigningError(
            f"{trusted} ({PUBLIC_KEY_ENV}) is neither a PEM public key nor PEM certificates: {exc}"
        ) from exc
    try:
        config.verify(directory, signature)
    except Exception as exc:  # noqa: BLE001 -- cryptography, OpenSSL and the library raise several types; all mean "refused"
        differences = _differences(directory, _bundle(signature)[1])
        said = " ".join(str(exc).split()).rstrip(". ") or "the signed statement was altered or signed by another key"
        reason = (
            f"files differ from the signed ones ({differences})" if differences else f"{type(exc).__name__}: {said}"
        )
        raise SigningError(f"{signature} does not verify with {trusted}: {reason}; do not use this model") from exc
    return describe(signature)


@contextmanager
def local_copy(store: ObjectStore, prefix: str) -> Iterator[Path]:
    """A published directory as files here: the store's own directory when it is local, else every object under
    ``prefix`` downloaded as stored (not checked against the manifest: the signature is the check, extra files included)."""
    if isinstance(store, LocalStore):
        yield store.root / check_key(prefix)
        return
    with tempfile.TemporaryDirectory(prefix="ft-verify-") as work:
        for key in store.list(prefix):
            store.get_file(key, Path(work) / check_key(key[len(prefix) :].lstrip("/")))
        yield Path(work)


def verify_published(store: ObjectStore, prefix: str, trusted: Path) -> dict:
    """Verify the published model at ``prefix`` of ``store`` with ``trusted``; see ``verify_directory``."""
    with local_copy(store, prefix) as directory:
        try:
            return verify_directory(directory, trusted)
        except SigningError as exc:
            raise SigningError(str(exc).replace(str(directory), store.uri(prefix))) from exc


def lineage_check(
    store: ObjectStore, prefix: str, public_key: str | None, environ: Mapping[str, str] = os.environ
) -> dict:
    """``ft-assets lineage``'s signature check of the published model at ``prefix``: with ``public_key`` (else
    ``FT_SIGNING_PUBLIC_KEY``) the signature must verify (``verified`` False otherwise, the status naming the file);
    without one it is not checked, and the status says whether the model carries a signature."""
    trusted = Path(public_key).expanduser() if public_key else trusted_key_from_env(environ)
    if trusted is None:
        carried = "signed" if store.exists(join_key(prefix, SIGNATURE_FILE)) else "unsigned"
        return {
            "status": f"{carried}; not checked (give --public-key or {PUBLIC_KEY_ENV})",
            "verified": True,
            "signature": None,
        }
    try:
        described = verify_published(store, prefix, trusted)
    except SigningError as exc:
        return {"status": f"REFUSED: {exc}", "verified": False, "signature": None}
    return {"status": f"ok, {summary(described)}, verified with {trusted}", "verified": True, "signature": described}


def recorded(store: ObjectStore, prefix: str, files: Mapping[str, dict]) -> dict:
    """The signature of an already published model, from its ``model.sig`` (``UNSIGNED`` when it has none)."""
    if SIGNATURE_FILE not in files:
        return dict(UNSIGNED)
    with tempfile.TemporaryDirectory(prefix="ft-signature-") as work:
        store.get_file(join_key(prefix, SIGNATURE_FILE), Path(work) / SIGNATURE_FILE)
        return describe(Path(work) / SIGNATURE_FILE)


def summary(signature: Mapping) -> str:
    """One line for metadata and logs: 'unsigned', or how and by whom, with the signature's sha256."""
    if not signature["signed"]:
        return "unsigned"
    who = f"{signature['method']} {signature['signer']}"
    return f"signed ({who}), {signature['files']} files, {signature['file']} sha256 {signature['sha256']}"
