"""Never a stale or silently wrong result: feature stores and runs are keyed by what they were computed from (image
contents, captions, weights file contents), features never overflow, and a changed input never resumes an old run.
Written as a user meets it: a small data set of real photographs on disk, a weights file, `prepare` and `fit`."""
import json, os
from pathlib import Path
import numpy as np
import pytest
import torch
from PIL import Image
from capbook.core import CapbookError
from capbook import data as D
from capbook.models import build
from capbook.prepare import prepare
from capbook.train import TrainConfig, fit
from photos import SAMPLE, make_photo_set, weights_file


def prep(root, weights, **kw):
    return prepare("flickr8k", data_path=root, encoder="vgg11", weights=str(weights), min_count=1, device="cpu", **kw)


@pytest.fixture
def photos(home, tmp_path):
    return make_photo_set(tmp_path / "photos"), weights_file(tmp_path / "vgg11.pth")


def store(P, split):
    return D.feature_path(P.dataset, P.encoder, split)


def test_real_photos_in_every_format(photos):
    P = prep(*photos)
    assert P.feat_shape == (196, 512) and P.grid == (14, 14) and P.encoder.startswith("vgg11-224px-file-")
    for s in ("train", "val", "test"):
        arr, meta = D.open_features(store(P, s))
        assert arr.dtype == np.float16 and np.isfinite(arr).all() and meta["finite"] and meta["source"]["images"]
    assert "encoder vgg11-224px-file-" in P.describe() and P.fingerprint in P.describe()


def test_changed_image_content_is_extracted_again(photos, capsys):
    root, w = photos
    P1 = prep(root, w)
    train_mtime = store(P1, "train").stat().st_mtime_ns
    Image.open(SAMPLE / "grace_hopper.jpg").crop((0, 0, 100, 60)).save(root / "images" / "button.jpg")  # same name
    P2 = prep(root, w)
    assert "test.npy: its images changed since it was computed" in capsys.readouterr().out
    row = P2.test.keys.index("button.jpg")
    assert not np.array_equal(P1.test.feats[row], P2.test.feats[row]) and P1.fingerprint != P2.fingerprint
    assert store(P2, "train").stat().st_mtime_ns == train_mtime          # the unchanged splits are reused
    assert prep(root, w).fingerprint == P2.fingerprint                      # and unchanged inputs stay unchanged


def test_changed_weights_file_under_the_same_name(photos):
    root, w = photos
    P1 = prep(root, w)
    weights_file(w, seed=1)                                                 # other weights, same path
    P2 = prep(root, w)
    assert P2.encoder != P1.encoder and P2.fingerprint != P1.fingerprint
    assert not np.array_equal(np.asarray(P1.train.feats), np.asarray(P2.train.feats))


def test_changed_captions_never_resume_the_old_run(photos, tmp_path):
    root, w = photos
    cfg = TrainConfig(epochs=1, batch_size=8, val_beam=1, device="cpu", progress=False)
    new = lambda P: build("sat_soft", len(P.vocab), P.feat_shape[1], P.grid, emb_dim=16, hidden_dim=32, att_dim=16)
    P1, logs = prep(root, w), []
    fit(new(P1), P1, cfg, tmp_path / "run" / "ckpt", log=logs.append)
    assert fit(new(P1), P1, cfg, tmp_path / "run" / "ckpt", log=logs.append).resumed_from is not None
    assert "same data (" + P1.fingerprint in logs[-1]                        # a resume says why it is the same run
    doc = json.loads((root / "dataset_flickr8k.json").read_text())
    toks = doc["images"][0]["sentences"][0]["tokens"]; toks.reverse()        # same words, so the same vocabulary
    (root / "dataset_flickr8k.json").write_text(json.dumps(doc))
    P2 = prep(root, w)
    assert P2.vocab == P1.vocab and P2.fingerprint != P1.fingerprint
    res = fit(new(P2), P2, cfg, tmp_path / "run" / "ckpt", log=logs.append)
    assert res.resumed_from is None and any("was trained on other data" in m for m in logs)
    aside = tmp_path / "run" / f"ckpt.data-{P1.fingerprint}"
    assert (aside / "last.pt").exists()                                    # the old run is kept, not overwritten


def test_large_activations_are_stored_as_float32_not_inf(photos, tmp_path):
    root, _ = photos
    P = prep(root, weights_file(tmp_path / "loud.pth", scale=40.0))         # activations far above 65504
    arr, meta = D.open_features(store(P, "train"))
    assert meta["dtype"] == "float32" and arr.dtype == np.float32
    assert np.isfinite(arr).all() and float(np.abs(arr).max()) > 65504.0


def test_non_finite_encoder_output_stops_with_one_line(photos, tmp_path):
    root, _ = photos
    w = tmp_path / "nan.pth"
    sd = torch.load(weights_file(w), weights_only=True); sd["features.0.bias"][0] = float("nan"); torch.save(sd, w)
    with pytest.raises(CapbookError) as e: prep(root, w)
    msg = str(e.value)
    assert "non-finite values" in msg and "train.npy" in msg and "\n" not in msg
    from capbook.encoders import weights_id
    assert not D.features_ready(D.feature_path("flickr8k", f"vgg11-224px-{weights_id('vgg11', w)}", "train"))


def test_image_deleted_after_its_features_were_cached(photos):
    root, w = photos
    prep(root, w)
    os.remove(root / "images" / "button.jpg")
    with pytest.raises(CapbookError) as e: prep(root, w)
    assert str(e.value).startswith(f"{root / 'images' / 'button.jpg'}: image not found (1 of 10 images")


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_figures_show_what_the_encoder_saw(photos, tmp_path):
    from capbook.viz import as_seen, attention_figure
    root, _ = photos
    ribbons, tag = root / "images" / "ribbons.png", root / "images" / "tag.png"      # 16-bit; RGBA
    assert np.asarray(Image.open(ribbons).convert("RGB")).mean() > 250               # PIL alone: all but white
    seen = as_seen(ribbons)
    assert seen.shape == (224, 224, 3) and 40 < seen.mean() < 200                    # a 160×50 crop, square and visible
    assert np.array_equal(as_seen(tag), D.load_rgb(tag, 224))                        # composited as the encoder saw it
    out = attention_figure([{"label": "ribbons", "image": ribbons, "words": ["a", "row"], "grid": (2, 2),
                             "alpha": torch.tensor([[0.25] * 4, [1.0, 0, 0, 0]])}], tmp_path / "fig.png")
    assert Image.open(out).size[0] > 200


@pytest.mark.slow
def test_real_photo_chapter_end_to_end_with_the_papers_encoder(home, tmp_path):
    "The real-data path of a paper chapter, run by papermill as a user would, with a weights file of the paper's encoder."
    import subprocess, sys
    root = make_photo_set(tmp_path / "photos")
    w = weights_file(tmp_path / "vgg16.pth", encoder="vgg16")
    out = tmp_path / "out.ipynb"
    nbs = Path(__file__).parent.parent / "nbs"
    p = subprocess.run([str(Path(sys.executable).parent / "papermill"), str(nbs / "02_show_attend_tell.ipynb"), str(out),
                        "-p", "dataset", "flickr8k", "-p", "data_path", str(root), "-p", "weights", str(w),
                        "-p", "profile", "smoke", "-p", "epochs", "1", "-p", "run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=900, cwd=nbs)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    text = out.read_text()
    assert "encoder vgg16-224px-file-" in text                              # the paper's encoder, said in the output
    rec = json.loads((tmp_path / "run" / "record.json").read_text())
    assert rec["data"]["encoder"].startswith("vgg16-224px-file-") and rec["metrics"]["BLEU-1"] >= 0
    assert rec["data"]["fingerprint"] in text
