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
# # encoders
#
# > The frozen CNNs that turn images into annotation vectors: torchvision backbones cut where each paper cuts them, the small shapes CNN pretrained on the synthetic set, and feature extraction into the memory-mapped store.

# %%
#| default_exp encoders

# %%
#| export
from __future__ import annotations
import contextlib, hashlib, itertools, socket, time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence
from urllib.parse import urlparse
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from capbook.core import (CapbookError, autocast, check_choice, data_dir, file_digest, get_device, load_torch, progress,
                          save_torch, stable_hash)
from capbook.data import KarpathyData, load_image, load_rgb, normalize, write_features


# %% [markdown]
# ## Where the papers take their features
#
# Show-Attend-Tell: *"we use the 14×14×512 feature map of the fourth convolutional layer before max pooling"* of the
# Oxford VGGnet, giving L×D = 196×512 annotation vectors. The spatial self-attention paper: *"feature maps of VGG-11
# net are used after a convolution layer that still retains a spatial resolution of 14×14"*. SPCA: *"Resnet-101 ...
# no cropping or re-scaling is applied to the original images, instead, an adaptive spatial average pooling layer is
# utilized to produce features with a fixed size of 2048×14×14"*.
#
# *capbook commentary:* the VGG cut is the last convolution of block 5 after its ReLU, before the last max-pool,
# which gives 14×14 at 224 px. Show-Attend-Tell's "fourth convolutional layer" of block 5 (conv5_4) exists in the
# 19-layer VGG, registered as `vgg19`; `vgg16`, capbook's default for real data, has three convolutions in block 5,
# so its cut is conv5_3. ResNet-101 takes 448 px images (its stride of 32 gives 14×14 there) followed by an adaptive
# average pool to 14×14, so any input size gives 196 regions. All images are squashed to a square (see
# `data.load_image`).

# %%
#| export
def _resnet_trunk(m: nn.Module) -> nn.Module:
    names = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
    return nn.Sequential(OrderedDict([(n, getattr(m, n)) for n in names] + [("pool", nn.AdaptiveAvgPool2d(14))]))

@dataclass(frozen=True)
class BackboneSpec:
    "A torchvision classifier cut where a paper takes its annotation vectors."
    arch: str                             # torchvision builder
    weights: str                          # torchvision weights used for weights='imagenet'
    image_size: int                       # input size giving the paper's 14×14 map
    dim: int                              # channels D of the annotation vectors
    layer: str                            # where the cut is
    cut: Callable[[nn.Module], nn.Module] # full model → trunk (submodule names kept)
    prefix: str                           # the trunk's state-dict prefix inside the full model

BACKBONES = {
    "vgg16": BackboneSpec("vgg16", "VGG16_Weights.IMAGENET1K_V1", 224, 512, "conv5_3 + ReLU, before the last max-pool",
                          lambda m: m.features[:30], "features."),
    "vgg19": BackboneSpec("vgg19", "VGG19_Weights.IMAGENET1K_V1", 224, 512, "conv5_4 + ReLU, before the last max-pool",
                          lambda m: m.features[:36], "features."),
    "vgg11": BackboneSpec("vgg11", "VGG11_Weights.IMAGENET1K_V1", 224, 512, "conv5_2 + ReLU, before the last max-pool",
                          lambda m: m.features[:20], "features."),
    "resnet101": BackboneSpec("resnet101", "ResNet101_Weights.IMAGENET1K_V1", 448, 2048,
                              "layer4, adaptive-average-pooled to 14×14", _resnet_trunk, ""),
    # no paper's: the COCO-scale rehearsal's small encoder (capbook.rehearsal), 4×4 at 112 px, ~500 images/s on 2 cores
    "mobilenet_v3_small": BackboneSpec("mobilenet_v3_small", "MobileNet_V3_Small_Weights.IMAGENET1K_V1", 112, 576,
                                       "the last features block (576 channels, stride 32)", lambda m: m.features, "features."),
}


# %% [markdown]
# ## A frozen encoder
#
# An `Encoder` wraps a trunk and stays frozen: no gradients, and `train()` leaves it in eval mode, so its BatchNorm
# statistics never move. Its `encoder_key(image_size)` (name, input size, weights) names its feature store.

# %%
#| export
class Encoder(nn.Module):
    "A frozen CNN trunk: ImageNet-normalised images (B, 3, S, S) → annotation maps (B, D, h, w)."
    def __init__(self, trunk: nn.Module, name: str, weights_id: str, dim: int):
        super().__init__()
        self.trunk, self.name, self.weights_id, self.dim = trunk, name, weights_id, dim
        self.requires_grad_(False).eval()

    def train(self, mode: bool = True) -> Encoder:
        "Frozen: always stays in eval mode."
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        "The annotation map (B, D, h, w)."
        return self.trunk(x)

    def encoder_key(self, image_size: int) -> str:
        "Name of this encoder's feature stores: `<name>-<size>px-<weights>`."
        return f"{self.name}-{image_size}px-{self.weights_id}"


# %% [markdown]
# ## Weights
#
# `weights="imagenet"` uses torchvision's ImageNet weights: the file in torch hub's checkpoint folder
# (`$TORCH_HOME/hub/checkpoints`, by default `~/.cache/torch/hub/checkpoints`) when it is there, else a download into
# that folder. With neither, one line says which file to put in which folder, or which parameter to pass instead
# (`-p weights /path/file.pth` to a chapter run by papermill, `weights=` to `prepare`). `weights=<path>` loads
# a state dict for the torchvision model (only the trunk's entries are needed); `weights="random"` gives torchvision's
# initialisation drawn from `seed` (for tests and ablations). Models are built on the meta device and only the trunk
# is materialised, so VGG's 120M-parameter classifier is never allocated.
#
# The weights are named **by content** in the encoder key that names the feature stores: `imagenet1k_v1-<hash>` or
# `file-<hash>` (SHA-256 of the file, `capbook.core.file_digest`), so another file under the same name never reuses
# features computed with the old one.

# %%
#| export
def imagenet_path(name: str) -> Path:
    "Where torch hub keeps `name`'s ImageNet weights (whether or not the file is there)."
    import torchvision                                           # here, not at the top: 1.3 s that only the backbones need
    url = torchvision.models.get_weight(BACKBONES[check_choice("encoder", name, BACKBONES)].weights).url
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name

def _imagenet_file(name: str, spec: BackboneSpec) -> Path:
    "The hub checkpoint of `spec`'s ImageNet weights, downloaded if missing."
    import torchvision
    url = torchvision.models.get_weight(spec.weights).url
    ckpt = imagenet_path(name)
    if ckpt.is_file(): return ckpt
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    old = socket.getdefaulttimeout(); socket.setdefaulttimeout(30)
    try: torch.hub.download_url_to_file(url, str(ckpt), progress=True)
    except Exception as e:
        why = f"{e.__class__.__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        raise CapbookError(f"{name}: ImageNet weights unavailable (download failed: {why}; no {ckpt.name} in "
                           f"{ckpt.parent}); put that file in that folder, or pass another weights file "
                           f"(a chapter run by papermill: -p weights /path/file.pth; Python: prepare(..., weights='/path/file.pth'))") from None
    finally: socket.setdefaulttimeout(old)
    return ckpt

def _trunk_state(file: Path, name: str, spec: BackboneSpec, trunk: nn.Module) -> dict[str, torch.Tensor]:
    "The trunk's entries of a torchvision state dict file, checked against the model."
    sd = load_torch(file, f"{name} weights")
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict): sd = sd["state_dict"]
    if not isinstance(sd, dict): raise CapbookError(f"{file}: not a {name} state dict (found a {type(sd).__name__})")
    out, bad = {}, []
    for k, v in trunk.state_dict().items():
        got = sd.get(spec.prefix + k)
        if got is None and k.endswith("num_batches_tracked"): got = torch.tensor(0)
        if not isinstance(got, torch.Tensor) or got.shape != v.shape: bad.append(spec.prefix + k)
        else: out[k] = got
    if bad: raise CapbookError(f"{file}: not a {name} state dict ({len(bad)} of {len(out) + len(bad)} entries missing "
                               f"or of the wrong shape, e.g. {bad[0]!r})")
    return out

def _init_random(trunk: nn.Module) -> None:
    "torchvision's initialisation for VGG and ResNet convolutions and BatchNorm."
    for m in trunk.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None: nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d): m.reset_parameters()

def weights_id(name: str, weights: str | Path = "imagenet", seed: int = 0) -> str:
    "The weights part of an encoder key, by content: 'imagenet1k_v1-<sha256>', 'file-<sha256>' or 'random-s<seed>'."
    spec = BACKBONES[check_choice("encoder", name, BACKBONES)]
    if weights == "random": return f"random-s{seed}"
    if weights == "imagenet":
        return f"{spec.weights.split('.')[-1].lower()}-{file_digest(_imagenet_file(name, spec), f'{name} weights')[:10]}"
    if not Path(weights).is_file():
        raise CapbookError(f"parameter weights={str(weights)!r} is invalid: no such file (expected 'imagenet', 'random' "
                           f"or the path of a {name} state-dict file)")
    return f"file-{file_digest(weights, f'{name} weights')[:10]}"

def build_backbone(name: str, weights: str | Path = "imagenet", seed: int = 0) -> Encoder:
    "A frozen torchvision trunk from `BACKBONES` with 'imagenet', 'random' (seeded) or a state-dict file's weights."
    import torchvision
    spec, wid = BACKBONES[check_choice("encoder", name, BACKBONES)], weights_id(name, weights, seed)
    with torch.device("meta"): trunk = spec.cut(getattr(torchvision.models, spec.arch)())
    trunk = trunk.to_empty(device="cpu")
    if weights == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed); _init_random(trunk)
    else:
        file = _imagenet_file(name, spec) if weights == "imagenet" else Path(weights)
        trunk.load_state_dict(_trunk_state(file, name, spec, trunk))
    return Encoder(trunk, name, wid, spec.dim)


# %%
_vgg = build_backbone("vgg11", weights="random")
assert _vgg(torch.zeros(1, 3, 64, 64)).shape == (1, 512, 4, 4) and _vgg.encoder_key(224) == "vgg11-224px-random-s0"
assert all(torch.equal(a, b) for a, b in zip(_vgg.state_dict().values(), build_backbone("vgg11", "random").state_dict().values()))

# %% [markdown]
# ## The shapes encoder
#
# The papers freeze an ImageNet-pretrained CNN. The synthetic set has no ImageNet, so capbook pretrains a small CNN
# on its own training split, once per (profile, seed), and freezes it, just as the papers froze VGG: the captioning
# models never see its labels or boxes, only its 14×14 map.
#
# **Architecture.** Four 3×3 convolutions with BatchNorm and ReLU take the 112 px image to 14×14 (three stride-2
# layers, 16 → 32 → 64 channels, then a dilated one that widens the receptive field to 47 px, enough for the largest
# shape), and a 1×1 convolution gives D=128 channels: 196 annotation vectors of 128 dimensions.
#
# **Pretraining task.** Multi-label presence, like an ImageNet classifier with several objects: which colour-shape pairs
# ("red circle"), shapes, colours, sizes and size-shape pairs appear in the image, from the `shapes_gt.json` ground
# truth. A 1×1 classifier scores every cell of the map and the scores are max-pooled over the grid (global max
# pooling, as in multiple-instance learning), so each label must be visible at some cell: the map learns *what is
# where*, which is what attention will read. (capbook measured that pooling the features first and classifying after
# learned the colour-shape binding far more slowly.) Training: AdamW with a one-cycle schedule, batch 16, random
# horizontal flips, 12 epochs (about 40 s on a 2-core CPU for the default profile). It reports micro-F1 and
# colour-shape pair F1 of the presence predictions on the held-out val split.

# %%
#| export
SHAPES_CNN = dict(width=16, dim=128, epochs=12, batch_size=16, lr=5e-3, weight_decay=1e-4)

class ShapesCNN(nn.Module):
    "The shapes encoder: `features` (112 px → 14×14×dim) and a per-cell presence classifier, max-pooled over the grid."
    def __init__(self, n_labels: int, width: int = 16, dim: int = 128):
        super().__init__()
        def block(i: int, o: int, stride: int = 1, dil: int = 1, k: int = 3) -> list[nn.Module]:
            return [nn.Conv2d(i, o, k, stride, padding=dil * (k // 2), dilation=dil, bias=False), nn.BatchNorm2d(o),
                    nn.ReLU(inplace=True)]
        w = width
        self.features = nn.Sequential(*block(3, w, 2), *block(w, 2 * w, 2), *block(2 * w, 4 * w, 2),
                                      *block(4 * w, 4 * w, dil=2), *block(4 * w, dim, k=1))
        self.head = nn.Conv2d(dim, n_labels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        "Presence logits (B, n_labels): the best cell's score for each label."
        return self.head(self.features(x)).amax((2, 3))

def shape_labels(objects: Sequence[dict]) -> set[str]:
    "Presence labels of a scene: 'red circle', 'circle', 'red', 'small', 'small circle' for each object."
    return {l for o in objects for l in (f"{o['colour']} {o['shape']}", o["shape"], o["colour"], o["size"],
                                         f"{o['size']} {o['shape']}")}


# %%
assert ShapesCNN(3).features(torch.zeros(2, 3, 112, 112)).shape == (2, 128, 14, 14)
assert shape_labels([dict(shape="star", colour="red", size="small", box=[0, 0, 9, 9])]) == {"red star", "star", "red", "small", "small star"}


# %%
#| export
def _load_rgb_batch(paths: Sequence[Path], size: int, workers: int = 2) -> torch.Tensor:
    with ThreadPoolExecutor(workers) as pool:
        return torch.from_numpy(np.stack(list(pool.map(lambda p: load_rgb(p, size), paths)))).permute(0, 3, 1, 2).contiguous()

def _targets(keys: Sequence[str], gt: dict, labels: Sequence[str]) -> torch.Tensor:
    idx = {l: i for i, l in enumerate(labels)}
    y = torch.zeros(len(keys), len(labels))
    for r, k in enumerate(keys):
        for l in shape_labels(gt["images"][k]["objects"]):
            if l in idx: y[r, idx[l]] = 1
    return y

@torch.inference_mode()
def presence_scores(model: ShapesCNN, x: torch.Tensor, y: torch.Tensor, labels: Sequence[str],
                    device: torch.device = torch.device("cpu")) -> dict:
    "Micro-F1, colour-shape pair F1 and exact-match rate of the presence predictions (logit > 0) on images `x`."
    model.eval()
    p = torch.cat([model(normalize(x[s:s + 256].to(device))).cpu() for s in range(0, len(x), 256)]) > 0
    t = y > 0
    f1 = lambda m: 2 * (p[:, m] & t[:, m]).sum().item() / max(1, p[:, m].sum().item() + t[:, m].sum().item())
    pair = torch.tensor([len(l.split()) == 2 and l.split()[0] not in ("small", "large") for l in labels])
    return {"micro_f1": round(f1(slice(None)), 4), "pair_f1": round(f1(pair), 4),
            "exact_match": round((p == t).all(1).float().mean().item(), 4), "images": len(x)}

def train_shapes_encoder(kdata: KarpathyData, gt: dict, seed: int = 0, device: str = "auto",
                         cfg: dict | None = None) -> tuple[ShapesCNN, list[str], dict]:
    "Pretrain the shapes CNN on the train split's presence labels; returns (model, labels, held-out val scores)."
    cfg = {**SHAPES_CNN, **(cfg or {})}
    dev, size, t0 = get_device(device), int(gt["image_size"]), time.perf_counter()
    tr, va = kdata.split("train"), kdata.split("val")
    labels = sorted(set().union(*(shape_labels(gt["images"][r.key]["objects"]) for r in tr)))
    xtr, ytr = _load_rgb_batch([r.path for r in tr], size), _targets([r.key for r in tr], gt, labels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ShapesCNN(len(labels), cfg["width"], cfg["dim"]).to(dev).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(seed)
    bs = min(cfg["batch_size"], len(tr)); steps = len(tr) // bs
    opt = torch.optim.AdamW(model.parameters(), cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg["lr"], total_steps=cfg["epochs"] * steps, pct_start=0.2)
    for _ in progress(range(cfg["epochs"]), desc="shapes encoder", unit="epoch"):
        model.train()
        perm = torch.randperm(len(tr), generator=g)
        for s in range(steps):
            i = perm[s * bs:(s + 1) * bs]
            x = normalize(xtr[i].to(dev))
            x = torch.where((torch.rand(len(i), generator=g) < 0.5).view(-1, 1, 1, 1).to(dev), x.flip(3), x)
            loss = F.binary_cross_entropy_with_logits(model(x.contiguous(memory_format=torch.channels_last)), ytr[i].to(dev))
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step(); sched.step()
    train_s = time.perf_counter() - t0
    xva, yva = _load_rgb_batch([r.path for r in va], size), _targets([r.key for r in va], gt, labels)
    scores = {**presence_scores(model, xva, yva, labels, dev), "train_seconds": round(train_s, 1)}
    return model.cpu().eval(), labels, scores


# %% [markdown]
# The trained encoder is saved atomically to `data_dir()/encoders/shapes-<profile>-s<seed>.pt` with its configuration,
# labels and scores, and loaded with `weights_only=True`. It is retrained only when that configuration (architecture,
# training settings, image size, training images) changes. Its weights' hash enters the encoder key, so features
# extracted from a different encoder are never mixed up with these.

# %%
#| export
def _state_id(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k, v in sd.items(): h.update(k.encode()); h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:10]

def shapes_encoder_path(profile: str, seed: int) -> Path:
    "Where the pretrained shapes encoder of (profile, seed) is cached."
    return data_dir() / "encoders" / f"shapes-{profile}-s{seed}.pt"

def shapes_encoder(kdata: KarpathyData, gt: dict, profile: str = "default", seed: int = 0,
                   device: str = "auto") -> Encoder:
    "The frozen shapes encoder of (profile, seed): loaded from its cache, or pretrained now and cached."
    path = shapes_encoder_path(profile, seed)
    config = {**SHAPES_CNN, "image_size": int(gt["image_size"]), "seed": seed,
              "train_images": kdata.digest("train", captions=False),
              "train_truth": stable_hash([gt["images"].get(r.key) for r in kdata.split("train")])}
    ck = load_torch(path, "shapes encoder") if path.exists() else None
    if ck is not None and ck.get("config") != config:
        changed = sorted(k for k in config if ck.get("config", {}).get(k) != config[k])
        print(f"{path}: the cached shapes encoder was trained with other {', '.join(changed)}; training it again")
    if ck is None or ck.get("config") != config:
        model, labels, scores = train_shapes_encoder(kdata, gt, seed, device)
        print(f"shapes encoder: held-out micro-F1 {scores['micro_f1']:.3f}, colour-shape F1 {scores['pair_f1']:.3f}, "
              f"trained in {scores['train_seconds']:.0f} s")
        sd = model.state_dict()
        ck = {"config": config, "labels": labels, "scores": scores, "state_dict": sd, "weights_id": _state_id(sd)}
        save_torch(path, ck)
    model = ShapesCNN(len(ck["labels"]), config["width"], config["dim"])
    model.load_state_dict(ck["state_dict"])
    return Encoder(model.features, "shapescnn", f"{profile}-s{seed}-{ck['weights_id']}", config["dim"])


# %% [markdown]
# ## Feature extraction
#
# `extract_features` runs a frozen encoder over a list of images in batches, under `torch.inference_mode` with
# channels-last tensors (and autocast on a GPU), while a thread pool decodes the next batch. Each map (B, D, h, w)
# becomes B×L×D annotation vectors, L = h·w, in row-major order over the grid (region `l` is at row `l // w`,
# column `l % w`), and goes straight into the crash-safe feature store (`data.write_features`) with the image keys,
# the encoder key and the grid in its meta.

# %%
#| export
def _image_batches(paths: Sequence[Path], size: int, batch_size: int, workers: int) -> Iterator[torch.Tensor]:
    "Normalised image batches, the next one decoding in threads while the current one is used."
    with ThreadPoolExecutor(workers) as pool:
        submit = lambda s: [pool.submit(load_image, p, size) for p in paths[s:s + batch_size]]
        pending = submit(0)
        for s in range(0, len(paths), batch_size):
            futures, pending = pending, submit(s + batch_size)
            yield torch.stack([f.result() for f in futures])

def extract_features(images: Sequence[str | Path], backbone: nn.Module, image_size: int, out_path: str | Path,
                     keys: Sequence[str], batch_size: int = 32, device: str = "auto", workers: int = 2,
                     source: dict | None = None) -> Path:
    "Encode `images` with the frozen `backbone` into the float16 feature store `out_path` (N, L, D)."
    if len(images) != len(keys) or not images:
        raise CapbookError(f"{out_path}: need one key per image and at least one image ({len(images)} images, {len(keys)} keys)")
    dev = get_device(device)
    net = backbone.eval().to(dev, memory_format=torch.channels_last)
    bar = progress(total=len(images), desc=f"features {Path(out_path).stem}", unit="img")

    @torch.inference_mode()
    def maps() -> Iterator[torch.Tensor]:
        for x in _image_batches([Path(p) for p in images], image_size, batch_size, workers):
            with autocast(dev): m = net(x.to(dev).contiguous(memory_format=torch.channels_last))
            bar.update(len(x))
            yield m.float()

    with bar, contextlib.closing(maps()) as it:
        first = next(it)
        D, h, w = first.shape[1:]
        key = backbone.encoder_key(image_size) if isinstance(backbone, Encoder) else type(backbone).__name__
        meta = {"keys": list(keys), "encoder": key, "image_size": image_size, "grid": [h, w], "source": source or {}}
        rows = (m.flatten(2).transpose(1, 2) for m in itertools.chain([first], it))
        return write_features(out_path, len(images), (h * w, D), rows, meta)


# %% [markdown]
# Three small images through an untrained shapes CNN: the store holds, row for row, what the backbone computes on the
# same normalised pixels, flattened row-major over the 14×14 grid, with the keys and grid in its meta.

# %%
import tempfile
from PIL import Image
from capbook.data import open_features
_d = Path(tempfile.mkdtemp())
for i, c in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
    Image.new("RGB", (112, 112), c).save(_d / f"{i}.png")
_paths = sorted(_d.glob("*.png"))
_net = ShapesCNN(3).eval()
_p = extract_features(_paths, _net.features, 112, _d / "f.npy", [p.name for p in _paths], batch_size=2, device="cpu")
_F, _meta = open_features(_p)
with torch.no_grad(): _ref = _net.features(torch.stack([load_image(p, 112) for p in _paths]))
assert _F.shape == (3, 196, 128) and _meta["keys"] == ["0.png", "1.png", "2.png"] and _meta["grid"] == [14, 14]
assert np.allclose(_F[:, 14 * 3 + 5], _ref[:, :, 3, 5].numpy(), atol=1e-2, rtol=1e-2)   # region l = row·w + col (float16)
