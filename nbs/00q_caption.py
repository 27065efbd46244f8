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
# # caption
#
# > Caption your own photographs with a model the book trained, and see where it looked: `capbook caption PHOTO...`.

# %%
#| default_exp caption

# %%
#| export
from __future__ import annotations
from pathlib import Path
from typing import Any
import torch
from capbook.core import CapbookError, autocast, get_device, load_json, runs_dir
from capbook.data import load_image, load_rgb

# %% [markdown]
# ## From a run folder back to a working captioner
#
# A run folder holds what is needed to caption a new image, but not all of it is in the folder itself: the best
# weights (`ckpt/best.pt`, with the model's name and hyper-parameters), and the results record naming the data the
# model was trained on — dataset, encoder and a fingerprint of everything a model of that data depends on (the
# encoder's identity, the vocabulary, the caption length; `capbook.prepare`). The vocabulary and the frozen encoder
# are rebuilt from `data/` by `prepare` with the run's own parameters, and the rebuilt data must have **the same
# fingerprint** as the record: a model is never handed features from an encoder it was not trained on, nor words
# from another vocabulary. This matters here more than it seems: the shapes encoder is pretrained on each machine,
# and its pretraining is not bit-identical across machines, so a run folder copied from another machine is refused
# unless its `data/` came along.
#
# Two kinds of model cannot caption a new photograph, and are refused in one line: a model trained on precomputed
# bottom-up *region* features (a new photo has no detector regions), and a model that reads per-image inputs besides
# the features (GLIED's detected attribute words, which come from the training split's detector cache).

# %%
#| export
def find_run(model: str | None = "02_show_attend_tell", run_dir: str | Path | None = None, profile: str = "default") -> Path:
    "The run folder to caption with: `run_dir` if given, else the book's run named `model` at `profile` (a plan step: `02_show_attend_tell`, `06_baselines-att2in`, ...); where it is not trained, one short line and the command that trains that run alone (`train_hint`)."
    d = Path(run_dir) if run_dir is not None else runs_dir() / profile / str(model)
    if (d / "record.json").is_file(): return d
    if run_dir is not None:
        raise CapbookError(f"{d}: no trained run here (no record.json); name the folder of a finished run "
                           "(runs/<profile>/<step>, or a hand run's under runs/<profile>/adhoc/)")
    msg, cmd = train_hint(str(model), profile)
    raise CapbookError(msg, then=cmd)

def train_hint(model: str, profile: str = "default") -> tuple[str, str | None]:
    "Why the book's run `model` at `profile` cannot caption here, and the smallest book that trains it — that step alone (`capbook book --only =<step> --force`: the published book's record stands in for its results, never for its weights), with the minutes the published book's run took; for a name that is no step of the plan, the runs trained here and no command."
    from capbook.plan import plan
    from capbook.profiles import out_dir
    if model not in {s.name for s in plan(profile)}:
        have = sorted(p.parent.name for p in (runs_dir() / profile).glob("*/record.json"))
        some = ", ".join(have[:2]) + (f" and {len(have) - 2} more" if len(have) > 2 else "")
        return (f"{model} is no step of the {profile} book (e.g. 06_baselines-att2in)" + (f"; trained here: {some}" if have else ""), None)
    from capbook.book import published_minutes
    minutes = published_minutes(out_dir(profile), model)
    took = f"  # about {minutes:.0f} min" if minutes is not None else ""
    book = "capbook book" + ("" if profile == "default" else f" --profile {profile}")
    # --force: on a clone the published book stands in for the run's results, but a caption needs its trained weights
    return (f"{model} is not trained here (the published book has its scores, no weights)",
            f"{book} --only ={model} --force --no-docs{took}")

def image_encoder(prep, params: dict) -> torch.nn.Module:
    "The frozen encoder `prep`'s features were computed with (the shapes CNN from its cache, or the torchvision backbone), checked by its key."
    from capbook import encoders
    if prep.dataset.startswith("shapes-"):
        net = encoders.shapes_encoder(prep.kdata, prep.gt, profile=params["profile"], seed=params.get("data_seed", 0))
    else:
        net = encoders.build_backbone(prep.encoder.split("-")[0], weights=params.get("weights", "imagenet"), seed=params.get("data_seed", 0))
    if net.encoder_key(prep.image_size) != prep.encoder:
        raise CapbookError(f"encoder {net.encoder_key(prep.image_size)} is not the run's {prep.encoder}; its features cannot be rebuilt here")
    return net

def load_captioner(run: str | Path, device: str = "auto") -> tuple[Any, Any, torch.nn.Module]:
    "(model, prepared data, image encoder) of the run in `run`, each checked to be the one the run was trained with."
    from capbook.profiles import chapter, read_params
    from capbook.stages import chapter_data
    from capbook.train import load_trained
    run = Path(run)
    rec = load_json(run / "record.json", "results record")
    p, data = rec.get("params", {}), rec.get("data", {})
    if p.get("regions") is not None:
        raise CapbookError(f"{run}: trained on precomputed region features ({p['regions']}); a new photograph has no detector regions to give it")
    ch = chapter(rec.get("notebook", ""))
    prep = chapter_data(ch, ch.resolve(read_params(ch.params, p)), device)   # the run's own data, as its chapter prepared it
    if prep.fingerprint != data.get("fingerprint"):
        raise CapbookError(f"{run}: trained on {data.get('dataset')} with encoder {data.get('encoder')} (data fingerprint "
                           f"{data.get('fingerprint')}); this machine's data/ gives {prep.encoder} (fingerprint {prep.fingerprint}): "
                           f"the run's encoder or vocabulary cannot be rebuilt here")
    model = load_trained(run, prep)
    if extra := [k for k in model.inputs if k not in ("feats", "feat_mask")]:
        raise CapbookError(f"{run}: model {rec.get('model')} also reads {', '.join(extra)} for each image, which cannot be "
                           f"computed for a new photograph; caption with a model that reads only the image")
    return model, prep, image_encoder(prep, p)

# %% [markdown]
# ## Encoding a photograph as the training images were
#
# The photograph goes through exactly the path the feature stores were filled by (`capbook.encoders.extract_features`):
# read as 8-bit RGB, resized to the encoder's square input, ImageNet-normalised, the frozen CNN's last map flattened to
# L = h·w annotation vectors of D channels — and then rounded to float16, because that is how the stores keep them and
# so what the model saw in training. The check below encodes three test images of the dataset from their files and
# compares them with the stored features.

# %%
#| export
@torch.inference_mode()
def encode_photos(paths: list[str | Path], net: torch.nn.Module, size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    "Features (N, L, D) of image files, as the feature store would hold them: the frozen `net`'s last map, float16-rounded."
    dev = get_device(str(device))
    x = torch.stack([load_image(p, size) for p in paths]).to(dev)
    net = net.eval().to(dev)
    with autocast(dev): maps = net(x)                          # (N, D, h, w)
    return maps.float().flatten(2).transpose(1, 2).half().float()   # (N, L = h·w, D)

# %% [markdown]
# ## Captioning, and drawing where the model looked
#
# `caption_photos` decodes with the book's one beam search; each caption comes with its per-word attention (T, L) when
# the model has one, which `capbook.viz.attention_figure` — the plotting code of every chapter — draws over the image
# as the encoder saw it.

# %%
#| export
def caption_photos(photos: list[str | Path], run: str | Path, beam_size: int = 3, device: str = "auto") -> list[dict]:
    "Caption image files with the model of run folder `run`: one {'photo', 'caption', 'words', 'alpha' (T, L) or None, 'grid', 'image'} per photo."
    from capbook.decode import beam_search
    if not photos: raise CapbookError("capbook caption: name at least one image file")
    for p in photos: load_rgb(p, 8)                            # a bad file stops here, named, before any work
    dev = get_device(device)
    model, prep, net = load_captioner(run, device)
    images = [load_rgb(p, prep.image_size) for p in photos]    # as the encoder sees them
    feats = encode_photos(photos, net, prep.image_size, dev)
    batch = {"feats": feats}
    if "feat_mask" in model.inputs: batch["feat_mask"] = torch.ones(feats.shape[:2], dtype=torch.bool, device=dev)
    caps = beam_search(model.to(dev), batch, beam_size, prep.max_len)
    return [{"photo": str(p), "caption": " ".join(w := prep.vocab.decode(c.tokens)), "words": w, "alpha": c.alpha,
             "grid": prep.grid, "image": img} for p, c, img in zip(photos, caps, images)]

def attention_png(captions: list[dict], path: str | Path, label: str = "") -> Path:
    "The per-word attention figure of `caption_photos`' results, one row per photo, through `capbook.viz.attention_figure`."
    from capbook.viz import attention_figure
    if any(c["alpha"] is None for c in captions):
        raise CapbookError(f"{label or 'this model'} has no attention to draw (it sees the image as one vector); leave out --attention")
    rows = [{"label": f"{Path(c['photo']).name}: {c['caption']}", "image": c["image"], "words": c["words"],
             "alpha": c["alpha"], "grid": c["grid"]} for c in captions]
    return attention_figure(rows, path)

# %% [markdown]
# From the command line (`capbook caption --help`):
#
# ```bash
# capbook caption my_photo.jpg other.png                          # the default book's soft-attention model
# capbook caption my_photo.jpg --model 06_baselines-att2in --attention where.png
# capbook caption my_photo.jpg --run-dir runs/default/adhoc/03_spca-1a2b3c4d --beam 5
# ```
#
# The models of this book were trained on the embedded shapes dataset, so a photograph of a person is described in
# the only words they know — coloured shapes and where they are. Trained on COCO (`-p dataset coco`), the same
# command captions photographs in COCO's words.
#
# A check on the smoke book's data, when it is there: the encoder rebuilt for captioning reproduces the stored test
# features of three images from their files.

# %%
from capbook.prepare import prepare as _prepare
from capbook.encoders import shapes_encoder_path as _enc_path
if _enc_path("smoke", 0).exists():
    _prep = _prepare("shapes", "smoke")
    _net = image_encoder(_prep, {"profile": "smoke", "seed": 0})
    _paths = [r.path for r in _prep.kdata.split("test")[:3]]
    _f = encode_photos(_paths, _net, _prep.image_size)
    _stored = torch.tensor(_prep.test.feats[:3], dtype=torch.float32)
    print("largest difference from the stored features:", float((_f - _stored).abs().max()))
    assert torch.allclose(_f, _stored, atol=1e-2, rtol=1e-2)
