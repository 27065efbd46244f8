"The speed-ups compute what the plain code computes: every model family trained a few steps both ways ends with the same weights."
import os
from pathlib import Path
import pytest
import torch
from capbook.models import available, build, plain_paths, tanh, Dropout, image_groups
from capbook.objectives import objective_for
from capbook.train import train_step


def _train(name, smoke, order, steps=3, **hp):
    "A model of `name` (dropout 0: the speed-ups must not change what is computed, and dropout's draws are random) trained `steps` steps from seed 0, with SGD: Adam divides by the gradients' size, which would blow a rounding difference in a near-zero gradient up to a whole step."
    torch.manual_seed(0)
    m = build(name, len(smoke.vocab), smoke.feat_shape[1], smoke.grid, dropout=0.0, **hp)
    opt, obj = torch.optim.SGD(m.parameters(), lr=0.05), objective_for(m)
    m.train()
    for b in list(smoke.train.batches(16, 0, 0, order=order))[:steps]:
        torch.manual_seed(1)                                        # hard attention's draws: the same in both runs
        train_step(m, m, obj, opt, b, torch.device("cpu"), clip=5.0)
    return m


SMALL = {"ssa": dict(d_model=32, d_hidden=64, heads=2), "ct": dict(d_model=32, d_hidden=64, heads=2),
         "glied": dict(d_embed=16, d_model=32, d_hidden=64, heads=2)}   # the transformers' paper sizes are large


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize("order", ["length", "image"])
def test_fast_paths_train_the_same_weights(name, order, smoke):
    from capbook.attributes import AttributeConfig, attributes_for
    if name == "glied":                                             # GLIED reads detected attribute words
        at = attributes_for(smoke, AttributeConfig(epochs=1), device=torch.device("cpu"), log=lambda s: None)
        for s in ("train", "val", "test"): smoke.split(s).with_inputs(attrs=at.ids[s])
    fast = _train(name, smoke, order, **SMALL.get(name, {}))
    with plain_paths(): plain = _train(name, smoke, order, **SMALL.get(name, {}))
    for (k, a), b in zip(fast.state_dict().items(), plain.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (name, k, (a - b).abs().max().item())


def test_fast_tanh_is_tanh():
    x = torch.randn(4000) * 4
    assert torch.allclose(tanh(x), torch.tanh(x), atol=1e-6)
    xd = torch.randn(30, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tanh, (xd,))


def test_fast_dropout_has_dropouts_distribution():
    torch.manual_seed(0)
    d = Dropout(0.3).train()
    y = d(torch.ones(200_000))
    kept = (y != 0).float()
    assert abs(kept.mean().item() - 0.7) < 0.005                 # each element kept with probability 1 - p
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.7))   # and scaled by 1/(1-p)
    assert torch.equal(d.eval()(torch.ones(5)), torch.ones(5))


def test_image_groups():
    assert image_groups(torch.tensor([4, 4, 7, 7, 1, 1]))[1] == 2
    assert torch.equal(image_groups(torch.tensor([4, 4, 7, 7, 1, 1]))[0], torch.tensor([0, 2, 4]))
    assert image_groups(torch.tensor([4, 4, 7, 1, 1, 1])) is None   # unequal runs
    assert image_groups(torch.tensor([4, 7, 4, 7])) is None          # an image's captions apart
    assert image_groups(torch.tensor([4, 4, 7, 7, 4, 4])) is None    # an image in two runs
    with plain_paths(): assert image_groups(torch.tensor([4, 4])) is None


def test_bench_times_a_family_as_the_book_builds_it(smoke):
    from capbook.bench import families, setup, alternatives, step_profile, op_kind
    fam, = families("smoke", ["nic"])
    assert fam.step.name == "06_baselines-nic" and fam.params.profile == "smoke"
    s = setup(fam)
    assert s["cfg"].batch_order == "image" and s["model"].name == "nic"      # the protocol's batches
    alt = alternatives(s, batches=1)
    assert set(alt) == {"fp32", "bf16", "batch_x2"} and all(v > 0 for v in alt.values())
    from capbook.bench import stacked_speed
    assert stacked_speed(s, 2, batches=1, rounds=1, warmup=1) > 0                  # two seeds as one stacked model
    prof = step_profile(s, batches=1)
    assert prof["gflop_per_caption"] > 0 and abs(sum(prof["shares"].values()) - 1) < 0.01
    assert op_kind("aten::mm") == "matrix products" and op_kind("aten::uniform_") == "random draws"


@pytest.mark.slow   # starts a kernel or fresh processes: the full suite's, not the quick loop's
def test_bench_against_an_earlier_commit_times_both_codes_in_alternating_processes(smoke):
    "`capbook bench --against REV`: each round times the family under REV's code (a temporary worktree) and under this code, each in a fresh process that imports its own tree; a bad commit or family is one line."
    from capbook.bench import versus, family_spec
    from capbook.core import CapbookError
    assert family_spec("lstm2d_spca/kernel=5/structure=S||C") == ("lstm2d_spca/kernel=5/structure=S||C", "lstm2d_spca",
                                                                  {"kernel": 5, "structure": "S||C"})
    with pytest.raises(CapbookError, match="parameter family='nic/seed' is invalid"): family_spec("nic/seed")
    with pytest.raises(CapbookError, match="parameter against='no-such-commit' is invalid"): versus("no-such-commit", ["nic"], "smoke")
    lines = []
    out = versus("HEAD", ["nic/seed=1"], "smoke", batches=1, rounds=1, log=lines.append)
    r = out["families"]["nic/seed=1"]
    assert r["before"] > 0 and r["now"] > 0 and r["rounds"] == {"before": [r["before"]], "now": [r["now"]]}
    assert [line.split()[2] for line in lines] == ["before", "now"]                 # the earlier code first, then this one


def test_bf16_precision_is_a_checked_option_close_to_fp32(smoke):
    "precision='bf16' autocasts the CPU step (products in bfloat16, weights in float32): its loss on a batch is within 1% of fp32's; any other value stops with one line."
    from capbook.core import CapbookError
    from capbook.train import TrainConfig
    b = next(smoke.train.batches(32, 0, 0))
    losses = {}
    for p in ("fp32", "bf16"):
        torch.manual_seed(0)
        m = build("ssa", len(smoke.vocab), smoke.feat_shape[1], smoke.grid, dropout=0.0, **SMALL["ssa"])
        losses[p] = train_step(m, m, objective_for(m), torch.optim.SGD(m.parameters(), lr=0.0), b, torch.device("cpu"),
                               precision=p)["loss"]
        assert all(q.dtype == torch.float32 for q in m.parameters())
    assert abs(losses["bf16"] - losses["fp32"]) < 0.01 * losses["fp32"] and losses["bf16"] != losses["fp32"]
    with pytest.raises(CapbookError, match="parameter precision='fp16' is invalid"):
        TrainConfig(precision="fp16").check()


def test_auto_precision_takes_bf16_only_where_the_cpu_has_bf16_kernels(monkeypatch):
    "precision='auto' (the default) resolves to bf16 on a GPU, and on the CPU to bf16 exactly where oneDNN has bfloat16 kernels for it (`cpu_bf16_kernels`, read from the CPU, never timed); an explicit choice is kept; the trainer records what it used."
    import capbook.core as C
    from capbook.core import CapbookError, cpu_precision
    from capbook.train import TrainConfig
    from capbook.profiles import RunConfig
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert TrainConfig().precision == "auto" and RunConfig().precision == "auto"
    assert cpu_precision("fp32", gpu) == "fp32" and cpu_precision("bf16", cpu) == "bf16"
    for kernels in (True, False):
        monkeypatch.setattr(C, "cpu_bf16_kernels", lambda kernels=kernels: kernels)
        assert cpu_precision("auto", cpu) == ("bf16" if kernels else "fp32")
        assert cpu_precision("auto", gpu) == "bf16"
    monkeypatch.undo()
    flags = open("/proc/cpuinfo").read().split() if Path("/proc/cpuinfo").exists() else None
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()     # oneDNN's instruction set lowered (as on an AVX2 machine)
    if flags and "avx2" in flags:                                # x86: AVX-512 BW, VL and DQ are what oneDNN's bf16 needs
        allowed = cap in ("ALL", "DEFAULT") or any(x in cap for x in ("AVX512", "AVX10", "AMX"))
        assert C.cpu_bf16_kernels() == (allowed and all(f in flags for f in ("avx512bw", "avx512vl", "avx512dq")))
    assert cpu_precision("auto", cpu) == ("bf16" if C.cpu_bf16_kernels() else "fp32")
    with pytest.raises(CapbookError, match="parameter precision='fp16' is invalid"):
        cpu_precision("fp16", cpu)


def test_the_smoke_profile_trains_in_fp32_on_the_cpu_and_the_others_keep_the_cpus_choice(monkeypatch):
    "A chapter run that leaves precision 'auto' trains the smoke profile in fp32 on the CPU (`PROFILE_PRECISION`) whatever the CPU, and the default profile in what the CPU chooses (left 'auto' for `fit`, never resolved into a key's config); an explicit precision is kept; a GPU keeps its bf16."
    import capbook.core as C
    from capbook.profiles import chapter, run_precision, train_config
    from capbook.sat import SATParams
    ch = chapter("02_show_attend_tell")
    cfg = lambda **kw: train_config(ch, ch.resolve(SATParams(**kw)), "sat_soft", 20)
    for kernels in (True, False):
        monkeypatch.setattr(C, "cpu_bf16_kernels", lambda kernels=kernels: kernels)
        assert run_precision("smoke") == cfg(profile="smoke").precision == "fp32"
        assert run_precision("default") == ("bf16" if kernels else "fp32") and cfg(profile="default").precision == "auto"
        assert run_precision("smoke", "bf16") == cfg(profile="smoke", precision="bf16").precision == "bf16"
    import capbook.profiles as P
    monkeypatch.setattr(P, "get_device", lambda d="auto": torch.device("cuda"))
    assert run_precision("smoke") == "bf16" and cfg(profile="smoke").precision == "auto"


def test_the_trainer_records_the_precision_it_trained_in(monkeypatch, tmp_path):
    "fit resolves precision='auto' once and reports the arithmetic it used (kept in every run's record)."
    from capbook.core import cpu_precision
    from capbook.train import fit
    import test_protocol as P
    P.scripted(monkeypatch, [0.5] * 8)                           # validation scores: the trainer, not the model, under test
    res = fit(P.model(), P.PREP, P.cfg(epochs=1, precision="auto", ema=0.0), tmp_path, log=lambda s: None)
    assert res.precision == cpu_precision("auto", torch.device("cpu")) and res.precision in ("fp32", "bf16")
    import capbook.core as C
    assert torch.load(tmp_path / "last.pt", weights_only=False)["config"]["precision"] == res.precision   # in the checkpoint
    monkeypatch.setattr(C, "cpu_bf16_kernels", lambda: res.precision == "fp32")   # another machine would choose the other
    logs = []
    again = fit(P.model(), P.PREP, P.cfg(epochs=1, precision="auto", ema=0.0), tmp_path, log=logs.append)
    assert again.precision == res.precision and again.resumed_from is not None and not any("moved to" in s for s in logs)
    monkeypatch.setattr(C, "cpu_bf16_kernels", lambda: res.precision == "bf16")
    res = fit(P.model(), P.PREP, P.cfg(epochs=1, precision="fp32", ema=0.0), tmp_path / "b", log=lambda s: None)
    assert res.precision == "fp32"


def test_a_shrinking_batch_computes_what_the_full_one_does():
    "unroll with lengths drops ended captions from the batch: the live positions' logits and attention equal the full unroll's, the ended ones are zeros."
    from capbook.models import build, unroll, unroll_shrinking
    torch.manual_seed(0)
    m = build("sat_soft", 15, 6, (2, 2), emb_dim=8, hidden_dim=16, att_dim=8).eval()
    caps = torch.tensor([[1, 5, 6, 2, 0, 0], [1, 7, 8, 9, 10, 2], [1, 2, 0, 0, 0, 0], [1, 11, 12, 13, 2, 0]])
    feats = torch.randn(4, 4, 6)
    lengths = m.target_lengths(caps)
    assert lengths.tolist() == [3, 5, 1, 4]
    full = unroll(m.step, caps[:, :-1], *m.init_state({"feats": feats}))
    short = unroll_shrinking(m.step, caps[:, :-1], *m.init_state({"feats": feats}), lengths)
    live = torch.arange(5)[None, :] < lengths[:, None]                     # (B, T): the steps each caption needs
    for k in ("logits", "alpha"):
        assert torch.allclose(full[k][live], short[k][live], atol=1e-6) and not short[k][~live].any()


@pytest.mark.slow                                   # a smoke chapter run, end to end
def test_chapter_times_makes_the_books_run_and_reports_it(home):
    "`capbook bench --chapters` runs a chapter as the book does (here at smoke, on the CPU) and reports where its time went; a bad chapter stops first."
    import json, subprocess, sys
    from pathlib import Path
    out = subprocess.run([str(Path(sys.executable).parent / "capbook"), "bench", "--profile", "smoke", "--device", "cpu",
                          "--chapters", "02_show_attend_tell"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    r = res["chapters"]["02_show_attend_tell"]
    assert res["device"] == "cpu" and r["model"] == "sat_soft" and r["epochs_trained"] >= 1
    assert r["train_s"] > 0 and r["test_s"] > 0 and 0 <= r["CIDEr"] and r["wall_s"] >= r["test_s"]
    from capbook.core import runs_dir
    rec = json.loads((runs_dir() / "smoke" / "adhoc" / r["run"] / "record.json").read_text())      # a run name, no machine path
    assert rec["timings"]["train_s"] == pytest.approx(r["train_s"], abs=0.06) and rec["machine"]["device"] == "cpu"
    bad = subprocess.run([str(Path(sys.executable).parent / "capbook"), "bench", "--chapters", "07_nothing"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "07_nothing" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_sites_gpu_table_is_the_measured_one():
    "The performance page's GPU table (`nbs/00r_bench`) is `gpu_table` of `figures/bench_gpu.json` (what the GPU measured), and that file holds every family and both chapter runs."
    import json
    from pathlib import Path
    from capbook.bench import gpu_table
    root = Path(__file__).resolve().parent.parent
    res = json.loads((root / "figures" / "bench_gpu.json").read_text())
    assert set(res["families"]) == set(available()) and {"02_show_attend_tell", "03_spca"} <= set(res["chapters"])
    assert all(r["precision"] == "bf16" for r in res["chapters"].values())
    from conftest import notebook_markdown
    block = notebook_markdown("00r_bench").split("<!-- gpu -->\n", 1)[1].split("\n<!-- /gpu -->", 1)[0]
    assert block == gpu_table(res)


def test_the_sites_capture_table_is_the_measured_one():
    "The captured-step table of `00r_bench` is `capture_table` of `figures/bench_gpu_capture.json` (what `make gpu-check` measured), which holds every family captured or the reason it is not."
    import json
    from capbook.bench import capture_table
    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / "figures" / "bench_gpu_capture.json").read_text())
    assert set(res["families"]) == set(available())
    assert all("captured_train_captions_per_s" in r or r.get("not_stacked") or r.get("capture_failed") for r in res["families"].values())
    from conftest import notebook_markdown
    block = notebook_markdown("00r_bench").split("<!-- capture -->\n", 1)[1].split("\n<!-- /capture -->", 1)[0]
    assert block == capture_table(res)


def test_the_bench_notebooks_speed_up_table_is_its_measurement():
    "The SPCA family's before/now table in `00r_bench` is `versus_table` of the measurement it cites (`figures/bench_2d.json`), not typed in."
    import json
    from capbook.bench import versus_table
    root = Path(__file__).resolve().parents[1]
    text = (root / "nbs" / "00r_bench.py").read_text()
    shown = text.split("# <!-- versus -->\n", 1)[1].split("# <!-- /versus -->", 1)[0]
    measured = json.loads((root / "figures" / "bench_2d.json").read_text())
    assert shown == "".join(f"# {line}\n" for line in versus_table(measured).splitlines())
    assert all(r["rounds"]["before"] and r["rounds"]["now"] for r in measured["families"].values())

