"The training protocol's parts in the one trainer: evaluations within an epoch, the plateau schedule, weight averaging, and exact resume with all three."
from types import SimpleNamespace
import numpy as np
import pytest
import torch
from capbook import train as T
from capbook.core import load_torch
from capbook.data import CaptionData, Vocab
from capbook.models import build
from capbook.train import TrainConfig, WeightAverage, fit

CAPS = [["a", "red", "circle"], ["two", "blue", "stars"]]
VOCAB = Vocab.build(CAPS, min_count=1)


def split(n, seed):
    y = np.random.default_rng(seed).integers(0, 2, n)
    f = np.random.default_rng(seed + 1).standard_normal((n, 4, 8)).astype(np.float16); f[:, :, 0] = 4 * y[:, None] - 2
    return CaptionData(f, [f"{i}.png" for i in range(n)], [[CAPS[k]] for k in y], VOCAB, max_len=5)


PREP = SimpleNamespace(train=split(32, 0), val=split(8, 10), vocab=VOCAB, feat_shape=(4, 8), grid=(2, 2))


def model():
    torch.manual_seed(0)
    return build("sat_soft", len(VOCAB), 8, (2, 2), emb_dim=16, hidden_dim=32, att_dim=16)


def cfg(**kw):
    return TrainConfig(**{"epochs": 3, "batch_size": 8, "lr": 1e-2, "val_beam": 1, "metric": "CIDEr", "device": "cpu",
                          "progress": False, "precision": "fp32", **kw})


def scripted(monkeypatch, scores):
    "Validation returns these CIDEr values in turn (the trainer's decisions, not the model, under test)."
    it = iter(scores)
    monkeypatch.setattr(T, "val_score", lambda *a, **k: {"BLEU-1": 0.0, "BLEU-2": 0.0, "BLEU-3": 0.0, "BLEU-4": 0.0, "CIDEr": next(it)})


def test_evaluations_are_spread_over_each_epoch(tmp_path):
    r = fit(model(), PREP, cfg(evals_per_epoch=2), tmp_path / "ckpt", log=lambda s: None)
    assert [h["epochs"] for h in r.history] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]     # 4 batches an epoch: after 2 and 4
    assert [h["epoch"] for h in r.history] == [0, 0, 1, 1, 2, 2]
    assert [h["step"] for h in r.history] == [2, 4, 6, 8, 10, 12]
    best = max(r.history, key=lambda h: h["val CIDEr"])
    assert (r.best_at, r.best_epoch, r.best_score) == (best["epochs"], best["epoch"], best["val CIDEr"])
    assert r.captions == 3 * 32


def test_plateau_decays_after_lr_patience_and_stops_after_patience(monkeypatch, tmp_path):
    scripted(monkeypatch, [0.5, 0.6, 0.6, 0.55, 0.7, 0.1, 0.2, 0.3, 0.4, 0.9])
    lines = []
    r = fit(model(), PREP, cfg(epochs=10, schedule="plateau", lr_gamma=0.5, lr_patience=2, patience=4, evals_per_epoch=1),
            tmp_path / "ckpt", log=lines.append)
    # evaluations: 0.5 0.6 | 0.6 0.55 (2 without: decay) | 0.7 (better) | 0.1 0.2 (decay) 0.3 0.4 (4 without: stop)
    assert [round(h["lr"] / 1e-2, 4) for h in r.history] == [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert len(r.history) == 9 and r.best_score == 0.7 and r.best_epoch == 4
    assert sum("learning rate x0.5" in s for s in lines) == 2 and "early stop" in lines[-1]


def test_weight_average_is_what_is_validated_and_kept(monkeypatch, tmp_path):
    m = model()
    seen = []
    real = T.val_score
    def spy(model, *a, **k):
        seen.append([p.detach().clone() for p in model.parameters()])
        return real(model, *a, **k)
    monkeypatch.setattr(T, "val_score", spy)
    r = fit(m, PREP, cfg(epochs=2, ema=0.9), tmp_path / "ckpt", log=lambda s: None)
    last = load_torch(tmp_path / "ckpt" / "last.pt")
    live = list(last["model"].values())
    avg = last["ema"]["avg"]
    assert all(torch.equal(a, b) for a, b in zip(seen[-1], [a for a in avg]))            # validated: the average
    assert not all(torch.equal(a, b) for a, b in zip(live, avg))                         # ... not the live weights
    best = load_torch(tmp_path / "ckpt" / "best.pt")["model"]
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), best.values()))
    kept = seen[int(r.best_epoch)]
    assert all(torch.equal(a, b) for a, b in zip(kept, best.values()))


def test_weight_average_formula():
    lin = torch.nn.Linear(3, 1, bias=False); avg = WeightAverage(lin, 0.5)
    w = [lin.weight.detach().clone()]
    for t in range(1, 6):
        with torch.no_grad(): lin.weight.add_(t)
        avg.update(); d = min(0.5, (1 + t) / (10 + t))
        w.append(d * w[-1] + (1 - d) * lin.weight.detach())
    with avg.swapped(): assert torch.allclose(lin.weight, w[-1])


class Killed(Exception):
    pass


def test_a_run_killed_at_an_evaluation_resumes_to_the_same_numbers(monkeypatch, tmp_path):
    "With evaluations inside epochs, the plateau schedule and weight averaging, a run stopped at its fourth evaluation resumes to the uninterrupted run's history and weights."
    c = cfg(epochs=4, evals_per_epoch=2, schedule="plateau", lr_patience=1, patience=6, ema=0.8)
    full_m = model(); full = fit(full_m, PREP, c, tmp_path / "full", log=lambda s: None)
    real, calls = T.val_score, [0]
    def dies(*a, **k):
        calls[0] += 1
        if calls[0] == 4: raise Killed()
        return real(*a, **k)
    monkeypatch.setattr(T, "val_score", dies)
    with pytest.raises(Killed): fit(model(), PREP, c, tmp_path / "killed", log=lambda s: None)
    monkeypatch.setattr(T, "val_score", real)
    again_m = model(); again = fit(again_m, PREP, c, tmp_path / "killed", log=lambda s: None)
    assert again.resumed_from == (1, 2)                                   # the third evaluation: epoch 1, batch 2
    clock = lambda hs: [{k: v for k, v in h.items() if k != "train_s"} for h in hs]
    assert clock(again.history) == clock(full.history)
    assert all(torch.equal(a, b) for a, b in zip(again_m.state_dict().values(), full_m.state_dict().values()))
