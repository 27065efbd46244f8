# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # docs
#
# > The offline docs site: executed notebooks with nbdev's directives honoured, an API reference, MathJax served locally.

# %%
#| default_exp docs

# %%
#| export
from __future__ import annotations
import base64, contextlib, copy, hashlib, importlib, json, logging, math, os, re, shutil, signal, subprocess, sys, tempfile, time
from pathlib import Path
from typing import Callable
from html import escape as _escape
from capbook.core import CapbookError, atomic_write, io_error, temp_dir

class _Deferred:
    "A module imported where it is first used. nbformat brings jsonschema, whose format checker compiles its grammars as it is imported (about a second), and every kernel of the book imports this module with the model registry (`capbook.models`) without reading a notebook."
    def __init__(self, name: str): self._name = name
    def __getattr__(self, attr: str): return getattr(importlib.import_module(self._name), attr)

nbformat = _Deferred("nbformat")

# %% [markdown]
# ## How the site is built
#
# The site shows what a run computed, so it is built from the *executed* copies of the notebooks that papermill writes
# to the run folder, never from the clean sources in `nbs/`. Jupyter Book 1.x renders them with execution switched off;
# it needs no network (version 2 downloads its theme, so capbook never uses it). Three things stand between an nbdev
# notebook and a clean page, and `prepare_notebook` handles them on a copy:
#
# - **nbdev directives.** myst-nb does not know nbdev's `#|` lines. `#| hide` and `#| default_exp` cells are dropped,
#   `#| echo: false` keeps only the outputs, `#| output: false` only the input, and the directive lines themselves are
#   stripped from every code cell that is shown (`#| export` cells stay visible: the book is about the code).
# - **Markdown outputs.** `show_doc` writes markdown that opens with a `---` rule; docutils asserts that a transition
#   never opens (or closes) a container and the whole build crashes. Rules at either end of a markdown output are
#   removed. Markdown outputs are parsed as MyST, so their pipe tables and `$...$` maths render.
# - **Widgets.** A notebook carrying widget state makes myst-nb load RequireJS from a CDN; widget state and widget
#   views are dropped, so every page stays offline.
#
# Images (`image/png`) and HTML outputs (pandas tables) pass through untouched. Equations in markdown cells (`$...$`,
# `$$...$$`, `\begin{align}`) are rendered by the MathJax copy that `sphinx-mathjax-offline` ships into `_static/`.

# %%
#| export
_DIRECTIVE = re.compile(r"^\s*#\s*\|\s*([\w-]+)\s*:?\s*(.*?)\s*$")
_HIDE_LINE = re.compile(r"#\s*\|\s*hide_line\s*$")
_RULE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_DROP = {"hide", "default_exp"}

def nbdev_directives(source: str) -> tuple[dict[str, str], str]:
    "Split the `#|` lines at the top of a code cell into `{name: value}` and the source after them (`#|hide_line` lines removed)."
    lines, dirs, i = source.splitlines(), {}, 0
    while i < len(lines) and ((m := _DIRECTIVE.match(lines[i])) or not lines[i].strip()):
        if m: dirs[m[1].lower()] = m[2]
        i += 1
    return dirs, "\n".join(l for l in lines[i:] if not _HIDE_LINE.search(l))

def _off(value: str) -> bool: return value.lower() in ("false", "no", "0")

def sanitize_markdown(md: str) -> str:
    "Remove the thematic breaks (`---`) opening or closing a markdown output, which crash docutils inside a container."
    lines = md.splitlines()
    while lines and (not lines[0].strip() or _RULE.match(lines[0])): lines.pop(0)
    while lines and (not lines[-1].strip() or _RULE.match(lines[-1]) and (len(lines) < 2 or not lines[-2].strip())):
        lines.pop()
    return "\n".join(lines)

STRIP = 4.0     # an image at least this many times wider than high (a per-word attention strip) keeps its size and scrolls
SCALE = 0.75    # the least a figure is shrunk to fit: its 9-point labels (110 dpi: 13.8 px) stay over 10 px; past that it scrolls
COLUMN = 680    # the page's column at 1,280 px, in CSS pixels: a wider figure takes the page's full width (the column and its margin)

def png_size(b64: str) -> tuple[int, int] | None:
    "The (width, height) in pixels of a base64 PNG, read from its header; None if it is not a PNG."
    import base64, struct
    try: head = base64.b64decode("".join(b64[:64].split())[:44])
    except ValueError: return None
    return struct.unpack(">II", head[16:24]) if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR" else None

def figure_html(b64: str, caption: str | None) -> str | None:
    "A PNG figure as the site shows it, with its caption under it: at its own size (one image pixel a CSS pixel) where it fits, else shrunk to the width it has but never below `SCALE` of its size, scrolling sideways past that; a strip (`STRIP`) always at its own size. None if `b64` is not a PNG."
    size = png_size(b64)
    if size is None: return None
    w, h = size
    fit = f"width: {w}px" if w >= STRIP * h else f"width: min(100%, {w}px); min-width: {math.ceil(SCALE * w)}px"
    text = _escape(caption or "")
    return (f'<figure class="capbook-figure"><div style="overflow-x: auto"><img src="data:image/png;base64,{"".join(b64.split())}" '
            f'alt="{text}" style="max-width: none; height: auto; {fit}"></div>' + (f"<figcaption>{text}</figcaption>" * bool(text)) + "</figure>")

_INLINE_PNG = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
FIGURES = "_static/figures"     # where the site keeps its figures, one file each by content

def figure_files(text: str, src: Path) -> str:
    "`text` (a page's HTML or Markdown) with each inline PNG of `figure_html` written once, by content, under the site's `FIGURES` and linked from there: a figure a reader can open alone, and pages that stay small."
    def save(m: re.Match) -> str:
        data = base64.b64decode(m[1])
        path = Path(src) / FIGURES / f"{hashlib.sha256(data).hexdigest()[:16]}.png"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True); atomic_write(path, lambda t: t.write_bytes(data))
        return f'src="{FIGURES}/{path.name}"'
    return _INLINE_PNG.sub(save, text)

def wide(b64: str) -> bool:
    "Whether a PNG is wider than the page's column (`COLUMN`): its cell takes the page's full width."
    return (png_size(b64) or (0, 0))[0] > COLUMN

WIDE = 8                          # a table of more columns shows a reader's columns on the site and folds all of them
READER = ("training", "seeds", "CIDEr", "semantic F1", "F1 all", "Δ CIDEr", "p", "on this run", "verdict", "Holm", "tests")
MERGED = {"CIDEr": "CIDEr 95% CI", "F1 all": "semantic F1 95% CI"}       # a score and its interval: one cell
_PIPE_TABLE = re.compile(r"^\|.*\|[ \t]*\n\|[ \t:|-]+\|[ \t]*\n(?:\|.*\|[ \t]*\n?)*", re.M)
_OURS = re.compile(r"^(\S+) \(capbook, \w+ profile\)$")                # shapes (capbook, default profile): shapes

def _cells(line: str) -> list[str]: return [c.strip() for c in line.strip().strip("|").split("|")]

def _number(c: str) -> float | None:
    "The cell's number, None for text or a number that is not finite."
    import math
    try: return x if math.isfinite(x := float(c)) else None
    except ValueError: return None

def _as_integers(col: list[str]) -> list[str]:
    "A column whose numbers are all whole shown as integers (3.00 seeds: 3), else as it is."
    nums = [_number(c) for c in col]
    if all(n is None and c in ("—", "") or n is not None and n == int(n) for c, n in zip(col, nums)) and any(n is not None for n in nums):
        return [c if n is None else str(int(n)) for c, n in zip(col, nums)]
    return col

def reader_table(md: str) -> str:
    "A Markdown table as the site shows it: dataset labels short (shapes, not 'shapes (capbook, default profile)') and whole numbers as integers; a table wider than `WIDE` columns shows the row names and a reader's columns (`READER`: seeds, CIDEr with its interval in one cell, semantic F1 likewise, the claim's difference, p and verdict), a note column as footnotes, and every column in a folded block under it. A table it cannot read is left as it is."
    lines = md.rstrip("\n").split("\n")
    head, rows = _cells(lines[0]), [_cells(l) for l in lines[2:]]
    if any(len(r) != len(head) for r in rows): return md
    cols = {h: _as_integers([_OURS.sub(r"\1", r[i]) for r in rows]) for i, h in enumerate(head)}
    if len(head) != len(cols): return md                                     # two columns of one name
    def table(names: list[str]) -> str:
        out = ["| " + " | ".join(names) + " |", "|" + "|".join(":---" if all(_number(c) is None for c in cols[n]) else "---:" for n in names) + "|"]
        return "\n".join(out + ["| " + " | ".join(cols[n][i] for n in names) + " |" for i in range(len(rows))])
    if len(head) <= WIDE: return table(head)
    prose = lambda h: h != head[0] and sum(map(len, cols[h])) > 40 * len(rows)
    names = []
    for h in head:
        if h in READER or h in MERGED.values() or any(_number(c) is not None for c in cols[h]): break
        if not prose(h) and h != "note": names.append(h)
    keep = [h for h in READER if h in cols and h not in names]
    if len(keep) < 2:                                                         # no reader's column: the F1s, else the first columns
        keep = [h for h in head if h.endswith("F1") and h not in names] or [h for h in head if h not in names and not prose(h)]
        keep = keep[:max(1, WIDE - len(names))]
    for score, ci in MERGED.items():
        if score in keep and ci in cols:
            cols[score] = [f"{a} {b}" if b not in ("—", "") else a for a, b in zip(cols[score], cols[ci])]
            title = "semantic F1" if score == "F1 all" else score
            cols[f"{title} [95% CI]"] = cols.pop(score); keep[keep.index(score)] = f"{title} [95% CI]"
    if "Δ CIDEr" in keep and {"95% CI low", "95% CI high"} <= set(cols):
        cols["Δ CIDEr [95% CI]"] = [f"{d} [{lo}, {hi}]" for d, lo, hi in zip(cols.pop("Δ CIDEr"), cols["95% CI low"], cols["95% CI high"])]
        keep[keep.index("Δ CIDEr")] = "Δ CIDEr [95% CI]"
    notes, marks = [], []
    if "note" in cols and names:
        for n in cols["note"]:
            if n in ("—", ""): marks.append(""); continue
            if n not in notes: notes.append(n)
            marks.append(f" [{notes.index(n) + 1}]")
        cols[names[-1]] = [c + m for c, m in zip(cols[names[-1]], marks)]      # on the row's name
    foot = "".join(f"\n\n[{i + 1}] {n}" for i, n in enumerate(notes))
    return (table(names + keep) + foot + f"\n\n<details><summary>All {len(head)} columns</summary>\n\n"
            + "\n".join(lines) + "\n\n</details>")

def frame_markdown(html: str) -> str | None:
    "A pandas DataFrame's HTML output (`class=\"dataframe\"`) as a Markdown table, its index left out where it is the default 0, 1, ... (then `reader_table` can shape it for the site); None for any other HTML."
    from html.parser import HTMLParser
    if html.count('class="dataframe"') != 1 or html.count("<table") != 1: return None
    rows: list[list[str]] = []
    class Frame(HTMLParser):
        cell = None
        def handle_starttag(self, tag, attrs):
            if tag == "tr": rows.append([])
            elif tag in ("td", "th") and rows: self.cell = ""
        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.cell is not None: rows[-1].append(" ".join(self.cell.split()).replace("|", "\\|")); self.cell = None
        def handle_data(self, data):
            if self.cell is not None: self.cell += data
    Frame().feed(html)
    if len(rows) < 2 or any(len(r) != len(rows[0]) for r in rows) or len(rows[0]) < 2: return None
    if [r[0] for r in rows[1:]] == [str(i) for i in range(len(rows) - 1)] and not rows[0][0]: rows = [r[1:] for r in rows]
    head = rows[0]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"] + ["| " + " | ".join(r) + " |" for r in rows[1:]])

def reader_tables(md: str) -> str:
    "Every Markdown table in `md` as the site shows it (`reader_table`)."
    return _PIPE_TABLE.sub(lambda m: reader_table(m.group(0)) + ("\n" if m.group(0).endswith("\n") else ""), md)

_PATH_REPR = re.compile(r"\b(?:Posix|Windows|Pure\w*)?Path\('([^'\n]*)'\)")

def _clean_output(out: nbformat.NotebookNode, caption: str | None = None) -> nbformat.NotebookNode | None:
    "An output as the site shows it; None for a widget view (its state is not kept) or a stream left empty by `_quiet`; a figure as HTML at its size with its `caption` (`figure_html`); a path's repr as the path."
    data = out.get("data", {})
    if _WIDGET_VIEW in data: return None
    if "image/png" in data and (fig := figure_html(data["image/png"], caption)):
        out["data"] = {"text/html": fig}
        return out
    if "text/html" in data and (md := frame_markdown(data["text/html"] if isinstance(data["text/html"], str) else "".join(data["text/html"]))):
        out["data"] = {"text/markdown": md}                  # a DataFrame: a Markdown table the site can shape like the others
        data = out["data"]                                   # (a notebook node copies what it is given)
    if "text/markdown" in data:
        data["text/markdown"] = reader_tables(sanitize_markdown(data["text/markdown"]))
    if set(data) == {"text/plain"}:               # a value's repr: a path shows as the path, not as PosixPath('...')
        text = data["text/plain"] if isinstance(data["text/plain"], str) else "".join(data["text/plain"])
        data["text/plain"] = _PATH_REPR.sub(lambda m: m[1], text)
    if out.get("output_type") == "stream":
        out["text"] = _quiet(out["text"])
        if not out["text"]: return None
    return out

_EQUATION = re.compile(r"^\s*#.*[=≈∝]", re.M)        # a comment line stating an equation: the code under it is the paper's

def _builds_only(cell: nbformat.NotebookNode) -> bool:
    "Whether a code cell only builds what it shows (a table, a figure) — folded on the site — rather than state the paper's equations or the book's example code: it shows an image, a Markdown table or HTML and defines nothing."
    shows = any(k in o.get("data", {}) for o in cell.outputs for k in ("image/png", "text/markdown", "text/html"))
    return shows and not _EQUATION.search(cell.source) and not re.search(r"^(def|class) ", cell.source, re.M)

TABLES_PAGE = re.compile(r"^(?!00)\d\da_")       # a tables chapter (02a_, 03a_, ...): it assembles earlier runs' results
ASSEMBLED = "How these tables were assembled"      # the section at the end of a tables chapter that keeps its books
_FOLDED = {"remove-input", "hide-input", "hide-cell"}

def _bookkeeping(cell: nbformat.NotebookNode, dirs: dict[str, str]) -> bool:
    "A cell that keeps books (`#| bookkeeping`: the run list, records, hashes), a run's parameters cell or papermill's note of them."
    return "bookkeeping" in dirs or "parameters" in cell.metadata.get("tags", []) or \
        (cell.cell_type == "markdown" and cell.source.startswith("*This run used"))

def _once(outputs: list) -> list:
    "A cell's outputs with an image it showed twice kept once (a figure displayed, then shown again by the inline backend at the cell's end)."
    seen, kept = set(), []
    for o in outputs:
        png = "".join(str(o.get("data", {}).get("image/png", "")).split())
        if png and png in seen: continue
        seen.add(png); kept.append(o)
    return kept

_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)

def _heading(md: str) -> str | None:
    "The last heading of a Markdown cell: the section its next cells are in."
    found = _HEADING.findall(md)
    return found[-1] if found else None

def prepare_notebook(nb: nbformat.NotebookNode, tables: bool = False) -> nbformat.NotebookNode:
    "A copy of an executed notebook as the site shows it: nbdev directives honoured, outputs made safe for docutils; a cell that only draws a table or figure folded; on a tables chapter (`tables`), every code cell folded and the cells that keep books moved, folded, to a last section (`ASSEMBLED`)."
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    nb.metadata.setdefault("language_info", {"name": "python"})
    cells, books, heading = [], [], None
    for cell in nb.cells:
        dirs = {}
        if cell.cell_type == "markdown": heading = _heading(cell.source) or heading
        if cell.cell_type == "code":
            dirs, cell.source = nbdev_directives(cell.source)
            if dirs.keys() & _DROP or _off(dirs.get("include", "")): continue
            tags = cell.metadata.setdefault("tags", [])
            if _off(dirs.get("echo", "")): tags.append("remove-input")
            if _off(dirs.get("output", "")): tags.append("remove-output")
            if not _off(dirs.get("code-fold", "false")): tags.append("hide-input")
            cell.outputs = _once(cell.outputs)
            if any(wide(o.get("data", {}).get("image/png", "")) for o in cell.outputs): tags.append("full-width")
            cell.outputs = [o for o in (_clean_output(o, dirs.get("fig-cap") or heading) for o in cell.outputs) if o is not None]
            if (tables or _builds_only(cell)) and not _FOLDED & set(tags): tags.append("hide-input")   # builds a table or figure: folded
            if not cell.source.strip() and not cell.outputs: continue
        if tables and _bookkeeping(cell, dirs):
            if cell.cell_type == "code": cell.metadata["tags"] = [t for t in cell.metadata["tags"] if t not in _FOLDED] + ["hide-cell"]
            books.append(cell); continue
        cells.append(cell)
    if books:
        cells.append(nbformat.v4.new_markdown_cell(f"## {ASSEMBLED}\n\nThe runs this page reads, their records and the "
                                                   "parameters it ran with (unfold a cell to see it)."))
    nb.cells = cells + books
    return nb


# %% [markdown]
# A check on a small notebook: the hidden and `default_exp` cells go, directive lines vanish from what is shown, `echo`
# and `output` become Jupyter Book's `remove-input` / `remove-output` tags, and `show_doc`'s opening rule is removed
# while a setext heading's underline at the end survives.

# %%
_nb = nbformat.v4.new_notebook(cells=[
    nbformat.v4.new_code_cell("#| default_exp x"), nbformat.v4.new_code_cell("#| hide\nsecret = 1"),
    nbformat.v4.new_code_cell("#|export\n#| eval: false\ndef f(): pass\nx = 1 #| hide_line"),
    nbformat.v4.new_code_cell("#| echo: false\nplot()"), nbformat.v4.new_code_cell("#| output: false\nnoisy()")])
_nb.cells[3].outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": "---\n\n### f\n\n*Doc.*\n\n---\n"})]
_p = prepare_notebook(_nb)
assert [c.source for c in _p.cells] == ["def f(): pass", "plot()", "noisy()"]
assert [c.metadata.tags for c in _p.cells] == [[], ["remove-input"], ["remove-output"]]
assert _p.cells[1].outputs[0].data["text/markdown"] == "### f\n\n*Doc.*"
assert sanitize_markdown("Title\n---") == "Title\n---" and _nb.cells[1].source.startswith("#| hide")

# %% [markdown]
# On a tables chapter every code cell is folded (its code assembles results; the method's code is in its chapter), and
# what keeps books — a `#| bookkeeping` cell, the parameters cell, papermill's note of them — moves, folded, to the
# page's last section. A path's repr shows as the path.

# %%
_t = nbformat.v4.new_notebook(cells=[
    nbformat.v4.new_markdown_cell("# 09a_tables"), nbformat.v4.new_code_cell("profile = 'default'", metadata={"tags": ["parameters"]}),
    nbformat.v4.new_markdown_cell("*This run used the defaults above.*"), nbformat.v4.new_code_cell("#| bookkeeping\nruns"),
    nbformat.v4.new_code_cell("def row(r): return r\nrun.path('t')")])
_t.cells[4].outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "PosixPath('runs/default/t')"}, execution_count=1)]
_p = prepare_notebook(_t, tables=True)
assert [c.source.splitlines()[0] for c in _p.cells] == ["# 09a_tables", "def row(r): return r", f"## {ASSEMBLED}",
                                                       "profile = 'default'", "*This run used the defaults above.*", "runs"]
assert _p.cells[1].metadata.tags == ["hide-input"] and _p.cells[3].metadata.tags == ["parameters", "hide-cell"]
assert _p.cells[1].outputs[0].data["text/plain"] == "runs/default/t" and prepare_notebook(_t).cells[-1].metadata.tags == []

# %% [markdown]
# A table fits a reader's screen: a wide one shows its row names and a reader's columns (seeds, CIDEr with its
# interval in one cell), whole numbers as integers, the dataset's label short and a note as a footnote, and keeps every
# column in a folded block; a DataFrame's HTML becomes the same kind of table.

# %%
_wide = ("| dataset | model | seeds | CIDEr | CIDEr sd | CIDEr 95% CI | BLEU-4 | F1 all | att. mass | note |\n|:--|:--|--:|--:|:--|:--|--:|--:|--:|:--|\n"
         "| shapes (capbook, default profile) | soft | 3.00 | 101.50 | 3.8 | [89.9, 113.1] | 32.4 | 24.4 | 39.5 | the protocol |")
_r = reader_table(_wide)
assert _r.startswith("| dataset | model | seeds | CIDEr [95% CI] | F1 all |\n") and "| shapes | soft [1] | 3 | 101.50 [89.9, 113.1] | 24.4 |" in _r
assert "[1] the protocol" in _r and "<details><summary>All 10 columns</summary>" in _r and _wide in _r
assert reader_table("| a | b |\n|--|--|\n| 1.0 | x |") == "| a | b |\n|---:|:---|\n| 1 | x |"
assert frame_markdown('<table border="1" class="dataframe"><thead><tr><th></th><th>loss</th></tr></thead>'
                      '<tbody><tr><th>0</th><td>1.5</td></tr><tr><th>1</th><td>1.2</td></tr></tbody></table>') == "| loss |\n|---|\n| 1.5 |\n| 1.2 |"

# %% [markdown]
# A figure is shown at its own size, one image pixel to a CSS pixel, so that its 9-point labels stay as drawn; one wider
# than the column (`COLUMN`) gets the page's full width, the column and its margin; one wider still is shrunk to fit, but
# never below three quarters of its size (`SCALE`), and past that it scrolls sideways. A strip of per-word panels (here
# 2,000 × 200 pixels) always keeps its size. Every figure carries a caption under it: its cell's `#| fig-cap:` line, or
# else the heading of the section that shows it. A figure a cell shows twice (displayed, then shown again by the inline
# backend as the cell ends) is shown once.

# %%
import io as _io
from PIL import Image as _PILImage
def _png_b64(w, h):
    buf = _io.BytesIO(); _PILImage.new("RGB", (w, h)).save(buf, format="PNG")
    return __import__("base64").b64encode(buf.getvalue()).decode()
def _fig_out(w, h): return nbformat.v4.new_output("display_data", data={"image/png": _png_b64(w, h), "text/plain": "<Figure>"})
_strip, _plain, _wide = _fig_out(2000, 200), _fig_out(600, 400), _fig_out(1200, 800)
assert png_size(_plain.data["image/png"]) == (600, 400) and png_size("bm90IGEgcG5n") is None
assert not wide(_plain.data["image/png"]) and wide(_wide.data["image/png"])
assert list(_clean_output(_strip, "Attention, word by word").data) == ["text/html"]
assert "max-width: none; height: auto; width: 2000px" in _strip.data["text/html"]
assert "width: min(100%, 1200px); min-width: 900px" in _clean_output(_wide, "A <wide> one").data["text/html"]
assert "<figcaption>A &lt;wide&gt; one</figcaption>" in _wide.data["text/html"]
_site = Path(tempfile.mkdtemp())                       # on the site, a figure is a file of its own, stored once by content
assert figure_files(_wide.data["text/html"] * 2, _site).count(f'src="{FIGURES}/') == 2 and len(list((_site / FIGURES).glob("*.png"))) == 1
_fig_nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("## Where it looks"),
                                          nbformat.v4.new_code_cell("show()", outputs=[_fig_out(600, 400)]),
                                          nbformat.v4.new_code_cell("#| fig-cap: Figure 1: the same, captioned\nshow()", outputs=[_fig_out(1200, 800)])])
_shown = prepare_notebook(_fig_nb)
assert [c.outputs[0].data["text/html"].count("<figcaption>Where it looks<") for c in _shown.cells[1:2]] == [1]
assert "<figcaption>Figure 1: the same, captioned<" in _shown.cells[2].outputs[0].data["text/html"]
assert "full-width" in _shown.cells[2].metadata.tags and "full-width" not in _shown.cells[1].metadata.tags
_twice = nbformat.v4.new_code_cell("display(fig)", outputs=[_fig_out(600, 400), _fig_out(600, 400), _fig_out(300, 200)])
assert len(prepare_notebook(nbformat.v4.new_notebook(cells=[_twice])).cells[0].outputs) == 2      # shown twice: once on the page

# %% [markdown]
# ## The book as readers meet it, and as the repository keeps it
#
# An executed notebook is a log as much as a chapter: papermill injects a `# Parameters` cell holding the run folder of
# the machine that ran it, pycocoevalcap's Java tokenizer prints a line on its own speed into
# every evaluation, warnings and progress bars name files under the machine's virtual environment, and tables list
# record paths. `reader_notebook` turns a copy into what a reader needs: the injected cell becomes one line — "This run
# used `profile = 'default'`, …" (the run folder left out) — tool chatter is removed from the outputs, and every
# machine path is written relative to the book's folder (`runs/default/…`), with the Python installation as
# `<python>`, the home folder as `~` and the temporary folder as `<tmp>`.
#
# The default book's chapters are kept in the repository in that form (`figures/notebooks/`), so that a clone can
# build the whole site without training (`capbook docs`). `slim_notebook` takes each image out of its notebook into
# `img/<content hash>.png` beside it, so an image that did not change between two books is stored once, and git sees
# text diffs of the notebooks; `inflate_notebook` puts the images back when the site is built. Cell timings and
# papermill's metadata (which hold absolute paths and change on every run) are dropped.

# %% [markdown]
# ## The reader's copy of a run
#
# A reader's copy shows the outputs of the cells its run executed and today's prose and exported code: a paragraph or
# a docstring changed since the run needs no rerun (its key is unchanged), only a refreshed copy (`refresh_copy`).

# %%
#| export
_EXPORT = re.compile(r"^\s*#\|\s*export", re.M)

def exported(source: str) -> bool:
    "Whether a code cell's `source` is a definition nbdev exports to the package (`#| export`)."
    return bool(_EXPORT.search(source))

def _text(c) -> str: return "".join(c["source"]) if isinstance(c["source"], list) else c["source"]

def _is_run(c) -> bool:
    "A cell whose outputs are the run's: a code cell that is not an exported definition."
    return c["cell_type"] == "code" and not exported(_text(c))

def _code_of(source: str) -> str | None:
    "What a code cell computes, as its syntax tree (comments and `#|` directives are not in it); None for a cell that is not Python."
    import ast
    try: return ast.dump(ast.parse(source))
    except SyntaxError: return None

def _same_run(ran: str, today: str) -> bool:
    "Whether a cell as it ran and as it is today compute the same thing, their text differing only in comments or directives."
    return ran != today and (code := _code_of(today)) is not None and code == _code_of(ran)

def refresh_copy(nb: nbformat.NotebookNode, source: Path) -> nbformat.NotebookNode:
    "An executed notebook `nb` (a notebook node) with today's prose and exported definitions from `source` (the notebook), cell by cell id, and the outputs of the cells it ran: a docstring, a paragraph or a comment changed since the run shows as it is now. Unchanged where a cell it ran is not in `source` (then the step's key has changed and it runs again)."
    import copy
    if not Path(source).exists(): return nb
    src = json.loads(Path(source).read_text())["cells"]
    ran = {c.get("id"): i for i, c in enumerate(nb.cells)}
    if any(_is_run(c) and c.get("id") not in ran for c in src): return nb
    cells = []
    for c in src:
        if _is_run(c):
            i = ran[c["id"]]
            if _same_run(_text(nb.cells[i]), _text(c)): nb.cells[i].source = _text(c)   # its comments as they are today
            cells.append(nb.cells[i])
            if i + 1 < len(nb.cells) and _run_parameters(nb.cells[i + 1]):
                cells.append(nb.cells[i + 1])      # papermill's parameters (or a reader's note of them), after the parameters cell
        else:
            new = copy.deepcopy(nb.cells[ran[c["id"]]]) if c.get("id") in ran else None
            if new is None or new.cell_type != c["cell_type"]:
                new = (nbformat.v4.new_markdown_cell if c["cell_type"] == "markdown" else
                       nbformat.v4.new_raw_cell if c["cell_type"] == "raw" else nbformat.v4.new_code_cell)(_text(c))
                if c.get("id"): new["id"] = c["id"]
                new["metadata"] = c.get("metadata", {})
            new.source = _text(c)
            cells.append(new)
    nb.cells = cells
    return nb

def copy_current(copy: Path, source: Path) -> bool:
    "Whether a reader's copy shows its notebook's prose, exported code and comments as they are today."
    if not Path(source).exists(): return True
    had = {c.get("id"): _text(c) for c in json.loads(Path(copy).read_text())["cells"]}
    src = json.loads(Path(source).read_text())["cells"]
    return all(had.get(c.get("id")) == _text(c) for c in src if not _is_run(c)) and \
        not any(_same_run(had.get(c.get("id"), ""), _text(c)) for c in src if _is_run(c))

def _run_parameters(c) -> bool:
    "A run's own parameters cell: papermill's injected one, or the one-line note a reader's copy makes of it (`capbook.docs.reader_notebook`)."
    return "injected-parameters" in c.get("metadata", {}).get("tags", []) or \
        (c["cell_type"] == "markdown" and _text(c).startswith("*This run used"))


# %%
#| export
_CHATTER = re.compile(r"PTBTokenizer tokenized|tokens per second|it/s\]|s/it\]|\d+%\|"        # tokenizer, tqdm bars
                      r"|TqdmWarning|from \.autonotebook import|^\s*$"
                      r"|: moved to .*, training from scratch$|^resumed from \S+ at epoch")       # the checkpoint's bookkeeping
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")                 # a Python warning; its source line follows

def _quiet(text: str) -> str:
    "A stream's text without tool chatter: tokenizer and progress lines, Python warnings (and their source line)."
    out, skip = [], False
    for line in text.splitlines(keepends=True):
        if skip and line.startswith("  "): skip = False; continue
        skip = bool(_WARNING.match(line))
        if not skip and not _CHATTER.search(line.rstrip("\n")): out.append(line)
    return "".join(out)

def machine_paths() -> list[tuple[str, str]]:
    "(absolute prefix, what a reader sees instead), longest first: the book's folder, the Python installation, the home and temporary folders."
    from capbook.core import project_root
    pairs = [(str(project_root()), "."), (sys.prefix, "<python>"), (sys.base_prefix, "<python>"),
             (os.path.realpath(sys.prefix), "<python>"), (os.path.expanduser("~"), "~"),
             (tempfile.gettempdir(), "<tmp>")]
    return sorted({(a.rstrip("/"), b) for a, b in pairs if len(a.rstrip("/")) > 1}, key=lambda p: -len(p[0]))

def _relative(text: str, paths: list[tuple[str, str]]) -> str:
    "Each path of `paths` (prefix, stand-in) in `text` replaced in one pass, only where it is a whole path or a path's folder: a file tmpab/x of the temporary folder becomes `<tmp>/tmpab/x` (never `<tmp><tmp>ab/x`), and a home folder user2 is left alone where the home folder user is replaced."
    if not paths: return text
    to = dict(paths)
    alt = "|".join(re.escape(a) for a, _ in sorted(paths, key=lambda p: -len(p[0])))   # longest first: the alternation tries in order
    def stand_in(m):
        b = to[m.group(1)]
        return ("" if b == "." else b + "/") if m.group(2) else b
    # a prefix not inside a longer name (no name character before it), then a slash or the path's end (not a name character, nor '.name')
    return re.sub(rf"(?<![\w.~-])({alt})(?:(/)|(?![\w-]|\.\w))", stand_in, text)

# Another Python installation's packages: a run made by another checkout's environment on this machine (or on another
# machine) names its own `site-packages`, which `machine_paths` of the publishing process does not know.
_SITE_PACKAGES = re.compile(r"(?<![\w.~-])/[^\s\"'<>:]*?(?=/lib/python\d+\.\d+/site-packages(?![\w-]))")

def without_machine_paths(text: str) -> str:
    "`text` with this machine's paths (`machine_paths`) made relative, and any other Python installation's prefix (up to its `lib/pythonX.Y/site-packages`) shown as `<python>`: what a published file may say."
    return _SITE_PACKAGES.sub("<python>", _relative(text, machine_paths()))

def _injected_note(source: str) -> str:
    "papermill's injected parameters as one line of markdown (the run folder left out)."
    import ast
    vals = [f"`{n.targets[0].id} = {ast.unparse(n.value)}`" for n in ast.parse(source).body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id != "run_dir"]
    return ("*This run used " + ", ".join(vals) + "; every other parameter has the default above.*" if vals
            else "*This run used the defaults above.*")

def reader_notebook(nb: nbformat.NotebookNode, paths: list[tuple[str, str]] | None = None) -> nbformat.NotebookNode:
    "A copy of an executed notebook as a reader meets it: the injected parameters as one line, no tool chatter, no machine paths, no timings."
    paths, nb = machine_paths() if paths is None else paths, copy.deepcopy(nb)
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in ("kernelspec", "language_info", "jupytext")}
    cells = []
    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        if "injected-parameters" in tags:
            note = nbformat.v4.new_markdown_cell(_injected_note(cell.source))
            if cell.get("id"): note["id"] = cell["id"]        # the run's own id: a republished copy differs only where the run does
            cells.append(note); continue
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "tags"}
        cell.source = _relative(cell.source, paths)
        if cell.cell_type == "code":
            cell.execution_count = None
            outs = []
            for o in cell.outputs:
                if o.output_type == "stream":
                    o.text = _relative(_quiet(o.text), paths)
                    if not o.text: continue
                for k, v in o.get("data", {}).items():
                    if k.startswith("text/"): o.data[k] = _relative(v if isinstance(v, str) else "".join(v), paths)
                if o.output_type == "execute_result": o.execution_count = None
                outs.append(o)
            cell.outputs = outs
        cells.append(cell)
    nb.cells = cells
    return nb

_IMG_KEY = "capbook_image"                     # an output's metadata key naming its image file in `img/`

def slim_notebook(nb: nbformat.NotebookNode, img_dir: Path) -> nbformat.NotebookNode:
    "A copy of `nb` whose PNG outputs live in `img_dir/<sha256[:16]>.png` (written once per content) instead of inline."
    import base64, hashlib
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if "image/png" not in o.get("data", {}): continue
            raw = base64.b64decode(o.data.pop("image/png"))
            name = f"{hashlib.sha256(raw).hexdigest()[:16]}.png"
            if not (img_dir / name).exists(): atomic_write(img_dir / name, lambda t, raw=raw: t.write_bytes(raw))
            o.metadata[_IMG_KEY] = name
    return nb

def inflate_notebook(nb: nbformat.NotebookNode, img_dir: Path) -> nbformat.NotebookNode:
    "The inverse of `slim_notebook`: each image file back inline; a missing one stops with one line naming it."
    import base64
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if (name := o.get("metadata", {}).pop(_IMG_KEY, None)) is None: continue
            if not (img_dir / name).is_file(): raise CapbookError(f"{img_dir / name}: image of a kept notebook not found")
            o.data["image/png"] = base64.b64encode((img_dir / name).read_bytes()).decode()
    return nb

def _images_of(path: Path) -> set[str]:
    "The image files a kept notebook's outputs name."
    nb = nbformat.read(path, as_version=4)
    return {o.metadata[_IMG_KEY] for c in nb.cells for o in c.get("outputs", []) if _IMG_KEY in o.get("metadata", {})}

def _nbs() -> Path: return Path(__file__).resolve().parent.parent / "nbs"

def keep_notebooks(executed: list[Path], dst: Path, replace: bool = True) -> list[Path]:
    "Write the reader's slim copies of `executed` notebooks to `dst` (images in `dst/img/`), replacing what was there (`replace`), or only those notebooks, the others' copies and images kept (a partial book); return them."
    dst = Path(dst); dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(dst)
    try:
        new = tmp / "new"; (new / "img").mkdir(parents=True)
        for p in executed:
            nb = slim_notebook(reader_notebook(refresh_copy(_read_notebook(Path(p)), _nbs() / Path(p).name)), new / "img")
            atomic_write(new / Path(p).name, lambda t, nb=nb: nbformat.write(nb, t))
        if not replace and dst.exists():                              # the other chapters' copies, with their images
            for old in sorted(dst.glob("*.ipynb")):
                if (new / old.name).exists(): continue
                shutil.copyfile(old, new / old.name)
                for name in _images_of(old):
                    if not (new / "img" / name).exists() and (dst / "img" / name).is_file():
                        shutil.copyfile(dst / "img" / name, new / "img" / name)
        if dst.exists(): os.replace(dst, tmp / "old")                 # the old copies leave with the temporary folder
        os.replace(new, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [dst / Path(p).name for p in executed]


# %% [markdown]
# A check on a small executed notebook: the injected cell becomes its note, the tokenizer line and the machine path
# go, and an image taken out by `slim_notebook` comes back byte for byte.

# %%
import base64 as _b64
_png = _b64.b64encode(b"\x89PNG fake bytes").decode()
_ex = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("# Parameters\nprofile = \"smoke\"\nrun_dir = \"/x/runs/smoke/02\"",
                                                                metadata={"tags": ["injected-parameters"]}),
                                      nbformat.v4.new_code_cell("evaluate()")])
_ex.cells[1].outputs = [nbformat.v4.new_output("stream", name="stderr", text="PTBTokenizer tokenized 3113 tokens at 36478.7 tokens per second.\n"),
                        nbformat.v4.new_output("stream", name="stdout", text="record: /x/runs/smoke/02/record.json\n"),
                        nbformat.v4.new_output("display_data", data={"image/png": _png, "text/plain": "<Figure>"})]
_r = reader_notebook(_ex, [("/x", ".")])
assert _r.cells[0].cell_type == "markdown" and _r.cells[0].source.startswith("*This run used `profile = 'smoke'`")
assert [o.get("text") for o in _r.cells[1].outputs[:1]] == ["record: runs/smoke/02/record.json\n"]
_img = Path(tempfile.mkdtemp())
_s = slim_notebook(_r, _img)
assert "image/png" not in _s.cells[1].outputs[1].data and len(list(_img.glob("*.png"))) == 1
assert inflate_notebook(_s, _img).cells[1].outputs[1].data["image/png"] == _png
print(_r.cells[0].source)

# %% [markdown]
# ## The Jupyter Book project
#
# `build_site` writes a throw-away Jupyter Book project next to the output folder: the prepared notebooks (the first
# is saved as `index`, the landing page, unless an introduction is given), an optional `api.rst` with one `automodule`
# section per importable module, `_config.yml` and `_toc.yml`. Autodoc imports the package, so the build runs with the
# same Python as the caller. Nbdev docstrings write code in single backticks, so the reST default role is `literal`.

# %%
#| export
_log = logging.getLogger(__name__)

def _config_yml(title: str, api: bool) -> str:
    "Jupyter Book settings: no execution, no network, MyST maths everywhere, autodoc when there is an API page."
    exts = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"] * api + ["sphinx-mathjax-offline"]
    return f"""title: {json.dumps(title)}
author: ""
copyright: ""
only_build_toc_files: true
execute:
  execute_notebooks: "off"
parse:
  myst_enable_extensions: [amsmath, dollarmath, colon_fence, deflist]
html:
  use_repository_button: false
  use_issues_button: false
  use_edit_page_button: false
launch_buttons:
  thebe: false
sphinx:
  extra_extensions: [{", ".join(exts)}]
  config:
    myst_dmath_double_inline: true
    nb_render_markdown_format: myst
    nb_ipywidgets_js: {{}}
    html_show_copyright: false
    default_role: literal
""" + "    autodoc_member_order: bysource\n" * api

_CSS = """/* capbook: code and outputs stay within the page: long lines wrap instead of scrolling sideways */
div.cell div.highlight pre, div.cell_output pre, div.output pre { white-space: pre-wrap; overflow-wrap: anywhere; }
div.cell_output table { display: block; max-width: 100%; overflow-x: auto; font-size: 0.85em; }
div.cell_output table th, div.cell_output table td { padding: 0.2em 0.4em; }   /* a table of eight columns fits the column */
mjx-container[display="true"] { max-width: 100%; overflow-x: auto; overflow-y: hidden; }   /* a display equation wider than the page scrolls inside it */
figure.capbook-figure { margin: 0.5em 0 1.2em; }      /* a figure at its size (capbook.docs.figure_html), its caption under it */
figure.capbook-figure figcaption { font-size: 0.9em; color: var(--pst-color-text-base); margin-top: 0.3em; }
"""

def _toc_yml(chapters: list[str]) -> str:
    "A one-part book whose root is `index`."
    return "format: jb-book\nroot: index\n" + ("chapters:\n" + "".join(f"- file: {c}\n" for c in chapters) if chapters else "")

def _importable(modules: list[str]) -> tuple[list[str], list[str]]:
    "The modules that import, and a warning for each one that does not (it is left out of the API page)."
    ok, warnings = [], []
    for m in modules:
        try: importlib.import_module(m); ok.append(m)
        except Exception as e: warnings.append(f"capbook: API reference skips {m} ({type(e).__name__}: {e})")
    for w in warnings: _log.warning(w)
    return ok, warnings

def _api_rst(modules: list[str]) -> str:
    "An API reference page: one autodoc section per module, documenting the members in its `__all__`."
    out = "API reference\n=============\n\nEvery public function and class of the package, with its docstring.\n"
    for m in modules: out += f"\n{m}\n{'-' * len(m)}\n\n.. automodule:: {m}\n   :members:\n   :show-inheritance:\n"
    return out

def _read_notebook(path: Path) -> nbformat.NotebookNode:
    "Read a notebook, a missing or malformed one becoming one `CapbookError` line."
    if not path.is_file(): raise CapbookError(f"{path}: notebook not found")
    try: return nbformat.read(path, as_version=4)
    except Exception as e: raise CapbookError(f"{path}: unreadable notebook ({type(e).__name__}: {e})") from None

def _png_b64(path: Path) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()

def figure_caption(nb: nbformat.NotebookNode, b64: str) -> str | None:
    "The caption a page gives the image `b64` (base64 PNG): its cell's `#| fig-cap:` line, else the heading of the section that shows it; None if the page does not show it."
    want, heading = "".join(b64.split()), None
    for c in nb.cells:
        if c.cell_type == "markdown": heading = _heading(c.source) or heading
        if c.cell_type == "code" and any("".join(str(o.get("data", {}).get("image/png", "")).split()) == want for o in c.get("outputs", [])):
            return nbdev_directives(c.source)[0].get("fig-cap") or heading
    return None

def _title_and_lede(md: str) -> tuple[str, str]:
    "A page's first Markdown cell split after its title and the quoted lede under it: (those, the rest)."
    lines = md.splitlines()
    i = next((k + 1 for k, l in enumerate(lines) if l.startswith("# ")), 0)
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(">")): i += 1
    return "\n".join(lines[:i]).rstrip(), "\n".join(lines[i:]).strip()

def findings_cells(nb: nbformat.NotebookNode, claims_md: str, figure: Path | None) -> list:
    "The cells a tables chapter opens with: what it found (`claims_md`, its verdicts one line each) and the figure that carries it, with the caption the page gives it (`figure_caption`; `nb`: the page as it ran)."
    cells = [nbformat.v4.new_markdown_cell("**What this chapter found.**\n\n" + claims_md)]
    if figure is not None and Path(figure).is_file():
        b64 = _png_b64(figure)
        caption = figure_caption(nb, b64) or Path(figure).stem.removeprefix("fig_").replace("_", " ")
        caption = (caption if caption.lower().startswith("fig") else f"Figure: {caption}") + " (its section below says how it was made)."
        fig = nbformat.v4.new_code_cell("# the chapter's figure", metadata={"tags": ["remove-input"] + ["full-width"] * wide(b64)})
        fig.outputs = [nbformat.v4.new_output("display_data", data={"text/html": figure_html(b64, caption)})]   # (a cell without source is not shown)
        cells.append(fig)
    return cells

def write_book(notebooks: list[Path], src: Path, title: str = "capbook", api_modules: list[str] | None = None,
               intro_md: str | None = None, notes: dict[str, str] | None = None, fill: Callable[[str], str] | None = None,
               findings: dict[str, tuple[str, Path | None]] | None = None) -> list[str]:
    "Write a Jupyter Book project for `notebooks` into `src` (`notes`: Markdown put under the title of the pages named; `fill`: applied to every Markdown cell, e.g. the generated blocks of the first page; `findings`: what a tables chapter found, its verdicts' Markdown and its figure, put under its title, `findings_cells`); returns the warnings about API modules left out."
    notebooks = [Path(p) for p in notebooks]
    if not notebooks: raise CapbookError("build_site: no notebooks given")
    names = ["index" if i == 0 and intro_md is None else p.stem for i, p in enumerate(notebooks)]
    pages = names + ["api"] + ["index"] * (intro_md is not None)
    if dups := sorted({n for n in pages if pages.count(n) > 1}):
        raise CapbookError(f"build_site: two pages would be named {', '.join(dups)}; rename the notebook")
    if intro_md is not None: (src / "index.md").write_text(figure_files(intro_md, src))
    for p, name in zip(notebooks, names):          # a kept (slim) notebook gets its images back from img/ beside it
        ran = inflate_notebook(_read_notebook(p), p.parent / "img")
        nb = prepare_notebook(ran, tables=bool(TABLES_PAGE.match(p.stem)))
        if fill:
            for c in nb.cells:
                if c.cell_type == "markdown": c.source = fill(c.source)
        at = next((i + 1 for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), 0)   # under the title cell
        if findings and p.stem in findings and at:                # ... and its lede: the rest of that cell after the findings
            head, rest = _title_and_lede(nb.cells[at - 1].source)
            if rest: nb.cells[at - 1].source = head; nb.cells.insert(at, nbformat.v4.new_markdown_cell(rest))
        if findings and p.stem in findings: nb.cells[at:at] = findings_cells(ran, *findings[p.stem])
        if notes and p.stem in notes: nb.cells.insert(at, nbformat.v4.new_markdown_cell(notes[p.stem]))
        for c in nb.cells:                        # figures as files of the site, linked from the page
            if c.cell_type == "markdown": c.source = figure_files(c.source, src)
            for o in c.get("outputs", []):
                if isinstance(html := o.get("data", {}).get("text/html"), str): o["data"]["text/html"] = figure_files(html, src)
        nbformat.write(nb, src / f"{name}.ipynb")
    (src / "_static").mkdir(exist_ok=True)
    (src / "_static" / "capbook.css").write_text(_CSS)
    modules, warnings = _importable(api_modules or [])
    if modules: (src / "api.rst").write_text(_api_rst(modules))
    (src / "_config.yml").write_text(_config_yml(title, bool(modules)))
    (src / "_toc.yml").write_text(_toc_yml([n for n in names if n != "index"] + ["api"] * bool(modules)))
    return warnings


# %% [markdown]
# ## Building, atomically
#
# Jupyter Book runs as a subprocess of this Python (`jupyter_book` has no `__main__`, so its click entry point is
# called with `-c`). Its log, with Sphinx's full traceback appended when there is one, is kept beside the site as
# `<out_dir>.build.log`. Sphinx warnings are fine; a failed build raises a `CapbookError` quoting the log lines that
# state the cause. The HTML is built in a temporary folder beside `out_dir` and renamed into place only when the build
# succeeded, so a failed build leaves the old site intact. A non-empty `out_dir` that is not a site is never replaced.

# %%
#| export
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

def _failure_summary(log: str) -> str:
    "Where a failed build's log states the cause: the lines before Jupyter Book's own traceback, and the last line."
    keep = lambda text: [l.strip() for l in text.splitlines() if l.strip() and not set(l.strip()) <= set("=")
                         and not l.startswith(("Please also report", "A bug report"))]
    head, lines = keep(log.split("Traceback (most recent call last):")[0]), keep(log)
    last = [l for l in lines[-1:] if "error in building your book" not in l]
    return " | ".join(dict.fromkeys(head[-3:] + last))

def _jupyter_book() -> list[str]:
    "The command that runs this Python's Jupyter Book."
    return [sys.executable, "-c", "from jupyter_book.cli.main import main; main()"]

def _is_site(d: Path) -> bool:
    "Whether `d` may be replaced by a site: absent, an empty folder, or a previous site."
    return not d.exists() or d.is_dir() and (not any(d.iterdir()) or (d / "index.html").exists())

def build_site(notebooks: list[Path], out_dir: Path, title: str = "capbook", api_modules: list[str] | None = None,
               intro_md: str | None = None, notes: dict[str, str] | None = None, fill: Callable[[str], str] | None = None,
               findings: dict[str, tuple[str, Path | None]] | None = None) -> Path:
    "Build the HTML site of executed `notebooks` (in reading order) into `out_dir`, atomically; returns its `index.html`."
    out_dir = Path(out_dir).resolve()
    if not _is_site(out_dir): raise CapbookError(f"{out_dir}: not empty and not a docs site; refusing to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_dir.with_name(f"{out_dir.name}.build.log")
    tmp = temp_dir(out_dir)
    try:
        src = tmp / "src"; src.mkdir()
        warnings = write_book(notebooks, src, title, api_modules, intro_md, notes, fill, findings)
        cmd = [*_jupyter_book(), "build", str(src), "--path-output", str(tmp), "--builder", "html"]
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
        log = "".join(w + "\n" for w in warnings) + _ANSI.sub("", res.stdout + res.stderr)
        failed = res.returncode != 0 or not (tmp / "_build" / "html" / "index.html").exists()
        summary = _failure_summary(log) if failed else ""
        if (m := re.search(r"full traceback has been saved in (\S+?),", log)) and Path(m[1]).is_file():
            log += f"\n--- {m[1]}\n" + Path(m[1]).read_text()
        atomic_write(log_path, lambda t: t.write_text(log))
        if failed: raise CapbookError(f"docs build failed (see {log_path}): {summary}")
        if out_dir.exists(): os.replace(out_dir, tmp / "old")
        os.replace(tmp / "_build" / "html", out_dir)
    except OSError as e:                          # a full disk: the old site stays, the partial one goes with `tmp`
        raise io_error(e.filename or out_dir, e, "build the site") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir / "index.html"


# %% [markdown]
# ## Looking at a page the way a reader does
#
# The site's tests open its pages in Debian's headless Chromium (`apt-get install chromium`, or `make browser`), so
# they see the DOM after MathJax and the theme's scripts ran, not just the HTML files. One browser, started with a
# fresh profile folder and no background networking, reads any number of pages: `Chromium` drives it over its
# DevTools pipe (the Chrome DevTools Protocol, JSON messages each ended by a NUL byte, written to the browser's file
# descriptor 3 and read from its 4), so no port is opened and nothing beyond the standard library is needed. Each
# page opens in a new tab; after its load event a short virtual time budget lets MathJax finish typesetting before
# the DOM is read. A browser that stops answering is killed with its whole process group.
#
# > **capbook:** the first version started Chromium once per page (`--dump-dom`): about 1.6 s of CPU a page, 60 s for
# > one check of the site. One browser for all of them costs about 0.2 s a page.

# %%
#| export
_CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]

_CHROMIUM = ("chromium", "/usr/bin/chromium")

def _chromium() -> str:
    "Path of the headless browser, or a one-line how-to."
    for name in _CHROMIUM:
        if exe := shutil.which(name): return exe
    raise CapbookError("chromium not found: install it with `apt-get install chromium` (or `make browser`)")

def _as_url(url_or_path: str | Path) -> str:
    "A URL unchanged; a local path as a `file://` URL (which must exist)."
    s = str(url_or_path)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", s): return s
    p = Path(s).resolve()
    if not p.exists(): raise CapbookError(f"{p}: page not found")
    return p.as_uri()

def _devtools_fds(to_browser: int, from_browser: int):
    "In the browser's process before exec: our pipe ends as its file descriptors 3 (it reads) and 4 (it writes), inheritable."
    def move():
        a, b = os.dup2(to_browser, 100), os.dup2(from_browser, 101)   # out of the way first: either may already be 3 or 4
        os.dup2(a, 3); os.dup2(b, 4)
    return move

class Chromium:
    "One headless Chromium for many pages, driven over its DevTools pipe: `with Chromium() as c: c.dom(page)`, `c.screenshot(page, png)`."
    def __init__(self, timeout: float = 60, budget_ms: int = 5000):
        self.timeout, self.budget_ms, self.proc = timeout, budget_ms, None

    def __enter__(self) -> "Chromium":
        exe = _chromium()
        self._profile = tempfile.TemporaryDirectory(prefix="capbook-chromium-")
        self._err = tempfile.TemporaryFile()
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()
        try:
            self.proc = subprocess.Popen([exe, *_CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe",
                                          "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._err,
                                         close_fds=False, preexec_fn=_devtools_fds(to_r, from_w), start_new_session=True)
        finally:
            os.close(to_r); os.close(from_w)
        self._buf, self._n, self._events = b"", 0, []
        return self

    def __exit__(self, *exc):
        try:
            if self.proc.poll() is None: self._send("Browser.close", timeout=5)
            self.proc.wait(timeout=5)
        except (CapbookError, subprocess.TimeoutExpired, OSError): pass
        finally:
            if self.proc.poll() is None: os.killpg(self.proc.pid, signal.SIGKILL); self.proc.wait()
            for fd in (self._to, self._from): os.close(fd)
            self._err.close(); self._profile.cleanup()

    def _fail(self, what: str):
        "Stop in one line: the browser gave no answer (killed with its process group) or ended (its last error line)."
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL); self.proc.wait()
            raise CapbookError(f"chromium gave no answer within {self.timeout} s for {what}")
        self._err.seek(0)
        last = [l for l in self._err.read().decode(errors="replace").splitlines() if l.strip()][-1:] or ["no message"]
        raise CapbookError(f"chromium failed (exit {self.proc.returncode}) on {what}: {last[0]}")

    def _message(self, deadline: float, what: str) -> dict:
        "The browser's next message (a reply or an event)."
        import select
        while b"\0" not in self._buf:
            if not select.select([self._from], [], [], max(0.0, deadline - time.time()))[0]: self._fail(what)
            chunk = os.read(self._from, 1 << 20)
            if not chunk: self._fail(what)
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def _send(self, method: str, params: dict | None = None, session: str | None = None, what: str = "", timeout: float | None = None) -> dict:
        "Call a DevTools method and return its result; events that arrive meanwhile are kept for `_event`."
        self._n += 1
        msg = {"id": self._n, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
        try: os.write(self._to, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError: self._fail(what or method)
        deadline = time.time() + (timeout or self.timeout)
        while (reply := self._message(deadline, what or method)).get("id") != self._n: self._events.append(reply)
        if "error" in reply: raise CapbookError(f"chromium refused {method} for {what}: {reply['error'].get('message')}")
        return reply["result"]

    def _event(self, name: str, session: str, what: str) -> dict:
        deadline = time.time() + self.timeout
        while True:
            for i, e in enumerate(self._events):
                if e.get("method") == name and e.get("sessionId") == session: return self._events.pop(i)
            self._events.append(self._message(deadline, what))

    @contextlib.contextmanager
    def _page(self, url_or_path: str | Path, size: tuple[int, int] | None = None):
        "A new tab (of `size` (width, height) if given) with the page loaded and its scripts run; yields (session, url)."
        url = _as_url(url_or_path)
        target, s = self._send("Target.createTarget", {"url": "about:blank"}, what=url)["targetId"], None
        try:
            s = self._send("Target.attachToTarget", {"targetId": target, "flatten": True}, what=url)["sessionId"]
            self._send("Page.enable", session=s, what=url)
            if size: self._send("Emulation.setDeviceMetricsOverride", {"width": size[0], "height": size[1], "deviceScaleFactor": 1,
                                                                       "mobile": False}, session=s, what=url)
            if err := self._send("Page.navigate", {"url": url}, session=s, what=url).get("errorText"):
                raise CapbookError(f"chromium could not open {url}: {err}")
            self._event("Page.loadEventFired", s, url)
            # then `budget_ms` of virtual time (paused while a fetch is pending): MathJax and the theme's timers run
            self._send("Emulation.setVirtualTimePolicy", {"policy": "pauseIfNetworkFetchesPending", "budget": self.budget_ms},
                       session=s, what=url)
            self._event("Emulation.virtualTimeBudgetExpired", s, url)
            yield s, url
        finally:
            if self.proc.poll() is None:
                self._send("Target.closeTarget", {"targetId": target}, what=url)
                self._events = [e for e in self._events if e.get("sessionId") not in (None, s)]

    def evaluate(self, url_or_path: str | Path, expression: str, size: tuple[int, int] | None = None):
        "The value of a JavaScript `expression` (JSON-able) on a page (a URL or a local file) after its scripts ran, in a window of `size` (width, height) if given."
        with self._page(url_or_path, size) as (s, url):
            res = self._send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=s, what=url)["result"]
        if "value" not in res: raise CapbookError(f"chromium could not evaluate on {url}: {res.get('description', res)}")
        return res["value"]

    def dom(self, url_or_path: str | Path) -> str:
        "The DOM of a page (a URL or a local file) after its scripts ran, as HTML."
        return self.evaluate(url_or_path, "document.documentElement.outerHTML")

    def screenshot(self, url_or_path: str | Path, png_path: str | Path, size: tuple[int, int] = (1280, 2000)) -> Path:
        "Save a `size` (width, height) PNG screenshot of a page (a URL or a local file) to `png_path`, atomically."
        png_path = Path(png_path).resolve(); png_path.parent.mkdir(parents=True, exist_ok=True)
        with self._page(url_or_path, size) as (s, url):
            data = self._send("Page.captureScreenshot", {"format": "png"}, session=s, what=url)["data"]
        return atomic_write(png_path, lambda t: t.write_bytes(base64.b64decode(data)))

def chromium_dom(url_or_path: str | Path, timeout: float = 60) -> str:
    "The DOM of a page (a URL or a local file) after its scripts ran, from headless Chromium (many pages: one `Chromium`)."
    with Chromium(timeout) as c: return c.dom(url_or_path)

def chromium_screenshot(url: str | Path, png_path: str | Path, size: tuple[int, int] = (1280, 2000), timeout: float = 60) -> Path:
    "Save a `size` (width, height) PNG screenshot of a page (a URL or a local file) to `png_path`."
    with Chromium(timeout) as c: return c.screenshot(url, png_path, size)


# %% [markdown]
# One browser, two pages: the DOM is read after the page's timers ran (a script appends a paragraph a second after
# load, in virtual time), and a screenshot has the size asked for. Without Chromium this example is skipped.

# %%
if shutil.which("chromium"):
    _dir = Path(tempfile.mkdtemp())
    (_dir / "late.html").write_text("<html><body><p>first</p><script>setTimeout(() => document.body.insertAdjacentHTML("
                                    "'beforeend', '<p>LATE_MARK</p>'), 1000)</script></body></html>")
    with Chromium() as _c:
        assert "LATE_MARK" in _c.dom(_dir / "late.html") and "first" in _c.dom(_dir / "late.html")
        assert _PILImage.open(_c.screenshot(_dir / "late.html", _dir / "shot.png", size=(320, 200))).size == (320, 200)
    shutil.rmtree(_dir)

# %% [markdown]
# Typical use, after papermill has executed the book into a run folder (a full build takes a few seconds, so it is
# left to the tests and to `capbook book`):
#
# ```python
# nbs = sorted(Path("runs/default").glob("*.ipynb"))
# index = build_site(nbs, Path("runs/default/site"), api_modules=["capbook.core", "capbook.data"])
# assert "BLEU-4" in chromium_dom(index)
# ```
