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
# # stages
#
# > What a chapter run trains, stage by stage: its data and model (`chapter_setup`), its cross-entropy stage, each self-critical arm from the selected cross-entropy weights (`scst_setup`, `self_critical`), and the same stages under `torchrun` on several GPUs (`fit_stages`); the runner and the keys' probes both train through it.

# %%
#| default_exp stages

# %%
#| export
from __future__ import annotations
import contextlib, dataclasses, os, time
from pathlib import Path
from typing import Any, Callable
from capbook.core import CapbookError, get_device, io_errors_as_lines, load_torch, seed_everything
from capbook.profiles import PROFILE_SCST, SCST_ARMS, SCST_WARMUP, Chapter, chapter, decoding, model_hparams, scst_arms, train_config

# %% [markdown]
# ## A run's data, model and stages
#
# `chapter_setup` prepares what a run of a chapter trains: the prepared data (the chapter's paper's encoder on real
# data), the per-image inputs the chapter declares (GLIED's attributes), the registered model seeded with the run's
# seed, and its training configuration. A run that goes on with self-critical training trains each arm from the same
# cross-entropy start (`scst_start`): the one trainer with the `SelfCritical` objective and the stage's own
# configuration (`scst_setup`), validated greedily as it trains (`self_critical`).

# %%
#| export
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
                               validate_start=True, label_smoothing=0.0, ss_start=-1,   # cross-entropy's options: self-critical training samples its own captions
                               draws="torch",   # from torch's generator, as the stage trains alone (never stacked), in a device book too
                               **PROFILE_SCST.get(getattr(p, "profile", None), {}))     # the smoke profile's short stage
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
    "What a run of chapter `ch` with resolved parameters `p` trains: (prepared data, per-image inputs' record, model seeded with `p.seed`, training config: `chapter_model`); the data's time into `phase['data_s']`."
    with timed(phase if phase is not None else {}, "data_s"):
        prep = chapter_data(ch, p)
        log(prep.describe())
        inputs = ch.inputs(prep, p, log) if ch.inputs else {}  # per-image inputs besides the features (attributes)
    return (prep, inputs, *chapter_model(ch, p, prep))

def chapter_model(ch: Chapter, p: Any, prep) -> tuple:
    "The model a run of chapter `ch` with resolved parameters `p` trains on `prep`, built from `p.seed`, and its training config."
    from capbook.models import build
    name = ch.model(p)
    seed_everything(p.seed)
    model = build(name, len(prep.vocab), prep.feat_shape[1], prep.grid, **model_hparams(name, p))
    return model, train_config(ch, p, name, prep.max_len)

def scst_start(model, xe: Path) -> None:
    "A self-critical arm's start: the cross-entropy run's (in checkpoint folder `xe`) selected weights."
    from capbook.train import BEST_PT
    model.load_state_dict(load_torch(xe / BEST_PT, "cross-entropy checkpoint")["model"])

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

# %% [markdown]
# ### Several seeds at once: a stacked pack
#
# On a GPU the book's models are launch-bound (`00r_bench`), and a row's seeds are runs of one architecture that differ
# only in numbers. `fit_pack` trains their cross-entropy stages as one stacked model (`capbook.stacked.fit_stacked`),
# each into its own run folder's `ckpt` under the keys the book gives its step (`envs`), where `run_chapter` would train
# it alone with `draws='keyed'`. Each run's notebook then finds its cross-entropy checkpoint finished and goes on as
# always: its evaluations, its self-critical stages (which sample outside the keyed draws and train alone), its
# measurements and its record. A pack's runs share everything but their seed and rate, and their data: a chapter whose
# per-image inputs depend on the seed (GLIED's attributes, found by a seeded detector) trains its runs alone.

# %%
#| export
def pack_params(notebook: str, params: dict) -> Any:
    "A chapter run's parameters as `run_chapter` resolves them (its profile's sizes, no self-critical stage where none is asked for)."
    ch = chapter(notebook)
    p = ch.resolve(ch.params(**{k: v for k, v in params.items() if k != "run_dir"}))
    return p if p.scst_epochs is not None else dataclasses.replace(p, scst_epochs=0)

def fit_pack(notebook: str, runs: list[tuple[dict, Path, dict[str, str] | None]], log: Callable[[str], None] = print) -> list:
    "Train the cross-entropy stages of runs of chapter `notebook` that differ only in their seed and rate as one stacked model, each into its run folder's `ckpt`: `runs` are (parameters, run folder, the book's keys for the run's step: `capbook.train.STEP_KEY`, `TRAINING_KEY`); each run's `draws` must be 'keyed', as a stacked run draws, so that its notebook finds the checkpoint trained as it would train it. Returns each run's `FitResult`."
    from capbook.profiles import RunConfig
    from capbook.stacked import fit_stacked
    if not runs: return []
    ch = chapter(notebook)
    if ch.inputs: raise CapbookError(f"{notebook}: its runs' per-image inputs depend on their seed ({ch.inputs.__name__}): train them alone")
    ps = [pack_params(notebook, params) for params, _, _ in runs]
    for p in ps:
        RunConfig.check(p)
        if ch.check: ch.check(p)
        if p.draws != "keyed": raise CapbookError(f"parameter draws={p.draws!r} is invalid for a stacked pack: allowed value is 'keyed' (what stacked runs draw)")
    row = lambda p: {k: v for k, v in dataclasses.asdict(p).items() if k not in ("seed", "lr")}
    if odd := next((p for p in ps[1:] if row(p) != row(ps[0])), None):
        differ = sorted(k for k, v in row(odd).items() if row(ps[0])[k] != v)
        raise CapbookError(f"{notebook}: a pack's runs may differ only in seed and lr; seed {odd.seed} differs from seed {ps[0].seed} in {', '.join(differ)}")
    prep = chapter_data(ch, ps[0])
    log(prep.describe())
    built = [chapter_model(ch, p, prep) for p in ps]
    log(f"{ch.model(ps[0])}: {len(runs)} runs stacked (seeds {', '.join(str(p.seed) for p in ps)})")
    return fit_stacked([m for m, _ in built], prep, [c for _, c in built], [Path(d) / "ckpt" for _, d, _ in runs], log=log,
                       envs=[e for _, _, e in runs])

