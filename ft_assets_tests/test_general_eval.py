"""General-ability checks: lm-eval tasks on the base, the fine-tuned model and the shipped GGUF, and the gate.

A local lm-eval task of 30 items (``support.write_general_tasks``: km to m, a local JSONL through ``include_path``)
that the random tiny model fails (exact match 0), that a model taught it passes (1.0), and that the taught model
forgets when fine-tuned hard on other data (0.07) but keeps when fine-tuned lightly (0.97). The harness runs on
real models through lm-eval's own ``hf`` model; the GGUF through a real llama.cpp server (``local-completions``).
The task shipped with the package (``ft-general-mini``, general_eval's default) is checked here as a file, a
dataset and a scorer, and run through lm-eval on a tiny model taught its answers; the session's published run
(``published.py``, ``test_pipeline.py``) runs it as the default on the base, the merged model and the GGUF.
"""

from __future__ import annotations

import shutil

import pytest

from ft_assets.delivery import harness, regression
from ft_assets.delivery.config import GeneralEvalConfig
from ft_assets.delivery.exports.gguf import NO_PROMPT_LOGPROBS, LlamaCpp
from ft_assets.delivery.general_tasks import ft_general_mini
from ft_assets.delivery.regression import BLOCK, WARN, Score
from ft_assets_tests.support import ANSWER, KM_ITEMS, KM_TASK, km_conversations, teach, write_general_tasks

CHOICE = f"{KM_TASK}_choice"

# (case, base, model, higher is better, max_drop, z, regressed, within noise)
JUDGEMENTS = [
    ("no drop", Score(0.9, 0.05), Score(0.9, 0.05), True, 0.05, 1.0, False, False),
    ("a drop within max_drop", Score(0.9, 0.0), Score(0.86, 0.0), True, 0.05, 1.0, False, False),
    ("a drop beyond max_drop and the noise", Score(1.0, 0.0), Score(0.07, 0.05), True, 0.05, 1.0, True, False),
    ("a drop beyond max_drop but within the noise", Score(0.5, 0.09), Score(0.35, 0.09), True, 0.05, 1.0, False, True),
    ("the same drop with z = 0 counts", Score(0.5, 0.09), Score(0.35, 0.09), True, 0.05, 0.0, True, False),
    ("lower is better: a rise is the drop", Score(2.0, 0.0), Score(2.5, 0.0), False, 0.1, 1.0, True, False),
    ("lower is better: a fall is no drop", Score(2.0, 0.0), Score(1.0, 0.0), False, 0.1, 1.0, False, False),
    ("no stderr: no allowance for noise", Score(0.9, None), Score(0.8, None), True, 0.05, 1.0, True, False),
    (
        "a refused model is not judged",
        Score(0.9, 0.0),
        Score(None, refused="no logprobs"),
        True,
        0.05,
        1.0,
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    "case, base, model, higher, max_drop, z, regressed, within", JUDGEMENTS, ids=[c[0] for c in JUDGEMENTS]
)
def test_a_model_against_its_base(case, base, model, higher, max_drop, z, regressed, within):
    judged = regression.judge_model(base, model, higher, max_drop, z)
    assert (judged.regressed, judged.within_noise) == (regressed, within)
    if model.refused:
        assert judged.drop is None and judged.refused == "no logprobs"


def _verdict(on_regression: str, finetuned: float, shipped: float | None = None) -> regression.GeneralVerdict:
    scores = {"base": {KM_TASK: Score(1.0, 0.0)}, "finetuned": {KM_TASK: Score(finetuned, 0.05)}}
    if shipped is not None:
        scores["gguf"] = {KM_TASK: Score(shipped, 0.05)}
    return regression.judge(
        scores, {KM_TASK: ("exact_match,none", True)}, 0.05, {}, 1.0, on_regression, 60, 12.0,
        {"finetuned": "fine-tuned", "gguf": "shipped GGUF f16"},
    )  # fmt: skip


def test_the_verdict_blocks_or_warns_as_configured_and_round_trips():
    blocked, warned, kept = _verdict(BLOCK, 0.07), _verdict(WARN, 0.07), _verdict(BLOCK, 0.97, shipped=0.2)
    assert blocked.regressed and blocked.blocks
    assert warned.regressed and not warned.blocks
    assert blocked.lines == [
        f"{KM_TASK} exact_match: base 1.000 → fine-tuned 0.070, a drop of 0.930 (at most 0.050 + 0.050 noise, 1 stderr)"
    ]
    assert kept.tasks[KM_TASK].regressed == ["gguf"] and "shipped GGUF f16 0.200" in kept.lines[0]
    again = regression.GeneralVerdict.of(kept.as_dict())
    assert again == kept and again.as_dict()["blocks"] is True
    assert kept.flat()["general.regressed"] is True and kept.flat()[f"general.{KM_TASK}.gguf"] == 0.2
    with pytest.raises(ValueError, match="choose block or warn"):
        _verdict("stop", 0.5)
    assert not regression.off("no tasks").blocks and regression.off("no tasks").reason == "no tasks"


def test_task_entries_are_names_or_local_files(tmp_path):
    paths = write_general_tasks(tmp_path)
    specs = harness.task_specs([str(paths[KM_TASK]), "gsm8k"])
    assert [(s.name, s.path) for s in specs] == [(KM_TASK, paths[KM_TASK]), ("gsm8k", None)]
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\n")
    for entries, message in [
        ([str(tmp_path / "nameless.yaml")], "has no 'task: <name>' key"),
        ([str(tmp_path / "missing.yaml")], "cannot read the task file"),
        ([str(paths[KM_TASK]), str(paths[KM_TASK])], f"task {KM_TASK} is listed twice"),
    ]:
        with pytest.raises(harness.HarnessError, match=message):
            harness.task_specs(entries)


@pytest.fixture(scope="module")
def km_models(tmp_path_factory, one_cpu_thread):
    """The random tiny model (fails km_to_m), one taught it, and the taught one fine-tuned on acknowledgements: lightly
    (keeps it) and hard (forgets it). ~45 s on one core."""
    from ft_assets_tests.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("km-models")
    acks = [
        [{"role": "user", "content": f"Request number {i}: please acknowledge item {i * 7 % 1000}."},
         {"role": "assistant", "content": ANSWER}]
        for i in range(240)
    ]  # fmt: skip
    words = [f"{q} {a}" for q, a in KM_ITEMS[:5]] + [f"{acks[3][0]['content']} {ANSWER}"]
    base = build_tiny_model(root / "base", extra_text=words)
    taught = teach(shutil.copytree(base, root / "taught"), km_conversations(), 100)
    light = teach(shutil.copytree(taught, root / "light"), acks, 20, lr=1e-3)
    hard = teach(shutil.copytree(taught, root / "hard"), acks, 60, lr=3e-3)
    return {"base": base, "taught": taught, "light": light, "hard": hard}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    paths = write_general_tasks(tmp_path_factory.mktemp("general-tasks"))
    return harness.load_suite(harness.task_specs([str(paths[KM_TASK]), str(paths[CHOICE])]))


SETTINGS = harness.RunSettings(limit=30, seed=1234, apply_chat_template=True)


@pytest.fixture(scope="module")
def km_scores(km_models, suite):
    """Each model's scores on both tasks, through lm-eval's hf model."""
    return {
        name: {s.task: s for s in harness.evaluate(harness.hf_model(path, name), suite, SETTINGS, print)[0]}
        for name, path in km_models.items()
    }


def test_the_suite_knows_each_tasks_request_type(suite):
    assert suite.output_types == {KM_TASK: {"generate_until"}, CHOICE: {"multiple_choice"}}


def test_lm_eval_scores_what_each_model_knows(km_scores):
    exact = {name: scores[KM_TASK].value for name, scores in km_scores.items()}
    assert exact["base"] == 0.0 and exact["taught"] == 1.0
    assert exact["light"] >= 0.9 and exact["hard"] <= 0.3, exact
    taught = km_scores["taught"][KM_TASK]
    assert (taught.metric, taught.items, taught.output_type, taught.higher_is_better) == (
        "exact_match,none",
        30,
        "generate_until",
        True,
    )
    assert km_scores["hard"][KM_TASK].stderr > 0  # lm-eval's stderr of the mean, 30 items
    choice = {name: scores[CHOICE].value for name, scores in km_scores.items()}
    assert km_scores["taught"][CHOICE].metric == "acc,none" and choice["taught"] == choice["light"] == 1.0
    assert choice["base"] <= 0.6 and choice["hard"] <= 0.85, choice  # the wrong choice is as long: chance is 0.5


def _judged(km_scores, base: str, tuned: str, on_regression: str = BLOCK) -> regression.GeneralVerdict:
    def score(s):
        return Score(s.value, s.stderr, s.refused)

    scores = {"base": km_scores[base], "finetuned": km_scores[tuned]}
    metrics = {task: (s.metric, s.higher_is_better) for task, s in km_scores[base].items()}
    return regression.judge(
        {key: {t: score(s) for t, s in by_task.items()} for key, by_task in scores.items()},
        metrics, 0.05, {}, 1.0, on_regression, 120, 10.0, {"finetuned": "fine-tuned"},
    )  # fmt: skip


def test_the_gate_blocks_a_model_that_forgot_and_lets_one_that_kept_through(km_scores):
    forgot = _judged(km_scores, "taught", "hard")
    assert forgot.blocks and forgot.tasks[KM_TASK].regressed == ["finetuned"]
    assert forgot.lines[0].startswith(f"{KM_TASK} exact_match: base 1.000 → fine-tuned ")
    assert forgot.tasks[CHOICE].regressed == ["finetuned"]  # the log-likelihood task fell too (1.0 → 0.8)
    assert forgot.lines[1].startswith(f"{CHOICE} acc: base 1.000 → fine-tuned 0.800")
    kept = _judged(km_scores, "taught", "light")
    assert not kept.regressed and not kept.blocks, kept.lines
    learned = _judged(km_scores, "base", "taught")  # a gain is never a regression
    assert not learned.regressed and learned.tasks[KM_TASK].models["finetuned"].drop == -1.0
    assert not _judged(km_scores, "taught", "hard", WARN).blocks


@pytest.mark.integration
def test_the_shipped_gguf_answers_through_a_real_llama_cpp_server(km_models, suite, tmp_path):
    """The taught model's F16 GGUF behind llama.cpp's OpenAI-compatible server, as lm-eval's local-completions model:
    the generate_until task scores what the merged model scores; the multiple-choice one is refused, saying why."""
    from ft_assets.delivery.gguf_export import export_gguf

    path = tmp_path / "taught-f16.gguf"
    export_gguf(km_models["taught"], path, "f16", name="taught")
    with LlamaCpp(path).harness(km_models["taught"], "shipped GGUF f16", chat=True) as model:
        assert model.model == "local-chat-completions" and model.output_types == {"generate_until"}
        scores, answers = harness.evaluate(model, suite, SETTINGS, print)
    by_task = {s.task: s for s in scores}
    assert by_task[KM_TASK].value == 1.0 and by_task[KM_TASK].items == 30
    assert answers[KM_TASK][0]["response"] == "1000"
    assert by_task[CHOICE].value is None
    assert by_task[CHOICE].refused == f"multiple_choice requests: {NO_PROMPT_LOGPROBS}"
    plain = harness.RunSettings(limit=30, apply_chat_template=False)  # the prompt as text: /v1/completions
    written = harness.load_suite(harness.task_specs([str(suite.specs[0].path.parent / f"{KM_TASK}_plain.yaml")]))
    hf = harness.evaluate(harness.hf_model(km_models["taught"], "merged"), written, plain, print)
    with LlamaCpp(path).harness(km_models["taught"], "shipped GGUF f16", chat=False) as model:
        assert model.model == "local-completions"
        served = harness.evaluate(model, written, plain, print)
    assert served[0][0].value == hf[0][0].value == 1.0 and served[0][0].items == 30
    assert [a["response"] for a in served[1][f"{KM_TASK}_plain"]] == [a["response"] for a in hf[1][f"{KM_TASK}_plain"]]


@pytest.mark.integration
def test_the_shipped_mlx_folder_answers_through_mlx_lms_server(km_models, suite, tmp_path, with_mlx):
    """The taught model as an mlx-lm bf16 folder behind ``mlx_lm server`` (as a Mac serves it), as lm-eval's
    local-chat-completions model: the generate_until task scores what the merged model scores; the multiple-choice
    one is refused, saying why."""
    pytest.importorskip("mlx.core", reason="the [mlx] extra (mlx, mlx-lm) is not installed")
    from ft_assets.delivery.exports import mlx

    folder = tmp_path / "taught-bf16"
    mlx.convert(km_models["taught"], folder, "bf16", 64)
    with mlx.MlxLm(folder).harness(km_models["taught"], "shipped MLX bf16", chat=True) as model:
        assert model.model == "local-chat-completions" and model.output_types == {"generate_until"}
        scores, answers = harness.evaluate(model, suite, SETTINGS, print)
    by_task = {s.task: s for s in scores}
    assert by_task[KM_TASK].value == 1.0 and by_task[KM_TASK].items == 30
    assert answers[KM_TASK][0]["response"] == "1000"
    assert by_task[CHOICE].refused == f"multiple_choice requests: {mlx.NO_PROMPT_LOGPROBS}"


@pytest.mark.integration
@pytest.mark.parametrize("family", ["qwen2.5", "gemma2"])
def test_other_families_score_through_hf_and_their_shipped_gguf(family, suite, tmp_path):
    """A random tiny model of another family (Qwen2.5: ChatML, q/k/v biases; Gemma 2: turns with no system role,
    soft-capping, sliding window) through lm-eval's hf model with its own chat template, both request types; and its
    F16 GGUF through llama.cpp's server with the template embedded in the file, answering the generate_until task."""
    from ft_assets.delivery.gguf_export import export_gguf
    from ft_assets_tests.families import build_family

    model_dir = build_family(family, tmp_path / family)
    scores, answers = harness.evaluate(harness.hf_model(model_dir, family), suite, SETTINGS, print)
    by_task = {s.task: s for s in scores}
    assert (by_task[KM_TASK].items, by_task[CHOICE].items) == (30, 30)
    assert by_task[KM_TASK].value is not None and by_task[CHOICE].value is not None and len(answers[KM_TASK]) == 30
    path = tmp_path / f"{family}-f16.gguf"
    export_gguf(model_dir, path, "f16", name=family)
    with LlamaCpp(path).harness(model_dir, f"shipped GGUF f16 ({family})", chat=True) as model:
        served, served_answers = harness.evaluate(model, suite, SETTINGS, print)
    served = {s.task: s for s in served}
    assert served[KM_TASK].items == 30 and served[KM_TASK].value is not None and len(served_answers[KM_TASK]) == 30
    assert served[CHOICE].refused == f"multiple_choice requests: {NO_PROMPT_LOGPROBS}"


# --- the task shipped with the package: ft-general-mini, general_eval's default ---------------------------------

MINI = harness.DEFAULT_TASK


def test_the_shipped_task_is_general_evals_default_and_reads_as_a_name_or_a_file():
    assert MINI == "ft-general-mini" and GeneralEvalConfig().tasks == [MINI]
    assert MINI in GeneralEvalConfig.model_fields["tasks"].description  # the launchpad names it
    (spec,) = harness.task_specs(GeneralEvalConfig().tasks)
    assert spec == harness.TaskSpec(MINI, harness.SHIPPED[MINI]) and spec.path.is_file()
    assert harness.task_specs([str(spec.path)]) == [spec]  # its file by path: lm-eval's !function tags read too
    assert harness.load_suite([spec]).output_types == {MINI: {"generate_until"}}  # what a shipped file's server answers


def test_the_shipped_items_have_answers_their_questions_do_not_give_away():
    rows = list(ft_general_mini.load()["test"])
    assert len(rows) == 24 and len({row["question"] for row in rows}) == 24
    for row in rows:
        assert row["answers"] and all(isinstance(a, str) and a.strip() for a in row["answers"]), row
        assert not any(ft_general_mini.words(a) in ft_general_mini.words(row["question"]) for a in row["answers"]), row


# (reply, accepted answers, score): the reply's words hold an answer's words, whole
REPLIES = [
    ("The capital of France is Paris", ["Paris"], 1.0),
    ("PARIS", ["Paris"], 1.0),
    ("Parisian cafes", ["Paris"], 0.0),
    ("The chemical symbol for water is H2O", ["H2O"], 1.0),
    ("The largest animal on Earth is the Blue Whale", ["blue whale"], 1.0),
    ("A whale that is blue", ["blue whale"], 0.0),
    ("The answer is 14", ["4", "four"], 0.0),
    ("Four", ["4", "four"], 1.0),
    ("", ["Paris"], 0.0),
]


@pytest.mark.parametrize("reply, answers, expected", REPLIES, ids=[f"{r!r}: {a}" for r, a, _ in REPLIES])
def test_a_reply_scores_when_it_names_an_accepted_answer(reply, answers, expected):
    assert ft_general_mini.score({"answers": answers}, [reply]) == {"names_answer": expected}


@pytest.fixture(scope="module")
def mini_models(tmp_path_factory, one_cpu_thread):
    """The random tiny model (knows none of ft-general-mini) and one taught its 24 answers."""
    from ft_assets_tests.tiny import build_tiny_model

    rows = list(ft_general_mini.load()["test"])
    chats = [
        [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answers"][0]}] for r in rows
    ]
    root = tmp_path_factory.mktemp("mini-models")
    base = build_tiny_model(root / "base", extra_text=[f"{r['question']} {r['answers'][0]}" for r in rows])
    return {"base": base, "taught": teach(shutil.copytree(base, root / "taught"), chats, 100)}


def test_the_shipped_task_runs_in_lm_eval_and_the_gate_holds_a_loss_on_it(mini_models):
    """Through lm-eval's hf model, in batches: the taught model names the answers, the random one does not; judged
    with the taught one as the base, the random one regressed on it, and the verdict's line says so."""
    suite = harness.load_suite(harness.task_specs([MINI]))
    settings = harness.RunSettings(limit=None, seed=1234, apply_chat_template=True)
    scores = {
        name: harness.evaluate(harness.hf_model(path, name, batch_size=8), suite, settings, print)[0][0]
        for name, path in mini_models.items()
    }
    taught, base = scores["taught"], scores["base"]
    assert (taught.metric, taught.items, taught.output_type) == ("names_answer,none", 24, "generate_until")
    assert taught.value >= 0.9 and base.value <= 0.2 and taught.stderr is not None, (taught, base)
    verdict = regression.judge(
        {"base": {MINI: Score(taught.value, taught.stderr)}, "finetuned": {MINI: Score(base.value, base.stderr)}},
        {MINI: (taught.metric, taught.higher_is_better)}, 0.05, {}, 1.0, BLOCK, 48, 1.0, {"finetuned": "fine-tuned"},
    )  # fmt: skip
    assert verdict.blocks and verdict.lines[0].startswith(f"{MINI} names_answer: base {taught.value:.3f} → fine-tuned")
    assert verdict.chains({"finetuned": "fine-tuned"}) == {
        MINI: f"names_answer: base {taught.value:.3f} → fine-tuned {base.value:.3f}"
    }


# (tasks, lm-eval installed, why the check is off: None when it runs)
OFF = [
    ([MINI], True, None),
    ([], True, "no general-ability tasks (general_eval.tasks: [])"),
    ([MINI], False, f"{MINI} not run: lm-eval is not installed (install the lmeval extra"),
    (["gsm8k"], False, None),  # a task the user named: the run fails, saying to install lm-eval
    ([MINI, "gsm8k"], False, None),
]


@pytest.mark.parametrize("tasks, installed, reason", OFF, ids=[f"{t} installed={i}" for t, i, _ in OFF])
def test_the_default_check_is_off_only_without_tasks_or_without_lm_eval(tasks, installed, reason):
    from ft_assets.delivery.assets import general_off

    off = general_off(tasks, installed)
    assert off == reason if reason is None or reason.endswith("[])") else off.startswith(reason), off


def test_the_run_summary_names_each_models_figure_and_which_fell():
    from ft_assets.cli.summaries import general_line, general_summary

    kept = general_summary(_verdict(BLOCK, 0.97, shipped=0.97).as_dict())
    assert general_line(kept) == (
        f"  general (lm-eval): {KM_TASK} exact_match: base 1.000 → fine-tuned 0.970 → shipped GGUF 0.970; kept (60 items, 12 s)"
    )
    fell = general_summary(_verdict(WARN, 0.07, shipped=0.2).as_dict())
    assert general_line(fell).endswith(
        f"0.200; REGRESSED (warn): {KM_TASK} on fine-tuned, shipped GGUF (60 items, 12 s)"
    )
    off = general_summary(regression.off("no general-ability tasks (general_eval.tasks: [])").as_dict())
    assert general_line(off) == "  general (lm-eval): no general-ability tasks (general_eval.tasks: [])"
