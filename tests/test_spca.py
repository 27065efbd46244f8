"SPCA (Eq. 7-12), its five structures, the 1D-LSTM + SPCA attention and the 2D-latent-state LSTM, against direct computations."
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
    s = m.structure
    if s == "S": return V * MS(V)
    if s == "C": return V * MC(V)
    if s == "S||C": return V * (MC(V) * MS(V))
    if s == "C-S": V1 = V * MC(V); return V1 * MS(V1)
    V1 = V * MS(V); return V1 * MC(V1)


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
    def indexed(step, xs, memory, state):                   # the unroll before: a zero-filled (B, T, ...) gradient per step
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
    assert torch.equal(train(M.unroll), train(indexed))
