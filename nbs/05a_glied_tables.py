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
# # GLIED: Tables 1, 2 and 4 and Figure 3
#
# > Liu et al.'s results, assembled from the runs of the previous chapter and from Show-Attend-Tell's LSTMs trained on the same features and data: cross-entropy against self-critical training (Table 1), size and speed (Table 2), the incremental study with the sub-category scores (Table 4), what the grid cells' positions do, and what each distilling step attends to (Figure 3).
#
# The book runs `05_glied` on the same data and features as `02_show_attend_tell`, every row over the profile's
# seeds: GLIED and the base model, each trained with cross-entropy and then self-critically; the four steps between
# them under cross-entropy only; and GLIED with the grid cells' positions in its Eq. 7 (two ablations). At the
# default profile every row trains 30 epochs, as long as the baselines it is compared with (`05_glied` says why). This
# notebook trains nothing: it reads the runs' results records (`capbook.records.step_record`) and what they saved.
#
# **What the paper gives to compare with.** Table 2 is in the paper's text and is quoted in full. Tables 1 and 4 are
# images in the paper: their numbers are not in its text, and capbook quotes no number it cannot read.
# So Table 1 quotes the one number the text states (the abstract's CIDEr 129.3 for GLIED), and Table 4 is checked
# against the paper's **claims** about each row, which the text states in words (`capbook.papers`).

# %%
#| hide
from pathlib import Path
import numpy as np, pandas as pd
import matplotlib.pyplot as plt
from IPython.display import Image as IPImage, Markdown, display
from capbook.runner import start_run
from capbook.profiles import read_params, epochs_trained, row_budget, row_epochs
from capbook.records import record_stage, stage_stats, seed_cells, stage_best
from capbook.claims import interval_cells, Claims, at_look, paired_verdict, same_budget, test_id
from capbook.papers import CLAIM_SOURCES
from capbook.records import compared_runs, run_file
from capbook.prepare import prepare
from capbook.metrics import results_row
from capbook.papers import glied_table2, GLIED_ABSTRACT_CIDER, GLIED_TABLE1_NOT_RUN, GLIED_TABLE4_CLAIMS
from capbook.viz import save_figure, save_table, show_table
from capbook.glied import distilling_figure

# %% tags=["parameters"]
profile = "default"     # smoke | default | paper: the profile whose runs are assembled
run_dir = None          # set by `capbook book`; None: runs/<profile>/adhoc/...

# %%
#| bookkeeping
run = start_run("05a_glied_tables", read_params(["profile", "run_dir"], globals()))
steps, recs = compared_runs(profile, {"glied": ("05_glied", None), "sat": ("02_show_attend_tell", ("", "none")),
                                      "base": ("06_baselines", None)})
p0 = recs["glied", ""]["params"]
prep = prepare(p0["dataset"], profile, seed=p0.get("data_seed", 0), data_path=p0["data_path"], encoder=p0["encoder"])
pd.DataFrame([{"run": s.name, "model": recs[k]["model"], "variant": recs[k].get("figure3", {}).get("variant", ""),
               "record": Path(recs[k]["_dir"]).name, "data": recs[k]["data"]["fingerprint"]} for k, s in steps.items()])

# %% [markdown]
# Every run this page reads (listed in its last section) was trained on the same data (the cell stops if a fingerprint differs), so the rows compare models.
#
# ## The attributes
#
# The multiple-instance-learning detector (`capbook.attributes`) that every GLIED run reads, on held-out images: mean
# average precision over the attribute words, and precision and recall of the attributes kept per image against the
# words of the image's captions.

# %%
at = recs["glied", ""]["attributes"]
display(Markdown(f"{len(at['words'])} attribute words: {', '.join(at['words'])}."))
attr_tab = pd.DataFrame({s: at["scores"][s] for s in ("val", "test")}).T.rename_axis("split").reset_index()
display(Markdown(save_table(attr_tab, run.path("table_glied_attributes"), floatfmt=".3f")))

# %% [markdown]
# ## Table 1: cross-entropy and self-critical training
#
# The base model and GLIED, each under cross-entropy and after self-critical training on CIDEr-D, beside the paper's
# one stated number and the two baselines of its Table 1 that capbook implements, trained the same way in the baselines
# chapter (`06_baselines`): SCST (Rennie et al.'s Att2in, self-critically trained) and Up-Down (Anderson et al.). RFNet
# (an ensemble of several CNNs' features) and GCN-LSTM (scene graphs from a separately trained relation detector) need
# inputs the book does not have, and stay out of the table. BLEU-1, BLEU-4, METEOR, ROUGE-L and CIDEr ×100 as in the paper; SPICE needs Stanford CoreNLP's
# jars, which the book does not download (the `note` says so when they are missing); capbook adds the shapes semantic F1s.

# %%
ds_name = f"{prep.dataset.split('-')[0]} (capbook, {profile} profile)"
T1 = ["BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "SPICE"]
STAGES = {"xe": "cross-entropy", "scst": "+ self-critical (CIDEr-D)", "scst-mean": "+ self-critical (CIDEr-D, mean baseline)"}
ST = {(k, st): stage_stats(recs[k], prep, st) for k in [("glied", ""), ("glied", "base"), ("base", ""), ("base", "att2in")]
      for st in STAGES}                          # per-image statistics of each stage's test captions, for the intervals
def stage_row(model, k, stage):
    rec = recs[k]
    m = rec["stages"][stage]["metrics"]
    return {"dataset": ds_name, "model": model, "training": STAGES[stage],
            "source": "capbook (measured)", **results_row(m), **({"SPICE": 100 * m["SPICE"]} if "SPICE" in m else {}),
            **interval_cells(ST[k, stage]), **seed_cells(rec, stage),
            "train min": rec["stages"][stage]["train_s"] / 60, "note": spice_note(rec)}
def spice_note(rec):                                      # the record's note names this machine's folders: the table does not
    note = rec.get("notes", {}).get("SPICE", "")
    return "SPICE not computed: it needs Stanford CoreNLP's jars, which the book's set-up does not install" if note else ""
ours = [stage_row(name, k, st) for st in STAGES
        for name, k in (("SCST (Att2in)", ("base", "att2in")), ("Up-Down", ("base", "")),
                        ("Base", ("glied", "base")), ("GLIED", ("glied", "")))]
quoted = [{"dataset": "COCO (Karpathy test)", "model": "GLIED", "training": "+ reinforcement learning", "source": "paper (quoted)",
           "CIDEr": GLIED_ABSTRACT_CIDER, "note": "the abstract's number; the paper's Table 1 is an image in its text, so its other cells are not quoted"}]
quoted += [{"dataset": "COCO (Karpathy test)", "model": m, "training": "cross-entropy; + reinforcement learning",
            "source": "paper (quoted)", "note": why} for m, why in GLIED_TABLE1_NOT_RUN.items()]
table1 = pd.DataFrame(quoted + ours)
cols = ["dataset", "model", "training", "source"] + [c for c in T1 if c in table1]
table1 = table1[cols + [c for c in table1.columns if c not in cols + ["note"]] + ["note"]]
display(Markdown(show_table(table1, run.path("table_glied_table1"), floatfmt=".2f")))

# %%
g, b = ("glied", ""), ("glied", "base")
judged = Claims()                                          # the chapter's claims, one family (Holm after Table 4's, below)
NAMES = {g: "GLIED", b: "GLIED base", ("base", ""): "Up-Down", ("base", "att2in"): "Att2in"}
name = lambda k: NAMES[k[0]] + (" + SCST" if k[1] == "scst" else "")
E = lambda k: row_epochs(recs[k])                         # a row's cross-entropy budget
def v(a, b_):                                              # the claim "a scores a higher CIDEr than b", with the paper's words
    label = f"{name(a)} above {name(b_)}"
    ra, rb = same_budget(a[0], b_[0], E, {})               # one budget: the chapter's rows train as long as the baselines
    budgets = (row_budget(recs[ra], a[1]), row_budget(recs[rb], b_[1]))   # a stage's claim: its cross-entropy and self-critical epochs both
    return judged.text(label, ST[ra, a[1]], ST[rb, b_[1]], epochs=budgets, source=CLAIM_SOURCES[label], rows=(recs[ra]["row"], recs[rb]["row"]))
def raised(k):                                             # a self-critical stage against its own start, seed by seed
    label = f"self-critical training raised {NAMES[k]}"
    return judged.text(label, ST[k, "scst"], ST[k, "xe"], paired=True, best=stage_best(recs[k]), source=CLAIM_SOURCES[label], rows=(recs[k]["row"],))
display(Markdown(
    "On this run of the book (each claim on the same test images, Student's t over the rows' seeds and the images, "
    "a stage against its own start paired seed by seed; one seed: no verdict):\n\n"
    f"- GLIED above the base under cross-entropy: {v((g, 'xe'), (b, 'xe'))}; after self-critical training: "
    f"{v((g, 'scst'), (b, 'scst'))} (the paper: GLIED above the base in both).\n"
    f"- Self-critical training raises CIDEr: for the base {raised(b)}; for GLIED {raised(g)}.\n"
    f"- GLIED above Up-Down (the paper: above all its baselines): under cross-entropy {v((g, 'xe'), (('base', ''), 'xe'))}; "
    f"after self-critical training {v((g, 'scst'), (('base', ''), 'scst'))}.\n"
    f"- GLIED above SCST (Att2in): under cross-entropy {v((g, 'xe'), (('base', 'att2in'), 'xe'))}; after self-critical "
    f"training {v((g, 'scst'), (('base', 'att2in'), 'scst'))}.\n\n"
    "A \"+ SCST\" row is the self-critical stage's own model (greedy baseline), selected on greedy validation CIDEr as it "
    "trains; the mean-baseline arm is in Table 1 beside it. Holm's correction over the chapter's claims is given after Table 4."))

# %% [markdown]
# What self-critical training does to what the captions *say*: the semantic F1s before and after it (each arm; the
# seeds' mean), and the first captions GLIED writes after it. CIDEr-D rewards n-grams that are frequent in an image's
# references and rare elsewhere; nothing in it asks a caption to commit to a relation or a number. The all-models
# chapter (`06a_baselines_tables`) shows, for every self-critical row, the kinds of caption each stage writes and how
# many of them use one relation word.

# %%
seeds_of = lambda k: recs[k].get("seed_runs", [recs[k]])
sem_rows = [{"model": name, "stage": st, **{f"{c} F1": 100 * np.mean([r["stages"][st]["metrics"]["semantic"][c]["f1"] for r in seeds_of(k)])
                                            for c in ("objects", "attributes", "counts", "relations", "all")}}
            for name, k in (("Base", b), ("GLIED", g)) for st in STAGES
            if "semantic" in recs[k]["stages"][st]["metrics"]]
if sem_rows:
    display(Markdown(save_table(pd.DataFrame(sem_rows), run.path("table_glied_scst_semantic"), floatfmt=".1f")))
    S = pd.DataFrame(sem_rows).set_index(["model", "stage"])
    display(Markdown(
        f"Self-critical training moved GLIED's relation F1 from {S.loc[('GLIED', 'xe'), 'relations F1']:.1f} to "
        f"{S.loc[('GLIED', 'scst'), 'relations F1']:.1f} and its count F1 from {S.loc[('GLIED', 'xe'), 'counts F1']:.1f} to "
        f"{S.loc[('GLIED', 'scst'), 'counts F1']:.1f} (the base: relations {S.loc[('Base', 'xe'), 'relations F1']:.1f} → "
        f"{S.loc[('Base', 'scst'), 'relations F1']:.1f}, counts {S.loc[('Base', 'xe'), 'counts F1']:.1f} → "
        f"{S.loc[('Base', 'scst'), 'counts F1']:.1f}). GLIED's first test captions after it: "
        + "; ".join(f"*{x['caption']}*" for x in recs[g]["samples"][:3]) + "."))

# %% [markdown]
# ### The switch to self-critical training, epoch by epoch
#
# The curves that show whether SCST works (the most common complaints about it elsewhere are rewards that go negative
# and a CIDEr that drops after the switch): at each evaluation of the greedy-baseline arm (its first seed), the mean
# CIDEr-D reward of the samples, the baseline's, the greedy caption's (on training images), and the validation CIDEr
# (greedy, as the stage is selected), which starts from the cross-entropy model's.

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
rows = []
for (name, k), ax in zip((("Base", b), ("GLIED", g)), axes):
    h = pd.DataFrame(recs[k]["stages"]["scst"]["history"])
    start, h = h[h["epoch"] < 0], h[h["epoch"] >= 0]           # epoch -1: the cross-entropy model, validated first
    xe = float(start["val CIDEr"].iloc[0]) if len(start) else max(e["val CIDEr"] for e in recs[k]["history"])
    ep = np.arange(len(h) + 1)
    ax.plot(ep, [xe] + list(h["val CIDEr"]), "o-", label="validation CIDEr")
    ax.plot(ep[1:], h["greedy_reward"], "s--", label="greedy reward (train)")
    ax.plot(ep[1:], h["reward"], "^:", label="sample reward (train)")
    ax.plot(ep[1:], h["baseline"], "v:", label="baseline (train)")
    ax.set_title(name, fontsize=10); ax.set_xlabel("self-critical evaluation (0: cross-entropy model)"); ax.grid(alpha=.3)
    rows += [{"model": name, "epochs": e["epochs"], **{c: e[c] for c in ("reward", "baseline", "greedy_reward", "val CIDEr")}}
             for _, e in h.iterrows()]
axes[0].legend(fontsize=8)
fig.tight_layout(); save_figure(fig, run.path("fig_glied_scst.png")); plt.close(fig)
display(IPImage(filename=str(run.path("fig_glied_scst.png"))))
display(Markdown(save_table(pd.DataFrame(rows), run.path("table_glied_scst"), floatfmt=".3f")))


# %% [markdown]
# ## Table 2: parameters, training time, inference speed
#
# The paper's Table 2 (quoted; a GTX 1080 Ti, COCO) beside capbook's models on the book's CPU and data, every row
# measured: the LSTM with the mean image feature at every step, Up-Down and CT (the baselines chapter), soft attention
# (Show-Attend-Tell's run), the base model and GLIED (cross-entropy stage). Training minutes are the cross-entropy
# training time over the run's epochs (`epochs` says how many: each chapter has its own budget), inference is the test
# split's beam-3 decode in images per second, CIDEr is on the test split.

# %%
def t2_row(name, k):                                    # the cross-entropy stage of every row, as the paper's Table 2
    rec = recs[k]
    s = record_stage(rec, "xe")
    return {"model": name, "source": "capbook (measured)", "#Parameters (M)": rec["n_params"] / 1e6,
            "Train time (min)": s["train_s"] / 60, "Inference (ips)": s["images_per_s"], "CIDEr": 100 * s["metrics"]["CIDEr"],
            "epochs": epochs_trained(rec["history"]),
            "device": f"{rec['machine']['device']} ({rec['machine']['threads']} threads)"}
ours2 = [t2_row("LSTM", ("base", "lstm")), t2_row("SoftAtt", ("sat", "")), t2_row("Up-Down", ("base", "")),
         t2_row("CT", ("base", "ct")), t2_row("Base", b), t2_row("GLIED", g)]
table2 = pd.concat([glied_table2(), pd.DataFrame(ours2)], ignore_index=True)
display(Markdown(save_table(table2, run.path("table_glied_table2"), floatfmt=".2f")))
T2 = pd.DataFrame(ours2).set_index("model")
display(Markdown(
    f"GLIED has {T2.loc['GLIED', '#Parameters (M)'] / T2.loc['Base', '#Parameters (M)']:.2f}× the base's parameters "
    f"(paper: {18.3 / 12.3:.2f}×) and decodes at {T2.loc['GLIED', 'Inference (ips)'] / T2.loc['Base', 'Inference (ips)']:.2f}× its "
    f"speed (paper: {34.5 / 37.9:.2f}×); the base decodes {T2.loc['Base', 'Inference (ips)'] / T2.loc['SoftAtt', 'Inference (ips)']:.2f}× "
    f"as fast as soft attention (paper: {37.9 / 23.3:.2f}×). Against the baselines: Up-Down has "
    f"{T2.loc['Up-Down', '#Parameters (M)'] / T2.loc['Base', '#Parameters (M)']:.2f}× the base's parameters (paper: {50.1 / 12.3:.2f}×) "
    f"and decodes at {T2.loc['Base', 'Inference (ips)'] / T2.loc['Up-Down', 'Inference (ips)']:.2f}× its speed "
    f"(paper: the base {37.9 / 14.8:.2f}× as fast); CT scores {T2.loc['CT', 'CIDEr'] - T2.loc['Base', 'CIDEr']:+.1f} CIDEr "
    f"against the base (paper: {115.1 - 113.5:+.1f}) and Up-Down {T2.loc['Up-Down', 'CIDEr'] - T2.loc['Base', 'CIDEr']:+.1f} "
    f"(paper: {113.2 - 113.5:+.1f})."))

# %% [markdown]
# ## Table 4: the incremental study, with the sub-category scores
#
# The paper's Table 4 adds each component to the base model under cross-entropy and lists SPICE's sub-categories. On
# shapes, capbook's exact semantic scores stand where SPICE's sub-categories stand (**named as such**: they are not
# SPICE): precision, recall and F1 of the objects, attributes, counts and relations the caption states, against the
# image's ground truth (precision) and the references (recall) — see `capbook.shapes.semantic_scores`.

# %%
order = [("Base", "base"), ("+ global visual", "global-visual"), ("+ global attribute", "global-attribute"),
         ("+ global", "global"), ("+ local", "local"), ("GLIED", "")]
ABLATIONS = [(recs["glied", f"position-{w}"]["figure3"]["variant"], f"position-{w}") for w in ("values", "qk")]   # the cells' positions: no row of the paper
CATS = ["objects", "attributes", "counts", "relations"]
def t4_row(name, tag):
    rec = recs["glied", tag]
    m = record_stage(rec)["metrics"]
    row = {"model": name, **{c: v for c, v in results_row(m).items() if c in ("BLEU-4", "METEOR", "ROUGE-L", "CIDEr")}}
    for c in CATS + ["all"]:
        s = m.get("semantic", {}).get(c)
        if s: row |= {f"{c} P": 100 * s["p"], f"{c} R": 100 * s["r"], f"{c} F1": 100 * s["f1"]}
    return row
table4 = pd.DataFrame([t4_row(*o) for o in order + ABLATIONS])
display(Markdown(show_table(table4, run.path("table_glied_table4"), floatfmt=".1f")))

# %% [markdown]
# The paper's claims about each row, each tested against the base on the same test images (`capbook.claims.Claims`:
# Student's t over the rows' seeds and the test images; the Δ columns are the changes in the seed means):

# %%
T4 = table4.set_index("model")
def delta(row, col): return T4.loc[row, col] - T4.loc["Base", col] if col in T4 else np.nan
NEEDS = {"+ global visual": ("CIDEr", "relations F1", "counts F1"), "+ global attribute": ("attributes F1", "relations F1", "counts F1"),
         "+ global": ("CIDEr",), "+ local": ("CIDEr",), "GLIED": ("CIDEr", "relations F1", "counts F1")}
T4_STATS = {name: stage_stats(recs["glied", tag], prep, "xe") for name, tag in order + ABLATIONS}   # Table 4 is under cross-entropy
T4_ROWS = {name: recs["glied", tag]["row"] for name, tag in order + ABLATIONS}
def verdict(row):
    d = {c: delta(row, c) for c in ("CIDEr", "objects F1", "attributes F1", "counts F1", "relations F1")}
    never = [c for c in NEEDS[row] if c.endswith("F1") and c in T4 and (T4[c] == 0).all()]
    A, B, look = at_look(T4_STATS[row], T4_STATS["Base"])   # the sequential design's look: as many seeds a side as it has reached
    tests = {c: {**paired_verdict(A, B, c, also=()), "look": look} for c in NEEDS[row]}   # the row's claim: judged once, below
    for t, c in zip(tests.values(), tests): t["test"], t["rows"] = test_id(A, B, c), (T4_ROWS[row], T4_ROWS["Base"])
    says = None
    if any(np.isnan(d[c]) for c in NEEDS[row]): says = "cannot tell (no sub-category scores on this data)"
    elif never: says = f"cannot tell (no model states {', '.join(c.split()[0] for c in never)})"
    elif row == "+ local":                        # "almost the same, if not worse": refuted only by a reliably higher CIDEr
        c = tests["CIDEr"]["verdict"]
        says = "does not hold" if c == "holds" else "holds" if c == "does not hold" else c
    r = judged.add(row, tests, all_parts=True, source=CLAIM_SOURCES[row], section="Table 4", verdict=says)
    if r["verdict"].startswith("cannot tell ("): r["p"] = None     # no test on this data: no entry in the family
    return {"row": row, "the paper says": GLIED_TABLE4_CLAIMS[row], **{f"Δ {c}": v for c, v in d.items()},
            "tests": "; ".join(f"{c}: {t['text']}" for c, t in tests.items()), "on this run": r["verdict"]}
claims = pd.DataFrame([verdict(r) for r, _ in order[1:]])
claims["Holm"] = [judged.holm_cell(r) for r in claims["row"]]
display(Markdown(save_table(claims, run.path("table_glied_claims"), floatfmt=".1f") + "\n\n" + judged.note("Table 4")))
display(Markdown("The chapter's other claims, above: " + judged.note("")))
def with_positions(name):                                  # an ablation against GLIED as Eq. 7 writes it: measured, not a claim
    out = []
    for c in ("CIDEr", "relations F1"):
        if c not in T4: continue
        r = paired_verdict(T4_STATS[name], T4_STATS["GLIED"], c, also=())
        out.append(f"{c} {T4.loc[name, c]:.1f} against {T4.loc['GLIED', c]:.1f}, higher with them: {r['text']}")
    return "; ".join(out)
display(Markdown(
    "**What the cells' positions do on this data** (the book's question, not a claim of the paper, so not in the family; "
    "each ablation against GLIED as Eq. 7 writes it, t over seeds and test images). The position added to everything "
    f"Eq. 7 reads: {with_positions(ABLATIONS[0][0])}. On its queries and keys alone: {with_positions(ABLATIONS[1][0])}."))
_ = save_table(judged.table(""), run.path("table_glied_verdicts"), floatfmt=".3g")                  # the verdicts, for the README's summary
_ = save_table(judged.table("Table 4"), run.path("table_glied_table4_verdicts"), floatfmt=".3g")
_ = save_table(judged.parts_table("Table 4"), run.path("table_glied_table4_parts"), floatfmt=".3g")   # each claim's parts: the size table simulates them

# %% [markdown]
# *capbook:* how a claim is read as a test. "Overall improvement" is a higher CIDEr; "higher Relations and Count" a
# higher F1 in both; "almost all sub-categories except for Object" higher attribute, relation and count F1s (the
# sentence names no CIDEr, so none is tested); GLIED's "especially Relations and Count" a higher CIDEr and higher
# relation and count F1s — each *holds* only when every named score is reliably higher (the book's rule, `02b_protocol`: its p
# under the bound of the sequential design's look; the claim's p is then the largest of the tests', the intersection-union test), *does not hold* when one is reliably
# lower (its p then Bonferroni's over the parts, k times the smallest), and otherwise *cannot tell*. "Almost the same, if not worse" does not hold when the CIDEr is reliably higher, holds when it is reliably lower,
# and otherwise cannot be told (that two numbers are "almost the same" would need an equivalence margin, which the
# paper does not give). A sub-category whose F1 is 0 for every row (the model never states it) cannot carry the claim
# either way. A row of one seed states no verdict.
#
# ## Figure 3: what each distilling step attends to
#
# GLIED's run saved, for the first test image whose caption names two of its objects, every attention's weights on
# its generated caption (`capbook.glied.distilling_weights`). At the step shown (input an adjective, output a noun, as
# the paper's "inputs small, outputs dog"): the region local distilling attends to most and the top-3 regions of its
# group in global visual distilling, drawn on the image; the top-3 attributes of global attribute distilling and of
# local distilling, listed with their weights.

# %%
dd = run_file(recs["glied", ""], "distilling.pt", "Figure 3 data")
if "feat_mask" in prep.test.inputs:
    display(Markdown("The runs read bottom-up regions, whose boxes capbook does not keep: Figure 3 is drawn on grid features only."))
else:
    fig3 = distilling_figure(prep.image_paths("test")[dd["index"]], dd["words"], dd["attr_words"], dd["weights"], dd["step"],
                             tuple(dd["grid"]), run.path("fig_glied_figure3.png"))
    display(IPImage(filename=str(fig3)))
