"The book end to end at the smoke profile: papermill plan, records, tables, figures, skip-unchanged, docs site."
import contextlib, json, re, subprocess, sys
from pathlib import Path
import pytest
from capbook.results import Step
from capbook.core import CapbookError

BIN = Path(sys.executable).parent


def _cmd(proc) -> str:
    "A process's command line, or '' for one that ended (or became a zombie) while the test looked at it."
    import psutil
    try: return " ".join(proc.cmdline())
    except psutil.Error: return ""


@pytest.fixture(scope="module")
def book(home):
    p = subprocess.run([str(BIN / "capbook"), "book", "--profile", "smoke", "-j", "2", "--no-docs"], capture_output=True,
                       text=True, timeout=1200)   # side by side; the skip test below reruns it one at a time; `site` builds its site
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "without encryption" not in p.stderr, "kernels over TCP: the book's IPC kernel manager was not used"
    assert "KeyboardInterrupt" not in p.stderr, "a kernel interrupted at shutdown"
    return home, p.stdout


@pytest.fixture(scope="module")
def site(book):
    "`capbook docs`: the site of the fixture's book, built from its kept notebooks alone (as `capbook book` ends; the kill test runs that path)."
    from capbook.plan import notebooks
    home, _ = book
    p = subprocess.run([str(BIN / "capbook"), "docs", "--profile", "smoke"], capture_output=True, text=True, timeout=600)
    chapters = sum(not nb.startswith(("00", "index")) for nb in notebooks())             # as README's table lists them
    assert p.returncode == 0 and f"docs site of {len(notebooks())} pages ({chapters} chapters, {len(notebooks()) - chapters - 1} on the engine)" in p.stdout, p.stdout + p.stderr
    return home / "runs" / "smoke" / "site"


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_smoke_book_publishes_tables_figures_records(book):
    home, log = book
    figs = home / "runs" / "smoke" / "figures"
    table = (figs / "table_sat_table1.md").read_text()
    assert "paper (quoted)" not in table and "capbook (measured)" in table
    head = [c.strip() for c in table.splitlines()[0].split("|")]
    assert all(re.fullmatch(r"\d+", l.split("|")[head.index("seeds")].strip()) for l in table.splitlines()[2:]), table   # whole seeds
    assert "paper (quoted)" in (figs / "table_sat_table1_paper.md").read_text()      # the paper's own table, its marks under it
    for model in ["Soft-Attention", "Hard-Attention", "Hard-Attention, argmax location at test", "No attention"]:
        assert f"| {model}" in table
    measured = [l for l in table.splitlines() if "capbook (measured)" in l]
    assert len(measured) == 5 and "| Google NIC" in measured[-1] and "06_baselines" in measured[-1]   # the baseline, measured
    assert "λ = 0" in (figs / "table_sat_ablation.md").read_text()
    for f in ["fig_sat_soft_attention.png", "fig_sat_figure3.png", "fig_soft_vs_hard_example.png"]:
        assert (figs / f).stat().st_size > 10_000, f
    assert not (figs / "fig_sat_hard_attention.png").exists(), "tagged (ablation) runs are not published on their own"
    assert (figs / "table_room.md").exists() and (figs / "table_dataset_card.md").exists()
    assert not (home / "figures").exists(), "a smoke run must not publish to figures/"
    rec = json.loads((home / "runs" / "smoke" / "02_show_attend_tell" / "record.json").read_text())
    for k in ["params", "seed", "code_version", "metrics", "timings", "n_params"]: assert k in rec
    assert 0 < rec["metrics"]["BLEU-1"] <= 1 and rec["n_params"] > 0 and rec["params"]["profile"] == "smoke"
    assert "attention" in rec["metrics"] and rec["metrics"]["attention"]["n"] > 0
    hard = json.loads((home / "runs" / "smoke" / "02_show_attend_tell-hard" / "record.json").read_text())
    assert hard["params"]["attention"] == "hard" and "metrics_argmax_context" in hard   # the other test context
    none = json.loads((home / "runs" / "smoke" / "02_show_attend_tell-none" / "record.json").read_text())
    assert none["metrics"]["attention"]["n"] == 0 and none["metrics"]["BLEU-1"] > 0
    assert "one METEOR process scored" in log and "METEOR" in rec["metrics"]     # the book's shared METEOR served its runs


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_unchanged_book_is_skipped(book):
    p = subprocess.run([str(BIN / "capbook"), "book", "--profile", "smoke", "--no-docs"], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ran in" not in p.stdout and p.stdout.count("unchanged, skipped") >= 3


@contextlib.contextmanager
def _a_clone_of(book, tmp_path, monkeypatch, names):
    "The smoke book as a clone sees it: its published book in the checkout (outside its runs, as the default profile's), the runs of `names` not here (moved aside, and back afterwards). Yields the published book's folder and where the runs wait."
    import shutil
    import capbook.book as B
    from capbook.core import runs_dir
    home, _ = book
    shipped = tmp_path / "figures"                                # the default profile's book sits in the checkout, outside its runs
    shutil.copytree(home / "runs" / "smoke" / "figures", shipped)
    monkeypatch.setattr(B, "out_dir", lambda profile: shipped)
    aside = tmp_path / "aside"
    for n in names: shutil.move(runs_dir() / "smoke" / n, aside / n)
    try: yield shipped, aside
    finally:
        for n in names:
            shutil.rmtree(runs_dir() / "smoke" / n, ignore_errors=True); shutil.move(aside / n, runs_dir() / "smoke" / n)


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_a_clone_retrains_nothing_its_published_book_made_under_todays_keys(book, tmp_path, monkeypatch):
    "A clone has the checkout's published book but none of its runs: a step that book made under today's key is not run again (its reader's copy or record stands in, and publishing leaves its files and entries as they were); another key, a published file edited since, a missing record or a run here of another key, and it is not current; a profile published inside its run folders has no stand-in."
    import shutil
    import capbook.book as B
    from capbook.core import runs_dir, save_json
    from capbook.results import plan_keys
    names = ("01_dataset", "02_show_attend_tell-none", "02a_soft_vs_hard")
    with _a_clone_of(book, tmp_path, monkeypatch, names) as (shipped, aside):
        K = plan_keys("smoke")
        steps, lines = [s for s in K.steps if s.name in names], []
        outs = B.run_plan("smoke", steps, log=lines.append)
        assert sorted(l for l in lines if "(no run here: the published book's results stand in)" in l) == [f"  {n}: unchanged, skipped (no run here: the published book's results stand in)" for n in names], lines
        assert outs == {"01_dataset": shipped / "notebooks" / "01_dataset.ipynb", "02_show_attend_tell-none": shipped / "records" / "02_show_attend_tell-none.json.gz",
                        "02a_soft_vs_hard": shipped / "notebooks" / "02a_soft_vs_hard.ipynb"}
        import nbformat
        from capbook.copies import copy_current
        from capbook.plan import nbs_dir
        rel = "notebooks/01_dataset.ipynb"; copy = shipped / rel          # a copy published before its prose was edited
        nb = nbformat.read(copy, as_version=4)
        md = next(c for c in nb.cells if c.cell_type == "markdown" and len(c.source) > 40)
        md.source = "A paragraph as it read when the step ran.\n"
        nbformat.write(nb, copy); B._rehash(shipped, [rel])
        assert not copy_current(copy, nbs_dir() / copy.name)
        outputs = lambda: [c.get("outputs") for c in nbformat.read(copy, as_version=4).cells if c.cell_type == "code"]
        ran = outputs()
        before = json.loads((shipped / "book.json").read_text())
        B.publish("smoke", steps)                                  # a whole book's publishing, where all three stood in
        after = json.loads((shipped / "book.json").read_text())
        own = lambda m: {f: e for f, e in m["files"].items() if e["step"] in names and f != rel}
        assert after["steps"] == before["steps"] and own(after) == own(before) and len(own(before)) >= 8
        assert copy_current(copy, nbs_dir() / copy.name) and outputs() == ran, "a stood-in step's copy shows today's prose, its outputs as they ran"
        from capbook.results import file_sha
        assert after["files"][rel] == {**before["files"][rel], "sha256": file_sha(copy)}
        tables, run = next(s for s in steps if s.name == "02a_soft_vs_hard"), next(s for s in steps if s.name == "02_show_attend_tell-none")
        assert B.unchanged(tables, "smoke", "another key") is None
        (runs_dir() / "smoke" / run.name).mkdir()
        save_json(runs_dir() / "smoke" / run.name / "done.json", {"key": "another key"})
        assert B.unchanged(run, "smoke", K.get(run)) is None, "a run here of another key is rerun, not stood in for"
        shutil.rmtree(runs_dir() / "smoke" / run.name)
        (shipped / "records" / f"{run.name}.json.gz").unlink()
        assert B.unchanged(run, "smoke", K.get(run)) is None, "a chapter run without its record"
        edited = next(shipped / f for f, e in own(before).items() if e["step"] == tables.name and f.startswith("table_") and f.endswith(".md"))
        assert B.unchanged(tables, "smoke", K.get(tables)) is not None
        edited.write_text(edited.read_text() + "\n")
        assert B.unchanged(tables, "smoke", K.get(tables)) is None, f"{edited.name} edited since it was published"
        monkeypatch.undo()
        assert B.unchanged(steps[0], "smoke", K.get(steps[0])) is None, "the smoke book's own folder stands in for nothing"


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_a_step_that_loads_a_runs_weights_has_that_run_trained_again_where_only_its_record_stands_in(book, tmp_path, monkeypatch):
    "A clone's published book keeps the runs' records, not their checkpoints: a step that will run and loads a run's trained weights (`02b_protocol`, soft attention's seed-0 model) has that run trained again first, under its own key, and what tabulates it after it; a step that stands in asks for nothing, nor does one whose run's checkpoint is here."
    import shutil
    import capbook.book as B
    from capbook.core import runs_dir
    from capbook.results import plan_keys
    names = ("02_show_attend_tell", "02a_soft_vs_hard", "02b_protocol")
    assert (runs_dir() / "smoke" / names[0] / "ckpt" / "best.pt").is_file()
    with _a_clone_of(book, tmp_path, monkeypatch, names) as (shipped, aside):
        K = plan_keys("smoke")
        run, steps = next(s for s in K.steps if s.name == names[0]), [s for s in K.steps if s.name in names[1:]]
        assert all(B.unchanged(s, "smoke", K.get(s)) is not None for s in [run, *steps]), "all three stand in"
        assert B.weights_to_make("smoke", steps, K) == [], "nothing runs, so no weights are loaded"
        assert B.weights_to_make("smoke", steps, K, force=True) == [run]
        m = json.loads((shipped / "book.json").read_text())
        table = next(shipped / f for f, e in m["files"].items() if e["step"] == "02b_protocol" and f.startswith("table_") and f.endswith(".md"))
        table.write_text(table.read_text() + "\n")                    # 02b_protocol no longer current: it will run
        assert B.weights_to_make("smoke", steps, K) == [run]
        lines = []
        B.run_plan("smoke", steps, dry_run=True, log=lines.append)
        assert lines == ["  02_show_attend_tell: would run again (its trained weights are not here; a notebook after it loads them)",
                         "  02a_soft_vs_hard: would run (after 02_show_attend_tell)",
                         "  02b_protocol: would run (after 02_show_attend_tell, 02a_soft_vs_hard)",
                         "dry run: 3 of 3 steps would run; nothing was run"], lines
        from concurrent.futures import ThreadPoolExecutor
        ran = []                                                  # the real run's calls, in order, the steps not executed
        monkeypatch.setattr(B, "_local_pool", lambda jobs: ThreadPoolExecutor(1))
        monkeypatch.setattr(B, "run_step", lambda s, profile, force, *a: ran.append((s.name, force)) or (tmp_path / s.name, True))
        B.run_plan("smoke", steps, log=lines.append)
        assert ran == [("02_show_attend_tell", True), ("02a_soft_vs_hard", True), ("02b_protocol", True)], \
            "trained again, then what tabulates it run again even where current: a run trained on another CPU may differ"
        shutil.copytree(aside / names[0], runs_dir() / "smoke" / names[0])   # its checkpoint here: nothing added
        assert B.weights_to_make("smoke", steps, K) == []


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_every_training_run_of_the_book_keeps_its_steps_key_for_resume(book):
    "The book hands each step's key and training key to its kernel, and every checkpoint its runs write keeps both: an unfinished run resumes under that key after an edit elsewhere in the package, a finished one under its training key after a change to the statistics or the drawing (`00i_train`). A checkpoint from before checkpoints kept a training key gets it stamped (`stamp_training_keys`), only where its step is current."
    import torch
    from capbook.book import stamp_first_stage_keys, stamp_training_keys
    from capbook.core import load_torch, save_torch
    from capbook.results import plan_keys
    home, _ = book
    runs = home / "runs" / "smoke"
    K = plan_keys("smoke")
    steps = {s.name: s for s in K.steps}
    lasts = sorted(runs.glob("*/ckpt*/last.pt"))
    assert len(lasts) >= 10
    for last in lasts:
        key = json.loads((last.parent.parent / "done.json").read_text())["key"]
        ck = torch.load(last, map_location="cpu", weights_only=True)
        assert key and ck["step_key"] == key and ck["training_key"] == K.training(steps[last.parent.parent.name]) != key, last
    old = lasts[0]
    save_torch(old, {k: v for k, v in load_torch(old).items() if k != "training_key"})     # as written before
    assert stamp_training_keys("smoke", log=lambda s: None) == [old]
    assert load_torch(old)["training_key"] == K.training(steps[old.parent.parent.name])
    assert stamp_training_keys("smoke", log=lambda s: None) == []
    # a '+ SCST' run's cross-entropy checkpoint keeps its first stage's key too; its later stages' and other runs' none
    firsts = [last for last in lasts if last.parent.name == "ckpt" and K.first_stage(steps[last.parent.parent.name])]
    assert firsts, "the smoke book has '+ SCST' runs"
    for last in lasts:
        ck = torch.load(last, map_location="cpu", weights_only=True)
        assert ck["first_stage_key"] == (K.first_stage(steps[last.parent.parent.name]) if last in firsts else None), last
    save_torch(firsts[0], {k: v for k, v in load_torch(firsts[0]).items() if k != "first_stage_key"})   # as written before
    assert stamp_first_stage_keys("smoke", log=lambda s: None) == [firsts[0]]
    assert stamp_first_stage_keys("smoke", log=lambda s: None) == []


def test_a_stage_that_climbed_the_ladder_resumes_its_checkpoints_at_the_rungs_below(monkeypatch):
    "A '+ SCST' row whose stages climbed the ladder (160 self-critical epochs, `scst_budget`) hands its kernel its training key, then its training keys at the rungs below (`Keys.resuming`): the key it had at 80, under which its 80-epoch checkpoints were written, differs from today's by the stage's budget alone, so those checkpoints go on (`capbook.train._extends`) and its cross-entropy stage stays finished. A row without a stage hands its training key alone."
    import capbook.results as R
    monkeypatch.setattr(R, "data_key", lambda params, encoder=None: "data")
    K = R.plan_keys("default", made=False, fresh=True)
    glied, local = (next(s for s in K.steps if s.name == n) for n in ("05_glied-base", "05_glied-local"))
    K._probes.update({K.row(glied): "m1", K.row(local): "m2", "shared scorer": "s", "shared stats": "t", "shared drawing": "d"})
    K._probes[K.row(R.first_stage_step(glied))] = "m0"                          # its cross-entropy stage's probe
    *keys, first = K.resuming(glied).split()
    assert R.budget(glied)["scst_epochs"] == 160 and keys[0] == K.training(glied) == K.key(glied, training=True, scst_epochs=160)
    assert keys[1:] == [K.key(glied, training=True, scst_epochs=e) for e in (80, 40, 20, 10, 5)] and len(set(keys)) == 6
    assert K.resuming(local) == K.training(local) and "scst_epochs" not in R.budget(local) and K.first_stage(local) is None
    # and the key of its cross-entropy stage alone, which a change to self-critical training alone leaves as it was
    from capbook.train import FIRST
    assert first == FIRST + K.first_stage(glied) and K.first_stage(glied) not in keys
    assert "scst_epochs" not in R.budget(R.first_stage_step(glied)) and not any(k.startswith("scst_") and v for k, v in R.first_stage_step(glied).params.items())
    was = K.first_stage(glied)
    K._keys.clear(); K._probes[K.row(glied)] = "m1 with another sampler"
    assert K.training(glied) != keys[0] and K.first_stage(glied) == was
    K._keys.clear(); K._probes[K.row(R.first_stage_step(glied))] = "m0 with another cross-entropy"
    assert K.first_stage(glied) != was


def test_a_runs_training_key_leaves_out_what_only_its_tables_and_figures_compute_with(monkeypatch):
    "A chapter run's training key is its key without the statistics and the drawing: a change to either re-keys the step (its notebook runs again) but not its training (its checkpoints resume); the scorer, which picks the kept weights and is SCST's reward, re-keys both."
    import capbook.results as R
    monkeypatch.setattr(R, "data_key", lambda params, encoder=None: "data")
    K = R.plan_keys("smoke", made=False, fresh=True)
    step = next(s for s in K.steps if s.name == "06_baselines")          # its cells compare runs: the statistics are in its key
    K._probes.update({K.row(step): "model", "shared scorer": "s1", "shared stats": "t1", "shared drawing": "d1"})
    key, training = K.key(step), K.key(step, training=True)
    assert key != training
    K._probes.update({"shared stats": "t2", "shared drawing": "d2"})
    assert K.key(step) != key and K.key(step, training=True) == training
    K._probes["shared scorer"] = "s2"
    assert K.key(step, training=True) != training
    # the run's attention figure: in the key of a row's own run (its figure is published), never in a seed's or a tagged run's
    import dataclasses
    seed = dataclasses.replace(step, params={**step.params, "seed": 1}, tag="seed1", replica=1)   # (the smoke book has one seed)
    tagged = next(s for s in K.steps if s.name == "06_baselines-nic")
    K._probes.update({K.row(tagged): "model of the tagged row", "helper attention_rows": "r1"})
    before = {s.name: (K.key(s), K.key(s, training=True)) for s in (step, seed, tagged)}
    K._probes["helper attention_rows"] = "r2"
    after = {s.name: (K.key(s), K.key(s, training=True)) for s in (step, seed, tagged)}
    assert after["06_baselines"][0] != before["06_baselines"][0] and after["06_baselines"][1] == before["06_baselines"][1]
    assert after["06_baselines-seed1"] == before["06_baselines-seed1"] and after["06_baselines-nic"] == before["06_baselines-nic"]


def test_a_device_books_verdicts_are_set_beside_the_cpu_books(tmp_path):
    "`device_verdicts`: each claim of the device book's verdicts tables beside the same claim in the CPU book's (seeds, means, verdict), whether the two verdicts are the same, and a dash where the CPU book has no such claim; written as a table of the device book."
    import pandas as pd
    from capbook.book import device_verdicts
    cpu, dev = tmp_path / "cpu", tmp_path / "dev"
    cpu.mkdir(); dev.mkdir()
    row = lambda c, v, m: {"claim": c, "verdict": v, "seeds": "5 vs 5", "mean": m}
    pd.DataFrame([row("A above B", "holds", "120.0, 110.0"), row("C above D", "cannot tell", "100.0, 99.0")]).to_csv(cpu / "table_x_verdicts.csv", index=False)
    pd.DataFrame([row("A above B", "holds", "121.0, 109.0"), row("C above D", "does not hold", "98.0, 99.5"),
                  row("E above F", "holds", "1.0, 0.0")]).to_csv(dev / "table_x_verdicts.csv", index=False)
    t = device_verdicts(dev, cpu)
    assert list(t["same verdict"]) == ["yes", "no", "—"] and list(t["table"]) == ["x"] * 3
    assert list(t["CPU verdict"]) == ["holds", "cannot tell", "—"] and t["device means"][1] == "98.0, 99.5"
    assert (dev / "table_device_verdicts.md").exists() and pd.read_csv(dev / "table_device_verdicts.csv")["claim"].tolist() == ["A above B", "C above D", "E above F"]
    assert len(device_verdicts(cpu / "none", cpu)) == 0


@pytest.fixture(scope="module")
def site_pages(book, site):
    "Every page of the fixture's site, checked in Chromium as a reader meets it (`sitecheck.check_site`: each page loaded once), {page: its DOM}."
    from sitecheck import check_site
    home, _ = book
    return check_site(site / "index.html", home / "runs" / "smoke" / "figures" / "notebooks")


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_docs_site_shows_table_and_attention_figure(site, site_pages):
    doms = site_pages                                                    # every page, as the site check loaded it
    assert "02a_soft_vs_hard" in doms, sorted(p.name for p in site.glob("*.html"))
    dom = doms["02a_soft_vs_hard"]
    assert "<table" in dom and "Hard-Attention" in dom and "paper (quoted)" in dom and "penalty off" in dom
    assert "<img" in dom and ("image/png" in dom or ".png" in dom)
    dom = doms["02_show_attend_tell"]
    assert "worked on one image" in dom and "<img" in dom
    assert not list(site.glob("*-hard*.html")), "each notebook appears once on the site"
    dom = doms["03a_spca_tables"]                                       # the SPCA chapter: its tables, answer, figures
    assert dom.count("<table") >= 5 and "S‖C" in dom and "Answer:" in dom and dom.count("<img") >= 2
    dom = doms["03_spca"]
    assert "Eq. 11" in dom and "<img" in dom
    assert not list(site.glob("03_spca-*.html")), "each notebook appears once on the site"


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_docs_command_rebuilds_the_site_a_reader_meets(book, site_pages):
    "`capbook docs` builds the site from the kept notebooks alone (the `site` fixture); every chapter reads as a book in Chromium (the `site_pages` fixture runs the site check over every page)."
    home, _ = book
    kept = home / "runs" / "smoke" / "figures" / "notebooks"
    assert (kept / "02_show_attend_tell.ipynb").exists() and not list(kept.glob("*-hard*"))    # untagged runs only
    p = subprocess.run([str(BIN / "capbook"), "docs", "--profile", "paper"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no kept notebooks of a paper book; run `capbook book --profile paper` first" in p.stderr


def test_step_record_prefers_book_run_then_exact_hand_run(home):
    from capbook.plan import nb_defaults
    from capbook.records import step_record
    from capbook.core import save_json
    runs = home / "runs" / "paper"                       # a profile no other test uses
    step = Step("02_show_attend_tell", {"profile": "paper", "attention": "hard"}, tag="hard")
    base = {**nb_defaults("02_show_attend_tell"), "profile": "paper", "attention": "hard"}
    def rec(folder, finished, **params):
        save_json(runs / folder / "record.json", {"notebook": "02_show_attend_tell", "finished": finished,
                                                   "params": {**base, **params}})
    with pytest.raises(CapbookError, match="no results record of 02_show_attend_tell-hard"): step_record("paper", step)
    rec("adhoc/a", "2026-01-01 00:00:00")
    rec("adhoc/b", "2026-01-03 00:00:00", epochs=2)                 # other parameters: never picked
    rec("adhoc/c", "2026-01-02 00:00:00", device="cpu")             # device does not change what is measured
    assert step_record("paper", step)["_dir"].endswith("adhoc/c")
    rec("02_show_attend_tell-hard", "2025-01-01 00:00:00")          # the book's own run wins
    assert step_record("paper", step)["_dir"].endswith("02_show_attend_tell-hard")
    older = {k: v for k, v in base.items() if k != "emb_dim"}       # made before the chapter had `emb_dim` (default None)
    save_json(runs / "02_show_attend_tell-hard" / "record.json", {"notebook": "02_show_attend_tell", "finished": "2026-02-01 00:00:00", "params": older})
    assert step_record("paper", step)["finished"] == "2026-02-01 00:00:00"
    save_json(runs / "02_show_attend_tell-hard" / "record.json", {"notebook": "02_show_attend_tell", "finished": "2026-02-01 00:00:00", "params": {**older, "retired": 1}})
    assert step_record("paper", step)["_dir"].endswith("adhoc/c")  # a parameter the chapter no longer has: another run
    from capbook.sat import WIDTHS
    save_json(runs / "02_show_attend_tell-hard" / "record.json", {"notebook": "02_show_attend_tell", "finished": "2026-03-01 00:00:00",
                                                                  "params": {**base, **WIDTHS["paper"]}})
    assert step_record("paper", step)["finished"] == "2026-03-01 00:00:00"   # widths given = the profile's widths left None


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_a_rerun_step_keeps_no_figure_or_table_of_the_last_execution(home, monkeypatch):
    "A figure the new execution does not draw (a weak model may give it nothing to show) must not be published from the old one."
    from capbook import results
    from capbook.book import run_step
    from capbook.core import runs_dir
    monkeypatch.setattr(results.Keys, "shared", property(lambda self: {}))       # the fingerprints: not what this test is about
    monkeypatch.setattr(results.Keys, "all_models", lambda self: "models")
    d = runs_dir() / "smoke" / "00_core"
    d.mkdir(parents=True, exist_ok=True)
    for f in ("fig_old.png", "old_plot.png", "table_old.md", "table_old.csv", "keep.json"): (d / f).write_text("old")
    run_step(Step("00_core"), "smoke", force=True, log=lambda s: None)
    assert sorted(p.name for p in d.iterdir() if "old" in p.name or p.name == "keep.json") == ["keep.json"]


def test_an_edit_made_while_a_step_runs_is_not_credited_to_it(home, monkeypatch):
    "A step's key is the code it started with: the notebook edited while its kernel runs (on the old code) leaves it to run again."
    import papermill as pm
    from capbook import book, results
    code = ["v1"]
    monkeypatch.setattr(results, "notebook_code", lambda path: {"cells": code[0], "layout": ""})
    monkeypatch.setattr(results.Keys, "shared", property(lambda self: {}))       # the fingerprints: not what this test is about
    monkeypatch.setattr(results.Keys, "all_models", lambda self: "models")
    monkeypatch.setattr(book, "warm_kernel", lambda cwd, step_key=None, training_key=None: None); monkeypatch.setattr(book, "kernel_manager", lambda: None)
    def execute(src, out, **kw):
        Path(out).write_text(Path(src).read_text()); code[0] = "v2"        # someone edits the notebook meanwhile
    monkeypatch.setattr(pm, "execute_notebook", execute)
    quiet = lambda s: None
    assert book.run_step(Step("00_core"), "smoke", force=True, log=quiet)[1]
    assert book.run_step(Step("00_core"), "smoke", log=quiet)[1]            # v2 never ran: not skipped
    assert not book.run_step(Step("00_core"), "smoke", log=quiet)[1]        # now it has


@pytest.mark.slow                                   # kernels and a smoke run: end to end
def test_side_by_side_failure_keeps_the_other_run(home):
    "`-j 2`: one step fails; the step beside it still finishes (nothing computed is lost), the book stops with the failure's line, naming the notebook, the cell and the parameter."
    from capbook.book import run_plan
    from capbook.core import runs_dir
    steps = [Step("02_show_attend_tell", {"profile": "smoke", "beam_size": 0}, tag="bad-j2"), Step("00_core")]
    (runs_dir() / "smoke" / "00_core" / "done.json").unlink(missing_ok=True)
    with pytest.raises(CapbookError) as e:
        run_plan("smoke", steps, jobs=2)
    msg = str(e.value)
    assert "02_show_attend_tell.ipynb failed in cell" in msg and "beam_size" in msg and "\n" not in msg
    assert (runs_dir() / "smoke" / "00_core" / "done.json").exists()


@pytest.mark.slow                                   # two smoke books of two runs: end to end
def test_a_device_book_trains_a_rows_seeds_stacked_as_each_trains_alone(home, monkeypatch):
    """`capbook book --device cpu` (the GPU book's path, tried on the CPU), bare (`--bare`: no papermill, no kernel, as on
    a GPU lent with torch alone): a row's two seeds train their cross-entropy stage as one stacked model (a pack) before
    their runs, which find it finished under their steps' keys; the book lives in a home of its own, its records name
    the device, the keyed draws and the arithmetic, and they equal the records of the same device book run through
    papermill with each run trained alone (metrics and captions exactly, losses to 10⁻⁶)."""
    import capbook.book as B
    import capbook.profiles as P
    from capbook.core import load_json, runs_dir
    monkeypatch.setitem(P.SEEDS, "smoke", 2)                       # a row of two seeds: a pack
    names, quiet = ["06_baselines-nic", "06_baselines-nic-seed1"], lambda s: None
    def book(where, bare):
        monkeypatch.setenv("CAPBOOK_HOME", str(home / where))
        B.run_book("smoke", device="cpu", bare=bare, only=[f"={n}" for n in names], docs=False, log=quiet)
        d = B.device_home("cpu") / "runs" / "smoke"
        assert B.device_home("cpu") == runs_dir() / "device-cpu" and not (runs_dir() / "smoke").exists()   # nothing in the CPU book's folders
        return d, {n: load_json(d / n / "record.json") for n in names}
    d, packed = book("packed", bare=True)
    assert "nic: 2 runs stacked (seeds 0, 1)" in (d / "packs" / "06_baselines-nic.log").read_text()
    for n, r in packed.items():
        assert (r["params"]["draws"], r["params"]["device"], r["machine"]["device"], r["precision"]) == ("keyed", "cpu", "cpu", "fp32")
        said = (d / n / "run.log").read_text()
        assert f"resumed from {d / n / 'ckpt' / 'last.pt'} at epoch 1" in said and "training from scratch" not in said
        assert load_json(d / n / "done.json")["bare"] and not (d / n / "06_baselines.ipynb").exists()
        assert (d / "figures" / "records" / f"{n}.json.gz").exists()       # what a bare book's machine gives back (`publish_bare`)
    from capbook.records import read_record, write_record                # METEOR scored here, for a machine without Java
    f = d / "figures" / "records" / f"{names[1]}.json.gz"
    r = read_record(f); meteor = r["metrics"].pop("METEOR"); r["notes"]["METEOR"] = "unavailable: Java not found"
    write_record(f, r)
    assert B.rescore_meteor(d / "figures", log=quiet) == [f"records/{f.name}"] and read_record(f)["metrics"]["METEOR"] == meteor
    assert B.rescore_meteor(d / "figures", log=quiet) == []              # once
    _received_here(B, home, monkeypatch, d / "figures", names, meteor)
    monkeypatch.setattr(B, "device_packs", lambda *a, **k: [])    # the same book through papermill, each run trained alone
    e, alone = book("alone", bare=False)
    assert (e / "06_baselines-nic" / "06_baselines.ipynb").exists()
    for n in names:
        a, b = packed[n], alone[n]
        assert a["metrics"] == b["metrics"] and a["samples"] == b["samples"], n
        assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a["history"], b["history"]) if "loss" in x) < 1e-6, n


def _received_here(B, home, monkeypatch, given: Path, names: list[str], meteor: float) -> None:
    """What a bare device book's machine gives back (`given`: `publish_bare`'s folder, packed in parts by tools/gpu_book.py),
    taken in by another home (`capbook book --device cpu --received PARTS`, `receive_device_book`): a part cut short or
    altered on the way stops in one line before anything is taken; the records stand for their runs under the keys this
    machine computes (one made where the scorer had no Java, METEOR scored here; one under a key of other code stands for
    nothing), and a tables chapter whose runs did not all come back waits, named."""
    import tarfile
    from capbook.core import load_json, save_json
    from capbook.records import MANIFEST, read_record
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "tools"))
    import gpu_book
    lines = []
    monkeypatch.setattr(gpu_book, "PART", 1)                       # a part a file: the manifest and each record apart
    m = load_json(given / MANIFEST)
    with B.device_book("cpu"):
        K = B.plan_keys("smoke", made=False)
        steps = {s.name: s for s in K.steps}
        there = K.with_shared("scorer", "0123456789abcdef")                   # a lent machine without Java: another scorer's keys
        m["steps"][names[1]], m["scorer"] = there.get(steps[names[1]]), "0123456789abcdef"
        r = read_record(given / "records" / f"{names[1]}.json.gz"); r["metrics"].pop("METEOR"); r["notes"]["METEOR"] = "unavailable: Java not found"
        from capbook.records import write_record
        from capbook.results import file_sha
        write_record(given / "records" / f"{names[1]}.json.gz", r)
        m["files"][f"records/{names[1]}.json.gz"]["sha256"] = file_sha(given / "records" / f"{names[1]}.json.gz")
    save_json(given / MANIFEST, m)
    out = home / "given"; out.mkdir()
    parts = [out / p for p in gpu_book.pack(given, out)]
    assert len(parts) >= 3 and all(tarfile.is_tarfile(p) for p in parts)
    monkeypatch.setenv("CAPBOOK_HOME", str(home / "received"))
    cut, extra = out / "cut.tar.gz", out / "extra.tar.gz"
    cut.write_bytes(parts[-1].read_bytes()[:200])
    with tarfile.open(extra, "w:gz") as tar: tar.add(given / MANIFEST, arcname="../run.log")
    for bad, said in ((cut, "not a readable part of a device book"), (extra, "is not what a device book gives back")):
        with pytest.raises(CapbookError) as e, B.device_book("cpu", here=False): B.receive_device_book("cpu", [*parts[:-1], bad], "smoke", log=lines.append)
        assert said in str(e.value) and "\n" not in str(e.value)
    with B.device_book("cpu", here=False):
        assert not (B.out_dir("smoke") / "records").exists()               # nothing taken from a bad set of parts
        got = B.receive_device_book("cpu", parts, "smoke", log=lines.append)
        assert sorted(got) == sorted(f"records/{n}.json.gz" for n in names)
        assert read_record(B.out_dir("smoke") / "records" / f"{names[1]}.json.gz")["metrics"]["METEOR"] == meteor   # scored here
        for n in names: assert B.unchanged(steps[n], "smoke", K.get(steps[n])), n           # each stands for its run
        tables = [s for s in B.plan("smoke") if s.notebook == "06a_baselines_tables"]
        assert B.received_tables("smoke", tables, log=lines.append) == []
        assert any(l.startswith("  06a_baselines_tables: waits for ") for l in lines), lines
    m = load_json(given / MANIFEST); m["steps"][names[0]] = "fedcba9876543210"       # made by other code: stands for nothing
    save_json(given / MANIFEST, m)
    with B.device_book("cpu", here=False):
        B.receive_device_book("cpu", [given], "smoke", log=lines.append)
        assert not B.unchanged(steps[names[0]], "smoke", K.get(steps[names[0]]))
    assert any("made under keys this machine does not compute" in l and names[0] in l for l in lines), lines


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_a_dead_worker_stops_the_book_with_one_line(home, monkeypatch):
    "`-j 2`: a worker process killed under a step (out of memory) ends the book with one line naming the step, not a traceback."
    import capbook.book as book
    monkeypatch.syspath_prepend(str(Path(__file__).parent))      # the spawned workers import it from here too
    import dying_worker
    steps = [Step("00_core"), Step("00a_shapes")]
    class Keyring:                                                # the keys are not what is tested: no fingerprints computed
        def __init__(self, profile, **how): self.steps = steps
        def get(self, step): return f"key of {step.name}"
        def training(self, step): return f"training key of {step.name}"
        def resuming(self, step): return self.training(step)
    monkeypatch.setattr(book, "plan_keys", Keyring)
    monkeypatch.setattr(book, "run_step", dying_worker.run_step)
    with pytest.raises(CapbookError) as e:
        book.run_plan("smoke", steps, jobs=2)
    msg = str(e.value)
    assert msg.endswith("run the book again to go on") and "the process running it died" in msg and "\n" not in msg
    assert msg.split(":")[0] in ("00_core", "00a_shapes")


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_papermill_invalid_parameter_is_one_line(home, tmp_path):
    p = subprocess.run([str(BIN / "papermill"), str(Path(__file__).parent.parent / "nbs" / "02_show_attend_tell.ipynb"),
                        str(tmp_path / "out.ipynb"), "-p", "profile", "huge"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "parameter profile='huge' is invalid: allowed values are 'smoke', 'default', 'paper'" in p.stderr + p.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_tensorboard_shows_every_training_run_of_the_book(book):
    "tensorboard --logdir runs/smoke lists a run per training step of the plan, with its loss and validation curves."
    import socket, time, urllib.request
    from capbook.plan import plan
    from capbook.profiles import chapters
    home, _ = book
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    tb = subprocess.Popen([str(BIN / "tensorboard"), "--logdir", str(home / "runs" / "smoke"), "--host", "127.0.0.1",
                           "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        get = lambda path: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read())
        trained = [f"{s.name}/ckpt/tb" for s in plan("smoke") if s.notebook in chapters()]   # every training run of the book
        want = {"train/loss", "train/lr", "val/CIDEr"}
        runs, tags, t0 = [], {}, time.time()
        while time.time() - t0 < 180:                  # TensorBoard reads the event files in the background, run by run
            try: runs, tags = get("/data/runs"), get("/data/plugin/scalars/tags")
            except OSError: pass
            if all(want <= set(tags.get(r, {})) for r in trained): break
            time.sleep(1)
        for r in trained: assert want <= set(tags.get(r, {})), (r, sorted(tags.get(r, {})), runs)
        scst = [r for r in runs if r.endswith("/ckpt-scst/tb")]
        assert scst and all({"train/reward", "train/baseline"} <= set(tags[r]) for r in scst)   # SCST's reward and baseline
    finally:
        tb.terminate(); tb.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGHUP"])
def test_a_killed_book_leaves_no_process_behind(smoke_data, tmp_path, sig):
    "SIGKILL to capbook book -j 2 mid-run: its workers and their kernels end with it (they used to live on, ~800 MB each). SIGHUP (a closed login shell; SIGTERM takes the same path): the book ends them at once instead of waiting for their steps, says so in one line and exits 128 + the signal. The session's smoke data, with the keys' fingerprints the first book of the run computed."
    import os, signal, time
    import psutil
    env = {**os.environ, "CAPBOOK_HOME": str(tmp_path), "CAPBOOK_DATA": str(smoke_data)}
    p = subprocess.Popen([str(BIN / "capbook"), "book", "--profile", "smoke", "-j", "2", "--no-docs"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    book, t0, family = psutil.Process(p.pid), time.time(), []
    while time.time() - t0 < 300:                                   # until both workers run a notebook in a kernel
        family = book.children(recursive=True)
        if sum("ipykernel" in _cmd(c) for c in family) >= 2: break
        time.sleep(0.5)
    assert len(family) >= 4, [_cmd(c) for c in family]
    t0 = time.time()
    os.kill(p.pid, getattr(signal, sig)); err = p.communicate(timeout=60)[1]
    _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [(a.pid, _cmd(a)[:120]) for a in alive]
    if sig == "SIGHUP":
        assert p.returncode == 128 + signal.SIGHUP and time.time() - t0 < 30, (p.returncode, err[-2000:])
        assert "ended by SIGHUP: what finished is kept; the same command goes on from there" in err, err[-2000:]


@contextlib.contextmanager
def _tmpfs(where: Path, options: str):
    "A tmpfs mounted at `where` with `options` (e.g. `ro,size=1m`) for the block: needs root, as on this project's machines; skips elsewhere."
    where.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if m.returncode: pytest.skip(f"cannot mount a tmpfs ({options}) here: {m.stderr.strip()}")
    try: yield where
    finally: subprocess.run(["umount", str(where)], check=True)


@pytest.fixture
def read_only_home(tmp_path):
    "A CAPBOOK_HOME on a read-only filesystem."
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro: yield ro


@pytest.mark.slow
@pytest.mark.parametrize("nb", ["02a_soft_vs_hard", "02_show_attend_tell"])
def test_a_read_only_home_is_one_line(read_only_home, tmp_path, nb):
    "A notebook on a read-only CAPBOOK_HOME (the run folder, or the data it would build) stops with one line, not a traceback."
    import os
    out = tmp_path / "out.ipynb"
    p = subprocess.run([str(BIN / "papermill"), str(Path(__file__).parent.parent / "nbs" / f"{nb}.ipynb"), str(out),
                        "-p", "profile", "smoke"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "CAPBOOK_HOME": str(read_only_home)})
    assert p.returncode != 0
    errors = [o for c in json.loads(out.read_text())["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert len(errors) == 1 and len(errors[0]["traceback"]) == 1, errors
    line = errors[0]["traceback"][0]
    assert line.startswith("capbook: ") and str(read_only_home) in line and "(the folder is read-only)" in line, line


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_the_readers_papermill_run_is_clean(book, tmp_path):
    "The README's own command (`papermill nbs/03_spca.ipynb out.ipynb -p kernel 5`, at the smoke profile, on the fixture's book and data, in a reader's shell): no plain-TCP kernel warning on the terminal; on papermill's terminal the training's bar (epoch, batch, the last validation score, the time left) and every log line the notebook keeps, ending with the run's folder, that smoke numbers are toy-sized, and that it reproduced the book's own run of the same parameters and seed exactly (one thread, as the book's workers); no progress bar or TqdmWarning in the notebook; its params.yaml starts the same run again."
    import os
    home, _ = book
    out = tmp_path / "out.ipynb"
    shell = {k: v for k, v in os.environ.items() if k not in ("CAPBOOK_IN_BOOK", "TQDM_DISABLE") and not k.startswith("PYTEST")}   # a reader's
    p = subprocess.run([str(BIN / "papermill"), str(Path(__file__).parent.parent / "nbs" / "03_spca.ipynb"), str(out),
                        "-p", "profile", "smoke", "-p", "kernel", "5"], capture_output=True, text=True, timeout=900,
                       env={**shell, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "without encryption" not in p.stderr
    said = [l.strip() for l in p.stderr.replace("\r", "\n").splitlines() if l.strip()]
    bars = [l for l in said if re.match(r"epoch 0: +\d+%\|.*\| *\d+/\d+ \[.*(val CIDEr [\d.]+|val CIDEr not yet)(, about \d+ (s|min) left)?\]", l)]
    assert bars and any("left" in l for l in bars), said[-20:]
    logged = [l for l in said if l.startswith("epoch 0") and "| val" in l]
    assert logged and any(l.startswith("epoch 0: loss") for l in logged), said[-20:]
    assert any(re.fullmatch(r"This run's folder: runs/smoke/adhoc/03_spca-\w+ \(.*\)\.", l) for l in said), said[-5:]
    assert any(l.startswith("The smoke profile trains toy sizes") for l in said), said[-5:]
    assert any(l.startswith("The book holds a run of these parameters and seed (03_spca-k5): this run reproduced its test CIDEr exactly")
               for l in said), said[-6:]
    nb = json.loads(out.read_text())
    streams = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "epoch 0" in streams and all(l in streams for l in logged)   # it trained and said so, the same lines as the terminal ...
    for chatter in ("TqdmWarning", "IProgress", "it/s]", "img/s]", "epoch/s]"):
        assert chatter not in streams, chatter                    # ... without a progress bar or ipywidgets' warning
    saved = list((home / "runs" / "smoke" / "adhoc").glob("03_spca-*/params.yaml"))
    assert len(saved) == 1 and "kernel: 5" in saved[0].read_text()
    p = subprocess.run([str(BIN / "papermill"), str(Path(__file__).parent.parent / "nbs" / "03_spca.ipynb"), str(out),
                        "-f", str(saved[0])], capture_output=True, text=True, timeout=900)   # the run again, from its own YAML
    assert p.returncode == 0, p.stderr[-3000:]
    again = "".join("".join(o.get("text", "")) for c in json.loads(out.read_text())["cells"] for o in c.get("outputs", [])
                    if o.get("output_type") == "stream")
    assert "resumed from" in again and "epoch 0" not in again    # its finished training found unchanged, not repeated


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_smoke_book_spca_tables(book):
    home, _ = book
    figs = home / "runs" / "smoke" / "figures"
    t2 = (figs / "table_spca_table2.md").read_text()
    for s in ["Baseline", "| S ", "| C ", "C-S", "S-C", "S‖C"]: assert s in t2, s
    assert t2.count("capbook (measured)") == 6 and "paper (quoted)" in t2
    t3 = (figs / "table_spca_table3.md").read_text()
    assert all(k in t3 for k in ["1×1", "3×3", "5×5"]) and t3.count("capbook (measured)") == 3
    t1 = (figs / "table_spca_table1.md").read_text()
    assert t1.count("capbook (measured") == 4 and "ms/image" in t1
    t4 = (figs / "table_spca_table4.md").read_text()
    measured = [l for l in t4.splitlines() if "capbook (measured)" in l]
    for m in ["Soft-Attention*", "2D-latent state*", "1D-LSTM + SPCA", "2D-latent-LSTM + SPCA", "Hard-Attention",
              "Google NIC", "SCA-CNN", "ATT2in"]:
        assert any(f"| {m} " in l for l in measured), m                        # every row of the paper's table, measured
    assert "The claim that convolutional attention localises more precisely than grid attention" in \
        (home / "runs" / "smoke" / "03a_spca_tables" / "03a_spca_tables.ipynb").read_text()
    loc = (figs / "table_spca_localisation.md").read_text()
    assert "| 1D-LSTM + SPCA (S‖C, 3×3)" in loc and "map max/min" in loc
    assert (figs / "fig_spca_figure1.png").stat().st_size > 10_000 and (figs / "fig_spca_figure4.png").stat().st_size > 10_000
    rec = json.loads((home / "runs" / "smoke" / "03_spca-k5" / "record.json").read_text())
    assert rec["params"]["kernel"] == 5 and rec["attention_on_references"]["n"] > 0


@pytest.mark.parametrize("param,value,message", [
    ("kernel", "4", "parameter kernel=4 is invalid: expected an odd integer >= 1"),
    ("structure", "SC", "parameter structure='SC' is invalid: allowed values are 'S', 'C', 'C-S', 'S-C', 'S||C', 'none'"),
    ("decoder", "3d", "parameter decoder='3d' is invalid: allowed values are '1d', '2d'")])
def test_spca_invalid_parameters_are_one_line(home, tmp_path, param, value, message):
    "In-process, through the checks the notebook's first cell runs (the notebook's own one-line path: test_papermill_*)."
    from capbook.runner import run_chapter
    before = sorted((home / "runs" / "smoke").glob("adhoc/*"))
    with pytest.raises(CapbookError) as e:
        run_chapter("03_spca", {"profile": "smoke", param: int(value) if value.isdigit() else value}, log=lambda s: None)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert sorted((home / "runs" / "smoke").glob("adhoc/*")) == before    # stopped before any work: no run folder


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_misspelt_papermill_parameter_stops_with_one_line(home, tmp_path):
    "papermill only warns about `-p epoch 5`; the chapter stops before training, naming the unknown parameter."
    p = subprocess.run([str(BIN / "papermill"), str(Path(__file__).parent.parent / "nbs" / "03_spca.ipynb"),
                        str(tmp_path / "out.ipynb"), "-p", "epoch", "5"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "parameter epoch is unknown: known parameters are profile, dataset" in p.stderr + p.stdout


def test_a_new_chapter_touches_no_list(monkeypatch, tmp_path):
    "A new notebook plus its chapter declaration: the plan, the README table and the API list pick it up."
    import shutil
    import capbook.book as B
    from capbook.profiles import CHAPTERS, Chapter, RunConfig, register_chapter
    nbs = tmp_path / "nbs"; shutil.copytree(Path(__file__).parent.parent / "nbs", nbs)
    for ext in ("py", "ipynb"):
        src = (nbs / f"01_dataset.{ext}").read_text()
        (nbs / f"04_toy.{ext}").write_text(src.replace("The data: shapes, its card", "Toy: a chapter added for a test"))
    monkeypatch.setattr(B, "nbs_dir", lambda: nbs); monkeypatch.setattr("capbook.plan.nbs_dir", lambda: nbs)
    register_chapter(Chapter("04_toy", "Toy et al. 2026, A toy", "https://arxiv.org/abs/0000.00000", RunConfig,
                             model=lambda p: "sat_soft", runs={"": {}, "big": {"batch_size": 128}}, epochs={"smoke": 1},
                             label=lambda p: "toy", figure=lambda p: "fig_toy.png"))
    try:
        steps = [s for s in B.plan("smoke") if s.notebook == "04_toy"]
        assert [(s.tag, s.params) for s in steps] == [("", {"profile": "smoke"}), ("big", {"profile": "smoke", "batch_size": 128})]
        assert "| [`04_toy`](04_toy.ipynb) | Toy: a chapter added for a test" in B.chapter_table() and "[Toy et al. 2026](https://arxiv.org/abs/0000.00000)" in B.chapter_table()
    finally:
        CHAPTERS.pop("04_toy")


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_every_chapter_publishes_what_it_declares(book):
    "Each chapter's declared figures are published by the smoke book; its declared published tables are quoted data."
    from capbook.profiles import chapters
    home, _ = book
    figs = home / "runs" / "smoke" / "figures"
    for name, ch in chapters().items():
        for f in ch.figures: assert (figs / f).stat().st_size > 10_000, (name, f)
        for t, table in ch.tables.items():
            df = table()
            assert len(df) and (df["source"] == "paper (quoted)").all(), (name, t)


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_smoke_book_semantic_and_glied_tables(book):
    home, _ = book
    figs = home / "runs" / "smoke" / "figures"
    for name, models in [("sat", ["Soft-Attention", "No attention"]), ("spca", ["Soft-Attention*", "S‖C, 3×3 (1D-LSTM)"]),
                         ("ssa", ["Transformer, τ paper", "Show-Attend-Tell soft (LSTM)"])]:
        t = (figs / f"table_{name}_semantic.md").read_text()
        assert all(f"{c} {k}" in t for c in ("counts", "relations", "all") for k in ("P", "R", "F1")), name
        assert all(f"| {m}" in t for m in models), (name, t[:500])
    t1 = (figs / "table_glied_table1.md").read_text()
    assert "paper (quoted)" in t1 and t1.count("capbook (measured)") == 12 and "+ self-critical (CIDEr-D)" in t1
    rows = [l for l in t1.splitlines() if "capbook (measured)" in l]
    for m in ["SCST (Att2in)", "Up-Down", "Base", "GLIED"]:
        assert sum(f"| {m} " in l for l in rows) == 3, m                       # cross-entropy and both self-critical arms
    assert "| RFNet " in t1 and "not run here" in t1 and "| GCN-LSTM " in t1
    t2 = (figs / "table_glied_table2.md").read_text()
    rows = [l for l in t2.splitlines() if "capbook (measured)" in l]
    assert all(any(f"| {m} " in l for l in rows) for m in ["LSTM", "Up-Down", "CT", "SoftAtt", "Base", "GLIED"]), t2
    allm = (figs / "table_baselines_all.md").read_text()
    names = [l.split("|")[1].strip() for l in allm.splitlines() if l.startswith("| ") and "model" not in l]
    assert len(names) == 23, names                                             # 15 cross-entropy rows; two self-critical arms on each of 4 starts
    assert all(f"{m} + SCST" in names and f"{m} + SCST (mean baseline)" in names for m in ("Att2in", "Up-Down", "GLIED base", "GLIED")), names
    assert (figs / "fig_baselines_comparison.png").stat().st_size > 10_000
    t4 = (figs / "table_glied_table4.md").read_text()
    assert all(f"| {m}" in t4 for m in ["Base", "+ global visual", "+ global attribute", "+ global", "+ local", "GLIED"])
    assert "counts P" in t4 and "relations R" in t4
    claims = (figs / "table_glied_claims.md").read_text()
    verdicts = [l.split("|")[-3].strip() for l in claims.splitlines()[2:]]      # the smoke book trains every row once
    assert len(verdicts) == 5 and all(v == "one seed: no verdict" or v.startswith("cannot tell (no model states") for v in verdicts), claims
    assert all(l.split("|")[-2].strip() == "—" for l in claims.splitlines()[2:]), claims     # no verdict, nothing to correct
    assert (figs / "fig_glied_figure3.png").stat().st_size > 10_000 and (figs / "fig_glied_scst.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_tables_show_intervals_and_paired_verdicts(book):
    "Every measured row carries 95% intervals (the smoke book's one seed: over the test images, so marked); every claim on a row of one seed states no verdict."
    home, _ = book
    figs = home / "runs" / "smoke" / "figures"
    for name in ("table_sat_table1", "table_spca_table4", "table_ssa_table1", "table_glied_table1", "table_baselines_all"):
        text = (figs / f"{name}.md").read_text()
        head = [c.strip() for c in text.splitlines()[0].split("|")]
        assert {"BLEU-4 95% CI", "CIDEr 95% CI", "semantic F1 95% CI"} <= set(head), name
        rows = [[c.strip() for c in l.split("|")] for l in text.splitlines()[2:] if "paper (quoted)" not in l]
        ci = [r[head.index("CIDEr 95% CI")] for r in rows]
        assert ci and all((c.startswith("[") and c.endswith("images only")) or "argmax location" in " ".join(r)
                          for c, r in zip(ci, rows)), (name, ci)
    spca = (figs / "table_spca_claims.md").read_text()
    head = [c.strip() for c in spca.splitlines()[0].split("|")]
    assert {"p", "on this run", "Holm"} <= set(head) and spca.count("|") > 40
    assert all("| one seed: no verdict" in l and "| —" in l for l in spca.splitlines()[2:]), spca
    glied = (figs / "table_glied_claims.md").read_text()
    assert "over the test images alone 95% CI" in glied and "Holm" in glied


@pytest.mark.slow                                   # kernels and a smoke run: end to end
def test_a_reused_kernel_gives_a_fresh_kernels_results(home):
    "A notebook run in a kernel another notebook used (reset between them) records the same numbers as in a fresh kernel, counts its cells from 1, and sees none of the last notebook's names."
    import nbformat
    from capbook import book
    from capbook.core import load_json, runs_dir
    step = lambda tag: Step("06_baselines", {"profile": "smoke", "model": "nic", "scst_epochs": 0}, tag=tag)
    book._shutdown_warm()
    out, _ = book.run_step(step("fresh-kernel"), "smoke", force=True, log=lambda s: None)
    km = book._WARM["km"]
    book.run_step(Step("00_core"), "smoke", force=True, log=lambda s: None)          # another notebook in between
    out2, _ = book.run_step(step("used-kernel"), "smoke", force=True, log=lambda s: None)
    assert book._WARM["km"] is km                                                      # the same kernel, reused
    a, b = (load_json(runs_dir() / "smoke" / s / "record.json") for s in ("06_baselines-fresh-kernel", "06_baselines-used-kernel"))
    assert a["metrics"] == b["metrics"] and a["history"] == [{**h, "train_s": g["train_s"]} for h, g in zip(b["history"], a["history"])]
    cells = [c for c in nbformat.read(out2, 4).cells if c.cell_type == "code" and c.get("execution_count")]
    assert cells[0].execution_count == 1
    nb0 = nbformat.read(out, 4)
    assert [c.get("outputs") and c.outputs[0].get("output_type") for c in nb0.cells if c.cell_type == "code"][:3] == \
           [c.get("outputs") and c.outputs[0].get("output_type") for c in nbformat.read(out2, 4).cells if c.cell_type == "code"][:3]
    from jupyter_client import BlockingKernelClient
    kc, said = BlockingKernelClient(), []
    kc.load_connection_info(km.get_connection_info()); kc.start_channels()
    try: kc.execute_interactive("import gc; print(gc.get_freeze_count())", timeout=60,
                                output_hook=lambda m: said.append(m["content"]["text"]) if m["msg_type"] == "stream" else None)
    finally: kc.stop_channels()
    assert int("".join(said)) > 100_000            # the libraries' objects set aside from the collector, once, at a reset


def test_a_kernel_that_cannot_be_prepared_stops_in_one_line(monkeypatch, tmp_path):
    "A fresh kernel whose reset fails is no kernel to run a notebook in: one line with the reason, not a new kernel after another."
    from capbook import book
    book._shutdown_warm()
    monkeypatch.setattr(book, "_RESET", "raise ValueError('cannot reset')")
    with pytest.raises(CapbookError, match=r"^a fresh Jupyter kernel could not be prepared for a notebook \(ValueError: cannot reset\)$"):
        book.warm_kernel(tmp_path)
    assert "km" not in book._WARM


def test_only_selects_chapters_steps_and_patterns():
    "`capbook book --only`: a notebook selects its every run, a pattern the matching steps, a step itself, `=` and a name that step alone (a chapter's first run is named as its notebook); a pattern matching nothing stops in one line."
    from capbook.book import select_steps
    from capbook.plan import plan
    steps = plan("default")
    spca = select_steps(steps, ["03_spca"])
    assert spca and all(s.notebook == "03_spca" for s in spca) and len(spca) == sum(s.notebook == "03_spca" for s in steps)
    hard = [s.name for s in select_steps(steps, ["02_show_attend_tell-hard*", "02a_soft_vs_hard"])]
    assert "02_show_attend_tell-hard-seed2" in hard and "02_show_attend_tell-hard-lr1" in hard and "02a_soft_vs_hard" in hard
    assert "02_show_attend_tell" not in hard and "02_show_attend_tell-none" not in hard
    assert [s.name for s in select_steps(steps, ["03_spca-base-seed1"])] == ["03_spca-base-seed1"]
    assert [s.name for s in select_steps(steps, ["=02_show_attend_tell"])] == ["02_show_attend_tell"]   # a chapter's first run alone
    assert [s.name for s in select_steps(steps, ["=03_spca-base*"])] == [s.name for s in spca if s.name.startswith("03_spca-base")]
    assert [s.name for s in select_steps(steps, ["04a*", "index"])] == [s.name for s in steps if s.name in ("index", "04a_ssa_tables")]
    with pytest.raises(CapbookError, match="only='03_spcaa' matches no step"): select_steps(steps, ["03_spcaa"])
    with pytest.raises(CapbookError, match="only='=03a_spca' matches no step"): select_steps(steps, ["=03a_spca"])


def test_readme_blocks_come_from_the_published_tables(tmp_path):
    "The README's generated sentences: the one-chapter example's minutes and machine from the published time table (the command alone where there is none), and its smoke run's minutes from `bench_reader.json` where they are of the same command; after the results, how many self-critical seeds ended below their start on validation and what each stage did to the captions, counted from the published tables, and where each stage is set beside its start."
    import pandas as pd
    from capbook.book import EXAMPLE, one_chapter, results_table
    figs = Path(__file__).resolve().parent.parent / "figures"
    cmd = f"papermill nbs/{EXAMPLE[0]}.ipynb out.ipynb -p kernel 5`"
    assert one_chapter(tmp_path).endswith(cmd + ".")                         # no time table yet: the command alone
    (tmp_path / "table_book_times.csv").write_text("step,minutes\n03_spca-k5,42.4\n")
    (tmp_path / "table_book_times.md").write_text("| step | minutes |\n\nMachine: Some CPU, 8 cores (the one that published this table).\n")
    assert f"{cmd} (the book's `03_spca-k5`: 42 minutes on Some CPU, 8 cores" in one_chapter(tmp_path)
    reader = {"command": "papermill nbs/03_spca.ipynb out.ipynb -p kernel 5 -p profile smoke", "profile": "smoke", "wall_s": 185.0, "machine": "Other CPU, 2 cores"}
    (tmp_path / "bench_reader.json").write_text(json.dumps(reader))                  # `capbook bench --reader --profile smoke`
    assert one_chapter(tmp_path).endswith("8 cores, two runs side by side; with `-p profile smoke`, toy-sized numbers in 3 minutes "
                                          "from a fresh clone on Other CPU, 2 cores).")
    (tmp_path / "bench_reader.json").write_text(json.dumps({**reader, "wall_s": 27.5}))
    assert "toy-sized numbers in 28 seconds from" in one_chapter(tmp_path)              # under a minute and a half: seconds
    (tmp_path / "bench_reader.json").write_text(json.dumps({**reader, "command": "papermill nbs/03_spca.ipynb out.ipynb -p kernel 3 -p profile smoke"}))
    assert "smoke" not in one_chapter(tmp_path)                                      # another command's minutes are not this one's
    pd.read_csv(figs / "table_baselines_all.csv").to_csv(tmp_path / "table_baselines_all.csv", index=False)
    pd.DataFrame([{"row": "Up-Down + SCST", "seed": 0, "val CIDEr, start (greedy)": 100.0, "best val CIDEr": 110.0},
                  {"row": "Up-Down + SCST", "seed": 1, "val CIDEr, start (greedy)": 107.5, "best val CIDEr": 107.0},
                  {"row": "Up-Down + SCST (mean baseline)", "seed": 1, "val CIDEr, start (greedy)": 107.5, "best val CIDEr": 90.0},
                  ]).to_csv(tmp_path / "table_baselines_scst.csv", index=False)
    pd.DataFrame([{"stage": "Up-Down + SCST", "captions of": "Up-Down", "F1 counts": 11.1, "F1 relations": 9.0, "top relation (seeds)": "below, right of", "% with it": "40, 45"},
                  {"stage": "Up-Down + SCST", "captions of": "Up-Down + SCST", "F1 counts": 0.0, "F1 relations": 12.0, "top relation (seeds)": "right of, right of", "% with it": "83, 100"},
                  ]).to_csv(tmp_path / "table_baselines_scst_captions.csv", index=False)
    t = results_table(tmp_path)
    assert "| GLIED + SCST |" in t and "| GLIED base + SCST |" in t and "(mean baseline)" not in t
    assert "never the start (1 of 2 seeds ended below their start on validation: Up-Down + SCST seed 1)" in t and "keeping the stage's best" in t
    assert "its top relation word): Up-Down 11.1 → 0.0, 9.0 → 12.0, 83–100 %." in t and "Relation words true" not in t
    pd.DataFrame([{"stage": "Up-Down + SCST", "captions of": "Up-Down", "F1 counts": 11.1, "F1 relations": 9.0, "top relation (seeds)": "below, —", "% with it": "40, 0", "% rel. true": 30.0, "% rel. swapped": 29.5},
                  {"stage": "Up-Down + SCST", "captions of": "Up-Down + SCST", "F1 counts": 0.0, "F1 relations": 12.0, "top relation (seeds)": "right of, —", "% with it": "83, 0", "% rel. true": 22.0, "% rel. swapped": 22.5},
                  ]).to_csv(tmp_path / "table_baselines_scst_captions.csv", index=False)
    pd.DataFrame([{"model": "Soft", "seeds": 2, "rel. true": 6.8, "rel. swapped": 6.7, "seeds beating the swap": 0, "p over seeds": 0.9},
                  {"model": "SPCA", "seeds": 3, "rel. true": 9.3, "rel. swapped": 6.4, "seeds beating the swap": 3, "p over seeds": 0.25},
                  {"model": "S", "seeds": 3, "rel. true": 9.0, "rel. swapped": 1.0, "seeds beating the swap": 2, "p over seeds": 0.25},
                  {"model": "k1", "seeds": 1, "rel. true": 9.0, "rel. swapped": 1.0, "seeds beating the swap": 1, "p over seeds": "—"}]
                 ).to_csv(tmp_path / "table_spca_relations.csv", index=False)
    t = results_table(tmp_path)
    assert "with the objects swapped): Up-Down 11.1 → 0.0, 9.0 → 12.0, 83 % (1 of 2 seeds write none), 22.0 vs 22.5 %." in t   # a silent seed is no 0 % share
    assert "in every seed (McNemar): 2 of SPCA's 4 rows (SPCA, 9.3 against 6.4 %, p over its 3 seeds 0.25; k1, 9.0 against 1.0 %, one seed); exploratory" in t
    assert "[`06a_baselines_tables`](06a_baselines_tables.ipynb) sets each stage beside its start" in t


def test_verdict_lines_read_an_empty_caveat_column(tmp_path):
    "The README's verdict lines from a published verdicts table: claims that hold and do not hold named, Holm's survivors marked, the cannot-tells counted; a caveat column with no caveat in it (read back as all-empty floats) reads as no caveat, with no warning from pandas."
    import warnings
    import pandas as pd
    from capbook.book import verdict_lines
    pd.DataFrame([{"claim": "A above B", "verdict": "holds", "Holm": "survives", "caveat": None},
                  {"claim": "C above D", "verdict": "does not hold", "Holm": "", "caveat": None},
                  {"claim": "E above F", "verdict": "cannot tell (p 0.3)", "Holm": "", "caveat": None},
                  ]).to_csv(tmp_path / "table_spca_verdicts.csv", index=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = verdict_lines(tmp_path)
    assert "3 claims: **holds**: A above B (survives Holm); **does not hold**: C above D; cannot tell: 1." in out
    assert "nan" not in out


TIMING = r"(?<!/)\bmin\b|minutes|\bms\b|\bips\b|time|/ ?s$|/s\b|^s / "      # columns of measured time and speed: this machine at that moment


def _published_results(figs: Path) -> dict:
    "A book's published figures (PNG bytes) and tables (CSV, every column but those of time and speed, and the book's own timings table); the reader's notebook copies hold the runs' logs and times, so they are not compared."
    import re
    import pandas as pd
    out = {f.name: f.read_bytes() for f in sorted(figs.glob("*.png"))}
    for f in sorted(figs.glob("table_*.csv")):
        if f.name.startswith("table_book_times"): continue
        df = pd.read_csv(f)
        out[f.name] = df[[c for c in df.columns if not re.search(TIMING, str(c))]].to_csv(index=False)
    return out


def _half_written(root: Path) -> list[str]:
    "Files under `root` that a killed write could have left: temporary files, and JSON, notebooks or checkpoints that do not load."
    import torch
    bad = [str(f) for f in root.rglob("*") if any(part.endswith(".tmp") for part in f.relative_to(root).parts)]
    for f in [*root.rglob("*.json"), *root.rglob("*.ipynb")]:
        try: json.loads(f.read_text())
        except ValueError: bad.append(str(f))
    for f in root.rglob("*.pt"):
        try: torch.load(f, map_location="cpu", weights_only=False)
        except Exception: bad.append(str(f))
    return bad


KILL_PLAN = ["02_show_attend_tell-hard", "02_show_attend_tell-no-gate", "02a_soft_vs_hard"]   # two of a chapter's runs, its assembly step


def _killed_at(p: subprocess.Popen, ready, label: str, seed: int, log: Path, killed: list, runs: Path, poll: float = 0.1):
    "SIGKILL book `p` and its family as soon as `ready()` holds; note what was done then."
    import os, signal, time
    import psutil
    while p.poll() is None and not ready(): time.sleep(poll)
    assert p.poll() is None, f"seed {seed}: the book ended before the kill {label}\n{log.read_text()[-2000:]}"
    family = psutil.Process(p.pid).children(recursive=True)
    os.kill(p.pid, signal.SIGKILL); p.wait()
    psutil.wait_procs(family, timeout=60)                            # its workers and kernels follow it (tested above)
    killed.append((label, sorted(d.parent.name for d in runs.glob("*/done.json") if d.parent.name in KILL_PLAN)))


def _completes_only_the_unfinished(p: subprocess.Popen, log: Path, finished_before: set, why, timeout: float) -> str:
    "The book `p` after its kills ends well, running none of the steps `finished_before` and skipping each as unchanged; its log."
    assert p.wait(timeout=timeout) == 0, log.read_text()[-3000:]
    out = log.read_text()
    ran = {l.split(": ran in ")[0].strip() for l in out.splitlines() if ": ran in " in l}
    assert not ran & finished_before, (why, ran & finished_before)              # nothing finished ran again
    assert all(f"{s}: unchanged, skipped" in out for s in finished_before), why
    return out


def _training_finished(runs: Path) -> bool:
    "Whether some run has finished training but not yet its step: it is scoring (test decoding, METEOR) or drawing."
    import torch
    for last in runs.glob("*/ckpt/last.pt"):
        if (last.parent.parent / "done.json").exists(): continue
        try:
            if torch.load(last, map_location="cpu", weights_only=False).get("finished"): return True
        except Exception: pass                                       # being written
    return False


@pytest.mark.slow
@pytest.mark.xdist_group("book")
@pytest.mark.sampled
def test_a_book_killed_in_every_phase_ends_with_the_same_figures(book, tmp_path):
    "SIGKILL a book (-j 2) of two of a chapter's runs and its assembly step, in a fresh home, in its phases — while it builds its data, while it trains, while it scores, while it publishes, while it builds the site — then let it finish: the same tables and figures as the book fixture's uninterrupted book (whose data was built the same way, one thread), no half-written file, and the last run recomputes only the steps left unfinished. The other runs the assembly step reads are the fixture's, copied in, and so are the keys' fingerprints (the kills are about the book's work). `make test` kills it in one of the five phases, drawn by the seed; `make soak` (CAPBOOK_EVERY=1) in all five, and kills whole books. CAPBOOK_KILL_SEED repeats a draw."
    import os, random, shutil, time
    from capbook.plan import plan, upstream_of
    seed = int(os.environ.get("CAPBOOK_KILL_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    ref_home, _ = book
    home, killed = tmp_path / "killed", []
    runs = home / "runs" / "smoke"
    steps = plan("smoke")
    for s in upstream_of(next(s for s in steps if s.name == KILL_PLAN[-1]), steps):
        if s.name not in KILL_PLAN: shutil.copytree(ref_home / "runs" / "smoke" / s.name, runs / s.name)
    from capbook.core import data_dir
    shutil.copytree(data_dir() / "fingerprints", home / "data" / "fingerprints")     # the fixture's, for today's package
    start = lambda i: (_start_book(home, tmp_path / f"book-{i}.log", "-j", "2", "--only", *KILL_PLAN), tmp_path / f"book-{i}.log")
    def after(cond, delay):                                          # `cond` first held, then `delay` seconds more
        since = []
        return lambda: bool(since or (cond() and since.append(time.time()))) and time.time() - since[0] >= delay
    features = lambda: any((home / "data").glob("features/**/*"))
    phases = [("data", after(lambda: (home / "data" / "shapes").exists(), rng.uniform(0, 4))),
              ("training", after(lambda: any(runs.glob("*/ckpt/tb/*")), rng.uniform(0, 4))),
              ("scoring", after(lambda: _training_finished(runs), rng.uniform(0, 0.5))),
              ("publishing", after(lambda: "one METEOR process scored" in log.read_text(), rng.uniform(0, 0.3))),
              ("the site", after(lambda: "tables, figures and the reader's notebooks" in log.read_text(), rng.uniform(0, 3)))]
    if not os.environ.get("CAPBOOK_EVERY"): phases = [phases[rng.randrange(len(phases))]]
    for i, (phase, ready) in enumerate(phases):
        p, log = start(i)
        _killed_at(p, ready, f"while {phase}" + (f" (features written: {features()})" if phase == "data" else ""), seed, log,
                   killed, runs)
    finished_before = {d.parent.name for d in runs.glob("*/done.json")} & set(KILL_PLAN)     # of the plan: not the copies
    p, log = start(len(phases))
    out = _completes_only_the_unfinished(p, log, finished_before, (seed, killed), timeout=900)
    ref, got = _published_results(ref_home / "runs" / "smoke" / "figures"), _published_results(runs / "figures")
    assert len(got) >= 4 and set(got) <= set(ref), (seed, killed, set(got) - set(ref))
    differ = [n for n in got if got[n] != ref[n]]
    assert not differ, (seed, killed, differ)                    # every score, interval, verdict and figure, bit for bit
    assert not _half_written(home), (seed, killed, _half_written(home))
    assert (runs / "site" / "index.html").exists() and "docs site of 1 page (1 chapter, 0 on the engine)" in out          # 02a's page, the book's one


@pytest.mark.soak                                   # `make soak`: three whole smoke books, ~10 minutes
def test_soak_a_whole_book_killed_at_random_moments_ends_with_the_same_figures(tmp_path):
    "The full-strength variant of `test_a_book_killed_in_every_phase_ends_with_the_same_figures`: SIGKILL a whole smoke book (-j 2) three times at random moments — while it builds data, while it trains and scores, while it publishes or builds the site — then let it finish: the same tables and figures as an uninterrupted book in a fresh home (data built the same way), no half-written file, and the last run recomputes only the steps left unfinished. CAPBOOK_KILL_SEED repeats a draw."
    import os, random, signal, time
    import psutil
    seed = int(os.environ.get("CAPBOOK_KILL_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    ref_home, home = tmp_path / "uninterrupted", tmp_path / "killed"
    runs, killed = home / "runs" / "smoke", []

    def start(h, i, *extra):                                     # each home builds its own data, as a newcomer's does
        log = tmp_path / f"book-{h.name}-{i}.log"
        return _start_book(h, log, "-j", "2", *extra), log

    p, log = start(ref_home, 0, "--no-docs")
    assert p.wait(timeout=1500) == 0, log.read_text()[-3000:]
    ref_secs = float(log.read_text().strip().splitlines()[-1].split()[-2])   # "book regenerated in N s"

    def kill_when(p, log, ready, label):
        t0 = time.time()
        while p.poll() is None and not ready(time.time() - t0, log.read_text()): time.sleep(0.2)
        assert p.poll() is None, f"seed {seed}: the book ended before the kill {label}\n{log.read_text()[-2000:]}"
        family = psutil.Process(p.pid).children(recursive=True)
        os.kill(p.pid, signal.SIGKILL); p.wait()
        psutil.wait_procs(family, timeout=60)                        # its workers and kernels follow it (tested above)
        killed.append((label, sorted(d.parent.name for d in runs.glob("*/done.json"))))

    early, mid, late = rng.uniform(2, 20), rng.uniform(0.2, 0.7) * ref_secs, rng.uniform(0, 4)
    p, log = start(home, 0); kill_when(p, log, lambda t, out: t > early, f"at {early:.0f} s (data)")
    p, log = start(home, 1); kill_when(p, log, lambda t, out: t > mid, f"at {mid:.0f} s (runs)")
    p, log = start(home, 2)
    kill_when(p, log, lambda t, out, s=[]: "one METEOR process scored" in out and
              (s.append(time.time()) or time.time() - s[0] > late), f"{late:.1f} s into publishing")
    finished_before = {d.parent.name for d in runs.glob("*/done.json")}
    p, log = start(home, 3)
    _completes_only_the_unfinished(p, log, finished_before, (seed, killed), timeout=1500)
    ref, got = _published_results(ref_home / "runs" / "smoke" / "figures"), _published_results(runs / "figures")
    assert len(ref) > 30 and sorted(got) == sorted(ref), (seed, killed, set(got) ^ set(ref))
    differ = [n for n in ref if got[n] != ref[n]]
    assert not differ, (seed, killed, differ)                    # every score, interval, verdict and figure, bit for bit
    assert not _half_written(home), (seed, killed, _half_written(home))
    assert (runs / "site" / "index.html").exists()


def _start_book(home_dir: Path, log: Path, *args: str, data: Path | None = None) -> subprocess.Popen:
    "`capbook book --profile smoke ARGS` in the background, in `home_dir` (its data in `data`, e.g. the session's prepared smoke data), output to `log`."
    import os
    env = {**os.environ, "CAPBOOK_HOME": str(home_dir), "CAPBOOK_DATA": str(data or home_dir / "data"), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([str(BIN / "capbook"), "book", "--profile", "smoke", *args], env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def _wait_for(cond, timeout: float = 300, what: str = ""):
    import time
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (v := cond()): return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


TWO_STEPS = ["02_show_attend_tell-none", "06_baselines-nic"]         # two of the smoke book's quickest training runs


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_a_killed_meteor_process_is_replaced_and_scores_stay_exact(book, smoke_data, tmp_path, monkeypatch):
    "The book's shared METEOR (Java) process SIGKILLed while runs score: the runs score through a fresh one, the book finishes, and every METEOR equals that of the same runs in the book fixture's uninterrupted book (same data)."
    import os, signal
    import psutil
    monkeypatch.delenv("CAPBOOK_METEOR", raising=False)                # the book's own Java process, not the test worker's
    p = _start_book(tmp_path / "killed", tmp_path / "book.log", "-j", "2", "--no-docs", "--only", *TWO_STEPS, data=smoke_data)
    me = psutil.Process(p.pid)
    java = _wait_for(lambda: next((c for c in me.children(recursive=True) if "meteor" in _cmd(c).lower()), None),
                     what="the shared METEOR process")
    os.kill(java.pid, signal.SIGKILL)
    assert p.wait(timeout=600) == 0, (tmp_path / "book.log").read_text()[-3000:]
    for step in TWO_STEPS:
        got = json.loads((tmp_path / "killed" / "runs" / "smoke" / step / "record.json").read_text())
        want = json.loads((book[0] / "runs" / "smoke" / step / "record.json").read_text())
        assert "METEOR" not in got.get("notes", {}) and got["metrics"]["METEOR"] == want["metrics"]["METEOR"] > 0, step


def test_a_meteor_that_cannot_score_stops_the_run_instead_of_a_silent_gap(monkeypatch):
    "With Java present, a METEOR failure (its own process too) is one line, not a table without METEOR."
    import shutil
    import capbook.metrics as M
    from capbook.core import CapbookError
    if shutil.which("java") is None: pytest.skip("needs Java (without it METEOR is reported unavailable, tested in test_metrics)")
    def dead(*a): raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(M, "meteor_score", dead)
    with pytest.raises(CapbookError) as e:
        M.coco_scores({1: ["a red circle"]}, {1: "a red circle"}, spice=False)
    assert str(e.value).count("\n") == 0 and "METEOR failed while scoring (BrokenPipeError" in str(e.value)


@pytest.mark.slow
def test_a_killed_kernel_fails_its_step_in_one_line_and_the_rerun_completes(smoke_data, tmp_path):
    "SIGKILL a notebook's kernel (as the out-of-memory killer would) while two steps run: one line names the step and the cause, the other step finishes, and the next book runs only the killed one. Meanwhile a second book on the same home and profile stops at once in one line naming the first (its pid), and the first goes on untouched."
    import os, signal, time
    import psutil
    p = _start_book(tmp_path, tmp_path / "book.log", "-j", "2", "--no-docs", "--only", *TWO_STEPS, data=smoke_data)
    lock = tmp_path / "runs" / "smoke" / ".book.lock"
    _wait_for(lambda: lock.exists() and f"pid {p.pid}" in lock.read_text(), what="the first book's lock")
    second = _start_book(tmp_path, tmp_path / "second.log", "--no-docs", "--only", TWO_STEPS[0], data=smoke_data)
    assert second.wait(timeout=120) == 2 and p.poll() is None
    err = (tmp_path / "second.log").read_text().strip().splitlines()
    assert len(err) == 1 and "another capbook book is running on this home and profile" in err[0] and f"pid {p.pid}" in err[0], err
    me = psutil.Process(p.pid)
    kernels = _wait_for(lambda: (k := [c for c in me.children(recursive=True) if "ipykernel" in _cmd(c)]) and len(k) == 2 and k,
                        what="two kernels")
    time.sleep(3)                                                # inside the notebooks' cells
    os.kill(kernels[0].pid, signal.SIGKILL)
    assert p.wait(timeout=600) == 2
    line = _error_line(tmp_path / "book.log")
    assert "its notebook's kernel died (out of memory, or killed)" in line, line
    dead = next(s for s in TWO_STEPS if f"{s}: its notebook" in line)
    other = next(s for s in TWO_STEPS if s != dead)
    assert (tmp_path / "runs" / "smoke" / other / "done.json").exists(), "the step under way was let finish"
    assert not (tmp_path / "runs" / "smoke" / dead / "done.json").exists()
    p = _start_book(tmp_path, tmp_path / "book2.log", "-j", "2", "--no-docs", "--only", *TWO_STEPS, data=smoke_data)
    assert p.wait(timeout=600) == 0
    out = (tmp_path / "book2.log").read_text()
    assert f"{dead}: ran in" in out and f"{other}: unchanged, skipped" in out     # a later book skips what the first made


def _fill(disk: Path) -> Path:
    "Fill the filesystem of `disk` to the last byte (a file written until ENOSPC); delete the file it returns to give the space back."
    import os
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True: os.write(fd, b"\0" * size)
            except OSError: pass
    finally: os.close(fd)
    return filler


def _error_line(log: Path) -> str:
    lines = [l for l in log.read_text().splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, log.read_text()[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["run", pytest.param("publishing", marks=pytest.mark.soak), pytest.param("docs", marks=pytest.mark.soak)])
def test_a_full_disk_is_one_line_changes_nothing_and_the_next_run_completes(smoke_data, tmp_path, phase):
    "CAPBOOK_HOME on a small tmpfs filled to the last byte during a run (`make test`), during publishing and during the docs build (`make soak`): each stops with one line naming a path and the full disk, the published tables and the site stay as they were, no temporary file is left, and once space is back the same command completes."
    import os
    with _tmpfs(tmp_path / "disk", "size=256m") as disk:
        env = {**os.environ, "CAPBOOK_HOME": str(disk), "CAPBOOK_DATA": str(smoke_data)}
        capbook = lambda log, *a: subprocess.run([str(BIN / "capbook"), *a], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                                 timeout=900).returncode
        book = ["book", "--profile", "smoke"]
        first = [*book, "--only", "01_dataset"] + (["--no-docs"] if phase == "run" else [])   # a site only where a phase could touch it
        assert capbook(tmp_path / "first.log", *first) == 0, (tmp_path / "first.log").read_text()[-3000:]
        figs, site = disk / "runs" / "smoke" / "figures", disk / "runs" / "smoke" / "site" / "index.html"
        snapshot = lambda: ({f: f.read_bytes() for f in figs.rglob("*") if f.is_file()}, site.read_bytes() if site.exists() else None)
        for phase, cmd in [(ph, c) for ph, c in [("run", [*book, "--no-docs", "--only", "02_show_attend_tell-none"]),
                                                 ("publishing", [*book, "--no-docs", "--only", "01_dataset"]),
                                                 ("docs", ["docs", "--profile", "smoke"])] if ph == phase]:
            before = snapshot()
            filler = _fill(disk)
            log = tmp_path / f"{phase}-full.log"
            assert capbook(log, *cmd) == 2, (phase, log.read_text()[-3000:])
            line = _error_line(log)
            assert "no space left on the device" in line and str(disk) in line, (phase, line)
            assert snapshot() == before, phase                   # nothing published changed, the site neither
            assert not _half_written(disk / "runs"), (phase, _half_written(disk / "runs"))
            filler.unlink()
            assert capbook(tmp_path / f"{phase}-again.log", *cmd) == 0, (phase, (tmp_path / f"{phase}-again.log").read_text()[-3000:])


def test_every_row_of_what_survives_what_is_a_test():
    "The site's fault table (`nbs/00n_book`): every row names its test(s), and each is a test of this file."
    import re
    from conftest import notebook_markdown
    root = Path(__file__).resolve().parent.parent
    table = notebook_markdown("00n_book").split("## What survives what", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    rows = [l for l in table.splitlines() if l.startswith("| ") and not l.startswith("| fault")]
    here = (root / "tests" / "test_book.py").read_text()
    assert len(rows) >= 8
    for row in rows:
        names = re.findall(r"`(test_\w+)`", row.rsplit("|", 2)[1])
        assert names and all(f"def {n}(" in here for n in names), row


def test_a_partial_book_keeps_the_time_table_rows_of_the_steps_it_did_not_run(tmp_path, monkeypatch):
    "A book run with `--only` on a clone that has no other run folders: the published time table's rows of the other steps stay; a step run here replaces its row; the total sums both."
    import pandas as pd
    from capbook.book import book_times
    from capbook.core import save_json
    monkeypatch.setenv("CAPBOOK_HOME", str(tmp_path))
    steps = [Step("00_core"), Step("00a_shapes"), Step("00b_data")]
    save_json(tmp_path / "runs" / "smoke" / "00a_shapes" / "done.json", {"key": "k", "seconds": 60.0})
    phases = {k: 0.0 for k in ("data", "train", "val", "test", "measure", "figure")}
    row = lambda step, minutes: {"step": step, "minutes": minutes, **phases, "rest": minutes, "captions / s": None}
    pd.DataFrame([row("00_core", 2.0), row("00a_shapes", 9.0), row("total (one after another)", 11.0)]).to_csv(tmp_path / "t.csv", index=False)
    df = book_times("smoke", steps, tmp_path / "t.csv")
    assert df["step"].tolist() == ["00_core", "00a_shapes", "total (one after another)"]     # 00b_data ran nowhere
    assert df["minutes"].tolist() == [2.0, 1.0, 3.0] and df["rest"].tolist() == [2.0, 1.0, 3.0]
    assert book_times("smoke", steps)["step"].tolist() == ["00a_shapes", "total (one after another)"]   # a whole book: its own runs


def test_the_time_table_names_the_machine_of_each_steps_minutes(tmp_path, monkeypatch):
    "Each row names the machine its minutes were measured on: as its run wrote it, else (a row kept from a table from before the column) the machine the old table's line named; the last line gives each machine's share, and the README's time sentence names the machine of most minutes."
    import pandas as pd
    from capbook.book import _timed_on, book_times, machines_line
    from capbook.core import save_json
    monkeypatch.setenv("CAPBOOK_HOME", str(tmp_path))
    steps = [Step("00_core"), Step("00a_shapes"), Step("00b_data")]
    save_json(tmp_path / "runs" / "smoke" / "00a_shapes" / "done.json", {"key": "k", "seconds": 60.0, "machine": "Here CPU, 2 cores"})
    save_json(tmp_path / "runs" / "smoke" / "00b_data" / "done.json", {"key": "k", "seconds": 30.0})      # from before the machine was kept
    pd.DataFrame([{"step": "00_core", "minutes": 20.0}, {"step": "total (one after another)", "minutes": 20.0}]).to_csv(tmp_path / "t.csv", index=False)
    (tmp_path / "t.md").write_text("| step |\n\nMachine: Old CPU, 2 cores (the one that published this table).\n")
    (tmp_path / "table_book_times.md").write_text((tmp_path / "t.md").read_text())
    (tmp_path / "t.csv").rename(tmp_path / "table_book_times.csv")
    df = book_times("smoke", steps, tmp_path / "table_book_times.csv")
    assert df["machine"].tolist()[:3] == ["Old CPU, 2 cores", "Here CPU, 2 cores", "Old CPU, 2 cores"] and pd.isna(df["machine"].iloc[3])
    assert machines_line(df) == ("Machines: Old CPU, 2 cores (20.5 minutes, 2 steps); Here CPU, 2 cores (1.0 minutes, 1 step). "
                                 "Each step's minutes are as it last ran, on the machine its row names.")
    assert machines_line(df[df["step"] != "00a_shapes"]) == "Machine: Old CPU, 2 cores (each step's minutes are as it last ran)."
    df.to_csv(tmp_path / "table_book_times.csv", index=False)
    assert _timed_on(tmp_path) == "Old CPU, 2 cores"                       # the machine of most minutes



def test_a_resumed_runs_time_row_counts_every_process_of_its_training(tmp_path, monkeypatch):
    "A run killed and resumed from its checkpoint: its last execution took 2 minutes, its training and validation 12 over both processes; the time table counts the 12 (never a negative rest)."
    from capbook.book import book_times
    from capbook.core import save_json
    monkeypatch.setenv("CAPBOOK_HOME", str(tmp_path))
    d = tmp_path / "runs" / "smoke" / "02_show_attend_tell"
    save_json(d / "done.json", {"key": "k", "seconds": 120.0})
    save_json(d / "record.json", {"timings": {"train_s": 600.0, "val_s": 120.0, "test_s": 6.0}})
    row = book_times("smoke", [Step("02_show_attend_tell", {"profile": "smoke"})]).iloc[0]
    assert row["minutes"] == 12.1 and row["train"] == 10.0 and row["val"] == 2.0 and row["rest"] == 0.0, row.to_dict()
    save_json(d / "done.json", {"key": "k", "seconds": 900.0})                   # run through: its own minutes
    row = book_times("smoke", [Step("02_show_attend_tell", {"profile": "smoke"})]).iloc[0]
    assert row["minutes"] == 15.0 and abs(row["rest"] - 2.9) < 1e-9, row.to_dict()

def test_a_step_job_runs_with_its_resources_and_leaves_the_signals_as_they_were(monkeypatch, tmp_path):
    "A job's step sees its resources: its CPUs as intra-op threads; several GPUs as CAPBOOK_TRAIN_PROCS (its run trains under torchrun, one process a GPU), none as none; submitit is asked for the GPUs; the job's signal handlers are the ones it had once the step returns; a malformed sacct interval stops in one line."
    import os, signal
    from capbook import cluster
    seen = []
    def run_step(step, profile, force, log, key, training=None):
        seen.append((os.environ.get("CAPBOOK_TRAIN_PROCS"), os.environ["OMP_NUM_THREADS"], signal.getsignal(signal.SIGTERM) is not before))
        return tmp_path / "out.ipynb", True
    for k in ("CAPBOOK_TRAIN_PROCS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CAPBOOK_METEOR"): monkeypatch.setenv(k, "9")   # restored after
    before = signal.getsignal(signal.SIGTERM)
    assert cluster._step_call(run_step, Step("02_show_attend_tell"), "smoke", False, "k", 4, 2)[:3] == ("ok", str(tmp_path / "out.ipynb"), True)
    assert cluster._step_call(run_step, Step("02_show_attend_tell"), "smoke", False, "k", 1, 1)[0] == "ok"
    assert seen == [("2", "4", True), (None, "1", True)] and signal.getsignal(signal.SIGTERM) is before
    assert "CAPBOOK_METEOR" not in os.environ                            # the host's METEOR socket: not on a node
    assert cluster.SlurmPool("paper", cluster.executor_config(None, "paper"), tmp_path, run_step).parameters("02_show_attend_tell")["gpus_per_node"] == 1
    monkeypatch.setenv("CAPBOOK_SACCT_S", "soon")
    with pytest.raises(CapbookError, match="CAPBOOK_SACCT_S='soon' is invalid"): cluster.sacct_interval()


def test_a_jobs_sbatch_script_is_written_where_no_slurm_client_is_installed(monkeypatch, tmp_path):
    "`SlurmPool.script` (a dry run's scripts, 00nb_cluster's example) on a machine without `srun` (a reader's laptop, a fresh clone's book): the same script as where SLURM is, and submitit's check left as it was after."
    import shutil
    from submitit.slurm.slurm import SlurmExecutor
    from capbook import cluster
    pool = lambda: cluster.SlurmPool("default", cluster.executor_config(None, "default"), tmp_path, print, cluster="slurm")
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: which(name, *a, **k) or ("/usr/bin/srun" if name == "srun" else None))
    there = pool().script("03_spca-k5")                                 # a SLURM client installed
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "srun" else which(name, *a, **k))
    with pytest.raises(RuntimeError, match="srun"): SlurmExecutor(tmp_path)   # submitit's own check, untouched
    here = pool().script("03_spca-k5")
    assert here == there and "#SBATCH --cpus-per-task=2" in here and SlurmExecutor.affinity() == -1


SLURM_STEPS = ["02_show_attend_tell-none", "02a_soft_vs_hard"]       # a training run and the tables step that reads it
SLURM_CANCELLED = "02_show_attend_tell-hard"                          # the training run whose job is requeued, then cancelled


@pytest.fixture(scope="module")
def slurm_book(book, tmp_path_factory):
    "The fixture's smoke book copied to a home of its own with `SLURM_STEPS` unmade, an executor config (one CPU a job: two side by side, as make test's two workers) and a one-node SLURM cluster to make them with: (home, environment, cluster)."
    import os, shutil
    from slurmcluster import one_node_slurm
    home, _ = book
    copy = tmp_path_factory.mktemp("slurm-home")
    shutil.copytree(home / "runs", copy / "runs", ignore=shutil.ignore_patterns("site", "slurm"))
    for s in SLURM_STEPS: shutil.rmtree(copy / "runs" / "smoke" / s)
    (copy / "slurm.yaml").write_text("cpus: 1\nmem_gb: 2\n")
    # a requeued job may start again 5 s after (cred_expire); a job that ends without a result is seen within 2 s (sacct)
    with one_node_slurm(tmp_path_factory.mktemp("slurm"), cred_expire=5) as cluster:
        yield copy, {**os.environ, **cluster.env, "CAPBOOK_HOME": str(copy), "CAPBOOK_SACCT_S": "2", "CAPBOOK_QUEUE_S": "4"}, cluster


def _slurm_book(env: dict, *only: str, ctrl_c: bool = False, argv: bool = False, options: tuple = ()) -> subprocess.Popen | list[str]:
    "A SLURM book of the `only` steps, with `options`; `ctrl_c`: with SIGINT's default action (a pytest-xdist worker ignores it, and so would the book); `argv`: its command line alone."
    import signal
    cmd = [str(BIN / "capbook"), "book", "--profile", "smoke", "--no-docs", "--executor", "slurm",
           "--executor-config", str(Path(env["CAPBOOK_HOME"]) / "slurm.yaml"), *options, "--only", *only]
    if argv: return cmd
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if ctrl_c else None)


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_slurm_job_requeued_resumes_and_cancelled_ends_the_book_in_one_line(slurm_book):
    "A training step's job requeued mid-training (`scontrol requeue`: what a preemption, or submitit at the time limit, does) starts again under its id and resumes the run from its checkpoint, the book saying so when it sees it, and saying at a steady interval how its queue stands; cancelled then (scancel), it ends the book with one line naming the step, the job, its state and its log; Ctrl-C, SIGTERM and SIGHUP on the book run again each cancel the job it submitted, in one line naming it. (The next test's book finishes the step.)"
    import shutil, signal, time
    home, env, cluster = slurm_book
    step, runs = SLURM_CANCELLED, home / "runs" / "smoke" / SLURM_CANCELLED
    shutil.rmtree(runs)
    def until(cond, what: str, timeout: float = 300):
        t0 = time.time()
        while not cond():
            assert p.poll() is None and time.time() - t0 < timeout, f"{what}: {p.communicate()[0][-3000:] if p.poll() is not None else 'timed out'}"
            time.sleep(0.05)
    p = _slurm_book(env, f"={step}")
    until(lambda: (runs / "ckpt" / "last.pt").exists(), "a checkpoint")
    job = next(l.split()[0] for l in cluster.run("squeue", "-h", "-o", "%A %j").stdout.split("\n") if l.endswith(f"capbook-{step}"))
    cluster.run("scontrol", "requeue", job)
    until(lambda: len(list((runs / "ckpt" / "tb").glob("events*"))) >= 2, "the requeued job resuming")   # the resumed run's curves
    cluster.run("scancel", job)
    out = p.communicate(timeout=300)[0]
    assert p.returncode != 0, out[-3000:]
    line = next(l for l in out.splitlines() if f"SLURM job {job}" in l)
    assert f"{step}: SLURM job {job} ended CANCELLED" in line, line
    assert (log := re.search(r"log: (\S+)", line)) and Path(log[1]).exists(), line
    log_path, t0 = Path(log[1]).with_suffix(".out"), time.time()
    while log_path.read_text().count("signal SIGTERM: the job ends here") < 2 and time.time() - t0 < 30:
        time.sleep(0.2)                                               # the job may still be writing as the queue reports it ended
    job_log = log_path.read_text()
    assert job_log.count("Starting with JobEnvironment") == 2 and job_log.count("signal SIGTERM: the job ends here") == 2, job_log
    assert not (runs / "done.json").exists()
    assert re.search(rf"{step}: job {job} requeued \(1 time so far\): it resumes from its checkpoint", out), out
    assert re.search(rf"queue at [\d:]+: 1 running \({step} [\d:]+\)", out), out         # the queue's status line
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):        # Ctrl-C; a `timeout`, the book's own job cancelled; a closed shell
        p = _slurm_book(env, f"={step}", ctrl_c=sig == signal.SIGINT)
        for l in p.stdout:
            if m := re.search(rf"{step}: job (\d+) submitted", l): break
        assert m, "no job submitted"
        p.send_signal(sig)
        out = p.communicate(timeout=120)[0]
        said = "interrupted" if sig == signal.SIGINT else f"ended by {sig.name}"
        assert p.returncode == 128 + sig and f"cancelled 1 SLURM jobs: {m[1]}" in out and f"{said}: what finished is kept" in out, out
        t0 = time.time()
        while m[1] in cluster.run("squeue", "-h", "-o", "%A").stdout.split(): time.sleep(0.2); assert time.time() - t0 < 30, "the job still queued"
        assert json.loads((home / "runs" / "smoke" / "slurm" / "jobs.json").read_text()) == {}     # nothing left for the next book to adopt


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_slurm_refusals_are_one_line_naming_their_cause(slurm_book, tmp_path, monkeypatch, capfd):
    "Against the real cluster, each refusal is one line naming its cause: an sbatch option sbatch does not know (its own words folded in, nothing of them printed besides), a job no node can ever start (cancelled, with SLURM's reason), a failed `setup:` line (the line names the log its words went to), no SLURM configuration, no sacct."
    import shutil
    from capbook.book import run_step
    from capbook.cluster import SlurmPool, executor_config
    from capbook.plan import plan
    home, env, cluster = slurm_book
    for k, v in cluster.env.items(): monkeypatch.setenv(k, v)
    monkeypatch.setenv("CAPBOOK_HOME", str(home))
    step = next(s for s in plan("smoke") if s.name == SLURM_STEPS[0])
    def pool(config: str) -> SlurmPool:
        (tmp_path / "c.yaml").write_text(config)
        return SlurmPool("smoke", executor_config(tmp_path / "c.yaml", "smoke"), tmp_path / "slurm", run_step, sacct_s=1, log=lambda _: None)
    with pool("cpus: 1\nmem_gb: 1\nsbatch: {qoss: high}\n") as p, pytest.raises(CapbookError) as refused: p.submit_step(step, "k")
    assert str(refused.value) == (f"{step.name}: sbatch refused its job (sbatch: unrecognized option '--qoss=high'); "
                                  f"check the sbatch option 'qoss' in {tmp_path / 'c.yaml'}")
    assert "sbatch" not in capfd.readouterr().err                     # sbatch's words are in the line, not printed besides it
    with pool("cpus: 99\nmem_gb: 1\n") as p: never = p.submit_step(step, "k").exception(timeout=120)
    assert re.fullmatch(rf"{step.name}: SLURM job \d+ can never start: PartitionConfig \(it asks for more CPUs, memory or GPUs than "
                        rf"a node of its partition has\); it was cancelled: change its resources in the executor config \(\S+c.yaml\)", str(never)), never
    with pool("cpus: 1\nmem_gb: 1\nsetup: ['echo the set-up failed here', 'exit 3']\n") as p: failed = p.submit_step(step, "k").exception(timeout=120)
    assert re.fullmatch(rf"{step.name}: SLURM job \d+ ended FAILED .*; log: (\S+_0_log.out)", str(failed)), failed
    assert "the set-up failed here" in Path(str(failed).rsplit("log: ", 1)[1]).read_text()    # the log it names holds the words
    monkeypatch.delenv("SLURM_CONF")
    with pytest.raises(CapbookError, match=r"^--executor slurm: SLURM finds no configuration here \(SLURM_CONF is not set; squeue: .*\); "
                                           r"set SLURM_CONF to the cluster's slurm.conf"): pool("cpus: 1\n").__enter__()
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    bare = tmp_path / "bin"; bare.mkdir()
    for cmd in ("sbatch", "squeue", "scancel"): (bare / cmd).symlink_to(shutil.which(cmd))
    monkeypatch.setenv("PATH", str(bare))
    with pytest.raises(CapbookError, match=r"^--executor slurm: sacct is not on PATH \(SLURM's accounting: the book reads how each job ended from it\)"):
        pool("cpus: 1\n").__enter__()


@pytest.mark.slow
@pytest.mark.xdist_group("book")
def test_slurm_book_finishes_what_is_unfinished_with_the_local_books_results(book, slurm_book, monkeypatch):
    "The book run through SLURM again finishes only its unfinished steps — a training run, the tables step that reads it, and the run the previous test cancelled, resumed from its checkpoint — each a job with the executor config's resources, in the plan's order, and publishes what the local book published: the same figures' bytes, tables and records (measured times aside). A dry run first shows each job's sbatch script and submits nothing. The first book is SIGKILLed once its training jobs are queued: its record names them, a duplicate job of one of them stops in one line naming the live writer, and the next book waits for the recorded jobs instead of submitting them again."
    import os, signal, time
    from capbook.book import run_step
    from capbook.cluster import SlurmPool, executor_config
    from capbook.plan import plan
    from capbook.records import read_record
    local, _ = book
    home, env, cluster = slurm_book
    steps = [SLURM_CANCELLED, *SLURM_STEPS]
    unfinished = [s for s in steps if not (home / "runs" / "smoke" / s / "done.json").exists()]
    assert set(SLURM_STEPS) <= set(unfinished)
    record = home / "runs" / "smoke" / "slurm" / "jobs.json"
    dry = subprocess.run(_slurm_book(env, *[f"={s}" for s in steps], argv=True, options=("--dry-run",)), env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    for s in unfinished:
        script = dry.stdout.split(f"  {s}: would run", 1)[1].split("\n  0")[0]
        assert "#SBATCH --cpus-per-task=1" in script and "#SBATCH --mem=2GB" in script and f"slurm/{s}/%j_0_log.out" in script, dry.stdout
    assert f"dry run: {len(unfinished)} of {len(steps)} steps would run; nothing was submitted" in dry.stdout, dry.stdout
    assert not cluster.run("squeue", "-h", "-o", "%A").stdout.split()
    twin = SLURM_STEPS[0]                                              # trained from scratch: its job runs a while
    p = _slurm_book(env, f"={twin}")                                   # one job: a CPU of the node left for the twin
    first = []
    for l in p.stdout:
        first.append(l)
        if m := re.search(rf"  {twin}: job (\d+) submitted", l): break
    assert m, "".join(first)
    ids, t0 = {twin: m[1]}, time.time()
    held = lambda f: f"SLURM job {m[1]}," in (f.read_text() if f.exists() else "")
    while not held(home / "runs" / "smoke" / twin / ".ckpt.writer.lock"):   # until its training holds the checkpoint folder
        assert time.time() - t0 < 180, "the job never started training"; time.sleep(0.1)
    assert held(home / "runs" / "smoke" / twin / ".writer.lock")         # (its step holds the run folder from the start)
    cluster.run("scontrol", "suspend", ids[twin])                      # held still mid-training (its processes stopped), its locks held: no race below
    os.kill(p.pid, signal.SIGKILL); p.wait()                           # killed outright: no chance to cancel its job
    assert {s: e["job"] for s, e in json.loads(record.read_text()).items()} == ids, "".join(first)
    for k, v in cluster.env.items(): monkeypatch.setenv(k, v)          # a second job on the step the live one is writing
    monkeypatch.setenv("CAPBOOK_HOME", str(home))
    with SlurmPool("smoke", executor_config(home / "slurm.yaml", "smoke"), home / "runs" / "smoke" / "slurm-twin", run_step, sacct_s=1, log=lambda _: None) as pool:
        refused = pool.submit_step(next(s for s in plan("smoke") if s.name == twin), "another key").exception(timeout=300)
    assert re.fullmatch(rf"\S+/runs/smoke/{twin}: another book step is writing this folder \(pid \d+ on \S+, SLURM job {ids[twin]}, since [\d: -]+\); .*", str(refused)), refused
    p = _slurm_book(env, *[f"={s}" for s in steps])
    seen = []
    for l in p.stdout:                                                 # the recorded job adopted while it is held still ...
        seen.append(l)
        if f"{twin}: waiting for job {ids[twin]}" in l: break
    cluster.run("scontrol", "resume", ids[twin])                       # ... then let go: the book waits for it to finish
    out = "".join(seen) + p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    assert f"{twin}: job {ids[twin]} of an earlier book that ended without cancelling it is still SUSPENDED" in out and f"{twin}: waiting for job {ids[twin]}" in out, out
    assert re.search(rf"{twin}: job {ids[twin]} submitted \(1 CPUs, 2 GB, 20 min\); log: \S+/slurm/{twin}/{ids[twin]}_0_log.out", "".join(first)), first
    for s in steps:
        if s in unfinished:
            assert re.search(rf"{s}: ran in [\d.]+ s \(job \d+\)", out), out
            if s != twin: assert re.search(rf"{s}: job \d+ submitted \(1 CPUs, 2 GB, 20 min\)", out), out
        else: assert f"{s}: unchanged, skipped" in out, out
    assert f"{twin}: job" not in out.replace(f"{twin}: job {ids[twin]} of", "")   # the adopted step: not submitted again
    assert json.loads(record.read_text()) == {}
    assert "METEOR process scored" not in out                          # each job scored on its node, not through this machine
    if SLURM_CANCELLED in unfinished:                                  # from its checkpoint, not from scratch
        kept = (home / "runs" / "smoke" / SLURM_CANCELLED / "02_show_attend_tell.ipynb").read_text()
        assert re.search(r"resumed from \S+ckpt/last.pt at epoch \d+, batch \d+", kept), kept[-2000:]
    figs, local_figs = home / "runs" / "smoke" / "figures", local / "runs" / "smoke" / "figures"
    assert _published_results(figs) == _published_results(local_figs)
    untimed = lambda r: {"metrics": r["metrics"], "history": [{k: v for k, v in e.items() if not k.endswith("_s")} for e in r["history"]]}
    for s in (SLURM_CANCELLED, SLURM_STEPS[0]):
        rec, local_rec = (read_record(f / "records" / f"{s}.json.gz") for f in (figs, local_figs))
        assert json.dumps(untimed(rec), sort_keys=True) == json.dumps(untimed(local_rec), sort_keys=True)   # as JSON: NaN where no attention is measured
