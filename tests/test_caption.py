"`capbook caption`: a real photograph captioned with a trained run, its attention drawn by the book's plotting code, and every model or file it cannot honestly caption refused in one line."
import json, shutil, subprocess, sys
from pathlib import Path
import matplotlib
import pytest
import torch
from capbook.caption import caption_photos, encode_photos, find_run, image_encoder, load_captioner
from capbook.core import CapbookError

BIN = Path(sys.executable).parent
PHOTO = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"     # a photograph shipped with matplotlib
pytestmark = pytest.mark.xdist_group("caption")     # one worker trains the module's run


@pytest.fixture(scope="module")
def run(smoke, tmp_path_factory):
    "A soft-attention model trained for one epoch at the smoke profile, in a run folder of its own."
    from capbook.runner import run_chapter
    from capbook.sat import SATParams
    d = tmp_path_factory.mktemp("caption") / "sat"
    run_chapter("02_show_attend_tell", SATParams(profile="smoke", epochs=1, run_dir=str(d)), log=lambda s: None)
    return d


def test_encoder_rebuilt_for_captioning_gives_the_stored_features(smoke):
    net = image_encoder(smoke, {"profile": "smoke", "seed": 0})
    paths = [r.path for r in smoke.kdata.split("test")[:4]]
    got = encode_photos(paths, net, smoke.image_size)
    assert got.shape == (4, *smoke.feat_shape)
    assert torch.allclose(got, torch.tensor(smoke.test.feats[:4], dtype=torch.float32), atol=1e-2)


@pytest.mark.slow
def test_caption_a_photograph_and_draw_its_attention(run, tmp_path):
    p = subprocess.run([str(BIN / "capbook"), "caption", str(PHOTO), "--run-dir", str(run), "--attention",
                        str(tmp_path / "att.png"), "--beam", "2", "--json", str(tmp_path / "res.json")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    line = p.stdout.splitlines()[0]
    assert json.loads((tmp_path / "res.json").read_text()) == [{"image_id": PHOTO.name, "caption": line[len(str(PHOTO)) + 2:]}]
    assert line.startswith(f"{PHOTO}: ") and len(line) > len(str(PHOTO)) + 3
    model, prep, _ = load_captioner(run, "cpu")
    words = line[len(str(PHOTO)) + 2:].split()
    assert all(w in prep.vocab.stoi for w in words)                       # the model's own vocabulary
    assert (tmp_path / "att.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "att.png").stat().st_size > 20_000
    caps = caption_photos([PHOTO, PHOTO], run, beam_size=2, device="cpu")
    assert caps[0]["caption"] == caps[1]["caption"] == " ".join(words)
    assert caps[0]["alpha"].shape == (len(words), prep.feat_shape[0])
    assert torch.allclose(caps[0]["alpha"].sum(1), torch.ones(len(words)), atol=1e-4)


def test_a_missing_run_names_the_smallest_book_that_trains_it(tmp_path, monkeypatch, capsys):
    "On a fresh clone `capbook caption` has no trained run: two short lines, what is missing and the command to run first — the book that trains the default run alone (that step, not the chapter's every run), with the minutes the published book's run took; a name that is no step says so."
    from capbook.book import select_steps
    from capbook.cli import CAPTION_MODEL, main
    from capbook.plan import plan
    monkeypatch.setenv("CAPBOOK_HOME", str(tmp_path))
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "table_book_times.csv").write_text(f"step,minutes\n{CAPTION_MODEL},4.1\n")
    with pytest.raises(CapbookError) as e: find_run(CAPTION_MODEL)
    assert "not trained here" in str(e.value) and "\n" not in str(e.value)
    cmd = e.value.then.split("#")[0].strip()
    assert cmd == f"capbook book --only ={CAPTION_MODEL} --force --no-docs"       # forced: a clone's published record has no weights
    assert "about 4 min" in e.value.then
    assert [s.name for s in select_steps(plan("default"), [cmd.split()[3]])] == [CAPTION_MODEL]     # exactly the run it captions with
    assert main(["caption", str(tmp_path / "photo.jpg")]) == 2                 # as the user reads it
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("run first: ") and all(len(x) <= 100 for x in lines), lines
    with pytest.raises(CapbookError, match="02_no_such_run is no step of the default book") as e: find_run("02_no_such_run")
    assert e.value.then is None


@pytest.mark.slow
def test_refusals_are_one_line(run, tmp_path, home):
    bad = tmp_path / "not_an_image.jpg"; bad.write_text("hello")
    with pytest.raises(CapbookError, match="not_an_image.jpg: cannot read image") as e: caption_photos([bad], run)
    assert "\n" not in str(e.value)
    with pytest.raises(CapbookError, match="02_no_such_run is no step of the smoke book"): find_run("02_no_such_run", None, "smoke")
    other = tmp_path / "other"; shutil.copytree(run, other)              # a run whose data this machine cannot rebuild
    rec = json.loads((other / "record.json").read_text()); rec["data"]["fingerprint"] = "0123456789abcdef"
    (other / "record.json").write_text(json.dumps(rec))
    with pytest.raises(CapbookError, match="encoder or vocabulary cannot be rebuilt here"): caption_photos([PHOTO], other)
    rec["params"]["regions"] = "/data/bottom-up"; (other / "record.json").write_text(json.dumps(rec))
    with pytest.raises(CapbookError, match="precomputed region features"): caption_photos([PHOTO], other)
    p = subprocess.run([str(BIN / "capbook"), "caption", str(PHOTO), "--run-dir", str(tmp_path / "nowhere")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no trained run here" in p.stderr


@pytest.mark.slow
def test_a_run_writes_coco_results_that_capbook_score_scores_as_the_run_did(run, smoke, tmp_path):
    from capbook.metrics import score_results
    res = json.loads((run / "captions_test.json").read_text())
    assert [r["image_id"] for r in res] == smoke.image_ids("test") and all(r["caption"].strip() for r in res)
    rec = json.loads((run / "record.json").read_text())["metrics"]
    refs = smoke.kdata.json_path
    got = score_results(run / "captions_test.json", refs, "test")
    assert got["images"] == smoke.test.n_images
    for k in ("BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr", "METEOR"):               # the run's own evaluation, exactly
        assert got["metrics"][k] == pytest.approx(rec[k], abs=1e-9), k
    p = subprocess.run([str(BIN / "capbook"), "score", str(run / "captions_test.json"), "--references", str(refs),
                        "--split", "test"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    printed = dict(line.split() for line in p.stdout.splitlines()[1:] if len(line.split()) == 2)
    assert float(printed["CIDEr"]) == pytest.approx(rec["CIDEr"], abs=1e-4)
    dup = tmp_path / "dup.json"; dup.write_text(json.dumps(res + res[:1]))   # a peer's file with a repeated image
    p = subprocess.run([str(BIN / "capbook"), "score", str(dup), "--references", str(refs)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1
    assert f"item {len(res)} repeats image_id {res[0]['image_id']!r} (first at item 0)" in p.stderr
