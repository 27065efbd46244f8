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
# # cluster
#
# > The book on a SLURM cluster: each step a job submitted through submitit, in the plan's order, running the step function the book hands it, with the book's keys, skipping, lock and publishing kept on the machine that submits.

# %%
#| default_exp cluster

# %%
#| export
from __future__ import annotations
import contextlib, fnmatch, os, re, signal, threading, time
from concurrent.futures import Future
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable
import submitit
from capbook.core import CapbookError, load_yaml

# %% [markdown]
# ## Why a second executor
#
# `capbook book -j N` runs the plan's steps in a pool of processes on one machine (`capbook.book.run_plan`): each step
# starts as soon as the runs it tabulates are done, an unchanged step is skipped before anything starts, and the book's
# lock and its publishing stay with the book's own process. A lab with a cluster wants the same book with each step on
# a node of its own. `capbook book --executor slurm` keeps every part of that and changes one thing: a step is a SLURM
# job, submitted through [submitit](https://github.com/facebookincubator/submitit) (the library Hydra's launcher,
# fairseq and DINO use), which pickles the call, writes the `sbatch` script, and reads the job's state and result back.
#
# What a cluster needs that one machine does not:
#
# - **the same files everywhere**: `CAPBOOK_HOME` (runs, figures), `CAPBOOK_DATA` (the dataset, features, encoder) and
#   the virtual environment on a filesystem every node mounts; a job writes its results where a local book would;
# - **resources per step**: CPUs, GPUs, memory, time limit, partition, account, any other `sbatch` option — from one
#   YAML file, with defaults per profile (below);
# - **failures as a cluster has them**: a job can fail, run out of time or memory, lose its node, or be preempted. Each
#   ends the step with one line (the step, the job id, the state, the log to open); a job that runs out of time or is
#   preempted is requeued, and its training resumes from its checkpoint (runs resume exactly after a kill);
# - **cancelling**: Ctrl-C on the book cancels the jobs it submitted.

# %% [markdown]
# ## Resources: one YAML file, defaults per profile
#
# A step's resources are merged from four layers, later ones winning: capbook's defaults for every profile
# (`RESOURCES`), capbook's defaults for the book's profile (`PROFILE_RESOURCES`), the config file's top level, its
# `profiles:` entry for the profile, and each of its `steps:` entries whose shell-style pattern matches the step's name
# (in the file's order). The defaults are sized from the published time table: the default book's longest run took
# under an hour on two cores; the paper profile trains on a GPU.

# %%
#| export
@dataclass(frozen=True)
class Resources:
    "What one step's job asks the scheduler for."
    cpus: int = 2                     # CPUs of the job's one task (its intra-op threads)
    gpus: int = 0                     # GPUs on its node; more than one: the training runs under torchrun, one process a GPU
    mem_gb: float = 8                 # memory of the job
    time_min: int = 120               # its time limit; a job that reaches it is requeued and resumes from its checkpoint
    partition: str | None = None      # the partition (queue); None: the cluster's default
    account: str | None = None        # the account charged; None: the user's default
    sbatch: dict = field(default_factory=dict)   # any other sbatch option, without its dashes: {"qos": "high", "constraint": "a100"}
    setup: tuple = ()                 # shell lines each job runs before capbook (e.g. "module load cuda/12.4")
    requeues: int = 3                 # how often a job that timed out or was preempted is requeued before the step fails

RESOURCES = Resources()
PROFILE_RESOURCES = {"smoke": {"mem_gb": 4, "time_min": 20},
                     "default": {"mem_gb": 8, "time_min": 180},
                     "paper": {"cpus": 8, "gpus": 1, "mem_gb": 32, "time_min": 2880}}
KEYS = [f.name for f in fields(Resources)]

# %%
#| export
def _checked(entry: Any, where: str) -> dict:
    "One layer of a config file, its keys and types checked: one line naming the file, the place and what is allowed."
    if entry is None: return {}
    if not isinstance(entry, dict): raise CapbookError(f"{where}: expected a mapping of {', '.join(KEYS)}, got {type(entry).__name__}")
    if bad := sorted(set(entry) - set(KEYS)):
        raise CapbookError(f"{where}: unknown key {', '.join(map(repr, bad))}; allowed: {', '.join(KEYS)}")
    out = dict(entry)
    for k in ("cpus", "gpus", "time_min", "requeues"):
        if k in out and (not isinstance(out[k], int) or isinstance(out[k], bool) or out[k] < (1 if k in ("cpus", "time_min") else 0)):
            raise CapbookError(f"{where}: {k} must be a whole number {'of at least 1' if k in ('cpus', 'time_min') else '>= 0'}, got {out[k]!r}")
    if "mem_gb" in out and (not isinstance(out["mem_gb"], (int, float)) or isinstance(out["mem_gb"], bool) or out["mem_gb"] <= 0):
        raise CapbookError(f"{where}: mem_gb must be a positive number, got {out['mem_gb']!r}")
    for k in ("partition", "account"):
        if k in out and out[k] is not None and not isinstance(out[k], str): raise CapbookError(f"{where}: {k} must be a name, got {out[k]!r}")
    if "sbatch" in out and not isinstance(out["sbatch"], dict): raise CapbookError(f"{where}: sbatch must be a mapping of options, got {out['sbatch']!r}")
    if "setup" in out:
        if isinstance(out["setup"], str): out["setup"] = [out["setup"]]
        if not isinstance(out["setup"], list) or not all(isinstance(s, str) for s in out["setup"]):
            raise CapbookError(f"{where}: setup must be a list of shell lines, got {out['setup']!r}")
        out["setup"] = tuple(out["setup"])
    return out

@dataclass
class ExecutorConfig:
    "The resources of every step of a book at one profile: `resources(step_name)`."
    profile: str
    layers: list = field(default_factory=list)          # [(pattern or None, {key: value})], applied in order
    source: str = "capbook's defaults"

    def resources(self, name: str) -> Resources:
        r = replace(RESOURCES, **PROFILE_RESOURCES.get(self.profile, {}))
        for pattern, entry in self.layers:
            if pattern is None or fnmatch.fnmatchcase(name, pattern):
                sb = {**r.sbatch, **entry.get("sbatch", {})}     # sbatch options add up; the rest replaces
                r = replace(r, **{**entry, "sbatch": sb})
        return r

def executor_config(path: str | Path | None, profile: str) -> ExecutorConfig:
    "The executor config for `profile`: capbook's defaults, then the YAML file at `path` (None: the defaults alone); a malformed file stops in one line naming it."
    if path is None: return ExecutorConfig(profile)
    path = Path(path)
    doc = load_yaml(path, "executor config") or {}
    if not isinstance(doc, dict): raise CapbookError(f"{path}: an executor config is a mapping (see capbook.cluster), got {type(doc).__name__}")
    profiles, steps = doc.pop("profiles", None) or {}, doc.pop("steps", None) or {}
    if not isinstance(profiles, dict): raise CapbookError(f"{path}: profiles must map a profile to its resources, got {profiles!r}")
    if not isinstance(steps, dict): raise CapbookError(f"{path}: steps must map a step pattern to its resources, got {steps!r}")
    layers = [(None, _checked(doc, f"{path}"))]
    for name, entry in profiles.items():
        checked = _checked(entry, f"{path}: profiles: {name}")
        if name == profile: layers.append((None, checked))
    layers += [(str(pat), _checked(entry, f"{path}: steps: {pat}")) for pat, entry in steps.items()]
    return ExecutorConfig(profile, layers, str(path))

# %% [markdown]
# An example config, as a lab would write it: every job on partition `cpu` of account `vision`, the default book's
# chapter runs given three hours, the SPCA rows (the book's slowest) four, the paper profile on two GPUs of partition
# `gpu`. A mistyped key stops with the file, the place and the keys allowed.

# %%
import tempfile
_cfg = Path(tempfile.mkdtemp()) / "slurm.yaml"
_cfg.write_text("""partition: cpu
account: vision
sbatch: {qos: normal}
profiles:
  paper: {partition: gpu, gpus: 2, sbatch: {constraint: a100}}
steps:
  "0[2-6]_*": {time_min: 180}
  "03_spca*": {time_min: 240, mem_gb: 12}
""")
_c = executor_config(_cfg, "default")
assert _c.resources("03_spca-k5") == Resources(cpus=2, gpus=0, mem_gb=12, time_min=240, partition="cpu", account="vision", sbatch={"qos": "normal"})
assert _c.resources("00_core").time_min == PROFILE_RESOURCES["default"]["time_min"] and _c.resources("00_core").partition == "cpu"
_p = executor_config(_cfg, "paper").resources("05_glied")
assert (_p.gpus, _p.partition, _p.sbatch, _p.time_min) == (2, "gpu", {"qos": "normal", "constraint": "a100"}, 180)
assert executor_config(None, "smoke").resources("02_show_attend_tell").time_min == 20
_cfg.write_text("steps:\n  '03_*': {time: 10}\n")
try: executor_config(_cfg, "default"); raise AssertionError("a mistyped key passed")
except CapbookError as e: assert "steps: 03_*: unknown key 'time'; allowed: cpus, gpus, mem_gb, time_min" in str(e), e
_cfg.write_text("cpus: two\n")
try: executor_config(_cfg, "default"); raise AssertionError("a bad value passed")
except CapbookError as e: assert str(e) == f"{_cfg}: cpus must be a whole number of at least 1, got 'two'", e

# %% [markdown]
# ## The job: one step, resumable
#
# A job calls `capbook.book.run_step` on its node, as a local worker does, with its own intra-op threads (its CPUs)
# and none of the submitting host's services (its METEOR process listens on a socket of that host: a job on another node
# starts its own). A step that fails in a way the book names (a notebook's failing cell, a full disk) returns that one
# line as its result, so the host reports it as a local book would; anything else fails the job, and its log says why.
#
# `StepJob` is a `submitit.helpers.Checkpointable`: when SLURM signals that the job's time is nearly up, or that it is
# preempted, submitit asks it for a checkpoint and requeues the same call. Nothing more is needed: a training run
# checkpoints every epoch and resumes exactly after a kill, so the requeued job goes on where the last one stopped.
#
# One thing is needed: a requeue (submitit's, at the time limit; SLURM's, on a preemption) ends the job with a SIGTERM
# to all its processes, SIGKILL following. The step's kernel dies of it, and a job that then returned would write the
# dead kernel as its result, which the host would read as the step's failure while SLURM starts the job again. So a
# job notes SLURM's signals (`_signals_noted`) and, signalled, writes nothing and waits for its SIGKILL (`_await_kill`):
# the host keeps waiting, and the requeued job, under the same id, writes the real result.
#
# A job given several GPUs (`gpus: N`, N > 1) sets `CAPBOOK_TRAIN_PROCS=N` for its step: the chapter run trains every
# stage under `torchrun`, one process a GPU, and its kernel then evaluates the finished checkpoints
# (`capbook.stages.fit_under_torchrun`). The host keys such a step apart from its one-process key
# (`capbook.results.Keys`): DDP's batch is every process's, another computation, never published as the one-process
# book's numbers.

# %%
#| export
def _step_call(run_step: Callable, step, profile: str, force: bool, key: str, cpus: int, gpus: int = 0) -> tuple:
    "What a job runs: the step, through the function a local worker runs it with (`run_step`: the book's, handed down by the book, so this room never imports the book); ('ok', executed notebook, whether it ran, seconds) or ('failed', the book's one line)."
    os.environ.pop("CAPBOOK_METEOR", None)                  # the submitting host's METEOR socket: not on this node
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"): os.environ[k] = str(cpus)
    from capbook.profiles import TRAIN_PROCS
    if gpus > 1: os.environ[TRAIN_PROCS] = str(gpus)          # its run trains under torchrun, one process a GPU
    else: os.environ.pop(TRAIN_PROCS, None)
    with _signals_noted() as signalled:
        t0 = time.time()
        try:
            out, ran = run_step(step, profile, force, print, key)
            return "ok", str(out), ran, time.time() - t0
        except BaseException as e:
            if signalled: _await_kill(signalled)   # requeued or preempted: no result, or the host would read it as the step's end
            if isinstance(e, CapbookError): return "failed", str(e)
            raise

KILL_WAIT_S = 600    # how long a signalled job waits for the scheduler's SIGKILL before it reports its step's failure after all

@contextlib.contextmanager
def _signals_noted():
    "Within the block, note SLURM's SIGTERM (a requeue, a preemption, a cancel: SIGKILL follows) and SIGUSR2 (submitit's warning before the time limit, on which it requeues the job), then let the handlers there were (submitit's) act; yields the list they are noted in."
    seen, before = [], {}
    def noted(previous):
        def handler(signum, frame):
            seen.append(signum)
            if callable(previous): previous(signum, frame)
        return handler
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        before[sig] = signal.getsignal(sig)
        signal.signal(sig, noted(before[sig]))
    try: yield seen
    finally:
        for sig, h in before.items(): signal.signal(sig, h)

def _await_kill(signalled: list) -> None:
    "Wait for the scheduler's SIGKILL after its signal: the step's kernel died of that signal, and its failure must not be written as the job's result (the requeued job writes the real one)."
    print(f"signal {', '.join(signal.Signals(s).name for s in signalled)}: the job ends here (requeued, it resumes the run from "
          f"its checkpoint; cancelled, the book's next run does)", flush=True)
    time.sleep(KILL_WAIT_S)                  # a handled signal does not cut it short (the sleep goes on for the rest)

class StepJob(submitit.helpers.Checkpointable):
    "One book step as a requeueable job (`checkpoint`, inherited from submitit: the same call again, and the run resumes from its checkpoint)."
    def __call__(self, run_step: Callable, step, profile: str, force: bool, key: str, cpus: int, gpus: int = 0) -> tuple:
        return _step_call(run_step, step, profile, force, key, cpus, gpus)

# %% [markdown]
# ## The pool: steps in, results out, failures in one line
#
# `SlurmPool` is what `run_plan` submits to in place of its process pool. `submit_step` sends a step as a job with the
# resources the config gives its name, and returns a `Future` that a watcher thread settles when the job ends: with
# the executed notebook, or with one line. submitit knows a job has ended when its result file appears, or else from
# `sacct` (a job that died without a result: out of time, out of memory, its node lost); the watcher looks for results
# every `poll_s` seconds and asks `sacct` at least every `sacct_s`.
#
# The states a step can end in, and the line the book prints (SLURM's names):
#
# | state | what happened | the line says |
# |---|---|---|
# | COMPLETED | the job ran; the step's own failure, if any, is the book's usual line | — |
# | FAILED | the job's process failed outside the notebook (the environment, an import) | the last line of its traceback |
# | TIMEOUT | out of time after `requeues` requeues | raise `time_min` |
# | PREEMPTED | preempted and not requeued | run the book again |
# | NODE_FAIL | its node was lost | run the book again |
# | OUT_OF_MEMORY | over its memory | raise `mem_gb` |
# | CANCELLED | cancelled (`scancel`, or the book's Ctrl-C) | run the book again |
#
# Each line names the step, the job id and the log file to open. A book run again completes only what is unfinished:
# every finished step is unchanged and skipped, and a requeued or rerun training resumes from its checkpoint.

# %%
#| export
ADVICE = {"TIMEOUT": "raise its time_min in the executor config (its run resumes from its checkpoint)",
          "OUT_OF_MEMORY": "raise its mem_gb in the executor config", "FAILED": "its log says why"}

def failure_line(step_name: str, job_id: str, state: str, log: Path | str, why: str = "") -> str:
    "The one line a step's failed job ends the book with: the step, the job, its state, what to do and the log to open."
    advice = ADVICE.get(state, "run the book again to finish what is unfinished")
    return f"{step_name}: SLURM job {job_id} ended {state}" + (f" ({why})" if why else "") + f"; {advice}; log: {log}"

_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*$")

def _last_line(e: BaseException) -> str:
    "What a job's error says in one line: the last exception named in it (submitit's carries the node's traceback), else its last line."
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    raised = [l for l in lines if _RAISED.match(l)]
    return (raised or lines or [type(e).__name__])[-1][:300]

NO_RESULT = ("CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "DEADLINE", "BOOT_FAIL")   # ended by the scheduler: the job wrote nothing
UNFINISHED = ("UNKNOWN", "PENDING", "RUNNING", "COMPLETING", "REQUEUED", "READY", "CONFIGURING", "SUSPENDED")

def final_state(job, wait_s: float = 20.0) -> str:
    "A job's final SLURM state: asked of `sacct` until it has one (a job can leave its result before the accounting records its end), at most `wait_s` seconds; its first word ('CANCELLED by 0': CANCELLED)."
    t0 = time.time()
    while True:
        try: state = (job.watcher.get_state(job.job_id, mode="force") or "UNKNOWN").split()[0]
        except Exception: state = "UNKNOWN"
        if state not in UNFINISHED or time.time() - t0 > wait_s: return state
        time.sleep(1)

SACCT_S = "CAPBOOK_SACCT_S"    # environment: seconds between the book's sacct calls about its running jobs (default 30)

def sacct_interval() -> float:
    "How often the pool asks sacct about its running jobs (`SACCT_S`, default 30 s: a job that ends without a result — cancelled, out of time, killed — is seen within it; a finished one at once, by its result); a malformed value stops in one line."
    v = os.environ.get(SACCT_S, "30")
    try: out = float(v)
    except ValueError: out = -1.0
    if not out > 0: raise CapbookError(f"environment variable {SACCT_S}={v!r} is invalid: seconds between sacct calls, a positive number")
    return out

class SlurmPool:
    "Book steps as SLURM jobs through submitit (`cluster`: 'slurm'; submitit's 'local' runs the same jobs as processes here, for a machine without SLURM); jobs' scripts, logs and pickles under `folder`; each job runs its step with `run_step` (the book's `capbook.book.run_step`, which the book hands in: a module-level function, pickled by name)."
    def __init__(self, profile: str, config: ExecutorConfig, folder: str | Path, run_step: Callable, force: bool = False, cluster: str = "slurm",
                 poll_s: float = 2.0, sacct_s: float | None = None, log: Callable = print):
        self.profile, self.config, self.force, self.cluster, self.log = profile, config, force, cluster, log
        self.run_step = run_step
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.poll_s, self.sacct_s = poll_s, sacct_interval() if sacct_s is None else sacct_s
        self.jobs: dict[Future, tuple] = {}
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="capbook-slurm-watcher", daemon=True)

    def parameters(self, name: str) -> dict:
        "submitit's parameters for the job of step `name` (`ExecutorConfig.resources`)."
        r = self.config.resources(name)
        p = {"name": f"capbook-{name}", "timeout_min": r.time_min, "cpus_per_task": r.cpus, "mem_gb": r.mem_gb,
             "tasks_per_node": 1, "nodes": 1}
        if self.cluster == "slurm":
            # submitit's warning before the time limit, when the job checkpoints and requeues itself: 90 s, or a quarter
            # of a short limit (SLURM checks limits every 30 s or so, so a warning too close to the end may come too late)
            p |= {"slurm_additional_parameters": dict(r.sbatch), "slurm_setup": list(r.setup),
                  "slurm_signal_delay_s": min(90, r.time_min * 15)}
            if r.gpus: p["gpus_per_node"] = r.gpus
            if r.partition: p["slurm_partition"] = r.partition
            if r.account: p["slurm_account"] = r.account
        return p

    def submit_step(self, step, key: str) -> Future:
        "Submit `step` (its key computed here, before it runs) as one job; the future settles with (executed notebook, whether it ran) or a `CapbookError` line."
        r = self.config.resources(step.name)
        requeues = {"slurm_max_num_timeout": r.requeues} if self.cluster == "slurm" else {}
        executor = submitit.AutoExecutor(folder=self.folder / "%j", cluster=self.cluster, **requeues)   # one a job: its own requeues
        executor.update_parameters(**self.parameters(step.name))
        try: job = executor.submit(StepJob(), self.run_step, step, self.profile, self.force, key, r.cpus, r.gpus)
        except Exception as e:                     # sbatch refused it: an unknown partition or account, a limit
            raise CapbookError(f"{step.name}: the scheduler refused its job ({_last_line(e)}); check the executor config "
                               f"({self.config.source})") from None
        fut = Future(); fut.set_running_or_notify_cancel()
        with self._lock: self.jobs[fut] = (step, job)
        self.log(f"  {step.name}: job {job.job_id} submitted ({r.cpus} CPUs{f', {r.gpus} GPUs' if r.gpus else ''}, "
                 f"{r.mem_gb:g} GB, {r.time_min} min{f', partition {r.partition}' if r.partition else ''})")
        return fut

    def _settle(self, fut: Future, step, job) -> None:
        state = final_state(job) if self.cluster == "slurm" and not job.paths.result_pickle.exists() else None
        if state in NO_RESULT:     # ended by the scheduler: no result is coming (submitit would wait 15 s for one, for a slow shared filesystem)
            fut.set_exception(CapbookError(failure_line(step.name, job.job_id, state, job.paths.stderr))); return
        try: res = job.result()
        except Exception as e:
            state = state or (final_state(job) if self.cluster == "slurm" else "FAILED")
            why = _last_line(e) if state in ("FAILED", "UNKNOWN") else ""
            fut.set_exception(CapbookError(failure_line(step.name, job.job_id, state, job.paths.stderr, why))); return
        if res[0] == "ok":
            self.log(f"  {step.name}: ran in {res[3]:.1f} s (job {job.job_id})" if res[2] else f"  {step.name}: unchanged, skipped (job {job.job_id})")
            fut.set_result((Path(res[1]), res[2]))
        else: fut.set_exception(CapbookError(res[1]))                 # the step's own line, as a local book prints it

    def _watch(self) -> None:
        last_sacct = time.time()
        while not self._stop.wait(self.poll_s):
            with self._lock: pending = [(f, s, j) for f, (s, j) in self.jobs.items() if not f.done()]
            ask = time.time() - last_sacct >= self.sacct_s
            if ask: last_sacct = time.time()
            for f, s, j in pending:
                try: done = j.done(force_check=ask)
                except Exception: continue                # sacct briefly unreachable: the next look asks again
                if done: self._settle(f, s, j)

    def cancel(self) -> list[str]:
        "Cancel every job not yet ended; returns their ids."
        with self._lock: pending = [(f, j) for f, (_, j) in self.jobs.items() if not f.done()]
        for f, j in pending:
            try: j.cancel(check=False)
            except Exception: pass
            try: f.set_exception(CapbookError(f"job {j.job_id} cancelled"))
            except Exception: pass                        # (the watcher settled it meanwhile)
        return [j.job_id for _, j in pending]

    def __enter__(self) -> "SlurmPool":
        self._watcher.start(); return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and (ids := self.cancel()):          # Ctrl-C, or the book stopping on an error of its own
            self.log(f"cancelled {len(ids)} SLURM jobs: {' '.join(ids)}")
        self._stop.set(); self._watcher.join(timeout=10)

# %% [markdown]
# A step's job parameters as submitit receives them, and a failed job's line:

# %%
_pool = SlurmPool("default", executor_config(None, "default"), Path(tempfile.mkdtemp()), print, cluster="slurm")
assert _pool.parameters("03_spca-k5") == {"name": "capbook-03_spca-k5", "timeout_min": 180, "cpus_per_task": 2, "mem_gb": 8,
                                           "tasks_per_node": 1, "nodes": 1, "slurm_additional_parameters": {}, "slurm_setup": [],
                                           "slurm_signal_delay_s": 90}
print(failure_line("03_spca-k5", "4127", "TIMEOUT", "runs/default/slurm/4127/4127_0_log.err"))
assert failure_line("x", "7", "OUT_OF_MEMORY", "l").endswith("raise its mem_gb in the executor config; log: l")
