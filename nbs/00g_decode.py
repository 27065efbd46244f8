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
# # decode
#
# > Greedy search, beam search and sampling for every model, batched over images, beams and samples, returning per-step attention.

# %%
#| default_exp decode

# %%
#| export
from __future__ import annotations
from dataclasses import dataclass
from typing import Any, Mapping
import torch
import torch.nn.functional as F
from capbook.models import CaptionModel, batch_size as _n_images, check_inputs
from capbook.core import CapbookError, check_float, check_int, wide
from capbook.data import to_device


# %% [markdown]
# Every decoder talks to a model only through `init_state` / `step` (see `capbook.models`) and takes a batch of named
# inputs (a `dict` with `feats` and whatever else the model declares; a bare feature tensor is accepted as
# `{"feats": tensor}`). A result per image is a
# `Caption`: the word ids without `<start>`/`<end>`, the summed log-probability, and, for models with attention, the
# weights of every emitted step (T, L) — the step that emitted word t is row t, and the `<end>` step is dropped.

# %%
#| export
@dataclass
class Caption:
    "One decoded caption: word ids (no <start>/<end>), total log-probability, and per-word attention (T, L) or None."
    tokens: list[int]
    logprob: float
    alpha: torch.Tensor | None = None

def _repeat(d: dict, k: int) -> dict:
    return {n: v.repeat_interleave(k, 0) for n, v in d.items()}

def _select(d: dict, idx: torch.Tensor) -> dict:
    return {n: v.index_select(0, idx) for n, v in d.items()}

def _mask(lp: torch.Tensor, done: torch.Tensor, model: CaptionModel, last: bool) -> torch.Tensor:
    "Live rows may not emit <start> or <pad> (and only <end> at the last step); finished rows only <pad>, at no cost."
    lp[:, model.start] = float("-inf"); lp[:, model.pad] = float("-inf")
    if last: lp[:, :model.end] = float("-inf"); lp[:, model.end + 1:] = float("-inf")
    lp[done] = float("-inf"); lp[done, model.pad] = 0
    return lp

def _block_repeats(lp: torch.Tensor, words: torch.Tensor, done: torch.Tensor, n: int, pad: int) -> torch.Tensor:
    "n-gram repeat blocking: in each live row, every word that would complete an n-gram the row already holds gets log p = -inf. lp: (R, V); words: (R, t) emitted so far."
    if n < 1 or words.shape[1] < n: return lp
    if n == 1: banned = words                                                   # every word already emitted: (R, t)
    else:
        grams = words.unfold(1, n, 1)                                           # every n-gram so far: (R, t-n+1, n)
        hit = (grams[..., :-1] == words[:, None, -(n - 1):]).all(-1)            # its first n-1 words are the row's last: (R, t-n+1)
        banned = grams[..., -1].masked_fill(~hit, pad)                          # the words that would repeat it (pad: none)
    ban = torch.zeros_like(lp, dtype=torch.bool).scatter_(1, banned, True)
    ban[:, pad] = False; ban[done] = False                                      # pad and ended rows as `_mask` left them
    return lp.masked_fill(ban, float("-inf"))

def as_batch(x: torch.Tensor | Mapping[str, Any]) -> dict:
    "A batch mapping; a bare tensor is taken as the features."
    return {"feats": x} if isinstance(x, torch.Tensor) else dict(x)

def _device(model: CaptionModel, batch: dict) -> torch.device:
    return batch[model.inputs[0]].device

def _finish(tokens: torch.Tensor, logprob: float, alpha: torch.Tensor | None, end: int) -> Caption:
    toks = tokens.tolist()
    n = toks.index(end) if end in toks else len(toks)
    return Caption(toks[:n], logprob, None if alpha is None else alpha[:n].float().cpu())


# %% [markdown]
# ## Greedy search
# The most probable word at every step, until `<end>`; after `max_len` words only `<end>` is allowed.

# %%
#| export
@torch.no_grad()
def greedy(model: CaptionModel, batch: Mapping[str, Any] | torch.Tensor, max_len: int = 20, no_repeat_ngram: int = 0) -> list[Caption]:
    "Greedy decoding of a batch of B images (with `no_repeat_ngram` n > 0: no n-gram twice in a caption)."
    batch = as_batch(batch); check_inputs(model, batch); check_int("no_repeat_ngram", no_repeat_ngram, lo=0)
    B, dev = _n_images(model, batch), _device(model, batch)
    memory, state = model.init_state(batch)
    tok = torch.full((B,), model.start, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    logp = torch.zeros(B, device=dev)
    words, alphas = [], []
    for t in range(max_len + 1):
        logits, state, aux = model.step(tok, memory, state)
        lp = _mask(F.log_softmax(wide(logits), -1), done, model, t == max_len)
        if no_repeat_ngram and words: lp = _block_repeats(lp, torch.stack(words, 1), done, no_repeat_ngram, model.pad)
        best, tok = lp.max(-1)
        logp += best
        words.append(tok); alphas.append(aux.get("alpha"))
        done |= tok == model.end
        if done.all(): break
    W = torch.stack(words, 1)
    A = torch.stack(alphas, 1) if alphas[0] is not None else None
    return [_finish(W[b], logp[b].item(), None if A is None else A[b], model.end) for b in range(B)]


# %% [markdown]
# ## Beam search, batched over images and beams
#
# All B images and their K beams run as one batch of B·K rows (the image features stay at B rows: the model broadcasts
# them over the beams). At every step each row's next-word log-probabilities are added to its beam's score, the K·V
# candidates of each image are ranked together and the best K kept; the model's `state` (and the word and attention
# histories) are then gathered along the batch dimension. An image is finished as soon as its best beam has ended: the
# beams are sorted, so every live beam scores lower, and log-probabilities only fall as a beam grows, so none of them
# can overtake it (the result is exactly what running every beam to its end would return). A finished image leaves the
# batch, so the remaining steps only compute the images still being searched. A finished beam
# (one that emitted `<end>`) keeps its score and can only be extended by `<pad>` at no cost, so it competes with the
# live beams on equal terms. At the first step only beam 0 is live, so the K beams start as K different words.
#
# **Length normalisation.** The papers rank beams by their summed log-probability, which favours short captions: each
# word can only lower it. With `length_norm` α > 0 the final K beams of an image are ranked by
#
# $$\frac{\log p(w_1, \dots, w_L \mid I)}{L^{\alpha}}$$
#
# with $L$ the tokens emitted, `<end>` included (α = 1: the mean log-probability per word; self-critical.pytorch's
# `length_penalty='avg_α'`, a simpler relative of GNMT's $((5 + L)/6)^{\alpha}$). With α > 0 a caption that ends
# goes to the image's pool of finished captions, ranked by that score, and never holds one of the K slots: each step
# ranks the best 2K candidates, the ended ones among the first K join the pool, and the K best that do not end go on
# (fairseq's rule; self-critical.pytorch's `done_beams` likewise). Finished captions thus compete with each other on
# the normalised score, while the K slots keep searching longer ones — instead of carrying finished captions on their
# raw score, which would only re-rank what survived. The search stops when no live beam can beat the pool's best: a live beam's summed
# log-probability only falls and its length is at most `max_len` + 1, so its final score is at most
# $\log p / (\text{max\_len} + 1)^{\alpha}$. α = 0 is the papers' rule, unchanged.

# %%
#| export
@torch.no_grad()
def beam_search(model: CaptionModel, batch: Mapping[str, Any] | torch.Tensor, beam_size: int = 3,
                max_len: int = 20, length_norm: float = 0.0, no_repeat_ngram: int = 0) -> list[Caption]:
    "Beam search for a batch of B images: the best of `beam_size` beams for each image (ranked by log-probability / length^`length_norm`; with `no_repeat_ngram` n > 0, no n-gram twice in a beam)."
    batch = as_batch(batch); check_inputs(model, batch); check_int("beam_size", beam_size, lo=1)
    check_int("no_repeat_ngram", no_repeat_ngram, lo=0)
    check_float("length_norm", length_norm, lo=0.0, hi=5.0)
    B, K, dev = _n_images(model, batch), beam_size, _device(model, batch)
    memory, state = model.init_state(batch)                                    # memory: (B, ...), state: (B, ...)
    state = _repeat(state, K)                                                  # (B*K, ...)
    tok = torch.full((B * K,), model.start, dtype=torch.long, device=dev)
    score = torch.full((B, K), float("-inf"), device=dev); score[:, 0] = 0    # (B, K)
    done = torch.zeros(B * K, dtype=torch.bool, device=dev)
    length = torch.zeros(B * K, device=dev)                                    # tokens emitted, <end> included
    words, alphas = torch.zeros(B * K, 0, dtype=torch.long, device=dev), None
    images, out = torch.arange(B, device=dev), [None] * B                      # images still being searched
    pool = torch.full((B,), float("-inf"), device=dev)                         # alpha > 0: best finished log p / L^alpha
    for t in range(max_len + 1):
        n = len(images)
        base = (torch.arange(n, device=dev) * K)[:, None]                      # first row of each image
        logits, state, aux = model.step(tok, memory, state)
        lp = _mask(F.log_softmax(wide(logits), -1), done, model, t == max_len)  # (n*K, V)
        if no_repeat_ngram: lp = _block_repeats(lp, words, done, no_repeat_ngram, model.pad)
        V = lp.shape[-1]
        flat = (score.view(-1, 1) + lp).view(n, K * V)                          # every beam's every next word: (n, K*V)
        if length_norm:
            # the best 2K candidates: those among the first K that end join the pool (log p / L^alpha, L the tokens with
            # <end>), and the K best that do not end go on (fairseq's rule: a finished caption never holds a slot)
            cand, cidx = flat.topk(min(2 * K, K * V), dim=-1)                  # (n, 2K)
            ends = (cidx % V == model.end) & cand.isfinite()
            L = length.view(n, K).gather(1, cidx // V) + 1
            first = torch.arange(cand.shape[1], device=dev)[None] < K
            top, at = (cand / L ** length_norm).masked_fill(~(ends & first), float("-inf")).max(1)
            for j in (top > pool[images]).nonzero().flatten().tolist():
                r0 = j * K + int(cidx[j, at[j]]) // V
                a = None if aux.get("alpha") is None else aux["alpha"][r0][None] if alphas is None else torch.cat([alphas[r0], aux["alpha"][r0][None]])
                out[images[j]] = _finish(torch.cat([words[r0], words.new_tensor([model.end])]), cand[j, at[j]].item(), a, model.end)
                pool[images[j]] = top[j]
            pick = torch.sort(ends.int(), dim=1, stable=True).indices[:, :K]   # the live candidates first, best first
            score, idx = cand.gather(1, pick).masked_fill(ends.gather(1, pick), float("-inf")), cidx.gather(1, pick)
        else: score, idx = flat.topk(K, dim=-1)                                # best K of K*V per image: (n, K)
        if torch.isnan(score).any():                # NaN would rank above every word and end as a caption
            raise CapbookError(f"beam search: the model's next-word scores are NaN at step {t} for "
                               f"{int(torch.isnan(score).any(1).sum())} of {B} images; check its weights and the features")
        rows = (base + idx // V).view(-1)                                      # source row of each new beam
        tok = (idx % V).view(-1)
        state = _select(state, rows)
        words = torch.cat([words.index_select(0, rows), tok[:, None]], 1)
        if aux.get("alpha") is not None:
            a = aux["alpha"].index_select(0, rows)[:, None]
            alphas = a if alphas is None else torch.cat([alphas.index_select(0, rows), a], 1)
        done = done.index_select(0, rows)
        length = length.index_select(0, rows) + (~done).float()
        done = done | (tok == model.end)
        if length_norm:
            # finished when no live beam can still beat the pool: a live beam's log p only falls, and its length is at
            # most max_len + 1, so its final log p / L^alpha is at most score / (max_len + 1)^alpha
            live = score.masked_fill(done.view(n, K), float("-inf")).max(1).values
            fin = pool[images] >= live / (max_len + 1) ** length_norm
        else:
            fin = done.view(n, K)[:, 0]             # the image's best beam has ended (topk is sorted): none can overtake it
        if fin.any():
            if not length_norm:
                for j in fin.nonzero().flatten().tolist():
                    out[images[j]] = _finish(words[j * K], score[j, 0].item(), None if alphas is None else alphas[j * K], model.end)
            keep = (~fin).nonzero().flatten()
            if not len(keep): break
            r = (keep[:, None] * K + torch.arange(K, device=dev)).flatten()
            images, score, memory = images[keep], score[keep], _select(memory, keep)
            state, tok, words, done, length = _select(state, r), tok[r], words[r], done[r], length[r]
            if alphas is not None: alphas = alphas[r]
    if any(o is None for o in out):             # only non-finite scores keep a beam from ending by max_len
        raise CapbookError(f"beam search: {sum(o is None for o in out)} of {B} images got no caption because the model's "
                           f"scores are not finite; check its weights and the features for NaN or inf")
    return out


# %% [markdown]
# A small soft-attention decoder, untrained, on three images of 2×2 locations: beam search with one beam is greedy
# search, whether the batch is a mapping or a bare feature tensor; and the score beam search gives a caption is the
# model's log-probability of it, as teacher forcing computes it. (A wider beam usually finds a more probable caption
# than greedy search, but not always: the greedy prefix can fall out of the beam. So this example does not assert it:
# unseeded weights can draw a case where it does not hold.)

# %%
from capbook.models import build
torch.manual_seed(0)
_m = build("sat_soft", 12, 8, (2, 2), emb_dim=8, hidden_dim=16, att_dim=8).eval()
_f = torch.randn(3, 4, 8)
_g, _b = greedy(_m, _f, 6), beam_search(_m, {"feats": _f}, beam_size=1, max_len=6)
assert [c.tokens for c in _g] == [c.tokens for c in _b] and all(c.alpha.shape == (len(c.tokens), 4) for c in _g)
from capbook.decode import teacher_forced as _tfd, pad_captions as _pad      # defined further down
_b3 = beam_search(_m, _f, beam_size=3, max_len=6)
_tf = _tfd(_m, {"feats": _f, "caps": _pad([[_m.start, *c.tokens, _m.end] for c in _b3], 9)})
assert all(abs(b.logprob - t.logprob) < 1e-4 for b, t in zip(_b3, _tf))

# %% [markdown]
# With a beam wide enough to hold every caption (here 12 words, at most 2 words: fewer than 12² + 12 + 1 candidates
# at every step) beam search is exhaustive, so with length normalisation it must return the caption that maximises
# $\log p / L^{\alpha}$ over every caption, found by enumerating them; with α = 0, the most probable one.

# %%
import itertools
_all = [list(w) for L in range(3) for w in itertools.product([t for t in range(12) if t not in (_m.start, _m.end, _m.pad)], repeat=L)]
_tf_all = _tfd(_m, {"feats": _f[:1].expand(len(_all), -1, -1), "caps": _pad([[_m.start, *w, _m.end] for w in _all], 5)})
for _alpha in (0.0, 0.7, 1.0):
    _want = max(_tf_all, key=lambda c: c.logprob / (len(c.tokens) + 1) ** _alpha)
    assert beam_search(_m, _f[:1], beam_size=200, max_len=2, length_norm=_alpha)[0].tokens == _want.tokens


# %% [markdown]
# **n-gram repeat blocking** (self-critical.pytorch's `block_trigrams`, Hugging Face's `no_repeat_ngram_size`): with
# `no_repeat_ngram` n > 0, a word that would complete an n-gram the caption (the beam) already holds gets probability
# zero, in greedy and beam search alike (n = 1: no word twice). Captioning models trained on short captions repeat
# phrases ("a red circle and a red circle"); blocking them is a decoding choice, off by default, as in the papers.
#
# Checked like the length normalisation: with a beam wide enough to hold every caption (3 words, at most 4), beam
# search with blocking returns the most probable caption among those without a repeated n-gram, found by enumerating
# every caption; greedy with blocking never repeats one either.

# %%
class _Table(CaptionModel):
    "A test model whose next-word logits are a random table indexed by position and previous word; <end> unlikely before 4 words."
    def __init__(self, V: int, seed: int):
        super().__init__(V)
        self.table = torch.randn(6, V, V, generator=torch.Generator().manual_seed(seed))
        self.table[:4, :, self.end] -= 8; self.table[4, :, self.end] += 4
    def init_state(self, batch): return {}, {"t": torch.zeros(len(batch["feats"]), dtype=torch.long)}
    def step(self, tokens, memory, state):
        t = state["t"]
        return self.table[t.clamp(max=5), tokens], {"t": t + 1}, {}

_s = _Table(6, 0)
_words = [t for t in range(6) if t not in (_s.start, _s.end, _s.pad)]
_caps = [list(w) for L in range(5) for w in itertools.product(_words, repeat=L)]
_tf_s = _tfd(_s, {"feats": _f[:1].expand(len(_caps), -1, -1), "caps": _pad([[_s.start, *w, _s.end] for w in _caps], 7)})
_repeats = lambda w, n: len(w) >= n and len(set(zip(*[w[i:] for i in range(n)]))) < len(w) - n + 1
for _n in (1, 2, 3):
    _want = max((c for c in _tf_s if not _repeats(c.tokens, _n)), key=lambda c: c.logprob)
    _got = beam_search(_s, _f[:1], beam_size=400, max_len=4, no_repeat_ngram=_n)[0]
    assert _got.tokens == _want.tokens and abs(_got.logprob - _want.logprob) < 1e-4, (_n, _got, _want)
    assert not any(_repeats(c.tokens, _n) for c in greedy(_s, _f, 4, no_repeat_ngram=_n) + beam_search(_s, _f, 3, 4, no_repeat_ngram=_n))
assert _repeats(max(_tf_s, key=lambda c: c.logprob).tokens, 1)       # unblocked, the best caption repeats a word: blocking mattered


# %% [markdown]
# ## An ensemble of checkpoints
#
# `Ensemble` decodes with several trained models of one kind (seeds, or checkpoints of one run) as one model: each
# member keeps its own memory and state, and at every step the next-word log-probabilities are averaged,
#
# $$\log \tilde p(w \mid w_{<t}, I) = 
# rac1M \sum_{m=1}^{M} \log p_m(w \mid w_{<t}, I)$$
#
# which the searches renormalise (their log-softmax): a product of the members' distributions (self-critical.pytorch's
# `AttEnsemble` averages the probabilities instead; averaging log-probabilities lets a word only one member finds
# unlikely lose, which is the usual choice in machine translation). Greedy, beam search, n-gram blocking and length
# normalisation work on it unchanged, since it is a `CaptionModel`. The attention it returns is the members' mean
# (they attend over the same grid). Models of different kinds or vocabularies stop in one line.

# %%
#| export
class Ensemble(CaptionModel):
    "Several trained models of one kind decoded as one: every step's next-word log-probabilities averaged over the members."
    def __init__(self, models: list[CaptionModel]):
        if not models: raise CapbookError("an ensemble needs at least one model")
        kinds = sorted({m.name or type(m).__name__ for m in models})
        if len(kinds) > 1: raise CapbookError(f"an ensemble decodes models of one kind: got {', '.join(kinds)}")
        sizes = sorted({m.vocab_size for m in models})
        if len(sizes) > 1: raise CapbookError(f"an ensemble's models must share a vocabulary: got sizes {sizes}")
        super().__init__(sizes[0])
        self.members = torch.nn.ModuleList(models)
        self.name, self.inputs = models[0].name, tuple(dict.fromkeys(k for m in models for k in m.inputs))
        self.region_masks = all(m.region_masks for m in models)
        if hasattr(models[0], "att_grid"): self.att_grid = models[0].att_grid

    @staticmethod
    def _part(d: dict, i: int) -> dict:                       # member i's entries of a prefixed dict
        p = f"{i}."
        return {k[len(p):]: v for k, v in d.items() if k.startswith(p)}

    def init_state(self, batch):
        memory, state = {}, {}
        for i, m in enumerate(self.members):                  # one flat dict, so the searches gather every member's rows
            mem, st = m.init_state(batch)
            memory |= {f"{i}.{k}": v for k, v in mem.items()}; state |= {f"{i}.{k}": v for k, v in st.items()}
        return memory, state

    def step(self, tokens, memory, state):
        lps, new, alphas = [], {}, []
        for i, m in enumerate(self.members):
            logits, st, aux = m.step(tokens, self._part(memory, i), self._part(state, i))
            lps.append(F.log_softmax(wide(logits), -1))     # member i's log p_m(w | w_<t, I): (R, V)
            new |= {f"{i}.{k}": v for k, v in st.items()}
            if aux.get("alpha") is not None: alphas.append(aux["alpha"])
        # log p~(w) = mean_m log p_m(w): (R, V)
        lp = torch.stack(lps).mean(0)
        return lp, new, ({"alpha": torch.stack(alphas).mean(0)} if len(alphas) == len(self.members) else {})


# %% [markdown]
# One member is that model; against brute force, a wide beam over the ensemble returns the caption that maximises the
# summed renormalised mean log-probability over every caption.

# %%
_s2 = _Table(6, 1)
_one, _alone = beam_search(Ensemble([_s]), _f, 3, 4), beam_search(_s, _f, 3, 4)
assert [c.tokens for c in _one] == [c.tokens for c in _alone] and all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(_one, _alone))
_batch = {"feats": _f[:1].expand(len(_caps), -1, -1), "caps": _pad([[_s.start, *w, _s.end] for w in _caps], 7)}
_lp = F.log_softmax(torch.stack([F.log_softmax(m.teacher_forcing(_batch)["logits"], -1) for m in (_s, _s2)]).mean(0), -1)
_tgt = _batch["caps"][:, 1:]
_score = (_lp.gather(-1, _tgt[..., None])[..., 0] * (_tgt != _s.pad)).sum(1)   # every caption's ensemble log-probability
_best = _caps[int(_score.argmax())]
_ens = beam_search(Ensemble([_s, _s2]), _f[:1], beam_size=400, max_len=4)[0]
assert _ens.tokens == _best and abs(_ens.logprob - float(_score.max())) < 1e-4
try: Ensemble([_m, build("sat_none", 12, 8, (2, 2), emb_dim=8, hidden_dim=16, att_dim=8)]); raise AssertionError
except CapbookError as e: assert "one kind: got sat_none, sat_soft" in str(e)
assert [c.tokens for c in beam_search(Ensemble([_m, _m]), _f, 3, 6)] == [c.tokens for c in _b3]   # two copies: the model itself


# %% [markdown]
# ## Sampling, for reinforcement learning
#
# `sample` draws `n` captions per image from the model, batched like beam search (R = B·n rows, the rows of an image
# adjacent, `memory` at B rows). At every step the next word is drawn from the model's distribution at temperature τ,
# $w_t \sim \mathrm{softmax}(\log p(\cdot \mid w_{<t}, I) / \tau)$, after the searches' masks (no `<start>` or
# `<pad>` while a caption is live, only `<pad>` at no cost once it has ended); τ = 0 takes the most probable word,
# which is greedy search. A sample is at most `max_len` tokens, `<end>` included: one that has not ended by then is
# **cut**, with no `<end>` and no term for one. With `end_by=True` (what self-critical training uses, so that its
# samples are no longer than the captions greedy decoding and beam search write) the last step may only be `<end>`,
# as the searches end: the row ends, and the reward scores it as ended. But a forced token is an action the policy
# never took: its log-probability (often −20 or lower, not renormalised over the one allowed word) would enter the
# policy gradient as if it had. So the forced `<end>` gets log-probability 0 and mask 0, as a finished row's padding
# does: it moves the reward, never the gradient. A sample that chose `<end>` itself keeps that word's term. Without
# `end_by` a sample that has not ended is cut, self-critical.pytorch's rule (its samples stop at `seq_length` tokens). It returns, per row, the sampled words, their log-probabilities (the model's $\log p(w_t \mid w_{<t}, I)$, as
# the searches score; with `policy=True`, **the distribution's it drew them from**, $\log \pi(w_t \mid w_{<t}, I)$,
# below; neither the tempered one: at τ = 1, the usual choice for self-critical training, they are the same), a mask
# of the words up to and including `<end>` (all of a cut row's), and the attention of every step. Unlike the searches
# it runs with gradients, so $\sum_t \log \pi(w_t)$ is what a REINFORCE objective differentiates
# (`capbook.objectives.SelfCritical` asks for `policy=True`); wrap it in `torch.no_grad()` for a baseline.
#
# > **Annotator's note: the policy is the distribution the sampler draws from.** The model's softmax runs over the
# > whole vocabulary, `<start>` and `<pad>` included, which no caption may contain; the sampler draws from that softmax
# > renormalised over the words it allows, $\pi(w) = p(w) / \sum_{v\ \mathrm{allowed}} p(v)$. With `policy=True` the
# > log-probabilities it returns are $\log \pi$, a log-softmax over the masked logits; by default they are $\log p$, the
# > model's log-softmax with the masked words set to −∞ afterwards, as the searches score. The draws are the same either
# > way (a constant per row shifts every log-probability alike); the gradient is not. With $\log p$, every sampled word's log-probability also falls as `<start>` and `<pad>` gain
# > mass, a direction no draw can ever pay for. Under a baseline that the samples mostly fall short of (the greedy
# > caption's reward: a negative advantage on average), REINFORCE rewards that direction at every step, and
# > Adam, which turns a small gradient of constant sign into a step of the full rate, follows it until the two words
# > hold most of the mass; a model trained so stops ending its captions.
# > A mean baseline hides the drift (its advantages sum to zero over an image's samples, so the push on the two words
# > cancels); it does not remove the term. Under $\log \pi$ a word the sampler cannot draw gets no gradient at all,
# > whatever the baseline:

# %%
#| export
@dataclass
class Samples:
    "Sampled captions: words (R, T) incl. <end> then <pad> (a row cut at max_len has no <end>; one forced to end has it), log-probabilities (R, T) with gradients, mask (R, T) of the words the policy chose (not a forced <end>), attention (R, T, L) or None."
    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor
    alpha: torch.Tensor | None = None
    n: int = 1                      # samples per image: row r belongs to image r // n

    def captions(self, end: int = CaptionModel.end) -> list[Caption]:
        "As `Caption` objects (words before `<end>`, summed log-probability, attention of the emitted words)."
        lp = (self.logprobs * self.mask).sum(1).tolist()
        return [_finish(self.tokens[r], lp[r], None if self.alpha is None else self.alpha[r], end) for r in range(len(lp))]

def sample(model: CaptionModel, batch: Mapping[str, Any] | torch.Tensor, n: int = 1, temperature: float = 1.0,
           max_len: int = 20, end_by: bool = False, policy: bool = False) -> Samples:
    "Draw `n` captions per image at `temperature` (0: greedy), each at most `max_len` tokens with <end> (cut there; with `end_by`, the last of them may only be <end>, as greedy and beam search end: at most `max_len` - 1 words, and that forced <end> carries no log-probability and is masked out), with the log-probabilities of the drawn words: the model's, as the searches score, or with `policy` the distribution's they were drawn from (what a policy gradient needs: `policy_logprobs`)."
    batch = as_batch(batch); check_inputs(model, batch)
    if temperature < 0: raise ValueError(f"temperature={temperature!r} is invalid: expected a number >= 0")
    B, dev = _n_images(model, batch), _device(model, batch)
    memory, state = model.init_state(batch)                                    # memory: (B, ...)
    state = _repeat(state, n)                                                  # (B*n, ...)
    tok = torch.full((B * n,), model.start, dtype=torch.long, device=dev)
    done = torch.zeros(B * n, dtype=torch.bool, device=dev)
    words, logps, masks, alphas = [], [], [], []
    for t in range(max_len):                                                   # at most max_len tokens: then cut
        logits, state, aux = model.step(tok, memory, state)
        z, last = wide(logits), end_by and t == max_len - 1
        # log pi(w | w_<t, I): the log-softmax over the words the sampler may draw (no <start> or <pad>; only <end> at a forced
        # last step; only <pad> once ended), the logits masked on a copy: (R, V)
        if policy: lp = F.log_softmax(_mask(z.clone(), done, model, last), -1)
        # log p(w | w_<t, I), the model's, under the same masks (on a copy: log_softmax's output is kept for backward): (R, V)
        else: lp = _mask(F.log_softmax(z, -1).clone(), done, model, last)
        if temperature == 0: tok = lp.detach().argmax(-1)
        # w_t ~ softmax(log p / tau): (R,)
        else: tok = torch.multinomial(F.softmax(lp.detach() / temperature, -1), 1).squeeze(1)
        # the word counts until <end> is out; a forced <end> (the last step under end_by) was no choice: no word, no gradient
        chose = ~done if not (end_by and t == max_len - 1) else torch.zeros_like(done)
        masks.append(chose.float())
        # log p(w_t | w_<t, I): (R,), 0 where the row chose nothing (finished, or its <end> forced)
        logps.append(lp.gather(1, tok[:, None]).squeeze(1).masked_fill(~chose, 0.0))
        words.append(tok); alphas.append(aux.get("alpha"))
        done = done | (tok == model.end)
        if done.all(): break
    A = torch.stack(alphas, 1) if alphas[0] is not None else None
    return Samples(torch.stack(words, 1), torch.stack(logps, 1), torch.stack(masks, 1), A, n)


# %% [markdown]
# At temperature 0 sampling is greedy search, `n` rows per image; at temperature 1 the draws differ and carry gradients.

# %%
_s = sample(_m, _f, n=2, temperature=0.0, max_len=6)
assert [c.tokens for c in _s.captions()[::2]] == [c.tokens for c in _g] and _s.tokens.shape[0] == 6
_s = sample(_m, _f, n=4, temperature=1.0, max_len=6)
assert _s.logprobs.requires_grad and (_s.logprobs <= 0).all() and _s.mask[:, 0].eq(1).all()

# %% [markdown]
# A model that never wants to end: every sample is cut at `max_len` tokens, none carries an `<end>`, and each
# log-probability is the model's own for a word it drew. Under `end_by` the same samples end with a forced `<end>`
# that carries neither a log-probability nor a place in the mask, so the gradient of Σ log p is that of the chosen
# words alone.

# %%
_never = build("sat_soft", 12, 8, (2, 2), emb_dim=8, hidden_dim=16, att_dim=8).eval()
with torch.no_grad(): _never.L_o.bias[_m.end] = -30.0                    # <end> all but impossible
_s = sample(_never, _f, n=3, temperature=1.0, max_len=5)
assert _s.tokens.shape[1] == 5 and not (_s.tokens == _m.end).any() and _s.mask.eq(1).all()
assert (_s.logprobs > -15).all(), _s.logprobs.min()
torch.manual_seed(0); _e = sample(_never, _f, n=3, temperature=1.0, max_len=5, end_by=True)
assert (_e.tokens[:, -1] == _m.end).all() and _e.mask[:, -1].eq(0).all() and _e.logprobs[:, -1].eq(0).all()
assert _e.mask[:, :-1].eq(1).all() and (_e.logprobs[:, :-1] > -15).all()        # the four chosen words keep their terms

# %% [markdown]
# The policy's log-probabilities: normalised over the words the sampler allows, so a loss on them, whatever the sign
# of its weights, never moves the logits of `<start>` and `<pad>`. Here the model's output layer is made to favour
# `<start>`, and a REINFORCE loss with a negative advantage (what a greedy baseline mostly gives) is differentiated:

# %%
_pm = build("sat_soft", 12, 8, (2, 2), emb_dim=8, hidden_dim=16, att_dim=8).eval()
with torch.no_grad(): _pm.L_o.bias[_pm.start] = 5.0                    # p(<start>) large: the sampler still never draws it
torch.manual_seed(0); _s = sample(_pm, _f, n=3, temperature=1.0, max_len=5, end_by=True, policy=True)
assert not (_s.tokens == _pm.start).any() and not (_s.tokens[:, 0] == _pm.pad).any()
_A = -1.0                                                              # a negative advantage
(-_A * (_s.logprobs * _s.mask).sum()).backward()                        # -A sum_t log pi(w_t)
_gb = _pm.L_o.bias.grad
assert _gb[_pm.start] == 0 and _gb[_pm.pad] == 0 and _gb.abs().sum() > 0, _gb
with torch.no_grad():                                                  # the first word's log pi, by hand: p renormalised
    _mem, _st = _pm.init_state(as_batch(_f))
    _p = F.softmax(_pm.step(torch.full((len(_s.tokens),), _pm.start), _mem, _repeat(_st, 3))[0], -1)    # (R, V)
    _pi = _p.gather(1, _s.tokens[:, :1]).squeeze(1) / (1 - _p[:, _pm.start] - _p[:, _pm.pad])
    assert torch.allclose(_s.logprobs[:, 0], _pi.log(), atol=1e-5), (_s.logprobs[:, 0], _pi.log())
    assert (_p[:, _pm.start] > 0.5).all()
# the same first words under log p, the model's softmax over the whole vocabulary: the loss would raise <start>'s logit
_pm.zero_grad()
_lp = F.log_softmax(_pm.step(torch.full((len(_s.tokens),), _pm.start), _mem, _repeat(_st, 3))[0], -1)
(-_A * _lp.gather(1, _s.tokens[:, :1]).sum()).backward()
assert _pm.L_o.bias.grad[_pm.start] < 0                                # gradient descent pushes <start> up

# %% [markdown]
# Read back over a whole caption, the policy's log-probabilities are the model's logits with `<start>` and `<pad>`
# masked, then a log-softmax: `policy_logprobs`, for any tensor of logits. The searches (greedy, beam) rank captions by
# the model's own $\log p$, the probability it gives a caption, which is also what `sample` returns by default (the
# same draws): the two sums differ by $\sum_t \log(1 - p_t(\texttt{<start>}) - p_t(\texttt{<pad>}))$.

# %%
#| export
def policy_logprobs(logits: torch.Tensor, model: CaptionModel) -> torch.Tensor:
    "log pi(w): the log-softmax of `logits` (..., V) over the words a live caption may hold (no <start>, no <pad>): what `sample` draws from and returns."
    z = wide(logits).clone()
    z[..., model.start] = z[..., model.pad] = float("-inf")
    return F.log_softmax(z, -1)

# %%
_caps = torch.cat([torch.full((len(_s.tokens), 1), _pm.start), _s.tokens], 1)          # the samples, read back: (R, T+1)
with torch.no_grad():
    _tf = policy_logprobs(_pm({"feats": _f.repeat_interleave(3, 0), "caps": _caps})["logits"], _pm).gather(2, _caps[:, 1:, None])[..., 0]
assert torch.allclose(_tf.where(_s.mask.bool(), 0.0), _s.logprobs.detach() * _s.mask, atol=1e-5)   # the chosen words (after <end>: <pad>, -inf)
torch.manual_seed(0); _sp = sample(_pm, _f, n=3, temperature=1.0, max_len=5, end_by=True)         # the model's log p, the same draws
assert torch.equal(_sp.tokens, _s.tokens) and ((_sp.logprobs - _s.logprobs.detach()) * _s.mask < -0.69).sum() == _s.mask.sum()   # each word: p(<start>) > 1/2


# %% [markdown]
# ## Teacher forcing: a given caption's attention
# To compare where two models look *for the same words*, both read the same caption: `teacher_forced` feeds the words
# of `caps` and returns, as `Caption`s, their attention at every word and the caption's log-probability.

# %%
#| export
def pad_captions(seqs: list[list[int]], length: int, pad: int = 0) -> torch.Tensor:
    "Token-id lists (each already <start> ... <end>) as one (N, length) tensor, padded with `pad`."
    out = torch.full((len(seqs), length), pad, dtype=torch.long)
    for i, s in enumerate(seqs): out[i, :len(s)] = torch.tensor(s[:length], dtype=torch.long)
    return out


# %%
#| export
@torch.no_grad()
def teacher_forced(model: CaptionModel, batch: Mapping[str, Any]) -> list[Caption]:
    "Per-word attention and log-probability of the batch's captions `caps` (B, T: <start> words <end> <pad>...)."
    model.eval()
    batch = dict(batch); check_inputs(model, batch); caps = batch["caps"]
    out = model(batch)
    lp = F.log_softmax(wide(out["logits"]), -1).gather(2, caps[:, 1:, None])[..., 0]   # log p(y_t | ...): (B, T-1)
    res = []
    for b, row in enumerate(caps[:, 1:].tolist()):
        n = row.index(model.end) if model.end in row else len(row)                      # words before <end>
        res.append(Caption(row[:n], lp[b, :n + 1].sum().item(), out["alpha"][b, :n].float().cpu() if "alpha" in out else None))
    return res


# %% [markdown]
# Teacher-forcing greedy search's own captions gives back their log-probabilities and attention.

# %%
_caps = pad_captions([[_m.start, *c.tokens, _m.end] for c in _g], 8)
assert _caps.shape == (3, 8) and _caps[0, 0] == _m.start
for _tf, _gc in zip(teacher_forced(_m, {"feats": _f, "caps": _caps}), _g):
    assert _tf.tokens == _gc.tokens and abs(_tf.logprob - _gc.logprob) < 1e-4 and torch.allclose(_tf.alpha, _gc.alpha, atol=1e-5)


# %% [markdown]
# ## Decoding a whole split
# `decode_split` runs either search over a split's images in batches and returns the captions in image order.

# %%
#| export
def decode_split(model: CaptionModel, data, beam_size: int = 3, max_len: int = 20, batch_size: int = 100,
                 device: torch.device | str = "cpu", length_norm: float = 0.0, no_repeat_ngram: int = 0) -> list[Caption]:
    "Decode every image of a `CaptionData` split with greedy (beam_size=1) or beam search (length-normalised by `length_norm`; n-gram blocking `no_repeat_ngram`), in image order."
    model.eval(); out = []
    for b in data.image_batches(batch_size):
        b = to_device(b, device)
        out += (greedy(model, b, max_len, no_repeat_ngram) if beam_size == 1
                else beam_search(model, b, beam_size, max_len, length_norm, no_repeat_ngram))
    return out


# %% [markdown]
# A split of five images decoded in batches of two comes back in image order, equal to decoding all at once.

# %%
import numpy as np
from capbook.data import CaptionData, Vocab
_cd = CaptionData(np.random.default_rng(0).standard_normal((5, 4, 8)).astype(np.float16), [f"{i}.png" for i in range(5)],
                  [[["a", "circle"]]] * 5, Vocab.build([["a", "circle"]]), max_len=5)
_all = greedy(_m, torch.from_numpy(_cd.feats.astype(np.float32)), 20)
assert [c.tokens for c in decode_split(_m, _cd, beam_size=1, batch_size=2)] == [c.tokens for c in _all]


# %% [markdown]
# ## Decoding speed
# `ms_per_image` times beam search the way SPCA's Table 1 does ("beam size 3, batch size 20"): all given images in
# batches, repeated, as milliseconds per image (mean and standard deviation over the repeats), after one warm-up batch.

# %%
#| export
def slice_batch(batch: Mapping[str, Any], i: int, j: int) -> dict:
    "Rows i..j-1 of every entry of a batch."
    return {k: v[i:j] for k, v in batch.items()}

def ms_per_image(model: CaptionModel, batch: Mapping[str, Any] | torch.Tensor, beam_size: int = 3, batch_size: int = 20,
                 max_len: int = 20, repeats: int = 3) -> tuple[float, float]:
    "Beam-search time per image in milliseconds over a batch of N images: (mean, std over `repeats`)."
    import time
    batch = as_batch(batch); N = _n_images(model, batch)
    model.eval(); sync = torch.cuda.synchronize if _device(model, batch).type == "cuda" else (lambda: None)
    beam_search(model, slice_batch(batch, 0, batch_size), beam_size, max_len); sync()    # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, N, batch_size): beam_search(model, slice_batch(batch, i, i + batch_size), beam_size, max_len)
        sync(); times.append(1000 * (time.perf_counter() - t0) / N)
    t = torch.tensor(times)
    return float(t.mean()), float(t.std()) if repeats > 1 else 0.0


# %%
_ms, _sd = ms_per_image(_m, _f, beam_size=2, batch_size=2, max_len=4, repeats=2)
print(f"{_ms:.2f} ± {_sd:.2f} ms/image"); assert _ms > 0 and _sd >= 0
