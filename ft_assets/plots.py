"""Small PNG charts for materialization metadata, embedded as base64 in markdown (the Dagster UI renders them)."""

from __future__ import annotations

import base64
import io


def _to_markdown(fig, title: str) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    plt.close(fig)
    return f"![{title}](data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()})"


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, points in series.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=name, marker="." if len(points) < 30 else None)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _to_markdown(fig, title)


def bar_chart(groups: dict[str, dict[str, float]], title: str, ylabel: str) -> str:
    """``groups``: category -> {series name: value}; one cluster of bars per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(groups)
    names = sorted({name for values in groups.values() for name in values})
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, name in enumerate(names):
        positions = [c + i * width for c in range(len(categories))]
        ax.bar(positions, [groups[c].get(name, 0.0) for c in categories], width, label=name)
    ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(len(categories))], categories)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    if len(names) > 1:
        ax.legend()
    return _to_markdown(fig, title)
