"""A real one-node SLURM cluster for tests: Debian's slurm-wlm and munge, configured entirely inside a temporary folder.

`one_node_slurm(tmp_path)` writes slurm.conf, a fresh munge key and every state, spool, log, pid and socket path into
`tmp_path`, starts the daemons in the foreground as its own children (their pids are the `Popen` pids, and each also
writes the pid file named in its configuration), waits until `sinfo` shows the node idle, yields a `SlurmCluster`
(the environment a client needs, the partition, the CPUs), and stops every daemon it started by pid on the way out,
after a test's failure too. Nothing is read from or written to /etc/slurm, /etc/munge, /run or /var, and the ports
are free ones picked at start, so it clashes neither with a system SLURM nor with a second cluster beside it.

The client commands (sbatch, squeue, scancel, sacct, scontrol, sinfo) find the cluster through `SLURM_CONF` alone
(and, with accounting="jobcomp", sacct through the PATH below): `cluster.env` holds both (`cluster.apply(monkeypatch)`
sets them in os.environ, which submitit's subprocesses inherit), and a job inherits its submitter's environment
(sbatch's default --export=ALL), so `scontrol requeue` on the node (submitit's requeue after a checkpoint) finds it too.

Job states: submitit asks `sacct` (never squeue) and with no accounting storage sacct only says "Slurm accounting
storage is disabled": a job that returns or raises still gives its result (submitit reads its result pickle) but
`job.state` stays UNKNOWN, and a job cancelled from outside never writes a pickle, so `job.done()` stays False and
`job.result()` waits forever. Two ways to give sacct something to read:

- accounting="jobcomp" (the default, the lightest): the job completion log (jobcomp/filetxt), and a `sacct` first on
  the cluster's PATH that runs the real sacct with `--completion` (read that log). Final states only: COMPLETED,
  FAILED, CANCELLED, TIMEOUT; a pending or running job reads UNKNOWN, which submitit counts as not done. No database,
  no package beyond slurm-wlm and munge; up in about 1.2 s.
- accounting="slurmdbd": the real thing, slurmdbd on a MariaDB server of its own (an empty data folder, its socket
  inside the folder, no networking, no grant tables), so sacct reports PENDING, RUNNING, REQUEUED as on a production
  cluster, and "CANCELLED by <uid>". Needs the slurmdbd and mariadb-server packages; up in about 5 s.

Needs root (slurmd starts each job as its submitter); a missing package is installed with apt-get, as `make browser`
installs Chromium; either failing skips the test with one line saying why.
"""
import contextlib, ctypes, fcntl, os, random, shutil, signal, socket, subprocess, tempfile, time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The commands each accounting mode needs and the Debian packages that bring them. --no-install-recommends: slurm-wlm
# recommends 33 more packages (the HDF5, InfluxDB, IPMI, ROCm... plugins) that a one-node cluster never loads.
_COMMANDS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge"}
_DBD_COMMANDS = {"slurmdbd": "slurmdbd", "mariadbd": "mariadb-server"}
_SBIN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MARKER = "CAPBOOK_SLURM_CLUSTER"    # in every daemon's and job's environment: how stop() finds what they left behind

SLURM_CONF = """\
# Written by tests/slurmcluster.py: a one-node cluster that lives in {root}.
ClusterName={cluster}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
# Root runs everything: slurmd has to be root to start each job as its submitter, and slurmctld/slurmdbd run as root
# so that the state folders need no second user.
SlurmUser=root
SlurmdUser=root
# munge authenticates every message; our own munged, key and socket (AccountingStoragePass is the socket slurmctld
# and the clients use towards slurmdbd: AuthInfo is not used for that connection).
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a job requeued (submitit's checkpoint) may start again only this long after (the default is 120 s).
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
MailProg=/bin/true
# Job ids start at a random number: submitit caches the state of finished job ids for the whole process, so a second
# cluster in one pytest process must not reuse the first one's ids.
FirstJobId={first_job_id}
# No cgroups (a container may not delegate them): processes tracked through their parents, no CPU binding, no
# accounting sampler polling every job.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
# Cores are allocated, memory is only checked against RealMemory (CR_Core, not CR_Core_Memory): a job that asks for
# no memory does not take the whole node's, so two one-CPU jobs run side by side on two cores.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# submitit ignores SIGTERM (it waits for its USR2 to checkpoint), so a cancelled job dies only at the SIGKILL that
# follows KillWait seconds later: it stays COMPLETING 30 s with the default, some 7.5 s with 2.
KillWait={kill_wait}
# A batch job starts at the controller's next one-second tick (0.1 to 1.1 s after sbatch, measured) instead of up to
# batch_sched_delay later (3 s by default: 0.7 to 2.2 s measured).
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
# The node comes back idle after a restart of slurmd rather than staying down.
ReturnToService=2
{accounting}
{node_line}
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""

ACCOUNTING_SLURMDBD = """\
# Accounting through our own slurmdbd (sacct reads it).
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={dbd_port}
AccountingStoragePass={munge_socket}
JobCompType=jobcomp/none"""

ACCOUNTING_JOBCOMP = """\
# No accounting storage: finished jobs are logged to a text file, which `sacct --completion` reads.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt"""

SLURMDBD_CONF = """\
# Written by tests/slurmcluster.py. slurmdbd reads the slurmdbd.conf beside $SLURM_CONF (it has no option for a path).
AuthType=auth/munge
AuthInfo=socket={munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
PidFile={root}/run/slurmdbd.pid
LogFile={root}/log/slurmdbd.log
# Our mariadbd: localhost means its unix socket, which MYSQL_UNIX_PORT in slurmdbd's environment names.
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
"""


@dataclass
class SlurmCluster:
    "What a test needs to use the running cluster; `env` goes into the environment of whatever submits or queries jobs."
    root: Path
    env: dict[str, str]
    partition: str
    node: str
    cpus: int
    memory_mb: int
    accounting: str
    pids: dict[str, int] = field(default_factory=dict)
    up_s: float = 0.0                 # seconds from the first daemon started to the node idle in sinfo

    def apply(self, monkeypatch) -> None:
        "Set `env` in os.environ for the test (submitit runs sbatch, sacct and scancel with the process's environment)."
        for k, v in self.env.items(): monkeypatch.setenv(k, v)

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        "A client command (`cluster.run('squeue', '-h')`) against this cluster; its output as text."
        return subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout, check=check)


def _which(cmd: str) -> str | None:
    return shutil.which(cmd, path=os.environ.get("PATH", "") + ":" + _SBIN)


def ensure_packages(accounting: str = "jobcomp") -> None:
    """Install what is missing with apt-get, as `make browser` installs Chromium (root only here: the cluster needs root
    anyway); skip the test with one line when not root or when apt-get fails. A lock keeps two pytest workers from
    running apt-get at once, and apt-get waits for a dpkg lock someone else holds instead of failing."""
    if os.geteuid() != 0: pytest.skip("a SLURM cluster needs root (slurmd starts each job as its submitter)")
    commands = {**_COMMANDS, **(_DBD_COMMANDS if accounting == "slurmdbd" else {})}
    missing = lambda: sorted({pkg for cmd, pkg in commands.items() if _which(cmd) is None})
    if not missing(): return
    with open("/tmp/capbook-apt.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (packages := missing()): return
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            for argv in (["apt-get", "update", "-qq"],
                         ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", *packages]):
                p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
                if p.returncode:
                    why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
                    pytest.skip(f"cannot install {' '.join(packages)} with apt-get: {why}")
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot install {' '.join(packages)} with apt-get: {e}")
    if missing(): pytest.skip(f"apt-get installed {' '.join(packages)} but {', '.join(missing())} still missing")


def _free_ports(n: int) -> list[int]:
    "n distinct ports that nothing listens on now (the kernel's pick), for slurmctld, slurmd and slurmdbd."
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks: s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks: s.close()


def _node_line() -> tuple[str, str, int, int]:
    """This machine as `slurmd -C` sees it: the NodeName line (sockets, cores, threads, RealMemory), its name, CPUs and
    memory. A NodeName line that claims more than slurmd finds drains the node; RealMemory left out defaults to 1 MB,
    and then any job asking for memory (submitit's mem_gb) is refused."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    line = next(s for s in out.splitlines() if s.startswith("NodeName="))
    fields = dict(kv.split("=", 1) for kv in line.split())
    return f"{line} NodeAddr=127.0.0.1 State=UNKNOWN", fields["NodeName"], int(fields["CPUs"]), int(fields.get("RealMemory", 1))


def _die_with_parent() -> None:
    "In each daemon before exec: SIGKILL it when the test process dies without running `stop` (killed, or os._exit)."
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # 1: PR_SET_PDEATHSIG


class _Daemons:
    "The processes the fixture started, in order: each in a session of its own, its output in log/<name>.out."
    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env, self.procs = root, env, {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.root / "log" / f"{name}.out", "ab") as out:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.root,
                                 env={**self.env, **(env or {})}, start_new_session=True,
                                 preexec_fn=_die_with_parent)
        self.procs[name] = p
        return p

    def wait_for(self, name: str, ready, timeout: float = 60, what: str = "ready") -> None:
        "Poll `ready()` until it is true; fail with the daemon's own words if it exits or the time runs out."
        p, deadline = self.procs[name], time.monotonic() + timeout
        while not ready():
            if p.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "log" / f"{name}.out").read_text(errors="replace").strip().splitlines()[-5:]
                what = f"exited with status {p.returncode}" if p.returncode is not None else f"not {what} after {timeout:.0f} s"
                raise RuntimeError(f"{name} {what}: " + " | ".join(tail))
            time.sleep(0.1)

    def stop(self, grace: float = 5) -> None:
        """SIGTERM each daemon, the last started first, then SIGKILL whichever has not exited after `grace` seconds
        (slurmd ignores SIGTERM while it is still retrying to register with a controller that is gone)."""
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError): p.send_signal(signal.SIGTERM)
                try: p.wait(grace)
                except subprocess.TimeoutExpired:
                    p.kill(); p.wait(grace)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _kill_marked(marker: str, spare: set[int] = frozenset()) -> list[int]:
    """SIGKILL every process whose environment has `CAPBOOK_SLURM_CLUSTER=<marker>` (slurmstepd, job steps, whatever
    they left), except the pids in `spare` and their children; the pids killed. Only this cluster's processes carry
    that value: the daemons got it from the fixture, slurmstepd from slurmd, jobs from the environment of `cluster.env`."""
    key, killed = f"{_MARKER}={marker}".encode(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in (os.getpid(), *spare): continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            if key not in (d / "environ").read_bytes().split(b"\0"): continue
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) in spare: continue   # ppid: slurmscriptd
            os.kill(int(d.name), signal.SIGKILL); killed.append(int(d.name))
    return killed


@contextlib.contextmanager
def one_node_slurm(tmp_path: Path, accounting: str = "jobcomp", partition: str = "debug", kill_wait: int = 2,
                   cred_expire: int = 10, timeout: float = 60):
    """A running one-node SLURM cluster under `tmp_path` for the block (see the module's docstring); yields a
    `SlurmCluster`. `accounting`: "slurmdbd" (sacct reads slurmdbd) or "jobcomp" (sacct reads the completion log).
    `kill_wait`: seconds between a cancelled job's SIGTERM and its SIGKILL. `cred_expire`: seconds before a requeued
    job may start again. On the way out: cancels what is still queued, kills the jobs' processes (found by the marker
    in their environment), stops the daemons by pid."""
    assert accounting in ("slurmdbd", "jobcomp"), accounting
    ensure_packages(accounting)
    # Unix socket paths (munged's, mariadbd's) must stay under 108 bytes: a long pytest folder gets a short one beside.
    root = Path(tmp_path) / "slurm" if len(str(tmp_path)) <= 60 else Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    for d in ("state", "spool", "log", "run", "bin", "munge", "db"): (root / d).mkdir(parents=True, exist_ok=True)
    for d in ("munge", "db"): (root / d).chmod(0o700)             # the key and the database's socket: root's alone
    node_line, node, cpus, memory_mb = _node_line()
    ctld_port, slurmd_port, dbd_port = _free_ports(3)
    munge_socket = root / "run" / "munge.socket"
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(128)); key.chmod(0o400)            # munged refuses a key others can read
    (root / "plugstack.conf").write_text("")                      # no SPANK plugins from /etc/slurm/plugstack.conf.d
    fmt = dict(root=root, munge_socket=munge_socket, dbd_port=dbd_port)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(
        **fmt, cluster=f"capbook{ctld_port}", node=node, ctld_port=ctld_port, slurmd_port=slurmd_port, partition=partition,
        cred_expire=cred_expire, kill_wait=kill_wait, first_job_id=random.randrange(1000, 60_000_000), node_line=node_line,
        accounting=(ACCOUNTING_SLURMDBD if accounting == "slurmdbd" else ACCOUNTING_JOBCOMP).format(**fmt)))
    env = {"SLURM_CONF": str(conf), _MARKER: str(root)}
    if accounting == "jobcomp":
        (root / "bin" / "sacct").write_text(f'#!/bin/sh\nexec {_which("sacct")} --completion "$@"\n')
        (root / "bin" / "sacct").chmod(0o755)
        env["PATH"] = f"{root / 'bin'}:{os.environ.get('PATH', _SBIN)}"
    daemons = _Daemons(root, {**os.environ, **env, "PATH": os.environ.get("PATH", "") + ":" + _SBIN})
    cluster = SlurmCluster(root, env, partition, node, cpus, memory_mb, accounting)
    t0 = time.monotonic()
    try:
        # --force: munged refuses a socket in a folder not everyone may enter, and pytest's are root's alone (0700).
        daemons.start("munged", [_which("munged"), "--foreground", "--force", f"--socket={munge_socket}", f"--key-file={key}",
                                 f"--pid-file={root}/run/munged.pid", f"--seed-file={root}/munge/munged.seed"])
        daemons.wait_for("munged", munge_socket.exists, timeout)
        if accounting == "slurmdbd":
            dbd_conf = root / "slurmdbd.conf"
            dbd_conf.write_text(SLURMDBD_CONF.format(**fmt)); dbd_conf.chmod(0o600)   # slurmdbd refuses it otherwise
            db_socket = root / "db" / "mysqld.sock"
            # An empty data folder and no grant tables: no mariadb-install-db (4 s); only root reaches the socket
            # (db/ is 0700) and there is no network. The small InnoDB sizes and lazy flushes suit a throwaway database.
            (root / "db" / "data").mkdir(exist_ok=True)
            daemons.start("mariadbd", [_which("mariadbd"), "--no-defaults", f"--datadir={root}/db/data", "--user=root",
                                       "--skip-grant-tables", "--skip-networking", f"--socket={db_socket}",
                                       f"--pid-file={root}/run/mariadbd.pid", "--skip-log-bin", "--innodb-buffer-pool-size=16M",
                                       "--innodb-log-file-size=4M", "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0"])
            daemons.wait_for("mariadbd", db_socket.exists, timeout)
            daemons.start("slurmdbd", [_which("slurmdbd"), "-D"], env={"MYSQL_UNIX_PORT": str(db_socket)})
            daemons.wait_for("slurmdbd", lambda: _listening(dbd_port), timeout)
        daemons.start("slurmctld", [_which("slurmctld"), "-D", "-i"])   # -i: ignore state files (there are none)
        daemons.start("slurmd", [_which("slurmd"), "-D", "-N", node])

        def idle() -> bool:
            try: return cluster.run("sinfo", "-h", "-N", "-o", "%t", timeout=10, check=False).stdout.strip() == "idle"
            except subprocess.TimeoutExpired: return False
        daemons.wait_for("slurmctld", idle, timeout, what=f"showing node {node} idle")
        cluster.up_s = time.monotonic() - t0
        cluster.pids = {name: p.pid for name, p in daemons.procs.items()}
        yield cluster
    finally:
        # Cancel what is left (its final state reaches sacct), kill the jobs' processes at once instead of waiting for
        # them: a cancelled submitit job ignores SIGTERM and stays COMPLETING for KillWait and then some 5 s more, and
        # slurmd, sent SIGTERM meanwhile, takes some 4 s to exit. Then the daemons by pid, then anything left over.
        if "slurmctld" in daemons.procs and daemons.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                if jobs := cluster.run("squeue", "-h", "-o", "%A", timeout=10, check=False).stdout.split():
                    cluster.run("scancel", *jobs, timeout=10, check=False)
        _kill_marked(str(root), spare={p.pid for p in daemons.procs.values()})
        daemons.stop()
        _kill_marked(str(root))
        if root.parent != Path(tmp_path):          # the short folder beside: its logs kept in tmp_path, the rest removed
            with contextlib.suppress(OSError): shutil.copytree(root / "log", Path(tmp_path) / "slurm-log", dirs_exist_ok=True)
            shutil.rmtree(root, ignore_errors=True)
