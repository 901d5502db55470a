"""The report page: one self-contained HTML file (inline SVG plots, JPEG thumbnails as data URIs, no
script, no network) made from a self-test report, and optionally the report it replaces.

Rendered by Jinja2 with autoescape (templates/page.html.j2): a report is data from a device, so every value is
escaped by the engine rather than by hand at each of dozens of f-string fragments; only the plots this module
draws, the constant CSS and fragments the template itself rendered are marked safe.

The headline figures come from `agent.link.health.selftest_figures`, the function health and
/metrics read, so the page, the health message and the metrics say the same thing.
"""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from markupsafe import Markup

from agent import __version__
from agent.fsio import write_atomic
from agent.logsetup import get_logger
from agent.link.health import audited, report_candidates, selftest_figures
from agent.report.extract import Metric, candidate_metrics, fmt, manifest_bounds, sample_views
from agent.report.plots import LatencySeries, SamplePoint, latency_plot, sample_metric_plot
from agent.report.serving import serving_view
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
.badge.degraded{background:#ef6c00}.banner.degraded{background:#fff3e0;border:1px solid #ef6c00}
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


def _text(v: Any) -> str:
    return fmt(v) if not isinstance(v, str) else v


def _short(provider: Any) -> str:
    return str(provider or "-").replace("ExecutionProvider", "")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _nodes(c: Mapping[str, Any]) -> dict[str, int]:
    """Nodes per provider of a candidate's placement, numbers only."""
    raw = _map(_map(c.get("placement")).get("nodes_by_provider"))
    return {str(p): int(n) for p, n in raw.items() if _finite(n) and n > 0}


@functools.lru_cache(maxsize=1)
def _macros() -> Any:
    """The template's macros (one per section), loaded once; autoescape on, undefined names are errors."""
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(loader=PackageLoader("agent.report", "templates"), autoescape=True, undefined=StrictUndefined,
                      keep_trailing_newline=False)
    env.filters.update(fmt=_text, short=_short)
    return env.get_template("page.html.j2").module


def _td(v: Any, num: bool = False) -> Markup:
    return _macros().td(v, num)


def readable_duration(ms: Any) -> str:
    """A self-test's time as a person reads it: 532 ms, 8.9 s, 1 min 29 s (never 8.924e+04 ms)."""
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not math.isfinite(ms) or ms < 0:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    minutes, seconds = divmod(round(ms / 1000), 60)
    return f"{minutes} min {seconds} s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g} ms"


class _Context:
    """What one report's sections share: the figures, the bundle's manifest and thumbnails."""

    def __init__(self, doc: Mapping[str, Any], bundle_root: Path | None, health: Mapping[str, Any] | None = None):
        self.doc = doc
        self.health = health  # the device's health message: what serving has seen since this proof
        # with the device's health: a drift its audit saw while serving makes a passed proof degraded here too
        self.figures = audited(selftest_figures(doc), _map(_map(health).get("audit")))
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
    b = ctx.budgets.get(str(f.get("provider")), ctx.budgets.get("default"))
    return (float(b), " (manifest)") if isinstance(b, (int, float)) and not isinstance(b, bool) else (None, "")


def _banner(ctx: _Context) -> Markup:
    f, doc = ctx.figures, ctx.doc
    b = _map(doc.get("bundle"))
    title = f"{b.get('name', '?')} v{b.get('version', '?')}" + (f" ({b['label']})" if b.get("label") else "")
    return _macros().banner(title, bool(f.get("selected")), _map(f.get("selected")),
                            doc.get("reason") or "no candidate passed", f.get("verdict", "fail"), doc.get("created"),
                            readable_duration(doc.get("duration_ms")), bool(f.get("cached")), str(b.get("manifest_sha256", "-"))[:16])


def _versions(ctx: _Context) -> Markup:
    doc = ctx.doc
    rows = [[_td("agent"), _td(doc.get("agent_version"))]]
    rows += [[_td(k), _td(v)] for k, v in _map(doc.get("versions")).items()]
    rows += [[_td(f"device {k}"), _td(v)] for k, v in _map(doc.get("device")).items()]
    prov_rows, classes = [], []
    listed = doc.get("providers")
    for p in (p for p in (listed if isinstance(listed, list) else []) if isinstance(p, Mapping)):
        vers = ", ".join(f"{k} {v}" for k, v in _map(p.get("versions")).items()) or "-"
        nodes = f"{p.get('nodes_on_provider')}/{p.get('total_nodes')}" if p.get("total_nodes") else "-"
        prov_rows.append([_td(p.get("name")), _td(p.get("listed")), _td(p.get("usable")), _td(nodes),
                          _td(", ".join(_strs(p.get("effective"))) or "-"), _td(vers), _td(p.get("reason") or "")])
        classes.append("" if p.get("usable") else "fail")
    return _macros().versions(rows, prov_rows, classes)


def _candidates(ctx: _Context) -> Markup:
    m = _macros()
    rows, classes = [], []
    for c, f in zip(ctx.cands, ctx.figures.get("candidates", [])):
        frac = "-" if f["provider_fraction"] is None else f"{f['nodes_on_provider']}/{f['nodes_total']} ({f['provider_fraction']:.0%})"
        budget, marked = _budget(ctx, f)
        rows.append([m.candidate_cell(f), Markup("<td>") + m.badge(f["verdict"]) + Markup("</td>"),
                     _td(", ".join(_short(p) for p in _strs(c.get("effective_providers"))) or "-"),
                     _td(frac), _td(f["partitions"], True),
                     _td(_ms(f["p50_ms"]), True), _td(_ms(f["p95_ms"]), True), _td(_ms(f["p99_ms"]), True),
                     _td(_ms(budget) + marked, True),
                     Markup("<td>") + m.reasons(f["reasons"]) + Markup("</td>") if f["reasons"] else Markup("<td></td>")])
        classes.append("fail" if f["verdict"] == "fail" else "")
    return m.candidates(rows, classes, _strs(ctx.doc.get("notes")))


def _latency(ctx: _Context) -> Markup:
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
        return _macros().latency(None, "", [])
    context = [(f"{_short(c.get('provider'))}:{_text(c.get('variant'))}", list(lc.items()))
               for c in ctx.cands if isinstance(lc := c.get("latency_context"), Mapping) and lc]
    kind = ("histogram of every timed run" if all(s.samples_ms for s in series)
            else "p50 to p95 as a bar, p99 as a whisker (the report keeps percentiles only)")
    return _macros().latency(Markup(latency_plot(series)), kind, context)  # SVG drawn here, from numbers


def _placement(ctx: _Context) -> Markup:
    providers = sorted({str(p) for c in ctx.cands for p in _nodes(c)})
    pcolor = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(providers)}
    blocks = []
    for c in ctx.cands:
        place = _map(c.get("placement"))
        nodes = _nodes(c)
        total = sum(nodes.values())
        if not total:
            continue
        ops = _map(place.get("op_types_by_provider"))
        op_rows = [[_td(_short(p)), _td(", ".join(f"{k} {v}" for k, v in sorted(
                       _map(t).items(), key=lambda kv: -kv[1] if _finite(kv[1]) else 0)))] for p, t in ops.items()]
        blocks.append({"label": f"{_short(c.get('provider'))}:{_text(c.get('variant'))}", "total": total,
                       "partitions": place.get("partitions"), "boundaries": place.get("boundaries"),
                       "source": place.get("source"), "op_rows": op_rows,
                       "bar": [(p, n, f"{100 * n / total:.2f}", pcolor[p]) for p, n in nodes.items()]})
    return _macros().placement([(p, pcolor[p]) for p in providers], blocks)


def _metrics(ctx: _Context) -> Markup:
    figs = ctx.figures.get("candidates", [])
    judged: list[list[Markup]] = []
    judged_cls: list[str] = []
    other: list[list[Markup]] = []
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
    # per-sample metrics: one plot per (section, metric), every candidate on it
    per: dict[tuple[str, str], list[tuple[str, Metric]]] = defaultdict(list)
    for f, metrics in zip(figs, ctx.metrics):
        for m in metrics:
            if m.sample is not None and m.value is not None:
                per[(m.section, m.name)].append((f"{_short(f['provider'])}:{f['variant']}", m))
    # a plot needs a spread of samples: a report that names only the worst sample has it in the table
    plots = []
    for (section, name), items in per.items():
        if len({m.sample for _, m in items}) < 3:
            continue
        bounds = {(m.bound.value, m.bound.op) for _, m in items if m.bound}
        bound, op = next(iter(bounds)) if len(bounds) == 1 else (None, None)
        pts = [SamplePoint(label, m.sample, m.value, m.passed) for label, m in items if m.sample is not None]
        plots.append(Markup(sample_metric_plot(f"{section}: {name}", pts, bound, op)))  # SVG drawn here
    return _macros().metrics(judged, judged_cls, other, plots)


def _samples(ctx: _Context) -> Markup:
    figs = ctx.figures.get("candidates", [])
    indices = sorted(set(ctx.thumbs) | {s for v in ctx.views for s in v})
    if not indices:
        return Markup("")
    cards = []
    for s in indices:
        failed_any, lines = False, []
        for f, views in zip(figs, ctx.views):
            v = views.get(s)
            if v is None:
                continue
            failed_any |= v.failed
            bad = [m for m in v.metrics if m.passed is False and m.value is not None]
            shown = bad or v.metrics[:3]
            lines.append({"failed": v.failed, "label": f"{_short(f['provider'])}:{f['variant']}",
                          "stages": ", ".join(sorted(v.stages)) if v.stages and v.failed else "",
                          "values": [(m.name, m.value, str(m.bound) if m.bound else "") for m in shown
                                     if m.value is not None],
                          "reasons": list(v.reasons)})
        cards.append({"index": s, "failed": failed_any, "thumb": ctx.thumbs.get(s), "lines": lines})
    return _macros().samples(cards, sum(1 for c in cards if c["failed"]),
                             str(ctx.bundle_root) if ctx.thumbs else "")


SERVING_HINT = ("The serving audit (canary and live audit) and the re-proof schedule live in the device's health "
                "message: give --health FILE (a saved health message, or the `status` reply) or --broker/--device.")


def _serving(ctx: _Context) -> Markup:
    return _macros().serving(serving_view(ctx.health, ctx.figures), SERVING_HINT)


def _section(fn: Any, ctx: _Context) -> Markup:
    """One section; a report this page does not understand costs that section, never the page."""
    try:
        return fn(ctx)
    except Exception as exc:  # noqa: BLE001 - shown on the page, so nothing is hidden
        log.warning("report.section_failed", section=fn.__name__.strip("_"), error=f"{type(exc).__name__}: {exc}")
        return _macros().section_failed(fn.__name__.strip("_"), f"{type(exc).__name__}: {str(exc)[:300]}")


def _body(ctx: _Context, raw_json: bool = True) -> Markup:
    # the report a comparison replaces has no health of its own: no "while serving" section there
    serving = (_serving,) if raw_json or ctx.health is not None else ()
    parts = [_section(fn, ctx) for fn in (_banner, *serving, _candidates, _latency, _samples, _metrics, _placement,
                                          _versions)]
    if raw_json:
        parts.append(_macros().raw_json(json.dumps(ctx.doc, indent=1, default=str)))
    return Markup("").join(parts)


def _comparison(old: _Context, new: _Context) -> Markup:
    m = _macros()

    def cell(f: Mapping[str, Any], key: str) -> Markup:
        return _td(_ms(f.get(key)) if key.endswith("_ms") else f.get(key))

    def badge_td(f: Mapping[str, Any]) -> Markup:
        return Markup("<td>") + (m.badge(f["verdict"]) if f else "-") + Markup("</td>")

    rows = []
    for label, ctx in (("before", old), ("after", new)):
        f, b = ctx.figures, _map(ctx.doc.get("bundle"))
        sel = _map(f.get("selected"))
        chosen: Mapping[str, Any] = next((c for c in f.get("candidates", []) if sel and c["provider"] == sel.get("provider")
                       and c["variant"] == sel.get("variant")), {})
        rows.append([_td(label), _td(f"{b.get('name')} v{b.get('version')}"), badge_td({"verdict": f.get("verdict", "fail")}),
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
        crow.append([_td(_short(key)), badge_td(b), _td(_ms(b.get("p95_ms")), True), badge_td(a),
                     _td(_ms(a.get("p95_ms")), True), _td(change, True),
                     Markup("<td>") + m.reasons(a.get("reasons", [])) + Markup("</td>")])
        ccls.append("fail" if a.get("verdict") == "fail" and b.get("verdict") == "pass" else "")
    return m.comparison(rows, crow, ccls, _body(old, False), _body(new, False))


def render_report(doc: Mapping[str, Any], *, bundle_root: Path | None = None, compare: Mapping[str, Any] | None = None,
                  compare_bundle_root: Path | None = None, health: Mapping[str, Any] | None = None) -> str:
    """The whole page as one HTML string. `compare`: the report of the bundle this one replaces; `health`:
    the device's health message (the audit and the re-proof schedule while serving)."""
    ctx = _Context(doc, bundle_root, health)
    b = _map(doc.get("bundle"))
    title = f"self-test: {b.get('name', '?')} v{b.get('version', '?')} {ctx.figures.get('verdict', '').upper()}"
    if compare is not None:
        content = _comparison(_Context(compare, compare_bundle_root), ctx)
    else:
        content = _body(ctx)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return str(_macros().page(title, Markup(CSS), compare is not None, content, __version__, stamp))


def write_report(out: Path, page: str) -> Path:
    write_atomic(out, page.encode("utf-8"))
    return out
