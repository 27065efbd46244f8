"The evaluator: pycocoevalcap scores, graceful METEOR/SPICE unavailability, attention correctness."
import shutil
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
