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
# # objectives
#
# > The training objectives, outside the models: cross-entropy, Show-Attend-Tell's doubly stochastic penalty and hard-attention learning rule, and self-critical sequence training — one trainer runs them all.
#
# An objective is what the trainer minimises. It sees the model's outputs **and the batch** — the captions, the
# images' references, any other input — so a loss that needs the references (self-critical training's CIDEr-D
# reward) is written as easily as cross-entropy, and every objective runs in the one training loop of `capbook.train`,
# as in ruotianluo's `LossWrapper`:
#
# ```python
# out = objective.outputs(net, batch)        # run the model: teacher forcing (default) or sampling
# loss, stats = objective.loss(out, batch)   # a scalar to minimise and the terms to log
# ```
#
# `outputs` runs under the trainer's autocast, `loss` in float32. An objective is an `nn.Module`, so state it keeps
# (hard attention's moving-average baseline) is saved in every checkpoint and restored on resume. A registered model
# names the objective its paper trains it with (`capbook.models.register(..., objective=...)`); `objective_for(model)`
# builds it from the model's config, and `fit` takes any other.

# %%
#| default_exp objectives

# %%
#| export
from __future__ import annotations
from typing import Any, Mapping
import numpy as np
import torch
from torch import nn
import torch.nn.functional as F
from capbook.core import CapbookError, check_choice, wide
from capbook.models import CaptionModel, spec, token_nll
from capbook.decode import sample


# %%
#| export
class Objective(nn.Module):
    "Base class: `outputs(net, batch)` runs the model (teacher forcing by default), `loss(out, batch) -> (loss, stats)`."
    pad = CaptionModel.pad
    sample_prob: float = 0.0        # scheduled sampling's probability of feeding the model its own word (set by the trainer)
    tensor_stats: bool = False      # the logged terms as 0-dim tensors, not numbers: no host synchronisation (stacked and graph-ready steps)

    def stat(self, t: torch.Tensor):
        "A logged term: a number, or with `tensor_stats` the detached tensor (read after the step)."
        return t.detach() if self.tensor_stats else t.item()

    def outputs(self, net: nn.Module, batch: Mapping[str, Any]) -> dict:
        "The model's outputs for this objective: teacher forcing over `batch['caps']` (scheduled sampling when `sample_prob` > 0)."
        return net(batch, mode="scheduled", p=self.sample_prob) if self.sample_prob else net(batch)

    def loss(self, out: dict, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def forward(self, net: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict]:
        return self.loss(self.outputs(net, batch), batch)

def targets(out: dict, batch: Mapping[str, Any]) -> torch.Tensor:
    "The next-word targets `caps[:, 1:]`, repeated when the model ran several rows per caption (hard attention's N samples)."
    caps = batch["caps"]
    k = len(out["logits"]) // len(caps)
    return (caps if k == 1 else caps.repeat_interleave(k, 0))[:, 1:]


# %% [markdown]
# ## Cross-entropy
#
# The negative log-likelihood of the next word, averaged over the real (non-pad) target words of the batch:
# $-\frac{1}{\sum_j C_j} \sum_j \sum_{t=1}^{C_j} \log p(y_{j,t} \mid y_{j,<t}, I_j)$.

# %%
#| export
class CrossEntropy(Objective):
    "Teacher-forced cross-entropy of the next word, per real target word; with label smoothing ε, against (1-ε)·one-hot + ε/V."
    label_smoothing: float = 0.0    # ε, set by the trainer from `TrainConfig.label_smoothing`
    def loss(self, out, batch):
        y = targets(out, batch)
        # -sum_j log p(y_j | I_j) / sum_j C_j
        nll = token_nll(out["logits"], y, self.pad)
        if not self.label_smoothing: return nll, {"nll": self.stat(nll)}
        # (1-ε) NLL + ε mean_v(-log p_v), per real target word
        smoothed = token_nll(out["logits"], y, self.pad, self.label_smoothing)
        return smoothed, {"nll": self.stat(nll), "smoothed": self.stat(smoothed)}


# %% [markdown]
# **Label smoothing** (Szegedy et al. 2016; in the recipes behind AoANet, X-LAN and fairseq's captioning numbers), off
# unless a chapter's paper uses it (none of the five does): with ε > 0 the target of every word is
# $(1-\varepsilon)\,\text{one-hot}(y) + \varepsilon/V$, so the loss per word is
#
# $$(1-\varepsilon)\,\big(-\log p(y)\big) + \frac{\varepsilon}{V}\sum_{v=1}^{V}\big(-\log p(v)\big).$$
#
# The reported `nll` stays the plain negative log-likelihood, so runs with and without smoothing compare; `smoothed` is
# what is minimised. Hard attention's sampled half keeps the plain log-likelihood as its REINFORCE reward.

# %%
_logits, _y = torch.randn(2, 3, 7), torch.tensor([[4, 5, 0], [3, 0, 0]])   # 3 real words; 0 is <pad>
_ce = CrossEntropy(); _ce.label_smoothing = 0.1
_loss, _st = _ce.loss({"logits": _logits}, {"caps": torch.cat([torch.ones(2, 1, dtype=torch.long), _y], 1)})
_lp = F.log_softmax(_logits, -1)[_y != 0]                                   # the real words' log p: (3, V)
_want = (0.9 * -_lp.gather(1, _y[_y != 0][:, None])[:, 0] + 0.1 * -_lp.mean(1)).mean()
assert torch.allclose(_loss, _want, atol=1e-6) and abs(_st["nll"] - float(-_lp.gather(1, _y[_y != 0][:, None]).mean())) < 1e-6


# %% [markdown]
# ## The doubly stochastic penalty — Show, Attend and Tell Eq. 9
#
# $$L_d = -\log p(y \mid a) + \lambda \sum_i^L \Big(1 - \sum_t^C \alpha_{ti}\Big)^2$$
#
# "encouraging the model to pay equal attention to every part of the image over the course of generation". *capbook's
# choice:* Eq. 9 is written per caption; we average it over the batch and divide both terms by the mean caption length,
# so the NLL term is the usual per-word cross-entropy and λ keeps the paper's meaning relative to $-\log p(y|a)$. The
# penalty is computed (and logged) whenever the model returns attention weights, and weighted by λ.

# %%
#| export
def doubly_stochastic(alpha: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    "sum_i (1 - sum_t alpha_ti)^2 averaged over captions, per word: alpha (B, T, L), mask (B, T) of real words."
    # sum_t alpha_ti over the real words: (B, L)
    att = (alpha * mask[..., None]).sum(1)
    # captions with a word: a batch padded to a fixed size (stacked runs) adds rows without one, which count nowhere
    real = mask.amax(1)
    mean = lambda x: (x * real).sum() / real.sum()
    # sum_i (1 - sum_t alpha_ti)^2 / C  (Eq. 9), averaged over the real captions (the same bits as .mean() without padding)
    return mean(((1 - att) ** 2).sum(1)) / mean(mask.sum(1))

class DoublyStochastic(CrossEntropy):
    "Cross-entropy plus λ times the doubly stochastic attention penalty (Eq. 9)."
    def __init__(self, penalty: float = 1.0):
        super().__init__()
        self.penalty = penalty
    def loss(self, out, batch):
        loss, stats = super().loss(out, batch)
        if "alpha" in out:
            mask = (targets(out, batch) != self.pad).float()                # real target words: (B, T)
            ds = doubly_stochastic(out["alpha"], mask)
            loss, stats["doubly_stochastic"] = loss + self.penalty * ds, self.stat(ds)
        return loss, stats


# %% [markdown]
# Cross-entropy and the doubly stochastic penalty on a small batch: with uniform attention over L = 4 locations and 2
# words per caption, $\sum_t \alpha_{ti} = 1/2$, so the penalty is $4 \cdot (1/2)^2 / 2 = 0.5$ per word.

# %%
_out = {"logits": torch.zeros(2, 3, 5), "alpha": torch.full((2, 3, 4), 0.25)}
_b = {"caps": torch.tensor([[1, 3, 2, 0], [1, 4, 2, 0]])}
_l, _st = DoublyStochastic(2.0).loss(_out, _b)
assert abs(_st["nll"] - np.log(5)) < 1e-6 and abs(_st["doubly_stochastic"] - 0.5) < 1e-6
assert abs(_l.item() - (np.log(5) + 2.0 * 0.5)) < 1e-6


# %% [markdown]
# ## Hard attention's learning rule — Show, Attend and Tell §4.1
#
# The objective is the variational lower bound $L_s = \sum_s p(s \mid a) \log p(y \mid s, a) \le \log p(y \mid a)$
# (Eq. 5), whose gradient is estimated from sampled location sequences $\tilde s$, with a moving-average baseline and
# an entropy term:
# $$\frac{\partial L_s}{\partial W} \approx \frac1N \sum_{n=1}^N \Big[\frac{\partial \log p(y \mid \tilde s^n, a)}{\partial W} +
#   \lambda_r \big(\log p(y \mid \tilde s^n, a) - b\big) \frac{\partial \log p(\tilde s^n \mid a)}{\partial W} +
#   \lambda_e \frac{\partial H[\tilde s^n]}{\partial W}\Big], \qquad b_k = 0.9\, b_{k-1} + 0.1 \log p(y \mid \tilde s_k, a).$$
#
# The model (`capbook.attention.HardAttention` inside `capbook.sat.ShowAttendTell`) returns, per step, $\log
# \alpha_{t,\tilde s_t}$ (`logp_s`), the entropy $H_t$ (`entropy`) and which captions used a sample rather than the
# expected context (`sampled`); the objective minimises the surrogate whose gradient is the rule's right-hand side
# (the reward is detached, which is what makes its gradient the REINFORCE term):
# $$\mathcal L = -\log p(y \mid \tilde s, a) - \lambda_r\, \mathrm{sg}\big[\log p(y \mid \tilde s, a) - b\big] \log p(\tilde s \mid a) - \lambda_e H[\tilde s].$$
#
# The choices (per-word baseline, its timing, the 50 % switch, λ values) are explained in the Show-Attend-Tell chapter;
# `tests/test_sat_hard.py` enumerates every location sequence of a tiny model and checks that the expectation of this
# estimator is exactly the gradient of $L_s$. The baseline $b$ is a buffer of the objective, so checkpoints carry it
# and an exact resume restores it. Without sampled captions in the outputs (a model in eval mode, or soft attention)
# the objective is the doubly stochastic one. Under DistributedDataParallel each process keeps its own baseline, computed from its own
# share of the batch (when the baseline was a model buffer, DDP overwrote it with rank 0's at every step); the weights
# stay identical across processes because the gradients are averaged.

# %%
#| export
class HardAttentionRule(DoublyStochastic):
    "Show-Attend-Tell §4.1: NLL under the sampled locations + REINFORCE with a per-word moving-average baseline + entropy."
    def __init__(self, lambda_r: float = 0.1, lambda_e: float = 0.002, penalty: float = 0.0):
        super().__init__(penalty)
        self.lambda_r, self.lambda_e = lambda_r, lambda_e
        self.register_buffer("baseline", torch.zeros(()))   # b_k (per word)

    def loss(self, out, batch):
        if "sampled" not in out: return super().loss(out, batch)
        y = targets(out, batch)
        mask = (y != self.pad).float()                               # real target words: (B, T)
        words = mask.sum()                                           # sum_j C_j
        # log p(y_jt | s~, a) of every real word: (B, T)
        lp_tok = -F.cross_entropy(wide(out["logits"]).transpose(1, 2), y, reduction="none") * mask
        # -sum_j log p(y_j | s~, a) / sum_j C_j
        nll = -lp_tok.sum() / words
        loss, stats = nll, {"nll": self.stat(nll)}
        ds = doubly_stochastic(out["alpha"], mask)
        loss, stats["doubly_stochastic"] = loss + self.penalty * ds, self.stat(ds)
        # log p(y | s~, a): (B,)
        ll = lp_tok.sum(1)
        # log p(s~ | a) = sum_t log alpha_{t,s_t}: (B,)
        logp_s = (out["logp_s"] * mask).sum(1)
        # H[s~] = sum_t H_t: (B,)
        H = (out["entropy"] * mask).sum(1)
        sampled, C = out["sampled"][:, 0], mask.sum(1)               # (B,), C_j: (B,)
        # log p(y | s~, a) - b, with b per word: (B,)
        adv = (ll - self.baseline * C).detach() * sampled
        # -lambda_r (log p(y|s~,a) - b) d log p(s~|a), per word
        reinforce = -(adv * logp_s).sum() / words
        # -lambda_e dH[s~], per word
        ent = -H.sum() / words
        loss = loss + self.lambda_r * reinforce + self.lambda_e * ent
        stats.update(reinforce=self.stat(reinforce), entropy=self.stat(-ent), baseline=self.stat(self.baseline.clone()),
                     sampled=self.stat(sampled.mean()))
        if self.training:
            # b_k = 0.9 b_{k-1} + 0.1 log p(y | s~_k, a), per word (kept while no caption of the batch sampled)
            b = self.baseline * 0.9 + 0.1 * (ll.detach() * sampled).sum() / (C * sampled).sum()
            self.baseline.copy_(torch.where(sampled.any(), b, self.baseline))   # b itself where any sampled; no host sync
        return loss, stats


# %% [markdown]
# With λ_r = λ_e = 0 and no penalty the rule is the NLL under the sampled locations, and the baseline moves a tenth of
# the way towards the batch's log-likelihood per word: two captions of two words at uniform logits over 5 words give
# $\log p = -\log 5$ per word.

# %%
_r = HardAttentionRule(lambda_r=0.0, lambda_e=0.0).train()
_o = {**_out, "logp_s": torch.full((2, 3), -1.0), "entropy": torch.ones(2, 3), "sampled": torch.ones(2, 3)}
_l, _st = _r.loss(_o, _b)
assert abs(_l.item() - np.log(5)) < 1e-6 and abs(_r.baseline.item() + 0.1 * np.log(5)) < 1e-6
assert set(_st) == {"nll", "doubly_stochastic", "reinforce", "entropy", "baseline", "sampled"}

# %% [markdown]
# ## Self-critical sequence training — Rennie et al. 2017 ([arXiv:1612.00563](https://arxiv.org/abs/1612.00563))
#
# SCST optimises the test metric directly: for each image it samples captions $w^s$ from the model and decodes the
# greedy caption $\hat w$; the greedy caption's reward is the baseline, so
# $$\nabla_\theta L(\theta) \approx -\big(r(w^s) - r(\hat w)\big) \nabla_\theta \log p_\theta(w^s),$$
# with $r$ the CIDEr-D score against the image's references (`capbook.metrics.CiderD`, its document frequencies from
# the training references, computed once and cached). GLIED (§4.2) trains this way after cross-entropy; `outputs`
# draws the samples through the model (`net(batch, mode=sample)`, so DistributedDataParallel still synchronises the
# gradients) and `loss` is the surrogate whose gradient is the right-hand side.
#
# *capbook:* the trainer's batches hold captions, several per image; SCST takes each image of a batch once
# (its references are all of the image's captions). Following ruotianluo's `self-critical.pytorch`, the surrogate is
# averaged over the sampled words (`mask`), the greedy caption is decoded in eval mode (no dropout), and the end
# token counts as a word of every caption in the reward (`end=True`). A caption is at most `max_len` words and then
# `<end>` — the limit greedy decoding and beam search keep, so a sample can be no longer than the caption the stage is
# validated and tested on (`sample(..., end_by=True)`). The greedy caption of the baseline is decoded in float32,
# as validation decodes it, so $r(\hat w)$ is the reward of the caption validation scores; the samples, whose
# log-probabilities carry the gradient, are drawn in the run's training arithmetic, as cross-entropy's forward pass is
# (bfloat16 autocast on a CPU with bfloat16 kernels). A row given no `<end>` (`sample` without `end_by` cuts it there)
# is scored without the end token and loses the n-grams that end a reference. The references are cut to
# `max_len` words too, for the rewards and for the document frequencies, as self-critical.pytorch's are (its labels
# hold `seq_length` words): a sample cannot be longer, so n-grams a sample could never reach neither count in the
# reference vectors nor weigh in the idf. `baseline="mean"` replaces $r(\hat w)$ by the mean reward of the image's other
# $n - 1$ samples, the variant most used since (it needs no greedy decode for the gradient; capbook still decodes
# the greedy caption, to log its reward). Each step reports the mean sample reward, the mean baseline and the
# greedy caption's reward, and the trainer keeps their epoch means in the history — the curves that show the switch
# from cross-entropy working (or a reward gone negative, the most common complaint about SCST elsewhere).

# %%
#| export
SCST_BASELINES = ("greedy", "mean")

class SelfCritical(Objective):
    "SCST: -(r(w^s) - b) log p(w^s), r = CIDEr-D against the image's references, `n` samples per image, b the greedy caption's reward or the mean of the image's other samples."
    def __init__(self, vocab, corpus: list[list[list[str]]], n: int = 5, temperature: float = 1.0, max_len: int = 16,
                 baseline: str = "greedy", end: bool = True, cache=None):
        super().__init__()
        from capbook.metrics import CiderD
        check_choice("scst_baseline", baseline, SCST_BASELINES)
        if baseline == "mean" and n < 2: raise CapbookError(f"scst_baseline='mean' needs at least 2 samples per image, not n={n}")
        self.vocab, self.n, self.temperature, self.max_len, self.baseline = vocab, n, temperature, max_len, baseline
        # df of the training references cut to max_len words (what a sample can reach), cached
        self.cider = CiderD([[r[:max_len] for r in rs] for rs in corpus], vocab=vocab, end=end, cache=cache)

    def _ids(self, tokens: torch.Tensor) -> tuple[list[np.ndarray], list[bool]]:
        "Sampled token rows up to (not including) <end>, and whether each ended: CiderD appends <end> to those that did, so a sample cut at max_len loses the n-grams that end a reference."
        out, ended = [], []
        for row in tokens.cpu().numpy():
            stop = np.flatnonzero(row == CaptionModel.end)
            out.append(row[:stop[0]] if len(stop) else row); ended.append(bool(len(stop)))
        return out, ended

    def reward(self, tokens: torch.Tensor, refs: list[list]) -> np.ndarray:
        "CIDEr-D of sampled token rows (R, T) against each row's references (lists of words, cut to `max_len`): (R,)."
        rows, ended = self._ids(tokens)
        cut = {id(rs): [r[:self.max_len] for r in rs] for rs in refs}       # one list per image, as CiderD caches it
        return self.cider.score(rows, [cut[id(rs)] for rs in refs], ended=ended)

    def outputs(self, net, batch):
        img = batch["img"].tolist()
        first = sorted({v: i for i, v in reversed(list(enumerate(img)))}.values())   # one row per image
        keep = torch.tensor(first, device=batch["caps"].device)
        b = {k: v.index_select(0, keep) if isinstance(v, torch.Tensor) else [v[i] for i in first] for k, v in batch.items()}
        was = net.training
        net.eval()
        dev = b["caps"].device
        # w^, in float32 as validation decodes it (autocast off): at most max_len words, then <end>
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            greedy = net(b, mode=sample, temperature=0.0, max_len=self.max_len + 1, end_by=True)
        net.train(was)
        # w^s ~ pi(w | I), in the run's training arithmetic, with log pi (the distribution drawn from: `00g_decode`): at most max_len words, then <end>
        s = net(b, mode=sample, n=self.n, temperature=self.temperature, max_len=self.max_len + 1, end_by=True, policy=True)
        refs = b["refs"]                                                     # each image's reference word lists
        r_g = self.reward(greedy.tokens, refs)                               # r(w^): (B,)
        r_s = self.reward(s.tokens, [r for r in refs for _ in range(self.n)])   # r(w^s): (B*n,)
        if self.baseline == "greedy": base = np.repeat(r_g, self.n)          # b = r(w^) (Rennie et al.)
        else:
            # b_i = (sum_j r(w^s_j) - r(w^s_i)) / (n - 1) over the image's other samples
            per = r_s.reshape(-1, self.n)
            base = ((per.sum(1, keepdims=True) - per) / (self.n - 1)).reshape(-1)
        return {"samples": s, "advantage": torch.tensor(r_s - base, dtype=torch.get_default_dtype(), device=s.logprobs.device),
                "reward": float(r_s.mean()), "baseline": float(base.mean()), "greedy_reward": float(r_g.mean())}

    def loss(self, out, batch):
        s = out["samples"]
        # -(r(w^s) - b) sum_t log p(w^s_t), per sampled word
        loss = -(out["advantage"][:, None] * s.logprobs * s.mask).sum() / s.mask.sum()
        return loss, {"scst": loss.item(), "reward": out["reward"], "baseline": out["baseline"],
                      "greedy_reward": out["greedy_reward"]}


# %% [markdown]
# An untrained soft-attention captioner on two images: three samples per image, each scored against its image's
# references, minus the greedy caption's score. A reference caption itself earns a positive CIDEr-D, a caption
# of no shared n-gram zero.

# %%
from capbook.data import Vocab
from capbook.models import build
_v = Vocab.build([["a", "red", "circle"], ["a", "blue", "star"]], min_count=1)
_refs = [[["a", "red", "circle"]], [["a", "blue", "star"]]]
_m = build("sat_soft", len(_v), 8, (2, 2), emb_dim=8, hidden_dim=16, att_dim=8)
_bt = {"feats": torch.randn(2, 4, 8), "caps": torch.tensor([_v.encode(r[0]) for r in _refs]),
       "img": torch.tensor([0, 1]), "refs": _refs}
_sc = SelfCritical(_v, _refs, n=3, max_len=5)
_o = _sc.outputs(_m, _bt)
_l, _st = _sc.loss(_o, _bt)
assert _o["samples"].tokens.shape[0] == 6 and _o["advantage"].shape == (6,) and _l.requires_grad
assert _sc.cider.score([["a", "red", "circle"], ["blue"]], _refs).tolist()[0] > 0 == _sc.cider.score([["blue"]], _refs[:1])[0]
print(_st)

# %% [markdown]
# A row cut off without `<end>` is scored without the end token, so it misses the n-grams that end a
# reference: the same words score less than when the caption ended.

# %%
_w = [_v.stoi[w] for w in ("a", "red", "circle")]
_r = [_sc.reward(torch.tensor([t]), [_refs[0]])[0] for t in (_w + [CaptionModel.end], _w)]   # ended; cut at max_len
assert _r[0] > _r[1] > 0, _r

# %% [markdown]
# With the mean of the other samples as baseline, the advantages of an image's samples sum to zero: the update only
# moves probability between them.

# %%
_sm = SelfCritical(_v, _refs, n=3, max_len=5, baseline="mean")
_om = _sm.outputs(_m, _bt)
assert torch.allclose(_om["advantage"].view(2, 3).sum(1), torch.zeros(2), atol=1e-5)


# %% [markdown]
# ## The objective a model trains with
#
# The registry entry of a model names its paper's objective (built from the model's config); models that name none
# train with cross-entropy.

# %%
#| export
def objective_for(model: CaptionModel) -> Objective:
    "The objective the model's registry entry names, built from its config; cross-entropy if it names none."
    make = spec(model.name).objective if model.name else None
    return make(model.config) if make else CrossEntropy()


# %% [markdown]
# Show-Attend-Tell's soft attention names the doubly stochastic objective; a model outside the registry trains with
# cross-entropy.

# %%
# (by class name: in this notebook the classes above are copies of the installed module's, which the registry uses)
assert [type(objective_for(m)).__name__ for m in (_m, CaptionModel(5))] == ["DoublyStochastic", "CrossEntropy"]
