"The spatial self-attention transformer: Eq. 1-3 against a direct computation, incremental = parallel decoding, one encoder pass per image, the batching and sizes the chapter relies on."
import math
import numpy as np
import pytest
import torch
from capbook.attention import MultiHeadAttention, TAUS
from capbook.data import CaptionData, Vocab
from capbook.decode import beam_search, sample
from capbook.models import build
from capbook.ssa import SSAParams, inter_attention_spread


def direct(m: MultiHeadAttention, xq, xkv, mask=None):
    "Eq. 1-3 head by head with explicit loops over heads: Q = x W_Q^i, a = softmax(Q K^T / tau), Attn = cat(a V) W_O."
    d, outs, ws = m.d, [], []
    for i in range(m.h):
        Wq, Wk, Wv = (W.weight[i * d:(i + 1) * d] for W in (m.W_Q, m.W_K, m.W_V))
        Q, K, V = xq @ Wq.T, xkv @ Wk.T, xkv @ Wv.T                         # (N, Tq, d), (N, Tk, d)
        e = Q @ K.transpose(1, 2)                                           # (N, Tq, Tk)
        n_keys = mask.sum(-1, keepdim=True).float() if mask is not None else torch.tensor(float(K.shape[1]))
        tau = torch.sqrt(n_keys + d) if m.tau == "paper" else math.sqrt(d)  # Eq. 2
        e = e / tau
        if mask is not None: e = e.masked_fill(~mask, float("-inf"))
        a = torch.softmax(e, -1)
        outs.append(a @ V); ws.append(a)
    return torch.cat(outs, -1) @ m.W_O.weight.T, torch.stack(ws, 1)


@pytest.mark.parametrize("tau", TAUS)
def test_multi_head_attention_is_eq_1_to_3(tau):
    torch.manual_seed(0)
    m = MultiHeadAttention(16, heads=4, tau=tau).eval()
    xq, xkv = torch.randn(3, 5, 16), torch.randn(3, 7, 16)
    out, w = m(xq, xkv)
    ref, wref = direct(m, xq, xkv)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(w, wref, atol=1e-6) and torch.equal(m.last, w)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()                        # masked self-attention: d_len = t + 1
    out, w = m(xq, mask=mask)
    ref, wref = direct(m, xq, xq, mask[None].expand(3, 5, 5))
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(w, wref, atol=1e-6)
    assert (w.triu(1) == 0).all()


def test_paper_tau_spreads_the_same_logits():
    "With the same weights, tau = sqrt(d_len + d_attn) gives flatter weights than sqrt(d_attn): higher entropy."
    torch.manual_seed(0)
    a, b = MultiHeadAttention(16, 4, tau="paper").eval(), MultiHeadAttention(16, 4, tau="standard").eval()
    b.load_state_dict(a.state_dict())
    xq, xkv = torch.randn(2, 3, 16) * 3, torch.randn(2, 49, 16) * 3
    H = lambda w: -(w * w.log()).sum(-1).mean()
    assert H(a(xq, xkv)[1]) > H(b(xq, xkv)[1])


def model(tau, **kw):
    torch.manual_seed(0)
    return build("ssa", 20, 8, (3, 3), d_model=16, heads=4, d_hidden=32, dec_layers=2, tau=tau, **kw).eval()


@pytest.mark.parametrize("tau", TAUS)
def test_incremental_decoding_equals_parallel(tau):
    "The log-probabilities of sampling (step by step with the key/value cache) are teacher forcing's on the same words."
    m = model(tau)
    f = torch.randn(4, 9, 8)
    s = sample(m, f, n=3, temperature=1.0, max_len=8)
    caps = torch.cat([torch.full((len(s.tokens), 1), m.start), s.tokens], 1)
    lp = torch.log_softmax(m({"feats": f.repeat_interleave(3, 0), "caps": caps})["logits"], -1)
    lp = lp.gather(2, caps[:, 1:, None])[..., 0] * s.mask
    assert torch.allclose(lp, s.logprobs.detach() * s.mask, atol=1e-5)


def test_beam_search_scores_are_teacher_forcing_scores():
    m = model("paper")
    f = torch.randn(2, 9, 8)
    outs = beam_search(m, f, beam_size=3, max_len=8)
    for i, o in enumerate(outs):
        caps = torch.tensor([[m.start, *o.tokens, m.end]])  # at max_len the search forces <end>, and scores it
        lp = torch.log_softmax(m({"feats": f[i:i + 1], "caps": caps})["logits"], -1)[0]
        total = lp.gather(1, caps[0, 1:, None]).sum()
        assert abs(float(total.detach()) - o.logprob) < 1e-4


def test_one_encoder_pass_per_image():
    m = model("paper")
    f = torch.randn(3, 9, 8)
    m.encoder_passes = 0
    m({"feats": f.repeat_interleave(5, 0), "caps": torch.randint(4, 20, (15, 6)), "img": torch.arange(3).repeat_interleave(5)})
    assert m.encoder_passes == 3                       # 15 captions, 3 images
    m.encoder_passes = 0
    beam_search(m, f, beam_size=4, max_len=6)
    assert m.encoder_passes == 3                       # 12 beams, 3 images


def test_grouping_by_image_gives_the_same_logits():
    "Encoding once per image and gathering gives what encoding every caption's copy gives (dropout off)."
    m = model("paper")
    f, caps = torch.randn(2, 9, 8), torch.randint(4, 20, (6, 5))
    img = torch.tensor([0, 0, 1, 1, 1, 0])
    a = m({"feats": f[img], "caps": caps, "img": img})["logits"]
    b = m({"feats": f[img], "caps": caps})["logits"]
    assert torch.allclose(a, b, atol=1e-5)


def caption_data(n_images=7, per=5, seed=0):
    rng = np.random.default_rng(seed)
    words = ["a", "red", "blue", "circle", "square", "left", "of", "the"]
    refs = [[list(rng.choice(words, rng.integers(2, 9))) for _ in range(per)] for _ in range(n_images)]
    v = Vocab.build([c for r in refs for c in r], min_count=1)
    return CaptionData(np.zeros((n_images, 2, 1), np.float16), [str(i) for i in range(n_images)], refs, v, max_len=10)


def test_batches_by_image_keep_an_images_captions_together():
    cd = caption_data()
    bs = list(cd.batches(8, epoch=2, seed=1, order="image"))
    assert sorted(np.concatenate([b["img"].numpy() for b in bs]).tolist()) == sorted(cd.cap_img.tolist())
    where = {}
    for k, b in enumerate(bs):
        for i in b["img"].tolist(): where.setdefault(i, set()).add(k)
    assert all(len(s) == 1 for s in where.values())                      # never split across batches
    assert all(len(b["caps"]) >= 8 for b in bs[:-1]) and len(bs) == cd.num_batches(8, order="image", epoch=2, seed=1)
    assert [b["img"].tolist() for b in bs] == [b["img"].tolist() for b in cd.batches(8, 2, 1, order="image")]
    tail = list(cd.batches(8, 2, 1, order="image", skip=2))
    assert [b["img"].tolist() for b in tail] == [b["img"].tolist() for b in bs[2:]]


def test_max_words_leaves_longer_captions_out_of_training():
    cd = caption_data()
    for order in ("length", "image"):
        kept = np.concatenate([b["lengths"].numpy() - 2 for b in cd.batches(4, 0, 0, order=order, max_words=4)])
        assert len(kept) == int((cd.words <= 4).sum()) and kept.max() <= 4
    assert cd.num_batches(4, max_words=4) == len(list(cd.batches(4, 0, 0, max_words=4)))


def test_default_batches_are_unchanged():
    "The default length-bucketed order is the one every earlier run trained with, draw for draw."
    cd = caption_data(n_images=11)
    g = torch.Generator().manual_seed(3 * 100003 + 4)
    order = torch.randperm(len(cd), generator=g).numpy()
    order = order[np.argsort(cd.lengths[order], kind="stable")]
    chunks = [order[s:s + 6] for s in range(0, len(order), 6)]
    chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()]
    got = [b["img"].tolist() for b in cd.batches(6, epoch=4, seed=3)]
    assert got == [cd.cap_img[c].tolist() for c in chunks]


def test_profile_sizes_fill_the_parameters_left_none():
    from capbook.profiles import chapter
    ch = chapter("04_spatial_self_attention")
    for profile, want in [("default", 64), ("paper", 512), ("smoke", 64)]:
        p = ch.resolve(SSAParams(profile=profile))
        assert p.d_model == want and p.d_hidden == 2 * want and p.d_model // p.heads == 64   # d_attn: the paper's 64
    assert ch.resolve(SSAParams(profile="default", d_model=32)).d_model == 32   # a value given wins


def test_tau_ratio_is_the_papers_at_every_profile():
    "τ_paper / τ_standard = √(L + d_attn) / √d_attn: the paper's 2.02 (196 regions, d_attn 64), not 3.64 (d_attn 16)."
    from capbook.profiles import chapter
    ch = chapter("04_spatial_self_attention")
    paper = (196 + 64) ** 0.5 / 64 ** 0.5
    for profile in ("smoke", "default", "paper"):
        p = ch.resolve(SSAParams(profile=profile))
        d_attn = p.d_model // p.heads
        assert abs((196 + d_attn) ** 0.5 / d_attn ** 0.5 - paper) < 0.05 * paper, (profile, d_attn)


def test_the_transformer_trains_on_every_caption_as_the_rows_it_is_compared_with():
    "One rule for every compared row: no caption is left out of training (the 14-word cut dropped 23 % on shapes)."
    from capbook.profiles import chapter
    from capbook.sat import SATParams
    from capbook.train import TrainConfig
    ssa_words = chapter("04_spatial_self_attention").resolve(SSAParams()).max_words
    sat_words = {**chapter("02_show_attend_tell").train, **vars(SATParams())}.get("max_words", TrainConfig.max_words)
    assert ssa_words == sat_words == 0
    cd = caption_data(n_images=11)
    assert cd.n_kept(ssa_words) == len(cd)


def test_scaled_word_embedding_and_positional_encoding_are_of_one_scale():
    "E w √d and the positional encoding within a factor of 2 of each other (it was 21 with nn.Embedding's N(0, 1))."
    from capbook.models import build
    for name, hp in [("ssa", {"d_model": 128, "heads": 2, "d_hidden": 256}), ("ct", {"d_model": 128, "d_hidden": 256})]:
        torch.manual_seed(0)
        m = build(name, 500, 128, (14, 14), **hp).eval()
        tokens = torch.arange(3, 500)[None]
        words = m.E(tokens) * m.cfg.d_model ** 0.5
        ratio = float(words.detach().std() / m.pe_txt[:20].std())
        assert 0.5 < ratio < 2, (name, ratio)


def test_every_transformer_warms_its_learning_rate_up():
    "The spatial transformer, CT and GLIED warm up (declared in their registry entries), then follow the protocol's cosine like every model."
    from capbook.models import spec
    from capbook.train import TrainConfig, lr_factor
    for name in ("ssa", "ct", "glied"):
        cfg = TrainConfig(**spec(name).train)
        assert cfg.check().warmup > 0 and cfg.schedule == "cosine"
        f = [lr_factor(cfg, s, s // 100, 100) for s in (1, 50, 100, 800, 1500)]
        assert f[0] < f[1] < f[2] == 1.0 > f[3] > f[4] == 0.0        # up to lr over the first epoch, then down to 0 at the budget's end
        assert abs(f[3] - 0.5) < 0.01                                # half way through the cosine: half the rate


def test_spread_of_uniform_and_one_hot_attention():
    m = model("paper")
    sp = inter_attention_spread(m, torch.randn(2, 9, 8), [[5, 6, 7], [8]])
    assert len(sp["layers"]) == 2 and all(0 < l["entropy"] <= 1 and 1 / 9 <= l["peak"] <= 1 for l in sp["layers"])
    with torch.no_grad():                               # queries that ignore the words: every weight 1/L
        for layer in m.dec: layer.inter.W_Q.weight.zero_()
    sp = inter_attention_spread(m, torch.randn(2, 9, 8), [[5, 6, 7], [8]])
    assert all(abs(l["entropy"] - 1) < 1e-5 and abs(l["peak"] - 1 / 9) < 1e-6 for l in sp["layers"])


@pytest.mark.parametrize("params,message", [
    ({"d_model": 100, "heads": 8}, "parameter d_model=100 is invalid: expected a multiple of heads=8"),
    ({"tau": "big"}, "parameter tau='big' is invalid: allowed values are 'paper', 'standard'"),
    ({"max_words": -1}, "parameter max_words=-1 is invalid")])
def test_ssa_invalid_parameters_are_one_line(home, params, message):
    "In-process, through the checks the notebook's first cell runs (the notebook's own one-line path: test_book's papermill tests)."
    from capbook.core import CapbookError
    from capbook.runner import run_chapter
    before = sorted((home / "runs" / "smoke").glob("adhoc/*"))
    with pytest.raises(CapbookError) as e:
        run_chapter("04_spatial_self_attention", {"profile": "smoke", **params}, log=lambda s: None)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert sorted((home / "runs" / "smoke").glob("adhoc/*")) == before    # stopped before any work: no run folder