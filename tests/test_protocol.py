"The training protocol's parts in the one trainer: evaluations within an epoch, the plateau schedule, weight averaging, and exact resume with all three."
from types import SimpleNamespace
import numpy as np
import pytest
import torch
from capbook import train as T
from capbook.core import load_torch
from capbook.data import CaptionData, Vocab
from capbook.models import build
from capbook.train import TrainConfig, WeightAverage, fit

CAPS = [["a", "red", "circle"], ["two", "blue", "stars"]]
VOCAB = Vocab.build(CAPS, min_count=1)


def split(n, seed):
    y = np.random.default_rng(seed).integers(0, 2, n)
    f = np.random.default_rng(seed + 1).standard_normal((n, 4, 8)).astype(np.float16); f[:, :, 0] = 4 * y[:, None] - 2
    return CaptionData(f, [f"{i}.png" for i in range(n)], [[CAPS[k]] for k in y], VOCAB, max_len=5)


PREP = SimpleNamespace(train=split(32, 0), val=split(8, 10), vocab=VOCAB, feat_shape=(4, 8), grid=(2, 2))


def model():
    torch.manual_seed(0)
    return build("sat_soft", len(VOCAB), 8, (2, 2), emb_dim=16, hidden_dim=32, att_dim=16)


def cfg(**kw):
    return TrainConfig(**{"epochs": 3, "batch_size": 8, "lr": 1e-2, "val_beam": 1, "metric": "CIDEr", "device": "cpu",
                          "progress": False, "precision": "fp32", **kw})


def scripted(monkeypatch, scores):
    "Validation returns these CIDEr values in turn (the trainer's decisions, not the model, under test)."
    it = iter(scores)
    monkeypatch.setattr(T, "val_score", lambda *a, **k: {"BLEU-1": 0.0, "BLEU-2": 0.0, "BLEU-3": 0.0, "BLEU-4": 0.0, "CIDEr": next(it)})


def test_evaluations_are_spread_over_each_epoch(tmp_path):
    r = fit(model(), PREP, cfg(evals_per_epoch=2), tmp_path / "ckpt", log=lambda s: None)
    assert [h["epochs"] for h in r.history] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]     # 4 batches an epoch: after 2 and 4
    assert [h["epoch"] for h in r.history] == [0, 0, 1, 1, 2, 2]
    assert [h["step"] for h in r.history] == [2, 4, 6, 8, 10, 12]
    best = max(r.history, key=lambda h: h["val CIDEr"])
    assert (r.best_at, r.best_epoch, r.best_score) == (best["epochs"], best["epoch"], best["val CIDEr"])
    assert r.captions == 3 * 32
    assert "val changed" not in r.history[0] and all(0 <= h["val openings changed"] <= h["val changed"] <= 1 for h in r.history[1:])


def test_plateau_decays_after_lr_patience_and_stops_after_patience(monkeypatch, tmp_path):
    scripted(monkeypatch, [0.5, 0.6, 0.6, 0.55, 0.7, 0.1, 0.2, 0.3, 0.4, 0.9])
    lines = []
    r = fit(model(), PREP, cfg(epochs=10, schedule="plateau", lr_gamma=0.5, lr_patience=2, patience=4, evals_per_epoch=1),
            tmp_path / "ckpt", log=lines.append)
    # evaluations: 0.5 0.6 | 0.6 0.55 (2 without: decay) | 0.7 (better) | 0.1 0.2 (decay) 0.3 0.4 (4 without: stop)
    assert [round(h["lr"] / 1e-2, 4) for h in r.history] == [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert len(r.history) == 9 and r.best_score == 0.7 and r.best_epoch == 4
    assert sum("learning rate x0.5" in s for s in lines) == 2 and "early stop" in lines[-1]


def test_weight_average_is_what_is_validated_and_kept(monkeypatch, tmp_path):
    m = model()
    seen = []
    real = T.val_score
    def spy(model, *a, **k):
        seen.append([p.detach().clone() for p in model.parameters()])
        return real(model, *a, **k)
    monkeypatch.setattr(T, "val_score", spy)
    r = fit(m, PREP, cfg(epochs=2, ema=0.9), tmp_path / "ckpt", log=lambda s: None)
    last = load_torch(tmp_path / "ckpt" / "last.pt")
    live = list(last["model"].values())
    avg = last["ema"]["avg"]
    assert all(torch.equal(a, b) for a, b in zip(seen[-1], [a for a in avg]))            # validated: the average
    assert not all(torch.equal(a, b) for a, b in zip(live, avg))                         # ... not the live weights
    best = load_torch(tmp_path / "ckpt" / "best.pt")["model"]
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), best.values()))
    kept = seen[[h["epochs"] for h in r.history].index(r.best_at)]
    assert all(torch.equal(a, b) for a, b in zip(kept, best.values()))


def test_weight_average_formula():
    lin = torch.nn.Linear(3, 1, bias=False); avg = WeightAverage(lin, 0.5)
    w = [lin.weight.detach().clone()]
    for t in range(1, 6):
        with torch.no_grad(): lin.weight.add_(t)
        avg.update(); d = min(0.5, (1 + t) / (10 + t))
        w.append(d * w[-1] + (1 - d) * lin.weight.detach())
    with avg.swapped(): assert torch.allclose(lin.weight, w[-1])


class Killed(Exception):
    pass


def test_a_run_killed_at_an_evaluation_resumes_to_the_same_numbers(monkeypatch, tmp_path):
    "With evaluations inside epochs, the plateau schedule and weight averaging, a run stopped at its fourth evaluation resumes to the uninterrupted run's history and weights."
    c = cfg(epochs=4, evals_per_epoch=2, schedule="plateau", lr_patience=1, patience=6, ema=0.8)
    full_m = model(); full = fit(full_m, PREP, c, tmp_path / "full", log=lambda s: None)
    real, calls = T.val_score, [0]
    def dies(*a, **k):
        calls[0] += 1
        if calls[0] == 4: raise Killed()
        return real(*a, **k)
    monkeypatch.setattr(T, "val_score", dies)
    with pytest.raises(Killed): fit(model(), PREP, c, tmp_path / "killed", log=lambda s: None)
    monkeypatch.setattr(T, "val_score", real)
    again_m = model(); again = fit(again_m, PREP, c, tmp_path / "killed", log=lambda s: None)
    assert again.resumed_from == (1, 2)                                   # the third evaluation: epoch 1, batch 2
    clock = lambda hs: [{k: v for k, v in h.items() if k != "train_s"} for h in hs]
    assert clock(again.history) == clock(full.history)
    assert all(torch.equal(a, b) for a, b in zip(again_m.state_dict().values(), full_m.state_dict().values()))


def fake_record(seed, cider, f1, stages=False):
    m = {"CIDEr": cider, "BLEU-4": 0.3, "semantic": {c: {"p": f1, "r": f1, "f1": f1} for c in ("objects", "attributes", "counts", "relations", "all")}}
    r = {"params": {"seed": seed}, "metrics": m, "timings": {"train_s": 10.0 * (seed + 1), "images_per_s": 100.0}, "history": [{"epoch": 0, "epochs": 1.0}]}
    if stages: r["stages"] = {"xe": {"metrics": m, "train_s": 1.0}, "scst": {"metrics": {**m, "CIDEr": cider + 0.1}, "train_s": 2.0}}
    return r


def test_a_row_over_seeds_averages_its_runs_and_shows_their_spread():
    from capbook.records import seed_cells
    from capbook.records import merge_seeds
    recs = [fake_record(s, c, f) for s, c, f in ((0, 1.0, 0.4), (1, 1.2, 0.5), (2, 0.8, 0.6))]
    row = merge_seeds(recs)
    assert row["metrics"]["CIDEr"] == pytest.approx(1.0) and row["metrics"]["semantic"]["all"]["f1"] == pytest.approx(0.5)
    assert row["metrics_sd"]["CIDEr"] == pytest.approx(0.2) and row["timings"]["train_s"] == pytest.approx(20.0)
    assert row["seeds"] == [0, 1, 2] and row["seed_runs"] == recs
    assert seed_cells(row) == {"seeds": 3, "CIDEr sd": "20.0", "semantic F1 sd": "10.0"}
    assert seed_cells(merge_seeds(recs[:1])) == {"seeds": 1, "CIDEr sd": "—", "semantic F1 sd": "—"}
    st = merge_seeds([fake_record(s, c, 0.5, stages=True) for s, c in ((0, 1.0), (1, 2.0))])
    assert st["stages"]["scst"]["metrics"]["CIDEr"] == pytest.approx(1.6) and seed_cells(st, "xe")["CIDEr sd"] == f"{100 * np.std([1.0, 2.0], ddof=1):.1f}"


def test_verdicts_over_seeds_state_cider_and_semantic_f1():
    from capbook.claims import paired_verdict, interval_cells
    rng = np.random.default_rng(0)
    def seed_stats(shift_c, shift_f):                 # per-image statistics as image_stats gives them (CIDEr, semantic F1 counts)
        f = np.zeros((50, 4)); f[:, 0] = rng.integers(2, 5, 50) + shift_f; f[:, 1] = 5; f[:, 2] = f[:, 0]; f[:, 3] = 5
        return {"CIDEr": rng.uniform(0.5, 1.5, 50) + shift_c, "semantic F1": f}
    a = [seed_stats(0.5, 0.0) for _ in range(7)]; b = [seed_stats(0.0, 0.0) for _ in range(7)]
    v = paired_verdict(a, b)
    assert v["verdict"] == "holds" and v["also"]["semantic F1"]["verdict"] == "cannot tell"
    assert "on semantic F1" in v["text"] and "the metrics disagree" in v["text"] and "t over 7 vs 7 seeds" in v["text"]
    three = paired_verdict(a[:3], b[:3])               # three seeds a side: the sign tests' least p is 0.25
    assert three["verdict"] == "cannot tell" and three["lo"] > 0 and "the least 3 seeds can give" in three["text"]
    one = paired_verdict(a[0], b[0])                   # one seed each: the training variance is unknown, no verdict
    assert one["verdict"] == "one seed: no verdict" and one["p"] is None and "over the test images alone" in one["text"]
    assert "disagree" not in one["text"]
    assert paired_verdict([a[0], None], b)["verdict"].startswith("cannot tell")
    assert interval_cells([a[0], None])["CIDEr 95% CI"] == "—" and interval_cells(a)["CIDEr 95% CI"].startswith("[")


def test_the_plan_repeats_every_chapter_run_over_the_profile_seeds(monkeypatch):
    monkeypatch.setenv("CAPBOOK_DESIGN", "off")              # the plan before the sequential design's looks add seeds
    from capbook.plan import plan
    from capbook.plan import chapter_steps, replicas
    from capbook.profiles import SEEDS, chapters
    steps = plan("default")
    chs = chapters()
    rows = [s for s in steps if s.notebook in chs and not s.replica]
    reps = [s for s in steps if s.replica]
    per_row = [chs[s.notebook].seeds.get(s.tag, SEEDS["default"]) for s in rows]     # a chapter may ask more seeds of a row, or one
    assert len(reps) == sum(n - 1 for n in per_row) and steps.index(reps[0]) > steps.index(rows[-1])
    assert {s.params["seed"] for s in reps} == set(range(1, max(SEEDS["default"], *[c.seeds.get(s.tag, 0) for s in rows for c in [chs[s.notebook]]])))
    assert [r.params.get("seed", 0) for r in replicas("default", chapter_steps("default", "02_show_attend_tell")["none"])] == [0, 1, 2, 3, 4]
    assert len({s.name for s in steps}) == len(steps)                            # every run its own folder
    sat = chapter_steps("default", "02_show_attend_tell")
    assert all(not s.replica for s in sat.values()) and [r.name for r in replicas("default", sat["hard"])] == \
        ["02_show_attend_tell-hard", "02_show_attend_tell-hard-seed1", "02_show_attend_tell-hard-seed2"]
    assert all(not s.replica for s in plan("smoke"))                              # the smoke book: one seed


def test_every_transformer_attends_in_64_dimensions_per_head_at_every_profile():
    "The spatial transformer, CT and GLIED keep the paper's d_attn = d_model / heads = 64 at every profile (one head of 64 at the CPU profiles' width), so CT beside the spatial transformer is like for like."
    from capbook.profiles import PROFILES, chapters, model_hparams
    chs = chapters()
    for nb, tag in (("04_spatial_self_attention", ""), ("04_spatial_self_attention", "tau-standard"), ("06_baselines", "ct"),
                    ("05_glied", ""), ("05_glied", "base")):
        ch = chs[nb]
        for profile in PROFILES:
            p = ch.resolve(ch.params(profile=profile, **ch.runs[tag]))
            hp = model_hparams(ch.model(p), p)
            assert hp["d_model"] // hp["heads"] == 64 and hp["d_model"] % hp["heads"] == 0, (nb, tag, profile, hp)


def _curve(rng, slope, wobble, evals=30):
    "A seed's validation history: a rise to a plateau by epoch 5, then flat (slope 0) or climbing `slope` CIDEr points an epoch, with evaluation noise of sd `wobble` points."
    x = np.arange(1, evals + 1) / 2
    c = 1.0 - 0.6 * np.exp(-2 * x) + slope * np.maximum(x - 5, 0) / 100 + rng.normal(0, wobble / 100, evals)
    return [{"epoch": -1, "val CIDEr": 0.0}] + [{"epoch": int(e - 1e-9), "epochs": float(e), "val CIDEr": float(v)} for e, v in zip(x, c)]


def test_the_ladder_rule_on_synthetic_curves():
    "A row climbs when most of its seeds gained more than a flat tail's wobble in their last three epochs: flat rows almost never do, rows still climbing a CIDEr point an epoch always do, and one climbing seed among flat ones does not move its row."
    from capbook.profiles import RISING, curve_end, late_gain
    rng = np.random.default_rng(0)
    row = lambda *slopes, w=0.5: curve_end([late_gain(_curve(rng, s, w)) for s in slopes])
    assert np.mean([row(0, 0, 0) == "still rising" for _ in range(300)]) < 0.02
    assert np.mean([(np.array([late_gain(_curve(rng, 0, 0.5)) for _ in range(3)]) > 0).sum() >= 2 for _ in range(300)]) > 0.05   # "gained anything" would
    assert np.mean([row(1, 1, 1) == "still rising" for _ in range(200)]) > 0.98
    assert np.mean([row(1, 1, 0) == "still rising" for _ in range(200)]) > 0.98          # two climbing seeds of three: most
    assert np.mean([row(1, 0, 0) == "still rising" for _ in range(200)]) < 0.02           # one seed is not most
    assert row(1) == "one seed" and curve_end([RISING + 0.1, RISING, RISING + 5]) == "still rising"
    assert curve_end([RISING, RISING, 5.0]) == "flat or falling"                            # the margin is strict


def test_glied_and_the_baselines_its_claims_name_train_one_budget():
    "At the default profile every GLIED row trains as long as Up-Down, CT and Att2in, the rows its claims name (30 cross-entropy epochs; every self-critical stage 160, the ladder's fourth rung: most seeds of GLIED's, its base's and Up-Down's stages were still rising at 20, GLIED's, its base's and Att2in's at 40, Att2in's at 80, and the flat ones climb with them, so that a claim between '+ SCST' rows compares one budget): GLIED's curve dips where 15 epochs would anneal it (`05_glied`), so its chapter has no 15-epoch row and no twin."
    from capbook.profiles import chapters, BUDGET, LADDER, SCST_RUNGS, scst_budget
    chs = chapters()
    def budget(nb, tag, profile="default"):
        ch = chs[nb]
        p = ch.resolve(ch.params(profile=profile, **ch.runs[tag]))
        e = ch.epochs[profile]
        return (e(p) if callable(e) else e), p.scst_epochs
    glied = {tag: budget("05_glied", tag) for tag in chs["05_glied"].runs}
    assert set(glied) == {"", "base", "global-visual", "global-attribute", "global", "local", "position-values", "position-qk"}
    top = LADDER * BUDGET["default"]
    stage = scst_budget(top, rungs=SCST_RUNGS)
    assert stage == 160 and {e for e, _ in glied.values()} == {top} and {s for e, s in glied.values() if s} == {stage}
    assert glied[""][1] == glied["base"][1] == stage and glied["local"][1] == 0
    for tag in ("", "ct", "att2in"):
        assert budget("06_baselines", tag)[0] == top, tag
    assert budget("06_baselines", "att2in")[1] == budget("06_baselines", "")[1] == stage
    assert budget("05_glied", "", "paper")[1] == budget("06_baselines", "", "paper")[1] == 20      # the paper profile: the peers' 20
    assert budget("06_baselines", "nic")[0] == BUDGET["default"]          # the other baselines keep the protocol's budget
    assert budget("05_glied", "", "paper")[0] == 25 and budget("05_glied", "", "smoke")[0] == BUDGET["smoke"]


def test_every_declared_pair_starts_alike_at_each_seed_and_an_undeclared_one_does_not():
    "Rows a chapter declares paired (`Chapter.paired`) start alike at a seed, as the default book builds them: every parameter they share has one initial tensor, and the same batches come in the same order (`capbook.train.same_start`); the check fails for a pair the book does not declare (SPCA's S‖C and C, whose convolution is built first)."
    from capbook.models import build
    from capbook.profiles import chapters, model_hparams, train_config
    from capbook.train import same_start
    def row(ch, tag, seed):
        p = ch.resolve(ch.params(**{"profile": "default", **ch.runs[tag], "seed": seed}))
        name = ch.model(p)
        return (lambda: build(name, 300, 64, (7, 7), **model_hparams(name, p))), train_config(ch, p, name, 20)
    declared = [(ch, a, b) for ch in chapters().values() for a, b in ch.paired]
    assert len(declared) >= 10
    for ch, a, b in declared:
        for seed in (0, 2):
            s = same_start(row(ch, a, seed), row(ch, b, seed))
            assert s["paired"], (ch.notebook, a, b, seed, s)
    spca = chapters()["03_spca"]
    s = same_start(row(spca, "", 0), row(spca, "C", 0))
    assert not s["paired"] and s["differ"], s


def test_which_runs_exist_at_a_look_is_a_function_of_the_earlier_looks_verdicts_alone(tmp_path, monkeypatch):
    "The sequential design: the plan gives a row the seeds the next look of a claim on it asks for (`design_seeds`, from the published verdict tables' looks); a claim decided or futile asks for none, a row in two claims gets the most; the numbers beside a verdict (its p, its interval) do not move the plan, only the looks' verdicts do."
    import capbook.profiles as P
    from capbook.plan import chapter_steps, design_seeds, replicas
    monkeypatch.setattr(P, "out_dir", lambda profile: tmp_path)
    soft, hard = chapter_steps("default", "02_show_attend_tell")[""], chapter_steps("default", "02_show_attend_tell")["hard"]
    assert [len(replicas("default", s)) for s in (soft, hard)] == [5, 3]              # nothing published with looks: the chapter's (soft: 5) or 3
    def publish(rows):
        (tmp_path / "table_sat_verdicts.csv").write_text("claim,test,rows,look,look verdict,p\n" + rows)
    publish('hard above soft,t1,"02_show_attend_tell-hard, 02_show_attend_tell",0,next look,0.25\n')
    assert [len(replicas("default", s)) for s in (soft, hard)] == [5, 5] and design_seeds("default") == {"02_show_attend_tell": 5, "02_show_attend_tell-hard": 5}
    publish('hard above soft,t1,"02_show_attend_tell-hard, 02_show_attend_tell",0,next look,0.9\n')   # another p, the same verdict
    assert [len(replicas("default", s)) for s in (soft, hard)] == [5, 5]
    publish('hard above soft,t1,"02_show_attend_tell-hard, 02_show_attend_tell",1,next look,0.2\n'
            'soft above none,t2,"02_show_attend_tell, 02_show_attend_tell-none",1,futile,0.7\n')
    assert [len(replicas("default", s)) for s in (soft, hard)] == [7, 7]               # the row in two claims: the most any asks
    assert design_seeds("default")["02_show_attend_tell-none"] == 5                    # futile at the second look: no more seeds
    publish('hard above soft,t1,"02_show_attend_tell-hard, 02_show_attend_tell",2,holds,0.01\n')
    assert [len(replicas("default", s)) for s in (soft, hard)] == [7, 7]               # decided: it keeps what it had
    assert len(replicas("smoke", chapter_steps("smoke", "02_show_attend_tell")[""])) == 1   # one seed a row: no design


def test_only_declared_pairs_are_tested_on_per_seed_differences():
    "A claim between two rows their chapter declares to start alike (`Chapter.paired`) is tested seed by seed; any other pair of rows is not, whatever their numbers."
    from capbook.claims import Claims, declared_pair
    from capbook.profiles import chapters
    rng = np.random.default_rng(7)
    img = rng.gamma(2.0, 0.5, 200)
    row = lambda shift: [{"CIDEr": img + shift + s + rng.normal(0, 0.2, 200)} for s in rng.normal(0, 0.05, 7)]
    a, b = row(0.1), row(0.0)
    for nb, ch in chapters().items():
        for x, y in ch.paired:
            name = lambda t, nb=nb: nb + (f"-{t}" if t else "")
            assert declared_pair(name(x), name(y)) and declared_pair(name(y), name(x))
            assert Claims().test("declared", a, b, rows=(name(x), name(y)))["paired"]
    assert not Claims().test("undeclared", a, b, rows=("03_spca", "03_spca-C"))["paired"]     # C builds its convolution first
    assert not Claims().test("across chapters", a, b, rows=("03_spca-soft", "02_show_attend_tell"))["paired"]


def test_a_declared_pair_with_the_same_captions_is_no_kept_start():
    "Two rows declared to start alike that write the same captions (a smoke book's one seed) are two rows, not a stage that kept its start: one seed states no verdict."
    from capbook.claims import Claims
    st = [{"CIDEr": np.linspace(0.5, 1.5, 50)}]
    r = Claims().test("same", st, st, rows=("03_spca", "03_spca-base"))
    assert r["verdict"] == "one seed: no verdict" and not r["verdict"].startswith("kept")
