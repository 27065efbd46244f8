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
# # plan
#
# > Which steps the book runs, with their parameters, and which earlier runs each one reads.

# %%
#| default_exp plan

# %%
#| export
from __future__ import annotations
import ast, json, os, re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from capbook.core import CapbookError
from capbook.profiles import SEEDS, check_profile, chapters


# %% [markdown]
# ## The plan, derived
#
# The book is a list of notebook runs, executed in order, and nothing in it is kept by hand: every notebook in `nbs/`
# runs, the index first, then the chapters in the order of their names (`01_dataset`, `02_show_attend_tell`,
# `02a_soft_vs_hard`, `03_spca`, ...), then the engine chapters (`00*`: their inline checks and documentation). A
# notebook whose `parameters` cell takes a `profile` gets the book's profile. A paper chapter declared with
# `capbook.profiles.register_chapter` runs once per run it declares — the paper's ablations, each the same notebook
# with other parameters and a `tag` — and an assembly notebook (such as `02a_soft_vs_hard`) then finds each run's
# results record with `step_record` — the book's own run of that step, or else a hand run (`papermill ... -p ...`)
# whose parameters are exactly the step's — and builds the paper's tables and figures from them. Tagged runs are not
# published or shown on the site on their own: their results reach the reader through the assembly notebook.

# %%
#| export
@dataclass
class Step:
    "One notebook run of the plan: notebook stem, parameters, and a tag for runs of the same notebook."
    notebook: str
    params: dict = field(default_factory=dict)
    tag: str = ""
    replica: int = 0                # a chapter run repeated with training seed `replica` (0: the row's own run)
    @property
    def name(self) -> str: return self.notebook + (f"-{self.tag}" if self.tag else "")

def replicas(profile: str, step: Step) -> list[Step]:
    "A chapter run and its repeats over the profile's training seeds (`capbook.profiles.SEEDS`, or more where the chapter asks for them: `Chapter.seeds`, or where the sequential design's next look asks for them: `design_seeds`): the rows a table averages."
    tag = lambda s: "-".join(t for t in (step.tag, f"seed{s}") if t)
    n = SEEDS[profile]
    if n > 1 and (ch := chapters().get(step.notebook)) is not None: n = ch.seeds.get(step.tag, n)   # a row with no verdict: 1
    if n > 1: n = max(n, design_seeds(profile).get(step.name, 0))      # the seeds the claims on this row still need
    return [step] + [Step(step.notebook, {**step.params, "seed": s}, tag(s), replica=s) for s in range(1, n)]

def design_seeds(profile: str, folder: Path | None = None) -> dict[str, int]:
    "The seeds each row needs under the sequential design after the looks the published verdicts record (`capbook.claims.look_record` over `folder`'s `table_*_verdicts.csv`, the profile's published book by default; `seeds_wanted`): a function of the earlier looks' verdicts alone. Empty where nothing with looks is published yet, or with `CAPBOOK_DESIGN=off` (the rows as they stand: a tables chapter run again before its next look's seeds)."
    from capbook.profiles import out_dir
    if os.environ.get("CAPBOOK_DESIGN") == "off": return {}           # the book as it stands: tabulate the looks already run
    files = sorted(Path(folder or out_dir(profile)).glob("table_*_verdicts.csv"))
    return dict(_design_seeds(tuple((str(f), f.stat().st_mtime_ns) for f in files)))

@lru_cache(maxsize=None)
def _design_seeds(files: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    import pandas as pd
    from capbook.claims import look_record, seeds_wanted
    try: tables = {Path(f).stem: pd.read_csv(f) for f, _ in files}
    except (OSError, ValueError) as e: raise CapbookError(f"the published verdict tables: not readable ({e})") from None
    return tuple(sorted(seeds_wanted(look_record(tables)).items()))

def nbs_dir() -> Path:
    "The notebook sources."
    return Path(__file__).resolve().parent.parent / "nbs"

def notebooks() -> list[str]:
    "Every notebook of the book in reading order: the index, the chapters (01, 02, 02a, ...), then the engine (00*)."
    names = sorted(p.stem for p in nbs_dir().glob("*.ipynb") if p.stem != "index")
    return ["index"] + [n for n in names if not n.startswith("00")] + [n for n in names if n.startswith("00")]

@lru_cache(maxsize=None)
def _nb_defaults(path: str, mtime: float) -> dict:
    "The values assigned in the notebook's cell tagged `parameters` (the cell papermill overrides), read from its JSON: what `papermill.inspect_notebook` reads, without papermill (a GPU machine's bare Python plans too)."
    try: cells = json.loads(Path(path).read_text())["cells"]
    except (OSError, ValueError, KeyError, TypeError) as e: raise CapbookError(f"{path}: not a readable notebook ({e})") from None
    cell = next((c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None: return {}
    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    out = {}
    for node in ast.parse(src).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(node, "target", None)
        if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
            out[target.id] = ast.literal_eval(node.value)
    return out

def nb_defaults(notebook: str) -> dict:
    "The default values of a notebook's `parameters` cell."
    p = nbs_dir() / f"{notebook}.ipynb"
    return dict(_nb_defaults(str(p), p.stat().st_mtime))

DEVICE_BOOK = "CAPBOOK_DEVICE_BOOK"   # environment: the device a device book (`capbook book --device`) trains its chapter runs on

def device_params() -> dict:
    "What a device book (`DEVICE_BOOK`) adds to every chapter run's parameters: its device, the keyed draws of stacked runs (`capbook.stages.fit_pack`), and on the CPU float32, the stacked step's arithmetic there; nothing for the CPU book."
    dev = os.environ.get(DEVICE_BOOK)
    return {"device": dev, "draws": "keyed", **({"precision": "fp32"} if dev == "cpu" else {})} if dev else {}

def plan(profile: str) -> list[Step]:
    "The runs that regenerate the book at `profile`, in order: every chapter's training runs first (in reading order), then the other notebooks in reading order, so that an assembly notebook can tabulate the runs of any chapter, a later one's too. A device book's chapter runs carry its `device_params`."
    check_profile(profile)
    chs, runs, rest, dev = chapters(), [], [], device_params()
    for nb in notebooks():
        if nb in chs: runs += [Step(nb, {"profile": profile, **kw, **dev}, tag) for tag, kw in chs[nb].runs.items()
                               if profile in chs[nb].only.get(tag, (profile,))]
        elif "profile" in nb_defaults(nb): rest.append(Step(nb, {"profile": profile}))
        else: rest.append(Step(nb))
    seeds = [r for s in runs for r in replicas(profile, s)[1:]]   # every row's first seed before any repeat
    return rest[:1] + runs + seeds + rest[1:]        # the index first

def chapter_steps(profile: str, notebook: str) -> dict[str, Step]:
    "The plan's runs of one chapter, by tag (each row's own run; `replicas` gives its repeats over seeds)."
    return {s.tag: s for s in plan(profile) if s.notebook == notebook and not s.replica}


# %% [markdown]
# The smoke plan: every notebook, the index first; Show-Attend-Tell's eight runs (the legacy recipe's included) and SPCA's ten, by tag.

# %%
import capbook.plan as _plan                               # the installed module (a notebook has no __file__)
_p = _plan.plan("smoke")
assert _p[0].notebook == "index" and {s.notebook for s in _p} == set(_plan.notebooks())
assert len(_plan.chapter_steps("smoke", "02_show_attend_tell")) == 8 and len(_plan.chapter_steps("smoke", "03_spca")) == 10

# %% [markdown]
# The sequential design's seeds (`capbook.claims`, `02b_protocol`): a row gets the seeds the next look of any claim on it
# asks for, read from the verdicts the book published — here a claim at its first look (3 seeds a side) going on, and
# one that ended for futility at its second:

# %%
import tempfile
with tempfile.TemporaryDirectory() as _d:
    Path(_d, "table_x_verdicts.csv").write_text("claim,test,rows,look,look verdict\n"
                                               "a above b,t1,\"02_show_attend_tell, 02_show_attend_tell-hard\",0,next look\n"
                                               "c above d,t2,\"03_spca, 03_spca-base\",1,futile\n")
    _want = _plan.design_seeds("default", Path(_d))
assert _want == {"02_show_attend_tell": 5, "02_show_attend_tell-hard": 5, "03_spca": 5, "03_spca-base": 5}
_want


# %% [markdown]
# ## Which runs a step reads
#
# An assembly notebook (a tables chapter such as `02a_soft_vs_hard`) tabulates the runs of its own chapter and of the
# chapters its chapter declares it `compares` with; the book runs it after them, and its key holds their keys
# (`capbook.results.Keys`). A training run reads no other run.

# %%
#| export
def upstream_of(step: Step, steps: list[Step]) -> list[Step]:
    "The earlier runs an assembly notebook tabulates: its chapter's (`02a_...` reads `02_...`) and those of the chapters it `compares` with."
    chapter_no = lambda nb: re.match(r"\d*", nb).group()
    names = [s.name for s in steps]
    chs = chapters()
    if step.notebook in chs or step.name not in names: return []    # a chapter's training run reads no other run; nor does a step outside the plan
    before = steps[:names.index(step.name)]
    compared = {c for nb, ch in chs.items() if chapter_no(nb) == chapter_no(step.notebook) for c in ch.compares}
    return [s for s in before if s.params and s.notebook != step.notebook
            and (chapter_no(s.notebook) == chapter_no(step.notebook) or s.notebook in compared)]


# %%
_steps = _plan.plan("smoke")
_ups = {s.name: [u.name for u in upstream_of(s, _steps)] for s in _steps}
assert _ups["02_show_attend_tell"] == [] and "02_show_attend_tell" in _ups["02a_soft_vs_hard"]

# %% [markdown]
# One assembly notebook reads more than records: `02b_protocol` decodes soft attention's seed-0 model five ways
# (greedy, beams, length normalisation), so it loads that run's trained weights. A clone's published book keeps the
# runs' records, not their checkpoints: where the weights are not here, the book trains that run again before the
# notebook, under its own key (`capbook.book.weights_to_make`), instead of letting the notebook stop at a missing file.

# %%
#| export
WEIGHTS_READ = {"02b_protocol": ("02_show_attend_tell",)}    # assembly notebook -> the steps whose trained weights it loads

def weights_read(step: Step, steps: list[Step]) -> list[Step]:
    "Of `steps`, the runs whose trained weights (`ckpt/best.pt`, as `capbook.train.load_trained` reads them), not only their records, assembly notebook `step` loads (`WEIGHTS_READ`)."
    want = WEIGHTS_READ.get(step.notebook, ())
    return [s for s in steps if s.name in want]

# %%
assert [s.name for s in weights_read(next(s for s in _steps if s.notebook == "02b_protocol"), _steps)] == ["02_show_attend_tell"]
assert all(weights_read(s, _steps) == [] for s in _steps if s.notebook != "02b_protocol")
