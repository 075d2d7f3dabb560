"""Notebook 03 -- how ``nn.DataParallel`` works (scatter, replicate, parallel_apply, gather on device 0), what
it costs device 0, and why DDP replaced it. On a CPU ``nn.DataParallel`` just calls the module (its parts
refuse CPU tensors), so exercise 3.1 (``checks.data_parallel``) writes the mechanism over CPU replicas, and
:func:`simulate_data_parallel` runs a thread per simulated device, each under its own :class:`MemoryTracker`
(a dispatch mode: thread-local). The script (DDP): ``torchrun --nproc-per-node 2 -m mgpu_helpers.data_parallel``
"""
import copy
import timeit
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from .memory import make_optimizer, torch_threads
from .runtime.launch import rank_device, script_args, torchrun_main
from .runtime.plots import stacked_bars
from .runtime.tracker import MemoryTracker


# A small "language-model head" whose logits (tokens x vocab) outweigh its parameters, as in real LMs:
# what makes gathering them on device 0 expensive.
DEMO = {"tokens": 512, "d_model": 64, "hidden": 256, "vocab": 8192}


def make_problem(tokens, d_model, hidden, vocab, seed=0, dtype=torch.float32):
    """(model, inputs, targets): Linear -> Tanh -> Linear over ``tokens`` rows, classes = ``vocab``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_model, hidden), nn.Tanh(), nn.Linear(hidden, vocab)).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, d_model, generator=g, dtype=dtype)
    return model, x, torch.randint(0, vocab, (tokens,), generator=g)


def single_device_grads(model, x, y, per_chunk=None):
    """Gradients of the mean cross-entropy on a copy of ``model`` (the reference); ``per_chunk=n``: the mean of n
    chunks' mean losses instead, a common mistake."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)  # a copy would carry over any .grad already there
    pairs = list(zip(x.chunk(per_chunk), y.chunk(per_chunk))) if per_chunk else [(x, y)]
    loss = torch.stack([F.cross_entropy(m(a), b) for a, b in pairs]).mean()
    loss.backward()
    return loss.detach(), [p.grad for p in m.parameters()]


class LossInside(nn.Module):
    """The fix: the replicas compute their share of the loss, so only n numbers are gathered on device 0.
    Each returns sum-of-losses / total rows (not its chunk's mean), so the shares add up to the mean."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y, total: int):
        return (F.cross_entropy(self.model(x), y, reduction="sum") / total).reshape(1)


class SimDevice:
    """A thread standing in for GPU ``index``: what its tasks allocate is counted by its own tracker."""

    def __init__(self, index, model, optimizer=None):
        self.model = model
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"device{index}")
        self.tracker = MemoryTracker(model, optimizer, device="cpu")
        self.run(self.tracker.__enter__)  # the mode is pushed on this device's thread only

    def run(self, fn, *args):
        return self.pool.submit(fn, *args).result()

    def close(self):
        self.run(self.tracker.__exit__, None, None, None)
        self.pool.shutdown()


def simulate_data_parallel(model, x, y, n, loss_inside=False, adam=False):
    """One DataParallel step over ``n`` simulated devices taking turns: the loss, the gradients and each device's
    peak, breakdown and phase peaks. ``adam=True``: then Adam's first step on device 0 (the only optimizer)."""
    xs, ys = x.chunk(n), y.chunk(n)
    replicas = [LossInside(model) if loss_inside else model]
    replicas += [copy.deepcopy(replicas[0]) for _ in xs[1:]]  # replicate: a full copy per extra device
    opt = make_optimizer("adam", model.parameters()) if adam else None
    devs = [SimDevice(i, r, opt if i == 0 else None) for i, r in enumerate(replicas)]
    for d in devs:
        d.run(d.tracker.mark, "forward")

    def forward(i):  # on device i: its chunk (scatter copies it over), forward, with loss_inside its share
        return devs[i].model(xs[i].clone(), ys[i].clone(), len(x)) if loss_inside else devs[i].model(xs[i].clone())
    outs = [d.run(forward, i) for i, d in enumerate(devs)]
    devs[0].run(devs[0].tracker.mark, "gather + loss")
    if loss_inside:
        loss = devs[0].run(lambda: torch.cat([o.detach() for o in outs]).sum())  # n numbers on device 0
        grads_out = [torch.ones(1)] * n
    else:
        def gather_and_loss():  # all the logits copied onto device 0, the loss and its gradient there
            gathered = torch.cat([o.detach() for o in outs]).requires_grad_()
            loss = F.cross_entropy(gathered, y)
            loss.backward()
            return loss.detach(), gathered.grad
        loss, grad = devs[0].run(gather_and_loss)
        grads_out = list(grad.split([len(c) for c in xs]))
        del grad
    for i, d in enumerate(devs):  # backward on each device, from its slice of the gathered gradient
        d.run(d.tracker.mark, "backward")
        d.run(lambda i=i: outs[i].backward(grads_out[i].clone()))
    del outs, grads_out
    devs[0].run(devs[0].tracker.mark, "reduce")

    def reduce():  # ReduceAddCoalesced: each replica's gradients copied to device 0 and added
        for p, *copies in zip(replicas[0].parameters(), *(r.parameters() for r in replicas[1:])):
            for c in copies:
                p.grad += c.grad.clone()
    devs[0].run(reduce)
    if opt:
        devs[0].run(devs[0].tracker.mark, "optimizer")
        devs[0].run(opt.step)
    ends = [d.tracker.breakdown() for d in devs]  # what each device holds when the step is over
    for d in reversed(devs):  # exit in reverse order: each tracker restores what the one before patched
        d.close()
    return {"loss": loss, "grads": [p.grad for p in model.parameters()],
            "devices": [{"peak": d.tracker.peak_bytes, "breakdown": d.tracker.peak_breakdown(),
                         "phases": d.tracker.phase_peaks(), "end": e} for d, e in zip(devs, ends)]}


def device_table(devices, name="device", cols=("parameters", "gradients", "activations", "other")):
    """Print each device's peak and the breakdown at its peak, in MiB (exact bytes: deterministic)."""
    print(f"{name:>8} {'peak MiB':>10}" + "".join(f"{c:>12}" for c in cols))
    for i, d in enumerate(devices):
        print(f"{i:>8} {d['peak'] / 2**20:>10.2f}" + "".join(f"{d['breakdown'][c] / 2**20:>12.2f}" for c in cols))


def device_bars(devices, title="", ax=None, name="device"):
    """Stacked bars, one per device (or rank), of the breakdown at each one's peak."""
    ax = stacked_bars({f"{name} {i}": d["breakdown"] for i, d in enumerate(devices)}, title=title, ax=ax)
    ax.legend(loc="upper right", fontsize=8, frameon=False)  # device 0's tall bar sits on the left
    return ax


def real_data_parallel_memory(n_gpus, loss_inside=False, spec=DEMO, seed=0):
    """Each GPU's peak above what it held before a DataParallel step (the second: the first warms cuBLAS up),
    the loss and the gradients (on CPU)."""
    model, x, y = make_problem(**spec, seed=seed)
    model = model.cuda(0)
    net = nn.DataParallel(LossInside(model) if loss_inside else model, device_ids=list(range(n_gpus)))
    peaks = []
    for _ in range(2):  # x stays on the CPU: scatter copies each chunk straight to its GPU
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = [torch.cuda.memory_allocated(i) for i in range(n_gpus)]
        for i in range(n_gpus):
            torch.cuda.reset_peak_memory_stats(i)
        loss = net(x, y, len(x)).sum() if loss_inside else F.cross_entropy(net(x), y.cuda(0))
        loss.backward()
        torch.cuda.synchronize()
        peaks = [torch.cuda.max_memory_allocated(i) - before[i] for i in range(n_gpus)]
    return {"loss": loss.detach().cpu(), "grads": [p.grad.cpu() for p in model.parameters()], "peaks": peaks}


def _best_of(fn, repeat=5):
    return min(timeit.repeat(fn, number=1, repeat=repeat))  # the least disturbed of `repeat` timings


def time_replicate(hiddens=(128, 256, 512, 1024), layers=4, batch=32, repeat=3):
    """Per model width: parameters, seconds to replicate (deepcopy) it, seconds for one training step."""
    rows = []
    for h in hiddens:
        model = nn.Sequential(*[nn.Linear(h, h) for _ in range(layers)])
        x = torch.randn(batch, h)
        rows.append({"params": sum(p.numel() for p in model.parameters()),
                     "replicate_s": _best_of(lambda: copy.deepcopy(model), repeat),
                     "step_s": _best_of(lambda: model(x).square().mean().backward(), repeat)})
    return rows


def gil_demo(n=2):
    """Seconds for n replicas' forwards in turn vs in n threads: the GIL serialises tiny ops, big matmuls release it."""
    out = {}
    # One intra-op thread per replica, as one GPU each; per thread, so each worker sets it too (else torch's
    # intra-op threads fill the cores and leave the Python threads nothing to run in parallel on).
    with torch_threads(1), torch.no_grad(), \
            ThreadPoolExecutor(n, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        for name, layer, x in (("Python-bound (100 tiny layers)", lambda: nn.Sequential(
                *[nn.Linear(8, 8) for _ in range(100)]), torch.randn(2, 8)),
                ("kernel-bound (one big matmul)", lambda: nn.Linear(1024, 1024), torch.randn(512, 1024))):
            ms = [layer() for _ in range(n)]
            out[name] = {"sequential_s": _best_of(lambda: [m(x) for m in ms]),
                         "threads_s": _best_of(lambda: list(pool.map(lambda m: m(x), ms)))}
    return out


def ddp_step(rank, world_size, spec=None, seed=0, adam=False):
    """One DDP step on this rank's share: its peak, breakdown and gradients (on CPU); ``adam``: then Adam's step."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = rank_device()
    model, x, y = make_problem(**(spec or DEMO), seed=seed)
    model = model.to(dev)
    xr, yr = x.chunk(world_size)[rank].to(dev), y.chunk(world_size)[rank].to(dev)
    opt = make_optimizer("adam", model.parameters()) if adam else None
    with MemoryTracker(model, opt, device=dev) as mt:
        # Made inside: its buckets count. init_sync=False: no initial broadcast (every rank built the same weights),
        # whose buffer gloo's worker thread frees when it likes -- under load, inside one rank's forward.
        ddp = DDP(model, init_sync=False)
        F.cross_entropy(ddp(xr), yr).backward()  # DDP averages grads: equal chunks give the full-batch mean
        if opt:
            opt.step()  # the step changes the parameters, not .grad
        end = mt.breakdown()
    return {"peak": mt.peak_bytes, "breakdown": mt.peak_breakdown(), "end": end,
            "grads": [p.grad.detach().cpu() for p in model.parameters()]}


if __name__ == "__main__":  # DataParallel's successor, as notebook 04 builds it
    from .ddp import _demo

    script_args(__doc__)
    torchrun_main(_demo)
