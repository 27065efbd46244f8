"""submitit against a real one-node SLURM cluster (tests/slurmcluster.py): a value comes back, a node's exception reaches
the caller, and a job cancelled from outside reads as sacct reports it. Root only; skips elsewhere."""
import subprocess, sys, time

import pytest

from slurmcluster import one_node_slurm

submitit = pytest.importorskip("submitit")
cloudpickle = pytest.importorskip("cloudpickle")       # submitit's own pickler
from capbook.cluster import final_state                 # noqa: E402 (after submitit is known to import)
pytestmark = pytest.mark.slow

# The node unpickles the submitted function: one defined here is pickled by reference to the module `test_slurmcluster`,
# which the job's python (started in pytest's working folder, the repository) cannot import; by value it needs nothing.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _double(x): return 2 * x


def _fail(): raise ValueError("raised on the node")


def _sleep(s): time.sleep(s); return s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    "The cluster the book's SLURM tests use (sacct from the job completion log; `accounting='slurmdbd'` gives a database's), shared by the module's tests."
    with one_node_slurm(tmp_path_factory.mktemp("slurm")) as c: yield c


@pytest.fixture
def executor(cluster, tmp_path, monkeypatch):
    "submitit's executor on the cluster: the environment that names its slurm.conf, its logs and pickles in tmp_path."
    cluster.apply(monkeypatch)
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    # mem_gb: sbatch refuses any memory request on a node whose RealMemory is left out (1 MB); slurmcluster sets it.
    ex.update_parameters(timeout_min=5, slurm_partition=cluster.partition, cpus_per_task=1, mem_gb=1)
    return ex


def _state_becomes(job, state: str, timeout: float = 10) -> bool:
    "Whether sacct gives the job `state` within `timeout` seconds."
    deadline = time.monotonic() + timeout
    while job.watcher.get_state(job.job_id, mode="force") != state:
        if time.monotonic() > deadline: return False
        time.sleep(0.2)
    return True


def test_value_and_exception_come_back(cluster, executor):
    ok, bad = executor.submit(_double, 21), executor.submit(_fail)     # side by side: one CPU each
    assert ok.result() == 42
    with pytest.raises(submitit.core.utils.FailedJobError, match="ValueError: raised on the node"): bad.result()
    assert (final_state(ok), final_state(bad)) == ("COMPLETED", "FAILED")


def test_scancel_reads_cancelled(cluster, executor):
    job = executor.submit(_sleep, 300)
    deadline = time.monotonic() + 20
    while "Loading pickle" not in (job.stdout() or ""):                      # the function itself has started
        assert time.monotonic() < deadline, "the job did not start within 20 s"
        time.sleep(0.2)
    # slurmdbd has it RUNNING (soon after squeue does); the completion log knows only finished jobs, UNKNOWN until then
    assert _state_becomes(job, "RUNNING" if cluster.accounting == "slurmdbd" else "UNKNOWN")
    subprocess.run(["scancel", job.job_id], check=True)                    # from outside: SLURM_CONF is all it needs
    deadline = time.monotonic() + 10
    while not job.done(force_check=True):
        assert time.monotonic() < deadline, "submitit did not see the cancelled job as done within 10 s"
        time.sleep(0.2)
    assert final_state(job) == "CANCELLED"                                  # ("CANCELLED by <uid>" with slurmdbd: its first word)
