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
# # Show, Attend and Tell: soft and hard attention
#
# > Xu et al. (2015), *Show, Attend and Tell: Neural Image Caption Generation with Visual Attention* — the decoder with
# > deterministic "soft" attention (§4.2), with stochastic "hard" attention (§4.1), and without attention (the
# > baseline), trained and evaluated by the book's one trainer, beam search and evaluator.
#
# The paper (full text: `shared/papers/show_attend_tell.txt`) generates a caption one word at a time with an LSTM that,
# at every step, looks at a different part of the image: "Using attention, we can also visualize what the model sees".
# The image is encoded once by a frozen CNN into $L$ annotation vectors $a_i \in \mathbb{R}^D$ (the 14×14×512 conv5_4
# map of VGG-16 on real data; capbook's frozen shapes encoder on the embedded dataset), and the decoder computes, from
# its previous hidden state, a weight $\alpha_{ti}$ for every location. The two attention mechanisms differ only in
# what they do with these weights: **soft** attention feeds the LSTM the weighted average of the annotation vectors,
# **hard** attention one annotation vector, whose location is *sampled* from the weights. The section
# [Soft and hard attention, worked on one image](#soft-and-hard-attention-worked-on-one-image) below makes this
# concrete on a 2×2 split of one image's feature map, after the explainer that accompanies the book
# (`shared/papers/soft_hard_attention_blog.txt`).
#
# This notebook runs **one configuration** (parameter `attention`: `soft`, `hard` or `none`). The book runs it six
# times — soft, hard (with two REINFORCE weights λ_r), no attention, and soft without the doubly stochastic penalty or
# without the gate — and the next
# chapter, *Soft vs hard attention: Table 1, Figures 3 and 5, §4.2.1*, assembles the runs into the paper's table and
# figures.

# %%
#| default_exp sat

# %%
#| export
from __future__ import annotations
import torch
from torch import nn
import torch.nn.functional as F
from capbook.attention import Attention, SoftAttention, HardAttention
from capbook.models import CaptionModel, register, token_nll

# %%
#| hide
import time
import numpy as np, pandas as pd
from IPython.display import Image as IPImage, Markdown, display
from capbook.core import check_choice, check_int, check_float, get_device, seed_everything, save_torch
from capbook.book import start_run
from capbook.data import prepare
from capbook.models import build
from capbook.train import TrainConfig, fit
from capbook.metrics import evaluate
from capbook.decode import pad_captions
from capbook.shapes import object_mentions
from capbook.viz import attention_figure, soft_hard_figure, save_table

# %% tags=["parameters"]
profile = "default"     # smoke | default | paper: sizes and epochs
dataset = "shapes"      # shapes | coco | flickr8k | flickr30k
data_path = None        # folder with dataset_<name>.json and its images (real datasets)
encoder = None          # None: the dataset's default (shapes CNN; VGG-16 conv5_4 for real data)
seed = 0
attention = "soft"      # soft (§4.2) | hard (§4.1) | none (the mean annotation vector: the no-attention baseline)
epochs = None           # None: the profile's default
batch_size = 64
lr = 4e-4
emb_dim = 128           # m
hidden_dim = 256        # n
att_dim = 128           # size of f_att's hidden layer
dropout = 0.5
penalty = None          # lambda of the doubly stochastic penalty (Eq. 9); None: 1 for soft, 0 otherwise (the paper's)
gate = None             # the gating scalar beta (§4.2.1); None: on for soft, off otherwise (the paper's)
samples = 1             # hard: N, sampled attention sequences per caption (Eq. 7)
lambda_r = 0.1          # hard: weight of the REINFORCE term (chosen on validation, see below)
lambda_e = 0.002        # hard: weight of the entropy term
p_expected = 0.5        # hard: probability that a caption is trained with the expected context instead of a sample
beam_size = 3
device = "auto"
run_dir = None          # set by `capbook book`; None: runs/<profile>/adhoc/...


# %% [markdown]
# ## The model, equation by equation
#
# Notation (the paper's): $a_i \in \mathbb{R}^D$, $i = 1..L$, the annotation vectors (B, L, D); $E \in \mathbb{R}^{m\times K}$
# the word embedding; $n$ the LSTM size; $y_{t-1}$ the previous word.
#
# **Initial state** (§3.1.2): "The initial memory state and hidden state of the LSTM are predicted by an average of
# the annotation vectors fed through two separate MLPs":
# $$c_0 = f_{init,c}\Big(\frac1L\sum_i a_i\Big), \qquad h_0 = f_{init,h}\Big(\frac1L\sum_i a_i\Big)$$
#
# **Attention and gating** (§3.1.2, §4.2.1): $e_{ti} = f_{att}(a_i, h_{t-1})$, $\alpha_t = \mathrm{softmax}(e_t)$,
# $\beta_t = \sigma(f_\beta(h_{t-1}))$, and the context $\hat z_t = \beta_t\, \phi(\{a_i\},\{\alpha_i\})$ with
#
# - **soft** (§4.2, Eq. 8): $\phi = \sum_i \alpha_{ti} a_i$, the expected context (`capbook.attention.SoftAttention`);
# - **hard** (§4.1, Eq. 3–4): $\phi = a_{\tilde s_t}$, $\tilde s_t \sim \mathrm{Multinoulli}_L(\{\alpha_{ti}\})$ in training,
#   $\arg\max_i \alpha_{ti}$ at test time (`capbook.attention.HardAttention`, which explains the choice);
# - **none** (the baseline): $\phi = \frac1L\sum_i a_i$ at every step — the same decoder with the attention taken away.
#
# **LSTM** (§3.1.2, following Zaremba et al.):
# $$\begin{aligned} i_t &= \sigma(W_i E y_{t-1} + U_i h_{t-1} + Z_i \hat z_t + b_i) \\ f_t &= \sigma(W_f E y_{t-1} + U_f h_{t-1} + Z_f \hat z_t + b_f) \\
# c_t &= f_t c_{t-1} + i_t \tanh(W_c E y_{t-1} + U_c h_{t-1} + Z_c \hat z_t + b_c) \\ o_t &= \sigma(W_o E y_{t-1} + U_o h_{t-1} + Z_o \hat z_t + b_o) \\ h_t &= o_t \tanh(c_t) \end{aligned}$$
#
# **Deep output layer** (Eq. 7): $p(y_t \mid a, y_1^{t-1}) \propto \exp(L_o(E y_{t-1} + L_h h_t + L_z \hat z_t))$.
#
# **Soft attention's loss** (Eq. 9, the doubly stochastic penalty): $L_d = -\log p(y \mid a) + \lambda \sum_i^L \big(1 - \sum_t^C \alpha_{ti}\big)^2$.
#
# **Hard attention's learning rule** (§4.1). The objective is the variational lower bound
# $L_s = \sum_s p(s \mid a) \log p(y \mid s, a) \le \log p(y \mid a)$ (Eq. 5), whose gradient is estimated from $N$
# sampled location sequences $\tilde s^n$, with the moving-average baseline and the entropy term:
# $$\frac{\partial L_s}{\partial W} \approx \frac1N \sum_{n=1}^N \Big[\frac{\partial \log p(y \mid \tilde s^n, a)}{\partial W}
#   + \lambda_r \big(\log p(y \mid \tilde s^n, a) - b\big) \frac{\partial \log p(\tilde s^n \mid a)}{\partial W}
#   + \lambda_e \frac{\partial H[\tilde s^n]}{\partial W}\Big], \qquad b_k = 0.9\, b_{k-1} + 0.1 \log p(y \mid \tilde s_k, a),$$
# and "with probability 0.5 for a given image, we set the sampled attention location $\tilde s$ to its expected value
# $\alpha$". In code: $\log p(\tilde s \mid a) = \sum_t \log \alpha_{t,\tilde s_t}$ (`logp_s`), $H[\tilde s] = \sum_t H_t$
# (`entropy`), and the loss is the surrogate whose gradient is the rule's right-hand side (the reward is detached,
# which is what makes its gradient the REINFORCE term):
# $$\mathcal L = -\log p(y \mid \tilde s, a) - \lambda_r\, \mathrm{sg}\big[\log p(y \mid \tilde s, a) - b\big] \log p(\tilde s \mid a) - \lambda_e H[\tilde s].$$
# `tests/test_sat.py` enumerates every location sequence of a tiny model and checks that the expectation of this
# estimator is exactly the gradient of $L_s$.
#
# *capbook's choices where the paper is silent:* $f_{init,c}$ and $f_{init,h}$ are one-layer tanh MLPs and $f_\beta$ a linear
# layer (as in the authors' released code); the deep output follows the paper's equation exactly (linear, no extra
# tanh, which the released code adds); dropout (the paper's only regulariser besides early stopping) is applied to
# $h_t$ before $L_h$ and to the deep-output sum before $L_o$. `nn.LSTMCell` on the concatenation $[E y_{t-1}; \hat z_t]$
# computes exactly the four gate equations: its input weight is $[W_\bullet\; Z_\bullet]$ and its hidden weight $U_\bullet$
# (gate order i, f, g=c̃, o); the unit test `tests/test_sat.py` recomputes every equation by hand from these weights.
# Eq. 9 is written per caption; we average it over the batch and divide both terms by the mean caption length, so the
# NLL term is the usual per-word cross-entropy and λ keeps the paper's meaning relative to $-\log p(y|a)$.
#
# *Choices for hard attention:*
# - **Scale.** Every term is summed over a batch's captions and divided by its number of words, as the NLL is, so each
#   caption's estimator is the paper's rule up to the same constant. The baseline is kept **per word**: the reward
#   $\log p(y \mid \tilde s, a)$ of a caption of $C$ words is compared with $C\,b$, and $b_k$ is updated with the
#   batch's log-likelihood per word. A single baseline for whole-caption log-likelihoods would mostly track caption
#   length (8 to 18 words here), which adds variance and no information.
# - **Baseline timing.** A batch's rule uses $b_{k-1}$, and $b_k$ is updated afterwards, so $b$ never depends on the
#   samples it is subtracted from (the estimator stays unbiased); $b_0 = 0$. $b$ is a buffer of the model, so it is
#   saved in checkpoints and an exact resume restores it.
# - **The 50% switch** is drawn per caption (each training row), once for the whole caption. Switched captions train
#   exactly as soft attention (without gate or penalty): no REINFORCE or entropy term, and the baseline is updated from
#   the sampled captions only.
# - **λ_r = 0.1, λ_e = 0.002, N = 1.** The paper set $\lambda_r$ and $\lambda_e$ "by crossvalidation" and reports neither,
#   nor $N$. $\lambda_r = 1$ would make the rule an unbiased estimate of $\partial L_s / \partial W$, but its REINFORCE
#   term is noisy: in a pilot run on shapes its gradient on $f_{att}$ dwarfed the signal that reaches $f_{att}$ through
#   the expected-context captions. Adam scales each parameter's step by its gradient's size, so that signal was
#   drowned and the attention stayed nearly uniform. The book therefore trains both $\lambda_r = 0.1$ (the default)
#   and $\lambda_r = 1$ and selects between them on the validation split, as the paper did. The next chapter shows both
#   runs and which one was selected. $\lambda_e = 0.002$ is the entropy weight of the authors' released code. $N = 1$
#   keeps a hard epoch as cheap as a soft one (the `samples` parameter sets $N$: each caption's row is repeated $N$
#   times, each with its own draws).
# - **Gate and penalty.** §4.2.1 introduces both for the deterministic model, so by default the hard model and the
#   baseline run without them (parameters `gate` and `penalty` override that).
#
# *For later chapters:* `attention` may also be any `capbook.attention.Attention` module (same `precompute` / `forward`
# interface). SPCA's 1D-LSTM (`capbook.spca`) is this decoder with SPCA passed in that way.

# %%
#| export
ATTENTION = ("soft", "hard", "none")

class ShowAttendTell(CaptionModel):
    "Show, Attend and Tell (Xu et al. 2015): LSTM decoder with soft (§4.2), hard (§4.1) or no attention, gating scalar and deep output layer."
    def __init__(self, vocab_size: int, feat_dim: int, grid: tuple[int, int], emb_dim: int = 128, hidden_dim: int = 256,
                 att_dim: int = 128, dropout: float = 0.5, penalty: float = 1.0, gate: bool = True,
                 attention: str | Attention = "soft", samples: int = 1, lambda_r: float = 0.1, lambda_e: float = 0.002,
                 p_expected: float = 0.5, test_context: str = "argmax"):
        super().__init__(vocab_size)
        D, m, n = feat_dim, emb_dim, hidden_dim
        if isinstance(attention, Attention): self.att, attention = attention, "module"   # another paper's f_att
        self.grid, self.penalty, self.gate, self.attention = grid, penalty, gate, attention
        self.samples, self.lambda_r, self.lambda_e, self.p_expected = samples, lambda_r, lambda_e, p_expected
        self.E = nn.Embedding(vocab_size, m)              # E y_{t-1}
        self.init_h = nn.Linear(D, n)                      # f_init,h
        self.init_c = nn.Linear(D, n)                      # f_init,c
        if attention == "soft": self.att = SoftAttention(D, n, att_dim)                   # f_att
        elif attention == "hard": self.att = HardAttention(D, n, att_dim, test_context)   # f_att, sampled
        self.f_beta = nn.Linear(n, 1) if gate else None    # f_beta
        self.lstm = nn.LSTMCell(m + D, n)                  # [W Z] [E y; z] + U h + b
        self.L_h = nn.Linear(n, m, bias=False)             # L_h
        self.L_z = nn.Linear(D, m, bias=False)             # L_z
        self.L_o = nn.Linear(m, vocab_size)                # L_o
        self.drop = nn.Dropout(dropout)
        self.register_buffer("baseline", torch.zeros(()))  # b_k of the hard-attention rule (per word), saved in checkpoints

    def init_state(self, feats):                                     # feats a: (B, L, D)
        mean = feats.mean(1)                                         # 1/L sum_i a_i: (B, D)
        h0, c0 = torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))   # (B, n) each
        if self.attention == "none": return {"mean": mean}, {"h": h0, "c": c0}
        memory = {"a": feats, "pre": self.att.precompute(feats)}
        if self.attention == "hard" and self.training:               # per caption: expected context with prob. p_expected
            memory["expected"] = torch.rand(len(feats), device=feats.device) < self.p_expected   # (B,) bool
        return memory, {"h": h0, "c": c0}

    def step(self, tokens, memory, state):
        h, c = state["h"], state["c"]                                # h_{t-1}, c_{t-1}: (B, n)
        Ey = self.E(tokens)                                          # E y_{t-1}: (B, m)
        aux = {}
        if self.attention in ("soft", "module"):
            z, alpha = self.att(memory["a"], memory["pre"], h)       # sum_i alpha_ti a_i: (B, D); alpha_t: (B, L)
            if alpha is not None: aux["alpha"] = alpha
        elif self.attention == "hard":                               # a_{s_t} (or sum_i alpha_ti a_i on `expected` rows)
            exp = memory.get("expected")
            z, aux["alpha"], info = self.att(memory["a"], memory["pre"], h, exp)
            aux["logp_s"], aux["entropy"] = info["logp_s"], info["entropy"]   # log alpha_{t,s_t}, H_t: (B,)
            if exp is not None: aux["sampled"] = (~exp).float()      # rows whose context is the sample: (B,)
        else:                                                        # no attention: the mean annotation vector
            z = memory["mean"].repeat_interleave(len(h) // len(memory["mean"]), 0)   # 1/L sum_i a_i: (B, D)
        beta = torch.sigmoid(self.f_beta(h)) if self.gate else torch.ones_like(h[:, :1])  # beta_t: (B, 1)
        z = beta * z                                                 # z_t = beta_t phi(a, alpha_t): (B, D)
        h, c = self.lstm(torch.cat([Ey, z], 1), (h, c))              # i, f, o, c_t, h_t: (B, n)
        logits = self.L_o(self.drop(Ey + self.L_h(self.drop(h)) + self.L_z(z)))   # L_o(E y + L_h h_t + L_z z_t): (B, V)
        return logits, {"h": h, "c": c}, aux | {"beta": beta}

    def forward(self, feats, caps):
        if self.training and self.attention == "hard" and self.samples > 1:   # N sampled attention sequences per caption
            feats, caps = feats.repeat_interleave(self.samples, 0), caps.repeat_interleave(self.samples, 0)
        return super().forward(feats, caps)

    def loss(self, out, caps):
        if len(out["logits"]) != len(caps): caps = caps.repeat_interleave(self.samples, 0)   # the N samples' rows
        mask = (caps[:, 1:] != self.pad).float()                     # real target words: (B, T)
        words = mask.sum()                                           # sum_j C_j
        if "sampled" in out:                                         # hard: log p(y_j | s~, a) per word is needed below
            lp_tok = -F.cross_entropy(out["logits"].float().transpose(1, 2), caps[:, 1:], reduction="none") * mask
            nll = -lp_tok.sum() / words                              # -sum_j log p(y_j | s~, a) / sum_j C_j
        else: nll = token_nll(out["logits"], caps[:, 1:])            # -sum_j log p(y_j | a) / sum_j C_j
        loss, stats = nll, {"nll": nll.item()}
        if "alpha" in out:
            att = (out["alpha"] * mask[..., None]).sum(1)            # sum_t alpha_ti: (B, L)
            ds = ((1 - att) ** 2).sum(1).mean() / mask.sum(1).mean() # sum_i (1 - sum_t alpha_ti)^2 / C  (Eq. 9)
            loss, stats["doubly_stochastic"] = loss + self.penalty * ds, ds.item()
        if "sampled" in out:                                         # the hard-attention learning rule (§4.1)
            ll = lp_tok.sum(1)                                       # log p(y | s~, a): (B,)
            logp_s = (out["logp_s"] * mask).sum(1)                   # log p(s~ | a) = sum_t log alpha_{t,s_t}: (B,)
            H = (out["entropy"] * mask).sum(1)                       # H[s~] = sum_t H_t: (B,)
            sampled, C = out["sampled"][:, 0], mask.sum(1)           # (B,), C_j: (B,)
            adv = (ll - self.baseline * C).detach() * sampled        # log p(y | s~, a) - b, b per word: (B,)
            reinforce = -(adv * logp_s).sum() / words                # -lambda_r (log p(y|s~,a) - b) d log p(s~|a)
            ent = -H.sum() / words                                   # -lambda_e dH[s~]
            loss = loss + self.lambda_r * reinforce + self.lambda_e * ent
            stats.update(reinforce=reinforce.item(), entropy=-ent.item(), baseline=self.baseline.item(),
                         sampled=sampled.mean().item())
            if self.training and sampled.any():                      # b_k = 0.9 b_{k-1} + 0.1 log p(y | s~_k, a), per word
                self.baseline.mul_(0.9).add_(0.1 * (ll.detach() * sampled).sum() / (C * sampled).sum())
        return loss, stats

def _sat(attention):
    def factory(vocab_size, feat_dim, grid, **hp):
        hp = {"gate": attention == "soft", "penalty": 1.0 if attention == "soft" else 0.0, **hp}
        return ShowAttendTell(vocab_size, feat_dim, grid, attention=attention, **hp)
    factory.__doc__ = f"Show-Attend-Tell with {attention} attention; gate and penalty default to the paper's choice for it."
    return register(f"sat_{attention}")(factory)

sat_soft, sat_hard, sat_none = _sat("soft"), _sat("hard"), _sat("none")


# %%
#| export
def quadrants(feats: torch.Tensor, grid: tuple[int, int], regions: tuple[int, int] = (2, 2)) -> torch.Tensor:
    "Average the annotation vectors (L, D) of an h×w feature map over a `regions` split (rows first): (R, D)."
    (h, w), D = grid, feats.shape[-1]
    return F.adaptive_avg_pool2d(feats.float().T.reshape(1, D, h, w), regions).flatten(2)[0].T

def worked_example(att: SoftAttention, regions: torch.Tensor, h: torch.Tensor, draws: int = 10_000, seed: int = 0) -> dict:
    "Soft vs hard attention over a few region vectors (R, D) for one decoder state h (n,), with capbook's modules."
    x, q = regions[None].float(), h[None].float()                        # x: (1, R, D); h_{t-1}: (1, n)
    sizes = (x.shape[-1], q.shape[-1], att.w.in_features)                 # the trained f_att, as soft and as hard attention
    soft_att, hard = SoftAttention(*sizes).to(x.device).eval(), HardAttention(*sizes).to(x.device).train()
    soft_att.load_state_dict(att.state_dict()); hard.load_state_dict(att.state_dict())
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pre = soft_att.precompute(x)                                     # W_a x_i + b: (1, R, att)
        e = soft_att.scores(pre, q)[0]                                   # e_i: (R,)
        soft, alpha = soft_att(x, pre, q)                                # sum_i alpha_i x_i: (1, D); alpha: (1, R)
        z, _, info = hard(x, pre, q)                                     # x_{s~}: (1, D)
        freq = torch.bincount(hard.sample(alpha.expand(draws, -1)), minlength=len(regions)).float() / draws
    return {"regions": regions.float(), "scores": e, "alpha": alpha[0], "soft": soft[0], "sample": int(info["s"]),
            "hard": z[0], "logp_sample": float(info["logp_s"]), "entropy": float(info["entropy"]), "freq": freq, "draws": draws}

# %% [markdown]
# ## Training and evaluation
#
# The profile sets the number of epochs; the paper's model selection is kept: "early stopping on BLEU score ... we used
# BLEU on our validation set for model selection" (§5.2), here BLEU-4 on the validation split (see `capbook.train`).
# Test captions are decoded with beam search (beam size 3).

# %%
EPOCHS = {"smoke": 2, "default": 6, "paper": 30}
check_choice("dataset", dataset, ["shapes", "coco", "flickr8k", "flickr30k"])
check_choice("attention", attention, ATTENTION)
for _n, _v in dict(seed=seed, batch_size=batch_size, emb_dim=emb_dim, hidden_dim=hidden_dim, att_dim=att_dim,
                   beam_size=beam_size, samples=samples).items():
    check_int(_n, _v, lo=0 if _n == "seed" else 1)
if epochs is not None: check_int("epochs", epochs, lo=1)
check_float("lr", lr, lo=1e-7, hi=1.0); check_float("dropout", dropout, lo=0, hi=0.95)
if penalty is not None: check_float("penalty", penalty, lo=0)
if gate is not None: check_choice("gate", gate, [True, False])
check_float("lambda_r", lambda_r, lo=0); check_float("lambda_e", lambda_e, lo=0); check_float("p_expected", p_expected, lo=0, hi=1)
run = start_run("02_show_attend_tell", dict(profile=profile, dataset=dataset, data_path=data_path, encoder=encoder,
                seed=seed, attention=attention, epochs=epochs, batch_size=batch_size, lr=lr, emb_dim=emb_dim,
                hidden_dim=hidden_dim, att_dim=att_dim, dropout=dropout, penalty=penalty, gate=gate, samples=samples,
                lambda_r=lambda_r, lambda_e=lambda_e, p_expected=p_expected, beam_size=beam_size, device=device,
                run_dir=run_dir))
prep = prepare(dataset, run.params["profile"], seed=seed, data_path=data_path, encoder=encoder, device=device)
hp = dict(emb_dim=emb_dim, hidden_dim=hidden_dim, att_dim=att_dim, dropout=dropout,
          **({} if penalty is None else {"penalty": penalty}), **({} if gate is None else {"gate": gate}),
          **(dict(samples=samples, lambda_r=lambda_r, lambda_e=lambda_e, p_expected=p_expected) if attention == "hard" else {}))
seed_everything(seed)
model = build(f"sat_{attention}", len(prep.vocab), prep.feat_shape[1], prep.grid, **hp)
cfg = TrainConfig(epochs=epochs or EPOCHS[profile], batch_size=batch_size, lr=lr, seed=seed, max_len=prep.max_len,
                  device=device)
print(f"sat_{attention}: {model.n_params:,} parameters; gate {model.gate}, penalty {model.penalty}; "
      f"{len(prep.train):,} training captions; {cfg.epochs} epochs at most")

# %%
fitted = fit(model, prep, cfg, run.path("ckpt"), meta={"model": f"sat_{attention}", "hparams": hp})
pd.DataFrame(fitted.history).round(4)

# %% [markdown]
# The test split is decoded with beam search. The hard model decodes with the most probable location at every step;
# it is also decoded with the expected context (soft attention's $\sum_i \alpha_{ti} a_i$), which the next chapter
# reports as a second hard-attention row. Every caption and its attention are saved with the run (`test_captions.pt`)
# for the figures of the next chapter.

# %%
dev = get_device(device)
model.to(dev)
def measure(ev):
    return {**ev["metrics"], **({"semantic": ev["semantic"], "attention": ev["attention"]} if "semantic" in ev else {})}
ev = evaluate(model, prep, "test", beam_size=beam_size, device=dev)
extra = {}
if attention == "hard":
    model.att.test_context = "expected"
    ev_exp = evaluate(model, prep, "test", beam_size=beam_size, device=dev)
    model.att.test_context = "argmax"
    extra["metrics_expected_context"] = measure(ev_exp)
if model.gate and prep.gt is not None:           # §4.2.1: is beta larger when the decoder names an object?
    caps = pad_captions([[model.start, *c.tokens, model.end] for c in ev["captions"]], prep.max_len + 2)
    model.eval()
    with torch.no_grad(): beta = model(torch.tensor(np.asarray(prep.test.feats[:]), dtype=torch.float32, device=dev),
                                       caps.to(dev))["beta"][..., 0].cpu()   # beta_t of the step emitting word t: (N, T)
    heads = [{t for t, _ in object_mentions(w, prep.gt["images"][k])} for w, k in zip(ev["words"], ev["keys"])]
    on = [float(beta[i, t]) for i, c in enumerate(ev["captions"]) for t in range(len(c.tokens)) if t in heads[i]]
    off = [float(beta[i, t]) for i, c in enumerate(ev["captions"]) for t in range(len(c.tokens)) if t not in heads[i]]
    extra["gate_beta"] = {"object_words": float(np.mean(on)), "other_words": float(np.mean(off)), "n_object": len(on)}
    print(f"mean beta_t when the next word is an object noun: {np.mean(on):.3f} ({len(on)} words); other words: {np.mean(off):.3f}")
save_torch(run.path("test_captions.pt"), {"keys": ev["keys"], "tokens": [c.tokens for c in ev["captions"]],
           "alpha": [c.alpha for c in ev["captions"]], "words": ev["words"]})
run.record(measure(ev), timings={"train_s": fitted.train_seconds, "train_captions_per_s": fitted.captions_per_s,
                                 **ev["timings"]},
           n_params=model.n_params, notes=ev["notes"], best_epoch=fitted.best_epoch, history=fitted.history,
           samples=[{"key": k, "caption": " ".join(w)} for k, w in list(zip(ev["keys"], ev["words"]))[:20]], **extra)
shown = {"test": ev["metrics"], **({"test, expected context": ev_exp["metrics"]} if attention == "hard" else {})}
pd.DataFrame({k: {m: round(100 * v, 1) for m, v in d.items()} for k, d in shown.items()}).T

# %% [markdown]
# ## Soft and hard attention, worked on one image
#
# The explainer (`shared/papers/soft_hard_attention_blog.txt`) splits a convolutional feature map into four regions —
# "the top right & left and the bottom right & left of the original pictures" — scores each region against the
# decoder's context, turns the scores into weights with a softmax, and then either averages the regions with these
# weights (soft attention) or "uses [the weights] as a sample rate to pick one as the input to the LSTM" (hard
# attention). Here the same computation runs through capbook's own modules, with this run's trained $f_{att}$:
#
# 1. the test image below (the first whose caption names an object) is encoded into its $h \times w$ feature map, and
#    each quadrant's annotation vectors are averaged: $x_1..x_4 \in \mathbb{R}^D$ (top-left, top-right, bottom-left,
#    bottom-right);
# 2. the decoder is run on its own caption up to the first object word; its state $h_{t-1}$ there is the context;
# 3. `SoftAttention.scores` gives $e_i = w^\top \tanh(W_a x_i + W_h h_{t-1}) + b$, its softmax $\alpha_i$, and
#    `SoftAttention.forward` the soft context $\sum_i \alpha_i x_i$;
# 4. `HardAttention.forward` (training mode, same weights) draws one region $\tilde s \sim \mathrm{Multinoulli}(\alpha)$
#    and returns $x_{\tilde s}$; 10,000 further draws by `HardAttention.sample` show that each region is picked with
#    probability $\alpha_i$.
#
# `tests/test_sat.py` checks every number of this example against a direct computation. The no-attention baseline has
# no $f_{att}$, so the section is skipped for it.

# %%
WE = None
if attention != "none" and prep.gt is not None:
    pick = next((i for i, w in enumerate(ev["words"]) if object_mentions(w, prep.gt["images"][ev["keys"][i]])), 0)
    toks, t_obj = ev["captions"][pick].tokens, object_mentions(ev["words"][pick], prep.gt["images"][ev["keys"][pick]])[0][0]
    f = torch.tensor(np.asarray(prep.test.feats[pick]), dtype=torch.float32, device=dev)[None]   # (1, L, D)
    model.eval()
    with torch.no_grad():
        memory, state = model.init_state(f)
        for tok in ([model.start] + toks)[:t_obj]:                   # the steps before the one that emits the object word
            _, state, _ = model.step(torch.tensor([tok], device=dev), memory, state)
    h_prev = state["h"][0]                                           # h_{t-1} of the step that emits it
    WE = worked_example(model.att, quadrants(f[0], prep.grid), h_prev)
    names = ["top-left", "top-right", "bottom-left", "bottom-right"]
    print(f"caption: {' '.join(ev['words'][pick])!r}; the word being predicted: {ev['words'][pick][t_obj]!r}")
    display(pd.DataFrame({"region": names, "score e_i": WE["scores"].cpu().numpy(), "alpha_i = softmax(e)_i": WE["alpha"].cpu().numpy(),
                          f"hard: share of {WE['draws']:,} draws": WE["freq"].cpu().numpy()}).round(4))
    print(f"soft context  = sum_i alpha_i x_i  (first 4 of {len(WE['soft'])} channels): {WE['soft'][:4].cpu().numpy().round(4)}")
    print(f"hard context  = x_{WE['sample'] + 1} ({names[WE['sample']]}), drawn with probability {np.exp(WE['logp_sample']):.4f}: "
          f"{WE['hard'][:4].cpu().numpy().round(4)}")
    fig_we = soft_hard_figure(prep.image_paths("test")[pick], WE, ev["words"][pick][t_obj], run.path("fig_soft_vs_hard_example.png"))
    display(IPImage(filename=str(fig_we)))

# %% [markdown]
# ## What the model looks at, word by word
#
# Figure 3 of the paper shows, for one image, the attention of every generated word, "upsampling the attention weights
# and smoothing" (§5.4; see `capbook.viz.smooth_attention` for the exact filter). capbook picks the test image by rule,
# not by hand: the first test image whose caption names at least two objects that are in the image. The next chapter
# puts the soft and the hard model's maps for the same image one above the other, as the paper's figure does.

# %%
if attention != "none":
    pick = 0
    if prep.gt is not None:
        pick = next((i for i, (k, w) in enumerate(zip(ev["keys"], ev["words"]))
                     if len([m for m in object_mentions(w, prep.gt["images"][k]) if m[1]]) >= 2), 0)
    fig_path = run.path(f"fig_sat_{attention}_attention.png")
    attention_figure([{"label": f"{attention.capitalize()}-Attention", "image": prep.image_paths("test")[pick],
                       "words": ev["words"][pick], "alpha": ev["captions"][pick].alpha, "grid": prep.grid}], fig_path)
    display(IPImage(filename=str(fig_path)))
