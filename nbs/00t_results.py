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
# # results
#
# > What a book step's numbers are computed from (its key), and whether the published book is what today's code makes.

# %%
#| default_exp results

# %%
#| export
from __future__ import annotations
import ast, contextlib, dataclasses, hashlib, json, math, os, random, re, tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable
import numpy as np
import torch
from capbook.core import CapbookError, load_json, runs_dir, save_json, stable_hash
from capbook.plan import Step, nbs_dir, plan, upstream_of
from capbook.records import MANIFEST, RECORDS, merge_seeds

# %% [markdown]
# ## Keys that know when a number can change
#
# The book reruns a step when its **key** changes, and the published book is *current* when every item in `figures/`
# was made by a step whose key is today's. A key that hashed the package's source would mark every table stale at a
# docstring; one that hashed nothing would keep a table after its model changed. So a step's key is what its numbers
# are computed from:
#
# - **its notebook's code** — the code cells it runs beyond the package's definitions, compared by their syntax tree
#   (comments, docstrings and layout are prose and do not count). The cells a notebook exports to `capbook/` count by
#   what they compute, below, so a rename or a reordering inside a model keeps every key;
# - **its parameters and data** — the profile, the training seed, what the shapes generator draws and the encoder's
#   recipe (`data_key`). A parameter the step sets is keyed as it is given: `-p precision fp32` is in the key as
#   `fp32`, and the default `auto` as `auto`;
# - **a numerical fingerprint of the code it runs** (`probe`): for the model a chapter run trains, a complete run of
#   the one trainer under that run's own `TrainConfig` on a fixed tiny data set (one epoch of four-caption batches,
#   validated twice by beam search and CIDEr as the run is, with its weight averaging, schedule and self-critical
#   stage), then a beam decode of its test images — its losses, validation scores, final weights and captions; and
#   the fingerprints of the shared code the step computes with (`shared_used`): the **scorer** (the COCO metrics with
#   Java's tokenizer and METEOR, the shapes semantic scores, the attention on the named object, CIDEr-D's reward) and
#   the **drawing** of an attention figure and a table for a training run, which scores its model and draws its
#   figures; those two and the **statistics** (per-image statistics, the seed t-test, Holm's correction, the claims'
#   text) for a tables chapter; for any other notebook, those whose functions its cells name. A change to the
#   verdict rule re-keys the tables chapters and no training run.
#
# **What a key leaves out: the machine.** The arithmetic a run trained in — the device, bfloat16 or float32 (`auto`
# picks bfloat16 on a CPU with bfloat16 kernels), the CPU's vector instructions — is written in its record
# (`precision`, `machine.isa`) and its `params.yaml`, never in its key. The digits of a run are reproducible on one
# kind of machine and its conclusions on any (`01_dataset`), so a book made in bfloat16 on an AVX-512 machine is
# current on an AVX2 machine that would train in float32, as long as the code, parameters and data are the same.
#
# **A fingerprint that is the same on every CPU.** Each fingerprint runs on one thread with every generator seeded,
# **in float64** (`torch.set_default_dtype` inside `_probing`: the data path, the losses and the log-softmaxes follow
# torch's default dtype through `capbook.core.wide`, which is float32 everywhere else), and keeps its numbers to
# `PROBE_DIGITS` = 6 significant digits. Why float64 and not float32 rounded: a float32 probe differs across CPU kinds
# by up to 1 % — an attention layer's score bias has a zero gradient in exact arithmetic (a softmax does not see a
# shift), so its gradient is rounding noise, which Adam normalises into steps of the learning rate's size, in a
# direction the last bits decide. In float64 that noise is 1e-17, far below Adam's ε, and the bias stays put.
# Measured on the default plan's 34 model probes and the shared ones (2,136 numbers), the same machine with its
# vector instructions lowered (`ATEN_CPU_CAPABILITY=avx2` and `=default`, `ONEDNN_MAX_CPU_ISA=AVX2`,
# `MKL_ENABLE_INSTRUCTIONS=AVX2`) against AVX-512: no token or count differs, 1,870–2,023 numbers are bit-identical,
# and the largest relative difference is 1.3e-10 (that same bias; every other number 6e-12 or less). Six digits leave
# four orders of magnitude of margin: a number changes its sixth digit across machines only if it lies within 1e-10
# of a rounding boundary, about one chance in 10⁵ per number, while any change of the code that moves a published
# number (reported to 0.1 CIDEr) moves these numbers by far more than 1e-6. `tests/test_results.py` recomputes every
# published key under the lowered instruction sets, with one and two threads, and finds them equal; it also changes
# one model's initialisation and one attention equation's constant and finds exactly their steps re-keyed.
#
# A fingerprint takes seconds: the keys of the whole default book are computed in about 25 s.

# %%
#| export
def _without_docstrings(tree: ast.AST) -> ast.AST:
    "`tree` with every docstring (a string expression opening a module, class or function body) removed."
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree

def cell_digest(source: str) -> str:
    "What a code cell computes, without its prose: its syntax tree without comments or docstrings; a cell that is not Python (an IPython magic) by its non-comment lines."
    try: return ast.dump(_without_docstrings(ast.parse(source)))
    except SyntaxError:
        return "\n".join(l.rstrip() for l in source.splitlines() if l.strip() and not l.lstrip().startswith("#") or l.lstrip().startswith("#|"))

def code_cells(path: Path) -> list[str]:
    "The sources of a notebook's code cells, in order."
    cells = [c for c in json.loads(Path(path).read_text())["cells"] if c["cell_type"] == "code"]
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]

def notebook_code(path: Path) -> dict:
    "A notebook's code as its key sees it: the digest of the code cells it runs beyond the package's definitions, and where its exported cells stand (their code counts through the fingerprints)."
    from capbook.copies import exported
    src = code_cells(path)
    layout = "".join("E" if exported(s) else "C" for s in src)
    return {"cells": stable_hash([cell_digest(s) for s, k in zip(src, layout) if k == "C"], 16), "layout": layout}

# %% [markdown]
# A comment, a docstring or a reformatted line leaves a cell's digest as it was; a changed number does not:

# %%
assert cell_digest("x = 1  # one\n") == cell_digest("# set x\nx = 1\n")
assert cell_digest('def f(a):\n    "Doc."\n    return a + 1\n') == cell_digest("def f(a):\n    return a + 1\n")
assert cell_digest("x = 1\n") != cell_digest("x = 2\n")

# %% [markdown]
# ## The data a step reads
#
# A shapes data set is what its generator draws for the profile's sizes and seed (the folder's name already says so:
# a hash of the first generated examples and the sizes), and its features are what the shapes encoder makes of it:
# the key names the encoder by its recipe. Its training is deterministic on one kind of CPU but not bit-identical
# across kinds (float32's last bits), so the default book's encoder is **shipped** with the book
# (`data/encoders/shapes-default-s0.pt`, 320 KB): every machine encodes the images with the weights the published
# runs were trained on, and the book's manifest names those weights (`current` checks them).

# %%
#| export
def encoder_digest(profile: str, seed: int) -> str:
    "The shapes encoder of (profile, seed) as a key sees it: its recipe (`capbook.encoders.SHAPES_CNN` and the seed; the images are the data key's)."
    from capbook.encoders import SHAPES_CNN
    return stable_hash([SHAPES_CNN, profile, seed], 12)

def encoder_weights(profile: str = "default", seed: int = 0) -> str | None:
    "The id of the cached (for the default book: shipped) shapes encoder's weights, None where there is none."
    from capbook.encoders import shapes_encoder_path
    from capbook.core import load_torch
    path = shapes_encoder_path(profile, seed)
    return load_torch(path, "shapes encoder").get("weights_id") if path.exists() else None

def data_key(params: dict, encoder: str | None = None) -> str | None:
    "What a chapter run with `params` reads: for the shapes data set, the generator's draws at the profile's sizes and the encoder's weights; for real data, the content of its input files (`capbook.prepare.inputs_digest`)."
    from capbook.prepare import inputs_digest
    from capbook import shapes
    p = {"encoder": encoder, **params, "seed": params.get("data_seed", 0)}
    if p.get("dataset", "shapes") == "shapes":
        if p.get("profile") not in shapes.PROFILES: return None
        return stable_hash([shapes.shapes_root(p["profile"], p["seed"]).name, encoder_digest(p["profile"], p["seed"])], 16)
    return inputs_digest(**p)

# %% [markdown]
# ## The probe data set
#
# Fourteen images in the shapes language, drawn by the data set's own scene and caption generator from a fixed seed
# (no pixels: each image's "features" are a fixed 3×3 grid of 16 numbers from NumPy's PCG64, which every platform draws
# alike), two captions each: eight for training, three to validate, three to test. Every model of the book trains on
# it in well under a second.

# %%
#| export
PROBE_SEED = 20261126
PROBE_DIGITS = 6   # significant digits a fingerprint keeps: the float64 probes differ by at most 1.3e-10 (relative) across the CPU kinds measured (see below)

@lru_cache(None)
def _probe_scenes(n: int) -> tuple:
    from capbook.shapes import make_captions, sample_scene, scene_relations
    out = []
    for i in range(n):
        rng = np.random.default_rng([PROBE_SEED, i])
        objs = sample_scene(rng, 112)
        out.append((objs, scene_relations(objs), make_captions(objs, rng)))
    return tuple(out)

def probe_data(splits: tuple[int, int, int] = (8, 3, 3), captions: int = 2, grid: tuple[int, int] = (3, 3), dim: int = 16,
               max_len: int = 12):
    "The fixed tiny data set every fingerprint trains and decodes on: a `Prepared` with shapes ground truth."
    from capbook.data import CaptionData, Vocab
    from capbook.prepare import Prepared
    scenes, g = _probe_scenes(sum(splits)), np.random.default_rng(PROBE_SEED)
    keys = [f"probe{i}.png" for i in range(sum(splits))]
    feats = g.standard_normal((sum(splits), grid[0] * grid[1], dim)).astype(np.float32)
    caps = [[list(c) for c in s[2][:captions]] for s in scenes]
    vocab = Vocab.build([c for cs in caps[:splits[0]] for c in cs], 1)
    cut = np.cumsum((0, *splits))
    data = [CaptionData(feats[a:b], keys[a:b], caps[a:b], vocab, max_len, s) for s, a, b in zip(("train", "val", "test"), cut, cut[1:])]
    gt = {"image_size": 112, "images": {k: {"objects": s[0], "relations": s[1]} for k, s in zip(keys, scenes)}}
    return Prepared(*data, vocab, gt, "probe", "probe", (grid[0] * grid[1], dim), grid, 112, max_len, "probe", None)

# %%
_pp = probe_data()
assert (_pp.train.n_images, _pp.val.n_images, _pp.test.n_images) == (8, 3, 3) and len(_pp.train) == 16
assert np.array_equal(_pp.test.feats, probe_data().test.feats)            # the same draws every time
print(_pp.train.refs[0][0])

# %% [markdown]
# ## Fingerprints
#
# `_probing` isolates a fingerprint: one thread, a scratch data folder (the attribute detector's and CIDEr's caches
# go there), and Python's, NumPy's and torch's generators given back as they were. `_numbers` rounds every float to 9
# significant digits (float32 carries about 7, so nothing float32 computes is hidden, and a key is a plain hash).

# %%
#| export
@contextlib.contextmanager
def _probing():
    "One thread, a scratch data folder, every generator restored afterwards."
    threads, env, dtype = torch.get_num_threads(), os.environ.get("CAPBOOK_DATA"), torch.get_default_dtype()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    with tempfile.TemporaryDirectory(prefix="capbook-probe-") as tmp:
        os.environ["CAPBOOK_DATA"] = tmp; torch.set_num_threads(1); torch.set_default_dtype(torch.float64)
        try: yield Path(tmp)
        finally:
            torch.set_num_threads(threads); torch.set_default_dtype(dtype)
            if env is None: os.environ.pop("CAPBOOK_DATA", None)
            else: os.environ["CAPBOOK_DATA"] = env
            random.setstate(states[0]); np.random.set_state(states[1]); torch.set_rng_state(states[2])

def _numbers(x: Any, digits: int = PROBE_DIGITS) -> Any:
    "`x` with every float rounded to `digits` significant digits (tensors and arrays as lists), for hashing."
    if isinstance(x, torch.Tensor): x = x.detach().cpu().double().numpy()
    if isinstance(x, np.ndarray): x = x.tolist()
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if not math.isfinite(x) or x == 0 else float(f"{x:.{digits - 1}e}")
    if isinstance(x, dict): return {str(k): _numbers(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)): return [_numbers(v, digits) for v in x]
    if isinstance(x, (np.integer, np.bool_)): return x.item()
    return x

_quiet = lambda *a, **k: None

# %% [markdown]
# ### A chapter run's model and trainer
#
# `probe` trains the model a chapter run trains, with that run's resolved parameters (its sizes, attention, penalty,
# gate, objective) and its `TrainConfig` — only the epochs (1), the batch (4 captions), the arithmetic (float32) and
# the seed are the probe's — then decodes the test images with the run's beam and decoding options. What it returns
# is every number the trainer records (losses and their terms, learning rates, validation scores), each weight
# tensor's sum of squares and the test captions with their log-probabilities. What the probe replaces, it cannot
# see: the arithmetic enters the key on its own (`cpu_precision`), the seed through the run's parameters, and the
# budget — the epochs a run trains and its batch size, both of which move every number — through `budget`, which
# names them where they depart from the protocol's (`TrainConfig`'s 15 epochs of 64 captions). A run at the protocol's
# budget adds nothing to its key.

# %%
#| export
def resolved(step) -> tuple[Any, Any, str]:
    "A chapter step's declaration, its resolved parameters (the profile's sizes filled in) and the model it trains."
    from capbook.profiles import chapters
    ch = chapters()[step.notebook]
    p = ch.resolve(ch.params(**{k: v for k, v in step.params.items() if k not in ("run_dir", "seed")}))
    if p.scst_epochs is None: p = dataclasses.replace(p, scst_epochs=0)
    return ch, p, ch.model(p)

def budget(step) -> dict:
    "What a chapter step's run trains for that its probe cannot see (the probe trains one epoch of batches of 4): the epochs and the batch size, where they depart from the protocol's (`TrainConfig`'s defaults), and a self-critical stage's epochs."
    from capbook.profiles import train_config
    from capbook.train import TrainConfig
    try: ch, p, name = resolved(step); cfg = train_config(ch, p, name, 0)
    except CapbookError: return {}                # the run stops on its bad parameter, in its notebook
    out = {k: getattr(cfg, k) for k in ("epochs", "batch_size") if getattr(cfg, k) != getattr(TrainConfig, k)}
    if p.scst_epochs: out["scst_epochs"] = p.scst_epochs   # a self-critical stage's budget: its probe trains one epoch
    return out

def probe(step) -> dict:
    "The numerical fingerprint of what a chapter step trains: its model under its own training config on `probe_data`, then a beam decode."
    from capbook.profiles import decoding, model_hparams, scst_arms, train_config
    from capbook.stages import scst_setup
    from capbook.models import build
    from capbook.train import fit
    from capbook.decode import decode_split
    from capbook.core import seed_everything
    ch, p, name = resolved(step)
    prep, hp = probe_data(), model_hparams(name, p)
    with _probing() as tmp:
        inputs = ch.inputs(prep, p, _quiet) if ch.inputs else {}
        seed_everything(0)
        model = build(name, len(prep.vocab), prep.feat_shape[1], prep.grid, **hp)
        small = dict(epochs=1, batch_size=4, precision="fp32", device="cpu", progress=False, log_every=0, ckpt_every=0, seed=0)
        cfg = dataclasses.replace(train_config(ch, p, name, prep.max_len), **small)
        runs = [fit(model, prep, cfg, tmp / "xe", log=_quiet)]
        if p.scst_epochs:                         # each self-critical arm, one epoch of it, continuing the cross-entropy run
            xe = {k: v.clone() for k, v in model.state_dict().items()}
            for arm, baseline in scst_arms(p):
                model.load_state_dict(xe)
                scfg, objective = scst_setup(prep, dataclasses.replace(p, scst_epochs=1), cfg, baseline)
                runs.append(fit(model, prep, dataclasses.replace(scfg, batch_size=4), tmp / arm, log=_quiet, objective=objective,
                                start=tmp / "xe" / "last.pt"))
        caps = decode_split(model, prep.test, p.beam_size, prep.max_len, 100, "cpu", **decoding(p))
    drop = lambda h: {k: drop(v) if isinstance(v, dict) else v for k, v in h.items()
                      if not k.endswith("_s") and k != "key"}   # timings and cache keys (a source file's hash) are not numbers of the code
    return _numbers({"model": name, "history": [[drop(h) for h in r.history] for r in runs],
                     "best": [[r.best_epoch, r.best_at] for r in runs], "inputs": drop(inputs),
                     "weights": {k: float((w.double() ** 2).sum()) for k, w in model.state_dict().items() if w.is_floating_point()},
                     "captions": [[c.tokens, c.logprob] for c in caps]})

# %% [markdown]
# NIC's row of the smoke book, fingerprinted twice: the same numbers.

# %%
from capbook.results import Step as _Step
_st = _Step("06_baselines", {"profile": "smoke", "model": "nic", "scst_epochs": 0}, "nic")
_f = probe(_st)
assert _f == probe(_st) and _f["model"] == "nic"
print(_f["best"], [round(h["loss"], 4) for h in _f["history"][0]], _f["captions"][0])
assert budget(_st) == {"epochs": 1}                       # the smoke profile's one epoch departs from the protocol's 15
assert budget(_Step("06_baselines", {"profile": "default", "model": "nic", "scst_epochs": 0}, "nic")) == {}

# %% [markdown]
# ### The scorer, the statistics, the drawing
#
# One fixed set of candidate captions for the probe's test images — a reference, a reference cut short, a caption of
# another image — scored by everything a run scores with; the per-image statistics and the verdicts of two made-up
# rows of three seeds; an attention figure and a table drawn and read back as pixels and text.

# %%
#| export
def _candidates(prep) -> tuple[dict, dict, list]:
    keys, refs = prep.test.keys, prep.test.refs
    words = [refs[0][1], refs[1][0][:5], refs[0][0]]
    return {k: " ".join(w) for k, w in zip(keys, words)}, {k: [" ".join(r) for r in rs] for k, rs in zip(keys, refs)}, words

def scorer_probe() -> dict:
    "The numbers every scoring path gives on fixed captions: COCO metrics (Java's tokenizer and METEOR where Java is), semantic scores, attention on the named object, CIDEr-D's reward."
    from capbook.metrics import CiderD, attention_correctness, coco_scores
    from capbook.shapes import semantic_scores
    from capbook.decode import Caption
    prep = probe_data()
    res, gts, words = _candidates(prep)
    scores, notes = coco_scores(gts, res)
    L = prep.feat_shape[0]
    alphas = [torch.softmax(torch.linspace(-2, 2, L * len(w)).reshape(len(w), L), -1) for w in words]
    caps = [Caption(prep.vocab.encode(w, 20)[1:-1], 0.0, a) for w, a in zip(words, alphas)]
    cider = CiderD(prep.train.refs + prep.test.refs)
    return _numbers({"coco": scores, "notes": sorted(notes),
                     "semantic": semantic_scores(dict(zip(prep.test.keys, words)), dict(zip(prep.test.keys, prep.test.refs)), prep.gt["images"]),
                     "attention": attention_correctness(caps, prep.test.keys, prep.gt, prep.vocab, prep.grid, prep.image_size),
                     "cider_d": cider.score(words, prep.test.refs)})

def stats_probe() -> dict:
    "The numbers and words the tables' statistics give on fixed inputs: per-image statistics, the book's test over seeds (unpaired, paired, a kept start, a compound claim; its sign tests and reach), Holm's correction over a chapter and over the book, a claims note and table, the rule's simulated size, merged seeds."
    from capbook.metrics import image_stats
    from capbook.claims import seed_t_test, seed_means_t_test, simulate_verdicts
    from capbook.claims import Claims, book_family
    prep = probe_data()
    _, _, words = _candidates(prep)
    st = image_stats(list(prep.test.keys), words, prep.test.refs, prep.gt)
    g = np.random.default_rng(PROBE_SEED)
    seeds = lambda shift: [{k: v + shift + 0.05 * g.standard_normal(v.shape) for k, v in st.items()} for _ in range(7)]   # 7 seeds: past the sign tests' floor
    a, b = seeds(0.1), seeds(0.0)
    claims = Claims()
    t = claims.test("a above b", a, b, source="the paper")
    claims.test("b above a", b, a)
    claims.test("a above b, paired", a, b, paired=True)
    claims.test("kept", a, a, paired=True)
    claims.add("both", {"CIDEr": t, "BLEU-4": claims.test("a above b (BLEU-4)", a, b, metric="BLEU-4")})
    rec = lambda s, c: {"params": {"seed": s}, "metrics": {"CIDEr": c, "semantic": {"all": {"f1": c / 2}}}, "timings": {"train_s": 1.0 + s}}
    return _numbers({"stats": st, "t": seed_t_test([x["CIDEr"] for x in a], "CIDEr", [x["CIDEr"] for x in b]),
                     "text": t["text"], "note": claims.note(), "table": claims.table().to_dict("list"),
                     "family": book_family({"a": claims.table()}).to_dict("list"),
                     "seed means": seed_means_t_test([1.0, 1.2, 1.1], [0.8, 0.9, 1.0]),
                     "size": simulate_verdicts((0.05, 0.02), (7, 7), trials=200, images=50, seed=PROBE_SEED),
                     "merged": {k: v for k, v in merge_seeds([rec(0, 1.0), rec(1, 1.2), rec(2, 0.9)]).items() if k != "seed_runs"}})

def drawing_probe() -> dict:
    "What the drawing paths make of fixed inputs: an attention figure's pixels (hashed) and a table's Markdown."
    import matplotlib; matplotlib.use("Agg")
    from PIL import Image
    import pandas as pd
    from capbook.shapes import render
    from capbook.viz import attention_figure, save_table
    prep = probe_data()
    _, _, words = _candidates(prep)
    with _probing() as tmp:
        img = tmp / "probe.png"
        render(_probe_scenes(14)[11][0], np.random.default_rng(PROBE_SEED), 112).save(img)
        L, w = prep.feat_shape[0], words[0]
        alpha = torch.softmax(torch.linspace(-2, 2, L * len(w)).reshape(len(w), L), -1)
        attention_figure([{"label": "probe", "image": img, "words": w, "alpha": alpha, "grid": prep.grid}], tmp / "fig.png")
        pixels = np.asarray(Image.open(tmp / "fig.png").convert("L"), dtype=np.uint8)
        md = save_table(pd.DataFrame({"row": ["a", "b"], "CIDEr": [1.234, None], "p": [0.01234, 0.5]}), tmp / "table")
    return {"figure": hashlib.sha256(pixels.tobytes()).hexdigest()[:16], "shape": list(pixels.shape), "table": md}

def labels_probe() -> list:
    "Where `capbook.viz.label_points` puts the labels of a fixed crowded scatter: each label's text and offset in points."
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from capbook.viz import label_points
    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    x, y = [1, 1.05, 1.1, 2, 3, 3], [1, 1.02, 0.98, 1.5, 2, 2]
    ax.scatter(x, y); ax.set_xlim(0, 4); ax.set_ylim(0, 3)
    out = [[t.get_text(), *[round(float(v), 3) for v in t.xyann]] for t in label_points(ax, x, y, list("abcdef"))]
    plt.close(fig)
    return out

def rows_probe() -> str:
    "What `capbook.viz.attention_rows` draws of a fixed caption of seven words: its pixels, hashed."
    import matplotlib; matplotlib.use("Agg")
    from PIL import Image
    from capbook.viz import attention_rows
    img = np.zeros((32, 32, 3), np.uint8); img[4:12, 4:12] = 200
    alpha = torch.softmax(torch.linspace(-2, 2, 7 * 4).reshape(7, 4), -1)
    with _probing() as tmp:
        attention_rows([{"label": "probe", "image": img, "words": list("abcdefg"), "alpha": alpha, "grid": (2, 2)}], tmp / "rows.png")
        pixels = np.asarray(Image.open(tmp / "rows.png").convert("L"), dtype=np.uint8)
    return hashlib.sha256(pixels.tobytes()).hexdigest()[:16] + f"-{pixels.shape}"

def show_probe() -> str:
    "The Markdown `capbook.viz.show_table` shows of a fixed wide table."
    import pandas as pd
    from capbook.viz import show_table
    df = pd.DataFrame({"model": ["a", "b"], **{f"m{i}": [1.0, 2.5] for i in range(12)}, "CIDEr": [None, 90.0], "empty": [None, None]})
    with _probing() as tmp: return show_table(df, tmp / "t")

HELPER_PROBES = {"label_points": labels_probe, "attention_rows": rows_probe, "show_table": show_probe}   # drawing helpers some notebooks call: a notebook that names one has its probe in its key
RUN_FIGURE = "attention_rows"   # the helper a chapter run draws its attention figure with (`capbook.runner.run_chapter`): in the key of each row's own run, whose figure the book publishes (a seed's or a tagged run's stays in its run folder)

def helpers_used(path: Path) -> list[str]:
    "The fingerprinted helpers (`HELPER_PROBES`) a notebook's code cells name."
    code = " ".join(code_cells(path))
    return [h for h in HELPER_PROBES if re.search(rf"\b{h}\b", code)]

SHARED_PROBES = {"scorer": scorer_probe, "stats": stats_probe, "drawing": drawing_probe}
# The names by which a notebook's own cells reach a shared probe's code (a chapter run reaches the scorer and the
# drawing through the runner, a tables chapter all three through the rows it tabulates).
SHARED_NAMES = {"scorer": ("coco_scores", "evaluate", "semantic_scores", "attention_correctness", "CiderD", "image_stats", "stage_stats"),
                "stats": ("Claims", "seed_t_test", "holm", "merge_seeds", "row_record", "stage_stats", "compared_runs",
                          "simulate_verdicts", "size_sweep", "seed_means_t_test", "book_family", "chapter_verdicts", "paired_verdict"),
                "drawing": ("attention_figure", "save_table", "show_table", "attention_rows", "label_points")}
TABLES_ONLY = ("shared stats", "shared drawing")   # a key's parts that no training computes with: its claims' statistics, its figures (the scorer stays: validation picks the kept weights, SCST's reward is CIDEr-D)
RUN_SHARED = ("scorer", "drawing")   # what a chapter's training run computes with beyond its model: its record's metrics, its figures

def shared_used(path: Path, run: bool = False, tables: bool = False) -> list[str]:
    "The shared probes (`SHARED_PROBES`) in the key of a step of notebook `path`: a training run's (`run`) the scorer and the drawing; a tables chapter's (`tables`: it tabulates earlier runs) all three; and any step's, those whose code the cells it runs name (`SHARED_NAMES`; its exported cells define code for others)."
    from capbook.copies import exported
    if tables: return list(SHARED_PROBES)
    code = " ".join(c for c in code_cells(path) if not exported(c))      # what it runs, not what it defines for others
    return [s for s in SHARED_PROBES if (run and s in RUN_SHARED) or any(re.search(rf"\b{n}\b", code) for n in SHARED_NAMES[s])]

# %% [markdown]
# ## Step keys
#
# `Keys` computes the keys of the steps of one plan, each fingerprint once (the seeds of a row share their row's
# probe; the scorer, statistics and drawing probes are computed once for the steps that use them). A chapter run's key
# holds its own probe, the scorer's and the drawing's;
# an assembly notebook's, the keys of the runs it tabulates; an engine chapter's (`00*`, whose examples exercise the
# whole package), every model's probe. A notebook that calls one of the drawing helpers outside the shared drawing
# probe (`HELPER_PROBES`: `capbook.viz.label_points`, which places a scatter plot's labels,
# `capbook.viz.attention_rows`, which wraps an attention figure's words, and `capbook.viz.show_table`, which splits a
# wide table on its page) has that helper's probe in its key too, so a changed layout redraws exactly the pages that
# use it. A chapter run draws its attention figure with `attention_rows` (`RUN_FIGURE`) inside `run_chapter`, which its
# cells do not name: the key of a row's own run (untagged, seed 0), whose figure the book publishes, holds that probe;
# a seed's or a tagged run's figure stays in its run folder and its key leaves it out, so a changed layout redraws the
# five published figures and trains nothing (the probe is not in a training key).

# %%
#| export
def fingerprint_cache() -> Path:
    "Where fingerprints are kept between processes: by the package's source and the libraries that compute them (a changed line of `capbook/` starts a new file)."
    import matplotlib, pycocoevalcap, sys
    from capbook.core import data_dir, package_hash
    env = stable_hash([sys.version, torch.__version__, np.__version__, matplotlib.__version__,
                       getattr(pycocoevalcap, "__version__", None)], 8)
    return data_dir() / "fingerprints" / f"{package_hash()}-{env}.json"

_FINGERPRINTS: dict = {}   # this process's fingerprints, by the file that keeps them

class Keys:
    "The keys of a plan's steps, the fingerprints computed once each: once per package source, kept between processes (`fingerprint_cache`), unless `fresh`."
    def __init__(self, steps: list, upstream: Callable[[Any, list], list], made: Callable[[Any], str | None] | None = None,
                 fresh: bool = False, procs: Callable[[Any], int] | None = None):
        from capbook.profiles import train_procs
        self.steps, self.upstream, self.made, self._keys = steps, upstream, made, {}
        self.procs = procs or (lambda step: train_procs())    # the processes a chapter step trains with: this machine's setting
        self._file = None if fresh else fingerprint_cache()
        self._probes = {} if fresh else _FINGERPRINTS.setdefault(str(self._file), {})
        if self._file is not None and not self._probes and self._file.exists():
            try: self._probes.update(load_json(self._file))
            except CapbookError: pass             # a damaged cache is recomputed

    def _keep(self, name: str, value: Any) -> Any:
        self._probes[name] = value
        if self._file is not None:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            try: save_json(self._file, {**(load_json(self._file) if self._file.exists() else {}), name: value})
            except (CapbookError, OSError): pass  # a cache that cannot be written is recomputed next time
        return value

    def with_shared(self, name: str, digest: str) -> "Keys":
        "These keys as a machine whose shared probe `name` hashes to `digest` computes them (another machine's scorer: `capbook.book.receive_device_book`): the other fingerprints reused, nothing written to the cache."
        import copy
        other = copy.copy(self)
        other._keys, other._file, other._probes = {}, None, {**self._probes, f"shared {name}": digest}
        return other

    def shared(self, name: str) -> str:
        "The hash of a shared probe (`SHARED_PROBES`: the scorer, the statistics, the drawing)."
        if f"shared {name}" not in self._probes:
            with _probing(): self._keep(f"shared {name}", stable_hash(SHARED_PROBES[name](), 16))
        return self._probes[f"shared {name}"]

    def helper(self, name: str) -> str:
        "The hash of a drawing helper's probe (`HELPER_PROBES`)."
        if f"helper {name}" not in self._probes:
            with _probing(): self._keep(f"helper {name}", stable_hash(HELPER_PROBES[name](), 16))
        return self._probes[f"helper {name}"]

    @staticmethod
    def row(step) -> str:
        "The name under which a chapter step's probe is kept: its notebook and parameters, the seed aside (its seeds share it)."
        return stable_hash({k: v for k, v in step.params.items() if k not in ("seed", "run_dir")} | {"nb": step.notebook}, 16)

    def probe(self, step) -> str:
        "The hash of a chapter step's probe, shared by its seeds."
        row = self.row(step)
        if row not in self._probes:
            try: fp = probe(step)
            except CapbookError as e: fp = f"invalid: {e}"    # a run with a bad parameter: its notebook stops on it, in one line
            self._keep(row, stable_hash(fp, 16))
        return self._probes[row]

    def all_models(self) -> str:
        from capbook.profiles import chapters
        chs = chapters()
        return stable_hash(sorted({self.probe(s) for s in self.steps if s.notebook in chs}), 16)

    def key(self, step, upstream_keys: dict | None = None, nb: dict | None = None, training: bool = False,
            scst_epochs: int | None = None) -> str:
        "A step's key (`upstream_keys`: the keys of the runs it tabulates, as they were made; default: as computed here): its code, parameters, data and the fingerprints of what it computes with, never the machine's arithmetic. `training`: its training key instead, the same without what only its tables and figures compute with (`TABLES_ONLY`, the drawing helpers); `scst_epochs`: the key it would have with that self-critical budget."
        from capbook.profiles import chapters
        ups = self.upstream(step, self.steps)
        if upstream_keys is None:
            upstream_keys = {u.name: (self.made(u) if self.made else None) or self.get(u) for u in ups}
        ch, path = chapters().get(step.notebook), nbs_dir() / f"{step.notebook}.ipynb"
        part = {"nb": nb or notebook_code(path), "params": step.params, "upstream": upstream_keys}
        if "profile" in step.params: part["data"] = data_key(step.params, ch.encoder if ch else None)
        if ch is not None:
            part["probe"] = self.probe(step)
            b = budget(step)
            if scst_epochs is not None and "scst_epochs" in b: b = {**b, "scst_epochs": scst_epochs}
            if b: part["budget"] = b                   # the protocol's budget adds nothing: a key names only a departure from it
            if (n := self.procs(step)) > 1: part["processes"] = n   # DDP's batch is every process's: another computation
        elif step.notebook.startswith("00"): part["models"] = self.all_models()
        for s in shared_used(path, run=ch is not None, tables=bool(ups)): part[f"shared {s}"] = self.shared(s)
        for h in helpers_used(path): part[f"helper {h}"] = self.helper(h)
        if ch is not None and not step.tag: part[f"helper {RUN_FIGURE}"] = self.helper(RUN_FIGURE)   # the figure the book publishes
        if training: part = {k: v for k, v in part.items() if k not in TABLES_ONLY and not k.startswith("helper ")}
        return stable_hash(part, 16)

    def get(self, step) -> str:
        if step.name not in self._keys: self._keys[step.name] = self.key(step)
        return self._keys[step.name]

    def training(self, step) -> str:
        "A step's training key (`key(step, training=True)`), under which its training runs resume their checkpoints: a change to the statistics or the drawing re-keys the step, whose notebook then runs again on the checkpoints it finished instead of training them again."
        if f"training {step.name}" not in self._keys: self._keys[f"training {step.name}"] = self.key(step, training=True)
        return self._keys[f"training {step.name}"]

    def resuming(self, step) -> str:
        "What the book hands a step's kernel as its training key (`capbook.train.TRAINING_KEY`): `training(step)`, then, space-separated, the training keys it had at the ladder's lower rungs of its self-critical budget (`capbook.profiles.rungs_below`), under which its checkpoints at those budgets were written: a stage that climbed goes on from where it stopped (`capbook.train._extends`), and its cross-entropy stage, which the climb does not touch, stays finished."
        from capbook.profiles import chapters
        from capbook.train import FIRST
        if step.notebook not in chapters(): return self.training(step)
        first = self.first_stage(step)
        return " ".join([*self.trainings(step), *([FIRST + first] if first else [])])

    def trainings(self, step) -> list[str]:
        "A chapter step's training key, then its training keys at the ladder's lower rungs of its self-critical budget (`capbook.profiles.rungs_below`), nearest first: the keys its checkpoints may have been written under."
        from capbook.profiles import rungs_below
        s = budget(step).get("scst_epochs")
        return [self.training(step), *(self.key(step, training=True, scst_epochs=r) for r in rungs_below(s or 1))]

    def first_stage(self, step) -> str | None:
        "The key of a chapter step's cross-entropy stage where a self-critical stage follows it: the training key of the same step without that stage (`scst_epochs` 0, no other self-critical parameter), whose probe trains cross-entropy alone. Its cross-entropy checkpoints resume under it (`capbook.train.book_first_stage_key`), so a change to self-critical training alone retrains only the stages it touches. None for a step with no self-critical stage: its training key is its stage's."
        from capbook.profiles import chapters
        if step.notebook not in chapters() or not budget(step).get("scst_epochs"): return None
        if f"first {step.name}" not in self._keys: self._keys[f"first {step.name}"] = self.key(first_stage_step(step), training=True)
        return self._keys[f"first {step.name}"]

def first_stage_step(step) -> Step:
    "A chapter step as its cross-entropy stage alone: its parameters without the self-critical ones, `scst_epochs` 0."
    return dataclasses.replace(step, params={**{k: v for k, v in step.params.items() if not k.startswith("scst_")}, "scst_epochs": 0})

def plan_keys(profile: str, made: bool = True, fresh: bool = False, procs: Callable[[Any], int] | None = None):
    "The keys of the profile's plan (`capbook.results.Keys`); `made`: the runs an assembly notebook tabulates by the keys they were made with (`done.json`) where they have run, else by today's; `fresh`: no fingerprint reused from earlier in this process; `procs`: the processes each chapter step trains with (default: `capbook.profiles.train_procs`)."
    def as_made(u: Step) -> str | None:
        done = runs_dir() / profile / u.name / "done.json"
        return load_json(done).get("key") if made and done.exists() else None
    return Keys(plan(profile), upstream_of, as_made, fresh, procs)

# %% [markdown]
# The all-models chapter places its scatter plot's labels with `label_points`, so its key holds that helper's probe;
# GLIED's chapter calls neither helper:

# %%
from capbook.book import nbs_dir as _nbs
assert helpers_used(_nbs() / "06a_baselines_tables.ipynb") == ["label_points", "show_table"] and helpers_used(_nbs() / "05_glied.ipynb") == []
labels_probe(), rows_probe(), show_probe()[:80]

# %% [markdown]
# ## The published book, checked
#
# `capbook book` publishes each step's tables, figures and reader's copy to `figures/` and writes there the book's
# **manifest**, `book.json`: which step made each file, the file's content hash, every step's key as it ran, and the
# encoder weights the runs read. `current` computes today's keys (from this machine's fingerprints of today's package
# where it has them, `fingerprint_cache`, as the book does: seconds; else about a minute of probes) and says of every
# item whether it is what today's code makes: *current*; *stale* (its step's key has changed: rerun it with `capbook book
# --only <step>`); *edited* (changed by hand after publishing); *shows old text* (a reader's copy whose prose or
# exported definitions have since changed in a way no number sees — a paragraph or a docstring, say: `capbook book`
# refreshes the copy without rerunning anything); *unknown* (no step of today's book made it). `tests/test_book.py` fails on any item that is
# not current, so no change lands that silently outdates the published book.

# %%
#| export
def file_sha(path: Path) -> str:
    "A file's content hash."
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]

def published_files(folder: Path) -> list[Path]:
    "What a book folder publishes: tables, figures, the reader's copies of the notebooks (their images are named by their content) and the runs' records."
    folder = Path(folder)
    top = [f for f in folder.glob("*") if f.suffix == ".png" or (f.name.startswith("table_") and f.suffix in (".md", ".csv"))]
    return sorted(top) + sorted((folder / "notebooks").glob("*.ipynb")) + sorted((folder / RECORDS).glob("*.json.gz"))

def write_manifest(folder: Path, profile: str, made_by: dict[str, str], keys: dict[str, str], partial: bool = False,
                   extra: dict | None = None) -> dict:
    "Write `folder/book.json`: `made_by` {file relative to folder: step name} with each file's hash, `keys` {step: key as it ran}; `partial`: the entries of the steps not republished stay, and what else the manifest says of the book; `extra`: what else it says now (a device book's: where it was received from, the scorer its keys had where it ran)."
    folder = Path(folder)
    old = load_json(folder / MANIFEST) if partial and (folder / MANIFEST).exists() else {}
    redone = set(made_by.values())
    files = {f: e for f, e in old.get("files", {}).items() if e["step"] not in redone and (folder / f).exists()}
    files |= {f: {"step": s, "sha256": file_sha(folder / f)} for f, s in made_by.items() if (folder / f).exists()}
    m = {**{k: v for k, v in old.items() if k not in ("profile", "encoder", "steps", "files")},
         "profile": profile, "encoder": encoder_weights(profile, 0) if profile != "paper" else None,
         "steps": {**old.get("steps", {}), **keys}, "files": dict(sorted(files.items())), **(extra or {})}
    save_json(folder / MANIFEST, m)
    return m

BOOK_STEP = "(the book)"    # the maker of what the book itself writes, its time table: a measurement of the runs, not a number of the code

def _rehearsal_table_is_its_record(folder: Path) -> bool:
    from capbook.rehearsal import rehearsal_table
    rec = folder / "rehearsal_coco.json"
    return rec.exists() and (folder / "table_rehearsal.md").read_text().rstrip("\n") == rehearsal_table(load_json(rec))

# what commands other than the book publish: measurements of a machine, current when they are what their record says
MEASUREMENTS = {"table_rehearsal.md": _rehearsal_table_is_its_record}

def current(profile: str = "default", folder: Path | None = None) -> list[dict]:
    "Every published item of the book at `profile` (in `folder`, default its output folder) with the step that made it and whether it is current under today's keys (see above)."
    from capbook.profiles import out_dir
    from capbook.copies import copy_current
    folder = Path(folder or out_dir(profile))
    m = load_json(folder / MANIFEST) if (folder / MANIFEST).exists() else {"files": {}, "steps": {}}
    K = plan_keys(profile, made=False)            # this machine's fingerprints of today's package where it has them (as the book's)
    steps, rows = {s.name: s for s in K.steps}, []
    weights = encoder_weights(profile, 0) if profile != "paper" else None
    for f in published_files(folder):
        rel = f.relative_to(folder).as_posix()
        e = m["files"].get(rel)
        if e is None and rel in MEASUREMENTS: status = "current" if MEASUREMENTS[rel](folder) else "edited"
        elif e is not None and e["step"] == BOOK_STEP: status = "current" if e["sha256"] == file_sha(f) else "edited"
        elif e is None or e["step"] not in steps: status = "unknown"
        elif e["sha256"] != file_sha(f): status = "edited"
        elif m["steps"].get(e["step"]) != K.get(steps[e["step"]]) or m.get("encoder") != weights: status = "stale"
        elif rel.startswith("notebooks/") and not copy_current(f, nbs_dir() / f.name): status = "shows old text"
        else: status = "current"
        rows.append({"file": rel, "step": e["step"] if e else None, "status": status})
    rows += [{"file": f, "step": e["step"], "status": "missing"} for f, e in m["files"].items() if not (folder / f).exists()]
    return rows
