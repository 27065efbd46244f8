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
# # attention
#
# > Every attention mechanism of the book, behind one interface that keeps its last weights.

# %%
#| default_exp attention

# %%
#| export
from __future__ import annotations
import torch
from torch import nn
import torch.nn.functional as F


# %% [markdown]
# ## One interface
#
# Every attention module of the book is called the same way and returns the same three things, so a decoder never
# branches on which attention it holds:
#
# ```python
# pre = att.precompute(a)                               # once per image: a (B, L, D) -> what does not depend on the query
# context, weights, info = att(a, pre, h, expected)     # at every step, for queries h (R, n), R = B*K
# ```
#
# - `context` (R, D): what the decoder reads at this step;
# - `weights` (R, L): the attention over the L locations that the figures and the attention-correctness score draw
#   (each row sums to 1), or `None` for a mechanism with no spatial map (SPCA's channel-only structure);
# - `info`: a dict of per-row extras a learning rule or an analysis needs (hard attention's sampled location, its
#   log-probability and entropy; SPCA's channel weights), empty for soft attention.
#
# A decoder calls `memory = att.memory(a)` once per image (`{"a": a, "pre": precompute(a)}`, plus hard attention's
# per-caption switch `expected` (B,) bool while training) and `att(**memory, h=h)` at every step; mechanisms without
# sampling ignore `expected`. Each module also keeps its most recent weights in `.last` (detached), so figures and scores read them
# from one place whatever the model.
#
# Projections of $a$ that do not depend on the decoder state are computed once per image by `precompute` and reused at
# every step and by every beam: the image tensors have B rows, the decoder state B·K rows (K beams or samples per
# image, rows of one image adjacent; K = 1 in training), and the attention broadcasts one over the other, so beam
# search never copies an image's features per beam.

# %%
#| export
class Attention(nn.Module):
    "Base class: `memory(a)` once per image, then `forward(**memory, h=h) -> (context, weights, info)` at every step; `.last` keeps the weights."
    last: torch.Tensor | None = None
    def precompute(self, a: torch.Tensor) -> torch.Tensor: return a
    def memory(self, a: torch.Tensor) -> dict:
        "What the attention keeps per image while a caption is generated: `a`, `precompute(a)` and any per-image draw."
        return {"a": a, "pre": self.precompute(a)}
    def keep(self, weights: torch.Tensor | None) -> torch.Tensor | None:
        "Remember the latest weights (detached) for figures and scores; returns them unchanged."
        self.last = None if weights is None else weights.detach()
        return weights
    def forward(self, a: torch.Tensor, pre: torch.Tensor, h: torch.Tensor,
                expected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        raise NotImplementedError


# %% [markdown]
# ## Soft (additive) attention — Show, Attend and Tell §3.1.2 and §4.2
#
# > "The weight $\alpha_i$ of each annotation vector $a_i$ is computed by an attention model $f_{att}$ for which we use
# > a multilayer perceptron conditioned on the previous hidden state $h_{t-1}$."
#
# $$e_{ti} = f_{att}(a_i, h_{t-1}) = w^\top \tanh(W_a a_i + W_h h_{t-1} + b), \qquad
#   \alpha_{ti} = \frac{\exp(e_{ti})}{\sum_{k=1}^{L} \exp(e_{tk})}, \qquad
#   \mathbb{E}_{p(s_t|a)}[\hat z_t] = \sum_{i=1}^{L} \alpha_{ti} a_i \quad (8)$$
#
# *capbook:* the paper names $f_{att}$ an MLP without giving its form; we use the one-hidden-layer
# additive form of Bahdanau et al. (2014), which the paper says it extends and which the authors' released code uses.
#
# *capbook:* $e_{ti}$ needs a tanh over a (B, L, att) tensor at every step, which dominates the
# decoder's cost. We compute it through the identity $\tanh(u) = 2\sigma(2u) - 1$, so $w^\top \tanh(u) + b =
# 2\,w^\top\sigma(2u) - \sum_k w_k + b$ (the same number up to float rounding; `tests/test_sat.py` checks it
# against `torch.tanh`), and over a few rows at a time so each piece stays in the CPU cache. On the 2-core machines
# this book is built on, torch's CPU `tanh` ran about 10× slower than its `sigmoid`, and the chunked form made a
# beam-search step over 300 rows about 6× faster.

# %%
#| export
_CHUNK = 1 << 18   # elements of (rows, L, att) scored at once: about 1 MB of float32

class SoftAttention(Attention):
    "Additive soft attention $e_{ti} = w^T \\tanh(W_a a_i + W_h h_{t-1})$, $\\alpha = \\mathrm{softmax}(e)$, context $\\sum_i \\alpha_{ti} a_i$."
    def __init__(self, feat_dim: int, query_dim: int, att_dim: int):
        super().__init__()
        self.W_a = nn.Linear(feat_dim, att_dim)               # W_a a_i (+ b)
        self.W_h = nn.Linear(query_dim, att_dim, bias=False)  # W_h h_{t-1}
        self.w = nn.Linear(att_dim, 1)                        # w^T tanh(.)
    def precompute(self, a):                                  # a: (B, L, D)
        return self.W_a(a)                                    # (B, L, att)
    def scores(self, pre, h):                                 # pre: (B, L, att); h: (B*K, n)
        B, L, A = pre.shape
        q, w = self.W_h(h).view(B, -1, 1, A), self.w.weight[0]  # W_h h_{t-1}: (B, K, 1, att); w: (att,)
        n = max(1, _CHUNK // (q.shape[1] * L * A))            # images per chunk
        # w^T tanh(u) + b with tanh(u) = 2 sigmoid(2u) - 1, in cache-sized chunks of images (see the note above)
        e = torch.cat([torch.sigmoid((pre[s:s + n, None] + q[s:s + n]).mul_(2)) @ w
                       for s in range(0, B, n)])             # w^T sigmoid(2u): (B, K, L)
        return (2 * e - w.sum() + self.w.bias).view(-1, L)    # e_t = w^T tanh(W_a a_i + W_h h_{t-1}) + b: (B*K, L)
    def forward(self, a, pre, h, expected=None):              # a: (B, L, D); h: (B*K, n); `expected`: no sampling here
        B = a.shape[0]
        # alpha_ti = exp(e_ti) / sum_k exp(e_tk): (B*K, L), sums to 1 over L
        alpha = self.keep(F.softmax(self.scores(pre, h), dim=-1))
        # z_t = sum_i alpha_ti a_i: (B, K, D)
        z = torch.bmm(alpha.view(B, -1, alpha.shape[-1]), a)
        return z.view(len(h), -1), alpha, {}



# %% [markdown]
# ## Stochastic "hard" attention — Show, Attend and Tell §4.1
#
# > "We represent the location variable $s_t$ as where the model decides to focus attention when generating the
# > $t$-th word ... we can assign a multinoulli distribution parametrized by $\{\alpha_i\}$, and view $\hat z_t$ as a
# > random variable":
#
# $$p(s_{t,i} = 1 \mid s_{j<t}, a) = \alpha_{t,i} \quad (3), \qquad \hat z_t = \sum_i s_{t,i}\, a_i \quad (4)$$
#
# The weights $\alpha_t$ come from the same $f_{att}$ as soft attention (the class below inherits it); what differs is
# what is done with them: soft attention feeds the expectation $\sum_i \alpha_{ti} a_i$ (Eq. 8), hard attention one
# annotation vector $a_{s_t}$, its location drawn from $\alpha_t$ while training, $\tilde s_t \sim
# \mathrm{Multinoulli}_L(\{\alpha_i\})$. Besides the context, `forward` returns what the learning rule of §4.1 needs
# (see `capbook.sat` for the rule), per row: the location $\tilde s_t$ (`s`), $\log p(\tilde s_t \mid a) =
# \log \alpha_{t,\tilde s_t}$ (`logp_s`) and the entropy $H_t = -\sum_i \alpha_{ti} \log \alpha_{ti}$ of the multinoulli
# (`entropy`), and `sampled`, 1 on the rows whose context is the sample. Rows flagged in `expected` take the
# expected context instead of the sample ("with probability 0.5 for a given image, we set the sampled attention
# location $\tilde s$ to its expected value $\alpha$"); for them $\log p(\tilde s_t \mid a)$ and $H_t$ are returned as 0,
# so they train exactly as deterministic soft attention.
#
# *capbook:* at test time — the paper does not say how the hard model decodes. capbook takes the most probable
# location, $\hat s_t = \arg\max_i \alpha_{ti}$ (`test_context="argmax"`): decoding stays deterministic, so beam search
# ranks captions rather than samples, and the model is tested as it is trained (one location per word).
# `test_context="expected"` decodes with the expected context instead; the Show-Attend-Tell chapter reports both.

# %%
#| export
class HardAttention(SoftAttention):
    "Stochastic hard attention (§4.1): soft attention's $f_{att}$ and $\\alpha$; the context is one $a_{s_t}$, $s_t \\sim$ Multinoulli($\\alpha_t$) in training."
    def __init__(self, feat_dim: int, query_dim: int, att_dim: int, test_context: str = "argmax", p_expected: float = 0.5):
        super().__init__(feat_dim, query_dim, att_dim)
        self.test_context, self.p_expected = test_context, p_expected

    def memory(self, a):
        "Also, while training, each caption's switch to the expected context, drawn once with probability `p_expected`."
        m = super().memory(a)
        if self.training: m["expected"] = torch.rand(len(a), device=a.device) < self.p_expected   # (B,) bool
        return m

    def sample(self, alpha: torch.Tensor) -> torch.Tensor:
        "Draw one location per row: $\\tilde s_t \\sim$ Multinoulli$_L(\\alpha_t)$; (R, L) -> (R,)."
        return torch.multinomial(alpha.float(), 1).squeeze(1)

    def forward(self, a, pre, h, expected=None):              # a: (B, L, D); h: (R, n), R = B*K; expected: (R,) bool
        B, R = a.shape[0], len(h)
        # log alpha_t: (R, L)
        logp = F.log_softmax(self.scores(pre, h).float(), -1)
        alpha = self.keep(logp.exp())                                    # alpha_t: (R, L)
        # sum_i alpha_ti a_i, the expected context: (R, D)
        soft = torch.bmm(alpha.view(B, -1, alpha.shape[-1]).to(a.dtype), a).view(R, -1)
        if not self.training and self.test_context == "expected":
            zero = torch.zeros(R, device=h.device)
            return soft, alpha, {"s": alpha.argmax(-1), "logp_s": zero, "entropy": zero}
        # s~_t ~ Multinoulli_L(alpha_t) in training (Eq. 3), argmax_i alpha_ti at test: (R,)
        s = self.sample(alpha.detach()) if self.training else alpha.argmax(-1)
        # z_t = sum_i s_ti a_i = a_{s_t} (Eq. 4): (R, D)
        z = a[torch.arange(R, device=h.device) // (R // B), s]
        # log p(s_t | s_<t, a) = log alpha_{t,s_t}: (R,)
        logp_s = logp.gather(1, s[:, None]).squeeze(1)
        # H_t = -sum_i alpha_ti log alpha_ti: (R,)
        ent = -(alpha * logp).sum(-1)
        info = {"s": s, "logp_s": logp_s, "entropy": ent}
        if expected is not None:                                         # rows set to the expected context
            if len(expected) != R: expected = expected.repeat_interleave(R // len(expected), 0)   # K rows per caption
            z = torch.where(expected[:, None], soft, z)
            logp_s, ent = logp_s.masked_fill(expected, 0.0), ent.masked_fill(expected, 0.0)
            info.update(logp_s=logp_s, entropy=ent, sampled=(~expected).float())
        return z, alpha, info


# %%
_a, _h = torch.randn(2, 5, 3), torch.randn(2, 4)
_att = SoftAttention(3, 4, 6)
_z, _al, _inf = _att(_a, _att.precompute(_a), _h)
assert _al.shape == (2, 5) and torch.allclose(_al.sum(-1), torch.ones(2)) and _z.shape == (2, 3) and _inf == {}
assert torch.equal(_att.last, _al.detach())

# %%
_hard = HardAttention(3, 4, 6).eval()
_hard.load_state_dict(_att.state_dict())
_zh, _alh, _info = _hard(_a, _hard.precompute(_a), _h)
assert torch.allclose(_alh, _al) and torch.equal(_zh, _a[torch.arange(2), _al.argmax(-1)])
assert torch.equal(_info['s'], _al.argmax(-1))
