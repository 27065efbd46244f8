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
# # bench
#
# > `capbook bench`: the training and decoding throughput of every model family at the book's own sizes, the tutorial decoder beside Show-Attend-Tell, and the self-critical reward against pycocoevalcap's.

# %%
#| default_exp bench

# %%
#| export
from __future__ import annotations
import itertools, time
from dataclasses import dataclass
from typing import Any, Callable
import numpy as np
import torch
from capbook.core import CapbookError, check_int, cpu_precision, load_torch, runs_dir, seed_everything, get_device
from capbook.profiles import check_profile

# %% [markdown]
# ## What is measured, and how
#
# Speed is measured here, in a script that prints figures, and never asserted in a timed test. A **family** is one
# registered model kind (`capbook.models.available()`); the benchmark builds each family exactly as the book's first
# run of it does at the profile — the chapter's parameters resolved at the profile's sizes, the model's registry
# recipe, the chapter's training settings (`capbook.profiles.train_config`), the chapter's per-image inputs (GLIED's
# attribute words) — so a figure here is the speed of the book's own run, not of a toy. For each family:
#
# - **training**: captions per second through the trainer's own `train_step` (forward, objective, backward,
#   clipping, Adam), on the batches the run draws (its batch order and caption filter), after 3 warm-up steps: the
#   same 12 batches timed three times and the fastest round kept, since a busy spell on the machine can only slow a
#   round down (best of rounds is the usual way to time code on a shared machine);
# - **decoding**: images per second of the batched beam search at the run's beam size, on up to 100 test images in
#   one batch, with the book's trained weights when the run's checkpoint exists and fits the model (decoding time
#   depends on how soon captions end), else freshly initialised weights (the output says which).
#
# Figures depend on the thread count (the output records it): `capbook book -j 2` gives each run one thread of the
# two cores, so `OMP_NUM_THREADS=1 capbook bench` gives the book's per-run speeds.

# %%
#| export
@dataclass
class Family:
    "One model family as the book first trains it at a profile: plan step, chapter, resolved parameters, model name."
    step: Any
    chapter: Any
    params: Any
    model: str

def families(profile: str = "default", only: list[str] | None = None) -> list[Family]:
    "Each registered model's first run in the book's plan at `profile` (its sizes and recipe); `only`: these model names."
    from capbook.plan import plan
    from capbook.profiles import chapters
    from capbook.models import available
    check_profile(profile)
    if only:
        bad = sorted(set(only) - set(available()))
        if bad: raise CapbookError(f"parameter family={bad[0]!r} is invalid: allowed values are {', '.join(available())}")
    chs, out = chapters(), {}
    for s in plan(profile):
        ch = chs.get(s.notebook)
        if ch is None or not s.params: continue
        p = ch.resolve(ch.params(**{k: v for k, v in s.params.items() if k != "run_dir"}))
        name = ch.model(p)
        if name not in out and (not only or name in only): out[name] = Family(s, ch, p, name)
    return list(out.values())

# %% [markdown]
# Setting a family up is `run_chapter`'s first half — the same data, model, objective and `TrainConfig` — without the
# run folder:

# %%
#| export
def setup(fam: Family, device: str = "cpu", log: Callable[[str], None] = lambda s: None) -> dict:
    "The prepared data (with the chapter's inputs), the model, its objective and training config, for family `fam`."
    from capbook.stages import chapter_data
    from capbook.profiles import model_hparams, train_config
    from capbook.models import build
    from capbook.objectives import objective_for
    ch, p = fam.chapter, fam.params
    prep = chapter_data(ch, p, device=device)
    if ch.inputs: ch.inputs(prep, p, log)
    seed_everything(p.seed)
    model = build(fam.model, len(prep.vocab), prep.feat_shape[1], prep.grid, **model_hparams(fam.model, p))
    cfg = train_config(ch, p, fam.model, prep.max_len)
    return {"prep": prep, "model": model.to(device), "objective": objective_for(model).to(device), "cfg": cfg,
            "device": torch.device(device)}

def train_batches(s: dict) -> Any:
    "The run's training batches, epoch after epoch (its batch size, order and caption filter)."
    cfg = s["cfg"]
    for epoch in itertools.count():
        yield from s["prep"].train.batches(cfg.batch_size, epoch, cfg.seed, order=cfg.batch_order, max_words=cfg.max_words)

def train_speed(s: dict, batches: int = 12, rounds: int = 3, warmup: int = 3) -> float:
    "Captions per second of the trainer's own step on the family's batches: the same `batches` batches timed `rounds` times, the fastest round kept (a busy spell on the machine only slows a round down), after `warmup` steps (at most `batches`)."
    from capbook.train import train_step
    model, cfg, it = s["model"], s["cfg"], train_batches(s)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model.train(); s["objective"].train()
    prec = cpu_precision(cfg.precision, s["device"])
    step = lambda b: train_step(model, model, s["objective"], opt, b, s["device"], cfg.clip, precision=prec)
    for _ in range(min(warmup, batches)): step(next(it))       # no more warm-up than the batches timed (a quick look: `--batches 1`)
    work, best = [next(it) for _ in range(batches)], float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for b in work: step(b)
        best = min(best, time.perf_counter() - t0)
    return sum(len(b["caps"]) for b in work) / best

def trained_weights(fam: Family, model: torch.nn.Module, profile: str) -> bool:
    "Load the book's trained weights of the family's run into `model` if its checkpoint exists and fits; whether it did."
    from capbook.train import best_checkpoint
    ck = best_checkpoint(runs_dir() / profile / fam.step.name)
    if not ck.exists(): return False
    try: model.load_state_dict(load_torch(ck)["model"])
    except (RuntimeError, KeyError, CapbookError): return False      # written by older code: other shapes or names
    return True

def decode_speed(s: dict, images: int = 100, beam: int | None = None, rounds: int = 3) -> float:
    "Images per second of the batched beam search (the run's beam size) on up to `images` test images (the fastest of `rounds`)."
    from capbook.decode import beam_search
    from capbook.data import to_device
    model, cfg = s["model"].eval(), s["cfg"]
    batch = to_device(next(s["prep"].test.image_batches(images)), s["device"])
    n = len(batch["img"])
    best = float("inf")
    with torch.no_grad():
        beam_search(model, {k: v[:4] for k, v in batch.items()}, beam or cfg.val_beam, cfg.max_len)   # warm-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            beam_search(model, batch, beam or cfg.val_beam, cfg.max_len)
            best = min(best, time.perf_counter() - t0)
    return n / best

# %% [markdown]
# ## Where a step's time goes, and how close it runs to the machine
#
# A throughput alone does not say whether a step could be much faster. `step_profile` adds the two numbers that do:
# the share of the step's time in each kind of operation (torch's profiler, self time per operator, grouped), and the
# floating-point work of its matrix products and convolutions (`torch.utils.flop_counter`, forward and backward)
# divided by the step's time, beside what this machine's matrix product reaches on one large square product at the
# same thread count (`matmul_peak`). A step that spends most of its time in matrix products running near that peak is
# arithmetic-bound: only less arithmetic makes it faster. A step dominated by the other kinds is overhead- or
# memory-bound, where fusing or reordering operations pays.

# %%
#| export
OP_KINDS = {"matrix products": ("mm", "bmm", "addmm", "addmv", "mv", "addmv_", "baddbmm", "dot", "matmul", "linear"),
            "convolutions": ("convolution", "mkldnn_convolution", "convolution_backward", "_convolution"),
            "random draws": ("uniform_", "random_", "bernoulli_", "normal_", "multinomial"),
            "copies and gathers": ("copy_", "cat", "stack", "index", "_index_put_impl_", "index_put_", "gather",
                                   "_to_copy", "clone", "repeat_interleave", "index_select")}

def op_kind(name: str) -> str:
    "The kind of a profiled operator (`aten::mm` -> 'matrix products'); anything else is 'elementwise and other'."
    op = name.split("::")[-1]
    return next((k for k, ops in OP_KINDS.items() if op in ops), "elementwise and other")

def matmul_peak(n: int = 1024, reps: int = 5) -> float:
    "GFLOP/s of one large float32 matrix product on this machine at the current thread count (the best of `reps`)."
    a, b, best = torch.randn(n, n), torch.randn(n, n), float("inf")
    a @ b
    for _ in range(reps):
        t0 = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9

def step_profile(s: dict, batches: int = 4) -> dict:
    "For `batches` training steps of family setup `s`: the share of time per kind of operator, and the matrix products' and convolutions' GFLOP per caption and GFLOP/s."
    from torch.profiler import profile
    from torch.utils.flop_counter import FlopCounterMode
    from capbook.train import train_step
    model, cfg, it = s["model"], s["cfg"], train_batches(s)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model.train(); s["objective"].train()
    step = lambda b: train_step(model, model, s["objective"], opt, b, s["device"], cfg.clip)
    work = [next(it) for _ in range(batches)]
    step(work[0])                                                             # warm-up
    with FlopCounterMode(display=False) as fc:
        for b in work: step(b)
    t0 = time.perf_counter()
    for b in work: step(b)
    secs = time.perf_counter() - t0
    with profile() as pr:
        for b in work: step(b)
    by_kind = {}
    for e in pr.key_averages():
        by_kind[op_kind(e.key)] = by_kind.get(op_kind(e.key), 0.0) + e.self_cpu_time_total
    total = sum(by_kind.values()) or 1.0
    n = sum(len(b["caps"]) for b in work)
    return {"gflop_per_caption": fc.get_total_flops() / n / 1e9, "matrix_gflops": fc.get_total_flops() / secs / 1e9,
            "shares": {k: round(v / total, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}

# %% [markdown]
# ## Two candidates, measured
#
# Two candidates are measured rather than assumed, by `alternatives` for any
# family (`capbook bench --alternatives`):
#
# - **bfloat16 autocast on the CPU** (`TrainConfig.precision`): the family's step in float32 and under
#   `torch.autocast("cpu", torch.bfloat16)` (the products' inputs in bfloat16; weights, optimiser and sums in float32).
#   This CPU has no bfloat16 arithmetic, yet oneDNN's bfloat16 products move half the bytes: it paid for every family
#   (1.1–1.9x), and the trained models came out the same (`capbook.train`'s notes), so `bf16` is the book's default.
# - **Several seeds in one process with stacked parameters** (`torch.func`). Stacking k seeds' parameters makes every
#   product k times as large and leaves the arithmetic per caption unchanged, so it can only win what a batch k times as
#   large wins over the book's batch: the step at twice the batch bounds what two stacked seeds could gain. Measured:
#   0.8–1.08x, so the book runs seeds side by side instead. `stacked_speed` (`capbook bench --stacked K`) now times
#   the stacked step itself (`capbook.stacked.StackedStep`, at its fixed shape, in float32: `stacked_precision`): at the
#   default profile on this 2-core machine, K = 3 seeds together trained NIC at 2,437 captions/s against the eager
#   step's 2,114 (bfloat16), GLIED 753 against 829, the spatial transformer 507 against 693, soft attention 450 against
#   550, Up-Down 332 against 480 and the 2D-LSTM + SPCA 66 against 228. The stacked step takes the plain paths (no
#   shrinking batch; the 2D-LSTM computes every word map per occurrence), which cost the recurrent models most. On a
#   CPU the book keeps the eager step; stacking is for the GPU, where every step is launch-bound.

# %%
#| export
def alternatives(s: dict, batches: int = 8) -> dict:
    "Captions per second of family setup `s` in float32 and under bfloat16 autocast on the CPU, and at twice the batch (the book's precision)."
    import dataclasses
    with_ = lambda **kw: {**s, "cfg": dataclasses.replace(s["cfg"], **kw)}
    out = {p: train_speed(with_(precision=p), batches) for p in ("fp32", "bf16")}
    out["batch_x2"] = train_speed(with_(batch_size=2 * s["cfg"].batch_size), max(1, batches // 2))
    return {k: round(v, 1) for k, v in out.items()}

def stacked_runs(s: dict, k: int, capture: bool = False, tmp=None) -> tuple:
    "`k` runs of family setup `s` (seeds 0..k-1, models built from those seeds) stacked at the fixed shape, in checkpoint folders under `tmp`; `capture`: as one captured CUDA graph (`capbook.stacked.CapturedStep`). Returns the runs, the step and a function that takes one step of every run on its next batch."
    import dataclasses
    from pathlib import Path
    from capbook.models import build, hparams
    from capbook.stacked import stack_runs
    check_int("stacked", k, lo=1)
    prep, m0 = s["prep"], s["model"]
    cfg = dataclasses.replace(s["cfg"], log_every=0, progress=False)
    models = []
    for i in range(k):
        torch.manual_seed(i)
        models.append(build(m0.name, len(prep.vocab), prep.feat_shape[1], prep.grid, **hparams(m0)))
    runs, step = stack_runs(models, prep, [dataclasses.replace(cfg, seed=i, device=str(s["device"])) for i in range(k)],
                            [Path(tmp) / str(i) for i in range(k)], log=lambda x: None, fixed=True, capture=capture)
    its = [train_batches({**s, "cfg": r.cfg}) for r in runs]
    return runs, step, lambda: step(runs, [next(i) for i in its], [cfg.lr] * k)

def stacked_speed(s: dict, k: int, batches: int = 12, rounds: int = 3, warmup: int = 2, capture: bool = False) -> float:
    "Captions per second, all members together, of `k` runs of family setup `s` (seeds 0..k-1, each on its own batches) trained as one stacked model at its fixed shape (`capbook.stacked.StackedStep`); `capture`: every step one replayed CUDA graph (`CapturedStep`, captured in the warm-up)."
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        runs, step, take = stacked_runs(s, k, capture, tmp)
        for _ in range(warmup): take()
        its = [train_batches({**s, "cfg": r.cfg}) for r in runs]
        work, best = [[next(i) for i in its] for _ in range(batches)], float("inf")
        lrs = [r.cfg.lr for r in runs]
        for _ in range(rounds):
            sync(s["device"]); t0 = time.perf_counter()
            for bs in work: step(runs, bs, lrs)
            sync(s["device"]); best = min(best, time.perf_counter() - t0)
    return sum(len(b["caps"]) for bs in work for b in bs) / best

def capture_agreement(s: dict, k: int = 4, steps: int = 6) -> dict:
    "The captured step against the eager one on a CUDA GPU: `k` runs of setup `s` trained `steps` steps from the same weights on the same batches, eagerly twice, eagerly without autocast's cache of cast weights (as capture runs), and captured; the largest difference in the first step's loss, in any loss and in any weight, each against the first eager run (the second eager run: how far two eager runs already part)."
    import tempfile
    from capbook.stacked import autocast_uncached
    import contextlib
    trained = {}
    for name, capture, ctx in (("eager", False, contextlib.nullcontext), ("eager_again", False, contextlib.nullcontext),
                               ("eager_uncached", False, autocast_uncached), ("captured", True, contextlib.nullcontext)):
        with tempfile.TemporaryDirectory() as tmp, ctx():
            runs, step, take = stacked_runs(s, k, capture, tmp)
            losses = torch.tensor([[t["loss"] for t in take()] for _ in range(steps)])
            trained[name] = (losses, [p.detach().clone() for p in step.params.values()])
    names, (l0, w0) = list(step.params), trained["eager"]
    def diff(l, w):
        d = [(x - y).abs().max().item() for x, y in zip(w0, w)]
        return {"first_loss": (l0[0] - l[0]).abs().max().item(), "loss": (l0 - l).abs().max().item(), "weight": max(d),
                "at": names[d.index(max(d))]}
    return {"steps": steps, "members": k, "precision": s["cfg"].precision,
            **{f"{n}_vs_eager": diff(*v) for n, v in trained.items() if n != "eager"}}

def capture_diagnosis(s: dict, k: int = 2) -> dict:
    "Why a stacked step of setup `s` cannot be captured on a CUDA GPU (empty where it can): the capture's error, the operators dispatched last before it, and the first operator that synchronises with the host in an eager step (`torch.cuda.set_sync_debug_mode('error')`), with the innermost capbook line that called it."
    import tempfile, traceback
    from torch.utils._python_dispatch import TorchDispatchMode
    class Ops(TorchDispatchMode):
        def __init__(self): super().__init__(); self.seen = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket)); return func(*args, **(kwargs or {}))
    first = lambda e: (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs, step, take = stacked_runs(s, k, True, tmp)
        batch, static = step.collate([next(train_batches({**s, "cfg": r.cfg})) for r in runs])
        keys = torch.arange(k, device=step.device)
        ops = Ops()
        try:
            with ops: step.capture(batch, keys, static)
            return out
        except Exception as e:
            out |= {"capture_error": first(e), "last_ops": ops.seen[-8:]}
        torch.cuda.synchronize()
        io = {"batch": batch, "keys": keys, "static": static}
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autograd.detect_anomaly(check_nan=False): step.body(io)
        except Exception as e:
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "capbook" in f.filename]
            out |= {"sync_error": first(e), "sync_at": f"{frames[-1].filename.split('capbook/')[-1]}:{frames[-1].lineno} {frames[-1].line}" if frames else ""}
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out

def sync(device) -> None:
    "Wait for a CUDA device's queued work (a timer's edge); nothing on the CPU."
    if torch.device(device).type == "cuda": torch.cuda.synchronize(device)

def capture_bench(profile: str = "default", only: list[str] | None = None, ks: list[int] = (1, 4, 32), batches: int = 8, rounds: int = 2,
                  device: str = "cuda", log: Callable[[str], None] = print) -> dict:
    "On a CUDA GPU, every stackable family's training throughput (captions/s): one run eager (`train_speed`), the largest of `ks` seeds stacked eagerly, and each of `ks` seeds stacked as one captured graph (`stacked_speed`); whether the captured step agrees with the eager one (`capture_agreement`); and why capture fails where it does (`capture_diagnosis`)."
    ks = sorted(ks); k = ks[-1]
    dev = str(get_device(device))
    if torch.device(dev).type != "cuda": raise CapbookError(f"parameter device={device!r}: capturing steps needs a CUDA GPU, and this machine has none")
    out = {"profile": profile, "device": dev, "name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "stacked": k, "families": {}}
    for fam in families(profile, only):
        t0, row = time.perf_counter(), {"step": fam.step.name}
        try:
            s = setup(fam, dev)
            row["train_captions_per_s"] = round(train_speed(s, batches, rounds), 1)
            row["stacked_train_captions_per_s"] = round(stacked_speed(s, k, batches, rounds), 1)
        except Exception as e:                        # not stackable (self-critical, scheduled sampling), or broken: says why
            row["not_stacked"] = f"{type(e).__name__}: {str(e).strip()[:300]}"; out["families"][fam.model] = row
            log(f"{fam.model:12s} not stacked: {row['not_stacked']}"); continue
        try:
            row["captured_train_captions_per_s"] = {n: round(stacked_speed(s, n, batches, rounds, capture=True), 1) for n in ks}
            row["agreement"] = capture_agreement(s)
        except Exception as e:
            row["capture_failed"] = capture_diagnosis(s) or {"error": str(e).splitlines()[0][:300]}
        out["families"][fam.model] = row
        cap = (f"captured {row['captured_train_captions_per_s']} (agreement: {row['agreement']})"
               if "agreement" in row else f"capture failed: {row['capture_failed']}")
        log(f"{fam.model:12s} {row['train_captions_per_s']:7.0f} captions/s alone, {k} stacked {row['stacked_train_captions_per_s']:.0f}, "
            f"{cap}  [{time.perf_counter() - t0:.0f} s]")
    return out

# %% [markdown]
# ## Against the tutorial everyone starts from
#
# The most-used PyTorch Show-Attend-Tell code (sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning, `models.py`,
# `DecoderWithAttention`) is the yardstick a reader brings. `TutorialDecoder` re-implements that decoder from its
# public description — written here, not copied — at capbook's sizes, and the benchmark trains both on the same
# batches of 64 captions with the same optimiser and thread count. Its step: captions sorted by length, and at word t
# only the captions still running are computed (the batch shrinks, which is where the original gets its speed); the
# encoder's attention projection recomputed at every word; a sigmoid gate on the context; the LSTM cell on [word
# embedding; context]; one linear layer from h_t to the words; cross-entropy over the real words plus the doubly
# stochastic penalty. capbook's soft-attention step computes more (the paper's deep output layer, Eq. 7) and is the one
# every chapter trains with. The two are timed in alternating rounds — the same batches through one, then through the
# other, six times — so a busy spell on a shared machine slows both alike.

# %%
#| export
class TutorialDecoder(torch.nn.Module):
    "A speed reference: the tutorial Show-Attend-Tell decoder described above (shrinking batch, per-step encoder projection, gate, one output layer)."
    def __init__(self, n_words: int, D: int, emb: int = 128, hidden: int = 256, att: int = 128, dropout: float = 0.5):
        super().__init__()
        nn = torch.nn
        self.enc_att, self.dec_att, self.full_att = nn.Linear(D, att), nn.Linear(hidden, att), nn.Linear(att, 1)
        self.embed, self.drop = nn.Embedding(n_words, emb), nn.Dropout(dropout)
        self.cell = nn.LSTMCell(emb + D, hidden)
        self.init_h, self.init_c, self.f_beta = nn.Linear(D, hidden), nn.Linear(D, hidden), nn.Linear(hidden, D)
        self.fc = nn.Linear(hidden, n_words)

    def loss(self, feats: torch.Tensor, caps: torch.Tensor, pad: int = 0) -> torch.Tensor:
        "Cross-entropy over the real next words plus the doubly stochastic penalty, for captions `caps` (B, T) from <start>."
        steps = (caps != pad).sum(1) - 1                              # words to predict per caption
        order = steps.argsort(descending=True)
        feats, caps, steps = feats[order], caps[order], steps[order].tolist()
        mean = feats.mean(1)
        h, c, e = self.init_h(mean), self.init_c(mean), self.embed(caps)
        B, T = len(caps), max(steps)
        logits, alphas = feats.new_zeros(B, T, self.fc.out_features), feats.new_zeros(B, T, feats.shape[1])
        for t in range(T):
            bt = sum(s > t for s in steps)                            # captions still running
            a = self.full_att(torch.relu(self.enc_att(feats[:bt]) + self.dec_att(h[:bt]).unsqueeze(1))).squeeze(2).softmax(1)
            z = torch.sigmoid(self.f_beta(h[:bt])) * (feats[:bt] * a.unsqueeze(2)).sum(1)
            h, c = self.cell(torch.cat([e[:bt, t], z], 1), (h[:bt], c[:bt]))
            logits[:bt, t], alphas[:bt, t] = self.fc(self.drop(h)), a
        real = torch.arange(T, device=caps.device)[None] < torch.tensor(steps, device=caps.device)[:, None]
        ce = torch.nn.functional.cross_entropy(logits[real], caps[:, 1:T + 1][real])
        return ce + ((1 - alphas.sum(1)) ** 2).mean()

def tutorial_speed(s: dict, batches: int = 60, rounds: int = 6) -> tuple[float, float]:
    "Captions per second of the family's step and of `TutorialDecoder`'s on the same batches, in alternating rounds."
    from capbook.train import train_step
    model, cfg, prep, dev, it = s["model"], s["cfg"], s["prep"], s["device"], train_batches(s)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    ref = TutorialDecoder(len(prep.vocab), prep.feat_shape[1]).to(dev).train()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=cfg.lr)
    def ref_step(b):
        loss = ref.loss(b["feats"].float().to(dev), b["caps"].to(dev))
        ref_opt.zero_grad(set_to_none=True); loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip); ref_opt.step()
    ours = lambda b: train_step(model, model, s["objective"], opt, b, dev, cfg.clip)
    model.train()
    for _ in range(3): b = next(it); ours(b); ref_step(b)                             # warm-up
    secs, n = {"ours": 0.0, "ref": 0.0}, 0
    for _ in range(rounds):
        work = [next(it) for _ in range(max(1, batches // rounds))]
        for name, fn in (("ours", ours), ("ref", ref_step)):
            t0 = time.perf_counter()
            for b in work: fn(b)
            secs[name] += time.perf_counter() - t0
        n += sum(len(b["caps"]) for b in work)
    return n / secs["ours"], n / secs["ref"]

# %% [markdown]
# ## The self-critical reward
#
# Self-critical training scores every sampled caption with CIDEr-D at every step. The benchmark times a batch of 13
# images × 5 sampled captions (the default SCST batch) with capbook's vectorised `CiderD` (document frequencies of the
# training references, computed once) against pycocoevalcap's `Cider` called on each batch, as most SCST code does
# (which also recomputes the document frequencies from the batch's own references). The "samples" are other images'
# references, so the scores vary as real ones do.

# %%
#| export
def cider_bench(prep, batches: int = 40, images: int = 13, samples: int = 5) -> tuple[float, float]:
    "Milliseconds per SCST batch of `images` x `samples` captions: capbook's `CiderD` and pycocoevalcap's `Cider`."
    from capbook.metrics import CiderD
    from pycocoevalcap.cider.cider import Cider
    refs, rng = prep.train.refs, np.random.default_rng(0)
    cd = CiderD(refs, vocab=prep.vocab, end=True)                      # once, as SelfCritical builds it
    work = []
    for _ in range(batches):
        img = rng.choice(len(refs), images, replace=False)
        cands = [refs[rng.integers(len(refs))][rng.integers(5)] for _ in range(images * samples)]
        work.append(([np.array([prep.vocab.stoi.get(w, prep.vocab.unk) for w in c]) for c in cands],
                     [refs[i] for i in img for _ in range(samples)], cands))
    t0 = time.perf_counter()
    for ids, rs, _ in work: cd.score(ids, rs)
    ours = (time.perf_counter() - t0) / batches * 1000
    t0 = time.perf_counter()
    for _, rs, cands in work:
        Cider().compute_score({i: [" ".join(r) for r in x] for i, x in enumerate(rs)}, {i: [" ".join(c)] for i, c in enumerate(cands)})
    return ours, (time.perf_counter() - t0) / batches * 1000

# %% [markdown]
# ## The benchmark
#
# `bench` runs the families one after another (each built, timed and dropped before the next), then the tutorial
# comparison on Show-Attend-Tell's soft attention and the reward timing, and returns one dictionary; `capbook bench`
# prints a line per family as it goes and the dictionary as JSON on its last line.

# %%
#| export
def bench(profile: str = "default", only: list[str] | None = None, batches: int = 12, tutorial: bool = True,
          device: str = "cpu", profile_ops: bool = True, compare: bool = False, stacked: int = 0,
          log: Callable[[str], None] = print) -> dict:
    "Training (captions/s) and decoding (images/s) throughput of every model family at `profile`, where each step's time goes, the tutorial ratio and the reward timing; `compare`: also each family's `alternatives`; `stacked`: also `stacked` seeds as one model (`stacked_speed`)."
    check_int("batches", batches, lo=1)
    dev = str(get_device(device))
    out = {"profile": profile, "device": dev, "threads": torch.get_num_threads(), "families": {}}
    if profile_ops and dev == "cpu":
        out["matmul_peak_gflops"] = round(matmul_peak(), 1)
        log(f"this machine's float32 matrix product: {out['matmul_peak_gflops']:.0f} GFLOP/s on {out['threads']} thread(s)")
    for fam in families(profile, only):
        t0 = time.perf_counter()
        s = setup(fam, dev)
        train = train_speed(s, batches)
        trained = trained_weights(fam, s["model"], profile)
        dec = decode_speed(s)
        prof = step_profile(s, min(batches, 4)) if profile_ops else {}
        if compare: prof["alternatives"] = alternatives(s)
        if stacked: prof |= {"stacked": stacked, "stacked_train_captions_per_s": round(stacked_speed(s, stacked, batches), 1)}
        out["families"][fam.model] = row = {
            "step": fam.step.name, "n_params": s["model"].n_params, "batch_order": s["cfg"].batch_order,
            "train_captions_per_s": round(train, 1), "beam": s["cfg"].val_beam, "beam_images_per_s": round(dec, 1),
            "trained_weights": trained, **prof}
        where = (f"; {prof['gflop_per_caption'] * 1000:.0f} MFLOP/caption at {prof['matrix_gflops']:.0f} GFLOP/s, "
                 + ", ".join(f"{k} {v:.0%}" for k, v in list(prof["shares"].items())[:3])) if prof else ""
        if compare: where += "; " + ", ".join(f"{k} {v:.0f}" for k, v in prof["alternatives"].items()) + " captions/s"
        if stacked: where += f"; {stacked} seeds stacked: {prof['stacked_train_captions_per_s']:.0f} captions/s"
        log(f"{fam.model:12s} {train:7.1f} captions/s training, {dec:6.1f} images/s beam {row['beam']}"
            f"{'' if trained else ' (untrained weights)'}{where}  [{fam.step.name}, {time.perf_counter() - t0:.0f} s]")
    if tutorial and (not only or "sat_soft" in only):
        s = setup(next(f for f in families(profile, ["sat_soft"])), dev)
        ours, ref = tutorial_speed(s, batches=5 * batches, rounds=6 if batches >= 4 else 2)   # a quick look (`--batches 1`): two rounds
        cider_ms, coco_ms = cider_bench(s["prep"])
        out |= {"sat_soft_train_captions_per_s": round(ours, 1), "tutorial_train_captions_per_s": round(ref, 1),
                "train_vs_tutorial": round(ours / ref, 2), "cider_d_batch_ms": round(cider_ms, 2),
                "pycocoevalcap_cider_batch_ms": round(coco_ms, 2), "cider_d_speedup": round(coco_ms / cider_ms, 1)}
        log(f"Show-Attend-Tell {ours:.0f} captions/s against the tutorial decoder's {ref:.0f} ({ours / ref:.2f}x, "
            f"alternating rounds); SCST reward of 65 captions: {cider_ms:.1f} ms (pycocoevalcap {coco_ms:.1f} ms, "
            f"{coco_ms / cider_ms:.1f}x)")
    return out

# %% [markdown]
# ### The SPCA family's step, profiled and sped up
#
# The 2D-latent LSTM is the book's most expensive family: every step convolves c×7×7 state maps with 3×3 kernels (K_H on
# H_{t-1}, K_V on SPCA's context, SPCA's own Conv₁ and Conv₂ of Eq. 11). Profiled at the sizes the default profile had
# then (c = 32, batch 64, the book's 2-core CPU), a step without the changes below spends 46% of its time in
# convolutions, 38% in elementwise operators and 14% copying and gathering. Run cold, a batch's first step shows where
# the copies come from: gathering the per-position K_X·X maps from the per-word table as a (N, 7, 7, 4c) tensor (its
# gradient a 4-dimensional scatter-add, 15% of that step) and sorting the (B, T, 4c, 7, 7) maps longest caption first
# for the shrinking batch (the index, its backward `index_put` and a fill, 10%). The fast path, kept beside the plain
# equations' code (`plain_paths()` runs the plain code, and `test_spca_fast_paths_compute_the_plain_equations` checks
# both give the same outputs and gradients for every structure and kernel):
#
# - the word table is an embedding looked up inside each step: the recurrence carries word indices, never the maps;
# - K_H·H_{t-1} + K_V·C_t is one convolution of [H_{t-1}; C_t] with the two kernels side by side;
# - the LSTM cell (three sigmoids, two ReLUs, the products and sums) is one autograd node, `Cell2D`, its gradient
#   written out (checked by `gradcheck`);
# - SPCA's channel attention (Eq. 12), 1×1 convolutions of a 1×1 map, runs as the matrix products it is;
# - the 1D decoder averages SPCA's context without making its C×H×W map (`SPCA.pooled`).
#
# Measured with `capbook bench --against e7cee4a --family lstm2d,lstm2d_spca,lstm2d_spca/kernel=5,lstm2d_spca/kernel=1,lstm1d_spca`
# (the code before these changes and today's, three alternating rounds each, the fastest kept; AMD EPYC, 2 threads,
# bfloat16 autocast; the whole result in `figures/bench_2d.json`):
#
# <!-- versus -->
# | family | before (captions/s) | now | speed-up | ceiling: convolutions only | beam images/s, before → now | now: time per kind of operator |
# |---|---|---|---|---|---|---|
# | lstm2d | 556 | 675 | 1.21× | 1435 (2.58×) | 753 → 756 | convolutions 47%, elementwise and other 37%, copies and gathers 12% |
# | lstm2d_spca | 328 | 375 | 1.14× | 646 (1.97×) | 500 → 506 | convolutions 58%, elementwise and other 31%, copies and gathers 8% |
# | lstm2d_spca/kernel=5 | 307 | 356 | 1.16× | 604 (1.97×) | 453 → 470 | convolutions 59%, elementwise and other 30%, copies and gathers 8% |
# | lstm2d_spca/kernel=1 | 335 | 416 | 1.24× | 714 (2.13×) | 546 → 580 | convolutions 58%, elementwise and other 30%, copies and gathers 8% |
# | lstm1d_spca | 218 | 248 | 1.14× | 839 (3.84×) | 783 → 736 | elementwise and other 33%, convolutions 30%, matrix products 28% |
# <!-- /versus -->
#
# The step is 1.14–1.24× faster, not the 2× we aimed for, and the ceiling column says why: the convolutions are now
# three fifths of a 2D step. The ceiling is the step's speed if everything but its convolutions, at the rate they run
# now, took no time: 1.97× the old step for the 2D-LSTM + SPCA at 3×3 or 5×5. Reaching 2× would need less convolution
# arithmetic, which means a different model (fewer channels, a smaller map), not a faster step. The 1D decoder's
# ceiling is higher (3.8×): its step is Show-Attend-Tell's LSTM plus SPCA's 14×14 maps (Conv₂ and the ReLU of Eq. 11
# over a 64-channel map at every step), elementwise work that eager PyTorch does not fuse. Decoding (beam 3) barely
# moved: its steps are the same convolutions, without a backward pass.

# %% [markdown]
# ### Against an earlier commit
#
# A speed-up is only measured against the code it replaces, on the same machine at the same time. `versus` checks out
# an earlier commit into a temporary worktree and times the same families under both codes, in fresh processes that
# alternate (earlier, now, earlier, now, ...), so a busy spell on the machine slows both alike; each keeps its fastest
# round, as `train_speed` keeps its fastest. A family is a model name with optional parameter overrides after `/`
# (`lstm2d_spca/kernel=5`: the book's first `lstm2d_spca` run with a 5×5 kernel). Only functions both codes have are
# called (`families`, `setup`, `train_speed`, `decode_speed`). `capbook bench --against REV --family ...` prints it.

# %%
#| export
_VERSUS = """
import dataclasses, json, sys
import capbook
from capbook.bench import families, setup, train_speed, decode_speed, step_profile
profile, specs, batches = json.loads(sys.argv[1])
out = {"capbook": capbook.__file__}
for label, name, over in specs:
    fam = families(profile, [name])[0]
    fam = dataclasses.replace(fam, params=dataclasses.replace(fam.params, **over))
    s = setup(fam)
    out[label] = [train_speed(s, batches), decode_speed(s), step_profile(s, min(batches, 4))["shares"]]
print(json.dumps(out))
"""

def family_spec(spec: str) -> tuple[str, str, dict]:
    "`name/key=value/...` as (label, model name, parameter overrides); values read as YAML scalars (5, 0.5, S||C)."
    import yaml
    name, *over = spec.split("/")
    pairs = [kv.split("=", 1) for kv in over]
    if any(len(kv) != 2 for kv in pairs): raise CapbookError(f"parameter family={spec!r} is invalid: allowed is name/key=value/...")
    return spec, name, {k: yaml.safe_load(v) for k, v in pairs}

def versus(rev: str, specs: list[str], profile: str = "default", batches: int = 12, rounds: int = 3,
           log: Callable[[str], None] = print) -> dict:
    "Training captions/s and beam images/s of each family in `specs` under commit `rev` and under this code, in alternating fresh processes on this machine, `rounds` each (fastest kept), with each code's `step_profile` shares and the ceiling: the captions/s if the step took only its convolutions' time: {family: {before, now, speedup, ceiling, ...}}."
    import json, os, subprocess, sys, tempfile
    from pathlib import Path
    check_int("rounds", rounds, lo=1); check_profile(profile)
    parsed = [family_spec(s) for s in specs]
    from capbook.core import project_root
    repo, home = Path(__file__).resolve().parents[1], project_root()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True)
    if git("rev-parse", "--verify", f"{rev}^{{commit}}").returncode: raise CapbookError(f"parameter against={rev!r} is invalid: allowed is a commit of {repo}")
    runs = {"before": [], "now": []}
    with tempfile.TemporaryDirectory(prefix="capbook-versus-") as tmp:
        old = Path(tmp) / "code"
        made = git("worktree", "add", "--detach", str(old), rev)
        if made.returncode: raise CapbookError(f"git worktree add {rev} failed: {made.stderr.strip().splitlines()[-1]}")
        try:
            for r in range(rounds):
                for which, tree in (("before", old), ("now", repo)):
                    env = {**os.environ, "PYTHONPATH": str(tree), "CAPBOOK_HOME": str(home)}   # both codes read this book's data
                    res = subprocess.run([sys.executable, "-c", _VERSUS, json.dumps([profile, parsed, batches])],
                                         capture_output=True, text=True, env=env, cwd=tree)   # cwd: `-c` puts it first on the path
                    if res.returncode: raise CapbookError(f"the {which} code failed in round {r + 1}: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
                    got = json.loads(res.stdout.strip().splitlines()[-1])
                    if Path(got.pop("capbook")).resolve().parents[1] != tree.resolve(): raise CapbookError(f"the {which} process imported capbook from elsewhere")
                    runs[which].append(got)
                    log(f"round {r + 1} {which:6s} " + ", ".join(f"{k} {v[0]:.0f}" for k, v in got.items()) + " captions/s")
        finally:
            git("worktree", "remove", "--force", str(old))
    out = {}
    for label, *_ in parsed:
        b, n = (max(x[label][0] for x in runs[w]) for w in ("before", "now"))
        bd, nd = (max(x[label][1] for x in runs[w]) for w in ("before", "now"))
        out[label] = {"before": round(b, 1), "now": round(n, 1), "speedup": round(n / b, 2),
                      "beam_before": round(bd, 1), "beam_now": round(nd, 1), "beam_speedup": round(nd / bd, 2),
                      "rounds": {w: [round(x[label][0], 1) for x in runs[w]] for w in runs},
                      "shares_before": runs["before"][-1][label][2], "shares_now": runs["now"][-1][label][2]}
        conv = out[label]["shares_now"].get("convolutions", 0.0)   # the step's share in convolutions, at the rate they run now
        if conv: out[label] |= {"ceiling": round(n / conv, 1), "ceiling_speedup": round(n / conv / b, 2)}   # if nothing else took time
    return {"against": git("rev-parse", "--short", rev).stdout.strip(), "profile": profile, "threads": torch.get_num_threads(),
            "families": out}

# %%
#| export
def versus_table(d: dict) -> str:
    "`versus`'s result as a markdown table: each family's captions/s before and now, the speed-up, the ceiling and the step's largest shares now."
    rows = ["| family | before (captions/s) | now | speed-up | ceiling: convolutions only | beam images/s, before → now | now: time per kind of operator |",
            "|---|---|---|---|---|---|---|"]
    for k, r in d["families"].items():
        shares = ", ".join(f"{n} {v:.0%}" for n, v in list(r["shares_now"].items())[:3])
        ceiling = f"{r['ceiling']:.0f} ({r['ceiling_speedup']:.2f}×)" if "ceiling" in r else "—"
        rows.append(f"| {k} | {r['before']:.0f} | {r['now']:.0f} | {r['speedup']:.2f}× | {ceiling} | "
                    f"{r['beam_before']:.0f} → {r['beam_now']:.0f} | {shares} |")
    return "\n".join(rows)

# %%
_v = {"against": "abc1234", "families": {"lstm2d": {"before": 500.0, "now": 650.0, "speedup": 1.3, "ceiling": 1300.0, "ceiling_speedup": 2.6,
      "beam_before": 700.0, "beam_now": 720.0, "shares_now": {"convolutions": 0.5, "elementwise and other": 0.4, "copies and gathers": 0.1}}}}
assert "| lstm2d | 500 | 650 | 1.30× | 1300 (2.60×) | 700 → 720 | convolutions 50%, elementwise and other 40%, copies and gathers 10% |" in versus_table(_v)

# %% [markdown]
# ## Whole chapter runs
#
# Step throughput says little about how long a *book* takes: a chapter run also prepares data, validates every half
# epoch, trains the protocol's whole budget of epochs, decodes the test split and measures
# attention. `chapter_times` makes complete chapter runs exactly as the book does (`run_chapter`, the chapter's own
# defaults at `profile`, training seed `seed`) on the device asked for, and reports where each run's time went. Its
# main use is the GPU: `capbook bench --device cuda --chapters 02_show_attend_tell 03_spca` says what a GPU buys the
# default book's slowest rows. The runs land in the usual ad-hoc folders, keyed by their parameters (device
# included), so a repeated call resumes finished training instead of timing it again: the reported `train_s` is then
# the checkpoint's own training time, still the time that training took.

# %%
#| export
def chapter_times(notebooks: list[str], profile: str = "default", device: str = "auto", seed: int = 0,
                  log: Callable[[str], None] = print) -> dict:
    "Complete book runs of each chapter in `notebooks` at `profile` on `device`: wall time, where it went, epochs trained, test CIDEr."
    from capbook.profiles import chapter, epochs_trained
    from capbook.runner import run_chapter
    for nb in notebooks: chapter(nb)                     # an unknown chapter stops before any run
    dev = str(get_device(device))
    out = {"profile": profile, "device": dev, "threads": torch.get_num_threads(), "chapters": {}}
    if dev.startswith("cuda"): out["gpu"] = torch.cuda.get_device_name(torch.device(dev))
    for nb in notebooks:
        t0 = time.perf_counter()
        ctx = run_chapter(nb, {"profile": profile, "device": dev, "seed": seed}, log=lambda s, nb=nb: log(f"  {nb}: {s}"))
        r, t = ctx.record, ctx.record["timings"]
        out["chapters"][nb] = row = {
            "model": r["model"], "precision": r["precision"], "n_params": r["n_params"],
            "wall_s": round(time.perf_counter() - t0, 1), **{k: round(t[k], 1) for k in ("data_s", "train_s", "val_s", "test_s") if k in t},
            "train_captions_per_s": round(t["train_captions_per_s"], 1), "epochs_trained": epochs_trained(r["history"]),
            "best_at": r["best_at"], "CIDEr": round(100 * r["metrics"]["CIDEr"], 1), "run": ctx.run.dir.name}
        log(f"{nb:22s} {row['model']:12s} {row['wall_s']:7.1f} s ({row['train_s']:.0f} s training, {row['val_s']:.0f} s validating, "
            f"{row['test_s']:.0f} s test) for {row['epochs_trained']:g} epochs, best at {row['best_at']:g}; "
            f"{row['train_captions_per_s']:.0f} captions/s; test CIDEr {row['CIDEr']:.1f}  [{dev}, {row['precision']}]")
    return out

# %% [markdown]
# A reader's first contact is one chapter with other parameters, the README's command
# (`papermill nbs/03_spca.ipynb out.ipynb -p kernel 5`). `reader_time` runs exactly that command as a newcomer would on
# a fresh clone: a new papermill process in a clone of this checkout's last commit, its own home (`CAPBOOK_HOME`: no
# run, no prepared data, no cached feature of this book to resume from), and times it from start to end: data
# preparation, training, test decoding and scoring, the notebook's closing lines. `capbook bench --reader` measures it
# at the smoke profile, the toy-sized run README offers for a first try; `figures/bench_reader.json` keeps what it
# measured, and README's one-chapter line reads its minutes from there (the default profile's minutes come from the
# book's own run of the same parameters, `table_book_times`).

# %%
#| export
def reader_time(notebook: str, params: dict, profile: str = "smoke", log: Callable[[str], None] = print) -> dict:
    "Wall time of `papermill nbs/<notebook>.ipynb out.ipynb -p k v … -p profile <profile>` as a newcomer runs it: a fresh clone of this checkout's last commit as its home (`CAPBOOK_HOME`), so nothing of this book's runs or caches is reused; the run's stderr tail in the error if it fails."
    import os, subprocess, sys, tempfile
    from pathlib import Path
    from capbook.core import cpu_name, project_root
    check_profile(profile)
    argv = [f"nbs/{notebook}.ipynb", "out.ipynb"] + [a for k, v in {**params, "profile": profile}.items() for a in ("-p", k, str(v))]
    with tempfile.TemporaryDirectory(prefix="capbook-reader-") as tmp:
        home = Path(tmp) / "capbook"
        subprocess.run(["git", "clone", "-q", str(project_root()), str(home)], check=True)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "papermill", *argv], cwd=home, env={**os.environ, "CAPBOOK_HOME": str(home)},
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode: raise CapbookError(f"papermill {' '.join(argv)} failed in {home}: " + p.stderr.strip()[-400:])
    out = {"command": "papermill " + " ".join(argv), "profile": profile, "wall_s": round(wall, 1), "machine": cpu_name(),
           "measured": time.strftime("%Y-%m-%d")}
    log(f"{out['command']}: {wall / 60:.1f} minutes on {out['machine']}")
    return out

# %% [markdown]
# `figures/bench_gpu.json` keeps what the GPU measured when one was lent (both commands above with `--device cuda`, the
# chapters at seed 0); `gpu_table` renders it for the last section of this page, whose copy a test keeps equal to it.

# %%
#| export
def gpu_table(results: dict) -> str:
    "Markdown of a GPU measurement (`figures/bench_gpu.json`): complete chapter runs, then each family's step."
    rows = [f"{results['device']}; {results['software']}; {results['profile']} profile, {results['precision']}, measured {results['measured']}.", "",
            "| chapter run | model | epochs trained (best at) | training | validation | test decode | wall | captions/s | test CIDEr |",
            "|---|---|---|---|---|---|---|---|---|"]
    for nb, r in results["chapters"].items():
        rows.append(f"| {nb} | {r['model']} | {r['epochs_trained']:g} ({r['best_at']:g}) | {r['train_s']:.0f} s | {r['val_s']:.0f} s | "
                    f"{r['test_s']:.0f} s | {r['wall_s']:.0f} s{'*' if 'resumed' in r else ''} | {r['train_captions_per_s']:.0f} | {r['CIDEr']:.1f} |")
    rows += ["", "| family | training captions/s | beam images/s | MFLOP/caption | matrix GFLOP/s | host time per kind of operator (launches) |",
             "|---|---|---|---|---|---|"]
    for k, r in results["families"].items():
        rows.append(f"| {k} | {r['train_captions_per_s']:.0f} | {r['beam_images_per_s']:.0f} (beam {r['beam']}) | {r['mflop_per_caption']} | "
                    f"{r['matrix_gflops']} | " + ", ".join(f"{n} {v:.0%}" for n, v in r["shares"].items()) + " |")
    return "\n".join(rows)

# %% [markdown]
# `figures/bench_gpu_capture.json` keeps what `make gpu-check` measured (`capbook bench --device cuda --capture`: the
# stacked and captured steps of the section below); `capture_table` renders it there, and the same test keeps that copy
# equal to it.

# %%
#| export
def capture_table(results: dict) -> str:
    "Markdown of a captured-step measurement (`figures/bench_gpu_capture.json`, `capture_bench`'s): each family's training captions/s alone, stacked and captured, the best against one eager run, and how far the captured step and the eager one without autocast's cache part from the eager step in six steps."
    ks = sorted({int(n) for r in results["families"].values() for n in r.get("captured_train_captions_per_s", {})})
    K = results["stacked"]
    rows = [f"{results['name']}; torch {results['torch']}; {results['profile']} profile, bfloat16 autocast; measured {results['measured']} "
            f"(`{results['how']}`).", "",
            f"| family | one run | {K} stacked | " + " | ".join(f"captured, {n} stacked" for n in ks) + " | best ÷ one run "
            "| captured − eager: first loss, loss, weight | eager uncached − eager: loss, weight |",
            "|---|---|---|" + "---|" * len(ks) + "---|---|---|"]
    for f, r in results["families"].items():
        if "captured_train_captions_per_s" not in r:
            rows.append(f"| {f} | " + " | ".join([r.get("not_stacked") or str(r.get("capture_failed"))] + [""] * (len(ks) + 4)) + " |"); continue
        cap, a = r["captured_train_captions_per_s"], r["agreement"]
        c, u = a["captured_vs_eager"], a["eager_uncached_vs_eager"]
        e = lambda x: "0" if x == 0 else f"{x:.0e}"
        rows.append(f"| {f} | {r['train_captions_per_s']:.0f} | {r['stacked_train_captions_per_s']:.0f} | "
                    + " | ".join(f"{cap[str(n)]:.0f}" for n in ks) + f" | {max(cap.values()) / r['train_captions_per_s']:.1f}× | "
                    f"{e(c['first_loss'])}, {e(c['loss'])}, {e(c['weight'])} | {e(u['loss'])}, {e(u['weight'])} |")
    caught = {f: r for f, r in results["families"].items() if "captured_train_captions_per_s" in r}
    ratio = lambda n: [r["captured_train_captions_per_s"][str(n)] / r["train_captions_per_s"] for r in caught.values()]
    rows += ["", "Captured against one eager run: " + "; ".join(
        f"{n} stacked {min(ratio(n)):.1f}–{max(ratio(n)):.1f}× ({sum(x >= 10 for x in ratio(n))} of {len(caught)} families at 10× or more)"
        for n in ks) + "."]
    return "\n".join(rows)

# %% [markdown]
# For example, one chapter run and one family (made-up numbers; the table at the end of this page is `figures/bench_gpu.json`'s, and
# `chapter_times` is tested by running a smoke chapter, `tests/test_speed.py`):

# %%
_g = {"device": "a GPU", "software": "torch", "profile": "smoke", "precision": "bf16", "measured": "today",
      "chapters": {"02_show_attend_tell": {"model": "sat_soft", "epochs_trained": 2.0, "best_at": 1.5, "train_s": 9.6, "val_s": 1.0,
                                           "test_s": 0.4, "wall_s": 12.0, "train_captions_per_s": 600.0, "CIDEr": 40.0}},
      "families": {"sat_soft": {"train_captions_per_s": 700.0, "beam_images_per_s": 1500.0, "beam": 3, "mflop_per_caption": 23,
                                "matrix_gflops": 18, "shares": {"elementwise and other": 0.7, "matrix products": 0.3}}}}
_t = gpu_table(_g)
assert "| 02_show_attend_tell | sat_soft | 2 (1.5) | 10 s | 1 s | 0 s | 12 s | 600 | 40.0 |" in _t
assert "| sat_soft | 700 | 1500 (beam 3) | 23 | 18 | elementwise and other 70%, matrix products 30% |" in _t

# %% [markdown]
# An example at the smoke profile, two families and two batches (the numbers are this machine's, at this moment):

# %%
_b = bench("smoke", only=["sat_soft", "nic"], batches=2, tutorial=False, profile_ops=False, log=lambda s: None)
assert set(_b["families"]) == {"sat_soft", "nic"} and all(r["train_captions_per_s"] > 0 and r["beam_images_per_s"] > 0
                                                           for r in _b["families"].values())
{k: (r["train_captions_per_s"], r["beam_images_per_s"]) for k, r in _b["families"].items()}

# %% [markdown]
# ## On a GPU, measured
#
# A GPU was lent to this book once, for fifteen minutes. There, `tests/test_gpu.py` (skipped where there is no CUDA, as
# on CI) passed: every family's loss on CUDA in float32 equals the CPU's (1e-4; gradients 1e-3) and under the GPU's
# bfloat16 autocast stays within 3 %; the batched beam search finds the CPU's captions; a chapter run trains in bf16,
# scores, and resumes from its checkpoint when killed. Complete chapter runs (`capbook bench --device cuda --chapters
# ...`) and every family's step (`capbook bench --device cuda`), from `figures/bench_gpu.json`:
#
# <!-- gpu -->
# NVIDIA H200 (143,771 MiB, driver 580.159.04), 16 CPU cores; one lease of 15 minutes; python 3.12.3, torch 2.11.0+cu130, torchvision 0.26.0+cu130; no Java (METEOR, SPICE unavailable; PTB tokenizer replaced by whitespace splitting); default profile, bf16 autocast, measured 2026-11-26.
#
# | chapter run | model | epochs trained (best at) | training | validation | test decode | wall | captions/s | test CIDEr |
# |---|---|---|---|---|---|---|---|---|
# | 03_spca | lstm2d_spca | 8.5 (5.5) | 68 s | 13 s | 3 s | 111 s | 932 | 87.1 |
# | 02_show_attend_tell | sat_soft | 15 (13.5) | 122 s | 23 s | 2 s | 66 s* | 918 | 124.1 |
#
# | family | training captions/s | beam images/s | MFLOP/caption | matrix GFLOP/s | host time per kind of operator (launches) |
# |---|---|---|---|---|---|
# | sat_soft | 758 | 1615 (beam 3) | 23 | 18 | elementwise and other 73%, matrix products 18%, copies and gathers 9% |
# | sat_hard | 590 | 1542 (beam 3) | 30 | 20 | elementwise and other 78%, matrix products 14%, copies and gathers 7% |
# | sat_none | 1661 | 8010 (beam 3) | 14 | 30 | elementwise and other 74%, matrix products 16%, copies and gathers 10% |
# | lstm2d_spca | 779 | 1300 (beam 3) | 330 | 210 | elementwise and other 82%, convolutions 10%, copies and gathers 6% |
# | lstm2d | 1894 | 1863 (beam 3) | 164 | 300 | elementwise and other 83%, copies and gathers 6%, matrix products 5% |
# | lstm1d_spca | 514 | 5732 (beam 3) | 90 | 42 | elementwise and other 76%, matrix products 11%, copies and gathers 9% |
# | ssa | 2242 | 4389 (beam 3) | 68 | 131 | elementwise and other 74%, matrix products 17%, copies and gathers 9% |
# | glied | 3638 | 5445 (beam 3) | 44 | 156 | elementwise and other 77%, matrix products 15%, copies and gathers 8% |
# | updown | 952 | 2643 (beam 3) | 42 | 46 | elementwise and other 75%, matrix products 16%, copies and gathers 9% |
# | att2in | 645 | 1946 (beam 3) | 21 | 15 | elementwise and other 77%, matrix products 14%, copies and gathers 9% |
# | nic | 2327 | 5537 (beam 3) | 9 | 19 | elementwise and other 74%, matrix products 17%, copies and gathers 9% |
# | lstm | 2570 | 3873 (beam 3) | 11 | 21 | elementwise and other 73%, matrix products 15%, copies and gathers 12% |
# | sca_cnn | 707 | 7291 (beam 3) | 101 | 74 | elementwise and other 76%, matrix products 16%, copies and gathers 8% |
# | ct | 1624 | 800 (beam 3) | 60 | 76 | elementwise and other 72%, matrix products 17%, copies and gathers 11% |
# <!-- /gpu -->
#
# \* resumed: the lease's first call ran out mid-run, the second resumed the checkpoint; its training and validation
# times are the whole run's. These models are small, and on the GPU their step is bound by launching kernels: three
# quarters of the host's time goes to elementwise operators, and the matrix products run at 15–300 GFLOP/s of the card's
# hundreds of TFLOP/s. The test CIDEr above is not the book's: that machine had no Java, so it is scored on
# whitespace-split text, and these are single seeds. The whole default book has not been run on a GPU.
#
# ### Captured steps
#
# A stacked step (`capbook.stacked`) has fixed shapes and no host synchronisation, so on a GPU `CapturedStep` captures
# it once as one CUDA graph (the gradients of every member and the whole update) and replays that graph at every step:
# a step is one launch after the batch, the keys and the optimiser's numbers for that step are copied into the graph's
# own tensors. `make gpu-check` (`capbook bench --device cuda --capture`) times each family's step alone (the trainer's
# eager step), stacked, and captured at several stack sizes, and trains four seeds six steps eagerly twice, eagerly
# without autocast's cache of cast weights, and captured, from the same weights on the same batches, comparing each
# with the first eager run. Its measurement, `figures/bench_gpu_capture.json`:
#
# <!-- capture -->
# NVIDIA H200; torch 2.11.0+cu130; default profile, bfloat16 autocast; measured 2026-11-28 (`make gpu-check: capbook bench --device cuda --capture --stacked 1 4 32 --batches 6`).
#
# | family | one run | 32 stacked | captured, 1 stacked | captured, 4 stacked | captured, 32 stacked | best ÷ one run | captured − eager: first loss, loss, weight | eager uncached − eager: loss, weight |
# |---|---|---|---|---|---|---|---|---|
# | sat_soft | 898 | 6592 | 3978 | 11263 | 19456 | 21.7× | 0, 1e-04, 9e-04 | 1e-04, 9e-04 |
# | sat_hard | 743 | 6298 | 4035 | 12174 | 18079 | 24.3× | 0, 2e-02, 2e-03 | 2e-02, 2e-03 |
# | sat_none | 2478 | 11708 | 8111 | 22130 | 21234 | 8.9× | 0, 1e-04, 1e-03 | 1e-04, 1e-03 |
# | lstm2d_spca | 779 | 4339 | 4152 | 6224 | 8430 | 10.8× | 0, 2e-03, 1e-03 | 2e-03, 1e-03 |
# | lstm2d | 1408 | 9382 | 7185 | 11700 | 10330 | 8.3× | 0, 3e-04, 1e-03 | 2e-04, 1e-03 |
# | lstm1d_spca | 511 | 4766 | 3412 | 8394 | 11267 | 22.0× | 0, 1e-04, 2e-03 | 1e-04, 2e-03 |
# | ssa | 1931 | 12306 | 6780 | 16510 | 17806 | 9.2× | 0, 2e-04, 4e-04 | 0, 0 |
# | glied | 2942 | 15528 | 8515 | 21378 | 21407 | 7.3× | 0, 9e-05, 3e-04 | 5e-05, 1e-04 |
# | updown | 801 | 6909 | 5176 | 13725 | 22423 | 28.0× | 0, 5e-05, 1e-03 | 6e-05, 1e-03 |
# | att2in | 856 | 9256 | 5624 | 16247 | 23893 | 27.9× | 0, 3e-05, 3e-04 | 3e-05, 3e-04 |
# | nic | 2868 | 12452 | 11299 | 26836 | 21105 | 9.4× | 0, 2e-05, 1e-03 | 2e-05, 1e-03 |
# | lstm | 2722 | 12145 | 11376 | 27025 | 20120 | 9.9× | 0, 2e-05, 9e-04 | 2e-05, 9e-04 |
# | sca_cnn | 635 | 7048 | 4311 | 11197 | 14355 | 22.6× | 0, 1e-04, 3e-03 | 2e-04, 3e-03 |
# | ct | 1692 | 11375 | 5881 | 16787 | 19643 | 11.6× | 0, 3e-04, 9e-04 | 0, 0 |
#
# Captured against one eager run: 1 stacked 2.9–6.8× (0 of 14 families at 10× or more); 4 stacked 7.3–19.0× (6 of 14 families at 10× or more); 32 stacked 7.3–28.0× (8 of 14 families at 10× or more).
# <!-- /capture -->
#
# **Every family captures.** An earlier probe on an H100 had failed to capture soft attention, Up-Down and the spatial
# transformer ("operation failed due to a previous error during capture", in the backward pass); its script was not
# kept. The step captured here runs without autocast's cache of cast weights, which CUDA graphs require (the cache holds
# casts made inside the capture), with keyed draws and the optimiser's numbers on the device; the cache is the likely
# cause of the earlier failure, not a measured one. Should a family fail again, `capture_diagnosis` reports the capture's
# error, the last operators dispatched and the first that synchronises with the host.
#
# **Speed.** One run captured alone gains what the launches cost; stacked seeds multiply that (the line under the
# table). 32 seeds add little over four for most families and lose for the plain LSTMs (nic, lstm, lstm2d, sat_none),
# whose `nn.LSTMCell` has no batching rule under `vmap` (torch warns of it) and runs member by member inside the step.
# The book's rows have three seeds each, so four is the stack size that matters for it.
#
# **Agreement.** In every family the first step's losses are equal to the bit, and two eager runs agree to the bit
# throughout. After the first update the captured step parts from the eager one by 2·10⁻⁵–2·10⁻³ in loss (2·10⁻² for
# hard attention, whose sampled locations flip on such differences) and up to 3·10⁻³ in a weight. For the recurrent
# families the eager step *without autocast's cache* parts from the eager step by the same amounts: the difference is
# the cache, not the graph. With the cache, a weight is cast to bfloat16 once per step and read at each of the T time
# steps, so its T gradients are summed in bfloat16; without it, each read's gradient returns to float32 and they are
# summed there (`capbook.stacked`'s example of `autocast_uncached` measures it on the CPU). The transformers (ssa, ct) read each weight once a step, so for
# them the cache changes nothing, yet their captured step parts from the eager one by 2–3·10⁻⁴ in loss: that residual
# was measured while the eager update still divided by numbers held on the host. *capbook:* since this measurement
# the stacked step on a GPU always runs without the cache and with the update's numbers on the device, captured or not:
# one arithmetic. The "one run" and "captured" columns are today's code; the "32 stacked" column and both agreement
# columns were measured before that change, and the next `make gpu-check` measures whether eager and captured now agree
# to the bit.
#
# Not yet captured: the beam search, whose batch shrinks as images finish (a graph needs a fixed-shape search that
# carries finished beams to the end), and the book itself, whose runs still train one at a time on the CPU.
