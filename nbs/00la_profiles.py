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
# # profiles
#
# > The declarations every other room reads: profiles and the protocol's budgets, the parameters every chapter run shares, the registry in which each paper chapter declares its runs, the training seeds, the ladder rule and the self-critical stage's shape (the runner, the plan, the records and the keys sit above it).

# %%
#| default_exp profiles

# %%
#| export
from __future__ import annotations
import ast, dataclasses, inspect, math, os, re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
from capbook.core import CapbookError, check_choice, check_float, check_int, cpu_precision, get_device, project_root, runs_dir

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
PROFILE_SCST = {"smoke": {"max_steps": 12}}  # a profile's self-critical stage besides the protocol's: the smoke book checks that a stage
                                            # trains, validates, records, logs its reward curves and draws, not what it learns, and half
                                            # its epoch does that (12 of 24 steps: to the mid-epoch validation, past one `log_every`
                                            # window of curves); the other profiles train every epoch

PROFILE_PRECISION = {"smoke": "fp32"}   # a profile's CPU arithmetic where a run leaves precision 'auto' (else the CPU's, `cpu_precision`):
                                        # the smoke profile's matrices are too small for bfloat16 to pay for autocast's casts (00r_bench:
                                        # fp32 trains 1.3-1.7x faster at smoke sizes on an AVX-512-bf16 CPU), and in fp32 its runs do
                                        # the same arithmetic on every kind of CPU

def profile_precision(profile: str, precision: str = "auto", device: Any = "auto") -> str:
    "`precision` as a run of `profile` on `device` asks for it: for 'auto' on the CPU the profile's own (`PROFILE_PRECISION`) where it has one, else as given ('auto' stays for `fit` to resolve)."
    if precision == "auto" and profile in PROFILE_PRECISION and get_device(device).type == "cpu": return PROFILE_PRECISION[profile]
    return precision

def run_precision(profile: str, precision: str = "auto", device: Any = "auto") -> str:
    "The arithmetic a run of `profile` trains in on `device`: `profile_precision`, its 'auto' resolved as `fit` resolves it (`cpu_precision`: bf16 on a GPU and where the CPU has bfloat16 kernels, else fp32)."
    return cpu_precision(profile_precision(profile, precision, device), get_device(device))

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
    draws: str = "torch"            # the models' random draws: torch (torch's generator: the CPU book's runs) | keyed (a function of seed and step, as stacked runs draw: `capbook book --device`)

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
        from capbook.train import DRAWS
        check_choice("draws", self.draws, DRAWS)
        get_device(self.device)

BOOK_SET = ("draws",)   # RunConfig fields that `capbook book --device` sets and a notebook's parameters cell leaves out: they came after the book's keys, which read the cells' code (a reader's run may still pass them with -p)

def book_set_defaults() -> dict:
    "The defaults of the `BOOK_SET` fields: a chapter run's values for them where neither its step nor its record names them."
    return {f.name: f.default for f in dataclasses.fields(RunConfig) if f.name in BOOK_SET}

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
    fields = [f for f in dataclasses.fields(cls) if f.name not in BOOK_SET]
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
assert "draws" not in parameters_source(RunConfig) and book_set_defaults() == {"draws": "torch"}   # the book sets it; a cell leaves it out


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
    paired: tuple[tuple[str, str], ...] = ()    # pairs of row tags that start alike at each seed (`capbook.train.same_start`, tested): the only rows a claim may test on per-seed differences

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
import capbook.profiles as _profiles                      # the installed module, where the chapters register
from capbook.sat import SATParams
_sat = _profiles.chapter("02_show_attend_tell")
assert _sat.params is SATParams and _sat.model(SATParams(attention="hard")) == "sat_hard" and "" in _sat.runs
assert _profiles.model_hparams("sat_hard", SATParams(attention="hard", lambda_r=1.0))["lambda_r"] == 1.0
assert "attention" not in _profiles.model_hparams("sat_soft", SATParams()) and "lambda_r = 0.1" in parameters_source(SATParams)

# %% [markdown]
# ## Seeds, the ladder rule, the self-critical stage
#
# Every chapter run of the book is repeated over the profile's training seeds (`SEEDS`), and a row's budget is read off
# its seeds' validation curves (`late_gain`, `curve_end`: the ladder rule that `02b_protocol` states and checks). A run
# that goes on with self-critical training trains each of its arms (`scst_arms`) for at most `scst_budget` epochs. The
# run's decoding options, its trainer's configuration and the processes it trains with (`decoding`, `train_config`,
# `train_procs`) are declared here too: the runner and the keys' probes read one definition.

# %%
#| export
SEEDS = {"smoke": 1, "default": 3, "paper": 1}   # training seeds of every chapter run the book makes, per profile (0, 1, ...)

def epochs_trained(history: list[dict]) -> float:
    "The epochs a run trained, from its validation history (the entries before cross-entropy's own, epoch -1, left out)."
    done = [h for h in history if h["epoch"] >= 0]
    return float(done[-1].get("epochs", done[-1]["epoch"] + 1)) if done else 0.0

def row_epochs(rec: dict) -> float:
    "A row's budget: the epochs its cross-entropy training ran (its first seed's), as a claim across rows names it where two differ (`Claims.test`)."
    return epochs_trained((rec.get("seed_runs") or [rec])[0]["history"])

def row_budget(rec: dict, stage: str = "xe") -> tuple[float, ...]:
    "A row's budget as a claim across rows must match it (`Claims.test`): its cross-entropy epochs (`row_epochs`), and for a self-critical stage's row (`stage`, a key of the record's `stages`) the epochs that stage trained after them (its first seed's)."
    rec0 = (rec.get("seed_runs") or [rec])[0]
    return (row_epochs(rec),) if stage == "xe" else (row_epochs(rec), epochs_trained(rec0["stages"][stage]["history"]))

def late_gain(history: list[dict], last: int = 3, upto: float | None = None) -> float | None:
    "What a run's last `last` epochs gained: its best validation CIDEr (×100) in them minus its best before them (the cross-entropy stage); None for a run of `last` epochs or fewer. `upto`: the run as a budget of `upto` epochs would have ended (its evaluations up to then), for a run whose rate does not read its budget (a self-critical stage's): a rung below, read off the longer run."
    h = [(e.get("epochs", e["epoch"] + 1), e["val CIDEr"]) for e in history if e["epoch"] >= 0 and "val CIDEr" in e]
    if upto is not None: h = [(x, c) for x, c in h if x <= upto + 1e-9]
    if not h: return None
    end = h[-1][0]
    before = [c for x, c in h if x <= end - last]
    return 100 * (max(c for x, c in h if x > end - last) - max(before)) if before else None

def curve_end(gains: list[float | None], margin: float = RISING) -> str:
    "A row's curve at the end of its budget, from its seeds' `late_gain`: 'still rising' when more than half of its seeds gained more than `margin` (the row's budget is too short: it climbs the ladder, `protocol_epochs`), 'one seed' where there is no spread to read it against."
    if not gains or None in gains: return "too short to tell"
    if len(gains) == 1: return "one seed"
    return "still rising" if 2 * sum(g > margin for g in gains) > len(gains) else "flat or falling"

SCST_SHARE = 2 / 3    # a self-critical stage's most epochs, as a share of its cross-entropy run's: the peers' (ruotianluo's recipes: 20 after 30)

SCST_RUNGS = 3        # the rungs the '+ SCST' rows' stages climbed at the default profile: most seeds of GLIED's and its base's arms still rising at 20 and again at 40, Att2in's at 40 and again at 80 (02b_protocol); one number for every such row, so that a claim between two compares one budget

def scst_budget(xe_epochs: int, rungs: int = 0) -> int:
    "The most epochs a self-critical stage trains after `xe_epochs` of cross-entropy: `SCST_SHARE` of them, rounded up, at the ladder's first rung; `rungs` up the ladder (`SCST_RUNGS` for the default book's '+ SCST' rows), `LADDER`**`rungs` times that, for a row whose stages were still rising at the end of each rung below (`curve_end` over its stages' seeds: the ladder rule holds for every row, a self-critical stage's too)."
    return math.ceil(SCST_SHARE * xe_epochs) * LADDER ** rungs

def rungs_below(epochs: int) -> list[int]:
    "The ladder's rungs below a budget of `epochs` (each `LADDER` times the one below it), from the nearest: the budgets a run that climbed trained at first."
    out = []
    while epochs % LADDER == 0 and epochs // LADDER >= 1: epochs //= LADDER; out.append(epochs)
    return out

SCST_ARMS = {"greedy": ("greedy",), "mean": ("mean",), "both": ("greedy", "mean")}   # a run's `scst_baseline`: the stage's arms, by baseline

SCST_WARMUP = 1.0     # epochs over which the rate climbs from where cross-entropy's cosine ended (0) to `scst_lr`: one continuous rate

def scst_arms(p: Any) -> list[tuple[str, str]]:
    "A run's self-critical arms, (stage name, baseline), in the order they train: every arm from the same cross-entropy start; the greedy baseline's (Rennie et al.) is the stage called 'scst' and trains last, the mean of the other samples' is 'scst-mean'."
    bs = SCST_ARMS[p.scst_baseline]
    return sorted([("scst" if b == bs[0] else f"scst-{b}", b) for b in bs], key=lambda a: a[0] == "scst")

def decoding(p: Any) -> dict:
    "The decoding options of a run's parameters besides the beam, as `evaluate` and `TrainConfig` (validation) take them: one decoding for test and validation."
    return {"length_norm": p.length_norm, "no_repeat_ngram": p.no_repeat_ngram}

def train_config(ch: Chapter, p: Any, name: str, max_len: int) -> Any:
    "The `TrainConfig` a run of chapter `ch` with resolved parameters `p` trains model `name` with: the model's recipe (registry), then the chapter's, then the run's own parameters (lr, seed, ...)."
    from capbook.models import spec
    from capbook.train import TrainConfig
    named = {f.name: getattr(p, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(p, f.name)}   # lr, seed, ...
    if "precision" in named: named["precision"] = profile_precision(p.profile, named["precision"], p.device)
    recipe = {**PROFILE_TRAIN.get(p.profile, {}), **RECIPES[getattr(p, "recipe", "protocol")]}
    epochs = ch.epochs[p.profile]
    epochs = recipe.get("epochs", epochs) if p.profile == "default" else epochs
    return TrainConfig(**{**spec(name).train, **ch.train, **recipe, **named, "epochs": p.epochs or (epochs(p) if callable(epochs) else epochs),
                          "max_len": max_len, "val_beam": p.beam_size, **decoding(p)})

TRAIN_PROCS = "CAPBOOK_TRAIN_PROCS"   # environment: the processes a chapter run trains with (DDP under torchrun, one a GPU); 1 when unset

def train_procs() -> int:
    "The processes a chapter run trains with (`TRAIN_PROCS`); a malformed value stops in one line."
    v = os.environ.get(TRAIN_PROCS, "1").strip()
    if not v.isdigit() or int(v) < 1:
        raise CapbookError(f"environment variable {TRAIN_PROCS}={v!r} is invalid: the processes a run trains with, a whole number of at least 1")
    return int(v)


# %% [markdown]
# Whether a row's budget was long enough, read off its seeds' validation curves: what a run gained in its last three
# epochs, and a row most of whose seeds gained more than a flat tail's wobble (`RISING`), which then trains at the
# ladder's next budget (`protocol_epochs`); `02b_protocol` states the rule and checks it on synthetic curves. The rule
# reads a self-critical stage's curve the same way (its history after the start's evaluation), and a row whose stages
# were still rising trains them at the next rung (`scst_budget(..., rungs=1)`), and so on up (`SCST_RUNGS`); its stages' checkpoints at
# the rung below go on where they stopped (`capbook.train`, *A budget that grows*), the rate of a stage not reading its budget.

# %%
_curve = lambda *v: [{"epoch": -1, "val CIDEr": 0.0}] + [{"epoch": i, "epochs": i + 1, "val CIDEr": c} for i, c in enumerate(v)]
assert abs(late_gain(_curve(0.5, 0.8, 0.9, 0.9, 0.95)) - 15.0) < 1e-9       # best of epochs 3-5 minus best of 1-2
assert late_gain(_curve(0.5, 0.9, 0.8, 0.85, 0.8)) < 0 and late_gain(_curve(0.5, 0.6)) is None
assert abs(late_gain(_curve(0.5, 0.8, 0.9, 0.9, 0.95, 0.2), upto=5) - 15.0) < 1e-9 and late_gain(_curve(0.5, 0.6, 0.7), upto=2) is None   # the run as a 5-epoch budget would have ended
assert curve_end([1.8, -0.1, 1.9]) == "still rising" and curve_end([1.8, 0.9, -1.9]) == "flat or falling" and curve_end([0.4]) == "one seed"
assert curve_end([0.3, 0.2, 0.9]) == "flat or falling" and curve_end([1.8, 1.1, -3, -2]) == "flat or falling"   # within a flat tail's wobble; half is not most
assert ladder_twin({"model": "x"}) == {"model": "x", "epochs": 30}
assert protocol_epochs()["default"] == 15 and protocol_epochs(longer=True)["default"](None) == 30
assert scst_budget(30) == 20 and scst_budget(30, rungs=1) == 40 and scst_budget(30, rungs=2) == 80
assert rungs_below(80) == [40, 20, 10, 5] and rungs_below(15) == []
