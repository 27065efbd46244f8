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
# # book
#
# > The papermill runner that regenerates the book from the notebooks and the chapters' declarations.

# %%
#| default_exp book

# %%
#| export
from __future__ import annotations
import atexit, base64, contextlib, dataclasses, logging, os, re, shutil, sys, tempfile, time, uuid
from functools import lru_cache
from pathlib import Path
from capbook.core import (CapbookError, IN_BOOK, atomic_write, check_choice, check_int, cpu_name, environment, io_error, load_json, one_writer, os_error_line, package_hash, progress, runs_dir,
                          save_json, stable_hash)
from capbook.profiles import check_profile, out_dir, chapters, parameters_source
from capbook.plan import Step, device_params, nbs_dir, notebooks, plan, upstream_of, weights_read
from capbook.results import plan_keys
from capbook.train import STEP_KEY, TRAINING_KEY

# %% [markdown]
# Profiles, run folders and results records live in `capbook.runner`, with the chapters' declarations.

# %% [markdown]
# ## The plan
#
# Which steps the book runs, with their parameters, lives in `capbook.plan` (`plan`, `Step`, `replicas`,
# `upstream_of`), below both this runner and the keys (`capbook.results`).

# %% [markdown]
# ### What else is derived: parameters cells, the API modules, the README's chapter table
#
# A chapter's `parameters` cell is generated from its parameters dataclass (`capbook.profiles.parameters_source`):
# `sync_parameters` rewrites the cell in each chapter's py:percent source, and `make sync` runs it. The modules of
# the API reference are the `default_exp` of each notebook, in reading order. README.md is the index notebook's text
# with its generated blocks filled in (nbdev's way): between `<!-- chapters -->` markers the chapter table (each
# chapter notebook's title, the paper its chapter declares, and whether its published results are current under the
# checkout's keys, `capbook.results.current`), between `<!-- results -->` the all-models table of the published book,
# between `<!-- verdicts -->` each tables chapter's verdicts, between `<!-- booktime -->` the book's measured time.
# `capbook readme` rewrites it; tests check it is what the published book says; the site's first page gets the same
# blocks when it is built.

# %%
#| export
_PARAMS_CELL = re.compile(r'(# %% tags=\["parameters"\]\n)(.*?)(\n\n# %%)', re.S)

def sync_parameters(write: bool = True) -> list[str]:
    "Rewrite each declared chapter's parameters cell (in its py:percent source) from its dataclass; the names of changed files."
    changed = []
    for nb, ch in chapters().items():
        py = nbs_dir() / f"{nb}.py"
        src = py.read_text()
        m = _PARAMS_CELL.search(src)
        if not m: raise CapbookError(f"{py}: chapter {nb} has no parameters cell")
        new = src[:m.start(2)] + parameters_source(ch.params) + src[m.end(2):]
        if new != src:
            changed.append(py.name)
            if write: py.write_text(new)
    return changed

def _default_exp(notebook: str) -> str | None:
    m = re.search(r"^#\|\s*default_exp\s+(\S+)", (nbs_dir() / f"{notebook}.py").read_text(), re.M)
    return m.group(1) if m else None

def api_modules() -> list[str]:
    "The package's modules, in the reading order of the notebooks that export them."
    return [f"capbook.{m}" for m in dict.fromkeys(filter(None, map(_default_exp, notebooks())))]

def _summary(notebook: str) -> tuple[str, str]:
    "A notebook's title (its H1) and summary (its first blockquote), from its py:percent source."
    src = (nbs_dir() / f"{notebook}.py").read_text()
    title = re.search(r"^# # (.+)$", src, re.M)
    quote = re.search(r"^# > (.+(?:\n# > .+)*)", src, re.M)
    text = " ".join(l[4:] for l in quote.group(0).splitlines()) if quote else ""
    return (title.group(1).strip() if title else notebook), text

def _paper_cell(ch) -> str:
    "A chapter's paper as one short linked cell; a chapter of several papers names how many (they are linked on its page)."
    if ch is None: return "—"
    if ";" in ch.paper: return f"{len(ch.paper.split(';'))} papers"
    m = re.match(r"(.+?) (\d{4}),", ch.paper)         # "Springenberg, Lakomkin, Weber and Wermter 2018, ..." -> "Springenberg et al. 2018"
    if not m: return f"[{ch.paper.split(',')[0]}]({ch.url})"
    first = re.split(r",| and ", m.group(1))[0].strip()
    return f"[{first if first.endswith('et al.') or first == m.group(1) else first + ' et al.'} {m.group(2)}]({ch.url})"

def chapter_status(rows: list[dict]) -> dict[str, bool]:
    "Whether each chapter notebook's published items are all current, from `capbook.results.current()`'s rows (a step `03_spca-base-seed1` belongs to notebook `03_spca`)."
    status: dict[str, bool] = {}
    for r in rows:
        if r["step"]: nb = r["step"].split("-")[0]; status[nb] = status.get(nb, True) and r["status"] == "current"
    return status

def chapter_table(status: dict[str, bool] | None = None) -> str:
    "The chapter table of the README and the site's first page: each chapter notebook, its title, the paper it reproduces, and (given `status`, `chapter_status`) whether its published results are the checkout's."
    chs = chapters()
    head = ["chapter", "what it holds", "paper"] + ["published results"] * (status is not None)
    rows, above = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)], None
    for nb in notebooks():
        if nb == "index" or nb.startswith("00"): continue
        num = re.match(r"\d*", nb).group()               # an assembly chapter (02a) belongs to its paper's (02)
        ch = chs.get(nb) or next((c for k, c in chs.items() if num and re.match(r"\d*", k).group() == num), None)
        paper = _paper_cell(ch)
        cells = [f"[`{nb}`]({nb}.ipynb)", _summary(nb)[0], "as above" if paper == above and paper.startswith("[") else paper]
        above = paper                                    # the same paper's link once: the README stays short
        if status is not None: cells.append("current" if status.get(nb) else "**not yet regenerated**")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)

SCST = " + SCST"        # the suffix of a self-critical stage's row in the book's tables

def results_table(folder: Path) -> str:
    "The README's results table: every model of the book (`06a_baselines_tables`' published table; of the two self-critical arms, the greedy baseline's) with CIDEr's mean ± sd over seeds, its 95 % interval, semantic F1 and the attention on the named object; then how many self-critical seeds ended below their start on validation, where each stage is set beside its start, and what each stage did to the captions (the published self-critical tables)."
    import pandas as pd
    csv = Path(folder) / "table_baselines_all.csv"
    if not csv.exists(): raise CapbookError(f"{csv.name} is not in the published book yet (`06a_baselines_tables` makes it)")
    df = pd.read_csv(csv)
    if missing := [c for c in ("model", "seeds", "CIDEr", "CIDEr sd", "CIDEr 95% CI") if c not in df]:
        raise CapbookError(f"the published {csv.name} is not yet regenerated by today's `06a_baselines_tables` (no column {', '.join(missing)})")
    num = lambda v, f=".1f": "—" if pd.isna(v) or v == "—" else format(float(v), f)
    lines = ["| model | seeds | CIDEr, mean ± sd | 95 % interval | semantic F1 | attention on the named object (%) |",
             "|---|---|---|---|---|---|"]
    for _, r in df[~df["model"].str.endswith(("(mean baseline)", "(30 epochs)"))].iterrows():   # the other arm, the twins: in the chapter
        lines.append(f"| {r['model']} | {r['seeds']} | {num(r['CIDEr'])} ± {num(r['CIDEr sd'])} | {r['CIDEr 95% CI']} | "
                     f"{num(r.get('F1 all'))} | {num(r.get('att. mass'))} |")
    if any(df["model"].str.endswith(SCST)):
        lines += ["", f"A *{SCST.strip()}* row continues its start self-critically, keeping the stage's best greedy validation, "
                  "never the start" + _stage_ends(Path(folder))
                  + "; [`06a_baselines_tables`](06a_baselines_tables.ipynb) sets each stage beside its start." + _stage_captions(Path(folder))]
    if sight := _relation_sight(Path(folder)): lines += ["", sight]
    return "\n".join(lines)

def _stage_ends(folder: Path) -> str:
    "How many self-critical seeds ended below their start on validation, from the published `table_baselines_scst.csv` (greedy arms)."
    import pandas as pd
    csv = folder / "table_baselines_scst.csv"
    if not csv.exists(): return ""
    df = pd.read_csv(csv)
    if not {"row", "val CIDEr, start (greedy)", "best val CIDEr"} <= set(df): return ""
    df = df[~df["row"].str.endswith("(mean baseline)")]
    below = df[df["best val CIDEr"] < df["val CIDEr, start (greedy)"]]
    return (f" ({len(below)} of {len(df)} seeds ended below their start on validation"
            + (": " + ", ".join(f"{r['row']} seed {r['seed']}" for _, r in below.iterrows()) if len(below) else "") + ")")

def _stage_captions(folder: Path) -> str:
    "What each self-critical stage (greedy arm) did to the captions, from the published `table_baselines_scst_captions.csv`: one sentence."
    import pandas as pd
    csv = folder / "table_baselines_scst_captions.csv"
    if not csv.exists(): return ""
    df = pd.read_csv(csv)
    from capbook.records import relation_spread
    if not {"stage", "captions of", "F1 counts", "F1 relations", "top relation (seeds)", "% with it"} <= set(df): return ""
    out, sight = [], {"% rel. true", "% rel. swapped"} <= set(df)
    for stage, g in df[~df["stage"].str.endswith("(mean baseline)")].groupby("stage", sort=False):
        start, end = g[g["captions of"] != stage].iloc[0], g[g["captions of"] == stage].iloc[0]
        span, none, seeds = relation_spread(end["top relation (seeds)"], end["% with it"])
        out.append(f"{stage.removesuffix(SCST)} {start['F1 counts']:.1f} → {end['F1 counts']:.1f}, {start['F1 relations']:.1f} → "
                   f"{end['F1 relations']:.1f}, {span}" + (f" ({none} of {seeds} seeds write none)" if none else "")
                   + (f", {end['% rel. true']:.1f} vs {end['% rel. swapped']:.1f} %" if sight else ""))
    return (" What each stage did to the captions (counts F1, relations F1, share of a seed's captions with its top relation "
            "word" + ("; its relations true vs with the objects swapped" if sight else "")
            + "): " + "; ".join(out) + ".") if out else ""

def _relation_sight(folder: Path) -> str:
    "Whether SPCA's rows' relation words say where the objects are, from the published `table_spca_relations.csv` (`03a_spca_tables`' exploratory control): one sentence, or '' where the table is not published."
    import pandas as pd
    csv = folder / "table_spca_relations.csv"
    if not csv.exists(): return ""
    df = pd.read_csv(csv)
    if not {"model", "seeds", "rel. true", "rel. swapped", "seeds beating the swap", "p over seeds"} <= set(df): return ""
    every = df[df["seeds beating the swap"] == df["seeds"]]
    said = "; ".join(f"{r['model']}, {r['rel. true']:.1f} against {r['rel. swapped']:.1f} %, "
                     + (f"p over its {r['seeds']} seeds {float(r['p over seeds']):.3g}" if r["seeds"] > 1 else "one seed") for _, r in every.iterrows())
    return ("Relation words true more often than with the objects swapped, in every seed (McNemar): "
            + (f"{len(every)} of SPCA's {len(df)} rows ({said})" if len(every) else f"none of SPCA's {len(df)} rows")
            + "; exploratory, outside the registered claims ([`03a_spca_tables`](03a_spca_tables.ipynb)).")

def verdict_tables(folder: Path) -> list[tuple[Path, str | None]]:
    "The verdicts tables a book in `folder` published (`table_*_verdicts.csv`), each with the step that made it (None where the manifest names none), in the book's order."
    from capbook.records import MANIFEST
    folder = Path(folder)
    made = {f: e["step"] for f, e in load_json(folder / MANIFEST)["files"].items()} if (folder / MANIFEST).exists() else {}
    return [(f, made.get(f.name)) for f in sorted(folder.glob("table_*_verdicts.csv"), key=lambda f: (made.get(f.name, ""), f.name))]

def published_minutes(folder: Path, step: str) -> float | None:
    "The minutes `step` took in the book published in `folder` (its `table_book_times.csv`); None where it has no row."
    import pandas as pd
    csv = Path(folder) / "table_book_times.csv"
    df = pd.read_csv(csv).set_index("step") if csv.exists() else None
    return float(df.loc[step, "minutes"]) if df is not None and step in df.index else None

def _part(f: Path) -> str:
    "The part of its chapter a verdicts table is about: table_glied_table4_verdicts.csv: 'Table 4'; '' for the chapter's own."
    return f.stem.removeprefix("table_").removesuffix("_verdicts").partition("_")[2].replace("table", "Table ")

def verdict_lines(folder: Path) -> str:
    "The README's verdicts: for each tables chapter, from its published `table_*_verdicts.csv`, the claims that hold, those that do not, and how many the seeds cannot tell (Holm's correction per chapter noted)."
    import pandas as pd
    out = []
    for f, step in verdict_tables(folder):
        df = pd.read_csv(f)
        cav = df["caveat"].astype(object).fillna("") if "caveat" in df else pd.Series([""] * len(df))
        by = lambda v, df=df.assign(caveat=cav): [f"{c}{' (survives Holm)' if h == 'survives' else ''}{f' ({k})' if k else ''}" for c, h, k in
                                                  df.loc[df["verdict"] == v, ["claim", "Holm", "caveat"]].itertuples(index=False)]
        cannot, none = df["verdict"].str.startswith("cannot tell").sum(), df["verdict"].str.contains("no verdict").sum()
        kept = df["verdict"].str.startswith("kept its start").sum()
        parts = [f"**holds**: {', '.join(by('holds'))}" if by("holds") else "",
                 f"**does not hold**: {', '.join(by('does not hold'))}" if by("does not hold") else "",
                 f"cannot tell: {cannot}" if cannot else "", f"no verdict (one seed): {none}" if none else "",
                 f"stage kept its start (no test): {kept}" if kept else ""]
        nb, part = step or f.stem, _part(f)
        what = f" ({part})" if part else ""
        out.append(f"- [`{nb}`]({nb}.ipynb){what}, {len(df)} claims: " + "; ".join(p for p in parts if p) + ".")
    if not out: return "*No tables chapter of this book has published its verdicts yet.*"
    return ("\"survives Holm\": the verdict stands after Holm's correction over its chapter's distinct tests.\n\n"
            + "\n".join(out))

def findings(folder: Path) -> dict[str, tuple[str, Path | None]]:
    "What each chapter found, for the top of its page and its reader's copy (`capbook.docs.findings_cells`, `with_findings`): a tables chapter's claims with their verdicts, one line each, from the `table_*_verdicts.csv` it published, and the first figure its chapter declares (`Chapter.figures`); a chapter run's scores among the book's rows (`run_summary`)."
    import pandas as pd
    from capbook.docs import FOUND
    folder = Path(folder)
    lines: dict[str, list[str]] = {}
    given = lambda x: x is not None and x == x                  # a cell the table fills (an empty CSV cell reads as NaN)
    for f, step in verdict_tables(folder):
        if step is None: continue
        part = _part(f)
        for r in pd.read_csv(f).to_dict("records"):
            p = f"p {r['p']:.2g}" if isinstance(r["p"], float) and r["p"] == r["p"] else ""
            if p and r["verdict"] in ("holds", "does not hold"):   # Holm named only where it bears on the reading
                p += "; survives Holm's correction" if r["Holm"] == "survives" else "; not after Holm's correction over the chapter"
            if p and r["verdict"] == "cannot tell" and given(could := r.get("could see (80 % power)")):
                share = r.get("could see (% of second row)")
                p += (f"; it could have seen a difference of {could:.1f} or more" + (f" ({share:.1f} % of the second row's score)" if given(share) else "")
                      if could != float("inf") else f"; no difference was within reach of {r.get('seeds', 'its')} seeds")   # what the seeds could have told (capbook.claims.book_reach)
                if given(paper := r.get("paper's difference (%)")):   # beside the paper's own (capbook.claims.within_reach)
                    p += (f"; the paper's difference, {paper:+.1f} % of its second row's, was "
                          + ("within" if r.get("paper's within reach") == "yes" else "out of") + " reach")
            claim = re.sub(r"([*_\[\]`])", r"\\\1", r["claim"])      # as written: Soft-Attention* is no emphasis
            claim = f"{part}: {claim}" if part else re.sub(r"^([+-])", r"\\\1", claim)   # "+ local" is no list
            lines.setdefault(step, []).append(f"- {claim}: **{r['verdict']}**" + (f" ({p})" if p else ""))
    out = {}
    for nb, ls in lines.items():
        ch = next((c for name, c in chapters().items() if name[:2] == nb[:2]), None)    # 03a_spca_tables: 03_spca's
        fig = folder / ch.figures[0] if ch is not None and ch.figures else None
        words = "".join(ls)
        terms = [SAY_SCST] * ("SCST" in words or "self-critical" in words) + [SAY_SEMANTIC]   # every tables chapter shows semantic F1
        out[nb] = (FOUND + "Each claim as this chapter tested it, over the training seeds and the test images (the rule: "
                   "[the training protocol](02b_protocol.ipynb)); the tables below give the numbers.\n\n" + "\n".join(ls)
                   + "\n\n" + " ".join([SAY_VERDICTS, *terms]), fig)
    return out | {nb: (md, None) for nb in chapters() if (md := run_summary(folder, nb))}

RAN = "**What this run scored.**\n\n"      # the head of a chapter run's page: its scores among the book's rows

def run_summary(folder: Path, notebook: str, metric: str = "CIDEr") -> str | None:
    "What a chapter's page opens with: the test `metric` of the run it shows (the book's run of the chapter's first row, from its record published in `folder`) among the book's rows of the chapter that differ from it in one parameter (`capbook.runner.beside`), as a table; None where the book published no such run."
    from capbook.profiles import chapter, read_params
    from capbook.records import MANIFEST, RECORDS, read_record
    from capbook.runner import beside
    folder = Path(folder)
    profile = load_json(folder / MANIFEST).get("profile") if (folder / MANIFEST).exists() else None
    if profile is None or not (f := folder / RECORDS / f"{notebook}.json.gz").exists(): return None
    rec, ch = read_record(f), chapter(notebook)
    p = ch.resolve(read_params(ch.params, rec["params"]))
    rows = beside(notebook, p, rec, metric, published=folder)   # the published seeds: a seed run here since is not the page's
    if not rows: return None
    cell = lambda r: (f"{r['mean']:.1f} [{r['lo']:.1f}, {r['hi']:.1f}]" if r["lo"] is not None else f"{r['mean']:.1f}")
    table = ["| row | how it differs | seeds | test " + metric + ", mean [95 % interval] | seeds' range | this run |", "|---|---|---:|---|---|---|"]
    esc = lambda t: t.replace("|", "\\|")                  # S||C is a structure, not two columns
    table += [f"| {esc(r['row'])} | {esc(r['differs']) or 'the same parameters'} | {len(r['seeds'])} | {cell(r)} | "
              f"{r['seeds'].min():.1f}–{r['seeds'].max():.1f} | {r['where']} |" for r in rows]
    return (RAN + f"This page is the book's run of the chapter's first row (seed {p.seed}): test {metric} {100 * rec['metrics'][metric]:.1f} "
            f"(×100, beam {p.beam_size}). Beside it, the book's rows of this chapter that differ from it in one parameter, each over "
            "its seeds (the mean's interval: t over the seeds):\n\n" + "\n".join(table))

SAY_VERDICTS = ("*holds*: the difference is above zero beyond what the seeds could give by chance — its 95 % interval above "
            "zero, and its p (never below that of the sign tests over the seeds) under the bound of the sequential design's "
            "look; *does not hold*: the same, below zero; *cannot tell*: neither, a difference these seeds cannot resolve "
            "(below six seeds a side, none can). Holm's correction asks more of each verdict the more claims a chapter tests: "
            "a verdict that does not survive it may be one of the chance findings among many.")
SAY_SCST = "SCST: self-critical training on CIDEr-D, the model's greedy caption (or its other samples) as the baseline."
SAY_SEMANTIC = "Semantic F1: the objects, attributes, counts and relations a caption states, checked against the image."

def _timed_on(folder: Path) -> str:
    "The machine that measured most of the published time table's minutes (its `machine` column), else the one its `Machine:` line names, else what the book says of it where there is no table."
    import pandas as pd
    csv, md = Path(folder) / "table_book_times.csv", Path(folder) / "table_book_times.md"
    df = pd.read_csv(csv) if csv.exists() else None
    if df is not None and "machine" in df and df["machine"].notna().any():
        return str(df.dropna(subset=["machine"]).groupby("machine")["minutes"].sum().idxmax())
    m = re.search(r"^Machines?: (.+?) \(", md.read_text(), re.M) if md.exists() else None
    return m.group(1) if m else "a 2-core CPU"

EXAMPLE = ("03_spca", {"kernel": 5})   # the README's one chapter run with other parameters: SPCA with 5×5 kernels

def one_chapter(folder: Path) -> str:
    "The README's one-chapter example (`EXAMPLE`): its papermill command; from the published `table_book_times.csv`, the minutes the book's run of the same parameters took and on what machine; from `bench_reader.json` (`capbook bench --reader --profile smoke`), the minutes the same command took at the smoke profile from a fresh clone."
    nb, params = EXAMPLE
    plain = f"papermill nbs/{nb}.ipynb out.ipynb " + " ".join(f"-p {k} {v}" for k, v in params.items())
    cmd = f"`.venv/bin/{plain}`"
    step = next((s.name for s in plan("default") if s.notebook == nb and s.params == {"profile": "default", **params}), None)
    minutes = published_minutes(folder, step) if step else None
    smoke = load_json(f) if (f := Path(folder) / "bench_reader.json").exists() else None
    took = lambda s: f"{s / 60:.0f} minutes" if s >= 90 else f"{s:.0f} seconds"
    toy = (f"; with `-p profile smoke`, toy-sized numbers in {took(smoke['wall_s'])} from a fresh clone on {smoke['machine']}"
           if smoke and smoke["profile"] == "smoke" and smoke["command"] == f"{plain} -p profile smoke" else "")
    if minutes is None: return f"One chapter with other parameters: {cmd}" + (f" ({toy[2:]})." if toy else ".")
    return (f"One chapter with other parameters: {cmd} (the book's `{step}`: {minutes:.0f} minutes on "
            f"{_timed_on(folder)}, two runs side by side{toy}).")

def book_time(folder: Path) -> str:
    "The default book's measured time, from its published `table_book_times.csv`: run-minutes one after another, and what that is at `-j 2`, on the machine its table names."
    import pandas as pd
    csv = Path(folder) / "table_book_times.csv"
    if not csv.exists(): return "**Time.** The default book has not been timed yet."
    df = pd.read_csv(csv).set_index("step")
    total, steps = df.loc["total (one after another)", "minutes"], [s.name for s in plan("default")]
    left = [s for s in steps if s not in df.index]
    which = "every seed" if not left else f"the {len(steps) - len(left)} of its {len(steps)} steps timed so far"
    return (f"**Time.** The default book, {which}: {total / 60:.1f} hours of runs one after another, about "
            f"{total / 120:.1f} hours of `make book` (two runs side by side) on the machine that timed most of it ({_timed_on(folder)}; "
            "`figures/table_book_times.md`, step by step); not yet timed on a GPU.")

_BLOCK = re.compile(r"<!-- (\w+) -->\n.*?<!-- /\1 -->", re.S)

def fill_blocks(md: str, blocks: dict[str, str]) -> str:
    "Put each generated block between its `<!-- name -->` and `<!-- /name -->` markers in `md` (what is there is replaced); unknown names stay as they are."
    return _BLOCK.sub(lambda m: f"<!-- {m.group(1)} -->\n{blocks[m.group(1)]}\n<!-- /{m.group(1)} -->" if m.group(1) in blocks else m.group(0), md)

FIGURE = ("fig_sat_figure3.png", "Where soft and hard attention look, word by word, on one test image (Show, Attend and Tell's Figure 3, regenerated)")

def index_blocks(folder: Path, status: dict[str, bool] | None, site: bool = False) -> dict[str, str]:
    "The generated parts of the README and the site's first page, from the published book in `folder` (where part of it is not made yet, a sentence saying so); `site`: the figure inline, as the site shows every figure (`capbook.docs.figure_html`: at its size, with its caption, the page's full width)."
    from capbook.docs import figure_html
    folder = Path(folder)
    def block(make):                                  # a part of the book not yet made: one sentence instead
        try: return make()
        except CapbookError as e: return f"*Not in this book yet: {e}.*"
    fig = folder / FIGURE[0]
    if not site: figure = f"![Figure 3, regenerated](figures/{FIGURE[0]})\n\n*{FIGURE[1]}.*"
    else: figure = f'<div class="full-width">{figure_html(base64.b64encode(fig.read_bytes()).decode(), FIGURE[1] + ".")}</div>' if fig.exists() else ""
    return {"chapters": chapter_table(status), "results": block(lambda: results_table(folder)), "verdicts": verdict_lines(folder),
            "booktime": book_time(folder), "onechapter": one_chapter(folder), "headline": headline(folder), "figure": figure}

def headline(folder: Path) -> str:
    "What the book found, in one sentence for the first screen, from every `table_*_verdicts.csv` it published: its distinct tests (a comparison claimed in two chapters is one test, `capbook.claims.test_id`), how many the seeds confirm, refute or cannot tell, and how many of those verdicts survive Holm's correction in their chapter and over the whole book (`table_*_book_family.csv`)."
    import pandas as pd
    tables = [pd.read_csv(f) for f, _ in verdict_tables(folder)]
    v = pd.concat(tables) if tables else pd.DataFrame({"verdict": pd.Series([], dtype=str)})
    if not len(v): return "*No chapter has tested its paper's claims yet.*"
    if "test" not in v: v["test"] = None
    tested = v[v["test"].notna()]
    distinct = tested.groupby("test").agg(verdict=("verdict", "first"), Holm=("Holm", lambda h: bool((h == "survives").any())))
    n = lambda pre: sum(str(x).startswith(pre) for x in distinct["verdict"])
    one, kept = int(v["verdict"].str.contains("one seed").sum()), int(v["verdict"].str.startswith("kept its start").sum())
    rest = [f"{one} with one seed"] * bool(one) + [f"{kept} a stage that kept its start"] * bool(kept)
    fam = sorted(Path(folder).glob("table_*_book_family.csv"))
    book = int((pd.read_csv(fam[0])["Holm over the book"] == "survives").sum()) if fam else None
    again = len(tested) - len(distinct)
    return (f"**What it found:** {len(distinct)} distinct tests of the papers' claims"
            + (f" ({again} claimed in two chapters, counted once)" if again else "")
            + f": the seeds confirm {n('holds')}, refute {n('does not hold')}, cannot tell {n('cannot tell')}"
            + (f" (untested: {', '.join(rest)})" if rest else "")
            + f"; {(h := sum(bool(x) for x in distinct['Holm']))} survive{'s' * (h == 1)} Holm's correction in {'its' if h == 1 else 'their'} chapter"
            + (f", {book} over the whole book" if book is not None else "") + ". Each is listed below.")

def readme_text(status: dict[str, bool] | None, folder: Path | None = None) -> str:
    "README.md: the index notebook's text, its generated blocks filled from the published book (`figures/`), its links to other notebooks pointing at their executed copies (`figures/notebooks/`: a code host shows their tables and figures; the sources in `nbs/` have no outputs), or into `nbs/` where the book has none."
    import nbformat
    root = nbs_dir().parent
    folder = Path(folder or root / "figures")
    kept = folder / "notebooks"
    where = (kept.resolve().relative_to(root.resolve()).as_posix() if kept.resolve().is_relative_to(root.resolve()) else None)
    link = lambda m: f"]({where if where and (kept / m.group(1)).exists() else 'nbs'}/{m.group(1)}"
    nb = nbformat.read(nbs_dir() / "index.ipynb", as_version=4)
    md = "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    md = re.sub(r"\]\((?![a-z]+:|#|/)([\w./-]+\.ipynb)", link, fill_blocks(md, index_blocks(folder, status)))
    return md + "\n"

def readme_status(path: Path | None = None) -> dict[str, bool] | None:
    "The chapters' status as the README states it (its chapter table's last column), or None where it states none."
    path = path or nbs_dir().parent / "README.md"
    rows = re.findall(r"^\| \[`(\w+)`\].*\| (current|\*\*not yet regenerated\*\*) \|$", path.read_text() if path.exists() else "", re.M)
    return {nb: s == "current" for nb, s in rows} or None

def sync_readme(path: Path | None = None, write: bool = True, status: dict[str, bool] | None = None) -> bool:
    "Rewrite README.md from the index notebook and the published book (`status`: the chapters' currency, default what the README states); whether it changed."
    path = path or nbs_dir().parent / "README.md"
    old = path.read_text() if path.exists() else ""
    new = readme_text(status if status is not None else readme_status(path))
    if write and new != old: atomic_write(path, lambda t: t.write_text(new))
    return new != old

# %%
import capbook.book as _book                               # the installed module (a notebook has no __file__)
_md = "a\n<!-- results -->\nold\n<!-- /results -->\nb <!-- other -->"
assert fill_blocks(_md, {"results": "new"}) == "a\n<!-- results -->\nnew\n<!-- /results -->\nb <!-- other -->"
assert chapter_status([{"step": "03_spca-base-seed1", "status": "current"}, {"step": "03_spca", "status": "stale"},
                       {"step": "02a_soft_vs_hard", "status": "current"}, {"step": None, "status": "unknown"}]) == {"03_spca": False, "02a_soft_vs_hard": True}
print("\n".join(_book.chapter_table({"02_show_attend_tell": True}).splitlines()[:4]))      # the installed module's notebooks

# %% [markdown]
# ## Running the plan
#
# Each step is executed by papermill into `runs/<profile>/<step>/<notebook>.ipynb` (runnable notebooks also get that
# folder as `run_dir`). A step is skipped when its folder holds a `done.json` whose key matches: a hash of the notebook
# source, the parameters, the package code, **the content of the inputs the run reads** (`capbook.prepare.inputs_digest`:
# the dataset file, every image, the ground truth, a weights file) and, for a chapter's assembly notebooks (`02a_...`,
# `03a_...`), the keys of the chapter's runs before them, whose records they tabulate, and of the runs of the chapters
# it is compared with (`Chapter.compares`: the transformer's tables read Show-Attend-Tell's runs). An unchanged run is not redone;
# a run whose data changed on disk, or whose chapter's runs were redone, is. The first failure stops the book with one
# line naming the notebook and the cell. Then the tables and figures of every run are published to the
# profile's output folder (`figures/` for the default profile; a smoke run never touches it), with the reader's copy of
# each executed notebook (`figures/notebooks/`, images as files in `img/`; see `capbook.copies.keep_notebooks`), and the
# docs site is built from those copies — the same build a fresh clone runs with `capbook docs`, without training.
#
# **Side by side.** `capbook book -j 2` runs up to two notebooks at once: a chapter's training runs read no other run,
# so any two can run together, and an assembly notebook starts as soon as the runs it tabulates are done. Each kernel
# gets its share of the cores (`OMP_NUM_THREADS` = cores / jobs). On the 2-core CPU one thread trains Show-Attend-Tell
# at 73 % of two threads' speed (339 vs 466 captions/s in `capbook bench`), and the Java evaluation and Python overhead
# of one run overlap with the other's training, so two 1-thread runs finish the book sooner than one 2-thread run at a
# time. A run's numbers depend on its thread count in the last bits only (float sums in another order): a model trained
# under `-j 2` and one under `-j 1` agree to about 1e-5 in their parameters, not bit for bit; the record keeps
# `threads`. Data that runs share — the prepared features, the attribute detector — is built by one process while
# the others wait (`capbook.core.one_at_a_time`). If a run fails, the runs under way finish, no new one starts, and the
# book stops with the failure's line; so does a run whose process dies (killed for memory).
#
# **Faults** (each tested in `tests/test_book.py`, README's "what survives what"). *Killed at any moment*, even by
# SIGKILL: the workers and their kernels end with the book (`_worker_init`); every file is written beside its target
# and renamed into place when complete (`capbook.core.atomic_write`, and `temp_dir` for folders: a shapes data set, the
# reader's copies, the site), a killed writer's temporaries swept by the next writer; the next book skips the finished
# steps and resumes the interrupted runs from their checkpoints, and ends with the same tables and figures, bit for bit,
# as an uninterrupted book under the same `-j`. *A kernel killed* (the out-of-memory killer's way): one line naming
# the step, the other steps under way finish, the next book runs the rest. *The shared METEOR process killed*: a
# run's score goes through a fresh one, the same score; METEOR failing outright stops the run in one line — no table is
# silently without METEOR when Java is there. *Two books on one home and profile*: the second stops at once in one line
# naming the first (`book_lock`, a file lock the kernel releases even when its holder is SIGKILLed); books of two
# profiles, or on two homes sharing `CAPBOOK_DATA`, run side by side, their shared data built by one at a time. *A full
# or read-only disk*: one line naming the path; the published tables, the reader's copies and the site are replaced
# only by complete new versions. *A signal of its own* (SIGTERM, SIGHUP: a `timeout`, a closed login shell): the book
# ends as on Ctrl-C, its workers at once (`_local_pool`), in one line (`ended_by_signals`). *Two processes on one run
# folder*: the second stops in one line naming the first (`capbook.core.one_writer`, held by `run_step` on the step's
# folder and by training on its checkpoint folder). *A dry run* (`--dry-run`) lists the steps that would run
# (`would_run`) and runs nothing.
#
# **One kernel per worker, reset between notebooks.** A fresh kernel for each of the book's 55 notebooks cost a kernel
# start and the imports of torch and capbook every time — about 3 s, a third of a smoke run's time. Each process that
# runs notebooks now keeps its kernel (`warm_kernel`) and, before the next notebook, resets it to a fresh kernel's state
# (`_RESET`: IPython's own reset of the namespace, input history and execution counter; the environment and working
# folder as the kernel started with; figures closed; torch's generator at its start-up seed; capbook itself unloaded,
# so the next notebook imports it afresh: a chapter notebook's exported cells register its models and chapter again,
# in the kernel's namespace, and a registry left pointing there would break once that namespace is cleared). What
# stays is what a notebook cannot see: torch, numpy, pandas and matplotlib imported, and their caches. A kernel is reused only if it was started with the same
# environment, folder and package code (a change to any starts a new one); a notebook that fails, or a kernel that
# cannot be reset, is not reused. The executed copies are those of fresh kernels: counts from 1, the same outputs —
# `tests/test_book.py` runs a chapter in a used kernel and in a fresh one and compares its record.
#
# **Where the time goes.** Every training run's record splits its time into phases — `data` (preparing or loading
# features, the attribute detector), `train` (optimisation steps, cross-entropy and self-critical), `val` (the
# validation decode and scores after each epoch), `test` (beam search over the test split and every metric,
# pycocoevalcap's Java tools included), `measure` (the chapter's own extra measurements) and `figure` (the run's
# attention figure) — and `publish` writes `table_book_times` beside the other tables: each step's minutes as it last
# ran, those phases, and the rest (kernel start, imports, the notebook's own tables, figures and bootstrap intervals).
# Its last row sums the steps one after another; under `-j 2` the wall time is about half of it.

# %%
#| export
@lru_cache(None)
def kernel_manager():
    "Papermill's kernel manager with the kernel on local IPC sockets in Jupyter's runtime folder instead of TCP ports: nothing listens on the network, side-by-side runs cannot race for a port, and the kernel has no plain-TCP warning to print. A finished notebook's kernel is shut down without the interrupt that precedes it."
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.paths import jupyter_runtime_dir
    from traitlets import default

    class IPCKernelManager(AsyncKernelManager):
        @default("transport")
        def _transport_default(self): return "ipc"
        @default("ip")                            # the sockets' path prefix (files <ip>-<n>, removed at shutdown)
        def _ip_default(self):
            d = jupyter_runtime_dir()
            if len(d) > 80: d = tempfile.mkdtemp(prefix="capbook-")     # a socket's path has at most 107 bytes
            os.makedirs(d, mode=0o700, exist_ok=True)
            return os.path.join(d, f"capbook-{uuid.uuid4().hex[:12]}")

        async def _async_interrupt_kernel(self):  # jupyter_client interrupts before every shutdown, and a kernel caught
            if not self.shutting_down:            # mid-message logs an ERROR; papermill shuts down only finished notebooks
                await super()._async_interrupt_kernel()
    return IPCKernelManager

_WARM: dict = {}        # this process's kernel, reused by the notebooks it runs: {"km": manager, "key": what it was started with}

# Run in the kernel before each notebook: the state a fresh kernel would have, without importing torch again. The environment and working folder as at the kernel's start, no figure open, torch's generator at its
# start-up seed (c10's default, 67280421310721; Python's and numpy's generators start from the OS's entropy anyway),
# then IPython's own reset: every name the last notebook defined, its input history (which `read_params` reads) and
# the execution counter (so the executed copy counts from 1). The one thing added to the environment is the step's key
# (`capbook.train.STEP_KEY`): a training run of the step keeps it in its checkpoint, and an unfinished run resumes under
# the same key, whatever else in the package changed since (`00i_train`, Checkpoints and exact resume). Last, once torch
# is in, what is alive after the collection (the libraries' own objects, a quarter of a million: torch, matplotlib,
# pandas) is set aside from the garbage collector (`gc.freeze`), so that each later reset's two full collections (IPython's
# and this one) walk only what notebooks made since: about 0.13 s a collection on this class of CPU, twice a notebook.
_RESET = """\
import gc, os, sys
sys.__dict__.setdefault("_capbook_env", dict(os.environ))
os.environ.clear(); os.environ.update(sys._capbook_env); os.environ.update({env!r}); os.chdir({cwd!r})
if "matplotlib.pyplot" in sys.modules: sys.modules["matplotlib.pyplot"].close("all")
if "torch" in sys.modules: sys.modules["torch"].manual_seed(67280421310721)
for m in [m for m in sys.modules if m == "capbook" or m.startswith("capbook.")]: del sys.modules[m]
get_ipython().reset(new_session=True)
__import__("gc").collect()                                # (the reset removed this cell's own names)
if "torch" in __import__("sys").modules and not hasattr(__import__("sys"), "_capbook_frozen"):
    __import__("gc").freeze(); __import__("sys")._capbook_frozen = True
"""

def _shutdown_warm() -> None:
    "Stop this process's reused kernel, if any."
    from jupyter_core.utils import run_sync
    km = _WARM.pop("km", None); _WARM.pop("key", None)
    if km is not None and km.has_kernel:
        try: run_sync(km.shutdown_kernel)(now=True)
        except Exception: pass                      # already gone (killed): nothing to stop

def warm_kernel(cwd: Path, step_key: str | None = None, training_key: str | None = None):
    "This process's kernel for the next notebook: the one the last notebook ran in, reset to a fresh kernel's state, if it is alive and was started with the same environment, folder and package code; else a new one. A kernel start and the import of torch are then paid once per process instead of once per notebook. `step_key`: the key of the book step it will run, and `training_key` its training key, set in its environment (`STEP_KEY`, `TRAINING_KEY`)."
    from jupyter_client import BlockingKernelClient
    from jupyter_core.utils import run_sync
    key = stable_hash({"env": dict(os.environ), "cwd": str(cwd), "code": package_hash()}, 16)
    km = _WARM.get("km")
    if km is not None and (_WARM.get("key") != key or not run_sync(km.is_alive)()): _shutdown_warm(); km = None
    if fresh := km is None:
        km = kernel_manager()(kernel_name="python3")
        run_sync(km.start_kernel)(cwd=str(cwd))
        if not _WARM.get("exit_hook"): atexit.register(_shutdown_warm); _WARM["exit_hook"] = True
        _WARM.update(km=km, key=key)
    kc = BlockingKernelClient()
    kc.load_connection_info(km.get_connection_info()); kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        env = {k: v for k, v in ((STEP_KEY, step_key), (TRAINING_KEY, training_key)) if v}
        reply = kc.execute_interactive(_RESET.format(cwd=str(cwd), env=env), timeout=120, output_hook=lambda msg: None)
    except (RuntimeError, TimeoutError): reply = None
    finally: kc.stop_channels()
    if not reply or reply["content"]["status"] != "ok":            # a kernel that cannot be reset is not reused ...
        _shutdown_warm()
        if fresh:                                                 # ... and a fresh one that cannot is no kernel to run in
            why = f"{reply['content'].get('ename')}: {reply['content'].get('evalue')}" if reply else "no answer"
            raise CapbookError(f"a fresh Jupyter kernel could not be prepared for a notebook ({why})")
        return warm_kernel(cwd, step_key, training_key)
    return km

def _published(f: Path) -> bool:
    "Whether a file of a run folder is one the book publishes: a figure (`.png`) or a table (`table_*.md`, `table_*.csv`)."
    return f.suffix == ".png" or (f.name.startswith("table_") and f.suffix in (".md", ".csv"))

def unchanged(step: Step, profile: str, key: str) -> Path | None:
    "The executed notebook of `step` if its last execution finished under `key` (its results are current); where the step has no run here at all, what the checkout's published book keeps of it if that book made it under `key` (`published_stand_in`); else None."
    d = runs_dir() / profile / step.name
    out, done = d / f"{step.notebook}.ipynb", d / "done.json"
    if done.exists():
        made = load_json(done)
        if made.get("bare"): out = d / "record.json"           # run without a notebook (`run_bare`): its record
        return out if out.exists() and made.get("key") == key else None
    return None if (d / "record.json").exists() else published_stand_in(step, profile, key)

def published_stand_in(step: Step, profile: str, key: str) -> Path | None:
    "What stands in for a step that has no run folder: its reader's copy (a tagged run: its record) in the book the checkout ships, where that book made it under `key` and keeps every file it made as it made it (the manifest's hashes; a chapter run's record among them); else None. Only the checkout's own book stands in (`figures/`, the default profile's): a clone has it without the runs, and it is what the currency test holds current; a profile published inside its run folders has none (a run folder deleted beside its published copy was deleted to be made again), but for a device book's runs made on another machine (`receive_device_book`: its manifest says it was received), which have no run folder here at all."
    from capbook.records import MANIFEST, RECORDS
    from capbook.results import encoder_weights, file_sha
    folder = out_dir(profile)
    if not (folder / MANIFEST).exists(): return None
    m = load_json(folder / MANIFEST, "published book's manifest")
    if folder.is_relative_to(runs_dir()) and not m.get("received"): return None
    if m.get("steps", {}).get(step.name) != key or m.get("encoder") != encoder_weights(profile, 0): return None
    made = [f for f, e in m.get("files", {}).items() if e["step"] == step.name]
    if not all((folder / f).is_file() and file_sha(folder / f) == m["files"][f]["sha256"] for f in made): return None
    record, copy = f"{RECORDS}/{step.name}.json.gz", f"notebooks/{step.notebook}.ipynb"
    if step.params and step.notebook in chapters() and record not in made: return None   # the tables chapters read it
    return folder / (copy if copy in made else record if record in made else MANIFEST)

def skipped_line(step: Step, kept: Path) -> str:
    "The book's line for a step `unchanged` found current: run here, or stood in for by the published book."
    return f"  {step.name}: unchanged, skipped" + ("" if kept.is_relative_to(runs_dir()) else " (no run here: the published book's results stand in)")

class _BookSetParameters(logging.Filter):
    "Papermill's warning about a parameter its notebook's cell does not list, where the book sets it (`capbook.profiles.BOOK_SET`)."
    def filter(self, record):
        from capbook.profiles import BOOK_SET
        return not re.fullmatch(rf"Passed unknown parameter: ({'|'.join(BOOK_SET)})", record.getMessage())

def _keys_or_kept(step: Step, profile: str, force: bool, log, key: str | None, training_key: str | None) -> tuple[str, str | None, Path | None]:
    "A step's key and training key (computed here where the book handed none: `Keys.get`, `Keys.resuming`) and, unless `force`, what keeps its results where they are current (`unchanged`; said on the log), else None."
    if key is None: K = plan_keys(profile); key, training_key = K.get(step), K.resuming(step)
    kept = None if force else unchanged(step, profile, key)
    if kept: log(skipped_line(step, kept))
    return key, training_key, kept

@contextlib.contextmanager
def _writing(d: Path):
    "Within the block, run folder `d` is this process's alone (`one_writer`: a second process on the step stops in one line), its last execution's `done.json`, figures and tables removed first: this one draws its own or none."
    d.mkdir(parents=True, exist_ok=True)
    with one_writer(d, "book step"):
        (d / "done.json").unlink(missing_ok=True)
        for f in filter(_published, d.glob("*")): f.unlink()
        yield

def run_step(step: Step, profile: str, force: bool = False, log=print, key: str | None = None,
             training_key: str | None = None, bare: bool = False) -> tuple[Path, bool]:
    "Execute one plan step with papermill unless its results are current (its `key`, `capbook.results.Keys`, computed before it runs: an edit during the run is not credited to it; `training_key`, its training key, under which its runs also resume, then its training keys at the ladder's lower rungs: `Keys.resuming`); return (executed notebook path, whether it ran). `bare`: a chapter step's run without papermill or a kernel (`run_bare`)."
    if bare: return run_bare(step, profile, force, log, key, training_key)
    import papermill as pm
    pm_log = logging.getLogger("papermill")
    if not any(isinstance(f, _BookSetParameters) for f in pm_log.filters): pm_log.addFilter(_BookSetParameters())
    src = nbs_dir() / f"{step.notebook}.ipynb"
    if not src.exists(): raise CapbookError(f"{src}: notebook of the plan not found")
    d = runs_dir() / profile / step.name
    out, done = d / f"{step.notebook}.ipynb", d / "done.json"
    key, training_key, kept = _keys_or_kept(step, profile, force, log, key, training_key)
    if kept: return kept, False
    with _writing(d):
        params = {**step.params, "run_dir": str(d)} if step.params else {}
        os.environ.setdefault("TQDM_DISABLE", "1")  # this worker's kernels: no library's bar in the executed notebooks and the site
        os.environ.setdefault(IN_BOOK, "1")         # ... and no run's lines on the book's terminal: its step lines say where it is
        t0 = time.time()
        try:
            pm.execute_notebook(str(src), str(out), parameters=params, cwd=str(src.parent), progress_bar=False,
                                kernel_name="python3", kernel_manager_class=kernel_manager(), km=warm_kernel(src.parent, key, training_key))
        except pm.PapermillExecutionError as e:
            _shutdown_warm()                          # a failed notebook's kernel is not reused
            raise CapbookError(f"notebook {src.name} failed in cell {e.cell_index} (execution count {e.exec_count}): "
                               f"{e.ename}: {str(e.evalue).splitlines()[0] if e.evalue else ''} — executed copy: {out}") from None
        except OSError as e:                          # the environment (a full disk) while papermill writes the executed copy
            _shutdown_warm(); out.unlink(missing_ok=True)   # its copy is cut short: no half-written notebook stays
            raise io_error(e.filename or out, e) from None
        except BaseException:
            _shutdown_warm(); raise
        save_json(done, {"key": key, "seconds": time.time() - t0, "machine": cpu_name()})   # the time table names the machine of each step's minutes
        log(f"  {step.name}: ran in {time.time() - t0:.1f} s")
        return out, True

def run_bare(step: Step, profile: str, force: bool = False, log=print, key: str | None = None,
             training_key: str | None = None) -> tuple[Path, bool]:
    "Run a chapter step as its notebook's run does (`capbook.runner.run_chapter`: training, evaluation, measurements, figure, record) in this process, without papermill or a kernel — a machine that has torch and not Jupyter (a GPU lent bare): its lines in the run folder's `run.log`, `done.json` marked bare, and no executed notebook (`unchanged` reads its record instead). Returns (its record, whether it ran)."
    from capbook.runner import run_chapter
    if step.notebook not in chapters(): raise CapbookError(f"{step.name}: a bare book runs chapter steps alone; run its tables chapters with papermill")
    d = runs_dir() / profile / step.name
    key, training_key, kept = _keys_or_kept(step, profile, force, log, key, training_key)
    if kept: return kept, False
    os.environ.setdefault("TQDM_DISABLE", "1"); os.environ.setdefault(IN_BOOK, "1")   # as a book's kernel: no bars, lines to the log
    with _writing(d):
        t0 = time.time()
        with environment({STEP_KEY: key, TRAINING_KEY: training_key or key}), open(d / "run.log", "w") as fh, contextlib.redirect_stdout(fh):
            run_chapter(step.notebook, {**step.params, "run_dir": str(d)}, log=lambda line: (fh.write(line + "\n"), fh.flush()))   # (what its measurements print: there too)
        save_json(d / "done.json", {"key": key, "seconds": time.time() - t0, "machine": cpu_name(), "bare": True})
        log(f"  {step.name}: ran bare in {time.time() - t0:.1f} s")
        return d / "record.json", True

def publish_bare(profile: str, steps: list[Step]) -> Path:
    "Publish what a bare book (`run_bare`) made: the record of each of `steps` that finished here, with its test captions and the files its tables read (`capbook.records.publish_records`: a few hundred kB a run), and the manifest's entries for them, in the profile's output folder, the manifest naming the scorer its keys were computed with (the shared probe's hash: a machine without Java scores without METEOR, `receive_device_book`); the reader's copies and tables wait for a machine with Jupyter. That folder alone is what a bare book's machine must give back."
    from capbook.records import publish_records
    from capbook.results import write_manifest
    dst = out_dir(profile); dst.mkdir(parents=True, exist_ok=True)
    done = {s.name: f for s in steps if (f := runs_dir() / profile / s.name / "done.json").exists()}
    made = publish_records(profile, [s for s in steps if s.name in done], dst)
    write_manifest(dst, profile, made, {n: load_json(f)["key"] for n, f in done.items()}, partial=True,
                   extra={"scorer": plan_keys(profile, made=False).shared("scorer")})
    return dst

def stamp_training_keys(profile: str = "default", log=print) -> list[Path]:
    "Write today's training key (`capbook.results.Keys.training`) into the last checkpoints of every chapter run current under today's key whose checkpoints were written under that key before checkpoints kept a training key: they were trained as it says, so a later change to the statistics or the drawing resumes them instead of training them again. Returns the checkpoints stamped."
    from capbook.core import load_torch, save_torch
    K, out = plan_keys(profile), []
    for s in K.steps:
        d = runs_dir() / profile / s.name
        if s.notebook not in chapters() or not (d / "done.json").exists() or load_json(d / "done.json").get("key") != K.get(s): continue
        for last in sorted(d.glob("ckpt*/last.pt")):
            if not (last.parent.name == "ckpt" or last.parent.name.startswith("ckpt-")): continue    # not a folder moved aside
            ck = load_torch(last)
            if ck.get("step_key") != K.get(s) or ck.get("training_key") == K.training(s): continue
            save_torch(last, {**ck, "training_key": K.training(s)}); out.append(last)
    log(f"{len(out)} checkpoints stamped with their step's training key")
    return out

def stamp_first_stage_keys(profile: str = "default", log=print) -> list[Path]:
    "Write each '+ SCST' chapter run's first-stage key (`capbook.results.Keys.first_stage`) into its finished cross-entropy checkpoint where that checkpoint was written under one of the step's training keys of today (`Keys.resuming`: at its budget or a rung below) before checkpoints kept a first-stage key: it was trained as today's cross-entropy stage, so a later change to self-critical training alone leaves it finished. Returns the checkpoints stamped."
    from capbook.core import load_torch, save_torch
    K, out = plan_keys(profile), []
    for s in K.steps:
        last = runs_dir() / profile / s.name / "ckpt" / "last.pt"
        if s.notebook not in chapters() or not last.exists() or not (first := K.first_stage(s)): continue
        ck = load_torch(last)
        if not ck.get("finished") or ck.get("first_stage_key") == first: continue
        if ck.get("training_key") not in K.trainings(s): continue
        save_torch(last, {**ck, "first_stage_key": first}); out.append(last)
    log(f"{len(out)} cross-entropy checkpoints stamped with their first-stage key")
    return out

PHASES = ("data_s", "train_s", "val_s", "test_s", "measure_s", "figure_s")   # a training run's phases (its record's timings)

def book_times(profile: str, steps: list[Step], published: Path | None = None):
    "Where the book's time went: each step's notebook minutes (as it last ran), split into the phases its training run recorded; the rest is the notebook's own cells (tables, figures, intervals) and kernel start. `published`: a book's time table (its CSV) whose rows stand for the steps that have not run here (a partial book on a fresh clone keeps the other steps' minutes)."
    import pandas as pd
    rows, kept, before = [], {}, None
    if published is not None and Path(published).exists():
        kept = {r["step"]: r for r in pd.read_csv(published).to_dict("records")}
        before = _timed_on(Path(published).parent)     # a table from before the machine column: the machine its line named
    for s in steps:
        d = runs_dir() / profile / s.name
        if not (d / "done.json").exists():
            if s.name in kept:
                r = kept[s.name]
                rows.append({**r, "machine": r["machine"] if isinstance(r.get("machine"), str) else before})
            continue
        done = load_json(d / "done.json")
        total = done["seconds"]
        rec = load_json(d / "record.json") if s.params and (d / "record.json").exists() else {}
        # the machine whose minutes these are: as the step's run wrote it, else its record's, else (a run from before
        # either kept one) the machine the published table named
        machine = done.get("machine") or rec.get("machine", {}).get("cpu") or before or cpu_name()
        t = rec.get("timings", {})
        ph = {k[:-2]: t.get(k, 0.0) / 60 for k in PHASES}
        # the self-critical stages' training and validation minutes (inside train and val): what each SCST row costs
        scst = sum(v.get("train_s", 0.0) + v.get("val_s", 0.0) for k, v in rec.get("stages", {}).items() if k != "xe") / 60
        # a run stopped and resumed from its checkpoint: its execution's minutes are the last process's, its training
        # and validation minutes every process's; the step costs at least those (the time of a killed process is not its)
        # (in minutes, so that where the phases are the whole, the rest is exactly 0, not a rounding's −1e-14)
        minutes = max(total / 60, sum(ph.values()))
        rows.append({"step": s.name, "minutes": minutes, **ph, "rest": minutes - sum(ph.values()),
                     "of it self-critical": scst, "captions / s": t.get("train_captions_per_s"), "machine": machine})
    df = pd.DataFrame(rows)
    if "of it self-critical" in df: df["of it self-critical"] = df["of it self-critical"].fillna(0.0)   # rows kept from a table without it
    if len(df): df = pd.concat([df, pd.DataFrame([{"step": "total (one after another)", **df.drop(columns=["step", "captions / s", "machine"]).sum()}])],
                               ignore_index=True)
    return df

def machines_line(times) -> str:
    "The time table's last line: the machine its minutes were measured on, or each machine with its share where steps last ran on several."
    by = times.dropna(subset=["machine"]).groupby("machine")["minutes"].agg(["sum", "count"]).sort_values("sum", ascending=False)
    if len(by) <= 1:
        return f"Machine: {by.index[0] if len(by) else cpu_name()} (each step's minutes are as it last ran)."
    return ("Machines: " + "; ".join(f"{m} ({r['sum']:,.1f} minutes, {int(r['count'])} step{'s' * (int(r['count']) != 1)})" for m, r in by.iterrows())
            + ". Each step's minutes are as it last ran, on the machine its row names.")

def publish(profile: str, steps: list[Step], partial: bool = False) -> Path:
    "Copy the tables (`table_*.md`, `table_*.csv`) and figures (`*.png`) of every untagged run to the profile's output folder, keep the reader's copies of the executed notebooks in its `notebooks/`, and write the book's manifest (`capbook.results.write_manifest`: which step made each file, and every step's key); `partial`: `steps` are part of the plan, the other chapters' copies and entries stay. A step with no finished run here (the published book stood in for it, `unchanged`) is left as published, as under `partial`."
    from capbook.copies import keep_notebooks
    from capbook.results import BOOK_STEP, write_manifest
    from capbook.records import publish_records
    dst = out_dir(profile); dst.mkdir(parents=True, exist_ok=True)
    here = [s for s in steps if (runs_dir() / profile / s.name / "done.json").exists()]
    stood_in = [f"notebooks/{s.notebook}.ipynb" for s in steps if s not in here and not s.tag]
    partial, steps = partial or len(here) < len(steps), here   # a step the published book stood in for keeps its files and entries
    untagged, made_by = [s for s in steps if not s.tag], {}    # ablation runs reach the book through assembly notebooks
    for s in untagged:
        for f in filter(_published, (runs_dir() / profile / s.name).glob("*")):
            atomic_write(dst / f.name, lambda t, f=f: shutil.copyfile(f, t))      # a full disk: the old copy stays, no half file
            made_by[f.name] = s.name
        if (runs_dir() / profile / s.name / f"{s.notebook}.ipynb").exists(): made_by[f"notebooks/{s.notebook}.ipynb"] = s.name
    keep_notebooks([f for s in untagged if (f := runs_dir() / profile / s.name / f"{s.notebook}.ipynb").exists()],   # (a bare run has none)
                   dst / "notebooks", replace=not partial)
    from capbook.viz import save_table
    times = book_times(profile, plan(profile), dst / "table_book_times.csv") if partial else book_times(profile, steps)   # partial: every step of the plan
    if len(times):
        md = save_table(times, dst / "table_book_times", floatfmt=".2f")
        atomic_write(dst / "table_book_times.md", lambda t: t.write_text(
            md + f"\n\n{machines_line(times)}\n"))
        made_by |= {"table_book_times.md": BOOK_STEP, "table_book_times.csv": BOOK_STEP}
    made_by |= publish_records(profile, steps, dst)   # every chapter run's record, tagged runs' too: what a fresh clone reassembles from
    done = {s.name: runs_dir() / profile / s.name / "done.json" for s in steps}
    write_manifest(dst, profile, made_by, {n: load_json(d)["key"] for n, d in done.items() if d.exists()}, partial=partial)
    retire(dst, {s.name for s in plan(profile)})
    refresh_copies(dst, stood_in)                     # a stood-in step's copy: its results current, its prose brought up to today's
    readers_copies(dst)
    return dst

def retire(folder: Path, steps: set[str]) -> list[str]:
    "Take out of the book in `folder` what steps no longer in its plan (`steps`: the plan's step names) published — their files and their manifest entries — so that a row the book no longer trains is not read as today's; returns the files removed."
    from capbook.records import MANIFEST
    from capbook.results import BOOK_STEP
    folder = Path(folder)
    if not (folder / MANIFEST).exists(): return []
    m = load_json(folder / MANIFEST)
    gone = sorted(f for f, e in m["files"].items() if e["step"] not in steps | {BOOK_STEP})
    if not gone and set(m["steps"]) <= steps: return []
    for f in gone: (folder / f).unlink(missing_ok=True)
    m["files"] = {f: e for f, e in m["files"].items() if f not in gone}
    m["steps"] = {s: k for s, k in m["steps"].items() if s in steps}
    save_json(folder / MANIFEST, m)
    return gone

def _rehash(folder: Path, rels: list[str]) -> None:
    "The manifest's hashes of the files `rels` (relative to `folder`) brought up to their content, after a rewrite that changes no result."
    from capbook.records import MANIFEST
    from capbook.results import file_sha
    if not rels or not (folder / MANIFEST).exists(): return
    m = load_json(folder / MANIFEST)
    m["files"] |= {rel: {**m["files"][rel], "sha256": file_sha(folder / rel)} for rel in rels if rel in m["files"]}
    save_json(folder / MANIFEST, m)

def rescore_meteor(folder: Path, log=print) -> list[str]:
    "METEOR, scored here, for every published record in `folder` whose run was scored where Java was not (a bare device book's on a lent GPU: its notes say METEOR was unavailable), from the test captions it kept (the final ones and each earlier stage's) against the test references; the record's notes say so, and the manifest's hashes follow. The other metrics are not scored again: on shapes a caption is lower-case words without punctuation, which the PTB tokenizer and whitespace splitting cut alike (checked: a record whose BLEU-4 or CIDEr scored here differs stops in one line). Returns the records rescored, relative to `folder`."
    from capbook.metrics import coco_scores
    from capbook.profiles import chapter
    from capbook.records import RECORDS, read_record, write_record
    from capbook.stages import chapter_data, pack_params
    folder, done, refs = Path(folder), [], {}
    for f in sorted((folder / RECORDS).glob("*.json.gz")):
        rec = read_record(f)
        if not str((rec.get("notes") or {}).get("METEOR", "")).startswith("unavailable"): continue   # scored where it ran, or here already
        p = pack_params(rec["notebook"], rec["params"])
        at = (p.dataset, p.profile, p.data_seed, p.data_path)
        if at not in refs:
            prep = chapter_data(chapter(rec["notebook"]), p, device="cpu")
            refs[at] = dict(zip(prep.test.keys, prep.test.refs))
        stages = rec.get("stages") or {}
        final = next((k for k, st in stages.items() if st.get("metrics") == rec["metrics"]), None)   # the stage whose captions are the final ones
        for w, tw in rec["test_words"].items():
            gts = {k: [" ".join(r) for r in refs[at][k]] for k in tw["keys"]}
            scores, _ = coco_scores(gts, {k: " ".join(x) for k, x in zip(tw["keys"], tw["words"])}, spice=False)
            targets = [rec["metrics"]] + ([stages[final]["metrics"]] if final else []) if w == "final" else [stages[w]["metrics"]]
            for m in targets:
                if any(abs(scores[k] - m[k]) > 1e-9 for k in ("BLEU-4", "CIDEr") if k in m):
                    raise CapbookError(f"{f}: its {w} captions score BLEU-4 {scores['BLEU-4']:.6f}, CIDEr {scores['CIDEr']:.6f} here, "
                                       f"not the record's {m.get('BLEU-4')}, {m.get('CIDEr')}: score the run again here")
                m["METEOR"] = scores["METEOR"]
        rec["notes"] = {**{k: v for k, v in rec["notes"].items() if k not in ("METEOR", "tokenizer")},
                        "METEOR": "scored after training on a machine with Java, from the test captions the record keeps; "
                                  "a stage's greedy decode has none (its captions are not kept)"}
        write_record(f, rec); done.append(f"{RECORDS}/{f.name}")
        log(f"  {f.name}: METEOR {100 * rec['metrics']['METEOR']:.1f} scored here")
    _rehash(folder, done)
    return done

def readers_copies(folder: Path) -> list[str]:
    "Make the reader's copies in `folder/notebooks` read as a reader opens them anywhere (GitHub, JupyterLab): each figure shown from `img/` (`capbook.copies.link_images`), paths shown as paths (`readable_outputs`), each tables chapter opening with what it found (`capbook.docs.with_findings`, from the verdicts it published: `findings`, the same text its page opens with). The manifest's hashes follow; returns the copies rewritten."
    import nbformat
    from capbook.copies import link_images, readable_outputs
    from capbook.docs import with_findings
    folder = Path(folder); kept = folder / "notebooks"
    found, done = findings(folder), []
    for f in sorted(kept.glob("*.ipynb")):
        old = nbformat.read(f, as_version=4)
        nb = readable_outputs(link_images(old))
        if f.stem in found: nb = with_findings(nb, *found[f.stem], kept / "img")
        if nb != old:
            atomic_write(f, lambda t, nb=nb: nbformat.write(nb, t)); done.append(f"notebooks/{f.name}")
    _rehash(folder, done)
    return done

def refresh_published(profile: str = "default", folder: Path | None = None) -> list[str]:
    "Bring every reader's copy in the book's folder whose step is current but that shows old prose or exported code up to today's notebook (`refresh_copy` on the copy itself, as publishing does on the executed notebook): a docstring or a paragraph republished without rerunning, where no run folder is at hand (a fresh clone). The manifest's hashes follow; returns the refreshed files."
    from capbook.results import current
    folder = Path(folder or out_dir(profile))
    todo = refresh_copies(folder, [r["file"] for r in current(profile, folder) if r["status"] == "shows old text"])
    return todo + [f for f in readers_copies(folder) if f not in todo]   # a refreshed tables chapter opens with its findings again

def refresh_copies(folder: Path, rels: list[str]) -> list[str]:
    "Of the reader's copies `rels` (relative to the book's `folder`), bring each that shows old prose or exported code (`capbook.copies.copy_current` is false) up to today's notebook (`refresh_copy`: its outputs, the results, stay); a copy not there is left alone. The manifest's hashes follow; returns the copies rewritten. Only for copies whose step is current: the caller says so (`publish`: the steps the published book stood in for, their keys today's)."
    import nbformat
    from capbook.copies import copy_current, reader_notebook, refresh_copy
    folder, done = Path(folder), []
    for rel in rels:
        f = folder / rel
        if not f.exists() or copy_current(f, nbs_dir() / f.name): continue
        nb = reader_notebook(refresh_copy(nbformat.read(f, as_version=4), nbs_dir() / f.name))
        atomic_write(f, lambda t, nb=nb: nbformat.write(nb, t)); done.append(rel)
    _rehash(folder, done)
    return done

STALE_NOTE = ("```{note}\n**Not yet regenerated by today's code.** This page and its tables come from an earlier version of "
              "capbook, whose runs today's code would train differently; its numbers will change when the chapter is "
              "regenerated. The chapter table on the first page says which chapters are current.\n```")

def build_docs(profile: str = "default", log=print) -> Path:
    "Build the docs site from the kept notebooks of the last book at `profile` (no training, no network); return its index page."
    from capbook.docs import build_site
    check_profile(profile)
    kept, rank = out_dir(profile) / "notebooks", {nb: i for i, nb in enumerate(notebooks())}
    pages = sorted((p for p in kept.glob("*.ipynb") if p.stem in rank), key=lambda p: rank[p.stem])
    if not pages: raise CapbookError(f"{kept}: no kept notebooks of a {profile} book; run `capbook book --profile {profile}` first")
    t0 = time.time()
    notes, status = {}, None
    if profile == "default":                      # the published book, regenerated in turns: say which pages today's code did not make
        from capbook.results import current
        rows = current(profile)
        old = {Path(r["file"]).stem for r in rows if r["file"].startswith("notebooks/") and r["status"] != "current"}
        notes, status = {nb: STALE_NOTE for nb in old}, chapter_status(rows)
    blocks = index_blocks(out_dir(profile), status, site=True)
    site = build_site(pages, runs_dir() / profile / "site", title="capbook", api_modules=api_modules(), notes=notes,
                      fill=lambda md: fill_blocks(md, blocks), findings=findings(out_dir(profile)))
    ch = sum(not p.stem.startswith(("00", "index")) for p in pages)   # the README's chapters; the rest: the index and the engine
    n = lambda k, what: f"{k} {what}{'s' * (k != 1)}"
    log(f"docs site of {n(len(pages), 'page')} ({n(ch, 'chapter')}, {len(pages) - ch - (kept / 'index.ipynb' in pages)} on the engine) -> {site} ({time.time() - t0:.0f} s)")
    return site

def _threads(jobs: int) -> int:
    "Intra-op threads for each of `jobs` side-by-side runs: the cores shared out, at least one."
    return max(1, (os.cpu_count() or 1) // jobs)

def _worker_init(book_pid: int) -> None:
    "A book worker ends with its book: Linux sends it SIGTERM when the book's process dies, even by SIGKILL (PR_SET_PDEATHSIG), and SIGTERM ends it at once; its kernel, which watches its parent, follows within a second."
    import ctypes, signal
    signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
    try: ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))      # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError): pass                                   # not Linux: a worker may outlive a killed book
    if os.getppid() != book_pid: os._exit(128 + signal.SIGTERM)              # the book died before the line above

def _step_failure(e: BaseException) -> str:
    "What stopped a step, besides a failing cell (CapbookError) and a dead worker: a dead kernel, the environment, or else the exception's first line."
    if type(e).__name__ == "DeadKernelError":    # nbclient's: the notebook's kernel process ended mid-cell
        return "its notebook's kernel died (out of memory, or killed)"
    if isinstance(e, OSError): return str(os_error_line(e)).removesuffix("; nothing already written was changed")
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"

@contextlib.contextmanager
def _local_pool(jobs: int):
    "The local book's pool of `jobs` worker processes; the book ended by a signal of its own (SIGTERM, SIGHUP: not its terminal's Ctrl-C, which reaches the workers too) ends its workers at once instead of waiting for their steps, and their kernels follow them."
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp
    pool = ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=(os.getpid(),))
    try: yield pool
    except BaseException:
        for p in list((getattr(pool, "_processes", None) or {}).values()): p.terminate()
        pool.shutdown(wait=True, cancel_futures=True); raise
    pool.shutdown(wait=True)

def weights_to_make(profile: str, steps: list[Step], keyring, force: bool = False) -> list[Step]:
    "The runs whose trained weights a step of `steps` that will run (not `unchanged`, or `force`) loads (`capbook.plan.weights_read`) and that have no checkpoint here: a clone's published book stands in for their records, not their weights. The book trains them again, under their own keys, before the steps that load them."
    from capbook.train import best_checkpoint
    out = []
    for s in steps:
        lacking = [u for u in weights_read(s, keyring.steps)
                   if not best_checkpoint(runs_dir() / profile / u.name).exists() and u not in out]
        if lacking and (force or not unchanged(s, profile, keyring.get(s))): out += lacking
    return out

def would_run(profile: str, steps: list[Step], keyring, ups: dict, force: bool, log=print, pool=None, again: frozenset = frozenset()) -> dict:
    "A dry run: each step, in the plan's order, that the book would run (not `unchanged`, or downstream of one that runs, or in `again`: trained again for its weights, `weights_to_make`), and with a SLURM `pool` its job's sbatch script; nothing runs or is submitted. Returns {} (no notebook executed)."
    runs = []
    for s in steps:
        after = [u for u in ups[s.name] if u in runs]
        if not force and not after and s.name not in again and (kept := unchanged(s, profile, keyring.get(s))): log(skipped_line(s, kept)); continue
        runs.append(s.name)
        log(f"  {s.name}: would run" + (" again (its trained weights are not here; a notebook after it loads them)" if s.name in again else "")
            + (f" (after {', '.join(after)})" if after else "") + (
            "; its job would be submitted with this script:\n" + "\n".join(f"    {l}" for l in pool.script(s.name).splitlines()) if pool else ""))
    log(f"dry run: {len(runs)} of {len(steps)} steps would run; nothing was " + ("submitted" if pool else "run"))
    return {}

# %% [markdown]
# ### The device book: a row's seeds as one stacked model
#
# `capbook book --device cuda` is the book on a GPU. Its runs are not the CPU book's (another device, another order of
# arithmetic, and the keyed draws that stacked runs need: `capbook.stacked`), so it lives in a home of its own
# (`device_home`: `runs/device-cuda/`, with its own runs, tables, figures and site, reading this home's data), and every
# chapter step carries the device and `draws='keyed'` in its parameters (`capbook.plan.device_params`): its keys are its
# own, and nothing of the CPU book is read as its or overwritten. On a GPU the book's small models are launch-bound, so
# the seeds of a row (the steps of one `Keys.row`: notebook and parameters, the seed aside) train their cross-entropy
# stages as one stacked model first (`Pack`, `run_pack`: `capbook.stages.fit_pack`), each into its own run folder under
# its step's keys; then each seed's notebook runs as in any book and finds its cross-entropy checkpoint finished.
# Self-critical stages, and chapters whose per-image inputs depend on the seed (GLIED's attributes), train alone, side
# by side (`-j`). `--device cpu` runs the same path on the CPU (in float32, the stacked step's arithmetic there), which
# is how it is tested: a packed row's records equal those of its runs trained alone.
#
# A GPU may be lent with torch and nothing of Jupyter. `--bare` runs the chapter steps there as their notebooks' runs do
# (`run_bare`: `capbook.runner.run_chapter`, the function every chapter notebook calls, in the worker itself), writes
# their run folders and records, and stops before the tables chapters and the reader's copies, which the same device
# book then makes where Jupyter is, from those run folders (a bare step is `unchanged` by its record).
#
# A lent machine keeps nothing: what comes back from it is `publish_bare`'s folder, the runs' records (their test
# captions and maps among them) and its manifest, packed into parts by `tools/gpu_book.py`. Here, `capbook book --device
# cuda --received gpu_book-*.tar.gz` takes them into the device book's home (`receive_device_book`: each record
# checked against the manifest's hash, and the manifest's encoder against this home's), scores METEOR with this
# machine's Java where the lent one had none (`rescore_meteor`), and runs the tables chapters whose every run came back
# (`received_tables`: a chapter run stands in by its record, `published_stand_in`, when the record was made under the
# key this machine computes for it; the others wait, named). The keys need no GPU: a step's key is its parameters and
# the fingerprints of its code computed on the CPU (`capbook.results`), so this machine computes the key the lent one
# trained under. Last, `device_verdicts` sets each claim's verdict in the device book beside the CPU book's.

# %%
#| export
@dataclasses.dataclass(frozen=True)
class Pack:
    "A device book's row of seeds (two or more chapter steps of one `capbook.results.Keys.row`) whose cross-entropy stages train as one stacked model before their notebooks run (`capbook.stages.fit_pack`)."
    notebook: str
    members: tuple[Step, ...]

    @property
    def name(self) -> str: return f"pack {self.members[0].name}"

def device_packs(profile: str, steps: list[Step], keyring, force: bool = False) -> list[Pack]:
    "A device book's packs among `steps`: the chapter steps that will run (not `unchanged`, unless `force`) and have no checkpoint yet (a run begun alone goes on alone), grouped by row (`Keys.row`: notebook and parameters, the seed aside), two or more a pack; a chapter whose per-image inputs depend on the seed (GLIED's attributes) trains its runs alone."
    from capbook.results import Keys
    chs, rows = chapters(), {}
    for s in steps:
        ch = chs.get(s.notebook)
        if ch is None or ch.inputs or (not force and unchanged(s, profile, keyring.get(s))): continue
        if (runs_dir() / profile / s.name / "ckpt" / "last.pt").exists(): continue
        rows.setdefault(Keys.row(s), []).append(s)
    return [Pack(ms[0].notebook, tuple(ms)) for ms in rows.values() if len(ms) > 1]

def run_pack(pack: Pack, profile: str, keys: list[tuple[str, str]], log=print) -> tuple[Path, bool]:
    "Train a device book's `pack` (`capbook.stages.fit_pack`): each member's cross-entropy stage into its run folder under its step's keys (`keys`: each member's key and training keys, `Keys.get` and `Keys.resuming`), its lines in `runs/<profile>/packs/<first member>.log`. Returns (that log, True)."
    from capbook.stages import fit_pack
    d = runs_dir() / profile
    runs = [({**m.params, "run_dir": str(d / m.name)}, d / m.name, {STEP_KEY: k, TRAINING_KEY: t}) for m, (k, t) in zip(pack.members, keys)]
    out = d / "packs" / f"{pack.members[0].name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(out, "w") as fh:
        fit_pack(pack.notebook, runs, log=lambda line: (fh.write(line + "\n"), fh.flush()))
    log(f"  {pack.name}: {len(runs)} runs' cross-entropy stages trained stacked in {time.time() - t0:.1f} s ({out})")
    return out, True

EXECUTORS = ("local", "slurm")     # where the book's steps run: processes on this machine, or jobs on a SLURM cluster (capbook.cluster)

def run_plan(profile: str, steps: list[Step], force: bool = False, jobs: int = 1, log=print, executor: str = "local",
             executor_config: str | Path | None = None, dry_run: bool = False, bare: bool = False) -> dict[str, Path]:
    "Run the plan's steps, up to `jobs` at a time, each as soon as the runs it tabulates are done (a run whose trained weights a step loads and that has none here, `weights_to_make`, is trained again first, and what tabulates it runs again after it); return the executed notebooks by step name. A failure lets the steps under way finish (nothing computed is lost), starts no new one, and stops with the first failure's line. `executor`: 'local' (a pool of processes here) or 'slurm' (each step a job, `capbook.cluster.SlurmPool`, its resources from `executor_config`)."
    from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, wait
    check_choice("executor", executor, EXECUTORS)
    procs = None                                  # a step's training processes: this machine's setting (`train_procs`) ...
    if executor == "slurm":
        from capbook.cluster import SlurmPool, executor_config as read_config
        config = read_config(executor_config, profile)
        procs = lambda s: max(1, config.resources(s.name).gpus)   # ... or its job's GPUs
    keyring = plan_keys(profile, procs=procs)     # the keys over the whole plan: a run's upstream outside `steps` counts as it was made
    retrain = weights_to_make(profile, steps, keyring, force)   # runs whose weights a step loads, their checkpoints not here
    steps = [s for s in keyring.steps if s in retrain and s not in steps] + steps
    named = {t.name for t in steps}
    ups = {s.name: list(dict.fromkeys(u.name for u in upstream_of(s, keyring.steps) + weights_read(s, retrain) if u.name in named))
           for s in steps}
    again = frozenset(s.name for s in retrain)
    rerun = lambda s: force or s.name in again or bool(again.intersection(ups[s.name]))   # trained again, or tabulates one that is: what it reads moves
    packs = device_packs(profile, steps, keyring, force) if device_params() and executor == "local" else []
    for pk in packs:                              # a device book's packs: their members' notebooks wait for the stacked training
        ups[pk.name] = []
        for m in pk.members: ups[m.name].append(pk.name)
    keys, outs, failed, waiting, running = {}, {}, None, [*packs, *steps], {}
    def ready() -> list[Step]:                    # the steps whose upstream is done; none after a failure
        return [s for s in waiting if all(u in keys for u in ups[s.name])] if failed is None else []
    if executor == "slurm":
        pool_cm = SlurmPool(profile, config, runs_dir() / profile / "slurm", run_step, force, log=log)
        submit = lambda pool, s: pool.submit_step(s, keyring.get(s), keyring.resuming(s), rerun(s))
        adopt = lambda pool: pool.adopt({s.name: keyring.get(s) for s in steps})   # the jobs a killed book left: waited for, not duplicated
    else:
        pool_cm = _local_pool(jobs)
        submit = lambda pool, s: (pool.submit(run_pack, s, profile, [(keyring.get(m), keyring.resuming(m)) for m in s.members])
                                  if isinstance(s, Pack) else pool.submit(run_step, s, profile, rerun(s), print, keyring.get(s), keyring.resuming(s), bare))
        adopt = lambda pool: None
    if dry_run:
        for pk in packs: log(f"  {pk.name}: would train {', '.join(m.name for m in pk.members)} stacked (their cross-entropy stages)")
        return would_run(profile, steps, keyring, ups, force, log, pool_cm if executor == "slurm" else None, again)
    threads = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if jobs > 1 and executor == "local":          # each kernel inherits its share of the cores (a job: its own CPUs)
        for k in threads: os.environ[k] = str(_threads(jobs))
    try:
        with pool_cm as pool, progress(total=len(steps), desc="book", unit="notebook", mininterval=1) as bar:
            adopt(pool)
            while waiting or running:
                while skip := [(s, kept) for s in ready() if isinstance(s, Step) and not rerun(s) and (kept := unchanged(s, profile, keyring.get(s)))]:
                    for s, kept in skip:              # unchanged: skipped here, no worker starts for it
                        waiting.remove(s); outs[s.name], keys[s.name] = kept, True
                        log(skipped_line(s, kept)); bar.update(1)
                for s in ready()[:jobs - len(running)]:
                    waiting.remove(s)
                    try: running[submit(pool, s)] = s
                    except CapbookError as e: failed = failed or e           # a job the scheduler refused
                if not running: break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    s = running.pop(f)
                    try: out = f.result()[0]
                    except CapbookError as e: failed = failed or e; continue
                    except BrokenExecutor:                # a worker killed (out of memory, a signal): its step did not finish
                        failed = failed or CapbookError(f"{s.name}: the process running it died (out of memory or killed); "
                                                        f"the runs finished so far are kept: run the book again to go on")
                        continue
                    except Exception as e:                # its kernel died (out of memory, a signal), or the environment failed it
                        failed = failed or CapbookError(f"{s.name}: {_step_failure(e)}; the runs finished so far are kept: "
                                                        f"run the book again to go on")
                        continue
                    keys[s.name] = True
                    if isinstance(s, Step): outs[s.name] = out; bar.update(1)
                bar.set_postfix_str(", ".join(r.name for r in running.values()), refresh=False)   # the steps under way
    finally:
        for k, v in threads.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
    if failed is not None: raise failed
    return outs

def select_steps(steps: list[Step], only: list[str]) -> list[Step]:
    "The steps whose name or notebook matches one of the shell-style patterns `only` (`03_spca` is the chapter's every run, `02_show_attend_tell-hard*` the hard rows and their seeds); a pattern after `=` matches step names alone (`=03_spca`: the chapter's first run, whose name is its notebook's, and no other); a pattern matching nothing stops in one line."
    import fnmatch
    hit = lambda s, pat: (fnmatch.fnmatchcase(s.name, pat[1:]) if pat.startswith("=") else
                          fnmatch.fnmatchcase(s.name, pat) or fnmatch.fnmatchcase(s.notebook, pat))
    for pat in only:
        if not any(hit(s, pat) for s in steps):
            raise CapbookError(f"parameter only={pat!r} matches no step of the plan: give a notebook (e.g. 03_spca), "
                               f"a step name (e.g. 03_spca-base-seed1), a pattern (e.g. '03_spca-base*') or '=' and a step "
                               f"name for that run alone (e.g. =03_spca)")
    return [s for s in steps if any(hit(s, pat) for pat in only)]

def book_lock(profile: str):
    "Hold the book of `profile` in this home for one process (`capbook.core.one_writer` on `runs/<profile>/.book.lock`, released when the process ends, even by SIGKILL): a second book on the same home and profile stops in one line naming the first."
    d = runs_dir() / profile
    return one_writer(d, "capbook book", d / ".book.lock", "another capbook book is running on this home and profile ({who}); "
                      "wait for it to finish, or give this one another CAPBOOK_HOME")

class Ended(KeyboardInterrupt):
    "The book ended by a signal of its own, SIGTERM or SIGHUP (a `timeout`, a closed login shell, its own job cancelled): as Ctrl-C, what finished is kept and its workers or jobs end with it."
    def __init__(self, signum: int):
        import signal
        super().__init__(signal.Signals(signum).name); self.signum = signum

@contextlib.contextmanager
def ended_by_signals():
    "Within the block, SIGTERM and SIGHUP raise `Ended` (once: a second signal while the book ends is ignored), so that the book's pool cancels its jobs or ends its workers on the way out (`SlurmPool.__exit__`, `_local_pool`); the handlers there were come back after. In the main thread only (elsewhere signals cannot be caught)."
    import signal, threading
    if threading.current_thread() is not threading.main_thread(): yield; return
    seen = []
    def handler(signum, frame):
        if not seen: seen.append(signum); raise Ended(signum)
    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try: yield
    finally:
        for sig, h in before.items(): signal.signal(sig, h)

def device_home(device: str) -> Path:
    "Where a device book (`capbook book --device`) lives: a home of its own inside this one's `runs/` (its runs, tables, figures and site), reading this home's data."
    return runs_dir() / f"device-{re.sub(r'[^a-z0-9]', '', device.lower())}"

@contextlib.contextmanager
def device_book(device: str | None, here: bool = True):
    "Inside the block the book is the device book of `device` (None: the CPU book, nothing changes): its home (`device_home`), this home's data, and every chapter run on `device` with the keyed draws stacked runs draw (`capbook.plan.device_params`); the processes it starts inherit it. `here`: the device must be this machine's (not so for a book whose runs another machine trained, `receive_device_book`)."
    from capbook.core import data_dir, get_device
    from capbook.plan import DEVICE_BOOK
    if device is None: yield; return
    if here: get_device(device)                   # a device this machine does not have stops here, in one line
    if os.environ.get(DEVICE_BOOK): raise CapbookError("parameter device: this book is already a device book")
    with environment({"CAPBOOK_HOME": str(device_home(device)), "CAPBOOK_DATA": str(data_dir()), DEVICE_BOOK: device}): yield

def _received_files(sources: list, into: Path) -> None:
    "Gather what a bare device book's machine gave back (`sources`: `publish_bare`'s folder, or the tar.gz parts `tools/gpu_book.py` packs it into) in the empty folder `into`, each file checked to be the manifest or a record (a member outside them, a link, a missing source: one line naming it)."
    import tarfile
    from capbook.records import MANIFEST, RECORDS
    def take(rel: str, where: str, data) -> None:       # `where` names the file for the one line; `data()` reads it
        if rel != MANIFEST and re.fullmatch(rf"{RECORDS}/[\w.+-]+\.json\.gz", rel) is None:
            raise CapbookError(f"{where} not what a device book gives back (its {MANIFEST} and {RECORDS}/*.json.gz)")
        (into / rel).parent.mkdir(parents=True, exist_ok=True); (into / rel).write_bytes(data())
    for src in map(Path, sources):
        if src.is_dir():
            for f in sorted(p for p in src.rglob("*") if p.is_file()): take(f.relative_to(src).as_posix(), f"{f}:", f.read_bytes)
            continue
        try:
            with tarfile.open(src, "r:gz") as tar:
                for m in (m for m in tar.getmembers() if not m.isdir()):
                    take(m.name if m.isfile() else f"{m.name} (a link)", f"{src}: its member {m.name!r} is", lambda m=m: tar.extractfile(m).read())
        except (OSError, tarfile.TarError, EOFError) as e:
            raise CapbookError(f"{src}: not a readable part of a device book ({e.__class__.__name__}: {e}); copy it back again") from None

def receive_device_book(device: str, sources: list, profile: str = "default", log=print) -> list[str]:
    "Take into this machine's device book (inside `device_book(device)`: its home here) what a bare device book's machine gave back (`sources`: `publish_bare`'s folder, or the gpu_book-N.tar.gz parts of it): its records, each checked against the manifest that came with them (its hash: a part cut short or altered on the way stops in one line before anything is taken; the encoder weights: this home's), beside the records taken before (a step taken again: its newest), their manifest entries merged; then METEOR scored here for the records a machine without Java scored (`rescore_meteor`). Returns the records taken, relative to the book's folder."
    from capbook.records import MANIFEST, RECORDS
    from capbook.results import encoder_weights, file_sha, write_manifest
    if not sources: raise CapbookError("parameter received: name the parts a device book gave back (gpu_book-N.tar.gz) or their folder")
    dst = out_dir(profile)
    with tempfile.TemporaryDirectory(prefix="received-") as tmp:
        tmp = Path(tmp)
        _received_files(sources, tmp)
        if not (tmp / MANIFEST).exists(): raise CapbookError(f"{', '.join(map(str, sources))}: no {MANIFEST} among them (its first part is missing?)")
        m = load_json(tmp / MANIFEST, "device book's manifest")
        if m.get("profile") != profile: raise CapbookError(f"{sources[0]}: a book of profile {m.get('profile')!r}, not {profile!r}: give --profile {m.get('profile')}")
        if m.get("encoder") != encoder_weights(profile, 0):
            raise CapbookError(f"{sources[0]}: trained on other encoder weights than this home's ({m.get('encoder')} there): its records cannot stand for this book's runs")
        got = sorted(f"{RECORDS}/{f.name}" for f in (tmp / RECORDS).glob("*.json.gz"))
        for rel in got:
            e = m.get("files", {}).get(rel)
            if e is None or e["sha256"] != file_sha(tmp / rel):
                raise CapbookError(f"{rel}: " + ("not in the manifest that came with it" if e is None else "its content is not what its manifest says (cut short or altered on the way)")
                                   + "; copy the parts back again")
        (dst / RECORDS).mkdir(parents=True, exist_ok=True)
        for rel in got: atomic_write(dst / rel, lambda t, rel=rel: shutil.copyfile(tmp / rel, t))
        made = {rel: m["files"][rel]["step"] for rel in got}
        keys = _keys_here(profile, {s: k for s, k in m.get("steps", {}).items() if s in set(made.values())}, m.get("scorer"), log)
        write_manifest(dst, profile, made, keys, partial=True, extra={"received": device})   # (its runs stand in: `published_stand_in`)
    log(f"{len(got)} records a device book gave back -> {dst / RECORDS}")
    rescore_meteor(dst, log)                      # (before any tables chapter reads them: `received_tables` runs after)
    return got

def _keys_here(profile: str, keys: dict[str, str], scorer: str | None, log=print) -> dict[str, str]:
    "The keys under which this machine takes runs another one made under `keys` {step: key}: a step's own key where it is the one computed here; where it is the key computed here with the other machine's scorer (`scorer`: the shared probe's hash there, a machine without Java scoring no METEOR, which `rescore_meteor` then scores here), the key computed here; else the key it came with (its code or arithmetic is not this machine's: it will not stand in, and the line says so)."
    K = plan_keys(profile, made=False)
    there = K.with_shared("scorer", scorer) if scorer else K    # the keys as computed with the other machine's scorer
    steps, out, other = {s.name: s for s in K.steps}, {}, []
    for name, k in keys.items():
        s = steps.get(name)
        if s is not None and (k == K.get(s) or k == there.get(s)): out[name] = K.get(s)   # the other scorer's key computed only where this one's differs
        else: out[name] = k; other.append(name)
    if other: log(f"{len(other)} of the runs given back were made under keys this machine does not compute for them "
                  f"(another version of capbook or torch there: {other[0]}, ...); they stand for nothing here")
    return out

def received_tables(profile: str, steps: list[Step], log=print) -> list[Step]:
    "Of `steps`, the tables chapters (the steps with runs to tabulate, `upstream_of`) of a device book whose runs another machine trained: those whose every chapter run is here (`unchanged`: its record received under today's key), each other one named with the runs it waits for."
    from capbook.records import MANIFEST
    keyring, out = plan_keys(profile), []
    got = load_json(out_dir(profile) / MANIFEST).get("steps", {}) if (out_dir(profile) / MANIFEST).exists() else {}
    for s in steps:
        ups = upstream_of(s, keyring.steps)
        if not ups: continue
        missing = [u.name for u in ups if u.name not in got or not unchanged(u, profile, keyring.get(u))]   # (a key computed only for a run given back)
        if missing: log(f"  {s.name}: waits for {len(missing)} of its {len(ups)} chapter runs (not given back, or under another key: {missing[0]}, ...)")
        else: out.append(s)
    return out

def device_verdicts(folder: Path, cpu: Path):
    "Each claim's verdict in the device book published in `folder` beside the CPU book's (in `cpu`), from their verdicts tables (`verdict_tables`): seeds, mean and verdict in each, and whether the verdicts are the same; written to `folder/table_device_verdicts` (.md, .csv). Returns the table (empty where no tables chapter ran)."
    import pandas as pd
    from capbook.viz import save_table
    rows = []
    for f, _ in verdict_tables(folder):
        dev = pd.read_csv(f)
        theirs = pd.read_csv(cpu / f.name).set_index("claim") if (cpu / f.name).exists() else pd.DataFrame()
        for _, r in dev.iterrows():
            c = theirs.loc[r["claim"]] if r["claim"] in theirs.index else None
            rows.append({"table": f.stem.removeprefix("table_").removesuffix("_verdicts"), "claim": r["claim"],
                         "CPU seeds": c["seeds"] if c is not None else "—", "CPU means": c["mean"] if c is not None else "—",
                         "CPU verdict": c["verdict"] if c is not None else "—",
                         "device seeds": r["seeds"], "device means": r["mean"], "device verdict": r["verdict"],
                         "same verdict": "—" if c is None else "yes" if c["verdict"] == r["verdict"] else "no"})
    t = pd.DataFrame(rows)
    if len(t): save_table(t, Path(folder) / "table_device_verdicts")
    return t

def run_book(profile: str = "default", force: bool = False, docs: bool = True, log=print, jobs: int | None = None,
             only: list[str] | None = None, executor: str = "local", executor_config: str | Path | None = None,
             dry_run: bool = False, device: str | None = None, bare: bool = False, received: list | None = None) -> dict:
    "Regenerate the book at `profile` (`device`: the device book of that device instead, `device_book`; `bare`: its chapter runs alone, without papermill or kernels, `run_bare`, publishing their records and no site; `received`: what a bare device book's machine gave back, taken in here, `receive_device_book`, and only the tables chapters run, on those records, `received_tables`); see `_run_book`."
    if device is not None and executor != "local":
        raise CapbookError(f"parameter device={device!r} is for the local executor: a device book packs its runs on this machine")
    if bare and executor != "local": raise CapbookError("parameter bare is for the local executor: a cluster's nodes run papermill")
    if received and (device is None or bare):
        raise CapbookError("parameter received: give it with --device (the device whose book it is) and without --bare")
    cpu_book = out_dir(profile)                   # (the CPU book's folder: a received book's verdicts are set beside its)
    with device_book(device, here=not received):
        if received and not dry_run: receive_device_book(device, received, profile, log)
        out = _run_book(profile, force, docs and not bare, log, jobs, only, executor, executor_config, dry_run, bare, bool(received))
        if received and out["out"] is not None:
            t = device_verdicts(out["out"], cpu_book)
            if len(t): log(f"its verdicts beside the CPU book's -> {out['out'] / 'table_device_verdicts.md'} "
                           f"({int(t['same verdict'].eq('yes').sum())} of {len(t)} the same)")
        return out

def _run_book(profile: str = "default", force: bool = False, docs: bool = True, log=print, jobs: int | None = None,
              only: list[str] | None = None, executor: str = "local", executor_config: str | Path | None = None,
              dry_run: bool = False, bare: bool = False, tables: bool = False) -> dict:
    "Regenerate the book at `profile`: run the plan (`jobs` notebooks side by side: default one here, every ready step at once on a cluster), publish tables and figures, build the docs site. `only`: just the steps these patterns select (`select_steps`); the runs their assembly notebooks read must exist, and the other chapters' published copies stay. `executor`: 'local' or 'slurm' (`run_plan`); the lock and the publishing stay on this machine either way. `dry_run`: say which steps would run (on SLURM, with each job's sbatch script) and run nothing (`would_run`). SIGTERM and SIGHUP end it as Ctrl-C does (`ended_by_signals`)."
    check_profile(profile)
    check_choice("executor", executor, EXECUTORS)
    if executor_config is not None and executor == "local":
        raise CapbookError("parameter executor_config is for --executor slurm: a local book runs on this machine's cores (-j)")
    t0, steps = time.time(), plan(profile)
    if only: steps = select_steps(steps, only)
    if bare: steps = [s for s in steps if s.notebook in chapters()]   # the chapter runs: the tables chapters run with papermill later
    if tables: steps = received_tables(profile, steps, log)           # a device book trained elsewhere: its tables chapters alone
    jobs = check_int("jobs", jobs, lo=1) if jobs is not None else (1 if executor == "local" else max(1, len(steps)))
    head = (f"capbook book --profile {profile} -j {jobs}" + (f" --executor {executor}" if executor != "local" else "")
            + f": {len(steps)} notebooks -> {runs_dir() / profile}")
    if dry_run:                                   # nothing written, nothing held: no lock
        log(head + " (dry run)"); run_plan(profile, steps, force, jobs, log, executor, executor_config, dry_run=True, bare=bare)
        return {"seconds": time.time() - t0, "site": None, "out": None}
    from capbook.metrics import meteor_service
    with book_lock(profile), ended_by_signals():  # one book at a time on a home and profile; its signals end it as Ctrl-C does
        log(head)
        shared = meteor_service() if executor == "local" else contextlib.nullcontext({"served": 0})   # a node cannot reach this machine's
        with shared as meteor:                    # one METEOR JVM for every run's scoring, not one per run
            run_plan(profile, steps, force, jobs, log, executor, executor_config, bare=bare)
        if meteor["served"]: log(f"one METEOR process scored {meteor['served']} runs")
        if bare:                                  # no Jupyter here for reader's copies: the runs' records, as a clone reads them
            dst = publish_bare(profile, steps)
            log(f"the chapter runs' records -> {dst} (their tables: `capbook book` where Jupyter is)")
            return {"seconds": time.time() - t0, "site": None, "out": dst}
        dst = publish(profile, steps, partial=bool(only) or tables)
        log(f"tables, figures and the reader's notebooks -> {dst}")
        site = build_docs(profile, log) if docs and not tables else None   # (a received book: its chapters' notebooks ran elsewhere)   # the site a clone builds: from the kept notebooks
    secs = time.time() - t0
    log(f"book regenerated in {secs:.0f} s")
    return {"seconds": secs, "site": site, "out": dst}

# %% [markdown]
# A step the plan no longer has (a row retired, a twin no longer needed) leaves the published book with its files:

# %%
with tempfile.TemporaryDirectory() as _t:
    _f = Path(_t); (_f / "records").mkdir(); (_f / "records" / "old.json.gz").write_text("x"); (_f / "t.csv").write_text("y")
    save_json(_f / "book.json", {"files": {"records/old.json.gz": {"step": "old"}, "t.csv": {"step": "kept"}}, "steps": {"old": "k1", "kept": "k2"}})
    assert retire(_f, {"kept"}) == ["records/old.json.gz"] and not (_f / "records" / "old.json.gz").exists()
    assert load_json(_f / "book.json") == {"files": {"t.csv": {"step": "kept"}}, "steps": {"kept": "k2"}} and retire(_f, {"kept"}) == []

# %% [markdown]
# One book at a time on a home and profile: a second `book_lock` (another book, or `capbook docs`) stops at once, in
# one line naming the holder; the lock goes with its holder, even a SIGKILLed one:

# %%
_old_home = os.environ.get("CAPBOOK_HOME")
with tempfile.TemporaryDirectory() as _h:
    os.environ["CAPBOOK_HOME"] = _h
    try:
        with book_lock("smoke"):
            try:
                with book_lock("smoke"): raise AssertionError("a second book got the lock")
            except CapbookError as e: print(e)
        with book_lock("smoke"): pass                          # released when the first ended
    finally:
        if _old_home is None: os.environ.pop("CAPBOOK_HOME")
        else: os.environ["CAPBOOK_HOME"] = _old_home

# %% [markdown]
# Each notebook's kernel listens on IPC sockets of its own, named in Jupyter's runtime folder (nothing is created until
# a kernel starts):

# %%
_km = kernel_manager()()
assert _km.transport == "ipc" and os.path.basename(_km.ip).startswith("capbook-") and _km.ip != kernel_manager()().ip

# %% [markdown]
# ## The reader's own papermill runs
#
# `papermill nbs/03_spca.ipynb out.ipynb -p kernel 5` starts its kernel through jupyter_client's default manager, on
# TCP ports, and ipykernel 7 prints a warning at each such start that the transport is unencrypted. Those kernels
# listen on the loopback interface of the reader's machine with every message signed; the book's own runs use IPC
# sockets (above). `make venv` writes an IPython kernel configuration into the environment (`<venv>/etc/ipython`, read
# by this environment's kernels only) that drops that one warning and leaves every other log line.

# %%
#| export
KERNEL_CONFIG = '''# Written by capbook (capbook.book.write_kernel_config, run by `make venv`). ipykernel >= 7 warns at each start that
# jupyter_client's default TCP transport is unencrypted; this environment's kernels listen on the loopback interface for
# papermill and JupyterLab on this machine, every message signed. That warning is dropped, nothing else.
import logging

class _LoopbackTCPWarning(logging.Filter):
    def filter(self, record): return "running over TCP without encryption" not in record.getMessage()

c.IPKernelApp.logging_config = {"filters": {"capbook_tcp": {"()": _LoopbackTCPWarning}},
                                "handlers": {"console": {"filters": ["capbook_tcp"]}}}
'''

def write_kernel_config(prefix: str | Path | None = None) -> Path:
    "Write `KERNEL_CONFIG` as `<prefix>/etc/ipython/ipython_kernel_config.py` (prefix: this environment's, `sys.prefix`)."
    from capbook.core import atomic_write
    path = Path(prefix or sys.prefix) / "etc" / "ipython" / "ipython_kernel_config.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda t: t.write_text(KERNEL_CONFIG))

# %%
_t = Path(tempfile.mkdtemp())
assert write_kernel_config(_t).read_text() == KERNEL_CONFIG
_ns = {"c": type("C", (), {"IPKernelApp": type("K", (), {})()})()}
exec(KERNEL_CONFIG, _ns)                                          # the file is valid Python that sets one option
import logging
_f = _ns["c"].IPKernelApp.logging_config["filters"]["capbook_tcp"]["()"]()
assert not _f.filter(logging.makeLogRecord({"msg": "Kernel is running over TCP without encryption. All ..."}))
assert _f.filter(logging.makeLogRecord({"msg": "any other warning"}))

# %% [markdown]
# ## The book's commands
#
# `make book` is `capbook book --profile default -j 2`: two notebooks side by side, each kernel on one core; a chapter's
# runs read no other run, and an assembly chapter starts once the runs it tabulates are done. What it writes:
#
# - `figures/`: the default profile's tables (`table_*.md`, `table_*.csv`) and figures (`*.png`); `figures/records/`,
#   every run's small results record (what a fresh clone reassembles the tables from); `figures/notebooks/`, the reader's
#   copy of every executed chapter (images as files in `img/`, named by content); `figures/book.json`, which step made
#   each file and under which key. A smoke book publishes to `runs/smoke/figures/` and never touches `figures/`.
# - `runs/<profile>/<step>/`: each executed notebook, its results record `record.json`, `params.yaml` and checkpoints;
#   `runs/<profile>/site/index.html`: the docs site (it works offline; `make docs` rebuilds it from `figures/notebooks/`).
#
# A step whose key is unchanged (`capbook.results`: its notebook's code, parameters, data and the numerical fingerprint
# of the code it runs) is skipped; `--force` reruns everything. `make book ONLY="03_spca 03a_spca_tables"` (`capbook
# book --only PATTERN...`) regenerates part of the book — a chapter's every run and seed, one step
# (`03_spca-base-seed1`; a chapter's first run, named as its notebook, alone: `=03_spca`) or a shell pattern
# (`'02_show_attend_tell-hard*'`) — and publishes only that part. Where the
# book's time goes, step by step, is `figures/table_book_times.md`. `capbook --help` lists the other commands:
# `caption`, `score`, `bench`, `train` (also under `torchrun` for DistributedDataParallel), `rehearse`, `params` and
# `readme`.
#
# ## What survives what
#
# Each row is a test in `tests/test_book.py` that injects the fault into a real smoke-profile book or run.
#
# | fault | what you see | what a rerun does | test |
# |---|---|---|---|
# | `capbook book -j 2` killed (even `kill -9`) at any moment: building data, training, scoring, publishing, building the site | nothing left running: its workers get SIGTERM from the kernel when the book dies, their notebook kernels follow; no half-written file (every write lands beside its target and is renamed into place) | skips the finished steps, resumes the interrupted runs from their checkpoints, and ends with the uninterrupted book's tables and figures, bit for bit | `test_a_killed_book_leaves_no_process_behind`, `test_a_book_killed_in_every_phase_ends_with_the_same_figures` (and, in `make soak`, `test_soak_a_whole_book_killed_at_random_moments_ends_with_the_same_figures`) |
# | `capbook book` ended by SIGTERM or SIGHUP (a `timeout`, a closed login shell, the book's own job cancelled) | one line, `ended by SIGHUP: what finished is kept; …`, exit status 128 + the signal; its workers and kernels end at once; on SLURM its jobs are cancelled, in one line naming them | as above | `test_a_killed_book_leaves_no_process_behind`, `test_slurm_job_requeued_resumes_and_cancelled_ends_the_book_in_one_line` |
# | a SLURM book killed outright (SIGKILL) while its jobs are queued | its jobs run on; `runs/<profile>/slurm/jobs.json` names them | waits for each recorded job still queued (`… is still RUNNING: this book waits for it instead of submitting the step again`), cancels those whose step changed | `test_slurm_book_finishes_what_is_unfinished_with_the_local_books_results` |
# | a second process on a run folder (a job a killed book left and its duplicate; a run started beside the book's) | the second stops at once in one line naming the first (`another book step is writing this folder (pid …, SLURM job …)`); the first goes on untouched | — | `test_slurm_book_finishes_what_is_unfinished_with_the_local_books_results` |
# | a SLURM job refused or stuck: an option sbatch does not know, resources no node has, a failed `setup:` line, no `SLURM_CONF`, no `sacct` | one line naming the cause (sbatch's own words folded in; SLURM's pending reason, the job cancelled; the log that holds the error) | completes once the config is fixed | `test_slurm_refusals_are_one_line_naming_their_cause` |
# | a notebook's kernel killed (as the out-of-memory killer does) | one line: `<step>: its notebook's kernel died (out of memory, or killed)`; the other steps under way finish | runs only the killed step | `test_a_killed_kernel_fails_its_step_in_one_line_and_the_rerun_completes` |
# | a step's worker process killed | one line naming the step; the steps under way finish | runs what did not finish | `test_a_dead_worker_stops_the_book_with_one_line` |
# | the shared METEOR (Java) process killed mid-book | nothing: the run scores through a fresh METEOR process, the same score | — | `test_a_killed_meteor_process_is_replaced_and_scores_stay_exact` |
# | METEOR cannot score at all (Java present) | the run stops in one line (`METEOR failed while scoring …`); no table is silently without METEOR. Without Java, every record notes METEOR as unavailable | scores it once METEOR works; training is kept | `test_a_meteor_that_cannot_score_stops_the_run_instead_of_a_silent_gap` |
# | a second `capbook book` on the same home and profile | it stops at once in one line naming the first (its pid, its start); the first is untouched | skips what the first finished | `test_a_killed_kernel_fails_its_step_in_one_line_and_the_rerun_completes` |
# | `CAPBOOK_HOME` on a read-only filesystem | one line, e.g. `capbook: <home>/runs/smoke/adhoc/…: cannot create the run folder (the folder is read-only); nothing already written was changed` | completes once the home is writable | `test_a_read_only_home_is_one_line` |
# | the disk full during a run (`make test`), during publishing, during the site's build (`make soak`) | one line naming the path and `no space left on the device`; the published tables, the reader's copies and the site unchanged | completes once space is back | `test_a_full_disk_is_one_line_changes_nothing_and_the_next_run_completes` |
#
# An invalid parameter, an unwritable or full disk, a file where a folder should be, or a missing GPU for `-p device
# cuda` stops with one line naming the parameter or path and what is allowed (`capbook:` in a notebook, `error:` and
# exit status 2 on the command line); the full traceback is kept in `runs/errors/`, in a file the line names.
#
# ## Contributing
#
# Notebooks are the source: edit `nbs/NAME.py` (each notebook's py:percent twin) or the notebook in JupyterLab, then
# `make sync` (jupytext sync, `nbdev_export`, the derived parameters cells and README, `nbdev_clean`). `capbook/` is
# generated and never edited by hand. A new model is a module plus `@register(name, Config, objective=..., train=...)`
# (`capbook.models`); a new chapter is a notebook plus `register_chapter(Chapter(...))` in its module: the plan, the site,
# the notebook tests and the README pick both up.
#
# Before each commit, `make test-fast` (the linter and every test not marked slow); `make hooks` installs the same
# checks as git pre-commit hooks. `make test` is what CI runs: the whole suite on two pytest-xdist workers, including a
# smoke book that the slow tests share, the site opened in headless Chromium, and the injected faults above. `make
# soak` runs what `make test` leaves out: whole smoke books killed at random moments, and the COCO rehearsal at a larger
# scale. The suite fails if `capbook/` is not what `nbdev_export` makes of `nbs/`, if a notebook pair is out of sync,
# if README is not what the index notebook and the published book make, or if any published table, figure or page is
# not what the checkout's code makes.
