"""General-ability tasks through EleutherAI's lm-evaluation-harness (``lm-eval`` 0.4.13): what did the fine-tune forget?

``eval_report`` measures the task the run was trained for; this module measures the others. A task is an lm-eval
task name (``gsm8k``, ``ifeval``, ``arc_easy``, ``mmlu``, ... for a worker with network or a warm Hugging Face
cache) or a local task file (an lm-eval YAML task over a local JSONL: ``dataset_path: json`` with
``dataset_kwargs.data_files``), found through ``TaskManager(include_path=<its folder>)``: that is how the test
suite runs offline. A task shipped with the package is named like an lm-eval one and read from its folder
(``SHIPPED``: ``ft-general-mini``, 24 short general-knowledge questions, the default of ``general_eval.tasks``;
``general_tasks/README.md``). ``evaluate`` runs each task on one model, alone, so each task's cost (items,
seconds) is its own:

- the base and the merged model through lm-eval's ``hf`` model on their local directories (``hf_model``);
- an export's shipped file through its runtime's server (GGUF: llama.cpp's OpenAI-compatible server, lm-eval's
  ``local-completions``). Such a model answers only some request types (``HarnessModel.output_types``): the
  others are refused per task with the runtime's reason, before any request is sent.

The trade-offs (timings on a 2-core CPU: docs/validation/planner-calibration.md):

- lm-eval's own task index (every task it ships: 14,685 names) takes ~30 s to build; a suite of local task
  files only indexes their folders (well under a second), so the default index is built only when a task is
  named rather than given as a file.
- ``limit`` takes each task's first N documents (lm-eval's ``limit``); ``seed`` seeds its few-shot sampling and
  generation. 30 items of a metric near 0.5 leave a standard error of ~0.09, which is why the gate
  (``delivery/regression.py``) allows for the stderr lm-eval reports rather than comparing bare means.
- ``bootstrap_iters`` is 1,000, not lm-eval's 100,000: the stderr of a mean (accuracy, exact match) is exact
  either way; a corpus metric (BLEU, chrF) gets a bootstrap standard error that is ~10x cheaper and about
  ±3% less precise.
- the model is loaded once per model (a 135M model: ~1 s from safetensors; a 7B: ~10 s on a GPU) and every
  task's requests go through it, ``batch_size`` documents at a time (on CPU, 8 at a time generates
  ft-general-mini's replies about 3x faster than one at a time).

lm-eval is the optional ``lmeval`` extra (``pip install 'ft-assets[lmeval]'``): imported inside the calls.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from ft_assets.vision import auto_class, model_has_vision

INSTALL_HINT = "install the lmeval extra: pip install 'ft-assets[lmeval]' (lm-eval 0.4.13)"
BOOTSTRAP_ITERS = 1000  # stderr of corpus metrics; a mean's stderr is exact whatever this is
OUTPUT_TYPES = ("generate_until", "loglikelihood", "loglikelihood_rolling", "multiple_choice")
SHIPPED_FOLDER = Path(__file__).with_name("general_tasks")  # package data: task files, their items and code
DEFAULT_TASK = "ft-general-mini"  # general_eval.tasks' default (general_tasks/README.md)
SHIPPED = {DEFAULT_TASK: SHIPPED_FOLDER / f"{DEFAULT_TASK}.yaml"}  # task name -> its file
SAMPLES_KEPT = 200  # per task and model, the answers kept in the store (the page shows a few)


class HarnessError(ValueError):
    """A task that cannot be run: unknown, unreadable, or failing in lm-eval; one line saying what and what to do."""


@dataclass(frozen=True)
class TaskSpec:
    """One entry of the ``tasks`` setting: a task lm-eval knows by name, or a local YAML task file."""

    name: str  # the task's name: the entry itself, or the file's ``task:`` key
    path: Path | None = None  # the local file; None: a name from lm-eval's own index


def task_specs(entries: list[str], where: str = "general_eval.tasks") -> list[TaskSpec]:
    """The ``tasks`` setting read: a task shipped with the package (``SHIPPED``) by its name, a ``.yaml``/``.yml``
    entry as a local task file (its ``task:`` names it), any other entry as an lm-eval task name. Refuses
    duplicates and unreadable files in one line."""
    specs = []
    for entry in entries:
        if entry in SHIPPED:
            specs.append(TaskSpec(entry, SHIPPED[entry]))
        elif entry.endswith((".yaml", ".yml")):
            path = Path(entry).expanduser().resolve()
            try:
                config = yaml.load(path.read_text(), TaskFileLoader)
            except (OSError, yaml.YAMLError) as exc:
                raise HarnessError(f"{where}: cannot read the task file {entry}: {' '.join(str(exc).split())}") from exc
            name = config.get("task") if isinstance(config, dict) else None
            if not isinstance(name, str):
                raise HarnessError(
                    f"{where}: {entry} has no 'task: <name>' key; an lm-eval task file names its task"
                    " (see lm-eval's docs/task_guide.md)"
                )
            specs.append(TaskSpec(name, path))
        else:
            specs.append(TaskSpec(entry))
    names = [spec.name for spec in specs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise HarnessError(f"{where}: task {', '.join(twice)} is listed twice")
    return specs


class TaskFileLoader(yaml.SafeLoader):
    """A task file as YAML, its lm-eval tags (``!function module.name``) read as plain strings: only its name is read
    here; lm-eval loads the file itself."""


TaskFileLoader.add_multi_constructor("!", lambda loader, tag, node: loader.construct_scalar(node))


@dataclass
class Suite:
    """The tasks of one check, resolved once (lm-eval's ``TaskManager``) and run on every model."""

    specs: list[TaskSpec]
    manager: object  # lm_eval.tasks.TaskManager
    output_types: dict[str, frozenset[str]]  # task -> the request types its documents make


def load_suite(specs: list[TaskSpec]) -> Suite:
    """Index the tasks (local files through ``include_path``, names in lm-eval's own index only when there is one),
    check each exists, and find the request types each makes, without loading any dataset."""
    TaskManager = _lm_eval().tasks.TaskManager
    folders = sorted({str(spec.path.parent) for spec in specs if spec.path})
    named = [spec for spec in specs if spec.path is None]
    manager = TaskManager(include_path=folders or None, include_defaults=bool(named))
    index = manager.task_index
    for spec in named:
        if spec.name not in index:
            close = difflib.get_close_matches(spec.name, list(index), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see `lm-eval ls tasks`"
            raise HarnessError(f"general_eval.tasks: lm-eval has no task {spec.name!r}; {hint}")
    return Suite(specs, manager, {spec.name: _output_types(index, spec.name) for spec in specs})


def _output_types(index: dict, name: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
    """The request types of a task, or of every task of a group or tag (lm-eval's index, includes resolved)."""
    entry = index.get(name)
    if entry is None or name in seen:
        return frozenset()
    config = entry.cfg or {}
    if config.get("output_type"):
        return frozenset({config["output_type"]})
    children = config.get("task") if entry.kind.name == "GROUP" else None
    if children is None:  # a tag: the tasks that carry it
        children = [other for other, e in index.items() if name in e.tags]
    names = [child if isinstance(child, str) else child.get("task") for child in _as_list(children)]
    return frozenset().union(*(_output_types(index, child, seen | {name}) for child in names if child))


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


@dataclass(frozen=True)
class HarnessModel:
    """A model as lm-eval takes it: its lm-eval model name and arguments, and the request types it can answer."""

    label: str  # how tables name it: "base", "fine-tuned", "GGUF q8_0 (llama.cpp)"
    model: str  # lm-eval's model name: "hf", "local-completions"
    args: dict  # its model_args
    output_types: frozenset[str] = frozenset(OUTPUT_TYPES)  # what it answers
    refusal: str = ""  # why it answers no other type (one line, shown per refused task)


def hf_model(model_dir: Path, label: str, batch_size: int = 1) -> HarnessModel:
    """A local Hugging Face directory through lm-eval's ``hf`` model (float32 on CPU, the checkpoint's dtype on CUDA).

    A vision-language model is loaded here as one (``vision.auto_class``) and handed to lm-eval as the model itself:
    lm-eval's ``hf`` would load it as a causal LM, which transformers refuses for a VLM's configuration, and its
    ``hf-multimodal`` answers no log-likelihood requests. The general-ability tasks are text, and a VLM's forward on
    token ids alone is its language model's, so every request type runs, as on a text model."""
    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "auto") if cuda else ("cpu", "float32")
    if model_has_vision(model_dir):
        model = auto_class(model_dir).from_pretrained(model_dir, dtype=dtype if cuda else torch.float32).to(device)
        args = {"pretrained": model.eval(), "tokenizer": str(model_dir), "backend": "causal"}
        return HarnessModel(label, "hf", args | {"batch_size": batch_size})
    args = {"pretrained": str(model_dir), "device": device, "dtype": dtype}
    return HarnessModel(label, "hf", args | {"batch_size": batch_size})


def served_model(
    url: str, name: str, max_length: int, tokenizer_dir: Path, label: str, chat: bool, refusal: str
) -> HarnessModel:
    """A model behind an OpenAI-compatible server on ``url`` (llama.cpp's, mlx-lm's) through lm-eval's API models:
    ``local-chat-completions`` with ``chat`` (the server renders its chat template), else ``local-completions`` (the
    prompt as text, tokenized by the server; lm-eval reads ``tokenizer_dir`` for lengths). ``generate_until`` only:
    ``refusal`` says why no other request type (such servers return no log-probabilities of the prompt)."""
    common = {"model": name, "max_length": max_length, "num_concurrent": 1, "max_retries": 1}
    if chat:
        model, args = "local-chat-completions", {"base_url": f"{url}/v1/chat/completions"}
    else:
        model, args = "local-completions", {
            "base_url": f"{url}/v1/completions", "tokenizer": str(tokenizer_dir),
            "tokenizer_backend": "huggingface", "tokenized_requests": False,
        }  # fmt: skip
    return HarnessModel(label, model, common | args, frozenset({"generate_until"}), refusal)


@dataclass
class TaskScore:
    """One task on one model: its headline metric with lm-eval's stderr, what it cost, or why it was refused."""

    task: str
    model: str  # the model's label
    metric: str | None = None  # "exact_match,none": lm-eval's metric and filter
    value: float | None = None
    stderr: float | None = None  # lm-eval's; None where it gives none ("N/A")
    higher_is_better: bool = True
    items: int = 0  # documents scored (after limit)
    seconds: float = 0.0
    output_type: str = ""
    refused: str | None = None  # why it did not run on this model
    metrics: dict = field(default_factory=dict)  # every metric lm-eval reported for the task

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunSettings:
    """How the suite runs: a limit and a seed per task, few-shot and chat template as lm-eval takes them."""

    limit: int | None = 100
    seed: int = 1234
    num_fewshot: int | None = None  # None: each task's own
    apply_chat_template: bool = False
    max_length: int = 2048  # context of an API model (local-completions): prompt + generation


def evaluate(
    model: HarnessModel, suite: Suite, settings: RunSettings, log: Callable[[str], None]
) -> tuple[list[TaskScore], dict]:
    """Every task of ``suite`` on ``model``, each alone (its own seconds): the scores, and per task the answers
    (up to ``SAMPLES_KEPT``: document, target, response, score) for the store."""
    lm_eval = _lm_eval()
    refused = {
        spec.name: _refusal(model, suite.output_types[spec.name]) for spec in suite.specs
    }  # before loading the model
    scores, answers = [], {}
    runnable = [spec for spec in suite.specs if not refused[spec.name]]
    for spec in suite.specs:
        if refused[spec.name]:
            log(f"{spec.name} on the {model.label} model: refused: {refused[spec.name]}")
    lm = _model(lm_eval, model) if runnable else None
    for spec in suite.specs:
        types = ", ".join(sorted(suite.output_types[spec.name])) or "unknown"
        if refused[spec.name]:
            scores.append(TaskScore(spec.name, model.label, output_type=types, refused=refused[spec.name]))
            continue
        started = time.perf_counter()
        try:
            results = lm_eval.simple_evaluate(
                model=lm, tasks=[str(spec.path) if spec.path else spec.name], task_manager=suite.manager,
                limit=settings.limit, num_fewshot=settings.num_fewshot, apply_chat_template=settings.apply_chat_template,
                random_seed=settings.seed, numpy_random_seed=settings.seed, torch_random_seed=settings.seed,
                fewshot_random_seed=settings.seed, bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True,
            )  # fmt: skip
        except Exception as exc:
            raise HarnessError(
                f"lm-eval task {spec.name} on the {model.label} model failed: {type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:300]}" + _hint(exc)
            ) from exc
        score = _score(spec.name, model.label, results, time.perf_counter() - started, types)
        spread = f" ± {score.stderr:.2g}" if score.stderr is not None else " (no stderr)"
        log(
            f"{spec.name} on the {model.label} model: {score.metric} {score.value:.4g}{spread}, {score.items} items, {score.seconds:.1f} s"
        )
        scores.append(score)
        answers[spec.name] = _answers(results, score.metric)
    return scores, answers


def installed() -> bool:
    """Whether lm-eval (the ``lmeval`` extra) can be imported, without importing it."""
    return importlib.util.find_spec("lm_eval") is not None


def _lm_eval():
    try:
        import lm_eval
        import lm_eval.tasks
    except ImportError as exc:
        raise HarnessError(f"lm-eval is not installed ({exc}): {INSTALL_HINT}") from exc
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)  # its INFO lines repeat every request's arguments
    task_log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _NoCustomDatasetHint) for f in task_log.filters):
        task_log.addFilter(_NoCustomDatasetHint())
    return lm_eval


class _NoCustomDatasetHint(logging.Filter):
    """Drops lm-eval's warning on every task that loads its own items (a shipped task: ``custom_dataset``), which
    points at its command line's ``--metadata``, an option this check does not have."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def _refusal(model: HarnessModel, types: frozenset[str]) -> str | None:
    unanswered = sorted(types - model.output_types)
    if not unanswered:
        return None
    return f"{', '.join(unanswered)} requests: {model.refusal}"


def _model(lm_eval, model: HarnessModel):
    import lm_eval.api.registry

    try:
        return lm_eval.api.registry.get_model(model.model).create_from_arg_obj(dict(model.args))
    except Exception as exc:
        raise HarnessError(
            f"lm-eval cannot load the {model.label} model ({model.model}): {type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:300]}"
        ) from exc


def _hint(exc: Exception) -> str:
    text = str(exc)
    if "offline" in text.lower() or "HF_HUB_OFFLINE" in text or "ConnectionError" in type(exc).__name__:
        return (
            "; its dataset is not in the local Hugging Face cache and the hub is unreachable or offline: download it once"
            " where there is network, or use a local task file (see README, General-ability check)"
        )
    return ""


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _score(task: str, label: str, results: dict, seconds: float, types: str) -> TaskScore:
    """The task's headline (its first metric and filter, as lm-eval lists them) with every metric beside it."""
    row = results["results"].get(task)
    if row is None:
        raise HarnessError(
            f"lm-eval gave no result named {task} (it reported {', '.join(results['results'])}): name a task or a group,"
            " not a tag"
        )
    metrics = {key: _number(value) for key, value in row.items() if "," in key and "_stderr," not in key}
    if not metrics:
        raise HarnessError(f"lm-eval task {task} reported no metric ({', '.join(row)})")
    headline = next(iter(metrics))
    name, _, filter_name = headline.partition(",")
    higher = results.get("higher_is_better", {}).get(task, {}).get(name, True)
    leaves = results.get("group_subtasks", {}).get(task) or [task]
    counts = results.get("n-samples", {})
    items = sum(int(counts.get(leaf, {}).get("effective", 0)) for leaf in leaves)
    return TaskScore(
        task, label, headline, metrics[headline], _number(row.get(f"{name}_stderr,{filter_name}")), bool(higher),
        items, round(seconds, 2), types, None, metrics,
    )  # fmt: skip


def _answers(results: dict, metric: str) -> list[dict]:
    """Each scored document of a task (its leaves for a group): the target, the response, the headline score."""
    name = metric.partition(",")[0]
    rows = []
    for leaf, samples in results.get("samples", {}).items():
        for sample in samples[:SAMPLES_KEPT]:
            response = sample.get("filtered_resps")
            response = response[0] if isinstance(response, list) and len(response) == 1 else response
            rows.append(
                {
                    "task": leaf,
                    "doc_id": sample.get("doc_id"),
                    "target": str(sample.get("target")),
                    "response": str(response),
                    name: _number(sample.get(name)),
                }
            )
    return rows[:SAMPLES_KEPT]


@dataclass(frozen=True)
class Subject:
    """A model the suite runs on: its key in the verdict ("base", "finetuned", an export's name), how lines name it,
    and lm-eval's model of it (a context: an export's server runs for the length of its tasks)."""

    key: str
    title: str
    model: Callable[[], AbstractContextManager[HarnessModel]]


@dataclass
class SuiteRun:
    """Every subject's scores and answers, and what it all cost."""

    scores: dict[str, list[TaskScore]]  # subject key -> one score per task
    answers: dict[str, dict[str, list[dict]]]  # subject key -> task -> its answers
    items: int
    seconds: float


def run_suite(suite: Suite, settings: RunSettings, subjects: list[Subject], log: Callable[[str], None]) -> SuiteRun:
    """The suite on each subject in turn. A subject whose model cannot start (an export's server refused its file:
    ``Refused``) has every task refused with that line instead of failing the check."""
    run = SuiteRun({}, {}, 0, 0.0)
    for subject in subjects:
        log(f"general-ability tasks on the {subject.title} model: {', '.join(spec.name for spec in suite.specs)}")
        try:
            with subject.model() as model:
                scores, answers = evaluate(model, suite, settings, log)
        except Refused as exc:
            scores = [TaskScore(spec.name, subject.title, refused=str(exc)) for spec in suite.specs]
            answers = {}
        run.scores[subject.key], run.answers[subject.key] = scores, answers
        run.items += sum(score.items for score in scores)
        run.seconds += sum(score.seconds for score in scores)
    return run


class Refused(Exception):
    """A subject's model cannot be started (an export's runtime refused its file): its tasks are refused with this line."""
