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
import contextlib, fnmatch, io, os, re, shutil, signal, subprocess, threading, time
from concurrent.futures import Future
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable
import submitit
from capbook.core import CapbookError, io_error, load_json, load_yaml, save_json

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
    from capbook.profiles import PROFILES
    for name, entry in profiles.items():
        if name not in PROFILES: raise CapbookError(f"{path}: profiles: unknown profile {name!r}; allowed: {', '.join(PROFILES)}")
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
_cfg.write_text("profiles:\n  smok: {cpus: 4}\n")
try: executor_config(_cfg, "smoke"); raise AssertionError("a misspelled profile passed")
except CapbookError as e: assert str(e) == f"{_cfg}: profiles: unknown profile 'smok'; allowed: smoke, default, paper", e
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
def _step_call(run_step: Callable, step, profile: str, force: bool, key: str, cpus: int, gpus: int = 0, training: str | None = None) -> tuple:
    "What a job runs: the step, through the function a local worker runs it with (`run_step`: the book's, handed down by the book, so this room never imports the book); ('ok', executed notebook, whether it ran, seconds) or ('failed', the book's one line)."
    os.environ.pop("CAPBOOK_METEOR", None)                  # the submitting host's METEOR socket: not on this node
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"): os.environ[k] = str(cpus)
    from capbook.profiles import TRAIN_PROCS
    if gpus > 1: os.environ[TRAIN_PROCS] = str(gpus)          # its run trains under torchrun, one process a GPU
    else: os.environ.pop(TRAIN_PROCS, None)
    with _signals_noted() as signalled:
        t0 = time.time()
        try:
            out, ran = run_step(step, profile, force, print, key, training)
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
    def __call__(self, run_step: Callable, step, profile: str, force: bool, key: str, cpus: int, gpus: int = 0, training: str | None = None) -> tuple:
        return _step_call(run_step, step, profile, force, key, cpus, gpus, training)

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
# | FAILED | the job's process failed outside the notebook (the environment, an import, a `setup:` line) | the last line of its traceback |
# | TIMEOUT | out of time after `requeues` requeues | raise `time_min` |
# | PREEMPTED | preempted and not requeued | run the book again |
# | NODE_FAIL | its node was lost | run the book again |
# | OUT_OF_MEMORY | over its memory | raise `mem_gb` |
# | CANCELLED | cancelled (`scancel`, or the book's Ctrl-C) | run the book again |
# | PENDING, for a reason no node can meet | `PartitionConfig` (more CPUs, memory or GPUs than a node has), `BadConstraints`, a partition's limit, an invalid account or QOS | the reason; the job is cancelled |
#
# Each line names the step, the job id and the log that holds the error (`.err`, or `.out` where the error went
# there: a failed `setup:` line). A book run again completes only what is unfinished: every finished step is unchanged
# and skipped, and a requeued or rerun training resumes from its checkpoint.
#
# **A queue that speaks.** While jobs wait, the pool asks `squeue` (every `sacct_s`) how they stand, prints a requeue
# when it sees one (SLURM's restart count went up), and every `queue_s` seconds prints one line: which steps run, which
# wait and for what (SLURM's reason: `Priority`, `Resources`, ...).
#
# **Jobs end with their book, or are found again.** Ctrl-C, SIGTERM and SIGHUP on the book (a closed login shell, a
# `timeout`, the book's own job being cancelled) cancel every job it submitted, in one line naming them. A book killed
# outright (SIGKILL, the login node rebooting) cannot: so the pool keeps a record of its live jobs (`jobs.json` in the
# pool's folder, written as each is submitted and settled), and the next book reads it first. A recorded job still in
# the queue whose step this book runs under the same key is adopted — the book waits for it instead of submitting the
# step again; one whose step changed is cancelled; one of a step this book does not run is left to run. Even so, two
# processes never write one run folder: the second stops in one line (`capbook.core.one_writer`).
#
# **Before anything is submitted** the pool checks that this machine can submit and watch jobs: `sbatch`, `squeue`,
# `scancel` and `sacct` on PATH, a SLURM configuration found (`SLURM_CONF`, or the machine's own), and accounting that
# `sacct` reads. Each refusal — the pool's or `sbatch`'s (an unknown option, partition or account) — is one line naming
# its cause. A job's files (script, logs, pickles) sit under `runs/<profile>/slurm/<step>/`, and its submit line names
# its log.

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

NEVER_STARTS = {"PartitionConfig": "it asks for more CPUs, memory or GPUs than a node of its partition has",
                "PartitionNodeLimit": "it asks for more nodes than its partition allows",
                "PartitionTimeLimit": "its time limit is above its partition's",
                "BadConstraints": "no node has the features it asks for",
                "InvalidAccount": "its account is not valid", "InvalidQOS": "its QOS is not valid"}   # squeue's reasons a job waits forever for

def _seconds(var: str, default: float, what: str) -> float:
    "A positive number of seconds from environment variable `var` (default `default`); a malformed value stops in one line."
    v = os.environ.get(var, str(default))
    try: out = float(v)
    except ValueError: out = -1.0
    if not out > 0: raise CapbookError(f"environment variable {var}={v!r} is invalid: {what}, a positive number")
    return out

SACCT_S = "CAPBOOK_SACCT_S"    # environment: seconds between the book's sacct and squeue calls about its jobs (default 30)
QUEUE_S = "CAPBOOK_QUEUE_S"    # environment: seconds between the book's queue status lines (default 60)

def sacct_interval() -> float:
    "How often the pool asks sacct and squeue about its jobs (`SACCT_S`, default 30 s: a job that ends without a result — cancelled, out of time, killed — or is requeued is seen within it; a finished one at once, by its result)."
    return _seconds(SACCT_S, 30, "seconds between sacct calls")

def queue_interval() -> float:
    "How often the pool prints its queue status line while jobs wait (`QUEUE_S`, default 60 s)."
    return _seconds(QUEUE_S, 60, "seconds between queue status lines")

def _slurm(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    "A SLURM client command, its output as text; a command that hangs counts as failed."
    try: return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired: return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]} gave no answer in {timeout:.0f} s")

def _said(p: subprocess.CompletedProcess) -> str:
    "What a failed SLURM command said, in one line: its last error line (not the 'Try ... --help' hint), without the command's own prefix."
    lines = [re.sub(r"^\w+: (?:error: |fatal: )?", "", l.strip()) for l in (p.stderr or p.stdout or "").splitlines()
             if l.strip() and not l.strip().startswith("Try ")]
    return (lines[-1] if lines else f"exit status {p.returncode}")[:300]

def check_slurm() -> None:
    "Stop in one line unless this machine can submit jobs and read how they ended: SLURM's commands on PATH, its configuration found, accounting that `sacct` reads."
    for cmd in ("sbatch", "squeue", "scancel", "sacct"):
        if shutil.which(cmd) is None:
            raise CapbookError(f"--executor slurm: {cmd} is not on PATH" + (" (SLURM's accounting: the book reads how each job ended from it)"
                               if cmd == "sacct" else "") + "; run the book where SLURM's commands are (a login node, or after `module load slurm`)")
    p = _slurm(["squeue", "-h", "-o", "%i", "-j", "1"], 30)
    if p.returncode and "Invalid job id" not in p.stderr:
        conf = os.environ.get("SLURM_CONF")
        if "configuration" in p.stderr or "slurm.conf" in p.stderr:
            raise CapbookError(f"--executor slurm: SLURM finds no configuration here ({f'SLURM_CONF={conf}' if conf else 'SLURM_CONF is not set'}; "
                               f"squeue: {_said(p)}); set SLURM_CONF to the cluster's slurm.conf, or run the book on a login node")
        raise CapbookError(f"--executor slurm: squeue cannot reach the cluster ({_said(p)})")
    p = _slurm(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], 30)
    if p.returncode:
        raise CapbookError(f"--executor slurm: sacct cannot tell how jobs end ({_said(p)}); the book needs SLURM accounting "
                           f"(slurmdbd, or a job completion log that sacct reads)")

def queue_states(ids: list[str]) -> dict[str, tuple[str, str, int, str]] | None:
    "How jobs `ids` stand in the queue (squeue: the pending and running ones; an ended job drops out): {id: (state, reason, restarts, time used)}; None when squeue cannot be asked."
    if not ids: return {}
    p = _slurm(["squeue", "-h", "-j", ",".join(ids), "-O", "JobID:|,State:|,Reason:|,RestartCnt:|,TimeUsed:|"])
    if p.returncode: return {} if "Invalid job id" in p.stderr else None
    out = {}
    for line in p.stdout.splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) >= 5 and f[0]: out[f[0]] = (f[1], f[2], int(f[3]) if f[3].isdigit() else 0, f[4])
    return out

def _log_of(job) -> Path:
    "The log of a job that holds its error: `.err`, unless it is empty and `.out` is not (a failed `setup:` line's words land there)."
    err, out = Path(job.paths.stderr), Path(job.paths.stdout)
    size = lambda p: p.stat().st_size if p.exists() else 0
    return out if size(err) == 0 and size(out) > 0 else err

def _refusal(name: str, e: BaseException, r: Resources, source: str) -> str:
    "sbatch's refusal of a step's job as one line: what sbatch said (its error lines, not its hint), and the setting that caused it."
    lines = [l.strip() for l in str(e).splitlines() if l.strip() and not l.strip().startswith("Try ")]
    said = [l for l in lines if l.startswith("sbatch")] or lines or [type(e).__name__]
    cause = "; ".join(dict.fromkeys(said[-2:]))[:300]
    opt = re.search(r"(?:unrecognized|invalid|unknown) option '?--?([\w-]+)", cause)
    if opt and opt[1] in r.sbatch: where = f"the sbatch option {opt[1]!r} in {source}"
    elif re.search(r"[Pp]artition", cause) and r.partition: where = f"partition {r.partition!r} in {source}"
    elif re.search(r"[Aa]ccount", cause) and r.account: where = f"account {r.account!r} in {source}"
    else: where = f"the executor config ({source})"
    return f"{name}: sbatch refused its job ({cause}); check {where}"

RECORD = "jobs.json"    # the pool's live jobs, {step: {job, key, folder, submitted}}: what a book killed outright leaves for the next

@contextlib.contextmanager
def _script_only(cluster: str):
    "Within the block, submitit's SLURM executor can be built where no SLURM client (`srun`) is installed — for its sbatch script alone, which is text (`SlurmPool.script`); nothing is submitted through it. Elsewhere, and where a client is installed, nothing changes."
    from submitit.slurm.slurm import SlurmExecutor
    if cluster != "slurm" or shutil.which("srun") is not None: yield; return
    was = SlurmExecutor.__dict__["affinity"]
    SlurmExecutor.affinity = classmethod(lambda cls: 2)    # submitit's only check: that `srun` is on the PATH
    try: yield
    finally: SlurmExecutor.affinity = was

class SlurmPool:
    "Book steps as SLURM jobs through submitit (`cluster`: 'slurm'; submitit's 'local' runs the same jobs as processes here, for a machine without SLURM); each step's job files under `folder/<step>/`, the live jobs recorded in `folder/jobs.json`; each job runs its step with `run_step` (the book's `capbook.book.run_step`, which the book hands in: a module-level function, pickled by name)."
    def __init__(self, profile: str, config: ExecutorConfig, folder: str | Path, run_step: Callable, force: bool = False, cluster: str = "slurm",
                 poll_s: float = 2.0, sacct_s: float | None = None, queue_s: float | None = None, log: Callable = print):
        self.profile, self.config, self.force, self.cluster, self.log = profile, config, force, cluster, log
        self.run_step = run_step
        self.folder = Path(folder)
        self.poll_s, self.sacct_s = poll_s, sacct_interval() if sacct_s is None else sacct_s
        self.queue_s = queue_interval() if queue_s is None else queue_s
        self.jobs: dict[Future, tuple] = {}
        self.adoptable: dict[str, dict] = {}          # steps whose job an earlier book left in the queue: waited for, not submitted
        self._restarts: dict[str, int] = {}
        self._lock, self._rec_lock, self._stop = threading.Lock(), threading.Lock(), threading.Event()
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

    def _executor(self, name: str):
        r = self.config.resources(name)
        requeues = {"slurm_max_num_timeout": r.requeues} if self.cluster == "slurm" else {}
        executor = submitit.AutoExecutor(folder=self.folder / name, cluster=self.cluster, **requeues)   # one a job: its own requeues
        executor.update_parameters(**self.parameters(name))
        return executor

    def script(self, name: str) -> str:
        "The sbatch script the job of step `name` would be submitted with (resources, setup lines, logs; `%j`: its job id): text, written on a machine with no SLURM client too (a dry run, this chapter's example), where submitit's executor would refuse to be built (`_script_only`)."
        with _script_only(self.cluster):
            ex = self._executor(name)._executor
        return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")

    # the record of live jobs: written under its own lock (the watcher settles jobs while the book submits)
    def _record(self) -> dict:
        f = self.folder / RECORD
        try: return load_json(f, "the SLURM pool's record of its jobs") if f.exists() else {}
        except CapbookError: return {}                # a record cut short: no job to adopt (their writers' locks still hold)

    def _remember(self, name: str, entry: dict | None) -> None:
        with self._rec_lock:
            rec = self._record()
            if entry is None and name not in rec: return
            if entry is None: rec.pop(name)
            else: rec[name] = entry
            save_json(self.folder / RECORD, rec)

    def adopt(self, keys: dict[str, str]) -> None:
        "Read the jobs an earlier book left (`RECORD`) before submitting anything: one still queued whose step this book runs under the same key (`keys`: step name → key) is waited for instead of submitted again; one whose step changed (or `force`) is cancelled; one of a step this book does not run is left to run; an ended one is forgotten."
        rec = self._record()
        if not rec or self.cluster != "slurm": return
        live = queue_states([e["job"] for e in rec.values()])
        if live is None: raise CapbookError(f"{self.folder / RECORD}: jobs of an earlier book are recorded, but squeue cannot be asked whether they still run")
        cancelled = []
        for name, e in rec.items():
            st = live.get(e["job"])
            if st is None or st[0] not in UNFINISHED: self._remember(name, None); continue
            if name not in keys: continue
            if not self.force and keys[name] == e["key"]:
                self.adoptable[name] = e
                self.log(f"  {name}: job {e['job']} of an earlier book that ended without cancelling it is still {st[0]}: "
                         f"this book waits for it instead of submitting the step again")
            else:
                _slurm(["scancel", e["job"]]); cancelled.append(e["job"]); self._remember(name, None)
                self.log(f"  {name}: job {e['job']} of an earlier book cancelled ({'--force' if self.force else 'its step changed since'})")
        t0 = time.time()                              # their writers' locks are free once they have left the queue
        while cancelled and queue_states(cancelled) and time.time() - t0 < 120: time.sleep(1)

    def submit_step(self, step, key: str, training: str | None = None, force: bool | None = None) -> Future:
        "Submit `step` (its key and training key computed here, before it runs) as one job, or wait for its job that an earlier book left (`adopt`); the future settles with (executed notebook, whether it ran) or a `CapbookError` line. `force`: run it even where current (the pool's `force` where None)."
        r = self.config.resources(step.name)
        fut = Future(); fut.set_running_or_notify_cancel()
        if (e := self.adoptable.pop(step.name, None)) is not None:
            job = submitit.SlurmJob(folder=e["folder"], job_id=e["job"])
            with self._lock: self.jobs[fut] = (step, job)
            self.log(f"  {step.name}: waiting for job {job.job_id} (log: {job.paths.stdout})")
            return fut
        executor = self._executor(step.name)
        try:
            with contextlib.redirect_stderr(io.StringIO()):   # submitit prints sbatch's stderr too: it is folded into the one line
                job = executor.submit(StepJob(), self.run_step, step, self.profile, self.force if force is None else force, key, r.cpus, r.gpus, training)
        except Exception as e:                     # sbatch refused it: an unknown option, partition or account, a limit
            raise CapbookError(_refusal(step.name, e, r, self.config.source)) from None
        with self._lock: self.jobs[fut] = (step, job)
        if self.cluster == "slurm":
            self._remember(step.name, {"job": job.job_id, "key": key, "folder": str(self.folder / step.name), "submitted": time.time()})
        self.log(f"  {step.name}: job {job.job_id} submitted ({r.cpus} CPUs{f', {r.gpus} GPUs' if r.gpus else ''}, "
                 f"{r.mem_gb:g} GB, {r.time_min} min{f', partition {r.partition}' if r.partition else ''}); log: {job.paths.stdout}")
        return fut

    def _end(self, fut: Future, step, job, error: str | None = None, result=None) -> None:
        "Settle a step's future (an error line, or its result) and forget its job."
        self._remember(step.name, None)
        try:
            if error is not None: fut.set_exception(CapbookError(error))
            else: fut.set_result(result)
        except Exception: pass                        # (settled meanwhile: cancelled)

    def _settle(self, fut: Future, step, job) -> None:
        state = final_state(job) if self.cluster == "slurm" and not job.paths.result_pickle.exists() else None
        if state in NO_RESULT:     # ended by the scheduler: no result is coming (submitit would wait 15 s for one, for a slow shared filesystem)
            return self._end(fut, step, job, failure_line(step.name, job.job_id, state, _log_of(job)))
        try: res = job.result()
        except Exception as e:
            state = state or (final_state(job) if self.cluster == "slurm" else "FAILED")
            why = _last_line(e) if state in ("FAILED", "UNKNOWN") else ""
            return self._end(fut, step, job, failure_line(step.name, job.job_id, state, _log_of(job), why))
        if res[0] == "ok":
            self.log(f"  {step.name}: ran in {res[3]:.1f} s (job {job.job_id})" if res[2] else f"  {step.name}: unchanged, skipped (job {job.job_id})")
            self._end(fut, step, job, result=(Path(res[1]), res[2]))
        else: self._end(fut, step, job, res[1])                       # the step's own line, as a local book prints it

    def _look(self, pending: list, status: bool) -> None:
        "Ask squeue how the pending jobs stand: print each requeue as it is seen, end a job no node can ever start (its reason in one line), and, if `status`, print the queue's status line."
        q = queue_states([j.job_id for _, _, j in pending])
        if q is None: return                          # squeue briefly unreachable: the next look asks again
        running, waiting = [], []
        for f, s, j in pending:
            if (st := q.get(j.job_id)) is None: continue
            state, reason, restarts, used = st
            if restarts > self._restarts.get(j.job_id, 0):
                self._restarts[j.job_id] = restarts
                self.log(f"  {s.name}: job {j.job_id} requeued ({restarts} {'time' if restarts == 1 else 'times'} so far"
                         f"{f'; SLURM says {reason}' if reason not in ('', 'None') else ''}): it resumes from its checkpoint")
            if state == "PENDING" and reason in NEVER_STARTS:
                try: j.cancel(check=False)                # as `cancel` ends a job
                except Exception: pass
                self._end(f, s, j, f"{s.name}: SLURM job {j.job_id} can never start: {reason} ({NEVER_STARTS[reason]}); it was cancelled: "
                                   f"change its resources in the executor config ({self.config.source})")
                continue
            if state == "RUNNING": running.append(f"{s.name} {used}")
            else: waiting.append(f"{s.name}: {state.lower()}{f', {reason}' if reason not in ('', 'None') else ''}")
        if status and (running or waiting):
            said = [f"{len(running)} running ({', '.join(running)})"] * bool(running) + [f"{len(waiting)} waiting ({'; '.join(waiting)})"] * bool(waiting)
            self.log(f"  queue at {time.strftime('%H:%M:%S')}: {'; '.join(said)}")

    def _watch(self) -> None:
        last_sacct = last_status = time.time()
        while not self._stop.wait(self.poll_s):
            with self._lock: pending = [(f, s, j) for f, (s, j) in self.jobs.items() if not f.done()]
            ask = time.time() - last_sacct >= self.sacct_s
            if ask: last_sacct = time.time()
            for f, s, j in pending:
                try: done = j.done(force_check=ask)
                except Exception: continue                # sacct briefly unreachable: the next look asks again
                if done: self._settle(f, s, j)
            if ask and self.cluster == "slurm" and (pending := [(f, s, j) for f, s, j in pending if not f.done()]):
                status = time.time() - last_status >= self.queue_s
                if status: last_status = time.time()
                try: self._look(pending, status)
                except Exception: pass                    # the queue's words are a courtesy: a job's end is read from sacct

    def cancel(self) -> list[str]:
        "Cancel every job not yet ended; returns their ids."
        with self._lock: pending = [(f, s, j) for f, (s, j) in self.jobs.items() if not f.done()]
        for f, s, j in pending:
            try: j.cancel(check=False)
            except Exception: pass
            self._end(f, s, j, f"job {j.job_id} cancelled")
        return [j.job_id for _, _, j in pending]

    def __enter__(self) -> "SlurmPool":
        if self.cluster == "slurm": check_slurm()
        try: self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e: raise io_error(self.folder, e, "create the SLURM jobs' folder") from None
        self._watcher.start(); return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and (ids := self.cancel()):          # Ctrl-C, SIGTERM, SIGHUP, or the book stopping on an error of its own
            self.log(f"cancelled {len(ids)} SLURM jobs: {' '.join(ids)}" + (f" (the book was ended by {exc})" if getattr(exc, "signum", None) else ""))
        self._stop.set(); self._watcher.join(timeout=10)

# %% [markdown]
# A step's job parameters as submitit receives them, its sbatch script, and the lines of a failed job and a refused one:

# %%
_pool = SlurmPool("default", executor_config(None, "default"), Path(tempfile.mkdtemp()), print, cluster="slurm")
assert _pool.parameters("03_spca-k5") == {"name": "capbook-03_spca-k5", "timeout_min": 180, "cpus_per_task": 2, "mem_gb": 8,
                                           "tasks_per_node": 1, "nodes": 1, "slurm_additional_parameters": {}, "slurm_setup": [],
                                           "slurm_signal_delay_s": 90}
_script = _pool.script("03_spca-k5")
assert "#SBATCH --cpus-per-task=2" in _script and "#SBATCH --time=180" in _script and f"{_pool.folder}/03_spca-k5/%j_0_log.out" in _script, _script
print(failure_line("03_spca-k5", "4127", "TIMEOUT", "runs/default/slurm/03_spca-k5/4127_0_log.err"))
assert failure_line("x", "7", "OUT_OF_MEMORY", "l").endswith("raise its mem_gb in the executor config; log: l")
_said_by_sbatch = Exception("sbatch: unrecognized option '--qoss=high'\nTry \"sbatch --help\" for more information")
print(_refusal("03_spca-k5", _said_by_sbatch, Resources(sbatch={"qoss": "high"}), "slurm.yaml"))
assert _refusal("03_spca-k5", _said_by_sbatch, Resources(sbatch={"qoss": "high"}), "slurm.yaml") == (
    "03_spca-k5: sbatch refused its job (sbatch: unrecognized option '--qoss=high'); check the sbatch option 'qoss' in slurm.yaml")
