"The one trainer: exact resume after SIGKILL, vocabulary check on resume, DistributedDataParallel on gloo."
import json, os, signal, subprocess, sys, time
import numpy as np
from pathlib import Path
import pytest
import torch
from capbook.core import CapbookError, load_torch, save_torch
from capbook.models import build
from dataclasses import replace
from capbook.train import TrainConfig, fit

BIN = Path(sys.executable).parent


def train_cmd(run_dir, epochs=2, extra=()):
    return [str(BIN / "capbook"), "train", "--profile", "smoke", "--run-dir", str(run_dir), "--epochs", str(epochs),
            "--ckpt-every", "7", *extra]


def run_json(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sigkill_and_resume_gives_the_same_numbers(smoke, tmp_path):
    "Killed and resumed, a run gives the numbers of the run trained through; the first trains while the other core is busy, which must not change its arithmetic or its numbers."
    import yaml
    from capbook.core import cpu_precision
    # the other core busy: niced, so that under `make test` it takes only what the other test worker leaves idle
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19))
    try: full = run_json(train_cmd(tmp_path / "full"))
    finally: burner.kill(); burner.wait()
    # start the same run, kill it hard as soon as its first (mid-epoch) checkpoint exists, then restart it
    proc = subprocess.Popen(train_cmd(tmp_path / "killed"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = tmp_path / "killed" / "ckpt" / "last.pt"
    t0 = time.time()
    while not last.exists() and proc.poll() is None and time.time() - t0 < 300: time.sleep(0.05)
    assert proc.poll() is None, "run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL); proc.wait()
    assert load_torch(last)["finished"] is False
    resumed = run_json(train_cmd(tmp_path / "killed"))
    assert resumed["resumed_from"] is not None
    clock = lambda hist: [{k: v for k, v in h.items() if k != "train_s"} for h in hist]   # wall-clock time differs
    assert clock(resumed["history"]) == clock(full["history"])
    for run in (full, resumed):                    # each epoch's cumulative training time, increasing
        t = [h["train_s"] for h in run["history"]]
        assert all(0 < a < b for a, b in zip(t, t[1:]))
    assert resumed["param_checksum"] == full["param_checksum"]
    assert resumed["best_score"] == full["best_score"]
    assert resumed["precision"] == full["precision"] == cpu_precision("auto", torch.device("cpu"))   # the CPU's flags decide
    assert yaml.safe_load((tmp_path / "full" / "params.yaml").read_text())["train"]["precision"] == full["precision"]    # written, resolved


def one_epoch(data, ckpt_dir, **kw):
    "Train a fresh soft-attention model for one epoch of `data` into `ckpt_dir`; return it and its config for a second fit."
    torch.manual_seed(0)
    m = build("sat_soft", len(data.vocab), data.feat_shape[1], data.grid)
    cfg = TrainConfig(epochs=1, lr=1e-3, ema=0.0, progress=False, max_len=data.max_len, **kw)   # the smoke book's rate, the live weights
    fit(m, data, cfg, ckpt_dir, log=lambda s: None)
    return m, cfg


@pytest.fixture(scope="module")
def tiny():
    "The keys' fixed 14-image data set (`capbook.results.probe_data`): enough for the trainer's bookkeeping, in a second."
    from capbook.results import probe_data
    return probe_data()


def test_resume_with_another_vocabulary_is_an_error(tiny, tmp_path):
    m, cfg = one_epoch(tiny, tmp_path / "ckpt", batch_size=4)
    ck = load_torch(tmp_path / "ckpt" / "last.pt")
    assert ck["finished"] and ck["vocab"] == tiny.vocab.itos
    ck["vocab"] = ck["vocab"][:-1] + ["zebra"]
    save_torch(tmp_path / "ckpt" / "last.pt", ck)
    with pytest.raises(CapbookError, match="different vocabulary"):
        fit(m, tiny, cfg, tmp_path / "ckpt", log=lambda s: None)


@pytest.mark.slow
def test_ddp_two_cpu_processes(smoke, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(BIN / "capbook"), "train",
           "--profile", "smoke", "--run-dir", str(tmp_path / "ddp"), "--epochs", "1", "--batch-size", "32"]
    out = run_json(cmd, env)
    assert out["world_size"] == 2 and len(out["history"]) == TrainConfig.evals_per_epoch      # one epoch's validations
    ck = load_torch(tmp_path / "ddp" / "ckpt" / "best.pt")
    m = build("sat_soft", len(smoke.vocab), smoke.feat_shape[1], smoke.grid)
    m.load_state_dict(ck["model"])
    assert abs(sum(float(p.detach().double().sum()) for p in m.parameters()) - out["param_checksum"]) < 1e-6


def test_an_unfinished_checkpoint_of_other_processes_is_moved_aside_a_finished_one_is_read(tiny, tmp_path):
    "DDP's batch is every process's: a run left unfinished by 2 processes is never resumed by 1 (it trains again, the old folder kept); a finished one is read, and the result names the processes that trained it."
    m, cfg = one_epoch(tiny, tmp_path / "ckpt", batch_size=4)
    ck = load_torch(tmp_path / "ckpt" / "last.pt")
    assert ck["world_size"] == 1 and ck["finished"]
    save_torch(tmp_path / "ckpt" / "last.pt", {**ck, "world_size": 2})
    res = fit(m, tiny, cfg, tmp_path / "ckpt", log=lambda s: None)
    assert res.resumed_from == (1, 0) and res.world_size == 2                       # finished: read, not trained
    save_torch(tmp_path / "ckpt" / "last.pt", {**ck, "world_size": 2, "finished": False, "epoch": 0, "batches_done": 3})
    lines = []
    res = fit(m, tiny, cfg, tmp_path / "ckpt", log=lines.append)
    assert res.resumed_from is None and res.world_size == 1 and "trained by 2 processes, this run has 1" in lines[0]
    assert load_torch(tmp_path / "ckpt.world-2" / "last.pt")["batches_done"] == 3                              # nothing lost


@pytest.mark.slow
def test_a_chapter_run_trains_under_torchrun_when_its_job_has_several_processes(smoke, tmp_path, monkeypatch):
    "With CAPBOOK_TRAIN_PROCS=2 (a SLURM job with 2 GPUs sets it), `run_chapter` trains every stage (cross-entropy, then self-critical) under torchrun — here 2 CPU processes over gloo —, then reads the finished checkpoints: its own process trains nothing; the record names the processes."
    from capbook.profiles import chapter
    from capbook.runner import run_chapter
    monkeypatch.setenv("CAPBOOK_TRAIN_PROCS", "2"); monkeypatch.setenv("OMP_NUM_THREADS", "2")
    nb = "02_show_attend_tell"
    lines = []
    ctx = run_chapter(nb, chapter(nb).params(profile="smoke", scst_epochs=1, run_dir=str(tmp_path / "run")), log=lines.append)
    assert ctx.record["world_size"] == 2 and ctx.fitted.resumed_from == (1, 0)
    for stage in ("ckpt", "ckpt-scst"):
        ck = load_torch(tmp_path / "run" / stage / "last.pt")
        assert ck["world_size"] == 2 and ck["finished"]
    assert any(line.startswith("training under torchrun: 2 processes") for line in lines)
    assert "continuing" in (tmp_path / "run" / "torchrun.log").read_text()          # the self-critical stage trained there
    assert sum(line.startswith("resumed from") for line in lines) == 2               # the kernel read both stages, trained neither


def test_a_malformed_process_count_stops_in_one_line(monkeypatch):
    from capbook.profiles import train_procs
    monkeypatch.setenv("CAPBOOK_TRAIN_PROCS", "two")
    with pytest.raises(CapbookError, match="CAPBOOK_TRAIN_PROCS='two' is invalid"): train_procs()


def test_checkpoint_of_other_code_is_moved_aside_not_resumed(tiny, tmp_path):
    m, cfg = one_epoch(tiny, tmp_path / "ckpt", batch_size=4)
    ck = load_torch(tmp_path / "ckpt" / "last.pt")
    ck["code"] = "0ldc0de"
    save_torch(tmp_path / "ckpt" / "last.pt", ck)
    res = fit(m, tiny, cfg, tmp_path / "ckpt", log=lambda s: None)
    assert res.resumed_from is None and len(res.history) == cfg.evals_per_epoch   # trained again (one epoch), not resumed
    assert load_torch(tmp_path / "ckpt.code-0ldc0de" / "last.pt")["code"] == "0ldc0de"   # nothing lost


def test_a_book_steps_checkpoint_resumes_under_its_key_after_an_edit_elsewhere(tiny, tmp_path, monkeypatch):
    "A book step's unfinished run is kept, like its finished one, while the step's key is unchanged; a run by hand (no key) keeps the package's rule."
    from capbook.train import STEP_KEY
    monkeypatch.setenv(STEP_KEY, "k1")
    m, cfg = one_epoch(tiny, tmp_path / "ckpt", batch_size=4)
    stale = lambda: save_torch(tmp_path / "ckpt" / "last.pt", {**load_torch(tmp_path / "ckpt" / "last.pt"), "code": "0ldc0de"})
    stale()
    logs = []
    res = fit(m, tiny, cfg, tmp_path / "ckpt", log=logs.append)
    assert res.resumed_from is not None and any("same book step (k1; code 0ldc0de" in s for s in logs)
    stale(); monkeypatch.delenv(STEP_KEY)                                        # by hand: the package's hash decides
    res = fit(m, tiny, cfg, tmp_path / "ckpt", log=lambda s: None)
    assert res.resumed_from is None and (tmp_path / "ckpt.code-0ldc0de").exists()
    assert load_torch(tmp_path / "ckpt" / "last.pt")["step_key"] is None


@pytest.mark.slow
def test_a_stage_validates_its_start_for_the_history_and_keeps_its_own_best(smoke, tmp_path):
    "The starting (cross-entropy) weights are validated first, as epoch -1, and never kept: even a stage that wrecks the model returns its own weights."
    from capbook.objectives import SelfCritical
    from capbook.train import val_score
    m, cfg = one_epoch(smoke, tmp_path / "xe")
    start = val_score(m, smoke.val, smoke.vocab, cfg, torch.device("cpu"))["CIDEr"]
    sc = SelfCritical(smoke.vocab, smoke.train.refs, n=2, max_len=smoke.max_len)
    bad = TrainConfig(epochs=1, lr=0.5, lr_gamma=1.0, metric="CIDEr", batch_order="image", validate_start=True,
                      ema=0.0, evals_per_epoch=1, progress=False, max_len=smoke.max_len)   # a rate that wrecks the model
    res = fit(m, smoke, bad, tmp_path / "scst", log=lambda s: None, objective=sc)
    assert res.history[0]["epoch"] == -1 and res.history[0]["val CIDEr"] == start
    assert res.best_epoch == 0 and res.best_score == res.history[1]["val CIDEr"]     # never the start (epoch -1), better or not
    assert val_score(m, smoke.val, smoke.vocab, bad, torch.device("cpu"))["CIDEr"] == res.best_score   # the stage's own weights


@pytest.mark.slow
def test_a_continued_stage_keeps_its_start_where_a_cold_restart_falls(smoke, tmp_path):
    "Self-critical training after cross-entropy at the rate cross-entropy ended at (the smoke profile's constant 1e-3): a fresh Adam's first sign-sized steps drop the first evaluation's validation CIDEr by more than the seeds' spread of the start; the stage that continues the run's Adam moments and warms its rate up does not."
    from capbook.objectives import SelfCritical
    starts, drops = [], {"cold": [], "continued": []}
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        m = build("sat_soft", len(smoke.vocab), smoke.feat_shape[1], smoke.grid)
        cfg = TrainConfig(epochs=2, lr=1e-3, progress=False, max_len=smoke.max_len, seed=seed, log_every=0, val_beam=1)
        fit(m, smoke, cfg, tmp_path / f"xe{seed}", log=lambda s: None)
        xe = {k: v.clone() for k, v in m.state_dict().items()}
        steps = smoke.train.num_batches(cfg.batch_size, 1, 0, seed, order="image", max_words=0) // 4
        for how in drops:
            m.load_state_dict(xe)
            sc = SelfCritical(smoke.vocab, smoke.train.refs, n=5, max_len=smoke.max_len)
            scfg = replace(cfg, epochs=1, schedule="step", lr_gamma=1.0, warmup=0.0 if how == "cold" else 1.0, batch_order="image",
                           validate_start=True, evals_per_epoch=4, max_steps=steps)                  # to its first evaluation
            r = fit(m, smoke, scfg, tmp_path / f"{how}{seed}", log=lambda s: None, objective=sc,
                    start=None if how == "cold" else tmp_path / f"xe{seed}" / "last.pt")
            drops[how].append(r.history[0]["val CIDEr"] - r.history[1]["val CIDEr"])
        starts.append(r.history[0]["val CIDEr"])
    spread = float(np.std(starts, ddof=1))
    assert max(drops["cold"]) > spread, (drops, spread)                   # the smoke run reproduces the drop ...
    assert max(drops["continued"]) < spread / 4, (drops, spread)          # ... and the continued stage has none


def test_the_self_critical_stage_continues_its_start_and_selects_greedily(monkeypatch, tmp_path):
    "runner.self_critical trains the whole budget on a rate warmed up to a constant, validated greedily, continuing the cross-entropy run's optimiser."
    import capbook.train, capbook.metrics
    from types import SimpleNamespace
    from capbook.stages import self_critical
    from capbook.profiles import SCST_WARMUP
    seen = {}
    monkeypatch.setattr(capbook.train, "fit", lambda model, prep, cfg, *a, **k: seen.update(cfg=cfg, **k))
    monkeypatch.setattr(capbook.metrics, "evaluate", lambda *a, **k: seen.setdefault("beams", []).append(k["beam_size"]) or {})
    monkeypatch.setattr("capbook.objectives.SelfCritical", lambda *a, **k: None)
    p = SimpleNamespace(scst_epochs=2, scst_lr=5e-5, scst_baseline="greedy", device="cpu", beam_size=3, length_norm=0.0, no_repeat_ngram=0)
    prep = SimpleNamespace(vocab=None, train=SimpleNamespace(refs=[], n_images=0), max_len=5)
    self_critical(torch.nn.Linear(1, 1), prep, p, TrainConfig(schedule="noam", warmup=3.0), tmp_path, log=lambda s: None, start=tmp_path / "last.pt")
    c = seen["cfg"]
    assert c.validate_start and c.schedule == "step" and c.warmup == SCST_WARMUP > 0 and c.lr_gamma == 1.0 and c.metric == "CIDEr"
    assert c.val_beam == 1 and c.patience == 0 and c.epochs == 2 and seen["start"] == tmp_path / "last.pt"
    assert seen["beams"] == [3, 1]                              # tested under the run's beam, and greedily beside it


@pytest.mark.slow
def test_a_run_started_from_its_saved_yaml_is_unchanged(smoke, tmp_path):
    "capbook train --config: a run folder's params.yaml repeats the run (no training), an edited one trains anew."
    import yaml
    conf = tmp_path / "mine.yaml"
    conf.write_text(yaml.safe_dump({"model": "sat_soft", "profile": "smoke", "run_dir": str(tmp_path / "run"), "epochs": 1,
                                    "train": {"lr": 2e-3}, "hparams": {"hidden_dim": 64}}))
    first = run_json([str(BIN / "capbook"), "train", "--config", str(conf)])
    saved = yaml.safe_load((tmp_path / "run" / "params.yaml").read_text())
    assert saved["train"]["lr"] == 2e-3 and saved["hparams"]["hidden_dim"] == 64 and saved["train"]["max_len"] > 0
    p = subprocess.run([str(BIN / "capbook"), "train", "--config", str(tmp_path / "run" / "params.yaml")],
                       capture_output=True, text=True, timeout=600)
    again = json.loads(p.stdout.strip().splitlines()[-1])
    assert "resumed from" in p.stderr and "moved to" not in p.stderr       # the finished run, found unchanged ...
    assert again["resumed_from"] == [1, 0] and again["history"] == first["history"]   # ... and not trained again
    assert again["param_checksum"] == first["param_checksum"]
    edited = {**saved, "train": {**saved["train"], "lr": 1e-3}}
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    p = subprocess.run([str(BIN / "capbook"), "train", "--config", str(tmp_path / "edited.yaml")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "was trained with other parameters (lr)" in p.stderr     # never resumes another recipe
    (tmp_path / "bad.yaml").write_text("model: sat_soft\nlearning_rate: 0.1\n")
    p = subprocess.run([str(BIN / "capbook"), "train", "--config", str(tmp_path / "bad.yaml"), "--run-dir", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "unknown parameter 'learning_rate'" in p.stderr
