import json
from pathlib import Path
import numpy as np
import pytest
import torch
from PIL import Image
from capbook.core import CapbookError
from capbook import data as D
from capbook.prepare import prepare


def one_line(e: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg
    return msg


# --- Karpathy reader -------------------------------------------------------------------------------------------

def _img(fn, split, caps, **kw):
    return {"filename": fn, "split": split, "sentences": [{"tokens": c, "raw": " ".join(c)} for c in caps], **kw}


def test_read_karpathy(tmp_path):
    doc = {"images": [_img("1.jpg", "train", [["A", "Dog"], ["a", "cat"]]), _img("2.jpg", "restval", [["x"]], filepath="val2014"),
                      _img("3.jpg", "val", [["y"]]), _img("4.jpg", "test", [["z"]])]}
    (tmp_path / "dataset_flickr8k.json").write_text(json.dumps(doc))
    k = D.read_karpathy(tmp_path / "dataset_flickr8k.json", tmp_path / "imgs")
    assert k.name == "flickr8k"
    train = k.split("train")
    assert [r.key for r in train] == ["1.jpg", "2.jpg"]  # restval counts as train
    assert train[0].captions == [["a", "dog"], ["a", "cat"]] and train[0].raw == ["A Dog", "a cat"]
    assert train[0].path == tmp_path / "imgs" / "1.jpg" and train[1].path == tmp_path / "imgs" / "val2014" / "2.jpg"
    assert [r.key for r in k.split("val")] == ["3.jpg"] and [r.key for r in k.split("test")] == ["4.jpg"]
    with pytest.raises(CapbookError) as e: k.split("restval")
    one_line(e, "split")


BAD = {
    "bad json": ("{not json", "malformed"),
    "no images list": (json.dumps({"imgs": []}), "'images' list"),
    "no filename": (json.dumps({"images": [{"split": "train", "sentences": [{"tokens": ["a"]}]}]}), "images[0] has no 'filename'"),
    "unknown split": (json.dumps({"images": [_img("a.jpg", "dev", [["a"]])]}), "images[0] (a.jpg) has split 'dev'"),
    "no split": (json.dumps({"images": [{"filename": "a.jpg", "sentences": [{"tokens": ["a"]}]}]}), "images[0] (a.jpg) has split None"),
    "no sentences": (json.dumps({"images": [_img("a.jpg", "train", [["a"]]), {"filename": "b.jpg", "split": "val"}]}),
                     "images[1] (b.jpg) has no 'sentences'"),
    "no tokens": (json.dumps({"images": [{"filename": "a.jpg", "split": "test", "sentences": [{"tokens": ["a"]}, {"raw": "a b"}]}]}),
                  "images[0] (a.jpg) sentences[1] has no 'tokens'"),
    "duplicate": (json.dumps({"images": [_img("a.jpg", "train", [["a"]]), _img("a.jpg", "val", [["a"]])]}), "images[1] repeats"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_read_karpathy_errors(tmp_path, case):
    text, part = BAD[case]
    p = tmp_path / "dataset_coco.json"
    p.write_text(text)
    with pytest.raises(CapbookError) as e: D.read_karpathy(p)
    one_line(e, str(p), part)


def test_read_karpathy_missing_file(tmp_path):
    with pytest.raises(CapbookError) as e: D.read_karpathy(tmp_path / "dataset_coco.json")
    one_line(e, str(tmp_path / "dataset_coco.json"), "not found")


# --- images ----------------------------------------------------------------------------------------------------

def _rgb(s=20):
    a = np.zeros((s, s, 3), np.uint8); a[..., 0] = 200; a[:, s // 2:, 2] = 100
    return a


def make_mode_images(d: Path) -> dict[str, Path]:
    "One file per image mode the loader must handle."
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    def save(name, im, **kw): out[name] = d / name; im.save(d / name, **kw)
    save("rgb.jpg", Image.fromarray(_rgb()), quality=95)
    save("gray.png", Image.fromarray(np.full((20, 30), 128, np.uint8), "L"))
    save("la.png", Image.fromarray(np.stack([np.full((20, 20), 0, np.uint8), np.zeros((20, 20), np.uint8)], -1), "LA"))
    rgba = np.zeros((20, 20, 4), np.uint8); rgba[:, :10] = (255, 0, 0, 255)  # left opaque red, right transparent
    save("rgba.png", Image.fromarray(rgba, "RGBA"))
    save("cmyk.jpg", Image.fromarray(_rgb()).convert("CMYK"), quality=95)
    save("g16.png", Image.fromarray(np.full((20, 20), 32768, np.uint16)))
    save("i32.tif", Image.fromarray(np.full((20, 20), 65535, np.int32), "I"))
    save("pal.png", Image.fromarray(_rgb()).convert("P", palette=Image.Palette.ADAPTIVE, colors=4))
    pt = Image.fromarray(_rgb()).convert("P", palette=Image.Palette.ADAPTIVE, colors=4); pt.info["transparency"] = 0
    save("pal_t.png", pt)
    save("bw.png", Image.fromarray(np.eye(20, dtype=bool)).convert("1"))
    return out


def test_load_image_modes(tmp_path):
    files = make_mode_images(tmp_path)
    assert Image.open(files["g16.png"]).mode.startswith("I") and Image.open(files["cmyk.jpg"]).mode == "CMYK"
    for name, p in files.items():
        x = D.load_image(p, 16)
        assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and torch.isfinite(x).all(), name
        rgb = D.load_rgb(p, 16)
        assert rgb.shape == (16, 16, 3) and rgb.dtype == np.uint8, name
    assert (D.load_rgb(files["gray.png"], 8) == 128).all()
    assert abs(int(D.load_rgb(files["g16.png"], 8)[0, 0, 0]) - 128) <= 1  # 16-bit scaled by 65535
    assert (D.load_rgb(files["i32.tif"], 8) == 255).all()
    rgba = D.load_rgb(files["rgba.png"], 20)
    assert tuple(rgba[5, 2]) == (255, 0, 0) and tuple(rgba[5, 17]) == (255, 255, 255)  # composited on white
    assert (D.load_rgb(files["la.png"], 8) == 255).all()  # fully transparent black → white
    assert np.abs(D.load_rgb(files["cmyk.jpg"], 8)[..., 0].astype(int) - 200).max() < 12
    # normalisation: load_image = (rgb/255 - mean) / std
    ref = (torch.from_numpy(D.load_rgb(files["rgb.jpg"], 16).copy()).permute(2, 0, 1) / 255 - torch.tensor(D.IMAGENET_MEAN).view(3, 1, 1)) \
        / torch.tensor(D.IMAGENET_STD).view(3, 1, 1)
    assert torch.allclose(D.load_image(files["rgb.jpg"], 16), ref, atol=1e-5)


def test_load_image_errors(tmp_path):
    Image.fromarray(_rgb(64)).save(tmp_path / "full.jpg", quality=95)
    data = (tmp_path / "full.jpg").read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[:len(data) // 2])
    (tmp_path / "junk.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage garbage")
    (tmp_path / "empty.jpg").write_bytes(b"")
    for name in ["trunc.jpg", "junk.png", "empty.jpg", "missing.jpg"]:
        with pytest.raises(CapbookError) as e: D.load_image(tmp_path / name, 16)
        assert one_line(e).startswith(f"{tmp_path / name}: cannot read image (")


# --- vocabulary --------------------------------------------------------------------------------------------------

def test_vocab():
    caps = [["a", "red", "circle"]] * 5 + [["a", "blue", "square"]] * 5 + [["a", "rare", "star"]] * 4
    v = D.Vocab.build(caps, min_count=5)
    assert v.itos[:4] == ["<pad>", "<start>", "<end>", "<unk>"] and (v.pad, v.start, v.end, v.unk) == (0, 1, 2, 3)
    assert v.itos[4:] == ["a", "blue", "circle", "red", "square"]  # count desc, then alphabetical
    assert len(v) == 9 and "rare" not in v.itos
    ids = v.encode(["a", "rare", "red", "circle"])
    assert ids == [1, 4, 3, 7, 6, 2]
    assert v.encode(["a", "rare", "red", "circle"], max_len=2) == [1, 4, 3, 2]
    assert v.decode(ids + [0, 0]) == ["a", "<unk>", "red", "circle"]
    assert v.decode(torch.tensor([1, 4, 2, 5, 5])) == ["a"] and v.decode([0, 4, 0]) == ["a"]
    w = D.Vocab(json.loads(json.dumps(v.to_list())))
    assert w == v and w.stoi == v.stoi and D.Vocab.build(caps, min_count=4) != v
    for bad in (["a", "b"], ["<pad>", "<start>", "<end>", "<unk>", "a", "a"]):
        with pytest.raises(CapbookError): D.Vocab(bad)
    with pytest.raises(CapbookError) as e: D.Vocab.build(caps, min_count=0)
    one_line(e, "min_count")


# --- feature store -----------------------------------------------------------------------------------------------

@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_shared_builders_run_one_at_a_time(tmp_path):
    "Two processes (two side-by-side book runs) calling a guarded builder: the second starts after the first ends."
    import subprocess, sys, textwrap
    log = tmp_path / "log"
    code = textwrap.dedent(f"""
        import os, time
        os.environ["CAPBOOK_DATA"] = {str(tmp_path / "data")!r}
        from capbook.core import one_at_a_time
        @one_at_a_time("build")
        def build():
            with open({str(log)!r}, "a") as f: f.write("start\\n")
            time.sleep(1.0)
            with open({str(log)!r}, "a") as f: f.write("end\\n")
            return 7
        assert build() == 7
    """)
    ps = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in ps] == [0, 0]
    assert log.read_text().split() == ["start", "end", "start", "end"]      # never interleaved
    assert (tmp_path / "data" / ".build.lock").exists()


def test_feature_store_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPBOOK_DATA", str(tmp_path))
    p = D.feature_path("toy", "enc-8px-x", "train")
    assert p == tmp_path / "features" / "toy" / "enc-8px-x" / "train.npy"
    keys = [f"k{i}" for i in range(5)]

    def rows(fail_at=None):
        for i in range(5):
            if i == fail_at: raise RuntimeError("killed")
            yield torch.full((1, 3, 2), float(i))

    with pytest.raises(RuntimeError): D.write_features(p, 5, (3, 2), rows(fail_at=3), {"keys": keys})
    assert not D.features_ready(p) and list(p.parent.iterdir()) == []
    with pytest.raises(CapbookError) as e: D.open_features(p)
    one_line(e, str(p))
    D.write_features(p, 5, (3, 2), rows(), {"keys": keys, "encoder": "enc"})
    arr, meta = D.open_features(p)
    assert isinstance(arr, np.memmap) and arr.dtype == np.float16 and arr.shape == (5, 3, 2) and arr[4, 2, 1] == 4
    assert meta["complete"] and meta["keys"] == keys and meta["shape"] == [5, 3, 2]
    assert D.features_ready(p, keys) and not D.features_ready(p, keys[::-1])
    # a rewrite killed midway invalidates the store (never a mix of old meta and partial data)
    with pytest.raises(RuntimeError): D.write_features(p, 5, (3, 2), rows(fail_at=1), {"keys": keys})
    assert not D.features_ready(p)
    # too few rows, wrong row shape, a stale temp file from a dead process
    (p.parent / f".{p.name}.999999999.tmp").write_bytes(b"x")
    with pytest.raises(CapbookError): D.write_features(p, 6, (3, 2), rows(), {"keys": keys + ["k5"]})
    with pytest.raises(CapbookError): D.write_features(p, 5, (2, 2), rows(), {"keys": keys})
    assert not D.features_ready(p) and [q.name for q in p.parent.iterdir()] == ["train.npy"]  # no temp files, no meta
    # a meta that does not match the array
    D.write_features(p, 5, (3, 2), rows(), {"keys": keys})
    meta = json.loads(p.with_suffix(".json").read_text()); meta["shape"] = [4, 3, 2]
    p.with_suffix(".json").write_text(json.dumps(meta))
    assert not D.features_ready(p)


# --- caption datasets --------------------------------------------------------------------------------------------

@pytest.fixture
def cdata(tmp_path):
    rng = np.random.default_rng(0)
    n = 23
    words = ["a", "red", "blue", "circle", "square", "star", "left", "of"]
    refs = [[list(rng.choice(words, rng.integers(1, 9))) for _ in range(int(rng.integers(1, 4)))] for _ in range(n)]
    vocab = D.Vocab.build([c for r in refs for c in r], min_count=1)
    feats = np.lib.format.open_memmap(tmp_path / "f.npy", mode="w+", dtype=np.float16, shape=(n, 4, 3))
    feats[:] = np.arange(n, dtype=np.float16)[:, None, None]; feats.flush()
    return D.CaptionData(np.load(tmp_path / "f.npy", mmap_mode="r"), [f"i{i}" for i in range(n)], refs, vocab, max_len=5, split="train")


def test_caption_data_encoding(cdata):
    M = sum(len(r) for r in cdata.refs)
    assert len(cdata) == M and cdata.n_images == 23 and cdata.caps.shape == (M, 7) and cdata.caps.dtype == np.int64
    for j in range(M):
        i, L = cdata.cap_img[j], cdata.lengths[j]
        assert cdata.caps[j, 0] == 1 and cdata.caps[j, L - 1] == 2 and (cdata.caps[j, L:] == 0).all() and L <= 7
        assert cdata.vocab.decode(cdata.caps[j]) in [ref[:5] for ref in cdata.refs[i]]
    assert max(len(c) for r in cdata.refs for c in r) == 8  # refs keep untruncated references


def test_batches(cdata):
    torch.manual_seed(1); np.random.seed(1)
    a = list(cdata.batches(4, epoch=3, seed=7))
    torch.manual_seed(2); np.random.seed(2)
    b = list(cdata.batches(4, epoch=3, seed=7))
    assert len(a) == cdata.num_batches(4) == -(-len(cdata) // 4)
    for x, y in zip(a, b):
        assert all(torch.equal(x[k], y[k]) for k in ("feats", "caps", "lengths", "img"))
    order = torch.cat([x["img"] for x in a])
    assert sorted(order.tolist()) == sorted(cdata.cap_img.tolist())
    assert not torch.equal(order, torch.cat([x["img"] for x in cdata.batches(4, epoch=4, seed=7)]))
    for x in a:
        B, T = x["caps"].shape
        assert x["feats"].shape == (B, 4, 3) and x["feats"].dtype == torch.float32 and x["caps"].dtype == torch.long
        assert T == x["lengths"].max() and torch.equal(x["feats"][:, 0, 0], x["img"].float())
        assert x["caps"][torch.arange(B), x["lengths"] - 1].eq(2).all()
    # resuming mid-epoch: skip gives the tail of the same order
    tail = list(cdata.batches(4, epoch=3, seed=7, skip=2))
    assert len(tail) == len(a) - 2 and all(torch.equal(x["caps"], y["caps"]) for x, y in zip(tail, a[2:]))


def test_batches_ranks(tmp_path):
    n, world, bs = 23, 3, 2
    refs = [[["w"] * (1 + i % 5)] for i in range(n)]  # one caption per image: caption index == image index
    cd = D.CaptionData(np.zeros((n, 1, 1), np.float16), [str(i) for i in range(n)], refs, D.Vocab.build([["w"]], 1), 4)
    shards = [list(cd.batches(bs, 5, 0, rank=r, world=world)) for r in range(world)]
    assert [len(s) for s in shards] == [cd.num_batches(bs, world)] * world == [4] * world  # 12 batches, 12 // 3 each
    got = [torch.cat([x["img"] for x in s]).tolist() for s in shards]
    assert not (set(got[0]) & set(got[1])) and not (set(got[1]) & set(got[2])) and not (set(got[0]) & set(got[2]))
    single = [x["img"].tolist() for x in cd.batches(bs, 5, 0)]
    assert sorted(map(sorted, (b.tolist() for s in shards for b in (x["img"] for x in s)))) == \
        sorted(map(sorted, single))  # the ranks share out the single-process batches (none dropped here: 12 % 3 == 0)
    with pytest.raises(CapbookError): next(cd.batches(2, 0, 0, rank=3, world=3))


def test_batches_are_length_bucketed():
    n = 40
    refs = [[["w"] * (1 + i % 7)] for i in range(n)]
    cd = D.CaptionData(np.zeros((n, 1, 1), np.float16), [str(i) for i in range(n)], refs, D.Vocab.build([["w"]], 1), 9)
    spans = [int(x["lengths"].max() - x["lengths"].min()) for x in cd.batches(5, 0, 0)]
    assert max(spans) <= 1 and spans.count(0) >= len(spans) // 2


def test_image_batches(cdata):
    bs = list(cdata.image_batches(10))
    assert [len(b["img"]) for b in bs] == [10, 10, 3]
    assert torch.equal(torch.cat([b["img"] for b in bs]), torch.arange(23))
    assert torch.equal(torch.cat([b["feats"][:, 0, 0] for b in bs]), torch.arange(23).float())


# --- prepare -----------------------------------------------------------------------------------------------------

def test_prepare_errors(tmp_path):
    with pytest.raises(CapbookError) as e: prepare("imagenet")
    one_line(e, "dataset", "'shapes'", "'coco'")
    with pytest.raises(CapbookError) as e: prepare("coco")
    one_line(e, "data_path", "dataset_coco.json")
    with pytest.raises(CapbookError) as e: prepare("coco", data_path=tmp_path)
    one_line(e, str(tmp_path / "dataset_coco.json"), "not found")
    with pytest.raises(CapbookError) as e: prepare("flickr8k", data_path=tmp_path, encoder="alexnet")
    one_line(e, "encoder", "vgg16")
