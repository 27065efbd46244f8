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
# # models
#
# > The one decoding interface every captioning model implements, its batch of named inputs, one config dataclass per model, and the registry that names them.

# %%
#| default_exp models

# %%
#| export
from __future__ import annotations
import contextlib, dataclasses, importlib, pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
import torch
from torch import nn
import torch.nn.functional as F
from capbook.core import CapbookError, wide


# %% [markdown]
# ## The step interface
#
# Every decoder in the book — Show-Attend-Tell's LSTMs, SPCA's 1D and 2D-latent-state LSTMs, the spatial transformer,
# GLIED — is a `CaptionModel`. It implements two methods and inherits the rest:
#
# - `init_state(batch) -> (memory, state)`: `batch` is a mapping of named inputs (below). `memory` holds what stays
#   fixed while a caption is generated (the features and their attention projections, a transformer's encoder
#   output); `state` holds what changes at every step (LSTM h and c, a transformer's key/value cache). Both are dicts
#   of tensors whose first dimension is the batch.
# - `step(tokens, memory, state) -> (logits, state, aux)`: one word; `tokens` (R,) are the previous words, `logits`
#   (R, V) the unnormalised scores of the next, `aux` a dict of per-step extras (`alpha`: (R, L) attention weights).
#
# Training (teacher forcing), greedy decoding, beam search and sampling (`capbook.decode`), attention figures and
# timings are written once, against this interface. `memory` always has one row per image (B); `state`, `tokens` and
# the outputs have R = B·K rows, K ≥ 1 rows per image with the rows of an image adjacent (K = 1 in training and greedy
# search, the beam size in beam search, the number of samples in sampling), so a model's `step` broadcasts `memory`
# over the K rows of each image (`K = len(tokens) // len(memory tensor)`). Beam search reorders `state` along its
# first dimension and never copies `memory`, so a model must keep everything that depends on the history in `state`.
#
# **The batch.** A batch is a `dict` of named inputs: `feats` (B, L, D) annotation vectors, `caps` (B, T) captions
# (`<start> w_1 ... <end> <pad>...`, training only), `img` (B,) image rows, `refs` (the images' reference captions,
# token lists), and whatever else the data carries (`capbook.data.CaptionData.with_inputs`: attribute words, region
# masks). A model lists the inputs it reads in its class attribute `inputs`; `check_inputs` stops with one line when a
# batch lacks one. The trainer, the decoders and the evaluator pass the batch through untouched, so a model with a new
# input needs no change to any of them.
#
# `forward(batch)` is teacher forcing; `forward(batch, mode=capbook.decode.sample, ...)` draws captions: sampling has
# one home, `capbook.decode`, and the model runs the decoding routine it is handed, so an objective that samples —
# self-critical training — still calls the model through its DistributedDataParallel wrapper, which is what keeps the
# gradients of all processes in step.

# %%
#| export
class CaptionModel(nn.Module):
    "Base class of every decoder: implement `init_state` and `step`; teacher forcing and sampling come for free."
    pad, start, end = 0, 1, 2
    inputs: tuple[str, ...] = ("feats",)     # the batch entries the model reads (besides `caps` in training)
    region_masks: bool = False              # reads `feat_mask` (a variable number of regions per image)
    name: str = ""                          # its registry name, set by `build`
    config: Any = None                      # its config dataclass, set by `build`

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def init_state(self, batch: Mapping[str, Any]) -> tuple[dict, dict]:
        "Return `(memory, state)` for a batch of B images."
        raise NotImplementedError

    def step(self, tokens: torch.Tensor, memory: dict, state: dict) -> tuple[torch.Tensor, dict, dict]:
        "One decoding step: previous words (R,) -> next-word logits (R, V), new state, extras such as `alpha` (R, L)."
        raise NotImplementedError

    def forward(self, batch: Mapping[str, Any], mode: str = "teacher", **kw) -> dict:
        "`mode='teacher'`: `teacher_forcing(batch)`; `'scheduled'`: `scheduled_sampling(batch, **kw)`; a decoding routine (`capbook.decode.sample`): `mode(self, batch, **kw)`, run inside the forward pass a DistributedDataParallel wrapper sees."
        if callable(mode): return mode(self, batch, **kw)
        if mode == "scheduled": return self.scheduled_sampling(batch, **kw)
        if mode != "teacher": raise CapbookError(f"mode={mode!r} is invalid: allowed values are 'teacher', 'scheduled' or a decoding routine (capbook.decode.sample)")
        return self.teacher_forcing(batch)

    def scheduled_sampling(self, batch: Mapping[str, Any], p: float) -> dict:
        "Teacher forcing in which each step's input word is, with probability `p`, drawn from the model's own previous distribution instead of the reference (Bengio et al. 2015): logits (B, T-1, V) and stacked extras, as `teacher_forcing`."
        last = []                                                           # the previous step's logits (B, V)
        def step(y, memory, state):                                         # y: the reference word y_t, (B,)
            if last and p:
                # w_t ~ p(. | w_<t, I) with probability p, else the reference y_t: (B,)
                drawn = torch.multinomial(F.softmax(last[0].detach().float(), -1), 1)[:, 0]
                y = torch.where(torch.rand(len(y), device=y.device) < p, drawn, y)
            logits, state, aux = self.step(y, memory, state)
            last[:] = [logits]
            return logits, state, aux
        memory, state = self.init_state(batch)
        return unroll(step, batch["caps"][:, :-1], memory, state)          # every row: a drawn word may differ from the reference's length

    shrinks: bool = True                    # teacher forcing may drop ended captions from the batch (`unroll`'s lengths)

    def teacher_forcing(self, batch: Mapping[str, Any]) -> dict:
        "Teacher forcing over `batch['caps']` (B, T) starting with `<start>`: logits (B, T-1, V) and stacked extras (B, T-1, ...)."
        memory, state = self.init_state(batch)
        return unroll(self.step, batch["caps"][:, :-1], memory, state, self.target_lengths(batch["caps"]))

    def target_lengths(self, caps: torch.Tensor) -> torch.Tensor | None:
        "The steps each caption of `caps` (B, T) needs, its words and `<end>`: (B,); None where the model keeps every row."
        return (caps[:, 1:] != self.pad).sum(1) if self.shrinks else None

    @property
    def n_params(self) -> int:
        "Number of trainable parameters."
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

def unroll(step: Callable, xs: torch.Tensor, memory: dict, state: dict, lengths: torch.Tensor | None = None) -> dict:
    "Run `step(xs[:, t], memory, state)` for every t: logits (B, T, V) and every extra stacked (B, T, ...); an extra a step gives as None (an attention without that part) is left out. With `lengths` (B,) the rows whose caption has ended leave the batch (`unroll_shrinking`)."
    if lengths is not None and fast() and int(lengths.min()) < xs.shape[1]:
        return unroll_shrinking(step, xs, memory, state, lengths)
    logits, extras = [], {}
    for x in xs.unbind(1):              # unbind, not xs[:, t]: for an input with gradients (SPCA's K_X * X_t) each index
        lg, state, aux = step(x, memory, state)   # zero-fills a (B, T, ...) gradient; unbind stacks them once (same bits)
        logits.append(lg)
        for k, v in aux.items():
            if v is not None: extras.setdefault(k, []).append(v)
    return {"logits": torch.stack(logits, 1), **{k: torch.stack(v, 1) for k, v in extras.items()}}

def unroll_shrinking(step: Callable, xs: torch.Tensor, memory: dict, state: dict, lengths: torch.Tensor) -> dict:
    "`unroll` computing, at step t, only the rows with lengths > t (sorted longest first, so they are a prefix): ended rows' logits and extras are zeros, as the loss masks them (the tutorial's shrinking batch, `decode_lengths`)."
    B, T = xs.shape[:2]
    order = lengths.argsort(descending=True, stable=True)                       # longest first: (B,)
    live = (lengths[order][None, :] > torch.arange(T, device=xs.device)[:, None]).sum(1).tolist()   # rows at each step
    def per_row(d, rows, idx):                                                  # v[idx] for the entries with a row per caption
        return {k: v[idx] if isinstance(v, torch.Tensor) and v.dim() and len(v) == rows else v for k, v in d.items()}
    memory, state = per_row(memory, B, order), per_row(state, B, order)
    xs, out, rows = xs[order], {}, B                                            # out: name -> (B, T, ...) zeros, filled by step
    for t, x in enumerate(xs.unbind(1)):
        n = live[t]
        if n == 0: break                                                        # every caption has ended: the rest stay zeros
        lg, state, aux = step(x[:n], per_row(memory, B, slice(n)), per_row(state, rows, slice(n)))
        rows = n
        for k, v in {"logits": lg, **aux}.items():
            if v is None: continue
            if k not in out: out[k] = v.new_zeros((B, T, *v.shape[1:]))
            out[k][:n, t] = v
    inverse = order.argsort()
    return {k: v.index_select(0, inverse) for k, v in out.items()}

_FAST = [True]

def fast() -> bool:
    "Whether the models take their fast paths (the default); `plain_paths()` turns them off."
    return _FAST[0]

@contextlib.contextmanager
def plain_paths():
    "Within this block every speed-up is off and the models run the plain equations' code: the tests train a model both ways and compare its weights."
    old, _FAST[0] = _FAST[0], False
    try: yield
    finally: _FAST[0] = old


# %% [markdown]
# **Keyed draws.** A run's random numbers normally come from torch's generator, seeded once: the draws a model takes
# depend on everything drawn before them in the process. Two runs trained as one stacked model (`capbook.train`'s
# stacked runs: several seeds as one `vmap`-ed step) share one process, and `vmap` draws one tensor for all of them, so
# neither run would see the numbers it sees alone. Inside `keyed(key)` the models' draws are instead a pure function,
# a counter-based generator in the manner of Salmon et al.'s Philox (SC 2011) and JAX's keys: element $i$ of the
# $k$-th draw under key $s$ is
#
# $$u = \operatorname{mix}\bigl(\operatorname{mix}(s \cdot \phi + k) + i\bigr) \gg 40 \quad\in [0, 2^{24})$$
#
# with mix SplitMix64's finaliser and $\phi$ the golden-ratio constant. The index $i$ gives each dimension its own bits
# (16 each for four dimensions), so a caption padded to a longer batch draws the same numbers for its real words. Nothing in it reads or
# advances a generator, so a run draws the same numbers alone or stacked, on any device, and a captured CUDA graph
# replays it with a new key. *capbook:* the book's CPU runs keep torch's generator (the keyed draws cost about a dozen
# integer operations per element, and switching would move every published number); keyed draws are what stacked
# runs and their lone equivalents use (`TrainConfig.draws='keyed'`).

# %%
#| export
_KEY: list = [None, 0]      # the keyed draws' key (an int64 tensor) and the draws taken under it

@contextlib.contextmanager
def keyed(key: torch.Tensor):
    "Within this block every random draw of the models (dropout, hard attention's locations) is a function of `key` (an int64 tensor of any shape that broadcasts to a scalar per run: under `vmap`, one per stacked member), the draw's rank in the block and the element's index: the same numbers whatever else draws, in one run or stacked with others."
    old, _KEY[:] = list(_KEY), [key, 0]
    try: yield
    finally: _KEY[:] = old

def keyed_draws() -> bool:
    "Whether the models draw from a key (inside `keyed`)."
    return _KEY[0] is not None

def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    "Logical right shift of int64 `z` by `s` bits (torch's >> on int64 is arithmetic)."
    return (z >> s) & ((1 << (64 - s)) - 1)

def mix64(z: torch.Tensor) -> torch.Tensor:
    "SplitMix64's finaliser (Steele et al. 2014) on int64 tensors: every input bit flips about half the output bits."
    z = (z ^ _srl(z, 30)) * -4658895280553007687             # 0xBF58476D1CE4E5B9
    z = (z ^ _srl(z, 27)) * -7723592293110705685             # 0x94D049BB133111EB
    return z ^ _srl(z, 31)

def keyed_uniform(shape: tuple, device=None) -> torch.Tensor:
    "Integers uniform on [0, 2^24), of `shape`, the next keyed draw (inside `keyed`): hash(key, draw, index) with each dimension's index in its own bits, so an element's number does not depend on how far the other dimensions are padded."
    key, k = _KEY
    _KEY[1] = k + 1
    bits = 64 // max(1, len(shape))                              # 64 bits shared by the dimensions (16 each for 4)
    if any(n >= 1 << bits for n in shape):
        raise CapbookError(f"a keyed draw of shape {tuple(shape)}: each of its {len(shape)} dimensions must be below {1 << bits}")
    idx = torch.zeros((), dtype=torch.long, device=device)
    for d, n in enumerate(shape):                                # sum_d i_d 2^(bits (D - 1 - d)), broadcast: shape
        idx = idx[..., None] + torch.arange(n, device=device) * (1 << (bits * (len(shape) - 1 - d)))
    base = mix64(key * -7046029254386353131 + k)              # one number per (key, draw): 0x9E3779B97F4A7C15
    return _srl(mix64(base + idx), 40)

class Dropout(nn.Dropout):
    "`nn.Dropout` with p rounded to a multiple of 1/65536: each element zeroed with that probability and the rest scaled by its inverse, drawn on the CPU from 16-bit uniforms (two per 32-bit draw: 2.7x faster than torch's `bernoulli_`, 1.6x than comparing float uniforms); on a GPU, torch's fused kernel; inside `keyed`, from the key."
    def forward(self, x):
        if not self.training or self.p == 0: return x
        if keyed_draws():
            cut = round(self.p * (1 << 24))                      # P(u < cut) = round(2^24 p) / 2^24, the dropped share
            # x * mask / P(keep)
            return x * (keyed_uniform(x.shape, x.device) >= cut) * ((1 << 24) / ((1 << 24) - cut))
        if x.device.type != "cpu" or not fast(): return super().forward(x)
        n = x.numel()
        # u: 16-bit integers uniform on [-32768, 32767], two from each 32-bit draw: x's shape
        u = torch.empty((n + 1) // 2, dtype=torch.int32).random_(-2 ** 31, None).view(torch.int16)[:n].view(x.shape)
        cut = round(self.p * 65536) - 32768                 # P(u < cut) = round(65536 p) / 65536, the dropped share
        # x * mask / P(keep)
        return x * (u >= cut) * (65536 / (32768 - cut))

class _Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.sigmoid(x * 2).mul_(2).sub_(1)           # tanh x = 2 sigma(2x) - 1
        ctx.save_for_backward(y)
        return y
    @staticmethod
    def backward(ctx, g):
        y, = ctx.saved_tensors
        return g * (1 - y * y)                              # d tanh x / dx = 1 - tanh^2 x

def tanh(x: torch.Tensor) -> torch.Tensor:
    "`torch.tanh(x)`, computed on the CPU as 2σ(2x) − 1: torch's CPU tanh has no vectorised path on the AVX CPU the book was timed on (about 10x slower than its sigmoid; it would take a fifth of SCA-CNN's step)."
    return _Tanh.apply(x) if x.device.type == "cpu" and fast() else torch.tanh(x)

def check_inputs(model: CaptionModel, batch: Mapping[str, Any]) -> None:
    "Stop with one line if `batch` lacks an input the model declares."
    missing = [k for k in model.inputs if k not in batch]
    if missing:
        raise CapbookError(f"model {model.name or type(model).__name__} needs batch input(s) {', '.join(missing)}; "
                           f"the batch has {', '.join(sorted(batch))} (add per-image inputs with CaptionData.with_inputs)")
    if "feat_mask" in batch and not model.region_masks:
        raise CapbookError(f"model {model.name or type(model).__name__} attends over every feature row and cannot read a "
                           f"variable number of regions (the data's feat_mask): use grid features (no regions parameter)")

def batch_size(model: CaptionModel, batch: Mapping[str, Any]) -> int:
    "The number of images B of a batch: the length of the model's first input."
    return len(batch[model.inputs[0]])

def image_rows(img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    "For captions whose images are `img` (N,): one row per distinct image (U,) and each caption's image among them (N,)."
    u, inv = torch.unique(img, return_inverse=True)
    first = torch.zeros(len(u), dtype=torch.long, device=img.device).scatter_(0, inv, torch.arange(len(img), device=img.device))
    return first, inv

def image_groups(img: torch.Tensor, every: int | None = None) -> tuple[torch.Tensor, int] | None:
    "For captions whose images are `img` (N,): when they come in equal runs of G captions of one image (an image-ordered batch), each run's first row (N/G,) and G; else None. Found by `captions_per_image` on the fast paths; `every`: G, found on the host beforehand: no check and no host synchronisation, on any path."
    if not every:
        if len(img) == 0 or not fast(): return None
        if not (every := captions_per_image(img)): return None          # unequal runs, or an image in two runs
    return torch.arange(0, len(img), every, device=img.device), every

def captions_per_image(img) -> int | None:
    "G when the captions whose images are `img` (N,) come in equal runs of G captions of distinct images, found on the host (NumPy) before a step; else None. A batch that carries it as `captions_per_image` lets a model encode each image once without looking (`image_groups(img, every=G)`), as a graph-ready step needs."
    import numpy as np
    img = np.asarray(img.cpu() if isinstance(img, torch.Tensor) else img)
    if len(img) == 0: return None
    starts = np.flatnonzero(np.r_[True, img[1:] != img[:-1]])
    G = len(img) // len(starts)
    if G * len(starts) != len(img) or not np.array_equal(starts, np.arange(0, len(img), G)) or len(np.unique(img[starts])) != len(starts):
        return None
    return int(G)

def repeat_batch(batch: Mapping[str, Any], n: int) -> dict:
    "Every row of the batch repeated `n` times, copies adjacent (tensors and lists alike)."
    if n == 1: return dict(batch)
    return {k: v.repeat_interleave(n, 0) if isinstance(v, torch.Tensor) else [x for x in v for _ in range(n)]
            for k, v in batch.items()}

def token_nll(logits: torch.Tensor, targets: torch.Tensor, pad: int = 0, smoothing: float = 0.0) -> torch.Tensor:
    "Mean negative log-likelihood of `targets` (B, T) under `logits` (B, T, V), ignoring `pad` positions (with `smoothing` ε: against (1-ε)·one-hot + ε/V)."
    return F.cross_entropy(wide(logits.reshape(-1, logits.shape[-1])), targets.reshape(-1), ignore_index=pad,
                           label_smoothing=smoothing)


# %% [markdown]
# Keyed draws are a function of the key, the draw's rank and the element's place: a padded draw holds the unpadded
# one, the next draw differs, and under `vmap` each member's key gives the numbers it gives alone. Dropout under a key
# drops its share:

# %%
from torch.func import vmap
with keyed(torch.tensor(7)): _a, _b = keyed_uniform((3, 5)), keyed_uniform((3, 5))
with keyed(torch.tensor(7)): _a2 = keyed_uniform((4, 9))
assert torch.equal(_a, _a2[:3, :5]) and not torch.equal(_a, _b)
def _draw(key):
    with keyed(key): return keyed_uniform((6,))
assert torch.equal(vmap(_draw)(torch.tensor([7, 8]))[1], _draw(torch.tensor(8)))
with keyed(torch.tensor(3)): _y = Dropout(0.25).train()(torch.ones(200_000))
assert abs((_y == 0).float().mean().item() - 0.25) < 0.005 and torch.allclose(_y[_y != 0], torch.tensor(4 / 3))
print(f"dropped {(_y == 0).float().mean().item():.4f} of 200,000 at p = 0.25")


# %% [markdown]
# ## Configs and the registry
#
# A model is a module plus a registry entry. Its hyperparameters live in **one config dataclass**, each field with its
# default and a comment, declared once (as nanoGPT's `GPTConfig`): the model's constructor reads the config, the
# chapter's papermill `parameters` cell is generated from it (`capbook.runner`), and `build` fills it from keyword
# arguments, stopping with one line on a name the config does not have. A config may define `check()` to validate
# its values (an even kernel, an unknown structure) with one line naming the parameter and what is allowed.
#
# `@register(name, Config, objective=..., **preset)` on a factory `f(cfg, vocab_size, feat_dim, grid)` registers it.
# `preset` fixes fields for that name (`sat_hard` is `ShowAttendTell` with `attention='hard'`); `objective` builds
# the model's training objective from its config (`capbook.objectives`: cross-entropy when not given), so the
# objective lives outside the model and the trainer takes it from the registry, and so does the training recipe the
# model's paper or its peers use (`train`: `TrainConfig` fields, e.g. the transformers' warm-up schedule). The paper modules register their
# models on import; `build` imports every capbook module on first use, so `capbook.models.build("sat_soft", ...)`
# works from a plain `import capbook`, and a new paper adds nothing to any list.

# %%
#| export
@dataclass
class ModelSpec:
    "A registry entry: the factory, its config class, fixed config values, the objective the paper trains it with and its training recipe."
    name: str
    factory: Callable[..., CaptionModel]
    config: type
    preset: dict = field(default_factory=dict)
    objective: Callable[[Any], Any] | None = None
    doc: str = ""
    train: dict = field(default_factory=dict)    # TrainConfig fields this kind of model trains with (a schedule)

REGISTRY: dict[str, ModelSpec] = {}

def register(name: str, config: type, objective: Callable[[Any], Any] | None = None, train: dict | None = None, **preset):
    "Decorator: register a model factory `f(cfg, vocab_size, feat_dim, grid)` under `name` with its config class (and `train`: TrainConfig fields)."
    def deco(factory):
        REGISTRY[name] = ModelSpec(name, factory, config, preset, objective, (factory.__doc__ or "").strip(), dict(train or {}))
        return factory
    return deco

def _load_all():
    import capbook
    for m in pkgutil.iter_modules(capbook.__path__):
        if not m.name.startswith("_"): importlib.import_module(f"capbook.{m.name}")

def available() -> list[str]:
    "Names of all registered models."
    _load_all(); return sorted(REGISTRY)

def spec(name: str) -> ModelSpec:
    "The registry entry of `name`, or one line naming the registered models."
    if name not in REGISTRY: _load_all()
    if name not in REGISTRY:
        raise CapbookError(f"parameter model={name!r} is invalid: allowed values are {', '.join(map(repr, sorted(REGISTRY)))}")
    return REGISTRY[name]

def make_config(name: str, **hparams):
    "The config of model `name` with `hparams` over its defaults and preset, checked."
    s = spec(name)
    known = {f.name for f in dataclasses.fields(s.config)}
    unknown = sorted(set(hparams) - known)
    if unknown:
        raise CapbookError(f"parameter {unknown[0]} is unknown for model {name}: known parameters are {', '.join(sorted(known))}")
    fixed = {k: v for k, v in hparams.items() if k in s.preset and v != s.preset[k]}
    if fixed:
        k = next(iter(fixed))
        raise CapbookError(f"parameter {k}={fixed[k]!r} is invalid for model {name}, which fixes {k}={s.preset[k]!r}")
    cfg = s.config(**{**hparams, **s.preset})
    if hasattr(cfg, "check"): cfg.check()
    return cfg

def build(name: str, vocab_size: int, feat_dim: int, grid: tuple[int, int], **hparams) -> CaptionModel:
    "Build the registered model `name` for a vocabulary, feature size D and feature grid (h, w); `hparams` set config fields."
    cfg = make_config(name, **hparams)
    model = spec(name).factory(cfg, vocab_size=vocab_size, feat_dim=feat_dim, grid=tuple(grid))
    model.name, model.config = name, cfg
    return model

def hparams(model: CaptionModel) -> dict:
    "The config fields of a built model that differ from its preset (what `build` needs to rebuild it)."
    preset = spec(model.name).preset
    return {k: v for k, v in dataclasses.asdict(model.config).items() if k not in preset}


# %% [markdown]
# A toy model shows the whole interface: it reads the mean of its features and predicts the next word from it and the
# previous word.

# %%
@dataclass
class _ToyConfig:
    emb_dim: int = 8          # word embedding size
    def check(self):
        if self.emb_dim < 1: raise CapbookError(f"parameter emb_dim={self.emb_dim!r} is invalid: expected an integer >= 1")

class _Toy(CaptionModel):
    def __init__(self, cfg, vocab_size, feat_dim, grid):
        super().__init__(vocab_size)
        self.E, self.W = nn.Embedding(vocab_size, cfg.emb_dim), nn.Linear(feat_dim + cfg.emb_dim, vocab_size)
    def init_state(self, batch): return {"mean": batch["feats"].mean(1)}, {}
    def step(self, tokens, memory, state):
        m = memory["mean"].repeat_interleave(len(tokens) // len(memory["mean"]), 0)
        return self.W(torch.cat([m, self.E(tokens)], 1)), state, {}

register("_toy", _ToyConfig)(_Toy)
_m = build("_toy", 7, 3, (2, 2), emb_dim=4)
_b = {"feats": torch.randn(2, 4, 3), "caps": torch.tensor([[1, 4, 5, 2], [1, 6, 2, 0]])}
assert _m(_b)["logits"].shape == (2, 3, 7) and _m.config.emb_dim == 4 and hparams(_m) == {"emb_dim": 4}
try: build("_toy", 7, 3, (2, 2), emb_dimm=4); raise AssertionError
except CapbookError as e: assert "emb_dimm is unknown" in str(e)
del REGISTRY["_toy"]

# %% [markdown]
# ## Using the engine from Python
#
# ```python
# from capbook.prepare import prepare
# from capbook.models import build, available
# from capbook.train import TrainConfig, fit
# from capbook.metrics import evaluate
#
# prep = prepare("shapes", "smoke")                       # data set -> frozen encoder -> memory-mapped features
# model = build("sat_soft", len(prep.vocab), prep.feat_shape[1], prep.grid, hidden_dim=512)   # fields of SATConfig
# fit(model, prep, TrainConfig(epochs=2, max_len=prep.max_len), "runs/mine/ckpt")           # with the model's objective
# print(evaluate(model, prep, "test", beam_size=3)["metrics"])
# ```
#
# The engine's extension points:
#
# - **A batch is a mapping** (`feats`, `caps`, `img`, `refs`, and any per-image input a split carries:
#   `prep.train.with_inputs(attrs=array)`). A model lists what it reads in `inputs`; trainer, decoders and evaluator
#   pass the batch through.
# - **Objectives live outside the models** (`capbook.objectives`): `CrossEntropy`, `DoublyStochastic` (Show-Attend-Tell
#   Eq. 9), `HardAttentionRule` (§4.1), `SelfCritical` (SCST with a CIDEr-D reward); `fit(..., objective=...)` trains any
#   model with any of them in the one loop.
# - **Decoding** (`capbook.decode`): `greedy`, batched `beam_search` and batched `sample`, through the same step
#   interface; length normalisation, n-gram repeat blocking and an `Ensemble` of trained models work in both searches.
# - **Training options** (`TrainConfig`): weight averaging (the protocol's default), label smoothing, scheduled sampling,
#   warm-up and the learning-rate schedules, each off unless a chapter's paper uses it.
# - **A new model** is a module plus `@register(name, Config, objective=..., train=...)`; `tests/test_engine.py` adds a
#   model with an extra input and its own objective this way.
