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
# # book
#
# > The papermill runner that regenerates the book, the results records every run leaves, the benchmark, and the
# > `capbook` command line.

# %%
#| default_exp book

# %%
#| export
from __future__ import annotations
import argparse, json, os, platform, shutil, sys, time
from dataclasses import dataclass, field
from pathlib import Path
import torch
from capbook.core import (CapbookError, check_choice, code_version, load_json, project_root, runs_dir, save_json,
                          stable_hash, package_hash)

# %% [markdown]
# ## Profiles
#
# A profile sets the sizes of everything: `smoke` is a minutes-long run for CI, `default` the book as published on a
# 2-core CPU, `paper` the papers' own settings for real data on a GPU. The paper notebooks read their per-profile
# defaults from here, so a profile means the same thing everywhere.

# %%
#| export
PROFILES = ("smoke", "default", "paper")

def check_profile(profile: str) -> str:
    "Stop unless `profile` is a known profile."
    return check_choice("profile", profile, PROFILES)

def out_dir(profile: str) -> Path:
    "Where a profile's tables and figures are published: `figures/` for the default profile, else inside its run folder."
    check_profile(profile)
    return project_root() / "figures" if profile == "default" else runs_dir() / profile / "figures"


# %% [markdown]
# ## Runs and results records
#
# Every runnable notebook calls `start_run(name, params)` after validating its parameters. The run folder is the one
# the book runner passed (`run_dir`), or, for a notebook run by hand with papermill,
# `runs/<profile>/adhoc/<name>-<hash of its parameters>` — so a hand-run with other parameters never overwrites the
# book's results. `Run.record(...)` writes the run's results record, `record.json`: parameters, seed, code version,
# metrics, timings, parameter count, machine. Tables are assembled from records.

# %%
#| export
@dataclass
class Run:
    "A notebook run: its name, parameters, folder and start time."
    name: str
    params: dict
    dir: Path
    t0: float = field(default_factory=time.time)

    def path(self, name: str) -> Path:
        "A file inside the run folder."
        return self.dir / name

    def record(self, metrics: dict, timings: dict | None = None, n_params: int | None = None, **extra) -> dict:
        "Write this run's results record `record.json` (atomically) and return it."
        rec = {"notebook": self.name, "params": self.params, "seed": self.params.get("seed"),
               "profile": self.params.get("profile"), "code_version": code_version(), "metrics": metrics,
               "timings": {**(timings or {}), "wall_s": time.time() - self.t0}, "n_params": n_params,
               "machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "device": "cuda" if torch.cuda.is_available() else "cpu",
                           "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
               "finished": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}
        save_json(self.dir / "record.json", rec)
        return rec

def start_run(name: str, params: dict) -> Run:
    "Validate the profile, create the run folder (the book's `run_dir` parameter, or an ad-hoc one) and return the `Run`."
    check_profile(params.get("profile"))
    p = {k: v for k, v in params.items() if k != "run_dir"}
    d = params.get("run_dir") or runs_dir() / p["profile"] / "adhoc" / f"{name}-{stable_hash(p, 8)}"
    d = Path(d); d.mkdir(parents=True, exist_ok=True)
    return Run(name, p, d)

def records(profile: str, notebook: str | None = None) -> list[dict]:
    "Every results record of a profile (book runs and ad-hoc runs), optionally of one notebook."
    out = []
    for f in sorted((runs_dir() / profile).rglob("record.json")):
        r = load_json(f, "results record"); r["_dir"] = str(f.parent)
        if notebook is None or r.get("notebook") == notebook: out.append(r)
    return out


# %% [markdown]
# ## The plan
#
# The book is a list of notebook runs, executed in order. Library notebooks run as they are (their inline checks and
# documentation); runnable notebooks get the profile and any plan parameters. A later paper adds its entries here. An
# ablation is the same notebook with other parameters and a `tag`; an assembly notebook (such as `02a_soft_vs_hard`)
# then finds each run's results record with `step_record` — the book's own run of that step, or else a hand run
# (`papermill ... -p ...`) whose parameters are exactly the step's — and builds the paper's tables and figures from
# them. Tagged runs are not published or shown on the site on their own: their results reach the reader through the
# assembly notebook.

# %%
#| export
@dataclass
class Step:
    "One notebook run of the plan: notebook stem, parameters, and a tag for runs of the same notebook."
    notebook: str
    params: dict = field(default_factory=dict)
    tag: str = ""
    @property
    def name(self) -> str: return self.notebook + (f"-{self.tag}" if self.tag else "")

LIBRARY = ["00_core", "00a_shapes", "00b_data", "00c_encoders", "00d_attention", "00e_models", "00f_decode",
           "00g_train", "00h_metrics", "00i_docs", "00j_viz", "00k_papers", "00l_book"]

SAT_RUNS = {"": {}, "hard": {"attention": "hard"}, "none": {"attention": "none"},     # Table 1
            "hard-lr1": {"attention": "hard", "lambda_r": 1.0},                        # lambda_r chosen on validation
            "no-penalty": {"penalty": 0.0}, "no-gate": {"gate": False}}                # §4.2.1 ablation

SPCA_RUNS = {"": {},                                                                # 2D-latent-LSTM + SPCA, S||C, 3x3
             "base": {"structure": "none"}, "S": {"structure": "S"}, "C": {"structure": "C"},   # Table 2
             "C-S": {"structure": "C-S"}, "S-C": {"structure": "S-C"},
             "k1": {"kernel": 1}, "k5": {"kernel": 5},                                # Table 3
             "1d": {"decoder": "1d"}}                                                 # Tables 1 and 4

def plan(profile: str) -> list[Step]:
    "The runs that regenerate the book at `profile`, in order."
    p = {"profile": profile}
    return ([Step("index"), Step("01_dataset", p)]
            + [Step("02_show_attend_tell", {**p, **kw}, tag) for tag, kw in SAT_RUNS.items()]
            + [Step("02a_soft_vs_hard", p)]
            + [Step("03_spca", {**p, **kw}, tag) for tag, kw in SPCA_RUNS.items()]
            + [Step("03a_spca_tables", p)]
            + [Step(n) for n in LIBRARY])

def nb_defaults(notebook: str) -> dict:
    "The default values of a notebook's `parameters` cell."
    import ast, papermill as pm
    return {k: ast.literal_eval(v["default"]) for k, v in pm.inspect_notebook(str(nbs_dir() / f"{notebook}.ipynb")).items()}

_NOT_CONFIG = ("run_dir", "device")   # parameters that do not change what a run measures

def step_record(profile: str, step: Step) -> dict:
    "The results record of a plan step: the book's own run, else the latest hand run with exactly its parameters."
    want = {k: v for k, v in {**nb_defaults(step.notebook), **step.params}.items() if k not in _NOT_CONFIG}
    book = runs_dir() / profile / step.name
    same = [r for r in records(profile, step.notebook)
            if {k: v for k, v in r["params"].items() if k not in _NOT_CONFIG} == want]
    same.sort(key=lambda r: (Path(r["_dir"]) == book, r.get("finished", "")))
    if not same:
        raise CapbookError(f"no results record of {step.name} at profile {profile!r} (parameters {step.params}): "
                           f"run `capbook book --profile {profile}` first")
    return same[-1]

def nbs_dir() -> Path:
    "The notebook sources."
    return Path(__file__).resolve().parent.parent / "nbs"


# %% [markdown]
# ## Running the plan
#
# Each step is executed by papermill into `runs/<profile>/<step>/<notebook>.ipynb` (runnable notebooks also get that
# folder as `run_dir`). A step is skipped when its folder holds a `done.json` whose key — a hash of the notebook
# source, the parameters and the package code — matches: an unchanged run is not redone. The first failure stops the
# book with one line naming the notebook and the cell. Then the tables and figures of every run are published to the
# profile's output folder (`figures/` for the default profile; a smoke run never touches it) and the docs site is
# built from the executed notebooks.

# %%
#| export
def _key(step: Step, src: Path) -> str:
    return stable_hash({"nb": stable_hash(src.read_text(), 16), "params": step.params, "code": package_hash()}, 16)

def run_step(step: Step, profile: str, force: bool = False, log=print) -> tuple[Path, bool]:
    "Execute one plan step with papermill unless unchanged; return (executed notebook path, whether it ran)."
    import papermill as pm
    src = nbs_dir() / f"{step.notebook}.ipynb"
    if not src.exists(): raise CapbookError(f"{src}: notebook of the plan not found")
    d = runs_dir() / profile / step.name
    out, done, key = d / f"{step.notebook}.ipynb", d / "done.json", _key(step, src)
    if not force and done.exists() and out.exists() and load_json(done).get("key") == key:
        log(f"  {step.name}: unchanged, skipped"); return out, False
    d.mkdir(parents=True, exist_ok=True); done.unlink(missing_ok=True)
    params = {**step.params, "run_dir": str(d)} if step.params else {}
    t0 = time.time()
    try:
        pm.execute_notebook(str(src), str(out), parameters=params, cwd=str(src.parent), progress_bar=False,
                            kernel_name="python3")
    except pm.PapermillExecutionError as e:
        raise CapbookError(f"notebook {src.name} failed in cell {e.cell_index} (execution count {e.exec_count}): "
                           f"{e.ename}: {str(e.evalue).splitlines()[0] if e.evalue else ''} — executed copy: {out}") from None
    save_json(done, {"key": key, "seconds": time.time() - t0})
    log(f"  {step.name}: ran in {time.time() - t0:.1f} s")
    return out, True

def publish(profile: str, steps: list[Step]) -> Path:
    "Copy the tables (table_*.md/.csv) and figures (*.png) of every untagged run to the profile's output folder."
    dst = out_dir(profile); dst.mkdir(parents=True, exist_ok=True)
    for s in steps:
        if s.tag: continue                          # ablation runs: their results reach the book through assembly notebooks
        for f in (runs_dir() / profile / s.name).glob("*"):
            if f.suffix == ".png" or (f.name.startswith("table_") and f.suffix in (".md", ".csv")):
                tmp = dst / f".{f.name}.tmp"; shutil.copyfile(f, tmp); os.replace(tmp, dst / f.name)
    return dst

def run_book(profile: str = "default", force: bool = False, docs: bool = True, log=print) -> dict:
    "Regenerate the book at `profile`: run the plan, publish tables and figures, build the docs site."
    check_profile(profile)
    os.environ.setdefault("TQDM_DISABLE", "1")      # progress bars would fill the executed notebooks and the site
    t0, steps, executed = time.time(), plan(profile), []
    log(f"capbook book --profile {profile}: {len(steps)} notebooks -> {runs_dir() / profile}")
    for s in steps:
        out = run_step(s, profile, force, log)[0]
        if not s.tag: executed.append(out)          # the site shows each notebook once: its untagged run
    dst = publish(profile, steps)
    log(f"tables and figures -> {dst}")
    site = None
    if docs:
        from capbook.docs import build_site
        order = [p for p in executed if not p.parent.name.startswith("00")] + [p for p in executed if p.parent.name.startswith("00")]
        site = build_site(order, runs_dir() / profile / "site", title="capbook",
                          api_modules=[f"capbook.{m}" for m in MODULES])
        log(f"docs site -> {site}")
    secs = time.time() - t0
    log(f"book regenerated in {secs:.0f} s")
    return {"seconds": secs, "site": site, "out": dst}

MODULES = ["core", "shapes", "data", "encoders", "attention", "models", "decode", "train", "metrics", "viz", "papers",
           "book", "docs", "sat", "spca"]


# %% [markdown]
# ## Benchmark
#
# `capbook bench` measures, for the soft-attention model on the profile's features: training throughput (captions per
# second through the trainer's own step), batched beam search (beam 3, all test images in batches of 100) and the same
# search run on the same images one image at a time — the way most tutorial code decodes. It uses the book's trained checkpoint when there
# is one (decoding speed depends on caption lengths), else freshly initialised weights, and prints one JSON object on its
# last line.

# %%
#| export
def bench(profile: str = "default", train_batches: int = 30, log=print) -> dict:
    "Time training and batched vs per-image beam search for the soft-attention model; return the figures."
    from capbook.data import prepare
    from capbook.models import build
    from capbook.decode import beam_search
    from capbook.train import train_step
    from capbook.core import load_torch, seed_everything, get_device
    check_profile(profile)
    prep = prepare("shapes", profile)
    seed_everything(0); dev = get_device()
    model = build("sat_soft", len(prep.vocab), prep.feat_shape[1], prep.grid).to(dev)
    ck = runs_dir() / profile / "02_show_attend_tell" / "ckpt" / "best.pt"
    trained = ck.exists()
    if trained: model.load_state_dict(load_torch(ck)["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batches = prep.train.batches(64, epoch=0, seed=0)
    model.train()
    for _ in range(3): train_step(model, model, opt, next(batches), dev, clip=5.0)     # warm-up
    t0, n = time.time(), 0
    for _ in range(train_batches):
        b = next(batches); train_step(model, model, opt, b, dev, clip=5.0); n += len(b["caps"])
    train_cps = n / (time.time() - t0)
    if trained: model.load_state_dict(load_torch(ck)["model"])
    model.eval()
    feats = torch.as_tensor(prep.test.feats[:]).float().to(dev)
    beam_search(model, feats[:10], 3, prep.max_len)                                       # warm-up
    t0 = time.time()
    for i in range(0, len(feats), 100): beam_search(model, feats[i:i + 100], 3, prep.max_len)
    beam_ips = len(feats) / (time.time() - t0)
    t0 = time.time()
    for i in range(len(feats)): beam_search(model, feats[i:i + 1], 3, prep.max_len)
    loop_ips = len(feats) / (time.time() - t0)
    out = {"profile": profile, "model": "sat_soft", "trained_weights": trained, "device": str(dev),
           "threads": torch.get_num_threads(), "train_captions_per_s": round(train_cps, 1),
           "beam_images_per_s": round(beam_ips, 1), "loop_beam_images_per_s": round(loop_ips, 1),
           "beam_speedup": round(beam_ips / loop_ips, 1), "n_params": model.n_params}
    log(f"training: {train_cps:.0f} captions/s; beam 3 batched: {beam_ips:.0f} images/s; "
        f"one image at a time: {loop_ips:.1f} images/s ({beam_ips / loop_ips:.1f}x)")
    return out


# %% [markdown]
# ## Command line
#
# `capbook book --profile smoke|default` regenerates the book; `capbook bench` prints the benchmark; `capbook train`
# trains one registered model on a dataset outside any notebook (the tests use it to kill and resume a run, and to run
# it under `torchrun`). A `CapbookError` ends the command with its one line on stderr and exit status 2.

# %%
#| export
def train_cli(model: str, profile: str, run_dir: str, epochs: int, ckpt_every: int = 0, batch_size: int = 64,
              seed: int = 0) -> dict:
    "Train a registered model on shapes at `profile` into `run_dir/ckpt`; return the fit summary (rank 0 prints it)."
    from capbook.data import prepare
    from capbook.models import build
    from capbook.train import TrainConfig, fit
    from capbook.core import seed_everything
    prep = prepare("shapes", profile, seed=0)
    seed_everything(seed)
    m = build(model, len(prep.vocab), prep.feat_shape[1], prep.grid)
    cfg = TrainConfig(epochs=epochs, batch_size=batch_size, seed=seed, ckpt_every=ckpt_every, progress=False,
                      max_len=prep.max_len, patience=epochs)
    res = fit(m, prep, cfg, Path(run_dir) / "ckpt", meta={"model": model}, log=lambda s: print(s, file=sys.stderr))
    checksum = float(sum(p.detach().double().sum() for p in m.parameters()))
    return {"history": res.history, "best_epoch": res.best_epoch, "best_score": res.best_score,
            "world_size": res.world_size, "param_checksum": checksum, "resumed_from": res.resumed_from}

def main(argv: list[str] | None = None) -> int:
    "The `capbook` command: `book`, `bench` and `train` subcommands."
    ap = argparse.ArgumentParser(prog="capbook", description="capbook: the attention-captioning reproduction book")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("book", help="regenerate the book (notebooks, tables, figures, docs site)")
    b.add_argument("--profile", default="default", choices=PROFILES)
    b.add_argument("--force", action="store_true", help="rerun notebooks even if unchanged")
    b.add_argument("--no-docs", action="store_true", help="skip building the docs site")
    be = sub.add_parser("bench", help="print training and decoding speed as JSON")
    be.add_argument("--profile", default="default", choices=PROFILES)
    t = sub.add_parser("train", help="train one registered model on shapes (supports torchrun)")
    t.add_argument("--model", default="sat_soft"); t.add_argument("--profile", default="smoke", choices=PROFILES)
    t.add_argument("--run-dir", required=True); t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--ckpt-every", type=int, default=0); t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "book": run_book(a.profile, force=a.force, docs=not a.no_docs)
        elif a.cmd == "bench": print(json.dumps(bench(a.profile)))
        else:
            out = train_cli(a.model, a.profile, a.run_dir, a.epochs, a.ckpt_every, a.batch_size, a.seed)
            if int(os.environ.get("RANK", 0)) == 0: print(json.dumps(out))
    except CapbookError as e:
        print(f"error: {e}", file=sys.stderr); return 2
    return 0
