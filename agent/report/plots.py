"""The page's plots, drawn with matplotlib's Agg backend into inline SVG text (no files, no network).

matplotlib is the optional extra `report`; only `edge-agent report` imports this module.
"""

from __future__ import annotations

import io
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from agent.errors import AgentError, install_hint

PASS_COLOR, FAIL_COLOR, NEUTRAL_COLOR, BUDGET_COLOR = "#2e7d32", "#c62828", "#607d8b", "#d84315"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise AgentError("edge-agent report draws its plots with matplotlib, which is not installed: "
                         + install_hint("report", "matplotlib")) from exc
    matplotlib.use("Agg", force=True)
    # the first import builds Matplotlib's font cache and says so on stderr ("Matplotlib is building the font cache;
    # this may take a moment"): noise beside the report's own lines, nothing for its reader to do
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False, "svg.hashsalt": "edge-agent"})
    return plt


def _svg(fig: Any) -> str:
    plt = _pyplot()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)  # creator/date RDF: bytes nobody reads
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: inline in HTML


@dataclass(frozen=True)
class LatencySeries:
    label: str
    verdict: str  # pass | fail | ...
    samples_ms: Sequence[float]
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    budget_ms: float | None


def latency_plot(series: Sequence[LatencySeries]) -> str:
    """One row per candidate: the histogram of its timed runs (or, when the report kept only the
    percentiles, p50-p95 as a bar with p99 as a whisker), with its budget as a vertical line."""
    plt = _pyplot()
    n = len(series)
    fig, axes = plt.subplots(n, 1, figsize=(7.0, 1.45 * n + 0.5), sharex=True, squeeze=False)
    # up to the furthest budget or 1.5 x p95: the few slow outliers past it are counted in the title, not
    # allowed to squash the distribution the verdict is about
    hi = 1.15 * (max([s.budget_ms or 0 for s in series] + [1.5 * (s.p95_ms or 0) for s in series]
                     + [max(s.samples_ms, default=0) if s.p95_ms is None else 0 for s in series]) or 1.0)
    # a budget far above the measured runs would squeeze them into one bar: then the axis is logarithmic
    p95s = [s.p95_ms for s in series if s.p95_ms]
    lo = min([x for s in series for x in s.samples_ms if x > 0] + [s.p50_ms for s in series if s.p50_ms], default=0)
    log_x = bool(p95s) and lo > 0 and hi / max(p95s) > 20
    edges = np.geomspace(lo * 0.8, hi, 61) if log_x else np.linspace(0, hi, 61)
    for ax, s in zip(axes[:, 0], series):
        color = PASS_COLOR if s.verdict == "pass" else FAIL_COLOR if s.verdict == "fail" else NEUTRAL_COLOR
        title = f"{s.label}  [{s.verdict.upper()}]"
        if s.samples_ms:
            shown = [x for x in s.samples_ms if x <= hi]
            ax.hist(shown, bins=edges, color=color, alpha=0.8)
            ax.set_ylabel("runs")
            if len(shown) < len(s.samples_ms):
                title += f"  ({len(s.samples_ms) - len(shown)} slower run(s) up to {max(s.samples_ms):.3g} ms not drawn)"
        elif s.p50_ms is not None:
            p95 = s.p95_ms if s.p95_ms is not None else s.p50_ms
            ax.barh([0], [p95 - s.p50_ms or hi * 0.002], left=[s.p50_ms], height=0.5, color=color, alpha=0.8)
            if s.p99_ms is not None:
                ax.plot([p95, min(s.p99_ms, hi)], [0, 0], color=color, lw=1.5)
                ax.plot([min(s.p99_ms, hi)], [0], "|", color=color, ms=12)
            ax.set_yticks([])
            ax.set_ylim(-0.8, 0.8)
        for q, name, style in ((s.p50_ms, "p50", ":"), (s.p95_ms, "p95", "-.")):
            if q is not None:
                ax.axvline(q, color="black", lw=0.9, ls=style, label=f"{name} {q:.3g} ms")
        if s.budget_ms is not None:
            ax.axvline(s.budget_ms, color=BUDGET_COLOR, lw=1.8, ls="--", label=f"budget {s.budget_ms:g} ms")
        ax.legend(fontsize=7, frameon=False, loc="upper right")
        ax.set_title(title, loc="left", fontsize=9, color=color)
    axes[-1, 0].set_xlabel("latency per run (ms)" + (", log scale" if log_x else ""))
    if log_x:
        axes[-1, 0].set_xscale("log")
        axes[-1, 0].set_xlim(edges[0], hi)
    else:
        axes[-1, 0].set_xlim(0, hi)
    fig.tight_layout()
    return _svg(fig)


@dataclass(frozen=True)
class SamplePoint:
    series: str       # candidate
    sample: int
    value: float | None
    passed: bool | None


def sample_metric_plot(title: str, points: Sequence[SamplePoint], bound: float | None, op: str | None) -> str:
    """A metric per golden sample, one marker series per candidate, the bound as a line; samples
    outside the bound in red."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 2.1))
    names = list(dict.fromkeys(p.series for p in points))
    markers = "osD^v<>"
    finite = [p.value for p in points if p.value is not None and math.isfinite(p.value)]
    for i, name in enumerate(names):
        pts = [p for p in points if p.series == name and p.value is not None]
        xs = [p.sample + (i - (len(names) - 1) / 2) * 0.12 for p in pts]
        ys = [p.value if p.value is not None and math.isfinite(p.value) else (max(finite, default=1.0) * 2 or 1.0)
              for p in pts]
        colors = [FAIL_COLOR if p.passed is False else PASS_COLOR if p.passed else NEUTRAL_COLOR for p in pts]
        ax.scatter(xs, ys, c=colors, marker=markers[i % len(markers)], s=22, label=name, edgecolors="none")
    if bound is not None:
        ax.axhline(bound, color=BUDGET_COLOR, lw=1.4, ls="--")
        ax.text(1.0, bound, f" bound {op or ''} {bound:g}", color=BUDGET_COLOR, transform=ax.get_yaxis_transform(),
                va="center", fontsize=8)
    pos = [v for v in finite + ([bound] if bound else []) if v > 0]
    if pos and min(pos) > 0 and max(pos) / min(pos) > 1e3 and len(pos) == len(finite) + (1 if bound else 0):
        ax.set_yscale("log")
    ax.set_xlabel("golden sample")
    ax.set_title(title, loc="left", fontsize=9)
    samples = sorted({p.sample for p in points})
    if samples and len(samples) <= 40:
        ax.set_xticks(samples)
        ax.tick_params(axis="x", labelsize=7)
    if len(names) > 1:
        ax.legend(fontsize=7, frameon=False, loc="best")
    fig.tight_layout()
    return _svg(fig)
