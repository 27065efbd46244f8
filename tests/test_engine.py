"""The engine's extension points: a model with an extra batch input and its own objective trained by `fit`, sampling,
self-critical training as one more objective, CIDEr-D against pycocoevalcap, and configs that stop on unknown names."""
import copy, dataclasses
from dataclasses import dataclass
import numpy as np
import pytest
import torch
from torch import nn
from capbook.core import CapbookError
from capbook.data import to_device
from capbook.decode import greedy, sample, teacher_forced, pad_captions
from capbook.models import CaptionModel, REGISTRY, build, register, make_config
from capbook.objectives import CrossEntropy, SelfCritical, objective_for
from capbook.train import TrainConfig, fit, load_trained


# --- a test-only model that needs an input besides the features, trained with a custom objective -----------------

@dataclass
class AttrConfig:
    emb_dim: int = 16           # word and attribute embedding size
    weight: float = 0.1         # weight of the objective's extra term

class AttrModel(CaptionModel):
    "Mean features plus the embedding of one attribute id per image (`attrs`), then a GRU cell."
    inputs = ("feats", "attrs")
    def __init__(self, cfg, vocab_size, feat_dim, grid):
        super().__init__(vocab_size)
        self.E, self.A = nn.Embedding(vocab_size, cfg.emb_dim), nn.Embedding(8, cfg.emb_dim)
        self.init = nn.Linear(feat_dim + cfg.emb_dim, cfg.emb_dim)
        self.cell, self.out = nn.GRUCell(cfg.emb_dim, cfg.emb_dim), nn.Linear(cfg.emb_dim, vocab_size)
        self.seen = []
    def init_state(self, batch):
        self.seen.append(batch["attrs"][:, 0].tolist())
        a = self.A(batch["attrs"][:, 0])                                  # the extra input: (B, emb)
        return {"a": a}, {"h": torch.tanh(self.init(torch.cat([batch["feats"].mean(1), a], 1)))}
    def step(self, tokens, memory, state):
        h = self.cell(self.E(tokens), state["h"])
        return self.out(h), {"h": h}, {}

class AttrNorm(CrossEntropy):
    "Cross-entropy plus a penalty on the attribute embedding of the batch's images; records what it saw of the batch."
    def __init__(self, model, weight):
        super().__init__(); self.model, self.weight, self.saw = [model], weight, []
    def loss(self, out, batch):
        nll, stats = super().loss(out, batch)
        self.saw.append({"keys": set(batch), "n_refs": len(batch["refs"])})
        pen = self.model[0].A(batch["attrs"][:, 0]).pow(2).mean()
        return nll + self.weight * pen, {**stats, "attr_norm": pen.item()}


@pytest.fixture
def attr_prep(smoke):
    "The smoke data with one attribute id per image (its number of objects, from the ground truth) as `attrs`."
    prep = copy.copy(smoke)
    for s in ("train", "val", "test"):
        d = copy.copy(getattr(smoke, s)); d.inputs = dict(d.inputs)
        n = [len(smoke.gt["images"][k]["objects"]) for k in d.keys]
        setattr(prep, s, d.with_inputs(attrs=np.array(n, dtype=np.int64)[:, None]))
    return prep


def test_model_with_extra_input_and_custom_objective_trains_through_fit(attr_prep, tmp_path):
    register("_attr", AttrConfig, objective=None)(AttrModel)
    try:
        torch.manual_seed(0)
        m = build("_attr", len(attr_prep.vocab), attr_prep.feat_shape[1], attr_prep.grid, emb_dim=12)
        obj = AttrNorm(m, m.config.weight)
        cfg = TrainConfig(epochs=1, progress=False, max_len=attr_prep.max_len, batch_size=128)
        res = fit(m, attr_prep, cfg, tmp_path / "ckpt", log=lambda s: None, objective=obj)
        assert "attr_norm" in res.history[0] and np.isfinite(res.history[0]["loss"])
        assert obj.saw and all({"feats", "attrs", "caps", "refs", "img"} <= s["keys"] for s in obj.saw)
        n_obj = {len(attr_prep.gt["images"][k]["objects"]) for k in attr_prep.train.keys}
        assert set(sum(m.seen, [])) <= n_obj and len(set(sum(m.seen, []))) > 1     # the model read the real attribute
        # rebuilt from its checkpoint by name and config, and decoded through the evaluator's path
        again = load_trained(tmp_path, attr_prep)
        assert isinstance(again, AttrModel) and again.config.emb_dim == 12
        b = next(attr_prep.test.image_batches(4))
        assert [c.tokens for c in greedy(again, b, 6)] == [c.tokens for c in greedy(m.eval(), b, 6)]
        with pytest.raises(CapbookError, match="needs batch input.*attrs"):
            greedy(m, {"feats": b["feats"]}, 4)
    finally:
        REGISTRY.pop("_attr", None)


# --- sampling -----------------------------------------------------------------------------------------------------

def sat(seed=0, V=13):
    torch.manual_seed(seed)
    m = build("sat_soft", vocab_size=V, feat_dim=8, grid=(3, 3), emb_dim=8, hidden_dim=16, att_dim=8)
    with torch.no_grad(): m.L_o.bias[2] += 0.3          # captions of several lengths
    return m.eval()


def test_sample_logprobs_equal_teacher_forcing():
    m, f = sat(), torch.randn(5, 9, 8)
    torch.manual_seed(1)
    s = sample(m, f, n=3, temperature=1.0, max_len=7)
    assert s.tokens.shape[0] == 15 and s.logprobs.requires_grad
    caps = [c.tokens for c in s.captions()]
    assert len({tuple(c) for c in caps}) > 3                            # real draws, not one caption repeated
    t = pad_captions([[m.start, *c, m.end] for c in caps], 9)
    tf = teacher_forced(m, {"feats": f.repeat_interleave(3, 0), "caps": t})
    with torch.no_grad():                         # each reference word's log-probability under teacher forcing: (R, 8)
        lp = torch.log_softmax(m({"feats": f.repeat_interleave(3, 0), "caps": t})["logits"].float(), -1).gather(2, t[:, 1:, None])[..., 0]
    summed = (s.logprobs * s.mask).sum(1)
    ended = (s.tokens == m.end).any(1).tolist()
    assert not all(ended) and any(ended)                                # cut rows (no <end> at max_len) and ended ones
    for r, (a, b) in enumerate(zip(tf, summed.tolist())):
        # an ended sample's words and its <end>; a cut one's words only: no term for an <end> it never drew
        want = lp[r, :len(caps[r]) + ended[r]].sum().item()
        assert a.tokens == caps[r] and abs(want - b) < 1e-4 and (len(caps[r]) == 7 or ended[r])
        assert torch.allclose(a.alpha, s.alpha[r, :len(caps[r])], atol=1e-6)
    summed.sum().backward()                                             # gradients reach the model for REINFORCE
    assert m.L_o.weight.grad is not None and m.L_o.weight.grad.abs().sum() > 0


def test_sample_at_temperature_zero_is_greedy():
    m, f = sat(2), 2 * torch.randn(6, 9, 8)
    g = greedy(m, f, max_len=8)
    for temp in (0.0, 1e-6):
        s = sample(m, f, n=2, temperature=temp, max_len=8)
        for i, c in enumerate(s.captions()):
            assert c.tokens == g[i // 2].tokens and abs(c.logprob - g[i // 2].logprob) < 1e-4
    with pytest.raises(ValueError): sample(m, f, temperature=-1)


def test_sampling_through_forward():
    m, f = sat(3), torch.randn(2, 9, 8)
    s = m({"feats": f}, mode=sample, n=4, temperature=0.0, max_len=5)            # the decoding routine, run inside forward
    assert s.tokens.shape[0] == 8 and s.n == 4
    with pytest.raises(CapbookError, match="mode='beam' is invalid"): m({"feats": f}, mode="beam")


# --- self-critical training and CIDEr-D ---------------------------------------------------------------------------

def test_cider_d_matches_pycocoevalcap(smoke):
    from pycocoevalcap.cider.cider import Cider
    from capbook.metrics import CiderD
    refs = smoke.test.refs
    rng = np.random.default_rng(0)
    cands = [list(refs[(i + 1) % len(refs)][0][: rng.integers(3, 10)]) if i % 3 else list(r[1]) for i, r in enumerate(refs)]
    cands[4] = []                                                        # an empty caption scores 0 on both
    ours = CiderD(refs).score(cands, refs)
    mean, theirs = Cider().compute_score({i: [" ".join(x) for x in r] for i, r in enumerate(refs)},
                                         {i: [" ".join(c)] for i, c in enumerate(cands)})
    assert np.allclose(ours, theirs, atol=1e-6) and abs(ours.mean() - mean) < 1e-6
    assert ours[0] > ours[1]                                             # a reference scores above a wrong caption


def test_cider_d_on_ids_with_end_token_matches_pycocoevalcap_and_caches_its_df(smoke, tmp_path):
    from pycocoevalcap.cider.cider import Cider
    from capbook.metrics import CiderD
    v, refs = smoke.vocab, smoke.test.refs
    as_vocab = [[[v.itos[i] for i in v.encode(r)[1:-1]] for r in rs] for rs in refs]     # what the ids can say
    rng = np.random.default_rng(1)
    cands = [rng.integers(4, len(v), rng.integers(0, 12)) for _ in refs]
    cands[0] = np.array(v.encode(refs[0][2])[1:-1])
    cd = CiderD(refs, vocab=v, end=True, cache=tmp_path)
    ours = cd.score(cands, refs)
    words = lambda ids: " ".join([v.itos[i] for i in ids] + ["<end>"])
    _, theirs = Cider().compute_score({i: [" ".join(r + ["<end>"]) for r in rs] for i, rs in enumerate(as_vocab)},
                                      {i: [words(c)] for i, c in enumerate(cands)})
    assert np.allclose(ours, theirs, atol=1e-9) and ours[0] == ours.max() > 0
    assert cd.cache_path.exists() and cd.cache_path.parent == tmp_path
    again = CiderD(refs, vocab=v, end=True, cache=tmp_path)                 # the cached df, the same scores
    assert again.cache_path == cd.cache_path and np.array_equal(again.score(cands, refs), ours)
    changed = [list(rs) for rs in refs]; changed[0] = changed[0][:-1]
    assert CiderD(changed, vocab=v, end=True, cache=tmp_path).cache_path != cd.cache_path   # never a stale df
    assert CiderD(refs, vocab=v, end=False, cache=tmp_path).cache_path != cd.cache_path


def test_self_critical_is_an_objective_of_the_one_trainer(smoke, tmp_path):
    torch.manual_seed(0)
    m = build("sat_soft", len(smoke.vocab), smoke.feat_shape[1], smoke.grid, emb_dim=16, hidden_dim=32, att_dim=16)
    scst = SelfCritical(smoke.vocab, smoke.train.refs, n=3, max_len=smoke.max_len)
    b = to_device(next(smoke.train.batches(32, epoch=0, seed=0)), "cpu")
    m.train()
    out = scst.outputs(m, b)
    n_img = len(set(b["img"].tolist()))
    s = out["samples"]
    assert s.tokens.shape[0] == 3 * n_img and out["advantage"].shape == (3 * n_img,)
    loss, stats = scst.loss(out, b)
    manual = -(out["advantage"][:, None] * s.logprobs * s.mask).sum() / s.mask.sum()
    assert torch.allclose(loss, manual) and {"reward", "baseline", "greedy_reward"} <= set(stats)
    cfg = TrainConfig(epochs=1, progress=False, max_len=smoke.max_len, batch_size=256)
    res = fit(m, smoke, cfg, tmp_path / "ckpt", log=lambda s: None, objective=scst)
    assert {"scst", "reward", "baseline", "greedy_reward"} <= set(res.history[0]) and np.isfinite(res.history[0]["scst"])


# --- training options: scheduled sampling and label smoothing -------------------------------------------------------

@pytest.mark.parametrize("name,kw", [("sat_soft", dict(emb_dim=8, hidden_dim=16, att_dim=8)),
                                     ("lstm2d_spca", dict(channels=8, map_size=3, word_hidden=8)),
                                     ("ssa", dict(d_model=16, d_hidden=32, heads=2, enc_layers=1, dec_layers=2)),
                                     ("updown", dict(emb_dim=8, hidden_dim=16, att_dim=8))])
def test_scheduled_sampling_at_probability_zero_is_teacher_forcing(name, kw):
    "Every step interface: scheduled sampling with p = 0 feeds the references, so its outputs are teacher forcing's; p = 1 feeds the model's own words."
    torch.manual_seed(0)
    m = build(name, vocab_size=13, feat_dim=8, grid=(3, 3), **kw).eval()
    caps = pad_captions([[1, 5, 6, 7, 2], [1, 8, 2], [1, 4, 4, 9, 10, 2]], 7)
    b = {"feats": torch.randn(3, 9, 8), "caps": caps}
    real = caps[:, 1:] != m.pad                                          # the steps the loss reads
    tf, ss = m(b)["logits"][real], m(b, mode="scheduled", p=0.0)["logits"][real]
    assert torch.allclose(tf, ss, atol=1e-5), (tf - ss).abs().max()
    torch.manual_seed(0)
    assert not torch.allclose(m(b, mode="scheduled", p=1.0)["logits"][real], tf, atol=1e-3)


@pytest.mark.slow                                                       # two smoke epochs: ~30 s
def test_label_smoothing_and_scheduled_sampling_train_through_fit(smoke, tmp_path):
    torch.manual_seed(0)
    m = build("sat_soft", len(smoke.vocab), smoke.feat_shape[1], smoke.grid, emb_dim=16, hidden_dim=32, att_dim=16)
    cfg = TrainConfig(epochs=2, progress=False, max_len=smoke.max_len, batch_size=128, evals_per_epoch=1, label_smoothing=0.1,
                      ss_start=0, ss_every=1, ss_increase=0.2)
    res = fit(m, smoke, cfg, tmp_path / "ckpt", log=lambda s: None)
    assert [h["ss_prob"] for h in res.history] == pytest.approx([0.0, 0.2])   # teacher forcing, then 20% of its own words
    assert all(h["smoothed"] > h["nll"] for h in res.history)           # the smoothed target costs more than the plain NLL
    scst = SelfCritical(smoke.vocab, smoke.train.refs, n=3, max_len=smoke.max_len)
    with pytest.raises(CapbookError, match="label_smoothing=0.1 applies to cross-entropy training; SelfCritical has none"):
        fit(m, smoke, dataclasses.replace(cfg, ss_start=-1), tmp_path / "ckpt2", log=lambda s: None, objective=scst)
    with pytest.raises(CapbookError, match="ss_start=0: scheduled sampling replaces teacher forcing, which SelfCritical"):
        fit(m, smoke, dataclasses.replace(cfg, label_smoothing=0.0), tmp_path / "ckpt3", log=lambda s: None, objective=scst)


# --- configs: one place for defaults, one line for a wrong name ---------------------------------------------------

def test_configs_stop_on_unknown_or_fixed_names():
    with pytest.raises(CapbookError, match="parameter kernel is unknown for model sat_soft: known parameters are"):
        build("sat_soft", 10, 8, (3, 3), kernel=3)
    with pytest.raises(CapbookError, match="parameter attention='soft' is invalid for model sat_hard"):
        build("sat_hard", 10, 8, (3, 3), attention="soft")
    with pytest.raises(CapbookError, match="parameter kernel=4 is invalid: expected an odd integer"):
        build("lstm2d_spca", 10, 8, (3, 3), kernel=4)
    assert make_config("lstm1d_spca").kernel == make_config("lstm2d_spca").kernel == 3   # SPCA's default, declared once
    assert isinstance(objective_for(build("lstm2d", 10, 8, (3, 3))), CrossEntropy)
    assert dataclasses.asdict(make_config("sat_none"))["attention"] == "none"


def test_self_critical_scores_against_references_cut_to_its_length(smoke):
    "SCST's rewards and document frequencies use the references cut to max_len words, as self-critical.pytorch's labels are: n-grams no sample can reach do not count."
    from capbook.metrics import CiderD
    refs = smoke.train.refs[:60]
    sc = SelfCritical(smoke.vocab, refs, n=2, max_len=4)
    cut = [[r[:4] for r in rs] for rs in refs]
    same = CiderD(cut, vocab=smoke.vocab, end=True)
    assert np.array_equal(sc.cider.df_codes, same.df_codes) and np.array_equal(sc.cider.df, same.df)
    row = torch.tensor([[smoke.vocab.stoi[w] for w in refs[0][0][:4]]])                    # a sample cut at 4 words
    got = sc.reward(row, [refs[0]])
    assert got == pytest.approx(same.score([row[0]], [cut[0]], ended=[False]))
    assert got != pytest.approx(CiderD(refs, vocab=smoke.vocab, end=True).score([row[0]], [refs[0]], ended=[False]))
