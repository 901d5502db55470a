"""The report page: one self-contained HTML file (inline SVG plots, JPEG thumbnails as data URIs, no
script, no network) made from a self-test report, and optionally the report it replaces.

The headline figures come from `agent.link.health.selftest_figures`, the function health and
/metrics read, so the page, the health message and the metrics say the same thing.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from agent import __version__
from agent.fsio import write_atomic
from agent.logsetup import get_logger
from agent.link.health import report_candidates, selftest_figures
from agent.report.extract import Metric, candidate_metrics, fmt, manifest_bounds, sample_views
from agent.report.plots import LatencySeries, SamplePoint, latency_plot, sample_metric_plot
from agent.report.thumbs import bundle_manifest, golden_thumbnails

log = get_logger("report")

PALETTE = ("#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#5d4037", "#9e9d24", "#ad1457")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1c1c1c;background:#fafafa}
main{max-width:1180px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;background:#fff}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top;font-size:13px}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.banner{padding:12px 16px;border-radius:6px;font-size:16px;margin:8px 0 12px}
.banner.pass{background:#e8f5e9;border:1px solid #2e7d32}.banner.fail{background:#ffebee;border:1px solid #c62828}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;font-weight:600;color:#fff}
.badge.pass{background:#2e7d32}.badge.fail{background:#c62828}.badge.other{background:#78909c}
tr.fail td{background:#fff1f1}ul.reasons{margin:2px 0;padding-left:18px;min-width:240px}ul.reasons li{color:#b71c1c}
.bar{display:flex;height:22px;width:100%;max-width:640px;border:1px solid #bbb;border-radius:3px;overflow:hidden}
.bar span{display:block;height:100%;color:#fff;font-size:11px;line-height:22px;padding-left:4px;white-space:nowrap;overflow:hidden}
.legend span{display:inline-block;margin-right:12px;font-size:12px}.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:8px;align-items:start}
.card{background:#fff;border:1px solid #ddd;border-radius:5px;padding:6px;font-size:12px}
.card.fail{border:2px solid #c62828;background:#fff5f5}.card img{display:block;width:96px;image-rendering:auto;margin-bottom:4px}
.card .stage{font-weight:600;color:#b71c1c}.muted{color:#777}
.cols{display:grid;grid-template-columns:1fr 1fr;gap:20px}.cols>section{min-width:0}
.cols table{display:block;overflow-x:auto;max-width:100%}main.wide{max-width:1800px}
.plot svg{max-width:100%;height:auto}details{margin:6px 0}pre{white-space:pre-wrap;font-size:11px;background:#fff;border:1px solid #ddd;padding:6px}
"""


def _map(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _strs(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def esc(v: Any) -> str:
    return html.escape(fmt(v) if not isinstance(v, str) else v)


def _short(provider: Any) -> str:
    return str(provider or "-").replace("ExecutionProvider", "")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _nodes(c: Mapping[str, Any]) -> dict[str, int]:
    """Nodes per provider of a candidate's placement, numbers only."""
    raw = _map(_map(c.get("placement")).get("nodes_by_provider"))
    return {str(p): int(n) for p, n in raw.items() if _finite(n) and n > 0}


def _badge(verdict: str) -> str:
    cls = verdict if verdict in ("pass", "fail") else "other"
    return f'<span class="badge {cls}">{esc(verdict.upper())}</span>'


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], row_classes: Sequence[str] | None = None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(r) + "</tr>")
    return "".join(out) + "</table>"


def _td(v: Any, num: bool = False) -> str:
    return f'<td class="num">{esc(v)}</td>' if num else f"<td>{esc(v)}</td>"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g} ms"


class _Context:
    """What one report's sections share: the figures, the bundle's manifest and thumbnails."""

    def __init__(self, doc: Mapping[str, Any], bundle_root: Path | None):
        self.doc = doc
        self.figures = selftest_figures(doc)
        self.cands = report_candidates(doc)  # the same entries the figures were made from, in order
        root = bundle_root
        if root is None:
            p = _map(doc.get("bundle")).get("path")
            root = Path(p) if p else None
        self.bundle_root = root if root is not None and root.is_dir() else None
        self.manifest = bundle_manifest(self.bundle_root) if self.bundle_root else None
        self.thumbs = golden_thumbnails(self.bundle_root, self.manifest)
        selftest = _map(_map(self.manifest).get("selftest"))
        # The manifest's legacy parity thresholds bound the old `parity` summary only: a report that judges
        # reproduction and fidelity carries its own bounds, and its `parity` block is a flat view, not judged.
        self.metrics: list[list[Metric]] = [
            candidate_metrics(c, None if ("reproduction" in c or "fidelity" in c)
                              else manifest_bounds(selftest, c.get("precision")))
            for c in self.cands]
        self.views = [sample_views(c, m) for c, m in zip(self.cands, self.metrics)]
        # tested candidates carry colours; the rest are listed but not plotted
        self.budgets = _map(selftest.get("latency_budget_ms")) if isinstance(selftest, Mapping) else {}
        self.colors = {f["key"]: PALETTE[i % len(PALETTE)] for i, f in enumerate(self.figures.get("candidates", []))}


def _budget(ctx: _Context, f: Mapping[str, Any]) -> tuple[float | None, str]:
    """The budget the report names, else the bundle manifest's (marked as such)."""
    if f.get("budget_ms") is not None:
        return f["budget_ms"], ""
    b = ctx.budgets.get(f.get("provider"), ctx.budgets.get("default"))
    return (float(b), " (manifest)") if isinstance(b, (int, float)) and not isinstance(b, bool) else (None, "")


def _banner(ctx: _Context) -> str:
    f, doc = ctx.figures, ctx.doc
    b = _map(doc.get("bundle"))
    title = f"{b.get('name', '?')} v{b.get('version', '?')}" + (f" ({b['label']})" if b.get("label") else "")
    if f.get("passed"):
        sel = f["selected"] or {}
        what = f"selected <b>{esc(_short(sel.get('provider')))}:{esc(sel.get('variant'))}</b> ({esc(sel.get('precision'))})"
    else:
        what = f"nothing selected: {esc(doc.get('reason') or 'no candidate passed')}"
    extra = ", cached verdict re-checked" if f.get("cached") else ""
    return (f'<h1>Self-test of {esc(title)}</h1>'
            f'<div class="banner {f.get("verdict", "fail")}">{_badge(f.get("verdict", "fail"))} {what}</div>'
            f'<p class="muted">run {esc(doc.get("created"))}, {esc(doc.get("duration_ms"))} ms{extra}; '
            f'manifest sha256 {esc(str(b.get("manifest_sha256", "-"))[:16])}…</p>')


def _versions(ctx: _Context) -> str:
    doc = ctx.doc
    rows = [[_td("agent"), _td(doc.get("agent_version"))]]
    rows += [[_td(k), _td(v)] for k, v in _map(doc.get("versions")).items()]
    rows += [[_td(f"device {k}"), _td(v)] for k, v in _map(doc.get("device")).items()]
    prov_rows, classes = [], []
    for p in (p for p in (doc.get("providers") if isinstance(doc.get("providers"), list) else ()) if isinstance(p, Mapping)):
        vers = ", ".join(f"{k} {v}" for k, v in _map(p.get("versions")).items()) or "-"
        nodes = f"{p.get('nodes_on_provider')}/{p.get('total_nodes')}" if p.get("total_nodes") else "-"
        prov_rows.append([_td(p.get("name")), _td(p.get("listed")), _td(p.get("usable")), _td(nodes),
                          _td(", ".join(_strs(p.get("effective"))) or "-"), _td(vers), _td(p.get("reason") or "")])
        classes.append("" if p.get("usable") else "fail")
    return ("<h2>Device, providers, versions</h2>" + _table(["", ""], rows)
            + _table(["provider", "listed", "usable", "probe nodes", "effective", "versions", "reason"], prov_rows, classes))


def _candidates(ctx: _Context) -> str:
    rows, classes = [], []
    for c, f in zip(ctx.cands, ctx.figures.get("candidates", [])):
        frac = "-" if f["provider_fraction"] is None else f"{f['nodes_on_provider']}/{f['nodes_total']} ({f['provider_fraction']:.0%})"
        reasons = "".join(f"<li>{esc(r)}</li>" for r in f["reasons"])
        rows.append([f"<td><b>{esc(_short(f['provider']))}:{esc(f['variant'])}</b><br>"
                     f"<span class='muted'>{esc(f['precision'])}</span></td>",
                     f"<td>{_badge(f['verdict'])}</td>",
                     _td(", ".join(_short(p) for p in _strs(c.get("effective_providers"))) or "-"),
                     _td(frac), _td(f["partitions"], True),
                     _td(_ms(f["p50_ms"]), True), _td(_ms(f["p95_ms"]), True), _td(_ms(f["p99_ms"]), True),
                     _td(_ms(_budget(ctx, f)[0]) + _budget(ctx, f)[1], True),
                     f"<td><ul class='reasons'>{reasons}</ul></td>" if reasons else "<td></td>"])
        classes.append("fail" if f["verdict"] == "fail" else "")
    notes = "".join(f"<li>{esc(n)}</li>" for n in _strs(ctx.doc.get("notes")))
    return ("<h2>Candidates</h2>"
            + _table(["candidate", "verdict", "runs on", "nodes on its provider", "partitions", "p50", "p95", "p99",
                      "budget (p95)", "every reason"], rows, classes)
            + (f"<ul class='muted'>{notes}</ul>" if notes else ""))


def _latency(ctx: _Context) -> str:
    series = []
    for c, f in zip(ctx.cands, ctx.figures.get("candidates", [])):
        lat = _map(c.get("latency"))
        samples = lat.get("samples_ms") or lat.get("samples")
        samples = [float(x) for x in samples if _finite(x)] if isinstance(samples, list) else []
        if f["p50_ms"] is None and not samples:
            continue
        series.append(LatencySeries(f"{_short(f['provider'])}:{f['variant']}", f["verdict"], samples,
                                    f["p50_ms"], f["p95_ms"], f["p99_ms"], _budget(ctx, f)[0]))
    if not series:
        return "<h2>Latency</h2><p class='muted'>No candidate reached the latency loop.</p>"
    context = ""
    for c in ctx.cands:
        lc = c.get("latency_context")
        if isinstance(lc, Mapping) and lc:
            context += (f"<li>{esc(_short(c.get('provider')))}:{esc(c.get('variant'))}: "
                        + ", ".join(f"{esc(k)} {esc(v)}" for k, v in lc.items()) + "</li>")
    context = f"<ul class='muted'>{context}</ul>" if context else ""
    kind = ("histogram of every timed run" if all(s.samples_ms for s in series)
            else "p50 to p95 as a bar, p99 as a whisker (the report keeps percentiles only)")
    return (f"<h2>Latency</h2><p class='muted'>{kind}; dashed line: the budget the p95 is judged against.</p>"
            f"<div class='plot' id='latency-plot'>{latency_plot(series)}</div>{context}")


def _placement(ctx: _Context) -> str:
    parts = ["<h2>Placement</h2>"]
    providers = sorted({str(p) for c in ctx.cands for p in _nodes(c)})
    pcolor = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(providers)}
    if not providers:
        return parts[0] + "<p class='muted'>No candidate reported its placement.</p>"
    parts.append("<div class='legend'>" + "".join(f"<span><i style='background:{pcolor[p]}'></i>{esc(_short(p))}</span>"
                                                 for p in providers) + "</div>")
    for c in ctx.cands:
        place = _map(c.get("placement"))
        nodes = _nodes(c)
        total = sum(nodes.values())
        if not total:
            continue
        bar = "".join(f"<span style='width:{100 * n / total:.2f}%;background:{pcolor[p]}' title='{esc(p)}: {n}'>"
                      f"{esc(_short(p))} {n}</span>" for p, n in nodes.items())
        ops = _map(place.get("op_types_by_provider"))
        op_rows = [[_td(_short(p)), _td(", ".join(f"{k} {v}" for k, v in sorted(
                       _map(t).items(), key=lambda kv: -kv[1] if _finite(kv[1]) else 0)))] for p, t in ops.items()]
        parts.append(f"<h3>{esc(_short(c.get('provider')))}:{esc(c.get('variant'))} — {total} nodes, "
                     f"{esc(place.get('partitions'))} partition(s), {esc(place.get('boundaries'))} boundary crossing(s), "
                     f"from {esc(place.get('source'))}</h3><div class='bar'>{bar}</div>"
                     + (_table(["provider", "op types"], op_rows) if op_rows else ""))
    return "".join(parts)


def _metrics(ctx: _Context) -> str:
    parts = ["<h2>Metrics against their bounds</h2>"]
    figs = ctx.figures.get("candidates", [])
    judged: list[list[str]] = []
    judged_cls: list[str] = []
    other: list[list[str]] = []
    for f, metrics in zip(figs, ctx.metrics):
        for m in metrics:
            row = [_td(f"{_short(f['provider'])}:{f['variant']}"), _td(m.section), _td(m.name), _td(m.value, True),
                   _td(str(m.bound) if m.bound else "-"), _td("-" if m.sample is None else m.sample, True),
                   _td(m.stage or ""), _td("-" if m.passed is None else ("ok" if m.passed else "FAIL"))]
            if m.bound is not None or m.passed is False:
                judged.append(row)
                judged_cls.append("fail" if m.passed is False else "")
            elif m.sample is None:
                other.append(row)
    head = ["candidate", "section", "metric", "value", "bound", "sample", "stage", ""]
    parts.append(_table(head, judged, judged_cls) if judged else "<p class='muted'>The report carries no bounded metrics.</p>")
    if other:
        parts.append(f"<details><summary>{len(other)} more figures without a bound</summary>{_table(head, other)}</details>")
    # per-sample metrics: one plot per (section, metric), every candidate on it
    per: dict[tuple[str, str], list[tuple[str, Metric]]] = defaultdict(list)
    for f, metrics in zip(figs, ctx.metrics):
        for m in metrics:
            if m.sample is not None and m.value is not None:
                per[(m.section, m.name)].append((f"{_short(f['provider'])}:{f['variant']}", m))
    # a plot needs a spread of samples: a report that names only the worst sample has it in the table
    per = {k: v for k, v in per.items() if len({m.sample for _, m in v}) >= 3}
    if per:
        parts.append("<h3>Per golden sample</h3>")
    for (section, name), items in per.items():
        bounds = {(m.bound.value, m.bound.op) for _, m in items if m.bound}
        bound, op = next(iter(bounds)) if len(bounds) == 1 else (None, None)
        pts = [SamplePoint(label, m.sample, m.value, m.passed) for label, m in items]
        parts.append(f"<div class='plot sample-plot'>{sample_metric_plot(f'{section}: {name}', pts, bound, op)}</div>")
    return "".join(parts)


def _samples(ctx: _Context) -> str:
    figs = ctx.figures.get("candidates", [])
    indices = sorted(set(ctx.thumbs) | {s for v in ctx.views for s in v})
    if not indices:
        return ""
    cards = []
    for s in indices:
        failed_any, lines = False, []
        for f, views in zip(figs, ctx.views):
            v = views.get(s)
            if v is None:
                continue
            label = f"{_short(f['provider'])}:{f['variant']}"
            failed_any |= v.failed
            bad = [m for m in v.metrics if m.passed is False and m.value is not None]
            shown = bad or v.metrics[:3]
            vals = "; ".join(f"{esc(m.name)} {esc(m.value)}" + (f" ({esc(str(m.bound))})" if m.bound else "")
                             for m in shown if m.value is not None)
            stage = f" <span class='stage'>stage blamed: {esc(', '.join(sorted(v.stages)))}</span>" if v.stages and v.failed else ""
            reasons = "".join(f"<li>{esc(r)}</li>" for r in v.reasons)
            lines.append(f"<div>{_badge('fail' if v.failed else 'pass')} {esc(label)}{stage}"
                         + (f"<br><span class='muted'>{vals}</span>" if vals else "")
                         + (f"<ul class='reasons'>{reasons}</ul>" if reasons else "") + "</div>")
        img = (f"<img alt='golden sample {s}' src='{ctx.thumbs[s]}'>" if s in ctx.thumbs
               else "<div class='muted'>(no thumbnail: bundle not reachable)</div>")
        cards.append(f"<div class='card{' fail' if failed_any else ''}' id='sample-{s}'>{img}<b>sample {s}</b>"
                     + "".join(lines) + "</div>")
    failing = sum(1 for c in cards if "card fail" in c)
    where = (f"thumbnails from {esc(str(ctx.bundle_root))}" if ctx.thumbs
             else "no thumbnails: pass --bundle DIR where the bundle is reachable")
    return (f"<h2>Golden samples</h2><p class='muted'>{len(indices)} samples, {failing} failing (red); {where}.</p>"
            f"<div class='grid'>{''.join(cards)}</div>")


def _section(fn: Any, ctx: _Context) -> str:
    """One section; a report this page does not understand costs that section, never the page."""
    try:
        return fn(ctx)
    except Exception as exc:  # noqa: BLE001 - shown on the page, so nothing is hidden
        log.warning("report.section_failed", section=fn.__name__.strip("_"), error=f"{type(exc).__name__}: {exc}")
        return (f"<h2>{esc(fn.__name__.strip('_'))}</h2><p class='muted'>This part of the report could not be shown "
                f"({esc(type(exc).__name__)}: {esc(str(exc))[:300]}); the raw report is below.</p>")


def _body(ctx: _Context, raw_json: bool = True) -> str:
    parts = [_section(fn, ctx) for fn in (_banner, _candidates, _latency, _samples, _metrics, _placement, _versions)]
    if raw_json:
        parts.append("<details><summary>report.json</summary><pre>"
                     + esc(json.dumps(ctx.doc, indent=1, default=str)) + "</pre></details>")
    return "".join(parts)


def _comparison(old: _Context, new: _Context) -> str:
    def cell(f: Mapping[str, Any], key: str) -> str:
        return _td(_ms(f.get(key)) if key.endswith("_ms") else f.get(key))

    rows = []
    for label, ctx in (("before", old), ("after", new)):
        f, b = ctx.figures, _map(ctx.doc.get("bundle"))
        sel = _map(f.get("selected"))
        chosen = next((c for c in f.get("candidates", []) if sel and c["provider"] == sel.get("provider")
                       and c["variant"] == sel.get("variant")), {})
        rows.append([_td(label), _td(f"{b.get('name')} v{b.get('version')}"), f"<td>{_badge(f.get('verdict', 'fail'))}</td>",
                     _td(f"{_short(sel.get('provider'))}:{sel.get('variant')}" if sel else "-"),
                     cell(chosen, "p50_ms"), cell(chosen, "p95_ms"), cell(chosen, "budget_ms"),
                     _td("-" if chosen.get("provider_fraction") is None else f"{chosen['provider_fraction']:.0%}"),
                     _td(ctx.doc.get("created"))])
    before = {c["key"]: c for c in old.figures.get("candidates", [])}
    after = {c["key"]: c for c in new.figures.get("candidates", [])}
    crow, ccls = [], []
    for key in list(dict.fromkeys([*before, *after])):
        b, a = before.get(key, {}), after.get(key, {})
        change = "-"
        if b.get("p95_ms") and a.get("p95_ms") is not None:
            change = f"{100 * (a['p95_ms'] - b['p95_ms']) / b['p95_ms']:+.0f} %"
        crow.append([_td(_short(key)), f"<td>{_badge(b['verdict']) if b else '-'}</td>", _td(_ms(b.get("p95_ms")), True),
                     f"<td>{_badge(a['verdict']) if a else '-'}</td>", _td(_ms(a.get("p95_ms")), True), _td(change, True),
                     f"<td><ul class='reasons'>{''.join(f'<li>{esc(r)}</li>' for r in a.get('reasons', []))}</ul></td>"])
        ccls.append("fail" if a.get("verdict") == "fail" and b.get("verdict") == "pass" else "")
    return ("<h2>Update: before and after</h2>"
            + _table(["", "bundle", "verdict", "selected", "p50", "p95", "budget", "nodes on provider", "run"], rows)
            + _table(["candidate", "before", "p95 before", "after", "p95 after", "p95 change", "reasons after"], crow, ccls)
            + f"<div class='cols'><section><h2>Before</h2>{_body(old, False)}</section>"
              f"<section><h2>After</h2>{_body(new, False)}</section></div>")


def render_report(doc: Mapping[str, Any], *, bundle_root: Path | None = None, compare: Mapping[str, Any] | None = None,
                  compare_bundle_root: Path | None = None) -> str:
    """The whole page as one HTML string. `compare`: the report of the bundle this one replaces."""
    ctx = _Context(doc, bundle_root)
    b = _map(doc.get("bundle"))
    title = f"self-test: {b.get('name', '?')} v{b.get('version', '?')} {ctx.figures.get('verdict', '').upper()}"
    if compare is not None:
        content = _comparison(_Context(compare, compare_bundle_root), ctx)
    else:
        content = _body(ctx)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body><main{' class=wide' if compare is not None else ''}>{content}"
            f"<p class='muted'>made by edge-agent {esc(__version__)} report, {stamp}</p></main></body></html>")


def write_report(out: Path, page: str) -> Path:
    write_atomic(out, page.encode("utf-8"))
    return out
