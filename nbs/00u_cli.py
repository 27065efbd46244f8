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
# # cli
#
# > The `capbook` command line: every command with a one-line purpose and an example, above the book, the bench and the engine it calls.

# %%
#| default_exp cli

# %%
#| export
from __future__ import annotations
import argparse, inspect, json, os, sys
from pathlib import Path
from capbook.core import CapbookError, check_int, cpu_precision, error_line, get_device, io_error, os_error_line
from capbook.profiles import PROFILES, check_profile
from capbook.book import book_lock, build_docs, chapter_status, run_book, sync_parameters, sync_readme
from capbook.plan import nbs_dir

# %% [markdown]
# *capbook:* the command line is its own module, the top layer: it imports the book (`capbook.book`), the benchmark
# (`capbook.bench`) and the engine, and nothing imports it.

# %% [markdown]
# ## The commands
#
# `capbook book --profile smoke|default` regenerates the book; `capbook bench` prints the benchmark (`capbook.bench`); `capbook train`
# trains one registered model on a dataset outside any notebook (the tests use it to kill and resume a run, and to run
# it under `torchrun`); its parameters come from flags or a YAML file (`--config`), and the run folder's `params.yaml`
# holds them all resolved, so `capbook train --config <run>/params.yaml` is the same run again (it finds its training
# finished). A `CapbookError` ends the command with its one line on stderr and exit status 2.

# %%
#| export
def train_cli(model: str = "sat_soft", profile: str = "smoke", run_dir: str | None = None, epochs: int = 2, ckpt_every: int = 0,
              batch_size: int = 64, seed: int = 0, train: dict | None = None, hparams: dict | None = None) -> dict:
    "Train a registered model on shapes at `profile` into `run_dir/ckpt`, with `train` (TrainConfig fields) and `hparams` (model sizes) over the defaults; write `run_dir/params.yaml`, every parameter resolved; return the fit summary."
    import dataclasses
    from capbook.prepare import prepare
    from capbook.models import build, hparams as model_sizes
    from capbook.train import TrainConfig, fit
    from capbook.core import save_yaml, seed_everything
    from capbook.models import spec
    spec(model); check_profile(profile)                        # every argument is checked before any work
    if not run_dir: raise CapbookError("parameter run_dir is missing: give --run-dir or run_dir in the --config file")
    for name, v in (("train", train), ("hparams", hparams)):
        if v is not None and not isinstance(v, dict): raise CapbookError(f"parameter {name}={v!r} is invalid: expected a mapping of names to values")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for k in (train or {}):
        if k not in fields: raise CapbookError(f"parameter train.{k} is unknown: TrainConfig's fields are {', '.join(sorted(fields))}")
    cfg = TrainConfig(**{"progress": False, "patience": max(epochs, 1), **(train or {}),
                         "epochs": epochs, "batch_size": batch_size, "seed": seed, "ckpt_every": ckpt_every}).check()
    cfg.precision = cpu_precision(cfg.precision, get_device(cfg.device))    # 'auto' as this machine resolves it, into params.yaml
    try: (Path(run_dir) / "ckpt").mkdir(parents=True, exist_ok=True)
    except OSError as e: raise io_error(Path(run_dir) / "ckpt", e, "create the run folder") from None
    prep = prepare("shapes", profile, seed=0)
    seed_everything(seed)
    m = build(model, len(prep.vocab), prep.feat_shape[1], prep.grid, **(hparams or {}))
    cfg.max_len = prep.max_len
    if int(os.environ.get("RANK", 0)) == 0:
        save_yaml(Path(run_dir) / "params.yaml", {"model": model, "profile": profile, "run_dir": str(run_dir), "epochs": epochs,
                                                 "ckpt_every": ckpt_every, "batch_size": batch_size, "seed": seed,
                                                 "train": dataclasses.asdict(cfg), "hparams": model_sizes(m)},
                  f"capbook train: every parameter of the run in this folder, resolved.\nThe same run again: capbook train --config {Path(run_dir) / 'params.yaml'}")
    res = fit(m, prep, cfg, Path(run_dir) / "ckpt", log=lambda s: print(s, file=sys.stderr))
    checksum = float(sum(p.detach().double().sum() for p in m.parameters()))
    return {"history": res.history, "best_epoch": res.best_epoch, "best_score": res.best_score,
            "world_size": res.world_size, "param_checksum": checksum, "resumed_from": res.resumed_from, "precision": res.precision}

CAPTION_MODEL = "02_show_attend_tell"      # `capbook caption`'s default run: Show, Attend and Tell's soft attention, seed 0

TRAIN_DEFAULTS = {k: v.default for k, v in inspect.signature(train_cli).parameters.items()}   # `capbook train`'s parameters, declared once: train_cli's

def train_params(config: str | None, flags: dict) -> dict:
    "`capbook train`'s parameters: the defaults, then the `--config` YAML file's, then the flags given; an unknown key in the file stops in one line."
    from capbook.core import load_yaml
    conf = load_yaml(config) if config else {}
    for k in conf:
        if k not in TRAIN_DEFAULTS:
            raise CapbookError(f"{config}: unknown parameter {k!r}: allowed are {', '.join(TRAIN_DEFAULTS)}")
    return {**TRAIN_DEFAULTS, **conf, **{k: v for k, v in flags.items() if v is not None}}

def main(argv: list[str] | None = None) -> int:
    "The `capbook` command: `book`, `docs`, `caption`, `score`, `bench`, `train`, `rehearse`, `params` and `readme` subcommands."
    ap = argparse.ArgumentParser(prog="capbook", description="capbook: the attention-captioning reproduction book",
                                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("book", help="regenerate the book (notebooks, tables, figures, docs site)")
    b.add_argument("--profile", default="default", choices=PROFILES)
    b.add_argument("--force", action="store_true", help="rerun notebooks even if unchanged")
    b.add_argument("--no-docs", action="store_true", help="skip building the docs site")
    b.add_argument("-j", "--jobs", type=int, default=None, help="notebooks run side by side (each with its share of the cores; "
                   "default 1); with --executor slurm, jobs queued at once (default: every step that is ready)")
    b.add_argument("--executor", default="local", choices=("local", "slurm"), help="where steps run: processes on this machine "
                   "(default), or one SLURM job each through submitit (CAPBOOK_HOME, CAPBOOK_DATA and the venv on a filesystem "
                   "the nodes share; see capbook.cluster)")
    b.add_argument("--executor-config", metavar="YAML", help="with --executor slurm: each step's CPUs, GPUs, memory, time "
                   "limit, partition, account and sbatch options (capbook.cluster.Resources; default: capbook's per profile)")
    b.add_argument("--only", nargs="+", metavar="PATTERN", help="only these notebooks or steps (shell patterns; "
                   "e.g. 03_spca 03a_spca_tables; =03_spca: the step of that name alone, not the chapter's every run): "
                   "the other chapters' published tables and copies stay")
    b.add_argument("--dry-run", action="store_true", help="only say which steps would run (with --executor slurm: each job's "
                   "sbatch script) and run or submit nothing")
    b.add_argument("--device", metavar="DEVICE", help="the device book: every chapter run on DEVICE (cuda, cuda:N, or cpu to try it), "
                   "a row's seeds trained as one stacked model, in a home of its own (runs/device-DEVICE/)")
    b.add_argument("--bare", action="store_true", help="the chapter runs alone, without papermill or Jupyter kernels (a machine "
                   "with torch alone, as a GPU may be lent); their records are published, the tables chapters run later")
    b.add_argument("--received", nargs="+", metavar="PART", help="with --device: what a bare device book's machine gave back "
                   "(its gpu_book-N.tar.gz parts, or their folder), taken into the device book here, METEOR scored, and its "
                   "tables chapters run on those records, their verdicts set beside the CPU book's (table_device_verdicts)")
    be = sub.add_parser("bench", help="print every model family's training and decoding speed (JSON on the last line)")
    be.add_argument("--profile", default="default", choices=PROFILES)
    be.add_argument("--family", help="comma-separated model names (default: every registered model)")
    be.add_argument("--batches", type=int, default=12, help="timed training batches per family")
    be.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    be.add_argument("--alternatives", action="store_true", help="also time each family in fp32 and bf16, and at twice the batch")
    be.add_argument("--stacked", type=int, nargs="+", default=[0], metavar="K", help="also time K seeds trained as one stacked model "
                    "(the graph-ready step); with --capture, each K given (the eager stack at the largest)")
    be.add_argument("--capture", action="store_true", help="instead, on a CUDA GPU: each family alone, K seeds stacked (--stacked, "
                    "default 32; several: each) eagerly and captured as one CUDA graph, the captured step against the eager one, and why a capture fails")
    be.add_argument("--against", metavar="REV", help="instead: time --family under commit REV and under this code in alternating "
                    "processes (families may override parameters: lstm2d_spca/kernel=5)")
    be.add_argument("--rounds", type=int, default=3, help="with --against: alternating rounds per code (the fastest kept)")
    be.add_argument("--chapters", nargs="+", metavar="NOTEBOOK", help="instead: time complete chapter runs as the book makes them "
                    "(e.g. 02_show_attend_tell 03_spca): training to the protocol's stop, test decoding, measurements")
    be.add_argument("--reader", action="store_true", help="instead: time README's one-chapter command as a newcomer runs it "
                    "(papermill in a fresh clone of the last commit, at --profile; what figures/bench_reader.json keeps at smoke)")
    t = sub.add_parser("train", help="train one registered model on shapes (supports torchrun)")
    t.add_argument("--config", metavar="YAML", help="parameters from this file (a run folder's params.yaml repeats that run); "
                   "flags given override it; keys: " + ", ".join(TRAIN_DEFAULTS))
    t.add_argument("--model"); t.add_argument("--profile", choices=PROFILES)
    t.add_argument("--run-dir"); t.add_argument("--epochs", type=int)
    t.add_argument("--ckpt-every", type=int); t.add_argument("--batch-size", type=int)
    t.add_argument("--seed", type=int)
    fc = sub.add_parser("fit-chapter", help="train a chapter run's stages in its run folder (under torchrun: what a book step "
                        "with several GPUs runs; capbook.stages.fit_stages)")
    fc.add_argument("notebook", help="the chapter's notebook, e.g. 02_show_attend_tell")
    fc.add_argument("run_dir", help="the run folder, holding the params.yaml its notebook wrote")
    d = sub.add_parser("docs", help="build the docs site from the last book's kept notebooks (no training) into "
                       "runs/<profile>/site/ (index.html)")
    d.add_argument("--profile", default="default", choices=PROFILES)
    d.add_argument("--open", action="store_true", help="open the site in the default browser (where there is none: print its index.html)")
    c = sub.add_parser("caption", help="caption your own images with a trained model of the book",
                       description=f"Caption image files with a run the book trained, by default {CAPTION_MODEL} (Show, Attend "
                       f"and Tell's soft attention). It needs that run trained: on a fresh clone `capbook book --only "
                       f"={CAPTION_MODEL} --force --no-docs` trains it alone; --model names another run of the book, --run-dir any run folder.")
    c.add_argument("photos", nargs="+", metavar="PHOTO", help="image files (any format the loader reads)")
    c.add_argument("--model", default=CAPTION_MODEL, help="a trained run of the book (a plan step, e.g. 06_baselines-att2in; "
                   "default: %(default)s)")
    c.add_argument("--run-dir", help="a run folder instead (e.g. runs/default/adhoc/03_spca-1a2b3c4d)")
    c.add_argument("--profile", default="default", choices=PROFILES, help="the book whose runs --model names")
    c.add_argument("--beam", type=int, default=3, help="beam size")
    c.add_argument("--attention", metavar="PNG", help="write the per-word attention figure here")
    c.add_argument("--device", default="auto", help="where the model runs: auto (a CUDA GPU if one is visible, else the CPU), "
                   "cpu, cuda or cuda:N")
    c.add_argument("--json", metavar="RESULTS", help="also write the captions here as a COCO results file (image_id: the file name)")
    sc = sub.add_parser("score", help="score a COCO results file (capbook's or a peer's) with the book's evaluator")
    sc.add_argument("results", metavar="RESULTS.json", help='[{"image_id": ..., "caption": ...}, ...]')
    sc.add_argument("--references", required=True, metavar="KARPATHY.json", help="a Karpathy split file (dataset_coco.json, ...)")
    sc.add_argument("--split", choices=["train", "val", "test"], help="insist that the results caption exactly this split's images")
    rh = sub.add_parser("rehearse", help="run the real-data path on a generated data set of COCO's size: time and memory per stage")
    rh.add_argument("--scale", type=float, default=1.0, help="fraction of COCO's 123,287 images (1: all)")
    rh.add_argument("--root", help="where the data set, features and run go (default: data/rehearsal-<scale>)")
    rh.add_argument("--stages", nargs="+", metavar="STAGE", help="only these stages (generate read extract open train evaluate project)")
    rh.add_argument("--stage", help=argparse.SUPPRESS)           # a child process running one stage
    pa = sub.add_parser("params", help="regenerate the chapters' parameters cells from their dataclasses")
    pa.add_argument("--check", action="store_true", help="only report the files that would change (exit 1 if any)")
    rd = sub.add_parser("readme", help="regenerate README.md from the index notebook and the published book (which chapters are current: ~25 s)")
    rd.add_argument("--check", action="store_true", help="only report whether it would change (exit 1 if so)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "book": run_book(a.profile, force=a.force, docs=not a.no_docs, jobs=a.jobs, only=a.only, executor=a.executor,
                                     executor_config=a.executor_config, dry_run=a.dry_run, device=a.device, bare=a.bare,
                                     received=a.received)
        elif a.cmd == "docs":
            with book_lock(a.profile): site = build_docs(a.profile)     # not while a book rewrites the kept notebooks
            if a.open:
                import webbrowser
                try: opened = webbrowser.open(site.as_uri())
                except webbrowser.Error: opened = False
                if not opened: print(f"no browser to open it with: open {site}")     # a headless machine
        elif a.cmd == "caption":
            from capbook.caption import attention_png, caption_photos, find_run
            check_int("beam", a.beam, lo=1)
            run = find_run(a.model, a.run_dir, a.profile)
            caps = caption_photos(a.photos, run, a.beam, a.device)
            for cap in caps: print(f"{cap['photo']}: {cap['caption']}")
            if a.attention: print(f"attention -> {attention_png(caps, a.attention, a.run_dir or a.model)}")
            if a.json:
                from capbook.metrics import write_results
                print(f"captions -> {write_results(a.json, [Path(c['photo']).name for c in caps], [c['caption'] for c in caps])}")
        elif a.cmd == "score":
            from capbook.metrics import score_results
            out = score_results(a.results, a.references, a.split)
            print(f"{a.results}: {out['images']} images scored against {a.references}" + (f" (split {a.split})" if a.split else ""))
            for k, v in out["metrics"].items(): print(f"{k:8s} {v:.4f}")
            for k, v in out["notes"].items(): print(f"{k}: {v}")
        elif a.cmd == "params":
            changed = sync_parameters(write=not a.check)
            print("\n".join(changed) or "parameters cells are current")
            return int(a.check and bool(changed))
        elif a.cmd == "readme":
            from capbook.results import current
            changed = sync_readme(write=not a.check, status=chapter_status(current("default", nbs_dir().parent / "figures")))
            print("README.md " + ("changed" if changed else "is current"))
            return int(a.check and changed)
        elif a.cmd == "fit-chapter":
            from capbook.stages import fit_stages
            fit_stages(a.notebook, a.run_dir)
        elif a.cmd == "rehearse":
            from capbook.rehearsal import rehearse, rehearsal_table, stage_main
            if a.stage: print(json.dumps(stage_main(a.stage, a.root, a.scale)), flush=True)
            else: print(rehearsal_table(rehearse(a.root, a.scale, a.stages)))
        elif a.cmd == "bench":
            from capbook.bench import bench, chapter_times
            if a.against:
                from capbook.bench import versus
                if not a.family: raise CapbookError("parameter family is missing: --against times the families named by --family")
                print(json.dumps(versus(a.against, a.family.split(","), a.profile, a.batches, a.rounds, log=lambda s: print(s, flush=True)))); return 0
            if a.capture:
                from capbook.bench import capture_bench
                print(json.dumps(capture_bench(a.profile, a.family.split(",") if a.family else None, [k for k in a.stacked if k] or [32], a.batches,
                                               device=a.device, log=lambda s: print(s, flush=True)))); return 0
            if a.reader:
                from capbook.bench import reader_time
                from capbook.book import EXAMPLE
                print(json.dumps(reader_time(*EXAMPLE, a.profile, log=lambda s: print(s, flush=True)))); return 0
            if a.chapters:
                print(json.dumps(chapter_times(a.chapters, a.profile, a.device, log=lambda s: print(s, flush=True)))); return 0
            print(json.dumps(bench(a.profile, a.family.split(",") if a.family else None, a.batches, device=a.device,
                                   compare=a.alternatives, stacked=a.stacked[0], log=lambda s: print(s, flush=True))))
        else:
            out = train_cli(**train_params(a.config, {k: getattr(a, k) for k in ("model", "profile", "run_dir", "epochs", "ckpt_every",
                                                                                  "batch_size", "seed")}))
            if int(os.environ.get("RANK", 0)) == 0: print(json.dumps(out))
    except CapbookError as e:
        print(error_line(e, "error"), file=sys.stderr); return 2
    except OSError as e:                            # the environment: read-only or full disk, a file as a folder
        print(error_line(os_error_line(e), "error"), file=sys.stderr); return 2
    except KeyboardInterrupt as e:                  # Ctrl-C, or SIGTERM / SIGHUP on a book: its workers or jobs end with it; what finished is kept
        import signal
        signum = getattr(e, "signum", signal.SIGINT)
        print(("interrupted" if signum == signal.SIGINT else f"ended by {signal.Signals(signum).name}")
              + ": what finished is kept; the same command goes on from there", file=sys.stderr)
        return 128 + signum
    return 0

# %% [markdown]
# Each command with an example, as `capbook --help` ends:

# %%
#| export
EXAMPLES = """examples:
  capbook book --profile smoke -j 2                     regenerate the whole book at toy sizes
  capbook book -j 2 --only '03_spca*' 03a_spca_tables   regenerate one chapter (every run and seed) and its tables
  capbook docs --open                                   build and open the site from the published book
  capbook caption photo.jpg --attention where.png       caption your own image with a trained model; where it looked
  capbook score captions.json --references dataset_coco.json --split test    score a COCO results file
  capbook bench --family sat_soft,lstm2d_spca           training captions/s and beam images/s of model families
  capbook bench --against main --family lstm2d,lstm2d_spca/kernel=5   ... under an earlier commit and now, alternating
  capbook bench --device cuda --stacked 32             ... and of 32 seeds trained as one stacked model on a GPU
  capbook bench --device cuda --capture --batches 8   ... 32 seeds stacked, eager and as one captured CUDA graph
  capbook train --model sat_soft --run-dir runs/mine    train one registered model outside the notebooks (torchrun too)
  capbook rehearse --scale 0.01                         the real-data path on a generated data set of COCO's shape
  capbook params; capbook readme                        regenerate the parameters cells and README.md"""

# %%
_help = []
try:
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()) as _out: main(["--help"])
except SystemExit: _help = _out.getvalue()
assert all(f"capbook {c}" in _help for c in ("book", "docs", "caption", "score", "bench", "train", "rehearse", "params", "readme"))
print(_help)
