"""Exports as one mechanism (``ft_assets.delivery.exports``), at the function level: every registered export has its
pieces wherever the run uses it; the GGUF export of Phi-3 with a GPT-2-style BPE loads in real llama.cpp; an export
refused by its converter or runtime is dropped with one line, and fails the run when its settings say ``required``.

The same refusal through a whole run (published without the export, the reason in metadata, lineage and ``--json``) is
``test_export_dropped.py``.
"""

from __future__ import annotations

import logging
import re

import dagster as dg
import pytest

from ft_assets.cli.summaries import export_lines, export_summary
from ft_assets.control.jobs import delivery_plane
from ft_assets.definitions import defs
from ft_assets.delivery.assets import export_outcome, score_exports
from ft_assets.delivery.config import export_config
from ft_assets.delivery.exports import EXPORTS
from ft_assets.delivery.exports.gguf import GGUF, OFF, GgufSettings
from ft_assets.delivery.exports.mlx import OFF as MLX_OFF
from ft_assets.delivery.exports.protocol import ExportRefused, ExportSettings, one_line
from ft_assets.delivery.lineage import LINEAGE_CHAIN
from ft_assets.delivery import evaluate as ev
from ft_assets.delivery.scoring import ChatScorer
from ft_assets.storage import LocalStore
from ft_assets_tests.families import build_family

LOG = logging.getLogger("ft_assets_tests.exports")
REQUIRED = "GGUF is required (gguf_model config required: true) and was refused: "


def test_every_export_has_its_pieces(tmp_path):
    """The checklist of the registration line: each export's asset, blocking check, lineage link, launchpad config,
    summary keys and runtime (eval answers, pair log-probabilities, lm-eval's model of the file for general_eval) come
    from its entry in EXPORTS, and no two exports share a name, an asset or a folder."""
    assert len({e.name for e in EXPORTS}) == len({e.asset for e in EXPORTS}) == len(EXPORTS)
    checks = {key.name for key in defs.resolve_asset_graph().asset_check_keys}
    job_assets = {key.to_user_string() for key in delivery_plane.resolve(asset_graph=defs.resolve_asset_graph()).asset_layer.executable_asset_keys}  # fmt: skip
    for export in EXPORTS:
        assert issubclass(export.settings, ExportSettings) and export.settings().required is False
        assert set(export_config(export.settings).model_fields) == set(export.settings.model_fields)
        assert defs.get_assets_def(export.asset).descriptions_by_key[dg.AssetKey(export.asset)] == export.description
        assert f"shipped_{export.name}_keeps_the_metric" in checks and export.asset in job_assets
        assert all(callable(getattr(export.runtime, name, None)) for name in ("chat_answers", "pair_logps", "harness"))
        assert (
            LINEAGE_CHAIN.index("merged_model") < LINEAGE_CHAIN.index(export.asset) < LINEAGE_CHAIN.index("eval_report")
        )
        store = LocalStore(tmp_path)
        store.put_json(f"runs/t/v1/refs/{export.asset}.json", {"prefix": f"runs/t/v1/{export.name}"})
        keys = export_summary(store, "t@v1", export, {"exports": {export.name: {"file": "f", "variant": "v", "metric": 1.0,
                                                                              "drop": 0.0, "reason": None}}})  # fmt: skip
        assert set(keys) == {f"{export.name}_{k}" for k in ("file", export.variant, "metric", "drop", "uri", "reason")}


def test_the_run_summary_has_a_line_per_export_shipped_or_not():
    shipped = {"metric_name": "exact_match", "gguf_uri": "/s/m-q8_0.gguf", "gguf_qtype": "q8_0", "gguf_metric": 0.9,
               "mlx_uri": "/s/m-mlx-bf16", "mlx_variant": "bf16", "mlx_metric": 0.85}  # fmt: skip
    assert export_lines(shipped) == [
        "  GGUF: /s/m-q8_0.gguf (q8_0, exact_match 0.900 in llama.cpp)",
        "  MLX: /s/m-mlx-bf16 (bf16, exact_match 0.850 in mlx-lm)",
    ]
    assert export_lines(
        {"metric_name": "exact_match", "gguf_uri": None, "gguf_reason": OFF, "mlx_uri": None, "mlx_reason": MLX_OFF}
    ) == [f"  GGUF: none ({OFF})", f"  MLX: none ({MLX_OFF})"]


def test_a_refusal_is_one_line():
    converter_failure = (
        "llama.cpp's converter failed on /m (exit 1):\nTraceback (most recent call last):\n  ...\nKeyError: 'x'"
    )
    assert one_line(converter_failure) == "llama.cpp's converter failed on /m (exit 1): … KeyError: 'x'"
    assert (
        one_line("a\n\n  b  c ") == "a … b c" and one_line("") == "no reason given" and len(one_line("x" * 999)) == 400
    )


def never_made():
    raise AssertionError("an export that is off or refused by its settings makes nothing")


SETTINGS_CASES = [  # settings -> (the reason it ships nothing | the Failure that stops the run)
    ("off", GgufSettings(qtypes=[]), OFF, None),
    ("off but required", GgufSettings(qtypes=[], required=True), None,
     f"gguf_model config: required is true, but {OFF}"),
    ("unknown type", GgufSettings(qtypes=["q3"]), None, "gguf_model config qtypes=['q3']: choose from f32, f16, q8_0"),
    ("ship not exported", GgufSettings(qtypes=["f16"], ship="q8_0"), None,
     "gguf_model config ship='q8_0': 'auto' or one of the exported qtypes ['f16']"),
]  # fmt: skip


@pytest.mark.parametrize("case, settings, reason, failure", SETTINGS_CASES, ids=[c[0] for c in SETTINGS_CASES])
def test_settings_that_make_nothing_say_why_before_any_work(case, settings, reason, failure):
    if failure:
        with pytest.raises(dg.Failure, match=f"^{re.escape(failure)}"):
            export_outcome(GGUF, settings, never_made, LOG)
    else:
        assert export_outcome(GGUF, settings, never_made, LOG) == (None, reason)


@pytest.mark.integration
def test_the_gguf_export_of_phi3_with_a_byte_level_bpe_loads_in_llamacpp(tmp_path):
    """The issue's model: Phi-3's architecture (fused qkv_proj, gate_up_proj) with a GPT-2-style BPE, in a run named after
    Phi-3 (converter.general_name). The shipped file loads in llama_cpp.Llama and answers through the export's runtime."""
    import llama_cpp

    model = build_family("phi3", tmp_path / "phi3")
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(), work.mkdir()
    made = GGUF.make(model, out, work, "phi3-acks-v1", GgufSettings(qtypes=["f16"], verify=False), LOG)
    assert made.shipped == "phi3-acks-v1-f16.gguf" and made.files[made.shipped]["llamacpp"]["tokens_match"]
    assert (out / "Modelfile").read_text().startswith(f"FROM ./{made.shipped}\n")
    llm = llama_cpp.Llama(model_path=str(out / made.shipped), n_ctx=256, verbose=False)
    assert llm.metadata["general.architecture"] == "phi3"
    llm.close()
    answers = GGUF.runtime(out / made.shipped).chat_answers([[{"role": "user", "content": "Say hi."}]], 4, LOG.info)
    assert len(answers) == 1 and isinstance(answers[0], str)


def test_a_model_the_export_cannot_take_is_dropped_or_fails_the_run_when_required(tmp_path):
    """Refused before the converter starts (no config.json; an architecture the converter has no layout for is refused
    the same way from its child process: test_gguf_export.test_refusals_are_one_line)."""
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(), work.mkdir()
    settings = GgufSettings(qtypes=["f16"], verify=False)
    made, reason = export_outcome(GGUF, settings, lambda: GGUF.make(tmp_path, out, work, "m-v1", settings, LOG), LOG)
    said = f"{tmp_path / 'config.json'} not found; export_gguf needs a Hugging Face model directory"
    assert made is None and reason == said
    required = GgufSettings(qtypes=["f16"], verify=False, required=True)
    with pytest.raises(dg.Failure, match=f"^{re.escape(REQUIRED + said)}$"):
        export_outcome(GGUF, required, lambda: GGUF.make(tmp_path, out, work, "m-v1", required, LOG), LOG)


@pytest.mark.integration
def test_a_file_the_runtime_refuses_at_eval_is_dropped_or_fails_the_run_when_required(tmp_path):
    """A shipped file llama.cpp cannot load when eval_report asks it the eval prompts (here: a corrupt one)."""
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "m-f16.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ExportRefused, match=r"^llama.cpp cannot load m-f16.gguf: ") as refused:
        GGUF.runtime(tmp_path / "gguf" / "m-f16.gguf").chat_answers([[{"role": "user", "content": "hi"}]], 4, LOG.info)
    assert "\n" not in str(refused.value) and str(tmp_path) not in str(refused.value)
    scorer = ChatScorer("exact_match", 1, 4, {})
    scorer.examples = [ev.EvalExample("a:1", [{"role": "user", "content": "say ok"}], "ok")]

    def made(required: bool) -> dict:
        stats = {"export": "gguf", "files": {"m-f16.gguf": {"qtype": "f16"}}, "shipped": "m-f16.gguf", "reason": None,
                 "required": required, "max_drop": 0.05}  # fmt: skip
        no_mlx = {"export": "mlx", "files": {}, "shipped": None, "reason": MLX_OFF, "required": False, "max_drop": 0.05}
        return {"gguf": {"asset": "gguf_model", "partition": "t@v1", "uri": str(tmp_path), "stats": stats},
                "mlx": {"asset": "mlx_model", "partition": "t@v1", "uri": str(tmp_path), "stats": no_mlx}}  # fmt: skip

    fetch = lambda ref, name, include=None: tmp_path / name  # noqa: E731 - the file is already there
    columns, verdicts = score_exports(scorer, made(False), fetch, 1.0, 1, LOG)
    assert columns == [] and verdicts["gguf"].file is None and verdicts["gguf"].within_drop
    assert verdicts["gguf"].reason.startswith(
        "llama.cpp could not answer the eval prompts with m-f16.gguf: llama.cpp cannot load"
    )
    with pytest.raises(dg.Failure, match=f"^{re.escape(REQUIRED)}llama.cpp could not answer the eval prompts"):
        score_exports(scorer, made(True), fetch, 1.0, 1, LOG)
