"Show-Attend-Tell soft attention: the module against a direct computation of the paper's equations."
import torch
import torch.nn.functional as F
from capbook.models import build, available
from capbook.sat import ShowAttendTell
from capbook.objectives import objective_for


def make(**kw):
    torch.manual_seed(0)
    m = build("sat_soft", vocab_size=11, feat_dim=6, grid=(2, 3), emb_dim=5, hidden_dim=7, att_dim=4, **kw)
    return m.eval()


def test_registered():
    assert "sat_soft" in available() and isinstance(make(), ShowAttendTell)


def test_step_matches_equations():
    m, B = make(), 3
    a = torch.randn(B, 6, 6)                      # (B, L, D), L = 2*3
    y = torch.tensor([1, 4, 7])                   # y_{t-1}
    memory, state = m.init_state({"feats": a})
    logits, new, aux = m.step(y, memory, state)
    # initial state: h0 = tanh(f_init,h(mean a)), c0 = tanh(f_init,c(mean a))
    abar = a.mean(1)
    h0 = torch.tanh(abar @ m.init_h.weight.T + m.init_h.bias); c0 = torch.tanh(abar @ m.init_c.weight.T + m.init_c.bias)
    assert torch.allclose(state["h"], h0) and torch.allclose(state["c"], c0)
    # e_ti = w^T tanh(W_a a_i + W_h h_{t-1}), alpha = softmax_i(e), beta = sigmoid(f_beta(h)), z = beta sum_i alpha a_i
    att = m.att
    e = torch.stack([torch.stack([att.w.weight[0] @ torch.tanh(att.W_a.weight @ a[b, i] + att.W_a.bias + att.W_h.weight @ h0[b])
                                  + att.w.bias[0] for i in range(6)]) for b in range(B)])
    alpha = torch.exp(e) / torch.exp(e).sum(1, keepdim=True)
    assert torch.allclose(aux["alpha"], alpha, atol=1e-6)
    beta = torch.sigmoid(h0 @ m.f_beta.weight.T + m.f_beta.bias)
    z = beta * (alpha[:, :, None] * a).sum(1)
    # LSTM gates with separate W (word), Z (context), U (hidden) blocks, order i, f, g, o as in nn.LSTMCell
    Ey = m.E.weight[y]
    Wx, U, b = m.lstm.weight_ih, m.lstm.weight_hh, m.lstm.bias_ih + m.lstm.bias_hh
    W, Z = Wx[:, :5], Wx[:, 5:]
    pre = Ey @ W.T + h0 @ U.T + z @ Z.T + b
    i, f, g, o = pre.chunk(4, 1)
    c = torch.sigmoid(f) * c0 + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    assert torch.allclose(new["c"], c, atol=1e-6) and torch.allclose(new["h"], h, atol=1e-6)
    # deep output: p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z z_t))  (dropout is off in eval mode)
    out = (Ey + h @ m.L_h.weight.T + z @ m.L_z.weight.T) @ m.L_o.weight.T + m.L_o.bias
    assert torch.allclose(logits, out, atol=1e-5)


def test_gate_off_and_penalty():
    m = make(gate=False)
    a = torch.randn(2, 6, 6)
    mem, st = m.init_state({"feats": a})
    _, _, aux = m.step(torch.tensor([1, 1]), mem, st)
    assert torch.equal(aux["beta"], torch.ones(2, 1))
    # doubly stochastic penalty: lambda * sum_i (1 - sum_t alpha_ti)^2, over real words only, / mean caption length
    m = make(penalty=2.0)
    caps = torch.tensor([[1, 5, 6, 2, 0], [1, 7, 2, 0, 0]])
    out = m({"feats": a, "caps": caps})
    loss, stats = objective_for(m).loss(out, {"caps": caps})
    mask = (caps[:, 1:] != 0).float()
    ds = ((1 - (out["alpha"] * mask[..., None]).sum(1)) ** 2).sum(1).mean() / mask.sum(1).mean()
    nll = F.cross_entropy(out["logits"].reshape(-1, 11), caps[:, 1:].reshape(-1), ignore_index=0)
    assert torch.allclose(loss, nll + 2.0 * ds) and abs(stats["doubly_stochastic"] - ds.item()) < 1e-6


def _sliced_scores(self, pre, h):
    "The scores with chunks taken by slicing (capbook before the split): the reference for the training-speed change."
    import capbook.attention as A
    B, L, At = pre.shape
    q, w = self.W_h(h).view(B, -1, 1, At), self.w.weight[0]
    n = max(1, A._CHUNK // (q.shape[1] * L * At))
    e = torch.cat([torch.sigmoid((pre[s:s + n, None] + q[s:s + n]).mul_(2)) @ w for s in range(0, B, n)])
    return (2 * e - w.sum() + self.w.bias).view(-1, L)


def test_split_once_trains_the_same_weights_bit_for_bit(monkeypatch):
    "The attention split once per batch (training's speed-up) gives the very same parameters as slicing at every word."
    import capbook.attention as A
    from capbook.attention import SoftAttention
    monkeypatch.setattr(A, "_CHUNK", 48)                     # 2 images per chunk: 4 chunks of a batch of 8
    torch.manual_seed(1)
    batches = [{"feats": torch.randn(8, 6, 6), "caps": torch.cat([torch.ones(8, 1, dtype=torch.long),
                torch.randint(3, 11, (8, 5)), torch.full((8, 1), 2)], 1)} for _ in range(4)]
    def train(scores):
        monkeypatch.setattr(SoftAttention, "scores", scores)
        m = make().train(); obj = objective_for(m); opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        torch.manual_seed(2)
        for b in batches:
            loss, _ = obj.loss(obj.outputs(m, b), b)
            opt.zero_grad(); loss.backward(); opt.step()
        return torch.cat([p.detach().flatten() for p in m.parameters()])
    ours, sliced = train(SoftAttention.scores), train(_sliced_scores)
    assert torch.equal(ours, sliced)
    assert not torch.equal(ours, torch.cat([p.detach().flatten() for p in make().parameters()]))   # it did train
