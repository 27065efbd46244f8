"SPCA (Eq. 7-12), its five structures, the 1D-LSTM + SPCA attention and the 2D-latent-state LSTM, against direct computations."
import re
import pytest
import torch
import torch.nn.functional as F
from capbook.models import build, available
from capbook.spca import SPCA, STRUCTURES, SPCAttention, conv_tiled, attention_weights

C, H, W = 4, 5, 6


def direct(m: SPCA, V, h):
    "Eq. 7-12 and §4.3.1 written out with F.conv2d on the concatenated F_t; h a (R, C, H, W) map."
    def MS(X):                                   # sigma(Conv2(ReLU(Conv1([X; h])))): (R, 1, H, W)
        Ft = torch.cat([X, h], 1)
        return torch.sigmoid(F.conv2d(F.relu(F.conv2d(Ft, m.conv1_s.weight, m.conv1_s.bias, padding=m.kernel // 2)),
                                      m.conv2_s.weight, m.conv2_s.bias, padding=m.kernel // 2))
    def MC(X):                                   # sigma(Conv2(ReLU(Conv1(AvgPool([X; h]))))): (R, C, 1, 1)
        f = torch.cat([X, h], 1).mean((2, 3), keepdim=True)
        return torch.sigmoid(F.conv2d(F.relu(F.conv2d(f, m.conv1_c.weight, m.conv1_c.bias)), m.conv2_c.weight, m.conv2_c.bias))
    def MSn(X):                                  # M^S rescaled to mean 1 over the map: M^S HW / sum M^S
        ms = MS(X)
        return ms * (ms.shape[-2] * ms.shape[-1]) / ms.sum((-2, -1), keepdim=True)
    s = m.structure
    if s == "S": return V * MSn(V)
    if s == "C": return V * MC(V)
    if s == "S||C": return V * (MC(V) * MSn(V))
    if s == "C-S": V1 = V * MC(V); return V1 * MSn(V1)
    V1 = V * MSn(V); return V1 * MC(V1)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_structures_match_equations(structure, kernel):
    torch.manual_seed(0)
    m = SPCA(C, structure, kernel, reduction=2, att_dim=3)
    V, h = torch.randn(2, C, H, W), torch.randn(2, C, H, W)
    ctx, weights, info = m(V, m.precompute(V), h)
    Ms, Mc = info["spatial"], info["channel"]
    assert (weights is None) == (Ms is None) and (weights is None or torch.equal(m.last, weights))
    assert torch.allclose(ctx, direct(m, V, h), atol=1e-6)
    assert (Ms is None) == (structure == "C") and (Mc is None) == (structure == "S")
    assert m.conv1_c.out_channels == 2 * C // 2 if m.has_channel else True
    # without the precomputed V half, and with beams: V per image broadcast over K = 3 rows of each image
    hK = torch.randn(6, C, H, W)
    ctxK, _, _ = m(V, None, hK)
    assert torch.allclose(ctxK, direct(m, V.repeat_interleave(3, 0), hK), atol=1e-6)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_tiled_vector_state_is_exact(structure):
    "A 1D state h (R, C) is the tiled map: the k^2-tap shortcut equals the convolution of the constant map."
    torch.manual_seed(1)
    m = SPCA(C, structure, 3, reduction=2, att_dim=3)
    V, h = torch.randn(2, C, H, W), torch.randn(2, C)
    ctx, _, _ = m(V, m.precompute(V), h)
    assert torch.allclose(ctx, direct(m, V, h[:, :, None, None].expand(-1, -1, H, W)), atol=1e-6)
    for k in (1, 3, 5, 7):
        w = torch.randn(3, C, k, k)
        assert torch.allclose(conv_tiled(h, w, (H, W)), F.conv2d(h[:, :, None, None].expand(-1, -1, H, W), w, padding=k // 2), atol=1e-5)


def test_kernel_1_is_position_wise():
    "With 1x1 kernels the spatial weight of a cell depends on that cell only (grid-based attention)."
    torch.manual_seed(2)
    m = SPCA(C, "S", 1, att_dim=3)
    V, h = torch.randn(1, C, H, W), torch.randn(1, C, H, W)
    Ms = m(V, None, h)[2]["spatial"]
    V2 = V.clone(); V2[..., 2, 3] += 5.0                      # change one cell
    Ms2 = m(V2, None, h)[2]["spatial"]
    changed = (Ms2 - Ms).abs()[0, 0] > 1e-7
    assert changed[2, 3] and changed.sum() == 1
    m3 = SPCA(C, "S", 3, att_dim=3)                            # a 3x3 kernel spreads to the 5x5 neighbourhood (two convs)
    a, b = m3(V, None, h)[2]["spatial"], m3(V2, None, h)[2]["spatial"]
    assert ((b - a).abs()[0, 0] > 1e-7).sum() > 1


def test_1d_attention_projects_tiles_and_pools():
    torch.manual_seed(3)
    att = SPCAttention(C, 7, (H, W), "S||C", 3, reduction=2, att_dim=3)
    a, h = torch.randn(2, H * W, C), torch.randn(2, 7)
    z, alpha, _ = att(a, att.precompute(a), h)
    V = a.transpose(1, 2).reshape(2, C, H, W)                 # annotation vectors (L, C) as the C x H x W map
    hp = (h @ att.proj.weight.T + att.proj.bias)[:, :, None, None].expand(-1, -1, H, W)   # tile(W_p h)
    assert torch.allclose(z, direct(att.spca, V, hp).mean((2, 3)), atol=1e-6)            # AvgPool(C_t)
    Ms = att.spca(V, None, hp)[2]["spatial"]
    assert torch.allclose(alpha, Ms.flatten(1) / Ms.flatten(1).sum(1, keepdim=True), atol=1e-6)
    assert torch.allclose(alpha.sum(1), torch.ones(2)) and attention_weights(None) is None


def test_latent2d_step_matches_equations():
    torch.manual_seed(4)
    assert {"lstm1d_spca", "lstm2d", "lstm2d_spca"} <= set(available())
    for name in ["lstm2d", "lstm2d_spca"]:
        m = build(name, 11, 6, (4, 4), channels=3, map_size=2, att_dim=2, reduction=2).eval()
        feats = torch.randn(2, 16, 6)
        memory, state = m.init_state({"feats": feats})
        fmap = feats.transpose(1, 2).reshape(2, 6, 4, 4)
        V = F.relu(m.img(F.avg_pool2d(fmap, 2)))                              # conv1x1 of the 2x2-pooled map
        assert torch.equal(state["H"], torch.zeros(2, 3, 2, 2))
        tok = torch.tensor([1, 5])
        logits, st, aux = m.step(tok, memory, state)
        e = m.word.weight[tok].view(2, 4, 10, 10)
        X = F.relu(F.conv2d(F.relu(F.conv2d(e, m.wconv1.weight, m.wconv1.bias)), m.wconv2.weight, m.wconv2.bias))
        img = V if name == "lstm2d" else direct(m.spca, V, state["H"])       # V, or SPCA's C_t from H_{t-1} = 0
        pre = (F.conv2d(state["H"], m.K_H.weight, m.K_H.bias, padding=1) + F.conv2d(X, m.K_X.weight, padding=1)
               + F.conv2d(img, m.K_V.weight, padding=1))
        i, f, o, g = pre.chunk(4, 1)
        Cn = torch.sigmoid(f) * 0 + torch.sigmoid(i) * F.relu(g)
        Hn = torch.sigmoid(o) * F.relu(Cn)
        assert torch.allclose(st["C"], Cn, atol=1e-6) and torch.allclose(st["H"], Hn, atol=1e-6)
        assert torch.allclose(logits, Hn.mean((2, 3)) @ m.out.weight.T + m.out.bias, atol=1e-6)
        assert ("alpha" in aux) == (name == "lstm2d_spca") and m.att_grid == (2, 2)


def test_1d_decoder_with_channel_only_spca_teacher_forces():
    "Channel-only SPCA gives no spatial map: teacher forcing leaves that extra out instead of stacking None (fuzz seed 9419)."
    torch.manual_seed(0)
    m = build("lstm1d_spca", 12, 4, (3, 3), structure="C", reduction=2).eval()
    out = m({"feats": torch.randn(2, 9, 4), "caps": torch.randint(4, 12, (2, 5))})
    assert out["logits"].shape == (2, 4, 12) and out.get("alpha") is None


def test_unrolled_word_maps_train_the_same_weights_as_indexing(monkeypatch):
    "Teacher forcing unrolls K_X * X_t with unbind (one stacked gradient, faster); the weights equal those of indexing xs[:, t], bit for bit."
    import capbook.models as M
    import capbook.spca as S
    from capbook.objectives import objective_for
    def indexed(step, xs, memory, state, lengths=None):     # the unroll before: a zero-filled (B, T, ...) gradient per step
        logits, extras = [], {}
        for t in range(xs.shape[1]):
            lg, state, aux = step(xs[:, t], memory, state)
            logits.append(lg)
            for k, v in aux.items():
                if v is not None: extras.setdefault(k, []).append(v)
        return {"logits": torch.stack(logits, 1), **{k: torch.stack(v, 1) for k, v in extras.items()}}
    torch.manual_seed(1)
    batches = [{"feats": torch.randn(5, 16, 6), "caps": torch.cat([torch.ones(5, 1, dtype=torch.long),
                torch.randint(3, 11, (5, 4)), torch.full((5, 1), 2)], 1)} for _ in range(3)]
    def train(unroll):
        monkeypatch.setattr(S, "unroll", unroll)
        torch.manual_seed(0)
        m = build("lstm2d_spca", 11, 6, (4, 4), channels=3, map_size=2, att_dim=2, reduction=2).train()
        obj, opt = objective_for(m), torch.optim.Adam(m.parameters(), lr=1e-2)
        for b in batches:
            loss, _ = obj.loss(obj.outputs(m, b), b)
            opt.zero_grad(); loss.backward(); opt.step()
        return torch.cat([p.detach().flatten() for p in m.parameters()])
    with M.plain_paths(): assert torch.equal(train(M.unroll), train(indexed))   # the plain path unrolls the maps (the fast one, word indices)


@pytest.mark.parametrize("name,structure,kernel", [("lstm2d", None, 3)] + [(n, s, k) for n in ("lstm2d_spca", "lstm1d_spca")
                                                                             for s in STRUCTURES for k in (1, 3, 5)])
def test_spca_fast_paths_compute_the_plain_equations(name, structure, kernel):
    "The SPCA models' fast paths (2D: the word table looked up per step, K_H and K_V as one convolution, the cell as one autograd node; 1D: the context's average without its map; both: 1x1 convolutions as linear maps, the shrinking batch) give the plain code's logits, maps and every gradient (float64, dropout 0), for every structure and kernel."
    from capbook.models import plain_paths
    torch.manual_seed(5)
    hp = dict(channels=3, map_size=3, att_dim=2, reduction=2) if "2d" in name else dict(emb_dim=8, hidden_dim=8, att_dim=4, reduction=2)
    hp["dropout"] = 0.0
    m = build(name, 11, 6, (6, 6), **hp, **({} if structure is None else {"structure": structure, "kernel": kernel})).double().train()
    caps = torch.zeros(5, 7, dtype=torch.long)
    for b, n in enumerate([5, 2, 4, 5, 1]):                                   # unequal lengths: the fast path's batch shrinks
        caps[b, 0], caps[b, 1:n + 1], caps[b, n + 1] = 1, torch.randint(3, 11, (n,)), 2
    batch = {"feats": torch.randn(5, 36, 6, dtype=torch.float64), "caps": caps}
    w = torch.randn(5, 6, 11, dtype=torch.float64)
    def run():
        m.zero_grad()
        out = m(batch)
        mask = (caps[:, 1:] != 0).double()[..., None]                        # ended rows: the fast path leaves zeros there
        loss = (out["logits"] * w * mask).sum() + ((out["alpha"] * mask).pow(2).sum() if "alpha" in out else 0)
        loss.backward()
        return out, {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    fast, gf = run()
    with plain_paths(): plain, gp = run()
    live = lambda v: v * (caps[:, 1:] != 0).view(5, 6, *[1] * (v.dim() - 2))   # the steps of captions not yet ended
    for k in plain: assert torch.allclose(live(fast[k]), live(plain[k]), atol=1e-12), k
    assert gf.keys() == gp.keys() and all(torch.allclose(gf[k], gp[k], atol=1e-10) for k in gp), [k for k in gp if not torch.allclose(gf[k], gp[k], atol=1e-10)]


def test_2d_cell_gradient_is_the_cells():
    "The fast path's cell writes its gradient out by hand: gradcheck against autograd's, through H_t alone and through both outputs."
    from capbook.spca import Cell2D
    torch.manual_seed(0)
    pre = torch.randn(3, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    C0 = torch.randn(3, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, c: Cell2D.apply(p, c), (pre, C0))
    assert torch.autograd.gradcheck(lambda p, c: Cell2D.apply(p, c)[0], (pre, C0))


def test_spatial_map_is_rescaled_to_mean_one():
    "M^S says where, not how much: C_t = V ⊗ M^S HW / sum M^S, so the 1D AvgPool is the M^S-weighted mean sum M^S V / sum M^S."
    torch.manual_seed(5)
    m = SPCA(C, "S", 3, att_dim=3)
    V, h = torch.randn(2, C, H, W), torch.randn(2, C, H, W)
    ctx, alpha, info = m(V, m.precompute(V), h)
    Ms = info["spatial"]                                                  # the sigmoid map (R, 1, H, W), not normalised
    assert torch.allclose(ctx, V * (Ms * H * W / Ms.sum((2, 3), keepdim=True)), atol=1e-6)
    with torch.no_grad(): m.conv2_s.bias += 4.0                          # a map that is on everywhere adds no gain
    ctx_on, _, info_on = m(V, None, h)
    assert info_on["spatial"].min() > 0.9 and torch.allclose(ctx_on.abs().mean(), V.abs().mean(), rtol=0.05)
    att = SPCAttention(C, 7, (H, W), "S", 3, att_dim=3)
    a, hq = torch.randn(2, H * W, C), torch.randn(2, 7)
    z, alpha, info = att(a, att.precompute(a), hq)
    w = info["spatial"].flatten(1)                                        # M^S over the H*W cells: (R, L)
    assert torch.allclose(z, (w[:, :, None] * a).sum(1) / w.sum(1, keepdim=True), atol=1e-6)
    assert torch.allclose(z, (alpha[:, :, None] * a).sum(1), atol=1e-6)    # = sum_i alpha_i a_i with the figures' weights


def test_lstm1d_spca_has_soft_attentions_gate_and_penalty():
    "1D-LSTM + SPCA is compared with Soft-Attention* (Table 4): same gate β and doubly stochastic penalty λ = 1 by default."
    from capbook.objectives import objective_for, DoublyStochastic
    torch.manual_seed(6)
    m, soft = build("lstm1d_spca", 12, 4, (3, 3), reduction=2), build("sat_soft", 12, 4, (3, 3))
    obj = objective_for(m)
    assert m.gate and soft.gate and isinstance(obj, DoublyStochastic) and obj.penalty == objective_for(soft).penalty == 1.0
    off = build("lstm1d_spca", 12, 4, (3, 3), reduction=2, gate=False, penalty=0.0)
    assert not off.gate and objective_for(off).penalty == 0.0
    b = {"feats": torch.randn(2, 9, 4), "caps": torch.cat([torch.ones(2, 1, dtype=torch.long), torch.randint(4, 12, (2, 4)),
                                                            torch.full((2, 1), 2)], 1)}
    m.eval()
    loss, stats = obj.loss(obj.outputs(m, b), b)                          # the penalty reads SPCA's normalised M^S
    assert "doubly_stochastic" in stats and stats["doubly_stochastic"] > 0
    mc = build("lstm1d_spca", 12, 4, (3, 3), structure="C", reduction=2).eval()   # no spatial map: cross-entropy only
    oc = objective_for(mc)
    out = oc.outputs(mc, b)
    loss, stats = oc.loss(out, b)
    assert "alpha" not in out and "doubly_stochastic" not in stats and loss.item() == pytest.approx(stats["nll"])


def test_profiles_size_the_2d_state():
    "The 2D state has c = 64 channels at the default profile (the trial in 03a: 32 cost CIDEr, a 14x14 map cost time), 16 at the smoke profile (the test suite's), Dai et al.'s 256 at the paper profile."
    from capbook.spca import SPCA_CHAPTER, SPCAParams
    from capbook.profiles import model_hparams
    got = {pr: SPCA_CHAPTER.resolve(SPCAParams(profile=pr)).channels for pr in ("smoke", "default", "paper")}
    assert got == {"smoke": 16, "default": 64, "paper": 256}
    assert SPCA_CHAPTER.resolve(SPCAParams(profile="paper", channels=8)).channels == 8
    hp = model_hparams("lstm1d_spca", SPCAParams())
    assert hp["gate"] is True and hp["penalty"] == 1.0 and "channels" not in hp
    assert model_hparams("lstm2d_spca", SPCA_CHAPTER.resolve(SPCAParams(profile="paper")))["channels"] == 256


@pytest.mark.slow                                                          # 60 training steps: 20 s
def test_1d_spatial_map_is_not_saturated_after_training(smoke):
    "Trained on the smoke data, the 1D decoder's M^S still tells cells apart (with M^S unnormalised it went to 1 everywhere)."
    from capbook.objectives import objective_for
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                                              # faster here than two threads on a shared CPU
    try: _train_and_check_map(smoke, objective_for)
    finally: torch.set_num_threads(threads)


def _train_and_check_map(smoke, objective_for, steps=60):
    torch.manual_seed(0)
    m = build("lstm1d_spca", len(smoke.vocab), smoke.feat_shape[1], smoke.grid)
    obj, opt = objective_for(m), torch.optim.Adam(m.parameters(), lr=4e-4)
    maps = []
    spatial = m.att.spca.spatial                                          # M^S as computed, on the map path and the pooled one
    m.att.spca.spatial = lambda *a: maps.append(spatial(*a)) or maps[-1]
    done, epoch = 0, 0
    while done < steps:
        for b in smoke.train.batches(64, epoch, 0):
            loss, _ = obj.loss(obj.outputs(m, b), b)
            opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0); opt.step()
            done += 1
            if done == steps: break
        epoch += 1
    maps.clear(); m.eval(); m.shrinks = False                            # every row at every step, so the maps stack
    with torch.no_grad(): m(next(iter(smoke.val.batches(64, 0, 0))))
    Ms = torch.stack([x.flatten(1) for x in maps], 1)                    # M^S of every step: (B, T, H*W)
    ratio = (Ms.max(-1).values / Ms.min(-1).values).mean().item()        # max/min over the map, averaged over steps
    print(f"M^S max/min after {steps} steps: {ratio:.3f}")
    assert ratio > 1.5, f"M^S is flat over the map: max/min {ratio:.3f}"


@pytest.mark.parametrize("structure", STRUCTURES)
def test_2d_spca_starts_near_the_identity(structure):
    "At initialisation the LSTM gets C_t ~ V (M~^S has mean 1, M^C ~ sigma(3)), not the quarter of V two sigmoids at 0.5 gave."
    torch.manual_seed(7)
    m = build("lstm2d_spca", 11, 128, (14, 14), structure=structure).eval()   # the default sizes: c = 32 on a 7x7 map
    memory, state = m.init_state({"feats": torch.rand(4, 196, 128)})
    V = memory["V"]
    ctx, _, info = m.spca(V, memory["pre"], state["H"])
    r = (ctx.abs().mean() / V.abs().mean()).item()
    assert 0.85 < r < 1.15, f"mean |C| / mean |V| = {r:.3f}"
    if info["channel"] is not None: assert info["channel"].min() > 0.8


def test_2d_decoding_with_distinct_word_maps_equals_plain():
    "A decoding step computes K_X * X once per distinct word of its beams (eval: no dropout); the beams, scores and maps equal the per-position code's."
    from capbook.decode import beam_search
    from capbook.models import plain_paths
    torch.manual_seed(3)
    m = build("lstm2d_spca", 11, 6, (4, 4), channels=3, map_size=2, att_dim=2, reduction=2).eval()
    a = torch.randn(3, 16, 6)
    with torch.no_grad():
        fast = beam_search(m, a, beam_size=3, max_len=6)
        with plain_paths(): plain = beam_search(m, a, beam_size=3, max_len=6)
    assert [c.tokens for c in fast] == [c.tokens for c in plain]
    for f, p in zip(fast, plain):
        assert abs(f.logprob - p.logprob) < 1e-4 and torch.allclose(f.alpha, p.alpha, atol=1e-5)


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_a_readers_kernel_run_is_placed_among_the_books_rows(monkeypatch):
    "`papermill nbs/03_spca.ipynb out.ipynb -p kernel 5` ends with where its score falls against the book's published rows that differ from it in one parameter (3x3 with its seeds' interval, 5x5 itself); a run on other data gets no such lines."
    import dataclasses
    from pathlib import Path
    from capbook.profiles import chapter
    from capbook.runner import book_context
    from capbook.records import records
    monkeypatch.setenv("CAPBOOK_HOME", str(Path(__file__).resolve().parents[1]))   # the checkout's published book
    ch = chapter("03_spca")
    k5 = next(r for r in records("default", "03_spca") if r["_dir"].endswith("/03_spca-k5"))
    p = ch.resolve(ch.params(profile="default", kernel=5))
    lines = book_context("03_spca", p, {**k5, "metrics": {**k5["metrics"], "CIDEr": 0.5}})
    assert lines[0].startswith("This run's test CIDEr (x100, beam 3): 50.0.")
    three = next(line for line in lines if "[kernel=3; this run 5]" in line)
    assert "95% interval of the mean [" in three and "this run is below their range" in three
    assert any("(S||C, 5×5) [the same parameters]" in line for line in lines)
    assert not any("none" in line.split("[")[0] for line in lines[1:])              # the 2D baseline differs in two: structure and kernel
    other = {**k5, "data": {**k5["data"], "fingerprint": "another data set"}}
    assert book_context("03_spca", p, other) == []
    assert book_context("03_spca", dataclasses.replace(p, profile="smoke"), k5) == []   # a profile the checkout did not publish


def test_the_chapter_states_its_2d_trial_as_published():
    "03_spca's table of the 2D state's trial says what figures/table_spca_trial.csv holds (a regenerated trial that moves a number fails here until the prose follows)."
    import pandas as pd
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    t = pd.read_csv(root / "figures" / "table_spca_trial.csv").set_index("channels", append=True)
    text = (root / "nbs" / "03_spca.py").read_text()
    rows = {r.split("|")[1].strip(" *"): [c.strip(" *") for c in r.split("|")[2:-1]]
            for r in re.findall(r"^# (\| (?:\*\*)?(?:32|64) channels.*\|)$", text, re.M)}
    assert len(rows) == 3, rows
    per = lambda v: "—" if pd.isna(v) else f"{v:.2f}"
    for (_, r), (name, got) in zip(t.iterrows(), rows.items()):
        ci = r["CIDEr 95% CI"] if r["seeds"] > 1 else "(one seed)"
        assert got[:5] == [str(r["seeds"]), f"{r['train min']:.1f}", f"{r['captions / s']:.0f}", f"{r['CIDEr']:.1f} {ci}",
                           f"{r['F1 all']:.1f} ({r['F1 relations']:.1f}, {r['F1 counts']:.1f})"], name
        assert got[5].startswith(per(r["CIDEr per extra minute"])), name
        if not pd.isna(r["Δ CIDEr"]) and r["seeds"] > 1: assert f"+{r['Δ CIDEr']:.1f} over 32 channels: {r['verdict']}" in got[5]
    m = t["train min"].to_numpy()
    assert f"cost {m[1] / m[0]:.1f}× the minutes" in text and f"cost {m[2] / m[0]:.1f}× the" in text.replace("\n# ", " ")
