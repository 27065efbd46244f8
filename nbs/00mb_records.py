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
# # records
#
# > Where a row's numbers are found: every results record of a profile (the book's runs, hand runs, the published book's records), a step's record, a row's seeds merged, a record's stages and the per-image statistics of its test captions.

# %%
#| default_exp records

# %%
#| export
from __future__ import annotations
import base64, json, os
from pathlib import Path
from typing import Any, Callable
import numpy as np
import torch
from capbook.core import (CapbookError, atomic_write, file_digests, load_json, load_torch, package_hash, runs_dir,
                          stable_hash)
from capbook.plan import Step, chapter_steps, nb_defaults, nbs_dir, replicas

# %% [markdown]
# ## Records, run folders and published records
#
# Everything a table needs to find a row's numbers lives here (the plan's `Step`, its repeats over
# seeds, `replicas`, and a chapter's runs, `chapter_steps`, are `capbook.plan`'s): every results record of a profile (`records`: the book's runs in `runs/<profile>/`, hand runs,
# and the records the published book keeps in `figures/records/`), the record of one step (`step_record`), a table
# row's seeds merged (`row_record`, `merge_seeds`) and the rows an assembly notebook compares (`compared_runs`).

# %%
#| export
MANIFEST = "book.json"   # the published book's manifest (capbook.results.write_manifest): which step made each file, every step's key
RECORDS = "records"      # the published book's folder of its runs' records (figures/records/<step>.json.gz)

def run_files(root: Path, name: str) -> list[Path]:
    "Every file called `name` under `root`, sorted, through symbolic links too: a run folder linked in from another home is the run's folder (`Path.rglob` does not follow links, and the step would silently fall back to its published record)."
    return sorted(Path(d) / name for d, _, files in os.walk(root, followlinks=True) if name in files)

def records(profile: str, notebook: str | None = None) -> list[dict]:
    "Every results record of a profile (book runs and ad-hoc runs in `runs/<profile>/`, then the published book's records of the steps that have no run folder here), optionally of one notebook."
    from capbook.profiles import out_dir
    out, here = [], set()
    for f in run_files(runs_dir() / profile, "record.json"):
        r = load_json(f, "results record"); r["_dir"] = str(f.parent); here.add(f.parent)
        if notebook is None or r.get("notebook") == notebook: out.append(r)
    for f in sorted((out_dir(profile) / RECORDS).glob("*.json.gz")):
        d = runs_dir() / profile / f.name[:-len(".json.gz")]
        if d in here or (notebook is not None and not f.name.startswith(notebook)): continue
        r = read_record(f)
        if notebook is None or r.get("notebook") == notebook: out.append({**r, "_dir": str(d), "_published": str(f)})
    return out

def read_record(path: Path) -> dict:
    "A published record (gzipped JSON), or one line naming the file."
    import gzip
    try:
        with gzip.open(path, "rt") as fh: return json.load(fh)
    except (OSError, ValueError, EOFError) as e:
        raise CapbookError(f"{path}: unreadable published record ({e.__class__.__name__}); delete it or publish the book again") from None

FIGURE_IMAGES = 16              # the first test images whose attention maps a published record keeps: the figures pick among them
RUN_FILES = ("distilling.pt",)  # a run folder's small files an assembly notebook draws from, kept whole in its published record

def kept_maps(alpha: torch.Tensor | None) -> dict | None:
    "Attention maps (T, L) as a published record keeps them: float16 (3 significant digits, so a map's max/min survives), base64."
    if alpha is None: return None
    a = alpha.detach().float().cpu().to(torch.float16)
    return {"shape": list(a.shape), "f16": base64.b64encode(a.numpy().tobytes()).decode()}

def restored_maps(d: dict | None) -> torch.Tensor | None:
    "The maps `kept_maps` kept: (T, L) float32."
    if d is None: return None
    return torch.from_numpy(np.frombuffer(base64.b64decode(d["f16"]), dtype=np.float16).copy()).reshape(d["shape"]).float()

def captions_file(folder: Path, tag: str = "final") -> Path:
    "Where a run folder keeps the test captions of stage `tag` (`stage_tag`): `test_captions.pt` for its last stage, `test_captions-{tag}.pt` for an earlier one ('xe', 'scst-mean')."
    return Path(folder) / ("test_captions.pt" if tag == "final" else f"test_captions-{tag}.pt")

def captions_tags(folder: Path) -> list[tuple[str, Path]]:
    "Every stage's test captions a run folder keeps, as (tag, file): the inverse of `captions_file`."
    d = Path(folder)
    return [("final", captions_file(d))] + [(f.stem.removeprefix("test_captions-"), f) for f in sorted(d.glob("test_captions-*.pt"))]

def run_captions(rec: dict, which: str = "final") -> dict:
    "A run's test captions as the assembly notebooks read them (a row of seeds: its first run's): `keys` and `words` of every test image, `alpha`, the attention maps (T, L) of the first `FIGURE_IMAGES` as a published record keeps them (float16, so a figure is the same from a run folder and from the book; None where the model has no map), and `grid`; from the run folder, else from the published record."
    from capbook.core import load_torch
    f = captions_file(rec["_dir"], which)
    if f.exists():
        c = load_torch(f, "test captions")
        return {"keys": list(c["keys"]), "words": [list(w) for w in c["words"]], "grid": list(c["grid"]),
                "alpha": [restored_maps(kept_maps(a)) for a in c["alpha"][:FIGURE_IMAGES]]}
    if which not in rec.get("test_words", {}) or which not in rec.get("test_alpha", {}):
        raise CapbookError(f"{rec.get('_published', f)}: no {which} test captions (run the step again: `capbook book --only ={Path(rec['_dir']).name} --force`)")
    w, a = rec["test_words"][which], rec["test_alpha"][which]
    return {"keys": w["keys"], "words": w["words"], "grid": a["grid"], "alpha": [restored_maps(x) for x in a["maps"]]}

def run_words(rec: dict, which: str = "final") -> list[list[str]]:
    "The words of a run's test captions of stage `which` ('final', 'xe', 'scst-mean', ...), one list per test image: from its run folder, else from the published record (which keeps every run's words, replicas' too, but only the first run's final maps)."
    from capbook.core import load_torch
    f = captions_file(rec["_dir"], which)
    if f.exists(): return [list(w) for w in load_torch(f, "test captions")["words"]]
    if which not in rec.get("test_words", {}):
        raise CapbookError(f"{rec.get('_published', f)}: no {which} test captions (run the step again: `capbook book --only ={Path(rec['_dir']).name} --force`)")
    return [list(w) for w in rec["test_words"][which]["words"]]

def run_file(rec: dict, name: str, what: str) -> Any:
    "One of a run's small files (`RUN_FILES`), loaded: from its run folder, else from the published record that keeps it."
    from capbook.core import load_torch
    f = Path(rec["_dir"]) / name
    if f.exists() or name not in rec.get("files", {}): return load_torch(f, what)
    import io
    try: return torch.load(io.BytesIO(base64.b64decode(rec["files"][name])), map_location="cpu", weights_only=True)
    except Exception as e: raise CapbookError(f"{rec['_published']}: unreadable {what} ({e.__class__.__name__})") from None

def publish_records(profile: str, steps: list, folder: Path) -> dict[str, str]:
    "Keep in `folder/records/` the record of every chapter run among `steps` that has one, with its test captions (words, by image: what the paired tests and intervals need), so a fresh clone reassembles a chapter's tables without retraining the others; {file relative to folder: step name}."
    from capbook.profiles import chapters
    from capbook.core import load_torch
    chs, made = chapters(), {}
    for s in steps:
        d = runs_dir() / profile / s.name
        if s.notebook not in chs or not (d / "record.json").exists(): continue
        rec = load_json(d / "record.json", "results record")
        files = captions_tags(d)
        caps = {w: load_torch(f, "test captions") for w, f in files if f.exists()}   # the final captions, and each earlier stage's
        rec["test_words"] = {w: {"keys": list(c["keys"]), "words": [list(x) for x in c["words"]]} for w, c in caps.items()}
        if not s.replica:                             # a row's figures draw its first seed's maps
            rec["test_alpha"] = {w: {"grid": list(c["grid"]), "maps": [kept_maps(a) for a in c["alpha"][:FIGURE_IMAGES]]}
                                 for w, c in caps.items() if w == "final"}   # the figures draw the final captions
        rec["files"] = {f: base64.b64encode((d / f).read_bytes()).decode() for f in RUN_FILES if (d / f).exists()}
        out = Path(folder) / RECORDS / f"{s.name}.json.gz"
        write_record(out, rec)
        made[f"{RECORDS}/{out.name}"] = s.name
    return made

def write_record(out: Path, rec: dict) -> Path:
    "Write a published record (gzipped JSON, naming no path of the machine that made it), atomically."
    import gzip
    from capbook.copies import without_machine_paths
    out.parent.mkdir(parents=True, exist_ok=True)
    text = without_machine_paths(json.dumps(rec, sort_keys=True))     # a record names no path of the machine that made it
    def write(t: Path):
        with open(t, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as fh:
            fh.write(text.encode())               # no name or time stamp in the header: the same record, the same bytes
    return atomic_write(out, write)

def _tree(xs: list, f: Callable) -> Any:
    "`f` over the numbers at the same place of nested dicts `xs` (keys all of them have); elsewhere the first's value."
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs): return f(xs)
    if all(isinstance(x, dict) for x in xs): return {k: _tree([x[k] for x in xs], f) for k in xs[0] if all(k in x for x in xs)}
    return xs[0]

def merge_seeds(recs: list[dict]) -> dict:
    "One table row's record from its runs over training seeds: metrics, each stage's metrics and timings averaged, `metrics_sd` the metrics' sample standard deviation, `seed_runs` the runs' own records."
    mean = lambda xs: float(np.mean(xs))
    sd = lambda xs: float(np.std(xs, ddof=1)) if len(xs) > 1 else None
    out = {**recs[0], "seed_runs": recs, "seeds": [r["params"].get("seed") for r in recs],
           "metrics": _tree([r["metrics"] for r in recs], mean), "metrics_sd": _tree([r["metrics"] for r in recs], sd),
           "timings": _tree([r["timings"] for r in recs], mean)}
    if "stages" in recs[0]:
        out["stages"] = {k: {**st, "metrics": _tree([r["stages"][k]["metrics"] for r in recs], mean),
                             "metrics_sd": _tree([r["stages"][k]["metrics"] for r in recs], sd),
                             "train_s": mean([r["stages"][k]["train_s"] for r in recs])}
                         for k, st in recs[0]["stages"].items()}
    return out

_NOT_CONFIG = ("run_dir", "device")   # parameters that do not change what a run measures

def _as_run(params: dict, sizes: dict) -> dict:
    "A run's parameters as it ran: a size left None is its profile's (`sizes`, the chapter's), and the ones that do not change what it measures dropped."
    return {k: sizes[k] if v is None and k in sizes else v for k, v in params.items() if k not in _NOT_CONFIG}

def step_record(profile: str, step: Step) -> dict:
    "The results record of a plan step: the book's own run, else the latest hand run with exactly its parameters, compared as they ran (`_as_run`; a parameter added to the chapter after the record was made counts at its default, the value its code then had)."
    from capbook.profiles import book_set_defaults, chapters
    ch, defaults = chapters().get(step.notebook), nb_defaults(step.notebook)
    if ch: defaults = {**book_set_defaults(), **defaults}                # a field its cell leaves out, at its default
    sizes = ch.sizes.get(profile, {}) if ch else {}                   # the records of runs/<profile> ran at `profile`
    want = _as_run({**defaults, **step.params}, sizes)
    book = runs_dir() / profile / step.name
    same = [r for r in records(profile, step.notebook) if _as_run({**defaults, **r["params"]}, sizes) == want]
    same.sort(key=lambda r: (Path(r["_dir"]) == book, r.get("finished", "")))
    if not same:
        raise CapbookError(f"no results record of {step.name} at profile {profile!r} (parameters {step.params}): "
                           f"run `capbook book --profile {profile}` first")
    return same[-1]

def row_record(profile: str, step: Step) -> dict:
    "A table row's record: the results of a chapter run and of its repeats over training seeds, merged (`merge_seeds`); `row` names its step (the plan's name of its first seed), which a claim on it records (`capbook.claims.Claims.test`)."
    return {**merge_seeds([step_record(profile, r) for r in replicas(profile, step)]), "row": step.name}

def compared_runs(profile: str, wanted: dict[str, tuple[str, tuple[str, ...] | None]]) -> tuple[dict, dict]:
    "Steps and results records, keyed (name, tag), of the runs an assembly notebook compares: `{name: (notebook, tags or None for all)}`; stops unless every run was trained on the first one's data."
    steps = {(name, t): s for name, (nb, tags) in wanted.items() for t, s in chapter_steps(profile, nb).items()
             if tags is None or t in tags}
    recs = {k: row_record(profile, s) for k, s in steps.items()}
    first = next(iter(recs))
    other = [s.name for k, s in steps.items()
             if any(r["data"]["fingerprint"] != recs[first]["data"]["fingerprint"] for r in recs[k]["seed_runs"])]
    if other:
        raise CapbookError(f"runs {other} were trained on other data than {steps[first].name}: "
                           f"run `capbook book --profile {profile}` again")
    return steps, recs


PAPER_CHAPTERS = ("02a_soft_vs_hard", "03a_spca_tables", "04a_ssa_tables", "05a_glied_tables")   # whose verdicts the book-wide family reads

def chapter_verdicts(profile: str, chapters: tuple[str, ...] = PAPER_CHAPTERS, published: Path | None = None, kind: str = "verdicts") -> dict:
    "Each paper chapter's verdicts, `{chapter: DataFrame}` (its `table_*_verdicts.csv` together; `kind` 'parts': the parts of its compound claims, `table_*_parts.csv`, `Claims.parts_table`): from the book's own run of the chapter, else from the published book (`figures/`, by its manifest); a chapter with neither is left out."
    import pandas as pd
    folder = Path(published or nbs_dir().parent / "figures")
    made = load_json(folder / MANIFEST)["files"] if (folder / MANIFEST).exists() else {}
    out = {}
    for ch in chapters:
        files = sorted((runs_dir() / profile / ch).glob(f"table_*_{kind}.csv"))
        if not files: files = sorted(folder / f for f, e in made.items() if e.get("step") == ch and f.endswith(f"_{kind}.csv"))
        if files: out[ch] = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    return out

# %% [markdown]
# A published record keeps the attention maps of the first `FIGURE_IMAGES` test images (of a row's first seed) in
# float16: a figure drawn from it is the figure drawn from the run folder, since both go through the same rounding.

# %%
_a = torch.softmax(3 * torch.randn(5, 196, generator=torch.Generator().manual_seed(0)), -1)   # 5 words' maps on a 14x14 grid
_b = restored_maps(kept_maps(_a))
assert _b.shape == _a.shape and torch.allclose(_a, _b, rtol=2**-10, atol=1e-7)
assert torch.allclose(restored_maps(kept_maps(_b)), _b) and kept_maps(None) is None

# %% [markdown]
# A run folder names each stage's test captions by its tag, and the readers find them back by the same two functions:

# %%
import tempfile
with tempfile.TemporaryDirectory() as _d:
    for _t in ("final", "xe", "scst-mean"): captions_file(_d, _t).touch()
    assert [t for t, _ in captions_tags(_d)] == ["final", "scst-mean", "xe"]
    assert all(captions_file(_d, t) == f for t, f in captions_tags(_d))

# %% [markdown]
# ## A record's stages and its test captions' statistics
#
# A run that went on with self-critical training keeps each stage's metrics (`record_stage`) and test captions; the
# per-image statistics of a stage's captions (`stage_stats`, by `capbook.metrics.image_stats`, cached in the run folder by
# content) are what the claims test, and a row's spread over its seeds (`seed_cells`) is what its table shows.

# %%
#| export
def record_stage(rec: dict, which: str = "xe") -> dict:
    "A results record's metrics, training seconds and decoding speed after cross-entropy ('xe') or self-critical training ('scst'); a run without SCST has only 'xe'."
    if "stages" in rec: return rec["stages"][which]
    if which != "xe": raise CapbookError(f"run {rec.get('_dir', '?')} has no self-critical stage (scst_epochs was 0)")
    return {"metrics": rec["metrics"], "train_s": rec["timings"]["train_s"], "images_per_s": rec["timings"]["images_per_s"],
            "best_epoch": rec.get("best_epoch")}

def stage_tag(rec: dict, which: str | None = None) -> str:
    "The name a run keeps stage `which`'s test captions under (`run_words`): 'final' for its last stage (None, or 'scst' / 'xe' as its record ends), else `which` ('xe' of a run that went on, 'scst-mean')."
    return "final" if which in (None, "scst" if "stages" in rec else "xe") else which

def stage_stats(rec: dict, prep, which: str | None = None) -> dict | list[dict] | None:
    "Per-image statistics of a run's test captions for bootstrap intervals (`capbook.metrics.image_stats`): its final captions, or those after cross-entropy (`which='xe'`) of a run that went on with SCST where it kept them; None where it kept none; a list, one per seed, for a row of several seeds (`merge_seeds`). Cached in the run folder, keyed by the captions' content, the data and the package code."
    from capbook.metrics import image_stats
    if len(rec.get("seed_runs", [])) > 1: return [stage_stats(r, prep, which) for r in rec["seed_runs"]]
    d, tag = Path(rec["_dir"]), stage_tag(rec, which)
    which = which or ("scst" if "stages" in rec else "xe")
    f = captions_file(d, tag)
    kept = rec.get("test_words", {}).get(tag)              # a published record's captions (no run folder here)
    if not f.exists() and kept is None: return None
    if rec.get("data", {}).get("fingerprint") != prep.fingerprint:
        raise CapbookError(f"{d}: trained on other data than {prep.dataset} (fingerprint {prep.fingerprint}); its captions are not scored against these references")
    if not f.exists():
        if kept["keys"] != list(prep.test.keys): raise CapbookError(f"{rec['_published']}: captions of other test images than {prep.dataset}'s")
        return image_stats(kept["keys"], kept["words"], prep.test.refs, prep.gt)
    cache = d / f"image_stats-{which}-{stable_hash([file_digests([f], 'test captions'), prep.fingerprint, package_hash()], 12)}.npz"
    if cache.exists():
        with np.load(cache) as z: return {k: z[k] for k in z.files}
    cap = load_torch(f, "test captions")
    if list(cap["keys"]) != list(prep.test.keys): raise CapbookError(f"{f}: captions of other test images than {prep.dataset}'s")
    st = image_stats(list(prep.test.keys), cap["words"], prep.test.refs, prep.gt)
    def write(t: Path):
        with open(t, "wb") as fh: np.savez(fh, **st)
    atomic_write(cache, write)
    return st

SEED_METRICS = {"CIDEr": "CIDEr", "semantic F1": "F1 all"}   # the spread over seeds a table shows: metric -> results_row column

def seed_cells(rec: dict, which: str | None = None) -> dict:
    "A table row's spread over training seeds: the number of seeds and the sample standard deviation (×100) of CIDEr and semantic F1 ('—' with one seed)."
    from capbook.metrics import results_row
    runs = rec.get("seed_runs", [rec])
    rows = [results_row(record_stage(r, which or ("scst" if "stages" in r else "xe"))["metrics"]) for r in runs]
    sd = lambda c: f"{np.std([r[c] for r in rows], ddof=1):.1f}" if len(rows) > 1 and all(c in r for r in rows) else "—"
    return {"seeds": len(runs), **{f"{m} sd": sd(c) for m, c in SEED_METRICS.items()}}

def stage_best(rec: dict, which: str = "scst") -> str:
    "A stage's own best validation CIDEr (×100) per seed against the score it started from, from its records' histories: what a stage that kept its start reached."
    runs = rec.get("seed_runs", [rec])
    pairs = []
    for r in runs:
        val = [100 * e["val CIDEr"] for e in r["stages"][which]["history"] if "val CIDEr" in e]
        if val: pairs.append(f"{max(val[1:], default=float('nan')):.1f} vs {val[0]:.1f}")
    return "its best validation CIDEr against its start's: " + ", ".join(pairs) if pairs else ""

# %% [markdown]
# Whether a row's relation words say where the objects are (`capbook.shapes.relation_truth`, on shapes only): each
# seed's share of relation statements true of the image and true with the two objects swapped, whether its own McNemar
# test puts that seed's gap above 0, and over the seeds, the unit of replication, Student's t of the gaps, never below
# the least p that S seeds can give (2^(1−S), as for every verdict). A row whose models write relations from the
# objects alone has a gap near 0 in every seed.

# %%
#| export
def relation_seeds(rec: dict, prep, which: str | None = None) -> list[dict]:
    "Each seed's `capbook.shapes.relation_truth` of a row's test captions of stage `which` (as `stage_stats` names them: None for the final ones, 'xe' for those after cross-entropy, 'scst-mean', ...); empty on data without ground truth."
    from capbook.shapes import relation_truth
    if not getattr(prep, "gt", None): return []
    return [relation_truth(run_words(r, stage_tag(r, which)), list(prep.test.keys), prep.gt["images"]) for r in rec.get("seed_runs", [rec])]

def relation_cells(rec: dict, prep, which: str | None = None) -> dict:
    "A table row's relation control over its seeds: its relation statements per test set (mean), % of them true (`rel. true`) and true with the objects swapped (`rel. swapped`), means over seeds; each seed's gap in points; how many seeds beat the swap by their own McNemar test (p below 0.05, the gap above 0; beside `seeds`); and the p over the seeds (`p over seeds`: Student's t of the gaps, never below the 2^(1−S) that S seeds can claim, as the book's verdicts; '—' with one seed). Empty without ground truth."
    from scipy.stats import ttest_1samp
    from capbook.claims import least_p
    rs = relation_seeds(rec, prep, which)
    if not rs: return {}
    gaps = [100 * (r["true"] - r["swapped"]) for r in rs]
    t = (float(ttest_1samp(gaps, 0.0).pvalue) if np.std(gaps) > 0 else float(np.mean(gaps) == 0))   # equal gaps: 0 unless all are 0
    return {"seeds": len(rs), "relation statements": float(np.mean([r["statements"] for r in rs])), "rel. true": 100 * float(np.mean([r["true"] for r in rs])),
            "rel. swapped": 100 * float(np.mean([r["swapped"] for r in rs])), "gap per seed": ", ".join(f"{g:+.1f}" for g in gaps),
            "seeds beating the swap": sum(r["p"] < 0.05 and g > 0 for r, g in zip(rs, gaps)),
            "p over seeds": max(t, float(least_p(len(gaps)))) if len(gaps) > 1 else "—"}

# %%
from types import SimpleNamespace
_objs = [dict(shape="circle", colour="red", size="small", box=[10, 40, 30, 60]),
         dict(shape="star", colour="blue", size="large", box=[70, 40, 100, 70])]
_prep = SimpleNamespace(test=SimpleNamespace(keys=["a.png", "b.png"]), gt={"images": {k: {"objects": _objs} for k in ("a.png", "b.png")}})
_said = lambda s: {"_dir": "/nonexistent", "test_words": {"final": {"keys": ["a.png", "b.png"], "words": [s.split()] * 2}}}
_row = {"seed_runs": [_said("a red circle is left of a blue star"), _said("a blue star is right of a red circle"),
                      _said("a red circle left of a blue star and a star")]}
_c = relation_cells(_row, _prep)
print(_c)
assert _c["relation statements"] == 2 and _c["rel. true"] == 100 and _c["rel. swapped"] == 0 and _c["gap per seed"] == "+100.0, +100.0, +100.0"
assert _c["seeds"] == 3 and _c["seeds beating the swap"] == 0 and _c["p over seeds"] == 0.25          # three seeds all one way: no test over them may claim less (`capbook.claims.least_p`)
assert relation_cells(_row, SimpleNamespace(test=_prep.test, gt=None)) == {}

# %% [markdown]
# A self-critical stage may settle one seed on one relation word and leave another writing none at all. How far each
# seed's most used word spreads over its captions is read off the caption table's two cells (one entry per seed), and
# a seed that writes no relation is said so, not averaged in as 0 %.

# %%
#| export
def relation_spread(words: str, shares: str) -> tuple[str, int, int]:
    "A row's seeds' most used relation word from the caption table's cells (`top relation (seeds)`, `% with it`: one comma-separated entry per seed, '—' for a seed that writes no relation): the span of its share of a seed's captions over the seeds that write one ('97–100 %', one number where they agree, '—' where none does), how many seeds write none, and the seeds."
    w, v = [x.strip() for x in str(words).split(",")], [int(x) for x in str(shares).split(",")]
    said = [x for t, x in zip(w, v) if t != "—"]
    span = "—" if not said else f"{min(said)} %" if min(said) == max(said) else f"{min(said)}–{max(said)} %"
    return span, len(v) - len(said), len(v)

# %%
assert relation_spread("right of, below, right of", "97, 100, 99") == ("97–100 %", 0, 3)
assert relation_spread("right of, —, right of", "100, 0, 100") == ("100 %", 1, 3)          # the silent seed is not a 0 % share
assert relation_spread("—, —", "0, 0") == ("—", 2, 2)
