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
# # viz
#
# > One attention-plotting path for every model, and the writer of results tables.

# %%
#| default_exp viz

# %%
#| export
from __future__ import annotations
import io, textwrap
from pathlib import Path
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from PIL import Image
import matplotlib.pyplot as plt
from capbook.core import atomic_write
from capbook.data import load_rgb


# %% [markdown]
# ## Smoothing attention as in Show-Attend-Tell §5.4
#
# > "in order to visualize the attention weights for the soft model, we upsample the weights by a factor of
# > $2^4 = 16$ and apply a Gaussian filter to emulate the large receptive field size."
#
# *capbook:* the upsampling factor is the image size over the grid size (16 for 224-pixel images and a 14×14
# grid, as in the paper; 8 for the 112-pixel shapes images). The paper gives no filter width; the authors' released
# code used `pyramid_expand(upscale=16, sigma=20)`, i.e. σ = 1.25 × the factor, which we keep. The map is normalised
# to [0, 1] for display.

# %%
#| export
def smooth_attention(alpha: torch.Tensor, grid: tuple[int, int], size: int) -> np.ndarray:
    "Upsample attention weights (L,) on a `grid` to `size`×`size` and Gaussian-smooth them (σ = 1.25 × factor)."
    from torchvision.transforms.functional import gaussian_blur   # here: importing torchvision takes 1.3 s
    h, w = grid
    a = torch.as_tensor(alpha, dtype=torch.float32).reshape(1, 1, h, w)
    up = F.interpolate(a, size=(size, size), mode="nearest")
    sigma = 1.25 * size / max(h, w)
    k = min(int(2 * round(3 * sigma) + 1), 2 * size - 1)   # ±3σ, cut to the image (a coarse grid on a small image)
    sm = gaussian_blur(up, [k, k], [sigma, sigma])[0, 0]
    sm = sm - sm.min()
    return (sm / sm.max().clamp_min(1e-12)).numpy()


# %% [markdown]
# ## Per-word attention figures (Figure 3 style)
#
# `attention_figure` draws one row per model: the image with its generated caption, then, for each word, the image
# overlaid with the smoothed attention of the step that emitted it. Every model and paper notebook uses it.
#
# *capbook:* the image is drawn **as the encoder saw it**: read by the loader the encoder uses (`capbook.data.load_rgb`:
# 16-bit and high-bit-depth images scaled to 8 bits, transparency composited on white, palette and CMYK converted)
# and resized to a square, so the attention grid lies on the pixels it was computed from and an extreme aspect ratio
# still gives readable panels. (PIL's plain `convert("RGB")` would clip a 16-bit image to white and hide an RGBA image's
# colour under its transparency.)

# %%
#| export
def as_seen(image, size: int | None = None) -> np.ndarray:
    "An image path read as the encoder reads it (8-bit RGB, square `size`: default its own if square, else 224), or an array as given."
    if not isinstance(image, (str, Path)): return np.asarray(image)
    if size is None:
        try:
            with Image.open(image) as im: w, h = im.size
        except (OSError, ValueError): w, h = 0, 1          # load_rgb names the file and the problem
        size = w if w == h and 0 < w <= 448 else 224
    return load_rgb(image, size)

def attention_figure(rows: list[dict], path: str | Path | None = None, max_words: int = 12, panel: float = 1.6):
    "Rows of {'label', 'image' (path or HxWx3 array), 'words', 'alpha' (T, L), 'grid'}; saved to `path` if given, else returned."
    ncol = 1 + min(max_words, max(len(r["words"]) for r in rows))
    fig, axes = plt.subplots(len(rows), ncol, figsize=(panel * ncol, panel * 1.15 * len(rows)), squeeze=False)
    for r, ax in zip(rows, axes):
        img = as_seen(r["image"])
        ax[0].imshow(img); ax[0].set_title(textwrap.fill(r["label"], 32), fontsize=9)
        for j, wd in enumerate(r["words"][:ncol - 1]):
            ax[j + 1].imshow(img)
            ax[j + 1].imshow(smooth_attention(r["alpha"][j], r["grid"], img.shape[0]), cmap="gray", alpha=0.65,
                             extent=(0, img.shape[1], img.shape[0], 0))
            ax[j + 1].set_title(wd, fontsize=9)
        for a in ax: a.axis("off")
    fig.tight_layout()
    if path is None: return fig
    save_figure(fig, path); plt.close(fig)
    return Path(path)

def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    "Save a matplotlib figure as PNG, atomically."
    def w(t):
        buf = io.BytesIO(); fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight"); t.write_bytes(buf.getvalue())
    return atomic_write(path, w)


# %% [markdown]
# A red square in the top-left quarter of a grey image, and a caption whose second word looks at it:

# %%
_img = np.full((64, 64, 3), 128, np.uint8); _img[4:28, 4:28] = (220, 40, 40)
_alpha = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01]])
_fig = attention_figure([{"label": "a square", "image": _img, "words": ["a", "square"], "alpha": _alpha, "grid": (2, 2)}])
assert len(_fig.axes) == 3 and [a.get_title() for a in _fig.axes[1:]] == ["a", "square"]
_sm = smooth_attention(_alpha[1], (2, 2), 64)                  # the watched quarter is the bright one
assert _sm[:32, :32].mean() > 0.5 > _sm[32:, 32:].mean() and _sm[:32, :32].mean() > _sm[:32, 32:].mean()


# %% [markdown]
# ## Attention figures legible at page width
#
# `attention_figure` puts a caption's words on one line: twelve words make thirteen panels, about 55 pixels each on
# a page. `attention_rows` wraps each row's words onto lines of at most `per_line` panels after the image (four: about
# 150 pixels each at the site's page width), the image repeated at the head of each line.

# %%
#| export
def attention_rows(rows: list[dict], path: str | Path | None = None, per_line: int = 4, max_words: int = 16, panel: float = 2.2):
    "`attention_figure` with each row's first `max_words` words wrapped onto lines of `per_line` panels (its label, then '(continued)')."
    lines = []
    for r in rows:
        words = list(r["words"])[:max_words]
        for i in range(0, max(len(words), 1), per_line):
            lines.append({**r, "label": r["label"] if i == 0 else f"{r['label']} (continued)",
                          "words": words[i:i + per_line], "alpha": r["alpha"][i:i + per_line]})
    return attention_figure(lines, path, max_words=per_line, panel=panel)


# %%
_f = attention_rows([{"label": "a square", "image": _img, "words": ["a", "square", "on", "grey", "ground"], "alpha": torch.cat([_alpha] * 3)[:5],
                      "grid": (2, 2)}])
assert len(_f.axes) == 10 and [a.get_title() for a in _f.axes if a.get_title()][-2:] == ["a square (continued)", "ground"]
plt.close(_f)


# %% [markdown]
# ## Scatter plots whose labels do not overlap
#
# The book's comparison figures put a dozen named models on one plane, several of them close together. `label_points`
# names each point with a label placed greedily: the first of a few offsets around the point whose text box overlaps no
# label already placed, no point and the axes' edge; points at the same place share one label.

# %%
#| export
_OFFSETS = [(4, 4), (4, -10), (-4, 4), (-4, -10), (4, 12), (-4, 12), (4, -18), (-4, -18), (10, -3), (-10, -3), (4, 20), (-4, -26)]

def label_points(ax, xs, ys, labels, fontsize: float = 7) -> list:
    "Name each point (x, y) of `ax` with its label where it overlaps nothing already drawn (see above); returns the text artists."
    fig = ax.figure
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    groups: dict = {}
    for x, y, lab in zip(xs, ys, labels): groups.setdefault((round(float(x), 6), round(float(y), 6)), []).append(str(lab))
    frame = ax.get_window_extent(r)
    taken = [ax.transData.transform((x, y)) for (x, y) in groups]
    boxes, out = [], []
    for (x, y), labs in sorted(groups.items(), key=lambda g: -g[0][1]):
        text = " = ".join(labs)
        first = best = None
        for dx, dy in _OFFSETS:
            t = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                            ha="left" if dx >= 0 else "right")
            bb = t.get_window_extent(r).expanded(1.02, 1.1)
            clash = (any(bb.overlaps(b) for b in boxes) or any(bb.contains(px, py) for px, py in taken)
                     or bb.x0 < frame.x0 or bb.x1 > frame.x1 or bb.y0 < frame.y0 or bb.y1 > frame.y1)
            if not clash: best = t; break
            if first is None: first = t                   # nowhere free: the first place, drawn anyway
            else: t.remove()
        if best is None: best = first
        elif first is not None: first.remove()
        boxes.append(best.get_window_extent(r)); out.append(best)
    return out


# %% [markdown]
# Five points, three of them crowded, one pair at the same place: every label is drawn once, and none overlaps another.

# %%
_fig, _ax = plt.subplots(figsize=(4, 3))
_x, _y = [1, 1.05, 1.1, 3, 3], [1, 1.02, 0.98, 2, 2]
_ax.scatter(_x, _y); _ax.set_xlim(0, 4); _ax.set_ylim(0, 3)
_t = label_points(_ax, _x, _y, ["alpha model", "beta model", "gamma model", "delta", "delta + SCST"])
_r = _fig.canvas.get_renderer()
_bb = [t.get_window_extent(_r) for t in _t]
assert len(_t) == len(_ax.texts) == 4 and "delta = delta + SCST" in [t.get_text() for t in _t]
assert not any(a.overlaps(b) for i, a in enumerate(_bb) for b in _bb[i + 1:])
plt.close(_fig)


# %% [markdown]
# ## Soft vs hard attention on a 2×2 split (the explainer's worked example)
#
# `soft_hard_figure` draws the result of `capbook.sat.worked_example` the way the explainer pictures it: the image cut
# into its four regions with each region's score and weight; the soft input to the LSTM, each region darkened in
# proportion to its weight ("high attention area keeps the original value while low attention areas get closer to 0");
# the hard input, only the sampled region; and the weights beside the share of draws that picked each region.

# %%
#| export
def _region_boxes(n_rows: int, n_cols: int, H: int, W: int):
    for r in range(n_rows):
        for c in range(n_cols):
            yield r * n_cols + c, (r * H // n_rows, (r + 1) * H // n_rows, c * W // n_cols, (c + 1) * W // n_cols)

def soft_hard_figure(image, ex: dict, word: str, path: str | Path | None = None, regions: tuple[int, int] = (2, 2)):
    "Four panels for a worked example `ex` (scores, alpha, sample, freq) over `regions` of `image` (path or HxWx3 array)."
    img = as_seen(image)
    H, W = img.shape[:2]
    alpha, scores, freq = (np.asarray(torch.as_tensor(ex[k]).float().cpu()) for k in ("alpha", "scores", "freq"))
    soft, hard = np.zeros_like(img, dtype=float), np.zeros_like(img, dtype=float)
    fig, ax = plt.subplots(1, 4, figsize=(12.5, 3.3))
    ax[0].imshow(img)
    for i, (y0, y1, x0, x1) in _region_boxes(*regions, H, W):
        soft[y0:y1, x0:x1] = img[y0:y1, x0:x1] * alpha[i] / alpha.max()
        if i == ex["sample"]: hard[y0:y1, x0:x1] = img[y0:y1, x0:x1]
        ax[0].text((x0 + x1) / 2, (y0 + y1) / 2, f"$e_{i + 1}$={scores[i]:.2f}\n$\\alpha_{i + 1}$={alpha[i]:.2f}",
                   ha="center", va="center", fontsize=8, color="white", bbox=dict(facecolor="black", alpha=0.55, lw=0))
    for a in ax[:3]:
        a.axhline(H / 2 - 0.5, color="w", lw=0.8); a.axvline(W / 2 - 0.5, color="w", lw=0.8)
    ax[0].set_title(f"regions $x_i$, scores, weights\n(predicting '{word}')", fontsize=9)
    ax[1].imshow(soft.astype(np.uint8)); ax[1].set_title("soft: $\\sum_i \\alpha_i x_i$\n(brightness ∝ $\\alpha_i$)", fontsize=9)
    ax[2].imshow(hard.astype(np.uint8)); ax[2].set_title(f"hard: $x_{{\\tilde s}}$, $\\tilde s$ = {ex['sample'] + 1}\n(one draw)", fontsize=9)
    for a in ax[:3]: a.axis("off")
    k = np.arange(len(alpha))
    ax[3].bar(k - 0.2, alpha, 0.4, label="$\\alpha_i$"); ax[3].bar(k + 0.2, freq, 0.4, label=f"share of {ex['draws']:,} draws")
    ax[3].set_xticks(k, [f"$x_{i + 1}$" for i in k]); ax[3].set_ylim(0, 1); ax[3].legend(fontsize=8)
    ax[3].set_title("hard: p(pick $x_i$) = $\\alpha_i$", fontsize=9)
    fig.tight_layout()
    if path is None: return fig
    save_figure(fig, path); plt.close(fig)
    return Path(path)


# %%
_ex = {"alpha": torch.tensor([0.7, 0.1, 0.1, 0.1]), "scores": torch.tensor([2.0, 0.1, 0.1, 0.1]), "sample": 0,
       "freq": np.array([0.69, 0.1, 0.11, 0.1]), "draws": 1000}
_fig = soft_hard_figure(_img, _ex, "square")
assert len(_fig.axes) == 4 and "s$ = 1" in _fig.axes[2].get_title()


# %% [markdown]
# ## Tables
# Results tables are pandas DataFrames written side by side as Markdown (for reading) and CSV (for reuse).

# %%
#| export
COUNTS = ("seeds", "images", "trials")   # the columns that count things: whole numbers, whatever pandas made of them

def whole_counts(df: pd.DataFrame) -> pd.DataFrame:
    "`df` with each count column (`COUNTS`) that pandas made float only to hold a missing value (seeds where a paper's row has none) as integers again (pandas' `Int64`), so that 3 seeds print as 3, not 3.00; a score is left as it is, whole or not."
    out = df.copy()
    for c in out.columns:
        x = out[c]
        if c in COUNTS and pd.api.types.is_float_dtype(x) and x.notna().any() and (x.dropna() % 1 == 0).all():
            out[c] = x.astype("Int64")
    return out

def markdown_table(df: pd.DataFrame, floatfmt: str = ".1f") -> str:
    "`df` as a Markdown table, missing values as —, counts as whole numbers (`whole_counts`)."
    df = whole_counts(df)
    return df.astype(object).where(df.notna(), None).to_markdown(index=False, floatfmt=floatfmt, missingval="—")

def save_table(df: pd.DataFrame, path_stem: str | Path, floatfmt: str = ".1f") -> str:
    "Write `df` to `<stem>.md` (`markdown_table`) and `<stem>.csv` atomically, counts as whole numbers in both; return the Markdown."
    stem, df = Path(path_stem), whole_counts(df)
    md = markdown_table(df, floatfmt)
    atomic_write(stem.with_suffix(".md"), lambda t: t.write_text(md + "\n"))
    atomic_write(stem.with_suffix(".csv"), lambda t: df.to_csv(t, index=False))
    return md

KEY_COLUMNS = ("training", "seeds", "CIDEr", "CIDEr sd", "CIDEr 95% CI", "BLEU-4", "F1 all", "semantic F1 95% CI", "att. mass", "att. hit", "note")

def show_table(df: pd.DataFrame, path_stem: str | Path, floatfmt: str = ".1f", max_columns: int = 12) -> str:
    "`save_table`, and the Markdown a page shows: without all-empty columns, and wider than `max_columns` split in two — the row names (the leading text columns) with the key columns (`KEY_COLUMNS`), then the row names with the others."
    md = save_table(df, path_stem, floatfmt)
    shown = df[[c for c in df.columns if df[c].notna().any() and not (df[c].astype(str) == "—").all()]]
    if shown.shape[1] <= max_columns: return md if shown.shape[1] == df.shape[1] else markdown_table(shown, floatfmt)
    names = []
    for c in shown.columns:
        if pd.api.types.is_numeric_dtype(shown[c]) or c in KEY_COLUMNS: break
        names.append(c)
    key = [c for c in KEY_COLUMNS if c in shown.columns and c not in names]
    rest = [c for c in shown.columns if c not in names + key]
    return markdown_table(shown[names + key], floatfmt) + "\n\nThe same rows, the other columns:\n\n" + markdown_table(shown[names + rest], floatfmt)

def stage_tables(record: dict) -> list[pd.DataFrame]:
    "A results record's self-critical stage, epoch by epoch (reward, baseline, greedy reward, validation), and each stage's test scores ×100; [] for a run without one."
    if "stages" not in record: return []
    st = record["stages"]
    return [pd.DataFrame(st["scst"]["history"]).round(4),
            pd.DataFrame({k: {m: round(100 * v, 1) for m, v in s["metrics"].items() if isinstance(v, float)}
                          for k, s in st.items()}).T]


# %% [markdown]
# A table of fourteen measured columns and an empty one, as a tables chapter shows it: the empty column dropped, the
# row names and CIDEr first, the other columns below.

# %%
import tempfile as _tf
_wide = pd.DataFrame({"model": ["a", "b"], "source": ["paper (quoted)", "capbook (measured)"], **{f"m{i}": [1.0, 2.0] for i in range(12)},
                      "CIDEr": [None, 90.0], "empty": [None, None]})
with _tf.TemporaryDirectory() as _d: _md = show_table(_wide, Path(_d) / "t")
_first, _second = _md.split("The same rows, the other columns:")
assert _first.startswith("| model") and _second.strip().startswith("| model") and "source" in _first      # the row names in both
assert "CIDEr" in _first and "m0" not in _first and "m0" in _second and "empty" not in _md


# %% [markdown]
# A record with a self-critical stage gives its epochs and both stages' scores; one without gives nothing to show.

# %%
_rec = {"stages": {"xe": {"metrics": {"CIDEr": 1.2}}, "scst": {"metrics": {"CIDEr": 1.3}, "history": [{"reward": 0.9}]}}}
_h, _s = stage_tables(_rec)
assert list(_h["reward"]) == [0.9] and _s.loc["scst", "CIDEr"] == 130.0 and stage_tables({"metrics": {}}) == []

# %%
_m = smooth_attention(torch.eye(1, 196).flatten(), (14, 14), 112)
assert _m.shape == (112, 112) and _m.max() == 1 and np.unravel_index(_m.argmax(), _m.shape)[0] < 16

# %%
import tempfile
_md = save_table(pd.DataFrame({"model": ["soft", "hard"], "BLEU-4": [21.3, None]}), Path(tempfile.mkdtemp()) / "t")
print(_md); assert "—" in _md and "21.3" in _md
_md = markdown_table(pd.DataFrame({"model": ["paper", "capbook"], "seeds": [None, 3.0], "CIDEr": [None, 104.0]}), ".2f")
assert "|       3 |" in _md and "3.00" not in _md and "104.00" in _md      # a count stays whole; a score that happens to be whole keeps its decimals
