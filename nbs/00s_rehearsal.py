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
# # rehearsal
#
# > `capbook rehearse --scale 1`: the real-data path run end to end on a generated data set of COCO's size, each stage's time and peak memory measured, and each paper encoder's feature store projected.

# %%
#| default_exp rehearsal

# %%
#| export
from __future__ import annotations
import json, os, subprocess, sys, threading, time
from pathlib import Path
from typing import Callable
import numpy as np
from capbook.core import CapbookError, check_float, data_dir, load_json, package_hash, save_json

# %% [markdown]
# ## Why a rehearsal
#
# The book downloads no COCO, and its other tests of the real-data path read 24 photos. The captioning
# codebases' bug reports are full of what goes wrong at COCO's size: feature files of 50–200 GB, "No space left
# on device", the whole feature file read into memory, hours of extraction nobody planned for. So capbook generates a
# data set with COCO's shape — Karpathy's split of COCO 2014: 113,287 training images (82,783 `train` and 30,504
# `restval`), 5,000 validation and 5,000 test images, five captions each, in `dataset_coco.json` with `train2014/`
# and `val2014/` image folders — and runs the same functions a chapter runs on it: reading the JSON, the vocabulary,
# the content hashes of the images, feature extraction (with a small encoder: the paper encoders would take hours
# on a CPU, so their cost is measured per image and projected), the caption dataset, training with the book's trainer,
# and the evaluation of 5,000 test images with the book's evaluator.
#
# *capbook:* training stops after `REHEARSAL_STEPS` (1,000) steps of the epoch, validated there. Measured at full
# scale: with COCO's ~11,000-word output layer, Show-Attend-Tell at the smoke widths trains about 70 captions/s on
# this 2-core CPU in float32 (bfloat16 autocast, on a CPU without bf16 hardware, is 4× slower), so COCO's epoch of 566,435
# captions would take over two hours — the step time is the output layer's, nearly the same at half the widths. The
# thousand steps run the real pipeline (memory-mapped batches drawn over the whole store, checkpoints, curves,
# validation on 5,000 images); the table gives the whole epoch's time projected from them, and says so.
#
# The images are small (64×64 JPEG, a coloured rectangle on a coloured ground) and the captions are drawn from a
# Zipf-distributed vocabulary of 27,000 types with COCO's caption lengths (about 10.5 words): the sizes, the counts
# and the vocabulary's long tail are COCO's; the content is not, so the scores of the rehearsal mean nothing and are
# not reported as results.

# %%
#| export
KARPATHY_COCO = {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000}   # Karpathy's split of COCO 2014: 123,287 images
CAPTIONS_PER_IMAGE = 5
REHEARSAL_ENCODER = "mobilenet_v3_small"      # capbook.encoders.BACKBONES: 4×4×576 at 112 px
REHEARSAL_STEPS = 1000                        # training steps of the rehearsal's epoch at most (its whole epoch is projected from them)
REHEARSAL_MODEL = {"name": "sat_soft", "hparams": {"emb_dim": 128, "hidden_dim": 256, "att_dim": 128}}   # Show-Attend-Tell, the smoke widths
_GEN_VERSION = 2                              # bump when generate_coco's output changes

def coco_counts(scale: float) -> dict[str, int]:
    "Images per Karpathy split at `scale` × COCO (at least one each; `scale=1`: COCO's 123,287)."
    check_float("scale", scale, lo=1e-5, hi=1.0)
    return {s: max(1 if s == "restval" else 2, round(n * scale)) for s, n in KARPATHY_COCO.items()}


# %%
assert coco_counts(1.0) == KARPATHY_COCO and sum(coco_counts(1.0).values()) == 123_287
print(coco_counts(0.001))

# %% [markdown]
# ## A data set of COCO's shape
#
# The captions' words: a few dozen of COCO's commonest words first, then synthetic ones, drawn with probability
# $\propto 1/r^{1.4}$ for the word of rank $r$ over 27,000 types, which leaves about 10,500 words seen five times or
# more in the training captions (COCO's Karpathy training captions: about 27,000 types, 9,487 of them that often). Each image's file is written by one of `workers` processes; the JSON is written
# last, atomically, so an interrupted generation is started again rather than half-used.

# %%
#| export
_COMMON = ("a on of the in with and is man to sitting an two standing at people are next white woman table street "
           "holding person large down top group field tennis front up plate his dog cat train young red her black "
           "riding room near water bus playing has pizza building grass kitchen wooden it parked").split()

def _words(n_types: int = 27_000) -> list[str]:
    return list(_COMMON) + [f"w{i:05d}" for i in range(n_types - len(_COMMON))]

def _write_images(job: tuple) -> int:
    "Write the images of one chunk: (folder, file names, colours (n, 2, 3), boxes (n, 4))."
    from PIL import Image, ImageDraw
    folder, names, colours, boxes = job
    for name, (ground, fill), box in zip(names, colours, boxes):
        im = Image.new("RGB", (64, 64), tuple(int(c) for c in ground))
        ImageDraw.Draw(im).rectangle([int(b) for b in box], fill=tuple(int(c) for c in fill))
        im.save(Path(folder) / name, quality=85)
    return len(names)

def generate_coco(root: str | Path, scale: float = 1.0, seed: int = 0, workers: int = 2, log: Callable = print) -> Path:
    "Write a Karpathy-format `root/dataset_coco.json` with `coco_counts(scale)` images under `root/train2014` and `root/val2014`; an existing one of the same scale, seed and generator is kept."
    import multiprocessing as mp
    root, counts = Path(root), coco_counts(scale)
    stamp = {"scale": scale, "seed": seed, "counts": counts, "version": _GEN_VERSION}
    js = root / "dataset_coco.json"
    if js.exists() and (root / "rehearsal_data.json").exists() and load_json(root / "rehearsal_data.json") == stamp:
        log(f"{js}: generated before with the same scale, seed and generator; kept"); return js
    rng = np.random.default_rng(seed)
    words = np.array(_words())
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.4; p /= p.sum()
    images, jobs, chunk = [], [], 2000
    for folder in ("train2014", "val2014"): (root / folder).mkdir(parents=True, exist_ok=True)
    order = [(s, k) for s in ("train", "restval", "val", "test") for k in range(counts[s])]
    n = len(order)
    lengths = np.clip(np.rint(rng.normal(10.5, 2.4, n * CAPTIONS_PER_IMAGE)), 5, 30).astype(int)
    tokens = rng.choice(len(words), size=int(lengths.sum()), p=p)
    ends = np.cumsum(lengths)
    colours = rng.integers(0, 256, (n, 2, 3))
    xy = rng.integers(0, 40, (n, 2)); wh = rng.integers(12, 24, (n, 2))
    boxes = np.concatenate([xy, np.minimum(xy + wh, 63)], 1)
    for i, (split, _) in enumerate(order):
        folder = "train2014" if split == "train" else "val2014"       # as COCO: restval, val and test come from val2014
        cocoid = i + 1
        fn = f"COCO_{folder}_{cocoid:012d}.jpg"
        sents = []
        for j in range(CAPTIONS_PER_IMAGE):
            k = i * CAPTIONS_PER_IMAGE + j
            toks = words[tokens[ends[k] - lengths[k]:ends[k]]].tolist()
            sents.append({"tokens": toks, "raw": " ".join(toks).capitalize() + ".", "imgid": i, "sentid": k})
        images.append({"filepath": folder, "filename": fn, "imgid": i, "cocoid": cocoid, "split": split,
                       "sentids": [s["sentid"] for s in sents], "sentences": sents})
    for a in range(0, n, chunk):
        for folder in ("train2014", "val2014"):
            idx = [i for i in range(a, min(a + chunk, n)) if images[i]["filepath"] == folder]
            if idx: jobs.append((str(root / folder), [images[i]["filename"] for i in idx], colours[idx], boxes[idx]))
    t0 = time.time()
    if workers > 1:                               # the package's function (a notebook's own cannot be sent to a child)
        from capbook.rehearsal import _write_images as write
        with mp.get_context("spawn").Pool(workers) as pool: done = sum(pool.imap_unordered(write, jobs))
    else: done = sum(map(_write_images, jobs))
    log(f"{done:,} images written in {time.time() - t0:.0f} s")
    (root / "rehearsal_data.json").unlink(missing_ok=True)
    save_json(js, {"images": images, "dataset": "coco"})
    save_json(root / "rehearsal_data.json", stamp)
    return js


# %%
import tempfile
from capbook.data import read_karpathy
_root = Path(tempfile.mkdtemp())
generate_coco(_root, 0.0005, workers=1)
_k = read_karpathy(_root / "dataset_coco.json", _root)
assert len(_k.records) == sum(coco_counts(0.0005).values()) and all(len(r.captions) == 5 for r in _k.records)
assert {r.split for r in _k.records} == {"train", "val", "test"} and all(r.path.is_file() for r in _k.records)
assert _k.records[0].image_id == 1 and _k.records[0].path.parent.name == "train2014"
_stamp = (_root / "dataset_coco.json").stat().st_mtime_ns
generate_coco(_root, 0.0005, workers=1)                                   # the same request: kept, not rewritten
assert (_root / "dataset_coco.json").stat().st_mtime_ns == _stamp

# %% [markdown]
# ## The stages, each measured in its own process
#
# Each stage runs as a child process (`capbook rehearse --stage NAME`) so that its memory is its own: the child
# samples its resident memory every 0.1 s — all of it, and the anonymous part alone (what the process allocated, as
# opposed to pages of the memory-mapped feature store, which the kernel can drop at any time) — and the parent reads
# the child's peak resident size from `wait4` as `/usr/bin/time -v` does. A stage that fails stops the rehearsal
# with its one line; the stages before it keep their results in `rehearsal.json`.
#
# | stage | what runs (the functions a chapter runs) |
# |---|---|
# | generate | `generate_coco` (not part of a real run: COCO's JSON and images would be downloaded) |
# | read | `read_karpathy` on `dataset_coco.json`, `Vocab.build` over the training captions |
# | extract | `prepare`: content hashes of the 123,287 images, the disk check, feature extraction, the caption datasets |
# | open | `prepare` again: what every later run pays (the stores found valid and memory-mapped) |
# | train | `prepare`, then `fit` for one epoch or `REHEARSAL_STEPS` steps, whichever ends first (Show-Attend-Tell soft attention, batch 64), validated with beam 3 on the 5,000 validation images |
# | evaluate | `prepare`, `load_trained`, `evaluate` on the 5,000 test images (beam 3; BLEU, METEOR, ROUGE-L, CIDEr) |
# | project | each paper encoder run on a few batches: images per second, and its store for COCO |

# %%
#| export
STAGES = ("generate", "read", "extract", "open", "train", "evaluate", "project")

class _MemorySampler:
    "Peak resident memory of this process, all of it and its anonymous part, sampled every `every` seconds."
    def __init__(self, every: float = 0.1):
        self.peak = {"rss": 0, "anon": 0}; self.every = every; self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        try: text = Path("/proc/self/status").read_text()
        except OSError: return
        vals = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in text.splitlines() if ln.startswith(("VmRSS", "RssAnon"))}
        self.peak["rss"] = max(self.peak["rss"], vals.get("VmRSS", 0)); self.peak["anon"] = max(self.peak["anon"], vals.get("RssAnon", 0))

    def _run(self):
        while not self._stop.wait(self.every): self.sample()

    def __enter__(self): self.sample(); self._t.start(); return self

    def __exit__(self, *exc): self._stop.set(); self._t.join(); self.sample()

def _data_args(root: Path, batch_size: int = 64) -> dict:
    return dict(dataset="coco", data_path=str(root), encoder=REHEARSAL_ENCODER, weights="random", batch_size=batch_size, device="cpu")

def _store_bytes(prep) -> int:
    from capbook.data import feature_path
    return sum(feature_path(prep.dataset, prep.encoder, s).stat().st_size for s in ("train", "val", "test"))

def run_stage(stage: str, root: str | Path, scale: float, log: Callable = print) -> dict:
    "Run one stage in this process (the child's side) and return what it measured besides time and memory."
    from capbook.data import read_karpathy
    from capbook.prepare import prepare
    root = Path(root)
    if stage == "generate":
        generate_coco(root, scale, log=log)
        return {"images": sum(coco_counts(scale).values()), "disk_bytes": sum(f.stat().st_size for f in root.rglob("*") if f.is_file())}
    if stage == "read":
        from capbook.data import Vocab
        k = read_karpathy(root / "dataset_coco.json", root)
        train = [c for r in k.records if r.split == "train" for c in r.captions]
        v = Vocab.build(train, 5)
        return {"images": len(k.records), "captions": sum(len(r.captions) for r in k.records), "vocabulary": len(v)}
    if stage in ("extract", "open"):
        prep = prepare(**_data_args(root))
        return {"train_captions": len(prep.train), "store_bytes": _store_bytes(prep), "feat_shape": list(prep.feat_shape),
                "memory_mapped": all(isinstance(getattr(prep, s).feats, np.memmap) for s in ("train", "val", "test"))}
    if stage == "train":
        from capbook.models import build
        from capbook.train import TrainConfig, fit
        prep = prepare(**_data_args(root))
        m = build(REHEARSAL_MODEL["name"], len(prep.vocab), prep.feat_shape[1], prep.grid, **REHEARSAL_MODEL["hparams"])
        cfg = TrainConfig(epochs=1, max_steps=REHEARSAL_STEPS, evals_per_epoch=1, max_len=prep.max_len, device="cpu", log_every=50)
        per_epoch = prep.train.num_batches(cfg.batch_size, 1, 0, cfg.seed, order=cfg.batch_order)
        res = fit(m, prep, cfg, root / "run" / "ckpt", log=log)
        steps = res.history[-1]["step"]
        return {"captions": res.captions, "captions_per_s": res.captions_per_s, "train_s": res.train_seconds, "val_s": res.val_seconds,
                "steps": steps, "steps_per_epoch": per_epoch, "epoch_s_projected": res.train_seconds / steps * per_epoch,
                "vocabulary": len(prep.vocab), "resumed": res.resumed_from is not None}
    if stage == "evaluate":
        from capbook.metrics import evaluate
        from capbook.train import load_trained
        prep = prepare(**_data_args(root))
        ev = evaluate(load_trained(root / "run", prep), prep, "test", beam_size=3, device="cpu")
        return {"images": len(prep.test.keys), "images_per_s": ev["timings"]["images_per_s"], "metrics": sorted(ev["metrics"])}
    if stage == "project":
        return project_encoders(log=log)
    raise CapbookError(f"parameter stage={stage!r} is invalid: allowed values are {', '.join(map(repr, STAGES))}")


# %% [markdown]
# ## Each paper encoder at COCO's size
#
# A store holds, per image, its $L = h \times w$ annotation vectors of $D$ channels in float16, so COCO's store is
# $123{,}287 \times L \times D \times 2$ bytes; its extraction time is COCO's images over the images per second the
# machine that runs the rehearsal encodes, measured on two batches of 8 after a warm-up batch (random weights: the
# arithmetic is the same, and the book downloads none).

# %%
#| export
def project_encoders(names: list[str] | None = None, batch: int = 8, log: Callable = print) -> dict:
    "Per encoder of `BACKBONES`: its map, the images/s measured on this machine, and COCO's store size and extraction time."
    import torch
    from capbook.encoders import BACKBONES, build_backbone
    n_coco, out = sum(KARPATHY_COCO.values()), {}
    for name in names or list(BACKBONES):
        spec = BACKBONES[name]
        net = build_backbone(name, weights="random").eval()
        x = torch.randn(batch, 3, spec.image_size, spec.image_size)
        with torch.inference_mode():
            h, w = net(x[:2]).shape[2:]                                     # warm-up and the map's size
            t0 = time.perf_counter()
            for _ in range(2): net(x)
            rate = 2 * batch / (time.perf_counter() - t0)
        store = n_coco * h * w * spec.dim * 2
        out[name] = {"image_size": spec.image_size, "map": [int(h), int(w), spec.dim], "images_per_s": rate,
                     "coco_store_bytes": store, "coco_extract_hours": n_coco / rate / 3600}
        log(f"{name}: {h}×{w}×{spec.dim} at {spec.image_size} px, {rate:.1f} images/s here -> COCO: {store / 1e9:.1f} GB, "
            f"{n_coco / rate / 3600:.1f} h")
    return out


# %% [markdown]
# The parent: one child per stage, its peak resident size from `wait4`, everything kept in `<root>/rehearsal.json`
# (written after every stage), and a table.

# %%
#| export
def rehearse(root: str | Path | None = None, scale: float = 1.0, stages: list[str] | None = None, log: Callable = print) -> dict:
    "Run the rehearsal's `stages` (default: all) at `scale` in `root` (default: `data/rehearsal-<scale>`), each in a child process; return and save the measurements."
    check_float("scale", scale, lo=1e-5, hi=1.0)
    stages = list(stages or STAGES)
    for s in stages:
        if s not in STAGES: raise CapbookError(f"parameter stage={s!r} is invalid: allowed values are {', '.join(map(repr, STAGES))}")
    root = Path(root or data_dir() / f"rehearsal-{scale:g}"); root.mkdir(parents=True, exist_ok=True)
    out_path = root / "rehearsal.json"
    results = load_json(out_path) if out_path.exists() else {}
    if results.get("scale") != scale: results = {"scale": scale, "stages": {}}
    env = {**os.environ, "CAPBOOK_HOME": str(root / "home")}          # features, digests and the encoder's files stay in root
    for s in stages:
        log(f"rehearsal stage {s} (scale {scale:g}) ...")
        t0 = time.time()
        p = subprocess.Popen([sys.executable, "-c", "from capbook.cli import main; raise SystemExit(main())", "rehearse",
                              "--stage", s, "--root", str(root), "--scale", repr(scale)],
                             stdout=subprocess.PIPE, stderr=None, text=True, env=env)
        text = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            raise CapbookError(f"rehearsal stage {s} failed (exit {p.returncode}); the stages before it are in {out_path}")
        got = json.loads(text.strip().splitlines()[-1])
        results["stages"][s] = {**got, "wall_s": time.time() - t0, "maxrss_bytes": usage.ru_maxrss * 1024}
        results["machine"] = {"cpus": os.cpu_count(), "code": package_hash()}
        save_json(out_path, results)
    return results

def stage_main(stage: str, root: str, scale: float) -> dict:
    "The child's side: run `stage`, print its measurements as one JSON line on stdout (logs go to stderr)."
    say = lambda m: print(m, file=sys.stderr, flush=True)
    with _MemorySampler() as mem:
        t0 = time.time()
        got = run_stage(stage, root, scale, log=say)
        secs = time.time() - t0
    return {"stage": stage, "seconds": secs, "peak_rss_bytes": mem.peak["rss"], "peak_anon_bytes": mem.peak["anon"], **got}


# %% [markdown]
# ## The table
#
# `rehearsal_table` turns `rehearsal.json` into the two tables at the end of this page: the stages as measured, and each paper
# encoder's projection for COCO.

# %%
#| export
def _gb(b: float) -> str: return f"{b / 1e9:.2f} GB"

def rehearsal_table(results: dict) -> str:
    "Markdown: one row per stage (time, peak memory, what it measured), then one per encoder (COCO's store, and its extraction time at the measured speed)."
    st, scale = results["stages"], results["scale"]
    n = sum(coco_counts(scale).values())
    rows = ["| stage | time | peak resident (largest process) | peak anonymous (allocated) | measured |", "|---|---|---|---|---|"]
    what = {"generate": lambda g: f"{g['images']:,} images, {_gb(g['disk_bytes'])} on disk",
            "read": lambda g: f"{g['images']:,} images, {g['captions']:,} captions, {g['vocabulary']:,} words (min count 5)",
            "extract": lambda g: f"stores {_gb(g['store_bytes'])} ({' × '.join(map(str, g['feat_shape']))} per image), memory-mapped: {g['memory_mapped']}",
            "open": lambda g: f"{g['train_captions']:,} training captions; stores memory-mapped: {g['memory_mapped']}",
            "train": lambda g: ((f"one epoch, {g['captions']:,} captions" if g["steps"] >= g["steps_per_epoch"] else
                                 f"{g['steps']:,} of the epoch's {g['steps_per_epoch']:,} steps ({g['captions']:,} captions)")
                                + f" at {g['captions_per_s']:.0f}/s ({g['vocabulary']:,}-word output); the epoch: "
                                + f"{g['epoch_s_projected'] / 3600:.1f} h{'' if g['steps'] >= g['steps_per_epoch'] else ' projected'}; "
                                + f"validation (beam 3) {g['val_s'] / 60:.1f} min"),
            "evaluate": lambda g: f"{g['images']:,} test images at {g['images_per_s']:.0f}/s (beam 3), {', '.join(g['metrics'])}",
            "project": lambda g: f"{sum(isinstance(v, dict) for v in g.values())} encoders"}
    for s in STAGES:
        if s not in st: continue
        g = st[s]
        rows.append(f"| {s} | {g['seconds'] / 60:.1f} min | {_gb(g['maxrss_bytes'])} | {_gb(g['peak_anon_bytes'])} | {what[s](g)} |")
    out = f"Scale {scale:g} ({n:,} images):\n\n" + "\n".join(rows)
    if "project" in st:
        p = [k for k in st["project"] if isinstance(st["project"][k], dict)]
        enc = ["| encoder | input | map (h × w × D) | images/s (measured) | COCO store (float16) | COCO extraction (projected) |", "|---|---|---|---|---|---|"]
        for k in p:
            e = st["project"][k]
            enc.append(f"| {k} | {e['image_size']} px | {' × '.join(map(str, e['map']))} | {e['images_per_s']:.1f} | "
                       f"{_gb(e['coco_store_bytes'])} | {e['coco_extract_hours']:.1f} h |")
        out += "\n\n" + "\n".join(enc)
    return out


# %% [markdown]
# A rehearsal at 1/2000 of COCO (62 images, every stage but the encoders' projection), end to end, as the suite's test
# does at a larger size:

# %%
_res = rehearse(_root, 0.0005, stages=["read", "extract", "open"], log=lambda s: None)
assert _res["stages"]["extract"]["memory_mapped"] and _res["stages"]["open"]["store_bytes"] == _res["stages"]["extract"]["store_bytes"]
print(rehearsal_table(_res))

# %% [markdown]
# ## Measured at COCO's scale
#
# `capbook rehearse --scale 1` on the book's 2-core CPU (`figures/rehearsal_coco.json`, `figures/table_rehearsal.md`;
# peak resident = the largest process's, from `wait4` as `/usr/bin/time -v` reports it, memory-mapped store pages
# included; peak anonymous = what the process itself allocated, sampled every 0.1 s):
#
# <!-- rehearsal -->
# Scale 1 (123,287 images):
#
# | stage | time | peak resident (largest process) | peak anonymous (allocated) | measured |
# |---|---|---|---|---|
# | generate | 1.2 min | 2.95 GB | 2.63 GB | 123,287 images, 0.31 GB on disk |
# | read | 0.4 min | 2.05 GB | 1.73 GB | 123,287 images, 616,435 captions, 11,093 words (min count 5) |
# | extract | 7.7 min | 4.30 GB | 2.05 GB | stores 2.27 GB (16 × 576 per image), memory-mapped: True |
# | open | 0.6 min | 2.31 GB | 1.93 GB | 566,435 training captions; stores memory-mapped: True |
# | train | 18.0 min | 3.89 GB | 2.32 GB | 1,000 of the epoch's 8,715 steps (65,000 captions) at 64/s (11,093-word output); the epoch: 2.5 h projected; validation (beam 3) 0.4 min |
# | evaluate | 1.5 min | 2.45 GB | 2.02 GB | 5,000 test images at 253/s (beam 3), BLEU-1, BLEU-2, BLEU-3, BLEU-4, CIDEr, METEOR, ROUGE-L |
# | project | 0.6 min | 1.35 GB | 0.94 GB | 5 encoders |
#
# | encoder | input | map (h × w × D) | images/s (measured) | COCO store (float16) | COCO extraction (projected) |
# |---|---|---|---|---|---|
# | vgg16 | 224 px | 14 × 14 × 512 | 3.0 | 24.74 GB | 11.5 h |
# | vgg19 | 224 px | 14 × 14 × 512 | 2.6 | 24.74 GB | 13.4 h |
# | vgg11 | 224 px | 14 × 14 × 512 | 5.9 | 24.74 GB | 5.9 h |
# | resnet101 | 448 px | 14 × 14 × 2048 | 1.1 | 98.98 GB | 31.8 h |
# | mobilenet_v3_small | 112 px | 4 × 4 × 576 | 226.0 | 2.27 GB | 0.2 h |
# <!-- /rehearsal -->
#
# What it shows. Nothing loads a feature store whole: every split is memory-mapped, and each stage's own memory is the
# parsed JSON (a 217 MB `dataset_coco.json`), the captions and the model, whatever the store's size; resident memory
# above it is store pages, which the kernel drops under pressure. A store that will not fit stops before anything is
# written, in one line naming the GB needed and free. Training is the wall: with COCO's 11,093-word output layer,
# Show-Attend-Tell trains at the rate the table gives, so the rehearsal trains 1,000 of the epoch's steps, validated on
# the 5,000 validation images, and projects the whole epoch. Extracting a paper encoder's features for COCO would take
# hours to days on this CPU: real COCO work needs a GPU, and the book's own runs use the shapes set for this reason.
# The rehearsal's scores mean nothing (the captions are random words) and are not reported.
