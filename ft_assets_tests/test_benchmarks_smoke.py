"""Every benchmark runs end to end on tiny inputs (``--quick``) and writes a result with sane figures.

The figures themselves are not asserted against the targets (``make bench`` reports those); this only
proves that each benchmark's code path works and that its JSON has what docs/validation/benchmarks.md reads.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture
def bench_dirs(tmp_path, monkeypatch):
    """A private cache and results folder: the committed results are never touched."""
    monkeypatch.setenv("FT_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FT_BENCH_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


COUNTS = (
    "rows_in",
    "rows_quarantined",
    "exact_duplicates",
    "near_duplicates",
    "train_rows",
    "eval_rows",
    "tokens",
    "packed_rows",
)


def result(results, name: str) -> dict:
    data = json.loads((results / f"{name}.json").read_text())
    assert {"command", "date", "machine"} <= set(data)
    return data


def test_every_benchmark_runs_on_tiny_inputs(bench_dirs):
    from benchmarks import data_plane, gpu_step, packing, run_all, training, vlm_step

    data_plane.main(["--quick"])
    summary = result(bench_dirs, "data_plane")["summary"]
    for key in ("rows_per_s", "tokens_per_s", "rows_per_s_n2", "speedup", "ratio_to_ceiling", "ratio_to_ceiling_per_core_n2",
                "speedup_over_baseline", "peak_rss_growth", "rows_per_s_ray2"):  # fmt: skip
        assert summary[key] > 0, key
    assert 0 < summary["ratio_to_ceiling"] < 1.5  # nothing beats tokenizing alone by much
    assert set(summary["projection"]["hours"]) == {"10,000,000 rows", "100,000,000 rows"}
    runs = result(bench_dirs, "data_plane")["runs"]
    assert set(runs) == {"ours_x1", "ours_n2_x1", "ours_ray2_x1", "ceiling_x1", "baseline_x1", "ours_n2_x4"}
    assert runs["ours_x1"]["rows_in"] == runs["ours_x1"]["corpus"]["lines"] - runs["ours_x1"]["corpus"]["blank_lines"]
    assert set(runs["ours_x1"]["stages"]) == {"executor_start", "read", "clean", "dedup", "split", "tokenize_pack"}
    assert runs["ours_x1"]["exact_duplicates"] > 0 and runs["ours_x1"]["rows_quarantined"] > 0
    for name in ("ours_n2_x1", "ours_ray2_x1"):  # the same counts on every executor, the shards spread over 2 workers
        assert {k: runs[name][k] for k in COUNTS} == {k: runs["ours_x1"][k] for k in COUNTS}, name
        assert (runs[name]["executor"], len(runs[name]["workers_shards"])) == (
            ("ray", 2) if "ray" in name else ("processes", 2)
        )

    packing.main(["--quick"])
    for name, figures in result(bench_dirs, "packing")["results"].items():
        assert 0.9 < figures["ours_packing"] <= 1, name
        assert 0 < figures["pad_max_length"] <= figures["pad_longest_map1000"] <= 1, name
        assert figures["packed_rows"] >= figures["lower_bound_rows"], name

    training.main(["--quick"])
    figures = result(bench_dirs, "training")
    assert {(f["save_steps"], f["upload"]) for f in figures["fractions"]} == {
        (2, "background"),
        (2, "synchronous"),
        (8, "background"),
    }
    assert all(0 < f["effective_training_fraction"] < 1 for f in figures["fractions"])
    sigterm, sigkill = figures["resume"]["SIGTERM"], figures["resume"]["SIGKILL"]
    assert sigterm["exit_code_of_killed_worker"] == 75 and sigterm["steps_lost"] == 0
    assert sigkill["exit_code_of_killed_worker"] == -9 and 0 <= sigkill["steps_lost"] <= 2
    assert sigterm["first_new_step"] == sigterm["resumed_from_step"] + 1

    gpu_step.main(["--cpu-smoke"])
    rows = result(bench_dirs, "gpu_step_cpu_smoke")["results"]
    assert {(r["method"], r["layout"]) for r in rows} == {
        (m, l) for m in ("lora", "qlora") for l in ("packed", "padded")
    }
    assert all(r["real_tokens_per_s"] > 0 for r in rows)
    moe = result(bench_dirs, "gpu_step_cpu_smoke")["gpt_oss_20b"]["result"]  # the MoE suite's code, on a tiny shape
    assert (
        moe["experts"] == "grouped_mm" and moe["real_tokens_per_s"] > 0 and "active (2 of 4 experts)" in moe["params"]
    )
    vlm = result(bench_dirs, "gpu_step_cpu_smoke")["qwen2_5_vl_7b"]["result"]  # Qwen2.5-VL-7B's suite, shrunk
    assert vlm["method"] == "qlora" and vlm["images_per_step"] == 1 and vlm["tokens_per_image"] == 16  # 112 px / 28
    assert vlm["images_per_s"] > 0 and vlm["planner_total_gib"] > 0

    vlm_step.main(["--quick"])
    rows = {r["model"]: r for r in result(bench_dirs, "vlm_step")["results"]}
    assert set(rows) == {"qwen2_5_vl", "smolvlm"}
    for name, r in rows.items():
        assert r["images_per_s"] > 0 and r["real_tokens_per_s"] > 0 and 0 < r["pixel_share"] < 1, name
        assert 0 < r["image_token_share"] < 1 and r["shards"]["images"] == r["shards"]["examples"], name

    snippet = run_all.readme_snippet(bench_dirs)
    assert "## Benchmarks" in snippet and "Pending" in snippet and "### Targets" in snippet
    assert "### Vision-language models: a LoRA training step on CPU" in snippet and "| smolvlm " in snippet
