"The notebooks are the source: capbook/ is what nbdev_export makes of them, pairs are in sync, sources are clean."
import json, shutil, subprocess, sys
from pathlib import Path
import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS = sorted((ROOT / "nbs").glob("*.ipynb"))
BIN = Path(sys.executable).parent


def test_export_changes_nothing(tmp_path):
    shutil.copytree(ROOT / "nbs", tmp_path / "nbs")
    shutil.copy(ROOT / "settings.ini", tmp_path)
    subprocess.run([str(BIN / "nbdev_export")], cwd=tmp_path, check=True, capture_output=True)
    ours = {p.relative_to(ROOT / "capbook"): p.read_text() for p in (ROOT / "capbook").rglob("*.py")}
    fresh = {p.relative_to(tmp_path / "capbook"): p.read_text() for p in (tmp_path / "capbook").rglob("*.py")}
    assert sorted(ours) == sorted(fresh), "capbook/ has files nbdev_export does not make (or lacks some): run make sync"
    stale = [str(k) for k in ours if ours[k] != fresh[k]]
    assert not stale, f"capbook/ differs from nbdev_export of nbs/ in {stale}: run make sync"


@pytest.mark.parametrize("nb", NBS, ids=lambda p: p.name)
def test_pair_in_sync_and_clean(nb):
    py = nb.with_suffix(".py")
    assert py.exists(), f"{nb.name} has no py:percent twin"
    a, b = jupytext.read(nb), jupytext.read(py)
    cells = lambda n: [(c.cell_type, c.source.strip()) for c in n.cells]
    assert cells(a) == cells(b), f"{nb.name} and {py.name} differ: run make sync"
    raw = json.loads(nb.read_text())
    for c in raw["cells"]:
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None, f"{nb.name}: stored outputs (run nbdev_clean)"
        assert "injected-parameters" not in c.get("metadata", {}).get("tags", [])


def test_runnable_notebooks_have_one_parameters_cell():
    for name in ["01_dataset", "02_show_attend_tell", "02a_soft_vs_hard"]:
        raw = json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())
        tagged = [c for c in raw["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, name
