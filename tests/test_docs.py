"""The offline docs site: nbdev directives honoured, tables/figures/maths on the page, API reference, atomic builds."""
import base64, html, io, os, re, struct, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest

import capbook.docs as docs
from capbook.core import CapbookError
from capbook.browser import Chromium, chromium_dom, chromium_screenshot
from capbook.docs import build_site, nbdev_directives, prepare_notebook
from capbook.copies import keep_notebooks

pytestmark = pytest.mark.xdist_group("docs")        # one worker builds the module's site

v4 = nbformat.v4
SHOW_DOC_MD = ("---\n\n### attend\n\n>      attend (e:torch.Tensor, dim:int=-1)\n\n*Soft attention weights.*\n\n"
               "|    | **Type** | **Default** | **Details** |\n| -- | -------- | ----------- | ----------- |\n"
               "| e | Tensor |  | scores |\n| dim | int | -1 | the axis |\n")


def _code(src: str, *outputs, tags=()) -> nbformat.NotebookNode:
    cell = v4.new_code_cell(src, outputs=list(outputs))
    if tags: cell.metadata.tags = list(tags)
    return cell


def _png(line=(1, 0)) -> str:
    "A small PNG of a line from (0, line[0]) to (1, line[1]), base64."
    fig, ax = plt.subplots(figsize=(2, 1.5)); ax.plot([0, 1], list(line))
    buf = io.BytesIO(); fig.savefig(buf, format="png", dpi=40); plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _executed_notebook() -> nbformat.NotebookNode:
    "A small notebook as papermill leaves it, with every kind of cell the book has."
    table = pd.DataFrame({"model": ["soft attention"], "BLEU-4": [24.31]}).to_html()
    nb = v4.new_notebook(cells=[
        v4.new_markdown_cell("# Synthetic paper\n\n> A one-page check of the site.\n\nThe attention weights\n\n"
                             "$$\\alpha_{ti} = \\frac{\\exp(e_{ti})}{\\sum_k \\exp(e_{tk})}$$\n\nwith $\\tau = 3$ and "
                             "$$z_t = \\sum_i \\alpha_{ti} a_i$$ inline.\n\n\\begin{align}\nh_t &= o_t \\odot \\tanh(c_t)\n"
                             "\\end{align}"),
        _code("#| default_exp fake"),
        _code("profile = 'default'", tags=["parameters"]),
        _code("# Parameters\nprofile = 'smoke'\n", tags=["injected-parameters"]),
        _code("#| export\ndef attend(e, dim=-1):\n    return e.softmax(dim)"),
        _code("#| hide\nHIDDEN_SOURCE_MARK = 1", v4.new_output("stream", name="stdout", text="HIDDEN_OUTPUT_MARK\n")),
        _code("#|export\nshow_doc(attend)", v4.new_output("display_data", data={"text/markdown": SHOW_DOC_MD,
                                                                                  "text/plain": "<show_doc>"})),
        _code("results_table", v4.new_output("execute_result", execution_count=1,
                                             data={"text/html": table, "text/plain": "table"})),
        _code("#| echo: false\nECHO_OFF_SOURCE_MARK", v4.new_output("display_data", data={"image/png": _png(),
                                                                                          "text/plain": "<Figure>"})),
        _code("#| output: false\nprint('noise')", v4.new_output("stream", name="stdout", text="NOISY_OUTPUT_MARK\n")),
    ])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.language_info = {"name": "python", "version": "3.11"}
    return nb


def _text(dom: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", dom))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    nb_path = root / "run" / "03_synthetic.ipynb"; nb_path.parent.mkdir()
    nbformat.write(_executed_notebook(), nb_path)
    out = root / "site"; out.mkdir()
    (out / "index.html").write_text("stale"); (out / "stale.html").write_text("stale")
    index = build_site([nb_path], out, title="capbook test", api_modules=["capbook.core", "capbook.no_such_module"],
                       intro_md="# The capbook test book\n\nRead the synthetic paper first.\n")
    return index, chromium_dom(index.parent / "03_synthetic.html")


def test_directives_parsed():
    assert nbdev_directives("#| export\n#|echo: false\n\nx = 1") == ({"export": "", "echo": "false"}, "x = 1")
    assert nbdev_directives("x = 1\n#| hide") == ({}, "x = 1\n#| hide")
    nb = prepare_notebook(_executed_notebook())
    srcs = [c.source for c in nb.cells if c.cell_type == "code"]
    assert not any("#|" in s or "HIDDEN" in s for s in srcs) and "def attend(e, dim=-1):" in srcs[2]
    tags = {c.source: c.metadata.get("tags", []) for c in nb.cells}
    assert tags["ECHO_OFF_SOURCE_MARK"] == ["remove-input"] and tags["print('noise')"] == ["remove-output"]
    assert tags["results_table"] == ["hide-input"] and tags["def attend(e, dim=-1):\n    return e.softmax(dim)"] == []   # a cell that only shows a table is folded, the paper's code is not
    show_doc = next(c for c in nb.cells if c.source == "show_doc(attend)")
    assert show_doc.outputs[0].data["text/markdown"].startswith("### attend")


@pytest.mark.slow
def test_page_shows_what_the_run_computed(site):
    index, dom = site
    assert not (index.parent / "stale.html").exists()
    assert "Read the synthetic paper first." in _text(chromium_dom(index))
    tables = re.findall(r"<table.*?</table>", dom, re.S)
    assert any("BLEU-4" in t and "24.31" in t for t in tables)
    assert any("Details" in t and "the axis" in t for t in tables), "show_doc's pipe table is rendered"
    img = re.search(r'<img[^>]+src="([^"]+\.png)"', dom)
    assert img and (index.parent / img[1]).is_file()
    text = _text(dom)
    assert "profile = 'smoke'" in text and "def attend(e, dim=-1):" in text
    for absent in ("HIDDEN_SOURCE_MARK", "HIDDEN_OUTPUT_MARK", "NOISY_OUTPUT_MARK", "ECHO_OFF_SOURCE_MARK",
                   "default_exp", "#|"):
        assert absent not in text, absent


@pytest.mark.slow
def test_maths_rendered_offline(site):
    index, dom = site
    assert dom.count("<mjx-container") == 4 and "<mjx-merror" not in dom, "MathJax typeset $, $$ (both) and align"
    for page in index.parent.glob("*.html"):
        srcs = re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', page.read_text())
        assert not [s for s in srcs if re.match(r"(https?:)?//", s)], page.name
    assert (index.parent / "_static" / "mathjax" / "tex-chtml.js").is_file()


@pytest.mark.slow
def test_api_reference(site):
    index, _ = site
    text = _text(chromium_dom(index.parent / "api.html"))
    assert "fill a temporary file beside" in text and "capbook.core.atomic_write" in text
    assert "no_such_module" not in text
    assert "skips capbook.no_such_module" in index.parent.with_name("site.build.log").read_text()


@pytest.mark.slow
def test_screenshot(site, tmp_path):
    png = chromium_screenshot(site[0], tmp_path / "shot.png", size=(800, 600)).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (800, 600)


@pytest.mark.slow
def test_a_page_that_hangs_is_one_line_and_leaves_no_browser(tmp_path):
    "A page whose script never yields: the browser is killed with its process group after the timeout, in one line; the same browser class then reads a page again."
    import psutil
    (tmp_path / "hang.html").write_text("<html><body><script>while (true) {}</script></body></html>")
    (tmp_path / "ok.html").write_text("<html><body><p>READ_AGAIN_MARK</p></body></html>")
    def session(sid):                      # the live processes of the browser's own session (it starts one: another test's browsers are not in it)
        out = set()
        for p in psutil.process_iter(["status"]):
            try:
                if p.info["status"] not in (None, psutil.STATUS_ZOMBIE) and os.getsid(p.pid) == sid: out.add(p.pid)
            except (ProcessLookupError, PermissionError, psutil.Error): pass      # a process that ended meanwhile
        return out
    with pytest.raises(CapbookError) as e, Chromium(timeout=3) as browser:
        assert session(browser.proc.pid)                                          # the check sees the browser while it lives
        browser.dom(tmp_path / "hang.html")
    assert str(e.value) == f"chromium gave no answer within 3 s for {(tmp_path / 'hang.html').as_uri()}"
    assert not (browser.proc.poll() is None), "the browser is gone"
    assert not session(browser.proc.pid), session(browser.proc.pid)
    with Chromium() as browser: assert "READ_AGAIN_MARK" in browser.dom(tmp_path / "ok.html")


def test_book_project(tmp_path):
    a, b = tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb"
    for p in (a, b): nbformat.write(_executed_notebook(), p)
    src = tmp_path / "src"; src.mkdir()
    assert docs.write_book([a, b], src, api_modules=["capbook.core"]) == []
    assert sorted(p.name for p in src.iterdir()) == ["02_b.ipynb", "_config.yml", "_static", "_toc.yml", "api.rst", "index.ipynb"]
    assert "pre-wrap" in (src / "_static" / "capbook.css").read_text()          # code wraps within the page
    assert (src / "_toc.yml").read_text().endswith("chapters:\n- file: 02_b\n- file: api\n")
    assert "#|" not in (src / "index.ipynb").read_text() and ".. automodule:: capbook.core" in (src / "api.rst").read_text()


def test_failed_build_keeps_old_site(tmp_path, monkeypatch):
    nb_path = tmp_path / "a.ipynb"; nbformat.write(_executed_notebook(), nb_path)
    out = tmp_path / "site"; out.mkdir(); (out / "index.html").write_text("old site")
    monkeypatch.setattr(docs, "_jupyter_book", lambda: [sys.executable, "-c", "print('sphinx exploded'); exit(1)"])
    with pytest.raises(CapbookError, match="sphinx exploded"): build_site([nb_path], out)
    assert (out / "index.html").read_text() == "old site"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ipynb", "site", "site.build.log"]


def test_bad_inputs(tmp_path, monkeypatch):
    keep = tmp_path / "project"; keep.mkdir(); (keep / "precious.txt").write_text("x")
    nb_path = tmp_path / "a.ipynb"; nbformat.write(_executed_notebook(), nb_path)
    with pytest.raises(CapbookError, match="refusing"): build_site([nb_path], keep)
    assert (keep / "precious.txt").exists()
    (tmp_path / "bad.ipynb").write_text("{oops")
    with pytest.raises(CapbookError, match="bad.ipynb: unreadable notebook"): build_site([tmp_path / "bad.ipynb"], tmp_path / "s")
    with pytest.raises(CapbookError, match="two pages would be named a"): build_site([nb_path, nb_path, nb_path], tmp_path / "s")
    import capbook.browser as browser
    monkeypatch.setattr(browser, "_CHROMIUM", ("no-such-chromium",))
    with pytest.raises(CapbookError, match="apt-get install chromium"): chromium_dom(nb_path)


def test_kept_copies_read_as_a_book(tmp_path):
    "The repository's copy of an executed notebook: papermill's cell as one line, no tool chatter, no machine path, images as files stored once by content; the site gets them back."
    nb = _executed_notebook()
    nb.cells.append(_code("evaluate()", v4.new_output("stream", name="stderr", text="PTBTokenizer tokenized 3113 tokens at 36478.67 tokens per second.\n"),
                          v4.new_output("stream", name="stdout", text=f"record -> {tmp_path}/runs/smoke/03/record.json\n")))
    nb.cells[3].source += f'run_dir = "{tmp_path}/runs/smoke/03"\n'
    run = tmp_path / "run"; run.mkdir()
    for name in ("01_a", "02_b"): nbformat.write(nb, run / f"{name}.ipynb")
    kept = keep_notebooks([run / "01_a.ipynb", run / "02_b.ipynb"], tmp_path / "kept")
    text = kept[0].read_text()
    assert "PTBTokenizer tokenized" not in text and str(tmp_path) not in text and "image/png" not in text
    assert "record -> <tmp>/" in text and "This run used `profile = 'smoke'`" in text and "run_dir" not in text
    assert len(list((tmp_path / "kept" / "img").glob("*.png"))) == 1                 # the same image, stored once
    assert keep_notebooks([run / "01_a.ipynb"], tmp_path / "kept") and sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["01_a.ipynb", "img"]
    src = tmp_path / "src"; src.mkdir()
    docs.write_book([tmp_path / "kept" / "01_a.ipynb"], src)
    shown = nbformat.read(src / "index.ipynb", 4).cells[-3].outputs[0].data["text/html"]       # a figure at its size, captioned,
    fig = re.search(r'<img src="(_static/figures/\w+\.png)"', shown)                            # a file of the site
    assert fig and "<figcaption>" in shown, shown[:300]
    assert (src / fig[1]).read_bytes() == base64.b64decode(nb.cells[-3].outputs[0].data["image/png"])
    next((tmp_path / "kept" / "img").glob("*.png")).unlink()
    with pytest.raises(CapbookError, match="image of a kept notebook not found"): docs.write_book([tmp_path / "kept" / "01_a.ipynb"], src)


def test_partial_keep_replaces_only_its_notebooks(tmp_path):
    "A partial book (`capbook book --only`) rewrites its chapters' copies and keeps the others' with their images; images no kept copy names leave."
    run = tmp_path / "run"; run.mkdir()
    a, b = _executed_notebook(), _executed_notebook()
    b.cells[-2].outputs[0].data["image/png"] = _png_other = _png((0, 1))
    nbformat.write(a, run / "01_a.ipynb"); nbformat.write(b, run / "02_b.ipynb")
    kept = tmp_path / "kept"
    keep_notebooks([run / "01_a.ipynb", run / "02_b.ipynb"], kept)
    assert len(list((kept / "img").glob("*.png"))) == 2
    a.cells[-2].outputs[0].data["image/png"] = _png_other                   # 01_a rerun: now b's image, its old one unused
    a.cells[0].source += "\n\nRERUN_MARK"
    nbformat.write(a, run / "01_a.ipynb")
    keep_notebooks([run / "01_a.ipynb"], kept, replace=False)
    assert sorted(p.name for p in kept.glob("*.ipynb")) == ["01_a.ipynb", "02_b.ipynb"]
    assert "RERUN_MARK" in (kept / "01_a.ipynb").read_text()
    assert len(list((kept / "img").glob("*.png"))) == 1                     # the image only the old 01_a named is gone
    src = tmp_path / "src"; src.mkdir()
    docs.write_book([kept / "01_a.ipynb", kept / "02_b.ipynb"], src)        # every kept copy still finds its images


@pytest.mark.slow
def test_repository_book_site(tmp_path):
    "What a fresh clone reads: the site built from the default book kept in figures/notebooks/ without one Sphinx warning, its first page with the README's generated blocks, every chapter opened in Chromium (its tables and images there, no error, machine path or tool chatter), two pages photographed."
    from pathlib import Path
    from capbook.book import api_modules, notebooks
    from sitecheck import check_site
    kept = Path(__file__).resolve().parent.parent / "figures" / "notebooks"
    rank = {nb: i for i, nb in enumerate(notebooks())}
    pages = sorted(kept.glob("*.ipynb"), key=lambda p: rank.get(p.stem, len(rank)))
    assert [p.stem for p in pages] == notebooks(), "figures/notebooks/ must hold every notebook of the book: run `make book`"
    from capbook.book import fill_blocks, findings, index_blocks
    blocks = index_blocks(kept.parent, None, site=True)                       # the first page's generated blocks, as `capbook docs` fills them
    index = build_site(pages, tmp_path / "site", api_modules=api_modules(), fill=lambda md: fill_blocks(md, blocks),
                       findings=findings(kept.parent))                        # what each tables chapter found, on its top
    log = (tmp_path / "site.build.log").read_text()
    assert "build succeeded." in log and "WARNING" not in log, [l for l in log.splitlines() if "WARNING" in l]   # zero Sphinx warnings
    front = (index.parent / "index.html").read_text()
    assert 'class="capbook-figure"><div style="overflow-x: auto"><img src="_static/figures/' in front and "what it holds" in front   # the figure, the chapter table
    with Chromium() as browser:
        seen = check_site(index, kept, browser)
        for name in notebooks():
            if name[:2].isdigit() and not name.startswith("00"):
                assert "<table" in seen[name] and "<img" in seen[name], name           # every chapter has a table and a figure
        for name in ("02_show_attend_tell", "03a_spca_tables"):
            png = browser.screenshot(index.parent / f"{name}.html", tmp_path / f"{name}.png", size=(1280, 2400)).read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 100_000


def test_a_readers_copy_refreshed_in_place_keeps_its_outputs_and_parameters_note(tmp_path):
    "A published reader's copy (no run folder at hand) brought up to a changed paragraph: the new text, the run's outputs and its one-line parameters note as they were; a copy already current is rewritten byte for byte."
    import json
    from pathlib import Path
    from capbook.copies import copy_current, reader_notebook, refresh_copy
    root = Path(__file__).parent.parent
    copy_path, src_path = root / "figures" / "notebooks" / "01_dataset.ipynb", root / "nbs" / "01_dataset.ipynb"
    write = lambda nb: (buf := io.StringIO(), nbformat.write(nb, buf))[0].getvalue()
    same = reader_notebook(refresh_copy(nbformat.read(copy_path, as_version=4), src_path))
    assert write(same) == copy_path.read_text()
    src = json.loads(src_path.read_text())
    md = next(c for c in src["cells"] if c["cell_type"] == "markdown" and len("".join(c["source"])) > 40)
    md["source"] = "A paragraph rewritten since the run.\n"
    (new_src := tmp_path / src_path.name).write_text(json.dumps(src))
    assert not copy_current(copy_path, new_src)
    nb = reader_notebook(refresh_copy(nbformat.read(copy_path, as_version=4), new_src))
    (out := tmp_path / "copy.ipynb").write_text(write(nb))
    assert copy_current(out, new_src)
    old = nbformat.read(copy_path, as_version=4)
    outputs = lambda n: [c.get("outputs") for c in n.cells if c.cell_type == "code"]
    notes = lambda n: [c.source for c in n.cells if c.cell_type == "markdown" and c.source.startswith("*This run used")]
    assert outputs(nb) == outputs(old) and notes(nb) == notes(old) and len(notes(nb)) == 1
    run_cell = next(c for c in src["cells"] if c["cell_type"] == "code" and "start_run(" in "".join(c["source"]))
    ran = "".join(run_cell["source"])
    run_cell["source"] = "#| bookkeeping\n" + ran + "  # a comment written since the run"   # the same code: its key unchanged
    new_src.write_text(json.dumps(src))
    assert not copy_current(out, new_src)                       # a copy shows the cell's comments as they are today ...
    nb2 = reader_notebook(refresh_copy(nbformat.read(out, as_version=4), new_src))
    (out2 := tmp_path / "copy2.ipynb").write_text(write(nb2))
    assert copy_current(out2, new_src) and outputs(nb2) == outputs(old)           # ... with the run's outputs
    assert any(c.source.startswith("#| bookkeeping") for c in nb2.cells)
    run_cell["source"] = ran + "\nextra = 1"                    # other code: the copy keeps the cell as it ran (the step runs again)
    new_src.write_text(json.dumps(src))
    assert refresh_copy(nbformat.read(out, as_version=4), new_src).cells == nbformat.read(out, as_version=4).cells


def test_machine_paths_are_replaced_once_and_only_as_whole_paths():
    "A published text names no path of the machine, and the replacement stops at path boundaries: a temporary file's folder named tmp... is not replaced twice (`<tmp><tmp>...`), and /home/user2 is not /home/user."
    from capbook.copies import _relative
    P = [("/work/main", "."), ("/work/main/.venv", "<python>"), ("/tmp", "<tmp>"), ("/home/user", "~")]
    cases = {"/tmp/tmpaqsmhbne/bad.yaml: line 1": "<tmp>/tmpaqsmhbne/bad.yaml: line 1",
             "/home/user2/x and /home/user/x": "/home/user2/x and ~/x",
             "PosixPath('/work/main/runs/default/x')": "PosixPath('runs/default/x')",
             "/work/main/.venv/bin/python": "<python>/bin/python", "cd /work/main.": "cd ..", "at /work/main": "at .",
             "/var/tmp/x and /home/user.bak": "/var/tmp/x and /home/user.bak", "file:///tmp/a": "file://<tmp>/a"}
    assert {a: _relative(a, P) for a in cases} == cases
    assert _relative("/tmp/x", []) == "/tmp/x"
    from capbook.copies import without_machine_paths   # a record made by another checkout's environment: its Python shown as <python>
    other = {"jars not in /srv/clone2/.venv/lib/python3.11/site-packages/pycocoevalcap/spice/lib (x)":
             "jars not in <python>/lib/python3.11/site-packages/pycocoevalcap/spice/lib (x)",
             "'/opt/conda/lib/python3.12/site-packages'": "'<python>/lib/python3.12/site-packages'",
             "/srv/data/lib/python3.11/site-packages-old/x": "/srv/data/lib/python3.11/site-packages-old/x"}
    assert {a: without_machine_paths(a) for a in other} == other


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_a_kernel_that_loads_the_model_registry_imports_no_notebook_reader():
    "Every chapter's kernel loads the registry (`capbook.profiles.chapters`, which imports every capbook module, this one too) without reading a notebook: nbformat and jsonschema, whose format checker compiles its grammars as it is imported (a second), stay unimported until a function of `capbook.docs` or `capbook.copies` reads one."
    import subprocess
    code = ("import sys, capbook.profiles as r; r.chapters(); import capbook.docs as d; "
            "print(sorted(m for m in ('nbformat', 'jsonschema') if m in sys.modules)); "
            "d.nbformat.v4.new_notebook(); print(sorted(m for m in ('nbformat', 'jsonschema') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "['jsonschema', 'nbformat']"], out.stdout
