"""Shared fixtures: one temporary capbook home per test process, and the smoke-profile data prepared once per test run.

`make test` runs the suite on both cores (pytest-xdist, `-n 2 --dist loadgroup`): each worker has its own home, and
both open one copy of the smoke data, kept between test runs for the code that builds it (`_smoke_data_folder`) and
built, where missing, by whichever worker asks first with one intra-op thread, as a
`capbook book -j 2` worker's kernel builds it, so that its bits are the ones any book on this machine builds: the kill
test compares a book that builds its own data with the book fixture's, bit for bit. Tests that share a module-scoped book run in one worker
(`pytest.mark.xdist_group`)."""
import contextlib, fcntl, os, subprocess, sys
from pathlib import Path
import pytest

BIN = Path(sys.executable).parent

if os.environ.get("PYTEST_XDIST_WORKER"):     # a core each: two 2-thread OpenMP pools on two cores spin against each other
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"     # (set before torch is imported)


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): tests that share a module fixture run in one worker")
    if not os.environ.get(SCRATCH):            # the run's first process (xdist's controller): its workers and their children inherit it
        import tempfile
        config._capbook_scratch = os.environ[SCRATCH] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="capbook-tests-")
        tempfile.tempdir = None                 # (tempfile reads TMPDIR again)


SCRATCH = "CAPBOOK_TEST_TMP"   # the test run's temporary folder: what its tests, the notebooks' examples, kernels and browsers write there


def pytest_unconfigure(config):
    """A passing test run leaves nothing in the machine's temporary folder: everything written there (pytest's own
    folders, the notebooks' examples, the books' kernels, Chromium's profiles) went to the run's folder, removed at its end.
    A failing run keeps it for its traces, and says where."""
    d = getattr(config, "_capbook_scratch", None)
    if not d: return
    import shutil
    if getattr(config, "_capbook_failed", False): print(f"\nthe test run's temporary files are kept in {d}", file=sys.stderr)
    else: shutil.rmtree(d, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    session.config._capbook_failed = exitstatus not in (0, 5)    # (5: nothing collected)


def pytest_collection_modifyitems(config, items):
    """The soak tests (`make soak`: whole books killed, the rehearsal at a larger scale) run only when `-m` names them.
    The rest run longest first: the book's group (its book is the longest chain of the run), then the other slow tests,
    so that neither worker is left with a long test at the end; within each, the tests that need no smoke data first,
    so that one worker's build of it leaves the other something to do."""
    if "soak" not in (config.getoption("markexpr") or ""):
        soak = [i for i in items if i.get_closest_marker("soak")]
        if soak:
            config.hook.pytest_deselected(items=soak)
            items[:] = [i for i in items if not i.get_closest_marker("soak")]
    rank = lambda i: (0 if any(m.args == ("book",) for m in i.iter_markers("xdist_group")) else 1 if i.get_closest_marker("slow") else 2,
                      "smoke_data" in i.fixturenames)
    items.sort(key=rank)                                # stable: file order within each rank


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    "pytest-xdist groups tests by a suffix it adds to their ids; where a pytest release stops honouring it, say so instead of building every group's fixtures in both workers."
    if getattr(session.config.option, "loadgroup", False):
        lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost: raise pytest.UsageError(f"pytest-xdist's --dist loadgroup did not group {lost[0]}: use the pytest pinned in pyproject.toml")


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory) -> Path:
    "A folder every worker of this test run sees (the run's base temporary folder; without xdist, the process's own)."
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _exclusive(lock: Path):
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)                  # released when the file closes, or when the process dies
        yield


def _smoke_data_folder() -> Path:
    """Where this machine keeps the smoke data between test runs (`CAPBOOK_TEST_CACHE`, else ~/.cache/capbook/tests): one
    folder per content of what decides its bits. `prepare` opens what a folder holds by the data's parameters alone (a
    generated shapes set is never made again), so the folder's name carries the rest: the sources of `capbook.prepare`
    and of every capbook module it imports (read by `test_rooms.imports`), torch's version, the CPU and the instruction
    sets the environment lets torch, oneDNN and MKL use. A changed builder or another kind of CPU builds afresh; folders
    unused for a week are removed."""
    import hashlib, platform, shutil, time
    from importlib.metadata import version
    from test_rooms import PKG, imports
    edges, seen, todo = imports(), set(), ["prepare"]
    while todo:
        m = todo.pop()
        if m not in seen: seen.add(m); todo += edges[m]
    cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0] if Path("/proc/cpuinfo").exists() else platform.processor()
    cpu = "\n".join(l for l in cpu.splitlines() if l.split(":")[0].strip() in ("vendor_id", "model name", "flags"))
    h = hashlib.sha256()
    for part in [*(f"{m}\n{(PKG / f'{m}.py').read_text()}" for m in sorted(seen)), version("torch"), platform.python_version(), cpu,
                 *(f"{k}={os.environ.get(k, '')}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"))]:
        h.update(part.encode() + b"\0")
    home = Path(os.environ.get("CAPBOOK_TEST_CACHE") or Path.home() / ".cache" / "capbook" / "tests")
    home.mkdir(parents=True, exist_ok=True)
    for old in home.glob("smoke-data-*"):
        if old.is_dir() and time.time() - old.stat().st_mtime > 7 * 86400: shutil.rmtree(old, ignore_errors=True)
    return home / f"smoke-data-{h.hexdigest()[:16]}"


def _build_smoke_data(shared: Path) -> Path:
    "Open (building what is missing) this machine's smoke data folder for this code, once per test run, one process at a time under a lock (held across test runs too); return it."
    data, done = _smoke_data_folder(), shared / "smoke-data.built"
    with _exclusive(shared / "smoke-data.lock"), _exclusive(data.with_name(data.name + ".lock")):
        if not done.exists():
            env = {**os.environ, "CAPBOOK_DATA": str(data), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            p = subprocess.run([sys.executable, "-c", "from capbook.prepare import prepare; print(prepare('shapes', 'smoke').describe())"],
                               env=env, capture_output=True, text=True, timeout=900)
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
            if data.exists(): os.utime(data)     # in use: kept from the week's sweep
            done.write_text(p.stdout)
    return data


@pytest.fixture(scope="session", autouse=True)
def _smoke_data_early(request, shared_tmp):
    "Where a test of this run needs the smoke data, start building it at once, in the background, while the tests that need none run (else a worker would wait idle for it, about 10 s)."
    if any("smoke_data" in i.fixturenames for i in request.session.items):
        import threading
        def build():
            with contextlib.suppress(Exception): _build_smoke_data(shared_tmp)
        threading.Thread(target=build, daemon=True).start()


@pytest.fixture(scope="session", autouse=True)
def _one_meteor_process():
    "One METEOR (Java) process for each test worker: every book, key computation and run it starts (their kernels and subprocesses inherit `$CAPBOOK_METEOR`) scores through it instead of starting Java again, about 10 s of CPU each (`meteor_service`: a book's own service passes requests on). The same scores either way (`test_metrics`); a test that needs a process of its own removes the variable."
    from capbook.metrics import meteor_service
    with meteor_service():
        yield


@pytest.fixture(scope="session")
def smoke_data(shared_tmp) -> Path:
    "The smoke data folder (CAPBOOK_DATA) of this test run, built once, in a process with one intra-op thread as a `capbook book -j 2` worker's kernel has: the bits every book on this machine builds (a failed build in the background is built again here, and fails here)."
    return _build_smoke_data(shared_tmp)


@pytest.fixture(scope="session")
def home(tmp_path_factory, smoke_data):
    "A CAPBOOK_HOME for the test process (runs/, figures/ go there, never into the checkout), reading the run's shared smoke data."
    d = tmp_path_factory.mktemp("capbook-home")
    old = {k: os.environ.get(k) for k in ("CAPBOOK_HOME", "CAPBOOK_DATA")}
    os.environ["CAPBOOK_HOME"], os.environ["CAPBOOK_DATA"] = str(d), str(smoke_data)
    yield d
    for k, v in old.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v


@pytest.fixture(scope="session")
def smoke(home):
    "The smoke-profile shapes data (dataset, frozen encoder, features), opened from the shared data folder."
    from capbook.prepare import prepare
    return prepare("shapes", "smoke")


def notebook_markdown(name: str) -> str:
    "The Markdown cells of `nbs/<name>.ipynb`, joined: where the site's prose and its generated blocks live."
    import nbformat
    nb = nbformat.read(Path(__file__).resolve().parent.parent / "nbs" / f"{name}.ipynb", as_version=4)
    return "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
