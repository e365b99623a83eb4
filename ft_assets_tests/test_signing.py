"""Signed delivery: a published directory signed with OpenSSF model-signing, on real files with real keys.

The directory is what ``published_model`` publishes (merged model, LoRA adapter, GGUF, eval report,
``lineage.json``) for two model families, signed with EC P-256 keys made here with ``cryptography``
(and with a certificate from a CA made here). Every tampering is refused by ``verify_directory``
naming the file, and the library's own CLI (``model_signing verify``, a subprocess) refuses it too;
the untampered directory passes both, with the store's ``manifest.json`` beside the signature.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from ft_assets.delivery import signing
from ft_assets.delivery.gguf_export import export_gguf
from ft_assets.manifests import MANIFEST, publish_dir
from ft_assets_tests.families import build_family
from ft_assets_tests.tiny import build_tiny_model

CLI = str(Path(sys.executable).parent / "model_signing")  # the library's own command line, installed beside python
FAMILIES = ("llama", "qwen2.5", "gemma2")  # GGUF export writes the plain llama architecture: the others ship none


@dataclass(frozen=True)
class Keys:
    private: Path
    public: Path
    other_public: Path  # a key pair that did not sign
    encrypted: Path  # the private key again, under PASSWORD
    ca: Path  # a root certificate, and the signing certificate + that root, for the PKI path
    chain: Path
    other_ca: Path


PASSWORD = "correct horse"


def _pem_private(key, password: str | None = None) -> bytes:
    crypt = serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, crypt)


def _pem_public(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _certificate(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=not ca,
                key_cert_sign=ca,
                crl_sign=ca,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(issuer_key, hashes.SHA256())
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    root = tmp_path_factory.mktemp("keys")
    key, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("ft-assets test CA", ca_key, "ft-assets test CA", ca_key, ca=True)
    other_ca = _certificate("another CA", other_ca_key, "another CA", other_ca_key, ca=True)
    leaf = _certificate("publisher@ft-assets.test", key, "ft-assets test CA", ca_key, ca=False)
    pem = serialization.Encoding.PEM
    files = {
        "private": _pem_private(key), "public": _pem_public(key), "other_public": _pem_public(other),
        "encrypted": _pem_private(key, PASSWORD), "ca": ca.public_bytes(pem), "chain": leaf.public_bytes(pem) + ca.public_bytes(pem),
        "other_ca": other_ca.public_bytes(pem),
    }  # fmt: skip
    for name, data in files.items():
        (root / f"{name}.pem").write_bytes(data)
    return Keys(**{name: root / f"{name}.pem" for name in files})


# llama's published directory holds a real GGUF (llama.cpp's converter process): its cases are integration
@pytest.fixture(
    scope="module", params=[pytest.param(f, marks=[pytest.mark.integration] if f == "llama" else []) for f in FAMILIES]
)
def published(request, tmp_path_factory) -> Path:
    """A published directory as ``published_model`` lays it out, for one model family (not yet signed)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(f"published-{request.param}")
    if request.param == "llama":
        build_tiny_model(root / "merged")
    else:
        build_family(request.param, root / "merged")
    base = AutoModelForCausalLM.from_pretrained(root / "merged")
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(
        root / "adapter"
    )
    if request.param == "llama":
        (root / "gguf").mkdir()
        export_gguf(root / "merged", root / "gguf" / "tiny-f16.gguf", "f16", name="tiny")
        (root / "gguf" / "Modelfile").write_text("FROM ./tiny-f16.gguf\n")
    (root / "eval").mkdir()
    (root / "eval" / "report.json").write_text(
        json.dumps({"stats": {"metric_name": "exact_match", "finetuned_metric": 0.75}})
    )
    (root / "lineage.json").write_text(json.dumps({"partition": "acks@v1", "family": request.param}))
    return root


@pytest.fixture(scope="module")
def signed(published, keys, tmp_path_factory) -> Path:
    """``published`` signed with the key, then the store's manifest written beside it (after the signature, as publishing does)."""
    out = tmp_path_factory.mktemp("signed") / "model"
    shutil.copytree(published, out)
    signing.sign_directory(out, signing.SigningKey(keys.private))
    (out / MANIFEST).write_text('{"written": "after the signature"}')
    return out


def cli_verify(directory: Path, public_key: Path, method: str = "key") -> subprocess.CompletedProcess:
    trust = ["--public_key", str(public_key)] if method == "key" else ["--certificate_chain", str(public_key)]
    command = [CLI, "verify", method, str(directory), "--signature", str(directory / "model.sig"),
               "--ignore-paths", str(directory / "model.sig"), *trust]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def signed_files(directory: Path) -> list[str]:
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name not in signing.UNSIGNED_FILES
    )


def test_the_signature_covers_every_published_file(signed, keys):
    described = signing.verify_directory(signed, keys.public)
    files = signed_files(signed)
    expected = {
        "merged/model.safetensors",
        "merged/tokenizer.json",
        "adapter/adapter_model.safetensors",
        "eval/report.json",
        "lineage.json",
    }
    assert expected <= set(files)
    assert described["files"] == len(files) and described["method"] == "key" and described["signed"]
    public = serialization.load_pem_public_key(keys.public.read_bytes())
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert described["signer"] == "sha256:" + hashlib.sha256(pem).hexdigest()  # the key id model-signing records


def test_a_flipped_byte_in_any_file_is_named(signed, keys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(signed, model)
    for rel in signed_files(model):
        original = (model / rel).read_bytes()
        flip_byte(model / rel)
        try:
            with pytest.raises(signing.SigningError) as refused:
                signing.verify_directory(model, keys.public)
            assert f"(changed: {rel})" in str(refused.value) and "\n" not in str(refused.value)
        finally:
            (model / rel).write_bytes(original)
    signing.verify_directory(model, keys.public)  # restored: verifies again


def _remove(model: Path) -> None:
    (model / "merged" / "tokenizer.json").unlink()


def _add(model: Path) -> None:
    (model / "merged" / "extra.safetensors").write_bytes(b"not signed")


def _flip_weights(model: Path) -> None:
    flip_byte(model / "merged" / "model.safetensors")


def _flip_lineage(model: Path) -> None:
    flip_byte(model / "lineage.json")


def _flip_adapter(model: Path) -> None:
    flip_byte(model / "adapter" / "adapter_model.safetensors")


def _resign_with_other_payload(model: Path) -> None:
    """An attacker who rewrites lineage.json and the signature's statement, without the private key."""
    (model / "lineage.json").write_text('{"partition": "forged"}')
    bundle = json.loads((model / "model.sig").read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    for resource in statement["predicate"]["resources"]:
        if resource["name"] == "lineage.json":
            resource["digest"] = hashlib.sha256((model / "lineage.json").read_bytes()).hexdigest()
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (model / "model.sig").write_text(json.dumps(bundle))


TAMPERING = [  # (case, change to the signed directory, which public key verifies, what our refusal says; None: accepted)
    ("untampered, the store's manifest.json beside", lambda model: None, "public", None),
    ("flipped byte in the weights", _flip_weights, "public", "(changed: merged/model.safetensors)"),
    ("flipped byte in the adapter", _flip_adapter, "public", "(changed: adapter/adapter_model.safetensors)"),
    ("flipped byte in lineage.json", _flip_lineage, "public", "(changed: lineage.json)"),
    ("removed file", _remove, "public", "(missing: merged/tokenizer.json)"),
    ("added file", _add, "public", "(extra: merged/extra.safetensors)"),
    ("wrong key", lambda model: None, "other_public", "Key mismatch"),
    ("statement rewritten without the key", _resign_with_other_payload, "public", "InvalidSignature"),
]


@pytest.mark.integration
@pytest.mark.parametrize("case, tamper, public, refusal", TAMPERING, ids=[case[0] for case in TAMPERING])
def test_tampering_is_refused_by_ours_and_by_model_signing_cli(case, tamper, public, refusal, signed, keys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(signed, model)
    tamper(model)
    trusted = getattr(keys, public)
    result = cli_verify(model, trusted)
    if refusal is None:
        assert signing.verify_directory(model, trusted)["signed"]
        assert result.returncode == 0 and "Verification succeeded" in result.stdout, result.stderr
        return
    with pytest.raises(signing.SigningError) as refused:
        signing.verify_directory(model, trusted)
    message = str(refused.value)
    assert refusal in message and message.endswith("do not use this model") and "\n" not in message, message
    assert result.returncode == 1 and "Verification failed" in result.stderr, (case, result.stdout, result.stderr)


@pytest.mark.integration
def test_a_certificate_chain_signs_and_its_root_verifies(published, keys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(published, model)
    described = signing.sign_directory(model, signing.SigningKey(keys.private, certificate=keys.chain))
    assert described["method"] == "certificate" and described["signer"] == "CN=publisher@ft-assets.test"
    assert signing.verify_directory(model, keys.ca)["files"] == len(signed_files(model))
    assert cli_verify(model, keys.ca, "certificate").returncode == 0
    with pytest.raises(signing.SigningError, match="does not verify with"):  # a root that did not issue the certificate
        signing.verify_directory(model, keys.other_ca)
    assert cli_verify(model, keys.other_ca, "certificate").returncode == 1
    flip_byte(model / "merged" / "model.safetensors")
    with pytest.raises(signing.SigningError, match=r"\(changed: merged/model\.safetensors\)"):
        signing.verify_directory(model, keys.ca)
    assert cli_verify(model, keys.ca, "certificate").returncode == 1


def test_an_encrypted_key_signs_with_its_password(published, keys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(published, model)
    key = signing.signing_key({signing.KEY_ENV: str(keys.encrypted), signing.PASSWORD_ENV: PASSWORD})
    signing.sign_directory(model, key)
    assert signing.verify_directory(model, keys.public)["signed"]


def test_without_a_key_nothing_is_signed_and_a_verifier_refuses_the_unsigned_model(published, keys):
    assert signing.signing_key({}) is None
    assert signing.summary(signing.UNSIGNED) == "unsigned"
    with pytest.raises(signing.SigningError, match=r"is unsigned \(no model\.sig\).*FT_SIGNING_KEY"):
        signing.verify_directory(published, keys.public)


def _rsa_key(path: Path) -> Path:
    path.write_bytes(_pem_private(rsa.generate_private_key(public_exponent=65537, key_size=2048)))
    return path


BAD_KEYS = [  # (case, environment from the test's paths, what the one-line error says)
    ("missing key file", lambda keys, tmp: {signing.KEY_ENV: str(tmp / "nope.pem")}, "cannot read the private key"),
    ("encrypted key, no password", lambda keys, tmp: {signing.KEY_ENV: str(keys.encrypted)},
     "is encrypted: set its password in FT_SIGNING_KEY_PASSWORD"),
    ("password for a plain key", lambda keys, tmp: {signing.KEY_ENV: str(keys.private), signing.PASSWORD_ENV: PASSWORD},
     "is not encrypted: unset FT_SIGNING_KEY_PASSWORD"),
    ("wrong password", lambda keys, tmp: {signing.KEY_ENV: str(keys.encrypted), signing.PASSWORD_ENV: "wrong"},
     "check FT_SIGNING_KEY_PASSWORD"),
    ("RSA key", lambda keys, tmp: {signing.KEY_ENV: str(_rsa_key(tmp / "rsa.pem"))}, "model-signing signs with an EC key"),
    ("certificate without key", lambda keys, tmp: {signing.CERT_ENV: str(keys.chain)}, "FT_SIGNING_CERT is set but FT_SIGNING_KEY is not"),
    ("certificate of another key", lambda keys, tmp: {signing.KEY_ENV: str(keys.private), signing.CERT_ENV: str(keys.other_ca)},
     "is not that of"),
    ("certificate with encrypted key",
     lambda keys, tmp: {signing.KEY_ENV: str(keys.encrypted), signing.PASSWORD_ENV: PASSWORD, signing.CERT_ENV: str(keys.chain)},
     "loads a certificate's key without a password"),
]  # fmt: skip


@pytest.mark.parametrize("case, environ, error", BAD_KEYS, ids=[case[0] for case in BAD_KEYS])
def test_a_key_that_cannot_sign_is_one_actionable_line(case, environ, error, keys, tmp_path):
    with pytest.raises(signing.SigningError) as refused:
        signing.signing_key(environ(keys, tmp_path))
    assert error in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_published_model_verifies_in_the_store_and_tampering_there_is_named(signed, published, keys, store):
    prefix, unsigned = "registry/acks/v1/run", "registry/acks/v1/unsigned"
    publish_dir(store, prefix, signed)
    publish_dir(store, unsigned, published)
    assert signing.verify_published(store, prefix, keys.public)["signed"]
    assert (
        signing.lineage_check(store, prefix, None, {})["status"]
        == "signed; not checked (give --public-key or FT_SIGNING_PUBLIC_KEY)"
    )
    assert signing.lineage_check(store, unsigned, None, {})["status"].startswith("unsigned; not checked")
    from_env = signing.lineage_check(store, prefix, None, {signing.PUBLIC_KEY_ENV: str(keys.public)})
    assert from_env["verified"] and from_env["status"].startswith("ok, signed (key sha256:")
    refused = signing.lineage_check(store, unsigned, str(keys.public))
    assert not refused["verified"] and "is unsigned (no model.sig)" in refused["status"]
    store.put_bytes(f"{prefix}/lineage.json", b'{"partition": "rewritten"}')
    check = signing.lineage_check(store, prefix, str(keys.public))
    assert (
        not check["verified"]
        and check["status"].startswith("REFUSED: ")
        and "(changed: lineage.json)" in check["status"]
    )
    assert store.uri(prefix) in check["status"]
