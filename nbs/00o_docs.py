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
import base64, copy, hashlib, importlib, json, logging, math, os, re, shutil, subprocess, sys
from pathlib import Path
from typing import Callable
from html import escape as _escape
from capbook.core import CapbookError, Deferred, atomic_write, io_error, temp_dir
from capbook.copies import PATH_REPR, _quiet, inflate_notebook, read_notebook as _read_notebook

nbformat = Deferred("nbformat")   # brings jsonschema, whose format checker compiles its grammars as it is imported (a second)

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

_MISSING = {"NaN", "nan", "None", "<NA>", "NaT"}   # how pandas prints a missing value

def frame_markdown(html: str) -> str | None:
    "A pandas DataFrame's HTML output (`class=\"dataframe\"`) as a Markdown table, its index left out where it is the default 0, 1, ..., a missing value as a dash and a column with none dropped (then `reader_table` can shape it for the site); None for any other HTML."
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
    rows = [[("—" if c in _MISSING else c) for c in r] for r in rows]        # a cell the row has no value for
    keep = [j for j in range(len(rows[0])) if j == 0 or any(r[j] != "—" for r in rows[1:])]
    rows = [[r[j] for j in keep] for r in rows]                                  # a table holds the columns it has
    head = rows[0]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"] + ["| " + " | ".join(r) + " |" for r in rows[1:]])

def reader_tables(md: str) -> str:
    "Every Markdown table in `md` as the site shows it (`reader_table`)."
    return _PIPE_TABLE.sub(lambda m: reader_table(m.group(0)) + ("\n" if m.group(0).endswith("\n") else ""), md)

_PATH_REPR = PATH_REPR          # a path's repr, shown as the path (`capbook.copies`)

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

LOG_LINES = 12    # a run's log longer than this shows on the site as one folded block: its last line, the rest on a click

def _merged(outputs: list) -> list:
    "A cell's outputs with each run of stream outputs of one stream (a log printed line by line) joined into one."
    kept = []
    for o in outputs:
        if o.get("output_type") == "stream" and kept and kept[-1].get("output_type") == "stream" and kept[-1].get("name") == o.get("name"):
            kept[-1] = nbformat.v4.new_output("stream", name=o["name"], text=kept[-1]["text"] + o["text"])
        else: kept.append(o)
    return kept

def _folded(out: nbformat.NotebookNode) -> nbformat.NotebookNode:
    "A stream of more than `LOG_LINES` lines as one folded block (HTML `details`): the summary names its length and shows its last line, where a run's log ends."
    if out.get("output_type") != "stream": return out
    lines = out["text"].rstrip("\n").split("\n")
    if len(lines) <= LOG_LINES: return out
    summary = f"The log, {len(lines)} lines (unfold to read it); its last: {_escape(lines[-1][:160])}"
    html = f'<details class="capbook-log"><summary>{summary}</summary><pre>{_escape(out["text"])}</pre></details>'
    return nbformat.v4.new_output("display_data", data={"text/html": html})

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
            cell.outputs = [_folded(o) for o in _merged(cell.outputs)]                          # a run's log: one folded block
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
assert frame_markdown('<table class="dataframe"><tr><th></th><th>beam</th><th>refs</th><th>att</th></tr>'     # no NaN cell, no empty column
                      '<tr><th>CIDEr</th><td>1.5</td><td>NaN</td><td>NaN</td></tr><tr><th>hit</th><td>NaN</td><td>NaN</td><td>0.4</td></tr></table>'
                      ) == "|  | beam | att |\n|---|---|---|\n| CIDEr | 1.5 | — |\n| hit | — | 0.4 |"
_log = [nbformat.v4.new_output("stream", name="stdout", text=f"epoch {i}\n") for i in range(20)]
_one = [_folded(o) for o in _merged(_log)]                                        # a log printed line by line: one folded block
assert len(_one) == 1 and _one[0].data["text/html"].startswith('<details class="capbook-log"><summary>The log, 20 lines') and "its last: epoch 19" in _one[0].data["text/html"]
assert _merged(_log[:3])[0].text == "epoch 0\nepoch 1\nepoch 2\n" and _folded(_merged(_log[:3])[0]).output_type == "stream"   # short: as it is

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
import tempfile
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
div.highlight pre, div.cell_output pre, div.output pre { white-space: pre-wrap; overflow-wrap: anywhere; }   /* the prose's code blocks too (Quick start) */
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

FOUND = "**What this chapter found.**\n\n"      # the head of a tables chapter's findings, on its page and in its reader's copy

def _findings_caption(nb: nbformat.NotebookNode, b64: str, figure: Path) -> str:
    "The caption of the figure a tables chapter's findings show: the one its page gives that figure (`figure_caption`), else its file's name."
    caption = figure_caption(nb, b64) or Path(figure).stem.removeprefix("fig_").replace("_", " ")
    return (caption if caption.lower().startswith("fig") else f"Figure: {caption}") + " (its section below says how it was made)."

def findings_cells(nb: nbformat.NotebookNode, claims_md: str, figure: Path | None) -> list:
    "The cells a chapter's page opens with: what it found (`claims_md`: a tables chapter's verdicts one line each under `FOUND`, a chapter run's scores among the book's rows) and the figure that carries it, with the caption the page gives it (`figure_caption`; `nb`: the page as it ran)."
    cells = [nbformat.v4.new_markdown_cell(claims_md)]
    if figure is not None and Path(figure).is_file():
        b64 = _png_b64(figure)
        caption = _findings_caption(nb, b64, figure)
        fig = nbformat.v4.new_code_cell("# the chapter's figure", metadata={"tags": ["remove-input"] + ["full-width"] * wide(b64)})
        fig.outputs = [nbformat.v4.new_output("display_data", data={"text/html": figure_html(b64, caption)})]   # (a cell without source is not shown)
        cells.append(fig)
    return cells

FINDINGS = "capbook-findings"   # the tag (and id) of a reader's copy's findings cell, which the site replaces with its own

def with_findings(nb: nbformat.NotebookNode, claims_md: str, figure: Path | None, img_dir: Path) -> nbformat.NotebookNode:
    "A chapter's reader's copy `nb` (slim, its images in `img_dir`) opening with what it found, right after its title cell: the page's text (`claims_md`, `findings_cells`) and the chapter's figure as a Markdown image with the page's caption, which GitHub and JupyterLab render from the copy's folder (`figure` is in the folder above it); an earlier findings cell is replaced."
    nb = copy.deepcopy(nb)
    nb.cells = [c for c in nb.cells if FINDINGS not in c.get("metadata", {}).get("tags", [])]
    md = claims_md
    if figure is not None and Path(figure).is_file():
        caption = _findings_caption(inflate_notebook(nb, img_dir), _png_b64(figure), figure)
        md += f"\n\n![the chapter's figure](../{Path(figure).name})\n\n*{caption}*"
    cell = nbformat.v4.new_markdown_cell(md, metadata={"tags": [FINDINGS]})
    cell["id"] = FINDINGS
    nb.cells.insert(next((i + 1 for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), 0), cell)
    return nb

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
        ran.cells = [c for c in ran.cells if FINDINGS not in c.get("metadata", {}).get("tags", [])]   # the copy's findings: the page puts its own
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
# A reader's copy opens with its findings as the page does, wherever it is opened (GitHub, JupyterLab): republished
# with new verdicts, its findings cell is replaced, not added to.

# %%
_d = Path(tempfile.mkdtemp()); (_d / "notebooks" / "img").mkdir(parents=True)
_PILImage.new("RGB", (40, 20), "white").save(_d / "fig_x.png")
_c = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A chapter\n\n> its lede"), nbformat.v4.new_code_cell("table()")])
for _v in ("holds", "cannot tell"): _c = with_findings(_c, FOUND + f"- a above b: **{_v}**", _d / "fig_x.png", _d / "notebooks" / "img")
assert [c.cell_type for c in _c.cells] == ["markdown", "markdown", "code"] and _c.cells[1].source.startswith(FOUND + "- a above b: **cannot tell**")
assert "![the chapter's figure](../fig_x.png)" in _c.cells[1].source
print(_c.cells[1].source)

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
# Typical use, after papermill has executed the book into a run folder (a full build takes a few seconds, so it is
# left to the tests and to `capbook book`):
#
# ```python
# nbs = sorted(Path("runs/default").glob("*.ipynb"))
# index = build_site(nbs, Path("runs/default/site"), api_modules=["capbook.core", "capbook.data"])
# assert "BLEU-4" in chromium_dom(index)
# ```
