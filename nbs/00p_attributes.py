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
# # attributes
#
# > Textual attributes detected from the image by multiple-instance learning (Fang et al. 2015), the second information source of GLIED: a per-region word detector, noisy-OR over the regions, trained on the words of the training captions.

# %%
#| default_exp attributes

# %%
#| export
from __future__ import annotations
import hashlib, time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable
import numpy as np
import torch
from torch import nn
import torch.nn.functional as F
from capbook.core import atomic_write, check_float, check_int, data_dir, load_json, one_at_a_time, save_json, seed_everything, stable_hash

# %% [markdown]
# GLIED (§3.1): "For textual attributes, we adopt Multiple Instance Learning [Zhang et al., 2006], a weakly-supervised
# method, to build an attribute extractor, following Fang et al. [2015]" and (§4.2) "we use the attribute prediction
# model pre-trained by Fang et al. [2015] for 1,000 attribute words on COCO. For an image, the number of attribute
# words is reduced to the number of image regions." The book downloads neither Fang et al.'s detector nor COCO, so
# capbook trains one the same way on whatever data the chapter runs on.
#
# ## The attribute vocabulary
#
# Fang et al. detect the 1,000 most frequent words of the training captions. *capbook:* the attributes are frequent
# **content** words, so function words (articles, prepositions that are not relations, auxiliaries, pronouns) and
# the captions' meta-words ("image", "picture", "photo") are left out; the rest are ranked by the number of training
# images whose captions use them, and the first `n_words` kept (1,000 as on COCO; on shapes that is every content
# word). Attributes are words of the captioning vocabulary, so GLIED embeds them with the word embedding (§4.2).

# %%
#| export
STOPWORDS = frozenset("""
a an the this that these those some any each every there here it its they them their he she his her we you i
of to in on into onto at by for from with without and or but nor so as than then while is are was were be been being
am do does did has have had having can could will would shall should may might must not no
up down out off about also just very too
image picture photo photograph view including
""".split())

def content_words(refs: list[list[list[str]]], stoi: dict, n_words: int = 1000) -> list[str]:
    "The attribute vocabulary: the `n_words` vocabulary words (not stop words) used by the most training images."
    df = Counter(w for caps in refs for w in {w for c in caps for w in c})
    words = [w for w in df if w in stoi and w not in STOPWORDS and not w.startswith("<")]
    return sorted(words, key=lambda w: (-df[w], w))[:n_words]

def attribute_labels(refs: list[list[list[str]]], words: list[str]) -> np.ndarray:
    "Weak labels (N images, W words): 1 where any caption of the image uses the word (Fang et al.)."
    col = {w: j for j, w in enumerate(words)}
    y = np.zeros((len(refs), len(words)), np.float32)
    for i, caps in enumerate(refs):
        for w in {w for c in caps for w in c}:
            if w in col: y[i, col[w]] = 1.0
    return y


# %%
_refs = [[["a", "red", "circle", "above", "a", "square"]], [["two", "red", "stars"], ["an", "image", "of", "stars"]]]
_words = content_words(_refs, {w: i for i, w in enumerate(["a", "red", "circle", "above", "square", "two", "stars", "image"])})
assert _words == ["red", "above", "circle", "square", "stars", "two"]        # red: in both images; "a", "image": stop words
assert attribute_labels(_refs, _words).tolist() == [[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 1, 1]]


# %% [markdown]
# ## Noisy-OR over the regions
#
# Fang et al. (§3.1): each region $j$ of image $i$ gives the probability $p^w_{ij}$ that word $w$ is in the image,
# and the image holds the word unless no region does:
# $$ p^w_i = 1 - \prod_{j} \big(1 - p^w_{ij}\big), \qquad p^w_{ij} = \sigma(f_w(\phi(b_{ij}))). $$
# Their public Caffe layer also takes the maximum with $\max_j p^w_{ij}$; since $1 - \prod_j (1 - p_j) \ge \max_j p_j$
# always, that maximum changes nothing but rounding, and capbook leaves it out.
#
# *capbook:* computed in log space, so that 196 regions of small probabilities neither underflow nor round to 1:
# $\log(1 - p^w_i) = \sum_j \log(1 - \sigma(z_{ij})) = -\sum_j \mathrm{softplus}(z_{ij})$ and
# $\log p^w_i = \log(1 - e^{\log(1 - p^w_i)})$ by the stable `log1mexp`. The loss is the binary cross-entropy of
# $p^w_i$ against the weak labels, averaged over words and images.

# %%
#| export
def log1mexp(x: torch.Tensor) -> torch.Tensor:
    "log(1 - exp(x)) for x <= 0, accurate near 0 and far below (Mächler 2012)."
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)                       # log 0 = -inf only at x = 0 exactly
    near, ln2 = x > -0.6931471805599453, -0.6931471805599453
    # each branch sees safe inputs only, so the branch torch.where discards has a finite gradient too
    return torch.where(near, torch.log(-torch.expm1(torch.where(near, x, ln2))), torch.log1p(-torch.exp(torch.where(near, ln2, x))))

def noisy_or(z: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    "Region logits z (B, L, W) -> (log p_i, log(1 - p_i)), each (B, W), with p_i = 1 - prod_j (1 - sigmoid(z_ij)) over the real regions (`mask` (B, L))."
    sp = F.softplus(z) if mask is None else F.softplus(z) * mask[..., None]
    # log(1 - p_i) = sum_j log(1 - sigma(z_ij)) = -sum_j softplus(z_ij): (B, W)
    log_not = -sp.sum(1)
    # log p_i = log(1 - exp(log(1 - p_i))): (B, W)
    return log1mexp(log_not), log_not

def mil_loss(z: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    "Binary cross-entropy of the noisy-OR image probabilities against weak labels y (B, W), mean over words and images."
    log_p, log_not = noisy_or(z, mask)
    # -[y log p_i + (1 - y) log(1 - p_i)]
    return -(y * log_p + (1 - y) * log_not).mean()


# %% [markdown]
# A tiny case: two regions, one word. The noisy-OR equals $1 - (1 - p_1)(1 - p_2)$, and its gradient has a closed
# form the test checks autograd against — for a positive word $\partial(-\log p)/\partial z_j = -p_j (1 - p)/p$, for a
# negative one $\partial(-\log(1 - p))/\partial z_j = p_j$.

# %%
_z = torch.tensor([[[0.3], [-1.2]]], requires_grad=True)
_pj = torch.sigmoid(_z.detach())[0, :, 0]
_lp, _ln = noisy_or(_z)
assert torch.allclose(_lp.exp(), 1 - (1 - _pj).prod()) and torch.allclose(_ln.exp(), (1 - _pj).prod())
mil_loss(_z, torch.ones(1, 1)).backward()
_p = 1 - (1 - _pj).prod()
assert torch.allclose(_z.grad[0, :, 0], -_pj * (1 - _p) / _p)
assert torch.isfinite(noisy_or(torch.full((1, 196, 1), -30.0))[0]).all()          # no underflow to log 0


# %% [markdown]
# ## The detector
#
# Fang et al. run a VGG-16 fully convolutionally, so its fc6/fc7 layers see every region, and learn one logistic
# classifier per word on top. *capbook:* on frozen region features (the same grid the captioners attend over), a
# two-layer network applied to every region — linear to `hidden`, ReLU, dropout, linear to the words — is the same
# shape of computation with the backbone frozen, as every other model of the book has it.

# %%
#| export
@dataclass
class AttributeConfig:
    "The MIL attribute detector and what GLIED keeps of its output."
    n_words: int = 1000         # attribute vocabulary: the most frequent content words (Fang et al.'s 1,000)
    hidden: int = 512           # the per-region network's hidden width
    dropout: float = 0.3
    epochs: int = 30
    lr: float = 1e-3            # Adam
    batch_size: int = 64        # images per step
    keep: int = 0               # attributes kept per image; 0: as many as there are image regions (GLIED §4.2)
    threshold: float = 0.5      # and of those only the ones detected with p >= threshold (always the first); 0: all
    seed: int = 0

    def check(self) -> AttributeConfig:
        "Stop with one line on an invalid value."
        for n in ("n_words", "hidden", "epochs", "batch_size"): check_int(n, getattr(self, n), lo=1)
        check_int("keep", self.keep, lo=0); check_int("seed", self.seed, lo=0)
        check_float("dropout", self.dropout, lo=0, hi=0.95); check_float("lr", self.lr, lo=1e-7, hi=1.0)
        check_float("threshold", self.threshold, lo=0, hi=1)
        return self

class MILDetector(nn.Module):
    "Per-region word logits z (B, L, W) from region features (B, L, D); `probs` gives the noisy-OR image probabilities."
    def __init__(self, feat_dim: int, n_words: int, hidden: int = 512, dropout: float = 0.3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(feat_dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, n_words))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # z_ij = f(phi(b_ij)): (B, L, W)
        return self.net(feats)

    @torch.no_grad()
    def probs(self, feats: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        "p_i = 1 - prod_j (1 - p_ij) over the (real) regions: (B, W)."
        return noisy_or(self(feats), mask)[0].exp()


# %% [markdown]
# ## Training and what it is worth
#
# The detector is trained on the training images' features with their caption words as weak labels, Adam, a fixed
# number of epochs; the validation split picks the epoch (mean average precision). Reported on held-out images, as
# Fang et al. report it: the **average precision** of each word over the images (ranking the images by $p^w_i$),
# averaged over words, and the **precision and recall of the attributes GLIED keeps** per image.

# %%
#| export
def average_precision(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    "Per-column average precision of `scores` (N, W) against binary `labels` (N, W); NaN for a word no image has."
    order = np.argsort(-scores, 0, kind="stable")
    y = np.take_along_axis(labels, order, 0)
    hits = np.cumsum(y, 0)
    # AP = sum_k P@k [y_k = 1] / #positives
    prec = hits / np.arange(1, len(y) + 1)[:, None]
    pos = y.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"): return (prec * y).sum(0) / pos

def _batches(n: int, size: int, rng: np.random.Generator | None = None):
    idx = rng.permutation(n) if rng is not None else np.arange(n)
    for s in range(0, n, size): yield np.sort(idx[s:s + size])

def _rows(a: np.ndarray | None, i: np.ndarray, device, dtype=None) -> torch.Tensor | None:
    "Rows `i` of `a` as a tensor in `dtype` (default: torch's default dtype, float64 inside a key's probe)."
    return None if a is None else torch.as_tensor(np.asarray(a[i]), dtype=dtype or torch.get_default_dtype(), device=device)

def detect(det: MILDetector, feats: np.ndarray, mask: np.ndarray | None = None, batch_size: int = 128, device="cpu") -> np.ndarray:
    "Image probabilities p_i (N, W) of every image of a feature store (`mask` (N, L): its real regions)."
    det.eval()
    return np.concatenate([det.probs(_rows(feats, i, device), _rows(mask, i, device)).cpu().numpy()
                           for i in _batches(len(feats), batch_size)] or [np.zeros((0, det.net[-1].out_features), np.float32)])

def train_detector(feats: np.ndarray, labels: np.ndarray, val_feats: np.ndarray, val_labels: np.ndarray,
                   cfg: AttributeConfig, device="cpu", log: Callable[[str], None] = print,
                   mask: np.ndarray | None = None, val_mask: np.ndarray | None = None) -> tuple[MILDetector, list[dict]]:
    "Train a `MILDetector` on (N, L, D) features (real regions `mask` (N, L)) and (N, W) weak labels; keep the epoch of best validation mAP."
    seed_everything(cfg.seed)
    det = MILDetector(feats.shape[-1], labels.shape[1], cfg.hidden, cfg.dropout).to(device)
    opt = torch.optim.Adam(det.parameters(), lr=cfg.lr)
    rng, best, history = np.random.default_rng(cfg.seed), (-1.0, None), []
    for epoch in range(cfg.epochs):
        det.train(); tot, n, t0 = 0.0, 0, time.time()
        for i in _batches(len(feats), cfg.batch_size, rng):
            loss = mil_loss(det(_rows(feats, i, device)), torch.as_tensor(labels[i], device=device), _rows(mask, i, device))
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
            tot, n = tot + loss.item() * len(i), n + len(i)
        m_ap = float(np.nanmean(average_precision(detect(det, val_feats, val_mask, device=device), val_labels)))
        history.append({"epoch": epoch, "loss": tot / n, "val mAP": m_ap, "s": time.time() - t0})
        if m_ap > best[0]: best = (m_ap, {k: v.detach().clone() for k, v in det.state_dict().items()})
    log(f"attribute detector: {cfg.epochs} epochs, best validation mAP {best[0]:.3f} "
        f"(epoch {max(history, key=lambda h: h['val mAP'])['epoch']})")
    det.load_state_dict(best[1])
    return det.eval(), history

def keep_attributes(probs: np.ndarray, word_ids: np.ndarray, keep: int, threshold: float) -> np.ndarray:
    "Per image the `keep` most probable attributes as vocabulary ids (N, keep), those under `threshold` (but the first) as 0 (padding)."
    keep = min(keep, probs.shape[1])
    top = np.argsort(-probs, 1, kind="stable")[:, :keep]
    ids = word_ids[top]
    low = np.take_along_axis(probs, top, 1) < threshold
    low[:, 0] = False                                                   # every image keeps at least one attribute
    return np.where(low, 0, ids)

def kept_scores(kept: np.ndarray, word_ids: np.ndarray, labels: np.ndarray) -> dict:
    "Micro precision and recall of the kept attributes (vocabulary ids, 0 = none) against the weak labels."
    col = {int(w): j for j, w in enumerate(word_ids)}
    tp = sum(labels[i, col[int(w)]] for i, row in enumerate(kept) for w in row if w)
    n_kept, n_pos = int((kept > 0).sum()), float(labels.sum())
    return {"precision": float(tp / max(n_kept, 1)), "recall": float(tp / max(n_pos, 1)),
            "kept_per_image": n_kept / max(len(kept), 1)}


# %%
_ap = average_precision(np.array([[0.9, 0.1], [0.8, 0.7], [0.1, 0.2]]), np.array([[1, 0], [0, 1], [1, 0]]))
assert np.allclose(_ap, [(1 + 2 / 3) / 2, 1.0])                       # word 0: hits at ranks 1 and 3
_k = keep_attributes(np.array([[0.9, 0.2, 0.6], [0.1, 0.3, 0.2]]), np.array([10, 11, 12]), keep=2, threshold=0.5)
assert _k.tolist() == [[10, 12], [11, 0]]                             # the second image keeps only its first
assert kept_scores(_k, np.array([10, 11, 12]), np.array([[1, 0, 0], [0, 1, 1]]))["precision"] == 2 / 3


# %% [markdown]
# ## Attributes for a prepared data set, cached
#
# `attributes_for(prep, cfg)` trains the detector on the training split, detects the attributes of every split and
# keeps them per image (the GLIED model's `attrs` input). The result is cached beside the features under a hash of
# what it was computed from: the data fingerprint (dataset content, encoder, vocabulary), the detector's settings and
# this module's source — a changed input trains again, never reuses. The held-out scores (validation and test mAP,
# precision and recall of the kept attributes) travel with it, for the chapter's record.

# %%
#| export
@dataclass
class Attributes:
    "Detected attributes of a prepared data set: per split the kept vocabulary ids (N, K; 0 = none), and the scores."
    words: list[str]
    ids: dict[str, np.ndarray]
    scores: dict
    key: str
    history: list

def _module_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

@one_at_a_time("attributes")         # side-by-side GLIED runs train the detector once
def attributes_for(prep, cfg: AttributeConfig | None = None, device="cpu", log: Callable[[str], None] = print) -> Attributes:
    "Train (or load the cached) MIL detector for `prep` and return the kept attributes of every split."
    cfg = (cfg or AttributeConfig()).check()
    key = stable_hash({"data": prep.fingerprint, "cfg": asdict(cfg), "code": _module_digest()}, 16)
    folder = data_dir() / "attributes" / prep.dataset / prep.encoder
    path, meta = folder / f"attributes-{key}.npz", folder / f"attributes-{key}.json"
    if path.exists() and meta.exists():
        info = load_json(meta, "attribute cache meta")
        with np.load(path) as z: ids = {s: z[s] for s in ("train", "val", "test")}
        log(f"attributes: cached {path.name} ({len(info['words'])} words, {info['scores']['test']['kept_per_image']:.1f} "
            f"kept per image, test precision {info['scores']['test']['precision']:.3f} recall {info['scores']['test']['recall']:.3f})")
        return Attributes(info["words"], ids, info["scores"], key, info["history"])
    t0 = time.time()
    words = content_words(prep.train.refs, prep.vocab.stoi, cfg.n_words)
    word_ids = np.array([prep.vocab.stoi[w] for w in words])
    labels = {s: attribute_labels(prep.split(s).refs, words) for s in ("train", "val", "test")}
    mask = {s: prep.split(s).inputs.get("feat_mask") for s in ("train", "val", "test")}     # bottom-up regions
    det, history = train_detector(prep.train.feats, labels["train"], prep.val.feats, labels["val"], cfg, device, log,
                                  mask["train"], mask["val"])
    keep = cfg.keep or prep.feat_shape[0]            # as many as there are image regions (§4.2; the most, for bottom-up)
    ids, scores = {}, {}
    for s in ("train", "val", "test"):
        p = detect(det, prep.split(s).feats, mask[s], device=device)
        ids[s] = keep_attributes(p, word_ids, keep, cfg.threshold)
        scores[s] = {"mAP": float(np.nanmean(average_precision(p, labels[s]))), **kept_scores(ids[s], word_ids, labels[s])}
    scores["train_s"] = time.time() - t0
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda t: np.savez(open(t, "wb"), **ids))
    save_json(meta, {"words": words, "scores": scores, "history": history, "config": asdict(cfg), "data": prep.fingerprint})
    log(f"attributes: {len(words)} words, {ids['test'].shape[1]} kept at most per image ({scores['test']['kept_per_image']:.1f} "
        f"on average); test mAP {scores['test']['mAP']:.3f}, precision {scores['test']['precision']:.3f}, "
        f"recall {scores['test']['recall']:.3f}; {scores['train_s']:.0f} s")
    return Attributes(words, ids, scores, key, history)
