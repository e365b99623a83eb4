"""Which GGUF ships, and the gate it must pass: plain functions, no llama.cpp needed."""

from dataclasses import asdict

import pytest

from ft_assets.delivery.gate import Gate, dropped, gate, shipped
from ft_assets.delivery.gguf_export import GgufExportError, modelfile_gguf, write_modelfile
from ft_assets.delivery.llamacpp import choose_shipped
from ft_assets.delivery.lineage import build_lineage, exports_of
from ft_assets_tests.support import lineage_refs
from ft_assets_tests.tiny import CHATML_TEMPLATE

# name -> qtype, MB, relative logit error through llama.cpp: SmolLM2-135M's (benchmarks/results/gguf_runtime.json)
FILES = {
    f"m-{qtype}.gguf": {"qtype": qtype, "bytes": int(mb * 1e6), "llamacpp": {"rel_error": error}}
    for qtype, mb, error in [
        ("f16", 270.9, 0.0019),
        ("q8_0", 144.8, 0.048),
        ("q6_k", 138.4, 0.067),
        ("q5_k_m", 112.1, 0.27),
        ("q4_k_m", 105.5, 0.14),
    ]
}

SHIP_CASES = [
    ("auto: smallest within tolerance", "auto", 0.05, "m-q8_0.gguf"),
    ("auto: looser tolerance, smaller file", "auto", 0.15, "m-q4_k_m.gguf"),
    ("auto: none within, the most accurate", "auto", 0.001, "m-f16.gguf"),
    ("named type", "q6_k", 0.05, "m-q6_k.gguf"),
]


@pytest.mark.parametrize("case, ship, max_rel_error, shipped", SHIP_CASES, ids=[c[0] for c in SHIP_CASES])
def test_choose_shipped(case, ship, max_rel_error, shipped):
    assert choose_shipped(FILES, ship, max_rel_error) == shipped


def test_choose_shipped_refuses_a_type_not_exported():
    with pytest.raises(ValueError, match="q4_0"):
        choose_shipped(FILES, "q4_0", 0.05)


GATE_CASES = [  # base, fine-tuned, gguf (None: none ships) -> beats_base, gguf within its drop
    ("both hold", 0.1, 0.9, 0.9, True, True),
    ("gguf a little worse", 0.1, 0.9, 0.86, True, True),
    ("gguf too much worse", 0.1, 0.9, 0.8, True, False),
    ("gguf better", 0.1, 0.9, 1.0, True, True),
    ("no improvement", 0.5, 0.52, 0.52, False, True),
    ("no gguf shipped", 0.1, 0.9, None, True, True),
    ("no gguf, no improvement", 0.5, 0.52, None, False, True),
]


@pytest.mark.parametrize("case, base, tuned, gguf, beats_base, within", GATE_CASES, ids=[c[0] for c in GATE_CASES])
def test_gate(case, base, tuned, gguf, beats_base, within):
    export = dropped("refused", 0.05) if gguf is None else shipped("m-f16.gguf", "f16", gguf, tuned, max_drop=0.05)
    verdict = gate("exact_match", base, tuned, 0.05, {"gguf": export})
    assert (verdict.beats_base, verdict.exports["gguf"].within_drop) == (beats_base, within)
    assert verdict.passed == (beats_base and within)
    assert verdict.exports["gguf"].drop == (None if gguf is None else pytest.approx(tuned - gguf))
    assert verdict.exports["gguf"].metric == gguf
    assert Gate.of({**verdict.as_dict(), "examples": 3}) == verdict  # read back from eval_report's stats


def test_every_export_must_keep_the_metric_for_the_gate_to_pass():
    exports = {"gguf": shipped("m.gguf", "f16", 0.9, 0.9, 0.05), "other": shipped("m", "4bit", 0.7, 0.9, 0.1)}
    verdict = gate("exact_match", 0.1, 0.9, 0.05, exports)
    assert verdict.beats_base and not verdict.passed and not verdict.exports["other"].within_drop
    assert gate("exact_match", 0.1, 0.9, 0.05, {**exports, "other": shipped("m", "4bit", 0.85, 0.9, 0.1)}).passed
    assert verdict.flat()["other.drop"] == pytest.approx(0.2) and verdict.flat()["gguf.file"] == "m.gguf"


def test_modelfile_names_the_shipped_file(tmp_path):
    write_modelfile("acks-v1-q8_0.gguf", tmp_path / "Modelfile", CHATML_TEMPLATE)
    assert modelfile_gguf(tmp_path / "Modelfile") == "acks-v1-q8_0.gguf"
    (tmp_path / "Other").write_text('TEMPLATE """x"""\n')
    with pytest.raises(GgufExportError, match="no 'FROM ./<file>.gguf' line"):
        modelfile_gguf(tmp_path / "Other")


def test_lineage_of_a_model_published_without_a_gguf_says_why():
    refs = lineage_refs()
    reason = "llama.cpp cannot take this model: llama.cpp 0.3.36's converter has no GGUF layout for architecture FooForCausalLM"
    refs["gguf_model"]["stats"].update(files={}, shipped=None, reason=reason)
    refs["eval_report"]["stats"]["exports"]["gguf"] = asdict(dropped(reason, 0.05))
    lineage = build_lineage("toolcalls@v1", refs, "registry/toolcalls/v1/r1")
    assert lineage["exports"]["gguf"] == {"asset": "gguf_model", "shipped": None, "files": {}, "reason": reason}
    assert (lineage["eval"]["exports"]["gguf"]["file"], lineage["eval"]["exports"]["gguf"]["metric"]) == (None, None)
    assert [a["asset"] for a in lineage["artifacts"]][-4:] == [
        "gguf_model",
        "mlx_model",
        "general_eval",
        "eval_report",
    ]  # still an artifact, no files


def test_an_export_dropped_at_eval_lists_no_files_and_its_reason():
    """Made, but its runtime could not answer the eval prompts: the registry holds none of its files."""
    refs = lineage_refs()
    reason = "llama.cpp could not answer the eval prompts with m-q8_0.gguf: llama.cpp cannot load m-q8_0.gguf"
    refs["eval_report"]["stats"]["exports"]["gguf"] = asdict(dropped(reason, 0.05))
    lineage = build_lineage("toolcalls@v1", refs, "registry/toolcalls/v1/r1")
    assert (lineage["exports"]["gguf"]["files"], lineage["exports"]["gguf"]["reason"]) == ({}, reason)


def test_a_lineage_written_before_exports_reads_the_same():
    """A published model is never rewritten: lineage.json of an older ft-assets (gguf, gguf_reason) still reads."""
    old = {"gguf": {"m-f16.gguf": {"sha256": "cd" * 32}}, "gguf_reason": None, "eval": {"gguf_file": "m-f16.gguf"}}
    assert exports_of(old) == {
        "gguf": {"asset": "gguf_model", "shipped": "m-f16.gguf", "files": old["gguf"], "reason": None}
    }
    off = {"gguf": {}, "gguf_reason": "GGUF export is off (gguf_model qtypes: [])", "eval": {"gguf_file": None}}
    assert exports_of(off)["gguf"]["reason"] == off["gguf_reason"]
