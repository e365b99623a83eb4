"""Run by SkyPilot's venv python: each task config (JSON on stdin) through SkyPilot's own classes.

For each: ``sky.Task.from_yaml_config``, ``Task.validate()`` (every ``sky.Resources`` against the catalog),
a YAML round trip (``to_yaml_config`` -> YAML text -> ``from_yaml_config``), and what SkyPilot made of it.
Writes a JSON list to the file named by argv[1]: {"ok": {...}} or {"error": "<class>: <message>"} per task.
"""

import json
import sys

import sky
import yaml


def check(config: dict) -> dict:
    task = sky.Task.from_yaml_config(config)
    task.validate()
    text = yaml.safe_dump(task.to_yaml_config())
    again = sky.Task.from_yaml_config(yaml.safe_load(text))
    resources = [
        {"cloud": str(r.cloud), "region": r.region, "accelerators": r.accelerators, "use_spot": r.use_spot,
         "image_id": r.image_id, "disk_size": r.disk_size, "job_recovery": r.job_recovery,
         "autostop": [r.autostop_config.idle_minutes, r.autostop_config.down] if r.autostop_config else None}
        for r in task.resources
    ]  # fmt: skip
    return {
        "name": task.name, "num_nodes": task.num_nodes, "run": task.run, "envs": dict(task.envs),
        "secrets": {k: v.get_secret_value() for k, v in task.secrets.items()}, "resources": resources,
        "ordered": isinstance(task.resources, list), "round_trip": [repr(r) for r in again.resources] == [repr(r) for r in task.resources]
        and again.envs == task.envs and again.run == task.run and again.secrets.keys() == task.secrets.keys(),
    }  # fmt: skip


results = []
for config in json.load(sys.stdin):
    try:
        results.append({"ok": check(config)})
    except Exception as exc:
        results.append({"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
with open(sys.argv[1], "w") as out:
    json.dump(results, out, default=str)
