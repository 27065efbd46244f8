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

# %%
#| default_exp core

# %%
#| export
from __future__ import annotations
import hashlib, json, os, random, tempfile, contextlib
from pathlib import Path
from typing import Any, Callable, Iterable
import numpy as np
import torch


# %% [markdown]
# ## One clear line for bad input
#
# Every error a user can cause (a corrupt image, a malformed dataset file, an invalid notebook parameter) is raised
# as a `CapbookError` whose message is a single line naming the file or parameter and what is allowed. The CLI
# prints it as `error: ...` and exits with status 2; inside a notebook it is the last line of the traceback.

# %%
#| export
class CapbookError(Exception):
    "A user-facing error: its message is one line naming the file or parameter and what is allowed."
    def __init__(self, msg: str):
        super().__init__(" ".join(str(msg).split()))


# %%
assert str(CapbookError("line one\n   line two")) == "line one line two"   # always one line


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
    return Path(os.environ.get("CAPBOOK_DATA", project_root() / "data"))

def runs_dir() -> Path:
    "Where executed notebooks and results records go, one folder per profile."
    return project_root() / "runs"


# %%
import os as _os
_old = _os.environ.get("CAPBOOK_HOME"); _os.environ["CAPBOOK_HOME"] = "/tmp/capbook-home-example"
assert project_root() == Path("/tmp/capbook-home-example") and runs_dir() == project_root() / "runs"
assert data_dir() == Path(_os.environ.get("CAPBOOK_DATA", project_root() / "data"))
if _old is None: del _os.environ["CAPBOOK_HOME"]
else: _os.environ["CAPBOOK_HOME"] = _old


# %% [markdown]
# ## Atomic writes
#
# A checkpoint, a feature store or a results record is first written to a temporary file in the same folder, flushed
# to disk, and then renamed over its final name. A process killed midway leaves at most a stray `.tmp` file, never a
# truncated file that a later run would read as valid.

# %%
#| export
def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    "Call `write(tmp)` to fill a temporary file beside `path`, fsync it, then rename it to `path`."
    path = Path(path); path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd); tmp = Path(tmp)
    try:
        write(tmp)
        with open(tmp, "rb+") as f: os.fsync(f.fileno())
        os.replace(tmp, path)
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


# %%
assert stable_hash({"a": 1, "b": [2, 3]}) == stable_hash({"b": [2, 3], "a": 1}) != stable_hash({"a": 2, "b": [2, 3]})
import capbook.core as _core                          # the installed module (a notebook has no __file__)
assert len(_core.package_hash()) == 12 and set(_core.code_version()) == {"package", "commit", "dirty"}


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
    try: return torch.device(device)
    except RuntimeError: raise CapbookError(f"device={device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from None

def autocast(device: torch.device):
    "Mixed precision on CUDA (bfloat16 where supported); a no-op context on the CPU."
    if device.type == "cuda":
        dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dt)
    return contextlib.nullcontext()


# %%
seed_everything(3); _x = torch.rand(2)
seed_everything(3); assert torch.equal(_x, torch.rand(2))                       # one seed, the same draws
assert get_device("cpu").type == "cpu" and get_device().type in ("cpu", "cuda")
with autocast(torch.device("cpu")): assert (torch.ones(2) @ torch.ones(2)).dtype == torch.float32   # no-op on the CPU


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
