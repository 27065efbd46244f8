"The notebooks are the source: capbook/ is what nbdev_export makes of them, pairs are in sync, sources are clean."
import json, re, shutil, subprocess, sys
from pathlib import Path
import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS = sorted((ROOT / "nbs").glob("*.ipynb"))
BIN = Path(sys.executable).parent


def test_export_changes_nothing(tmp_path):
    shutil.copytree(ROOT / "nbs", tmp_path / "nbs")
    shutil.copy(ROOT / "settings.ini", tmp_path)
    subprocess.run([str(BIN / "nbdev_export")], cwd=tmp_path, check=True, capture_output=True)
    ours = {p.relative_to(ROOT / "capbook"): p.read_text() for p in (ROOT / "capbook").rglob("*.py")}
    fresh = {p.relative_to(tmp_path / "capbook"): p.read_text() for p in (tmp_path / "capbook").rglob("*.py")}
    assert sorted(ours) == sorted(fresh), "capbook/ has files nbdev_export does not make (or lacks some): run make sync"
    stale = [str(k) for k in ours if ours[k] != fresh[k]]
    assert not stale, f"capbook/ differs from nbdev_export of nbs/ in {stale}: run make sync"


@pytest.mark.parametrize("nb", NBS, ids=lambda p: p.name)
def test_pair_in_sync_and_clean(nb):
    py = nb.with_suffix(".py")
    assert py.exists(), f"{nb.name} has no py:percent twin"
    a, b = jupytext.read(nb), jupytext.read(py)
    cells = lambda n: [(c.cell_type, c.source.strip()) for c in n.cells]
    assert cells(a) == cells(b), f"{nb.name} and {py.name} differ: run make sync"
    raw = json.loads(nb.read_text())
    for c in raw["cells"]:
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None, f"{nb.name}: stored outputs (run nbdev_clean)"
        assert "injected-parameters" not in c.get("metadata", {}).get("tags", [])


def _parameter_cells(name):
    raw = json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())
    return [c for c in raw["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]


def test_every_notebook_is_in_the_plan_and_runnable_ones_have_one_parameters_cell():
    from capbook.plan import notebooks, plan
    from capbook.profiles import chapters
    assert sorted(notebooks()) == sorted(p.stem for p in NBS)
    steps = plan("smoke")
    assert {s.notebook for s in steps} == {p.stem for p in NBS}, "the book runs every notebook"
    for name in notebooks():
        cells = _parameter_cells(name)
        assert len(cells) <= 1, name
        if any(s.params for s in steps if s.notebook == name): assert len(cells) == 1, name
    for name, ch in chapters().items():
        assert (ROOT / "nbs" / f"{name}.ipynb").exists(), f"chapter {name} is declared but has no notebook"
        assert [s.tag for s in steps if s.notebook == name] == [t for t in ch.runs if "smoke" in ch.only.get(t, ("smoke",))], name


def test_derived_parameters_cells_and_readme_are_current(monkeypatch):
    "README.md is the index notebook's text with its blocks generated from figures/ (the chapters' currency as the README states it: the currency test checks that); the parameters cells are their dataclasses'."
    from capbook.book import sync_parameters, sync_readme
    monkeypatch.setenv("CAPBOOK_HOME", str(ROOT))      # the checkout's book (its plan reads the looks it published), whatever home an earlier test of this process set
    assert sync_parameters(write=False) == [], "a parameters cell differs from its dataclass: run make sync"
    assert not sync_readme(write=False), "README.md is not what the index notebook and figures/ make: run capbook readme"


def test_readme_is_a_front_door():
    "README: at most 10,000 characters, its first command within its first 40 lines, every chapter's currency stated, its links to the executed copies (figures/notebooks/: the sources in nbs/ have no outputs), and no history (issue numbers, commit hashes, sessions) or workshop talk: that goes to CHANGELOG.md."
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(text) <= 10_000, len(text)
    first = next(i for i, l in enumerate(lines) if l.startswith("make "))
    assert first < 40, first
    assert "| current |" in text or "not yet regenerated" in text
    links = __import__("re").findall(r"\]\(([\w./-]+\.ipynb)\)", text)          # a code host shows the executed copies' outputs
    assert links and all(l.startswith("figures/notebooks/") and (ROOT / l).exists() for l in links), links
    assert not HISTORY.search(text), HISTORY.search(text)
    from sitecheck import workshop_words
    assert not workshop_words(text), workshop_words(text)


HISTORY = __import__("re").compile(r"\bissues? #?\d+\b|\bcommit `?[0-9a-f]{7,}\b|`[0-9a-f]{7}`|\bthis session\b|\bsessions?\b|\bprevious book\b|"
                                   r"\bthe book used to\b|\bbefore this chapter\b|\bthe issue(?:'s| asks)\b", __import__("re").I)


def test_no_history_on_the_site():
    "The site speaks to readers: no notebook's Markdown names an issue, a commit or a session, or says what the workshop lost or could not download (history goes to CHANGELOG.md; `sitecheck.WORKSHOP`)."
    import nbformat
    from sitecheck import workshop_words
    found = []
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        for c in nbformat.read(nb, as_version=4).cells:
            if c.cell_type == "markdown" and (m := HISTORY.search(c.source)): found.append(f"{nb.name}: {m.group(0)!r}")
            if c.cell_type == "markdown": found += [f"{nb.name}: {w!r}" for w in workshop_words(c.source)]
    assert not found, found


def test_no_workshop_talk_in_the_published_book():
    "What the site shows of each published reader's copy (figures/notebooks: its prose and its outputs, not its code) holds no workshop talk (`sitecheck.WORKSHOP`) and none of the tools' chatter the site check refuses (`sitecheck.CHATTER`), nor do the docstrings the API page shows: the site's own checks, without building the site."
    import ast, nbformat
    from sitecheck import chatter, shown_text, workshop_words
    shown = {f.stem: shown_text(nbformat.read(f, as_version=4)) for f in sorted((ROOT / "figures" / "notebooks").glob("*.ipynb"))}
    found = [f"{name}: {w!r}" for name, text in shown.items() for w in workshop_words(text) + chatter(text)]
    for mod in sorted((ROOT / "capbook").glob("*.py")):
        for node in ast.walk(ast.parse(mod.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and (doc := ast.get_docstring(node)):
                found += [f"{mod.name}: {w!r}" for w in workshop_words(doc)]
    assert not found, found


def test_published_copies_read_as_they_ran_wherever_opened(monkeypatch):
    "Each reader's copy in figures/notebooks shows what it ran on GitHub and in JupyterLab: paths as paths (no repr, no temporary folder's random name, no machine path written into its code), every figure output carries a Markdown link to its image (`capbook.copies.link_images`) whose file is there, every code cell that ran has its execution count, and every tables chapter opens with its findings, the same text as its page's (`capbook.book.findings`), before its first output."
    import nbformat
    from capbook.book import findings
    from capbook.docs import FINDINGS
    kept = ROOT / "figures" / "notebooks"
    monkeypatch.setenv("CAPBOOK_HOME", str(ROOT))      # the checkout's book, whatever home an earlier test of this process set
    found, bare, countless, late, reprs = findings(kept.parent), [], set(), [], []
    for f in sorted(kept.glob("*.ipynb")):
        nb = nbformat.read(f, as_version=4)
        for c in (c for c in nb.cells if c.cell_type == "code"):
            for o in c.get("outputs", []):
                d, name = o.get("data", {}), o.get("metadata", {}).get("capbook_image")
                shows = "image/png" in d or (name and d.get("text/markdown") == f"![figure](img/{name})" and (kept / "img" / name).is_file())
                if name or str(d.get("text/plain", "")).startswith(("<Figure size", "<IPython.core.display.Image")):
                    if not shows: bare.append(f"{f.stem}: {d.get('text/plain', name)}")
            if (c.get("outputs") or c.source.startswith("#| export")) and c.execution_count is None: countless.add(f.stem)
            shown = "".join(str(o.get("text", "")) + "".join(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/")) for o in c.get("outputs", []))
            reprs += [f"{f.stem}: {m}" for m in re.findall(r"PosixPath\(.{0,40}|<tmp>/tmp\w{8}/.{0,20}", shown)]
            reprs += [f"{f.stem}: code names {m}" for m in re.findall(r"[\"']<tmp>/[^\"']*", c.source)]   # a path literal, rewritten
        if f.stem in found:
            at = next((i for i, c in enumerate(nb.cells) if FINDINGS in c.metadata.get("tags", [])), None)
            first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("outputs"))
            if at is None or at > first or not nb.cells[at].source.startswith(found[f.stem][0]): late.append(f.stem)
    assert not bare, ("figure outputs a reader's viewer cannot show", bare)
    assert not reprs, ("a path's repr, a temporary folder's random name, or a machine's path written into code", reprs)
    assert not countless, ("code cells that ran without an execution count", sorted(countless))
    assert not late and len(found) >= 8, ("chapters whose copy does not open with its findings", late)   # five tables chapters, the chapter runs


def test_every_parameter_of_a_chapter_is_read_back_from_its_notebook():
    "The book matches a run to its step by the notebook's parameters cell as papermill parses it: a field it cannot parse (e.g. an '=' in its comment) would leave every assembly chapter without its runs. The fields the book sets (`BOOK_SET`) are left out of the cells and matched at their defaults."
    import dataclasses
    from capbook.plan import nb_defaults
    from capbook.profiles import BOOK_SET, chapters
    for nb, ch in chapters().items():
        assert set(nb_defaults(nb)) == {f.name for f in dataclasses.fields(ch.params)} - set(BOOK_SET), nb


def test_the_plans_parameters_are_what_papermill_reads(tmp_path):
    "The plan reads each notebook's `parameters` cell from its JSON (no papermill on a GPU machine's bare Python): the same names and values as `papermill.inspect_notebook` for every notebook; a notebook that is not JSON stops in one line naming it."
    import ast, papermill
    from capbook.core import CapbookError
    from capbook.plan import _nb_defaults
    for p in NBS:
        pm = {k: ast.literal_eval(v["default"]) for k, v in papermill.inspect_notebook(str(p)).items()}
        assert _nb_defaults(str(p), -1.0) == pm, p.name
    bad = tmp_path / "torn.ipynb"
    bad.write_text('{"cells": [')
    with pytest.raises(CapbookError, match="torn.ipynb: not a readable notebook"):
        _nb_defaults(str(bad), -1.0)


def test_no_notebook_source_holds_a_control_character():
    "A backslash lost in an edit turns TeX's \\bar or \\frac into a backspace or a form feed, which the site shows as garbage."
    import re
    bad = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
    found = [f"{p.name}:{i + 1}" for p in sorted((Path(__file__).parent.parent / "nbs").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines()) if bad.search(line)]
    assert found == []


def test_no_machine_path_in_the_published_book():
    "Nothing in figures/ names a path of the machine that made it (the reader's copies, the tables, the measurements)."
    import re
    pat = re.compile(rb"(?<![\w.])/(?:root|home|tmp|work|Users)/")
    import gzip
    read = lambda f: gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
    found = [f.relative_to(ROOT).as_posix() for f in sorted((ROOT / "figures").rglob("*"))
             if f.is_file() and f.suffix in (".json", ".md", ".csv", ".ipynb", ".gz") and pat.search(read(f))]
    assert not found, found


def test_no_table_row_became_a_heading():
    "A table row in a notebook's prose stays a row: a Markdown line '# | ...' (a stray comment mark before a row) would turn it into a heading of the page's contents."
    import re, nbformat
    found = [f"{nb.name}: {m.group(0)[:60]!r}" for nb in sorted((ROOT / "nbs").glob("*.ipynb"))
             for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "markdown"
             for m in re.finditer(r"^#+ \|.*$", c.source, re.M)]
    assert not found, found


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_a_capbook_process_reads_notebooks_without_rfc3987_syntax():
    "capbook.core keeps jsonschema from importing rfc3987_syntax (39 grammars compiled at import, for an 'iri' string format no notebook schema has): in a process that imported it, papermill and nbformat load without it and still validate a notebook, and a malformed one still fails validation."
    code = ("import sys, capbook.core, papermill, nbformat\n"
            "assert sys.modules.get('rfc3987_syntax') is None, 'rfc3987_syntax was imported'\n"
            "nb = nbformat.read('nbs/01_dataset.ipynb', as_version=4); nbformat.validate(nb)\n"
            "nb.cells[0]['cell_type'] = 'nonsense'\n"
            "try: nbformat.validate(nb)\n"
            "except nbformat.ValidationError: print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
