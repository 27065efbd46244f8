"""The GPU path: every model family computes on CUDA what it computes on the CPU, trains there under bfloat16 autocast,
decodes the same captions, and a chapter runs there end to end. These tests need a CUDA GPU; CI's machines have none,
so there pytest reports them as skipped with this reason (run them with `python -m pytest tests/test_gpu.py` on a GPU)."""
import copy
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU path's own tests)")


def _families():
    from capbook.bench import families
    return families("smoke")


@pytest.fixture(scope="module")
def fams(home):
    return {f.model: f for f in _families()}


def _one_batch(s):
    from capbook.bench import train_batches
    return next(train_batches(s))


@pytest.mark.parametrize("model", [f.model for f in (_families() if torch.cuda.is_available() else [])])
def test_each_family_computes_the_same_loss_and_gradients_on_cuda(fams, model):
    "One batch's loss and gradients: CUDA in float32 equal the CPU's (1e-4); under the GPU's bfloat16 autocast within 3 %."
    from capbook.bench import setup
    from capbook.data import to_device
    s = setup(fams[model], "cpu")
    batch = _one_batch(s)
    net, obj = s["model"].train(), s["objective"].train()

    def loss_and_grads(dev, bf16=False):
        m, o = copy.deepcopy(net).to(dev), copy.deepcopy(obj).to(dev)
        torch.manual_seed(0)                      # the same dropout masks where the device's generator allows
        m.eval(); o.eval()                        # no dropout: the two devices draw different masks
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = o.loss(o.outputs(m, to_device(batch, dev)), to_device(batch, dev))
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten().float().cpu() for p in m.parameters() if p.grad is not None])

    l_cpu, g_cpu = loss_and_grads("cpu")
    l_gpu, g_gpu = loss_and_grads("cuda")
    l_bf, g_bf = loss_and_grads("cuda", bf16=True)
    assert abs(l_gpu - l_cpu) <= 1e-4 * abs(l_cpu) + 1e-5, (model, l_cpu, l_gpu)
    assert torch.allclose(g_gpu, g_cpu, rtol=1e-3, atol=1e-5), (model, (g_gpu - g_cpu).abs().max().item())
    assert abs(l_bf - l_cpu) <= 0.03 * abs(l_cpu), (model, l_cpu, l_bf)
    cos = torch.nn.functional.cosine_similarity(g_bf, g_cpu, dim=0).item()
    assert cos > 0.98, (model, cos)


def test_beam_search_on_cuda_finds_the_cpus_captions(fams):
    "The batched beam search on CUDA (float32) returns the CPU's captions and log-probabilities for a trained-for-a-bit model."
    from capbook.bench import setup, train_batches
    from capbook.data import to_device
    from capbook.decode import beam_search
    from capbook.train import train_step
    s = setup(fams["sat_soft"], "cpu")
    model, it = s["model"], train_batches(s)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(30): train_step(model, model, s["objective"], opt, next(it), torch.device("cpu"))   # away from uniform ties
    model.eval()
    batch = next(s["prep"].test.image_batches(40))
    with torch.no_grad():
        cpu = beam_search(model, batch, 3, s["cfg"].max_len)
        twin = setup(fams["sat_soft"], "cpu")["model"]
        twin.load_state_dict(model.state_dict())
        gpu = beam_search(twin.cuda().eval(), to_device(batch, "cuda"), 3, s["cfg"].max_len)
    same = sum(a.tokens == b.tokens for a, b in zip(cpu, gpu))
    assert same >= 0.95 * len(cpu), (same, len(cpu))
    for a, b in zip(cpu, gpu):
        if a.tokens == b.tokens: assert abs(a.logprob - b.logprob) < 1e-3
        assert b.alpha is None or b.alpha.device.type == "cpu"       # captions come back on the host


def test_a_chapter_trains_and_scores_on_cuda(home, tmp_path):
    "Show-Attend-Tell's chapter run on the GPU: trains in bfloat16 autocast, records it, and scores like a CPU run."
    from capbook.runner import run_chapter
    ctx = run_chapter("02_show_attend_tell", {"profile": "smoke", "device": "cuda", "run_dir": str(tmp_path / "run")}, log=lambda s: None)
    rec = ctx.record
    assert ctx.device.type == "cuda" and rec["precision"] == "bf16" and rec["machine"]["device"] == "cuda"
    assert next(ctx.model.parameters()).device.type == "cuda"
    assert rec["metrics"]["CIDEr"] > 0 and rec["timings"]["train_captions_per_s"] > 0
    assert (tmp_path / "run" / "ckpt" / "best.pt").exists()
    # the checkpoint loads on the CPU (a reader without a GPU can use it)
    from capbook.core import load_torch
    state = load_torch(tmp_path / "run" / "ckpt" / "best.pt")["model"]
    assert all(v.device.type == "cpu" for v in state.values() if torch.is_tensor(v))


def test_fit_on_cuda_resumes_where_it_stopped(home, smoke, tmp_path):
    "A run interrupted after its first epoch on the GPU resumes there and ends where an uninterrupted one does (same curve within bf16 noise)."
    from capbook.models import build
    from capbook.train import TrainConfig, fit
    from capbook.core import seed_everything

    class Killed(Exception): pass

    def die_at_epoch_1(line):
        if line.startswith("epoch 1"): raise Killed(line)     # after the checkpoint that ends epoch 0

    def run(d, log=lambda s: None):
        seed_everything(0)
        m = build("sat_soft", len(smoke.vocab), smoke.feat_shape[1], smoke.grid)
        cfg = TrainConfig(epochs=2, patience=5, device="cuda", progress=False, max_len=smoke.max_len)
        return fit(m, smoke, cfg, d, log=log)

    whole = run(tmp_path / "a")
    with pytest.raises(Killed): run(tmp_path / "b", die_at_epoch_1)
    resumed = run(tmp_path / "b")
    assert resumed.resumed_from is not None and resumed.resumed_from[0] == 1
    a = [h["val CIDEr"] for h in whole.history]; b = [h["val CIDEr"] for h in resumed.history]
    assert len(a) == len(b) and all(abs(x - y) <= 0.05 * max(abs(x), 0.05) for x, y in zip(a, b)), (a, b)
