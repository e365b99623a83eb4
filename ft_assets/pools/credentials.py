"""The store keys a GPU target's worker gets: this host's, the workers' own, or keys scoped to one run (AWS STS).

``worker_secrets`` decides, from the control host's environment:

- ``FT_WORKER_KEYS=sts`` (AWS S3): for each attempt, temporary keys from ``sts:GetFederationToken`` with an inline
  session policy (``run_policy``) that lets them read the run's base model and shards and read, write and delete
  under the run's own prefix, nothing else in the bucket. AWS grants the intersection of that policy and the policy
  of the IAM user whose keys this host holds (GetFederationToken needs an IAM user's long-term keys, not a role's
  session). They last ``FT_WORKER_KEYS_HOURS`` (default 12, at most 36): an attempt that runs longer loses its store
  access, so set it above the longest attempt you expect;
- else ``FT_WORKER_AWS_ACCESS_KEY_ID`` / ``FT_WORKER_AWS_SECRET_ACCESS_KEY`` (/ ``_SESSION_TOKEN``), keys meant for
  workers (``deploy/worker-s3-policy.json`` scopes them to every run's training prefixes);
- else this host's own ``AWS_*`` keys.

A folder store needs no keys: none are sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ft_assets.pools import TargetError
from ft_assets.storage import ObjectStore, S3Store, env_credentials, join_key

REMOTE_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")  # the store's credentials
WORKER_KEYS = "FT_WORKER_"  # + a REMOTE_SECRETS name: the workers' own keys, sent in place of this host's
MODE_ENV, HOURS_ENV = "FT_WORKER_KEYS", "FT_WORKER_KEYS_HOURS"
DEFAULT_HOURS, MAX_HOURS = 12, 36  # GetFederationToken's longest: 36 h


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
            f"{MODE_ENV}=sts: AWS STS refused GetFederationToken ({' '.join(str(exc).split())}); it needs an IAM "
            f"user's long-term keys on the control host; else unset {MODE_ENV} and give workers keys of their own "
            f"({WORKER_KEYS}AWS_ACCESS_KEY_ID, ...)"
        ) from None
    credentials = token["Credentials"]
    return {"AWS_ACCESS_KEY_ID": credentials["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": credentials["SecretAccessKey"],
            "AWS_SESSION_TOKEN": credentials["SessionToken"]}  # fmt: skip


def worker_secrets(
    environ: Mapping[str, str], store: ObjectStore, reads: list[str], run_prefix: str, name: str
) -> dict[str, str]:
    """The store keys of one attempt's worker (see the module): scoped, the workers' own, or this host's."""
    mode = (environ.get(MODE_ENV) or "").strip().lower()
    if mode not in ("", "sts"):
        raise TargetError(
            f"{MODE_ENV}={environ[MODE_ENV]!r}: use sts (AWS S3: keys scoped to the run) or leave it unset"
        )
    if mode == "sts":
        if not isinstance(store, S3Store):
            raise TargetError(f"{MODE_ENV}=sts: the store {store.url} is not on S3; a folder store needs no keys")
        try:
            hours = float(environ.get(HOURS_ENV) or DEFAULT_HOURS)
        except ValueError:
            hours = -1.0
        if not 0.25 <= hours <= MAX_HOURS:
            raise TargetError(f"{HOURS_ENV}={environ.get(HOURS_ENV)!r}: hours from 0.25 to {MAX_HOURS}")
        return scoped_keys(store, reads, run_prefix, name, hours)
    own = {k: environ[WORKER_KEYS + k] for k in REMOTE_SECRETS if environ.get(WORKER_KEYS + k)}
    return own or {k: environ[k] for k in REMOTE_SECRETS if environ.get(k)}
