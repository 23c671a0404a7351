"""``bench throughput --timeline FILE``: the dashboard's step timeline for an offline run.

Writes every step of the run (``StepTimeline`` columns): tokens scheduled (prefill vs
decode), step time, rows, preemptions, and KV blocks used with the queue lengths after each
step. ``.html``: one self-contained page with the dashboard's charts (uPlot inlined, nothing
fetched); ``.png``: matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from pagedserve.entrypoints.openai.dashboard import STATIC

FORMATS = (".html", ".png")

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{uplot_css}
body {{ font: 14px system-ui, sans-serif; margin: 1em 2em; }}</style></head>
<body><h1 style="font-size:1.2em">{title}</h1>
<div id="tokens"></div><div id="time"></div><div id="blocks"></div>
<script>{uplot_js}</script>
<script>
const d = {data};
const bars = uPlot.paths.bars({{ size: [0.9, 8] }});
function chart(id, title, series, axes, ys) {{
  new uPlot({{ title, width: 1100, height: 220, scales: {{ x: {{ time: false }} }},
    series: [{{ label: "step" }}, ...series], axes: [{{ label: "step" }}, ...axes] }},
    [d.step, ...ys], document.getElementById(id));
}}
chart("tokens", "Tokens scheduled per step", [
  {{ label: "prefill", stroke: "#ef6c00", fill: "rgba(239,108,0,.35)", paths: bars }},
  {{ label: "decode", stroke: "#1e88e5", fill: "rgba(30,136,229,.35)", paths: bars }}],
  [{{ label: "tokens" }}], [d.prefill_tokens, d.decode_tokens]);
chart("time", "Step time, rows and preemptions", [
  {{ label: "step time (ms)", stroke: "#6a1b9a", scale: "ms" }},
  {{ label: "rows", stroke: "#2e7d32", scale: "n" }},
  {{ label: "preemptions", stroke: "#c62828", scale: "n", points: {{ show: true }} }}],
  [{{ label: "ms", scale: "ms" }}, {{ label: "count", scale: "n", side: 1 }}],
  [d.duration.map((s) => s * 1000), d.num_rows, d.num_preempted.map((n) => n || null)]);
chart("blocks", "KV blocks used (of {num_blocks}) and queues after each step", [
  {{ label: "used blocks", stroke: "#00838f", scale: "b" }},
  {{ label: "running", stroke: "#2e7d32", scale: "n" }},
  {{ label: "waiting", stroke: "#f9a825", scale: "n" }}],
  [{{ label: "blocks", scale: "b" }}, {{ label: "requests", scale: "n", side: 1 }}],
  [d.used_blocks, d.num_running, d.num_waiting]);
</script></body></html>
"""


def check_path(path: str) -> None:
    """Raise ``ValueError`` unless ``path`` ends in .html or .png (before a long run)."""
    if Path(path).suffix.lower() not in FORMATS:
        raise ValueError(f"--timeline must name a .html or .png file; got {path!r}")


def write_timeline(path: str, columns: dict[str, list], num_blocks: int, title: str) -> None:
    """Write the step timeline ``columns`` (``StepTimeline.columns()``) of a pool of
    ``num_blocks`` blocks to ``path`` (.html or .png). Raises ``ValueError`` for another
    suffix, or for .png without matplotlib."""
    check_path(path)
    if Path(path).suffix.lower() == ".png":
        _write_png(path, columns, num_blocks, title)
        return
    data = {k: v for k, v in columns.items() if k != "end"}
    page = _PAGE.format(title=html.escape(title), num_blocks=num_blocks,
                        uplot_css=(STATIC / "uPlot.min.css").read_text(),
                        uplot_js=(STATIC / "uPlot.iife.min.js").read_text(),
                        data=json.dumps(data).replace("</", "<\\/"))
    Path(path).write_text(page)


def _write_png(path: str, c: dict[str, list], num_blocks: int, title: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--timeline FILE.png needs matplotlib: pip install 'pagedserve[bench]'"
                         ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    ax1.bar(c["step"], c["prefill_tokens"], width=1.0, color="tab:orange", label="prefill")
    ax1.bar(c["step"], c["decode_tokens"], width=1.0, bottom=c["prefill_tokens"],
            color="tab:blue", label="decode")
    ax1.set_ylabel("tokens scheduled")
    ax1.legend(loc="upper right")
    ax2.plot(c["step"], [d * 1000 for d in c["duration"]], color="tab:purple", lw=1)
    ax2.set_ylabel("step time (ms)")
    rows = ax2.twinx()
    rows.plot(c["step"], c["num_rows"], color="tab:green", lw=1)
    rows.set_ylabel("rows", color="tab:green")
    ax3.plot(c["step"], c["used_blocks"], color="tab:cyan", label="used blocks")
    ax3.axhline(num_blocks, color="grey", ls="--", lw=1, label=f"pool ({num_blocks})")
    ax3.set_ylabel("KV blocks")
    ax3.set_xlabel("engine step")
    preempted = [s for s, n in zip(c["step"], c["num_preempted"]) if n]
    if preempted:
        ax3.plot(preempted, [0] * len(preempted), "rx", label="preemption")
    ax3.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
