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
# # runner
#
# > Run folders and results records (`start_run`), and `run_chapter`, the one call a chapter's run cell makes: data, model, training and self-critical stages, test evaluation, figure and record, and where a hand run falls among the book's rows.

# %%
#| default_exp runner

# %%
#| export
from __future__ import annotations
import dataclasses, os, platform, time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
import numpy as np
import torch
from capbook.core import (CapbookError, code_version, cpu_name, get_device, io_error, runs_dir, save_json, save_torch, save_yaml, tell,
                          stable_hash)
from capbook.metrics import measured
from capbook.profiles import (Chapter, RunConfig, chapter, check_profile, decoding, model_hparams, read_params, run_precision, scst_arms,
                              train_procs)
from capbook.stages import chapter_setup, fit_under_torchrun, scst_start, self_critical, timed
from capbook.records import captions_file

# %% [markdown]
# ## Runs and results records
#
# Every runnable notebook calls `start_run(name, params)` after validating its parameters. The run folder is the one
# the book runner passed (`run_dir`), or, for a notebook run by hand with papermill,
# `runs/<profile>/adhoc/<name>-<hash of its parameters>` — so a hand-run with other parameters never overwrites the
# book's results. The folder's `params.yaml` holds every parameter as the run used it (the profile's sizes filled in
# where the notebook left `None`); papermill's `-f runs/.../params.yaml` starts the same run again, which finds its
# finished training and does not repeat it. `Run.record(...)` writes the run's results record, `record.json`: parameters, seed, code version,
# metrics, timings, parameter count, machine. Tables are assembled from records.

# %%
#| export
@dataclass
class Run:
    "A notebook run: its name, parameters, folder and start time."
    name: str
    params: dict
    dir: Path
    t0: float = field(default_factory=time.time)

    def path(self, name: str) -> Path:
        "A file inside the run folder."
        return self.dir / name

    def record(self, metrics: dict, timings: dict | None = None, n_params: int | None = None, device: str | None = None, **extra) -> dict:
        "Write this run's results record `record.json` (atomically) and return it; `device`: where the run computed (default: the CPU)."
        rec = {"notebook": self.name, "params": self.params, "seed": self.params.get("seed"),
               "profile": self.params.get("profile"), "code_version": code_version(), "metrics": metrics,
               "timings": {**(timings or {}), "wall_s": time.time() - self.t0}, "n_params": n_params,
               "machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "device": str(device or "cpu"), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                           "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "cpu": cpu_name(),
                           "isa": torch.backends.cpu.get_cpu_capability()},     # the vector instructions its CPU kernels ran (with `precision`: the arithmetic, never in a key)
               "finished": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}
        save_json(self.dir / "record.json", rec)
        return rec

def start_run(name: str, params: dict, resolved: dict | None = None) -> Run:
    "Validate the profile, create the run folder (the book's `run_dir` parameter, or an ad-hoc one keyed by the `resolved` parameters), write its `params.yaml`, and return the `Run`."
    check_profile(params.get("profile"))
    p = {k: v for k, v in params.items() if k != "run_dir"}
    full = {k: v for k, v in (resolved or params).items() if k != "run_dir"}     # every value as the run uses it
    if full.get("precision") == "auto":                                          # the arithmetic this machine will use
        full["precision"] = run_precision(full["profile"], "auto", full.get("device", "auto"))
    d = params.get("run_dir") or runs_dir() / p["profile"] / "adhoc" / f"{name}-{stable_hash(full, 8)}"
    d = Path(d)
    try: d.mkdir(parents=True, exist_ok=True)
    except OSError as e: raise io_error(d, e, "create the run folder") from None
    again = {**full, **({"run_dir": str(params["run_dir"])} if params.get("run_dir") else {})}
    save_yaml(d / "params.yaml", again, f"{name}: every parameter of the run in this folder, as it ran.\n"
              f"The same run again (it resumes its finished training): papermill nbs/{name}.ipynb out.ipynb -f {d / 'params.yaml'}")
    return Run(name, p, d)

# %% [markdown]
# A run in a folder the book would pass: its record carries the parameters (not `run_dir`), the metrics and the time.

# %%
import tempfile
from capbook.core import load_json
_run = start_run("demo", {"profile": "smoke", "seed": 3, "run_dir": tempfile.mkdtemp()})
_rec = _run.record({"BLEU-4": 0.2}, {"train_s": 1.5}, n_params=10)
assert load_json(_run.path("record.json"))["metrics"] == {"BLEU-4": 0.2} and _rec["params"] == {"profile": "smoke", "seed": 3}
assert _rec["seed"] == 3 and _rec["timings"]["train_s"] == 1.5 and _rec["timings"]["wall_s"] >= 0
from capbook.core import load_yaml
assert load_yaml(_run.path("params.yaml")) == {"profile": "smoke", "seed": 3, "run_dir": str(_run.dir)}

# %% [markdown]
# ## One chapter run
#
# Every paper chapter's run cell is one call, `run_chapter(notebook, globals())`: it reads and checks the parameters,
# then prepares the data (`capbook.prepare`), builds the registered model (`capbook.models.build`), trains it with
# its objective (`capbook.train.fit`), decodes and scores the test split (`capbook.metrics.evaluate`), adds the
# chapter's own measurements, saves every test caption with its attention (`test_captions.pt`, for the assembly
# notebooks' figures) and as a COCO results file (`captions_test.json`, `capbook.metrics.write_results`: what the
# evaluation server and the peers' eval scripts read, and what `capbook score` scores), writes the results record, and draws the attention of the first test image whose caption names
# two of its objects (one plotting path for every model, `capbook.viz.attention_rows`: the caption's words on lines of
# four panels, so the figure fits a page's column; the book publishes a row's own run's, so that helper is in those
# runs' keys, `capbook.results.RUN_FIGURE`). It returns a `ChapterRun`
# with all of it, for the chapter's own analysis cells.

# %%
#| export
@dataclass
class ChapterRun:
    "What `run_chapter` made: parameters, run folder, data, model, fit result, test evaluation, record, device."
    chapter: Chapter
    params: Any
    run: Run
    prep: Any
    model: Any
    fitted: Any
    ev: dict
    record: dict
    device: torch.device
    figure: Path | None = None

    def measured(self) -> dict:
        "The metrics as a results record keeps them (caption metrics, semantic scores, attention correctness)."
        return measured(self.ev)

def results_ids(prep, split: str, keys: list[str]) -> list:
    "The COCO results file's image ids of a split's images named by `keys` (their filenames)."
    ids = {r.key: r.image_id for r in prep.kdata.split(split)}
    return [ids[k] for k in keys]

def save_test_captions(path: Path, ev: dict, grid: list[int]) -> Path:
    "An evaluation's test captions (keys, tokens, words, attention and its grid) for the assembly notebooks and their intervals."
    return save_torch(path, {"keys": ev["keys"], "tokens": [c.tokens for c in ev["captions"]],
                             "alpha": [c.alpha for c in ev["captions"]], "words": ev["words"], "grid": grid})

def figure_pick(ev: dict, gt: dict | None) -> int:
    "The first test image whose caption names at least two objects of the image (0 without ground truth)."
    if gt is None: return 0
    from capbook.shapes import object_mentions
    return next((i for i, (k, w) in enumerate(zip(ev["keys"], ev["words"]))
                 if len([m for m in object_mentions(w, gt["images"][k]) if m[1]]) >= 2), 0)

def run_chapter(notebook: str, namespace: Mapping[str, Any] | Any, log: Callable[[str], None] = tell) -> ChapterRun:
    "Run a chapter with the parameters in `namespace` (the notebook's `globals()`, or a parameters dataclass)."
    from capbook.models import make_config
    from capbook.train import fit
    from capbook.metrics import evaluate, write_results
    from capbook.viz import attention_rows
    ch = chapter(notebook)
    given = namespace if isinstance(namespace, ch.params) else read_params(ch.params, namespace)
    p = ch.resolve(given)                         # the profile's sizes where the parameters leave None
    if p.scst_epochs is None: p = dataclasses.replace(p, scst_epochs=0)   # no chapter default: none
    RunConfig.check(p)
    if ch.check: ch.check(p)
    name = ch.model(p)
    hp = model_hparams(name, p)
    make_config(name, **hp)                       # a wrong model parameter stops here, before any work
    run = start_run(notebook, dataclasses.asdict(given), dataclasses.asdict(p))   # its record: the parameters as asked for; params.yaml: as used
    phase = {}                                    # where the run's time goes: data, train, val, test, measure, figure
    prep, inputs, model, cfg = chapter_setup(ch, p, phase, log)
    kept = prep.train.n_kept(cfg.max_words)
    log(f"{name} on {prep.dataset} ({prep.encoder}): {model.n_params:,} parameters; {kept:,} training captions"
        + (f" (of {len(prep.train):,}: at most {cfg.max_words} words)" if kept < len(prep.train) else "")
        + f"; {cfg.epochs} epoch{'s' * (cfg.epochs != 1)} at most")
    if (procs := train_procs()) > 1: fit_under_torchrun(notebook, run.dir, procs, log)   # then every fit below reads its finished checkpoint
    fitted = fit(model, prep, cfg, run.path("ckpt"), log=log)
    dev = get_device(p.device)
    model.to(dev)
    with timed(phase, "test_s"): ev = evaluate(model, prep, "test", beam_size=p.beam_size, device=dev, **decoding(p))
    phase |= {"train_s": fitted.train_seconds, "val_s": fitted.val_seconds}
    stages = {}
    grid = list(getattr(model, "att_grid", prep.grid))  # a model may attend over its own map (the 2D LSTMs)
    if p.scst_epochs:                              # then self-critical training from the selected cross-entropy weights
        with timed(phase, "test_s"): evg = evaluate(model, prep, "test", beam_size=1, device=dev, **decoding(p))   # greedy, beside the beam
        stages["xe"] = {"metrics": measured(ev), "greedy": measured(evg), "best_epoch": fitted.best_epoch, "best_at": fitted.best_at,
                        "train_s": fitted.train_seconds, "images_per_s": ev["timings"]["images_per_s"]}
        save_test_captions(captions_file(run.dir, "xe"), ev, grid)
        xe = run.path("ckpt")
        for arm, baseline in scst_arms(p):           # each arm from the same start; the greedy baseline's last
            scst_start(model, xe)
            rl, ev, evg = self_critical(model, prep, p, cfg, run.path(f"ckpt-{arm}"), log, start=xe / "last.pt", baseline=baseline)
            stages[arm] = {"metrics": measured(ev), "greedy": measured(evg), "baseline": baseline, "best_epoch": rl.best_epoch,
                           "best_at": rl.best_at, "train_s": rl.train_seconds, "val_s": rl.val_seconds, "history": rl.history,
                           "images_per_s": ev["timings"]["images_per_s"]}
            if arm != "scst": save_test_captions(captions_file(run.dir, arm), ev, grid)
            phase["train_s"] += rl.train_seconds; phase["val_s"] += rl.val_seconds
            # the stage's test: its two decodes and their scoring, as timed (its training and validation may have run in
            # an earlier process that was stopped: this process's wall time less those would go negative)
            phase["test_s"] += sum(e["timings"].get(k, 0.0) for e in (ev, evg) for k in ("decode_s", "score_s"))
    ctx = ChapterRun(ch, p, run, prep, model, fitted, ev, {}, dev)
    with timed(phase, "measure_s"): extra = ch.measure(ctx) if ch.measure else {}
    save_test_captions(captions_file(run.dir), ev, grid)
    write_results(run.path("captions_test.json"), results_ids(prep, "test", ev["keys"]), [" ".join(w) for w in ev["words"]])   # COCO results form
    with timed(phase, "figure_s"):
        if ev["captions"] and ev["captions"][0].alpha is not None and "feat_mask" not in prep.test.inputs:   # a grid to draw on
            i = figure_pick(ev, prep.gt)
            ctx.figure = attention_rows([{"label": ch.label(p), "image": prep.image_paths("test")[i], "words": ev["words"][i],
                                            "alpha": ev["captions"][i].alpha, "grid": tuple(grid)}], run.path(ch.figure(p)))
    ctx.record = run.record(measured(ev), timings={**phase, "train_captions_per_s": fitted.captions_per_s, **ev["timings"]},
                            n_params=model.n_params, device=str(dev), notes=ev["notes"], best_epoch=fitted.best_epoch, best_at=fitted.best_at,
                            history=fitted.history, model=name, hparams=hp, precision=fitted.precision,
                            data={"dataset": prep.dataset, "encoder": prep.encoder, "fingerprint": prep.fingerprint},
                            samples=[{"key": k, "caption": " ".join(w)} for k, w in list(zip(ev["keys"], ev["words"]))[:20]],
                            **({"stages": stages} if stages else {}), **({"world_size": fitted.world_size} if fitted.world_size > 1 else {}),
                            **inputs, **extra)
    if given.run_dir is None:                      # a reader's run by hand: where it falls among the book's own rows, and where it is
        for line in [*book_context(notebook, p, ctx.record), *reproduced(notebook, p, ctx.record), *ending(p, run.dir)]: log(line)
    return ctx

# %%
#| export
_NOT_COMPARED = ("run_dir", "device", "seed")   # what a book row's seeds differ in, or what changes no number

def _compared(ch, params: dict) -> tuple[Any, dict]:
    "A chapter run's parameters as `run_chapter` resolves them, and those of them that change a number and do not vary over seeds."
    p = ch.resolve(ch.params(**{k: v for k, v in params.items() if k != "run_dir"}))
    if p.scst_epochs is None: p = dataclasses.replace(p, scst_epochs=0)
    return p, {k: v for k, v in dataclasses.asdict(p).items() if k not in _NOT_COMPARED}

def beside(notebook: str, p, record: dict, metric: str = "CIDEr", published: Path | None = None) -> list[dict]:
    "The book's rows of a run's chapter, at its profile and on its data, that differ from it in at most one parameter (`record`: the run's results record): each row's name, how it differs, its seeds' test `metric` (x100), their mean, the mean's 95% interval (`_judged`: mean ± t_{n-1} sd/√n; one seed: none), and where the run falls against their range. `published`: a published book's folder (`figures/`), whose records alone are read — the seeds its tables were made from, never a seed this machine ran since."
    from capbook.plan import chapter_steps, replicas
    from capbook.records import RECORDS, read_record, step_record
    from capbook.claims import _judged
    ch = chapter(notebook)
    _, mine = _compared(ch, dataclasses.asdict(p))
    value, rows = 100 * record["metrics"][metric], []
    try: steps = chapter_steps(p.profile, notebook)
    except CapbookError: return []
    for step in steps.values():
        row, theirs = _compared(ch, step.params)
        differ = sorted(k for k in mine if mine[k] != theirs.get(k))
        if len(differ) > 1: continue
        recs, seeds = [], []
        for s in replicas(p.profile, step):
            if published is not None:                                     # the published book's seeds alone
                if (f := Path(published) / RECORDS / f"{s.name}.json.gz").exists(): recs.append(read_record(f)); seeds.append(s)
                continue
            try: recs.append(step_record(p.profile, s)); seeds.append(s)
            except CapbookError: pass                                     # a seed the book has not made (yet: the design's next look)
        if not recs: continue                                             # a row the book has not made (yet)
        if published is None and any(Path(r["_dir"]) != runs_dir() / p.profile / s.name for r, s in zip(recs, seeds)): continue   # only the book's own runs (or their published records), never a run by hand
        if any(r["data"]["fingerprint"] != record["data"]["fingerprint"] for r in recs): continue   # other data: not comparable
        xs = np.array([100 * r["metrics"][metric] for r in recs])
        lo, hi = ((float(v) for v in _judged(xs.mean(), xs.var(ddof=1) / len(xs), len(xs) - 1)[:2]) if len(xs) > 1 else (None, None))
        rows.append({"row": ch.label(row), "differs": f"{differ[0]}={theirs[differ[0]]!r}; this run {mine[differ[0]]!r}" if differ else "",
                     "seeds": xs, "mean": float(xs.mean()), "lo": lo, "hi": hi,
                     "where": "inside" if xs.min() <= value <= xs.max() else "above" if value > xs.max() else "below"})
    return rows

def book_context(notebook: str, p, record: dict, metric: str = "CIDEr") -> list[str]:
    "Lines placing a run's test `metric` (x100; `record` its results record) among the book's rows of its chapter that differ from it in at most one parameter (`beside`): each row's mean over its seeds, the mean's 95% interval, its seeds' range, and where the run falls. Empty where the book has no such row."
    rows = beside(notebook, p, record, metric)
    if not rows: return []
    def line(r):
        what = r["differs"] or "the same parameters"
        if len(r["seeds"]) < 2: return f"  {r['row']} [{what}]: {r['mean']:.1f}, one seed (no interval)"
        return (f"  {r['row']} [{what}]: {r['mean']:.1f}, 95% interval of the mean [{r['lo']:.1f}, {r['hi']:.1f}], "
                f"{len(r['seeds'])} seeds from {r['seeds'].min():.1f} to {r['seeds'].max():.1f}: this run is {r['where']} their range")
    value = 100 * record["metrics"][metric]
    return [f"This run's test {metric} (x100, beam {p.beam_size}): {value:.1f}. The book's rows beside it (profile {p.profile}):", *map(line, rows)]

_MACHINE = ("threads", "isa", "device", "torch")   # what a record notes of the arithmetic a run was computed with, besides its precision

def reproduced(notebook: str, p, record: dict, metric: str = "CIDEr") -> list[str]:
    "Where the book holds a run of these very parameters and seed (its own run or its published record, on the same data): a line with its test `metric` beside this run's, saying whether this run reproduced it exactly, or else what differs between the two records' arithmetic (threads, instruction set, device, torch, precision). Empty where the book has none."
    from capbook.plan import chapter_steps, replicas
    from capbook.records import step_record
    ch = chapter(notebook)
    _, mine = _compared(ch, dataclasses.asdict(p))
    try: steps = chapter_steps(p.profile, notebook)
    except CapbookError: return []
    for s in (s for step in steps.values() for s in replicas(p.profile, step)):
        if s.params.get("seed", 0) != p.seed or _compared(ch, s.params)[1] != mine: continue
        try: rec = step_record(p.profile, s)
        except CapbookError: continue
        if Path(rec["_dir"]) != runs_dir() / p.profile / s.name or rec["data"]["fingerprint"] != record["data"]["fingerprint"]: continue
        theirs, here = rec.get("machine", {}), record.get("machine", {})
        differ = [f"{k} {theirs.get(k)} there, {here.get(k)} here" for k in _MACHINE if theirs.get(k) != here.get(k)]
        differ += [f"precision {rec.get('precision')} there, {record.get('precision')} here"] * (rec.get("precision") != record.get("precision"))
        a, b = record["metrics"][metric], rec["metrics"][metric]
        if a == b: return [f"The book holds a run of these parameters and seed ({s.name}): this run reproduced its test {metric} exactly, {100 * b:.1f}."]
        why = ("they differ in " + "; ".join(differ) + ": the order of the arithmetic, not the code" if differ else
               "nothing the two records note of the arithmetic differs (threads, instruction set, device, torch, precision)")
        return [f"The book holds a run of these parameters and seed ({s.name}): test {metric} {100 * b:.1f} there, {100 * a:.1f} here; {why}."]
    return []

def ending(p, folder: Path) -> list[str]:
    "The last lines of a reader's run: where its folder is (from the project's root) and, at the smoke profile, what its numbers are."
    where = os.path.relpath(folder, runs_dir().parent)
    lines = [f"This run's folder: {where} (its results record, checkpoints and test captions)."]
    if p.profile == "smoke":
        lines.append("The smoke profile trains toy sizes for an epoch: its numbers show that the chapter runs, not what the method "
                     "does; the book's numbers are the default profile's (-p profile default).")
    return lines

# %% [markdown]
# ## Running one chapter by hand
#
# ```bash
# .venv/bin/papermill nbs/02_show_attend_tell.ipynb out.ipynb -p epochs 2
# .venv/bin/papermill nbs/02_show_attend_tell.ipynb out.ipynb -p attention hard -p lambda_r 1.0
# .venv/bin/papermill nbs/03_spca.ipynb out.ipynb -p kernel 5
# .venv/bin/papermill nbs/03_spca.ipynb out.ipynb -p decoder 1d -p structure C-S -p profile smoke
# .venv/bin/papermill nbs/03_spca.ipynb out.ipynb -f runs/default/adhoc/03_spca-1a2b3c4d/params.yaml -p seed 1
# ```
#
# A chapter creates what it needs (data set, encoder, features) when it is missing, cached under `data/`, and writes
# to `runs/<profile>/adhoc/<notebook>-<hash of its parameters>/`, so a hand run never overwrites the book's. Its
# `params.yaml` starts the same run again (it finds its training finished); a flag after `-f` overrides the file. A
# misspelt or invalid parameter stops with one line naming it and what is allowed. A checkpoint resumes only the recipe
# that wrote it (the same code, data, sizes and training configuration); any other change moves it aside and trains
# anew. The assembly chapters (`02a_soft_vs_hard`, ...) read the book's own run of each step, or else a hand run whose
# parameters are exactly the step's. A hand run ends by placing its test CIDEr among the book's rows of its chapter that
# differ from it in at most one parameter, on the same data (`book_context`): `-p kernel 5` on SPCA prints the book's
# 3×3 row (its mean, the mean's 95% interval and its seeds' range) and its 5×5 row, and whether the run falls inside.
#
# **Watching a run.** Every training run writes TensorBoard event files in its `ckpt/tb` (`ckpt-scst/tb` for the
# self-critical stage): each training term, the learning rate, and every validation's scores and caption churn.
# `.venv/bin/tensorboard --logdir runs/` shows every run side by side, live. On a terminal, long steps show a progress
# bar; in notebooks, the site and CI logs they stay quiet.
#
# **Real data.** Put `dataset_coco.json` (or `dataset_flickr8k.json`, `dataset_flickr30k.json`, Karpathy's splits) and
# the images in one folder and run with `-p dataset coco -p data_path /path/to/folder -p profile paper` (a GPU is used
# when present). Each chapter then uses its paper's encoder (VGG-16 cut at conv5_3 for Show-Attend-Tell, ResNet-101 for
# SPCA) with torchvision's ImageNet weights, downloaded or placed in `~/.cache/torch/hub/checkpoints/`; `-p weights
# /path/file.pth` uses another state-dict file. Features and runs are keyed by content: a replaced image, caption or
# weights file gives new features and a new run, never the old result.
