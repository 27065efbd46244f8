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
# > The one decoding interface every captioning model implements, and the registry that names them.

# %%
#| default_exp models

# %%
#| export
from __future__ import annotations
import importlib
from typing import Callable
import torch
from torch import nn
import torch.nn.functional as F
from capbook.core import CapbookError


# %% [markdown]
# ## The step interface
#
# Every decoder in the book — Show-Attend-Tell's LSTMs, SPCA's 1D and 2D-latent-state LSTMs, the spatial transformer,
# GLIED — is a `CaptionModel`. It implements two methods and inherits the rest:
#
# - `init_state(feats) -> (memory, state)`: `feats` are the annotation vectors (B, L, D). `memory` holds what stays fixed
#   while a caption is generated (the features and their attention projections); `state` holds what changes at every
#   step (LSTM h and c, ...). Both are dicts of tensors whose first dimension is the batch.
# - `step(tokens, memory, state) -> (logits, state, aux)`: one word; `tokens` (B,) are the previous words, `logits`
#   (B, V) the unnormalised scores of the next, `aux` a dict of per-step extras (`alpha`: (B, L) attention weights).
#
# Training (teacher forcing), greedy and beam search (`capbook.decode`), attention figures and timings are written once,
# against this interface. `memory` always has one row per image (B); `state`, `tokens` and the outputs have B·K rows,
# K ≥ 1 rows per image with the rows of an image adjacent (K = 1 in training and greedy search, the beam size in beam
# search), so a model's `step` broadcasts `memory` over the K rows of each image (`K = len(tokens) // len(memory
# tensor)`). Beam search reorders `state` along its first dimension and never copies `memory`, so a model must keep
# everything that depends on the beam history in `state`.

# %%
#| export
class CaptionModel(nn.Module):
    "Base class of every decoder: implement `init_state` and `step`; `forward` (teacher forcing) and `loss` come for free."
    pad, start, end = 0, 1, 2
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def init_state(self, feats: torch.Tensor) -> tuple[dict, dict]:
        "Return `(memory, state)` for annotation vectors `feats` (B, L, D)."
        raise NotImplementedError

    def step(self, tokens: torch.Tensor, memory: dict, state: dict) -> tuple[torch.Tensor, dict, dict]:
        "One decoding step: previous words (B,) -> next-word logits (B, V), new state, extras such as `alpha` (B, L)."
        raise NotImplementedError

    def forward(self, feats: torch.Tensor, caps: torch.Tensor) -> dict:
        "Teacher forcing over `caps` (B, T) starting with `<start>`: logits (B, T-1, V) and stacked extras (B, T-1, ...)."
        memory, state = self.init_state(feats)
        logits, extras = [], {}
        for t in range(caps.shape[1] - 1):
            lg, state, aux = self.step(caps[:, t], memory, state)
            logits.append(lg)
            for k, v in aux.items(): extras.setdefault(k, []).append(v)
        return {"logits": torch.stack(logits, 1), **{k: torch.stack(v, 1) for k, v in extras.items()}}

    def loss(self, out: dict, caps: torch.Tensor) -> tuple[torch.Tensor, dict]:
        "Cross-entropy of the next word, averaged over real (non-pad) target tokens; models add their own terms."
        nll = token_nll(out["logits"], caps[:, 1:])
        return nll, {"nll": nll.item()}

    @property
    def n_params(self) -> int:
        "Number of trainable parameters."
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

def token_nll(logits: torch.Tensor, targets: torch.Tensor, pad: int = 0) -> torch.Tensor:
    "Mean negative log-likelihood of `targets` (B, T) under `logits` (B, T, V), ignoring `pad` positions."
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=pad)


# %% [markdown]
# ## The registry
#
# A model is a module plus a registry entry: `@register("name")` on a factory `f(vocab_size, feat_dim, grid, **hparams)`.
# The paper notebooks export the modules that register their models; `build` imports them on first use, so
# `capbook.models.build("sat_soft", ...)` works from a plain `import capbook`.

# %%
#| export
REGISTRY: dict[str, Callable[..., CaptionModel]] = {}
MODEL_MODULES = ["capbook.sat", "capbook.spca"]  # modules whose import registers models; a new paper adds its module here

def register(name: str):
    "Decorator: register a model factory under `name`."
    def deco(factory):
        REGISTRY[name] = factory; return factory
    return deco

def _load_all():
    for m in MODEL_MODULES:
        try: importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name != m: raise

def available() -> list[str]:
    "Names of all registered models."
    _load_all(); return sorted(REGISTRY)

def build(name: str, vocab_size: int, feat_dim: int, grid: tuple[int, int], **hparams) -> CaptionModel:
    "Build the registered model `name` for a vocabulary, feature size D and feature grid (h, w)."
    _load_all()
    if name not in REGISTRY:
        raise CapbookError(f"parameter model={name!r} is invalid: allowed values are {', '.join(map(repr, sorted(REGISTRY)))}")
    return REGISTRY[name](vocab_size=vocab_size, feat_dim=feat_dim, grid=tuple(grid), **hparams)
