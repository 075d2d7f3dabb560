"""MemoryTracker: exact byte counts on the CPU, derived by hand from what PyTorch allocates and keeps.

Notation: B batch rows, P parameter count, n parameter tensors; fp32 = 4 bytes per element.
"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mgpu_helpers.runtime.tracker import CATEGORIES, MemoryTracker

B = 16


def mlp(*widths, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def sizes(model):
    ps = list(model.parameters())
    return sum(p.numel() for p in ps), len(ps)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)  # CUDA's default on every device


def train_step(model, opt, mt, x):
    loss = model(x).sum()
    mt.mark("backward")
    loss.backward()
    del loss
    mt.mark("step")
    opt.step()


def test_parameter_gradient_and_adam_state_bytes():
    model = mlp(64, 128, 10)
    opt = adam(model)
    P, n = sizes(model)
    x = torch.randn(B, 64)
    with MemoryTracker(model, opt) as mt:
        assert mt.current_bytes == 4 * P  # only the model existed at entry
        train_step(model, opt, mt, x)
        got = mt.breakdown()
    # Adam keeps exp_avg and exp_avg_sq (fp32, like the parameter) and a `step` counter per parameter
    # tensor; in torch 2.x that counter is a 0-d fp32 tensor (on the CPU unless capturable/fused).
    steps = [opt.state[p]["step"] for p in model.parameters()]
    assert all(torch.is_tensor(s) and s.dtype == torch.float32 and s.dim() == 0 for s in steps)
    assert got == {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P + 4 * n,
                   "activations": 0, "other": 0}
    assert sum(got.values()) == mt.current_bytes
    assert set(got) == set(CATEGORIES) and mt.device == torch.device("cpu")


@pytest.mark.parametrize("widths", [(64, 128, 10), (64, 128, 96, 10)])
def test_saved_activations_of_linear_relu_stack_exact(widths):
    model = mlp(*widths)
    x = torch.randn(B, widths[0])  # made before entry: not counted, like a batch already on the GPU
    with MemoryTracker(model) as mt:
        out = model(x)
        act = mt.breakdown()["activations"]
    # Autograd keeps: each Linear's input (mat1 of addmm, needed for the weight gradient) -- the first
    # one is x, made before entry; the others are the ReLU outputs, which ReLU also saves (one storage);
    # the ReLU inputs (Linear outputs) are freed once ReLU has run; the logits stay alive as the output.
    hidden = sum(widths[1:-1])
    assert act == 4 * B * (hidden + widths[-1])
    assert out.shape == (B, widths[-1])


def test_inputs_made_inside_are_other_and_loss_side_is_other():
    model = mlp(64, 128, 10)
    with MemoryTracker(model) as mt:
        x = torch.randn(B, 64)
        loss = model(x).sum()  # the logits are freed by sum (it saves no tensor); the 0-d loss remains
        got = mt.breakdown()
    assert got["activations"] == 4 * B * 128
    assert got["other"] == 4 * B * 64 + 4
    del loss


def test_peak_of_a_full_step_is_params_grads_state_and_adams_temporary():
    model = mlp(64, 128, 10)
    opt = adam(model)
    P, n = sizes(model)
    x = torch.randn(B, 64)
    with MemoryTracker(model, opt) as mt:
        train_step(model, opt, mt, x)
        opt.zero_grad(set_to_none=True)
    # First step. Forward peaks while Linear1's output h and ReLU's output relu(h) are both alive:
    # 4P + 2*(4*B*128). Backward never holds more than 4P grads + a few B x 128 buffers. The step creates
    # Adam's state lazily (8P + 4n) while the 4P gradients live, and foreach Adam then computes
    # sqrt(exp_avg_sq) into a fresh list of tensors the size of the parameters (4P, a temporary):
    #   peak = params 4P + grads 4P + state (8P + 4n) + temporary 4P = 20P + 4n, in the step phase.
    assert mt.peak_bytes == 20 * P + 4 * n
    assert mt.peak_breakdown() == {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P + 4 * n,
                                   "activations": 0, "other": 4 * P}
    peaks = mt.phase_peaks()
    assert list(peaks) == ["forward", "backward", "step"]
    assert peaks["step"] == mt.peak_bytes
    assert peaks["forward"] == 4 * P + 2 * 4 * B * 128
    assert peaks["forward"] < peaks["backward"] < peaks["step"]
    assert mt.current_bytes == 4 * P + 8 * P + 4 * n  # zero_grad(set_to_none=True) freed the grads


def test_reset_peak_and_views_and_in_place():
    before = torch.zeros(1000)  # existed before entry: in-place ops on it must not count it
    with MemoryTracker() as mt:
        assert mt.current_bytes == mt.peak_bytes == 0
        a = torch.empty(1000)
        v, w, t = a.view(10, 100), a[::2], a.unsqueeze(0)
        a.add_(1)
        before.mul_(2)
        before.view(-1)[:10].zero_()
        assert mt.current_bytes == 4000  # one storage, however many views
        del a
        assert mt.current_bytes == 4000  # the views keep it alive
        tmp = torch.empty(500)
        del tmp
        assert mt.peak_bytes == 6000
        mt.reset_peak()
        assert mt.peak_bytes == mt.current_bytes == 4000
        del v, w, t
        assert mt.current_bytes == 0 and mt.peak_bytes == 4000
        mt.reset_peak()
        assert mt.peak_bytes == 0
    assert mt.breakdown()["other"] == 0


def test_round_to_cuda_blocks():
    with MemoryTracker(round_to=512) as mt:
        a, b, c = torch.zeros(1), torch.zeros(128), torch.zeros(129)  # 4, 512 and 516 bytes
        e = torch.zeros(0)  # the CUDA allocator does not allocate for 0 bytes
        assert mt.current_bytes == 512 + 512 + 1024
    del a, b, c, e


def test_zero_grad_set_to_none_and_not():
    model = mlp(64, 128, 10)
    opt = adam(model)
    P, _ = sizes(model)
    with MemoryTracker(model, opt) as mt:
        train_step(model, opt, mt, torch.randn(B, 64))
        opt.zero_grad(set_to_none=False)
        assert mt.breakdown()["gradients"] == 4 * P  # zeroed in place: still allocated
        opt.zero_grad(set_to_none=True)
        assert mt.breakdown()["gradients"] == 0


def test_timeline_two_iterations_and_accumulation():
    model = mlp(64, 128, 10)
    opt = adam(model)
    P, n = sizes(model)
    with MemoryTracker(model, opt) as mt:
        results = []
        for _ in range(3):
            mt.mark("forward")
            mt.reset_peak()
            for _ in range(4):  # gradient accumulation: 4 micro-batches, one step
                loss = model(torch.randn(B, 64)).sum() / 4
                loss.backward()
                del loss
                assert mt.breakdown()["gradients"] == 4 * P  # accumulated in place, not k copies
                assert mt.breakdown()["activations"] == 0  # each backward freed its graph
            mt.mark("step")
            opt.step()
            opt.zero_grad(set_to_none=True)
            results.append((mt.breakdown(), mt.peak_bytes))
    # First iteration: as in the single step, the peak is Adam's first step, 20P + 4n. Later ones
    # start with the state allocated (4P + 8P + 4n), so backward's temporaries on top of the 4P
    # accumulated gradients can peak higher; from then on every iteration is the same.
    assert results[0][1] == 20 * P + 4 * n
    assert results[1] == results[2] and results[1][1] >= results[0][1]
    assert results[2][0] == {"parameters": 4 * P, "gradients": 0, "optimizer_state": 8 * P + 4 * n,
                             "activations": 0, "other": 0}
    labels = [s[0] for s in mt.timeline]
    assert len(mt.timeline) > 20 and labels[0] == "forward" and "step" in labels
    assert all(total == sum(cats.values()) for _, total, cats in mt.timeline)
    assert max(s[1] for s in mt.timeline) == max(mt.phase_peaks().values())
    assert list(mt.phase_peaks()) == ["forward", "step"]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.f(x)


class Net(nn.Module):
    def __init__(self, d=64, layers=4, ckpt=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks, self.ckpt, self.head = nn.ModuleList(Block(d) for _ in range(layers)), ckpt, nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return self.head(x)


def test_checkpointing_reduces_activations_and_grads_match():
    acts, grads = {}, {}
    x = torch.randn(B, 64)
    for ckpt in (False, True):
        model = Net(ckpt=ckpt)
        with MemoryTracker(model) as mt:
            loss = model(x).sum()
            acts[ckpt] = mt.breakdown()["activations"]
            loss.backward()
        grads[ckpt] = [p.grad for p in model.parameters()]
    # With checkpointing only each block's input survives the forward (the checkpoint keeps it to
    # recompute from) -- the first one is x, made before entry -- plus the last block's output, which
    # the head saves: 4 x (B x 64) fp32. The logits were freed by sum.
    assert acts[True] == 4 * 4 * B * 64
    assert acts[True] < acts[False] / 4
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def test_autocast_bf16_counts_the_weight_copies_it_saves():
    model = mlp(64, 128, 10)
    x = torch.randn(B, 64)
    with MemoryTracker(model) as mt:
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        act = mt.breakdown()["activations"]
        out.float().sum().backward()
    # bf16 (2 bytes): x's bf16 copy (saved: W1 needs it), relu output, W2's bf16 copy (saved: the relu
    # output requires grad, so its gradient needs W2) and the logits. W1's copy is not saved (x needs no
    # gradient) and the bias copies are not saved: both die when autocast clears its cast cache.
    assert act == 2 * (B * 64 + B * 128 + 128 * 10 + B * 10)
    assert out.dtype == torch.bfloat16


def test_per_module_wraps_torchs_memtracker_across_iterations():
    model = mlp(64, 128, 10)
    opt = adam(model)
    with MemoryTracker(model, opt, per_module=True) as mt:
        for _ in range(2):  # MemTracker alone raises NotImplementedError on the second forward
            train_step(model, opt, mt, torch.randn(B, 64))
    assert mt.module_tracker is not None and len(mt.module_tracker.memory_tracking) > 0


def _rank_step(rank, world_size):
    import torch.distributed as dist
    from mgpu_helpers.runtime.launch import rank_device
    from mgpu_helpers.runtime.tracker import MemoryTracker
    model = mlp(16, 32, 4).to(rank_device())  # the device contract: what meets a collective lives there
    opt = adam(model)
    with MemoryTracker(model, opt) as mt:
        model(torch.randn(8, 16, device=rank_device())).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # in place: no new storage
        opt.step()
    return mt.breakdown(), sizes(model)


def test_inside_run_ranks():
    launch = pytest.importorskip("mgpu_helpers.runtime.launch")
    results = launch.run_ranks(_rank_step, 2, timeout=120)
    (P, n) = results[0][1]
    for got, _ in results:
        assert got["parameters"] == got["gradients"] == 4 * P
        assert got["optimizer_state"] == 8 * P + 4 * n


def test_fsdp2_on_a_fake_process_group_halves_per_rank_bytes():
    import torch.distributed as dist
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        model = mlp(64, 128, 64, 10)  # every parameter's first dimension is even: exact halves
        P, n = sizes(model)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = adam(model)
        with MemoryTracker(model, opt) as mt:
            for _ in range(2):
                train_step(model, opt, mt, torch.randn(B, 64))
                opt.zero_grad()
        got = mt.breakdown()
        assert got["parameters"] == 4 * P // 2
        assert got["optimizer_state"] == 8 * P // 2 + 4 * n
        assert mt.phase_peaks()["forward"] > 4 * P // 2  # layers are all-gathered (unsharded) in forward
    finally:
        dist.destroy_process_group()
