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
# # Image-to-text transduction with spatial self-attention
#
# > Springenberg, Lakomkin, Weber and Wermter, *Image-to-Text Transduction with Spatial Self-Attention*, ESANN 2018:
# > the Transformer of Vaswani et al. with self-attention over the 14×14 image regions and inter-attention from the
# > words to them, and a larger attention temperature.
#
# *capbook (work in progress, issue 11):* this notebook holds the model so far; the chapter's runs, Table 1, the
# τ ablation, the training-time table and Figure 2 come next.

# %%
#| default_exp ssa

# %%
#| export
from __future__ import annotations
import math
from dataclasses import dataclass
import torch
from torch import nn
from capbook.core import CapbookError, check_choice, check_float, check_int
from capbook.attention import TAUS, MultiHeadAttention
from capbook.models import CaptionModel, register

# %% [markdown]
# ## Positions
#
# > "Computed image features of these regions are subsequently equipped with a positional encoding ... As positional
# > encoding, the same sinusoidal function as presented in [5] is used."
#
# $PE_{(pos, 2i)} = \sin(pos / 10000^{2i/d})$, $PE_{(pos, 2i+1)} = \cos(pos / 10000^{2i/d})$. *capbook:* the regions
# are numbered row-major, 0 … 195, as the feature store orders them; the paper says no more (a 2D encoding of row
# and column would be the alternative).

# %%
#| export
def sinusoid(n: int, d: int) -> torch.Tensor:
    "The sinusoidal positional encoding of Vaswani et al.: (n, d)."
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    # 10000^{2i/d}: (d/2,)
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
    pe = torch.zeros(n, d)
    pe[:, 0::2] = torch.sin(pos * freq)                     # PE(pos, 2i)
    pe[:, 1::2] = torch.cos(pos * freq[: d // 2])           # PE(pos, 2i+1)
    return pe

# %%
_pe = sinusoid(196, 8)
assert _pe.shape == (196, 8) and torch.allclose(_pe[0], torch.tensor([0., 1, 0, 1, 0, 1, 0, 1]))
assert torch.isclose(_pe[3, 2], torch.sin(torch.tensor(3 / 10000 ** (2 / 8))))

# %% [markdown]
# ## Layers
#
# > "Finally, a residual connection is applied, followed by layer normalisation: $AttnOut = LayerNorm(Attn +
# > V_{input})$." ... "$FeedForward(x) = Relu(x W_1 + b_1) W_2 + b_2$ (4) ... $FFOut = LayerNorm(FeedForward(x) + x)$."
#
# *capbook:* the residual of an attention adds its **query** input. The paper writes $V_{input}$, which is the query
# input in self-attention ($Q_{input} = K_{input} = V_{input}$) but cannot be added in inter-attention, where
# $V_{input}$ is the image (196 regions) and the output has one row per word; adding the query, as Vaswani et al. do,
# is the only reading that works for both.

# %%
#| export
class FeedForward(nn.Module):
    "Eq. 4: Relu(x W_1 + b_1) W_2 + b_2, d_model -> d_hidden -> d_model."
    def __init__(self, d_model: int, d_hidden: int, dropout: float = 0.1):
        super().__init__()
        self.W1, self.W2, self.drop = nn.Linear(d_model, d_hidden), nn.Linear(d_hidden, d_model), nn.Dropout(dropout)

    def forward(self, x):
        return self.W2(self.drop(torch.relu(self.W1(x))))

class EncoderLayer(nn.Module):
    "Source encoding (§2.1): multi-head self-attention over the regions, then the feed-forward, each with residual and layer norm."
    def __init__(self, d, heads, d_hidden, tau, dropout):
        super().__init__()
        self.att, self.ff = MultiHeadAttention(d, heads, tau=tau, dropout=dropout), FeedForward(d, d_hidden, dropout)
        self.n1, self.n2, self.drop = nn.LayerNorm(d), nn.LayerNorm(d), nn.Dropout(dropout)

    def forward(self, x):
        # AttnOut = LayerNorm(Attn(x, x, x) + x): (B, L, d)
        x = self.n1(x + self.drop(self.att(x, x)[0]))
        # FFOut = LayerNorm(FeedForward(x) + x): (B, L, d)
        return self.n2(x + self.drop(self.ff(x)))

class DecoderLayer(nn.Module):
    "Target encoding (masked self-attention) and source-target mapping (inter-attention), then the feed-forward (§2.2)."
    def __init__(self, d, heads, d_hidden, tau, dropout):
        super().__init__()
        self.self_att = MultiHeadAttention(d, heads, tau=tau, dropout=dropout)
        self.inter = MultiHeadAttention(d, heads, tau=tau, dropout=dropout)
        self.ff = FeedForward(d, d_hidden, dropout)
        self.n1, self.n2, self.n3, self.drop = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d), nn.Dropout(dropout)

    def forward(self, y, self_kv, inter_kv, mask=None):
        "Words y (R, T, d) with their own keys/values `self_kv` (R, h, T', d_attn) and the image's `inter_kv` (B, h, L, d_attn)."
        # target encoding: LayerNorm(Attn(y, y_<=t) + y): (R, T, d)
        y = self.n1(y + self.drop(self.self_att(y, mask=mask, kv=self_kv)[0]))
        # source-target mapping: LayerNorm(Attn(y, image) + y): (R, T, d); weights (R, h, T, L)
        z, w = self.inter(y, kv=inter_kv)
        y = self.n2(y + self.drop(z))
        return self.n3(y + self.drop(self.ff(y))), w

# %% [markdown]
# ## The model
#
# Image features (B, L, D) are projected to $d_{feat}$ when D differs (VGG-11's 512 channels need no projection; the
# shapes encoder's 128 do — *capbook*), equipped with the positional encoding, dropped out (p = 0.1, §3) and encoded
# by two encoder layers. Words are embedded (scaled by $\sqrt{d}$ as in Vaswani et al.), positionally encoded, dropped
# out, and pass four decoder layers; a linear layer and softmax give the next word.
#
# **One encoder pass per image.** In training, a batch holds several captions of an image: the encoder runs on each
# image once (`batch["img"]` names the image of each caption) and its keys and values are gathered per caption. In
# beam search and sampling the image's keys and values have B rows and serve its K beams without copies.
#
# **Incremental decoding.** `step` appends the new word's keys and values to a per-layer cache and attends with the one
# new query: the same function as the masked parallel decoder (the τ of each position counts the keys it sees), which
# a test below checks to float precision.

# %%
#| export
@dataclass
class SSAConfig:
    "The spatial self-attention transformer (§2): sizes of the paper by default."
    d_model: int = 512          # d_feat, the width of every layer (VGG-11's channels)
    heads: int = 8              # h
    d_hidden: int = 1024        # the feed-forward's hidden width, 2 d_feat
    enc_layers: int = 2         # self-attention layers over the regions
    dec_layers: int = 4         # decoder layers
    dropout: float = 0.1        # on caption embeddings, image features and attention weights (§3)
    tau: str = "paper"          # paper: sqrt(d_len + d_attn) (Eq. 2) | standard: sqrt(d_attn) (Vaswani et al.)
    max_positions: int = 64     # longest caption the positional table covers

    def check(self):
        "Stop with one line on an invalid value."
        for n in ("d_model", "heads", "d_hidden", "enc_layers", "dec_layers", "max_positions"): check_int(n, getattr(self, n), lo=1)
        if self.d_model % self.heads:
            raise CapbookError(f"parameter d_model={self.d_model} is invalid: expected a multiple of heads={self.heads}")
        check_float("dropout", self.dropout, lo=0, hi=0.95); check_choice("tau", self.tau, TAUS)
        return self

class SpatialTransformer(CaptionModel):
    "Springenberg et al.'s image-to-text transformer: 2 self-attention layers over the regions, 4 decoder layers."
    def __init__(self, cfg: SSAConfig, vocab_size: int, feat_dim: int, grid: tuple[int, int]):
        super().__init__(vocab_size)
        cfg.check(); self.cfg, d = cfg, cfg.d_model
        self.L = grid[0] * grid[1]
        self.proj = nn.Identity() if feat_dim == d else nn.Linear(feat_dim, d)
        self.E = nn.Embedding(vocab_size, d, padding_idx=self.pad)
        self.register_buffer("pe_img", sinusoid(self.L, d), persistent=False)
        self.register_buffer("pe_txt", sinusoid(cfg.max_positions, d), persistent=False)
        self.enc = nn.ModuleList(EncoderLayer(d, cfg.heads, cfg.d_hidden, cfg.tau, cfg.dropout) for _ in range(cfg.enc_layers))
        self.dec = nn.ModuleList(DecoderLayer(d, cfg.heads, cfg.d_hidden, cfg.tau, cfg.dropout) for _ in range(cfg.dec_layers))
        self.out, self.drop = nn.Linear(d, vocab_size), nn.Dropout(cfg.dropout)
        self.encoder_passes = 0                                  # images encoded (for the one-pass-per-image test)

    @property
    def n_params(self) -> int: return sum(p.numel() for p in self.parameters())

    def encode(self, feats: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        "Regions (B, L, D) -> every decoder layer's inter-attention keys and values, each (B, h, L, d_attn)."
        self.encoder_passes += len(feats)
        # x = dropout(proj(a) + PE): (B, L, d)
        x = self.drop(self.proj(feats) + self.pe_img)
        for layer in self.enc: x = layer(x)
        return [layer.inter.keys_values(x) for layer in self.dec]

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        "Words (R, T) at positions start.. -> dropout(E w sqrt(d) + PE): (R, T, d)."
        T = tokens.shape[1]
        if start + T > self.cfg.max_positions:
            raise ValueError(f"caption of {start + T} positions: max_positions is {self.cfg.max_positions}")
        return self.drop(self.E(tokens) * math.sqrt(self.cfg.d_model) + self.pe_txt[start:start + T])

    def init_state(self, batch):
        kv = self.encode(batch["feats"])
        memory = {f"{n}{i}": t for i, (k, v) in enumerate(kv) for n, t in (("k", k), ("v", v))}
        B, h, dh = len(batch["feats"]), self.cfg.heads, self.cfg.d_model // self.cfg.heads
        empty = batch["feats"].new_zeros(B, h, 0, dh)
        state = {f"s{n}{i}": empty for i in range(len(self.dec)) for n in "kv"}
        return memory, state

    def step(self, tokens, memory, state):
        t = state["sk0"].shape[2]                                # words already decoded
        y, new = self.embed(tokens[:, None], t), {}
        for i, layer in enumerate(self.dec):
            k, v = layer.self_att.keys_values(y)                 # the new word's keys and values: (R, h, 1, d_attn)
            new[f"sk{i}"] = K = torch.cat([state[f"sk{i}"], k], 2)
            new[f"sv{i}"] = V = torch.cat([state[f"sv{i}"], v], 2)
            y, w = layer(y, (K, V), (memory[f"k{i}"], memory[f"v{i}"]))
        # inter-attention of the last layer, mean over heads: (R, L)
        return self.out(y[:, 0]), new, {"alpha": w[:, :, 0].mean(1)}

    def teacher_forcing(self, batch):
        caps = batch["caps"][:, :-1]                             # <start> w_1 ... : (N, T)
        feats, img = batch["feats"], batch.get("img")
        if img is not None:                                      # one encoder pass per image, gathered per caption
            u, inv = torch.unique(img, return_inverse=True)
            first = torch.zeros(len(u), dtype=torch.long, device=img.device).scatter_(0, inv, torch.arange(len(img), device=img.device))
            kv = [(k[inv], v[inv]) for k, v in self.encode(feats[first])]
        else: kv = self.encode(feats)
        T = caps.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=caps.device).tril()     # word t sees words <= t
        y = self.embed(caps, 0)
        for layer, ikv in zip(self.dec, kv):
            y, w = layer(y, layer.self_att.keys_values(y), ikv, mask)
        return {"logits": self.out(y), "alpha": w.mean(1)}      # (N, T, V), (N, T, L)

@register("ssa", SSAConfig)
def ssa(cfg: SSAConfig, vocab_size, feat_dim, grid):
    "Springenberg et al. 2018: the spatial self-attention transformer (τ = √(d_len + d_attn) unless tau='standard')."
    return SpatialTransformer(cfg, vocab_size, feat_dim, grid)

# %% [markdown]
# Incremental decoding equals the masked parallel decoder: the log-probabilities that `step` gives, word by word with
# its key/value cache, are those of teacher forcing on the same caption, for both temperatures.

# %%
from capbook.models import build
from capbook.decode import beam_search, sample
for _tau in TAUS:
    torch.manual_seed(0)
    _m = build("ssa", 20, 8, (2, 2), d_model=16, heads=4, d_hidden=32, dec_layers=2, tau=_tau).eval()
    _f = torch.randn(3, 4, 8)
    _s = sample(_m, _f, n=2, temperature=1.0, max_len=6)
    _caps = torch.cat([torch.full((6, 1), _m.start), _s.tokens], 1)
    _tf = torch.log_softmax(_m({"feats": _f.repeat_interleave(2, 0), "caps": _caps})["logits"], -1)
    _lp = _tf.gather(2, _caps[:, 1:, None])[..., 0] * _s.mask
    assert torch.allclose(_lp, _s.logprobs.detach() * _s.mask, atol=1e-5), (_tau, (_lp - _s.logprobs * _s.mask).abs().max())
_m.encoder_passes = 0
_b = {"feats": _f.repeat_interleave(5, 0), "caps": _caps[:1].repeat(15, 1), "img": torch.arange(3).repeat_interleave(5)}
_out = _m(_b)
assert _m.encoder_passes == 3 and _out["logits"].shape[:2] == (15, _caps.shape[1] - 1) and _out["alpha"].shape[-1] == 4
_m.encoder_passes = 0; beam_search(_m, _f, beam_size=3, max_len=6)
assert _m.encoder_passes == 3                                             # beams share the image's keys and values
