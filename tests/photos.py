"""A small real-photo data set in Karpathy form, made from the photographs that ship inside matplotlib.

matplotlib's sample data holds one photograph (Grace Hopper in uniform, 512×600 JPEG) and one RGBA picture of a
present. Crops of the photograph, each saved in another of the formats real data sets mix (grayscale, CMYK, 16-bit,
palette, transparency, an extreme aspect ratio), with captions written for this fixture, make ten images: six for
training, two for validation, two for testing. Everything is generated into a folder of the test's choosing."""
from __future__ import annotations
import json
from pathlib import Path
import numpy as np
import torch
from PIL import Image
import matplotlib

SAMPLE = Path(matplotlib.get_data_path()) / "sample_data"

# (file name, crop box of the photograph or "present", how it is saved, split, captions)
IMAGES = [
    ("hopper.jpg", None, "RGB", "train",
     ["an old woman in a navy uniform and cap in front of a flag", "a woman with glasses in a dark uniform"]),
    ("flag.png", (0, 0, 150, 420), "P", "train",
     ["white stars on a blue flag with red stripes", "a flag with stars and stripes"]),
    ("face.jpg", (150, 120, 380, 340), "L", "train",
     ["the face of an old woman with glasses", "a woman with glasses looking at the camera"]),
    ("cap.jpg", (150, 20, 370, 160), "CMYK", "train",
     ["a navy cap with a gold badge", "a dark cap with a white top and a gold badge"]),
    ("ribbons.png", (310, 480, 470, 530), "I;16", "train",
     ["a row of ribbons on a dark uniform", "colourful ribbons on a dark jacket"]),
    ("tag.png", (70, 470, 180, 530), "RGBA", "train",
     ["a name tag on a dark uniform", "a white name tag on a navy jacket"]),
    ("sky.png", (380, 0, 512, 300), "RGB", "val",
     ["a plain blue background", "a blue background behind a flag"]),
    ("collar.jpg", (200, 320, 320, 480), "RGB", "val",
     ["a white collar and a black tie on a dark uniform", "a black tie under a white collar"]),
    ("present.png", "present", "RGBA", "test",
     ["a blue present with a ribbon", "a blue gift box with a bow"]),
    ("button.jpg", (200, 540, 300, 600), "RGB", "test",
     ["a gold button on a dark uniform", "a dark jacket with a gold button"]),
]


def _save(im: Image.Image, path: Path, mode: str) -> None:
    if mode == "I;16":                                   # 16-bit grayscale, full range
        a = np.asarray(im.convert("L"), dtype=np.uint16) * 257
        Image.fromarray(a).save(path)                     # uint16 → mode I;16
        assert Image.open(path).mode in ("I;16", "I"), Image.open(path).mode
    elif mode == "RGBA" and im.mode != "RGBA":           # transparency fading in from the left
        a = np.asarray(im.convert("RGB"))
        alpha = np.tile(np.linspace(60, 255, a.shape[1]).astype(np.uint8), (a.shape[0], 1))
        Image.fromarray(np.dstack([a, alpha]), "RGBA").save(path)
    elif mode == "P": im.convert("RGB").quantize(32).save(path)
    else: im.convert(mode).save(path, **({"quality": 92} if path.suffix == ".jpg" else {}))


def make_photo_set(root: Path, name: str = "flickr8k") -> Path:
    "Write `root/dataset_<name>.json` and `root/images/...`; return `root`."
    root = Path(root); (root / "images").mkdir(parents=True, exist_ok=True)
    photo = Image.open(SAMPLE / "grace_hopper.jpg"); photo.load()
    doc, sid = [], 0
    for i, (fn, box, mode, split, caps) in enumerate(IMAGES):
        im = Image.open(SAMPLE / "Minduka_Present_Blue_Pack.png") if box == "present" else \
            (photo if box is None else photo.crop(box))
        _save(im, root / "images" / fn, mode)
        sents = [{"tokens": c.split(), "raw": c, "imgid": i, "sentid": sid + k} for k, c in enumerate(caps)]
        doc.append({"filepath": "images", "filename": fn, "imgid": i, "split": split, "sentences": sents,
                    "sentids": [s["sentid"] for s in sents]})
        sid += len(sents)
    (root / f"dataset_{name}.json").write_text(json.dumps({"dataset": name, "images": doc}))
    return root


def weights_file(path: Path, encoder: str = "vgg11", seed: int = 0, scale: float = 1.0) -> Path:
    "A torchvision state-dict file for `encoder`'s trunk (seeded random weights, optionally scaled), as a user would pass."
    from capbook.encoders import BACKBONES, build_backbone
    net = build_backbone(encoder, weights="random", seed=seed)
    sd = {BACKBONES[encoder].prefix + k: (v * scale if v.is_floating_point() else v) for k, v in net.trunk.state_dict().items()}
    torch.save(sd, path)
    return path
