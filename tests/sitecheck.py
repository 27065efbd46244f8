"""The docs site as a reader meets it, checked in headless Chromium: every chapter linked from the landing page, each
page showing the tables and images its notebook holds, and no error output, machine path or tool chatter anywhere."""
import re
from pathlib import Path
import nbformat
from capbook.docs import Chromium

# an absolute path on a build machine: /work/…, /home/…, /root/…, /tmp/…, /Users/…, /mnt/…, /var/folders/…
MACHINE_PATH = re.compile(r"(?<![\w.:/~<>-])/(?:work|home|root|tmp|Users|mnt|var/folders|opt/conda)/[\w.-]")
CHATTER = ("PTBTokenizer tokenized", "tokens per second", "it/s]", "TqdmWarning", "run_dir = ", "training from scratch", "resumed from")
_CODE_INPUT = re.compile(r'<div class="highlight-ipython3 notranslate">.*?</pre>', re.S)   # the code itself may name paths
_MD_TABLE = re.compile(r"^\|.*\|[ \t]*\n\|[ \t]*:?-", re.M)


def expected(nb: nbformat.NotebookNode) -> tuple[int, int]:
    "(tables, images) among a kept notebook's outputs; an error output fails."
    tables = images = 0
    for cell in nb.cells:
        assert "injected-parameters" not in cell.metadata.get("tags", []), "papermill's injected cell is kept"
        for o in cell.get("outputs", []):
            assert o.output_type != "error", f"error output: {o.get('ename')}: {o.get('evalue')}"
            d = o.get("data", {})
            images += "capbook_image" in o.get("metadata", {}) or "image/png" in d
            tables += "<table" in str(d.get("text/html", "")) or len(_MD_TABLE.findall(str(d.get("text/markdown", ""))))
    return tables, images


def check_site(index: Path, kept: Path, browser: Chromium | None = None) -> dict[str, tuple[int, int]]:
    "Open the site at `index` and every chapter linked from it, in one Chromium (`browser`, else a new one); check each against its kept notebook in `kept`. Returns {page: (tables, images) seen}."
    if browser is None:
        with Chromium() as browser: return check_site(index, kept, browser)
    index = Path(index)
    dom = browser.dom(index)
    linked = set(re.findall(r'href="([\w-]+)\.html', dom))
    pages = {p.stem: p for p in Path(kept).glob("*.ipynb")}
    assert pages, f"no kept notebooks in {kept}"
    assert not (set(pages) - linked - {"index"}), f"chapters the landing page does not link: {sorted(set(pages) - linked - {'index'})}"
    doms = {n: dom if n == "index" else browser.dom(index.parent / f"{n}.html") for n in sorted(pages)}
    seen = {}
    for name, nb_path in sorted(pages.items()):
        html = doms[name]
        want_tables, want_images = expected(nbformat.read(nb_path, as_version=4))
        tables, images = html.count("<table"), html.count("<img")
        assert tables >= want_tables and images >= want_images, (name, (tables, images), (want_tables, want_images))
        shown = _CODE_INPUT.sub("", html)             # what the run printed and the prose
        assert "Traceback (most recent call last)" not in shown and 'class="output traceback' not in shown, name
        assert not (m := MACHINE_PATH.search(shown)), (name, shown[max(0, m.start() - 80):m.end() + 80])
        assert not [c for c in CHATTER if c in shown], (name, [c for c in CHATTER if c in shown])
        if any(c.source.startswith("*This run used") for c in nbformat.read(nb_path, as_version=4).cells):
            assert "This run used" in html, name               # the injected parameters, as one line
        seen[name] = (tables, images)
    return seen
