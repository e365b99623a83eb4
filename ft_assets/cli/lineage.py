"""``ft-assets lineage``: the chain behind a published model, verified in the store at hand (no Dagster instance).

The checking is ``ft_assets.delivery.lineage.verify_lineage``, next to the code that builds the
lineage; this module finds the store from the URI and prints. Exit 0 when every link verifies, 1 when
one does not, 2 when there is nothing published at the URI.
"""

from __future__ import annotations

import argparse

from ft_assets.cli.output import CliError, print_json
from ft_assets.data.sources import describe_source
from ft_assets.delivery.exports import named
from ft_assets.delivery.lineage import verify_lineage
from ft_assets.layout import registry_key
from ft_assets.manifests import ArtifactNotFound
from ft_assets.storage import open_store


def execute(args: argparse.Namespace, partial: dict) -> dict:
    try:
        store_url, key = registry_key(args.uri)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    try:
        return verify_lineage(open_store(store_url or None), key, rehash=not args.fast, public_key=args.public_key)
    except ArtifactNotFound as exc:
        raise CliError(f"{args.uri}: {exc}") from exc


def print_lineage(report: dict) -> None:
    print(f"{report['published_uri']}")
    print(
        f"  dataset version {report['dataset_version']}; base model {report['base_model']['model_id']} (sha256 {report['base_model']['source_sha256'][:16]}…)"
    )
    for line in describe_source(report["dataset_source"]):
        print(line)
    for link in report["chain"]:
        print(f"  ← {link['asset']:<21} {link['digest'][:16]}…  {link['created_at'] or '':<25} {link['status']}")
        if link["asset"] == "lora_adapter":
            print(
                f"      from {report['checkpoint']} ({report['training']['method']}, {report['training']['steps']} steps)"
            )
            image = report["training"]["image"] or {"digest": None, "reason": "not recorded (an older ft-assets)"}
            print(f"      in image {image['digest'] or 'unknown: ' + image['reason']}")
    for name, export in report["exports"].items():
        title = named(name).title if named(name) else name  # an export this version no longer has: its name
        for file, info in export["files"].items():
            print(f"  {title} {file}: sha256 {info['sha256'][:16]}…{' (ships)' if file == export['shipped'] else ''}")
        if export["reason"]:
            print(f"  {title}: none ({export['reason']})")
    ev = report["eval"]
    print(
        f"  eval {ev['metric_name']}: base {ev['base_metric']:.3f} → fine-tuned {ev['finetuned_metric']:.3f}; code {report['code_version']}"
    )
    print(f"  signature: {report['signature']['status']}")
    how = "every file re-hashed" if report["files_rehashed"] else "manifests only (--fast)"
    print(f"  lineage {'verified' if report['verified'] else 'NOT verified: see the statuses above'} ({how})")


def report(args: argparse.Namespace, result: dict) -> int:
    """The chain as text, or with ``--json`` as one JSON object alone."""
    if args.json:
        print_json(result)
    else:
        print_lineage(result)
    return 0 if result["verified"] else 1
