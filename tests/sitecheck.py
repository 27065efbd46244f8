"""The docs site as a reader meets it, checked in headless Chromium: every chapter linked from the landing page, each
page showing the tables and images its notebook holds, and no error output, machine path, tool chatter or workshop talk
anywhere."""
import html as _html
import re
from pathlib import Path
import nbformat
from capbook.docs import ASSEMBLED, SCALE, TABLES_PAGE
from capbook.browser import Chromium

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


def workshop_words(text: str) -> list[str]:
    "The workshop words (`WORKSHOP`) in `text`, each with its context."
    return [" ".join(text[max(0, m.start() - 60):m.end() + 60].split()) for m in WORKSHOP.finditer(text)]


def chatter(text: str) -> list[str]:
    "The tools' chatter (`CHATTER`) that `text` shows."
    return [c for c in CHATTER if c in text]


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
_FOLDED = ("tag_hide-input", "tag_hide-cell", "tag_remove-input")
_METHOD = re.compile(r"^\s*(?:def|class)\b|#.*[=≈∝]", re.M)   # a definition, or an equation's comment line


def cells(html: str) -> list[tuple[str, str, str]]:
    "The code cells of a built page: (their classes, their input's HTML, their output's HTML), in order, each cut at the end of its own container."
    from html.parser import HTMLParser
    found = []
    class Cells(HTMLParser):
        depth, start, classes = 0, None, ""
        def handle_starttag(self, tag, attrs):
            if tag != "div": return
            cls = dict(attrs).get("class") or ""
            if self.start is None and re.match(r"cell( |$)", cls):
                self.start, self.classes, self.depth = self.getpos(), cls, 0
            if self.start is not None: self.depth += 1
        def handle_endtag(self, tag):
            if tag != "div" or self.start is None: return
            self.depth -= 1
            if self.depth == 0: found.append((self.start, self.getpos(), self.classes)); self.start = None
    Cells(convert_charrefs=False).feed(html)
    lines = html.splitlines(keepends=True)
    offset = [0]
    for line in lines: offset.append(offset[-1] + len(line))
    out = []
    for (l0, c0), (l1, c1), classes in found:
        part = html[offset[l0 - 1] + c0:offset[l1 - 1] + c1]
        cut = part.find('class="cell_output')
        inp, outp = (part, "") if cut < 0 else (part[:cut], part[cut:])
        out.append((classes, inp if 'class="cell_input' in inp else "", outp))
    return out


def check_folding(name: str, html: str) -> int:
    "One folding rule over a built page: on a tables chapter every code cell is folded; on any page a cell that only draws a table or figure (it shows one, and its code neither defines anything nor states an equation) is folded; the method's code stays open. Returns the visible code cells."
    visible = 0
    for classes, inp, outp in cells(html):
        if not inp or any(f in classes for f in _FOLDED): continue
        visible += 1
        assert not TABLES_PAGE.match(name), (name, "a tables chapter shows a code cell", re.sub(r"<[^>]+>", "", inp)[:300])
        code = re.sub(r"<[^>]+>", "", inp)
        draws = "<img" in outp or "<table" in outp
        assert not (draws and not _METHOD.search(code)), (name, "a cell that only draws is open", code[:300])
    return visible


SCREEN = (1280, 900)   # the reader's window
_TABLE_WIDTHS = """Array.from(document.querySelectorAll('article table, article pre')).filter(t => t.offsetParent !== null && !t.closest('details:not([open])'))
  .map(t => [t.scrollWidth, t.clientWidth, (t.closest('.cell_output, section') || t).getAttribute('id') || '', t.innerText.slice(0, 60)])"""


def check_table_widths(name: str, widths: list) -> int:
    "No table or code block a reader sees on page `name` (folded ones aside) is wider than its column in a 1,280-pixel window: each fits without scrolling (the index's Quick start among them). `widths`: the page's `_TABLE_WIDTHS` (`read_page`). Returns the boxes measured."
    wide = [w for w in widths if w[0] > w[1] + 2]
    assert not wide, (name, "tables or code blocks wider than the column (content px, shown px, where, text)", wide)
    return len(widths)


_FIGURES = """Array.from(document.querySelectorAll('article img')).filter(i => i.offsetParent !== null && !i.closest('details:not([open])'))
  .map(i => { const f = i.closest('figure'), c = f && f.querySelector('figcaption'), box = i.parentElement.getBoundingClientRect();
    return [i.naturalWidth, i.getBoundingClientRect().width, box.width, c ? c.innerText.trim() : '', (i.closest('section') || i).getAttribute('id') || ''] })"""


def check_figures(name: str, figures: list) -> int:
    "Every figure a reader sees on page `name` in a 1,280-pixel window is legible and captioned: shown at its own size, or shrunk to no less than `SCALE` of it (it scrolls past that), never enlarged, with a visible caption. `figures`: the page's `_FIGURES` (`read_page`). Returns the figures measured."
    small = [f for f in figures if f[1] < SCALE * f[0] - 1 or f[1] > f[0] + 1]
    assert not small, (name, "figures not at their size (own px, shown px, room px, caption, where)", small)
    bare = [f for f in figures if not f[3]]
    assert not bare, (name, "figures without a caption (own px, shown px, room px, caption, where)", bare)
    return len(figures)


def read_page(browser: Chromium, page: Path) -> tuple[str, list, list]:
    "A page loaded once in the reader's window (`SCREEN`; each load typesets its mathematics again): its DOM as HTML, its visible tables' widths (`check_table_widths`) and its visible figures (`check_figures`)."
    dom, widths, figures = browser.evaluate(page, f"[document.documentElement.outerHTML, {_TABLE_WIDTHS}, {_FIGURES}]", SCREEN)
    return dom, widths, figures


def check_findings_first(name: str, html: str, claims: list[str]) -> None:
    "A tables chapter opens with what it found: every claim it tested, with its verdict, before its first table; its books kept, folded, at the end."
    import html as H
    marked = re.sub(r"<table\b", "\x00TABLE<table", html)
    plain = lambda t: re.sub(r"\s+", " ", t.translate(str.maketrans("‘’“”", "''\"\"")))   # Sphinx's smart quotes as typed
    text = plain(H.unescape(re.sub(r"<[^>]+>", " ", marked)))
    at, first_table = text.find("What this chapter found"), text.find("\x00TABLE")
    assert 0 <= at < first_table, (name, at, first_table)
    for c in claims:
        shown = text.find(plain(c), at)
        assert at < shown < first_table, (name, "a claim is not on top", c)
    books = html.find(f'id="{ASSEMBLED.lower().replace(" ", "-")}"')     # the section itself, not the page's table of contents
    assert books > html.find("<table"), (name, "no books section after the tables")
    assert all("tag_hide-cell" in classes for classes, _, _ in cells(html[books:])), (name, "an open cell among the books")


def expected(nb: nbformat.NotebookNode) -> tuple[int, int]:
    "(tables, images) among a kept notebook's outputs; an error output fails."
    tables = images = 0
    for cell in nb.cells:
        assert "injected-parameters" not in cell.metadata.get("tags", []), "papermill's injected cell is kept"
        shown = set()                                       # an image a cell shows twice is on the page once
        for o in cell.get("outputs", []):
            assert o.output_type != "error", f"error output: {o.get('ename')}: {o.get('evalue')}"
            d = o.get("data", {})
            image = o.get("metadata", {}).get("capbook_image") or d.get("image/png")
            images += bool(image) and image not in shown
            shown.add(image)
            tables += "<table" in str(d.get("text/html", "")) or len(_MD_TABLE.findall(str(d.get("text/markdown", ""))))
    return tables, images


def check_site(index: Path, kept: Path, browser: Chromium | None = None) -> dict[str, str]:
    "Open the site at `index` and every chapter linked from it, in one Chromium (`browser`, else a new one); check each against its kept notebook in `kept`. Returns {page: its DOM as HTML}, for a test's own checks without a second load."
    if browser is None:
        with Chromium() as browser: return check_site(index, kept, browser)
    index = Path(index)
    front = read_page(browser, index)
    linked = set(re.findall(r'href="([\w-]+)\.html', front[0]))
    pages = {p.stem: p for p in Path(kept).glob("*.ipynb")}
    assert pages, f"no kept notebooks in {kept}"
    assert not (set(pages) - linked - {"index"}), f"chapters the landing page does not link: {sorted(set(pages) - linked - {'index'})}"
    seen = {}
    for name, nb_path in sorted(pages.items()):
        html, widths, figures = front if name == "index" else read_page(browser, index.parent / f"{name}.html")
        want_tables, want_images = expected(nbformat.read(nb_path, as_version=4))
        tables, images = html.count("<table"), html.count("<img")
        assert tables >= want_tables and images >= want_images, (name, (tables, images), (want_tables, want_images))
        shown = _CODE_INPUT.sub("", html)             # what the run printed and the prose
        assert "Traceback (most recent call last)" not in shown and 'class="output traceback' not in shown, name
        assert not (m := MACHINE_PATH.search(shown)), (name, shown[max(0, m.start() - 80):m.end() + 80])
        assert not (c := chatter(shown)), (name, c)
        assert not (w := workshop_words(as_text(shown))), (name, w)
        if any(c.source.startswith("*This run used") for c in nbformat.read(nb_path, as_version=4).cells):
            assert "This run used" in html, name               # the injected parameters, as one line
        check_folding(name, html)
        check_table_widths(name, widths)
        check_figures(name, figures)
        if TABLES_PAGE.match(name) and (claims := published_claims(Path(kept).parent, name)):
            check_findings_first(name, html, claims)
        seen[name] = html
    return seen


def published_claims(folder: Path, notebook: str) -> list[str]:
    "The claims a notebook published in its `table_*_verdicts.csv`, each as its page should state it: the claim, then its verdict."
    import csv, json
    from capbook.records import MANIFEST
    made = json.loads((folder / MANIFEST).read_text())["files"] if (folder / MANIFEST).exists() else {}
    return [f"{r['claim']}: {r['verdict']}" for f in sorted(folder.glob("table_*_verdicts.csv"))
            if made.get(f.name, {}).get("step") == notebook for r in csv.DictReader(f.open())]
