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
# # metrics
#
# > One evaluator for every model: the COCO caption metrics through pycocoevalcap, exact semantic scores on shapes, and attention correctness.

# %%
#| default_exp metrics

# %%
#| export
from __future__ import annotations
import atexit, contextlib, hashlib, io, shutil, threading, time
from pathlib import Path
import numpy as np
import torch
import torch.nn.functional as F
from capbook.core import CapbookError, atomic_write, check_choice, load_json, save_json, stable_hash
from capbook.data import to_device
from capbook.decode import decode_split, teacher_forced, pad_captions, Caption


# %% [markdown]
# ## Caption metrics (pycocoevalcap)
#
# BLEU-1..4, METEOR, ROUGE-L and CIDEr(-D) are computed with the COCO caption evaluation code the papers used
# (`pycocoevalcap`), after its PTB tokenizer. Both the tokenizer and METEOR run on Java: without Java the tokenizer
# falls back to lower-casing and splitting on spaces, and METEOR is reported unavailable with the reason. SPICE needs
# Stanford CoreNLP 3.6.0's jars, which pycocoevalcap downloads on first use; they cannot be downloaded on machines with
# no internet, so SPICE is reported unavailable unless the jars are already in `pycocoevalcap/spice/lib`.
# Scores are fractions in [0, 1]; tables show them ×100 as the papers do.
#
# Java's start is most of what scoring costs: METEOR's process loads its paraphrase tables for about 7 s before it
# scores 250 captions in under one. So the tokenizer runs once for references and candidates together (it works line by
# line: the same tokens as two calls), a run's second scoring of the same captions reuses the first's tokens, and
# a process keeps its METEOR process for its next scoring, and `capbook book` serves its own to all the book's runs
# (`meteor_service`, over a private Unix socket); a run outside a book, or one whose service has gone, starts its own.
# A service opened inside another's reach passes its requests on (the test suite serves one METEOR process to all its
# books, key computations and runs, instead of a Java start, about 10 s of CPU, for each).
# Every score is the same either way (tested). A METEOR process that dies (killed, out of memory) is replaced at the
# next call, the run in hand scoring through its own; where Java is present and METEOR still cannot score, the run stops
# in one line rather than write a record and tables silently without METEOR (`tests/test_book.py` kills the book's).

# %%
#| export
def spice_jars() -> tuple[bool, str]:
    "Whether SPICE's Stanford CoreNLP 3.6.0 jars are installed, and where they are expected."
    from pycocoevalcap.spice import spice
    lib = Path(spice.__file__).parent / "lib"
    need = [lib / "stanford-corenlp-3.6.0.jar", lib / "stanford-corenlp-3.6.0-models.jar"]
    return all(p.exists() for p in need), str(lib)

@contextlib.contextmanager
def _quiet_fd2():
    "Send file descriptor 2 (where child processes such as Java write) to a temporary file for the block; on an error, show what was written."
    import os, sys, tempfile
    with tempfile.TemporaryFile() as f:
        sys.stderr.flush(); saved = os.dup(2); os.dup2(f.fileno(), 2)
        try: yield
        except BaseException:
            os.dup2(saved, 2); f.seek(0); sys.stderr.write(f.read().decode(errors="replace")); raise
        finally: os.dup2(saved, 2); os.close(saved)

_TOKENIZED: dict = {}

def tokenized(gts: dict, res: dict) -> tuple[dict, dict, dict]:
    "References {id: [str]} and candidates {id: str} as pycocoevalcap scores them ({id: [tokenized str]}, PTB tokenizer on Java), and notes."
    if shutil.which("java") is None:
        return ({k: [" ".join(c.lower().split()) for c in v] for k, v in gts.items()},
                {k: [" ".join(c.lower().split())] for k, c in res.items()},
                {"tokenizer": "Java not found: PTB tokenizer replaced by lower-case whitespace splitting"})
    key = stable_hash([sorted((str(k), v) for k, v in gts.items()), sorted((str(k), c) for k, c in res.items())], 32)
    if key not in _TOKENIZED:                     # a run scores the same captions twice (metrics, then per-image statistics)
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
        both = {("ref", k): [{"caption": c} for c in v] for k, v in gts.items()} | {("cand", k): [{"caption": c}] for k, c in res.items()}
        with _quiet_fd2():                        # one Java start for both (it tokenizes line by line); quiet: its "tokens per second" line
            out = PTBTokenizer().tokenize(both)
        _TOKENIZED.clear()
        _TOKENIZED[key] = ({k: out[("ref", k)] for k in gts}, {k: out[("cand", k)] for k in res})
    g, r = _TOKENIZED[key]
    return {k: list(v) for k, v in g.items()}, {k: list(v) for k, v in r.items()}, {}

METEOR_ENV = "CAPBOOK_METEOR"                    # "socket path|authkey" of the METEOR service a book's runs share

def _meteor_end(m) -> None:
    "End a pycocoevalcap `Meteor`'s Java process now. A failed `compute_score` leaves its lock held, on which its `__del__` would wait forever."
    with contextlib.suppress(Exception): m.meteor_p.kill(); m.meteor_p.wait()
    if m.lock.locked(): m.lock.release()

_METEOR: dict = {"process": None, "pid": None, "lock": threading.Lock()}

def _meteor_here(gts: dict, res: dict) -> float:
    "METEOR through this process's own Java process, started at the first call (its paraphrase tables take seconds to load) and kept for the next."
    import os
    from pycocoevalcap.meteor.meteor import Meteor
    with _METEOR["lock"]:
        if _METEOR["pid"] != os.getpid():         # none yet, or a forked child's copy of its parent's: start one
            _METEOR.update(process=(m := Meteor()), pid=os.getpid())
            drain = lambda f: all(True for _ in f)        # a kept process must not stall on a full stderr pipe
            threading.Thread(target=drain, args=(m.meteor_p.stderr,), daemon=True).start()
        try: return float(_METEOR["process"].compute_score(gts, res)[0])
        except BaseException: _meteor_close(locked=True); raise        # a fresh process for the next call

def _meteor_close(locked: bool = False) -> None:
    import os
    with contextlib.nullcontext() if locked else _METEOR["lock"]:
        if _METEOR["pid"] == os.getpid(): _meteor_end(_METEOR["process"])
        _METEOR.update(process=None, pid=None)

atexit.register(_meteor_close)

def _meteor_at(addr: str | None, gts: dict, res: dict) -> float:
    "METEOR through the service at `addr` ('socket path|authkey', `meteor_service`), else, where none serves (no address, the service gone, or its scoring failed), through this process's own (`_meteor_here`)."
    from multiprocessing.connection import Client
    if addr:
        path, key = addr.rsplit("|", 1)
        try:
            with Client(path, family="AF_UNIX", authkey=bytes.fromhex(key)) as c:
                c.send((gts, res)); ok, v = c.recv()
            if ok: return v
        except (OSError, EOFError): pass          # the service is gone: score here
    return _meteor_here(gts, res)

def meteor_score(gts: dict, res: dict) -> float:
    "METEOR 1.5 of tokenized candidates {id: [str]} against references {id: [str]}: through the book's shared METEOR process when one serves (`meteor_service`), else through a Java process of its own. The same score either way."
    import os
    return _meteor_at(os.environ.get(METEOR_ENV), gts, res)

@contextlib.contextmanager
def meteor_service():
    "Serve one METEOR process to every run started inside the block (children inherit `$CAPBOOK_METEOR`), so its tables load once per book instead of once per run. A service opened where one already serves (a book started by a process that has one: the test suite's) passes its requests on to that one, and scores itself only if it has gone. Yields the service's counters."
    import os, secrets, tempfile
    from multiprocessing.connection import Client, Listener
    d = tempfile.mkdtemp(prefix="capbook-meteor-")      # private (0700): only this user reaches the socket
    key, state, outer = secrets.token_bytes(16), {"served": 0}, os.environ.get(METEOR_ENV)
    listener = Listener(os.path.join(d, "meteor.sock"), family="AF_UNIX", authkey=key)

    def serve(conn):
        with conn:
            try:
                gts, res = conn.recv()
                try: reply = (True, _meteor_at(outer, gts, res)); state["served"] += 1
                except Exception as e: reply = (False, f"{e.__class__.__name__}: {e}")   # the run then tries its own
                conn.send(reply)
            except (OSError, EOFError): pass

    def accept():
        while True:
            try: conn = listener.accept()
            except OSError: return
            except Exception: continue            # a client that failed the handshake
            if state.get("closing"): conn.close(); return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    os.environ[METEOR_ENV] = f"{listener.address}|{key.hex()}"
    try: yield state
    finally:
        if outer is None: os.environ.pop(METEOR_ENV, None)
        else: os.environ[METEOR_ENV] = outer
        state["closing"] = True                   # wake the accepting thread (closing a socket does not), then close
        with contextlib.suppress(Exception): Client(listener.address, family="AF_UNIX", authkey=key).close()
        listener.close()
        shutil.rmtree(d, ignore_errors=True)

def coco_scores(gts: dict, res: dict, meteor: bool = True, spice: bool = True) -> tuple[dict, dict]:
    "Score candidate captions `res` {id: str} against references `gts` {id: [str]}: (scores, notes on what was unavailable)."
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.cider.cider import Cider
    java = shutil.which("java") is not None
    gts, res, notes = tokenized(gts, res)
    out = {}
    with contextlib.redirect_stdout(io.StringIO()):
        b, _ = Bleu(4).compute_score(gts, res, verbose=0)
    out.update({f"BLEU-{i+1}": float(v) for i, v in enumerate(b)})
    if meteor and not java: notes["METEOR"] = "unavailable: Java not found (METEOR 1.5 runs on Java)"
    elif meteor:
        try: out["METEOR"] = meteor_score(gts, res)   # a dead shared process: its own; a failure of that too stops
        except Exception as e:                        # Java is here, so a table without METEOR would be a silent gap
            raise CapbookError(f"METEOR failed while scoring ({e.__class__.__name__}: {(str(e).splitlines() or [''])[0]}); "
                               f"nothing is scored without it: run again (training is kept)") from None
    out["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    out["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    if spice:
        ok, lib = spice_jars()
        if not ok: notes["SPICE"] = f"unavailable: Stanford CoreNLP 3.6.0 jars not in {lib} (the book does not download them)"
        elif not java: notes["SPICE"] = "unavailable: Java not found"
        else:
            from pycocoevalcap.spice.spice import Spice
            out["SPICE"] = float(Spice().compute_score(gts, res)[0])
    return out, notes


# %% [markdown]
# The service is an environment variable for the block's children, restored after it (no Java starts until a run
# scores; inside `capbook book` this notebook runs under the book's own service):

# %%
import os
_before = os.environ.get(METEOR_ENV)
with meteor_service() as _svc:
    assert os.environ[METEOR_ENV] != _before and os.environ[METEOR_ENV].count("|") == 1 and _svc["served"] == 0
assert os.environ.get(METEOR_ENV) == _before


# %% [markdown]
# ## Attention correctness (shapes)
#
# On shapes every object's box is known, so capbook can ask what Show-Attend-Tell could only show: when the model emits
# a word that names an object, does it look at that object? For each generated noun phrase that names a shape (found
# by the shapes parser, `capbook.shapes.object_mentions`) and matches objects of the image, we take the attention
# weights $\alpha_t$ of the step that emitted its head noun and report
#
# - **mass**: $\sum_i \alpha_{ti}\, \mathrm{frac}_i$, the attention inside the matching objects' boxes, where
#   $\mathrm{frac}_i$ is the fraction of grid cell $i$ covered by a box (uniform attention scores the boxes' area
#   fraction, reported as `mass_uniform` for scale);
# - **hit**: whether the cell with the largest weight has its centre inside a matching box.

# %%
#| export
def box_fractions(boxes: list, grid: tuple[int, int], image_size: int) -> torch.Tensor:
    "Fraction of each grid cell (h*w,) covered by the union of `boxes` [x0, y0, x1, y1] of inclusive pixel coordinates."
    m = torch.zeros(1, 1, image_size, image_size)
    for x0, y0, x1, y1 in boxes: m[..., int(y0):int(y1) + 1, int(x0):int(x1) + 1] = 1   # pixel x1 is inside the box
    return F.adaptive_avg_pool2d(m, grid).flatten()

def attention_correctness(captions: list[Caption], keys: list[str], gt: dict, vocab, grid: tuple[int, int],
                          image_size: int) -> dict:
    "Mean attention mass inside, and peak-hit rate on, the objects named by each generated object word."
    from capbook.shapes import object_mentions
    mass, hit, unif = [], [], []
    for cap, key in zip(captions, keys):
        if cap.alpha is None: continue
        words, objs = vocab.decode(cap.tokens), gt["images"][key]["objects"]
        for t, idx in object_mentions(words, gt["images"][key]):
            if not idx or t >= len(cap.alpha): continue
            boxes = [objs[i]["box"] for i in idx]
            frac, a = box_fractions(boxes, grid, image_size), cap.alpha[t].float()
            mass.append(float((a * frac).sum())); unif.append(float(frac.mean()))
            hit.append(_peak_in(a.argmax().item(), grid, image_size, boxes))
    n = len(mass)
    return {"mass": float(np.mean(mass)) if n else float("nan"), "hit": float(np.mean(hit)) if n else float("nan"),
            "mass_uniform": float(np.mean(unif)) if n else float("nan"), "n": n}

def _peak_in(cell: int, grid, image_size, boxes) -> float:
    h, w = grid
    cy, cx = (cell // w + 0.5) * image_size / h, (cell % w + 0.5) * image_size / w
    return float(any(x0 <= cx < x1 + 1 and y0 <= cy < y1 + 1 for x0, y0, x1, y1 in boxes))   # pixel x covers [x, x+1)


# %% [markdown]
# ## Evaluating a model
#
# `evaluate` decodes a split (batched beam search, the papers' evaluation), scores it, and on shapes adds the exact
# semantic scores (precision, recall and F1 of objects, attributes, counts and relations against the ground truth and
# the references, `capbook.shapes.semantic_scores`) and attention correctness. It returns the metrics, the captions
# (with their attention) and the decoding time.

# %%
#| export
def evaluate(model, prep, split: str = "test", beam_size: int = 3, max_len: int | None = None,
             device: torch.device | str = "cpu", batch_size: int = 100, length_norm: float = 0.0, no_repeat_ngram: int = 0) -> dict:
    "Decode `split` of a `Prepared` dataset with beam search (length-normalised by `length_norm`, n-gram blocking `no_repeat_ngram`) and compute every metric that applies."
    data = getattr(prep, check_choice("split", split, ("train", "val", "test")))
    max_len = max_len or prep.max_len
    t0 = time.time()
    caps = decode_split(model, data, beam_size, max_len, batch_size, device, length_norm, no_repeat_ngram)
    decode_s = time.time() - t0
    words = [prep.vocab.decode(c.tokens) for c in caps]
    res = {k: " ".join(w) for k, w in zip(data.keys, words)}
    gts = {k: [" ".join(r) for r in refs] for k, refs in zip(data.keys, data.refs)}
    t1 = time.time()
    scores, notes = coco_scores(gts, res)
    out = {"metrics": scores, "notes": notes, "captions": caps, "words": words, "keys": list(data.keys),
           "timings": {"decode_s": decode_s, "images_per_s": len(caps) / decode_s}}
    if prep.gt is not None:
        from capbook.shapes import semantic_scores
        out["semantic"] = semantic_scores(dict(zip(data.keys, words)), dict(zip(data.keys, data.refs)), prep.gt["images"])
        grid = getattr(model, "att_grid", prep.grid)          # a model may attend over its own map (the 2D LSTMs: 7x7)
        out["attention"] = attention_correctness(caps, data.keys, prep.gt, prep.vocab, grid, prep.image_size)
    out["timings"]["score_s"] = time.time() - t1
    return out

def measured(ev: dict) -> dict:
    "An evaluation's metrics as a results record keeps them."
    return {**ev["metrics"], **({"semantic": ev["semantic"], "attention": ev["attention"]} if "semantic" in ev else {})}


# %% [markdown]
# ## COCO results files: the captions in the form everyone reads
#
# The COCO evaluation server and every peer's `eval` script (self-critical.pytorch's `eval_utils`, coco-caption's
# `COCOEvalCap`) read a model's captions as one JSON list, `[{"image_id": 391895, "caption": "a man riding ..."}, ...]`.
# Every chapter run writes its test captions in that form beside `record.json` (`captions_test.json`), and
# `score_results` scores any such file — capbook's or a peer's — against a Karpathy split file with the book's one
# evaluator (`coco_scores`: PTB tokenizer, BLEU, METEOR, ROUGE-L, CIDEr). The image ids are the Karpathy file's
# (`ImageRecord.image_id`: `cocoid`, else `imgid`, else the filename). Like coco-caption, it scores the images the
# results name; with `split` it also insists that they are exactly that split's. A malformed file stops in one line
# naming the file, the item and what is allowed.

# %%
#| export
def write_results(path: str | Path, ids: list, captions: list[str]) -> Path:
    "Write captions as a COCO results file, `[{\"image_id\": id, \"caption\": str}, ...]` (atomically)."
    if len(ids) != len(captions): raise CapbookError(f"{path}: {len(ids)} image ids but {len(captions)} captions")
    return save_json(path, [{"image_id": i, "caption": c} for i, c in zip(ids, captions)])

def read_results(path: str | Path) -> dict:
    "A COCO results file as {image_id: caption}, or one line naming the file, the item and what is wrong."
    doc = load_json(path, "COCO results file")
    form = 'a JSON list of {"image_id": int or str, "caption": str} objects'
    if not isinstance(doc, list): raise CapbookError(f"{path}: expected {form}, found a JSON {type(doc).__name__}")
    if not doc: raise CapbookError(f"{path}: the results list is empty: expected {form}")
    out, first = {}, {}
    for i, it in enumerate(doc):
        if not isinstance(it, dict) or "image_id" not in it or "caption" not in it:
            raise CapbookError(f"{path}: item {i} is not an object with 'image_id' and 'caption': expected {form}")
        iid, cap = it["image_id"], it["caption"]
        if isinstance(iid, bool) or not isinstance(iid, (int, str)):
            raise CapbookError(f"{path}: item {i} has image_id {iid!r}: expected an integer or a string")
        if not isinstance(cap, str) or not cap.strip():
            raise CapbookError(f"{path}: item {i} (image_id {iid!r}) has an empty caption: expected a non-empty string")
        if iid in out: raise CapbookError(f"{path}: item {i} repeats image_id {iid!r} (first at item {first[iid]}): one caption per image")
        out[iid], first[iid] = cap, i
    return out

def score_results(results: str | Path, references: str | Path, split: str | None = None, meteor: bool = True) -> dict:
    "Score a COCO results file against a Karpathy split file's references: {'images', 'metrics', 'notes'}."
    from capbook.data import read_karpathy
    res = read_results(results)
    recs = read_karpathy(references).records
    if split is not None: recs = [r for r in recs if r.split == check_choice("split", split, ("train", "val", "test"))]
    by_id = {r.image_id: r for r in recs}
    where = f"{references}" + (f" (split {split})" if split else "")
    unknown = [i for i in res if i not in by_id]
    if unknown: raise CapbookError(f"{results}: {len(unknown)} image_id(s) are not images of {where}, e.g. {unknown[0]!r}")
    missing = [i for i in by_id if i not in res] if split else []
    if missing: raise CapbookError(f"{results}: {len(missing)} of the {len(by_id)} images of {where} have no caption, e.g. {missing[0]!r}")
    gts = {i: [" ".join(c) for c in by_id[i].captions] for i in res}
    scores, notes = coco_scores(gts, res, meteor=meteor)
    return {"images": len(res), "metrics": scores, "notes": notes}


# %%
import json, tempfile
_d = Path(tempfile.mkdtemp())
_refs = {0: ["a red circle", "one red circle"], 1: ["two blue squares", "a pair of blue squares"], 2: ["a green triangle"]}
(_d / "dataset_toy.json").write_text(json.dumps({"images": [
    {"filename": f"{i}.png", "imgid": i, "split": "test" if i < 2 else "val", "sentences": [{"tokens": r.split()} for r in rs]}
    for i, rs in _refs.items()]}))
write_results(_d / "res.json", [0, 1], ["a red circle", "two blue circles"])
_sc = score_results(_d / "res.json", _d / "dataset_toy.json", split="test", meteor=False)
assert _sc["images"] == 2 and _sc["metrics"] == coco_scores({0: _refs[0], 1: _refs[1]}, {0: "a red circle", 1: "two blue circles"}, meteor=False)[0]
for bad, msg in [({"image_id": 0}, "found a JSON dict"), ([], "results list is empty"), ([{"image_id": 0}], "item 0 is not an object with"),
                 ([{"image_id": 0, "caption": " "}], "item 0 (image_id 0) has an empty caption"),
                 ([{"image_id": 0, "caption": "a"}, {"image_id": 0, "caption": "b"}], "item 1 repeats image_id 0 (first at item 0)"),
                 ([{"image_id": [0], "caption": "a"}], "item 0 has image_id [0]"),
                 ([{"image_id": 9, "caption": "a"}], "1 image_id(s) are not images of"),
                 ([{"image_id": 0, "caption": "a"}], "1 of the 2 images of")]:
    (_d / "bad.json").write_text(json.dumps(bad))
    try: score_results(_d / "bad.json", _d / "dataset_toy.json", split="test", meteor=False); raise AssertionError(bad)
    except CapbookError as e: assert msg in str(e) and "\n" not in str(e), (msg, e)


# %% [markdown]
# ## Attention on the same words for every model
#
# Attention correctness on a model's own captions compares maps of different words when two models write different
# captions. `attention_on_references` makes every model read the same words: the first reference caption of each image
# of a split (teacher forcing, `capbook.decode.teacher_forced`), scored at the references' object words.

# %%
#| export
def attention_on_references(model, prep, split: str = "test", device: torch.device | str = "cpu",
                            batch_size: int = 100) -> tuple[list[Caption], dict]:
    "Teacher-forced captions (with attention) of each image's first reference, and their attention correctness."
    data = getattr(prep, split)
    refs = [prep.vocab.encode(r[0], prep.max_len) for r in data.refs]
    caps = pad_captions(refs, prep.max_len + 2)
    out = []
    for b in data.image_batches(batch_size):
        b["caps"] = caps[b["img"]]
        out += teacher_forced(model, to_device(b, device))
    grid = getattr(model, "att_grid", prep.grid)
    scores = attention_correctness(out, data.keys, prep.gt, prep.vocab, grid, prep.image_size) if prep.gt is not None else {"n": 0}
    return out, scores


# %% [markdown]
# ## CIDEr-D as a reward
#
# Self-critical training (`capbook.objectives.SelfCritical`) scores every sampled caption of every batch, so it needs
# CIDEr-D fast and with document frequencies from a fixed corpus — the training references, as in Rennie et al. —
# rather than from the handful of images in a batch, which is what pycocoevalcap's `Cider` would use. `CiderD`
# computes the same formula as pycocoevalcap's scorer (Vedantam et al. 2015, the variant the COCO server reports):
# per n-gram order $n = 1..4$, TF-IDF vectors $g^n$ with $\mathrm{idf} = \log N_{images} - \log \max(1, df)$,
# the candidate's vector clipped by the reference's, a Gaussian length penalty with σ = 6,
# $$\mathrm{CIDEr\text{-}D}_n(c, S) = \frac{10}{m} \sum_{j=1}^m e^{-\frac{(l_c - l_{s_j})^2}{2\sigma^2}}
#   \frac{\min(g^n(c), g^n(s_j)) \cdot g^n(s_j)}{\lVert g^n(c)\rVert \lVert g^n(s_j)\rVert}, \qquad
#   \mathrm{CIDEr\text{-}D}(c, S) = \frac14 \sum_{n=1}^4 \mathrm{CIDEr\text{-}D}_n(c, S).$$
# (Like pycocoevalcap, the length $l$ is counted in bigrams, one less than the words.)
#
# *capbook:* how it is made fast. Every word becomes an integer id (the vocabulary's, or the order of first sight),
# every n-gram one integer code $\sum_i (\mathrm{id}_i + 1) B^{k-1-i}$ (codes of different orders cannot collide),
# so the document frequencies are one sorted array looked up with `searchsorted`, and a batch is scored with a few
# array operations: the n-grams of all candidates and references of the batch are numbered densely, candidates
# become one TF-IDF matrix $(R, U)$ and references another $(S, U)$, and every (candidate, reference) pair is a row
# of $\min(g(c), g(s)) \cdot g(s)$ summed per order. The document frequencies are computed once per corpus and
# cached on disk under a hash of the corpus's ids (`cache=`): a changed caption or vocabulary gives another file,
# never a stale one. With `end=True` the end token is appended to every caption, candidates and references, as
# ruotianluo's `self-critical.pytorch` scores rewards — a sample that never ends is then penalised for it.
# `tests/test_metrics.py` checks it against pycocoevalcap on the same corpus; `capbook bench` times both.

# %%
#| export
class CiderD:
    "CIDEr-D with document frequencies from a fixed reference `corpus` (a list of images, each a list of token lists), vectorised over a batch."
    END, BASE = "<end>", 2 ** 15          # n-gram codes in base B: 4-grams stay below 2^60

    def __init__(self, corpus: list[list[list[str]]], n: int = 4, sigma: float = 6.0, vocab=None, end: bool = False,
                 cache: str | Path | None = None):
        if not 1 <= n <= 4: raise ValueError(f"CiderD: n={n} is invalid: 1 to 4")
        self.n, self.sigma, self.vocab, self.end = n, sigma, vocab, end
        self._ids: dict[str, int] = dict(vocab.stoi) if vocab is not None else {}
        if end and self.END not in self._ids: self._ids[self.END] = len(self._ids)
        refs = [[self.ids(r) for r in rs] for rs in corpus]
        self.log_n = float(np.log(max(len(corpus), 1)))
        digest = hashlib.sha256()
        for rs in refs:
            for r in rs: digest.update(r.tobytes() + b"|")
            digest.update(b"#")
        key = stable_hash([digest.hexdigest(), n, end, None if vocab is None else vocab.itos], 16)
        self.cache_path = Path(cache) / f"cider-df-{key}.npz" if cache is not None else None
        if self.cache_path is not None and self.cache_path.exists():
            with np.load(self.cache_path) as z: self.df_codes, self.df = z["codes"], z["df"]
        else:
            # df(w): the number of images whose references contain n-gram w, each image counted once
            per_image = [np.unique(self._windows(rs)[1]) for rs in refs]
            self.df_codes, self.df = np.unique(np.concatenate([np.zeros(0, np.int64), *per_image]), return_counts=True)
            if self.cache_path is not None:
                atomic_write(self.cache_path, lambda t: np.savez(open(t, "wb"), codes=self.df_codes, df=self.df))

    def ids(self, words, ended: bool = True) -> np.ndarray:
        "A caption — words, or an id array/tensor when built with a vocabulary — as ids, the end token appended if `end`."
        if isinstance(words, (np.ndarray, torch.Tensor)): a = np.asarray(words, np.int64)
        elif self.vocab is not None: a = np.array([self._ids.get(w, self.vocab.unk) for w in words], np.int64)
        else: a = np.array([self._ids.setdefault(w, len(self._ids)) for w in words], np.int64)
        if len(self._ids) > self.BASE - 2: raise ValueError(f"CiderD: more than {self.BASE - 2} distinct words")
        return np.append(a, self._ids[self.END]) if self.end and ended else a

    def doc_freq(self, ngram: list[str]) -> int:
        "df of one n-gram (a list of words) in the corpus."
        code = self._windows([self.ids(ngram)[:len(ngram)]])[1][-1]
        i = np.searchsorted(self.df_codes, code)
        return int(self.df[i]) if i < len(self.df_codes) and self.df_codes[i] == code else 0

    def _windows(self, rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        "Every n-gram of every row: (row index, code, order - 1), each (M,)."
        B = self.BASE
        T = max((len(r) for r in rows), default=0)
        if T == 0: return (np.zeros(0, np.int64),) * 3
        ids = np.zeros((len(rows), T), np.int64)
        lens = np.array([len(r) for r in rows])
        for i, r in enumerate(rows): ids[i, :len(r)] = r + 1            # shifted ids: 0 is no word
        out = []
        code = np.zeros((len(rows), T), np.int64)
        for k in range(1, self.n + 1):
            # code of the k-gram starting at j: code_{k-1}(j) * B + id_{j+k-1}
            code = code[:, :T - k + 1] * B + ids[:, k - 1:]
            valid = np.arange(T - k + 1)[None] + k <= lens[:, None]
            r, j = np.nonzero(valid)
            out.append((r, code[r, j], np.full(len(r), k - 1)))
        return tuple(np.concatenate(x) for x in zip(*out))

    def score(self, cands: list, refs: list[list], chunk: int = 512, ended: list[bool] | None = None) -> np.ndarray:
        "CIDEr-D of each candidate (words or ids) against its references (lists of words or ids): (len(cands),)."
        out = np.zeros(len(cands))
        for s in range(0, len(cands), chunk):
            # reference sets given as the same list object (an image's, repeated for its samples) are converted once
            sets, which = {}, []
            for rs in refs[s:s + chunk]: which.append(sets.setdefault(id(rs), (len(sets), rs))[0])
            ends = ended[s:s + chunk] if ended is not None else [True] * len(cands[s:s + chunk])
            out[s:s + chunk] = self._score([self.ids(c, e) for c, e in zip(cands[s:s + chunk], ends)],
                                           [[self.ids(r) for r in rs] for _, rs in sets.values()], np.array(which))
        return out

    def _score(self, cands: list[np.ndarray], sets: list[list[np.ndarray]], which: np.ndarray) -> np.ndarray:
        "Candidates, the distinct reference sets, and the set of each candidate."
        R, n = len(cands), self.n
        flat = [r for rs in sets for r in rs]
        first = np.cumsum([0] + [len(rs) for rs in sets])                         # each set's first reference
        m = np.array([len(sets[w]) for w in which])                               # references per candidate: (R,)
        # every (candidate, reference) pair: P = sum_i m_i
        pc = np.repeat(np.arange(R), m)
        ps = first[which][pc] + np.arange(len(pc)) - np.repeat(np.cumsum(m) - m, m)
        ci, cc, co = self._windows(cands)
        ri, rc, ro = self._windows(flat)
        # the batch's n-grams numbered densely: u (U,), and each n-gram's order
        u, inv = np.unique(np.concatenate([cc, rc]), return_inverse=True)
        order = np.zeros(len(u), np.int64); order[inv] = np.concatenate([co, ro])
        look = np.searchsorted(self.df_codes, u).clip(max=max(len(self.df_codes) - 1, 0))
        df = np.where(self.df_codes[look] == u, self.df[look], 0) if len(self.df_codes) else np.zeros(len(u))
        # idf(w) = log N - log max(1, df(w)): (U,)
        idf = self.log_n - np.log(np.maximum(1.0, df))
        U = len(u)
        # g(s) = tf * idf for the references, dense: (S, U); ||g^n(s)||: (S, n)
        gs = np.bincount(ri * U + inv[len(cc):], minlength=len(flat) * U).reshape(len(flat), U) * idf
        ns = np.sqrt((gs ** 2) @ np.eye(n)[order])
        # g(c) = tf * idf for the candidates, sparse: entries (candidate e_i, n-gram e_u, weight g); ||g^n(c)||: (R, n)
        key, tf = np.unique(ci * U + inv[:len(cc)], return_counts=True)
        e_i, e_u = key // U, key % U
        g = tf * idf[e_u]
        nc = np.sqrt(np.bincount(e_i * n + order[e_u], weights=g ** 2, minlength=R * n).reshape(R, n))
        # min(g^n(c), g^n(s)) . g^n(s) summed over the candidate's n-grams, for each of its pairs: (P, n)
        pstart = np.cumsum(m) - m
        rep = m[e_i]
        e = np.repeat(np.arange(len(e_i)), rep)
        pair = pstart[e_i][e] + np.arange(len(e)) - np.repeat(np.cumsum(rep) - rep, rep)
        w = gs[ps[pair], e_u[e]]
        dot = np.bincount(pair * n + order[e_u[e]], weights=np.minimum(g[e], w) * w, minlength=len(pc) * n).reshape(-1, n)
        den = nc[pc] * ns[ps]
        val = np.where(den > 0, dot / np.where(den > 0, den, 1), dot)
        # the length penalty, lengths in bigrams as pycocoevalcap counts them: (P,)
        lc = np.array([max(len(c) - 1, 0) for c in cands])[pc]
        ls = np.array([max(len(r) - 1, 0) for r in flat])[ps]
        val = val * np.exp(-((lc - ls) ** 2) / (2 * self.sigma ** 2))[:, None]
        # 10/m sum_j over each candidate's m references, mean over the orders: (R,)
        per = np.zeros((R, n)); np.add.at(per, pc, val)
        return 10.0 * per.mean(1) / np.maximum(m, 1)


# %% [markdown]
# ## How sure is a number? Bootstrap intervals over test images
#
# A table row is one model on one test split of a few hundred images; another split of the same size would give
# another number. The book's intervals answer "how much would this number move with other test images of the same
# kind" by the percentile bootstrap (Efron & Tibshirani 1993; for MT metrics, Koehn 2004): draw the test images with
# replacement, as many as there are, 1,000 times (seeded), score each draw, and report the 2.5 % and 97.5 % quantiles.
# A claim "A beats B" is tested **paired**: both models are scored on the *same* draws, and the interval is that of
# the difference — far tighter than two separate intervals, because the images that are hard for one are hard for
# the other. The verdict: *holds* when the whole 95 % interval of the difference is on the claimed side of zero,
# *does not hold* when it is on the other side, *cannot tell at this size* when it contains zero.
#
# Rescoring 1,000 draws with pycocoevalcap would take minutes per row; instead `image_stats` computes each test image's
# **sufficient statistics** once, and every metric of a draw is a function of their weighted sums:
#
# - **BLEU-4** (corpus-level, as pycocoevalcap computes it): per image the candidate length, the closest reference
#   length, and for n = 1..4 the candidate's n-gram count and its clipped matches; then
#   $\mathrm{BLEU} = \mathrm{BP} \cdot \big(\prod_{n=1}^4 \frac{\sum \mathrm{correct}_n + 10^{-15}}{\sum \mathrm{guess}_n + 10^{-9}}\big)^{1/4}$,
#   $\mathrm{BP} = e^{1 - r/c}$ when $c < r$ (pycocoevalcap's exact constants);
# - **CIDEr**: each image's score with the document frequencies of the whole split held fixed (resampling a
#   reference corpus would count an image's n-grams twice), then the mean;
# - **semantic F1** (shapes): per image the true, candidate, matched and reference tuple counts (`semantic_counts`),
#   micro-averaged as `semantic_scores` does.
#
# With the weights w (R × N: how often each image is drawn) the R scores are a few matrix products.

# %%
#| export
_TINY, _SMALL = 1e-15, 1e-9                 # pycocoevalcap's BLEU constants

def image_stats(keys: list[str], words: list[list[str]], refs: list[list[list[str]]], gt: dict | None = None) -> dict[str, np.ndarray]:
    "Per-image sufficient statistics of BLEU-4 (N, 10), CIDEr (N,) and, with shapes ground truth `gt`, semantic F1 (N, 4) overall and per tuple category."
    from pycocoevalcap.bleu.bleu_scorer import cook_refs, cook_test
    from pycocoevalcap.cider.cider import Cider
    gts, res, _ = tokenized({k: [" ".join(r) for r in rs] for k, rs in zip(keys, refs)},
                            {k: " ".join(w) for k, w in zip(keys, words)})
    gts, res = {k: gts[k] for k in keys}, {k: res[k] for k in keys}
    bleu = [cook_test(res[k][0], cook_refs(gts[k]), eff="closest") for k in keys]
    out = {"BLEU-4": np.array([[c["testlen"], c["reflen"], *c["guess"], *c["correct"]] for c in bleu], dtype=np.float64),
           "CIDEr": np.asarray(Cider().compute_score(gts, res)[1], dtype=np.float64)}
    if gt is not None:                            # (N, 4 categories, 4 counts): all categories, and each on its own
        from capbook.shapes import CATEGORIES, semantic_counts
        sem = np.stack([semantic_counts(w, r, gt["images"][k]) for k, w, r in zip(keys, words, refs)]).astype(np.float64)
        out["semantic F1"] = sem.sum(1)
        out |= {f"{c} F1": sem[:, i] for i, c in enumerate(CATEGORIES)}
    return out

def _bleu4(t: np.ndarray) -> np.ndarray:
    "BLEU-4 from summed statistics t (R, 10): testlen, reflen, guess 1..4, correct 1..4."
    b = np.prod((t[:, 6:10] + _TINY) / (t[:, 2:6] + _SMALL), axis=1) ** 0.25
    ratio = (t[:, 0] + _TINY) / (t[:, 1] + _SMALL)
    return b * np.where(ratio < 1, np.exp(1 - 1 / np.minimum(ratio, 1)), 1.0)

def _f1(t: np.ndarray) -> np.ndarray:
    "Micro F1 from summed (true, candidate, matched, reference) tuple counts t (R, 4)."
    p, r = t[:, 0] / np.maximum(t[:, 1], 1), t[:, 2] / np.maximum(t[:, 3], 1)
    return np.where(p + r > 0, 2 * p * r / np.where(p + r > 0, p + r, 1), 0.0)

FROM_SUMS = {"BLEU-4": lambda t, n: _bleu4(t), "CIDEr": lambda t, n: t / n, "semantic F1": lambda t, n: _f1(t),
             **{f"{c} F1": lambda t, n: _f1(t) for c in ("objects", "attributes", "counts", "relations")}}

def draws(n: int, resamples: int = 1000, seed: int = 0) -> np.ndarray:
    "How often each of `n` images is drawn in each of `resamples` bootstrap draws: counts (resamples, n), seeded."
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    w = np.zeros((resamples, n)); np.add.at(w, (np.arange(resamples)[:, None], idx), 1)
    return w

def resampled(stats: np.ndarray, metric: str, w: np.ndarray) -> np.ndarray:
    "The metric (×100) of each draw: `w` (R, N) says how often each image is drawn; `stats` are `image_stats`' rows for the metric."
    return 100 * FROM_SUMS[metric](w @ stats, w.sum(1)).reshape(len(w))

def bootstrap(stats: np.ndarray, metric: str, other: np.ndarray | None = None, resamples: int = 1000, seed: int = 0,
              level: float = 0.95, w: np.ndarray | None = None) -> dict:
    "The metric (×100) and its percentile bootstrap interval over images; with `other` (another model on the same images) the paired difference, its interval and the verdict on 'this > other'."
    n = len(stats)
    if other is not None and len(other) != n: raise CapbookError(f"paired bootstrap: {n} images against {len(other)}; score both models on the same test images")
    w, full = draws(n, resamples, seed) if w is None else w, np.ones((1, n))
    a, value = resampled(stats, metric, w), float(resampled(stats, metric, full)[0])
    if other is not None:                         # the same draws for both models
        a, value = a - resampled(other, metric, w), value - float(resampled(other, metric, full)[0])
    lo, hi = np.quantile(a, [(1 - level) / 2, (1 + level) / 2])
    out = {"value": value, "lo": float(lo), "hi": float(hi), "resamples": len(w), "seed": seed, "level": level}
    if other is not None:
        out["verdict"] = "holds" if lo > 0 else "does not hold" if hi < 0 else "cannot tell at this size"
    return out


# %% [markdown]
# A check against brute force on a tiny case: three candidate captions, and seven draws written out image by image.
# For each draw, pycocoevalcap's own `BleuScorer` scores the drawn images (duplicates included) and the CIDEr and F1
# are recomputed from the drawn list; the weighted sums must give the same numbers.

# %%
from pycocoevalcap.bleu.bleu_scorer import BleuScorer as _BleuScorer
_keys = ["a", "b", "c"]
_words = [["a", "red", "circle"], ["two", "blue", "squares", "left", "of", "a", "circle"], ["a", "small", "green", "triangle"]]
_refs = [[["a", "red", "circle"], ["one", "red", "circle"]], [["two", "blue", "squares"], ["blue", "squares", "left", "of", "a", "circle"]],
         [["a", "green", "triangle", "above", "a", "square"], ["small", "green", "triangle"]]]
_st = image_stats(_keys, _words, _refs)
_w = np.zeros((7, 3)); _picks = [[0, 0, 0], [1, 1, 2], [2, 0, 1], [2, 2, 2], [0, 1, 1], [1, 0, 0], [2, 1, 0]]
for _r, _p in enumerate(_picks):
    for _i in _p: _w[_r, _i] += 1
for _r, _p in enumerate(_picks):
    _bs = _BleuScorer(n=4)
    for _i in _p: _bs += (" ".join(_words[_i]), [" ".join(x) for x in _refs[_i]])
    _brute = _bs.compute_score(option="closest")[0][3]
    assert abs(resampled(_st["BLEU-4"], "BLEU-4", _w)[_r] - 100 * _brute) < 1e-9, (_r, _brute)
    assert abs(resampled(_st["CIDEr"], "CIDEr", _w)[_r] - 100 * np.mean(_st["CIDEr"][_p])) < 1e-9
_ci = bootstrap(_st["BLEU-4"], "BLEU-4", resamples=1000, seed=0)
assert _ci["lo"] <= _ci["value"] <= _ci["hi"] and bootstrap(_st["BLEU-4"], "BLEU-4", seed=0) == _ci    # seeded
_pair = bootstrap(_st["CIDEr"], "CIDEr", other=_st["CIDEr"] * 0.5)
print(_ci, _pair["verdict"])

# %% [markdown]
# ## One row of a results table
#
# Every results table of the book flattens a run's measured metrics the same way: the captioning metrics ×100, and on
# shapes the semantic F1s and attention correctness (mass on the named object and peak-hit rate, ×100). A metric that
# was not measured (METEOR without Java, attention for a model without attention) is left out, and tables show it as —.

# %% [markdown]
# The reference itself scores highest; a caption sharing only "a" and "circle" less; an empty one zero. "a" is in
# two of the three images' references, so it weighs less than "circle", which is in one.

# %%
_cd = CiderD([[["a", "red", "circle"]], [["two", "green", "stars"]], [["a", "blue", "square"]]])
_sc = _cd.score([["a", "red", "circle"], ["a", "green", "circle"], []], [[["a", "red", "circle"]]] * 3)
assert _sc[0] > _sc[1] > _sc[2] == 0 and _cd.doc_freq(["a"]) == 2 and _cd.doc_freq(["circle"]) == 1 == _cd.doc_freq(["a", "red"])
print(_sc.round(3))

# %%
#| export
CAPTION_METRICS = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr"]

def results_row(m: dict) -> dict:
    "Table columns (×100) from a run's measured metrics (the `metrics` of its results record, or `evaluate`'s parts)."
    row = {k: 100 * m[k] for k in CAPTION_METRICS if k in m}
    if "semantic" in m:
        row.update({f"F1 {c}": 100 * m["semantic"][c]["f1"] for c in ["objects", "attributes", "counts", "relations", "all"]})
    if m.get("attention", {}).get("n"):
        row.update({"att. mass": 100 * m["attention"]["mass"], "att. hit": 100 * m["attention"]["hit"]})
    return row

SEMANTIC_CATEGORIES = ["objects", "attributes", "counts", "relations", "all"]

def semantic_table(runs: dict[str, dict]):
    "Semantic precision, recall and F1 (×100) per category, one row per run: `{label: metrics}` (runs measured without ground truth are left out); a pandas DataFrame."
    import pandas as pd
    return pd.DataFrame([{"model": label, **{f"{c} {k.upper() if k != 'f1' else 'F1'}": 100 * m["semantic"][c][k]
                                             for c in SEMANTIC_CATEGORIES for k in ("p", "r", "f1")}}
                         for label, m in runs.items() if "semantic" in m])


# %%
_s, _n = coco_scores({1: ["a red circle", "a red circle above a blue square"], 2: ["two green stars"]},
                     {1: "a red circle", 2: "two green stars"}, meteor=False, spice=False)
assert _s["BLEU-1"] > 0.99 and 0 <= _s["CIDEr"]
_f = box_fractions([[0, 0, 7, 7]], (2, 2), 16)            # pixels 0..7 inclusive: exactly the top-left cell
assert torch.allclose(_f, torch.tensor([1., 0, 0, 0]))
assert torch.allclose(box_fractions([[0, 0, 3, 7]], (2, 2), 16), torch.tensor([0.5, 0, 0, 0]))

# %% [markdown]
# A caption whose object word looks at the object's cell scores a mass of 1 and a hit; uniform attention would score
# the box's share of the image.

# %%
from capbook.data import Vocab
_v = Vocab.build([["a", "red", "circle"]], min_count=1)
_gt = {"images": {"x.png": {"objects": [{"shape": "circle", "colour": "red", "size": "small", "box": [0, 0, 7, 7]}],
                            "relations": []}}}
_alpha = torch.tensor([[0.25] * 4, [0.25] * 4, [1.0, 0, 0, 0]])        # step 2 emits "circle", looking at the top left
_ac = attention_correctness([Caption(_v.encode(["a", "red", "circle"])[1:-1], 0.0, _alpha)], ["x.png"], _gt, _v, (2, 2), 16)
assert _ac == {"mass": 1.0, "hit": 1.0, "mass_uniform": 0.25, "n": 1}, _ac

# %%
_r = results_row({"BLEU-4": 0.25, "semantic": {c: {"f1": 0.5} for c in ["objects", "attributes", "counts", "relations", "all"]},
                  "attention": {"mass": 0.3, "hit": 0.5, "n": 0}})
assert _r["BLEU-4"] == 25 and _r["F1 all"] == 50 and "att. mass" not in _r and "METEOR" not in _r

# %% [markdown]
# The semantic scores' precision and recall, not only their F1: a model that never states a count has a count
# precision and recall of 0, and a model that states many false ones a low precision beside a high recall.

# %%
_st = semantic_table({"a": {"semantic": {c: {"p": 0.5, "r": 0.25, "f1": 1 / 3} for c in SEMANTIC_CATEGORIES}}, "blind": {}})
assert list(_st["model"]) == ["a"] and _st.loc[0, "counts P"] == 50 and _st.loc[0, "counts R"] == 25
assert list(_st.columns[:4]) == ["model", "objects P", "objects R", "objects F1"]
