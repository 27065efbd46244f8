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
# # stacked
#
# > Several runs of one architecture trained as one stacked model: every weight (K, ...), the K gradients from one `vmap`-ed `grad`, each run's own seed, rate, clipping, Adam, weight average, validation and checkpoints; each run ends where `capbook.train.fit` with `draws='keyed'` ends it alone.

# %%
#| default_exp stacked

# %%
#| export
from __future__ import annotations
import contextlib
import copy
from dataclasses import asdict, replace
from typing import Callable
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from capbook.core import CapbookError, environment, get_device
from capbook.models import CaptionModel, captions_per_image, hparams, keyed, plain_paths
from capbook.objectives import Objective
# the trainer's own run state, loop and finish: a stacked run is the trainer's run with another optimisation step
from capbook.train import FitResult, TrainConfig, _finish, _loop, _Run, dist_info, step_key, step_loss, writing

# %% [markdown]
# ## Stacked runs
#
# The book's models are small (0.2–1.5 M parameters) and on a GPU every one of them is launch-bound: each operator of
# a step is a kernel launch that does microseconds of work. Its seeds, though, are runs of one architecture that differ
# only in numbers, so they can be one model: every weight gets a leading member dimension $K$ and every operator is
# launched once for all of them. `fit_stacked` trains them so, with `torch.func`: `functional_call` runs one run's
# step (`_Member`: the objective's outputs under autocast, its loss in float32, as `train_step`) on a given set of
# weights, `grad` differentiates it, and `vmap` maps it over the $K$ sets of weights and the $K$ batches:
#
# $$g_k = \nabla_{\theta_k} \mathcal{L}(\theta_k;\, \text{batch}_k,\, \text{key}_k), \qquad k = 1..K$$
#
# Each run keeps everything that makes it that run: its initialisation (built from its seed), its data order (its
# seed's shuffle), its dropout and hard-attention draws (keyed by its seed and step: `capbook.models.keyed`), its
# rate $lr_k$, its gradient-norm clipping, Adam moments and weight average (the same equations as `train_step` and
# `WeightAverage`, on $(K, \dots)$ tensors), its validations, best weights, early stopping and checkpoint folder. Its
# own module, optimiser and average become views of the stacked tensors (`StackedStep`), so `fit`'s bookkeeping (`_Run`:
# validation, `best.pt`, `last.pt`, the history) runs unchanged, member by member, and its checkpoints are a lone run's.
# The loop is `fit`'s loop with a different step.
#
# **What "the same run alone" means.** A stacked run equals `fit` with `draws='keyed'`: the keyed draws and the
# plain paths (the speed-ups that shrink a batch as its captions end, or find which captions share an image, decide
# shapes on the host inside the step, which `vmap` cannot). What an image-ordered batch's layout gives for free is
# found on the host before the step instead: its captions come in runs of G per image (`captions_per_image`), so the
# transformers still encode each image once. With dropout off it equals the book's own step
# (`test_stacked_runs_equal_runs_alone` trains a stacked pair of every family and two lone runs: losses and weights to
# $10^{-5}$). The draws differ from the book's CPU runs (torch's generator), so a stacked seed is a different draw of
# the same experiment, not a replay of the published one.
#
# **Graph-ready.** The stacked step has no host synchronisation inside it: `vmap` refuses `.item()`, data-dependent
# Python branches and operators of data-dependent shape (`unique`, `nonzero`), the objectives return their terms as
# tensors (`Objective.tensor_stats`), random draws outside the keys fail (`randomness='error'`), and the terms and the
# finiteness check are read once after the step. Captions are always padded to the split's full width (keyed runs
# alone too: a model that folds rows and tokens into one dimension, as the 2D-LSTM's word maps, would otherwise index
# its draws by the batch's own width), and with `fixed=True` the rows too, to whole images of the largest batch
# (`fixed_shape`), so one CUDA graph could replay every step; padded rows are captions without a word, which no loss
# counts. On a GPU, `CapturedStep` captures the step once as one CUDA graph and replays it (below). *capbook:* the
# book's own runs train on a CPU, one at a time; stacking and capture are there for a GPU, measured in `00r_bench`.
#
# Runs differ only in `STACKABLE` fields (seed and rate) and must take as many steps an epoch (image-ordered batches
# of a fixed caption count per image do). Self-critical training and scheduled sampling draw captions outside the keys
# and train alone.

# %%
#| export
STACKABLE = ("seed", "lr")   # the TrainConfig fields in which runs trained as one stacked model may differ

@contextlib.contextmanager
def autocast_uncached():
    "Autocast without its cache of cast weights: each use of a weight casts it anew, so a recurrent model's weight, read at every time step, sums its per-step gradients in float32 rather than in bfloat16 (the cached cast's gradient); and CUDA graph capture needs it. The forward's numbers are the same."
    old = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try: yield
    finally: torch.set_autocast_cache_enabled(old)

class _Member(nn.Module):
    "One run's model and objective as one module, for `functional_call`: its forward is `train_step`'s loss (`step_loss`)."
    def __init__(self, model: CaptionModel, objective: Objective, device, precision: str):
        super().__init__()
        self.model, self.objective, self.device, self.precision = model, objective, device, precision
    def forward(self, batch: dict):
        return step_loss(self.model, self.objective, batch, self.device, self.precision)

class StackedStep:
    "The optimisation step of K runs of one architecture as one model: every weight (K, ...), the K gradients from one `vmap`-ed `grad`, each run's gradient-norm clipping, Adam and weight average; the runs' own modules, optimisers and averages become views of the stacked tensors, so that validation, checkpoints and records read each run as if it trained alone."
    def __init__(self, runs: list[_Run], pad_to: tuple[int, int] | None = None):
        self.runs, self.K, self.pad_to = runs, len(runs), pad_to
        r0 = runs[0]
        self.width = r0.data.train.caps.shape[1]                     # every caption padded to the split's longest
        self.device, self.clip, self.betas, self.eps = r0.device, r0.cfg.clip, (0.9, 0.999), 1e-8
        members = [_Member(r.model, r.objective, r.device, r.cfg.precision) for r in runs]
        self.fn = copy.deepcopy(members[0])                          # the structure every member's weights run through
        self.fn.objective.tensor_stats = True                        # terms as tensors: no host synchronisation in the step
        stack = lambda named: {n: torch.stack([dict(named(m))[n].detach() for m in members]) for n, _ in named(self.fn)}
        self.params, self.buffers = stack(lambda m: m.named_parameters()), stack(lambda m: m.named_buffers())
        # each run's tensors become views of the stacked ones: what the stacked step writes, the run's own module holds
        for k, m in enumerate(members):
            for n, p in m.named_parameters(): p.data = self.params[n][k]
            for n, b in m.named_buffers(): b.data = self.buffers[n][k]
        # Adam's moments, stacked from each run's optimiser (zeros, or its checkpoint's), and given back as views
        states = [[r.opt.state.get(p, {}) for p in r.model.parameters()] for r in runs]
        names = ["model." + n for n, _ in r0.model.named_parameters()]
        steps = {int(s["step"]) if s else 0 for st in states for s in st}
        if len(steps) > 1: raise CapbookError(f"stacked runs must resume from one step: their optimisers stand at steps {sorted(steps)}")
        self.t = steps.pop()
        moment = lambda key, i, n: torch.stack([st[i][key] if st[i] else torch.zeros_like(self.params[n][0]) for st in states])
        self.m = {n: moment("exp_avg", i, n) for i, n in enumerate(names)}
        self.v = {n: moment("exp_avg_sq", i, n) for i, n in enumerate(names)}
        self.t_tensor = torch.tensor(float(self.t))                 # the optimisers' shared step count (as torch's Adam keeps it)
        for k, r in enumerate(runs):
            for n, p in zip(names, r.model.parameters()):
                r.opt.state[p] = {"step": self.t_tensor, "exp_avg": self.m[n][k], "exp_avg_sq": self.v[n][k]}
        # the weight averages: stacked, and each run's a view of them
        self.avg = self.live = None
        if r0.avg is not None:
            full = {**self.params, **self.buffers}
            self.avg = [torch.stack([r.avg.avg[i] for r in runs]) for i in range(len(r0.avg.names))]
            self.live = [full["model." + n] for n in r0.avg.names]
            for k, r in enumerate(runs):
                r.avg.avg, r.avg.live = [a[k] for a in self.avg], [v[k] for v in self.live]

        f32 = dict(dtype=torch.float32, device=self.device)
        # on a GPU, `advance`'s numbers held on the device (as a captured step reads them): lr_k / (1 - b1^t) (K,),
        # 1 / sqrt(1 - b2^t) in float32, 1 - d
        self.step_size, self.inv_sqrt_bc2, self.avg_w = torch.zeros(self.K, **f32), torch.zeros((), **f32), torch.zeros((), **f32)

    def collate(self, batches: list[dict]) -> tuple[dict, dict]:
        "The K runs' batches as one: every tensor (K, ...), each dimension padded with zeros (`<pad>` captions and tokens, which no loss counts) to the largest, the rows to `pad_to[0]` where given, the captions always to the split's full width (as `draws='keyed'` alone: a model that folds (rows, tokens) into one dimension then draws the same keyed numbers); and what every member's batch shares, found on the host (`captions_per_image`, when all have the same)."
        G = {captions_per_image(b["img"]) for b in batches}
        static = {"captions_per_image": G.pop()} if len(G) == 1 and None not in G else {}
        out = {}
        for key, v0 in batches[0].items():
            if not isinstance(v0, torch.Tensor): continue               # `refs`: read by self-critical training only
            vs = [b[key] for b in batches]
            size = [max(v.shape[d] for v in vs) for d in range(v0.dim())]
            if key == "caps": size[1] = self.width
            if self.pad_to:
                if size[0] > self.pad_to[0]:
                    raise CapbookError(f"a batch of {size[0]} captions exceeds the stacked step's fixed shape {self.pad_to}")
                size[0] = self.pad_to[0]
            pads = [[x for d in reversed(range(v.dim())) for x in (0, size[d] - v.shape[d])] for v in vs]
            out[key] = torch.stack([F.pad(v, p) for v, p in zip(vs, pads)]).to(self.device)
        if static and len(out["caps"][0]) % static["captions_per_image"]: static = {}   # padded rows must form whole images
        return out, static

    def grads(self, batch: dict, keys: torch.Tensor, static: dict | None = None):
        "Every run's gradients (K, ...) and terms (K,) on the stacked `batch` (with `static`: what every member's batch shares), its draws from `keys` (K,)."
        def member(params, buffers, b, key):
            with keyed(key):
                loss, stats = functional_call(self.fn, (params, buffers), ({**b, **(static or {})},))
            return loss, (loss, stats)
        # without autocast's cache of cast weights: a weight cast once and read at every time step would sum its T
        # gradients in bfloat16; uncached, each step's gradient is cast back to float32 and summed there (and capture needs it)
        with plain_paths(), autocast_uncached():
            return vmap(grad(member, has_aux=True), randomness="error")(self.params, self.buffers, batch, keys)

    def advance(self, lrs: list[float]) -> tuple[list[float], float, float | None]:
        "On the host, the optimisers' next step count t and what it gives each step: every run's lr_k / (1 - b1^t), sqrt(1 - b2^t), and the weight average's 1 - d (None without one)."
        (b1, b2), w = self.betas, None
        self.t += 1; self.t_tensor.fill_(self.t)
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        if self.avg is not None:
            for r in self.runs: r.avg.t += 1
            w = 1.0 - min(self.runs[0].avg.decay, (1 + self.runs[0].avg.t) / (10 + self.runs[0].avg.t))
        return [lr / bc1 for lr in lrs], bc2 ** 0.5, w

    @torch.no_grad()
    def adam(self, g: dict, step_size: torch.Tensor, sqrt_bc2, avg_w) -> None:
        "Each run's gradient-norm clipping, Adam step (torch's single-tensor algorithm) and weight average, with `advance`'s numbers: `step_size` (K,) on the device; `sqrt_bc2` a number, or a 0-dim device tensor holding its float32 reciprocal (as a captured step keeps it); `avg_w` likewise a number or a 0-dim device tensor."
        K, (b1, b2) = self.K, self.betas
        per = lambda c, x: c.view(K, *[1] * (x.dim() - 1))          # a value per run (K,), against x (K, ...)
        if self.clip:
            # ||g||: (K,) over every parameter of each run; g * min(1, clip / (||g|| + 1e-6))
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.flatten(1), dim=1) for x in g.values()], 1), dim=1)
            coef = (self.clip / (norm + 1e-6)).clamp(max=1.0)
            for x in g.values(): x.mul_(per(coef, x))
        for n, p in self.params.items():
            m, v = self.m[n], self.v[n]
            # m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
            m.lerp_(g[n], 1 - b1); v.mul_(b2).addcmul_(g[n], g[n], value=1 - b2)
            # sqrt(v / (1 - b2^t)): CUDA divides by a host number as a product with its float32 reciprocal, which a
            # captured step holds on the device: the same arithmetic either way
            root = v.sqrt() / sqrt_bc2 if isinstance(sqrt_bc2, float) else v.sqrt() * sqrt_bc2
            # theta <- theta - lr_k / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)
            p.add_((-per(step_size, m) * m) / root.add_(self.eps))      # addcdiv's order: (value * m) / denom
        if self.avg is None: return
        # avg <- avg + (1 - d) (live - avg)
        if isinstance(avg_w, float): torch._foreach_lerp_(self.avg, self.live, avg_w)
        else:
            for a, live in zip(self.avg, self.live): a.lerp_(live, avg_w)

    def update(self, g: dict, lrs: list[float]) -> None:
        "One optimisation step of every run from its gradients `g` at rates `lrs`: `advance`, then `adam`; on the CPU with the numbers as numbers (torch's own Adam, to the bit), elsewhere held on the device, as a captured step reads them (one arithmetic, eager or captured)."
        if self.device.type != "cpu":
            self.numbers(lrs)
            return self.adam(g, self.step_size, self.inv_sqrt_bc2, self.avg_w if self.avg is not None else None)
        step_size, sqrt_bc2, avg_w = self.advance(lrs)
        self.adam(g, torch.tensor(step_size, dtype=torch.float32, device=self.device), sqrt_bc2, avg_w)

    def numbers(self, lrs: list[float]) -> None:
        "`advance`, and its numbers into the device's tensors (`step_size`, `inv_sqrt_bc2`, `avg_w`)."
        step_size, sqrt_bc2, avg_w = self.advance(lrs)
        self.step_size.copy_(torch.tensor(step_size, dtype=torch.float32))
        self.inv_sqrt_bc2.fill_(float(np.float32(1) / np.float32(sqrt_bc2)))   # CUDA's reciprocal of a host divisor
        if avg_w is not None: self.avg_w.fill_(avg_w)

    def __call__(self, runs: list[_Run], batches: list[dict], lrs: list[float], where: str = "") -> list[dict]:
        "One optimisation step of every run on its own batch: their terms, read after the step (the one host synchronisation)."
        self.fn.train()
        keys = torch.tensor([step_key(r.cfg.seed, r.step) for r in runs], device=self.device)
        batch, static = self.collate(batches)
        g, (loss, stats) = self.grads(batch, keys, static)
        self.check_finite(runs, loss, where)
        self.update(g, lrs)
        return self.terms(loss, stats)

    def check_finite(self, runs: list[_Run], loss: torch.Tensor, where: str) -> None:
        "Stop, naming the run, where a member's loss is not finite (the step's one host synchronisation)."
        finite = torch.isfinite(loss).tolist()
        if not all(finite):
            k = finite.index(False)
            raise CapbookError(f"loss is {loss[k].item()}{' at ' + where if where else ''} for the stacked run of seed {runs[k].cfg.seed}: "
                               f"lower the learning rate (lr) or the gradient clip (clip); the last checkpoints are kept")

    def terms(self, loss: torch.Tensor, stats: dict) -> list[dict]:
        "Each run's loss and terms as numbers, from the step's (K,) tensors."
        cols = {"loss": loss.tolist(), **{n: v.tolist() for n, v in stats.items()}}
        return [{n: c[k] for n, c in cols.items()} for k in range(self.K)]

class CapturedStep(StackedStep):
    "A `StackedStep` on a CUDA GPU whose gradients and update are captured once as one CUDA graph, at its fixed shape, and replayed at every step: a step is then one launch, after the batch, keys and `advance`'s numbers are copied into the graph's own tensors. The same arithmetic as the eager stacked step; one graph for each set of what the members' batches share (`static`)."
    def __init__(self, runs: list[_Run], pad_to: tuple[int, int] | None, warmup: int = 3):
        super().__init__(runs, pad_to)
        if pad_to is None: raise CapbookError("a captured step needs one shape for every batch: stack the runs with fixed=True")
        self.warmup, self.graphs = warmup, {}

    def state(self) -> list[torch.Tensor]:
        "Every tensor a step writes: weights, buffers, Adam's moments, weight averages."
        return [*self.params.values(), *self.buffers.values(), *self.m.values(), *self.v.values(), *(self.avg or [])]

    def body(self, io: dict) -> tuple:
        "What the graph holds: the gradients on the graph's batch and keys, and the update; returns the terms (loss (K,), stats)."
        g, (loss, stats) = self.grads(io["batch"], io["keys"], io["static"])
        self.adam(g, self.step_size, self.inv_sqrt_bc2, self.avg_w if self.avg is not None else None)
        return loss, stats

    def capture(self, batch: dict, keys: torch.Tensor, static: dict) -> dict:
        "Capture `body` on copies of `batch` and `keys` (the graph's inputs from then on), after `warmup` eager steps on a side stream (as capture needs) whose writes are then undone: returns the graph, its inputs and outputs."
        if self.device.type != "cuda": raise CapbookError(f"a captured step needs a CUDA GPU: these runs train on {self.device}")
        io = {"batch": {k: v.clone() for k, v in batch.items()}, "keys": keys.clone(), "static": static}
        keep = [t.clone() for t in self.state()]
        main, side = torch.cuda.current_stream(self.device), torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(self.warmup): self.body(io)
        main.wait_stream(side)
        with torch.no_grad():
            for t, k in zip(self.state(), keep): t.copy_(k)
        io["graph"] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(io["graph"], capture_error_mode="thread_local"):
            io["out"] = self.body(io)
        return io

    def __call__(self, runs: list[_Run], batches: list[dict], lrs: list[float], where: str = "") -> list[dict]:
        "One optimisation step of every run on its own batch, replayed (captured at the first step of its kind): their terms, read after the step."
        self.fn.train()
        keys = torch.tensor([step_key(r.cfg.seed, r.step) for r in runs], device=self.device)
        batch, static = self.collate(batches)
        kind = tuple(sorted(static.items()))
        if kind not in self.graphs: self.graphs[kind] = self.capture(batch, keys, static)
        io = self.graphs[kind]
        for k, v in batch.items(): io["batch"][k].copy_(v)
        io["keys"].copy_(keys)
        self.numbers(lrs)
        io["graph"].replay()
        loss, stats = io["out"]
        self.check_finite(runs, loss, where)   # after the update, unlike the eager step: the checkpoints on disk are kept
        return self.terms(loss, stats)

def stacked_precision(precision: str, device) -> str:
    "The arithmetic of a stacked step: on the CPU float32 (torch's `vmap` has no backward for layer norm on bfloat16 inputs with float32 weights, which the CPU's autocast leaves mixed; CUDA's autocast runs layer norm in float32), elsewhere the run's own."
    if torch.device(device).type != "cpu": return precision
    if precision == "bf16": raise CapbookError("parameter precision='bf16' is invalid for stacked runs on the CPU: allowed values are 'auto' and 'fp32' (torch's vmap cannot differentiate the CPU's mixed bfloat16 layer norm)")
    return "fp32"

def fixed_shape(data, cfg: TrainConfig) -> tuple[int, int]:
    "The largest batch of `data`'s training split under `cfg` (rows, caption tokens): the one shape a graph-ready step is padded to."
    tr = data.train
    if cfg.batch_order != "image": return cfg.batch_size, tr.caps.shape[1]
    per = np.bincount(tr.cap_img)                                        # an image's captions, all in one batch
    if per.min() == per.max():                   # whole images of G captions: a multiple of G, so padded rows form images too
        return -(-cfg.batch_size // int(per[0])) * int(per[0]), tr.caps.shape[1]
    return cfg.batch_size + int(per.max()) - 1, tr.caps.shape[1]

def stack_runs(models: list[CaptionModel], data, cfgs: list[TrainConfig], ckpt_dirs: list, metas: list | None = None,
               log: Callable[[str], None] = print, fixed: bool = False, capture: bool = False,
               envs: list[dict[str, str]] | None = None) -> tuple[list[_Run], StackedStep]:
    "The runs of `fit_stacked`, checked (one architecture, configs that differ only in `STACKABLE` fields, teacher-forced objectives) and set up, with the stacked step that trains them. `envs`: each run's book keys (`capbook.train.STEP_KEY`, `TRAINING_KEY`), set while it is set up, as the book sets them for a step's kernel: the keys its checkpoints keep and resume under."
    if not models: raise CapbookError("fit_stacked needs at least one model")
    if len({len(models), len(cfgs), len(ckpt_dirs)}) > 1:
        raise CapbookError(f"fit_stacked: {len(models)} models, {len(cfgs)} configs and {len(ckpt_dirs)} checkpoint folders differ in number")
    kinds = {(m.name, type(m).__name__, repr(hparams(m) if m.name else None)) for m in models}
    if len(kinds) > 1: raise CapbookError(f"stacked runs must be one architecture with one set of sizes: got {sorted(kinds)}")
    cfgs = [replace(c, draws="keyed").check() for c in cfgs]
    shared = lambda c: {k: v for k, v in asdict(c).items() if k not in STACKABLE}
    for c in cfgs[1:]:
        diff = sorted(k for k, v in shared(c).items() if shared(cfgs[0])[k] != v)
        if diff: raise CapbookError(f"stacked runs may differ only in {', '.join(STACKABLE)}: they differ in {', '.join(diff)}")
    if cfgs[0].ss_start >= 0: raise CapbookError(f"parameter ss_start={cfgs[0].ss_start}: scheduled sampling draws outside the keyed draws; train such runs apart")
    rank, world, local = dist_info()
    if world > 1: raise CapbookError("stacked runs train in one process: run them without torchrun")
    device = get_device(cfgs[0].device)
    if capture and device.type != "cuda": raise CapbookError(f"parameter device={cfgs[0].device!r}: a captured step needs a CUDA GPU; train the stacked runs without capture")
    cfgs = [replace(c, precision=stacked_precision(c.precision, device)) for c in cfgs]
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise CapbookError("stacked runs need bfloat16 or float32 arithmetic: this GPU would need float16's gradient scaler")
    if envs is not None and len(envs) != len(models): raise CapbookError(f"fit_stacked: {len(models)} models and {len(envs)} environments differ in number")
    runs = []
    for i, (m, c, d) in enumerate(zip(models, cfgs, ckpt_dirs)):
        with environment((envs or [None] * len(models))[i]):
            runs.append(_Run(m, data, c, d, (metas or [None] * len(models))[i], log, None, rank, world, local, device))
    for r in runs:
        if type(r.objective).outputs is not Objective.outputs:
            raise CapbookError(f"{type(r.objective).__name__} is not teacher-forced: stacked runs train cross-entropy and hard attention's rule; train it apart")
    shape = fixed_shape(data, cfgs[0]) if fixed or capture else None
    return runs, (CapturedStep if capture else StackedStep)(runs, shape)

def fit_stacked(models: list[CaptionModel], data, cfgs: list[TrainConfig], ckpt_dirs: list, metas: list | None = None,
                log: Callable[[str], None] = print, fixed: bool = False, capture: bool = False,
                envs: list[dict[str, str]] | None = None) -> list[FitResult]:
    "Train K runs of one architecture as one stacked model, each with its own seed (initialisation, data order, draws) and rate, weight average, validation, early stopping and checkpoint folder; each run's result and checkpoints are those of `fit` with `draws='keyed'` alone. `fixed`: every batch padded to one shape (`fixed_shape`); `capture` (on a CUDA GPU): so padded, and every step replayed as one captured CUDA graph (`CapturedStep`); `envs`: each run's book keys while it is set up (`stack_runs`)."
    with writing(ckpt_dirs):                        # one writer per checkpoint folder (`capbook.train.writing`)
        runs, step = stack_runs(models, data, cfgs, ckpt_dirs, metas, log, fixed, capture, envs)
        _loop(runs, step)
        return [_finish(r) for r in runs]

# %% [markdown]
# ## Two seeds as one model
#
# On the keys' fixed probe data set (`capbook.results.probe_data`: 14 shapes images, 3×3 features of 16 channels).

# %%
import tempfile
from pathlib import Path
from capbook.models import build
from capbook.results import probe_data
from capbook.train import fit
_prep = probe_data()
_cfg = TrainConfig(epochs=2, batch_size=4, lr=1e-2, val_beam=1, metric="BLEU-1", device="cpu", progress=False)

# %% [markdown]
# Two seeds of the soft-attention captioner at two learning rates, trained as one stacked model (dropout 0.5 on, drawn
# from each seed's keys), end where each ends alone with `draws='keyed'`: the same losses, and the same weights up to
# the order in which the stacked sums round (`tests/test_stack.py` holds every family to 10⁻⁵). In float32: under
# bfloat16 autocast the batched products round their bfloat16 inputs in another order than one run's, so a stacked
# run and its lone twin part at bfloat16's rounding (about 10⁻³ of a value) and drift as seeds do, not as runs of one seed.

# %%
_sc = [TrainConfig(**{**asdict(_cfg), "epochs": 2, "seed": s, "lr": lr, "draws": "keyed", "log_every": 0, "precision": "fp32"}) for s, lr in ((0, 1e-2), (1, 5e-3))]
def _sat(seed):
    torch.manual_seed(seed); return build("sat_soft", len(_prep.vocab), _prep.feat_shape[1], _prep.grid, emb_dim=16, hidden_dim=32, att_dim=16)
_alone = [(_sat(c.seed), c) for c in _sc]
_alone = [(m, fit(m, _prep, c, Path(tempfile.mkdtemp()) / "ckpt", log=lambda s: None)) for m, c in _alone]
_ms = [_sat(c.seed) for c in _sc]
_st = fit_stacked(_ms, _prep, _sc, [Path(tempfile.mkdtemp()) / f"ckpt{i}" for i in range(2)], log=lambda s: None)
for (m, r), ms, rs in zip(_alone, _ms, _st):
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(r.history, rs.history)) < 1e-5
    # att.w.bias adds one number to every score before a softmax: its gradient is zero but for rounding, which Adam,
    # dividing by the gradient's own size, turns into steps of up to lr either way; every other weight agrees
    assert max((a - b).abs().max().item() for (k, a), b in zip(m.state_dict().items(), ms.state_dict().values()) if k != "att.w.bias") < 1e-4
print([[round(h["loss"], 4) for h in r.history] for r in _st])

# %% [markdown]
# ## Captured
#
# On a GPU a stacked step is launch-bound: hundreds of small kernels a step, each doing microseconds of work.
# `CapturedStep` records the whole step (every member's gradients, clipping, Adam, the weight averages) once as a CUDA
# graph at the fixed shape and replays it; before each replay the batch, the keys and the optimiser's numbers of that
# step (`advance`: lr_k / (1 - b1^t), 1 / sqrt(1 - b2^t), the average's 1 - d) are copied into the graph's own tensors.
# A graph cannot hold autocast's cache of cast weights, so a stacked step always runs without it
# (`autocast_uncached`). That changes the gradient of a weight read at every time step: cached, its bfloat16 cast is
# one tensor whose T gradients are summed in bfloat16; uncached, each read is its own cast and the gradients are summed
# in float32. An LSTM cell over 20 steps under the CPU's bfloat16 autocast, its recurrent weight's gradient against
# float32's:

# %%
def _lstm_grad(cache: bool | None) -> torch.Tensor:
    "The recurrent weight's gradient of a seeded LSTM cell over 20 steps: float32 (None), or bfloat16 autocast with or without its cache."
    torch.manual_seed(0)
    cell, x = nn.LSTMCell(64, 128), torch.randn(20, 32, 64)
    ctx = contextlib.nullcontext() if cache is None else torch.autocast("cpu", dtype=torch.bfloat16)
    with ctx, (contextlib.nullcontext() if cache in (None, True) else autocast_uncached()):
        h = c = torch.zeros(32, 128)
        for t in range(20): h, c = cell(x[t], (h, c))
    h.float().pow(2).sum().backward()
    return cell.weight_hh.grad
_ref = _lstm_grad(None)
_err = {k: ((_lstm_grad(v) - _ref).norm() / _ref.norm()).item() for k, v in (("cached", True), ("uncached", False))}
assert _err["uncached"] < _err["cached"] and torch.is_autocast_cache_enabled()
{k: f"{v:.2%}" for k, v in _err.items()}

# %% [markdown]
# The graph itself needs a GPU (`make gpu-check` runs it there and compares it with the eager step); what it holds,
# `CapturedStep.body` with the step's numbers in tensors, runs anywhere, and trains what the eager step trains
# (`tests/test_stack.py` holds two families to 10⁻⁵; on the CPU a host divisor and its float32 reciprocal round apart).
# On the CPU, asking for capture stops before anything trains:

# %%
try: stack_runs([_sat(0)], _prep, [_sc[0]], [Path(tempfile.mkdtemp()) / "c"], log=lambda s: None, capture=True)
except CapbookError as e: print(e)
else: raise AssertionError("capture on the CPU must stop")

