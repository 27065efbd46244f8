"The COCO-scale rehearsal at a small scale: every stage of the real-data path in its own process, measured."
import json, subprocess, sys
from pathlib import Path
import pytest
from capbook.rehearsal import coco_counts, project_encoders, rehearsal_table

BIN = Path(sys.executable).parent


def _rehearse_and_check(root: Path, scale: float) -> None:
    "Every stage of the real-data path at `scale` × COCO, each in its own process, and what each must have measured."
    p = subprocess.run([str(BIN / "capbook"), "rehearse", "--scale", repr(scale), "--root", str(root),
                        "--stages", "generate", "read", "extract", "open", "train", "evaluate"],
                       capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((root / "rehearsal.json").read_text())
    st, counts = res["stages"], coco_counts(scale)
    n = sum(counts.values())
    assert st["generate"]["images"] == st["read"]["images"] == n
    assert st["read"]["captions"] == 5 * n and st["read"]["vocabulary"] > 4
    assert st["extract"]["memory_mapped"] and st["open"]["memory_mapped"]          # no split read into memory whole
    assert st["extract"]["store_bytes"] == n * 16 * 576 * 2 + 3 * 128                # float16 rows (+ three .npy headers)
    assert st["train"]["captions"] == 5 * (counts["train"] + counts["restval"])     # one epoch, every caption
    assert st["evaluate"]["images"] == counts["test"] and "CIDEr" in st["evaluate"]["metrics"]
    assert all(s["maxrss_bytes"] > 0 and s["peak_anon_bytes"] > 0 and s["seconds"] > 0 for s in st.values())
    assert "| train |" in p.stdout and "| evaluate |" in p.stdout
    assert (root / "run" / "ckpt" / "tb").is_dir()                                  # its training curves, like any run


@pytest.mark.slow
def test_rehearsal_runs_every_stage_at_small_scale(tmp_path):
    assert sum(coco_counts(0.001).values()) == 124        # a thousandth of COCO: five images in each of val and test
    _rehearse_and_check(tmp_path, 0.001)


@pytest.mark.soak                                   # `make soak`: 2,466 images, twenty times the scale above
def test_soak_rehearsal_at_a_larger_scale(tmp_path):
    _rehearse_and_check(tmp_path, 0.02)


def test_encoder_projection_and_table():
    got = project_encoders(["mobilenet_v3_small"], batch=2, log=lambda s: None)["mobilenet_v3_small"]
    assert got["map"] == [4, 4, 576] and got["coco_store_bytes"] == 123_287 * 16 * 576 * 2 and got["images_per_s"] > 0
    stage = {"seconds": 3.0, "maxrss_bytes": 2**30, "peak_anon_bytes": 2**29, "mobilenet_v3_small": got}   # as the stage reports it
    table = rehearsal_table({"scale": 1.0, "stages": {"project": stage}})
    assert "| project | 0.1 min | 1.07 GB | 0.54 GB | 1 encoders |" in table
    assert "| mobilenet_v3_small | 112 px | 4 × 4 × 576 |" in table and "2.27 GB" in table


def test_the_sites_table_is_the_measured_one():
    "The rehearsal page's table (`nbs/00s_rehearsal`) is rehearsal_table of the measurements kept in figures/, not typed in."
    from conftest import notebook_markdown
    root = Path(__file__).resolve().parent.parent
    res = json.loads((root / "figures" / "rehearsal_coco.json").read_text())
    assert res["scale"] == 1.0 and res["stages"]["read"]["images"] == 123_287       # the full scale ran
    block = notebook_markdown("00s_rehearsal").split("<!-- rehearsal -->\n", 1)[1].split("\n<!-- /rehearsal -->", 1)[0]
    assert block == rehearsal_table(res) == (root / "figures" / "table_rehearsal.md").read_text().rstrip("\n")
