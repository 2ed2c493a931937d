"""One self-contained HTML page per compile: the passes (matches, near-misses, time, nodes), what
was rewritten in each layer (main model and MTP layers apart), near-miss explanations, rolled-back
passes, and a before/after picture (inline SVG, drawn by Graphviz ``dot``) of every rewrite."""

from __future__ import annotations

import datetime
import html
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from ..report import CompileReport
from .layers import OUTSIDE, layer_summary, mtp_layers, ops_by_layer
from .subgraphs import GraphRecord, Rewrite, Subgraph, SubgraphRecorder, dot_available, to_svg

log = logging.getLogger("ascend_passes.inspect")

MAX_PICTURES = 400  # per page; a 61-layer model has far more rewrites than anyone reads

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px;
       color: #1f2328; background: #ffffff; font-size: 14px; line-height: 1.4; }
h1 { font-size: 22px; margin: 0 0 4px 0; } h2 { font-size: 18px; margin-top: 28px;
  border-bottom: 1px solid #d0d7de; padding-bottom: 4px; } h3 { font-size: 15px; margin: 18px 0 6px; }
.meta { color: #57606a; margin-bottom: 12px; }
table { border-collapse: collapse; margin: 6px 0 12px 0; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.rolled_back td { background: #fde2e1; } .bad { color: #c0392b; font-weight: 600; }
.ok { color: #1e8449; } code, .mono { font-family: Menlo, Consolas, monospace; font-size: 12px; }
.note { background: #fff8c5; border: 1px solid #d4a72c; padding: 6px 10px; margin: 8px 0; }
details { border: 1px solid #d0d7de; border-radius: 6px; margin: 6px 0; padding: 4px 10px; }
summary { cursor: pointer; } .pair { display: flex; gap: 16px; flex-wrap: wrap; align-items: flex-start; }
figure { margin: 6px 0; flex: 1 1 420px; min-width: 300px; } figcaption { font-weight: 600; margin-bottom: 4px; }
figure svg { max-width: 100%; height: auto; } .legend span { padding: 1px 6px; margin-right: 8px; border-radius: 3px; }
pre.nodes { background: #f6f8fa; padding: 6px; overflow-x: auto; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    num: Sequence[int] = (),
    row_classes: Sequence[str] | None = None,
) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        cells = "".join(f'<td class="num">{c}</td>' if j in num else f"<td>{c}</td>" for j, c in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{_e(k)}&nbsp;×{v}" for k, v in counts.items()) or "-"


# --------------------------------------------------------------------------- sections
def _passes_section(report: CompileReport, anchor: str, drawn: set[str]) -> str:
    rows, classes = [], []
    for i, r in enumerate(report.passes.values()):
        status = _e(r.status) if r.status == "ok" else f'<span class="bad">{_e(r.status)}</span>'
        name = f"<code>{_e(r.name)}</code>"
        if r.name in drawn:
            name = f'<a href="#{anchor}-{_e(r.name)}">{name}</a>'
        rows.append(
            [
                str(i),
                name,
                status,
                str(r.num_matches),
                str(len(r.near_misses)),
                f"{r.nodes_before} → {r.nodes_after}",
                f"{r.seconds * 1e3:.1f}",
                _counts(dict(sorted(r.counts().items()))),
            ]
        )
        classes.append("" if r.status == "ok" else r.status)
    out = [
        "<h3>Passes</h3>",
        _table(
            ["#", "pass", "status", "matches", "near-misses", "nodes", "ms", "rewrites"],
            rows,
            num=(0, 3, 4, 5, 6),
            row_classes=classes,
        ),
    ]
    failed = [r for r in report.passes.values() if r.error]
    if failed:
        out.append("<h3>Rolled-back passes</h3><ul>")
        for r in failed:
            out.append(
                f'<li><code>{_e(r.name)}</code>: <span class="bad">{_e(r.error)}</span> — the '
                "graph was restored to its state before this pass and compiling went on.</li>"
            )
        out.append("</ul>")
    return "\n".join(out)


def _layers_section(report: CompileReport) -> str:
    summary = layer_summary(report)
    ops = ops_by_layer(report)
    mtp = set(mtp_layers(report)) | {k for k in (*summary, *ops) if k.startswith("mtp.")}
    layers = list(dict.fromkeys([*summary, *ops]))
    groups = (
        ("Main model", [x for x in layers if x not in mtp and x != OUTSIDE]),
        ("MTP layers", [x for x in layers if x in mtp]),
        ("Outside any layer", [x for x in layers if x == OUTSIDE]),
    )
    out = ["<h3>Rewrites per layer</h3>"]
    if not layers:
        out.append("<p>Nothing was rewritten.</p>")
    for title, names in groups:
        if not names:
            continue
        rows = [[f"<code>{_e(x)}</code>", _counts(summary.get(x, {})), _counts(ops.get(x, {}))] for x in names]
        out.append(f"<p><b>{_e(title)}</b></p>")
        out.append(_table(["layer", "matches (pattern × count)", "ascend ops in the final graph"], rows))
    return "\n".join(out)


def _near_miss_section(report: CompileReport, record: GraphRecord | None) -> str:
    rows = []
    for r in report.passes.values():
        for nm in r.near_misses:
            info = record.near_miss_nodes.get((r.name, nm.node)) if record and nm.node else None
            node = f"<code>{_e(nm.node)}</code>" if nm.node else "-"
            if info is not None:
                node += f'<br><span class="mono">{_e(info.label)} {_e(info.shape)}</span>'
            rows.append(
                [
                    f"<code>{_e(r.name)}</code>",
                    _e(nm.pattern),
                    _e(nm.layer or "-"),
                    node,
                    f'<span class="mono">{_e(info.source)}</span>' if info and info.source else "-",
                    _e(nm.reason),
                ]
            )
    if not rows:
        return "<h3>Near-misses</h3><p>None: every candidate subgraph either matched or was not one.</p>"
    return (
        "<h3>Near-misses</h3><p>Subgraphs that looked like a pattern but were not rewritten: "
        "the node where matching stopped and why.</p>"
        + _table(["pass", "pattern", "layer", "node", "source", "why not"], rows)
    )


def _nodes_text(sub: Subgraph) -> str:
    lines = [f"in   {n.name}: {n.label} {n.shape}" for n in sub.inputs]
    lines += [f"core {n.name}: {n.label} {n.shape}   {n.source}" for n in sub.core]
    lines += [f"out  {n.name}: {n.label} {n.shape}" for n in sub.users]
    return "\n".join(lines)


def _picture(sub: Subgraph, kind: str, draw: bool) -> str:
    if not (sub.core or sub.inputs or sub.users):
        return "<p><i>no nodes of its own (its result is drawn with a neighbouring rewrite)</i></p>"
    if draw:
        try:
            return to_svg(sub, kind)
        except Exception as exc:  # dot crashed or timed out: show the nodes instead
            log.warning("dot could not draw a subgraph: %s", exc)
    return f'<pre class="nodes">{_e(_nodes_text(sub))}</pre>'


def _rewrites_section(record: GraphRecord | None, draw: bool, budget: list[int], anchor: str) -> str:
    out = ["<h3>Rewritten subgraphs</h3>"]
    if record is None or not record.rewrites:
        out.append("<p>No rewrite replaced graph nodes (or none was recorded).</p>")
        return "\n".join(out)
    out.append(
        '<p class="legend"><span style="background:#fde2e1">replaced nodes</span>'
        '<span style="background:#dff3e4">new nodes</span>'
        '<span style="background:#ddeeff">matched, kept (annotated)</span>'
        '<span style="border:1px dashed #7f8c8d">direct inputs</span>'
        '<span style="border:1px dotted #7f8c8d">users of the result</span></p>'
    )
    by_pass: dict[str, list[Rewrite]] = {}
    for rw in record.rewrites:
        by_pass.setdefault(rw.pass_name, []).append(rw)
    for pass_name, rewrites in by_pass.items():
        out.append(f'<p id="{anchor}-{_e(pass_name)}"><b>{_e(pass_name)}</b>: {len(rewrites)} rewrite(s)</p>')
        for i, rw in enumerate(rewrites):
            where = f"at <code>{_e(rw.layer)}</code>" if rw.layer else "outside any layer"
            title = f"{_e(rw.pattern)} {where} — {len(rw.before.core)} node(s) → {len(rw.after.core)} node(s)"
            if budget[0] <= 0:
                out.append(
                    f"<details><summary>{title}</summary><p>Not drawn: this page draws at most "
                    f'{MAX_PICTURES} rewrites.</p><pre class="nodes">'
                    f"{_e(_nodes_text(rw.before))}</pre></details>"
                )
                continue
            budget[0] -= 1
            opened = " open" if i == 0 else ""
            if rw.kept:
                out.append(
                    f"<details{opened}><summary>{title.split(' — ')[0]} — {len(rw.before.core)} "
                    'node(s) matched and annotated, none replaced</summary><div class="pair">'
                    f"<figure><figcaption>matched</figcaption>{_picture(rw.before, 'kept', draw)}"
                    "</figure></div></details>"
                )
                continue
            out.append(
                f'<details{opened}><summary>{title}</summary><div class="pair">'
                f"<figure><figcaption>before</figcaption>{_picture(rw.before, 'replaced', draw)}</figure>"
                f"<figure><figcaption>after</figcaption>{_picture(rw.after, 'new', draw)}</figure>"
                "</div></details>"
            )
    return "\n".join(out)


# --------------------------------------------------------------------------- the page
def render_html(
    runs: Sequence[tuple[str, CompileReport]],
    recorder: SubgraphRecorder | None = None,
    *,
    title: str = "ascend_passes compile report",
    draw: bool | None = None,
) -> str:
    """The page for ``runs`` (``(model name, report)`` pairs, one per compiled graph).

    ``draw``: draw subgraphs with ``dot`` (default: when ``dot`` is installed); without it the
    page lists the subgraphs' nodes and says how to get the pictures.
    """
    draw = dot_available() if draw is None else draw
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f"<h1>{_e(title)}</h1>",
        f'<div class="meta">generated {now} · torch {_e(torch.__version__)} · {len(runs)} compiled graph(s)</div>',
    ]
    if not draw:
        parts.append(
            '<div class="note">Graphviz <code>dot</code> was not found, so the rewritten '
            "subgraphs are listed as text instead of drawn. Install it "
            "(<code>apt-get install -y graphviz</code>) to get pictures.</div>"
        )
    toc = []
    for i, (name, report) in enumerate(runs):
        toc.append(
            f'<li><a href="#g{i}">{_e(name)}: graph {_e(report.graph_id)}</a> — {report.num_matches} rewrites</li>'
        )
    if len(runs) > 1:
        parts.append(f"<ul>{''.join(toc)}</ul>")
    budget = [MAX_PICTURES]
    for i, (name, report) in enumerate(runs):
        record = recorder.graphs.get(str(report.graph_id)) if recorder else None
        verified = {None: "not checked", True: '<span class="ok">yes</span>', False: '<span class="bad">no</span>'}[
            report.verified
        ]
        nodes = [r for r in report.passes.values()]
        span = f"{nodes[0].nodes_before} → {nodes[-1].nodes_after} nodes" if nodes else ""
        parts.append(
            f'<h2 id="g{i}">{_e(name)}: graph {_e(report.graph_id)} → {_e(report.compiler)} ({_e(report.target)})</h2>'
        )
        parts.append(
            f'<div class="meta">{span} · pipeline {report.seconds * 1e3:.1f} ms · '
            f"{report.num_matches} rewrites · numerics verified: {verified} · config "
            f"<code>{_e(report.config_hash[:12])}</code></div>"
        )
        drawn = {rw.pass_name for rw in record.rewrites} if record else set()
        parts.append(_passes_section(report, f"g{i}", drawn))
        parts.append(_layers_section(report))
        parts.append(_near_miss_section(report, record))
        parts.append(_rewrites_section(record, draw, budget, f"g{i}"))
    body = "\n".join(parts)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def write_html(
    path: str | Path,
    runs: Sequence[tuple[str, CompileReport]],
    recorder: SubgraphRecorder | None = None,
    **kwargs: object,
) -> Path:
    """Write ``render_html(runs, recorder, **kwargs)`` to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(runs, recorder, **kwargs), encoding="utf-8")  # type: ignore[arg-type]
    log.info("wrote HTML report %s", path)
    return path


__all__ = ["render_html", "write_html"]
