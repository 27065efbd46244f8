"The baselines chapter: every model's equations against a direct computation, beam scores, region masks, the chapter's parameters, and the plan that lets any assembly notebook read any chapter's runs."
import dataclasses
import pytest
import torch
import torch.nn.functional as F
from capbook.baselines import BASELINES, BaselineParams, SCAttention, baseline_records
from capbook.core import CapbookError
from capbook.decode import beam_search, pad_captions
from capbook.models import build, spec
from capbook.profiles import model_hparams
from capbook.records import record_stage as stage

V, D, GRID = 13, 6, (2, 3)
L = GRID[0] * GRID[1]


def make(name, **kw):
    torch.manual_seed(0)
    hp = dict(d_model=16, heads=2, d_hidden=32) if name == "ct" else dict(emb_dim=5, hidden_dim=7, att_dim=4)
    return build(name, V, D, GRID, **{**hp, **kw}).eval()


def lstm_cell(x, h, c, cell):
    "i, f, g, o of nn.LSTMCell written out: gates = W x + U h + b."
    i, f, g, o = (x @ cell.weight_ih.T + cell.bias_ih + h @ cell.weight_hh.T + cell.bias_hh).chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def additive(att, a, q):
    "e_i = w^T tanh(W_a a_i + b + W_h q) + b_w, alpha = softmax(e), one image at a time: a (B, L, D), q (B, n)."
    e = torch.stack([torch.stack([att.w.weight[0] @ torch.tanh(att.W_a.weight @ a[b, i] + att.W_a.bias + att.W_h.weight @ q[b])
                                  + att.w.bias[0] for i in range(a.shape[1])]) for b in range(len(a))])
    alpha = torch.softmax(e, 1)
    return alpha, (alpha[:, :, None] * a).sum(1)


def test_every_baseline_is_registered():
    from capbook.models import available
    assert set(BASELINES) <= set(available())
    assert spec("ct").preset == {"enc_layers": 0, "dec_layers": 6, "tau": "standard"}
    assert spec("nic").preset == {"image_input": "first"} and spec("lstm").preset == {"image_input": "every"}


def test_show_and_tell_feeds_the_image_once():
    m, a, y = make("nic"), torch.randn(3, L, D), torch.tensor([1, 4, 7])
    mem, st = m.init_state({"feats": a})
    # x_{-1} = W_I mean(a); (h_{-1}, c_{-1}) = LSTM(x_{-1}, 0, 0)
    zero = torch.zeros(3, 7)
    h, c = lstm_cell(a.mean(1) @ m.W_I.weight.T + m.W_I.bias, zero, zero, m.lstm)
    assert mem == {} and torch.allclose(st["h"], h, atol=1e-6) and torch.allclose(st["c"], c, atol=1e-6)
    logits, new, _ = m.step(y, mem, st)
    # x_t = W_e S_t; p_{t+1} = softmax(W_o h_t)
    h, c = lstm_cell(m.E.weight[y], h, c, m.lstm)
    assert torch.allclose(new["h"], h, atol=1e-6) and torch.allclose(logits, h @ m.W_o.weight.T + m.W_o.bias, atol=1e-5)


def test_lstm_feeds_the_mean_image_with_every_word():
    m, a, y = make("lstm"), torch.randn(3, L, D), torch.tensor([1, 4, 7])
    mem, st = m.init_state({"feats": a})
    vg = torch.relu(a.mean(1) @ m.W_I.weight.T + m.W_I.bias)                   # v^g = ReLU(W_b a^g)
    assert torch.allclose(mem["vg"], vg) and not st["h"].any() and not st["c"].any()
    logits, new, _ = m.step(y, mem, st)
    h, _ = lstm_cell(torch.cat([m.E.weight[y], vg], 1), st["h"], st["c"], m.lstm)   # x_t = [w_t; v^g]
    assert torch.allclose(logits, h @ m.W_o.weight.T + m.W_o.bias, atol=1e-5)


def test_att2in_is_its_equations():
    m, a, y, n = make("att2in"), torch.randn(3, L, D), torch.tensor([1, 4, 7]), 7
    mem, st = m.init_state({"feats": a})
    h0, c0 = torch.randn(3, n), torch.randn(3, n)
    logits, new, aux = m.step(y, mem, {"h": h0, "c": c0})
    alpha, I = additive(m.att, a, h0)                                           # attention on h_{t-1}
    x = m.E.weight[y]
    Wx, bx, Wh, WcI = m.W_x.weight, m.W_x.bias, m.W_h.weight, m.W_cI.weight
    pre = lambda k: x @ Wx[k * n:(k + 1) * n].T + bx[k * n:(k + 1) * n] + h0 @ Wh[k * n:(k + 1) * n].T
    i, f, o = torch.sigmoid(pre(0)), torch.sigmoid(pre(1)), torch.sigmoid(pre(2))
    # phi = maxout of two pieces, the image only in the cell input
    u1, u2 = pre(3) + I @ WcI[:n].T, pre(4) + I @ WcI[n:].T
    c = i * torch.maximum(u1, u2) + f * c0
    h = o * torch.tanh(c)
    assert torch.allclose(aux["alpha"], alpha, atol=1e-6)
    assert torch.allclose(new["c"], c, atol=1e-5) and torch.allclose(new["h"], h, atol=1e-5)
    assert torch.allclose(logits, h @ m.W_s.weight.T + m.W_s.bias, atol=1e-5)
    # the gates i, f, o do not read the image: another image changes c_t only through the maxout's cell input
    other = m.step(y, m.init_state({"feats": torch.randn(3, L, D)})[0], {"h": h0, "c": c0})[1]
    assert not torch.allclose(other["c"], new["c"])


@pytest.mark.parametrize("order", ["C-S", "S-C"])
def test_sca_cnn_attention_is_eq_4_and_5(order):
    torch.manual_seed(1)
    att, C, d = SCAttention(D, 7, 4, order).eval(), D, 7
    Vmap, h = torch.randn(2, L, C), torch.randn(2, d)

    def channel(vbar, h):                       # Eq. 5, channel by channel: b_c = tanh(W_c v_c + b_c + W_hc h)
        b = torch.stack([torch.tanh(att.W_c * vbar[j] + att.b_c[:, 0] + att.W_hc.weight @ h) for j in range(C)], 1)   # (k, C)
        return torch.softmax(att.W_i_c.weight[0] @ b + att.W_i_c.bias, 0)

    def spatial(Vp, h):                         # Eq. 4, region by region: a_i = tanh(W_s v'_i + b_s + W_hs h)
        s = torch.stack([att.W_i_s.weight[0] @ torch.tanh(att.W_s.weight @ Vp[i] + att.W_s.bias + att.W_hs.weight @ h)
                         + att.W_i_s.bias[0] for i in range(L)])
        return torch.softmax(s, 0)

    z, alpha, info = att(Vmap, att.precompute(Vmap), h)
    for b in range(2):
        if order == "C-S":
            beta = channel(Vmap[b].mean(0), h[b])                      # beta = Phi_c(h, V)
            al = spatial(Vmap[b] * C * beta, h[b])                     # alpha = Phi_s(h, f_c(V, C beta))
        else:
            al = spatial(Vmap[b], h[b])                                # alpha = Phi_s(h, V)
            beta = channel((Vmap[b] * al[:, None]).mean(0), h[b])      # beta = Phi_c(h, f_s(V, alpha))
        assert torch.allclose(info["channel"][b], beta, atol=1e-6) and torch.allclose(alpha[b], al, atol=1e-6)
        assert torch.allclose(z[b], (al[:, None] * Vmap[b] * C * beta).sum(0), atol=1e-5)   # X = sum_i alpha_i (C beta ⊙ v_i)
    # on Show-Attend-Tell's decoder, without its gate and penalty
    m = make("sca_cnn", order=order)
    assert isinstance(m.att, SCAttention) and m.f_beta is None and m.cfg.penalty_value == 0


def test_sca_cnn_context_is_at_the_scale_of_a_feature():
    "β sums to 1 over C channels; the authors' code scales it by C, so the context is not 1/C of a feature."
    torch.manual_seed(0)
    att = SCAttention(128, 7, 4).eval()
    V, h = torch.rand(3, L, 128), torch.randn(3, 7)
    z, alpha, _ = att(V, att.precompute(V), h)
    plain = torch.bmm(alpha[:, None], V)[:, 0]                       # sum_i alpha_i v_i: the feature's scale
    ratio = float(z.detach().abs().mean() / plain.detach().abs().mean())
    assert 0.5 < ratio < 2, ratio                                     # it was about 1/128


def test_up_down_is_its_equations():
    m, a, y, n = make("updown"), torch.randn(3, L, D), torch.tensor([1, 4, 7]), 7
    mem, st = m.init_state({"feats": a})
    s = {k: torch.randn(3, n) for k in ("h1", "c1", "h2", "c2")}
    logits, new, aux = m.step(y, mem, s)
    # x^1 = [h^2_{t-1}; v̄; W_e Π_t]; h^1 = LSTM^1(x^1)
    h1, c1 = lstm_cell(torch.cat([s["h2"], a.mean(1), m.W_e.weight[y]], 1), s["h1"], s["c1"], m.att_lstm)
    # alpha = softmax(w_a^T tanh(W_va v_i + W_ha h^1_t)) on the current h^1; v̂ = sum alpha v
    alpha, v_hat = additive(m.att, a, h1)
    # x^2 = [v̂; h^1]; h^2 = LSTM^2(x^2); p = softmax(W_p h^2 + b_p)
    h2, c2 = lstm_cell(torch.cat([v_hat, h1], 1), s["h2"], s["c2"], m.lang_lstm)
    assert torch.allclose(new["h1"], h1, atol=1e-6) and torch.allclose(aux["alpha"], alpha, atol=1e-6)
    assert torch.allclose(new["h2"], h2, atol=1e-5) and torch.allclose(new["c2"], c2, atol=1e-5)
    assert torch.allclose(logits, h2 @ m.W_p.weight.T + m.W_p.bias, atol=1e-5)
    assert all(not v.any() for v in st.values())                                # states start at zero


@pytest.mark.parametrize("name", ["updown", "att2in", "nic"])
def test_padded_regions_change_nothing(name):
    "Bottom-up regions of variable number: padding rows, masked, get no attention and leave the captions' scores unchanged."
    m, a = make(name), torch.randn(2, L, D)
    caps = torch.tensor([[1, 4, 5, 6, 2], [1, 7, 2, 0, 0]])
    padded = torch.cat([a, 50 * torch.randn(2, 3, D)], 1)
    mask = torch.cat([torch.ones(2, L, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.bool)], 1)
    out = m({"feats": a, "caps": caps})
    out_p = m({"feats": padded, "caps": caps, "feat_mask": mask})
    assert torch.allclose(out["logits"], out_p["logits"], atol=1e-5)
    if "alpha" in out_p: assert not out_p["alpha"][..., L:].any()


def test_ct_is_the_books_transformer_with_six_decoder_blocks_and_no_encoder():
    from capbook.ssa import SpatialTransformer
    m = make("ct")
    assert isinstance(m, SpatialTransformer) and len(m.enc) == 0 and len(m.dec) == 6
    assert all(l.inter.tau == "standard" and l.self_att.tau == "standard" for l in m.dec)
    with pytest.raises(CapbookError, match="fixes enc_layers=0"):
        build("ct", V, D, GRID, enc_layers=2)


@pytest.mark.parametrize("name", BASELINES)
def test_beam_scores_are_teacher_forced_log_probabilities(name):
    "The one beam search on every baseline: a returned caption's score is the model's own log-probability of it."
    m, a = make(name), torch.randn(3, L, D)
    caps = beam_search(m, a, beam_size=3, max_len=6)
    toks = pad_captions([[m.start, *c.tokens, m.end] for c in caps], 8)
    with torch.no_grad(): lp = F.log_softmax(m({"feats": a, "caps": toks})["logits"], -1)
    for b, c in enumerate(caps):
        ys = [*c.tokens, m.end]                                                 # <end> is scored, forced at max_len
        want = sum(lp[b, t, w].item() for t, w in enumerate(ys))
        assert abs(c.logprob - want) < 1e-3, (name, c.tokens)


def test_chapter_parameters():
    "The model's own dropout when none is given; the transformer's widths only reach CT; unknown models stop in one line."
    p = BaselineParams(profile="smoke", model="ct", d_model=32, d_hidden=64)
    assert model_hparams("ct", p) == {"d_model": 32, "d_hidden": 64}                  # heads None: the profile's
    assert model_hparams("ct", dataclasses.replace(p, heads=2)) == {"d_model": 32, "heads": 2, "d_hidden": 64}
    assert "dropout" not in model_hparams("updown", p) and build("updown", V, D, GRID).drop.p == 0.5
    assert model_hparams("updown", dataclasses.replace(p, dropout=0.2))["dropout"] == 0.2
    from capbook.runner import run_chapter
    with pytest.raises(CapbookError, match="parameter model='vgg' is invalid: allowed values are 'nic', 'lstm'"):
        run_chapter("06_baselines", BaselineParams(profile="smoke", model="vgg"))


def test_stage_of_a_record():
    rec = {"metrics": {"CIDEr": 1.0}, "timings": {"train_s": 5.0, "images_per_s": 9.0}, "best_epoch": 2}
    assert stage(rec)["metrics"] == {"CIDEr": 1.0} and stage(rec)["train_s"] == 5.0
    with pytest.raises(CapbookError, match="no self-critical stage"):
        stage(rec, "scst")
    rec["stages"] = {"xe": {"metrics": {"CIDEr": 0.5}}, "scst": {"metrics": {"CIDEr": 0.7}}}
    assert stage(rec, "scst")["metrics"]["CIDEr"] == 0.7 and stage(rec)["metrics"]["CIDEr"] == 0.5


def test_baseline_records_stop_on_other_data(monkeypatch):
    import capbook.records as B
    steps = {("b", ""): B.Step("06_baselines", {"profile": "smoke"}), ("b", "nic"): B.Step("06_baselines", {}, "nic")}
    recs = {("b", ""): {"data": {"fingerprint": "aaa"}}, ("b", "nic"): {"data": {"fingerprint": "aaa"}}}
    monkeypatch.setattr(B, "compared_runs", lambda profile, wanted: (steps, recs))
    assert set(baseline_records("smoke", "aaa")) == {"", "nic"}
    with pytest.raises(CapbookError, match="trained on other data"):
        baseline_records("smoke", "bbb")


def test_plan_runs_every_chapter_before_any_assembly_notebook():
    "An assembly notebook may tabulate a later chapter's runs (SPCA's Table 4 reads the baselines): they run first, and feed its key."
    from capbook.plan import plan, upstream_of
    steps = plan("smoke")
    names = [s.name for s in steps]
    last_run = max(i for i, s in enumerate(steps) if s.notebook in ("02_show_attend_tell", "06_baselines"))
    assert names[0] == "index" and names.index("02a_soft_vs_hard") > last_run and names.index("01_dataset") > last_run
    up = {s.name: [u.name for u in upstream_of(s, steps)] for s in steps}
    assert "06_baselines-nic" in up["02a_soft_vs_hard"] and "06_baselines-sca-cnn" in up["03a_spca_tables"]
    assert "02_show_attend_tell" in up["04a_ssa_tables"] and "05_glied" in up["06a_baselines_tables"]
    assert up["06_baselines"] == [] and up["03_spca-1d"] == []                 # a training run reads no other run
