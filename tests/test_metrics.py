"The evaluator: pycocoevalcap scores, graceful METEOR/SPICE unavailability, attention correctness."
import shutil
import pytest
import torch
import capbook.metrics as M
from capbook.decode import Caption
from capbook.data import Vocab

GTS = {"a": ["a red circle above a blue square", "there is a red circle"], "b": ["two green stars", "a green star"]}
RES = {"a": "a red circle above a blue square", "b": "a blue circle"}


def test_scores_rank_a_perfect_caption_higher():
    s, notes = M.coco_scores(GTS, RES, meteor=False, spice=False)
    s2, _ = M.coco_scores(GTS, {"a": "two green stars", "b": "a red circle"}, meteor=False, spice=False)
    assert set(s) == {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "ROUGE-L", "CIDEr"}
    assert s["CIDEr"] > s2["CIDEr"] and s["BLEU-1"] > s2["BLEU-1"]


def test_without_java_meteor_is_reported_unavailable(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    s, notes = M.coco_scores(GTS, RES, meteor=True, spice=True)
    assert "METEOR" not in s and "Java" in notes["METEOR"] and "tokenizer" in notes
    assert "SPICE" not in s and "SPICE" in notes


def test_spice_unavailable_without_corenlp_jars():
    ok, lib = M.spice_jars()
    s, notes = M.coco_scores(GTS, RES, meteor=False, spice=True)
    assert ok == ("SPICE" in s)
    if not ok: assert "3.6.0" in notes["SPICE"] and lib in notes["SPICE"]


def test_attention_correctness_on_a_known_object():
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "red", "circle", "blue", "square", "above"])
    gt = {"images": {"x.png": {"objects": [{"shape": "circle", "colour": "red", "size": "large", "box": [0, 0, 56, 56]},
                                           {"shape": "square", "colour": "blue", "size": "small", "box": [60, 60, 100, 100]}],
                               "relations": [[0, "above", 1]]}}}
    toks = [vocab.stoi[w] for w in "a red circle above a blue square".split()]
    on = torch.zeros(7, 4); on[2, 0] = 1; on[6, 3] = 1          # 2x2 grid: circle in cell 0, square in cell 3
    off = torch.zeros(7, 4); off[2, 3] = 1; off[6, 0] = 1
    good = M.attention_correctness([Caption(toks, 0.0, on)], ["x.png"], gt, vocab, (2, 2), 112)
    bad = M.attention_correctness([Caption(toks, 0.0, off)], ["x.png"], gt, vocab, (2, 2), 112)
    assert good["n"] == bad["n"] == 2
    assert good["hit"] == 1.0 and bad["hit"] == 0.0
    assert good["mass"] > 0.6 and bad["mass"] < 0.1


# --- bootstrap intervals over test images ------------------------------------------------------------------------

def _smoke_captions(smoke, n=40):
    "The first `n` test images of the smoke set, captioned by another image's first reference (right and wrong ones)."
    keys, refs = smoke.test.keys[:n], smoke.test.refs[:n]
    words = [refs[(i * 7) % n][0] if i % 3 else refs[i][0] for i in range(n)]
    return keys, words, refs


def test_interval_statistics_reproduce_pycocoevalcap_and_semantic_scores(smoke):
    "With every image drawn once, the sums give the evaluator's own BLEU-4, CIDEr and semantic F1."
    import numpy as np
    from capbook.shapes import semantic_scores
    keys, words, refs = _smoke_captions(smoke)
    st = M.image_stats(keys, words, refs, smoke.gt)
    scores, _ = M.coco_scores({k: [" ".join(r) for r in rs] for k, rs in zip(keys, refs)},
                              {k: " ".join(w) for k, w in zip(keys, words)}, meteor=False, spice=False)
    assert abs(M.bootstrap(st["BLEU-4"], "BLEU-4")["value"] - 100 * scores["BLEU-4"]) < 1e-9
    assert abs(M.bootstrap(st["CIDEr"], "CIDEr")["value"] - 100 * scores["CIDEr"]) < 1e-9
    sem = semantic_scores(dict(zip(keys, words)), dict(zip(keys, refs)), smoke.gt["images"])["all"]["f1"]
    ci = M.bootstrap(st["semantic F1"], "semantic F1")
    assert abs(ci["value"] - 100 * sem) < 1e-9 and ci["lo"] < ci["value"] < ci["hi"]
    w = M.draws(len(keys), 1000, seed=3)
    assert w.shape == (1000, len(keys)) and (w.sum(1) == len(keys)).all() and (w == M.draws(len(keys), 1000, seed=3)).all()
    assert np.isfinite(w @ st["BLEU-4"]).all()


def test_bootstrap_equals_brute_force_rescoring(smoke):
    "Each draw scored through the sums = the drawn images (duplicates included) rescored from scratch by pycocoevalcap's BleuScorer, CIDEr's per-image mean and the micro F1 of the drawn tuple counts."
    import numpy as np
    from pycocoevalcap.bleu.bleu_scorer import BleuScorer
    from capbook.shapes import semantic_counts
    keys, words, refs = _smoke_captions(smoke, n=6)
    st = M.image_stats(keys, words, refs, smoke.gt)
    w = M.draws(6, 25, seed=1)
    idx = [np.repeat(np.arange(6), w[r].astype(int)) for r in range(25)]
    bleu, cider, f1 = (M.bootstrap(st[m], m, w=w) for m in ("BLEU-4", "CIDEr", "semantic F1"))
    for r, picks in enumerate(idx):
        bs = BleuScorer(n=4)
        for i in picks: bs += (" ".join(words[i]), [" ".join(x) for x in refs[i]])
        brute_bleu = bs.compute_score(option="closest")[0][3]
        tp, nc, hit, nr = sum(semantic_counts(words[i], refs[i], smoke.gt["images"][keys[i]]).sum(0) for i in picks)
        p, rec = tp / max(nc, 1), hit / max(nr, 1)
        brute_f1 = 2 * p * rec / (p + rec) if p + rec else 0.0
        assert abs(M.resampled(st["BLEU-4"], "BLEU-4", w)[r] - 100 * brute_bleu) < 1e-9
        assert abs(M.resampled(st["CIDEr"], "CIDEr", w)[r] - 100 * st["CIDEr"][picks].mean()) < 1e-9
        assert abs(M.resampled(st["semantic F1"], "semantic F1", w)[r] - 100 * brute_f1) < 1e-9
    for m, ci in zip(("BLEU-4", "CIDEr", "semantic F1"), (bleu, cider, f1)):            # the interval: their quantiles
        assert np.allclose([ci["lo"], ci["hi"]], np.quantile(M.resampled(st[m], m, w), [0.025, 0.975]))


def test_paired_verdicts():
    import numpy as np
    import pytest
    from capbook.core import CapbookError
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 1.5, 300)
    assert M.bootstrap(a, "CIDEr", other=a)["verdict"] == "cannot tell at this size"          # no difference at all
    assert M.bootstrap(a + 0.2, "CIDEr", other=a)["verdict"] == "holds"
    assert M.bootstrap(a, "CIDEr", other=a + 0.2)["verdict"] == "does not hold"
    assert M.bootstrap(a + rng.normal(0, 0.3, 300), "CIDEr", other=a)["verdict"] == "cannot tell at this size"
    with pytest.raises(CapbookError, match="300 images against 299"): M.bootstrap(a, "CIDEr", other=a[:-1])


def test_the_verdict_rule_is_wrong_at_most_5_percent_of_the_time_and_gains_power_with_seeds():
    # no true difference: the share of "holds" or "does not hold" at seed spreads of 2, 10 and 20 % of CIDEr
    for spread in (0.02, 0.10, 0.20):
        r = M.simulate_verdicts(spread, trials=1000)
        assert r["holds"] + r["does not hold"] <= 0.05, (spread, r)
    # a true difference of 3 seed sds: found in most trials with 3 seeds, almost always with 5; 1 sd: rarely with 3
    power = {(S, d): M.simulate_verdicts(0.10, d, seeds=S, trials=400)["holds"] for S in (3, 5) for d in (1, 3)}
    assert power[3, 1] < 0.3 < 0.5 < power[3, 3] < power[5, 3] and power[5, 3] > 0.9 and power[3, 1] < power[5, 1], power


def test_seed_t_test_against_welch_by_hand():
    import numpy as np
    from scipy.stats import t
    rng = np.random.default_rng(1)
    img = rng.gamma(2.0, 0.5, 200)
    a = [img + s for s in (0.30, 0.10, 0.20)]          # every image shifted by a seed constant: no image variance
    b = [img + s for s in (0.00, 0.05)]
    r = M.seed_t_test(a, "CIDEr", b)
    va, vb = np.var([30, 10, 20], ddof=1) / 3, np.var([0, 5], ddof=1) / 2
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 1)
    half = t.ppf(0.975, df) * np.sqrt(va + vb)
    assert r["value"] == pytest.approx(17.5) and r["df"] == pytest.approx(df)
    assert (r["lo"], r["hi"]) == pytest.approx((17.5 - half, 17.5 + half)) and r["p"] == pytest.approx(2 * t.sf(17.5 / np.sqrt(va + vb), df))
    with pytest.raises(M.CapbookError, match="seeds scored on"): M.seed_t_test(a, "CIDEr", [img[:-1]])


def test_one_tokenizer_call_gives_the_tokens_of_two(monkeypatch):
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
    gts = {1: ["A Red-circle, above a BLUE square.", "there's a circle"], 2: ["two  green stars!"]}
    res = {1: "", 2: "Two green stars, (left)"}             # an empty candidate keeps its line
    tok = PTBTokenizer()
    two = (tok.tokenize({k: [{"caption": c} for c in v] for k, v in gts.items()}),
           tok.tokenize({k: [{"caption": c}] for k, c in res.items()}))
    M._TOKENIZED.clear()
    g, r, notes = M.tokenized(gts, res)
    assert (g, r) == two and notes == {}
    calls = []
    monkeypatch.setattr(PTBTokenizer, "tokenize", lambda self, d: calls.append(d))
    assert M.tokenized(gts, res)[:2] == two and calls == []       # the same captions again: no second Java start
    g[1].append("x")                                                 # callers get copies
    assert M.tokenized(gts, res)[:2] == two


@pytest.mark.slow
def test_the_shared_meteor_process_scores_as_a_runs_own(monkeypatch):
    import os
    import multiprocessing as mp
    g, r, _ = M.tokenized(GTS | {"c": ["a small red circle", "a red circle on the left"]}, RES | {"c": "a large red circle"})
    M._meteor_close()
    fresh = M.meteor_score(g, r)                                   # a Java process started for this call
    assert M.METEOR_ENV not in os.environ and 0 < fresh < 1
    M.meteor_score(g, {k: ["two blue squares"] for k in g})         # kept for the next call ...
    assert M.meteor_score(g, r) == fresh                           # ... which scores the same
    with M.meteor_service() as svc:
        with mp.get_context("spawn").Pool(2) as pool:              # runs in other processes, as the book's kernels
            shared = pool.starmap(M.meteor_score, [(g, r), (g, r)])
        assert shared == [fresh, fresh] and svc["served"] == 2
    assert M.METEOR_ENV not in os.environ
    monkeypatch.setenv(M.METEOR_ENV, "/nonexistent/meteor.sock|00")   # a service that has gone: the run scores itself
    assert M.meteor_score(g, r) == fresh
