# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # data
#
# > Karpathy-split reader, robust image loading, vocabulary, memory-mapped feature stores and caption datasets whose batches are mappings of named inputs.

# %%
#| default_exp data

# %%
#| export
from __future__ import annotations
import errno, os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence
import numpy as np
import torch
from PIL import Image
from capbook.core import (CapbookError, wide, check_choice, check_int, data_dir, file_digests, io_error, load_json, save_json,
                          stable_hash, sweep_tmp)

# %% [markdown]
# ## The Karpathy split files
#
# Every captioning paper in this book trains and evaluates on the splits of Karpathy & Fei-Fei (2015), distributed as
# `dataset_coco.json`, `dataset_flickr8k.json` and `dataset_flickr30k.json`: one object with an `images` list, each
# image carrying its `filename`, an optional `filepath` (COCO's `train2014`/`val2014`; absent for Flickr), its `split`
# and its `sentences`, each with `tokens` (already tokenised) and `raw`. capbook's synthetic *shapes* set is generated
# in the same form (`dataset_shapes.json`), so the default run goes through exactly the code a COCO user runs.
#
# Splits are `train`, `val`, `test` and `restval`. *capbook commentary:* following Karpathy's own code and every paper
# reproduced here, `restval` (the 30,504 COCO val2014 images outside the 5k val and 5k test sets) **counts as
# training data**, giving the usual 113,287 COCO training images.
#
# An image's unique key is its `filename`; its path is `image_root / filepath / filename`. Tokens are lower-cased.
# A malformed file stops with one line naming the file, the image index and the missing field.

# %%
#| export
SPLITS = ("train", "val", "test")
KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}  # restval counts as train

@dataclass
class ImageRecord:
    "One image of a Karpathy split file: its unique `key` (the filename), `path`, `split` and its reference captions."
    key: str
    path: Path
    split: str
    captions: list[list[str]]  # lower-cased token lists, one per reference sentence
    raw: list[str]             # the raw sentences, as given
    image_id: int | str = ""   # the id a COCO results file names it by: `cocoid` (COCO), else `imgid`, else the filename

@dataclass
class KarpathyData:
    "A parsed Karpathy split file: `.name` (e.g. 'coco') and `.split(s)`, the image records of one split in file order."
    name: str
    json_path: Path
    image_root: Path
    records: list[ImageRecord]

    def split(self, s: str) -> list[ImageRecord]:
        "The records of split `s` ('train' includes 'restval'), in file order."
        check_choice("split", s, SPLITS)
        return [r for r in self.records if r.split == s]

    def digest(self, split: str | None = None, captions: bool = True) -> str:
        "Content hash of a split (or all): each image's key and file content, and (if `captions`) its captions."
        recs = self.records if split is None else self.split(split)
        files = file_digests([r.path for r in recs], "image")
        return stable_hash([[r.key, r.split, f, r.captions if captions else None] for r, f in zip(recs, files)], 16)


# %%
#| export
def _image_record(im: Any, i: int, src: Path, root: Path) -> ImageRecord:
    where = f"{src}: images[{i}]"
    if not isinstance(im, dict): raise CapbookError(f"{where} is not an object")
    fn = im.get("filename")
    if not isinstance(fn, str) or not fn: raise CapbookError(f"{where} has no 'filename'")
    where = f"{where} ({fn})"
    split = im.get("split")
    if split not in KARPATHY_SPLITS:
        raise CapbookError(f"{where} has split {split!r}: allowed values are 'train', 'val', 'test', 'restval'")
    sents = im.get("sentences")
    if not isinstance(sents, list) or not sents: raise CapbookError(f"{where} has no 'sentences' list (or it is empty)")
    caps, raws = [], []
    for j, s in enumerate(sents):
        toks = s.get("tokens") if isinstance(s, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, str) for t in toks):
            raise CapbookError(f"{where} sentences[{j}] has no 'tokens' list of strings")
        caps.append([t.strip().lower() for t in toks if t.strip()])
        raws.append(s.get("raw") if isinstance(s.get("raw"), str) else " ".join(toks))
    fp = im.get("filepath") or ""
    if not isinstance(fp, str): raise CapbookError(f"{where} has a non-string 'filepath'")
    ids = [im[k] for k in ("cocoid", "imgid") if isinstance(im.get(k), (int, str)) and not isinstance(im.get(k), bool)]
    return ImageRecord(fn, root / fp / fn, KARPATHY_SPLITS[split], caps, raws, ids[0] if ids else fn)

def read_karpathy(json_path: str | Path, image_root: str | Path | None = None) -> KarpathyData:
    "Parse and validate a Karpathy split file; images live under `image_root` (default: the file's folder)."
    json_path = Path(json_path)
    doc = load_json(json_path, "Karpathy split file")
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise CapbookError(f"{json_path}: expected a JSON object with an 'images' list")
    root = Path(image_root) if image_root is not None else json_path.parent
    records, seen, ids = [], set(), set()
    for i, im in enumerate(doc["images"]):
        r = _image_record(im, i, json_path, root)
        if r.key in seen: raise CapbookError(f"{json_path}: images[{i}] repeats filename {r.key!r}")
        if r.image_id in ids: raise CapbookError(f"{json_path}: images[{i}] ({r.key}) repeats image id {r.image_id!r} (cocoid/imgid)")
        seen.add(r.key); ids.add(r.image_id); records.append(r)
    if not records: raise CapbookError(f"{json_path}: the 'images' list is empty")
    name = json_path.stem.removeprefix("dataset_")
    return KarpathyData(name, json_path, root, records)


# %%
import json, tempfile as _tf
_d = Path(_tf.mkdtemp())
_doc = {"images": [
    {"filename": "a.jpg", "filepath": "val2014", "split": "restval", "sentences": [{"tokens": ["A", "dog"], "raw": "A dog."}]},
    {"filename": "b.jpg", "split": "test", "sentences": [{"tokens": ["a", "cat"]}]}]}
(_d/"dataset_toy.json").write_text(json.dumps(_doc))
_k = read_karpathy(_d/"dataset_toy.json", _d)
assert _k.name == "toy" and [r.key for r in _k.split("train")] == ["a.jpg"]
assert _k.split("train")[0].path == _d/"val2014"/"a.jpg" and _k.split("train")[0].captions == [["a", "dog"]]
_doc["images"][1]["split"] = "dev"; (_d/"dataset_bad.json").write_text(json.dumps(_doc))
try: read_karpathy(_d/"dataset_bad.json"); raise AssertionError
except CapbookError as e: assert "dataset_bad.json: images[1] (b.jpg) has split 'dev'" in str(e), e

# %% [markdown]
# Each record also carries the id a COCO results file names the image by (`capbook.metrics.write_results`): COCO's
# `cocoid`, else the `imgid` every Karpathy file has, else the filename. Two images with one id stop in one line.

# %%
assert [r.image_id for r in _k.records] == ["a.jpg", "b.jpg"]                     # no ids in the toy file: the filenames
_doc["images"][1]["split"] = "test"; _doc["images"][0]["cocoid"] = 391895; _doc["images"][1]["imgid"] = 7
(_d/"dataset_ids.json").write_text(json.dumps(_doc))
assert [r.image_id for r in read_karpathy(_d/"dataset_ids.json").records] == [391895, 7]
_doc["images"][1]["imgid"] = 391895; (_d/"dataset_dup.json").write_text(json.dumps(_doc))
try: read_karpathy(_d/"dataset_dup.json"); raise AssertionError
except CapbookError as e: assert "images[1] (b.jpg) repeats image id 391895" in str(e), e

# %% [markdown]
# ## Loading an image, whatever its mode
#
# Real collections hold more than 8-bit RGB JPEGs: COCO has grayscale and CMYK JPEGs, scraped sets have palette and
# RGBA PNGs, scientific images are 16-bit. `load_image` turns each into 8-bit RGB: transparent images are composited on
# white, palette and bi-level images are expanded, CMYK is converted, and 16-bit (`I;16`) images are scaled by
# 65535 (32-bit `I` and float `F` images by their actual range when it exceeds 16 bits). `load_rgb` then resizes to
# `size`×`size` (bilinear with antialiasing: the image is squashed, not cropped) and returns 8-bit RGB; `load_image`
# also normalises with the ImageNet mean and standard deviation that the torchvision backbones were trained with
# (`normalize` does the same for a uint8 batch).
#
# A missing, truncated or corrupt file stops with one line: `<path>: cannot read image (reason)`.

# %%
#| export
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

def _to_rgb8(im: Image.Image) -> Image.Image:
    "Any PIL mode to 8-bit RGB (alpha composited on white, high bit depths scaled to 0..255)."
    if im.mode in ("I", "F") or im.mode.startswith("I;16"):
        a = np.asarray(im, dtype=np.float64)
        lo = min(float(a.min()), 0.0)
        hi = 65535.0 if im.mode.startswith("I;16") or a.max() <= 65535 else float(a.max())
        im = Image.fromarray(np.clip((a - lo) / (hi - lo) * 255 + 0.5, 0, 255).astype(np.uint8), "L")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")

def load_rgb(path: str | Path, size: int) -> np.ndarray:
    "Read any image as 8-bit RGB resized to size×size: a uint8 array (size, size, 3)."
    try:
        with Image.open(path) as im:
            im.draft(None, (size, size))  # JPEG: decode at a reduced DCT scale when the image is ≥2× larger
            im.load()
            rgb = _to_rgb8(im).resize((size, size), Image.Resampling.BILINEAR)
    except FileNotFoundError: raise CapbookError(f"{path}: cannot read image (file not found)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise CapbookError(f"{path}: cannot read image ({e.__class__.__name__}: {e})") from None
    return np.asarray(rgb, dtype=np.uint8)

def normalize(x: torch.Tensor) -> torch.Tensor:
    "uint8 images (..., 3, H, W) in 0..255 → float, ImageNet-normalised."
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=x.device).view(3, 1, 1) * 255
    return (x.float() - mean) / std

def load_image(path: str | Path, size: int) -> torch.Tensor:
    "Read any image as an ImageNet-normalised float tensor (3, size, size)."
    return normalize(torch.from_numpy(load_rgb(path, size).copy()).permute(2, 0, 1))


# %%
Image.fromarray(np.full((8, 8, 4), (0, 0, 0, 0), np.uint8), "RGBA").save(_d/"clear.png")
Image.fromarray(np.full((8, 8), 65535, np.uint16)).save(_d/"white16.png")
assert (load_rgb(_d/"clear.png", 4) == 255).all() and (load_rgb(_d/"white16.png", 4) == 255).all()
assert load_image(_d/"clear.png", 4).shape == (3, 4, 4)
(_d/"broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
try: load_image(_d/"broken.jpg", 4); raise AssertionError
except CapbookError as e: assert str(e).startswith(f"{_d/'broken.jpg'}: cannot read image (") and "\n" not in str(e)


# %% [markdown]
# ## Vocabulary
#
# As in Show-Attend-Tell and its successors, words seen fewer than `min_count` times in the training captions are
# replaced by `<unk>`. Four special tokens come first: `<pad>`=0, `<start>`=1, `<end>`=2, `<unk>`=3; the rest are
# sorted by frequency (ties alphabetically), so the vocabulary is a deterministic function of the training captions.
# A caption is encoded as `<start>`, at most `max_len` word ids, `<end>`. Checkpoints store the plain list of strings
# (`to_list()`), and `Vocab(itos)` rebuilds it.

# %%
#| export
class Vocab:
    "Word ↔ id mapping with `<pad>` = 0, `<start>` = 1, `<end>` = 2, `<unk>` = 3."
    SPECIALS = ("<pad>", "<start>", "<end>", "<unk>")
    pad, start, end, unk = 0, 1, 2, 3

    def __init__(self, itos: Sequence[str]):
        itos = list(itos)
        if tuple(itos[:4]) != self.SPECIALS or len(set(itos)) != len(itos):
            raise CapbookError(f"vocabulary: expected {', '.join(self.SPECIALS)} first and no repeated words")
        self.itos = itos
        self.stoi = {w: i for i, w in enumerate(itos)}

    @classmethod
    def build(cls, token_lists: Iterable[Sequence[str]], min_count: int = 5) -> Vocab:
        "Keep the words seen at least `min_count` times, most frequent first (ties alphabetically)."
        check_int("min_count", min_count, lo=1)
        counts = Counter(t for toks in token_lists for t in toks)
        words = sorted((w for w, c in counts.items() if c >= min_count and w not in cls.SPECIALS),
                       key=lambda w: (-counts[w], w))
        return cls([*cls.SPECIALS, *words])

    def encode(self, tokens: Sequence[str], max_len: int | None = None) -> list[int]:
        "`<start>`, the ids of the first `max_len` tokens (unknown words → `<unk>`), `<end>`."
        ids = [self.stoi.get(t, self.unk) for t in tokens]
        return [self.start, *(ids if max_len is None else ids[:max_len]), self.end]

    def decode(self, ids: Iterable[int]) -> list[str]:
        "Words up to the first `<end>`, dropping `<start>` and `<pad>`."
        out = []
        for i in map(int, ids):
            if i == self.end: break
            if i not in (self.start, self.pad): out.append(self.itos[i])
        return out

    def to_list(self) -> list[str]:
        "The plain list of words (id order) that checkpoints store."
        return list(self.itos)

    def __len__(self) -> int: return len(self.itos)
    def __eq__(self, other) -> bool: return isinstance(other, Vocab) and self.itos == other.itos
    def __repr__(self) -> str: return f"Vocab({len(self)} words: {' '.join(self.itos[4:12])} ...)"


# %%
_v = Vocab.build([["a", "red", "circle"], ["a", "blue", "circle"], ["a", "red", "star"]], min_count=2)
assert _v.itos == ["<pad>", "<start>", "<end>", "<unk>", "a", "circle", "red"]
assert _v.encode(["a", "blue", "circle"]) == [1, 4, 3, 5, 2] and _v.encode(["a", "red", "circle"], max_len=2) == [1, 4, 6, 2]
assert _v.decode([1, 4, 3, 5, 2, 0, 0]) == ["a", "<unk>", "circle"] and Vocab(_v.to_list()) == _v

# %% [markdown]
# ## The feature store
#
# The papers freeze their CNN and compute its annotation vectors once; so does capbook. Each (dataset, encoder,
# split) gets one array of shape (N images, L regions, D channels) in NumPy's `.npy` format, read back
# memory-mapped so that training never holds the whole set in RAM and never decodes an image:
# `data_dir()/features/<dataset>/<encoder key>/<split>.npy`, where the encoder key names the encoder, the image size
# and the weights *by content* (e.g. `vgg16-224px-imagenet1k_v1-3f0c…`, the last part a hash of the weights file).
#
# **What a store was computed from** is in its meta: the image keys in order and `source`, a hash of the split's
# image *contents* (`KarpathyData.fingerprint`) and of the encoder's weights. A store is reused only when both match
# what the run would compute now; replacing an image file, or the weights file under the same name, makes the next
# run extract again (and say why), never train on the old features.
#
# **Finite values only.** Stores are float16 (half the disk and memory traffic of float32) as long as every value
# fits: real backbones can produce activations above float16's largest value, 65504, which would be stored as `inf`
# and turn training into NaN. The writer checks every batch; the first batch that would overflow switches the store
# to float32 (the rows already written are copied exactly), and the meta says which dtype it holds. A value that is
# already non-finite when it leaves the encoder (broken weights) stops the extraction with one line naming the store,
# the rows and the count. The meta records `finite: true`; a store without it (written by older code) is re-extracted.
#
# Writing is crash-safe. The array is filled in a temporary file in the same folder (`np.lib.format.open_memmap`),
# flushed and renamed; only then is its meta file `<split>.json` written, atomically. A store is valid only when its
# meta exists, says complete and matches the array's shape, so an extraction killed at any moment leaves nothing that a
# later run reads as valid: the next run simply extracts again. Temporary files left by a killed process are removed by
# the next writer. The file's blocks are reserved before the first row is written, so a disk too small for the store
# stops at once with one line, instead of killing the process (a memory-mapped write to a full disk is a SIGBUS).

# %%
#| export
F16_MAX = float(np.finfo(np.float16).max)    # 65504

def feature_path(dataset: str, encoder_key: str, split: str) -> Path:
    "Where the features of one (dataset, encoder, split) live: `data_dir()/features/<dataset>/<encoder_key>/<split>.npy`."
    return data_dir() / "features" / dataset / encoder_key / f"{split}.npy"

def _meta_path(path: Path) -> Path: return Path(path).with_suffix(".json")

def _open_tmp(path: Path, tmp: Path, shape: tuple, dtype) -> np.memmap:
    "A new memory-mapped .npy file, its blocks reserved first: a full disk fails here, not as SIGBUS mid-write."
    try:
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
        with open(tmp, "r+b") as f:
            try: os.posix_fallocate(f.fileno(), 0, os.path.getsize(tmp))
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS): raise
        return arr
    except OSError as e:
        tmp.unlink(missing_ok=True); raise io_error(path, e) from None

DISK_SLACK = 256 * 2**20      # bytes a new store leaves free on its disk, besides its own size

def check_free_disk(path: str | Path, nbytes: int, what: str = "the feature store") -> int:
    "Stop in one line, before anything is written, unless the disk holding `path` has `nbytes` (and `DISK_SLACK`) free; return the free bytes."
    import shutil
    where = Path(path).absolute()
    while not where.exists(): where = where.parent
    free = shutil.disk_usage(where).free
    if nbytes + DISK_SLACK > free:
        raise CapbookError(f"{path}: {what} needs {nbytes / 1e9:.2f} GB and its disk has {free / 1e9:.2f} GB free: free some space "
                           f"or set CAPBOOK_HOME to a folder on a larger disk; nothing was written")
    return free

def write_features(path: str | Path, n: int, shape: Sequence[int], batches: Iterable[Any], meta: dict) -> Path:
    "Fill a store of `n` items of `shape` from `batches` (arrays or tensors, in order), float16 unless a value needs float32, then its meta; crash-safe. A disk without room for it stops the write before anything changes."
    path = Path(path)
    check_free_disk(path, int(n) * int(np.prod(shape)) * 2, f"the feature store ({int(n):,} × {' × '.join(map(str, shape))} float16)")
    try: path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e: raise io_error(path, e) from None
    sweep_tmp(path)
    _meta_path(path).unlink(missing_ok=True)  # the old store (if any) stops being valid before anything changes
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    full = (int(n), *map(int, shape))
    try:
        arr, i = _open_tmp(path, tmp, full, np.float16), 0
        for b in batches:
            b = b.detach().float().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float32)
            if b.shape[1:] != full[1:] or i + len(b) > n:
                raise CapbookError(f"{path}: feature batch of shape {b.shape} does not fit a store of shape {full} at row {i}")
            bad = int((~np.isfinite(b)).sum())
            if bad:
                raise CapbookError(f"{path}: the encoder produced {bad} non-finite values in images {i}..{i + len(b) - 1} "
                                   f"(check its weights); nothing was stored")
            if arr.dtype == np.float16 and len(b) and float(np.abs(b).max()) > F16_MAX:   # would become inf: float32
                wide = _open_tmp(path, tmp.with_suffix(".f32.tmp"), full, np.float32)
                wide[:i] = arr[:i]; del arr
                os.replace(tmp.with_suffix(".f32.tmp"), tmp); arr = wide
            arr[i:i + len(b)] = b; i += len(b)
        if i != n: raise CapbookError(f"{path}: got {i} feature rows, expected {n}")
        dtype = str(arr.dtype); arr.flush(); del arr
        with open(tmp, "rb+") as f: os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True); tmp.with_suffix(".f32.tmp").unlink(missing_ok=True); raise io_error(path, e) from None
    except BaseException:
        tmp.unlink(missing_ok=True); tmp.with_suffix(".f32.tmp").unlink(missing_ok=True); raise
    save_json(_meta_path(path), {**meta, "shape": list(full), "dtype": dtype, "finite": True, "complete": True})
    return path

def open_features(path: str | Path) -> tuple[np.memmap, dict]:
    "Open a complete store read-only, memory-mapped, with its meta; an incomplete or mismatched one is an error."
    path = Path(path)
    if not _meta_path(path).exists() or not path.exists():
        raise CapbookError(f"{path}: no complete feature store (extraction missing or interrupted)")
    meta = load_json(_meta_path(path), "feature store meta")
    try: arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e: raise CapbookError(f"{path}: unreadable feature store ({e})") from None
    if not meta.get("complete") or list(arr.shape) != meta.get("shape") or len(meta.get("keys", ())) != arr.shape[0]:
        raise CapbookError(f"{path}: feature store does not match its meta (shape {list(arr.shape)} vs {meta.get('shape')})")
    return arr, meta

def store_outdated(path: str | Path, keys: Sequence[str] | None = None, source: dict | None = None) -> str | None:
    "Why the store at `path` cannot be used for these image `keys` computed from `source`, or None when it can."
    try: _, meta = open_features(path)
    except CapbookError as e: return str(e).split(": ", 1)[-1]
    if not meta.get("finite"): return "written without the finite-value check (older capbook)"
    if keys is not None and meta["keys"] != list(keys): return "it holds other images"
    if source is not None:
        old = meta.get("source") or {}
        changed = [k for k in source if old.get(k) != source[k]]
        if changed: return f"its {' and '.join(changed)} changed since it was computed ({', '.join(f'{k} {old.get(k)} → {source[k]}' for k in changed)})"
    return None

def features_ready(path: str | Path, keys: Sequence[str] | None = None, source: dict | None = None) -> bool:
    "True when a valid store exists at `path` (and, if given, holds exactly these image `keys`, computed from `source`)."
    return store_outdated(path, keys, source) is None


# %%
_p = _d/"features"/"toy"/"enc"/"train.npy"
def _rows(k):
    for i in range(k): yield np.full((1, 4, 2), i)
    raise KeyboardInterrupt  # killed midway
try: write_features(_p, 3, (4, 2), _rows(2), {"keys": ["a", "b", "c"]})
except KeyboardInterrupt: pass
assert not features_ready(_p) and list(_p.parent.iterdir()) == []
write_features(_p, 3, (4, 2), (np.full((1, 4, 2), i) for i in range(3)), {"keys": ["a", "b", "c"], "source": {"images": "h1"}})
_arr, _meta = open_features(_p)
assert _arr.dtype == np.float16 and _arr.shape == (3, 4, 2) and _arr[2, 0, 0] == 2 and features_ready(_p, ["a", "b", "c"])
print(store_outdated(_p, ["a", "b", "c"], {"images": "h2"}))
assert not features_ready(_p, ["a", "b", "c"], {"images": "h2"}) and features_ready(_p, ["a", "b", "c"], {"images": "h1"})

# %% [markdown]
# A value beyond float16's range turns the store into float32 (nothing becomes `inf`); a non-finite value from the
# encoder stops with one line and leaves no store.

# %%
write_features(_p, 3, (4, 2), (np.full((1, 4, 2), v) for v in (1.0, 7e4, 2.5)), {"keys": ["a", "b", "c"]})
_arr, _meta = open_features(_p)
assert _arr.dtype == np.float32 and _meta["dtype"] == "float32" and _arr[1, 0, 0] == 7e4 and np.isfinite(_arr).all()
try: write_features(_p, 3, (4, 2), (np.full((1, 4, 2), v) for v in (1.0, np.nan, 2.5)), {"keys": ["a", "b", "c"]}); raise AssertionError
except CapbookError as e: print(e); assert "8 non-finite values in images 1..1" in str(e)
assert not features_ready(_p) and not list(_p.parent.glob(".*.tmp"))   # the old store stopped being valid first

# %% [markdown]
# A store larger than the free disk stops before anything is written — the old store, if any, stays valid — in one
# line that says how much is needed and how much is free (at COCO's size a paper encoder's store is 25–100 GB:
# `capbook.rehearsal`):

# %%
write_features(_p, 3, (4, 2), (np.full((1, 4, 2), i) for i in range(3)), {"keys": ["a", "b", "c"]})
try: write_features(_p, 10**6, (196, 2048), iter(()), {"keys": []}); raise AssertionError
except CapbookError as e: print(e); assert "needs 802.82 GB" in str(e) and "GB free" in str(e) and "\n" not in str(e)
assert features_ready(_p) and not list(_p.parent.glob(".*.tmp"))      # the old store untouched



# %% [markdown]
# ## Caption datasets
#
# `CaptionData` joins one split's memory-mapped features with its captions. Every reference caption of every image is a
# training example (five per image for COCO, Flickr and shapes), encoded once into a padded int64 array `caps`
# (M, max_len+2) with `lengths` (tokens including `<start>` and `<end>`) and `cap_img` (its image's row). `refs` keeps
# every reference of every image, untruncated, for evaluation.
#
# `batches(batch_size, epoch, seed)` follows Show-Attend-Tell's training procedure (§4.3): "in preprocessing we build a
# dictionary mapping the length of a sentence to the corresponding subset of captions. Then, during training we
# randomly sample a length and retrieve a mini-batch of size 64 of that length", because the decoder's cost grows with
# the longest caption of a batch. capbook's version: shuffle the M captions, sort them by length (stable, so the order
# within a length stays random), cut the sorted list into batches (so a batch holds captions of one length, or of two
# neighbouring lengths where a length's group does not divide evenly), and shuffle the batches. Every permutation is
# drawn from the split's own generator seeded with `seed*100003 + epoch`: the order depends on nothing but (seed,
# epoch), which is what makes a resumed run identical to an uninterrupted one (`skip` jumps over the batches already
# done). For DistributedDataParallel, rank `r` of `world` takes every `world`-th batch starting at `r`, after dropping
# the last `len % world` batches so every rank runs the same number of steps. Features are gathered from the memmap
# with sorted, de-duplicated row indices (sequential reads) and then put back in batch order.
#
# Two options serve the transformer chapters. `order="image"` keeps the captions of an image together: the images are
# shuffled and cut into groups holding `batch_size` captions or just more (a group never splits an image), so a model
# whose encoder is expensive runs it once per image of the batch (`batch["img"]` tells it which captions share an
# image). `max_words=n` trains only on captions of at most n words (Springenberg et al. §3: "Captions are restricted
# to have a maximum length of 14 words during training"); validation and test keep every reference. With the
# defaults the batches are exactly those above, draw for draw.
#
# **A batch is a mapping of named inputs.** Every batch is a `dict`: `feats` (B, L, D), `caps` (B, T), `lengths` (B,),
# `img` (B,: the image's row in the split) and `refs` (the B images' reference captions as token lists: what a
# self-critical reward is computed against). A split may carry more per-image inputs than the features — attribute
# words, region masks for a variable number of regions — added with `with_inputs(name=array)`, an array with one row
# per image; every batch then carries them under their names, gathered like `feats`. A model declares the names it
# reads (`CaptionModel.inputs`), and the trainer, the decoders and the evaluator pass the whole batch through, so a
# model with a new input needs no change to any of them.

# %%
#| export
BATCH_ORDERS = ("length", "image")   # captions bucketed by length (Show-Attend-Tell §4.3) | the captions of an image together

class CaptionData:
    "One split: memory-mapped features (N, L, D), other per-image `inputs`, image `keys`, all references `refs`, and encoded training captions."

    def __init__(self, feats: np.ndarray, keys: Sequence[str], refs: Sequence[list[list[str]]], vocab: Vocab,
                 max_len: int, split: str = ""):
        if not (len(feats) == len(keys) == len(refs)):
            raise CapbookError(f"split {split!r}: {len(feats)} feature rows, {len(keys)} keys and {len(refs)} caption sets differ")
        self.feats, self.keys, self.refs, self.vocab, self.split = feats, list(keys), [list(r) for r in refs], vocab, split
        self.inputs: dict[str, np.ndarray] = {"feats": feats}      # per-image arrays, one row per image
        self.max_len = check_int("max_len", max_len, lo=1)
        enc = [(i, vocab.encode(c, max_len)) for i, cs in enumerate(self.refs) for c in cs]
        self.caps = np.zeros((len(enc), max_len + 2), np.int64)
        for row, (_, ids) in zip(self.caps, enc): row[:len(ids)] = ids
        self.lengths = np.array([len(ids) for _, ids in enc], np.int64)
        self.cap_img = np.array([i for i, _ in enc], np.int64)
        self.words = np.array([len(c) for cs in self.refs for c in cs], np.int64)   # words of each caption, untruncated

    def __len__(self) -> int: return len(self.caps)

    @property
    def n_images(self) -> int:
        "Number of images in the split."
        return len(self.keys)

    def __repr__(self) -> str:
        extra = "".join(f", {k} {tuple(v.shape)}" for k, v in self.inputs.items() if k != "feats")
        return f"CaptionData({self.split!r}: {self.n_images} images, {len(self)} captions, feats {tuple(self.feats.shape)}{extra})"

    def n_kept(self, max_words: int = 0) -> int:
        "The training captions of at most `max_words` words (0: every caption)."
        return int((self.words <= max_words).sum()) if max_words else len(self)

    def with_inputs(self, **arrays: np.ndarray) -> CaptionData:
        "Add per-image inputs (one row per image, in the split's order); every batch then carries them by name."
        for name, a in arrays.items():
            if name in ("caps", "lengths", "img", "refs"):
                raise CapbookError(f"input name {name!r} is reserved: batches already carry caps, lengths, img and refs")
            if len(a) != self.n_images:
                raise CapbookError(f"input {name!r} of split {self.split!r} has {len(a)} rows: expected one per image ({self.n_images})")
            self.inputs[name] = a
        return self

    def _gather(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        u, inv = np.unique(rows, return_inverse=True)  # sorted unique rows: sequential memmap reads
        out = {}
        for name, a in self.inputs.items():
            x = torch.from_numpy(np.ascontiguousarray(np.asarray(a[u])[inv]))
            out[name] = wide(x) if x.is_floating_point() else x
        return out

    def num_batches(self, batch_size: int, world: int = 1, epoch: int = 0, seed: int = 0, order: str = "length",
                    max_words: int = 0) -> int:
        "Batches per epoch for each of `world` ranks (`epoch` and `seed` matter only when images have unequal caption counts)."
        if order == "length" and not max_words: return -(-len(self) // batch_size) // world
        return len(self._chunks(batch_size, epoch, seed, order, max_words)) // world

    def _chunks(self, batch_size: int, epoch: int, seed: int, order: str, max_words: int) -> list[np.ndarray]:
        "The epoch's batches as caption indices, in the order they are drawn."
        check_int("batch_size", batch_size, lo=1); check_choice("order", order, BATCH_ORDERS)
        check_int("max_words", max_words, lo=0)
        keep = self.words <= max_words if max_words else None
        g = torch.Generator().manual_seed(seed * 100003 + epoch)
        if order == "image":                                                  # all captions of an image together
            caps_of = np.split(np.arange(len(self)), np.flatnonzero(np.diff(self.cap_img)) + 1)   # captions per image row
            caps_of = [c[keep[c]] if keep is not None else c for c in caps_of]
            chunks, cur = [], []
            for i in torch.randperm(len(caps_of), generator=g).tolist():
                if len(caps_of[i]) == 0: continue
                cur.append(caps_of[i])
                if sum(map(len, cur)) >= batch_size: chunks.append(np.concatenate(cur)); cur = []
            return chunks + ([np.concatenate(cur)] if cur else [])
        perm = torch.randperm(len(self), generator=g).numpy()
        if keep is not None: perm = perm[keep[perm]]
        perm = perm[np.argsort(self.lengths[perm], kind="stable")]           # by length, random within a length
        chunks = [perm[s:s + batch_size] for s in range(0, len(perm), batch_size)]
        return [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()]

    def batches(self, batch_size: int, epoch: int, seed: int, rank: int = 0, world: int = 1,
                skip: int = 0, order: str = "length", max_words: int = 0) -> Iterator[dict]:
        "Shuffled caption batches {inputs..., caps, lengths, img, refs} (bucketed by length, or by image), deterministic for (seed, epoch); rank's share when world>1."
        check_int("world", world, lo=1); check_int("rank", rank, lo=0, hi=world - 1); check_int("skip", skip, lo=0)
        chunks = self._chunks(batch_size, epoch, seed, order, max_words)
        chunks = chunks[:len(chunks) // world * world][rank::world]
        for idx in chunks[skip:]:
            lens, img = self.lengths[idx], self.cap_img[idx]
            yield {**self._gather(img), "caps": torch.from_numpy(self.caps[idx, :lens.max()]),
                   "lengths": torch.from_numpy(lens), "img": torch.from_numpy(img), "refs": [self.refs[i] for i in img]}

    def image_batches(self, batch_size: int) -> Iterator[dict]:
        "The split's images in order, {inputs..., img, refs}: for decoding and evaluation."
        check_int("batch_size", batch_size, lo=1)
        for s in range(0, self.n_images, batch_size):
            e = min(s + batch_size, self.n_images)
            yield {**{k: _as_tensor(a[s:e]) for k, a in self.inputs.items()}, "img": torch.arange(s, e),
                   "refs": self.refs[s:e]}

def _as_tensor(a: np.ndarray) -> torch.Tensor:
    x = np.asarray(a)
    return wide(torch.from_numpy(x.astype(np.float32))) if x.dtype.kind == "f" else torch.from_numpy(np.array(x))   # a writable copy

def to_device(batch: dict, device: torch.device | str) -> dict:
    "The batch with every tensor moved to `device` (other entries, such as `refs`, as they are)."
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# %%
_cd = CaptionData(np.arange(3 * 2 * 1, dtype=np.float16).reshape(3, 2, 1), ["x", "y", "z"],
                  [[["a", "red", "circle"]], [["a", "red", "star"], ["a", "blue", "circle"]], [["a"]]], _v, max_len=3)
assert len(_cd) == 4 and _cd.n_images == 3 and _cd.caps.shape == (4, 5) and list(_cd.lengths) == [5, 5, 5, 3]
_b = [b["img"].tolist() for b in _cd.batches(2, epoch=1, seed=0)]
assert sorted(sum(_b, [])) == [0, 1, 1, 2] and _b == [b["img"].tolist() for b in _cd.batches(2, epoch=1, seed=0)]
_x = next(_cd.batches(4, 0, 0))
assert (_x["feats"][:, 0, 0] == torch.tensor([2.0 * i for i in _x["img"].tolist()])).all()
assert [len(r) for r in _x["refs"]] == [len(_cd.refs[i]) for i in _x["img"].tolist()]

# %% [markdown]
# Grouped by image, every image's captions sit in one batch; with `max_words` the longer captions are left out.

# %%
_g = [b["img"].tolist() for b in _cd.batches(2, epoch=1, seed=0, order="image")]
assert sorted(sum(_g, [])) == [0, 1, 1, 2] and all(len(set(g)) == len(g) or g.count(1) == 2 for g in _g)
assert next(i for i, g in enumerate(_g) if 1 in g) == next(i for i, g in enumerate(_g) if g.count(1) == 2)
assert sorted(sum([b["img"].tolist() for b in _cd.batches(2, 1, 0, max_words=1)], [])) == [2]
assert _cd.num_batches(2, order="image") == len(list(_cd.batches(2, 0, 0, order="image")))

# %% [markdown]
# A second per-image input travels with the features: here an attribute id per image, gathered by image row.

# %%
_cd.with_inputs(attrs=np.array([[10], [11], [12]]))
_x = next(_cd.batches(4, 0, 0))
assert _x["attrs"][:, 0].tolist() == [10 + i for i in _x["img"].tolist()] and _x["attrs"].dtype == torch.int64
assert [b["attrs"][:, 0].tolist() for b in _cd.image_batches(2)] == [[10, 11], [12]]
