"The package's rooms: no import circle, each module saying on its first line what it holds, the layout paragraph naming every room."
import ast, re
from pathlib import Path
import capbook

PKG = Path(capbook.__file__).parent


def imports() -> dict[str, set[str]]:
    "Every capbook module's imports of other capbook modules, at module level and inside functions alike: {module: modules it imports}."
    mods = {p.stem for p in PKG.glob("*.py") if not p.stem.startswith("_")}
    edges = {m: set() for m in mods}
    for m in mods:
        for n in ast.walk(ast.parse((PKG / f"{m}.py").read_text())):
            if isinstance(n, ast.ImportFrom):
                if n.level == 1: targets = [n.module.split(".")[0]] if n.module else [a.name for a in n.names]
                elif n.module and n.module.startswith("capbook."): targets = [n.module.split(".")[1]]
                elif n.module == "capbook": targets = [a.name for a in n.names]
                else: targets = []
            elif isinstance(n, ast.Import): targets = [a.name.split(".")[1] for a in n.names if a.name.startswith("capbook.")]
            else: continue
            edges[m] |= {t for t in targets if t in mods and t != m}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    "The strongly connected components of more than one module (Tarjan): each an import circle."
    index, low, stack, on, out = {}, {}, [], set(), []
    def visit(v):
        index[v] = low[v] = len(index); stack.append(v); on.add(v)
        for w in sorted(edges[v]):
            if w not in index: visit(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1: out.append(sorted(comp))
    for v in sorted(edges):
        if v not in index: visit(v)
    return out


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    "No capbook module reaches itself through its imports, lazy ones inside functions included: every room sits below the rooms that use it."
    edges = imports()
    assert len(edges) > 25 and edges["runner"] >= {"profiles", "metrics"}      # the graph is the package's, not an empty one
    found = circles(edges)
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_room_says_what_it_holds_and_the_layout_names_every_room():
    "Each module's docstring (its notebook's summary line) is a whole sentence, and 00_core's layout paragraph names every module."
    layout = re.search(r"\*\*The rooms\.\*\*(.*?)\n\n", (PKG.parent / "nbs" / "00_core.py").read_text().replace("\n# ", " "), re.S).group(1)
    for p in sorted(PKG.glob("*.py")):
        if p.stem.startswith("_"): continue
        doc = ast.get_docstring(ast.parse(p.read_text()))
        assert doc and doc.rstrip().endswith((".", ")", "`")), f"{p.name}: its first line says what it holds: {doc!r}"
        assert f"`{p.stem}`" in layout, f"00_core's layout paragraph does not name {p.stem}"
