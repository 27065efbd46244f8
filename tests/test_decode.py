"Greedy and batched beam search through the one step interface."
import torch
from capbook.models import build
from capbook.decode import greedy, beam_search


def model(seed=0, V=13):
    torch.manual_seed(seed)
    m = build("sat_soft", vocab_size=V, feat_dim=8, grid=(3, 3), emb_dim=8, hidden_dim=16, att_dim=8)
    with torch.no_grad():
        m.L_o.bias[2] += 0.1           # make <end> likely enough that captions finish at different lengths
    return m.eval()


def test_beam_one_is_greedy():
    m = model(); f = torch.randn(6, 9, 8)
    g, b = greedy(m, f, max_len=12), beam_search(m, f, beam_size=1, max_len=12)
    for x, y in zip(g, b):
        assert x.tokens == y.tokens and abs(x.logprob - y.logprob) < 1e-4
        assert torch.allclose(x.alpha, y.alpha)


def test_batched_equals_per_image_loop():
    m = model(3); f = 3 * torch.randn(7, 9, 8)
    batched = beam_search(m, f, beam_size=3, max_len=10)
    lens = set()
    for i in range(7):
        one = beam_search(m, f[i:i + 1], beam_size=3, max_len=10)[0]
        assert one.tokens == batched[i].tokens
        assert abs(one.logprob - batched[i].logprob) < 1e-4
        assert one.alpha.shape == batched[i].alpha.shape == (len(one.tokens), 9)
        assert torch.allclose(one.alpha, batched[i].alpha, atol=1e-5)
        lens.add(len(one.tokens))
    assert len(lens) > 1           # the batch mixed finished and unfinished beams


def test_beam_not_worse_than_greedy_and_respects_limits():
    m = model(2); f = torch.randn(5, 9, 8)
    g, b = greedy(m, f, max_len=6), beam_search(m, f, beam_size=4, max_len=6)
    for x, y in zip(g, b):
        assert y.logprob >= x.logprob - 1e-5
        assert len(y.tokens) <= 6 and all(t not in (0, 1, 2) for t in y.tokens)


def test_pad_captions_and_teacher_forced_round_trip():
    from capbook.decode import pad_captions, teacher_forced
    m = model(1); f = torch.randn(4, 9, 8)
    caps = beam_search(m, f, beam_size=2, max_len=8)
    seqs = [[m.start, *c.tokens, m.end] for c in caps]
    t = pad_captions(seqs, 10)
    assert t.shape == (4, 10) and t.dtype == torch.long
    for s, row in zip(seqs, t.tolist()):
        assert row[:len(s)] == s and all(x == 0 for x in row[len(s):])
    assert pad_captions([[5] * 12], 10).tolist() == [[5] * 10]          # longer than `length`: cut, not an error
    tf = teacher_forced(m, {"feats": f, "caps": t})                                         # the decoder's own captions read back
    for c, r in zip(caps, tf):
        assert r.tokens == c.tokens and abs(r.logprob - c.logprob) < 1e-4
