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
# # The baselines: Show and Tell, Att2in, SCA-CNN, Up-Down, the Captioning Transformer, and SCST on them
#
# > The models the five papers compare themselves with, measured on the same features, data, trainer and beam search instead of quoted: Show and Tell (Vinyals et al. 2015) and its every-step variant, Att2in and self-critical training (Rennie et al. 2017), SCA-CNN (Chen et al. 2017), Up-Down (Anderson et al. 2018) and the Captioning Transformer (Zhu et al. 2018).
#
# Every paper of this book compares itself with models it only quotes: SPCA's Table 4 quotes Google NIC, SCA-CNN and
# Att2in; GLIED's Table 1 quotes SCST and Up-Down, its Table 2 an LSTM, SoftAtt, Up-Down and CT; Show-Attend-Tell's
# Table 1 quotes Google NIC. Quoted numbers come from other features, other vocabularies and other training budgets.
# This chapter implements each baseline as one module and one registry entry, on the book's one trainer, one beam search
# and one evaluator, so the paper tables of the other chapters can put a **measured** row beside each quoted one.
#
# | model | paper | what it adds to the LSTM | registry name |
# |---|---|---|---|
# | Show and Tell (NIC) | Vinyals et al. 2015, [arXiv:1411.4555](https://arxiv.org/abs/1411.4555) | the image once, as the first input | `nic` |
# | LSTM (GLIED Table 2's row) | Lu et al. 2017's form, [arXiv:1612.01887](https://arxiv.org/abs/1612.01887) | the mean image feature with every word | `lstm` |
# | Att2in | Rennie et al. 2017, [arXiv:1612.00563](https://arxiv.org/abs/1612.00563) | attention fed to the cell input only | `att2in` |
# | SCA-CNN | Chen et al. 2017, [arXiv:1611.05594](https://arxiv.org/abs/1611.05594) | channel-wise, then spatial attention | `sca_cnn` |
# | Up-Down | Anderson et al. 2018, [arXiv:1707.07998](https://arxiv.org/abs/1707.07998) | an attention LSTM below a language LSTM | `updown` |
# | CT | Zhu et al. 2018, [doi:10.3390/app8050739](https://doi.org/10.3390/app8050739) | a transformer decoder of six blocks | `ct` |
# | SCST | Rennie et al. 2017 | self-critical training on CIDEr-D | `scst_epochs` on `att2in`, `updown` |
#
# This notebook holds the models, equation by equation, and runs **one** of them (parameter `model`). The book runs all
# six, Att2in and Up-Down each followed by self-critical training, and the next chapter, *All models of the book side by
# side*, puts them beside every other model of the book; their rows also appear in Show-Attend-Tell's Table 1, SPCA's
# Table 4 and GLIED's Tables 1 and 2.
#
# *capbook:* notation as in each paper; $a_i \in \mathbb{R}^D$, $i = 1..L$, are the regions (the encoder's 14×14 grid, or
# bottom-up regions on the real path), $\bar a = \frac1L \sum_i a_i$ their mean, $E$ the word embedding, $w_{t-1}$ the
# previous word. The recurrent baselines share Show-Attend-Tell's sizes by default (embedding 128, LSTM 256, attention
# 128, dropout 0.5 on the LSTM output), so a difference in a table is a difference in the model, not in its width.

# %%
#| default_exp baselines

# %%
#| export
from __future__ import annotations
from dataclasses import dataclass
import torch
from torch import nn
import torch.nn.functional as F
from capbook.core import check_choice, check_float, check_int
from capbook.attention import Attention, SoftAttention
from capbook.models import CaptionModel, Dropout, register, tanh
from capbook.objectives import DoublyStochastic
from capbook.sat import SATConfig, ShowAttendTell, WIDTHS
from capbook.ssa import WARMUP, SSAConfig, SpatialTransformer
from capbook.profiles import BUDGET, Chapter, LADDER, SCST_RUNGS, RunConfig, register_chapter, protocol_epochs, scst_budget

# %%
#| hide
import pandas as pd
from IPython.display import Image as IPImage, display
from capbook.runner import run_chapter
from capbook.viz import stage_tables


# %% [markdown]
# ## The recurrent baselines' sizes
#
# One config for the four LSTM baselines (each adds only what its paper adds), so that a width is declared once.

# %%
#| export
@dataclass
class RecurrentConfig:
    "The sizes every recurrent baseline shares (Show-Attend-Tell's defaults, so the LSTMs of the book compare at one width)."
    emb_dim: int = SATConfig.emb_dim          # the word (and image) embedding size
    hidden_dim: int = SATConfig.hidden_dim    # the LSTM size (Up-Down: each of its two LSTMs)
    att_dim: int = SATConfig.att_dim          # the attention's hidden size
    dropout: float = SATConfig.dropout        # on the LSTM output before the word layer

    def check(self):
        "Stop with one line on an invalid value."
        for n in ("emb_dim", "hidden_dim", "att_dim"): check_int(n, getattr(self, n), lo=1)
        check_float("dropout", self.dropout, lo=0, hi=0.95)

def _rows(x: torch.Tensor, R: int) -> torch.Tensor:
    "A per-image tensor (B, ...) for the decoder's R = B*K rows (an image's rows adjacent, as beam search keeps them)."
    return x if len(x) == R else x.repeat_interleave(R // len(x), 0)

def _mean_region(a: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    "The mean region a̅ = 1/L Σ_i a_i over the real regions: (B, L, D) -> (B, D)."
    if mask is None: return a.mean(1)
    m = mask.to(a.dtype)[..., None]                                       # (B, L, 1)
    return (a * m).sum(1) / m.sum(1).clamp_min(1)


# %% [markdown]
# ## Show and Tell (Vinyals et al. 2015) and the every-step LSTM
#
# Vinyals et al. feed the image **once**, before the first word, and never again (§3.1, Eq. 10–12):
# $$x_{-1} = \mathrm{CNN}(I), \qquad x_t = W_e S_t, \qquad p_{t+1} = \mathrm{LSTM}(x_t),$$
# the CNN's image vector projected to the word-embedding size, the LSTM's state starting from zero. The paper argues
# for it: feeding the image at each time step "yields inferior results, as the network can explicitly exploit noise in
# the image and overfits more easily". GLIED's Table 2 row "LSTM" is the other choice: a one-layer LSTM that "inputs
# visual features at each timestep as Lu et al. [2017]" — Lu et al.'s baseline concatenates the global image feature
# $v^g = \mathrm{ReLU}(W_b a^g)$ with every word embedding, $x_t = [w_t; v^g]$. One module computes both
# (`image_input` = `first` | `every`), registered under two names, so every table says which row is which.
#
# *capbook:* the CNN's image vector is the mean region $\bar a$ of the book's frozen features (Vinyals et al. used
# GoogLeNet's pooled output, itself a mean over its last map); no beam-time ensembling; dropout on $h_t$ before the
# word layer, as Vinyals et al. regularise with dropout and nothing else.
#
# *capbook:* on shapes, NIC does not learn to use the image within the book's budget: in the first default runs its
# validation CIDEr stayed near the blind caption's for 10 epochs, with the image embedding batch-normalised too, or
# with the forget gates' bias at 1 so that the first step's state survives longer. The mean of the shapes features
# varies little from image to image (a standard deviation of about 0.2 per channel against a mean of 0.9), and NIC
# sees it once, 15 steps before the last word; the every-step LSTM, which sees it with every word, does learn. The
# module stays the paper's; the table row says what it measures.

# %%
#| export
IMAGE_INPUTS = ("first", "every")

@dataclass
class NICConfig(RecurrentConfig):
    "Show and Tell's decoder; `image_input` is fixed by the registry entry (nic: first, lstm: every)."
    image_input: str = "first"                # first: x_{-1} = W_I a̅ only (Vinyals et al.) | every: [E w; v^g] at every step (Lu et al.)

    def check(self):
        super().check(); check_choice("image_input", self.image_input, IMAGE_INPUTS)

class ShowAndTell(CaptionModel):
    "One LSTM over the words, the image either its first input (Vinyals et al.) or beside every word (Lu et al.'s baseline)."
    region_masks = True
    def __init__(self, cfg: NICConfig, vocab_size: int, feat_dim: int, grid: tuple[int, int]):
        super().__init__(vocab_size)
        m, n, self.every = cfg.emb_dim, cfg.hidden_dim, cfg.image_input == "every"
        self.E = nn.Embedding(vocab_size, m)                       # W_e
        self.W_I = nn.Linear(feat_dim, m)                          # the image embedding (Vinyals: into x_{-1}; Lu: W_b)
        self.lstm = nn.LSTMCell(2 * m if self.every else m, n)
        self.W_o = nn.Linear(n, vocab_size)                        # p_{t+1} = softmax(W_o h_t)
        self.drop = Dropout(cfg.dropout)

    def init_state(self, batch):
        a = batch["feats"]                                         # regions: (B, L, D)
        mean = _mean_region(a, batch.get("feat_mask"))             # a̅: (B, D)
        zero = a.new_zeros(len(a), self.lstm.hidden_size)          # h, c start at 0: (B, n)
        if self.every:
            # v^g = ReLU(W_b a^g): (B, m), beside every word
            return {"vg": F.relu(self.W_I(mean))}, {"h": zero, "c": zero}
        # x_{-1} = W_I CNN(I): (B, m); the LSTM's first step reads the image, and only that step
        h, c = self.lstm(self.W_I(mean), (zero, zero))
        return {}, {"h": h, "c": c}

    def step(self, tokens, memory, state):
        # x_t = W_e S_t: (R, m); with the image at every step, [W_e S_t; v^g]: (R, 2m)
        x = self.E(tokens)
        if self.every: x = torch.cat([x, _rows(memory["vg"], len(x))], 1)
        # h_t, c_t = LSTM(x_t, h_{t-1}, c_{t-1}): (R, n)
        h, c = self.lstm(x, (state["h"], state["c"]))
        # p_{t+1} = softmax(W_o h_t): (R, V)
        return self.W_o(self.drop(h)), {"h": h, "c": c}, {}

@register("nic", NICConfig, image_input="first")
def nic(cfg: NICConfig, vocab_size, feat_dim, grid):
    "Show and Tell (Vinyals et al. 2015): the image once, as the LSTM's first input."
    return ShowAndTell(cfg, vocab_size, feat_dim, grid)

@register("lstm", NICConfig, image_input="every")
def lstm(cfg: NICConfig, vocab_size, feat_dim, grid):
    "GLIED Table 2's LSTM: one LSTM with the mean image feature beside every word (Lu et al. 2017's baseline)."
    return ShowAndTell(cfg, vocab_size, feat_dim, grid)


# %% [markdown]
# A check: the image reaches the words only through the first step's state in `nic`, and with every word in `lstm`.

# %%
_a = torch.randn(2, 6, 8)
for _name in ("nic", "lstm"):
    _m = nic(NICConfig(emb_dim=4, hidden_dim=5, image_input="first" if _name == "nic" else "every"), 9, 8, (2, 3)).eval()
    _mem, _st = _m.init_state({"feats": _a})
    assert (_st["h"].abs().sum() > 0) == (_name == "nic") and ("vg" in _mem) == (_name == "lstm")
    assert _m.step(torch.tensor([1, 1]), _mem, _st)[0].shape == (2, 9)


# %% [markdown]
# ## Att2in (Rennie et al. 2017)
#
# The attention model of the self-critical paper (§3, "Attention Model (Att2in)"): the attended image feature enters
# **only the cell input** of the LSTM, through a maxout non-linearity with two units, and the state starts at zero:
# $$\begin{aligned} i_t &= \sigma(W_{ix} x_t + W_{ih} h_{t-1} + b_i), \quad f_t = \sigma(W_{fx} x_t + W_{fh} h_{t-1} + b_f), \quad o_t = \sigma(W_{ox} x_t + W_{oh} h_{t-1} + b_o) \\
# c_t &= i_t \odot \phi(W_{cx} x_t + W_{ch} h_{t-1} + W_{cI} I_t + b_c) + f_t \odot c_{t-1}, \qquad h_t = o_t \odot \tanh(c_t), \qquad s_t = W_s h_t \end{aligned}$$
# with $x_t = E w_{t-1}$ and the attention $I_t = \sum_i \alpha_t^i I_i$, $\alpha_t = \mathrm{softmax}(a_t)$,
# $a_t^i = W \tanh(W_{aI} I_i + W_{ah} h_{t-1})$ — the additive attention of Show-Attend-Tell, which is capbook's one
# `SoftAttention` module. $\phi(u) = \max(u^{(1)}, u^{(2)})$ is the maxout of two linear pieces.
#
# *capbook:* dropout on $h_t$ before $W_s$ (the paper does not say; its released code does so).

# %%
#| export
class Att2in(CaptionModel):
    "Rennie et al.'s Att2in: an LSTM whose cell input alone reads the attended image feature, through a two-unit maxout."
    region_masks = True
    def __init__(self, cfg: RecurrentConfig, vocab_size: int, feat_dim: int, grid: tuple[int, int]):
        super().__init__(vocab_size)
        m, n = cfg.emb_dim, cfg.hidden_dim
        self.n = n
        self.E = nn.Embedding(vocab_size, m)                       # x_t = E w_{t-1}
        self.att = SoftAttention(feat_dim, n, cfg.att_dim)         # a_t = W tanh(W_aI I + W_ah h_{t-1})
        self.W_x = nn.Linear(m, 5 * n)                             # W_ix, W_fx, W_ox, and W_cx for both maxout pieces (+ b)
        self.W_h = nn.Linear(n, 5 * n, bias=False)                 # W_ih, W_fh, W_oh, W_ch (both pieces)
        self.W_cI = nn.Linear(feat_dim, 2 * n, bias=False)         # W_cI: the image, into the cell input only
        self.W_s = nn.Linear(n, vocab_size)                        # s_t = W_s h_t
        self.drop = Dropout(cfg.dropout)

    def init_state(self, batch):
        a = batch["feats"]                                         # I_i: (B, L, D)
        memory = self.att.memory(a)
        if batch.get("feat_mask") is not None: memory["mask"] = batch["feat_mask"]
        zero = a.new_zeros(len(a), self.n)                         # h_0 = c_0 = 0: (B, n)
        return memory, {"h": zero, "c": zero}

    def step(self, tokens, memory, state):
        h, c, n = state["h"], state["c"], self.n                   # h_{t-1}, c_{t-1}: (R, n)
        # I_t = sum_i alpha_t^i I_i, alpha_t = softmax(W tanh(W_aI I + W_ah h_{t-1})): (R, D), (R, L)
        I, alpha, _ = self.att(memory["a"], memory["pre"], h, mask=memory.get("mask"))
        # W_*x x_t + W_*h h_{t-1} + b_*: (R, 5n)
        g = self.W_x(self.E(tokens)) + self.W_h(h)
        # i_t, f_t, o_t = sigma(...): (R, n) each
        i, f, o = torch.sigmoid(g[:, :3 * n]).chunk(3, 1)
        # phi(W_cx x_t + W_ch h_{t-1} + W_cI I_t + b_c), phi = max of the two maxout pieces: (R, n)
        phi = (g[:, 3 * n:] + self.W_cI(I)).view(-1, 2, n).amax(1)
        # c_t = i_t ⊙ phi(.) + f_t ⊙ c_{t-1}: (R, n)
        c = i * phi + f * c
        # h_t = o_t ⊙ tanh(c_t): (R, n)
        h = o * torch.tanh(c)
        # s_t = W_s h_t: (R, V)
        return self.W_s(self.drop(h)), {"h": h, "c": c}, {"alpha": alpha}

@register("att2in", RecurrentConfig)
def att2in(cfg: RecurrentConfig, vocab_size, feat_dim, grid):
    "Att2in (Rennie et al. 2017): attention into the LSTM's cell input only; with scst_epochs, the paper's SCST model."
    return Att2in(cfg, vocab_size, feat_dim, grid)


# %% [markdown]
# ## SCA-CNN (Chen et al. 2017)
#
# SCA-CNN attends over **channels** as well as locations, both conditioned on the LSTM state $h_{t-1}$ (§3.2–3.3).
# With the conv map $V \in \mathbb{R}^{W\times H\times C}$ flattened to $V = [v_1, ..., v_m]$, $v_i \in \mathbb{R}^C$,
# $m = W\cdot H$:
#
# - **channel-wise attention** (Eq. 5): the channels' spatial means $\bar v = [\bar v_1, ..., \bar v_C]$,
#   $$b = \tanh\big((W_c \otimes \bar v + b_c) \oplus W_{hc} h_{t-1}\big) \in \mathbb{R}^{k\times C}, \qquad \beta = \mathrm{softmax}(W_{i'}^T b + b_{i'}) \in \mathbb{R}^C,$$
#   with $W_c \in \mathbb{R}^k$ (so $W_c \otimes \bar v$ is an outer product) and $\oplus$ adding a vector to every column;
# - **spatial attention** (Eq. 4) on the channel-weighted map $V' = f_c(V, \beta)$ ($v'_i = \beta \odot v_i$):
#   $$a = \tanh\big((W_s V' + b_s) \oplus W_{hs} h_{t-1}\big) \in \mathbb{R}^{k\times m}, \qquad \alpha = \mathrm{softmax}(W_i^T a + b_i) \in \mathbb{R}^m;$$
# - the **C-S** order (Eq. 6–7): $\beta = \Phi_c(h_{t-1}, V)$, $\alpha = \Phi_s(h_{t-1}, f_c(V, \beta))$,
#   $X = f(V, \alpha, \beta)$; on the last layer, $X$ is the context the LSTM reads, $\sum_i \alpha_i v'_i$.
#
# The decoder is Show-Attend-Tell's ("we follow [Xu et al.]"), so `sca_cnn` is the book's `ShowAttendTell` with this
# attention in place of its $f_{att}$, with neither the gate nor the doubly stochastic penalty (SCA-CNN has neither).
#
# *capbook: what is left out, and why.* SCA-CNN attends in **several** conv layers of the CNN (e.g. VGG's conv5_3 and
# conv5_4, ResNet's res5c and res4f), each modulated map feeding the next layers *through the CNN*, at every word. With
# frozen, cached features — the book's design, as the papers' — only the last layer exists, and re-running the upper CNN
# at every step would cost a forward pass of the backbone per word; so capbook implements the part that applies to the
# last layer (the paper's single-layer rows). `order="S-C"` gives the other order of §3.3 for the ablation.
#
# *capbook: β's scale, from the authors' code.* $\beta$ is a softmax over the $C$ channels, as in the paper, so it sums
# to 1 and $\beta \odot V$ is $V$ scaled by about $1/C$ — with 128 channels the context reached the decoder at about
# 1/128 of a feature, and the spatial attention read a map 128 times fainter (the book's first SCA-CNN row, 81.5 CIDEr,
# was trained so). The paper is silent on it; Chen et al.'s released code (`sca_resnet_branch2b.py`) multiplies the
# channel weights by the number of channels wherever they scale a map (`* 512`, `* 2048`), so a uniform $\beta$
# leaves the map as it is. capbook does the same: the map is scaled by $C\beta$, whose mean over the channels is 1.

# %%
#| export
SCA_ORDERS = ("C-S", "S-C")

class SCAttention(Attention):
    "SCA-CNN's channel-wise (Eq. 5) and spatial (Eq. 4) attention on the last conv map, in the C-S (or S-C) order."
    def __init__(self, feat_dim: int, query_dim: int, att_dim: int, order: str = "C-S"):
        super().__init__()
        C, d, k = feat_dim, query_dim, att_dim
        self.order = check_choice("order", order, SCA_ORDERS)
        self.W_c = nn.Parameter(torch.randn(k) * 0.1)             # W_c ∈ R^k
        self.b_c = nn.Parameter(torch.zeros(k, 1))                 # b_c ∈ R^k
        self.W_hc = nn.Linear(d, k, bias=False)                    # W_hc ∈ R^{k×d}
        self.W_i_c = nn.Linear(k, 1)                               # W_i' ∈ R^k, b_i'
        self.W_s = nn.Linear(C, k)                                 # W_s ∈ R^{k×C}, b_s
        self.W_hs = nn.Linear(d, k, bias=False)                    # W_hs ∈ R^{k×d}
        self.W_i_s = nn.Linear(k, 1)                               # W_i ∈ R^k, b_i

    def channel(self, vbar: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        "β = softmax(W_i'^T tanh((W_c ⊗ v̄ + b_c) ⊕ W_hc h) + b_i'): v̄ (R, C), h (R, d) -> (R, C)."
        # b = tanh((W_c ⊗ v̄ + b_c) ⊕ W_hc h_{t-1}): (R, k, C)
        b = tanh(self.W_c[None, :, None] * vbar[:, None, :] + self.b_c + self.W_hc(h)[:, :, None])
        # beta = softmax(W_i'^T b + b_i'): (R, C)
        return F.softmax(self.W_i_c(b.transpose(1, 2)).squeeze(-1), -1)

    def spatial(self, V: torch.Tensor, h: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        "α = softmax(W_i^T tanh((W_s V' + b_s) ⊕ W_hs h) + b_i) with V' = β ⊙ V: V (B, L, C), h (R, d), β (R, C) -> (R, L)."
        R = len(h)
        if scale is None: u = _rows(self.W_s(V), R)                # W_s V + b_s: (R, L, k)
        # W_s (β ⊙ v_i) + b_s = (W_s diag β) v_i + b_s: (R, L, k), one weight per row
        else: u = torch.bmm(_rows(V, R), (self.W_s.weight[None] * scale[:, None, :]).transpose(1, 2)) + self.W_s.bias
        # alpha = softmax(W_i^T tanh(u ⊕ W_hs h_{t-1}) + b_i): (R, L)
        return F.softmax(self.W_i_s(tanh(u + self.W_hs(h)[:, None])).squeeze(-1), -1)

    def precompute(self, a):                                       # a: (B, L, C) -> v̄: (B, C)
        return a.mean(1)

    def forward(self, a, pre, h, expected=None):                   # a: (B, L, C); pre: v̄ (B, C); h: (R, d)
        R, L = len(h), a.shape[1]
        weighted = lambda alpha: torch.bmm(alpha.view(len(a), -1, L), a).view(R, -1)   # sum_i alpha_i v_i: (R, C)
        C = a.shape[-1]
        if self.order == "C-S":
            # beta = Phi_c(h_{t-1}, V): (R, C)
            beta = self.channel(_rows(pre, R), h)
            # alpha = Phi_s(h_{t-1}, f_c(V, C beta)): (R, L); C beta of mean 1, as the authors' code scales it
            alpha = self.spatial(a, h, C * beta)
            av = weighted(alpha)
        else:
            # alpha = Phi_s(h_{t-1}, V): (R, L)
            alpha = self.spatial(a, h)
            av = weighted(alpha)
            # beta = Phi_c(h_{t-1}, f_s(V, alpha)), the channels' means of the spatially weighted map: (R, C)
            beta = self.channel(av / L, h)
        # X = sum_i alpha_i (C beta ⊙ v_i) = C beta ⊙ sum_i alpha_i v_i: (R, C)
        z = C * beta * av
        return z, self.keep(alpha), {"channel": beta}

@dataclass
class SCAConfig(RecurrentConfig):
    "SCA-CNN on Show-Attend-Tell's decoder: the attention's order."
    order: str = "C-S"                        # sca_cnn: C-S (channel, then spatial; the paper's) | S-C

    def check(self):
        super().check(); check_choice("order", self.order, SCA_ORDERS)

@register("sca_cnn", SCAConfig, objective=lambda cfg: DoublyStochastic(0.0))
def sca_cnn(cfg: SCAConfig, vocab_size, feat_dim, grid):
    "SCA-CNN (Chen et al. 2017), last conv layer: channel-wise then spatial attention on Show-Attend-Tell's decoder."
    att = SCAttention(feat_dim, cfg.hidden_dim, cfg.att_dim, cfg.order)
    sat = SATConfig(emb_dim=cfg.emb_dim, hidden_dim=cfg.hidden_dim, att_dim=cfg.att_dim, dropout=cfg.dropout,
                    gate=False, penalty=0.0)
    return ShowAttendTell(sat, vocab_size, feat_dim, grid, attention=att)


# %% [markdown]
# A check: with a one-hot $\beta$, SCA-CNN's context is the chosen channel's α-weighted sum and nothing else; with a
# uniform $\beta$ it is the α-weighted feature itself, at full scale.

# %%
_sca = SCAttention(4, 3, 5).eval()
_V, _h = torch.randn(2, 6, 4), torch.randn(2, 3)
_beta = F.one_hot(torch.tensor([1, 3]), 4).float()
_alpha = _sca.spatial(_V, _h, _beta)
assert torch.allclose(_alpha.sum(1), torch.ones(2)) and _alpha.shape == (2, 6)
_z, _al, _info = _sca(_V, _sca.precompute(_V), _h)
assert _z.shape == (2, 4) and torch.allclose(_info["channel"].sum(1), torch.ones(2))
with torch.no_grad(): _sca.W_i_c.weight.zero_()          # equal channel scores: beta = 1/C, so C beta = 1
_z, _al, _ = _sca(_V, _sca.precompute(_V), _h)
assert torch.allclose(_z, torch.bmm(_al.view(2, 1, 6), _V).view(2, 4), atol=1e-6)   # the plain alpha-weighted feature


# %% [markdown]
# ## Up-Down (Anderson et al. 2018)
#
# The top-down captioning model (§3.2): two LSTMs per step. The **attention LSTM** reads the language LSTM's previous
# output, the mean region and the word (Eq. 2); its output queries the regions (Eq. 3–5); the **language LSTM** reads
# the attended feature and the attention LSTM's output (Eq. 6), and its output gives the word (Eq. 7):
# $$\begin{aligned} x^1_t &= [h^2_{t-1}; \bar v; W_e \Pi_t], \qquad h^1_t = \mathrm{LSTM}(x^1_t, h^1_{t-1}) \\
# a_{i,t} &= w_a^T \tanh(W_{va} v_i + W_{ha} h^1_t), \qquad \alpha_t = \mathrm{softmax}(a_t), \qquad \hat v_t = \sum_i \alpha_{i,t} v_i \\
# x^2_t &= [\hat v_t; h^1_t], \qquad h^2_t = \mathrm{LSTM}(x^2_t, h^2_{t-1}), \qquad p(y_t \mid y_{1:t-1}) = \mathrm{softmax}(W_p h^2_t + b_p) \end{aligned}$$
#
# The regions $v_i$ are the bottom-up Faster R-CNN features in the paper; here the grid by default, and on the real path
# the same `regions=<folder>` features as GLIED's (variable $N$, padding masked out of $\bar v$ and of $\alpha$).
#
# *capbook:* the attention is the one additive module (`SoftAttention`), queried with $h^1_t$ of the current step;
# states start at zero; dropout on $h^2_t$ before $W_p$ (the paper's released code uses dropout there). The paper's
# sizes (1,000-unit LSTMs, 512-unit attention) are a parameter away: `-p hidden_dim 1000 -p att_dim 512`.

# %%
#| export
class UpDown(CaptionModel):
    "Anderson et al.'s top-down captioner: an attention LSTM, additive attention over the regions, a language LSTM."
    region_masks = True
    def __init__(self, cfg: RecurrentConfig, vocab_size: int, feat_dim: int, grid: tuple[int, int]):
        super().__init__(vocab_size)
        m, n, D = cfg.emb_dim, cfg.hidden_dim, feat_dim
        self.n = n
        self.W_e = nn.Embedding(vocab_size, m)                     # W_e Π_t
        self.att_lstm = nn.LSTMCell(n + D + m, n)                  # LSTM^1 on x^1_t = [h^2_{t-1}; v̄; W_e Π_t]
        self.att = SoftAttention(D, n, cfg.att_dim)                # a_{i,t} = w_a^T tanh(W_va v_i + W_ha h^1_t)
        self.lang_lstm = nn.LSTMCell(D + n, n)                     # LSTM^2 on x^2_t = [v̂_t; h^1_t]
        self.W_p = nn.Linear(n, vocab_size)                        # W_p h^2_t + b_p
        self.drop = Dropout(cfg.dropout)

    def init_state(self, batch):
        v, mask = batch["feats"], batch.get("feat_mask")           # v_i: (B, L, D); real regions (B, L) or None
        memory = {**self.att.memory(v), "vbar": _mean_region(v, mask)}   # v̄ = 1/k Σ_i v_i: (B, D)
        if mask is not None: memory["mask"] = mask
        zero = v.new_zeros(len(v), self.n)                         # every state starts at 0: (B, n)
        return memory, {"h1": zero, "c1": zero, "h2": zero, "c2": zero}

    def step(self, tokens, memory, state):
        R = len(tokens)
        # x^1_t = [h^2_{t-1}; v̄; W_e Π_t]: (R, n + D + m)
        x1 = torch.cat([state["h2"], _rows(memory["vbar"], R), self.W_e(tokens)], 1)
        # h^1_t = LSTM(x^1_t, h^1_{t-1}): (R, n)
        h1, c1 = self.att_lstm(x1, (state["h1"], state["c1"]))
        # v̂_t = Σ_i α_{i,t} v_i, α_t = softmax(w_a^T tanh(W_va v_i + W_ha h^1_t)): (R, D), (R, L)
        v_hat, alpha, _ = self.att(memory["a"], memory["pre"], h1, mask=memory.get("mask"))
        # h^2_t = LSTM([v̂_t; h^1_t], h^2_{t-1}): (R, n)
        h2, c2 = self.lang_lstm(torch.cat([v_hat, h1], 1), (state["h2"], state["c2"]))
        # p(y_t | y_1:t-1) = softmax(W_p h^2_t + b_p): (R, V)
        return self.W_p(self.drop(h2)), {"h1": h1, "c1": c1, "h2": h2, "c2": c2}, {"alpha": alpha}

@register("updown", RecurrentConfig)
def updown(cfg: RecurrentConfig, vocab_size, feat_dim, grid):
    "Up-Down (Anderson et al. 2018): the two-layer top-down attention LSTM, on grid or bottom-up region features."
    return UpDown(cfg, vocab_size, feat_dim, grid)


# %% [markdown]
# ## The Captioning Transformer (Zhu et al. 2018)
#
# CT replaces the LSTM by a transformer **decoder** of stacked attention blocks (masked self-attention over the words,
# attention from the words to the CNN's regions, a feed-forward network) reading the CNN features directly; GLIED's
# Table 2 describes it as "based on a transformer with six decoder blocks". It is therefore a configuration of the
# book's one transformer (`capbook.ssa.SpatialTransformer`, the spatial self-attention chapter's), not a second one:
# **no encoder layers** over the regions (that is what Springenberg et al. add), **six decoder blocks**, and the
# standard temperature $\tau = \sqrt{d_{attn}}$.
#
# *capbook: what is left out.* CT's multi-level supervision (a word prediction from every block's output, combined at
# test time) is not reproduced — GLIED's Table 2 compares the plain six-block decoder; positions are added to the
# regions, as in the book's transformer. Widths follow the chapter's profile (`d_model`, `d_hidden`) and so do the
# heads, as the spatial transformer's: each head attends in d_attn = 64 dimensions (the Transformer's 8 × 64 = 512 at
# the paper profile, one head of 64 at the CPU profiles' width of 64), so CT and the spatial transformer beside it in
# `06a_baselines_tables` differ only in what CT's paper changes (no region encoder, six blocks, τ).
#
# *capbook: its batches.* CT trains on image-ordered batches (the five captions of each image together, the
# `batch_order` of its registry entry), as the book's other transformers do and as self-critical.pytorch batches every
# model (`seq_per_img` 5): each image's keys and values of the six blocks are computed once per batch and read by its
# captions (the attention's grouped path), instead of once per caption. With the book's other speed-ups,
# CT's training went from 195 to 266 captions per second at the default sizes (`capbook bench`, one thread, best of
# three rounds); the recurrent baselines keep length-bucketed batches (Show-Attend-Tell §4.3's bucketing).

# %%
#| export
@register("ct", SSAConfig, train=WARMUP, enc_layers=0, dec_layers=6, tau="standard")
def ct(cfg: SSAConfig, vocab_size, feat_dim, grid):
    "CT (Zhu et al. 2018): the book's transformer with no region encoder, six decoder blocks and τ = √d_attn."
    return SpatialTransformer(cfg, vocab_size, feat_dim, grid)


# %% [markdown]
# ## Self-critical training (Rennie et al. 2017) on the baselines
#
# SCST is not a model but an objective: the one trainer's `SelfCritical` (`capbook.objectives`, the GLIED chapter's),
# switched on after cross-entropy by `scst_epochs`. The self-critical paper's "SCST" row is Att2in trained so; GLIED's
# Table 1 also quotes Up-Down trained so. The book runs both, and each record keeps the cross-entropy stage and the
# self-critical ones.
#
# *capbook:* the stage is run as its authors and ruotianluo's `self-critical.pytorch` run it, and as the book runs every row:
# - **It continues its start.** It starts from the selected cross-entropy weights with that run's Adam moments (the
#   reference's `optimizer.pth`), and its weight average goes on at full decay. The cross-entropy cosine ended at a rate of
#   0, so the rate climbs back over one epoch to Rennie et al.'s 5·10⁻⁵ and stays there: one continuous rate, where a
#   fresh Adam at full rate would take a sign-sized step on every weight at once.
# - **Its budget is the peers', then the ladder's.** 2/3 of the row's cross-entropy epochs (20 after 30 in the
#   reference configs), then the ladder rule, which holds for every row of the book: at 20 epochs most seeds of both
#   of Up-Down's arms were still gaining in their last three, so its stages climbed to 40; at 40 most seeds of both
#   arms of GLIED's, its base's and Att2in's stages were still gaining, so every "+ SCST" row climbed to 80; at 80 most
#   seeds of Att2in's stages were still gaining (its mean-baseline arm's and its greedy-baseline arm's), so every
#   "+ SCST" row climbs to 160 (`SCST_RUNGS`). Att2in's had flattened at 20 and climbed to 40 with the others, where it
#   was rising again; the rows whose stages were flat climb with the ones still rising, so that every claim between
#   "+ SCST" rows (Att2in's or Up-Down's against GLIED's) compares one budget.
#   Like every row of the book it trains its whole budget and keeps its best validation evaluation, so it never stops on a plateau a longer run would climb out of.
# - **It is selected as it trains.** Validation decodes greedily, as the stage samples and as the reference validates
#   (`beam_size` 1). On shapes the decode picks the caption's kind, so a beam-3 selection would credit the stage with the
#   beam's bonus over its own greedy caption. The start is validated first, for the history, and never kept: a "+ SCST"
#   row is the self-critical model's own.
# - **It is tested as every row is.** Beam 3, with the greedy decode's scores beside it, so the decoding bonus shows.
# - **Both baselines, as two arms from one start.** The greedy caption's reward (Rennie et al.) and the mean reward of
#   the image's other samples (the reference's "new self-critical"). The greedy arm is the "+ SCST" row; the other is
#   the "+ SCST (mean baseline)" row.

# %% [markdown]
# ## The chapter's runs
#
# The parameters are the run's (`capbook.profiles.RunConfig`), then `model`, then the recurrent models' sizes
# (`RecurrentConfig`, SCA-CNN's `order`) and the transformer's (CT). *capbook:* every baseline is trained under the
# book's one protocol, as every row it is compared with (`nbs/02b_protocol`): validation CIDEr twice an epoch on
# averaged weights, the rate annealed to 0 on a cosine over the budget of 15 epochs (30 for Up-Down and CT, most of
# whose seeds were still rising at the end of 15: the protocol's ladder; 30 for Att2in, GLIED's Table 1 baseline, as
# long as every GLIED row trains, `05_glied`); then, for Att2in and Up-Down, a self-critical stage of 2/3 of the row's
# cross-entropy epochs three rungs up the ladder (160 at the default profile, `scst_budget`). The same budget for the baselines matters: a baseline stopped
# while it is still learning would flatter every model compared with it (`06a_baselines_tables` shows where each
# row's curve ends).

# %%
#| export
BASELINES = ("nic", "lstm", "att2in", "sca_cnn", "updown", "ct")

@dataclass
class BaselineParams(SCAConfig, RunConfig):
    "The baselines chapter's parameters: the run's (`RunConfig`), the model, the recurrent sizes, the transformer's."
    model: str = "updown"               # nic | lstm | att2in | sca_cnn | updown | ct
    emb_dim: int | None = None          # the LSTMs' word (and image) embedding; None: the profile's (Show-Attend-Tell's `WIDTHS`)
    hidden_dim: int | None = None       # the LSTM size; None: the profile's (Show-Attend-Tell's `WIDTHS`)
    att_dim: int | None = None          # the attention's hidden size; None: the profile's (Show-Attend-Tell's `WIDTHS`)
    dropout: float | None = None        # None: the model's own (0.5 for the LSTMs, 0.1 for CT)
    scst_epochs: int | None = None      # the most self-critical epochs after cross-entropy; None: the profile's (default: 2/3 of the row's cross-entropy epochs three rungs up the ladder, `scst_budget`)
    d_model: int | None = None          # ct: the width of every block; None: the profile's (paper 512, default and smoke 64)
    heads: int | None = None            # ct: attention heads; None: the profile's, for a d_attn of 64 as the spatial transformer (paper 8, default and smoke 1)
    d_hidden: int | None = None         # ct: the feed-forward's width; None: the profile's (2 d_model)

def baselines_check(p) -> None:
    "The model must be one of the chapter's."
    check_choice("model", p.model, BASELINES)

BASELINES_CHAPTER = register_chapter(Chapter(
    notebook="06_baselines",
    paper="Baselines: Vinyals et al. 2015; Rennie et al. 2017; Chen et al. 2017; Anderson et al. 2018; Zhu et al. 2018",
    url="https://arxiv.org/abs/1707.07998",
    params=BaselineParams,
    model=lambda p: p.model,
    runs={"": {"model": "updown", "scst_baseline": "both"}, "att2in": {"model": "att2in", "scst_baseline": "both"},   # + SCST, both baselines (GLIED Table 1)
          **{m.replace("_", "-"): {"model": m, "scst_epochs": 0} for m in ("nic", "lstm", "sca_cnn", "ct")}},
    epochs=protocol_epochs(longer=lambda p: p.model in ("updown", "ct", "att2in")),   # the protocol's budget; Up-Down and CT at the ladder's second rung (still rising at 15), Att2in as long as GLIED
    sizes={"smoke": {"d_model": 64, "heads": 1, "d_hidden": 128, "scst_epochs": 1, **WIDTHS["smoke"]},
           "default": {"d_model": 64, "heads": 1, "d_hidden": 128, **WIDTHS["default"],   # SCST: 2/3 of the row's cross-entropy epochs, `SCST_RUNGS` up
                       "scst_epochs": lambda p: scst_budget(LADDER * BUDGET["default"] if p.model in ("updown", "att2in") else BUDGET["default"],
                                                            rungs=SCST_RUNGS if p.model in ("updown", "att2in") else 0)},
           "paper": {"d_model": 512, "heads": 8, "d_hidden": 1024, "scst_epochs": 20, **WIDTHS["paper"]}},
    train={},                                             # the protocol, as every compared row
    label=lambda p: {"nic": "Show and Tell", "lstm": "LSTM", "att2in": "Att2in", "sca_cnn": "SCA-CNN",
                     "updown": "Up-Down", "ct": "CT"}[p.model],
    figure=lambda p: f"fig_baseline_{p.model}_attention.png",
    check=baselines_check,
    encoder="resnet101",
    compares=("02_show_attend_tell", "03_spca", "04_spatial_self_attention", "05_glied",   # every row of the book, and
              "02a_soft_vs_hard", "03a_spca_tables", "04a_ssa_tables", "05a_glied_tables"),  # every chapter's verdicts
    figures=("fig_baselines_comparison.png",),
))

# %% [markdown]
# The other chapters' tables read these runs through one function, which stops if a run was trained on other data than
# the table's own runs (a stale or mismatched baseline never enters a table silently).

# %%
#| export
BASELINE_NOTE = "capbook's baselines chapter (06_baselines): same data, features and training protocol"

def baseline_records(profile: str, fingerprint: str | None = None) -> dict[str, dict]:
    "The book's baseline runs' results records at `profile`, by tag ('' is Up-Down, then 'att2in', 'nic', 'lstm', 'sca-cnn', 'ct'); stops unless each was trained on the data `fingerprint` (when given)."
    from capbook.records import compared_runs
    from capbook.core import CapbookError
    steps, recs = compared_runs(profile, {"b": ("06_baselines", None)})
    if fingerprint is not None:
        other = [s.name for k, s in steps.items() if recs[k]["data"]["fingerprint"] != fingerprint]
        if other:
            raise CapbookError(f"baseline runs {other} were trained on other data than this table's runs: "
                               f"run `capbook book --profile {profile}` again")
    return {tag: rec for (_, tag), rec in recs.items()}


# %% [markdown]
# ## Training and evaluation
#
# The parameters cell (generated from `BaselineParams`: `make sync` rewrites it) and the run: one call that prepares
# the data, builds the model, trains it (then self-critically, if asked), evaluates it on the test split, writes the
# results record and draws the attention figure (`capbook.runner.run_chapter`).

# %% tags=["parameters"]
profile = 'default'       # smoke | default | paper: sizes and epochs
dataset = 'shapes'        # shapes | coco | flickr8k | flickr30k
data_path = None          # folder with dataset_<name>.json and its images (real datasets)
encoder = None            # None: the dataset's default (the shapes CNN; for real data, the paper's backbone)
weights = 'imagenet'      # real data: the encoder's weights, imagenet | random | /path/file.pth
regions = None            # real data: folder of precomputed region features (<image>.npy, N x D) instead of a grid
seed = 0                  # the training seed (initial weights, batches, dropout); the book repeats compared rows over SEEDS
data_seed = 0             # the shapes data set's and its encoder's seed: fixed while the training seed varies
epochs = None             # None: the chapter's default for the profile
batch_size = 64           # captions per training step
lr = None                 # Adam's learning rate; None: the chapter's for the profile (smoke 1e-3, else 4e-4)
beam_size = 3             # beam of the validation and test decodes
length_norm = 0.0         # beams ranked by log-probability / length^length_norm (0: summed log-probability, as the papers)
no_repeat_ngram = 0       # no n-gram of this size twice in a caption (0: off, as the papers)
scst_epochs = None        # the most self-critical epochs after cross-entropy; None: the profile's (default: 2/3 of the row's cross-entropy epochs three rungs up the ladder, `scst_budget`)
scst_lr = 5e-05           # Adam's learning rate in self-critical training (Rennie et al.'s 5e-5)
scst_baseline = 'greedy'  # greedy: the greedy caption's reward (Rennie et al.) | mean: the other samples' mean | both: two arms from one start
device = 'auto'           # auto | cpu | cuda | cuda:N
precision = 'auto'        # the CPU's training arithmetic: auto (bf16 where the CPU has bfloat16 kernels: its instruction set, never a timing) | bf16 (autocast, as a GPU always does) | fp32
recipe = 'protocol'       # protocol: the book's one training protocol | early-stop: the protocol's rule before, halving on plateaus, stopping early | legacy: capbook's recipe before that (both: nbs/02b_protocol)
run_dir = None            # set by `capbook book`; None: runs/<profile>/adhoc/...
emb_dim = None            # the LSTMs' word (and image) embedding; None: the profile's (Show-Attend-Tell's `WIDTHS`)
hidden_dim = None         # the LSTM size; None: the profile's (Show-Attend-Tell's `WIDTHS`)
att_dim = None            # the attention's hidden size; None: the profile's (Show-Attend-Tell's `WIDTHS`)
dropout = None            # None: the model's own (0.5 for the LSTMs, 0.1 for CT)
order = 'C-S'             # sca_cnn: C-S (channel, then spatial; the paper's) | S-C
model = 'updown'          # nic | lstm | att2in | sca_cnn | updown | ct
d_model = None            # ct: the width of every block; None: the profile's (paper 512, default and smoke 64)
heads = None              # ct: attention heads; None: the profile's, for a d_attn of 64 as the spatial transformer (paper 8, default and smoke 1)
d_hidden = None           # ct: the feed-forward's width; None: the profile's (2 d_model)

# %%
r = run_chapter("06_baselines", globals())
model, prep, ev, dev = r.model, r.prep, r.ev, r.device
pd.DataFrame(r.fitted.history).round(4)

# %% [markdown]
# Self-critical training, when the run has it: per epoch, the mean CIDEr-D reward of the samples, the baseline's, the
# greedy caption's (training images) and the validation scores; then both stages' test scores.

# %%
for _t in stage_tables(r.record): display(_t)

# %%
pd.DataFrame({"test": {m: round(100 * v, 1) for m, v in ev["metrics"].items()}}).T

# %% [markdown]
# What the model looks at, word by word, through the book's one plotting path (models without attention draw nothing).

# %%
#| fig-cap: What the model looks at, word by word, on the first test image whose caption names two of its objects
if r.figure is not None: display(IPImage(filename=str(r.figure)))

# %% [markdown]
# ## Where capbook departs from the papers
#
# *capbook:* the departures of the baselines from their papers and authors' code, why, and where the book measures
# what they change (on shapes). A one-seed measurement made when a choice was taken, on code the book has since
# replaced, is not a number of this book: those are in the changelog.
#
# | what | why | where it is measured |
# |---|---|---|
# | SCA-CNN: the channel weights scaled by C (mean 1) | Chen et al.'s released code multiplies them by the channel count (`* 512`, `* 2048`); a bare softmax over 128 channels hands on 1/128 of a feature | the context is at a feature's scale: ratio 1.000, against about 1/128 for a bare softmax (tested) |
# | SCA-CNN on the last conv layer only | frozen, cached features (see the section above) | not measured |
# | CT: embedding N(0, 1/d) and one epoch of linear warm-up, then the protocol's cosine (no 1/√step decay) | Vaswani et al.'s unit-scale embedding; the warm-up every peer transformer uses, the cosine every compared row's | word/position scale ratio 1.8, against 21 for a unit-scale embedding (tested: within 2) |
# | self-critical training (Att2in, Up-Down) continues the cross-entropy run (its Adam state and weight average, the rate climbing back over one epoch) and keeps the stage's best greedy validation evaluation, never the start itself; a forced `<end>` after 18 words carries no gradient | ruotianluo's recipe, which validates as it trains and keeps its best | `06a_baselines_tables`' self-critical table gives each seed's start and best validation CIDEr, so a stage that ended below its start shows there (the README counts them) |
# | every row trains the protocol's budget (15 epochs at the default profile, 30 for Up-Down and CT, most of whose seeds were still rising at 15, and for Att2in, as long as GLIED; the papers: until validation stops improving) | one rule for every compared row (`02b_protocol`) | `06a_baselines_tables`' curve table: the evaluation each seed kept and what its last three epochs gained |
