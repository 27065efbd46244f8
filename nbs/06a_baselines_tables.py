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
# # All models of the book side by side
#
# > Every model the book trains — the five papers' and their baselines — on the same test images, features and data: caption metrics against what the captions say (semantic F1) and where the models look (attention correctness), in one table and one figure.
#
# This notebook trains nothing: it reads the results records of the book's runs (`capbook.records.compared_runs`, which
# stops if any run was trained on other data) and sets them side by side. Every row is trained under the book's one
# protocol (`nbs/02b_protocol`): the profile's whole budget (15 epochs at `default`, 30 for a row most of whose seeds
# were still rising at 15, and for GLIED's chapter, whose curve dips where 15 epochs would anneal it) with the learning rate annealed to zero and the evaluation of best validation CIDEr kept,
# then, where a row says so, a self-critical stage of 2/3 as many epochs, three rungs up the ladder (160 after 30, `06_baselines`); the `epochs` column says how many each row
# had. A row marked "(30 epochs)" is the twin of a 15-epoch row, trained as long as the rows a claim compares it with.
#
# Three kinds of score, because a captioner can be good at one and bad at another:
# - **caption metrics** (BLEU-4, CIDEr) reward n-grams shared with the references;
# - **semantic F1** (shapes only) scores what the caption states — objects, attributes, counts, relations — against the
#   image's ground truth and the references (`capbook.shapes.semantic_scores`);
# - **attention correctness** (shapes only) measures how much of the attention, at the step that names an object, lies
#   on that object (`att. mass`; uniform attention scores the objects' area) and how often its peak does (`att. hit`).

# %%
#| hide
import numpy as np, pandas as pd
import matplotlib.pyplot as plt
from IPython.display import Image as IPImage, Markdown, display
from capbook.runner import start_run
from capbook.profiles import read_params, epochs_trained, late_gain, curve_end, row_epochs, LADDER, SCST_RUNGS
from capbook.records import record_stage, stage_stats, stage_tag, seed_cells, SEED_METRICS, stage_best, relation_cells
from capbook.claims import interval_cells, Claims, paired_verdict, same_budget, book_family
from capbook.papers import CLAIM_SOURCES
from capbook.records import compared_runs
from capbook.prepare import prepare
from capbook.metrics import results_row
from capbook.viz import label_points, save_figure, save_table, show_table

# %% tags=["parameters"]
profile = "default"     # smoke | default | paper: the profile whose runs are assembled
run_dir = None          # set by `capbook book`; None: runs/<profile>/adhoc/...

# %%
#| bookkeeping
run = start_run("06a_baselines_tables", read_params(["profile", "run_dir"], globals()))
MODELS = [  # (label, family, (group, tag), training stage)
    ("Show and Tell (NIC)", "baselines", ("base", "nic"), "xe"),
    ("LSTM, image every step", "baselines", ("base", "lstm"), "xe"),
    ("No attention (SAT decoder)", "Show-Attend-Tell", ("sat", "none"), "xe"),
    ("Soft-Attention", "Show-Attend-Tell", ("sat", ""), "xe"),
    ("Hard-Attention", "Show-Attend-Tell", ("sat", "hard"), "xe"),
    ("SCA-CNN", "baselines", ("base", "sca-cnn"), "xe"),
    ("Att2in", "baselines", ("base", "att2in"), "xe"),
    ("Att2in + SCST", "baselines", ("base", "att2in"), "scst"),
    ("Att2in + SCST (mean baseline)", "baselines", ("base", "att2in"), "scst-mean"),
    ("Up-Down", "baselines", ("base", ""), "xe"),
    ("Up-Down + SCST", "baselines", ("base", ""), "scst"),
    ("Up-Down + SCST (mean baseline)", "baselines", ("base", ""), "scst-mean"),
    ("2D-latent state", "SPCA", ("spca", "base"), "xe"),
    ("2D-latent-LSTM + SPCA", "SPCA", ("spca", ""), "xe"),
    ("1D-LSTM + SPCA", "SPCA", ("spca", "1d"), "xe"),
    ("CT (6-block transformer decoder)", "baselines", ("base", "ct"), "xe"),
    ("Spatial self-attention transformer", "spatial transformer", ("ssa", ""), "xe"),
    ("GLIED base", "GLIED", ("glied", "base"), "xe"),
    ("GLIED base + SCST", "GLIED", ("glied", "base"), "scst"),
    ("GLIED base + SCST (mean baseline)", "GLIED", ("glied", "base"), "scst-mean"),
    ("GLIED", "GLIED", ("glied", ""), "xe"),
    ("GLIED + SCST", "GLIED", ("glied", ""), "scst"),
    ("GLIED + SCST (mean baseline)", "GLIED", ("glied", ""), "scst-mean"),
    ("Soft-Attention (30 epochs)", "Show-Attend-Tell", ("sat", "e30"), "xe"),     # the twin a claim against a 30-epoch row reads
]
START = {label: next(l for l, _, k2, s2 in MODELS if k2 == k and s2 == "xe") for label, _, k, st in MODELS if st != "xe"}   # a stage's start
steps, recs = compared_runs(profile, {"sat": ("02_show_attend_tell", ("", "hard", "none", "e30")),
                                      "spca": ("03_spca", ("", "base", "1d")),
                                      "ssa": ("04_spatial_self_attention", ("",)),
                                      "glied": ("05_glied", ("", "base")),
                                      "base": ("06_baselines", None)})
MODELS = [m for m in MODELS if m[2] in recs]              # the twins: at the default profile only (the others train every row at one budget)
TWINS = {label.removesuffix(" (30 epochs)"): label for label, *_ in MODELS if label.endswith(" (30 epochs)")}
data, p0 = recs["base", ""]["data"], recs["base", ""]["params"]
print(f"{len(steps)} runs, all trained on {data['dataset']} ({data['encoder']} features, data {data['fingerprint']})")
prep = prepare(p0["dataset"], profile, seed=p0.get("data_seed", 0), data_path=p0["data_path"], encoder=p0["encoder"])   # the test references

# %% [markdown]
# ## The table
#
# Test split, beam 3 for every row. Scores ×100: the mean over the row's training seeds, their standard deviation, and a
# 95 % interval by Student's t with the seed as the unit of replication, over the seeds and the test images, each
# variance component counted once (`capbook.claims.seed_t_test`): how far the number would move with other seeds and another test set of the same
# size; a row of one seed (the smoke and paper profiles) gets the test images' interval alone, marked so. "—": the run
# kept no captions of that stage. `rel. true` and `rel. swapped`: the share of a row's relation statements true of the
# image, and true with the two objects swapped (`capbook.shapes.relation_truth`; mean over seeds): alike where its
# relation words do not say where the objects are.

# %%
rows, stats, E = [], {}, {}
for label, family, k, st in MODELS:
    rec = recs[k]
    E[label] = row_epochs(rec)                             # its budget, named in a claim against a row of another
    s = record_stage(rec, st)
    xe = record_stage(rec, "xe")
    epochs = epochs_trained(rec["history"]) + (epochs_trained(rec["stages"][st]["history"]) if st != "xe" else 0)
    stats[label] = stage_stats(rec, prep, st)
    rows.append({"model": label, "family": family, "training": "cross-entropy" if st == "xe" else "+ self-critical",
                 **results_row(s["metrics"]), **interval_cells(stats[label]), **seed_cells(rec, st),
                 **{c: v for c, v in relation_cells(rec, prep, st).items() if c in ("rel. true", "rel. swapped")}, "params (k)": round(rec["n_params"] / 1e3),
                 "train min": (xe["train_s"] + (s["train_s"] if st != "xe" else 0)) / 60, "epochs": epochs,
                 "images/s": s["images_per_s"]})
table = pd.DataFrame(rows)
order = ["model", "training", "seeds", "CIDEr", "CIDEr sd", "CIDEr 95% CI", "BLEU-4", "F1 all", "semantic F1 95% CI", "att. mass",
         "att. hit", "BLEU-4 95% CI", "METEOR", "F1 counts", "F1 relations", "rel. true", "rel. swapped", "params (k)", "train min", "epochs",
         "images/s", "family"]
table = table[[c for c in order if c in table.columns and table[c].notna().any()]]      # no all-empty column
display(Markdown(show_table(table, run.path("table_baselines_all"), floatfmt=".1f")))   # the key columns, then the rest

# %% [markdown]
# ## Which model looks where, and which describes best
#
# Left: CIDEr against the semantic F1 (what the caption states; shapes only). Right: CIDEr against the attention mass
# on the named object, for the models that have a spatial map to measure (NIC and the every-step LSTM have none). The
# bars are the spread over training seeds (one sample standard deviation each way); a ring marks a row whose
# cross-entropy training ran at the ladder's next budget: because most of its seeds were still rising at the base one,
# because its chapter trains there (GLIED's), or as the twin of a row compared with one that was.

# %%
#| fig-cap: Every model of the book on the same test images: CIDEr against the semantic F1 and against the attention mass on the named object; bars: one seed standard deviation; a ring: a row whose cross-entropy training ran at the next budget
T = table.set_index("model")
sd = {r["model"]: {c: float(r[f"{m} sd"]) if r[f"{m} sd"] != "—" else np.nan for m, c in SEED_METRICS.items()} for r in rows}
budget = pd.Series(E)                                 # each row's cross-entropy budget; a longer one climbed the ladder (`protocol_epochs`)
base_epochs = budget.min()
families = list(dict.fromkeys(T["family"]))
marks = dict(zip(families, "osD^vP"))
has_sem = "F1 all" in T
panels = ([("F1 all", "semantic F1 (all categories)")] if has_sem else []) + [("att. mass", "attention mass on the named object")]
fig, axes = plt.subplots(len(panels), 1, figsize=(9, 5.2 * len(panels)), squeeze=False)          # one panel a row: room for the names
axes = axes.T
for ax, (col, xlabel) in zip(axes[0], panels):
    if col not in T: ax.set_visible(False); continue
    shown = T[T[col].notna()]
    ax.errorbar(shown[col], shown["CIDEr"], yerr=[sd[m]["CIDEr"] for m in shown.index],
                xerr=[sd[m].get(col, np.nan) for m in shown.index], fmt="none", ecolor="0.55", lw=0.9, capsize=2, zorder=1)
    for fam in families:
        sub = shown[shown["family"] == fam]
        ax.scatter(sub[col], sub["CIDEr"], marker=marks[fam], s=46, label=fam, zorder=2)
    longer = shown[budget[shown.index] > base_epochs]
    ax.scatter(longer[col], longer["CIDEr"], s=190, facecolors="none", edgecolors="k", lw=1.1, zorder=3,
               label=f"cross-entropy for {', '.join(f'{e:.0f}' for e in sorted(set(budget[longer.index])))} epochs, not {base_epochs:.0f}" if len(longer) else None)
    ax.set_xlabel(xlabel); ax.set_ylabel("CIDEr (bars: ±1 seed sd)"); ax.grid(alpha=.3)
    ax.margins(0.12)
    label_points(ax, shown[col], shown["CIDEr"], shown.index, fontsize=7)
axes[0][0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
fig.suptitle(f"Every model of the book on the same test images ({data['dataset']}, {profile} profile)", fontsize=10)
fig.tight_layout()
fig_path = save_figure(fig, run.path("fig_baselines_comparison.png"))
plt.close(fig)
display(IPImage(filename=str(fig_path)))

# %% [markdown]
# ## Did every row train to a flat curve?
#
# The protocol trains every row through the same budget with its rate annealed to zero and keeps the best validation
# evaluation, so no row stops early on a plateau its sibling seeds climb out of. What the budget must still show is that
# it is long enough: a row whose validation curve is still rising when the budget ends is cut short. For each row and
# seed, from its records: the evaluation whose weights were kept, and the gain of the last three epochs — the best
# validation CIDEr (averaged weights, beam 3, ×100) in them minus the best before them. *Still rising* marks a row
# most of whose seeds gained more than a flat tail's wobble (1 CIDEr) in their last three epochs
# (`capbook.profiles.curve_end`, the rule `02b_protocol` states and checks): its budget was too short, and it trains at
# the ladder's next budget, twice the epochs (`capbook.profiles.protocol_epochs`); the `epochs` column gives each row's.

# %%
curve_rows = []
for label, _family, k, st in MODELS:
    if st != "xe": continue
    runs = recs[k].get("seed_runs", [recs[k]])
    gains = [late_gain(r["history"]) for r in runs]
    curve_rows.append({"model": label, "seeds": len(runs), "epochs": epochs_trained(runs[0]["history"]),
                       "kept at epoch": ", ".join(f"{r['best_at']:g}" for r in runs),
                       "last-3-epoch gain": ", ".join("—" if g is None else f"{g:+.1f}" for g in gains),
                       "curve at the end": curve_end(gains)})
curves = pd.DataFrame(curve_rows)
display(Markdown(save_table(curves, run.path("table_baselines_curves"), floatfmt=".1f")))
rising = curves.loc[curves["curve at the end"] == "still rising", "model"].tolist()
display(Markdown(f"{(curves['curve at the end'] == 'flat or falling').sum()} of {len(curves)} rows end flat or falling; "
                 + (f"still rising in most seeds: {', '.join(rising)}." if rising else "none is still rising in most of its seeds.")))

# %% [markdown]
# ## Self-critical training, run as its authors run it
#
# A self-critical stage (Rennie et al. 2017) continues its row's cross-entropy run, as ruotianluo's
# `self-critical.pytorch` does (`06_baselines`): from the selected weights, with that run's Adam moments and weight
# average, its rate climbing back over one epoch to a constant 5·10⁻⁵. It trains for 2/3 of its row's cross-entropy
# epochs, three rungs up the ladder (160 after 30), and keeps its best evaluation, as every row of the book. It is validated and selected
# greedily, as it samples, and tested like every row (beam 3), with greedy decoding beside it. Two arms start from the
# same weights: the greedy caption's reward as the baseline (Rennie et al.: the "+ SCST" row) and the mean reward of the
# image's other samples (ruotianluo's "new self-critical": the "(mean baseline)" row).
#
# Each row is one seed's stage: the greedy validation CIDEr it started from and the best it reached (×100), the epochs
# it trained and what its last three gained (the best validation CIDEr in them minus the best before), the reward
# (CIDEr-D) of the training images' greedy captions at the first and last evaluation, its mean advantage (a sample's
# reward minus its baseline, over the stage's training batches: what sign its policy gradient mostly has), and the
# test CIDEr of its start and of the stage under beam 3 and greedily. The beam's lead over greedy decoding is the
# *decoding bonus*: how much of a row's CIDEr the decode, not the model, chose.

# %%
scst_rows, scst_curves = [], {}
for label, _family, k, st in MODELS:
    if st == "xe": continue
    for seed, r in enumerate(recs[k].get("seed_runs", [recs[k]])):
        stage, start = r["stages"][st], r["stages"]["xe"]
        h = stage["history"]; scst_curves.setdefault(label, []).append(h)
        val = [e["val CIDEr"] for e in h if "val CIDEr" in e]
        greedy = [e["greedy_reward"] for e in h if "greedy_reward" in e]
        at = [e.get("epochs", e["epoch"] + 1) for e in h if "val CIDEr" in e]
        best = int(np.argmax(val[1:])) + 1 if len(val) > 1 else 0
        scst_rows.append({"row": label, "seed": r.get("seed", seed), "val CIDEr, start (greedy)": 100 * val[0],
                          "best val CIDEr": 100 * max(val[1:], default=float("nan")), "kept at (epochs)": at[best] if best else float("nan"),
                          "last val CIDEr": 100 * val[-1], "epochs": epochs_trained(h),
                          "last-3-epoch gain": late_gain(h),
                          "greedy reward, first → last": f"{greedy[0]:.3f} → {greedy[-1]:.3f}" if greedy else "—",
                          "advantage, mean": np.mean([e["reward"] - e["baseline"] for e in h if "baseline" in e]),   # sample's reward − baseline, over the stage
                          "test CIDEr, start: beam 3 / greedy": f"{100 * start['metrics']['CIDEr']:.1f} / {100 * start['greedy']['CIDEr']:.1f}",
                          "test CIDEr, stage: beam 3 / greedy": f"{100 * stage['metrics']['CIDEr']:.1f} / {100 * stage['greedy']['CIDEr']:.1f}",
                          "stage min": (stage["train_s"] + stage.get("val_s", 0.0)) / 60})
scst = pd.DataFrame(scst_rows)
display(Markdown(save_table(scst, run.path("table_baselines_scst"), floatfmt=".1f")))
ends = scst.groupby("row", sort=False)["last-3-epoch gain"].apply(lambda g: curve_end(list(g)))
rising = [r for r, e in ends.items() if e == "still rising"]
display(Markdown("Still rising in most seeds when its budget ended: " + (", ".join(rising) if rising else "no stage") + "."))
# The ladder read again at each rung, off the stages' own curves: a stage's rate does not read its budget, so its first E
# epochs are the run a budget of E would have trained (`late_gain(..., upto=E)`), and the rule reads each rung as it would
# have ended there. The rungs were first climbed on stages trained before the sampler's log-probabilities were the policy's
# (`00g_decode`); this table is the rule on today's stages.
def _rung(hs, upto):
    g = [late_gain(h, upto=upto) for h in hs]
    return f"{curve_end(g)} ({', '.join('—' if x is None else f'{x:+.1f}' for x in g)})"
_top = max((epochs_trained(h) for hs in scst_curves.values() for h in hs), default=0)
_rungs = [_top / LADDER ** i for i in range(SCST_RUNGS, -1, -1) if _top / LADDER ** i >= 1]   # (a smoke stage's one epoch: one rung)
display(Markdown("The ladder's rule at each rung, read off the stages' curves (each seed's last-3-epoch gain at that budget):\n\n" +
                 save_table(pd.DataFrame([{"row": label, **{f"at {u:g} epochs": _rung(hs, u) for u in _rungs}}
                                          for label, hs in scst_curves.items()]), run.path("table_baselines_scst_rungs"))))
fell = scst[scst["last val CIDEr"] < 0.9 * scst["best val CIDEr"]]     # a stage that fell far from its best before its budget ended
display(Markdown(("Fell from its best before its budget ended (its last evaluation more than 10 % below its best; the row keeps "
                  "its best evaluation, the protocol's selection, so the fall costs the row nothing, but it says the stage is "
                  "unstable at this rate and length): " + "; ".join(f"{r['row']} seed {r['seed']}, {r['best val CIDEr']:.1f} at "
                  f"{r['kept at (epochs)']:g} epochs → {r['last val CIDEr']:.1f} at {r['epochs']:g}" for _, r in fell.iterrows()) + ".")
                 if len(fell) else "No stage fell more than 10 % below its best before its budget ended."))
arm = lambda r: "mean" if "(mean baseline)" in r else "greedy"
adv = scst.assign(arm=scst["row"].map(arm)).groupby("arm")["advantage, mean"]
display(Markdown(f"A greedy-baseline stage's samples score below its greedy captions on average (its mean advantage, reward − "
                 f"baseline, runs from {adv.min()['greedy']:+.3f} to {adv.max()['greedy']:+.3f} CIDEr-D over its stages), so most of "
                 "its gradient pushes down what it sampled; a mean-baseline stage's advantage is zero on average by construction "
                 f"({adv.min()['mean']:+.3f} to {adv.max()['mean']:+.3f}). Stages that fell: {(fell['row'].map(arm) == 'greedy').sum()} "
                 f"of {(scst['row'].map(arm) == 'greedy').sum()} greedy-baseline, {(fell['row'].map(arm) == 'mean').sum()} of "
                 f"{(scst['row'].map(arm) == 'mean').sum()} mean-baseline. The push moves no mass onto `<start>` or `<pad>`, which no "
                 "caption contains: the sampler's log-probabilities are normalised over the words it may draw (`00g_decode`)."))
bonus = lambda m: 100 * np.mean([r["stages"][m[1]]["metrics"]["CIDEr"] - r["stages"][m[1]]["greedy"]["CIDEr"]
                                 for r in recs[m[0]].get("seed_runs", [recs[m[0]]])])
stages_of = [(label, k, st) for label, _f, k, st in MODELS if st != "xe"]
display(Markdown("The decoding bonus (beam 3 over greedy, test CIDEr, mean over seeds): " + "; ".join(
    f"{START[label]} {bonus((k, 'xe')):+.1f} → {label} {bonus((k, st)):+.1f}" for label, k, st in stages_of if st == "scst") + "."))

# %% [markdown]
# ## What self-critical training does to the captions
#
# CIDEr-D rewards the n-grams the references share. On shapes the ground truth says what a caption gets right, so the
# book can show what the reward bought. For each stage and its start (beam 3, test split, mean over seeds): the
# semantic F1 and its four parts (`capbook.shapes.semantic_scores`), the share of captions of each kind
# (`capbook.shapes.caption_kinds`: counts, relations, both, neither), and the relation word most captions use with
# its share, and whether its relation statements are true more often than the same statements with the two objects
# swapped (`capbook.shapes.relation_truth`: a model that knows where the objects are says true ones more often; one that
# writes the relation word from the objects alone, both equally often). A stage that raises CIDEr by writing the
# references' most typical template, or one relation for every image, has bought its reward with the captions' form;
# one that raises the objects' and attributes' F1 has bought it with what they say. The table tells the two apart.
#
# *capbook:* how to read it. CIDEr-D rewards the n-grams an image's five references share: the colour, size and shape
# words of its objects recur across them, while their relation words vary from one reference to the next and only some
# count. A relation caption naming two objects with their colours and sizes earns those shared n-grams, and a count
# caption risks the n-grams around a wrong number: counting is the first thing to go. Which relation word the caption
# then uses is true no more often than any other when the model cannot see where the objects are (the last two
# columns: alike when it cannot), so the stage can settle on whichever one its samples made pay first and write it for
# every image; which one may differ between seeds.

# %%
from capbook.records import run_words, relation_spread
from capbook.shapes import caption_kinds, CATEGORIES, CAPTION_KINDS
def captions_of(rec, st):                                  # each seed's test captions of a stage (beam 3)
    return [run_words(r, stage_tag(r, st)) for r in rec.get("seed_runs", [rec])]
def spread_words(row, named=False):                        # how far each seed's most used relation word spreads over its captions
    span, none, S = relation_spread(row["top relation (seeds)"], row["% with it"])
    if none == S: return "no seed writes a relation"
    word = "the most used relation word" + (f" ({row['top relation (seeds)']})" if named else "")
    return f"{word} is in {span} of a seed's captions" + (f" ({none} of {S} seeds write none)" if none else "")
effect_rows = []
if has_sem:
    for label, k, st in stages_of:
        for name, which in ((START[label], "xe"), (label, st)):
            rel = relation_cells(recs[k], prep, which)
            runs = recs[k].get("seed_runs", [recs[k]])
            sem = [record_stage(r, which)["metrics"]["semantic"] for r in runs]
            kinds = [caption_kinds(w) for w in captions_of(recs[k], which)]
            top = pd.Series([kd["top relation"] for kd in kinds]).value_counts().index[0]
            effect_rows.append({"stage": label, "captions of": name, "F1 all": 100 * np.mean([x["all"]["f1"] for x in sem]),
                                **{f"F1 {c}": 100 * np.mean([x[c]["f1"] for x in sem]) for c in CATEGORIES},
                                **{f"% {kd}": 100 * np.mean([x[kd] for x in kinds]) for kd in CAPTION_KINDS},
                                "top relation (seeds)": ", ".join(kd["top relation"] for kd in kinds),
                                "% with it": ", ".join(f"{100 * kd['top relation share']:.0f}" for kd in kinds),
                                "% rel. true": rel["rel. true"], "% rel. swapped": rel["rel. swapped"]})
    effect = pd.DataFrame(effect_rows)
    display(Markdown(save_table(effect, run.path("table_baselines_scst_captions"), floatfmt=".1f")))
    E2 = effect.set_index(["stage", "captions of"])
    found = []
    for label, _k, _st in stages_of:
        a, b = E2.loc[(label, START[label])], E2.loc[(label, label)]
        found.append(f"{label}: semantic F1 {a['F1 all']:.1f} → {b['F1 all']:.1f} (relations {a['F1 relations']:.1f} → {b['F1 relations']:.1f}, "
                     f"counts {a['F1 counts']:.1f} → {b['F1 counts']:.1f}); captions with a relation {a['% relations'] + a['% counts and relations']:.0f} % → "
                     f"{b['% relations'] + b['% counts and relations']:.0f} %; {spread_words(b, named=True)}; "
                     f"relation statements true {a['% rel. true']:.1f} % → {b['% rel. true']:.1f} %, "
                     f"with the objects swapped {a['% rel. swapped']:.1f} % → {b['% rel. swapped']:.1f} %.")
    display(Markdown("\n".join(f"- {l}" for l in found)))
else:
    display(Markdown("No ground truth on this data set: what the captions state cannot be scored."))

# %% [markdown]
# ## What the runs say
#
# What the runs say, computed from the table above. Each comparison is a claim "the first scores a higher CIDEr" on
# the same test images (`capbook.claims.Claims`), each quoting the paper's words or table cells it tests: Student's *t*
# over the rows' training seeds and the test images, each variance component counted once; a self-critical stage
# against its own start is paired seed by seed, and a stage that kept its start in every seed is no test. *Holds* when the difference is above zero
# and its p, never below the sign tests' over the seeds, is under the bound of the sequential design's look (each
# verdict's bracket names the look, its seeds a side and the bound: `02b_protocol`), *does not hold* the same below
# zero, *cannot tell* otherwise, and below six seeds a side whatever the difference. The interval shown is the single
# test's 95 %: it may lie above zero while the look's stricter bound is not met. *One seed: no verdict* for rows trained once. Where a paper's table puts a model below another (SPCA's Table 4 has
# SCA-CNN below Soft-Attention*, GLIED's Table 2 its base below CT), the claim is stated in the paper's direction. The
# last line says how many verdicts the list states and which survive Holm's correction over the chapter's distinct tests.

# %%
judged = Claims()                                          # the chapter's claims: one family
ROW = {label: recs[k]["row"] for label, _family, k, _st in MODELS}   # each model's step: the rows a claim gives seeds to
def claim(label, a, b_, **kw):                             # "a scores a higher CIDEr than b", with the paper's words it tests
    return judged.text(label, stats[a], stats[b_], source=CLAIM_SOURCES[label], rows=(ROW[a], ROW[b_]), **kw)
def at_one_budget(label, a, b_):                           # a claim across rows: the shorter row's twin where the budgets differ
    ra, rb = same_budget(a, b_, E.get, TWINS)
    twin = f" ({ra if ra != a else rb}: both at {E[ra]:g} epochs)" if (ra, rb) != (a, b_) else ""
    return claim(label, ra, rb, epochs=(E[ra], E[rb])) + twin
best = T["CIDEr"].idxmax()
second = T["CIDEr"].drop(best).idxmax()
ahead = paired_verdict(stats[best], stats[second], also=(), paired=START.get(best) == second)
lines = [f"The best caption metrics: **{best}** ({T.loc[best, 'CIDEr']:.1f} CIDEr, {T.loc[best, 'BLEU-4']:.1f} BLEU-4); "
         f"ahead of the next, {second}, by {ahead.get('value', float('nan')):+.1f} CIDEr"
         + (f" (95% CI [{ahead['lo']:+.1f}, {ahead['hi']:+.1f}]; a ranking, not a claim of the papers, so not counted)" if "lo" in ahead else "") + "."]
if has_sem:
    sem = T["F1 all"].idxmax()
    lines.append(f"The most accurate statements: **{sem}** (semantic F1 {T.loc[sem, 'F1 all']:.1f}).")
    r = np.corrcoef(T["CIDEr"], T["F1 all"])[0, 1]
    lines.append(f"Across the {len(T)} rows, CIDEr and semantic F1 correlate at r = {r:.2f}.")
if "att. mass" in T and T["att. mass"].notna().any():
    look = T["att. mass"].idxmax()
    lines.append(f"The attention most on the named object: **{look}** ({T.loc[look, 'att. mass']:.1f} % of its mass, "
                 f"peak on the object {T.loc[look, 'att. hit']:.0f} % of the time).")
for a, b_ in (("Up-Down", "Soft-Attention"), ("Att2in", "Soft-Attention"), ("Soft-Attention", "SCA-CNN"),
              ("Soft-Attention", "LSTM, image every step"), ("GLIED", "Up-Down"), ("CT (6-block transformer decoder)", "GLIED base")):
    label = f"{a.removesuffix(' (6-block transformer decoder)')} above {b_}"
    lines.append(f"{label}: {at_one_budget(label, a, b_)}.")
def what_it_did(stage):                                    # a stage's captions against its start's, from the table above
    if not has_sem: return ""
    x, y = E2.loc[(stage, START[stage])], E2.loc[(stage, stage)]
    return (f"counts F1 {x['F1 counts']:.1f} → {y['F1 counts']:.1f}, relations F1 {x['F1 relations']:.1f} → {y['F1 relations']:.1f}; "
            + spread_words(y))
for a in ("Att2in", "Up-Down", "GLIED"):
    label, did = f"self-critical training raised {a}", what_it_did(a + " + SCST")
    lines.append(f"Self-critical training raised {a}'s CIDEr (its stage against its own start, seed by seed): "
                 f"{claim(label, a + ' + SCST', a, paired=True, best=stage_best(recs[next(k for l, _, k, _ in MODELS if l == a)]), caveat=did)}"
                 + (f"; what it did to the captions: {did}" if did else "") + ".")
    m = f"{a} + SCST (mean baseline)"                       # the other arm, seed by seed from the same starts: no claim of the papers
    arms = paired_verdict(stats[m], stats[a + " + SCST"], also=(), paired=True)
    lines.append(f"With the mean of the other samples as its baseline, {a}'s stage ended at {T.loc[m, 'CIDEr']:.1f} CIDEr against "
                 f"{T.loc[a + ' + SCST', 'CIDEr']:.1f} with the greedy caption's"
                 + (f" (paired by seed: {arms['value']:+.1f}, 95% CI [{arms['lo']:+.1f}, {arms['hi']:+.1f}]; the two arms are not a claim of "
                    f"the papers, so not counted in the family)" if "lo" in arms else "") + ".")
display(Markdown("\n".join(f"- {l}" for l in lines) + "\n\n" + judged.note()))
_ = save_table(judged.table(), run.path("table_baselines_verdicts"), floatfmt=".3g")      # the verdicts, for the README's summary

# %% [markdown]
# ## Every verdict of the book, one family
#
# Each paper chapter judges its claims as one family: Holm's correction over the chapter's distinct tests (the same
# comparison named twice, or a "+ SCST" claim whose stages kept their start, counts once), each claim quoting the
# paper's words or table cells it tests. A reader who takes the book's verdicts together, as the README lists them,
# should hold them to the stricter family of all of them: below, every distinct test of the paper chapters and of this
# one, Holm's correction over all of them beside its chapter's. A test two chapters share (GLIED above Up-Down is in
# GLIED's chapter and in this one) is one row.

# %%
from capbook.records import chapter_verdicts
tables = {**chapter_verdicts(profile), "06a_baselines_tables": judged.table()}     # every paper chapter's verdicts, and this one's
family = book_family(tables)
display(Markdown(save_table(family, run.path("table_baselines_book_family"), floatfmt=".3g")
                 + f"\n\n{len(family)} distinct tests; {(family['Holm in its chapter'] == 'survives').sum()} survive Holm's "
                 f"correction in their chapter, {(family['Holm over the book'] == 'survives').sum()} over the whole book."))

# %% [markdown]
# ## The rule's error rate at each of the book's comparisons
#
# The test's size — how often it says "holds" or "does not hold" when the two models are equal — depends on each
# comparison's own configuration: its seed counts, the two rows' seed spreads, its model × image spread and per-image
# noise, paired or not, on its metric (CIDEr, BLEU-4 or semantic F1, each in its own units). `02b_protocol` measures it
# over a grid; here every distinct test of the book is simulated at its own configuration, as the verdict tables record
# it (`capbook.claims.configuration_size`, 10,000 trials each at the default profile, no true difference), and so is
# every part of a claim judged from several tests (GLIED's Table 4 rows, SPCA's localisation: `Claims.parts_table`), whose
# error rate bounds the claim's (every part must hold); a part measured once per seed, with no per-image part (attention
# correctness), is simulated by running its own test (`seed_means_size`). Each is simulated with normal
# and with two-point seed effects (each seed ± its sd: a seed that lands in one of two modes). Beside the false-verdict
# rate at 5 % stands the share of p below Holm's smallest threshold in the test's chapter (0.05 over its distinct tests)
# and over the book, as a multiple of the nominal rate; the promise is at most 5 % and at most 1.5 times.

# %%
from capbook.claims import configuration_size, seed_means_size
trials = 500 if profile == "smoke" else 10_000
size_rows = []
floats = lambda col: [float(x) for x in str(col).split(", ")]
parts = chapter_verdicts(profile, kind="parts")             # the parts of the compound claims (Table 4's, SPCA's localisation)
for ch, df in tables.items():
    tested = df[df["p"].notna() & df["seeds"].notna()] if "seeds" in df else df.iloc[:0]
    m_ch = max(1, df.loc[df["p"].notna(), "test"].nunique())
    if ch in parts: tested = pd.concat([tested, parts[ch][parts[ch]["p"].notna() & parts[ch]["seeds"].notna()]], ignore_index=True)
    for _, r in tested.iterrows():
        if r["test"] == r["test"] and r["test"] and r["test"] in {x["test"] for x in size_rows}: continue   # a test two claims share: once
        S, sd = tuple(int(x) for x in str(r["seeds"]).split(" vs ")), floats(r["seed sd"])
        image_sd = 0.0 if pd.isna(r["image sd"]) else float(r["image sd"])
        row = {"test": r["test"], "chapter": ch, "claim": r["claim"], "design": r["design"], "seeds": r["seeds"], "seed sd": r["seed sd"],
               "image sd": image_sd}
        for eff in ("normal", "two-point"):
            tails = (0.05 / m_ch, 0.05 / len(family))
            if pd.isna(r.get("noise sd")) or pd.isna(r.get("images")):   # one number per seed (attention correctness): its own test
                sim = seed_means_size(S, tuple(sd), eff, trials=trials, tails=tails)
            else:
                sim = configuration_size(S, tuple(sd), image_sd, tuple(floats(r["noise sd"])), int(r["images"]), eff, trials=trials, tails=tails)
            below = list(sim["p below"].values())
            row |= {f"{eff}: false verdicts (%)": 100 * sim["false verdicts"],
                    f"{eff}: chapter's Holm tail (× nominal)": below[0] / (0.05 / m_ch),
                    f"{eff}: book's Holm tail (× nominal)": below[1] / (0.05 / len(family))}
        size_rows.append(row)
size = pd.DataFrame(size_rows)
if len(size):
    size = size.drop(columns="test")
    rates = [c for c in size if c.endswith("false verdicts (%)")]
    tails_ = [c for c in size if c.endswith("(× nominal)")]
    display(Markdown(save_table(size, run.path("table_baselines_rule_size"), floatfmt=".2f")
                     + f"\n\n{len(size)} distinct tests, {trials:,} trials each and seed-effect shape: false verdicts at most "
                     f"{size[rates].max().max():.2f} %, Holm's tails at most {size[tails_].max().max():.2f} times their nominal rate."))
else:
    display(Markdown("No comparison of this book states a verdict over seeds (every row has one seed): there is no size to simulate."))
