import json
from pathlib import Path
from urllib.error import URLError
import numpy as np
import pytest
import torch
from PIL import Image
from capbook.core import CapbookError, file_digest
from capbook import data as D, encoders as E, shapes as S
from capbook.prepare import prepare


def one_line(e: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg
    return msg


def _rgb(s=40, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (s, s, 3), dtype=np.uint8)


MODES = {  # filename: (split, how to write it)
    "rgb.jpg": ("train", lambda p: Image.fromarray(_rgb(50, 1)).save(p, quality=90)),
    "gray.png": ("train", lambda p: Image.fromarray(_rgb(30, 2)[..., 0], "L").save(p)),
    "rgba.png": ("restval", lambda p: Image.fromarray(np.dstack([_rgb(40, 3), _rgb(40, 4)[..., :1]]), "RGBA").save(p)),
    "pal.png": ("train", lambda p: Image.fromarray(_rgb(40, 5)).convert("P", palette=Image.Palette.ADAPTIVE).save(p)),
    "cmyk.jpg": ("val", lambda p: Image.fromarray(_rgb(40, 6)).convert("CMYK").save(p, quality=90)),
    "g16.png": ("test", lambda p: Image.fromarray((_rgb(40, 7)[..., 0].astype(np.uint16) * 257)).save(p)),
}


@pytest.fixture
def flickr(tmp_path_factory):
    "A Flickr8k-style Karpathy folder: dataset_flickr8k.json plus six images of different modes (no filepath)."
    tmp_path, images = tmp_path_factory.mktemp("flickr8k"), []
    for i, (fn, (split, write)) in enumerate(MODES.items()):
        write(tmp_path / fn)
        images.append({"filename": fn, "imgid": i, "split": split,
                       "sentences": [{"tokens": ["a", "dog", "runs"], "raw": "A dog runs."},
                                     {"tokens": ["a", "Dog", "sits", "on", "grass"], "raw": "A Dog sits on grass"}]})
    (tmp_path / "dataset_flickr8k.json").write_text(json.dumps({"images": images, "dataset": "flickr8k"}))
    return tmp_path


@pytest.fixture(scope="module")
def vgg16():
    return E.build_backbone("vgg16", weights="random")


def test_real_data_pipeline(flickr, vgg16, tmp_path_factory):
    k = D.read_karpathy(flickr / "dataset_flickr8k.json", flickr)
    out = tmp_path_factory.mktemp("store")
    vocab = D.Vocab.build([c for r in k.split("train") for c in r.captions], min_count=1)
    for split, n in [("train", 4), ("val", 1), ("test", 1)]:
        recs = k.split(split)
        assert len(recs) == n
        p = E.extract_features([r.path for r in recs], vgg16, 64, out / f"{split}.npy", [r.key for r in recs], batch_size=3)
        feats, meta = D.open_features(p)
        assert feats.shape == (n, 16, 512) and feats.dtype == np.float16  # VGG's stride 16: 4×4 regions at 64 px
        assert meta["grid"] == [4, 4] and meta["keys"] == [r.key for r in recs] and meta["encoder"] == "vgg16-64px-random-s0"
        with torch.no_grad():
            ref = vgg16(D.load_image(recs[-1].path, 64)[None])[0].flatten(1).T  # (L, D), row-major over the grid
        assert torch.allclose(torch.from_numpy(np.asarray(feats[-1], np.float32)), ref, rtol=1e-2, atol=1e-2)
        cd = D.CaptionData(feats, meta["keys"], [r.captions for r in recs], vocab, max_len=4, split=split)
        b = next(cd.batches(8, epoch=0, seed=0))
        assert b["feats"].shape == (min(8, 2 * n), 16, 512) and b["caps"].shape[1] <= 6
        assert vocab.decode(b["caps"][0])[0] == "a"
    assert len(vocab) == 4 + 6  # a dog runs sits on grass (lower-cased 'Dog')


def test_documented_grids(vgg16):
    x = torch.zeros(1, 3, 224, 224)
    assert vgg16(x).shape == (1, 512, 14, 14)  # Show-Attend-Tell: 14×14×512 at 224 px
    r = E.build_backbone("resnet101", weights="random")
    assert r(torch.zeros(1, 3, 64, 64)).shape == (1, 2048, 14, 14)  # adaptive pool: 14×14 for any input
    assert E.BACKBONES["resnet101"].image_size == 448 and E.BACKBONES["vgg11"].image_size == 224
    assert not any(p.requires_grad for p in vgg16.parameters()) and not vgg16.train().training


def test_prepare_real(flickr, monkeypatch, tmp_path_factory):
    monkeypatch.setenv("CAPBOOK_DATA", str(tmp_path_factory.mktemp("data")))
    P = prepare("flickr8k", data_path=flickr, encoder="vgg11", weights="random", min_count=1)
    assert P.feat_shape == (196, 512) and P.grid == (14, 14) and P.image_size == 224  # VGG-11 at 224: 14×14
    assert P.encoder == "vgg11-224px-random-s0" and P.dataset == "flickr8k" and P.gt is None
    assert (P.train.n_images, P.val.n_images, P.test.n_images) == (4, 1, 1) and len(P.train) == 8
    assert P.max_len == P.test.max_len == 20 and P.image_paths("val") == [flickr / "cmyk.jpg"]
    assert P.train.feats.shape == (4, 196, 512) and np.isfinite(np.asarray(P.train.feats, np.float32)).all()
    with monkeypatch.context() as m:  # a second call only opens the stores: no backbone, no extraction
        m.setattr(E, "build_backbone", lambda *a, **k: pytest.fail("backbone should not be needed"))
        m.setattr(E, "extract_features", lambda *a, **k: pytest.fail("features should be cached"))
        Q = prepare("flickr8k", data_path=flickr, encoder="vgg11", weights="random", min_count=1)
    assert np.array_equal(Q.test.feats, P.test.feats) and Q.vocab == P.vocab
    (flickr / "gray.png").unlink()
    monkeypatch.setenv("CAPBOOK_DATA", str(tmp_path_factory.mktemp("fresh")))
    with pytest.raises(CapbookError) as e: prepare("flickr8k", data_path=flickr, encoder="vgg11", weights="random")
    one_line(e, str(flickr / "gray.png"), "image not found", "1 of 6 images")


def test_extraction_bad_images(flickr, vgg16, tmp_path):
    (flickr / "broken.jpg").write_bytes((flickr / "rgb.jpg").read_bytes()[:300])
    for bad in ["broken.jpg", "nowhere.png"]:
        paths = [flickr / "rgb.jpg", flickr / "gray.png", flickr / bad, flickr / "pal.png"]
        out = tmp_path / bad / "train.npy"
        with pytest.raises(CapbookError) as e: E.extract_features(paths, vgg16, 32, out, list("abcd"), batch_size=2)
        assert one_line(e).startswith(f"{flickr / bad}: cannot read image (")
        assert not D.features_ready(out) and list(out.parent.iterdir()) == []


def test_extraction_killed_midway(flickr, vgg16, tmp_path, monkeypatch):
    paths = sorted(flickr.glob("*.[jp][pn]g"))
    out, keys = tmp_path / "train.npy", [p.name for p in paths]
    calls, real = [], D.load_image
    def dying(p, size):
        calls.append(p)
        if len(calls) == 4: raise KeyboardInterrupt  # the process is interrupted inside the batch iterator
        return real(p, size)
    monkeypatch.setattr(E, "load_image", dying)
    with pytest.raises(KeyboardInterrupt): E.extract_features(paths, vgg16, 32, out, keys, batch_size=2)
    assert not D.features_ready(out) and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(E, "load_image", real)
    E.extract_features(paths, vgg16, 32, out, keys, batch_size=2)
    feats, meta = D.open_features(out)
    assert feats.shape == (6, 4, 512) and meta["keys"] == keys and D.features_ready(out, keys)


def test_imagenet_weights_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    tried = []
    def offline(url, dst, *a, **k):
        tried.append(url); raise URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(CapbookError) as e: E.build_backbone("vgg16")
    ckdir = tmp_path / "torch" / "hub" / "checkpoints"
    one_line(e, "vgg16: ImageNet weights unavailable", "vgg16-397923af.pth", str(ckdir), "-p weights /path/file.pth")
    assert tried == ["https://download.pytorch.org/models/vgg16-397923af.pth"]


def test_weights_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", lambda *a, **k: pytest.fail("no download expected"))
    import torchvision                                  # here: both test workers collect this module, one runs the backbones
    src = E.build_backbone("vgg11", weights="random", seed=1)
    sd = {f"features.{k}": v for k, v in src.trunk.state_dict().items()}
    name = Path(torchvision.models.get_weight(E.BACKBONES["vgg11"].weights).url).name
    hub = tmp_path / "torch" / "hub" / "checkpoints" / name
    hub.parent.mkdir(parents=True); torch.save(sd, hub)
    for w in ["imagenet", hub]:
        net = E.build_backbone("vgg11", weights=w)
        assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), src.state_dict().values()))
    assert E.build_backbone("vgg11", weights=hub).weights_id.startswith("file-")
    key = E.build_backbone("vgg11").encoder_key(224)                 # the weights named by content, not by name
    assert key == f"vgg11-224px-imagenet1k_v1-{file_digest(hub)[:10]}"
    torch.save({k: v + 1 for k, v in sd.items()}, hub)                # another file under the same name
    assert E.build_backbone("vgg11").encoder_key(224) != key
    torch.save({k.replace("features.", "layer."): v for k, v in sd.items()}, tmp_path / "wrong.pth")
    torch.save(torch.zeros(3), tmp_path / "tensor.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    for bad, part in [("wrong.pth", "not a vgg11 state dict"), ("tensor.pth", "not a vgg11 state dict"),
                      ("junk.pth", "unreadable vgg11 weights"), ("none.pth", "weights=")]:
        with pytest.raises(CapbookError) as e: E.build_backbone("vgg11", weights=tmp_path / bad)
        one_line(e, str(tmp_path / bad), part)
    with pytest.raises(CapbookError) as e: E.build_backbone("vgg17")
    one_line(e, "encoder", "'vgg16'")


def test_shapes_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPBOOK_DATA", str(tmp_path))
    monkeypatch.setitem(S.PROFILES, "smoke", dict(train=40, val=10, test=10))
    monkeypatch.setitem(E.SHAPES_CNN, "epochs", 2)
    P = prepare("shapes", "smoke", seed=0, min_count=1)
    assert P.feat_shape == (196, 128) and P.grid == (14, 14) and P.image_size == 112 and P.dataset == "shapes-smoke-s0"
    assert P.encoder.startswith("shapescnn-112px-smoke-s0-") and set(P.gt["images"]) >= set(P.train.keys)
    assert (P.train.n_images, P.val.n_images, P.test.n_images) == (40, 10, 10) and len(P.train) == 200
    lengths = [len(c) for r in P.train.refs for c in r]
    assert P.max_len == P.train.max_len == int(np.ceil(np.percentile(lengths, 95))) and P.train.caps.shape[1] == P.max_len + 2
    assert all(p.is_file() for p in P.image_paths("test")) and [p.name for p in P.image_paths("test")] == P.test.keys
    ck = torch.load(tmp_path / "encoders" / "shapes-smoke-s0.pt", weights_only=True)
    assert ck["config"]["epochs"] == 2 and set(ck["scores"]) >= {"micro_f1", "pair_f1", "train_seconds"}
    assert "red circle" in ck["labels"] or "blue square" in ck["labels"]
    # a second call opens the caches: no training, no extraction, same features
    monkeypatch.setattr(E, "train_shapes_encoder", lambda *a, **k: pytest.fail("encoder should be cached"))
    monkeypatch.setattr(E, "extract_features", lambda *a, **k: pytest.fail("features should be cached"))
    Q = prepare("shapes", "smoke", seed=0, min_count=1)
    assert Q.encoder == P.encoder and np.array_equal(Q.val.feats, P.val.feats) and Q.vocab == P.vocab
    with pytest.raises(CapbookError) as e: prepare("shapes", "huge")
    one_line(e, "profile", "'smoke'")
