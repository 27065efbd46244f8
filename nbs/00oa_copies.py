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
# # copies
#
# > The reader's copy of a run: an executed notebook turned into what a reader needs (its parameters as one line, no machine paths or tool chatter, its images kept once by content), brought up to today's prose and exported code without rerunning (`refresh_copy`), and kept in the repository (`keep_notebooks`).

# %%
#| default_exp copies

# %%
#| export
from __future__ import annotations
import copy, json, os, re, shutil, sys, tempfile
from pathlib import Path
from capbook.core import CapbookError, Deferred, atomic_write, temp_dir

nbformat = Deferred("nbformat")   # brings jsonschema, whose format checker compiles its grammars as it is imported (a second)

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
def read_notebook(path: Path) -> nbformat.NotebookNode:
    "Read a notebook, a missing or malformed one becoming one `CapbookError` line."
    if not path.is_file(): raise CapbookError(f"{path}: notebook not found")
    try: return nbformat.read(path, as_version=4)
    except Exception as e: raise CapbookError(f"{path}: unreadable notebook ({type(e).__name__}: {e})") from None

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
    "A run's own parameters cell: papermill's injected one, or the one-line note a reader's copy makes of it (`capbook.copies.reader_notebook`)."
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

PATH_REPR = re.compile(r"\b(?:Posix|Windows|Pure\w*)?Path\('([^'\n]*)'\)")   # a path's repr
_MKDTEMP = re.compile(r"<tmp>[/]tmp[a-z0-9_]{8}(?=/)")       # a `tempfile.mkdtemp` folder under the stand-in ([/]: no machine path here)

def readable(text: str) -> str:
    "An output's text as a reader's copy keeps it (after `_relative`): a path's repr as the path (`PosixPath('runs/x')`: runs/x), and a temporary folder's random name left out (`<tmp>/tmpab12cd34/x`: `<tmp>/x`), which says nothing and changes on every run."
    return _MKDTEMP.sub("<tmp>", PATH_REPR.sub(lambda m: m[1], text))

def readable_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    "`nb` with every output's text `readable`: for a copy kept before its outputs were."
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream": o.text = readable(o.text if isinstance(o.text, str) else "".join(o.text))
            for k, v in o.get("data", {}).items():
                if k.startswith("text/") and k != "text/html": o.data[k] = readable(v if isinstance(v, str) else "".join(v))
    return nb

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
        if cell.cell_type == "code":                  # its execution count kept: the copy shows that it ran, in which order
            outs = []
            for o in cell.outputs:
                if o.output_type == "stream":
                    o.text = readable(_relative(_quiet(o.text), paths))
                    if not o.text: continue
                for k, v in o.get("data", {}).items():
                    if k.startswith("text/"):
                        o.data[k] = _relative(v if isinstance(v, str) else "".join(v), paths)
                        if k != "text/html": o.data[k] = readable(o.data[k])
                outs.append(o)
            cell.outputs = outs
        cells.append(cell)
    nb.cells = cells
    return nb

_IMG_KEY = "capbook_image"                     # an output's metadata key naming its image file in `img/`

def image_link(name: str) -> str:
    "The Markdown a slim copy's figure output shows in place of its inline PNG: a link to its file in `img/`, which GitHub and JupyterLab render from the copy's folder."
    return f"![figure](img/{name})"

_BARE_REPR = re.compile(r"<[\w.]+ object>")   # a repr that names only its class, as an IPython `Image`'s does

def link_images(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    "`nb` (slim) with each image output also carrying `image_link` as Markdown, the richest form a reader's viewer then finds. For a viewer of text only, a text/plain that says something (`<Figure size 1400x420 with 4 Axes>`) stays; one that names only its class (`_BARE_REPR`) becomes the image's file."
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if (name := o.get("metadata", {}).get(_IMG_KEY)) is None: continue
            o.setdefault("data", {})["text/markdown"] = image_link(name)
            if _BARE_REPR.fullmatch(str(o.data.get("text/plain", "")).strip()): o.data["text/plain"] = f"figure: img/{name}"
    return nb

def slim_notebook(nb: nbformat.NotebookNode, img_dir: Path) -> nbformat.NotebookNode:
    "A copy of `nb` whose PNG outputs live in `img_dir/<sha256[:16]>.png` (written once per content) instead of inline, each output showing its file as a Markdown image (`link_images`)."
    import base64, hashlib
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if "image/png" not in o.get("data", {}): continue
            raw = base64.b64decode(o.data.pop("image/png"))
            name = f"{hashlib.sha256(raw).hexdigest()[:16]}.png"
            if not (img_dir / name).exists(): atomic_write(img_dir / name, lambda t, raw=raw: t.write_bytes(raw))
            o.metadata[_IMG_KEY] = name
    return link_images(nb)

def inflate_notebook(nb: nbformat.NotebookNode, img_dir: Path) -> nbformat.NotebookNode:
    "The inverse of `slim_notebook`: each image file back inline (its Markdown link dropped); a missing one stops with one line naming it."
    import base64
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if (name := o.get("metadata", {}).pop(_IMG_KEY, None)) is None: continue
            if not (img_dir / name).is_file(): raise CapbookError(f"{img_dir / name}: image of a kept notebook not found")
            o.data["image/png"] = base64.b64encode((img_dir / name).read_bytes()).decode()
            if o.data.get("text/markdown") == image_link(name): del o.data["text/markdown"]
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
            nb = slim_notebook(reader_notebook(refresh_copy(read_notebook(Path(p)), _nbs() / Path(p).name)), new / "img")
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
                                      nbformat.v4.new_code_cell("evaluate()", execution_count=2)])
_ex.cells[1].outputs = [nbformat.v4.new_output("stream", name="stderr", text="PTBTokenizer tokenized 3113 tokens at 36478.7 tokens per second.\n"),
                        nbformat.v4.new_output("stream", name="stdout", text="record: /x/runs/smoke/02/record.json\n"),
                        nbformat.v4.new_output("display_data", data={"image/png": _png, "text/plain": "<Figure>"})]
_r = reader_notebook(_ex, [("/x", ".")])
assert _r.cells[0].cell_type == "markdown" and _r.cells[0].source.startswith("*This run used `profile = 'smoke'`")
assert [o.get("text") for o in _r.cells[1].outputs[:1]] == ["record: runs/smoke/02/record.json\n"]
assert _r.cells[1].execution_count == 2                                      # it ran, second
_st = "<tmp>"                                                                  # the temporary folder's stand-in
assert readable(f"{_st}/tmph1a6sfm4/bad.yaml: unreadable; PosixPath('runs/x')") == f"{_st}/bad.yaml: unreadable; runs/x"
_img = Path(tempfile.mkdtemp())
_s = slim_notebook(_r, _img)
assert "image/png" not in _s.cells[1].outputs[1].data and len(list(_img.glob("*.png"))) == 1
assert _s.cells[1].outputs[1].data["text/markdown"] == f"![figure](img/{next(_img.glob('*.png')).name})"   # what GitHub shows
assert inflate_notebook(_s, _img).cells[1].outputs[1].data == _ex.cells[1].outputs[2].data       # the PNG back, the link gone
from IPython.display import Image as _Image
_o = nbformat.v4.new_output("display_data", data={"text/plain": repr(_Image(data=b"\x89PNG fake bytes", format="png"))}, metadata={_IMG_KEY: "a.png"})
assert link_images(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=[_o])])).cells[0].outputs[0].data == \
    {"text/plain": "figure: img/a.png", "text/markdown": "![figure](img/a.png)"}                # a bare repr says where the figure is
print(_r.cells[0].source)
