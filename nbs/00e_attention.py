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
from capbook.core import check_choice, wide
from capbook.models import Dropout, fast, keyed_draws, keyed_uniform


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
#
# *capbook:* in training the chunks are taken with `torch.split`, once per batch (`_split`). With slices, the backward
# pass zero-filled a full (B, L, att) gradient for every chunk at every word, 80% of a training step; with a split at
# every word it concatenated the chunks' gradients at every word. Split once, each chunk's gradients from all words add
# up and are concatenated once. The parameters after training are the same bit for bit as with slices
# (`tests/test_sat.py`); a Show-Attend-Tell training step ran 1.2× faster (459 against 385 captions/s, the two timed
# in alternating rounds on the 2-core CPU; 1.8× when each was timed alone, as the zero-filling's cost varies).

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
    _chunks = (None, 0, ())
    def _split(self, pre, n):
        "`pre.split(n)`, split once per batch in training: every step's gradient then flows into the same chunks, concatenated once."
        if not pre.requires_grad: return pre.split(n)
        if self._chunks[0] is not pre or self._chunks[1] != n: self._chunks = (pre, n, pre.split(n))
        return self._chunks[2]
    def scores(self, pre, h):                                 # pre: (B, L, att); h: (B*K, n)
        B, L, A = pre.shape
        q, w = self.W_h(h).view(B, -1, 1, A), self.w.weight[0]  # W_h h_{t-1}: (B, K, 1, att); w: (att,)
        n = max(1, _CHUNK // (q.shape[1] * L * A))            # images per chunk
        # w^T tanh(u) + b with tanh(u) = 2 sigmoid(2u) - 1, in cache-sized chunks of images (see the note above);
        # chunks by split, not slicing: a slice's gradient would be a zero-filled (B, L, att) tensor per chunk
        e = torch.cat([torch.sigmoid((p[:, None] + k).mul_(2)) @ w
                       for p, k in zip(self._split(pre, n), q.split(n))])   # w^T sigmoid(2u): (B, K, L)
        return (2 * e - w.sum() + self.w.bias).view(-1, L)    # e_t = w^T tanh(W_a a_i + W_h h_{t-1}) + b: (B*K, L)
    def forward(self, a, pre, h, expected=None, mask=None):   # a: (B, L, D); h: (B*K, n); `expected`: no sampling here
        B, e = a.shape[0], self.scores(pre, h)
        if mask is not None:                                  # real regions (B, L): padding gets no weight
            e = e.view(B, -1, e.shape[-1]).masked_fill(~mask.bool()[:, None], float("-inf")).view(len(h), -1)
        # alpha_ti = exp(e_ti) / sum_k exp(e_tk): (B*K, L), sums to 1 over L
        alpha = self.keep(F.softmax(e, dim=-1))
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
        if self.training:                                                # (B,) bool
            m["expected"] = (keyed_uniform((len(a),), a.device) < round(self.p_expected * (1 << 24)) if keyed_draws()
                             else torch.rand(len(a), device=a.device) < self.p_expected)
        return m

    def sample(self, alpha: torch.Tensor) -> torch.Tensor:
        "Draw one location per row: $\\tilde s_t \\sim$ Multinoulli$_L(\\alpha_t)$; (R, L) -> (R,)."
        if not keyed_draws(): return torch.multinomial(alpha.float(), 1).squeeze(1)
        # keyed (`capbook.models.keyed`): the first i whose cumulative alpha exceeds u ~ U[0, 1) (inverse CDF, no host sync)
        u = (keyed_uniform((len(alpha),), alpha.device).double() + 0.5) / (1 << 24)
        return (alpha.double().cumsum(-1) <= u[:, None]).sum(-1).clamp_max(alpha.shape[-1] - 1)

    def forward(self, a, pre, h, expected=None):              # a: (B, L, D); h: (R, n), R = B*K; expected: (R,) bool
        B, R = a.shape[0], len(h)
        # log alpha_t: (R, L)
        logp = F.log_softmax(wide(self.scores(pre, h)), -1)
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

# %% [markdown]
# ## Multi-head dot-product attention — Springenberg et al. §2.3, after Vaswani et al.
#
# The spatial self-attention transformer (chapter 4) and GLIED (chapter 5) attend with the Transformer's multi-head
# scaled dot-product attention, with one change in the first of them: the temperature.
#
# > "Attention weights between constituents of two representations can be obtained by first projecting both to a new
# > feature space and then calculating the dot product ... $Q = Q_{input} W_Q$, $K = K_{input} W_K$,
# > $V = V_{input} W_V$ (1) ... $a_{Q,K} = \mathrm{softmax}(Q K^T / \tau)$, $\tau = \sqrt{d_{len} + d_{attn}}$ (2) ...
# > $Attn = cat(Multihead_1, \dots, Multihead_h) \cdot W_O$ (3)."
#
# "$d_{len}$ ... represents the spatial (in case of an image) or temporal (in case of text) dimensionality of the
# keys. This is different to the implementation of Vaswani et al. which does not involve adding $d_{len}$ ... We found
# increasing τ this way to be beneficial ... as it enforces to spread attention instead of focusing only on a single
# entry."
#
# *capbook:* $d_{len}$ is the number of keys **each query may see**: all L = 196 regions for the image, but $t$ words
# for the $t$-th position of the masked caption self-attention. With the whole padded caption length instead, τ
# would depend on how a batch happens to be padded, and decoding word by word (where position $t$ has $t$ keys) would
# compute another function than training; with the visible count, incremental and parallel decoding are the same
# function (tested in chapter 4). `tau="standard"` gives Vaswani et al.'s $\sqrt{d_{attn}}$.
#
# One module serves self-attention ($Q_{input} = K_{input} = V_{input}$), inter-attention (queries from the caption,
# keys and values from the image) and incremental decoding: keys and values can be passed already projected (a
# cache), and, as for the attention modules above, keys and values with B rows serve queries with B·G rows (G beams
# or captions per image, adjacent) without being copied. Residual connections and layer normalisation belong to the
# layers that use the module. It keeps its last weights (R, h, T_q, T_k) in `.last`.

# %%
#| export
TAUS = ("paper", "standard")

class MultiHeadAttention(nn.Module):
    "Multi-head dot-product attention (Eq. 1–3) with τ = √(d_len + d_attn) ('paper') or √d_attn ('standard')."
    def __init__(self, d_model: int, heads: int = 8, d_attn: int | None = None, tau: str = "paper", dropout: float = 0.0):
        super().__init__()
        check_choice("tau", tau, TAUS)
        self.h, self.d, self.tau = heads, d_attn or d_model // heads, tau
        self.W_Q = nn.Linear(d_model, heads * self.d, bias=False)
        self.W_K = nn.Linear(d_model, heads * self.d, bias=False)
        self.W_V = nn.Linear(d_model, heads * self.d, bias=False)
        self.W_O = nn.Linear(heads * self.d, d_model, bias=False)
        self.drop = Dropout(dropout)         # on the attention weights (Springenberg et al. §3)
        self.last = None

    def heads(self, x: torch.Tensor, W: nn.Linear) -> torch.Tensor:
        "x W for every head: (N, T, d_model) -> (N, h, T, d_attn)."
        N, T, _ = x.shape
        return W(x).view(N, T, self.h, self.d).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        "K = x W_K, V = x W_V (Eq. 1): each (N, h, T, d_attn), to cache."
        return self.heads(x, self.W_K), self.heads(x, self.W_V)

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        "Queries x_q (R, T_q, d_model); keys/values from x_kv (B, T_k, d_model; None: x_q, self-attention) or `kv`; mask True = visible, broadcastable to (R, 1, T_q, T_k)."
        R, Tq, _ = x_q.shape
        # Q = Q_input W_Q: (R, h, T_q, d)
        Q = self.heads(x_q, self.W_Q)
        # K = K_input W_K, V = V_input W_V: (B, h, T_k, d)
        K, V = kv if kv is not None else self.keys_values(x_q if x_kv is None else x_kv)
        B, Tk = K.shape[0], K.shape[2]
        G = R // B                                                    # query rows per key row
        if fast() and G > 1 and (mask is None or (mask.dim() == 4 and mask.shape[0] == B and mask.shape[2] == 1)):
            return self._grouped(Q, K, V, mask, G)
        Qg = Q.view(B, G, self.h, Tq, self.d)
        m = None
        if mask is not None:
            m = (mask if mask.dim() < 4 or mask.shape[0] == R else mask.repeat_interleave(G, 0)).expand(R, 1, Tq, Tk)
            m = m.reshape(B, G, 1, Tq, Tk)
        # d_len: the keys each query sees: (B, G, 1, T_q, 1) or a number
        n_keys = m.sum(-1, keepdim=True) if m is not None else Tk
        tau = (n_keys + self.d) ** 0.5 if self.tau == "paper" else self.d ** 0.5
        # Q K^T / tau: (B, G, h, T_q, T_k)
        e = Qg @ K[:, None].transpose(-1, -2) / tau
        if m is not None: e = e.masked_fill(~m, float("-inf"))
        # a_{Q,K} = softmax(Q K^T / tau) (Eq. 2)
        a = torch.softmax(e, -1)
        # Multihead = a_{Q,K} V: (R, h, T_q, d)
        heads = (self.drop(a) @ V[:, None]).view(R, self.h, Tq, self.d)
        # Attn = cat(Multihead_1, ..., Multihead_h) W_O (Eq. 3): (R, T_q, d_model)
        out = self.W_O(heads.transpose(1, 2).reshape(R, Tq, self.h * self.d))
        self.last = a.detach().view(R, self.h, Tq, Tk)
        return out, a.view(R, self.h, Tq, Tk)

    def _grouped(self, Q, K, V, mask, G):
        "The same attention when G query rows share each key row and the mask, if any, is per key row (B, 1, 1, T_k): the G rows' queries side by side, so one product per head reads K and V once (nothing copied G times)."
        R, h, Tq, d = Q.shape
        B, Tk = K.shape[0], K.shape[2]
        # the G rows' queries side by side: (B, h, G T_q, d)
        Qs = Q.view(B, G, h, Tq, d).transpose(1, 2).reshape(B, h, G * Tq, d)
        n_keys = mask.sum(-1, keepdim=True) if mask is not None else Tk   # d_len per key row: (B, 1, 1, 1)
        tau = (n_keys + self.d) ** 0.5 if self.tau == "paper" else self.d ** 0.5
        # Q K^T / tau: (B, h, G T_q, T_k)
        e = Qs @ K.transpose(-1, -2) / tau
        if mask is not None: e = e.masked_fill(~mask, float("-inf"))
        a = torch.softmax(e, -1)
        # a V, back to one row per query row: (R, h, T_q, d)
        heads = (self.drop(a) @ V).view(B, h, G, Tq, d).transpose(1, 2).reshape(R, h, Tq, d)
        out = self.W_O(heads.transpose(1, 2).reshape(R, Tq, h * d))
        a = a.view(B, h, G, Tq, Tk).transpose(1, 2).reshape(R, h, Tq, Tk)
        self.last = a.detach()
        return out, a


# %% [markdown]
# Against a direct computation of Eq. 1–3, head by head, for inter-attention of two captions per image over 5 regions
# (keys shared, not copied), and for masked self-attention, where position $t$ sees $t$ keys and has its own τ:

# %%
torch.manual_seed(0)
_mha = MultiHeadAttention(16, heads=4, tau="paper").eval()
_img, _txt = torch.randn(3, 5, 16), torch.randn(6, 4, 16)              # 3 images; 2 captions each (rows adjacent)
_out, _w = _mha(_txt, _img)
def _direct(xq, xkv, W, tau_of, mask=None):
    outs, ws = [], []
    for i in range(W.h):
        sl = slice(i * W.d, (i + 1) * W.d)
        Q, K, V = xq @ W.W_Q.weight[sl].T, xkv @ W.W_K.weight[sl].T, xkv @ W.W_V.weight[sl].T
        e = Q @ K.transpose(-1, -2)
        if mask is not None: e = e.masked_fill(~mask, float("-inf"))
        a = torch.softmax(e / tau_of(mask), -1)
        outs.append(a @ V); ws.append(a)
    return torch.cat(outs, -1) @ W.W_O.weight.T, torch.stack(ws, 1)
_ref, _rw = _direct(_txt, _img.repeat_interleave(2, 0), _mha, lambda m: (5 + 4) ** 0.5)
assert torch.allclose(_out, _ref, atol=1e-5) and torch.allclose(_w, _rw, atol=1e-6)
_causal = torch.ones(4, 4, dtype=torch.bool).tril()
_out, _w = _mha(_txt, _txt, mask=_causal)
_ref, _rw = _direct(_txt, _txt, _mha, lambda m: (m.sum(-1, keepdim=True) + 4) ** 0.5, _causal)
assert torch.allclose(_out, _ref, atol=1e-5) and _w[0, 0, 0, 1:].eq(0).all() and torch.allclose(_w, _rw, atol=1e-6)
_std = MultiHeadAttention(16, heads=4, tau="standard").eval(); _std.load_state_dict(_mha.state_dict())
_ent = lambda w: -(w * w.clamp_min(1e-12).log()).sum(-1).mean()
assert _ent(_mha(_txt, _img)[1]) > _ent(_std(_txt, _img)[1])      # the larger τ spreads attention
