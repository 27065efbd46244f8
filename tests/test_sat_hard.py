"Show-Attend-Tell hard attention (§4.1), the no-attention baseline and the soft-vs-hard worked example."
import itertools
import pytest
import torch
import torch.nn.functional as F
from capbook.attention import HardAttention, SoftAttention
from capbook.models import build, available
from capbook.sat import quadrants, worked_example
from capbook.objectives import HardAttentionRule, objective_for

V, D = 11, 6


def make(name="sat_hard", grid=(1, 3), **kw):
    torch.manual_seed(0)
    return build(name, vocab_size=V, feat_dim=D, grid=grid, emb_dim=5, hidden_dim=7, att_dim=4, dropout=0.0, **kw)


def fwd(model, a, caps):
    "Teacher forcing on features `a` and captions `caps`."
    return model({"feats": a, "caps": caps})


def grads(model, loss, retain=False):
    model.zero_grad(); loss.backward(retain_graph=retain)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def forced(model, seq):
    "Make the hard attention take the locations `seq` (one per step) instead of sampling."
    it = iter(seq)
    model.att.sample = lambda alpha: torch.full((len(alpha),), next(it), dtype=torch.long)


def test_registered_variants():
    assert {"sat_soft", "sat_hard", "sat_none"} <= set(available())
    hard, none = make(), make("sat_none")
    assert isinstance(hard.att, HardAttention) and isinstance(objective_for(hard), HardAttentionRule)
    assert none.att is None and not none.gate and objective_for(none).penalty == 0


def test_gate_on_both_penalty_on_soft_only():
    "The gate on both (arctic-captions offers it to either model); the doubly stochastic penalty (§4.2.1) on the deterministic model only, λ = 1; hard decodes with the expected context."
    hard, soft = make(), make("sat_soft")
    assert hard.gate and soft.gate and objective_for(soft).penalty == 1.0 and objective_for(hard).penalty == 0.0
    assert objective_for(make(penalty=1.0)).penalty == 1.0                        # an explicit λ is kept
    assert hard.att.test_context == "expected"


@pytest.mark.parametrize("lambda_e", [0.0, 0.3])
def test_estimator_expectation_is_exact_gradient(lambda_e):
    """Enumerate all L^T location sequences of a tiny model: the expectation over s~ of the gradient of capbook's
    surrogate loss equals the gradient of the lower bound -L_s / C (Eq. 5-7), whatever the baseline b, plus the
    entropy term lambda_e dH[s~]/dW along each path."""
    m = make(p_expected=0.0, lambda_r=1.0, lambda_e=lambda_e, penalty=0.0).train()   # the rule alone, without Eq. 9
    obj = objective_for(m).train()
    a = torch.randn(1, 3, D)                                    # L = 3 locations
    caps = torch.tensor([[1, 5, 6, 2]])                          # C = 3 words, T = 3 attention steps
    C = 3.0
    expected, exact, ent = {}, 0.0, {}
    for seq in itertools.product(range(3), repeat=3):
        obj.baseline.fill_(-0.7)                                   # any constant baseline leaves the estimator unbiased
        forced(m, seq); out = fwd(m, a, caps)
        assert torch.equal(out["sampled"], torch.ones(1, 3))
        logp_s = out["logp_s"].sum()                             # log p(s~ | a) = sum_t log alpha_{t, s_t}
        ll = -F.cross_entropy(out["logits"][0], caps[0, 1:], reduction="sum")   # log p(y | s~, a)
        p = logp_s.exp()
        loss, stats = obj.loss(out, {"caps": caps})
        assert stats["baseline"] == pytest.approx(-0.7)
        g = grads(m, loss, retain=True)
        for k, v in g.items(): expected[k] = expected.get(k, 0) + p.detach() * v
        exact = exact + p * ll                                   # sum_s p(s | a) log p(y | s, a) = L_s
        if lambda_e:
            forced(m, seq); H = fwd(m, a, caps)["entropy"].sum()
            for k, v in grads(m, H).items(): ent[k] = ent.get(k, 0) + p.detach() * v
    m.att.sample = HardAttention.sample.__get__(m.att)
    truth = grads(m, -exact / C)
    assert set(truth) <= set(expected)
    for k in expected:
        want = truth.get(k, torch.zeros_like(expected[k])) - lambda_e * ent.get(k, 0) / C
        assert torch.allclose(expected[k], want, atol=1e-6, rtol=1e-4), k


def test_n_samples_monte_carlo():
    "With N sampled sequences per caption the estimate approaches the exact gradient of L_s / C."
    m = make(p_expected=0.0, lambda_r=1.0, lambda_e=0.0, samples=20000, penalty=0.0).train()   # the rule alone
    a, caps = torch.randn(1, 3, D), torch.tensor([[1, 5, 6, 2]])
    obj = objective_for(m).train()
    obj.baseline.fill_(-2.4)
    torch.manual_seed(1)
    out = fwd(m, a, caps)
    assert out["logits"].shape[0] == 20000
    est = grads(m, obj.loss(out, {"caps": caps})[0])
    m.samples, exact = 1, 0.0
    for seq in itertools.product(range(3), repeat=3):
        forced(m, seq); o = fwd(m, a, caps)
        exact = exact + o["logp_s"].sum().exp() * -F.cross_entropy(o["logits"][0], caps[0, 1:], reduction="sum")
    truth = grads(m, -exact / 3)
    e, t = torch.cat([est[k].flatten() for k in truth]), torch.cat([truth[k].flatten() for k in truth])
    assert F.cosine_similarity(e, t, dim=0) > 0.99 and abs(e.norm() / t.norm() - 1) < 0.05


def test_baseline_update_rule():
    "b_k = 0.9 b_{k-1} + 0.1 log p(y | s~_k, a) (per word, sampled captions only), applied after batch k used b_{k-1}."
    m = make(p_expected=0.0).train()
    obj = objective_for(m).train()
    a, caps = torch.randn(4, 3, D), torch.tensor([[1, 5, 6, 2, 0], [1, 7, 2, 0, 0], [1, 4, 4, 4, 2], [1, 9, 2, 0, 0]])
    b, used = 0.0, []
    for _ in range(3):
        out = fwd(m, a, caps)
        mask = (caps[:, 1:] != 0).float()
        ll = -(F.cross_entropy(out["logits"].transpose(1, 2), caps[:, 1:], reduction="none") * mask).sum()
        _, stats = obj.loss(out, {"caps": caps})
        used.append(stats["baseline"])
        assert stats["baseline"] == pytest.approx(b)              # batch k used b_{k-1}
        b = 0.9 * b + 0.1 * (ll / mask.sum()).item()
        assert obj.baseline.item() == pytest.approx(b, rel=1e-5)
    m.eval(); obj.eval(); obj.loss(fwd(m, a, caps), {"caps": caps})
    assert obj.baseline.item() == pytest.approx(b, rel=1e-5)     # evaluation does not move the baseline
    assert "baseline" in obj.state_dict()                        # saved in checkpoints, restored on resume


def test_expected_context_switch():
    "With probability p_expected per caption the context is the expected one (Eq. 8) and no REINFORCE/entropy term."
    m = make().train()
    a = torch.randn(4000, 3, D)
    mem, _ = m.init_state({"feats": a})
    frac = mem["expected"].float().mean().item()
    assert 0.47 < frac < 0.53
    out = fwd(m, a, torch.tensor([[1, 5, 6, 2]]).expand(4000, -1))
    sampled = out["sampled"][:, 0]
    assert torch.equal(out["sampled"], sampled[:, None].expand(-1, 3))          # one switch per caption, all steps
    assert 0.47 < 1 - sampled.mean().item() < 0.53
    assert (out["logp_s"][sampled == 0] == 0).all() and (out["entropy"][sampled == 0] == 0).all()
    assert (out["logp_s"][sampled == 1] < 0).all()
    assert all(make(p_expected=p).train().init_state({"feats": a})[0]["expected"].float().mean() == p for p in (0.0, 1.0))
    # the context itself: the expected one on switched rows, one annotation vector on the others
    att = HardAttention(D, 7, 4).train()
    h, exp = torch.randn(6, 7), torch.tensor([True, False, True, False, True, False])
    x = torch.randn(6, 3, D)
    z, alpha, info = att(x, att.precompute(x), h, exp)
    soft = (alpha[:, :, None] * x).sum(1)
    assert torch.allclose(z[exp], soft[exp], atol=1e-6)
    assert torch.equal(z[~exp], x[torch.arange(6), info["s"]][~exp])
    assert torch.allclose(info["logp_s"][~exp], alpha[~exp].gather(1, info["s"][~exp, None]).log().squeeze(1), atol=1e-6)


def test_test_time_context():
    "At test time: the argmax location (capbook's choice), or the expected context if asked; beams broadcast."
    att = HardAttention(D, 7, 4).eval()
    x, h = torch.randn(2, 5, D), torch.randn(6, 7)                 # 2 images, 3 beams each
    z, alpha, info = att(x, att.precompute(x), h)
    rows = torch.arange(6) // 3
    assert torch.equal(info["s"], alpha.argmax(-1)) and torch.equal(z, x[rows, alpha.argmax(-1)])
    att.test_context = "expected"
    z, alpha, _ = att(x, att.precompute(x), h)
    assert torch.allclose(z, (alpha[:, :, None] * x[rows]).sum(1), atol=1e-6)


def test_no_attention_baseline_sees_only_the_mean():
    "The baseline's context is the mean annotation vector: permuting the locations changes nothing; no alpha."
    m = make("sat_none").eval()
    a, caps = torch.randn(2, 3, D), torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]])
    out = fwd(m, a, caps)
    assert "alpha" not in out
    assert torch.allclose(out["logits"], fwd(m, a[:, [2, 0, 1]], caps)["logits"], atol=1e-6)
    assert torch.allclose(fwd(m, a, caps)["logits"], fwd(m, a.mean(1, keepdim=True).expand(-1, 3, -1), caps)["logits"], atol=1e-6)


def test_worked_example_numbers():
    "The 2x2 worked example: quadrant means, e_i by hand, alpha = softmax(e), soft = sum alpha x, hard = x_s~ ~ alpha."
    torch.manual_seed(0)
    feats = torch.randn(16, D)                                   # a 4x4 feature map, rows first
    reg = quadrants(feats, (4, 4))
    fmap = feats.view(4, 4, D)
    want = torch.stack([fmap[:2, :2].mean((0, 1)), fmap[:2, 2:].mean((0, 1)), fmap[2:, :2].mean((0, 1)), fmap[2:, 2:].mean((0, 1))])
    assert torch.allclose(reg, want, atol=1e-6)
    att, h = SoftAttention(D, 7, 4), torch.randn(7)
    ex = worked_example(att, reg, h, draws=20000)
    e = torch.stack([att.w.weight[0] @ torch.tanh(att.W_a.weight @ x + att.W_a.bias + att.W_h.weight @ h) + att.w.bias[0] for x in reg])
    assert torch.allclose(ex["scores"], e, atol=1e-5)
    assert torch.allclose(ex["alpha"], torch.softmax(e, 0), atol=1e-6)
    assert torch.allclose(ex["soft"], (ex["alpha"][:, None] * reg).sum(0), atol=1e-6)
    assert torch.equal(ex["hard"], reg[ex["sample"]])
    assert ex["logp_sample"] == pytest.approx(ex["alpha"][ex["sample"]].log().item(), abs=1e-6)
    assert ex["entropy"] == pytest.approx(-(ex["alpha"] * ex["alpha"].log()).sum().item(), abs=1e-6)
    assert torch.allclose(ex["freq"], ex["alpha"], atol=0.015) and ex["freq"].sum().item() == pytest.approx(1)
    assert worked_example(att, reg, h, draws=20000)["sample"] == ex["sample"]   # seeded: the same draw every time
    hard = HardAttention(D, 7, 4); hard.load_state_dict(att.state_dict())     # a hard model's f_att works the same
    assert torch.allclose(worked_example(hard, reg, h, draws=100)["alpha"], ex["alpha"])
