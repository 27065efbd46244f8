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
# # The data: shapes, its card, and the room it leaves
#
# > The embedded dataset every chapter runs on by default, what is in it, and the floor and ceiling of its scores.
#
# The book downloads no real captioning dataset and no pretrained weights, and a fresh
# clone must run end to end on a CPU. So capbook generates **shapes**: images of coloured shapes on a cluttered,
# textured background, each with five reference captions from a grammar (objects, attributes, counts and
# left/right/above/below relations), written in the same Karpathy-split JSON format as `dataset_coco.json`. Everything
# downstream — the frozen encoder, the feature store, the vocabulary, the caption datasets, the models, the
# evaluator — is the code path a COCO run takes (`dataset="coco", data_path=...`). Because every object's box and
# attributes are known, shapes also allows two measurements no captioning paper could make on COCO: exact semantic
# precision/recall of a caption, and whether the attention falls on the object being named.
#
# This chapter builds (or loads from `data/`) the dataset, the encoder and the features, then shows the dataset card
# and the **room** the models have: the *floor*, a captioner that never sees the image, and the *ceiling*, each human
# (here: grammar) reference scored against the other four. A dataset on which every model scores near the ceiling could
# not tell the papers' models apart.
#
# **The book's one default scale** (*capbook:* chosen so that every compared row can be trained through
# the protocol's whole budget, over three seeds, on a 2-core CPU): 1,500 training images (7,500 captions), 500
# validation and 1,000 test images; every model at one width — Show-Attend-Tell's decoder and every recurrent baseline
# with 64-dimensional word embeddings and attention and a 128-unit LSTM, the transformers (spatial transformer, CT)
# and GLIED at d = 64 with one 64-dimensional head (the paper's d_attn) and a 128-wide (GLIED 256) feed-forward layer,
# the 2D-latent-state LSTM with a 64-channel state (chosen by `03_spca`'s trial of 32 and 64; 16 starved it). A
# converged small model says more than an unconverged large one; the `paper` profile keeps the papers' sizes where the
# chapter declares them.
#
# **What keeps the whole book to hours on two cores**, each lever chosen by measurement (the times are on a
# 2-core AMD EPYC with AVX-512 BF16; `figures/table_book_times.md` lists every step's minutes and the machine):
# - *the arithmetic:* the CPU trains in bfloat16 where it has bfloat16 kernels (`precision="auto"`, from the CPU's
#   flags). On that CPU, one thread, `capbook bench --alternatives` measured the 2D-latent-state LSTM + SPCA at 193
#   captions/s in bfloat16 against 150 in float32 (1.28×: its convolutions gain), and the 1D decoder + SPCA at 155
#   against 150 (its small products barely do): the 2D rows, the book's slowest, are where it pays. (Its `capbook
#   bench --family sat_soft,lstm2d_spca` on two threads: a float32 product at 197 GFLOP/s, soft attention 768
#   training captions/s, the 2D-LSTM + SPCA 312.)
# - *the budget:* one rule for every compared row: 15 epochs on a cosine to zero, and twice that for a row most of
#   whose seeds were still rising at the end of 15 (Up-Down, CT, and the spatial transformer with its temperature
#   ablation), checked against every row's own curve (`06a_baselines_tables`, "Did every row train to a flat curve?");
#   a claim between a 15- and a 30-epoch row reads the shorter row's twin at 30; never shortened per row, and not 30
#   for every row, which would nearly double the book's time;
# - *the seeds:* three on every row a verdict rests on (five on Show-Attend-Tell's headline rows), one on SPCA's six
#   ablation rows that no verdict rests on (`03_spca`: a 2D run takes 16–21 minutes there, so its chapter is 18 runs,
#   not 30);
# - *the scale:* the one above for every compared row, with no row narrowed to fit (16 channels starved the 2D state).
#
# **What "current" promises across machines.** Every published number carries the key of the step that made it
# (`nbs/00t_results`): its notebook's code, parameters and data, and a numerical fingerprint of the code it runs,
# computed in float64 so that it is the same on every CPU; `make test` fails when a published item's key is not
# today's. The arithmetic a run trained in (bfloat16 or float32, the CPU's instructions) is written in its record, not
# in its key: a book made on one kind of CPU is current on another. The data are the
# same everywhere: the generator draws the same images from the same seed, and the default book's shapes encoder is
# shipped (`data/encoders/shapes-default-s0.pt`) rather than trained on each machine, because its training, like any
# float32 computation, is bit-identical only on machines of one kind. The training runs are not bit-identical across
# kinds of CPU either: a float32 (or bfloat16) product's last bits depend on the instructions that computed it, and
# training amplifies them, so a run repeated on another kind of CPU lands elsewhere within the spread of its seeds.
# That is what the seeds of a row measure, and why a verdict rests on them: "current" means *made by today's code
# from these data*; the digits of a run are reproducible on one kind of machine, its conclusions on any.

# %%
#| hide
from collections import Counter
import numpy as np, pandas as pd
import matplotlib.pyplot as plt
from PIL import Image
from capbook.core import check_choice, check_int
from capbook.runner import start_run, read_params
from capbook.prepare import prepare
from capbook.metrics import coco_scores
from capbook.viz import save_table, save_figure

# %% tags=["parameters"]
profile = "default"     # smoke | default | paper
dataset = "shapes"      # shapes | coco | flickr8k | flickr30k
data_path = None        # folder with dataset_<name>.json and the images (real datasets)
encoder = None          # None: the dataset's default encoder
seed = 0
run_dir = None          # set by `capbook book`; None: runs/<profile>/adhoc/...

# %%
read_params(["profile", "dataset", "data_path", "encoder", "seed", "run_dir"], globals())   # a misspelt -p stops here
check_choice("dataset", dataset, ["shapes", "coco", "flickr8k", "flickr30k"])
check_int("seed", seed, lo=0)
run = start_run("01_dataset", dict(profile=profile, dataset=dataset, data_path=data_path, encoder=encoder, seed=seed,
                                   run_dir=run_dir))
prep = prepare(dataset, profile, seed=seed, data_path=data_path, encoder=encoder)


# %% [markdown]
# ## Dataset card

# %%
def lengths(split): return [len(r) for refs in split.refs for r in refs]
card = {"images (train/val/test)": f"{prep.train.n_images}/{prep.val.n_images}/{prep.test.n_images}",
        "captions per image": Counter(len(r) for r in prep.train.refs).most_common(1)[0][0],
        "vocabulary (words kept, incl. 4 specials)": len(prep.vocab),
        "caption length (mean / min / max words)": "{:.1f} / {} / {}".format(np.mean(lengths(prep.train)),
                                                                          min(lengths(prep.train)), max(lengths(prep.train))),
        "max length kept for training": prep.max_len,
        "features (L × D) / grid": f"{prep.feat_shape[0]} × {prep.feat_shape[1]} / {prep.grid[0]}×{prep.grid[1]}",
        "encoder": prep.encoder}
if prep.gt is not None:
    objs = [len(g["objects"]) for g in prep.gt["images"].values()]
    rels = [len(g["relations"]) for g in prep.gt["images"].values()]
    card["objects per image (mean / min / max)"] = f"{np.mean(objs):.2f} / {min(objs)} / {max(objs)}"
    card["relations per image (mean)"] = f"{np.mean(rels):.1f}"
card_df = pd.DataFrame({"": list(card), "value": [str(v) for v in card.values()]})
save_table(card_df, run.path("table_dataset_card"))
card_df

# %% [markdown]
# Some test images with their five references:

# %%
#| fig-cap: The first four test images of the book's data, each with its reference captions
paths = prep.image_paths("test")[:4]
fig, axes = plt.subplots(1, 4, figsize=(14, 4.2))
for ax, p, refs in zip(axes, paths, prep.test.refs[:4]):
    ax.imshow(Image.open(p).convert("RGB")); ax.axis("off")
    ax.set_title("\n".join(" ".join(r) for r in refs), fontsize=7, loc="left")
fig.tight_layout(); save_figure(fig, run.path("fig_dataset_examples.png"))

# %% [markdown]
# ## The room between floor and ceiling
#
# **Floor** — a captioner that never sees the image: one fixed caption for every image, the one among the 100 most
# frequent training captions with the best CIDEr on the validation references (chosen on val, scored on test).
#
# **Ceiling** — each reference scored against the other four, averaged over the five folds (note: four references
# instead of five makes BLEU slightly stricter for the ceiling than for the models).

# %%
from pycocoevalcap.cider.cider import Cider
freq = Counter(" ".join(r) for refs in prep.train.refs for r in refs).most_common(100)
nval = min(100, prep.val.n_images)
vgts = {i: [" ".join(r) for r in prep.val.refs[i]] for i in range(nval)}
blind = max((c for c, _ in freq), key=lambda c: Cider().compute_score(vgts, {i: [c] for i in vgts})[0])
gts = {k: [" ".join(r) for r in refs] for k, refs in zip(prep.test.keys, prep.test.refs)}
floor, _ = coco_scores(gts, {k: blind for k in gts})
folds = []
for j in range(5):
    res = {k: v[j] for k, v in gts.items() if len(v) > j}
    folds.append(coco_scores({k: [r for i, r in enumerate(gts[k]) if i != j] for k in res}, res)[0])
ceiling = {m: float(np.mean([f[m] for f in folds])) for m in folds[0]}
sem = {}
if prep.gt is not None:
    from capbook.shapes import semantic_scores
    refs = dict(zip(prep.test.keys, prep.test.refs))
    sem["floor"] = semantic_scores({k: blind.split() for k in refs}, refs, prep.gt["images"])
    sem["ceiling"] = semantic_scores({k: v[0] for k, v in refs.items()},
                                     {k: v[1:] for k, v in refs.items()}, prep.gt["images"])
print("floor caption:", blind)

# %%
rows = []
for name, sc in [("floor (blind caption)", floor), ("ceiling (reference vs other four)", ceiling)]:
    row = {"": name, **{m: 100 * v for m, v in sc.items()}}
    key = "floor" if name.startswith("floor") else "ceiling"
    if key in sem: row["semantic F1 (all)"] = 100 * sem[key]["all"]["f1"]
    rows.append(row)
room = pd.DataFrame(rows)
save_table(room, run.path("table_room"))
run.record({"floor": floor, "ceiling": ceiling, "semantic": sem, "blind_caption": blind, "card": card})
room

# %% [markdown]
# *Reading the table (capbook's commentary):* the floor is what language statistics alone buy; every model must beat
# it to show it uses the image. The "ceiling" is an upper bound only for what a caption *says*, not for n-gram
# metrics: a model that writes the most typical sentence for an image can out-score a single human reference on BLEU
# and CIDEr, as models out-score humans on COCO. So the room a model really has is clearest in the semantic F1
# column — the exact agreement of what the caption states (objects, attributes, counts, relations) with the image and
# the references — which the model chapters report beside the COCO metrics, on the same test split.
