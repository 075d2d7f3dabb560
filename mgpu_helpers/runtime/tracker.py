"""Device-agnostic memory accounting with the semantics of ``torch.cuda.memory_allocated()``::

    with MemoryTracker(model, opt) as mt:            # device=None: the model's device, else "cpu"
        loss = model(x).sum(); mt.mark("backward"); loss.backward(); mt.mark("step"); opt.step()
    mt.peak_bytes, mt.peak_breakdown(), mt.phase_peaks(), mt.timeline

Counted: each distinct live storage on the tracked device made inside the ``with`` (views once), plus the
model's parameters, buffers and ``.grad`` and the optimizer's state at entry, by role (the first that fits):
parameters (and buffers), gradients, optimizer_state, activations (made in a forward of ``model``, recomputation
too), other (inputs, loss, temporaries). A role that shows late (AccumulateGrad adopts a temporary as ``.grad``,
Adam makes its state in ``step``) is carried back through the timeline and the peak breakdown. ``round_to=None``:
exact bytes on the CPU, 512-byte blocks on CUDA (``round_to=512`` on the CPU predicts a GPU). On CUDA
``current_bytes``/``peak_bytes`` read the allocator (kernels' scratch too), less what entry held beyond model and
optimizer; the breakdowns' ``other`` absorbs the difference.

Why not torch's ``torch.distributed._tools.mem_tracker.MemTracker``, whose design this follows? It labels by
*when* a tensor was made, not its role; counts a pre-entry tensor once touched in place; needs a reset between
forwards; has no timeline, phases or rounding off CUDA. ``per_module=True`` runs it as ``mt.module_tracker``.
"""

import os
import threading
import weakref

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import (TorchDispatchMode, is_traceable_wrapper_subclass,
                                          is_traceable_wrapper_subclass_type)
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
_RANK = {c: i for i, c in enumerate(CATEGORIES)}  # a storage only moves to a category ranked before its own
CUDA_BLOCK = 1 if int(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", 0)) else 512  # mem_tracker's rule
_CREATES = {torch.ops.aten.lift_fresh.default}  # torch.tensor(...) reaches dispatch already made, as an input


def _storages(t):
    # Plain tensors have one storage; wrapper subclasses (DTensor) keep theirs in inner tensors.
    if is_traceable_wrapper_subclass(t):
        return [s for a in t.__tensor_flatten__()[0] if isinstance(getattr(t, a), torch.Tensor)
                for s in _storages(getattr(t, a))]
    return [t.untyped_storage()]


class _Rec:
    __slots__ = ("nbytes", "cat", "born", "ref")


class MemoryTracker(TorchDispatchMode):
    """Live tensor bytes as ``torch.cuda.memory_allocated()`` counts them: ``current_bytes``, ``peak_bytes``
    (since entry or ``reset_peak()``), ``breakdown()``, ``peak_breakdown()``, ``mark()``, ``phase_peaks()``."""

    def __init__(self, model=None, optimizer=None, device=None, round_to=None, per_module=False):
        super().__init__()
        self.model, self.optimizer, self.per_module, self.module_tracker = model, optimizer, per_module, None
        device = torch.device(device or next((p.device for p in self._params()), "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self._cuda = device, device.type == "cuda"
        self.round_to = round_to or (CUDA_BLOCK if self._cuda else 1)
        self._lock = threading.RLock()  # frees can arrive from autograd's device threads
        self._recs, self._cats, self._total = {}, dict.fromkeys(CATEGORIES, 0), 0
        self._phase, self._phase_peaks, self._timeline = "forward", {}, []
        self._peak, self._peak_cats, self._peak_idx = 0, dict(self._cats), -1
        self._active, self._fwd_depth, self._in_opt, self._handles = False, 0, False, []
        self.events = None  # a list: every size change in order (planner.allocator replays a fake trace's)

    def _params(self):  # an optimizer may hold parameters the model does not (or no model); tensors hash by id
        return list(dict.fromkeys([*(self.model.parameters() if self.model is not None else ()),
                                   *(p for g in getattr(self.optimizer, "param_groups", []) for p in g["params"])]))

    def _claim(self, tensors, cat, add=False):
        # Label the storages as `cat`; add=True also counts unseen ones (seeds; a .grad set by hand).
        for t in tensors:
            for st in _storages(t) if isinstance(t, torch.Tensor) else ():
                rec = self._recs.get(st._cdata)
                if rec is None and add and st.device == self.device:
                    self._add(st, cat)
                elif rec is not None and _RANK[cat] < _RANK[rec.cat]:
                    self._relabel(rec, cat)

    def _scan(self, state=False):
        self._claim([p.grad for p in self._params()], "gradients", add=True)
        if state and self.optimizer is not None:
            self._claim([v for s in self.optimizer.state.values() for v in s.values()], "optimizer_state",
                        add=True)

    def _sample(self):  # every change of the accounting makes one timeline sample
        self._timeline.append((self._phase, self._total, dict(self._cats)))
        if self._total > self._phase_peaks.get(self._phase, -1):
            self._phase_peaks[self._phase] = self._total
        if self._total > self._peak:
            self._peak, self._peak_cats, self._peak_idx = self._total, dict(self._cats), len(self._timeline) - 1

    def _change(self, rec, delta):
        self._cats[rec.cat] += delta
        self._total += delta
        if self.events is not None and delta:  # (storage, change, live at entry, phase, category)
            self.events.append((id(rec), delta, not self._active, self._phase, rec.cat))
        if delta and self._active:  # the seeds at entry make a single sample, taken by __enter__
            self._sample()

    def _add(self, st, cat):
        rec, key = _Rec(), st._cdata  # key: the StorageImpl's address; views share the storage object
        rec.nbytes, rec.cat, rec.born = 0, cat, len(self._timeline)
        rec.ref = weakref.ref(st, lambda ref: self._on_free(key, ref))
        self._recs[key] = rec
        self._resized(rec, st)

    def _resized(self, rec, st):
        n = -(-st.nbytes() // self.round_to) * self.round_to  # 0 bytes: no block, as on CUDA
        if n != rec.nbytes:
            n, rec.nbytes = n - rec.nbytes, n
            self._change(rec, n)

    def _on_free(self, key, ref):
        with self._lock:
            rec = self._recs.get(key)
            if self._active and rec is not None and rec.ref is ref:
                del self._recs[key]
                self._change(rec, -rec.nbytes)

    def _relabel(self, rec, cat):
        # Now, in every sample since the storage was made, and at the peak if it lived then: the role all along.
        old, n, rec.cat = rec.cat, rec.nbytes, cat
        for cats in [self._cats] + [s[2] for s in self._timeline[rec.born:]] + (
                [self._peak_cats] if self._peak_idx >= rec.born else []):
            cats[old] -= n
            cats[cat] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let DTensor & co. run; their local ops come back through here
        out = func(*args, **(kwargs or {}))
        if not self._active or active_fake_mode() is not self._fake_on_entry:
            return out  # e.g. DTensor's sharding propagation, or a FakeTensorMode: no real memory
        inputs, cat = None, "other" if self._in_opt or not self._fwd_depth else "activations"
        with self._lock:
            for t in tree_leaves(out):
                for st in _storages(t) if isinstance(t, torch.Tensor) else ():
                    rec = self._recs.get(st._cdata)
                    if rec is not None:
                        self._resized(rec, st)  # out= variants and resize_ reallocate in place
                    elif st.device == self.device:
                        if inputs is None:  # an unseen storage that was an input existed before entry
                            inputs = set() if func in _CREATES else {s._cdata for a in tree_leaves(
                                (args, kwargs)) if isinstance(a, torch.Tensor) for s in _storages(a)}
                        if st._cdata not in inputs:
                            self._add(st, cat)
        return out

    def _pre_forward(self, module, args):
        self._fwd_depth += 1
        with self._lock:  # FSDP2 swaps all-gathered tensors in as the parameters: parameters too
            self._claim([*module.parameters(recurse=False), *module.buffers(recurse=False)], "parameters")

    def _post_forward(self, *_):
        self._fwd_depth -= 1

    def _step_hook(self, in_opt):
        def hook(*_):  # before optimizer.step (in_opt) and after it
            with self._lock:
                self._scan(state=not in_opt)  # after: Adam has made its state lazily inside step
                self._in_opt = in_opt
        return hook

    def _grad_hook(self, p):  # AccumulateGrad has just made p.grad, or adopted a backward temporary
        with self._lock:
            self._claim([p.grad], "gradients", add=True)

    def _resize_hook(self, orig):
        def resize_(st, size):  # the dispatcher never sees UntypedStorage.resize_ (FSDP2 frees with it)
            before = st.nbytes()
            r = orig(st, size)
            if self._active and st.device == self.device:
                with self._lock:  # FSDP2 re-grows storages it made before the `with`: new bytes, counted
                    rec = self._recs.get(st._cdata)
                    if rec is not None:
                        self._resized(rec, st)
                    elif st.nbytes() != before:  # a new block ("other" until a forward claims it)
                        self._add(st, "other")
            return r
        return resize_

    def __enter__(self):
        self._fake_on_entry = active_fake_mode()
        with self._lock:
            buffers = list(self.model.buffers()) if self.model is not None else []
            self._claim(buffers + self._params(), "parameters", add=True)
            self._scan(state=True)
            self._sample()
        h = self._handles
        for m in self.model.modules() if self.model is not None else ():
            h += [m.register_forward_pre_hook(self._pre_forward),
                  m.register_forward_hook(self._post_forward, always_call=True)]
        h += [p.register_post_accumulate_grad_hook(self._grad_hook) for p in self._params()
              if p.requires_grad and p.is_leaf]
        if self.optimizer is not None:
            h += [self.optimizer.register_step_pre_hook(self._step_hook(True)),
                  self.optimizer.register_step_post_hook(self._step_hook(False))]
        self._orig_resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = self._resize_hook(self._orig_resize)
        if self._cuda:
            self._extra = torch.cuda.memory_allocated(self.device) - self._total
            torch.cuda.reset_peak_memory_stats(self.device)
        self._active = True
        super().__enter__()
        if self.per_module:
            from torch.distributed._tools.mem_tracker import MemTracker  # slow import: only when asked
            mt = self.module_tracker = MemTracker()
            mt.track_external(*[o for o in (self.model, self.optimizer) if o is not None])

            def reset(module, args):  # registered before MemTracker's global hooks, so it runs first
                if module is self.model and torch._C._current_graph_task_id() == -1:
                    mt.reset_mod_stats()
            h.append(torch.nn.modules.module.register_module_forward_pre_hook(reset))
            mt.__enter__()
        return self

    def __exit__(self, *exc):
        if self.module_tracker is not None:
            self.module_tracker.__exit__(*exc)
        super().__exit__(*exc)
        with self._lock:
            self._scan(state=True)
            self._frozen = (self.current_bytes, self.peak_bytes)
            self._active = False
            self._recs.clear()
        torch.UntypedStorage.resize_ = self._orig_resize
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def mark(self, label: str) -> None:
        """Label the samples from now on (``"forward"`` until the first mark)."""
        with self._lock:
            if self._active:
                self._scan()  # gradients set by hand (p.grad = ...) count as gradients from here on
            self._phase = label
            self._sample()

    accounted_bytes = property(lambda self: self._total)
    accounted_peak_bytes = property(lambda self: self._peak)
    current_bytes = property(lambda self: self._read(self._total, torch.cuda.memory_allocated, 0))
    peak_bytes = property(lambda self: self._read(self._peak, torch.cuda.max_memory_allocated, 1))
    timeline = property(lambda self: self._timeline,
                        doc="[(phase, total, {category: bytes})] after every allocation and free")

    def _read(self, accounted, allocator, i):
        if not self._cuda:
            return accounted
        return allocator(self.device) - self._extra if self._active else self._frozen[i]

    def reset_peak(self) -> None:
        """Like ``torch.cuda.reset_peak_memory_stats``: the peak becomes the current figure."""
        with self._lock:
            self._peak, self._peak_cats, self._peak_idx = self._total, dict(self._cats), len(self._timeline) - 1
            if self._cuda and self._active:
                torch.cuda.reset_peak_memory_stats(self.device)

    def breakdown(self) -> dict:
        """Current bytes per category; sums to ``current_bytes``."""
        with self._lock:
            if self._active:
                self._scan()
            cats = dict(self._cats)
        cats["other"] += self.current_bytes - self._total
        return cats

    def peak_breakdown(self) -> dict:
        """Bytes per category at the moment of the peak; sums to ``peak_bytes``."""
        cats = dict(self._peak_cats)
        cats["other"] += self.peak_bytes - self._peak
        return cats

    def phase_peaks(self) -> dict:
        """Peak bytes within each phase label, in the order the phases first appeared."""
        return dict(self._phase_peaks)
