"""The provider SDKs that cannot share ft-assets' venv (SkyPilot, Vast.ai), called in a venv of their own.

Why a second venv: skypilot 0.14 pins ``click<8.2`` while huggingface_hub (so transformers) needs
``click>=8.4.2``, and vastai 1.9 pins ``cryptography==49.0.0`` and ``pillow==12.2.0`` where ft-assets'
venv has 50.0.2 and 13.0.0; no resolver puts either beside the trainer. ``make install`` builds
``.venv-skypilot`` with both (``SKY_VENV`` in the Makefile); the control host points
``FT_SKYPILOT_PYTHON`` at its python (default: ``.venv-skypilot/bin/python`` next to this checkout).

This file is both ends. ``call(verb, request)`` runs this same file under that python, hands it the
request as JSON on stdin (credentials never appear in argv or the process list) and reads the answer
from a file it names: SkyPilot writes its spinners to stdout, and the local API server it may start
inherits the process's pipes, so neither can be the answer's channel. Run as a script (the other end),
it imports only the standard library, ``sky`` and ``vastai``, never ft_assets. A call costs a process
start and ``import sky`` (seconds: docs/validation/planner-calibration.md), once per launch, cancel, health check (every 120 s at run monitoring's default) and idle-sensor tick.

An SDK's refusal comes back as ``SdkError``, one line with the SDK's exception class:
``NoCloudAccessError: Cloud access is not set up. Run: sky check``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PYTHON_ENV = "FT_SKYPILOT_PYTHON"  # the python of the venv that has skypilot and vastai
DEFAULT_TIMEOUT_S = 300.0  # a first launch may start SkyPilot's local API server (~15 s here) and provision
QUEUE_FIELDS = (
    "job_id", "job_name", "status", "resources", "cluster_resources", "cloud", "region", "zone", "infra",
    "recovery_count", "submitted_at", "start_at", "end_at", "last_recovered_at", "job_duration", "failure_reason",
    "current_cluster_name", "accelerators", "details",
)  # fmt: skip  # ManagedJobRecord fields the launcher reads
CLUSTER_FIELDS = (
    "name", "launched_at", "status", "autostop", "to_down", "is_managed", "cloud", "region", "resources_str",
    "status_updated_at", "user_name",
)  # fmt: skip  # StatusResponse fields the idle sensor reads
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class SdkError(RuntimeError):
    """An SDK call failed: the SDK's exception class and its message, on one line."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind


def sdk_python(configured: str | None = None) -> str:
    """The python that has the SDKs: ``configured``, else $FT_SKYPILOT_PYTHON, else this checkout's .venv-skypilot."""
    found = configured or os.environ.get(PYTHON_ENV)
    if found:
        return found
    local = Path(__file__).resolve().parents[2] / ".venv-skypilot" / "bin" / "python"
    if local.exists():
        return str(local)
    raise SdkError(
        "SkyPilotNotInstalled",
        f"no python with skypilot: set {PYTHON_ENV} (or the launcher's 'python') to the python of a venv with "
        "skypilot==0.14.1 and vastai==1.9.1 (`make install` builds .venv-skypilot)",
    )


def call(
    verb: str,
    request: dict[str, Any] | None = None,
    python: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> Any:
    """Run ``verb`` (see ``VERBS``) in the SDKs' venv and return its answer; raises ``SdkError``."""
    executable = sdk_python(python)
    with tempfile.TemporaryDirectory(prefix="ft-sdk-") as tmp:
        answer, log = Path(tmp) / "answer.json", Path(tmp) / "sdk.log"
        with open(log, "w") as log_file:
            try:
                done = subprocess.run(
                    [executable, __file__, verb, str(answer)],
                    input=json.dumps(request or {}),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=timeout_s,
                    env=env,
                )
            except subprocess.TimeoutExpired:
                raise SdkError("Timeout", f"{verb} took longer than {timeout_s:.0f} s; its log: {_tail(log)}") from None
            except OSError as exc:
                raise SdkError("SkyPilotNotInstalled", f"cannot run {executable}: {exc.strerror or exc}") from None
        if not answer.exists():
            raise SdkError("SdkCrashed", f"{verb} exited with code {done.returncode} and no answer: {_tail(log)}")
        reply = json.loads(answer.read_text())
    if "error" in reply:
        raise SdkError(reply["error"]["type"], reply["error"]["message"])
    return reply["ok"]


def _tail(log: Path, chars: int = 600) -> str:
    return one_line(log.read_text(errors="replace")[-chars:]) if log.exists() else ""


def one_line(text: str) -> str:
    """An SDK message as one line: colours and line breaks gone."""
    return " ".join(ANSI.sub("", text).split())


# --- the other end: runs under the SDKs' python, imports sky / vastai only ---------------------------


def _sky_launch(request: dict) -> dict:
    import sky

    task = sky.Task.from_yaml_config(request["task"])
    job_ids, _ = sky.get(sky.jobs.launch(task, name=request["name"]))
    return {"job_id": job_ids[0]}


def _sky_queue(request: dict) -> list[dict]:
    """The managed jobs ``job_ids``, each with the catalog's hourly price of the resources it runs on now."""
    import sky

    records, *_ = sky.get(sky.jobs.queue_v2(refresh=False, job_ids=request["job_ids"], fields=list(QUEUE_FIELDS)))
    out = []
    for record in records:
        row = {field: getattr(record, field, None) for field in QUEUE_FIELDS}
        row["status"] = record.status.value if record.status is not None else None
        row["usd_per_hour"] = _hourly_price(row, bool(request.get("use_spot")))
        out.append(row)
    return out


def _hourly_price(row: dict, use_spot: bool) -> float | None:
    """SkyPilot's catalog price of the cheapest instance with the job's accelerators in its cloud and region."""
    from sky import catalog

    if not (row.get("cloud") and row.get("region") and row.get("accelerators")):
        return None
    (name, count), *_ = row["accelerators"].items()
    try:
        types, _ = catalog.get_instance_type_for_accelerator(
            name, count, use_spot=use_spot, region=row["region"], clouds=row["cloud"].lower()
        )
        if not types:
            return None
        return float(catalog.get_hourly_cost(types[0], use_spot, row["region"], None, clouds=row["cloud"].lower()))
    except Exception:  # a cloud without a catalog (Kubernetes): no price
        return None


def _sky_cancel(request: dict) -> None:
    import sky

    sky.get(sky.jobs.cancel(job_ids=request["job_ids"]))


def _sky_catalog(request: dict) -> dict:
    """Every GPU offering of ``clouds`` in SkyPilot's catalog (each region), and when each cloud's file was fetched."""
    from sky import catalog
    from sky.catalog import common

    rows = []
    fetched = {}
    for cloud in request["clouds"]:
        offers = catalog.list_accelerators(gpus_only=True, clouds=cloud, all_regions=True)
        rows += [info._asdict() for infos in offers.values() for info in infos]
        path = common.get_catalog_path(f"{cloud.lower()}/vms.csv")
        fetched[cloud] = os.path.getmtime(path) if os.path.exists(path) else None
    return {"rows": rows, "fetched_at": fetched, "schema": common.constants.CATALOG_SCHEMA_VERSION}


def _sky_clusters(request: dict) -> list[dict]:
    import sky

    records = sky.get(sky.status(all_users=False))
    out = []
    for record in records:
        row = {field: getattr(record, field, None) for field in CLUSTER_FIELDS}
        row["status"] = record.status.value
        out.append(row)
    return out


def _sky_stop(request: dict) -> None:
    import sky

    sky.get(sky.stop(request["cluster"]))


def _sky_down(request: dict) -> None:
    import sky

    sky.get(sky.down(request["cluster"]))


def _vast(request: dict):
    from vastai import VastAI

    return VastAI(server_url=request.get("server_url") or None, raw=True, quiet=True)


def _vast_instances(request: dict) -> list[dict]:
    return _vast(request).show_instances()


def _vast_stop(request: dict) -> dict:
    return _vast(request).stop_instance(int(request["id"]))


def _vast_destroy(request: dict) -> dict:
    return _vast(request).destroy_instance(int(request["id"]))


VERBS = {
    "sky.launch": _sky_launch,
    "sky.queue": _sky_queue,
    "sky.cancel": _sky_cancel,
    "sky.catalog": _sky_catalog,
    "sky.clusters": _sky_clusters,
    "sky.stop": _sky_stop,
    "sky.down": _sky_down,
    "vast.instances": _vast_instances,
    "vast.stop": _vast_stop,
    "vast.destroy": _vast_destroy,
}


def serve(verb: str, answer_path: str, stdin=sys.stdin) -> None:
    """One request from stdin, one answer to ``answer_path``: {"ok": ...} or {"error": {"type", "message"}}."""
    started = time.monotonic()
    try:
        reply: dict = {"ok": VERBS[verb](json.loads(stdin.read() or "{}"))}
    except Exception as exc:  # every SDK error becomes one line for the caller
        reply = {"error": {"type": type(exc).__name__, "message": one_line(str(exc))}}
    reply["seconds"] = round(time.monotonic() - started, 3)
    Path(answer_path).write_text(json.dumps(reply, default=str))


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
