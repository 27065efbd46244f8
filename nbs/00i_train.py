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
# # train
#
# > One trainer for every model and objective: Adam with a learning-rate schedule (a cosine over the run's budget — the book's protocol —, halving on plateaus, step decay, or warm-up and inverse-square-root decay), weight averaging, validation within epochs, clipping, early stopping, exact resume after a kill, bfloat16 autocast (GPU, and CPU by default) and DistributedDataParallel under `torchrun`.

# %%
#| default_exp train

# %%
#| export
from __future__ import annotations
import contextlib, math, os, random, shutil, time
from dataclasses import dataclass, asdict, field, replace
from pathlib import Path
from typing import Callable
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from capbook.core import (CapbookError, PRECISION_CHOICES, autocast, check_choice, check_float, check_int, cpu_precision,
                          get_device, io_error, load_torch, one_writer, package_hash, progress, save_torch,
                          seed_everything, stable_hash)
from capbook.models import CaptionModel, captions_per_image, check_inputs, hparams, keyed, plain_paths
from capbook.data import BATCH_ORDERS, to_device
from capbook.objectives import CrossEntropy, Objective, objective_for
from capbook.decode import decode_split

# %% [markdown]
# ## Configuration
#
# **The defaults are the book's training protocol**, one for every model a table compares (measured and argued in
# `nbs/02b_protocol`): Adam at 4×10⁻⁴ (Show-Attend-Tell used Adam on COCO; SPCA its rate), mini-batches of 64 captions
# holding all five captions of each image (the peers' `seq_per_img`), gradient-norm clipping at 5, an exponential moving
# average of the weights (decay min(0.995, (1+t)/(10+t)) at step t: about 0.93 after one default epoch, 0.99 after ten)
# that is what gets validated and kept, validation twice an epoch on CIDEr with beam 3,
# and a fixed budget of 15 epochs over which the rate falls from 4×10⁻⁴ to 0 on a cosine, the weights kept from the
# evaluation with the best validation CIDEr. There is no early stop: stopping on a noisy validation curve decided
# results (a run cut on a plateau its sibling seeds climbed out of), so every run trains its whole budget and the
# annealed rate flattens its last epochs (`nbs/02b_protocol` measures the old rule beside it). The papers' own words
# where they have them: early stopping ("the only other regularization strategy we used was early stopping on BLEU
# score", Show-Attend-Tell; on CIDEr, GLIED) becomes the selection of the best validation evaluation; decay (SPCA:
# ×0.5 every five COCO epochs, ~35k steps) becomes the cosine, whose rate after a third and two thirds of the budget
# (0.75 and 0.25 of its peak) is close to SPCA's step schedule over fifteen epochs. A model whose paper or peers add something declares
# it once in its registry entry (`register(..., train=...)`: the transformers' warm-up), not per chapter.
#
# The learning-rate schedule is one function of the step, `lr_factor`, for every model: `schedule='step'` multiplies
# the rate by `lr_gamma` every `lr_step` epochs (the LSTM papers); `schedule='noam'` is the Transformer's (Vaswani et
# al. §5.3): a linear warm-up over `warmup` epochs to `lr`, then decay with the inverse square root of the step. A
# model whose paper or peers train it so declares it once in its registry entry (`register(..., train=...)`: the
# book's transformers), not per chapter. *capbook:* the warm-up is counted in epochs rather than steps so that one
# setting serves the smoke, default and paper profiles, whose epochs differ a hundredfold in steps; peers' 4k–33k
# steps are one to several COCO epochs.

# %%
#| export
@dataclass
class TrainConfig:
    "Everything the trainer needs besides the model and the data; saved in every checkpoint."
    epochs: int = 15            # the budget: epochs trained (fewer only with early stopping, patience > 0)
    max_steps: int = 0          # stop after this many optimisation steps, validated there (0: no limit; a budget, e.g. the COCO-scale rehearsal's)
    batch_size: int = 64        # captions per step (per process under DDP)
    lr: float = 4e-4            # Adam learning rate
    schedule: str = "cosine"    # step: x lr_gamma every lr_step epochs | noam: warm-up, then lr * sqrt(warm-up steps / step) | plateau: x lr_gamma after lr_patience evaluations without a better score | cosine: from lr to 0 over the run's steps
    lr_step: int = 3            # step: decay the learning rate every lr_step epochs ...
    lr_gamma: float = 0.5       # ... by this factor (step and plateau; SPCA's 0.5)
    lr_patience: int = 2        # plateau: evaluations without a better validation score before each decay
    warmup: float = 0.0         # epochs of linear warm-up from 0 to lr (either schedule; noam needs some)
    clip: float = 5.0           # gradient-norm clipping (0: off)
    patience: int = 0           # early stopping after this many evaluations without a better validation score (0: none, the whole budget is trained)
    evals_per_epoch: int = 2    # validation evaluations per epoch, evenly spaced (the last at the epoch's end)
    ema: float = 0.995          # weight averaging: decay of the exponential moving average validated, selected and kept (0: off)
    label_smoothing: float = 0.0   # ε of label-smoothed cross-entropy (0: off, as the five papers)
    ss_start: int = -1          # scheduled sampling from this epoch on (-1: off, as the five papers) ...
    ss_every: int = 5           # ... its probability raised every ss_every epochs ...
    ss_increase: float = 0.05   # ... by this much ...
    ss_max: float = 0.25        # ... up to this (self-critical.pytorch's defaults)
    metric: str = "CIDEr"       # validation metric for early stopping and model selection
    val_beam: int = 3           # beam size of the validation decode (1: greedy)
    length_norm: float = 0.0    # the validation beams ranked by log-probability / length^length_norm
    no_repeat_ngram: int = 0    # the validation decode writes no n-gram of this size twice (0: off)
    max_len: int = 20           # longest caption decoded
    seed: int = 0
    ckpt_every: int = 0         # also checkpoint every this many steps (0: at the end of each epoch only)
    batch_order: str = "image"  # length: captions bucketed by length | image: the captions of an image in one batch
    max_words: int = 0          # train on captions of at most this many words (0: every caption)
    device: str = "auto"
    progress: bool = True       # a progress bar per epoch (shown on a terminal only: `capbook.core.progress`)
    log_every: int = 10         # TensorBoard: the training terms averaged over this many steps, with every validation's scores, in <ckpt>/tb (0: no event files)
    validate_start: bool = False   # validate the starting weights first, as the history's epoch -1 (a stage's start, shown beside it; never kept: the stage keeps its own best)
    precision: str = "auto"     # the CPU's training arithmetic: auto (bf16 where the CPU has oneDNN's bf16 kernels, `cpu_precision`) | bf16 (autocast: products in bfloat16, weights in float32) | fp32
    draws: str = "torch"        # the models' random draws: torch (torch's generator, seeded once: the book's runs) | keyed (a function of seed, step and draw, on the plain paths: what stacked runs draw, `fit_stacked`)

    def check(self) -> TrainConfig:
        "Stop with one line on a value the trainer cannot use."
        check_int("epochs", self.epochs, lo=1); check_int("batch_size", self.batch_size, lo=1); check_int("max_steps", self.max_steps, lo=0)
        check_float("lr", self.lr, lo=1e-9, hi=10.0); check_int("lr_step", self.lr_step, lo=1)
        check_float("lr_gamma", self.lr_gamma, lo=1e-6, hi=1.0); check_float("clip", self.clip, lo=0.0)
        check_choice("schedule", self.schedule, LR_SCHEDULES); check_float("warmup", self.warmup, lo=0.0)
        if self.schedule == "noam" and not self.warmup:
            raise CapbookError("parameter warmup=0 is invalid with schedule='noam': expected a positive number of epochs")
        check_int("patience", self.patience, lo=0); check_choice("metric", self.metric, VAL_METRICS)
        check_int("lr_patience", self.lr_patience, lo=1); check_int("evals_per_epoch", self.evals_per_epoch, lo=1)
        check_float("ema", self.ema, lo=0.0, hi=0.99999); check_float("label_smoothing", self.label_smoothing, lo=0.0, hi=0.99)
        check_int("ss_start", self.ss_start, lo=-1); check_int("ss_every", self.ss_every, lo=1)
        check_float("ss_increase", self.ss_increase, lo=0.0, hi=1.0); check_float("ss_max", self.ss_max, lo=0.0, hi=1.0)
        check_int("val_beam", self.val_beam, lo=1); check_int("max_len", self.max_len, lo=1)
        check_float("length_norm", self.length_norm, lo=0.0, hi=5.0); check_int("no_repeat_ngram", self.no_repeat_ngram, lo=0)
        check_int("seed", self.seed, lo=0); check_int("ckpt_every", self.ckpt_every, lo=0); check_int("log_every", self.log_every, lo=0)
        check_choice("batch_order", self.batch_order, BATCH_ORDERS); check_int("max_words", self.max_words, lo=0)
        check_choice("precision", self.precision, PRECISIONS); check_choice("draws", self.draws, DRAWS)
        get_device(self.device)
        return self

VAL_METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr")
LR_SCHEDULES = ("step", "noam", "plateau", "cosine")
PRECISIONS = PRECISION_CHOICES
DRAWS = ("torch", "keyed")

# %% [markdown]
# ## The learning-rate schedule
#
# With $s$ the optimisation steps taken (from 1), $e$ the epoch, $w$ the warm-up in steps (`warmup` epochs):
#
# $$\text{step:}\quad lr \cdot \min(1, s/w) \cdot \gamma^{\lfloor e / \text{lr\_step} \rfloor} \qquad\qquad
#   \text{noam:}\quad lr \cdot \min(s/w, \sqrt{w/s})$$
#
# Noam's rate peaks at `lr` when the warm-up ends ($s = w$), as in the reference implementations that parameterise it
# by its peak; Vaswani et al.'s $d^{-0.5}$ factor is folded into `lr`.
#
# `schedule='cosine'` takes the rate from `lr` to 0 over the run's steps $T$ after the warm-up:
# $lr \cdot \min(1, s/w) \cdot \tfrac12\bigl(1 + \cos(\pi \, (s - w)/(T - w))\bigr)$, the schedule of a fixed budget
# (the book's `budget` recipe checks the protocol's stopping rule with it, `nbs/02b_protocol`).
#
# `schedule='plateau'` decays when validation stops improving rather than on a calendar: with $k$ the decays so far,
# the rate is $lr \cdot \min(1, s/w) \cdot \gamma^k$, and $k$ grows by one each time `lr_patience` consecutive
# evaluations bring no better validation score (Keras' and torch's `ReduceLROnPlateau`; sgrvinod's Show-Attend-Tell
# tutorial multiplies by 0.8 after 8 epochs without improvement). With early stopping after `patience` such evaluations,
# a run ends when its score has not moved through `patience // lr_patience` decays: trained until validation stops
# improving, whatever the model's speed, which is what the book's protocol asks (`nbs/01_dataset`).

# %%
#| export
def lr_factor(cfg: TrainConfig, step: int, epoch: int, steps_per_epoch: int, decays: int = 0) -> float:
    "The multiplier of `cfg.lr` for optimisation step `step` (1-based) in epoch `epoch`, after `decays` plateaus."
    w = cfg.warmup * steps_per_epoch                           # warm-up steps
    # min(1, s / w): linear warm-up
    warm = min(1.0, step / w) if w > 0 else 1.0
    if cfg.schedule == "cosine":
        T = cfg.max_steps or cfg.epochs * steps_per_epoch       # the run's steps
        # (1 + cos(pi (s - w) / (T - w))) / 2 after the warm-up
        return warm * (0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, step - w) / (T - w)))) if T > w else 1.0)
    if cfg.schedule == "noam":
        # min(s / w, sqrt(w / s))
        return min(warm, (w / step) ** 0.5)
    if cfg.schedule == "plateau":
        # gamma^k
        return warm * cfg.lr_gamma ** decays
    # gamma^floor(e / lr_step)
    return warm * cfg.lr_gamma ** (epoch // cfg.lr_step)


def ss_prob(cfg: TrainConfig, epoch: int) -> float:
    "Scheduled sampling's probability in epoch `epoch` (0-based): ss_increase per ss_every epochs after ss_start, at most ss_max."
    if cfg.ss_start < 0 or epoch <= cfg.ss_start: return 0.0
    # min(increase * floor((e - start) / every), max)
    return min(cfg.ss_increase * ((epoch - cfg.ss_start) // cfg.ss_every), cfg.ss_max)

# %%
assert [ss_prob(TrainConfig(ss_start=0, ss_every=2, ss_increase=0.1, ss_max=0.25), e) for e in range(8)] == [0, 0, 0.1, 0.1, 0.2, 0.2, 0.25, 0.25]
assert ss_prob(TrainConfig(), 100) == 0.0                                  # off by default
_c = TrainConfig(schedule="noam", warmup=1.0)
assert [round(lr_factor(_c, s, 0, 100), 3) for s in (1, 50, 100, 400)] == [0.01, 0.5, 1.0, 0.5]
_c = TrainConfig(schedule="step", lr_step=2, lr_gamma=0.5)
assert [lr_factor(_c, 1, e, 100) for e in range(5)] == [1.0, 1.0, 0.5, 0.5, 0.25]
_c = TrainConfig(schedule="plateau", lr_gamma=0.5)
assert [lr_factor(_c, 1000, 7, 100, k) for k in range(3)] == [1.0, 0.5, 0.25]
_c = TrainConfig(schedule="cosine", epochs=2)                # the budget recipe: from lr to 0 over the run's 200 steps
assert [round(lr_factor(_c, s, s // 100, 100), 3) for s in (0, 100, 200)] == [1.0, 0.5, 0.0]
_c = TrainConfig(schedule="cosine", epochs=3, warmup=1.0)   # after a warm-up: the cosine over the steps that are left
assert [round(lr_factor(_c, s, s // 100, 100), 3) for s in (50, 100, 200, 300)] == [0.5, 1.0, 0.5, 0.0]

# %% [markdown]
# ## Validation score
#
# Validation decodes the validation split with beam search (beam 3, as the test split) and scores it with pycocoevalcap's BLEU and CIDEr-D
# scorers on the dataset's own tokens (the Java tokenizer and METEOR are kept for the final evaluation in
# `capbook.metrics`, where they cost seconds rather than per-epoch minutes).
#
# *capbook:* greedy decoding makes a poor validation signal here. As training goes on, the single most likely
# next word leads greedy search into the shortest frequent caption ("there are two yellow objects"), so greedy BLEU
# falls (brevity penalty) while the likelihood and the beam-search captions keep improving; on shapes we measured
# greedy validation BLEU-4 dropping from 0.44 to 0.15 over three epochs while the training NLL went from 1.96 to 1.17.
# Beam search over the default profile's 500 validation images costs a few seconds, so validation uses it.

# %%
#| export
def val_score(model: CaptionModel, data, vocab, cfg: TrainConfig, device) -> dict:
    "Decode the validation split and return BLEU-1..4 and CIDEr on its references, and the captions (`captions`)."
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    caps = decode_split(model, data, cfg.val_beam, cfg.max_len, device=device, length_norm=cfg.length_norm, no_repeat_ngram=cfg.no_repeat_ngram)
    res = {i: [" ".join(vocab.decode(c.tokens)) or "<empty>"] for i, c in enumerate(caps)}
    gts = {i: [" ".join(r) for r in data.refs[i]] for i in range(len(caps))}
    b, _ = Bleu(4).compute_score(gts, res, verbose=0)
    c, _ = Cider().compute_score(gts, res)
    return {**{f"BLEU-{k+1}": float(v) for k, v in enumerate(b)}, "CIDEr": float(c), "captions": [r[0] for r in res.values()]}

# %% [markdown]
# ## Checkpoints and exact resume
#
# `last.pt` holds everything a run needs to continue as if it had never stopped: model, optimizer and scheduler
# states, the position in the data (epoch and batches done; the order of an epoch is a pure function of seed and epoch,
# see `CaptionData.batches`), the random generators (dropout draws from torch's), the early-stopping bookkeeping and
# the history. It is rewritten atomically at the end of every epoch (and every `ckpt_every` steps), so a run killed
# with SIGKILL at any moment restarts from the last one and ends with the same numbers. `best.pt` holds the weights of
# the best validation epoch. Both carry the vocabulary; resuming with a different one is an error. Everything in them
# is a tensor, number, string or container of those, so they load with `torch.load(weights_only=True)`. A checkpoint
# also records the package hash of the code that wrote it: a run restarted after capbook's code changed does not
# resume from it (its numbers would come from other code) but moves the old folder aside as `ckpt.code-<hash>` and
# trains from scratch, so regenerating the book always measures the current code and nothing computed is lost. A
# book's step is the exception, and the reason is the book's own rule for what is current: a finished step is kept
# while its key (`capbook.results.Keys`: the behaviour of the code it runs, its parameters, its data) is unchanged,
# whatever else in the package moved. The book hands that key to the step's kernel (`STEP_KEY`), the checkpoint keeps
# it, and an unfinished step resumes under the same key — an edit elsewhere in the package no longer throws away hours
# of a run the book would have kept had it finished. The book also hands the step's training key (`TRAINING_KEY`,
# `capbook.results.Keys.training`: the key without the statistics and the drawing, which no training computes with),
# and a checkpoint written under the same training key resumes too: a step re-keyed because its tables' test or its
# figures changed runs its notebook again on the checkpoints it finished (nothing left to train) instead of training
# them again. A run by hand has no step key and keeps the package's rule. The
# same holds for the data: `fit` keeps the data's fingerprint (`Prepared.fingerprint`: image contents, captions,
# splits, encoder weights, vocabulary) in the checkpoint's meta, and a checkpoint trained on other data is moved aside
# as `ckpt.data-<fingerprint>` — changed captions with the same vocabulary would otherwise resume, or report, the old
# model. A resumed run says what it resumed and why it is the same run. One process trains into a checkpoint folder at
# a time (`writing`, `capbook.core.one_writer`): a second training on the same folder — a job left by a killed book
# beside its duplicate, a run started by hand beside the book's — stops before it reads `last.pt`, in one line naming
# the live one, instead of resuming a checkpoint the other keeps rewriting.

# %%
#| export
def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_gauss": random.getstate()[2]}
    if torch.cuda.is_available(): st["cuda"] = torch.cuda.get_rng_state_all()
    return st

def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate((3, tuple(st["python"]), st["python_gauss"]))
    if "cuda" in st and torch.cuda.is_available(): torch.cuda.set_rng_state_all(st["cuda"])

RESUME_FREE = ("progress", "log_every", "ckpt_every", "device")   # TrainConfig fields a run may change and still resume

ADDED = {"draws": "torch"}   # TrainConfig fields added after checkpoints were first written, at the value older ones trained with

def _recipe(cfg: dict, meta: dict | None) -> dict:
    "What a checkpoint's training depends on besides code and data: the model, its sizes, and the training config."
    return {"model": (meta or {}).get("model"), "hparams": (meta or {}).get("hparams"),
            "config": {k: v for k, v in {**ADDED, **cfg}.items() if k not in RESUME_FREE}}

STEP_KEY = "CAPBOOK_STEP_KEY"   # environment: the key of the book step this process runs (`capbook.book.run_step`), set in its kernel
TRAINING_KEY = "CAPBOOK_TRAINING_KEY"   # environment: that step's training key (`capbook.results.Keys.training`), set beside it; after it, space-separated, the step's training keys at the ladder's lower rungs (`Keys.resuming`), and its first stage's key after `FIRST`
FIRST = "first="   # in `TRAINING_KEY`: the key of the step's cross-entropy stage where a self-critical stage follows it (`Keys.first_stage`)

def book_step_key() -> str | None:
    "The key of the book step this process runs (`STEP_KEY`), or None outside a book."
    return os.environ.get(STEP_KEY) or None

def _training_keys() -> list[str]: return [k for k in os.environ.get(TRAINING_KEY, "").split() if not k.startswith(FIRST)]

def book_training_key() -> str | None:
    "The training key of the book step this process runs (`TRAINING_KEY`'s first: its key without what only its tables and figures compute with), or None."
    return next(iter(_training_keys()), None)

def book_shorter_keys() -> tuple[str, ...]:
    "The training keys the book step this process runs had at the ladder's lower rungs of its budget (`TRAINING_KEY` after its first): a checkpoint its run finished at a shorter budget goes on from where it stopped (`_extends`)."
    return tuple(_training_keys()[1:])

def book_first_stage_key() -> str | None:
    "The key of the cross-entropy stage of the book step this process runs, where a self-critical stage follows it (`TRAINING_KEY`'s `FIRST` entry), or None: its checkpoints resume under it whatever changed in the self-critical training alone."
    return next((k[len(FIRST):] for k in os.environ.get(TRAINING_KEY, "").split() if k.startswith(FIRST)), None)

def _extends(was: dict, now: dict) -> bool:
    "Whether a run of recipe `now` (`_recipe`) is a run of recipe `was` given more epochs that trains its first epochs step for step as `was` did, so that `was`'s finished checkpoint goes on from where it stopped: the two differ in `epochs` alone, `now` has more, and nothing either trained read its budget — the rate follows a schedule that is not the cosine (whose rate at each step depends on the run's length: the step, plateau and inverse-square-root schedules do not) and no step budget (`max_steps`) ended it."
    a, b = was["config"], now["config"]
    others = {k for k in a.keys() | b.keys() if k != "epochs" and a.get(k) != b.get(k)}
    return (was["model"] == now["model"] and was["hparams"] == now["hparams"] and not others and a.get("epochs", 0) < b.get("epochs", 0)
            and b.get("schedule") != "cosine" and not b.get("max_steps"))

def _not_resumable(ck: dict | None, code: str, fp: str | None, recipe: dict | None = None, world: int = 1,
                   step: str | None = None, training: str | None = None, shorter: tuple[str, ...] = (),
                   first: str | None = None) -> tuple[str, str] | None:
    "Why checkpoint `ck` must not be resumed by this run of `world` processes, as (folder tag, reason), or None. `step`: the key of the book step this run belongs to, `training` its training key, `shorter` its training keys at the ladder's lower rungs, `first` (a cross-entropy stage that a self-critical one follows) its stage's key; a checkpoint written under the same key, or one of those training keys, or the same stage key, resumes whatever else in the package changed. A checkpoint whose recipe this run's extends (`_extends`: more epochs of a budget-free schedule) goes on from where it stopped, finished or not."
    if ck is None: return None
    same_step = ((step is not None and ck.get("step_key") == step) or (training is not None and ck.get("training_key") == training)
                 or ck.get("training_key") in shorter or (first is not None and ck.get("first_stage_key") == first))
    if ck.get("code") != code and not same_step:
        return f"code-{ck.get('code')}", f"was written by other capbook code ({ck.get('code')}, now {code}{f'; book step {step}' if step else ''})"
    # DDP's batch is every process's batch: an unfinished run goes on only with as many processes as it trained with; a
    # finished one (nothing left to train) is read by any (the book's kernel reads the training torchrun finished)
    was_world = ck.get("world_size", 1)
    if was_world != world and not ck.get("finished"):
        return f"world-{was_world}", f"was trained by {was_world} processes, this run has {world}"
    old = (ck.get("meta") or {}).get("data")
    if fp and old != fp: return f"data-{old}", f"was trained on other data (fingerprint {old}, this run's is {fp})"
    if recipe is not None:
        was = _recipe(ck.get("config") or {}, ck.get("meta"))
        if was != recipe and _extends(was, recipe):
            return None if was_world == world else (f"world-{was_world}", f"was trained by {was_world} processes, this run, which extends it, has {world}")
        if was != recipe:
            diff = [k for k in ("model", "hparams") if was[k] != recipe[k]] + sorted(
                k for k in set(was["config"]) | set(recipe["config"]) if was["config"].get(k) != recipe["config"].get(k))
            return f"recipe-{stable_hash(was, 8)}", f"was trained with other parameters ({', '.join(diff)})"
    return None

def _aside(folder: Path, tag: str) -> Path:
    "Rename `folder` to `<folder>.<tag>` (or `.<tag>-2`, ...), keeping what it holds."
    stale, k = folder.with_name(f"{folder.name}.{tag}"), 2
    while stale.exists(): stale, k = folder.with_name(f"{folder.name}.{tag}-{k}"), k + 1
    os.replace(folder, stale)
    return stale

def check_vocab(ckpt: dict, vocab, path: Path) -> None:
    "Stop if checkpoint `path` was made with another vocabulary than `vocab`."
    if ckpt.get("vocab") != vocab.itos:
        raise CapbookError(f"{path}: checkpoint was trained with a different vocabulary ({len(ckpt.get('vocab') or [])} "
                           f"words, this run has {len(vocab)}); use another run folder or delete the checkpoint")

# %% [markdown]
# ## Distributed training
#
# Under `torchrun` (environment variable `WORLD_SIZE` > 1) every process trains on its own, disjoint share of each
# epoch's captions (`CaptionData.batches(rank=, world=)`), gradients are averaged by DistributedDataParallel (NCCL on
# GPUs, gloo on CPUs), and rank 0 alone validates and writes checkpoints; its early-stopping decision is broadcast.

# %%
#| export
def dist_info() -> tuple[int, int, int]:
    "(rank, world size, local rank); initialises the process group under torchrun."
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if world > 1: return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", 0))
    return 0, 1, 0

# %% [markdown]
# ## One step
# The step every model trains with (and `capbook bench` times): the batch (a mapping of named inputs) moves to the
# device, the objective runs the model under autocast (`objective.outputs`) and scores its outputs against the batch
# in float32 (`objective.loss`), then backward, gradient-norm clipping, Adam. The objective is not part of the model
# (`capbook.objectives`): cross-entropy, hard attention's rule and self-critical training all take this step.
#
# **Precision.** On a GPU the model always runs under autocast (bfloat16 where the card has it, else float16 with a
# gradient scaler). On the CPU, `TrainConfig.precision` chooses: `bf16` runs the model's matrix products
# and convolutions under `torch.autocast("cpu", torch.bfloat16)` — their inputs rounded to bfloat16, their sums, the
# weights, the optimiser and the loss in float32 — and `fp32` runs everything in float32; `auto` (the default) takes
# bf16 only where oneDNN has bfloat16 kernels for this CPU (AVX-512 or newer: `capbook.core.cpu_bf16_kernels`). Which one wins
# depends on the machine, and by far. On an AVX machine without bfloat16 arithmetic oneDNN's bfloat16 products move
# half the bytes: measured with `capbook bench --alternatives` (one thread, default sizes), bf16 trained the
# transformers 1.8x as fast, NIC and LSTM 1.9x, the others 1.1–1.6x. On an AVX2 machine of the same 2-core kind
# the same autocast fell to a slow path: a 1024² product at 0.84 GFLOP/s against 38.7 in
# float32, the 2D-LSTM + SPCA step 5 against 40 captions/s — a fixed `bf16` default made every run there several
# times slower. The choice is read from the CPU's feature flags, not timed: timing both ways at each run's start (as
# capbook once did) let a loaded machine flip a run to float32 and move its numbers, and the same command and seed
# must give the same numbers. The arithmetic is resolved before anything trains and written into the run's config —
# so into its checkpoint, the recipe a resume is checked against, and its record (`precision`) — and a resumed run keeps
# its checkpoint's: a run started under `auto` and resumed on another machine does not switch arithmetic halfway. Where bf16 is chosen it
# trains the same models: two epochs at the default sizes, seed 0, fp32 against bf16, gave training losses equal to
# the fourth decimal and validation CIDEr 1.1942 / 1.1943 (spatial transformer), 1.0860 / 1.0859 (GLIED), 1.3101 /
# 1.3050 (soft attention), differences far inside what one seed to the next changes. `train_step` itself defaults to
# `fp32` (tests compare its weights bit for bit); the trainer passes the config's choice.

# %%
#| export
def step_loss(net, objective: Objective, batch: dict, device, precision: str = "fp32") -> tuple[torch.Tensor, dict]:
    "The objective's outputs of `net` under autocast and its loss on them in float32: (loss, terms)."
    with autocast(device, cpu_bf16=precision == "bf16"):
        out = objective.outputs(net, batch)
    return objective.loss(out, batch)

def train_step(net, model: CaptionModel, objective: Objective, opt, batch: dict, device, clip: float = 0.0,
               scaler=None, where: str = "", precision: str = "fp32") -> dict:
    "One optimisation step on `batch`; `net` is the model or its DDP wrapper. Returns the loss and the objective's terms."
    batch = to_device(batch, device)
    loss, stats = step_loss(net, objective, batch, device, precision)
    if not torch.isfinite(loss):
        feats = batch.get("feats")
        hint = ("the batch's features are not finite: extract them again" if isinstance(feats, torch.Tensor)
                and not torch.isfinite(feats).all() else "lower the learning rate (lr) or the gradient clip (clip)")
        raise CapbookError(f"loss is {loss.item()}{' at ' + where if where else ''} "
                           f"({', '.join(f'{k} {v:.4g}' for k, v in stats.items())}): {hint}; the last checkpoint is kept")
    opt.zero_grad(set_to_none=True)
    if scaler is not None and scaler.is_enabled():
        scaler.scale(loss).backward(); scaler.unscale_(opt)
    else: loss.backward()
    if clip: torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if scaler is not None and scaler.is_enabled(): scaler.step(opt); scaler.update()
    else: opt.step()
    return {"loss": loss.item(), **stats}

# %% [markdown]
# ## Weight averaging
#
# With `ema > 0` the trainer keeps an exponential moving average of the weights beside the weights it optimises, and
# validates, selects and keeps the average (Polyak averaging; the EMA of fairseq's and timm's recipes, and of the
# strongest COCO captioners' training):
#
# $$\bar\theta_t = d_t\,\bar\theta_{t-1} + (1 - d_t)\,\theta_t, \qquad d_t = \min\!\Big(d, \frac{1 + t}{10 + t}\Big)$$
#
# with $\bar\theta_0 = \theta_0$. The warm-up of $d_t$ (TensorFlow's `ExponentialMovingAverage` with `num_updates`)
# keeps the first evaluations from being dominated by the random start; it also means $d_t$ stays below $d$ for
# most of a run — it reaches 0.995 only after 1,790 steps, while a default epoch is about 116 — so the average covers
# roughly the last $t/9$ steps (`nbs/02b_protocol` tabulates it and measures the warm-up against a constant 0.995). *capbook:* on shapes, a few hundred Adam
# steps at a constant rate can switch the opening template of most validation captions (`nbs/01_dataset`); the
# average moves only as far as the weights move on average, so consecutive evaluations measure the model rather
# than the last few batches.

# %%
#| export
class WeightAverage:
    "An exponential moving average of a model's floating-point parameters and buffers (`decay` d, warmed up as (1+t)/(10+t))."
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay, self.t = decay, 0
        sd = model.state_dict()
        self.names = [k for k, v in sd.items() if v.is_floating_point()]
        self.live = [sd[k] for k in self.names]                    # views of the model's tensors
        self.avg = [v.detach().clone() for v in self.live]

    @torch.no_grad()
    def update(self) -> None:
        "One step of the average, after an optimiser step."
        self.t += 1
        d = min(self.decay, (1 + self.t) / (10 + self.t))
        # avg <- d * avg + (1 - d) * theta
        torch._foreach_lerp_(self.avg, self.live, 1.0 - d)

    @contextlib.contextmanager
    def swapped(self):
        "Inside the block the model holds the averaged weights; its own come back afterwards."
        own = [v.detach().clone() for v in self.live]
        with torch.no_grad():
            for v, a in zip(self.live, self.avg): v.copy_(a)
        try: yield
        finally:
            with torch.no_grad():
                for v, o in zip(self.live, own): v.copy_(o)

    def state_dict(self) -> dict:
        return {"t": self.t, "avg": [a.cpu() for a in self.avg]}

    def load_state_dict(self, st: dict) -> None:
        self.t = st["t"]
        for a, v in zip(self.avg, st["avg"]): a.copy_(v)

# %%
_m = torch.nn.Linear(2, 1); _avg = WeightAverage(_m, 0.5)
_w0 = _m.weight.detach().clone()
with torch.no_grad(): _m.weight.add_(1.0)
_avg.update()                                               # t = 1: d = min(0.5, 2/11) = 2/11
with _avg.swapped(): _wa = _m.weight.detach().clone()
assert torch.allclose(_wa, _w0 + 9 / 11) and torch.allclose(_m.weight, _w0 + 1)   # the average inside, the own weights after

# %% [markdown]
# ## The loop
#
# An epoch is the training captions in the batch order's shuffle; `evals_per_epoch` validations are spread evenly over
# it (the last at its end). Each evaluation decodes the validation split (with the averaged weights under `ema`),
# keeps the weights as `best.pt` when they beat every earlier evaluation on `metric`, counts the evaluations since the
# last improvement (early stopping after `patience`; a decay of the plateau schedule after every `lr_patience`) and
# checkpoints `last.pt`, so a killed run resumes at the evaluation, or the `ckpt_every` step, where it stopped. Each
# evaluation after the first also records how many validation captions changed since the one before (`val changed`)
# and how many changed their first two words (`val openings changed`: on shapes, the caption's template): a model
# that has settled changes few; one still swinging between templates changes most (`nbs/01a_protocol`).
#
# A run's bookkeeping (where it stands, its history, validation, `best.pt` and `last.pt`) is one object, `_Run`, and
# the loop drives a list of them with one step function: `fit` passes one run and `train_step`; `fit_stacked`
# (below) passes several runs of one architecture and the stacked step that trains them as one model.

# %%
#| export
BEST_PT, LAST_PT = "best.pt", "last.pt"   # in a run's checkpoint folder: its best weights; where it stands (to resume)

@dataclass
class FitResult:
    "What `fit` returns: the history (one entry per validation), best evaluation and score, timings."
    history: list = field(default_factory=list)
    best_epoch: int = -1             # the epoch (from 0) in which the kept weights were validated (-1: the starting weights)
    best_at: float = 0.0             # ... and the epochs trained by then (fractional with several evaluations per epoch)
    best_score: float = float("-inf")
    train_seconds: float = 0.0       # optimisation steps only
    val_seconds: float = 0.0         # the validation decodes and scores
    captions_per_s: float = 0.0
    resumed_from: tuple | None = None
    world_size: int = 1              # the processes that trained it (DDP under torchrun; a resumed run: its checkpoint's)
    captions: int = 0                # training captions seen (over every process)
    precision: str = "fp32"          # the arithmetic it trained in (`cpu_precision` of the config's)

class Curves:
    "A run's TensorBoard event files (`tensorboard --logdir runs/`): each training term (the loss, its parts, SCST's reward and baseline), averaged over `every` steps; the learning rate; every validation's scores."
    def __init__(self, folder: Path, every: int, resumed_at: int | None = None):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: a resumed run's curves go on from its checkpoint (saved after step resumed_at - 1); what an
        # interrupted run wrote after it is dropped when read
        self.writer = SummaryWriter(str(folder), purge_step=resumed_at, flush_secs=10)
        self.every, self.sums, self.n = every, {}, 0

    def train(self, step: int, terms: dict) -> None:
        for k, v in terms.items(): self.sums[k] = self.sums.get(k, 0.0) + v
        self.n += 1
        if self.n < self.every: return
        for k, v in self.sums.items(): self.writer.add_scalar(f"train/{k}", v / self.n, step)
        self.sums, self.n = {}, 0

    def validation(self, step: int, epochs: float, scores: dict) -> None:
        for k, v in scores.items(): self.writer.add_scalar("val/" + k.removeprefix("val ").replace(" ", "_"), v, step)
        self.writer.add_scalar("epochs", epochs, step)

    def close(self) -> None: self.writer.close()

def _eval_marks(n_batches: int, k: int) -> set[int]:
    "The batch counts after which an epoch of `n_batches` batches is validated `k` times (its end included)."
    return {max(1, round(j * n_batches / k)) for j in range(1, k + 1)}

class _Run:
    "One run inside `fit`'s loop: its model, objective, optimiser and average, its checkpoint folder, where it stands (epoch, batches done, steps) and its history; `validate`, `evaluation` and `save_last` are its bookkeeping."
    def __init__(self, model: CaptionModel, data, cfg: TrainConfig, ckpt_dir, meta: dict | None, log: Callable,
                 objective: Objective | None, rank: int, world: int, local: int, device, start: str | Path | None = None):
        cfg.check()
        objective = objective_for(model) if objective is None else objective
        if cfg.label_smoothing:
            if not isinstance(objective, CrossEntropy):
                raise CapbookError(f"parameter label_smoothing={cfg.label_smoothing} applies to cross-entropy training; {type(objective).__name__} has none")
            objective.label_smoothing = cfg.label_smoothing
        if cfg.ss_start >= 0 and type(objective).outputs is not Objective.outputs:
            raise CapbookError(f"parameter ss_start={cfg.ss_start}: scheduled sampling replaces teacher forcing, which {type(objective).__name__} does not train with")
        if model.name: meta = {"model": model.name, "hparams": hparams(model), **(meta or {})}
        check_inputs(model, next(data.train.image_batches(1)))
        ckpt_dir = Path(ckpt_dir); self.last, self.best = ckpt_dir / LAST_PT, ckpt_dir / BEST_PT
        try: ckpt_dir.mkdir(parents=True, exist_ok=True)              # a bad folder stops before any training
        except OSError as e: raise io_error(ckpt_dir, e, "create the checkpoint folder") from None
        seed_everything(cfg.seed)
        model.to(device); objective.to(device)
        self.model, self.objective, self.data, self.log, self.rank, self.world, self.device = model, objective, data, log, rank, world, device
        self.net = DDP(model, device_ids=[local] if device.type == "cuda" else None) if world > 1 else model
        self.opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        self.avg = WeightAverage(model, cfg.ema) if cfg.ema else None
        self.code, self.step_key, self.training_key, fp = package_hash(), book_step_key(), book_training_key(), getattr(data, "fingerprint", None)
        ck = load_torch(self.last) if self.last.exists() else None
        # the arithmetic, written into the config (so into the checkpoint, its recipe and the record): 'auto' is read from
        # the CPU's flags (`cpu_precision`), and a resumed run keeps the one its checkpoint trained in
        was = ((ck or {}).get("config") or {}).get("precision")
        self.cfg = cfg = replace(cfg, precision=was if cfg.precision == "auto" and was in ("bf16", "fp32") else cpu_precision(cfg.precision, device))
        self.res = FitResult(world_size=world, precision=cfg.precision)
        self.epoch = self.skip = self.bad = self.step = self.n = self.decays = 0
        self.tot, self.val_caps, self.stopped, self.finished = {}, None, False, False   # val_caps: the last evaluation's validation captions
        if fp: meta = {**(meta or {}), "data": fp}
        self.meta = meta
        # a first stage (no `start`) of a book step that has a later one: its stage's key (`book_first_stage_key`)
        self.first_key = book_first_stage_key() if start is None else None
        why = _not_resumable(ck, self.code, fp, _recipe(asdict(cfg), meta), world, self.step_key, self.training_key, book_shorter_keys(),
                             self.first_key)
        if why:
            stale = _aside(ckpt_dir, why[0]) if rank == 0 else None
            if world > 1: dist.barrier()
            log(f"{self.last} {why[1]}: moved to {stale}, training from scratch")
            ck = None
        if ck is not None:
            check_vocab(ck, data.vocab, self.last)
            model.load_state_dict(ck["model"]); self.opt.load_state_dict(ck["optimizer"])
            objective.load_state_dict(ck["objective"])
            if self.avg is not None: self.avg.load_state_dict(ck["ema"])
            self.epoch, self.skip, self.bad, self.step, self.decays = ck["epoch"], ck["batches_done"], ck["bad_evals"], ck["step"], ck["decays"]
            self.tot, self.n, self.val_caps = ck["epoch_sums"], ck["epoch_batches"], ck["val_captions"]
            r = self.res
            r.history, r.best_epoch, r.best_at, r.best_score = ck["history"], ck["best_epoch"], ck["best_at"], ck["best_score"]
            r.train_seconds, r.val_seconds, r.captions = ck["train_seconds"], ck["val_seconds"], ck["captions"]
            r.resumed_from, r.world_size = (self.epoch, self.skip), ck.get("world_size", 1)
            _set_rng_state(ck["rng"])
            was_epochs = (ck.get("config") or {}).get("epochs", cfg.epochs)
            # a finished run given more epochs (`_extends`) goes on, unless it had stopped early: the longer run stops there too
            grows = ck.get("finished") and was_epochs < cfg.epochs and self.epoch >= was_epochs and not (cfg.patience and self.bad >= cfg.patience)
            if ck.get("finished") and not grows: self.epoch, self.finished = cfg.epochs, True   # nothing to train, nothing to write again
            same = (f"same code ({self.code})" if ck.get("code") == self.code else
                    f"same book step ({self.step_key}; code {ck.get('code')} → {self.code})" if ck.get("step_key") == self.step_key else
                    f"same training ({self.training_key}; book step {ck.get('step_key')} → {self.step_key}, code {ck.get('code')} → {self.code})"
                    if ck.get("training_key") == self.training_key else
                    f"the same training at a shorter budget ({ck.get('training_key')}; code {ck.get('code')} → {self.code})"
                    if ck.get("training_key") in book_shorter_keys() else
                    f"the same first stage ({self.first_key}; training {ck.get('training_key')} → {self.training_key}, code {ck.get('code')} → {self.code})")
            if grows: same += f"; its {was_epochs} epochs extended to {cfg.epochs}, which its schedule ({cfg.schedule}) does not read"
            log(f"resumed from {self.last} at epoch {self.epoch}, batch {self.skip}: {same}, same data ({fp or 'not fingerprinted'}), "
                f"same vocabulary ({len(data.vocab)} words)")
        if ck is None and rank == 0 and (ckpt_dir / "tb").exists():
            shutil.rmtree(ckpt_dir / "tb")             # the curves of a run killed before its first checkpoint: nothing resumes them
        self.fresh = ck is None
        if self.fresh and start is not None:        # a stage that continues a run: its optimiser and average go on
            sck = load_torch(Path(start), "the checkpoint a stage continues")
            self.opt.load_state_dict(sck["optimizer"])       # Adam's moments and step count, for these very parameters
            if self.avg is not None and sck.get("ema"): self.avg.t = sck["ema"]["t"]   # the average (from the weights held) at its full decay
            log(f"continuing {start}: its Adam moments (step {float(self.opt.state_dict()['state'][0]['step']):g}) and weight average")
        self.curves = Curves(ckpt_dir / "tb", cfg.log_every, self.step + 1 if ck is not None else None) if cfg.log_every and rank == 0 else None

    @property
    def done(self) -> bool: return self.stopped or self.epoch >= self.cfg.epochs

    def save_last(self, finished: bool = False) -> None:
        if self.rank: return
        avg, r = self.avg, self.res
        save_torch(self.last, {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                               "objective": self.objective.state_dict(), "ema": avg.state_dict() if avg else None,
                               "epoch": self.epoch, "batches_done": self.skip, "step": self.step, "epoch_sums": self.tot,
                               "epoch_batches": self.n, "bad_evals": self.bad, "decays": self.decays, "history": r.history,
                               "best_epoch": r.best_epoch, "best_at": r.best_at, "best_score": r.best_score, "train_seconds": r.train_seconds,
                               "val_seconds": r.val_seconds, "captions": r.captions, "val_captions": self.val_caps, "rng": _rng_state(),
                               "vocab": self.data.vocab.itos, "config": asdict(self.cfg), "meta": self.meta or {}, "code": self.code, "step_key": self.step_key, "training_key": self.training_key, "first_stage_key": self.first_key,
                               "world_size": self.world, "finished": finished})
        self.finished = finished

    def validate(self, at: float, means: dict, candidate: bool = True) -> bool:
        "Score the (averaged) weights on validation after `at` epochs, log them, keep them as best.pt if they are the best so far (and a `candidate`)."
        cfg, res, data = self.cfg, self.res, self.data
        ep = -1 if at == 0 else math.ceil(at) - 1                        # the epoch it ends or falls in
        tv = time.time()
        with self.avg.swapped() if self.avg else contextlib.nullcontext():
            scores = val_score(self.model, data.val, data.vocab, cfg, self.device)
            caps = scores.pop("captions", None)
            better = candidate and scores[cfg.metric] > res.best_score
            if better:
                res.best_score, res.best_epoch, res.best_at = scores[cfg.metric], ep, at
                save_torch(self.best, {"model": self.model.state_dict(), "vocab": data.vocab.itos, "epoch": ep, "epochs": at,
                                       "scores": scores, "meta": self.meta or {}})
        res.val_seconds += time.time() - tv
        churn = {}
        if caps and self.val_caps and len(caps) == len(self.val_caps):     # how many validation captions changed since the last evaluation
            opening = lambda c: c.split()[:2]
            churn = {"val changed": sum(a != b for a, b in zip(caps, self.val_caps)) / len(caps),
                     "val openings changed": sum(opening(a) != opening(b) for a, b in zip(caps, self.val_caps)) / len(caps)}
        self.val_caps = caps
        res.history.append({"epoch": ep, "epochs": at, "step": self.step, **means, **{f"val {k}": v for k, v in scores.items()},
                            **churn, "train_s": res.train_seconds})
        if self.curves: self.curves.validation(self.step, at, {**scores, **churn})
        self.log((f"epoch {ep} ({at:g} trained): " if at != math.ceil(at) else f"epoch {ep}: ") + "  ".join(f"{k} {v:.4g}" for k, v in means.items()) + "  | val "
                 + "  ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        return better

    def evaluation(self, at: float) -> bool:
        "Validate after `at` epochs (every rank agrees); update early stopping and the plateau schedule; True: stop."
        cfg = self.cfg
        count = torch.zeros(1)                           # evaluations without a better score, decided by rank 0 ...
        if self.rank == 0: count[0] = 0 if self.validate(at, {k: v / max(self.n, 1) for k, v in self.tot.items()}) else self.bad + 1
        if self.world > 1: dist.broadcast(count, 0)      # ... and known to every rank, whose rates must decay together
        self.bad = int(count.item()); stop = bool(cfg.patience) and self.bad >= cfg.patience
        if cfg.schedule == "plateau" and self.bad and self.bad % cfg.lr_patience == 0 and not stop:
            self.decays += 1; self.log(f"no better {cfg.metric} for {self.bad} evaluations: learning rate x{cfg.lr_gamma:g}")
        self.tot, self.n = {}, 0
        if stop: self.log(f"early stop after {at:g} epochs: no better {cfg.metric} for {cfg.patience} evaluations")
        return stop

    def took(self, batch: dict, stats: dict, lr: float) -> None:
        "Book one optimisation step of this run on `batch` (its terms `stats`, at rate `lr`)."
        self.skip += 1; self.step += 1; self.n += 1; self.res.captions += len(batch["caps"]) * self.world
        terms = {**stats, "lr": lr, **({"ss_prob": self.objective.sample_prob} if self.cfg.ss_start >= 0 else {})}
        for k, v in terms.items(): self.tot[k] = self.tot.get(k, 0.0) + v
        if self.curves: self.curves.train(self.step, terms)

    def stop(self, log_line: str = "") -> None:
        "End this run here: its last checkpoint says it finished."
        self.stopped = True
        if log_line: self.log(log_line)
        self.save_last(finished=True)

def step_key(seed: int, step: int) -> int:
    "The key of run `seed`'s draws at optimisation step `step` (`capbook.models.keyed`): distinct for every (seed, step)."
    return (seed << 32) + step

def _eager_step(runs: list[_Run], batches: list[dict], lrs: list[float], where: str, scaler=None) -> list[dict]:
    "One run's step as `train_step` takes it (its draws from torch's generator, or from its key with `draws='keyed'`), then its weight average."
    r, b = runs[0], batches[0]
    for g in r.opt.param_groups: g["lr"] = lrs[0]
    draws = contextlib.ExitStack()
    if r.cfg.draws == "keyed":                 # the graph-ready path: keyed draws, plain paths, image groups found on the host
        draws = _keyed_plain(torch.tensor(step_key(r.cfg.seed, r.step), device=r.device))
        b = {**b, "caps": F.pad(b["caps"], (0, r.data.train.caps.shape[1] - b["caps"].shape[1]))}   # every caption at full width
        if G := captions_per_image(b["img"]): b = {**b, "captions_per_image": G}
    with draws:
        stats = train_step(r.net, r.model, r.objective, r.opt, b, r.device, r.cfg.clip, scaler, where=where, precision=r.cfg.precision)
    if r.avg is not None: r.avg.update()
    return [stats]

@contextlib.contextmanager
def _keyed_plain(key: torch.Tensor):
    "Keyed draws on the plain paths: what a stacked run draws and computes."
    with plain_paths(), keyed(key): yield

def _where(r: _Run, done: int, left: int, secs: float) -> str:
    "The bar's note on a run's progress: its last validation score and the time its budget has left, from this process's pace (`done` steps in `secs` seconds, validations included, `left` to go); a run that stops early ends sooner."
    last = next((h[f"val {r.cfg.metric}"] for h in reversed(r.res.history) if f"val {r.cfg.metric}" in h), None)
    val = f"val {r.cfg.metric} {last:.3f}" if last is not None else f"val {r.cfg.metric} not yet"
    eta = left * secs / done if done else None
    return val + ("" if eta is None else f", about {eta / 60:.0f} min left" if eta >= 90 else f", about {eta:.0f} s left")

def _loop(runs: list[_Run], step: Callable) -> None:
    "The epochs of `runs` (one, or several trained in step by a stacked step): `step(runs, batches, lrs, where)` takes one optimisation step of every run and returns each run's terms."
    first, data = runs[0], runs[0].data
    rank, world, cfg = first.rank, first.world, first.cfg            # cfg: what stacked runs share (all but `STACKABLE`)
    t_start, steps_here = time.time(), 0                              # this process's pace, for the bar's time left
    try:
        for r in runs:
            if r.fresh and r.cfg.validate_start and rank == 0:
                # the starting weights, validated for the history (epoch -1): where a stage starts, never a candidate
                r.validate(0.0, {}, candidate=False)
        sel = {"order": cfg.batch_order, "max_words": cfg.max_words}
        per_epoch = [data.train.num_batches(r.cfg.batch_size, world, 0, r.cfg.seed, **sel) for r in runs]   # steps of an epoch, for the warm-up
        while not all(r.done for r in runs):
            live = [r for r in runs if not r.done]
            epoch, skip = live[0].epoch, live[0].skip
            if any((r.epoch, r.skip) != (epoch, skip) for r in live):
                raise CapbookError("stacked runs must stand at one place to train in step: " + ", ".join(
                    f"seed {r.cfg.seed} at epoch {r.epoch}, batch {r.skip}" for r in live) + "; train them apart or clear their folders")
            counts = {data.train.num_batches(r.cfg.batch_size, world, epoch, r.cfg.seed, **sel) for r in runs}
            if len(counts) > 1:
                raise CapbookError(f"stacked runs must take as many steps an epoch: epoch {epoch} has {sorted(counts)} batches across their seeds; train them apart")
            n_batches = counts.pop()
            for r in runs:
                r.net.train(); r.objective.train()
                r.objective.sample_prob = ss_prob(r.cfg, epoch)          # scheduled sampling's probability this epoch (0: teacher forcing)
            marks, t0 = _eval_marks(n_batches, cfg.evals_per_epoch), time.time()
            its = [data.train.batches(r.cfg.batch_size, epoch, r.cfg.seed, rank, world, skip=skip, **sel) for r in runs]
            bar = progress(zip(*its), cfg.progress and rank == 0, total=n_batches - skip, desc=f"epoch {epoch}", leave=False)
            for bs in bar:
                if not bar.disable:                     # epoch, batch, the last validation and the time left: a terminal's view only
                    left = (cfg.epochs - epoch) * n_batches - live[0].skip
                    bar.set_postfix_str(_where(live[0], steps_here, left, time.time() - t_start), refresh=False)
                steps_here += 1
                # a run that stopped early is carried at rate 0 (a stacked step takes every member) and books nothing
                lrs = [0.0 if r.done else r.cfg.lr * lr_factor(r.cfg, r.step + 1, epoch, pe, r.decays) for r, pe in zip(runs, per_epoch)]
                terms = step(runs, list(bs), lrs, f"epoch {epoch}, step {live[0].step}")
                for r, b, st, lr in zip(runs, bs, terms, lrs):
                    if not r.done: r.took(b, st, lr)
                live = [r for r in runs if not r.done]
                skip, step_no = live[0].skip, live[0].step
                if cfg.max_steps and step_no >= cfg.max_steps and skip < n_batches:   # the step budget is spent mid-epoch: validate here, stop
                    dt = time.time() - t0
                    for r in live:
                        r.res.train_seconds += dt
                        r.evaluation(round(epoch + skip / n_batches, 3)); r.stop(f"stopped after max_steps={cfg.max_steps} steps")
                    break
                if skip in marks and skip < n_batches:                        # a validation inside the epoch
                    dt = time.time() - t0
                    for r in live:
                        r.res.train_seconds += dt
                        if r.evaluation(round(epoch + skip / n_batches, 3)): r.stop()
                        else: r.save_last(); r.net.train(); r.objective.train()
                    if all(r.done for r in runs): break
                    t0 = time.time()
                elif cfg.ckpt_every and step_no % cfg.ckpt_every == 0 and skip < n_batches:
                    dt = time.time() - t0
                    for r in live: r.res.train_seconds += dt; r.save_last()
                    t0 = time.time()
            if all(r.done for r in runs): break
            dt = time.time() - t0
            for r in [r for r in runs if not r.done]:
                r.res.train_seconds += dt
                stopped = r.evaluation(epoch + 1.0) or bool(cfg.max_steps and r.step >= cfg.max_steps)
                r.epoch += 1; r.skip = 0
                if stopped: r.stop()
                else: r.save_last()
        for r in runs:
            if not r.finished: r.save_last(finished=True)
    finally:
        for r in runs:
            if r.curves: r.curves.close()

def _finish(r: _Run) -> FitResult:
    "The run's best weights loaded into its model, and its result."
    ck = load_torch(r.best); check_vocab(ck, r.data.vocab, r.best)
    r.model.load_state_dict(ck["model"])
    res = r.res
    res.captions_per_s = res.captions / res.train_seconds if res.train_seconds else 0.0
    return res

def fit(model: CaptionModel, data, cfg: TrainConfig, ckpt_dir: str | Path, meta: dict | None = None,
        log: Callable[[str], None] = print, objective: Objective | None = None, start: str | Path | None = None) -> FitResult:
    "Train `model` on `data` (a `Prepared`) with `objective` (default: the model's own); resume from `ckpt_dir/last.pt`; load the best weights at the end. `start`: a stage that continues a run (self-critical after cross-entropy) — that run's last checkpoint, whose Adam moments and step count, and weight average's count, go on from the weights the model holds."
    cfg.check()
    rank, world, local = dist_info()
    device = get_device(cfg.device)
    if device.type == "cuda" and world > 1: device = torch.device("cuda", local)
    with writing([ckpt_dir], rank):                 # one writer per checkpoint folder, from before its checkpoint is read
        run = _Run(model, data, cfg, ckpt_dir, meta, log, objective, rank, world, local, device, start)
        scaler = torch.amp.GradScaler(enabled=device.type == "cuda" and not torch.cuda.is_bf16_supported())
        _loop([run], lambda runs, bs, lrs, where: _eager_step(runs, bs, lrs, where, scaler))
        if world > 1:                               # every rank must hold the same weights after DDP training
            cs = torch.tensor([sum(float(p.detach().double().sum()) for p in model.parameters())], dtype=torch.float64)
            every = [torch.zeros_like(cs) for _ in range(world)]
            dist.all_gather(every, cs)
            if any(not torch.equal(c, every[0]) for c in every): raise RuntimeError(f"DDP ranks diverged: {every}")
            dist.barrier()
        return _finish(run)

def writing(ckpt_dirs: list, rank: int = 0) -> contextlib.ExitStack:
    "Hold each checkpoint folder for this training (`capbook.core.one_writer`; the lock beside it, `.<folder>.writer.lock`, so that a folder moved aside moves without it), in the one process that writes it (rank 0); another training on the same folder stops in one line naming this one."
    held = contextlib.ExitStack()
    if rank == 0:
        for d in map(Path, ckpt_dirs): held.enter_context(one_writer(d, lock=d.parent / f".{d.name}.writer.lock"))
    return held

# %% [markdown]
# ## Loading a trained run
# Assembly notebooks (the papers' tables and figures) re-use trained models: `load_trained` rebuilds a run's model
# from the registry name and hyper-parameters saved in its best checkpoint and loads its weights.

# %%
#| export
def best_checkpoint(run_dir: str | Path) -> Path:
    "Where a run in `run_dir` keeps its best weights (whether or not it has trained yet)."
    return Path(run_dir) / "ckpt" / BEST_PT

def load_trained(run_dir: str | Path, prep) -> CaptionModel:
    "The best weights of the run in `run_dir` (`best_checkpoint`), rebuilt from the model name and hyper-parameters it saved."
    from capbook.models import build
    path = best_checkpoint(run_dir)
    if not path.exists(): raise CapbookError(f"{path}: no trained checkpoint; run the notebook that trains it first")
    ck = load_torch(path); check_vocab(ck, prep.vocab, path)
    meta = ck.get("meta", {})
    if "model" not in meta: raise CapbookError(f"{path}: checkpoint does not name its model (meta['model'])")
    m = build(meta["model"], len(prep.vocab), prep.feat_shape[1], prep.grid, **meta.get("hparams", {}))
    m.load_state_dict(ck["model"])
    return m.eval()

def load_ensemble(run_dirs: list[str | Path], prep) -> CaptionModel:
    "The best weights of several runs of one model kind (its seeds, say) as one decoder, `capbook.decode.Ensemble`: every step's log-probabilities averaged."
    from capbook.decode import Ensemble
    return Ensemble([load_trained(d, prep) for d in run_dirs]).eval()

# %% [markdown]
# ## A whole run, small
#
# Sixteen "images" whose first feature channel says which of two captions they carry, a soft-attention captioner,
# three epochs: the training loss falls, a second `fit` on the same folder resumes the finished run instead of
# training again, and `load_trained` rebuilds the best weights from the checkpoint alone.

# %%
import tempfile
from types import SimpleNamespace
import numpy as np
from capbook.data import CaptionData, Vocab
from capbook.models import build
_caps = [["a", "red", "circle"], ["two", "blue", "stars"]]
_v = Vocab.build(_caps, min_count=1)
def _split(n, seed):
    y = np.random.default_rng(seed).integers(0, 2, n)
    f = np.random.default_rng(seed + 1).standard_normal((n, 4, 8)).astype(np.float16); f[:, :, 0] = 4 * y[:, None] - 2
    return CaptionData(f, [f"{i}.png" for i in range(n)], [[_caps[k]] for k in y], _v, max_len=5)
_prep = SimpleNamespace(train=_split(16, 0), val=_split(8, 10), vocab=_v, feat_shape=(4, 8), grid=(2, 2))
torch.manual_seed(0)
_m = build("sat_soft", len(_v), 8, (2, 2), emb_dim=16, hidden_dim=32, att_dim=16)
_cfg = TrainConfig(epochs=3, batch_size=8, lr=1e-2, val_beam=1, metric="BLEU-1", device="cpu", progress=False)
_dir = Path(tempfile.mkdtemp())
_r = fit(_m, _prep, _cfg, _dir / "ckpt")
assert _r.history[-1]["loss"] < _r.history[0]["loss"] and _r.best_epoch >= 0
_again = fit(build("sat_soft", len(_v), 8, (2, 2), emb_dim=16, hidden_dim=32, att_dim=16), _prep, _cfg, _dir / "ckpt")
assert _again.resumed_from is not None and _again.best_score == _r.best_score and _again.history == _r.history
_back = load_trained(_dir, _prep)
assert all(torch.equal(a, b) for a, b in zip(_back.state_dict().values(), _m.state_dict().values()))

# %% [markdown]
# Every run also leaves TensorBoard event files in `<ckpt>/tb`, so `tensorboard --logdir runs/` shows the book's runs
# side by side while they train: the training terms averaged over `log_every` steps, the learning rate, and each
# validation's scores. The run above wrote them (two batches an epoch, six in all, fewer than `log_every=10`: only the
# validations; a run with `log_every=1` writes every step's loss):

# %%
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
def _tags(folder):
    ea = EventAccumulator(str(folder)); ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}
_tb = _tags(_dir / "ckpt" / "tb")
assert [s for s, _ in _tb["val/BLEU-1"]] == [h["step"] for h in _r.history]                     # one point per validation
assert all(abs(v - h["val BLEU-1"]) < 1e-6 for (_, v), h in zip(_tb["val/BLEU-1"], _r.history))
_d1 = Path(tempfile.mkdtemp())
fit(build("sat_soft", len(_v), 8, (2, 2), emb_dim=16, hidden_dim=32, att_dim=16), _prep,
    TrainConfig(**{**asdict(_cfg), "epochs": 1, "log_every": 1}), _d1 / "ckpt")
_tb1 = _tags(_d1 / "ckpt" / "tb")
assert [s for s, _ in _tb1["train/loss"]] == [1, 2] and "train/lr" in _tb1 and "train/nll" in _tb1
print(sorted(_tb1))

# %% [markdown]
# A checkpoint resumes only the run that wrote it: the same code, data, model sizes and training configuration
# (`RESUME_FREE` lists the fields that do not change what is trained: progress bars, event files, checkpoint
# frequency, device). Any other change — here the learning rate — moves the old checkpoints aside and trains anew:

# %%
_logs = []
fit(build("sat_soft", len(_v), 8, (2, 2), emb_dim=16, hidden_dim=32, att_dim=16), _prep,
    TrainConfig(**{**asdict(_cfg), "epochs": 1, "log_every": 1, "lr": 5e-3}), _d1 / "ckpt", log=_logs.append)
assert "was trained with other parameters (lr)" in _logs[0] and any(p.name.startswith("ckpt.recipe-") for p in _d1.iterdir())
print(_logs[0])

# %% [markdown]
# Inside a book the step's key stands in for the package's hash. A run finished (or killed) under step key `a`, whose
# checkpoint an edit elsewhere in the package has since made "other code", resumes while the book still gives its step
# key `a`; under another key it is moved aside and trained anew:

# %%
_d2, _m = Path(tempfile.mkdtemp()), lambda: build("sat_soft", len(_v), 8, (2, 2), emb_dim=16, hidden_dim=32, att_dim=16)
_c1 = TrainConfig(**{**asdict(_cfg), "epochs": 1})
_env = {k: os.environ.pop(k, None) for k in (STEP_KEY, TRAINING_KEY)}          # (a book running this notebook sets both)
try:
    os.environ[STEP_KEY] = "a"
    fit(_m(), _prep, _c1, _d2 / "ckpt", log=lambda s: None)
    _ck = load_torch(_d2 / "ckpt" / "last.pt")
    assert _ck["step_key"] == "a"
    save_torch(_d2 / "ckpt" / "last.pt", {**_ck, "code": "0ldc0de"})           # as if written before an edit elsewhere
    _logs = []
    assert fit(_m(), _prep, _c1, _d2 / "ckpt", log=_logs.append).resumed_from is not None
    print(next(l for l in _logs if l.startswith("resumed")))
    save_torch(_d2 / "ckpt" / "last.pt", {**load_torch(_d2 / "ckpt" / "last.pt"), "code": "0ldc0de"})
    os.environ[STEP_KEY] = "b"                                                 # the step's key moved: its code did
    _logs = []
    assert fit(_m(), _prep, _c1, _d2 / "ckpt", log=_logs.append).resumed_from is None and (_d2 / "ckpt.code-0ldc0de").exists()
    print(_logs[0])
    os.environ[STEP_KEY], os.environ[TRAINING_KEY] = "c", "t"                 # a step that kept its training key ...
    fit(_m(), _prep, _c1, _d2 / "ckpt3", log=lambda s: None)
    save_torch(_d2 / "ckpt3" / "last.pt", {**load_torch(_d2 / "ckpt3" / "last.pt"), "code": "0ldc0de"})
    os.environ[STEP_KEY] = "d"                                                 # ... re-keyed by its statistics: resumed, not trained again
    _logs = []
    assert fit(_m(), _prep, _c1, _d2 / "ckpt3", log=_logs.append).resumed_from is not None
    print(next(l for l in _logs if l.startswith("resumed")))
    assert "same training (t; book step c → d" in next(l for l in _logs if l.startswith("resumed"))
finally:
    for _name, _was in _env.items():
        if _was is None: os.environ.pop(_name, None)
        else: os.environ[_name] = _was

# %% [markdown]
# ### A budget that grows
#
# The ladder rule (`02b_protocol`) moves a row still rising at the end of its budget to the next rung. Where the
# schedule does not read the budget — a self-critical stage's constant rate after its warm-up, the step, plateau and
# inverse-square-root schedules; not the cosine, whose rate at every step depends on the run's length — the first
# epochs of the longer run are the shorter run's, step for step: the same batches (an epoch's order is a function of
# seed and epoch), the same rates, the same draws (the generators are in the checkpoint). So a checkpoint whose recipe
# differs from this run's in `epochs` alone, fewer of them, goes on from where it stopped instead of training those
# epochs again (`_extends`), and ends as the longer run trained from the start would: the same weights, the same
# history. In the book the step's key moved with its budget, so the book also hands the step's training keys at the
# ladder's lower rungs (`capbook.results.Keys.resuming`), under which those checkpoints were written. A run that had
# stopped early (`patience`) is finished at any budget: the longer run stops there too. Here, two epochs of a step
# schedule grown to three, against three from the start; then the cosine, which is moved aside:

# %%
_d3, _step = Path(tempfile.mkdtemp()), dict(schedule="step", lr_step=2, lr_gamma=0.5, warmup=0.5, ema=0.9)
_c2, _c3 = (TrainConfig(**{**asdict(_cfg), **_step, "epochs": e, "evals_per_epoch": 2}) for e in (2, 3))
_seeded = lambda: (torch.manual_seed(0), _m())[1]                             # a model built as a chapter run builds it: after its seed
fit(_seeded(), _prep, _c2, _d3 / "grown", log=lambda s: None)
_logs, _m3 = [], _seeded()
_grown = fit(_m3, _prep, _c3, _d3 / "grown", log=_logs.append)
_m3b = _seeded()
_whole = fit(_m3b, _prep, _c3, _d3 / "whole", log=lambda s: None)
_drop = lambda h: [{k: v for k, v in e.items() if not k.endswith("_s")} for e in h]
assert _grown.resumed_from == (2, 0) and _drop(_grown.history) == _drop(_whole.history) and len(_whole.history) == 6
assert all(torch.equal(a, b) for a, b in zip(_m3.state_dict().values(), _m3b.state_dict().values()))     # the best weights, bit for bit
_last = lambda d: load_torch(d / "last.pt")
assert all(torch.equal(a, b) for a, b in zip(_last(_d3 / "grown")["model"].values(), _last(_d3 / "whole")["model"].values()))
print(next(l for l in _logs if l.startswith("resumed")))
_env = {k: os.environ.pop(k, None) for k in (STEP_KEY, TRAINING_KEY)}          # in a book: the step's key moved with its budget
try:
    os.environ[STEP_KEY], os.environ[TRAINING_KEY] = "at 2", "t2"
    fit(_seeded(), _prep, _c2, _d3 / "book", log=lambda s: None)
    save_torch(_d3 / "book" / "last.pt", {**load_torch(_d3 / "book" / "last.pt"), "code": "0ldc0de"})
    os.environ[STEP_KEY], os.environ[TRAINING_KEY] = "at 3", "t3 t2"          # its training key, then the rung below's
    assert book_training_key() == "t3" and book_shorter_keys() == ("t2",)
    _logs, _m3c = [], _seeded()
    assert fit(_m3c, _prep, _c3, _d3 / "book", log=_logs.append).resumed_from == (2, 0)
    assert all(torch.equal(a, b) for a, b in zip(_m3c.state_dict().values(), _m3b.state_dict().values()))
    assert "the same training at a shorter budget (t2" in next(l for l in _logs if l.startswith("resumed"))
finally:
    for _name, _was in _env.items():
        if _was is None: os.environ.pop(_name, None)
        else: os.environ[_name] = _was
fit(_m(), _prep, TrainConfig(**{**asdict(_cfg), "epochs": 2}), _d3 / "cosine", log=lambda s: None)
_logs = []
fit(_m(), _prep, TrainConfig(**{**asdict(_cfg), "epochs": 3}), _d3 / "cosine", log=_logs.append)   # the cosine reads its budget
assert "was trained with other parameters (epochs)" in _logs[0]
print(_logs[0])

# %% [markdown]
# ### A first stage keyed by what it trained
#
# A chapter step that trains cross-entropy and then self-critical stages has one training key for all of them, so a
# change to self-critical training alone (its sampler, its loss) re-keys the step, though nothing its cross-entropy
# stage computed moved. The book therefore also hands such a step the key of its cross-entropy stage alone
# (`capbook.results.Keys.first_stage`: the step without its self-critical stage, after `FIRST` in `TRAINING_KEY`). A
# first stage (a `fit` with no `start`) keeps it in its checkpoint and resumes under it; a later stage, which continues a
# run (`start`), never does, and its checkpoint goes aside:

# %%
_d4 = Path(tempfile.mkdtemp())
_env = {k: os.environ.pop(k, None) for k in (STEP_KEY, TRAINING_KEY)}
try:
    os.environ[STEP_KEY], os.environ[TRAINING_KEY] = "s1", f"t1 {FIRST}x1"
    assert book_training_key() == "t1" and book_shorter_keys() == () and book_first_stage_key() == "x1"
    fit(_m(), _prep, _c1, _d4 / "ckpt", log=lambda s: None)
    fit(_m(), _prep, _c1, _d4 / "ckpt-later", log=lambda s: None, start=_d4 / "ckpt" / "last.pt")
    assert load_torch(_d4 / "ckpt" / "last.pt")["first_stage_key"] == "x1"
    assert load_torch(_d4 / "ckpt-later" / "last.pt")["first_stage_key"] is None
    for _s in ("ckpt", "ckpt-later"): save_torch(_d4 / _s / "last.pt", {**load_torch(_d4 / _s / "last.pt"), "code": "0ldc0de"})
    os.environ[STEP_KEY], os.environ[TRAINING_KEY] = "s2", f"t2 {FIRST}x1"       # the later stage changed, the first did not
    _logs = []
    assert fit(_m(), _prep, _c1, _d4 / "ckpt", log=_logs.append).resumed_from is not None
    print(next(l for l in _logs if l.startswith("resumed")))
    assert "the same first stage (x1" in next(l for l in _logs if l.startswith("resumed"))
    _logs = []
    assert fit(_m(), _prep, _c1, _d4 / "ckpt-later", log=_logs.append, start=_d4 / "ckpt" / "last.pt").resumed_from is None
    assert "was written by other capbook code" in _logs[0]
finally:
    for _name, _was in _env.items():
        if _was is None: os.environ.pop(_name, None)
        else: os.environ[_name] = _was

# %% [markdown]
# A step budget (`max_steps`) ends training wherever it falls, with a validation there:

# %%
_rb = fit(build("sat_soft", len(_v), 8, (2, 2), emb_dim=16, hidden_dim=32, att_dim=16), _prep,
          TrainConfig(**{**asdict(_cfg), "max_steps": 3, "evals_per_epoch": 1}), Path(tempfile.mkdtemp()) / "ckpt", log=lambda s: None)
assert [h["step"] for h in _rb.history] == [2, 3] and _rb.history[-1]["epochs"] == 1.5   # epoch 0's end, then step 3 mid-epoch 1


# %% [markdown]
# ## Pairing by construction
#
# Two rows compared seed by seed — a model and its ablation, trained at the same seeds — can be tested on their
# per-seed differences only if a seed gives both the same start: the same batches in the same order, and the same
# initial tensors for every parameter they share. Then what a seed draws is common to both and cancels in the
# difference; if not, pairing them would be a choice made after looking. `same_start` checks it the way a chapter run
# starts (the model built right after `seed_everything`, the epochs' batches a function of seed and epoch alone). The
# 2D-LSTM and the 2D-LSTM with SPCA share every one of the LSTM's tensors at a seed (the SPCA parts are built after
# them); soft attention and Up-Down share five parameter names and no tensor.

# %%
#| export
def same_start(a: tuple[Callable, TrainConfig], b: tuple[Callable, TrainConfig], data=None, epochs: int = 1) -> dict:
    "Whether two runs, each (a builder of its model, its config), start alike: each model built right after `seed_everything(cfg.seed)`, as a chapter run builds it, the parameters of one name and shape in both compared, and the first `epochs` epochs' batches (caption indices) compared (`data` None: what decides them, batch size, order, caption filter and seed, on one data set). {'shared': n, 'differ': [names], 'same batches': bool, 'paired': whether both hold (and something is shared)}."
    models = []
    for build_model, cfg in (a, b):
        seed_everything(cfg.seed); models.append(build_model())
    pa, pb = dict(models[0].named_parameters()), dict(models[1].named_parameters())
    shared = [k for k in pa if k in pb and pa[k].shape == pb[k].shape]
    differ = [k for k in shared if not torch.equal(pa[k], pb[k])]
    order = lambda cfg: ((cfg.batch_size, cfg.batch_order, cfg.max_words, cfg.seed) if data is None else
                         [c.tolist() for e in range(epochs) for c in data.train._chunks(cfg.batch_size, e, cfg.seed, cfg.batch_order, cfg.max_words)])
    same = order(a[1]) == order(b[1])
    return {"shared": len(shared), "differ": differ, "same batches": same, "paired": bool(shared) and not differ and same}

# %%
_pair = lambda name, **kw: (lambda: build(name, len(_v), 8, (2, 2)), TrainConfig(**{**asdict(_cfg), **kw}))     # each at its default sizes
_s = same_start(_pair("lstm2d"), _pair("lstm2d_spca"), _prep)
print("2D-LSTM and 2D-LSTM + SPCA:", _s)
assert _s["paired"] and _s["shared"] > 5
_s = same_start(_pair("sat_soft"), _pair("updown"), _prep)
print("soft attention and Up-Down:", _s)
assert not _s["paired"] and _s["differ"]
assert not same_start(_pair("lstm2d"), _pair("lstm2d_spca", seed=1), _prep)["paired"]          # another seed: another start
assert not same_start(_pair("lstm2d"), _pair("lstm2d_spca", batch_size=3), _prep)["same batches"]
