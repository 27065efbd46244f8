"""Stacked runs (`capbook.stacked.fit_stacked`): for every family, a stacked pair trains to what its two runs train alone,
and the graph-ready step (fixed shapes, no host synchronisation) trains what the book's step trains."""
import tempfile
from dataclasses import replace
from pathlib import Path
import pytest
import torch
from capbook.core import CapbookError
from capbook.models import available, build, keyed, plain_paths
from capbook.objectives import objective_for
from capbook.train import TrainConfig, fit, step_key
from capbook.stacked import fit_stacked
from test_speed import SMALL

STEPS = 2
CFG = TrainConfig(epochs=1, max_steps=STEPS, batch_size=8, val_beam=1, evals_per_epoch=1, device="cpu", progress=False,
                  log_every=0, precision="fp32")
quiet = lambda s: None
SIZES = {**SMALL, "lstm2d": dict(channels=16), "lstm2d_spca": dict(channels=16),   # the smoke book's 2D state
         "lstm1d_spca": dict(emb_dim=32, hidden_dim=64)}


@pytest.fixture(scope="module")
def data(smoke):
    "The smoke data with GLIED's attribute words (every model ignores the inputs it does not declare)."
    from capbook.attributes import AttributeConfig, attributes_for
    if "attrs" not in smoke.train.inputs:
        at = attributes_for(smoke, AttributeConfig(epochs=1), device=torch.device("cpu"), log=quiet)
        for s in ("train", "val", "test"): smoke.split(s).with_inputs(attrs=at.ids[s])
    return smoke


def _model(name, data, seed, **hp):
    torch.manual_seed(seed)
    return build(name, len(data.vocab), data.feat_shape[1], data.grid, **{**SIZES.get(name, {}), **hp})


def _noise_params(name, data, cfg, **hp) -> set:
    """The parameters whose gradient is zero but for rounding: a bias added to every score before a softmax (additive
    attention's w's bias) cannot change the loss. Adam divides each gradient by its own size, so rounding noise of
    1e-9 in one path and 3e-9 in another moves such a weight by up to the learning rate a step, either way."""
    m = _model(name, data, cfg.seed, **hp)
    obj, b = objective_for(m), next(iter(data.train.batches(cfg.batch_size, 0, cfg.seed, order=cfg.batch_order)))
    with plain_paths(), keyed(torch.tensor(step_key(cfg.seed, 0))):
        loss, _ = obj.loss(obj.outputs(m, b), b)
    loss.backward()
    top = max(p.grad.abs().max().item() for p in m.parameters() if p.grad is not None)
    return {n for n, p in m.named_parameters() if p.grad is None or p.grad.abs().max().item() < 1e-6 * top}


def _same_run(alone, stacked, noise, lr, rtol=0.0):
    """Losses at every validation to 1e-5; every weight to 1e-5 (+ `rtol` of its size) but for at most one in a
    thousand, and those of `noise` parameters, within the STEPS Adam steps they may take apart. Adam divides each
    gradient by its own size: where a weight's gradient is rounding noise (a sum whose terms cancel, summed in another
    order when a batch is padded or stacked), noise of 1e-9 in one run and 3e-9 in the other moves it by up to the
    learning rate a step, either way."""
    (ra, ma), (rs, ms) = alone, stacked
    assert [h["step"] for h in ra.history] == [h["step"] for h in rs.history]
    for ha, hs in zip(ra.history, rs.history):
        assert abs(ha["loss"] - hs["loss"]) < 1e-5, (ha["loss"], hs["loss"])
    for (n, a), b in zip(ma.named_parameters(), ms.parameters()):
        err = (a - b).detach().abs()
        assert (err <= STEPS * lr).all(), (n, err.max().item())
        off = (err > 1e-5 + rtol * a.detach().abs()).float().mean().item()
        assert off <= (1.0 if n in noise else 1e-3), (n, off, err.max().item())


@pytest.mark.slow
@pytest.mark.parametrize("name", available())
def test_stacked_runs_equal_runs_alone(name, data):
    """Two seeds at two learning rates, dropout on (the keyed draws), padded to the fixed shape a graph needs: each
    stacked member's history and weights are its run's alone (`fit` with draws='keyed'); and with dropout off, a run
    stacked on its own at the fixed shape trains what the book's own step trains (fast paths, torch's generator)."""
    tmp = Path(tempfile.mkdtemp())
    cfgs = [replace(CFG, seed=0, draws="keyed"), replace(CFG, seed=1, lr=2e-4, draws="keyed")]
    alone = []
    for i, c in enumerate(cfgs):
        m = _model(name, data, c.seed)
        alone.append((fit(m, data, c, tmp / f"alone{i}", log=quiet), m))
    ms = [_model(name, data, c.seed) for c in cfgs]
    res = fit_stacked(ms, data, cfgs, [tmp / f"stacked{i}" for i in range(2)], log=quiet, fixed=True)
    noise = _noise_params(name, data, cfgs[0]) | _noise_params(name, data, cfgs[1])
    for a, r, m, c in zip(alone, res, ms, cfgs): _same_run(a, (r, m), noise, c.lr)
    last = [torch.load(tmp / f"{w}{i}" / "last.pt", weights_only=True) for w in ("alone", "stacked") for i in range(2)]
    for i in range(2):                                           # the checkpoints a lone run would resume from
        a, s = last[i], last[2 + i]
        assert a["config"] == s["config"] and a["step"] == s["step"] == STEPS and a["finished"] and s["finished"]
        assert a["ema"]["t"] == s["ema"]["t"] and a["optimizer"]["state"][0]["step"] == s["optimizer"]["state"][0]["step"]
    if name == "sat_hard": return                                # hard attention draws its locations whatever the dropout
    book = _model(name, data, 0, dropout=0.0)
    rb = fit(book, data, CFG, tmp / "book", log=quiet)                              # today's step: fast paths, torch's draws
    st = _model(name, data, 0, dropout=0.0)
    rs, = fit_stacked([st], data, [CFG], [tmp / "graph-ready"], log=quiet, fixed=True)
    # the plain paths against the fast ones: the tolerance of `test_fast_paths_train_the_same_weights` (rtol 1e-4)
    _same_run((rb, book), (rs, st), _noise_params(name, data, CFG, dropout=0.0), CFG.lr, rtol=1e-4)


def test_stacked_runs_are_one_architecture_differing_in_numbers(data):
    "Runs that differ in more than seed and rate, or in sizes, stop with one line before anything trains."
    tmp = Path(tempfile.mkdtemp())
    two = lambda **hp: [_model("nic", data, 0, **hp), _model("nic", data, 1)]
    with pytest.raises(CapbookError, match="may differ only in seed, lr: they differ in clip"):
        fit_stacked(two(), data, [CFG, replace(CFG, seed=1, clip=1.0)], [tmp / "a", tmp / "b"], log=quiet)
    with pytest.raises(CapbookError, match="one architecture with one set of sizes"):
        fit_stacked(two(hidden_dim=32), data, [CFG, replace(CFG, seed=1)], [tmp / "a", tmp / "b"], log=quiet)
    with pytest.raises(CapbookError, match="scheduled sampling"):
        fit_stacked(two(), data, [replace(CFG, ss_start=0), replace(CFG, seed=1, ss_start=0)], [tmp / "a", tmp / "b"], log=quiet)
    with pytest.raises(CapbookError, match="precision='bf16' is invalid for stacked runs on the CPU"):
        fit_stacked(two(), data, [replace(CFG, precision="bf16"), replace(CFG, seed=1, precision="bf16")], [tmp / "a", tmp / "b"], log=quiet)
    assert not (tmp / "a" / "last.pt").exists()


def test_a_stacked_step_draws_only_from_its_keys(data):
    "Inside the stacked step a draw from torch's generator is an error, not a silent shared draw (`vmap`'s randomness='error')."
    from capbook.stacked import StackedStep
    from capbook.train import _Run
    m = _model("nic", data, 0)
    run = _Run(m, data, replace(CFG, draws="keyed"), Path(tempfile.mkdtemp()), None, quiet, None, 0, 1, 0, torch.device("cpu"))
    step = StackedStep([run])
    b = next(iter(data.train.batches(16, 0, 0, order="image")))
    real = type(step.fn.model).teacher_forcing
    def drawing(self, batch):
        torch.rand(1)
        return real(self, batch)
    type(step.fn.model).teacher_forcing = drawing
    try:
        with pytest.raises(RuntimeError, match="randomness"):
            step([run], [b], [1e-3])
    finally: type(step.fn.model).teacher_forcing = real


@pytest.mark.slow
def test_stacked_members_stop_early_on_their_own(data):
    "With early stopping each member stops where it stops alone (its last checkpoint says finished there) while the other trains on."
    tmp = Path(tempfile.mkdtemp())
    cfgs = [replace(CFG, max_steps=0, epochs=1, batch_size=64, evals_per_epoch=6, patience=1, seed=s, lr=lr, draws="keyed")
            for s, lr in ((0, 1e-2), (1, 1e-3))]                 # alone, seed 1 stops after 3 of its 6 evaluations
    alone = [fit(_model("nic", data, c.seed), data, c, tmp / f"alone{i}", log=quiet) for i, c in enumerate(cfgs)]
    ms = [_model("nic", data, c.seed) for c in cfgs]
    res = fit_stacked(ms, data, cfgs, [tmp / f"stacked{i}" for i in range(2)], log=quiet)
    assert len(alone[0].history) != len(alone[1].history)      # the two stop at different evaluations
    for a, r in zip(alone, res):
        assert [h["step"] for h in a.history] == [h["step"] for h in r.history]
        assert all(abs(x["loss"] - y["loss"]) < 1e-5 and x["val CIDEr"] == pytest.approx(y["val CIDEr"], abs=1e-6)
                   for x, y in zip(a.history, r.history))
    for i in range(2):
        a, s = (torch.load(tmp / f"{w}{i}" / "last.pt", weights_only=True) for w in ("alone", "stacked"))
        assert a["finished"] and s["finished"] and (a["epoch"], a["batches_done"], a["step"]) == (s["epoch"], s["batches_done"], s["step"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sat_soft", "glied"])
def test_the_captured_steps_body_computes_the_eager_step(name, data):
    """What a CUDA graph captures (`CapturedStep.body`: the gradients and the update, with the step's numbers held in
    tensors, as a replay reads them) trains what the eager stacked step trains, weights, Adam's moments and weight
    averages, over three steps (run here on the CPU, where no graph can be captured; the GPU check replays it). On the
    CPU a divisor held as a number and its float32 reciprocal held in a tensor round apart by an ulp (CUDA multiplies
    by that reciprocal either way); the `noise` parameters move by Adam's amplified rounding."""
    from capbook.stacked import CapturedStep, stack_runs
    cfgs = [replace(CFG, seed=0, draws="keyed"), replace(CFG, seed=1, lr=2e-4, draws="keyed")]
    tmp, out = Path(tempfile.mkdtemp()), []
    for kind in ("eager", "body"):
        runs, step = stack_runs([_model(name, data, c.seed) for c in cfgs], data, cfgs, [tmp / f"{kind}{i}" for i in range(2)],
                                log=quiet, fixed=True)
        if kind == "body": step = CapturedStep(runs, step.pad_to)
        its = [iter(data.train.batches(c.batch_size, 0, c.seed, order=c.batch_order)) for c in cfgs]
        for _ in range(3):
            bs, lrs = [next(i) for i in its], [c.lr for c in cfgs]
            if kind == "eager": step(runs, bs, lrs); continue
            batch, static = step.collate(bs)
            keys = torch.tensor([step_key(r.cfg.seed, r.step) for r in runs])
            step.numbers(lrs)
            step.body({"batch": batch, "keys": keys, "static": static})
        out.append({"t": step.t, **{f"{w} {n}": x.clone() for w, d in (("w", step.params), ("m", step.m), ("v", step.v))
                                    for n, x in d.items()}, **{f"avg model.{n}": a.clone() for n, a in zip(runs[0].avg.names, step.avg)}})
    eager, body = out
    noise = {"model." + n for n in _noise_params(name, data, cfgs[0]) | _noise_params(name, data, cfgs[1])}
    assert eager["t"] == body["t"] == 3 and eager.keys() == body.keys() and len(step.avg) > 0
    for k in eager:
        if k == "t" or k.split(" ", 1)[1] in noise: continue
        assert torch.allclose(eager[k], body[k], rtol=1e-5, atol=1e-6), (k, (eager[k] - body[k]).abs().max().item())
    with pytest.raises(CapbookError, match="a captured step needs a CUDA GPU"):
        stack_runs([_model(name, data, 0)], data, [cfgs[0]], [tmp / "cpu"], log=quiet, capture=True)



def test_a_pack_is_one_row_drawing_as_stacked_runs_draw(data, tmp_path):
    "A pack (`capbook.stages.fit_pack`) of runs that differ in more than seed and rate, or that draw from torch's generator, stops in one line before anything trains (the book's device book trains packs: `tests/test_book.py`)."
    from capbook.stages import fit_pack
    base = {"profile": "smoke", "model": "nic", "scst_epochs": 0, "epochs": 1, "draws": "keyed", "precision": "fp32", "device": "cpu"}
    with pytest.raises(CapbookError, match="may differ only in seed and lr; seed 1 differs from seed 0 in beam_size"):
        fit_pack("06_baselines", [(base, tmp_path / "a", None), ({**base, "seed": 1, "beam_size": 2}, tmp_path / "b", None)], log=quiet)
    with pytest.raises(CapbookError, match="draws='torch' is invalid for a stacked pack"):
        fit_pack("06_baselines", [({**base, "draws": "torch"}, tmp_path / "a", None)], log=quiet)
    with pytest.raises(CapbookError, match="per-image inputs depend on their seed"):
        fit_pack("05_glied", [({**base, "model": "glied"}, tmp_path / "a", None)], log=quiet)
    assert not list(tmp_path.glob("*/ckpt/last.pt"))
