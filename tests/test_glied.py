"GLIED: the MIL attribute detector (noisy-OR and its gradient), Eq. 3-11 against a direct computation, incremental = parallel decoding, one image pass per image, the chapter end to end with self-critical training."
import itertools, json
from pathlib import Path
import numpy as np
import pytest
import torch
from capbook.attributes import (AttributeConfig, attribute_labels, attributes_for, average_precision,
                                content_words, keep_attributes, mil_loss, noisy_or, train_detector)
from capbook.core import CapbookError
from capbook.decode import beam_search, sample
from capbook.glied import GLIED, GLIEDConfig, GLIEDParams, direct_glied
from capbook.models import build


# --- attributes: multiple-instance learning ----------------------------------------------------------------------

def test_noisy_or_and_its_gradient_on_a_tiny_case():
    z = torch.tensor([[[0.7, -2.0], [-0.4, 1.5], [0.1, -3.0]]], requires_grad=True)     # 3 regions, 2 words
    p = torch.sigmoid(z.detach())[0]                                                    # p_ij: (3, 2)
    P = 1 - (1 - p).prod(0)                                                             # 1 - prod_j (1 - p_ij)
    log_p, log_not = noisy_or(z)
    assert torch.allclose(log_p.exp()[0], P) and torch.allclose(log_not.exp()[0], 1 - P)
    y = torch.tensor([[1.0, 0.0]])
    mil_loss(z, y).backward()
    # d/dz_j of -log P (positive word) = -p_j (1 - P) / P; of -log(1 - P) (negative word) = p_j; the loss averages over 2 words
    expect = torch.stack([-p[:, 0] * (1 - P[0]) / P[0], p[:, 1]], 1) / 2
    assert torch.allclose(z.grad[0], expect, atol=1e-6)
    far = torch.full((1, 196, 1), -40.0, requires_grad=True)                           # 196 tiny probabilities
    lp, _ = noisy_or(far)
    assert torch.isfinite(lp).all() and abs(lp.item() - (np.log(196) - 40)) < 1e-3
    mil_loss(far, torch.ones(1, 1)).backward()
    assert torch.isfinite(far.grad).all()


def test_detector_learns_a_word_present_in_one_region():
    "A word whose region carries a marker: noisy-OR over the regions finds it from image-level labels only."
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(400, 9, 6)).astype(np.float32)
    labels = (rng.random((400, 2)) < 0.5).astype(np.float32)
    for i in range(400):
        for w in range(2):
            if labels[i, w]: feats[i, rng.integers(9), w] += 4.0                        # one region says it
    cfg = AttributeConfig(hidden=16, epochs=15, lr=1e-2, batch_size=32, dropout=0.0)
    det, hist = train_detector(feats[:300], labels[:300], feats[300:], labels[300:], cfg, log=lambda s: None)
    ap = average_precision(det.probs(torch.as_tensor(feats[300:])).numpy(), labels[300:])
    assert (ap > 0.9).all() and hist[-1]["loss"] < hist[0]["loss"]


def test_attribute_vocabulary_labels_and_kept_attributes():
    refs = [[["there", "is", "a", "red", "star"], ["a", "star", "above", "a", "circle"]], [["two", "red", "circles"]]]
    stoi = {w: i for i, w in enumerate(["<pad>", "<start>", "<end>", "<unk>", "a", "red", "star", "circle", "above",
                                        "two", "circles", "there", "is"])}
    words = content_words(refs, stoi)
    assert "a" not in words and "there" not in words and words[0] == "red" and "above" in words
    y = attribute_labels(refs, words)
    assert y[0, words.index("star")] == 1 and y[1, words.index("star")] == 0 and y.sum() == 7
    kept = keep_attributes(np.array([[0.2, 0.1, 0.3]]), np.array([7, 8, 9]), keep=5, threshold=0.5)
    assert kept.tolist() == [[9, 0, 0]]                                   # capped at the words; the first always kept


def test_attributes_for_a_prepared_set_are_cached_by_content(smoke, capsys):
    cfg = AttributeConfig(epochs=2, hidden=32)
    logs = []
    a = attributes_for(smoke, cfg, log=logs.append)
    L = smoke.feat_shape[0]
    assert a.ids["train"].shape == (smoke.train.n_images, min(L, len(a.words)))
    assert set(np.unique(a.ids["test"])) <= {0} | {smoke.vocab.stoi[w] for w in a.words}
    assert (a.ids["test"][:, 0] > 0).all() and 0 <= a.scores["test"]["precision"] <= 1 and "mAP" in a.scores["val"]
    b = attributes_for(smoke, cfg, log=logs.append)
    assert "cached" in logs[-1] and b.key == a.key and all(np.array_equal(a.ids[s], b.ids[s]) for s in a.ids)
    assert attributes_for(smoke, AttributeConfig(epochs=1, hidden=32), log=logs.append).key != a.key


# --- the model: Eq. 3-11 ------------------------------------------------------------------------------------------

def glied(flags, **kw):
    torch.manual_seed(0)
    v, a, l = flags
    return GLIED(GLIEDConfig(d_embed=6, d_model=12, heads=3, d_hidden=20, global_visual=v, global_attribute=a, local=l, **kw),
                 15, 5, (2, 3)).eval()


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_every_variant_is_its_equations(flags):
    m = glied(flags)
    feats, attrs = torch.randn(2, 6, 5), torch.tensor([[4, 9, 0, 0], [5, 6, 7, 0]])
    caps = torch.tensor([[1, 4, 5, 6, 2, 0], [1, 7, 7, 7, 8, 2]])
    logits = m({"feats": feats, "attrs": attrs, "caps": caps})["logits"]
    for i in range(2):
        assert torch.allclose(logits[i], direct_glied(m, feats[i], attrs[i], caps[i, :-1]), atol=1e-5), flags


@pytest.mark.parametrize("where", ["values", "qk"])
def test_the_position_ablations_are_their_equations_and_the_default_is_eq7_without_one(where):
    "Eq. 7 as the paper writes it has no position term; the ablations add the cells' sinusoid to all Eq. 7 reads, or to its queries and keys alone."
    feats, attrs = torch.randn(2, 6, 5), torch.tensor([[4, 9, 0, 0], [5, 6, 7, 0]])
    caps = torch.tensor([[1, 4, 5, 6, 2, 0], [1, 7, 7, 7, 8, 2]])
    paper, m = glied((True, True, True)), glied((True, True, True), visual_position=where)
    assert not hasattr(paper, "pe_cells") and paper.cfg.variant == "GLIED" and m.cfg.variant.startswith("GLIED + cell positions")
    out = m({"feats": feats, "attrs": attrs, "caps": caps})["logits"]
    for i in range(2):
        assert torch.allclose(out[i], direct_glied(m, feats[i], attrs[i], caps[i, :-1]), atol=1e-5)
    assert not torch.allclose(out, paper({"feats": feats, "attrs": attrs, "caps": caps})["logits"], atol=1e-3)   # same weights, another input
    mem = m.encode(feats, attrs)
    m.pe_cells.zero_()                                                   # no position: the paper's equation, exactly
    assert torch.allclose(m.encode(feats, attrs)["v_v"], paper.encode(feats, attrs)["v_v"], atol=1e-6)
    assert not torch.allclose(mem["v_v"], paper.encode(feats, attrs)["v_v"], atol=1e-4)
    with pytest.raises(CapbookError, match="visual_position=True is invalid"): GLIEDConfig(visual_position=True).check()


def test_switches_add_exactly_their_modules():
    names = lambda f: {n.split(".")[0] for n, _ in glied(f).named_parameters()}
    base = names((False, False, False))
    assert names((True, False, False)) - base == {"H_vd", "g_vd", "post_vd"}
    assert names((False, True, False)) - base == {"H_ad", "g_ad"}
    assert names((False, False, True)) - base == {"local", "post_l"}
    assert glied((False, False, False)).cross.H.h == 1                    # H_v = H_a: one head, shared


@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True)])
def test_incremental_decoding_equals_teacher_forcing_and_the_image_side_runs_once(flags):
    m = glied(flags)
    b = {"feats": torch.randn(3, 6, 5), "attrs": torch.tensor([[4, 5, 0], [9, 0, 0], [4, 6, 8]])}
    s = sample(m, b, n=2, temperature=1.0, max_len=7)
    caps = torch.cat([torch.full((6, 1), m.start), s.tokens], 1)
    tf = torch.log_softmax(m({k: v.repeat_interleave(2, 0) for k, v in b.items()} | {"caps": caps})["logits"], -1)
    lp = tf.gather(2, caps[:, 1:, None])[..., 0] * s.mask
    assert torch.allclose(lp, s.logprobs.detach() * s.mask, atol=1e-5)
    m.encoder_passes = 0
    out = m({k: v.repeat_interleave(5, 0) for k, v in b.items()} | {"caps": caps[:1].repeat(15, 1),
                                                                      "img": torch.arange(3).repeat_interleave(5)})
    assert m.encoder_passes == 3 and out["alpha"].shape == (15, caps.shape[1] - 1, 6)
    m.encoder_passes = 0
    beam_search(m, b, beam_size=3, max_len=7)
    assert m.encoder_passes == 3


def test_missing_attributes_get_no_attention():
    m = glied((False, False, True))
    b = {"feats": torch.randn(2, 6, 5), "attrs": torch.tensor([[4, 0, 0], [5, 6, 0]]), "caps": torch.tensor([[1, 4, 2], [1, 5, 2]])}
    a = m(b)["alpha_attr"]                                                # (2, T, K)
    assert (a[0, :, 1:] == 0).all() and (a[1, :, 2] == 0).all() and torch.allclose(a.sum(-1), torch.ones(2, 2))


def test_the_model_needs_its_attributes():
    m = build("glied", 15, 5, (2, 3), d_embed=6, d_model=12, heads=3, d_hidden=20)
    with pytest.raises(CapbookError, match="needs batch input.*attrs"):
        sample(m, {"feats": torch.randn(1, 6, 5)}, max_len=3)


@pytest.mark.parametrize("bad, match", [({"global_visual": "yes"}, "global_visual='yes' is invalid"),
                                        ({"d_model": 10, "heads": 4}, "d_model=10 is invalid"),
                                        ({"dropout": 2.0}, "dropout")])
def test_bad_model_parameters_are_one_line(bad, match):
    with pytest.raises(CapbookError, match=match): build("glied", 15, 5, (2, 3), **bad)


# --- the chapter: attributes, cross-entropy, then self-critical training ----------------------------------------

@pytest.mark.slow
def test_chapter_trains_then_self_critically_and_records_both_stages(smoke, tmp_path):
    from capbook.runner import run_chapter
    p = GLIEDParams(profile="smoke", epochs=1, scst_epochs=1, attr_epochs=1, run_dir=str(tmp_path / "run"), batch_size=32)
    r = run_chapter("05_glied", p, log=lambda s: None)
    rec = json.loads((tmp_path / "run" / "record.json").read_text())
    assert set(rec["stages"]) == {"xe", "scst"} and rec["hparams"]["d_model"] == 64
    start, h = rec["stages"]["scst"]["history"][:2]              # epoch -1: the cross-entropy model, validated first
    assert start["epoch"] == -1 and "val CIDEr" in start and h["epoch"] == 0
    assert {"reward", "baseline", "greedy_reward", "val CIDEr"} <= set(h) and np.isfinite(h["scst"])
    assert rec["attributes"]["words"] and 0 <= rec["attributes"]["scores"]["test"]["recall"] <= 1
    assert (tmp_path / "run" / "distilling.pt").exists() and rec["figure3"]["variant"] == "GLIED"
    assert rec["metrics"] == rec["stages"]["scst"]["metrics"] and r.record["timings"]["train_s"] > rec["stages"]["xe"]["train_s"]
    again = run_chapter("05_glied", p, log=lambda s: None).record        # run again: both stages found finished, only tested
    assert again["metrics"] == rec["metrics"] and 0 < again["timings"]["test_s"] < again["timings"]["wall_s"], again["timings"]
    with pytest.raises(CapbookError, match="parameter scst_baseline='best' is invalid"):
        run_chapter("05_glied", GLIEDParams(profile="smoke", scst_baseline="best"), log=lambda s: None)


# --- bottom-up regions: a variable number per image, through the feature store -----------------------------------

def _region_set(tmp_path):
    from photos import IMAGES, make_photo_set
    root = make_photo_set(tmp_path / "photos", "coco")
    folder, rng = tmp_path / "bu", np.random.default_rng(0)
    folder.mkdir()
    counts = {}
    for i, (fn, *_rest) in enumerate(IMAGES):
        n = int(rng.integers(2, 7)); counts[fn] = n
        a = rng.normal(size=(n, 16)).astype(np.float32)
        if i % 2: np.savez(folder / f"{Path(fn).stem}.npz", feat=a)       # both layouts of the distributed files
        else: np.save(folder / f"{Path(fn).stem}.npy", a)
    return root, folder, counts


def test_bottom_up_regions_are_padded_masked_and_read_only_by_models_that_mask(tmp_path, home):
    from capbook.prepare import prepare
    from capbook.train import TrainConfig, fit
    from capbook.decode import decode_split
    root, folder, counts = _region_set(tmp_path)
    prep = prepare("coco", data_path=root, regions=folder, min_count=1)
    n_max = max(counts.values())
    assert prep.feat_shape == (n_max, 16) and prep.encoder.startswith("regions-")
    for s in ("train", "val", "test"):
        d = prep.split(s)
        assert d.inputs["feat_mask"].sum(1).tolist() == [counts[k] for k in d.keys]
        assert np.all(np.asarray(d.feats)[~d.inputs["feat_mask"]] == 0)                # padding is zeros
    k0 = prep.train.keys[0]
    stem = Path(k0).stem
    ref = np.load(folder / f"{stem}.npy") if (folder / f"{stem}.npy").exists() else np.load(folder / f"{stem}.npz")["feat"]
    assert np.allclose(np.asarray(prep.train.feats[0])[:counts[k0]], ref, atol=1e-2)     # float16 store
    prep.split("train").with_inputs(attrs=np.full((prep.train.n_images, 2), 4))
    for s in ("val", "test"): prep.split(s).with_inputs(attrs=np.full((prep.split(s).n_images, 2), 4))
    m = build("glied", len(prep.vocab), 16, prep.grid, d_embed=8, d_model=16, heads=2, d_hidden=16)
    fit(m, prep, TrainConfig(epochs=1, progress=False, max_len=prep.max_len, batch_size=4), tmp_path / "ck", log=lambda s: None)
    caps = decode_split(m, prep.test, beam_size=2, max_len=5)
    for c, k in zip(caps, prep.test.keys):
        assert (c.alpha[:, counts[k]:] == 0).all()                                  # no attention on padding
    soft = build("sat_soft", len(prep.vocab), 16, prep.grid, emb_dim=8, hidden_dim=8, att_dim=8)
    with pytest.raises(CapbookError, match="cannot read a variable number of regions"):
        decode_split(soft, prep.test, beam_size=1, max_len=3)
    again = prepare("coco", data_path=root, regions=folder, min_count=1)                  # cached by content
    assert again.encoder == prep.encoder
    one = sorted(folder.glob("*.npy"))[0]
    np.save(one, np.zeros(3, np.float32))                                               # a malformed file: one line naming it
    with pytest.raises(CapbookError, match=f"{one}: region features must be a numeric N x D array"):
        prepare("coco", data_path=root, regions=folder, min_count=1)
    one.unlink()
    with pytest.raises(CapbookError, match="no region features for image"):
        prepare("coco", data_path=root, regions=folder, min_count=1)


def test_figure3_of_a_caption_that_ends_at_once(tmp_path):
    "A weak model may emit <end> first (a one-epoch smoke run did): Figure 3 shows that step instead of failing."
    from capbook.glied import distilling_figure, figure3_step
    torch.manual_seed(0)
    dw = {"final_regions": torch.rand(1, 4), "final_attrs": torch.rand(1, 3), "groups": torch.rand(4, 4),
          "collocations": torch.rand(1, 3)}
    t = figure3_step([], {"circle"}, {"red"})
    out = distilling_figure(np.zeros((32, 32, 3), np.uint8), [], ["red", "circle", "—"], dw, t, (2, 2), tmp_path / "f3.png")
    assert t == 0 and out.stat().st_size > 1000
