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
# # core
#
# > Errors, paths, atomic writes, seeding, devices and parameter checks shared by every capbook module.
#
# **The rooms.** `capbook` is a stack of modules, each importing only those below it (`tests/test_rooms.py` fails on
# any import circle). At the bottom, `core` (this notebook) and the data: `shapes`, `data`, `encoders`, `prepare`. The
# engine: `models` (the decoding interface and the registry), `attention`, `decode` (greedy, beam search and sampling:
# the one home of each), `objectives`, `train` (the one trainer) with `stacked` (several seeds as one stacked model),
# `metrics` (the one evaluator) and beside it `claims` (the verdict statistics: the seed-and-image test, Holm,
# `Claims`), and `viz` (the one plotting path). The papers: `papers` (their published numbers) and one module per
# paper (`sat`, `spca`, `ssa`, `glied`, `baselines`, with `attributes`), each declaring its chapter in `profiles`
# (profiles, budgets, seeds and chapter declarations: the room every room above reads). The book: `plan` (the steps),
# `records` (where a row's numbers are found), `stages` (what a run trains, stage by stage), `runner` (one chapter
# run), `results` (the keys and the published book's currency), `book` (the runner of the plan) and `cluster` (its
# SLURM executor, handed the step function it runs); the site: `copies` (the reader's copies), `docs` (the site
# build) and `browser` (pages seen as a reader sees them); at the top `bench`, `rehearsal`, `caption` and `cli`.

# %%
#| default_exp core

# %%
#| export
from __future__ import annotations
import contextlib, errno, functools, hashlib, json, os, random, shutil, sys, tempfile, time
from pathlib import Path
from typing import Any, Callable, Iterable
import numpy as np
import torch

# jsonschema, under nbformat and papermill, imports rfc3987_syntax where it is installed (jupyter-events pulls it in) for
# one string format, "iri", and that import compiles 39 grammars: 3-6 s of every process that reads a notebook (each book,
# each of its workers, each `capbook docs`). No notebook schema checks an "iri" string: a capbook process goes without it.
sys.modules.setdefault("rfc3987_syntax", None)


# %% [markdown]
# ## One clear line for bad input
#
# Every error a user can cause (a corrupt image, a malformed dataset file, an invalid notebook parameter) is raised
# as a `CapbookError` whose message is a single line naming the file or parameter and what is allowed. The CLI
# prints it as `error: ...` and exits with status 2; inside a notebook it is the last line of the traceback.

# %%
#| export
class Deferred:
    "A module imported where it is first used (`nbformat = Deferred('nbformat')`): every kernel of the book imports the rooms that read notebooks with the model registry, and nbformat brings jsonschema, whose format checker compiles its grammars as it is imported (about a second)."
    def __init__(self, name: str): self._name = name
    def __getattr__(self, attr: str):
        import importlib
        return getattr(importlib.import_module(self._name), attr)


# %%
#| export
class CapbookError(Exception):
    "A user-facing error: its message is one line naming the file or parameter and what is allowed; `then`, where one command fixes it: that command, which `error_line` shows on a line of its own."
    def __init__(self, msg: str, then: str | None = None):
        super().__init__(" ".join(str(msg).split()))
        self.then = then


# %%
assert str(CapbookError("line one\n   line two")) == "line one line two"   # always one line


# %% [markdown]
# A notebook run by papermill would bury that line under two tracebacks (the kernel's and papermill's). Importing
# any capbook module in IPython therefore installs a handler for `CapbookError` alone: the failing cell's error output is the
# one line, prefixed `capbook:`, and the full traceback goes to a log file whose path the line names
# (`runs/errors/`, or the system's temporary folder when that cannot be written). Any other exception — a bug — keeps
# its full traceback. The CLI does the same on stderr (`error: ...`, exit status 2).

# %%
#| export
def save_traceback(exc: BaseException) -> Path | None:
    "Write `exc`'s full traceback to a log file (runs/errors/, else the temporary folder); return its path."
    import traceback, datetime
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log"
    for folder in (runs_dir() / "errors", Path(tempfile.gettempdir()) / "capbook-errors"):
        try:
            folder.mkdir(parents=True, exist_ok=True); (folder / name).write_text(text); return folder / name
        except OSError: continue
    return None

def error_line(exc: BaseException, prefix: str = "capbook") -> str:
    "The one line a user reads for a `CapbookError` (its traceback saved to a log file the line names); for an error that names the command that fixes it (`then`), that line and the command on a second: nothing went wrong in the code, so no traceback is kept."
    if then := getattr(exc, "then", None): return f"{prefix}: {exc}\nrun first: {then}"
    log = save_traceback(exc)
    return f"{prefix}: {exc}" + (f" (traceback: {log})" if log else "")

ENV_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EDQUOT)   # OSErrors of the environment, not of the code

def _install_notebook_errors() -> None:
    "Under IPython, show a `CapbookError` — and an `OSError` of the environment (read-only or full disk, permission) — as its one line instead of a traceback."
    try: ip = get_ipython()  # noqa: F821 (defined inside IPython only)
    except NameError: return
    if ip is None or getattr(ip, "_capbook_errors", False): return
    def handler(shell, etype, value, tb, tb_offset=None):
        if isinstance(value, OSError) and not isinstance(value, CapbookError) and value.errno not in ENV_ERRNOS:
            return shell.showtraceback((etype, value, tb), tb_offset=tb_offset)   # a bug's OSError keeps its traceback
        value.__traceback__ = tb
        line = error_line(os_error_line(value) if isinstance(value, OSError) else value)
        shell._showtraceback(etype, value, [line])      # the cell's error output: the line, in place of a traceback
        return [line]
    ip.set_custom_exc((CapbookError, OSError), handler); ip._capbook_errors = True

_install_notebook_errors()      # every capbook module imports this one: importing capbook in a notebook installs it

# %% [markdown]
# An error a command fixes reads as two short lines, the second the command to run first:

# %%
print(error_line(CapbookError("02_show_attend_tell is not trained here", then="capbook book --only =02_show_attend_tell --force"), "error"))
assert error_line(CapbookError("x", then="make venv")).splitlines() == ["capbook: x", "run first: make venv"]


# %% [markdown]
# ## Paths
#
# capbook keeps everything it computes under the project root: `data/` (datasets, encoders, feature stores),
# `runs/` (executed notebooks, results records) and `figures/` (the default profile's published tables and figures).
# `CAPBOOK_HOME` moves the whole tree (the tests use it to work in a temporary folder).

# %%
#| export
def project_root() -> Path:
    "The folder holding `data/`, `runs/` and `figures/`: `$CAPBOOK_HOME`, else the checkout capbook was installed from, else the cwd."
    env = os.environ.get("CAPBOOK_HOME")
    if env: return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    if (here / "settings.ini").exists(): return here
    return Path.cwd().resolve()

def data_dir() -> Path:
    "Where datasets, trained encoders and feature stores are cached."
    env = os.environ.get("CAPBOOK_DATA")                    # project_root() only when needed
    return Path(env) if env else project_root() / "data"

def runs_dir() -> Path:
    "Where executed notebooks and results records go, one folder per profile."
    return project_root() / "runs"


# %%
import os as _os
_ex_home = Path(tempfile.gettempdir()) / "capbook-home-example"
_old = _os.environ.get("CAPBOOK_HOME"); _os.environ["CAPBOOK_HOME"] = str(_ex_home)
assert project_root() == _ex_home and runs_dir() == project_root() / "runs"
assert data_dir() == Path(_os.environ.get("CAPBOOK_DATA", project_root() / "data"))
if _old is None: del _os.environ["CAPBOOK_HOME"]
else: _os.environ["CAPBOOK_HOME"] = _old


# %% [markdown]
# ## Atomic writes
#
# A checkpoint, a feature store or a results record is first written to a temporary file in the same folder, flushed
# to disk, and then renamed over its final name. A process killed midway leaves at most a stray temporary file
# `.<name>.<pid>.<random>.tmp`, never a truncated file that a later run would read as valid; the next write of the same
# file deletes the strays whose process is gone. The file gets the permissions of any file the user creates (the
# temporary file's private 0600 would otherwise stick). A folder that cannot be written (read-only, full disk, no
# permission) stops with one line naming the file, and the previous version of the file is left as it was.

# %%
#| export
def _pid_alive(pid: int) -> bool:
    try: os.kill(pid, 0)
    except ProcessLookupError: return False
    except (PermissionError, OverflowError): return True
    return True

def sweep_tmp(path: str | Path) -> None:
    "Delete temporary files and folders `.<name>.<pid>.*tmp` beside `path` whose writing process is gone (a killed write's)."
    path = Path(path)
    for t in path.parent.glob(f".{path.name}.*.tmp"):
        pid = t.name[len(path.name) + 2:].split(".")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            if t.is_dir() and not t.is_symlink(): shutil.rmtree(t, ignore_errors=True)
            else: t.unlink(missing_ok=True)

def temp_dir(path: str | Path) -> Path:
    "A new temporary folder beside `path`, `.<name>.<pid>.<random>.tmp`, to be renamed into place when complete; a killed writer's are swept first."
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_tmp(path)
        return Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    except OSError as e: raise io_error(path, e, "create a temporary folder for") from None

def _umask() -> int:
    m = os.umask(0o022); os.umask(m); return m

_FILE_MODE = 0o666 & ~_umask()

def io_error(path: str | Path, e: OSError, doing: str = "write") -> CapbookError:
    "An `OSError` on `path` as one line: what failed, where, and why (read-only, full disk, permission)."
    why = {30: "the folder is read-only", 28: "no space left on the device", 13: "permission denied",
           122: "disk quota exceeded", 2: "no such file or folder", 20: "a path component is a file, not a folder",
           21: "it is a folder", 17: "a path component is a file, not a folder"}.get(e.errno, e.strerror or str(e))
    return CapbookError(f"{path}: cannot {doing} ({why}); nothing already written was changed")

def os_error_line(e: OSError) -> CapbookError:
    "An `OSError` from the environment (a file as a folder, a full disk), named by its file, as one line."
    return io_error(e.filename or "(unnamed file)", e, "write" if e.errno in (28, 30, 122) else "use")

def io_errors_as_lines(fn: Callable) -> Callable:
    "Decorate an entry point so that an `OSError` from the environment becomes one line (`os_error_line`)."
    import functools
    @functools.wraps(fn)
    def wrapper(*a, **k):
        try: return fn(*a, **k)
        except OSError as e: raise os_error_line(e) from None
    return wrapper

def one_at_a_time(name: str) -> Callable:
    "Decorate a builder of shared data so that one process at a time runs it (an exclusive lock on `data/.<name>.lock`): runs side by side (`capbook book -j 2`) build a missing cache once and the others then open it."
    import fcntl, functools
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*a, **k):
            try:
                data_dir().mkdir(parents=True, exist_ok=True)
                f = open(data_dir() / f".{name}.lock", "a")
            except OSError: return fn(*a, **k)            # a read-only data folder: nothing to build, nothing to guard
            with f:
                fcntl.flock(f, fcntl.LOCK_EX)            # released when the file closes, or when the process dies
                return fn(*a, **k)
        return wrapper
    return deco

def _holder() -> str:
    "Who this process is, as a lock names its holder: pid, host, SLURM job if any, and since when."
    import socket
    job = os.environ.get("SLURM_JOB_ID")
    return f"pid {os.getpid()} on {socket.gethostname()}" + (f", SLURM job {job}" if job else "") + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}"

WRITING = "another {what} is writing this folder ({who}); wait for it to end (a killed one releases it), or use another folder"

@contextlib.contextmanager
def one_writer(folder: str | Path, what: str = "training run", lock: str | Path | None = None, refusal: str = WRITING):
    "Hold `folder` for this process's writing, for the block: an exclusive lock on `lock` (default `<folder>/.writer.lock`) that dies with its holder (flock: released when the process ends, even by SIGKILL; on NFS, Linux takes it as a lock the server keeps for every client). A second writer stops at once, in one line: the folder, then `refusal` naming the live one (`{what}`, `{who}`)."
    import fcntl
    folder = Path(folder); lock = Path(lock) if lock else folder / ".writer.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        f = open(lock, "a+b", buffering=0)        # unbuffered: a holder's line a full disk refused is not written again at close
    except OSError as e: raise io_error(lock.parent, e, f"create the folder of this {what}") from None
    with f:
        try: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0); who = f.read().decode(errors="replace").strip() or "another process"
            raise CapbookError(f"{folder}: " + refusal.format(what=what, who=who)) from None
        try: f.seek(0); f.truncate(); f.write(_holder().encode())
        except OSError: pass                      # a full disk: the lock holds all the same; what fails next says why
        yield

@contextlib.contextmanager
def environment(values: dict[str, str] | None):
    "The process's environment with `values` set inside the block, and as it was after (a variable it lacked, unset again)."
    old = {k: os.environ.get(k) for k in values or {}}
    os.environ.update(values or {})
    try: yield
    finally:
        for k, v in old.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v

def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    "Call `write(tmp)` to fill a temporary file beside `path`, fsync it, then rename it to `path`."
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_tmp(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as e: raise io_error(path, e) from None
    tmp = Path(tmp)
    try:
        write(tmp)
        with open(tmp, "rb+") as f: os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True); raise io_error(path, e) from None
    except BaseException:
        tmp.unlink(missing_ok=True); raise
    return path

def save_json(path: str | Path, obj: Any) -> Path:
    "Write `obj` as indented JSON, atomically."
    return atomic_write(path, lambda t: t.write_text(json.dumps(obj, indent=1, sort_keys=False, default=_jsonable)))

def _jsonable(o):
    if isinstance(o, (np.integer,)): return int(o)
    if isinstance(o, (np.floating,)): return float(o)
    if isinstance(o, np.ndarray): return o.tolist()
    if isinstance(o, Path): return str(o)
    if isinstance(o, torch.Tensor): return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")

def load_json(path: str | Path, what: str = "JSON file") -> Any:
    "Read JSON, turning a missing or malformed file into one `CapbookError` line."
    path = Path(path)
    if not path.exists(): raise CapbookError(f"{path}: {what} not found")
    try: return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CapbookError(f"{path}: malformed {what} ({e.__class__.__name__}: {e})") from None

def save_torch(path: str | Path, obj: Any) -> Path:
    "`torch.save` atomically."
    return atomic_write(path, lambda t: torch.save(obj, t))

def save_yaml(path: str | Path, obj: dict, header: str = "") -> Path:
    "Write a mapping of plain values as YAML, keys in their order, atomically; `header`: comment lines above it."
    import yaml
    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(json.loads(json.dumps(obj, default=_jsonable)), sort_keys=False, allow_unicode=True)
    return atomic_write(path, lambda t: t.write_text(text))

def load_yaml(path: str | Path, what: str = "parameters file") -> dict:
    "A YAML mapping; a missing, unparsable or non-mapping file becomes one `CapbookError` line."
    import yaml
    path = Path(path)
    if not path.is_file(): raise CapbookError(f"{path}: {what} not found")
    try: obj = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CapbookError(f"{path}: unreadable {what} ({' '.join(str(e).split())})") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise CapbookError(f"{path}: a {what} must be a YAML mapping of names to values (got {type(obj).__name__})")
    return obj

def load_torch(path: str | Path, what: str = "checkpoint") -> Any:
    "`torch.load(weights_only=True)` on the CPU; an unreadable file becomes one `CapbookError` line."
    path = Path(path)
    if not path.exists(): raise CapbookError(f"{path}: {what} not found")
    try: return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CapbookError(f"{path}: unreadable {what} ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


# %%
import tempfile as _tf
_d = Path(_tf.mkdtemp())
save_json(_d/"r.json", {"a": np.float32(1.5)})
assert load_json(_d/"r.json") == {"a": 1.5}
(_d/"bad.json").write_text("{oops")
try: load_json(_d/"bad.json", "results record"); raise AssertionError
except CapbookError as e: assert "bad.json" in str(e) and "\n" not in str(e)
def _boom(t): t.write_text("half"); raise KeyboardInterrupt
try: atomic_write(_d/"x.txt", _boom)
except KeyboardInterrupt: pass
assert not (_d/"x.txt").exists() and not list(_d.glob(".x.txt*"))
assert (_d/"r.json").stat().st_mode & 0o777 == _FILE_MODE                        # readable like any other file
(_d/".r.json.999999999.abc.tmp").write_text("left by a killed process"); save_json(_d/"r.json", {})
save_yaml(_d/"p.yaml", {"kernel": 5, "lr": np.float64(4e-4), "grid": (7, 7), "att_dim": None}, "a run's parameters")
assert load_yaml(_d/"p.yaml") == {"kernel": 5, "lr": 4e-4, "grid": [7, 7], "att_dim": None}
for _bad in ("kernel: [5", "- 5\n- 7"):
    (_d/"bad.yaml").write_text(_bad)
    try: load_yaml(_d/"bad.yaml"); raise AssertionError
    except CapbookError as e: assert "bad.yaml" in str(e) and "\n" not in str(e); print(e)
assert not list(_d.glob(".r.json.*"))                                            # swept on the next write
try: save_json(_d/"r.json"/"inner.json", {}); raise AssertionError                 # a file where a folder should be
except CapbookError as e: print(e); assert "r.json/inner.json: cannot write (a path component is a file" in str(e)


# %% [markdown]
# **One writer per folder.** A run folder has one writer at a time: a training run (`capbook.train.fit`) holds its
# checkpoint folder, a book step (`capbook.book.run_step`) its run folder, for as long as it writes them
# (`one_writer`). A second process on the same folder — a job that a killed book left running and its duplicate, a
# reader's run started beside the book's — stops before it reads or writes anything, in one line naming the live one.
# The lock dies with its holder, so a killed run never leaves a folder locked.

# %%
import subprocess
_held = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
                          "f.write('pid 4242 on node7'); f.flush(); print('held', flush=True); time.sleep(60)", str(_d/".writer.lock")],
                         stdout=subprocess.PIPE, text=True)
assert _held.stdout.readline().strip() == "held"
try:
    with one_writer(_d): raise AssertionError("a second writer got in")
except CapbookError as e: print(e); assert f"{_d}: another training run is writing this folder (pid 4242 on node7)" in str(e)
_held.kill(); _held.wait()
with one_writer(_d): assert f"pid {os.getpid()} on " in (_d/".writer.lock").read_text()    # the holder gone: the folder is free
with one_writer(_d): pass                                                                   # released at the block's end


# %% [markdown]
# ## Hashes and code version
#
# Results records carry the code version (the git commit when there is one, and a hash of the package source), and
# the book runner uses the same hashes to skip runs whose notebook, parameters and code are unchanged.

# %%
#| export
def stable_hash(obj: Any, n: int = 12) -> str:
    "A short, order-independent hash of a JSON-able object."
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=_jsonable).encode()).hexdigest()[:n]

def package_hash() -> str:
    "Hash of every capbook module's source: changes whenever the package code changes."
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode()); h.update(p.read_bytes())
    return h.hexdigest()[:12]

def code_version() -> dict:
    "The package hash and, when run from a git checkout, the commit and whether the tree is dirty."
    out = {"package": package_hash(), "commit": None, "dirty": None}
    root = Path(__file__).resolve().parent.parent
    with contextlib.suppress(Exception):
        import subprocess
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                       text=True, timeout=5).stdout.strip() or None
        st = subprocess.run(["git", "status", "--porcelain", "--", "capbook", "nbs"], cwd=root, capture_output=True,
                            text=True, timeout=5).stdout
        out["dirty"] = bool(st.strip())
    return out


# %% [markdown]
# ## Content hashes of input files
#
# Caches and runs are keyed by what they were computed from, by content rather than by name: an image replaced
# under the same file name, or another weights file at the same path, must give a new feature store and a new run.
# Hashing a dataset's images on every run would cost a pass over all of COCO, so `file_digests` keeps each file's
# SHA-256 in `data_dir()/digests.json` beside the file's size, modification time (in nanoseconds) and inode, and
# hashes again only a file whose signature changed — the rule `make` and `rsync` rely on. A file rewritten with new
# content within one tick of the file system's clock can keep its signature, so, like git's index ("racily clean"
# entries), a cached hash is trusted only when the file was last modified at least two seconds before the hash was
# taken. A data folder that cannot be written only makes hashing slower.

# %%
#| export
_DIGESTS: dict = {}

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""): h.update(chunk)
    return h.hexdigest()[:16]

def file_digests(paths: Iterable[str | Path], what: str = "file") -> list[str]:
    "Content hashes (SHA-256, 16 hex digits) of files, cached by size, mtime and inode in `data_dir()/digests.json`."
    cache_path = data_dir() / "digests.json"
    cache = _DIGESTS.setdefault(str(cache_path), {})
    if not cache and cache_path.exists():
        with contextlib.suppress(Exception): cache.update(json.loads(cache_path.read_text()))
    out, new = [], 0
    for p in paths:
        p = os.path.abspath(p)
        try: st = os.stat(p)
        except FileNotFoundError: raise CapbookError(f"{p}: {what} not found") from None
        except OSError as e: raise io_error(p, e, "read") from None
        sig, e = [st.st_size, st.st_mtime_ns, st.st_ino], cache.get(p)
        if e and e[:3] == sig and e[4] > st.st_mtime_ns + 2_000_000_000: out.append(e[3]); continue
        try: d, t = _sha256(Path(p)), time.time_ns()
        except OSError as err: raise io_error(p, err, "read") from None
        cache[p] = [*sig, d, t]; out.append(d); new += 1
    if new:
        with contextlib.suppress(CapbookError): save_json(cache_path, cache)
    return out

def file_digest(path: str | Path, what: str = "file") -> str:
    "The content hash of one file (see `file_digests`)."
    return file_digests([path], what)[0]


# %%
assert stable_hash({"a": 1, "b": [2, 3]}) == stable_hash({"b": [2, 3], "a": 1}) != stable_hash({"a": 2, "b": [2, 3]})
import capbook.core as _core                          # the installed module (a notebook has no __file__)
assert len(_core.package_hash()) == 12 and set(_core.code_version()) == {"package", "commit", "dirty"}
_old = os.environ.get("CAPBOOK_DATA"); os.environ["CAPBOOK_DATA"] = str(_d)      # a private digest cache
_f = _d / "img.bin"; _f.write_bytes(b"one")
_h1 = _core.file_digest(_f); _f.write_bytes(b"two")                             # same name and size, new content
assert _h1 == hashlib.sha256(b"one").hexdigest()[:16] != _core.file_digest(_f) == _core.file_digests([_f])[0]
assert str(_f) in load_json(_d / "digests.json")
if _old is None: del os.environ["CAPBOOK_DATA"]
else: os.environ["CAPBOOK_DATA"] = _old


# %% [markdown]
# ## Seeds and devices
#
# One seed fixes Python's, NumPy's and torch's generators. The device is chosen automatically: CUDA when present
# (with bf16/fp16 autocast), else the CPU in full precision.

# %%
#| export
def seed_everything(seed: int) -> None:
    "Seed Python, NumPy and torch (all devices)."
    random.seed(seed); np.random.seed(seed % 2**32); torch.manual_seed(seed)

def get_device(device: str = "auto") -> torch.device:
    "`'auto'` picks CUDA when available, else CPU; any torch device string is accepted."
    if device == "auto": return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try: dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise CapbookError(f"parameter device={device!r} is invalid: expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0: raise CapbookError(f"parameter device={device!r} is invalid here: no CUDA GPU is visible; use 'auto' or 'cpu'")
        if dev.index is not None and dev.index >= n:
            raise CapbookError(f"parameter device={device!r} is invalid here: {n} GPU(s) visible, cuda:0 to cuda:{n - 1}")
    elif dev.type != "cpu":
        raise CapbookError(f"parameter device={device!r} is invalid: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return dev

def autocast(device: torch.device, cpu_bf16: bool = False):
    "Mixed precision on CUDA (bfloat16 where supported); on the CPU bfloat16 autocast if `cpu_bf16`, else none."
    if device.type == "cuda":
        dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dt)
    if cpu_bf16: return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()

@functools.lru_cache(maxsize=None)
def cpu_bf16_kernels() -> bool:
    "Whether oneDNN has bfloat16 kernels for this CPU (x86 with AVX-512 BW/VL/DQ, or Arm with BF16), read from the CPU's feature flags: the same answer on a busy machine and an idle one."
    try: return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError): return False    # a torch built without oneDNN: float32

def cpu_name() -> str:
    "The CPU's model name and core count as the OS reports them (for the tables that say which machine measured them)."
    import platform
    try: name = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
    except (OSError, StopIteration): name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"

def wide(x: torch.Tensor) -> torch.Tensor:
    "`x` in the arithmetic a loss or a log-softmax is taken in: torch's default dtype (float32; float64 inside a key's probe, `capbook.results`), whatever autocast computed it in."
    return x if x.dtype == torch.get_default_dtype() else x.to(torch.get_default_dtype())

PRECISION_CHOICES = ("auto", "fp32", "bf16")

def cpu_precision(precision: str, device: torch.device) -> str:
    "The arithmetic a run trains in: `precision` as given, or for 'auto' bfloat16 autocast on a GPU and on a CPU with oneDNN's bfloat16 kernels (`cpu_bf16_kernels`: measured 1.2-2.3x faster on AVX-512 machines, 8-45x slower on an AVX2 one, which has none), else float32. Decided by the CPU's flags, never by a timing: a loaded machine must not change a run's numbers."
    check_choice("precision", precision, PRECISION_CHOICES)
    if precision != "auto": return precision
    return "bf16" if device.type == "cuda" or cpu_bf16_kernels() else "fp32"


# %%
seed_everything(3); _x = torch.rand(2)
seed_everything(3); assert torch.equal(_x, torch.rand(2))                       # one seed, the same draws
assert get_device("cpu").type == "cpu" and get_device().type in ("cpu", "cuda")
if not torch.cuda.is_available():
    try: get_device("cuda"); raise AssertionError
    except CapbookError as e: print(e)
with autocast(torch.device("cpu")): assert (torch.ones(2) @ torch.ones(2)).dtype == torch.float32   # no-op on the CPU


# %% [markdown]
# ## Progress on a terminal, silence elsewhere
#
# Long steps (pretraining the shapes encoder, extracting features, an epoch, the book's plan) show a tqdm bar with a
# time estimate when their output is an interactive terminal. Anywhere else — a notebook kernel (the executed
# notebooks and the docs site), a pipe, CI's log — the bar is off: it would only fill the record with carriage
# returns. Text bars, never `tqdm.auto`: that one wants ipywidgets in a notebook and, without them, leaves tqdm's
# warning about a missing IProgress widget in the output. `TQDM_DISABLE=1` silences a terminal too.
#
# One exception: a reader's own run of a chapter (`papermill nbs/03_spca.ipynb out.ipynb -p kernel 5`, or Jupyter).
# Its kernel's output goes into the notebook, and papermill's terminal would show only "Executing: 76 %" for the whole
# of the training. ipykernel keeps a copy of the stderr the kernel inherited, which is papermill's terminal
# (`terminal`): there the run's bars go, and each of its log lines (`tell`) besides the notebook's copy. The book sets
# `IN_BOOK` for the notebooks it runs: their progress is the book's own step lines.

# %%
#| export
IN_BOOK = "CAPBOOK_IN_BOOK"     # environment: set by the book for the notebooks it runs
_TERMINAL: list = []            # the terminal's stream, opened once

def terminal():
    "The stream of the terminal a reader's run of a notebook was started from, where the kernel's own output goes into the notebook: the copy of the kernel's inherited stderr that ipykernel keeps (papermill's terminal, or Jupyter's). None outside a kernel and in a notebook the book runs (`IN_BOOK`)."
    if os.environ.get(IN_BOOK): return None
    fd = getattr(sys.stderr, "_original_stdstream_copy", None)
    if fd is None and type(sys.stderr).__module__.startswith("ipykernel"):   # a kernel that does not capture its fds (ipykernel
        fd = sys.__stderr__.fileno() if sys.__stderr__ is not None else None   # under pytest, or configured so): fd 2 is the terminal
    if not isinstance(fd, int): return None
    if not _TERMINAL:
        try: _TERMINAL.append(os.fdopen(os.dup(fd), "w", buffering=1))
        except OSError: return None
    return _TERMINAL[0]

def tell(line: str) -> None:
    "Print `line` (into the notebook, in one) and, in a reader's run of a notebook, to the terminal it was started from (`terminal`): so a papermill run says what it is doing."
    print(line)
    if (t := terminal()) is not None:
        from tqdm import tqdm
        try: tqdm.write(line, file=t)            # above a bar drawn there, which is drawn again under it
        except OSError: pass                      # a terminal closed under the run: the notebook keeps the line

def progress(iterable: Iterable | None = None, enabled: bool = True, **kw):
    "A tqdm text bar over `iterable` (or `total=`) shown only on an interactive terminal, or the terminal of a reader's run of a notebook (`terminal`), and when `enabled`."
    from tqdm import tqdm
    on = enabled and os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true", "yes")
    if on and (t := terminal()) is not None:      # papermill's terminal: a bar even where it is a pipe (it reads as lines)
        return tqdm(iterable, file=t, mininterval=kw.pop("mininterval", 2), ncols=100, **kw)
    # disable=None is tqdm's "off unless the stream is a TTY"; a Jupyter kernel's stderr is not one
    return tqdm(iterable, disable=None if on else True, mininterval=kw.pop("mininterval", 2), dynamic_ncols=True, **kw)


# %%
import io, contextlib as _cl
with _cl.redirect_stderr(io.StringIO()) as _err:
    assert list(progress(range(3), desc="quiet")) == [0, 1, 2]   # a StringIO is not a terminal: no bar
assert _err.getvalue() == "", _err.getvalue()
assert terminal() is None or os.environ.get(IN_BOOK) is None   # in the book's notebooks: the book's step lines, no bar


# %% [markdown]
# ## Parameter checks
#
# Notebook parameters arrive from papermill as plain values; these checks stop a bad one with a single line that names
# the parameter and what is allowed.

# %%
#| export
def check_choice(name: str, value: Any, allowed: Iterable) -> Any:
    "Stop unless `value` is one of `allowed`."
    allowed = list(allowed)
    if value not in allowed:
        raise CapbookError(f"parameter {name}={value!r} is invalid: allowed values are {', '.join(map(repr, allowed))}")
    return value

def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, odd: bool = False) -> int:
    "Stop unless `value` is an integer in [lo, hi] (and odd, if asked)."
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    ok = ok and (lo is None or value >= lo) and (hi is None or value <= hi) and (not odd or value % 2 == 1)
    if not ok:
        rng = f"{'an odd' if odd else 'an'} integer" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
        raise CapbookError(f"parameter {name}={value!r} is invalid: expected {rng}")
    return int(value)

def check_float(name: str, value: Any, lo: float | None = None, hi: float | None = None) -> float:
    "Stop unless `value` is a number in [lo, hi]."
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    ok = ok and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        raise CapbookError(f"parameter {name}={value!r} is invalid: expected a number"
                           + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else ""))
    return float(value)


# %%
for bad, call in [("kernel=4", lambda: check_int("kernel", 4, lo=1, odd=True)),
                  ("structure='X'", lambda: check_choice("structure", "X", ["S", "C"]))]:
    try: call(); raise AssertionError
    except CapbookError as e: assert bad in str(e), e
assert check_int("kernel", 5, lo=1, odd=True) == 5
