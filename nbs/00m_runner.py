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
# > Profiles, run folders and results records; the parameters every chapter run shares; the registry in which each paper chapter declares its runs, tables and figures; and `run_chapter`, the one call a chapter's run cell makes.

# %%
#| default_exp runner

# %%
#| export
from __future__ import annotations
import ast, contextlib, dataclasses, hashlib, inspect, math, os, platform, re, time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
import numpy as np
import torch
from capbook.core import (CapbookError, atomic_write, check_choice, check_float, check_int, code_version, cpu_name, file_digests, get_device,
                          io_error, io_errors_as_lines, load_torch, package_hash, project_root, runs_dir, save_json, save_torch,
                          save_yaml, seed_everything, stable_hash, cpu_precision)

# %% [markdown]
# ## Profiles
#
# A profile sets the sizes of everything: `smoke` is a minutes-long run for CI, `default` the book as published on a
# 2-core CPU, `paper` the papers' own settings for real data on a GPU. A profile means the same thing everywhere.

# %%
#| export
PROFILES = ("smoke", "default", "paper")

def check_profile(profile: str) -> str:
    "Stop unless `profile` is a known profile."
    return check_choice("profile", profile, PROFILES)

def out_dir(profile: str) -> Path:
    "Where a profile's tables and figures are published: `figures/` for the default profile, else inside its run folder."
    check_profile(profile)
    return project_root() / "figures" if profile == "default" else runs_dir() / profile / "figures"


# %%
try: check_profile("fast")
except CapbookError as e: print(e); assert "'smoke', 'default', 'paper'" in str(e)
assert out_dir("default").name == "figures" and out_dir("smoke").parts[-3:] == ("runs", "smoke", "figures")


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
# ## Notebook parameters: declared once, checked by name
#
# A chapter's parameters are a dataclass: the run's own (`RunConfig` below: data, seed, budget, decoding, device)
# followed by its model's config (`capbook.sat.SATConfig`, ...), each field with its default and a comment. The
# chapter's papermill `parameters` cell is **generated** from that dataclass (`parameters_source`; `make sync`
# rewrites it, and `tests/test_notebooks.py` fails when a cell and its dataclass disagree), so every default is
# declared once, in the library, where `import capbook` users see the same values, and papermill still sees a
# literal cell it can inspect and override (`papermill --help-notebook`, `-p kernel 5`).
#
# papermill passes an unknown name (`-p epoch 5`, a typo for `epochs`) into its injected cell with only a warning,
# and the run would silently train the default number of epochs. `read_params` therefore reads the sources of the
# cells the kernel has run (IPython's `In`), finds papermill's injected cell (it starts with `# Parameters`), and stops
# with one line naming any name it assigns that the dataclass does not have.

# %%
#| export
def _train_default(name: str):
    from capbook.train import TrainConfig
    return getattr(TrainConfig, name)

RECIPES = {   # TrainConfig over the protocol (its defaults) for a run's `recipe`
    "protocol": {},
    # capbook's recipe before the protocol (nbs/02b_protocol): captions bucketed by length, x0.8 every 3 epochs, no
    # averaging, validation once an epoch on BLEU-4 (Show-Attend-Tell's early stopping), 3 epochs' patience, 6 epochs
    "legacy": {"batch_order": "length", "schedule": "step", "lr_step": 3, "lr_gamma": 0.8, "ema": 0.0, "evals_per_epoch": 1,
               "patience": 3, "metric": "BLEU-4", "epochs": 6},
    # the book's protocol before it trained every run its whole budget (nbs/02b_protocol, the stopping rule checked): the
    # rate halved after one epoch without a better validation CIDEr, stopped after three
    "early-stop": {"schedule": "plateau", "lr_patience": 2, "patience": 6},
}

PROFILE_TRAIN = {"smoke": {"schedule": "step", "lr_step": 1000}}   # the smoke profile's one epoch is no budget to anneal over: a constant rate

PROFILE_LR = {"smoke": 1e-3}    # a profile's learning rate where the chapter and the run set none (else TrainConfig's 4e-4):
                                # the smoke book trains one epoch, and at 1e-3 its models learn what two epochs at 4e-4 did

BUDGET = {"smoke": 1, "default": 15, "paper": 30}   # the protocol's budget by profile: epochs, the rate annealed to 0 over them
LADDER = 2                      # the next budget, as a multiple, for a row still rising when the protocol's ends
RISING = 1.0                    # a seed is still rising when its last three epochs beat its best before them by more than this (CIDEr ×100; 02b_protocol)

def protocol_epochs(longer: bool | Callable[[Any], bool] = False) -> dict:
    "A chapter's `epochs`: the protocol's budget (`BUDGET`), or, for the rows `longer` picks (a function of a run's parameters, or True: every row), the ladder's next rung at the default profile — `LADDER` times its epochs — where most seeds of a row were still rising at the protocol's (`curve_end`, 02b_protocol)."
    if not longer: return dict(BUDGET)
    pick = longer if callable(longer) else (lambda p: True)
    return {**BUDGET, "default": lambda p: LADDER * BUDGET["default"] if pick(p) else BUDGET["default"]}

def ladder_twin(params: dict) -> dict:
    "A row's twin at the ladder's next rung (`LADDER` × the default profile's budget): the same parameters and seeds, more epochs, for a claim against a row trained that long (a claim compares its rows at one budget: `Claims.test`). Declare it for the default profile alone (`Chapter.only`): the other profiles train every row at one budget."
    return {**params, "epochs": LADDER * BUDGET["default"]}

@dataclass
class RunConfig:
    "The parameters every chapter run takes, besides its model's."
    profile: str = "default"        # smoke | default | paper: sizes and epochs
    dataset: str = "shapes"         # shapes | coco | flickr8k | flickr30k
    data_path: str | None = None    # folder with dataset_<name>.json and its images (real datasets)
    encoder: str | None = None      # None: the dataset's default (the shapes CNN; for real data, the paper's backbone)
    weights: str = "imagenet"       # real data: the encoder's weights, imagenet | random | /path/file.pth
    regions: str | None = None      # real data: folder of precomputed region features (<image>.npy, N x D) instead of a grid
    seed: int = 0                   # the training seed (initial weights, batches, dropout); the book repeats compared rows over SEEDS
    data_seed: int = 0              # the shapes data set's and its encoder's seed: fixed while the training seed varies
    epochs: int | None = None       # None: the chapter's default for the profile
    batch_size: int = _train_default("batch_size")   # captions per training step
    lr: float | None = None         # Adam's learning rate; None: the chapter's for the profile (smoke 1e-3, else 4e-4)
    beam_size: int = 3              # beam of the validation and test decodes
    length_norm: float = 0.0        # beams ranked by log-probability / length^length_norm (0: summed log-probability, as the papers)
    no_repeat_ngram: int = 0        # no n-gram of this size twice in a caption (0: off, as the papers)
    scst_epochs: int | None = 0     # then self-critical training on CIDEr-D for this many epochs (0: none; None: the chapter's default)
    scst_lr: float = 5e-5           # Adam's learning rate in self-critical training (Rennie et al.'s 5e-5)
    scst_baseline: str = "greedy"   # greedy: the greedy caption's reward (Rennie et al.) | mean: the other samples' mean | both: two arms from one start
    device: str = "auto"            # auto | cpu | cuda | cuda:N
    precision: str = "auto"         # the CPU's training arithmetic: auto (bf16 where the CPU has bfloat16 kernels: its instruction set, never a timing) | bf16 (autocast, as a GPU always does) | fp32
    recipe: str = "protocol"        # protocol: the book's one training protocol | early-stop: the protocol's rule before, halving on plateaus, stopping early | legacy: capbook's recipe before that (both: nbs/02b_protocol)
    run_dir: str | None = None      # set by `capbook book`; None: runs/<profile>/adhoc/...

    def check(self):
        "Stop with one line on an invalid run parameter."
        from capbook.prepare import DATASETS
        check_profile(self.profile); check_choice("dataset", self.dataset, DATASETS)
        check_int("seed", self.seed, lo=0); check_int("data_seed", self.data_seed, lo=0)
        check_int("batch_size", self.batch_size, lo=1)
        check_int("beam_size", self.beam_size, lo=1); check_float("length_norm", self.length_norm, lo=0.0, hi=5.0)
        check_int("no_repeat_ngram", self.no_repeat_ngram, lo=0)
        if self.epochs is not None: check_int("epochs", self.epochs, lo=1)
        check_float("lr", self.lr, lo=1e-7, hi=1.0)
        if self.scst_epochs is not None: check_int("scst_epochs", self.scst_epochs, lo=0)
        check_float("scst_lr", self.scst_lr, lo=1e-9, hi=1.0)
        check_choice("scst_baseline", self.scst_baseline, SCST_ARMS)
        from capbook.train import PRECISIONS
        check_choice("precision", self.precision, PRECISIONS); check_choice("recipe", self.recipe, RECIPES)
        get_device(self.device)

def _injected_names(namespace: Mapping[str, Any]) -> list[str]:
    "Names assigned by papermill's injected parameters cell(s), read from the kernel's input history."
    names = []
    for src in namespace.get("In", []) or []:
        if not isinstance(src, str) or not src.lstrip().startswith("# Parameters"): continue
        try: tree = ast.parse(src)
        except SyntaxError: continue
        names += [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)]
    return names

def read_params(spec: type | list[str], namespace: Mapping[str, Any]) -> Any:
    "The parameters a notebook was run with: a `spec` dataclass (or name list) filled from `namespace`; unknown injected names stop."
    known = [f.name for f in dataclasses.fields(spec)] if dataclasses.is_dataclass(spec) else list(spec)
    unknown = [n for n in _injected_names(namespace) if n not in known]
    if unknown:
        raise CapbookError(f"parameter {unknown[0]} is unknown: known parameters are {', '.join(known)}")
    values = {n: namespace[n] for n in known if n in namespace}
    return spec(**values) if dataclasses.is_dataclass(spec) else values

_FIELD = re.compile(r"^\s+(\w+)\s*:[^=#]*=\s*(?P<value>[^#]*?)\s*(?:#\s*(?P<doc>.*))?$")

def _field_docs(cls: type) -> dict[str, str]:
    "The trailing comment of each field's line in the class bodies of `cls` and its bases."
    docs = {}
    for c in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(c): continue
        try: lines = inspect.getsource(c).splitlines()
        except (OSError, TypeError): continue
        for line in lines:
            m = _FIELD.match(line)
            if m and m.group("doc"): docs[m.group(1)] = m.group("doc")
    return docs

def parameters_source(cls: type) -> str:
    "The papermill `parameters` cell of a parameters dataclass: one `name = default  # doc` line per field."
    docs, lines = _field_docs(cls), []
    fields = dataclasses.fields(cls)
    width = max(len(f"{f.name} = {f.default!r}") for f in fields)
    for f in fields:
        code = f"{f.name} = {f.default!r}"
        lines.append(f"{code:<{width}}  # {docs[f.name]}" if f.name in docs else code)
    return "\n".join(lines)


# %% [markdown]
# A typo in a papermill parameter stops the run; the generated cell renders every default:

# %%
_ns = {"In": ["", "# Parameters\nepoch = 5\nseed = 1\n"], "epoch": 5, "seed": 1}
try: read_params(RunConfig, _ns); raise AssertionError("a typo must stop the run")
except CapbookError as e: assert str(e).startswith("parameter epoch is unknown: known parameters are profile, dataset")
assert read_params(RunConfig, {"In": [], "seed": 1}).seed == 1
assert parameters_source(RunConfig).splitlines()[0].startswith("profile = 'default'") and "batch_size = 64" in parameters_source(RunConfig)


# %% [markdown]
# ## Chapters register themselves
#
# A paper chapter declares, in its own module, everything the book needs to run it (`Chapter` below): its notebook,
# the paper, its parameters dataclass, which registered model a parameter set trains, the runs the book executes (the
# paper's ablations, each a set of parameters over the defaults), its training schedule, what it measures beyond the
# common metrics, its attention figure, and the published tables and figures its assembly notebook regenerates. The
# book's plan, the docs site's chapter list, the notebook tests and the README's chapter table are derived from the
# notebooks and these declarations (`capbook.book`); adding a chapter touches no list anywhere else.
#
# Two fields serve chapters whose paper sizes do not fit the default profile on a CPU: `sizes` gives, per profile, the
# values of model parameters that the parameters dataclass leaves `None` (the transformer's widths: the paper's at
# `paper`, smaller at `default`), and a run's record keeps the values it used. `compares` names other chapters whose
# runs the assembly notebook puts beside this chapter's (the transformer is compared with Show-Attend-Tell's soft
# attention), so the book reruns the assembly when one of them changes. A parameters field named like a
# `capbook.train.TrainConfig` field (the transformer's `max_words`) is passed to the trainer.

# %%
#| export
@dataclass
class Chapter:
    "A paper chapter's declaration: how to run it, which runs the book executes, what it publishes."
    notebook: str                               # the notebook's file stem, e.g. '03_spca'
    paper: str                                  # the paper, cited
    url: str                                    # its public identifier (arXiv / DOI link)
    params: type                                # the parameters dataclass (RunConfig + the model's config)
    model: Callable[[Any], str]                 # parameters -> registered model name
    runs: dict[str, dict]                       # tag -> parameters over the defaults; '' is the chapter's own run
    epochs: dict[str, int | Callable[[Any], int]]   # default epochs per profile (or a function of the parameters)
    label: Callable[[Any], str]                 # parameters -> the row label of its attention figure
    figure: Callable[[Any], str]                # parameters -> the attention figure's file name
    train: dict = field(default_factory=dict)   # TrainConfig fields the paper fixes (schedule, selection metric)
    encoder: str = "vgg16"                      # the paper's backbone for real data
    check: Callable[[Any], None] | None = None  # extra parameter checks (combinations)
    measure: Callable[[Any], dict] | None = None   # ChapterRun -> extra measurements for its results record
    tables: dict[str, Callable] = field(default_factory=dict)   # published tables (capbook.papers), by name
    figures: tuple[str, ...] = ()               # the figures its assembly notebook publishes
    sizes: dict[str, dict] = field(default_factory=dict)   # profile -> values of the parameters a run leaves None
    compares: tuple[str, ...] = ()              # other chapters whose runs its assembly notebook tabulates
    inputs: Callable[[Any, Any, Callable], dict] | None = None   # (prep, params, log) -> adds per-image inputs; a record entry
    seeds: dict[str, int] = field(default_factory=dict)   # tag -> seeds in place of SEEDS where a profile repeats runs: more for a headline claim in the 3-seed test's reach, 1 for a row no verdict rests on
    only: dict[str, tuple[str, ...]] = field(default_factory=dict)   # tag -> the only profiles that run it (a trial of one profile's sizes); every profile where absent

    def resolve(self, p: Any) -> Any:
        "Parameters `p` with each `None` the profile sizes filled in (`sizes[p.profile]`: a value, or a function of `p`), and a learning rate left None the profile's (`PROFILE_LR`)."
        fill = {k: v(p) if callable(v) else v for k, v in self.sizes.get(p.profile, {}).items() if getattr(p, k, 0) is None}
        if getattr(p, "lr", 0) is None and "lr" not in fill: fill["lr"] = PROFILE_LR.get(p.profile, _train_default("lr"))
        return dataclasses.replace(p, **fill) if fill else p

CHAPTERS: dict[str, Chapter] = {}

def register_chapter(ch: Chapter) -> Chapter:
    "Declare a paper chapter (called by the paper's module on import)."
    CHAPTERS[ch.notebook] = ch
    return ch

def chapters() -> dict[str, Chapter]:
    "Every declared chapter, by notebook (imports every capbook module, so each paper's declaration is made)."
    from capbook.models import _load_all
    _load_all()
    return dict(sorted(CHAPTERS.items()))

def chapter(notebook: str) -> Chapter:
    "The declaration of chapter `notebook`."
    chs = chapters()
    if notebook not in chs:
        raise CapbookError(f"chapter {notebook!r} is not declared: declared chapters are {', '.join(chs)}")
    return chs[notebook]

def model_hparams(name: str, params: Any) -> dict:
    "The fields of model `name`'s config taken from chapter parameters `params` (its preset fields left out, and a None the model's config does not default to None: the model's own default)."
    from capbook.models import spec
    s = spec(name)
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(s.config)
            if f.name not in s.preset and hasattr(params, f.name)
            and not (getattr(params, f.name) is None and f.default is not None)}


# %% [markdown]
# Show-Attend-Tell's chapter, for instance: its parameters dataclass renders its parameters cell, and a run's model
# takes the config fields from the parameters (the field its registry name fixes, `attention`, left out).

# %%
import capbook.runner as _runner                          # the installed module, where the chapters register
from capbook.sat import SATParams
_sat = _runner.chapter("02_show_attend_tell")
assert _sat.params is SATParams and _sat.model(SATParams(attention="hard")) == "sat_hard" and "" in _sat.runs
assert _runner.model_hparams("sat_hard", SATParams(attention="hard", lambda_r=1.0))["lambda_r"] == 1.0
assert "attention" not in _runner.model_hparams("sat_soft", SATParams()) and "lambda_r = 0.1" in parameters_source(SATParams)


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

def measured(ev: dict) -> dict:
    "An evaluation's metrics as a results record keeps them."
    return {**ev["metrics"], **({"semantic": ev["semantic"], "attention": ev["attention"]} if "semantic" in ev else {})}

def record_stage(rec: dict, which: str = "xe") -> dict:
    "A results record's metrics, training seconds and decoding speed after cross-entropy ('xe') or self-critical training ('scst'); a run without SCST has only 'xe'."
    if "stages" in rec: return rec["stages"][which]
    if which != "xe": raise CapbookError(f"run {rec.get('_dir', '?')} has no self-critical stage (scst_epochs was 0)")
    return {"metrics": rec["metrics"], "train_s": rec["timings"]["train_s"], "images_per_s": rec["timings"]["images_per_s"],
            "best_epoch": rec.get("best_epoch")}

def results_ids(prep, split: str, keys: list[str]) -> list:
    "The COCO results file's image ids of a split's images named by `keys` (their filenames)."
    ids = {r.key: r.image_id for r in prep.kdata.split(split)}
    return [ids[k] for k in keys]

def save_test_captions(path: Path, ev: dict, grid: list[int]) -> Path:
    "An evaluation's test captions (keys, tokens, words, attention and its grid) for the assembly notebooks and their intervals."
    return save_torch(path, {"keys": ev["keys"], "tokens": [c.tokens for c in ev["captions"]],
                             "alpha": [c.alpha for c in ev["captions"]], "words": ev["words"], "grid": grid})

SEEDS = {"smoke": 1, "default": 3, "paper": 1}   # training seeds of every chapter run the book makes, per profile (0, 1, ...)

def stage_stats(rec: dict, prep, which: str | None = None) -> dict | list[dict] | None:
    "Per-image statistics of a run's test captions for bootstrap intervals (`capbook.metrics.image_stats`): its final captions, or those after cross-entropy (`which='xe'`) of a run that went on with SCST where it kept them; None where it kept none; a list, one per seed, for a row of several seeds (`merge_seeds`). Cached in the run folder, keyed by the captions' content, the data and the package code."
    from capbook.metrics import image_stats
    if len(rec.get("seed_runs", [])) > 1: return [stage_stats(r, prep, which) for r in rec["seed_runs"]]
    d, final = Path(rec["_dir"]), ("scst" if "stages" in rec else "xe")
    which = which or final
    f = d / ("test_captions.pt" if which == final else f"test_captions-{which}.pt")
    kept = rec.get("test_words", {}).get("final" if which == final else which)   # a published record's captions (no run folder here)
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

CI_METRICS = ("BLEU-4", "CIDEr", "semantic F1")

def epochs_trained(history: list[dict]) -> float:
    "The epochs a run trained, from its validation history (the entries before cross-entropy's own, epoch -1, left out)."
    done = [h for h in history if h["epoch"] >= 0]
    return float(done[-1].get("epochs", done[-1]["epoch"] + 1)) if done else 0.0

def row_epochs(rec: dict) -> float:
    "A row's budget: the epochs its cross-entropy training ran (its first seed's), as a claim across rows names it where two differ (`Claims.test`)."
    return epochs_trained((rec.get("seed_runs") or [rec])[0]["history"])

def late_gain(history: list[dict], last: int = 3) -> float | None:
    "What a run's last `last` epochs gained: its best validation CIDEr (×100) in them minus its best before them (the cross-entropy stage); None for a run of `last` epochs or fewer."
    h = [(e.get("epochs", e["epoch"] + 1), e["val CIDEr"]) for e in history if e["epoch"] >= 0 and "val CIDEr" in e]
    if not h: return None
    end = h[-1][0]
    before = [c for x, c in h if x <= end - last]
    return 100 * (max(c for x, c in h if x > end - last) - max(before)) if before else None

def curve_end(gains: list[float | None], margin: float = RISING) -> str:
    "A row's curve at the end of its budget, from its seeds' `late_gain`: 'still rising' when more than half of its seeds gained more than `margin` (the row's budget is too short: it climbs the ladder, `protocol_epochs`), 'one seed' where there is no spread to read it against."
    if not gains or None in gains: return "too short to tell"
    if len(gains) == 1: return "one seed"
    return "still rising" if 2 * sum(g > margin for g in gains) > len(gains) else "flat or falling"

def _seeds(stats: dict | list | None) -> list[dict] | None:
    "A row's per-image statistics as a list over its seeds; None if any seed kept no captions."
    stats = stats if isinstance(stats, list) else [stats]
    return None if any(s is None for s in stats) else stats

def interval_cells(stats: dict | list[dict] | None, metrics: tuple[str, ...] = CI_METRICS) -> dict:
    "A table row's 95 % intervals, one cell per metric ('[lo, hi]', ×100): Student's t over its seeds and test images, each variance component counted once (`capbook.metrics.seed_t_test`); a row of one seed gets the test images' interval alone, marked 'images only'; '—' where a run kept no captions."
    from capbook.metrics import seed_t_test
    st = _seeds(stats)
    def cell(m):
        if st is None or m not in st[0]: return "—"
        r = seed_t_test([s[m] for s in st], m)
        return f"[{r['lo']:.1f}, {r['hi']:.1f}]" + (" images only" if r["images_only"] else "")
    return {f"{m} 95% CI": cell(m) for m in metrics}

SEED_METRICS = {"CIDEr": "CIDEr", "semantic F1": "F1 all"}   # the spread over seeds a table shows: metric -> results_row column

def seed_cells(rec: dict, which: str | None = None) -> dict:
    "A table row's spread over training seeds: the number of seeds and the sample standard deviation (×100) of CIDEr and semantic F1 ('—' with one seed)."
    from capbook.metrics import results_row
    runs = rec.get("seed_runs", [rec])
    rows = [results_row(record_stage(r, which or ("scst" if "stages" in r else "xe"))["metrics"]) for r in runs]
    sd = lambda c: f"{np.std([r[c] for r in rows], ddof=1):.1f}" if len(rows) > 1 and all(c in r for r in rows) else "—"
    return {"seeds": len(runs), **{f"{m} sd": sd(c) for m, c in SEED_METRICS.items()}}

def paired_verdict(a: dict | list | None, b: dict | list | None, metric: str = "CIDEr", also: tuple[str, ...] = ("semantic F1",),
                   paired: bool = False, best: str | None = None) -> dict:
    "The test of the claim 'a scores higher than b' on the same test images with the seed as the unit of replication (`capbook.metrics.seed_t_test`): difference, 95 % t-interval, p, and holds / does not hold / cannot tell — or 'one seed: no verdict' where a row has one seed; the text adds the verdict on each `also` metric and says where they disagree. `paired`: `a` is a stage that continued `b` seed by seed (self-critical after cross-entropy): the test is on the per-seed differences, and a stage that kept its start in every seed is no test at all ('kept its start in every seed', `best` the stage's own best score beside it)."
    from capbook.metrics import seed_t_test
    A, B = _seeds(a), _seeds(b)
    if A is None or B is None: return {"verdict": "cannot tell: captions not kept", "p": None, "text": "cannot tell: a run kept no test captions"}
    if metric not in A[0]: return {"verdict": f"cannot tell: no {metric}", "p": None, "text": f"cannot tell: no {metric} on this data"}
    if paired and len(A) == len(B) and all(np.array_equal(x[metric], y[metric]) for x, y in zip(A, B)):
        return {"verdict": "kept its start in every seed", "p": None, "value": 0.0, "paired": True,
                "text": "kept its start in every seed: no test" + (f" ({best})" if best else "")}
    test = lambda m: seed_t_test([s[m] for s in A], m, [s[m] for s in B], paired=paired)
    def fmt(m, r):
        if r["images_only"]:
            return f"{r['verdict']} ({m} {r['value']:+.1f}; over the test images alone 95% CI [{r['lo']:+.1f}, {r['hi']:+.1f}])"
        over = f"paired t over {len(A)} seeds" if paired else f"t over {len(A)} vs {len(B)} seeds"
        return (f"{r['verdict']} ({m} {r['value']:+.1f}, 95% CI [{r['lo']:+.1f}, {r['hi']:+.1f}], "
                f"{over} and the test images, df {r['df']:.1f}, " + (f"p {r['p']:.3f})" if r["p"] >= 0.001 else "p < 0.001)"))
    r, others = test(metric), {m: test(m) for m in also if m != metric and m in A[0]}
    text = fmt(metric, r) + "".join(f"; on {m}: {fmt(m, o)}" for m, o in others.items())
    if not r["images_only"] and any(o["verdict"] != r["verdict"] for o in others.values()): text += " - the metrics disagree"
    return {**r, "also": others, "text": text}

def test_id(a, b, metric: str, paired: bool = False) -> str | None:
    "What a comparison tests, by content: the hash of both rows' per-image statistics of `metric` and the design; two claims with the same id are one test (the same two rows named twice, or a stage that kept its start compared again)."
    A, B = _seeds(a), _seeds(b)
    if A is None or B is None or metric not in A[0]: return None
    side = lambda X: hashlib.sha256(b"".join(np.ascontiguousarray(s[metric], dtype=np.float64).tobytes() for s in X)).hexdigest()
    return stable_hash([metric, paired, *sorted([side(A), side(B)])], 10)      # 'a above b' and 'b above a': one test

def stage_best(rec: dict, which: str = "scst") -> str:
    "A stage's own best validation CIDEr (×100) per seed against the score it started from, from its records' histories: what a stage that kept its start reached."
    runs = rec.get("seed_runs", [rec])
    pairs = []
    for r in runs:
        val = [100 * e["val CIDEr"] for e in r["stages"][which]["history"] if "val CIDEr" in e]
        if val: pairs.append(f"{max(val[1:], default=float('nan')):.1f} vs {val[0]:.1f}")
    return "its best validation CIDEr against its start's: " + ", ".join(pairs) if pairs else ""

class Claims:
    "The verdicts of one paper chapter, judged as one family: `test` is `paired_verdict` under a label with the paper's words it tests (`source`); the same comparison named twice is one test (`test_id`), and Holm's correction runs over the chapter's distinct tests; `table(section)` and `note(section)` show one table's share of the family."
    def __init__(self, metric: str = "CIDEr", alpha: float = 0.05):
        self.metric, self.alpha, self.tests = metric, alpha, {}

    def test(self, label: str, a, b, epochs: tuple[float, float] | None = None, source: str = "", section: str = "",
             paired: bool = False, caveat: str = "", **kw) -> dict:
        "`paired_verdict(a, b, self.metric, ...)`, kept under `label` with the paper's words or cells it tests (`source`); `epochs`: the two rows' cross-entropy budgets (`row_epochs`), which must be one (a claim across budgets would judge the budget: the shorter row's twin at the longer one, `ladder_twin`, is compared instead); `paired`: a stage against its own start; `caveat`: what a reader must know beside the verdict (what the stage did to the captions), shown with it."
        metric = kw.pop("metric", self.metric)
        if epochs is not None and epochs[0] != epochs[1]:
            raise CapbookError(f"claim {label!r} compares rows trained {epochs[0]:g} and {epochs[1]:g} epochs: compare the shorter row's "
                               "twin at the longer budget (capbook.runner.ladder_twin)")
        r = paired_verdict(a, b, metric, paired=paired, **kw)
        tid = test_id(a, b, metric, paired) if r.get("p") is not None else None
        self.tests[label] = {**r, "test": tid, "source": source, "section": section, "metric": metric, "caveat": caveat}
        return self.tests[label]

    def text(self, label: str, a, b, **kw) -> str:
        return self.test(label, a, b, **kw)["text"]

    def add(self, label: str, parts: dict[str, dict], all_parts: bool = True, source: str = "", section: str = "",
            verdict: str | None = None) -> dict:
        "A claim judged from several tests `parts` (metric: `paired_verdict`): 'every part holds' (`all_parts`) holds when every part holds, its p the intersection-union p (the largest), and does not hold when one part is reliably the other way (Bonferroni's p over the parts); 'some part holds' the reverse. `verdict` overrides the rule (a claim whose words read a test otherwise)."
        from capbook.metrics import compound_p
        vs, ps = [t["verdict"] for t in parts.values()], [t.get("p") for t in parts.values()]
        if verdict is None:
            if any(t["verdict"].startswith(("cannot tell:", "kept")) for t in parts.values()): verdict = next(v for v in vs if v.startswith(("cannot tell:", "kept")))
            elif None in ps: verdict = "one seed: no verdict"
            elif all_parts: verdict = "holds" if all(v == "holds" for v in vs) else "does not hold" if "does not hold" in vs else "cannot tell"
            else: verdict = "holds" if "holds" in vs else "does not hold" if all(v == "does not hold" for v in vs) else "cannot tell"
        p = None
        if None not in ps and verdict in ("holds", "does not hold", "cannot tell"):
            refuted = verdict == "does not hold"
            p = compound_p(ps, all_parts=(all_parts != refuted))   # IUT for "every part", Bonferroni for "some part"
        ids = sorted(t.get("test") or "" for t in parts.values())
        tid = hashlib.sha256("|".join([str(all_parts), *ids]).encode()).hexdigest()[:10] if p is not None else None
        if tid and len(parts) == 1: tid = ids[0]                 # one part: the same test as that part's
        self.tests[label] = r = {"verdict": verdict, "p": p, "test": tid, "source": source, "section": section,
                                 "parts": parts, "all_parts": all_parts, "text": verdict}
        return r

    def _family(self) -> dict[str, float]:
        "The chapter's distinct tests, `{test id (or the label of a claim without one): p}`: what Holm's correction runs over."
        family = {}
        for k, r in self.tests.items():
            if r.get("p") is not None: family.setdefault(r["test"] or k, r["p"])
        return family

    def survivors(self) -> dict[str, bool]:
        "Each stated verdict (one with a p-value): does it survive Holm's correction over the chapter's distinct tests?"
        from capbook.metrics import holm
        family = self._family()
        keep = dict(zip(family, holm(list(family.values()), self.alpha)))
        return {k: keep[r["test"] or k] for k, r in self.tests.items() if r.get("p") is not None}

    def holm_cell(self, label: str) -> str:
        "'survives' / 'does not survive' Holm's correction over the chapter, or '—' for a claim that states no verdict."
        keep = self.survivors()
        return "—" if label not in keep else "survives" if keep[label] else "does not survive"

    def distinct(self) -> int:
        "How many distinct tests the chapter's family holds."
        return len(self._family())

    def note(self, section: str | None = None) -> str:
        "One paragraph under a table: its claims, the verdicts it states, how many are decided one by one and after Holm's correction over the chapter's distinct tests, and those that state none."
        keep = self.survivors()
        mine = {k: r for k, r in self.tests.items() if section is None or r["section"] == section}
        stated = [k for k in mine if k in keep]
        none = [k for k in mine if k not in keep]
        head = f"**Multiplicity.** {'This table' if section is not None else 'This chapter'} tests {len(mine)} claim{'s' * (len(mine) != 1)}"
        if not stated:
            return head + ": none states a verdict (each rests on a row with one seed, a stage that kept its start, or runs that kept no captions)."
        dup = len(stated) - len({mine[k]["test"] or k for k in stated})
        raw = [k for k in stated if mine[k]["verdict"] in ("holds", "does not hold")]
        sig = [k for k in stated if keep[k]]
        text = (f"{head} and states {len(stated)} verdict{'s' * (len(stated) != 1)}"
                + (f" ({dup} of them the same test as another claim, counted once)" if dup else "")
                + f": {len(raw)} {'is' if len(raw) == 1 else 'are'} decided at 5 % one by one; with Holm's correction over the "
                f"chapter's {self.distinct()} distinct test{'s' * (self.distinct() != 1)} (family-wise error {100 * self.alpha:.0f} %; "
                f"the other metrics beside a claim are secondary and not counted) {len(sig)} survive{'s' * (len(sig) == 1)}"
                + (": " + "; ".join(f"{k} ({mine[k]['verdict']})" for k in sig) if sig else "") + ".")
        if none: text += (f" {len(none)} claim{'s' * (len(none) != 1)} state{'s' * (len(none) == 1)} no verdict "
                          "(one seed, a stage that kept its start in every seed, or no captions kept).")
        return text

    def table(self, section: str | None = None):
        "The verdicts as a table (claim, the paper's words it tests, verdict, p, Holm over the chapter, test id): what a tables chapter publishes as `table_*_verdicts` and the README's verdict lines read."
        import pandas as pd
        design = lambda r: ({"design": ("paired" if r.get("paired") else "unpaired") + f" {r.get('metric', '')}",
                             "seeds": " vs ".join(map(str, np.atleast_1d(r["seeds"]))), "images": r.get("images"),
                             "seed sd": ", ".join(f"{x:.2f}" for x in r["seed sd"] if x is not None), "mean": ", ".join(f"{x:.2f}" for x in r["mean"]),
                             "image sd": r.get("image sd")} if "seed sd" in r and r.get("p") is not None else {})
        cols = ["claim", "in the paper", "verdict", "p", "Holm", "test", "caveat", "design", "seeds", "images", "seed sd", "mean", "image sd"]
        return pd.DataFrame([{"claim": k, "in the paper": r.get("source", ""), "verdict": r["verdict"], "p": r.get("p"),
                              "Holm": self.holm_cell(k), "test": r.get("test") or "", "caveat": r.get("caveat", ""), **design(r)}
                             for k, r in self.tests.items() if section is None or r["section"] == section], columns=cols)

def same_budget(a: Any, b: Any, epochs: Callable[[Any], float], twins: Mapping[Any, Any]) -> tuple[Any, Any]:
    "The two rows a claim between rows `a` and `b` compares (`epochs`: a row's cross-entropy budget, as `row_epochs` reads it): each itself where their budgets agree, else the shorter row's twin at the longer budget (`twins`: row -> its `ladder_twin` run); stops in one line where the shorter row has none."
    ea, eb = epochs(a), epochs(b)
    if ea == eb: return a, b
    short, long_ = (a, eb) if ea < eb else (b, ea)
    t = twins.get(short)
    if t is None or epochs(t) != long_:
        raise CapbookError(f"rows {a!r} and {b!r} trained {ea:g} and {eb:g} epochs, and {short!r} has no twin at {long_:g}: "
                           "declare one (capbook.runner.ladder_twin)")
    return (t, b) if ea < eb else (a, t)

def book_family(tables: dict, alpha: float = 0.05):
    "Holm's correction over every distinct verdict of the book: `tables` {chapter: its published verdicts}; one row per distinct test (the chapters and claims naming it joined), with its (first) chapter's Holm result beside the book-wide one."
    import pandas as pd
    from capbook.metrics import holm
    rows = {}
    for ch, df in tables.items():
        for r in df.itertuples(index=False):
            if pd.isna(r.p): continue
            key = r.test if isinstance(r.test, str) and r.test else f"{ch}:{r.claim}"
            if key in rows:                                  # the same test named again, here or in another chapter
                e = rows[key]
                if ch not in e["chapter"].split(", "): e["chapter"] += f", {ch}"
                if r.claim not in e["claims"].split("; "): e["claims"] += f"; {r.claim}"
                continue
            rows[key] = {"chapter": ch, "claims": r.claim, "verdict": r.verdict, "p": float(r.p), "Holm in its chapter": r.Holm}
    out = pd.DataFrame(list(rows.values()), columns=["chapter", "claims", "verdict", "p", "Holm in its chapter"])
    out["Holm over the book"] = ["survives" if k else "does not survive" for k in holm(list(out["p"]), alpha)]
    return out.sort_values("p", kind="stable").reset_index(drop=True)

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

SCST_SHARE = 2 / 3    # a self-critical stage's most epochs, as a share of its cross-entropy run's: the peers' (ruotianluo's recipes: 20 after 30)

def scst_budget(xe_epochs: int) -> int:
    "The most epochs a self-critical stage trains after `xe_epochs` of cross-entropy: `SCST_SHARE` of them, rounded up."
    return math.ceil(SCST_SHARE * xe_epochs)

SCST_ARMS = {"greedy": ("greedy",), "mean": ("mean",), "both": ("greedy", "mean")}   # a run's `scst_baseline`: the stage's arms, by baseline
SCST_WARMUP = 1.0     # epochs over which the rate climbs from where cross-entropy's cosine ended (0) to `scst_lr`: one continuous rate

def scst_arms(p: Any) -> list[tuple[str, str]]:
    "A run's self-critical arms, (stage name, baseline), in the order they train: every arm from the same cross-entropy start; the greedy baseline's (Rennie et al.) is the stage called 'scst' and trains last, the mean of the other samples' is 'scst-mean'."
    bs = SCST_ARMS[p.scst_baseline]
    return sorted([("scst" if b == bs[0] else f"scst-{b}", b) for b in bs], key=lambda a: a[0] == "scst")

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

def decoding(p: Any) -> dict:
    "The decoding options of a run's parameters besides the beam, as `evaluate` and `TrainConfig` (validation) take them: one decoding for test and validation."
    return {"length_norm": p.length_norm, "no_repeat_ngram": p.no_repeat_ngram}

def train_config(ch: Chapter, p: Any, name: str, max_len: int) -> Any:
    "The `TrainConfig` a run of chapter `ch` with resolved parameters `p` trains model `name` with: the model's recipe (registry), then the chapter's, then the run's own parameters (lr, seed, ...)."
    from capbook.models import spec
    from capbook.train import TrainConfig
    named = {f.name: getattr(p, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(p, f.name)}   # lr, seed, ...
    recipe = {**PROFILE_TRAIN.get(p.profile, {}), **RECIPES[getattr(p, "recipe", "protocol")]}
    epochs = ch.epochs[p.profile]
    epochs = recipe.get("epochs", epochs) if p.profile == "default" else epochs
    return TrainConfig(**{**spec(name).train, **ch.train, **recipe, **named, "epochs": p.epochs or (epochs(p) if callable(epochs) else epochs),
                          "max_len": max_len, "val_beam": p.beam_size, **decoding(p)})

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
TRAIN_PROCS = "CAPBOOK_TRAIN_PROCS"   # environment: the processes a chapter run trains with (DDP under torchrun, one a GPU); 1 when unset

def train_procs() -> int:
    "The processes a chapter run trains with (`TRAIN_PROCS`); a malformed value stops in one line."
    v = os.environ.get(TRAIN_PROCS, "1").strip()
    if not v.isdigit() or int(v) < 1:
        raise CapbookError(f"environment variable {TRAIN_PROCS}={v!r} is invalid: the processes a run trains with, a whole number of at least 1")
    return int(v)

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
    from capbook.results import step_record
    from capbook.metrics import _judged
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
# A chapter's claims through `Claims`: a difference well outside the seeds' spread holds and survives Holm's correction,
# one inside it cannot be told, and a row of one seed states no verdict. The same comparison under a second name is the
# same test, counted once; a stage that kept its start in every seed is no test; a stage that moved is tested seed by
# seed against its start; a compound claim takes the intersection-union p. (Per-image CIDEr as `image_stats` gives it.)

# %%
_rng = np.random.default_rng(0)
_img = _rng.gamma(2.0, 0.5, 300)
_row = lambda shift, S: [{"CIDEr": _img + shift + _rng.normal(0, 0.02) + _rng.normal(0, 0.2, 300)} for _ in range(S)]
_cl = Claims()
_base, _up = _row(0.0, 3), _row(0.4, 3)
assert _cl.test("clear", _up, _base, source="Table 1, CIDEr: 2 vs 1", section="t1")["verdict"] == "holds"
assert _cl.test("within the spread", _row(0.005, 3), _base)["verdict"] == "cannot tell"
assert _cl.test("one seed", _row(0.4, 1), _base)["verdict"] == "one seed: no verdict"
assert _cl.test("clear, said again", _up, _base)["test"] == _cl.tests["clear"]["test"]          # one test, two names
assert test_id(_base, _up, "CIDEr") == _cl.tests["clear"]["test"]                              # and either way round
assert _cl.test("the stage raised it", _base, _base, paired=True)["verdict"] == "kept its start in every seed"
_stage = [{"CIDEr": s["CIDEr"] + 0.03 + _rng.normal(0, 0.002)} for s in _base]                 # each seed continued, a little higher
assert _cl.test("the stage that moved", _stage, _base, paired=True)["verdict"] == "holds"
_both = _cl.add("higher in both", {"CIDEr": _cl.tests["clear"], "again": _cl.tests["the stage that moved"]})
assert _both["verdict"] == "holds" and _both["p"] == max(_cl.tests["clear"]["p"], _cl.tests["the stage that moved"]["p"])
assert _cl.distinct() == 4 and _cl.survivors()["clear"] and not _cl.survivors()["within the spread"]
assert list(_cl.table("t1")["in the paper"]) == ["Table 1, CIDEr: 2 vs 1"]                      # what a tables chapter publishes
assert "1 of them the same test as another claim, counted once" in _cl.note() and "2 claims state no verdict" in _cl.note()
_cl2 = Claims(); _cl2.test("same", _up, _base, epochs=(15, 15))
try: _cl2.test("longer", _up, _base, epochs=(30, 15)); raise AssertionError("a claim across budgets")
except CapbookError as e: assert "trained 30 and 15 epochs" in str(e)                # one budget per claim: the twin is compared
assert list(_cl2.tests) == ["same"]
_E = {"soft": 15, "soft at 30": 30, "up-down": 30, "ct": 30}.get
assert same_budget("up-down", "soft", _E, {"soft": "soft at 30"}) == ("up-down", "soft at 30")   # the shorter row's twin
assert same_budget("ct", "up-down", _E, {}) == ("ct", "up-down")
try: same_budget("soft", "ct", _E, {}); raise AssertionError("no twin")
except CapbookError as e: assert "has no twin at 30" in str(e)
assert interval_cells(_base)["CIDEr 95% CI"].startswith("[") and interval_cells(_base[:1])["CIDEr 95% CI"].endswith("images only")
_fam = book_family({"a": _cl.table(), "b": _cl2.table()})
assert len(_fam) == _cl.distinct() and "same" in "".join(_fam["claims"])       # the same test in two chapters: once
assert set(_fam["Holm over the book"]) <= {"survives", "does not survive"}
print(_cl.tests["clear"]["text"]); print(_cl.note())

# %% [markdown]
# Whether a row's budget was long enough, read off its seeds' validation curves: what a run gained in its last three
# epochs, and a row most of whose seeds gained more than a flat tail's wobble (`RISING`), which then trains at the
# ladder's next budget (`protocol_epochs`); `02b_protocol` states the rule and checks it on synthetic curves.

# %%
_curve = lambda *v: [{"epoch": -1, "val CIDEr": 0.0}] + [{"epoch": i, "epochs": i + 1, "val CIDEr": c} for i, c in enumerate(v)]
assert abs(late_gain(_curve(0.5, 0.8, 0.9, 0.9, 0.95)) - 15.0) < 1e-9       # best of epochs 3-5 minus best of 1-2
assert late_gain(_curve(0.5, 0.9, 0.8, 0.85, 0.8)) < 0 and late_gain(_curve(0.5, 0.6)) is None
assert curve_end([1.8, -0.1, 1.9]) == "still rising" and curve_end([1.8, 0.9, -1.9]) == "flat or falling" and curve_end([0.4]) == "one seed"
assert curve_end([0.3, 0.2, 0.9]) == "flat or falling" and curve_end([1.8, 1.1, -3, -2]) == "flat or falling"   # within a flat tail's wobble; half is not most
assert ladder_twin({"model": "x"}) == {"model": "x", "epochs": 30}
assert protocol_epochs()["default"] == 15 and protocol_epochs(longer=True)["default"](None) == 30

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
