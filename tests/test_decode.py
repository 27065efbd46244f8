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


def test_a_sample_that_never_ends_is_cut_not_forced():
    "sample draws at most max_len tokens; a row without <end> by then is cut: no forced <end>, no log-probability for one."
    from capbook.decode import sample
    m = model()
    with torch.no_grad(): m.L_o.bias[m.end] = -30.0               # <end> all but impossible
    s = sample(m, torch.randn(4, 9, 8), n=3, temperature=1.0, max_len=6)
    assert s.tokens.shape == (12, 6) and not (s.tokens == m.end).any() and s.mask.eq(1).all()
    assert (s.logprobs > -15).all(), s.logprobs.min()              # every term is a word the policy drew


def test_a_forced_end_carries_no_log_probability_and_no_gradient():
    "Under end_by a sample that hits the cap ends with a forced <end>: mask 0, log-probability 0, and the self-critical loss's gradient is that of the chosen words alone, computed here by hand from teacher forcing."
    import torch.nn.functional as F
    from capbook.decode import sample
    m = model(); f = torch.randn(3, 9, 8)
    with torch.no_grad(): m.L_o.bias[m.end] = -30.0               # every sample runs to the cap
    torch.manual_seed(1)
    s = sample(m, f, n=2, temperature=1.0, max_len=5, end_by=True, policy=True)      # as self-critical training samples
    assert s.tokens.shape == (6, 5) and (s.tokens[:, -1] == m.end).all() and not (s.tokens[:, :-1] == m.end).any()
    assert s.mask.tolist() == [[1.0] * 4 + [0.0]] * 6 and s.logprobs[:, -1].eq(0).all()
    adv = torch.tensor([0.5, -1.0, 2.0, 0.3, -0.2, 1.1])
    # the self-critical loss, -(r - b) sum_t log pi(w_t) per chosen word (capbook.objectives.SelfCritical.loss)
    loss = -(adv[:, None] * s.logprobs * s.mask).sum() / s.mask.sum()
    got = torch.autograd.grad(loss, m.L_o.bias)[0]
    # by hand: the same words read back under teacher forcing, log pi(w_t | w_<t) for the 4 chosen words of each row
    caps = torch.cat([torch.full((6, 1), m.start), s.tokens[:, :4]], 1)
    logits = m({"feats": f.repeat_interleave(2, 0), "caps": torch.cat([caps, torch.zeros(6, 1, dtype=torch.long)], 1)})["logits"][:, :4]
    z = logits.detach().float().clone()
    z[..., m.start] = z[..., m.pad] = float("-inf")                               # the policy: what the sampler may draw
    p = F.softmax(z, -1)                                                          # pi: (6, 4, V)
    onehot = F.one_hot(s.tokens[:, :4], p.shape[-1]).float()
    # d/d bias of -adv log pi_w = -adv (onehot(w) - pi), over 24 chosen words; 0 at <start> and <pad>
    expect = -(adv[:, None, None] * (onehot - p)).sum((0, 1)) / 24
    assert torch.allclose(got, expect, atol=1e-5), (got - expect).abs().max()
    assert got[m.start] == 0 and got[m.pad] == 0
    assert abs(got[m.end].item() - (adv[:, None] * p[..., m.end]).sum().item() / 24) < 1e-6   # <end>: only its share of each softmax


def test_with_length_norm_finished_beams_leave_the_beam():
    """With alpha > 0 a finished caption leaves the beam for the pool and its slot searches on: here "a <end>" and
    "a d <end>" finish early with high summed log-probability, and only a search that keeps its K slots live finds
    "b c e f <end>", whose mean log-probability per token is the best of every caption (found by enumeration)."""
    import itertools
    from capbook.models import CaptionModel
    from capbook.decode import teacher_forced, pad_captions
    P = {1: {3: .7, 4: .3}, 3: {2: .55, 6: .45}, 6: {2: 1.0}, 4: {5: 1.0}, 5: {7: 1.0}, 7: {8: 1.0}, 8: {2: 1.0}}

    class Chain(CaptionModel):
        def __init__(self):
            super().__init__(9)
            self.table = torch.full((9, 9), -60.0)
            for prev, nxt in P.items():
                for w, p in nxt.items(): self.table[prev, w] = float(torch.tensor(p).log())
        def init_state(self, batch): return {}, {"t": torch.zeros(len(batch["feats"]), dtype=torch.long)}
        def step(self, tokens, memory, state): return self.table[tokens], state, {}

    m, f = Chain(), torch.zeros(1, 1, 1)
    words = [w for w in range(9) if w not in (m.pad, m.start, m.end)]
    caps = [list(c) for L in range(6) for c in itertools.product(words, repeat=L)]
    tf = teacher_forced(m, {"feats": f.expand(len(caps), -1, -1), "caps": pad_captions([[1, *c, 2] for c in caps], 8)})
    best = max(tf, key=lambda c: c.logprob / (len(c.tokens) + 1))
    assert best.tokens == [4, 5, 7, 8]
    got = beam_search(m, f, beam_size=2, max_len=6, length_norm=1.0)[0]
    assert got.tokens == best.tokens and abs(got.logprob - best.logprob) < 1e-4
    assert beam_search(m, f, beam_size=2, max_len=6)[0].tokens == [3]        # alpha = 0: the papers' rule, unchanged
