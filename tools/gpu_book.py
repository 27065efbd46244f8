"""The GPU book's prepared run, for a machine lent with a GPU for a few minutes (`make gpu-book`; its own python3 and
torch, no venv, no Java, perhaps no Jupyter):

1. the families' training and decoding throughput (`capbook bench --device cuda --capture`), as `make gpu-check`;
2. the default book's chapter runs, bare (`capbook book --device cuda --bare`: no papermill, no kernel), a row's seeds
   stacked, for as long as BOOK_S seconds allow; SIGTERM then ends it as Ctrl-C does, keeping what finished;
3. into $OUT: gpu_book.json (the throughput, the book's wall time, the share of its chapter runs' CPU minutes done and
   the whole book's projected wall time) and gpu_book-N.tar.gz (the finished runs' records with their test captions and
   the manifest, `capbook.book.publish_bare`), which a machine with Java and Jupyter takes back with
   `capbook book --device cuda --received gpu_book-*.tar.gz`: METEOR scored there, the tables chapters run on the
   records, and the device book's verdicts set beside the CPU book's (`table_device_verdicts`).

Environment: DEVICE (cuda), PROFILE (default), JOBS (8), BENCH_S (150), BOOK_S (240), OUT (runs/gpu-book): about 7 minutes
in all, so that a 15-minute lease, its start included, leaves time to run it again.
`DEVICE=cpu PROFILE=smoke BENCH_S=0 BOOK_S=120` tries the whole path on a CPU."""
import csv, json, os, signal, subprocess, sys, tarfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CAPBOOK = [sys.executable, "-c", "import sys; from capbook.cli import main; sys.exit(main())"]
PART = 15 * 2 ** 20          # a file that comes back from the GPU machine: at most 16 MiB


def env(name: str, default: str) -> str: return os.environ.get(name) or default


def run(argv: list[str], seconds: float, log: Path) -> dict:
    "Run `argv` for at most `seconds` (then SIGTERM, and SIGKILL 30 s later), its output into `log`; its exit status and wall time."
    t0 = time.time()
    with open(log, "w") as fh:
        p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
                                                                                 "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try: rc = p.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try: rc = p.wait(timeout=30)
            except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL); rc = p.wait()
    return {"command": " ".join(argv[3:]), "exit": rc, "wall_s": round(time.time() - t0, 1), "timed_out": time.time() - t0 >= seconds}


def last_json(log: Path) -> dict | None:
    "The JSON object on the last line of `log` that holds one (the bench's result)."
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try: return json.loads(line)
            except ValueError: continue
    return None


def finished(runs: Path) -> set[str]:
    "The runs in `runs` that finished (their done.json)."
    return {d.name for d in runs.glob("*") if (d / "done.json").exists()}

def share_done(runs: Path, steps: list[str], profile: str, before: set[str]) -> dict:
    "The chapter runs of the device book's plan (`steps`) that finished in `runs` during this book (not in `before`), and their share of the whole: of the CPU book's minutes for those steps (`figures/table_book_times.csv`, the default profile's), else of their number."
    minutes = {r["step"]: float(r["minutes"]) for r in csv.DictReader(open(ROOT / "figures" / "table_book_times.csv"))} if profile == "default" else {}
    done = sorted(set(steps) & (finished(runs) - before))
    weight = (lambda s: minutes.get(s, 0.0)) if minutes else (lambda s: 1.0)
    whole, part = sum(map(weight, steps)), sum(map(weight, done))
    return {"steps_done": len(done), "chapter_steps": len(steps), "done_before": len(before & set(steps)), "done": done,
            "share_of": "the CPU book's minutes" if minutes else "the steps", "share": round(part / whole, 4) if whole else None}


def pack(published: Path, out: Path) -> list[str]:
    "The bare book's published folder (its runs' records and manifest: `capbook.book.publish_bare`), in tar.gz parts of at most `PART` bytes (a part closes before the file that would overflow it)."
    files = sorted(f for f in published.rglob("*") if f.is_file())
    parts, n, size, tar = [], 0, 0, None
    for f in files:
        if tar is None or size + f.stat().st_size > PART:
            if tar: tar.close()
            n += 1; parts.append(f"gpu_book-{n}.tar.gz"); tar = tarfile.open(out / parts[-1], "w:gz"); size = 0
        tar.add(f, arcname=str(f.relative_to(published))); size += f.stat().st_size
    if tar: tar.close()
    return parts


def main() -> int:
    device, profile, jobs = env("DEVICE", "cuda"), env("PROFILE", "default"), env("JOBS", "8")
    bench_s, book_s = float(env("BENCH_S", "150")), float(env("BOOK_S", "240"))
    out = Path(env("OUT", str(ROOT / "runs" / "gpu-book"))); out.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "profile": profile, "jobs": int(jobs), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if bench_s > 0:
        report["bench"] = run([*CAPBOOK, "bench", "--profile", profile, "--device", device, "--capture", "--stacked", "1", "4", "32",
                               "--batches", "8"], bench_s, out / "bench.log")
        report["bench"]["result"] = last_json(out / "bench.log")
    sys.path.insert(0, str(ROOT))
    from capbook.book import device_book, publish_bare
    from capbook.core import runs_dir
    from capbook.plan import plan
    from capbook.profiles import chapters
    with device_book(device): runs = runs_dir() / profile
    before = finished(runs)                       # a book resumed: what it finds done is not its time's
    report["book"] = run([*CAPBOOK, "book", "--profile", profile, "--device", device, "--bare", "-j", jobs], book_s, out / "book.log")
    with device_book(device):                     # the device book's own plan and home
        steps = [s for s in plan(profile) if s.notebook in chapters()]
        published = publish_bare(profile, steps)  # (a book its time cut short published nothing)
    report["book"] |= share_done(runs, [s.name for s in steps], profile, before)
    s = report["book"]["share"]
    report["book"]["projected_wall_s"] = round(report["book"]["wall_s"] / s, 1) if s else None
    report["parts"] = pack(published, out)
    (out / "gpu_book.json").write_text(json.dumps(report, indent=1))
    b = report["book"]
    print(f"gpu book on {device}: {b['steps_done']} of {b['chapter_steps']} chapter runs in {b['wall_s']:.0f} s "
          f"({100 * (s or 0):.1f} % of {b['share_of']}); projected whole: "
          + (f"{b['projected_wall_s'] / 60:.1f} min" if b["projected_wall_s"] else "—") + f"; {out / 'gpu_book.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
