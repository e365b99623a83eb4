"""What the asset pages show, from the plain functions that build the metadata (no Dagster run).

Numbers first: headline figures are top-level int/float entries to 4 significant digits, a figure that
does not exist is left out (never an empty cell or NaN), sizes are in MB, dicts are tables rather than
JSON blobs, charts are markdown the page draws in place, and each $ per million tokens says which it is.
"""

import math

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ft_assets.control.assets import mfu_metadata
from ft_assets.delivery import evaluate as ev
from ft_assets.delivery import gate as gating
from ft_assets.delivery.assets import eval_metadata, shipped_metadata
from ft_assets.delivery.scoring import ChatScorer, Report, Scored, Shipped, same_answer
from ft_assets.materialize import dataset_metadata, figures, megabytes, ref_metadata, rounded, settings_table
from ft_assets.plots import LEFT, MAX_MARKDOWN, RIGHT
from ft_assets.training.assets import adapter_metadata, checkpoint_table, figure_metadata
from ft_assets_tests.charts import SVG, bars, dots, svg_of

NOT_SHOWN_AS_IS = (dg.JsonMetadataValue,)  # a dict or list where a table or a number fits


@pytest.mark.parametrize(
    "value, expected",
    [
        (2 / 3, 0.6667),
        (0.10050251256281408, 0.1005),
        (1234.5678, 1235.0),
        (0.000123456, 0.0001235),
        (0.0, 0.0),
        (None, None),
    ],
)
def test_rounded_keeps_four_significant_digits(value, expected):
    assert rounded(value) == expected


def test_figures_keep_ints_round_floats_and_leave_out_what_does_not_exist():
    shown = figures(steps=60, train_loss=0.04567891, eval_loss=None, mfu=float("nan"), share=2 / 3)
    assert shown == {
        "steps": dg.MetadataValue.int(60),
        "train_loss": dg.MetadataValue.float(0.04568),
        "share": dg.MetadataValue.float(0.6667),
    }


def test_sizes_are_shown_in_megabytes():
    ref = {"uri": "/store/x", "digest": "d", "bytes": 771636891, "files": {"a": {}, "b": {}}}
    metadata = ref_metadata(ref)
    assert metadata["size_mb"] == dg.MetadataValue.float(771.6) and "bytes" not in metadata
    assert megabytes(94_310_000) == 94.31


def test_a_dataset_carries_dagsters_row_count_and_column_schema(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(
        pa.table({
            "messages": [[{"role": "user", "content": "hi"}]], "source": ["a.jsonl:1"], "input_ids": pa.array([[1, 2]], pa.list_(pa.int32())),
        }),
        path,
    )  # fmt: skip
    metadata = dataset_metadata(1234, pq.read_schema(path))
    assert metadata["dagster/row_count"] == dg.MetadataValue.int(1234)
    schema = metadata["dagster/column_schema"].schema
    assert [(c.name, c.type) for c in schema.columns] == [
        ("messages", "list<struct<role: string, content: string>>"), ("source", "string"), ("input_ids", "list<int32>"),
    ]  # fmt: skip


def test_settings_are_a_table_of_rounded_values():
    value = settings_table(
        {"method": "lora", "epochs": 0.10050251256281408, "targets": ["q_proj", "v_proj"], "warmup": None}
    )
    assert isinstance(value, dg.TableMetadataValue)
    assert [(r.data["setting"], r.data["value"]) for r in value.records] == [
        ("method", "lora"), ("epochs", "0.1005"), ("targets", '["q_proj", "v_proj"]'), ("warmup", "none"),
    ]  # fmt: skip


ADAPTER_STATS = {
    "method": "lora", "objective": "sft", "device": "cpu x1", "steps": 60, "train_loss": 0.0412345678, "eval_loss": 0.0523456789,
    "eval_metrics": {"eval_loss": 0.0523456789, "eval_perplexity": 1.053745}, "tokens_seen": 61_440,
    "tokens_per_second": 1234.56789, "wall_seconds": 49.87654, "effective_training_fraction": 0.8123456, "resumed_from_step": None,
    "attn_implementation": "sdpa", "resolved": {"method": "lora", "epochs": 0.10050251256281408, "batch_size": 2},
    "checkpoints": ["/store/runs/acks/v1/train/r1/checkpoint-00000030/", "/store/runs/acks/v1/train/r1/checkpoint-00000060/"],
    "run_id": "r1", "figure_history": [], "train_loss_window": 10,
    "worker_image": {"digest": "sha256:" + "ab" * 32, "reference": None, "source": "FT_IMAGE_DIGEST", "base": "python:3.11-slim",
                     "ft_assets": "0.1.0", "torch": "2.13.0+cpu", "packages_sha256": "cd" * 32, "reason": None},
}  # fmt: skip


def test_the_adapter_leads_with_rounded_figures_and_shows_no_json_blob():
    history = [(step, 7.5 * math.exp(-step / 400) + 0.04) for step in range(1, 20_001)]
    evals = [(5_000, 0.2), (10_000, 0.06)]  # eval_steps 5,000: two intermediate evals, then the final one
    metadata = adapter_metadata(ADAPTER_STATS, history, evals)
    assert list(metadata)[:3] == ["train_loss", "eval_loss", "eval_perplexity"]  # the page lists entries in this order
    assert metadata["train_loss"] == dg.MetadataValue.float(0.04123) and metadata[
        "eval_loss"
    ] == dg.MetadataValue.float(0.05235)
    assert metadata["steps"] == dg.MetadataValue.int(60) and metadata["tokens_per_second"] == dg.MetadataValue.float(
        1235.0
    )
    assert metadata["effective_training_fraction"] == dg.MetadataValue.float(0.8123)
    assert not [name for name, value in metadata.items() if isinstance(value, NOT_SHOWN_AS_IS)]
    assert [r.data["value"] for r in metadata["settings"].records if r.data["setting"] == "epochs"] == ["0.1005"]
    assert [r.data["step"] for r in metadata["checkpoints"].records] == [30, 60]
    assert (
        metadata["worker_image"]
        == f"sha256:{'ab' * 32} (FT_IMAGE_DIGEST); built on python:3.11-slim with ft-assets 0.1.0, torch 2.13.0+cpu"
    )
    curve = metadata["loss_curve"].value
    texts = ["".join(t.itertext()) for t in svg_of(curve).iter(f"{SVG}text")]
    assert len(curve) <= MAX_MARKDOWN  # the figures beside it, named as what they are:
    assert texts[0] == "train_loss 0.04123 (mean, last 10); eval_loss 0.05235"
    assert len(next(svg_of(curve).iter(f"{SVG}polyline")).get("points").split(",")) >= 2 * 16  # 16 points or more
    assert [x for x, _ in dots(svg_of(curve))] == [LEFT + 65, LEFT + 130, RIGHT]  # steps 5,000, 10,000, 20,000


def test_a_run_without_an_eval_loss_leaves_it_out():
    metadata = adapter_metadata(
        {**ADAPTER_STATS, "eval_loss": None, "eval_metrics": {}}, [(1, 2.0)], [(1, 0.7)]
    )  # GRPO: no reference reply (its evals are rewards, no dots on the loss curve)
    assert "eval_loss" not in metadata and "train_loss" in metadata
    assert not dots(svg_of(metadata["loss_curve"].value))


def test_a_grpo_run_shows_its_last_figures_rounded_and_its_reward_curve():
    history = [(step, {"reward_mean": step / 3000, "reward_std": 0.5 - step / 9000, "kl": 0.0123456, "completion_length": 17.25})
               for step in range(1, 3001)]  # fmt: skip
    metadata = figure_metadata(history)
    assert metadata["reward_mean"] == dg.MetadataValue.float(1.0) and metadata["kl"] == dg.MetadataValue.float(0.01235)
    curve = svg_of(metadata["reward_curve"].value)
    assert len(metadata["reward_curve"].value) <= MAX_MARKDOWN and len(list(curve.iter(f"{SVG}polyline"))) == 2
    assert figure_metadata([]) == {}


def test_checkpoint_table_reads_each_step_from_its_folder_name():
    value = checkpoint_table(["s3://b/runs/x/checkpoint-00000100", "s3://b/runs/x/checkpoint-00001000/"])
    assert [(r.data["step"], r.data["uri"]) for r in value.records] == [
        (100, "s3://b/runs/x/checkpoint-00000100"),
        (1000, "s3://b/runs/x/checkpoint-00001000/"),
    ]


@pytest.mark.parametrize(
    "mfu, device, shown",
    [(0.2934567, "cuda x1", dg.MetadataValue.float(0.2935)),
     (None, "cpu x1", "n/a: trained on cpu, whose peak FLOP/s the cost model does not list")],
)  # fmt: skip
def test_mfu_is_a_number_on_a_known_gpu_and_says_why_not_elsewhere(mfu, device, shown):
    assert mfu_metadata(mfu, device) == {"mfu": shown}


OFF = "GGUF export is off (gguf_model qtypes: [])"
MLX_OFF = "MLX export is off (mlx_model variants: [])"


def gate(base, tuned, gguf):
    """The gate with the GGUF export shipping acks-v1-f16.gguf scored ``gguf``, or (None) shipping nothing; no MLX."""
    export = gating.dropped(OFF, 0.05) if gguf is None else gating.shipped("acks-v1-f16.gguf", "f16", gguf, tuned, 0.05)
    return gating.gate("exact_match", base, tuned, 0.1, {"gguf": export, "mlx": gating.dropped(MLX_OFF, 0.05)})


SFT_SAMPLES = [
    {"prompt": "set a timer", "reference": "ok", "base": "hm", "fine-tuned": "ok", "correct": True, "GGUF f16 (llama.cpp)": "ok", "exact_match": 1.0, "source": "a:1"},
    {"prompt": "call mom", "reference": "ok", "base": "", "fine-tuned": "okay", "correct": False, "GGUF f16 (llama.cpp)": "okay", "exact_match": 0.0, "source": "a:2"},
]  # fmt: skip


def test_eval_report_shows_the_metric_base_to_shipped_as_numbers_a_chart_with_every_bar_and_answers_with_correct():
    report = Report(
        {"base_eval_loss": 7.5123456, "finetuned_eval_loss": 0.0812345},
        [{"": "exact_match", "base": 0.0}],
        SFT_SAMPLES,
        {},
        "",
    )
    metadata = eval_metadata(gate(0.0, 0.95, 0.95), report, 20, "eval conversations", "/store/eval/answers.jsonl")
    assert metadata["metric"] == "exact_match" and metadata["gguf_file"] == "acks-v1-f16.gguf"
    assert metadata["improvement"] == dg.MetadataValue.float(0.95) and metadata["examples"] == dg.MetadataValue.int(20)
    assert not {"base_metric", "finetuned_metric", "gguf_metric", "base_eval_loss"} & set(metadata)  # in the table once
    assert not [name for name, value in metadata.items() if isinstance(value, NOT_SHOWN_AS_IS)]
    chart = metadata["chart"].value
    assert len(chart) <= MAX_MARKDOWN and len(bars(svg_of(chart))) == 3  # the base's 0 is a bar too
    answers = metadata["answers"]
    assert [c.name for c in answers.schema.columns][:5] == ["prompt", "reference", "base", "fine-tuned", "correct"]
    assert [r.data["correct"] for r in answers.records] == [False, True]  # the wrong answers first
    assert metadata["all_answers"] == dg.MetadataValue.path("/store/eval/answers.jsonl")
    assert metadata["answers_shown"].startswith("2 of 2, the wrong ones first")


def test_a_vlms_eval_pictures_are_drawn_with_every_models_answer_at_most_half_of_them_wrong(tmp_path):
    from pathlib import Path

    from ft_assets.delivery.assets import picture_gallery

    picture = Path(__file__).parents[1] / "samples" / "shapes" / "images" / "0001.png"
    rows = [{**SFT_SAMPLES[i % 2], "prompt": f"<image>What color is shape {i}?"} for i in range(8)]
    report = Report({}, [], rows, {}, "", [str(picture)] * 7 + [None])  # the last row has no picture
    gallery = picture_gallery(report, ["GGUF f16 (llama.cpp)"])
    assert list(gallery) == ["picture_1", "picture_2", "picture_3", "picture_4"]
    captions = [md.value.split("\n\n", 1)[1] for md in gallery.values()]
    assert (
        captions[0]
        == "**What color is shape 0?** · expected *ok* · base: hm · fine-tuned: ok · GGUF f16 (llama.cpp): ok ✓"
    )
    assert [c.endswith("✗") for c in captions] == [False, True, False, True]  # two right, two wrong, in row order
    assert picture_gallery(Report({}, [], SFT_SAMPLES, {}, ""), []) == {}  # a text model: no pictures


def test_without_a_gguf_the_eval_report_has_no_gguf_figures_and_two_bars():
    report = Report({"base_eval_loss": None, "finetuned_eval_loss": None}, [], [], {}, "")
    metadata = eval_metadata(gate(0.0, 0.5, None), report, 8, "eval prompts", "answers.jsonl")
    assert "gguf_metric" not in metadata and "gguf_drop" not in metadata and "base_eval_loss" not in metadata
    assert metadata["gguf_file"] == f"none: {OFF}" and len(bars(svg_of(metadata["chart"].value))) == 2


@pytest.mark.parametrize(
    "metric, tuned, correct",
    [("exact_match", ['{"name": "f", "arguments": {"a": 1}}', "okay"], [True, False]),  # a task metric: full marks
     ("ft_assets.rewards:tool_call_json", ['{"name": "f", "arguments": {}}', "{"], [False, False]),  # a reward: the reference's answer
     ("ft_assets.rewards:tool_call_json", ['{"name": "f", "arguments": {"a": 1}}', "ok"], [True, True])],
)  # fmt: skip
def test_a_chat_scorers_answers_say_correct_by_its_own_measure(metric, tuned, correct):
    scorer = ChatScorer(metric, 10, 8, None)
    scorer.examples = [ev.EvalExample("a:1", [{"role": "user", "content": "call f"}], '{"name": "f", "arguments": {"a": 1}}'),
                       ev.EvalExample("a:2", [{"role": "user", "content": "say ok"}], "ok")]  # fmt: skip
    scored = Scored(0.5, {"eval_loss": 1.0, "perplexity": 2.7}, tuned)
    report = scorer.report(Scored(0.0, {"eval_loss": 2.0, "perplexity": 7.4}, ["", ""]), scored, [])
    assert [row["correct"] for row in report.samples] == correct
    assert list(report.samples[0])[:5] == ["prompt", "reference", "base", "fine-tuned", "correct"]


@pytest.mark.parametrize(
    "reply, reference, correct",
    [('{"name": "f", "arguments": {}}', '{"name": "f", "arguments": {}}', True),
     ('{"name": "g", "arguments": {}}', '{"name": "f", "arguments": {}}', False),
     ("Paris ", '"Paris"', True), ("Paris", "Paris", True), ("Lyon", '"Paris"', False), ("x", None, None)],
)  # fmt: skip
def test_same_answer(reply, reference, correct):
    assert same_answer(reply, reference) is correct


def test_published_model_says_which_gguf_shipped_and_its_metric_or_why_none():
    no_mlx = {"shipped": None, "files": {}, "reason": MLX_OFF}
    made = {
        "gguf": {"shipped": "acks-v1-f16.gguf", "files": {"acks-v1-f16.gguf": {"qtype": "f16", "bytes": 12_345_678}}},
        "mlx": no_mlx,
    }
    shipped = shipped_metadata(gate(0.0, 0.95, 0.9), made)
    assert shipped["result"] == "exact_match: base 0.000 → fine-tuned 0.950 → shipped f16 GGUF 0.900 (no MLX shipped)"
    assert shipped["shipped_mlx"] == f"none: {MLX_OFF}"
    assert shipped["shipped_gguf"] == "acks-v1-f16.gguf" and shipped["gguf_mb"] == dg.MetadataValue.float(12.35)
    assert not {"metric", "base_metric", "finetuned_metric", "gguf_metric"} & set(shipped)  # the result says them once
    none = shipped_metadata(
        gate(0.0, 0.95, None), {"gguf": {"shipped": None, "files": {}, "reason": OFF}, "mlx": no_mlx}
    )
    assert none["shipped_gguf"] == f"none: {OFF}" and "gguf_metric" not in none
    assert none["result"] == "exact_match: base 0.000 → fine-tuned 0.950 (no GGUF shipped) (no MLX shipped)"


def test_a_scorer_gives_each_shipped_export_its_column_and_figure():
    scorer = ChatScorer("exact_match", 10, 8, {})
    scorer.examples = [ev.EvalExample("a:1", [{"role": "user", "content": "say ok"}], "ok")]
    tuned = Scored(1.0, {"eval_loss": 1.0, "perplexity": 2.7}, ["ok"])
    columns = [Shipped("gguf", "GGUF f16 (llama.cpp)", Scored(1.0, answers=["ok"])),
               Shipped("other", "Other 4bit (runtime)", Scored(0.0, answers=["no"]))]  # fmt: skip
    report = scorer.report(Scored(0.0, {"eval_loss": 2.0, "perplexity": 7.4}, ["hm"]), tuned, columns)
    assert report.comparison[0] == {"": "exact_match", "base": 0.0, "fine-tuned": 1.0, "GGUF f16 (llama.cpp)": 1.0,
                                    "Other 4bit (runtime)": 0.0}  # fmt: skip
    assert (report.samples[0]["GGUF f16 (llama.cpp)"], report.samples[0]["Other 4bit (runtime)"]) == ("ok", "no")
    assert (report.tracked["gguf_exact_match"], report.tracked["other_exact_match"]) == (1.0, 0.0)
