"""The docs site as a reader meets it, checked in headless Chromium: every chapter linked from the landing page, each
page showing the tables and images its notebook holds, and no error output, machine path, tool chatter or workshop talk
anywhere."""
import html as _html
import re
from pathlib import Path
import nbformat
from capbook.docs import Chromium

# an absolute path on a build machine: /work/…, /home/…, /root/…, /tmp/…, /Users/…, /mnt/…, /var/folders/…
MACHINE_PATH = re.compile(r"(?<![\w.:/~<>-])/(?:work|home|root|tmp|Users|mnt|var/folders|opt/conda)/[\w.-]")
CHATTER = ("PTBTokenizer tokenized", "tokens per second", "it/s]", "TqdmWarning", "run_dir = ", "training from scratch", "resumed from")
# workshop talk: how the book was made (an issue, a session, a lost copy, this machine's downloads, what the book used to
# do) rather than what it is; history goes to CHANGELOG.md. Tuned on the site: beam *search*, "nothing computed is lost",
# "X is used to compute Y", a browser's DevTools session and "on this machine" (the reader's, in a command's
# description) stay legitimate.
WORKSHOP = re.compile(r"\bissues?\b|\b(?:this|previous|last|earlier|next|our) sessions?\b|\bwe could\b|\blost them\b|\bcopy lost\b|\bdownload(?:ed|able) here\b|"
                      r"(?<!\bis )(?<!\bare )(?<!\bwas )(?<!\bwere )(?<!\bbe )(?<!\bbeen )\bused to\b|\bbefore this (?:chapter|section)\b|"
                      r"\bafternoon\b|\bthe machines? this book\b", re.I)
# Workshop words a page shows that come from a tables chapter's own code cells (not its prose): editing those cells re-keys
# the chapter's results, so they stay until it is regenerated. (page, the words matched)
WORKSHOP_PENDING = {("05a_glied_tables", "copy lost"), ("05a_glied_tables", "downloaded here")}


def workshop_words(text: str, page: str) -> list[str]:
    "The workshop words (`WORKSHOP`) in `text` shown on `page`, each with its context; those `WORKSHOP_PENDING` allows left out."
    return [" ".join(text[max(0, m.start() - 60):m.end() + 60].split()) for m in WORKSHOP.finditer(text)
            if (page, m.group(0).lower()) not in WORKSHOP_PENDING]


def as_text(html: str) -> str:
    "What a reader reads of `html`: its text, without markup, scripts or styles."
    return _html.unescape(_NOT_SHOWN.sub(" ", html))


def shown_text(nb: nbformat.NotebookNode) -> str:
    "What a notebook shows a reader besides its code: its Markdown and its outputs' text (HTML as text)."
    parts = []
    for c in nb.cells:
        if c.cell_type == "markdown": parts.append(c.source)
        for o in c.get("outputs", []):
            parts.append(str(o.get("text", "")))
            for kind, v in o.get("data", {}).items():
                if kind.startswith("text/"): parts.append(as_text(str(v)) if kind == "text/html" else str(v))
    return "\n".join(parts)


_CODE_INPUT = re.compile(r'<div class="highlight-ipython3 notranslate">.*?</pre>', re.S)   # the code itself may name paths
_NOT_SHOWN = re.compile(r"<(script|style)\b.*?</\1>|<[^>]+>", re.S | re.I)              # a page's markup, scripts and styles
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
        assert not (w := workshop_words(as_text(shown), name)), (name, w)
        if any(c.source.startswith("*This run used") for c in nbformat.read(nb_path, as_version=4).cells):
            assert "This run used" in html, name               # the injected parameters, as one line
        seen[name] = (tables, images)
    return seen
