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
# # prepare
#
# > `prepare`: from a dataset name to ready-to-train splits — the one data entry point every chapter calls.
#
# This module sits above `capbook.data` (readers, vocabulary, feature stores, caption datasets) and
# `capbook.encoders` (the frozen CNNs), which builds on `capbook.data`; keeping `prepare` here means no module of the
# data layer imports another that imports it back.

# %%
#| default_exp prepare

# %%
#| export
from __future__ import annotations
from dataclasses import dataclass, field
from pathlib import Path
import numpy as np
from capbook.core import CapbookError, check_choice, check_int, file_digests, io_errors_as_lines, load_json, one_at_a_time, stable_hash
from capbook.data import (SPLITS, CaptionData, KarpathyData, Vocab, feature_path, open_features, read_karpathy,
                          store_outdated, write_features)
from capbook import encoders, shapes

# %% [markdown]
# ## From a dataset name to ready-to-train splits
#
# Every paper notebook starts with `prepare(...)`. It builds whatever is missing and caches it under `data_dir()`:
#
# - **shapes** (default): generates the synthetic set for the profile and seed (`capbook.shapes.ensure_shapes`),
#   pretrains and freezes the small shapes CNN on its training split (`capbook.encoders.shapes_encoder`) and extracts
#   its 14×14 annotation vectors for train/val/test;
# - **coco / flickr8k / flickr30k**: reads `data_path/dataset_<name>.json` with the images under `data_path`, builds
#   the torchvision backbone (`encoder`: `vgg16` by default as in Show-Attend-Tell, `vgg11` for the spatial
#   transformer, `resnet101` for SPCA) and extracts its features.
#
# The vocabulary comes from the training captions (`min_count`); `max_len` defaults to the 95th percentile of the
# training caption lengths for shapes, and to 20 words for real data. For real data, `weights` picks the backbone's
# weights (`'imagenet'`, a state-dict file, or `'random'` for plumbing tests; see `encoders.build_backbone`), and
# `batch_size` the extraction batch. A second call with the same arguments only opens the cached stores: it builds no
# backbone and decodes no image.
#
# **Provenance.** Every image file must be present: its content hash (`capbook.core.file_digests`, cached by file
# signature, so a second call only stats the files) is part of what the feature stores were computed from, and a store
# whose images changed is extracted again, saying why. `Prepared.fingerprint` hashes everything a model trained on
# this data depends on — each image's content and captions, the split it is in, the encoder key (which names the
# weights by content), the vocabulary and `max_len` — and the trainer keeps it in its checkpoints: a run folder whose
# checkpoint was trained on other data is never resumed (`capbook.train.fit`).

# %%
#| export
DATASETS = ("shapes", "coco", "flickr8k", "flickr30k")

@dataclass
class Prepared:
    "Everything a paper notebook trains and evaluates on: three `CaptionData` splits, the vocabulary and provenance."
    train: CaptionData
    val: CaptionData
    test: CaptionData
    vocab: Vocab
    gt: dict | None          # shapes ground truth (boxes, attributes, relations), None for real data
    dataset: str             # e.g. 'shapes-default-s0' or 'coco'
    encoder: str             # encoder key, e.g. 'vgg16-224px-imagenet1k_v1'
    feat_shape: tuple[int, int]  # (L regions, D channels)
    grid: tuple[int, int]    # (h, w) of the feature map, L = h*w
    image_size: int
    max_len: int             # words kept per training caption
    fingerprint: str         # hash of everything a model of this data depends on (see above)
    kdata: KarpathyData = field(repr=False)

    def describe(self) -> str:
        "One line of provenance: dataset, sizes, encoder, fingerprint."
        return (f"data: {self.dataset} ({self.train.n_images}/{self.val.n_images}/{self.test.n_images} train/val/test "
                f"images, {len(self.vocab)} words), encoder {self.encoder}, grid {self.grid[0]}×{self.grid[1]}×"
                f"{self.feat_shape[1]}, fingerprint {self.fingerprint}")

    def split(self, s: str) -> CaptionData:
        "The `CaptionData` of split `s`."
        return getattr(self, check_choice("split", s, SPLITS))

    def image_paths(self, split: str) -> list[Path]:
        "Image files of a split, in the order of its `CaptionData` rows (for figures)."
        return [r.path for r in self.kdata.split(split)]

    def image_ids(self, split: str) -> list[int | str]:
        "The ids a COCO results file names a split's images by (`ImageRecord.image_id`), in the order of its rows."
        return [r.image_id for r in self.kdata.split(split)]


# %% [markdown]
# ## Precomputed region features
#
# Up-Down and GLIED read the bottom-up regions of Anderson et al.: for each image, a Faster R-CNN's N detected
# regions as an N × 2048 array, N varying by image (10 to 100 on COCO). They are distributed precomputed, one file per
# image; `prepare(..., regions=<folder>)` reads `<folder>/<image file stem>.npy` or `.npz`, or `<folder>/<COCO id>.npy`
# / `.npz` (the id being the number at the end of the file name, as in ruotianluo's `cocobu_att/391895.npz`; an `.npz`
# holds its array as `feat` or alone). The arrays go into the same feature store as a grid, zero-padded to the longest
# N, and the store's meta keeps each image's N; every split then carries a `feat_mask` input (True for a real region),
# so a model that reads it attends only to real regions — and a model that does not declare `region_masks` refuses
# such data in one line rather than attending to padding (`capbook.models.check_inputs`). The store is keyed by the
# region files' content. No image is decoded, but the images must be present like any other real data set: they are
# part of the data's fingerprint, and figures draw them.

# %%
#| export
def region_files(kdata: KarpathyData, folder: str | Path) -> list[Path]:
    "The region-features file of every image of `kdata`: <stem>.npy|.npz or <numeric id>.npy|.npz in `folder`."
    import re
    folder, out = Path(folder), []
    if not folder.is_dir(): raise CapbookError(f"{folder}: region features folder not found (parameter regions)")
    for r in kdata.records:
        stem = Path(r.key).stem
        m = re.search(r"(\d+)$", stem)
        names = [stem] + ([str(int(m.group(1)))] if m else [])
        hit = next((folder / f"{n}{ext}" for n in names for ext in (".npy", ".npz") if (folder / f"{n}{ext}").is_file()), None)
        if hit is None:
            raise CapbookError(f"{folder}: no region features for image {r.key} (expected {' or '.join(f'{n}.npy/.npz' for n in names)})")
        out.append(hit)
    return out

def load_regions(path: Path) -> np.ndarray:
    "One image's region features, checked: a finite (N >= 1, D) float array."
    try:
        with np.load(path, allow_pickle=False) as z: a = z["feat"] if "feat" in z.files else z[z.files[0]] if len(z.files) == 1 else None
    except (AttributeError, TypeError):               # a .npy: np.load returns the array itself
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError, KeyError) as e: raise CapbookError(f"{path}: unreadable region features ({e})") from None
    if a is None: raise CapbookError(f"{path}: an .npz of region features holds its array as 'feat' or alone")
    a = np.asarray(a)
    if a.ndim != 2 or a.shape[0] < 1 or not np.issubdtype(a.dtype, np.number):
        raise CapbookError(f"{path}: region features must be a numeric N x D array with N >= 1, not shape {a.shape}, dtype {a.dtype}")
    if not np.isfinite(a).all(): raise CapbookError(f"{path}: region features hold NaN or infinite values")
    return a.astype(np.float32)

def region_extent(files: list[Path]) -> tuple[int, int, dict]:
    "(longest N, D, each file's N) over the files; one line naming a file whose D differs."
    d, counts = None, {}
    for f in files:
        a = load_regions(f)
        if d is not None and a.shape[1] != d: raise CapbookError(f"{f}: {a.shape[1]} features per region, other files have {d}")
        d, counts[f] = a.shape[1], len(a)
    return max(counts.values()), d, counts

def write_regions(files: list[Path], path: Path, keys: list[str], source: dict, extent: tuple[int, int, dict]) -> Path:
    "A feature store of the images' regions, zero-padded to (N_max, D) of `extent`; its meta keeps each image's N."
    n_max, d, counts = extent
    def rows():
        for f in files:
            a = load_regions(f)
            out = np.zeros((1, n_max, d), np.float32); out[0, :len(a)] = a
            yield out
    meta = {"keys": list(keys), "source": source, "grid": [1, n_max], "nregions": [counts[f] for f in files]}
    return write_features(path, len(files), (n_max, d), rows(), meta)


# %%
#| export
@io_errors_as_lines
@one_at_a_time("prepare")            # side-by-side runs: the first builds what is missing, the others then open it
def prepare(dataset: str = "shapes", profile: str = "default", seed: int = 0, data_path: str | Path | None = None,
            encoder: str | None = None, min_count: int = 5, max_len: int | None = None, device: str = "auto",
            weights: str = "imagenet", batch_size: int = 32, regions: str | Path | None = None) -> Prepared:
    "Build (or open the cached) features, vocabulary and caption splits of `dataset`; see the text above."
    check_choice("dataset", dataset, DATASETS)
    seed = check_int("seed", seed, lo=0); check_int("min_count", min_count, lo=1)
    if max_len is not None: check_int("max_len", max_len, lo=1)
    gt = None
    if dataset == "shapes":
        check_choice("profile", profile, list(shapes.PROFILES))
        if data_path is not None: raise CapbookError("data_path is only used with dataset='coco', 'flickr8k' or 'flickr30k'")
        if encoder not in (None, "shapes"):
            raise CapbookError(f"parameter encoder={encoder!r} is invalid: the shapes set uses its own encoder ('shapes' or None)")
        if regions is not None: raise CapbookError("regions is only used with dataset='coco', 'flickr8k' or 'flickr30k'")
        root = shapes.ensure_shapes(profile, seed)
        kdata = read_karpathy(root / "dataset_shapes.json", root)
        gt = load_json(root / "shapes_gt.json", "shapes ground truth")
        shapes_net = encoders.shapes_encoder(kdata, gt, profile=profile, seed=seed, device=device)
        name, size = f"shapes-{profile}-s{seed}", int(gt["image_size"])
        key, make_net = shapes_net.encoder_key(size), lambda: shapes_net
    else:
        if data_path is None:
            raise CapbookError(f"dataset={dataset!r} needs data_path=<folder> holding dataset_{dataset}.json (Karpathy split) "
                               f"and the images at <folder>/<filepath>/<filename>"
                               + (" (<folder>/train2014/ and <folder>/val2014/)" if dataset == "coco" else ""))
        if regions is None: encoder = check_choice("encoder", encoder or "vgg16", list(encoders.BACKBONES))
        kdata = read_karpathy(Path(data_path) / f"dataset_{dataset}.json", data_path)
        if regions is not None:                   # precomputed region features instead of an encoder's grid
            rfiles = dict(zip((r.key for r in kdata.records), region_files(kdata, regions)))
            rdig = dict(zip(rfiles, file_digests(list(rfiles.values()), "region features file")))
            name, size, key = dataset, 0, f"regions-{stable_hash(sorted(rdig.values()), 12)}"
        else:
            name, size = dataset, encoders.BACKBONES[encoder].image_size
            key = f"{encoder}-{size}px-{encoders.weights_id(encoder, weights, seed)}"
            make_net = lambda: encoders.build_backbone(encoder, weights=weights, seed=seed)
    missing = [r.path for r in kdata.records if not r.path.is_file()]
    if missing: raise CapbookError(f"{missing[0]}: image not found ({len(missing)} of {len(kdata.records)} images of "
                                   f"{kdata.json_path.name} are missing)")
    splits, net, extent = {}, None, None
    for s in SPLITS:
        recs = kdata.split(s)
        if not recs: raise CapbookError(f"{kdata.json_path}: split {s!r} has no images")
        path, keys = feature_path(name, key, s), [r.key for r in recs]
        source = ({"images": kdata.digest(s, captions=False)} if regions is None   # what the store is computed from
                  else {"regions": stable_hash([rdig[k] for k in keys], 16)})
        why = store_outdated(path, keys, source)
        if why is not None:
            if path.exists(): print(f"{path}: {why}; extracting again")
            if regions is not None:
                extent = extent or region_extent(list(rfiles.values()))   # one longest region list for every split
                write_regions([rfiles[k] for k in keys], path, keys, source, extent)
            else:
                if net is None: net = make_net()  # the backbone is built only when a store is missing
                encoders.extract_features([r.path for r in recs], net, size, path, keys, batch_size=batch_size,
                                          device=device, source=source)
        feats, meta = open_features(path)
        splits[s] = (feats, recs, meta)
    train_caps = [c for r in splits["train"][1] for c in r.captions]
    shapes_ = {tuple(f.shape[1:]) for f, _, _ in splits.values()}
    if len(shapes_) > 1: raise CapbookError(f"{feature_path(name, key, 'train').parent}: the splits' stores differ in shape ({sorted(shapes_)}); delete them to rebuild")
    if max_len is None:
        max_len = max(1, int(np.ceil(np.percentile([len(c) for c in train_caps], 95)))) if dataset == "shapes" else 20
    vocab = Vocab.build(train_caps, min_count)
    data = {s: CaptionData(f, [r.key for r in recs], [r.captions for r in recs], vocab, max_len, s)
            for s, (f, recs, _) in splits.items()}
    for s, (f, _, m) in splits.items():
        if "nregions" in m:                      # a variable number of regions: which rows are real
            data[s].with_inputs(feat_mask=np.arange(f.shape[1])[None] < np.asarray(m["nregions"])[:, None])
    meta = splits["train"][2]
    L, D = data["train"].feats.shape[1:]
    fingerprint = stable_hash({"dataset": name, "data": kdata.digest(), "encoder": key, "vocab": vocab.itos,
                               "max_len": max_len}, 16)
    return Prepared(data["train"], data["val"], data["test"], vocab, gt, name, key, (L, D), tuple(meta["grid"]), size,
                    max_len, fingerprint, kdata)


# %% [markdown]
# Usage (not run here: the first call trains the shapes encoder and extracts features, about a minute on a CPU):
#
# ```python
# P = prepare()                                   # shapes, default profile
# P = prepare(profile="smoke")                    # the CI-sized set
# P = prepare("coco", data_path="/data/coco", encoder="resnet101", device="cuda")
# for batch in P.train.batches(64, epoch=0, seed=0): ...
# ```

# %% [markdown]
# ## What a run's inputs are, without preparing them
#
# `capbook book` skips a chapter run whose notebook, parameters and code are unchanged — and whose inputs are
# unchanged: `inputs_digest` hashes, by content, the files a run with these parameters would read (the Karpathy file,
# every image, the shapes ground truth, a weights file given by path) without building anything. It is `None` while
# the data does not exist yet (the shapes set of a fresh clone), and the book records the digest after the run.
# `encoder` is the backbone the run uses on real data (the book passes the chapter's when the parameters name none),
# so that the hub's ImageNet weights file counts too.

# %%
#| export
def inputs_digest(dataset: str = "shapes", profile: str = "default", seed: int = 0, data_path: str | None = None,
                  weights: str = "imagenet", encoder: str | None = None, regions: str | None = None, **_) -> str | None:
    "Content hash of the input files a chapter run with these parameters reads; None if they do not exist yet."
    if dataset == "shapes":
        if profile not in shapes.PROFILES: return None
        root = shapes.shapes_root(profile, seed)
        if not (root / "dataset_shapes.json").exists(): return None
        files = [root / "dataset_shapes.json", root / "shapes_gt.json"]
    else:
        if data_path is None or not (Path(data_path) / f"dataset_{dataset}.json").exists(): return None
        files = [Path(data_path) / f"dataset_{dataset}.json"]
        if weights not in ("imagenet", "random") and Path(weights).is_file(): files.append(Path(weights))
        if weights == "imagenet" and encoder in encoders.BACKBONES and encoders.imagenet_path(encoder).is_file():
            files.append(encoders.imagenet_path(encoder))         # the hub's file, by content like any other input
    kdata = read_karpathy(files[0], files[0].parent if dataset == "shapes" else data_path)
    if any(not r.path.is_file() for r in kdata.records): return None
    if regions is not None and dataset != "shapes":
        try: files += region_files(kdata, regions)
        except CapbookError: return None
    return stable_hash([file_digests(files), kdata.digest()], 16)
