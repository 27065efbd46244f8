"""Every failure a user can cause ends in one line naming the culprit and what is allowed — from papermill, the CLI
and the API — with the full traceback in a log file the line names, and nothing already computed lost."""
import errno, json, os, random, subprocess, sys, time
from pathlib import Path
import nbformat
import pytest
import torch
from capbook import core
from capbook.book import run_step
from capbook.results import Step
from capbook.core import CapbookError, load_json, save_json, save_torch

BIN = Path(sys.executable).parent
NBS = Path(__file__).parent.parent / "nbs"


def one_line(msg: str, *parts: str) -> str:
    assert "\n" not in msg.strip() and all(p in msg for p in parts), msg
    return msg


def cli(*args, home=None, timeout=600):
    env = {**os.environ, **({"CAPBOOK_HOME": str(home)} if home else {})}
    return subprocess.run([str(BIN / "capbook"), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
@pytest.mark.skipif(torch.cuda.is_available(), reason="device='cuda' is valid on a machine with a GPU")
def test_cuda_without_a_gpu_is_one_line_in_the_notebook(home):
    with pytest.raises(CapbookError) as e:
        run_step(Step("02_show_attend_tell", {"profile": "smoke", "device": "cuda"}, tag="cuda"), "smoke", log=lambda s: None,
                 key="the step's key is not what this test is about")
    one_line(str(e.value), "parameter device='cuda' is invalid here: no CUDA GPU is visible")
    # the failing cell's error output is the capbook line alone, not a traceback; the traceback is in the log it names
    nb = nbformat.read(home / "runs" / "smoke" / "02_show_attend_tell-cuda" / "02_show_attend_tell.ipynb", as_version=4)
    err = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert len(err) == 1 and len(err[0].traceback) == 1 and err[0].traceback[0].startswith("capbook: parameter device=")
    log = Path(err[0].traceback[0].rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert "Traceback (most recent call last)" in log.read_text() and "get_device" in log.read_text()


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "0"], "parameter batch_size=0 is invalid: expected an integer >= 1"),
    (["--epochs", "0"], "parameter epochs=0 is invalid: expected an integer >= 1"),
    (["--model", "sat_sfot"], "parameter model='sat_sfot' is invalid: allowed values are"),
])
def test_cli_bad_arguments_are_one_line(tmp_path, monkeypatch, capsys, args, message):
    "The first case as a process (the installed command), the others through the same `main` in-process."
    if args[0] == "--batch-size":
        p = cli("train", "--run-dir", tmp_path / "run", *args, home=tmp_path / "home")
        code, err = p.returncode, p.stderr
    else:
        from capbook.cli import main
        monkeypatch.setenv("CAPBOOK_HOME", str(tmp_path / "home"))
        code, err = main(["train", "--run-dir", str(tmp_path / "run"), *args]), capsys.readouterr().err
    assert code == 2 and err.startswith("error: ")
    one_line(err, message, "(traceback: ")
    assert not (tmp_path / "home" / "data").exists()               # stopped before any work


def test_cli_file_as_run_dir_is_one_line(tmp_path, monkeypatch, capsys):
    from capbook.cli import main                                   # in-process: the command's own path is tested above
    (tmp_path / "run").write_text("a file, not a folder")
    monkeypatch.setenv("CAPBOOK_HOME", str(tmp_path / "home"))
    assert main(["train", "--run-dir", str(tmp_path / "run")]) == 2
    one_line(capsys.readouterr().err, f"{tmp_path / 'run' / 'ckpt'}: cannot create the run folder (a path component is a file, not a folder)")


def test_docs_open_without_a_browser_prints_the_site(tmp_path, monkeypatch, capsys):
    "`capbook docs --open` where no browser opens (a headless machine: `webbrowser.open` answers False): the site's index.html, printed, instead of nothing."
    import webbrowser
    import capbook.cli as cli
    monkeypatch.setenv("CAPBOOK_HOME", str(tmp_path))
    site = tmp_path / "runs" / "default" / "site" / "index.html"
    monkeypatch.setattr(cli, "build_docs", lambda profile: site)        # the site itself: tests/test_docs.py
    monkeypatch.setattr(webbrowser, "open", lambda url: False)
    assert cli.main(["docs", "--open"]) == 0
    assert f"open {site}" in capsys.readouterr().out


def test_home_under_a_file_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("CAPBOOK_HOME", str(tmp_path / "file" / "home"))
    monkeypatch.delenv("CAPBOOK_DATA", raising=False)             # data/ under that home too
    from capbook.prepare import prepare
    with pytest.raises(CapbookError) as e: prepare("shapes", "smoke")
    one_line(str(e.value), str(tmp_path / "file"), "a path component is a file, not a folder")


@pytest.mark.parametrize("err,why", [(errno.EROFS, "the folder is read-only"), (errno.ENOSPC, "no space left on the device"),
                                     (errno.EACCES, "permission denied")])
def test_unwritable_or_full_disk_keeps_the_old_file(tmp_path, monkeypatch, err, why):
    save_json(tmp_path / "record.json", {"BLEU-4": 0.25})
    save_torch(tmp_path / "last.pt", {"epoch": 3})
    def fail(*a, **k): raise OSError(err, os.strerror(err))
    monkeypatch.setattr(core.os, "replace", fail)                     # the rename that publishes a write
    with pytest.raises(CapbookError) as e: save_json(tmp_path / "record.json", {"BLEU-4": 0.5})
    one_line(str(e.value), str(tmp_path / "record.json"), why, "nothing already written was changed")
    monkeypatch.undo()
    monkeypatch.setattr(torch, "save", fail)                          # the disk fills while writing a checkpoint
    with pytest.raises(CapbookError) as e: save_torch(tmp_path / "last.pt", {"epoch": 4})
    one_line(str(e.value), "last.pt", why)
    assert load_json(tmp_path / "record.json") == {"BLEU-4": 0.25} and core.load_torch(tmp_path / "last.pt") == {"epoch": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "record.json"]   # no temporary files left


def test_written_files_are_readable_like_any_other(tmp_path):
    old = os.umask(0o022)
    try:
        for p in (save_json(tmp_path / "a.json", {}), save_torch(tmp_path / "b.pt", {})):
            assert p.stat().st_mode & 0o777 == 0o644, oct(p.stat().st_mode)
    finally: os.umask(old)


def test_stray_temporary_files_of_killed_writers_are_swept(tmp_path):
    stray = tmp_path / f".last.pt.{2**22 + 12345}.abcd.tmp"            # a pid no process has
    stray.write_bytes(b"half a checkpoint")
    live = tmp_path / f".last.pt.{os.getpid()}.efgh.tmp"; live.write_bytes(b"being written")
    save_torch(tmp_path / "last.pt", {"epoch": 1})
    assert not stray.exists() and live.exists()


def test_evaluate_unknown_split_is_one_line(smoke):
    from capbook.metrics import evaluate
    from capbook.models import build
    m = build("sat_soft", len(smoke.vocab), smoke.feat_shape[1], smoke.grid)
    with pytest.raises(CapbookError) as e: evaluate(m, smoke, "testing")
    one_line(str(e.value), "parameter split='testing' is invalid: allowed values are 'train', 'val', 'test'")


def test_non_finite_model_never_returns_an_empty_caption(smoke):
    from capbook.decode import beam_search
    from capbook.models import build
    m = build("sat_soft", len(smoke.vocab), smoke.feat_shape[1], smoke.grid).eval()
    with torch.no_grad(): next(m.parameters()).fill_(float("nan"))
    b = next(smoke.test.image_batches(4))
    with pytest.raises(CapbookError) as e: beam_search(m, b, beam_size=3, max_len=5)
    one_line(str(e.value), "beam search: the model's next-word scores are NaN at step 0 for 4 of 4 images")


def test_non_finite_loss_stops_at_the_step_with_a_hint(smoke, tmp_path):
    from capbook.models import build
    from capbook.train import TrainConfig, fit
    m = build("sat_soft", len(smoke.vocab), smoke.feat_shape[1], smoke.grid)
    with torch.no_grad(): next(m.parameters()).fill_(float("nan"))
    with pytest.raises(CapbookError) as e:
        fit(m, smoke, TrainConfig(epochs=1, batch_size=16, device="cpu", progress=False), tmp_path / "ckpt", log=lambda s: None)
    one_line(str(e.value), "loss is nan at epoch 0, step 0", "lower the learning rate")


@pytest.mark.slow
def test_bench_smoke_profile(smoke, home):
    p = cli("bench", "--profile", "smoke", "--family", "sat_soft,ssa", "--batches", "1", home=home)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(out["families"]) == {"sat_soft", "ssa"}
    assert all(r["train_captions_per_s"] > 0 and r["beam_images_per_s"] > 0 for r in out["families"].values())
    assert out["tutorial_train_captions_per_s"] > 0 and out["sat_soft_train_captions_per_s"] > 0
    p = cli("bench", "--profile", "smoke", "--family", "sat_softt", home=home)
    assert p.returncode == 2 and "parameter family='sat_softt' is invalid" in p.stderr


# Each chapter's parameters and values to draw from (all valid; `valid` filters joint constraints).
FUZZ = {
    "02_show_attend_tell": dict(space=dict(attention=["soft", "hard", "none"], gate=[None, True, False],
                                           penalty=[None, 0.0, 1.0], samples=[1, 2], p_expected=[0.0, 0.5, 1.0],
                                           test_context=["argmax", "expected"], dropout=[0.0, 0.5],
                                           beam_size=[1, 2, 3], batch_size=[7, 64]),
                                valid=lambda c: True),
    "03_spca": dict(space=dict(decoder=["1d", "2d"], structure=["S", "C", "C-S", "S-C", "S||C", "none"],
                               kernel=[1, 3, 5], reduction=[2, 8], map_size=[4, 7], beam_size=[1, 2],
                               batch_size=[7, 32]),
                    valid=lambda c: not (c["decoder"] == "1d" and c["structure"] == "none")),
    "04_spatial_self_attention": dict(space=dict(tau=["paper", "standard"], heads=[2, 4, 8], d_model=[None, 32, 64],
                                                 d_hidden=[None, 48], enc_layers=[1, 2], dec_layers=[1, 4],
                                                 dropout=[0.0, 0.1], max_words=[0, 8, 14], beam_size=[1, 3],
                                                 batch_size=[7, 64]),
                                      valid=lambda c: c["d_model"] is None or c["d_model"] % c["heads"] == 0),
    "05_glied": dict(space=dict(global_visual=[True, False], global_attribute=[True, False], local=[True, False],
                                heads=[2, 4, 8], d_model=[None, 32], scst_epochs=[0, 1], scst_baseline=["greedy", "mean"],
                                attr_threshold=[0.0, 0.5], attr_keep=[0, 3], attr_epochs=[1], beam_size=[1, 3],
                                batch_size=[7, 64]),
                     valid=lambda c: c["d_model"] is None or c["d_model"] % c["heads"] == 0),
    "06_baselines": dict(space=dict(model=["nic", "lstm", "att2in", "sca_cnn", "updown", "ct"], order=["C-S", "S-C"],
                                    hidden_dim=[16, 256], att_dim=[8, 128], dropout=[None, 0.0], heads=[2, 8],
                                    d_model=[None, 32], scst_epochs=[0, 1], scst_baseline=["greedy", "mean"],
                                    beam_size=[1, 3], batch_size=[7, 64]),
                         valid=lambda c: c["d_model"] is None or c["d_model"] % c["heads"] == 0),
}


def test_every_chapter_has_a_fuzz_space():
    from capbook.profiles import chapters
    assert sorted(chapters()) == sorted(FUZZ), "add the new chapter's parameters to FUZZ"


@pytest.mark.slow
@pytest.mark.sampled
def test_valid_parameter_combinations_never_crash(home):
    "Fuzz: for two paper chapters drawn by the seed (`make soak`, CAPBOOK_EVERY=1: every one), a random valid combination of its parameters, at the smoke profile, one epoch."
    from capbook.metrics import meteor_service
    seed = int(os.environ.get("CAPBOOK_FUZZ_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    chosen = list(FUZZ) if os.environ.get("CAPBOOK_EVERY") else sorted(rng.sample(list(FUZZ), 2))
    with meteor_service():                                      # one METEOR process for the runs, as in the book
        for nb, f in ((nb, FUZZ[nb]) for nb in chosen):
            while not f["valid"](combo := {k: rng.choice(v) for k, v in f["space"].items()}): pass
            print(f"CAPBOOK_FUZZ_SEED={seed}: {nb} {combo}")
            try: run_step(Step(nb, {"profile": "smoke", "epochs": 1, **combo}, tag=f"fuzz{seed}"), "smoke", log=lambda s: None)
            except CapbookError as e:
                pytest.fail(f"CAPBOOK_FUZZ_SEED={seed}: {nb} with {combo} failed: {e}")


def test_feature_store_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    "A memory-mapped write to a full disk would kill the process (SIGBUS); the store reserves its blocks first."
    from capbook import data as D
    def full(fd, off, n): raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(D.os, "posix_fallocate", full)
    p = tmp_path / "features" / "train.npy"
    with pytest.raises(CapbookError) as e:
        D.write_features(p, 3, (4, 2), (torch.ones(1, 4, 2) for _ in range(3)), {"keys": ["a", "b", "c"]})
    one_line(str(e.value), str(p), "no space left on the device")
    assert list(p.parent.iterdir()) == []
