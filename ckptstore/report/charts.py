"""The report's pictures: PNG charts of ``report.figures`` (matplotlib, an optional extra) and
an ``index.html`` that shows them with the numbers behind them.

matplotlib is imported here only, and only when a report is drawn: ``pip install
'ckptstore[report]'``. Figures are drawn with the Agg canvas directly (no pyplot, no global
state, no display needed), so a report can be made on a headless node or from cron.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from ..errors import UnsupportedError
from ..layers import EXPERTS
from .figures import Figures

CHARTS = {
    "updates.png": "Update magnitude of each layer at each step (x: saved by that step)",
    "bytes.png": "Logical and stored bytes per step",
    "cumulative.png": "Logical and stored bytes, cumulative",
    "durations.png": "Seconds each commit took, and its upload from the local tier",
}


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UnsupportedError(
            "ckptstore report draws with matplotlib, which is not installed: pip install 'ckptstore[report]' "
            "(report --json needs nothing more)"
        ) from None
    return Figure, FigureCanvasAgg


def draw(figures: Figures, folder: Path) -> list[Path]:
    """Write the charts of ``figures`` into ``folder`` and ``index.html`` showing them; returns
    the files written. UnsupportedError without matplotlib."""
    figure_class, canvas_class = _matplotlib()
    written = []
    for name, draw_chart in (
        ("updates.png", _updates),
        ("bytes.png", _bytes),
        ("cumulative.png", _cumulative),
        ("durations.png", _durations),
    ):
        chart = figure_class(figsize=_size(name, figures), dpi=100, layout="constrained")
        canvas_class(chart)
        draw_chart(chart, figures)
        chart.savefig(folder / name)
        written.append(folder / name)
    (folder / "figures.json").write_text(json.dumps(figures.as_json(), indent=1) + "\n")
    (folder / "index.html").write_text(_page(figures))
    return [*written, folder / "figures.json", folder / "index.html"]


def _size(name: str, figures: Figures) -> tuple[float, float]:
    if name == "updates.png":
        return (min(4 + 0.35 * len(figures.steps), 24), min(2 + 0.3 * len(heatmap_rows(figures)[0]), 30))
    return (min(4 + 0.35 * len(figures.steps), 24), 4.0)


# Past this many layers, the experts of each MoE layer share one row of the heatmap.
MAX_ROWS = 80


def heatmap_rows(
    figures: Figures, limit: int = MAX_ROWS
) -> tuple[list[str], list[list[float | None]], list[list[bool]]]:
    """The heatmap's rows: ``(labels, updates, saved)``, a row per layer and a column per step.
    Past ``limit`` layers, the experts of each MoE layer (``...deepspeed_experts.N``) become
    one row: their largest update at each step, saved where any of them was."""
    steps = range(len(figures.steps))
    if len(figures.layers) <= limit:
        return (
            list(figures.layers),
            [[figures.updates[i][j] for i in steps] for j in range(len(figures.layers))],
            [[figures.saved[i][j] for i in steps] for j in range(len(figures.layers))],
        )
    labels: list[str] = []
    groups: dict[str, list[int]] = {}
    for j, layer in enumerate(figures.layers):
        owner, _, index = layer.rpartition(".")
        key = f"{owner}.*" if owner.rpartition(".")[2] in EXPERTS and index.isdigit() else layer
        if key not in groups:
            labels.append(key)
        groups.setdefault(key, []).append(j)
    updates, saved = [], []
    for key in labels:
        members = groups[key]
        measured = [
            [figures.updates[i][j] for j in members if figures.updates[i][j] is not None] for i in steps
        ]
        updates.append([max(values, default=None) for values in measured])
        saved.append([any(figures.saved[i][j] for j in members) for i in steps])
    named = [
        f"{key} ({len(groups[key])} experts, largest update)" if key.endswith(".*") else key for key in labels
    ]
    return named, updates, saved


def _updates(chart, figures: Figures) -> None:
    import numpy as np

    labels, updates, saved = heatmap_rows(figures)
    axes = chart.add_subplot()
    grid = np.array([[np.nan if value is None else value for value in row] for row in updates], dtype=float)
    image = axes.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
    chart.colorbar(image, ax=axes, label="relative update ||w - w_prev|| / ||w_prev||")
    rows, columns = np.nonzero(np.array(saved, dtype=bool))
    # Red shows on every colour of the map and on the blank of a step with no measure.
    axes.scatter(columns, rows, marker="x", color="#e8322a", s=22, linewidths=1.2)
    axes.set_xticks(range(len(figures.steps)), [str(step) for step in figures.steps], rotation=90)
    # Layer names come from the store, as written: `$...$` in one is no formula to typeset
    # (matplotlib's mathtext raises ValueError on `$\frac{$`).
    axes.set_yticks(range(len(labels)), labels, fontsize=7, parse_math=False)
    axes.set_xlabel("step")
    axes.set_title(CHARTS["updates.png"])


def _bytes(chart, figures: Figures) -> None:
    _paired_bars(
        chart, figures, "bytes.png", "MiB",
        ("logical (uncompressed)", _mib(figures.logical_bytes)), ("stored (added)", _mib(figures.stored_bytes)),
    )  # fmt: skip


def _cumulative(chart, figures: Figures) -> None:
    axes = chart.add_subplot()
    axes.plot(figures.steps, _mib(figures.cumulative_logical_bytes), marker="o", label="logical")
    axes.plot(figures.steps, _mib(figures.cumulative_stored_bytes), marker="o", label="stored")
    axes.set_xlabel("step")
    axes.set_ylabel("MiB")
    axes.legend(loc="upper left")
    ratio = "-" if figures.dedup_ratio is None else f"{figures.dedup_ratio:.2f}x"
    axes.set_title(f"{CHARTS['cumulative.png']} (logical / stored: {ratio})")


def _durations(chart, figures: Figures) -> None:
    # A step without a figure (recorded before it was kept, or not uploaded) has no bar.
    _paired_bars(
        chart, figures, "durations.png", "seconds",
        ("commit", _or_nan(figures.commit_seconds)), ("upload", _or_nan(figures.upload_seconds)),
    )  # fmt: skip


def _paired_bars(chart, figures: Figures, name: str, unit: str, *series: tuple[str, list[float]]) -> None:
    """Two bars per step, side by side, with a legend outside the plot."""
    axes = chart.add_subplot()
    positions = range(len(figures.steps))
    for shift, (label, values) in zip((-0.2, 0.2), series, strict=True):
        axes.bar([p + shift for p in positions], values, width=0.4, label=label)
    axes.set_xticks(list(positions), [str(step) for step in figures.steps], rotation=90)
    axes.set_xlabel("step")
    axes.set_ylabel(unit)
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes.set_title(CHARTS[name])


def _or_nan(values: list[float | None]) -> list[float]:
    return [float("nan") if value is None else value for value in values]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _mib(values: list[int]) -> list[float]:
    """Bytes in MiB, the unit ``ckptstore log`` and ``show`` print."""
    return [value / 2**20 for value in values]


def _page(figures: Figures) -> str:
    """The HTML page: each chart, then the table of numbers it was drawn from."""
    ratio = "-" if figures.dedup_ratio is None else f"{figures.dedup_ratio:.2f}x"
    rows = "".join(
        f"<tr><td>{step}</td><td>{sum(saved)} of {len(saved)}</td><td>{logical}</td><td>{stored}</td>"
        f"<td>{total_stored}</td><td>{_seconds(commit)}</td><td>{_seconds(stall)}</td><td>{_seconds(upload)}</td>"
        f"<td>{html.escape(' '.join(f'{earlier} {how}' for earlier, how in missed)) or '-'}</td></tr>"
        for step, saved, logical, stored, total_stored, commit, stall, upload, missed in zip(
            figures.steps, figures.saved, figures.logical_bytes, figures.stored_bytes,
            figures.cumulative_stored_bytes, figures.commit_seconds, figures.stall_seconds,
            figures.upload_seconds, figures.not_committed, strict=True,
        )
    )  # fmt: skip
    images = "".join(
        f'<h2>{html.escape(title)}</h2><img src="{name}" alt="{html.escape(title)}">'
        for name, title in CHARTS.items()
    )
    return (
        '<!doctype html><html><head><meta charset="utf-8"><title>ckptstore report</title></head><body>'
        f"<h1>ckptstore report: steps {figures.steps[0]} to {figures.steps[-1]}</h1>"
        f"<p>{len(figures.steps)} steps, {len(figures.layers)} layers; logical / stored bytes: {ratio}. "
        'The numbers are in <a href="figures.json">figures.json</a>.</p>'
        f'{images}<h2>Per step</h2><table border="1"><tr><th>step</th><th>layers saved</th>'
        f"<th>logical bytes</th><th>stored bytes added</th><th>stored, cumulative</th><th>commit seconds</th><th>training held (s)</th><th>upload seconds</th><th>not committed before it</th></tr>{rows}</table>"
        "</body></html>\n"
    )
