"""The store keys a GPU target's worker gets: keys scoped to its run, keys made for workers, or none.

Least privilege is the default: this host's own keys (often a whole account's) never go to a rented machine unless
you say so. ``worker_keys`` decides, from the control host's environment and the store, before anything is rented:

- a folder store (ssh, Slurm on a shared file system): no keys;
- ``FT_WORKER_AWS_ACCESS_KEY_ID`` / ``FT_WORKER_AWS_SECRET_ACCESS_KEY`` (/ ``_SESSION_TOKEN``) set: those, keys you
  made for workers (``deploy/worker-s3-policy.json`` on AWS; a bucket-scoped key on R2, B2, MinIO, Wasabi);
- a store on AWS S3 (no other endpoint), or ``FT_WORKER_KEYS=sts``: for each attempt, temporary keys from
  ``sts:GetFederationToken`` with an inline session policy (``run_policy``) that lets them read the run's base model
  and shards and read, write and delete under the run's own prefix, nothing else in the bucket. AWS grants the
  intersection of that policy and the policy of the IAM user whose keys this host holds (GetFederationToken needs an
  IAM user's long-term keys, not a role's session). Each lives ``FT_WORKER_KEYS_HOURS`` (default 12, at most 36) and is renewed
  while the attempt runs (``ft_assets.targets.renewal``);
- ``FT_WORKER_KEYS=host-keys``: this host's own ``AWS_*`` keys, said in so many words;
- else (an S3-compatible store without STS and no keys for workers): refused in one line (``TargetError``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from urllib.parse import urlparse

from ft_assets.targets import TargetError
from ft_assets.storage import ObjectStore, S3Store, env_credentials, join_key

REMOTE_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")  # the store's credentials
WORKER_KEYS = "FT_WORKER_"  # + a REMOTE_SECRETS name: the workers' own keys, sent in place of this host's
MODE_ENV, HOURS_ENV = "FT_WORKER_KEYS", "FT_WORKER_KEYS_HOURS"
STS, HOST_KEYS = "sts", "host-keys"  # FT_WORKER_KEYS's values
NONE, OWN = "none", "own"  # what else worker_keys may answer: a folder store's, the workers' own keys
DEFAULT_HOURS, MAX_HOURS = 12, 36  # GetFederationToken's longest: 36 h
AWS_HOSTS = (".amazonaws.com", ".amazonaws.com.cn")
SECURITY_PAGE = "docs/deploy/security.md"


def run_policy(bucket: str, prefix: str, reads: list[str], run_prefix: str) -> dict:
    """An IAM policy: GetObject under each of ``reads``; Get, Put and Delete under ``run_prefix``; ListBucket of those
    prefixes only (keys relative to the store's ``prefix`` in ``bucket``)."""
    full = [join_key(prefix, key) for key in (*reads, run_prefix)]
    arn = f"arn:aws:s3:::{bucket}"
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"{arn}/{key}/*" for key in full[:-1]]},
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
             "Resource": [f"{arn}/{full[-1]}/*"]},
            {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [arn],
             "Condition": {"StringLike": {"s3:prefix": [f"{key}/*" for key in full]}}},
        ],
    }  # fmt: skip


def scoped_keys(store: S3Store, reads: list[str], run_prefix: str, name: str, hours: float) -> dict[str, str]:
    """Temporary keys for one attempt, limited by ``run_policy`` (``sts:GetFederationToken`` with this host's keys)."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    policy = json.dumps(run_policy(store.bucket, store.prefix, reads, run_prefix), separators=(",", ":"))
    sts = boto3.client("sts", **env_credentials())
    try:
        token = sts.get_federation_token(Name=name[-32:], Policy=policy, DurationSeconds=int(hours * 3600))
    except (BotoCoreError, ClientError) as exc:
        raise TargetError(
            f"AWS STS refused GetFederationToken, which makes the worker keys scoped to this run "
            f"({' '.join(str(exc).split())}); it needs an IAM user's long-term keys on the control host; else give "
            f"workers keys of their own ({WORKER_KEYS}AWS_ACCESS_KEY_ID, {WORKER_KEYS}AWS_SECRET_ACCESS_KEY)"
        ) from None
    credentials = token["Credentials"]
    return {"AWS_ACCESS_KEY_ID": credentials["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": credentials["SecretAccessKey"],
            "AWS_SESSION_TOKEN": credentials["SessionToken"]}  # fmt: skip


def on_aws(store: S3Store) -> bool:
    """Whether ``store`` is AWS S3 itself (its endpoint an ``amazonaws.com`` host), not an S3-compatible store."""
    host = urlparse(store.client.meta.endpoint_url or "").hostname or ""
    return host.endswith(AWS_HOSTS) or host in ("amazonaws.com", "amazonaws.com.cn")


def worker_keys(environ: Mapping[str, str], store: ObjectStore) -> str:
    """Which keys the workers of a run on ``store`` get (see the module): ``none``, ``own``, ``sts`` or
    ``host-keys``; a setting that cannot be used, or a store this host cannot make scoped keys for while no keys for
    workers are given, is refused in one line that says what to set."""
    mode = (environ.get(MODE_ENV) or "").strip().lower()
    if mode not in ("", STS, HOST_KEYS):
        raise TargetError(
            f"{MODE_ENV}={environ[MODE_ENV]!r}: use {STS} (keys scoped to the run, AWS S3), {HOST_KEYS} (send this "
            "host's own keys to the workers) or leave it unset"
        )
    if not isinstance(store, S3Store):
        if mode == STS:
            raise TargetError(f"{MODE_ENV}={STS}: the store {store.url} is not on S3; a folder store needs no keys")
        return NONE
    if mode:
        return mode
    if any(environ.get(WORKER_KEYS + k) for k in REMOTE_SECRETS):
        return OWN
    if on_aws(store):
        return STS
    raise TargetError(
        f"the store {store.url} is on {store.client.meta.endpoint_url}, an S3-compatible store where ft-assets cannot "
        f"make keys scoped to one run, and this host's own keys do not go to a rented worker by default: set "
        f"{WORKER_KEYS}AWS_ACCESS_KEY_ID and {WORKER_KEYS}AWS_SECRET_ACCESS_KEY to a key made for workers ("
        f"{SECURITY_PAGE} shows a bucket-scoped key on R2, B2, MinIO, Wasabi), or {MODE_ENV}={HOST_KEYS} to send "
        "this host's keys"
    )


def describe_keys(mode: str, environ: Mapping[str, str]) -> str:
    """A log line's words for ``mode`` (``worker_keys``'): what the worker will hold."""
    return {
        NONE: "no store keys (a folder store)",
        OWN: f"the keys made for workers ({WORKER_KEYS}AWS_*), not this host's",
        STS: f"keys scoped to this run from AWS STS, made for each attempt ({hours_of(environ):g} h)",
        HOST_KEYS: f"this host's own store keys ({MODE_ENV}={HOST_KEYS})",
    }[mode]


def hours_of(environ: Mapping[str, str]) -> float:
    """How long scoped keys last (``FT_WORKER_KEYS_HOURS``); out of range is refused in one line."""
    try:
        hours = float(environ.get(HOURS_ENV) or DEFAULT_HOURS)
    except ValueError:
        hours = -1.0
    if not 0.25 <= hours <= MAX_HOURS:
        raise TargetError(f"{HOURS_ENV}={environ.get(HOURS_ENV)!r}: hours from 0.25 to {MAX_HOURS}")
    return hours


def worker_secrets(
    environ: Mapping[str, str], store: ObjectStore, reads: list[str], run_prefix: str, name: str
) -> dict[str, str]:
    """The store keys of one attempt's worker (``worker_keys`` says which): none, the workers' own, keys scoped to
    the run, or this host's."""
    mode = worker_keys(environ, store)
    if mode == NONE:
        return {}
    if mode == STS:
        return scoped_keys(store, reads, run_prefix, name, hours_of(environ))
    source = WORKER_KEYS if mode == OWN else ""
    return {k: environ[source + k] for k in REMOTE_SECRETS if environ.get(source + k)}
