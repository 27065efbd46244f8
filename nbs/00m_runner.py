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
import contextlib, dataclasses, os, platform, time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
import numpy as np
import torch
from capbook.core import (CapbookError, code_version, cpu_name, get_device, io_error, io_errors_as_lines, load_torch, runs_dir,
                          save_json, save_torch, save_yaml, seed_everything, stable_hash, cpu_precision)
from capbook.metrics import measured
from capbook.profiles import (SCST_ARMS, SCST_WARMUP, Chapter, RunConfig, chapter, check_profile, decoding, model_hparams, read_params,
                              scst_arms, train_config, train_procs)

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
        full["precision"] = cpu_precision("auto", get_device(full.get("device", "auto")))
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
# two of its objects (one plotting path for every model, `capbook.viz.attention_figure`). It returns a `ChapterRun`
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

@contextlib.contextmanager
def timed(phase: dict, key: str):
    "Add the seconds the `with` block takes to `phase[key]` (a run's time per phase: data, test, measure, figure)."
    t0 = time.time()
    try: yield
    finally: phase[key] = phase.get(key, 0.0) + time.time() - t0

def self_critical(model, prep, p: Any, cfg: Any, ckpt_dir: Path, log: Callable[[str], None] = print,
                  start: Path | None = None, baseline: str | None = None) -> tuple[Any, dict, dict]:
    "Self-critical training after cross-entropy (Rennie et al. 2017): the one trainer with the `SelfCritical` objective (`baseline`: 'greedy' or 'mean', default the run's first arm's), from the weights the model holds, continuing the optimiser and weight average of the cross-entropy run's last checkpoint `start`; validated and selected greedily, as it trains; returns the fit and the test evaluations under the run's beam and greedy."
    from capbook.train import fit
    from capbook.metrics import evaluate
    scfg, objective = scst_setup(prep, p, cfg, baseline)
    log(f"self-critical training: {scfg.epochs} epochs, the best greedy validation CIDEr kept, "
        f"5 samples per image, baseline {baseline or SCST_ARMS[p.scst_baseline][0]}, lr {scfg.lr:g} after a {SCST_WARMUP:g}-epoch warm-up, "
        f"CIDEr-D document frequencies of {prep.train.n_images:,} training images")
    fitted = fit(model, prep, scfg, ckpt_dir, log=log, objective=objective, start=start)
    dev = get_device(p.device)
    model.to(dev)
    return (fitted, evaluate(model, prep, "test", beam_size=p.beam_size, device=dev, **decoding(p)),
            evaluate(model, prep, "test", beam_size=1, device=dev, **decoding(p)))

def scst_setup(prep, p: Any, cfg: Any, baseline: str | None = None) -> tuple[Any, Any]:
    "The training config and objective of self-critical training after cross-entropy config `cfg`, for run parameters `p` (`baseline`: the arm's; default the run's first)."
    from capbook.objectives import SelfCritical
    from capbook.core import data_dir
    # a constant small rate (Rennie et al.; ruotianluo's recipes), reached by a warm-up from the 0 cross-entropy's cosine
    # ended at; whole images (one row each); validated greedily, as the stage trains and as the reference validates
    # (its beam_size 1), the start validated first for the history, never kept: the stage's own best is its result;
    # the protocol's rule: the whole budget trained, no early stop on a plateau a longer run climbs out of
    scfg = dataclasses.replace(cfg, epochs=p.scst_epochs, lr=p.scst_lr, schedule="step", warmup=SCST_WARMUP, lr_gamma=1.0,
                               metric="CIDEr", patience=0, val_beam=1, batch_order="image", max_words=0,
                               validate_start=True, label_smoothing=0.0, ss_start=-1)   # cross-entropy's options: self-critical training samples its own captions
    objective = SelfCritical(prep.vocab, prep.train.refs, n=5, max_len=prep.max_len, baseline=baseline or SCST_ARMS[p.scst_baseline][0],
                             cache=data_dir() / "cider")
    return scfg, objective

@io_errors_as_lines
def chapter_data(ch: Chapter, p: Any, device: str | None = None):
    "The prepared data a run of chapter `ch` with parameters `p` trains on: on real data the chapter's paper's encoder unless `p.encoder` names one."
    from capbook.prepare import prepare
    encoder = p.encoder if p.encoder is not None or p.dataset == "shapes" else ch.encoder
    return prepare(p.dataset, p.profile, seed=p.data_seed, data_path=p.data_path, encoder=encoder, device=device or p.device,
                   weights=p.weights, regions=p.regions)

def chapter_setup(ch: Chapter, p: Any, phase: dict | None = None, log: Callable[[str], None] = print) -> tuple:
    "What a run of chapter `ch` with resolved parameters `p` trains: (prepared data, per-image inputs' record, model seeded with `p.seed`, training config); the data's time into `phase['data_s']`."
    from capbook.models import build
    name = ch.model(p)
    with timed(phase if phase is not None else {}, "data_s"):
        prep = chapter_data(ch, p)
        log(prep.describe())
        inputs = ch.inputs(prep, p, log) if ch.inputs else {}  # per-image inputs besides the features (attributes)
    seed_everything(p.seed)
    model = build(name, len(prep.vocab), prep.feat_shape[1], prep.grid, **model_hparams(name, p))
    return prep, inputs, model, train_config(ch, p, name, prep.max_len)

def scst_start(model, xe: Path) -> None:
    "A self-critical arm's start: the cross-entropy run's (in checkpoint folder `xe`) selected weights."
    model.load_state_dict(load_torch(xe / "best.pt", "cross-entropy checkpoint")["model"])

def run_chapter(notebook: str, namespace: Mapping[str, Any] | Any, log: Callable[[str], None] = print) -> ChapterRun:
    "Run a chapter with the parameters in `namespace` (the notebook's `globals()`, or a parameters dataclass)."
    from capbook.models import make_config
    from capbook.train import fit
    from capbook.metrics import evaluate, write_results
    from capbook.viz import attention_figure
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
        + f"; {cfg.epochs} epochs at most")
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
        save_test_captions(run.path("test_captions-xe.pt"), ev, grid)
        xe = run.path("ckpt")
        for arm, baseline in scst_arms(p):           # each arm from the same start; the greedy baseline's last
            scst_start(model, xe)
            with timed(phase, "test_s"):
                rl, ev, evg = self_critical(model, prep, p, cfg, run.path(f"ckpt-{arm}"), log, start=xe / "last.pt", baseline=baseline)
            stages[arm] = {"metrics": measured(ev), "greedy": measured(evg), "baseline": baseline, "best_epoch": rl.best_epoch,
                           "best_at": rl.best_at, "train_s": rl.train_seconds, "val_s": rl.val_seconds, "history": rl.history,
                           "images_per_s": ev["timings"]["images_per_s"]}
            if arm != "scst": save_test_captions(run.path(f"test_captions-{arm}.pt"), ev, grid)
            phase["train_s"] += rl.train_seconds; phase["val_s"] += rl.val_seconds
            phase["test_s"] -= rl.train_seconds + rl.val_seconds   # self_critical's own time left in test: its test decodes
    ctx = ChapterRun(ch, p, run, prep, model, fitted, ev, {}, dev)
    with timed(phase, "measure_s"): extra = ch.measure(ctx) if ch.measure else {}
    save_test_captions(run.path("test_captions.pt"), ev, grid)
    write_results(run.path("captions_test.json"), results_ids(prep, "test", ev["keys"]), [" ".join(w) for w in ev["words"]])   # COCO results form
    with timed(phase, "figure_s"):
        if ev["captions"] and ev["captions"][0].alpha is not None and "feat_mask" not in prep.test.inputs:   # a grid to draw on
            i = figure_pick(ev, prep.gt)
            ctx.figure = attention_figure([{"label": ch.label(p), "image": prep.image_paths("test")[i], "words": ev["words"][i],
                                            "alpha": ev["captions"][i].alpha, "grid": tuple(grid)}], run.path(ch.figure(p)))
    ctx.record = run.record(measured(ev), timings={**phase, "train_captions_per_s": fitted.captions_per_s, **ev["timings"]},
                            n_params=model.n_params, device=str(dev), notes=ev["notes"], best_epoch=fitted.best_epoch, best_at=fitted.best_at,
                            history=fitted.history, model=name, hparams=hp, precision=fitted.precision,
                            data={"dataset": prep.dataset, "encoder": prep.encoder, "fingerprint": prep.fingerprint},
                            samples=[{"key": k, "caption": " ".join(w)} for k, w in list(zip(ev["keys"], ev["words"]))[:20]],
                            **({"stages": stages} if stages else {}), **({"world_size": fitted.world_size} if fitted.world_size > 1 else {}),
                            **inputs, **extra)
    if given.run_dir is None:                      # a reader's run by hand: where it falls among the book's own rows
        for line in book_context(notebook, p, ctx.record): log(line)
    return ctx

# %% [markdown]
# ### Several GPUs: the training under `torchrun`
#
# A run trains in the notebook's kernel, one process. Where its job has several GPUs (a SLURM step that asks for them,
# `capbook.cluster`; or `CAPBOOK_TRAIN_PROCS=N` set by hand), `run_chapter` first trains every stage of the run —
# cross-entropy, then each self-critical arm from its selected weights — under `torchrun`, one process a GPU
# (`fit_stages`, the trainer's DistributedDataParallel path), and then goes on as always: each of its `fit` calls finds
# its stage's checkpoint finished and reads it, so evaluation, measurements, figure and record are the one path.
#
# > **Annotator's note.** DDP's batch is every process's batch: `N` processes train with `N × batch_size` captions a
# > step, another computation than the one-process run. So the run's record names its `world_size`, a checkpoint left
# > unfinished by `N` processes is never resumed by another number of them, and the book keys a step that trains with
# > several processes apart from the one-process step (`capbook.results.Keys`): its numbers are never published as the
# > one-process book's.

# %%
#| export
def fit_stages(notebook: str, run_dir: str | Path, log: Callable[[str], None] = print) -> None:
    "Train every stage of the chapter run in `run_dir` (its `params.yaml`, as `run_chapter` wrote it): cross-entropy, then each self-critical arm from its selected weights — what `run_chapter` trains, without its evaluations. Under torchrun (`capbook fit-chapter`) each process calls it: the run's DDP training."
    from capbook.core import load_yaml
    from capbook.train import dist_info, fit
    import torch.distributed as dist
    ch, d = chapter(notebook), Path(run_dir)
    known = {f.name for f in dataclasses.fields(ch.params)}
    p = ch.resolve(ch.params(**{k: v for k, v in load_yaml(d / "params.yaml").items() if k in known}))
    rank = dist_info()[0]
    say = log if rank == 0 else (lambda s: None)             # one process speaks
    prep, _, model, cfg = chapter_setup(ch, p, log=say)
    fit(model, prep, cfg, d / "ckpt", log=say)
    for arm, baseline in scst_arms(p) if p.scst_epochs else []:
        scst_start(model, d / "ckpt")
        scfg, objective = scst_setup(prep, p, cfg, baseline)
        fit(model, prep, scfg, d / f"ckpt-{arm}", log=say, objective=objective, start=d / "ckpt" / "last.pt")
    if dist.is_initialized(): dist.destroy_process_group()

def fit_under_torchrun(notebook: str, run_dir: Path, procs: int, log: Callable[[str], None] = print) -> None:
    "Train the chapter run in `run_dir` with `procs` processes under torchrun (`fit_stages`), its first process's lines logged as they come and kept in `run_dir/torchrun.log`; a failure stops in one line naming that log."
    import subprocess, sys
    log(f"training under torchrun: {procs} processes (DistributedDataParallel; a step's batch: {procs} x batch_size)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", "--no-python", sys.executable,
           "-c", "import sys; from capbook.cli import main; sys.exit(main())", "fit-chapter", notebook, str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)) // procs))}
    out = Path(run_dir) / "torchrun.log"
    with open(out, "w") as fh, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            fh.write(line); fh.flush()
            log(line.rstrip())
    if proc.returncode:
        raise CapbookError(f"{notebook}: its training under torchrun ({procs} processes) failed (exit status {proc.returncode}): see {out}")

# %%
#| export
_NOT_COMPARED = ("run_dir", "device", "seed")   # what a book row's seeds differ in, or what changes no number

def _compared(ch, params: dict) -> tuple[Any, dict]:
    "A chapter run's parameters as `run_chapter` resolves them, and those of them that change a number and do not vary over seeds."
    p = ch.resolve(ch.params(**{k: v for k, v in params.items() if k != "run_dir"}))
    if p.scst_epochs is None: p = dataclasses.replace(p, scst_epochs=0)
    return p, {k: v for k, v in dataclasses.asdict(p).items() if k not in _NOT_COMPARED}

def book_context(notebook: str, p, record: dict, metric: str = "CIDEr") -> list[str]:
    "Lines placing a run's test `metric` (x100; `record` its results record) among the book's rows of its chapter, at its profile and on its data, that differ from it in at most one parameter: each row's mean over its seeds, the mean's 95% interval (`_judged`: mean ± t_{n-1} sd/√n), its seeds' range, and where the run falls. Empty where the book has no such row."
    from capbook.plan import chapter_steps, replicas
    from capbook.records import step_record
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
        seeds = replicas(p.profile, step)
        try: recs = [step_record(p.profile, s) for s in seeds]
        except CapbookError: continue                                     # a row the book has not made (yet)
        if any(Path(r["_dir"]) != runs_dir() / p.profile / s.name for r, s in zip(recs, seeds)): continue   # only the book's own runs (or their published records), never a run by hand
        if any(r["data"]["fingerprint"] != record["data"]["fingerprint"] for r in recs): continue   # other data: not comparable
        xs = np.array([100 * r["metrics"][metric] for r in recs])
        name = ch.label(row)
        what = "the same parameters" if not differ else f"{differ[0]}={theirs[differ[0]]!r}; this run {mine[differ[0]]!r}"
        if len(xs) > 1:
            lo, hi, _, _ = _judged(xs.mean(), xs.var(ddof=1) / len(xs), len(xs) - 1)
            where = "inside" if xs.min() <= value <= xs.max() else "above" if value > xs.max() else "below"
            rows.append(f"  {name} [{what}]: {xs.mean():.1f}, 95% interval of the mean [{float(lo):.1f}, {float(hi):.1f}], "
                        f"{len(xs)} seeds from {xs.min():.1f} to {xs.max():.1f}: this run is {where} their range")
        else: rows.append(f"  {name} [{what}]: {xs[0]:.1f}, one seed (no interval)")
    if not rows: return []
    return [f"This run's test {metric} (x100, beam {p.beam_size}): {value:.1f}. The book's rows beside it (profile {p.profile}):", *rows]

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
