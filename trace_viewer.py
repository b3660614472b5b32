"""One self-contained HTML page from a run directory: the metrics plot, and every dumped step's samples.

    python trace_viewer.py outputs/run                       # -> outputs/run/traces.html
    python trace_viewer.py outputs/run --out page.html --max-samples 32
    python trace_viewer.py outputs/run --screenshot docs/trace_viewer.png   # headless Chromium

It reads <run>/metrics.jsonl, and the dumps of trainer.rollout_data_dir (training steps: tokens
coloured by advantage or by the engine-vs-actor log-prob gap) and trainer.validation_data_dir
(validation steps; multi-turn samples by turn), both <dir>/<step>.jsonl, found through
<run>/config.yaml or given with --rollout-dir / --validation-dir. The page has no external URL: CSS
and JS inline, the samples embedded as JSON and drawn with textContent (model text is never parsed
as HTML), the plot an inline SVG. The URL's hash picks the view: #step=rollout:2&colour=gap.
Standard library only: it runs wherever the run directory is copied.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# The plot's panels: the metrics a person looks at first, where the run has them.
PLOT_KEYS = ("critic/score/mean", "val/score", "critic/advantages/max", "response_length/mean", "actor/pg_loss",
             "actor/entropy", "actor/grad_norm", "rollout/logprob_diff_max", "num_turns/mean", "timing_s/step")


def config_value(run_dir: Path, key: str) -> str | None:
    """trainer.<key> from <run>/config.yaml (the resolved config the trainer wrote), read without a
    YAML parser: the trainer section's `  key: value` line; None for null or no file."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    section, lines = None, path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith(" "):
            section = line.rstrip(":")
        match = re.fullmatch(rf"  {key}: (.*)", line)
        if section == "trainer" and match:
            value = match.group(1).strip()
            for more in lines[i + 1:]:  # a long scalar folds onto deeper-indented lines, joined by spaces
                if not more.startswith("    "):
                    break
                value += " " + more.strip()
            if value in ("null", "~", ""):
                return None
            return value[1:-1].replace("''", "'") if value[:1] == value[-1:] == "'" else value.strip('"')
    return None


def read_steps(directory: Path | None, max_samples: int) -> list[dict[str, Any]]:
    """[{step, total, samples}] of a dump directory's <step>.jsonl files, in step order; at most
    max_samples samples of each (0: all)."""
    if directory is None or not directory.is_dir():
        return []
    steps = []
    for path in sorted(directory.glob("*.jsonl"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1):
        if not path.stem.isdigit():
            continue
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = lines[:max_samples] if max_samples > 0 else lines
        steps.append({"step": int(path.stem), "total": len(lines), "samples": [json.loads(line) for line in kept]})
    return steps


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def metrics_svg(rows: list[dict[str, Any]], width: int = 240, height: int = 120) -> str:
    """Small multiples, one inline SVG panel per PLOT_KEYS metric the rows have: value against step."""
    panels = []
    pad_l, pad_r, pad_t, pad_b = 58, 8, 18, 18
    for key in PLOT_KEYS:
        pts = [(r["step"], r[key]) for r in rows if _finite(r.get(key)) and _finite(r.get("step"))]
        if not pts:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)

        def px(x: float, lo: float = x0, hi: float = x1) -> float:
            return pad_l + (x - lo) / ((hi - lo) or 1) * (width - pad_l - pad_r)

        def py(y: float, lo: float = y0, hi: float = y1) -> float:
            return height - pad_b - (y - lo) / ((hi - lo) or 1) * (height - pad_t - pad_b)

        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        dots = "".join(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2"/>' for x, y in pts)
        panels.append(
            f'<svg class="panel" data-metric="{html.escape(key)}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
            f'<text class="title" x="{pad_l}" y="12">{html.escape(key)}</text>'
            f'<text class="tick" x="{pad_l - 4}" y="{pad_t + 4}" text-anchor="end">{y1:.4g}</text>'
            f'<text class="tick" x="{pad_l - 4}" y="{height - pad_b}" text-anchor="end">{y0:.4g}</text>'
            f'<text class="tick" x="{pad_l}" y="{height - 4}">{x0:g}</text>'
            f'<text class="tick" x="{width - pad_r}" y="{height - 4}" text-anchor="end">{x1:g}</text>'
            f'<rect x="{pad_l}" y="{pad_t}" width="{width - pad_l - pad_r}" height="{height - pad_t - pad_b}"/>'
            f'<polyline points="{line}"/>{dots}</svg>')
    return "".join(panels) or '<p class="note">no metrics.jsonl in this run directory</p>'


def _embed(data: Any) -> str:
    """JSON that stays inert inside <script type="application/json">: no `<`, `>` or `&` in it."""
    text = json.dumps(data, ensure_ascii=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}
header{padding:8px 16px;background:#f3f3f3;border-bottom:1px solid #ddd}
h1{font-size:17px;margin:0}
#plot{padding:6px 16px;display:flex;flex-wrap:wrap;gap:6px}
.panel rect{fill:none;stroke:#ccc}.panel polyline{fill:none;stroke:#1f77b4;stroke-width:1.5}
.panel circle{fill:#1f77b4}.panel .title{font-size:11px;font-weight:600}.panel .tick{font-size:9px;fill:#666}
#layout{display:flex;border-top:1px solid #ddd}
nav{width:150px;flex:none;border-right:1px solid #ddd;padding:6px}
nav h2{font-size:12px;margin:8px 0 2px;color:#555}
nav button{display:block;width:100%;text-align:left;border:0;background:none;padding:2px 6px;cursor:pointer}
nav button.current{background:#dbe9f7;font-weight:600}
main{flex:1;padding:6px 14px;min-width:0}
#controls{margin:4px 0 8px}#controls label{margin-right:10px}
.sample{border:1px solid #ddd;border-radius:4px;margin:8px 0;padding:6px 8px}
.meta{font-size:12px;color:#555}.meta b{color:#222}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font:12px/1.45 ui-monospace,monospace}
.input{color:#555;background:#fafafa}
.tok{border-radius:2px}.tok.untrained{color:#888;background:#eee;font-style:italic}
.mode-advantage .a-p1{background:#dff2df}.mode-advantage .a-p2{background:#a9dfa9}.mode-advantage .a-p3{background:#5fbf5f}
.mode-advantage .a-n1{background:#fbe0e0}.mode-advantage .a-n2{background:#f3a9a9}.mode-advantage .a-n3{background:#e06060}
.mode-gap .g0{background:#f4f4ff}.mode-gap .g1{background:#ffe9b3}.mode-gap .g2{background:#ffc266}
.mode-gap .g3{background:#ff7a33}.mode-gap .g-na{background:none}
.turn{border-left:3px solid #999;padding-left:6px;margin:4px 0}.turn.assistant{border-color:#1f77b4}
.role{font-size:11px;font-weight:600;color:#555}
.legend span{padding:0 5px;margin-right:3px}
.note{color:#777}
"""

SCRIPT = r"""
const data = JSON.parse(document.getElementById('trace-data').textContent);
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; };
const fmt = v => typeof v !== 'number' || Number.isInteger(v) ? String(v)
  : Math.abs(v) >= 1e-3 ? v.toFixed(3) : v.toExponential(1);
const views = [];
for (const kind of ['rollout', 'validation']) for (const s of data[kind]) views.push({kind, ...s});
const state = {view: null, colour: 'advantage'};

function advClass(a, scale) {
  if (!a || !scale) return 'a-z';
  const level = Math.min(3, Math.max(1, Math.ceil(3 * Math.abs(a) / scale)));
  return (a > 0 ? 'a-p' : 'a-n') + level;
}
function gapClass(g) {
  if (g === null || g === undefined) return 'g-na';
  const m = Math.abs(g);
  return m < 1e-4 ? 'g0' : m < 1e-2 ? 'g1' : m < 1e-1 ? 'g2' : 'g3';
}
function tokens(sample, scale) {
  const pre = el('pre', 'response');
  sample.pieces.forEach((piece, i) => {
    const a = sample.token_advantages[i], g = sample.logprob_gap ? sample.logprob_gap[i] : null;
    const span = el('span', 'tok ' + (sample.mask[i] ? advClass(a, scale) + ' ' + gapClass(g) : 'untrained'), piece);
    span.title = 'token ' + sample.tokens[i] + (sample.mask[i] ? '' : ' (not trained)') + ' · advantage ' + fmt(a) +
      (g === null ? '' : ' · engine - actor log-prob ' + fmt(g));
    pre.appendChild(span);
  });
  return pre;
}
function sampleCard(sample, index, scale) {
  const card = el('article', 'sample');
  const meta = el('div', 'meta');
  const fields = [['#', String(index)], ['score', sample.score], ['advantage', sample.advantage], ['gts', sample.gts],
    ['data_source', sample.data_source], ['num_turns', sample.num_turns]];
  for (const [name, value] of fields) if (value !== undefined && value !== null) {
    meta.appendChild(el('b', '', name + ' ')); meta.appendChild(document.createTextNode(fmt(value) + '  '));
  }
  card.appendChild(meta);
  card.appendChild(el('pre', 'input', sample.input));
  if (sample.pieces) card.appendChild(tokens(sample, scale));
  else if (sample.turns) for (const turn of sample.turns) {
    const t = el('div', 'turn ' + (turn.role === 'assistant' ? 'assistant' : 'other'));
    t.appendChild(el('div', 'role', turn.role + (turn.trained ? '' : ' (not trained)') + ' · ' + turn.tokens + ' tokens'));
    t.appendChild(el('pre', 'turn-text', turn.text));
    card.appendChild(t);
  }
  else card.appendChild(el('pre', 'output', sample.output));
  return card;
}
function legend() {
  const box = el('div', 'legend');
  const items = state.colour === 'advantage'
    ? [['a-n3', 'most negative'], ['a-n1', '< 0'], ['a-p1', '> 0'], ['a-p3', 'most positive']]
    : [['g0', '|gap| < 1e-4'], ['g1', '< 1e-2'], ['g2', '< 0.1'], ['g3', '>= 0.1']];
  box.appendChild(document.createTextNode(state.colour === 'advantage' ? 'advantage: ' : 'engine - actor log-prob: '));
  for (const [cls, text] of items) box.appendChild(el('span', 'tok ' + cls, text));
  box.appendChild(el('span', 'tok untrained', 'not trained'));
  return box;
}
function render() {
  document.body.className = 'mode-' + state.colour;
  for (const b of document.querySelectorAll('nav button'))
    b.classList.toggle('current', b.dataset.view === state.view);
  const main = document.getElementById('samples');
  main.replaceChildren();
  const view = views.find(v => v.kind + ':' + v.step === state.view);
  if (!view) { main.appendChild(el('p', 'note', 'no dumped samples: set trainer.rollout_data_dir')); return; }
  main.appendChild(el('h2', 'view-title', (view.kind === 'rollout' ? 'training step ' : 'validation at step ') +
    view.step + ': ' + view.samples.length + ' of ' + view.total + ' samples'));
  if (view.kind === 'rollout') main.appendChild(legend());
  const scale = Math.max(0, ...view.samples.flatMap(s => (s.token_advantages || []).filter((_, i) => s.mask[i])
    .map(Math.abs)));  // the step's largest |advantage| on a trained token
  view.samples.forEach((s, i) => main.appendChild(sampleCard(s, i, scale)));
}
function fromHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  state.view = params.get('step') || (views[0] ? views[0].kind + ':' + views[0].step : null);
  state.colour = params.get('colour') === 'gap' ? 'gap' : 'advantage';
  for (const r of document.querySelectorAll('input[name=colour]')) r.checked = r.value === state.colour;
  render();
}
function toHash() { location.hash = 'step=' + state.view + '&colour=' + state.colour; }
const nav = document.getElementById('steps');
for (const kind of ['rollout', 'validation']) {
  const these = views.filter(v => v.kind === kind);
  nav.appendChild(el('h2', '', kind === 'rollout' ? 'training steps' : 'validation'));
  if (!these.length) nav.appendChild(el('div', 'note', 'none'));
  for (const v of these) {
    const b = el('button', 'step', 'step ' + v.step + ' (' + v.total + ')');
    b.dataset.view = v.kind + ':' + v.step;
    b.onclick = () => { state.view = b.dataset.view; toHash(); };
    nav.appendChild(b);
  }
}
for (const r of document.querySelectorAll('input[name=colour]')) r.onchange = () => { state.colour = r.value; toHash(); };
window.addEventListener('hashchange', fromHash);
fromHash();
"""


def render_page(run_dir: Path, rollout_dir: Path | None, validation_dir: Path | None, max_samples: int) -> str:
    """The page's HTML: the metrics plot, the steps list, the samples (drawn by SCRIPT from the embedded JSON)."""
    metrics_file = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()] \
        if metrics_file.is_file() else []
    data = {"rollout": read_steps(rollout_dir, max_samples), "validation": read_steps(validation_dir, max_samples)}
    title = html.escape(f"traces: {run_dir}")
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title><style>{STYLE}</style></head>'
            f'<body class="mode-advantage"><header><h1>{title}</h1></header>'
            f'<section id="plot">{metrics_svg(rows)}</section>'
            '<div id="layout"><nav id="steps"></nav><main><div id="controls">colour tokens by '
            '<label><input type="radio" name="colour" value="advantage" checked> advantage</label>'
            '<label><input type="radio" name="colour" value="gap"> engine - actor log-prob gap</label></div>'
            '<div id="samples"></div></main></div>'
            f'<script type="application/json" id="trace-data">{_embed(data)}</script>'
            f'<script>{SCRIPT}</script></body></html>')


def find_dump_dirs(run_dir: Path, rollout_dir: str | None, validation_dir: str | None) -> tuple[Path | None, Path]:
    """The two dump directories: as given, else from config.yaml's trainer.rollout_data_dir and
    trainer.validation_data_dir (null: none, and <run>/val_generations). A relative path is tried
    from the current directory (where the trainer ran, as verl resolves it), then from the run's."""
    def locate(path: str | None) -> Path | None:
        if path is None:
            return None
        candidates = [Path(path), run_dir / path, run_dir.parent / path]
        return next((p for p in candidates if p.is_dir()), Path(path))

    rollout = locate(rollout_dir or config_value(run_dir, "rollout_data_dir"))
    validation = locate(validation_dir or config_value(run_dir, "validation_data_dir")) or run_dir / "val_generations"
    return rollout, validation


def chromium_binary() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))),
                None)


def chromium(page: Path, *, screenshot: Path | None = None, fragment: str = "", size: str = "1280,900",
             timeout: float = 60.0) -> str:
    """Load `page` in headless Chromium and return the DOM after its scripts ran; with `screenshot`, also
    write a PNG of the window. Raises RuntimeError when no Chromium is installed (Debian: apt-get install
    chromium; `make chromium`)."""
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("no chromium on PATH: install Debian's package (apt-get install chromium, or "
                           "`make chromium` as root)")
    url = page.resolve().as_uri() + (f"#{fragment}" if fragment else "")
    with tempfile.TemporaryDirectory() as profile:
        flags = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
                 f"--window-size={size}", "--hide-scrollbars"]
        if screenshot is not None:
            subprocess.run([*flags, f"--screenshot={screenshot.resolve()}", url], check=True, capture_output=True,
                           timeout=timeout)
        out = subprocess.run([*flags, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=timeout)
    return out.stdout


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write one self-contained HTML page of a run's rollout traces.")
    ap.add_argument("run_dir", type=Path, help="the run's trainer.default_local_dir")
    ap.add_argument("--out", type=Path, help="the page (default: <run_dir>/traces.html)")
    ap.add_argument("--rollout-dir", help="the training dumps (default: config.yaml's trainer.rollout_data_dir)")
    ap.add_argument("--validation-dir", help="the validation dumps (default: config.yaml's "
                    "trainer.validation_data_dir, else <run_dir>/val_generations)")
    ap.add_argument("--max-samples", type=int, default=64, help="samples shown per step (0: all; default 64)")
    ap.add_argument("--screenshot", type=Path, help="also write a PNG of the page in headless Chromium")
    ap.add_argument("--fragment", default="", help="the view of the screenshot, e.g. step=rollout:2&colour=gap")
    args = ap.parse_args(argv)
    if not args.run_dir.is_dir():
        sys.exit(f"trace_viewer: {args.run_dir} is not a directory (give a run's trainer.default_local_dir)")
    rollout_dir, validation_dir = find_dump_dirs(args.run_dir, args.rollout_dir, args.validation_dir)
    out = args.out or args.run_dir / "traces.html"
    page = render_page(args.run_dir, rollout_dir, validation_dir, args.max_samples)
    out.write_text(page)
    found = {name: len(read_steps(d, 1)) for name, d in (("training", rollout_dir), ("validation", validation_dir))}
    print(f"{out}: {found['training']} training steps (from {rollout_dir}), {found['validation']} validations "
          f"(from {validation_dir})")
    if args.screenshot is not None:
        chromium(out, screenshot=args.screenshot, fragment=args.fragment)
        print(f"screenshot: {args.screenshot}")


if __name__ == "__main__":
    main()
