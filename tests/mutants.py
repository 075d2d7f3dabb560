"""The planted mistakes of every exercise, as data: read by tests/test_mutants.py (each mistake fails its check,
naming it) and tests/test_grading_course.py (one per notebook, graded as a class would be).

``EXERCISES["N.M"]``: the solution notebook (``solutions/<notebook>.ipynb``), the function its check grades,
and the mistakes. A mistake is textual edits applied in turn to the solution's exercise cell, the words the
check's failure must contain, and the seeds it is tried on: every seed of ``sweep_seeds()`` (``MGPU_SEEDS``:
2 in the fast tier, 20 in the full one), or the fixed seeds ``ONE``/``TWO`` for the mistakes that have been
proven only there: 8.x's secondary ones (a rank launch each); 12.1's (its draw changes nothing its judge
reads) and 12.2's (what names them is the same in every draw, or follows from the draw's edge case).
"""
from typing import NamedTuple


class Mistake(NamedTuple):
    edits: list                  # [(old, new), ...] applied in turn to the solution cell
    named: str                   # words the failure message must contain
    seeds: tuple | None = None   # None: every seed of sweep_seeds()


class Exercise(NamedTuple):
    notebook: str                # solutions/<notebook>.ipynb
    function: str                # what the check grades
    mistakes: list


ONE, TWO = (7,), (7, 8)

# --- 01 ---------------------------------------------------------------------------------------------------
RETURN_11 = ('return {"parameters": n * weight,\n            "gradients": n * weight,\n'
             '            "optimizer_state": n * (buffers * state + master)}')
RETURN_12 = "return batch * bytes_per_element * (relu_outputs + logits)"
# --- 03 ---------------------------------------------------------------------------------------------------
SUM_31 = "total = torch.stack([c.grad for c in copies]).sum(0)"
REDUCE_31 = "p.grad = total if p.grad is None else p.grad + total"
LOSS_31 = "loss = F.cross_entropy(torch.cat(outputs), targets)"
# --- 04 ---------------------------------------------------------------------------------------------------
DIVIDE_41 = "            p.grad /= world_size"
REDUCE_41 = "            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)   # every rank now holds the sum..."
RULE_42 = "if current and current_bytes + nbytes > bucket_cap_bytes:"
LAST_42 = "    if current:\n        buckets.append(current)\n"
# --- 05 ---------------------------------------------------------------------------------------------------
LOSS_51 = 'loss = loss_fn(model(x), y, reduction="sum") / n'
LOSS_52 = "loss = loss_fn(ddp_model(x), y) / k"
CTX_52 = "contextlib.nullcontext() if last else ddp_model.no_sync()"
# --- 06 ---------------------------------------------------------------------------------------------------
RESET_61 = "            self.clean_steps = 0\n            return False\n"
GROW_61 = "            self.scale_value *= self.growth_factor\n            self.clean_steps = 0\n"
UNSCALE_62 = "m.grad = p.grad.float() / loss_scale                   # fp32 and unscaled, BEFORE clipping\n"
CLIP_62 = "    torch.nn.utils.clip_grad_norm_(master, max_norm)\n"
# --- 07 ---------------------------------------------------------------------------------------------------
LOOP_71 = "    for start in range(0, len(blocks), k):\n"
CALL_71 = "x = checkpoint(run_segment, blocks[start:start + k], x, use_reentrant=False)"
CHECK_71 = "    if not 1 <= k <= len(blocks):\n"
# --- 08 ---------------------------------------------------------------------------------------------------
SYNC_81 = '            inner.update({k: v for k, v in outer.items() if k != "params"})'
MINE_81 = 'mine = {k: v for k, v in param_group.items() if k != "params"}'
RS_82 = "    reduce_scatter(shard, flat) "
# --- 09 ---------------------------------------------------------------------------------------------------
LOSS_91 = "out = F.cross_entropy(out, y) / n_micro "
START_91 = "start = rank * per + min(rank, extra)"
BACKWARD_91 = """        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)                # d(loss)/d(our output), from the next stage
            out.backward(grad)
        if not first:
            dist.send(x.grad, dst=rank - 1)              # d(loss)/d(our input), to the previous stage
"""
SEND_91 = "dist.send(out.detach(), dst=rank + 1)"
CHECK_91 = """    if len(inputs) % n_micro:
        raise ValueError(f"n_micro={n_micro} does not divide the batch of {len(inputs)} samples")
"""
W1_92 = "self.fc1.weight.copy_(dense.fc1.weight[rows])"
W2_92 = "self.fc2.weight.copy_(dense.fc2.weight[:, rows])"
CHECK_92 = """            if h % world_size:
                raise ValueError(f"hidden size h={h} is not divisible by world_size={world_size}")
"""
# --- 11 ---------------------------------------------------------------------------------------------------
FIT_111 = "fitting = [p for p in plans if p.device_bytes <= capacity]"
KEY_111 = 'key=lambda p: (p.config["world_size"], p.step_cost)'
# --- 12 ---------------------------------------------------------------------------------------------------
RAF_121 = "reshard_after_forward=2)"
PREFETCH_121 = "        block.set_modules_to_forward_prefetch([following])  # one block ahead"
ROOT_121 = "    fully_shard(model, mesh=mesh)  # then the root: the first and last Linear"
GET_122 = ("        model_sd, optim_sd = get_state_dict(model, optimizer)  # save: what to write; load: the template "
           "to fill")
SAVE_122 = "            dcp.save(state, checkpoint_id=path)  # each rank writes its own shards, rank 0 the metadata"
LOAD_122 = "            dcp.load(state, checkpoint_id=path)  # in place, into the template's tensors, resharded"
SET_122 = ('            set_state_dict(model, optimizer, model_state_dict=state["model"], '
           'optim_state_dict=state["optim"])')
STATE_122 = '        state = {"model": model_sd, "optim": optim_sd}'
FULL_122 = ("options=__import__('torch').distributed.checkpoint.state_dict.StateDictOptions("
            "full_state_dict=True, cpu_offload=True)")
RANK = '__import__("torch").distributed.get_rank()'

M = Mistake
EXERCISES = {
    "1.1": Exercise("01_where_memory_goes", "training_state_bytes", [
        M([('"adam": 2', '"adam": 1')], "Adam keeps TWO states"),
        M([("master = 4 if precision == \"mixed\" else 0", "master = 0")], "forgot the fp32 master copy"),
        M([(RETURN_11, 'return {"parameters": n, "gradients": n, "optimizer_state": n * (buffers + (master > 0))}')],
          "counted elements, not bytes"),
        M([('weight = {"fp32": 4, "bf16": 2, "mixed": 2}', 'weight = {"fp32": 4, "bf16": 4, "mixed": 4}')],
          "used fp32 (4 bytes)"),
        M([(RETURN_11, RETURN_11.replace('"parameters": n * weight', '"parameters": n * (weight + master)')
                                .replace("n * (buffers * state + master)", "n * buffers * state"))],
          "master copy counted under parameters (total right, split wrong)"),
        M([(RETURN_11, "return (n * weight, n * weight, n * (buffers * state + master))")],
          "returned a list; expected a dict with keys"),
    ]),
    "1.2": Exercise("01_where_memory_goes", "activation_bytes", [
        M([("(relu_outputs + logits)", "relu_outputs")], "forgot the output of the last Linear"),
        M([("(relu_outputs + logits)", "(2 * relu_outputs + logits)")], "pre-activations"),
        M([("(relu_outputs + logits)", "(relu_outputs + logits + widths[0])")], "counted the input batch"),
        M([('bytes_per_element = {"fp32": 4, "bf16": 2}[dtype]', "bytes_per_element = 4")],
          "4 bytes per element for bf16"),
        M([(RETURN_12, f"return float({RETURN_12[7:]})")], "returned a float; expected an int"),
    ]),
    "2.1": Exercise("02_measuring_memory", "peak_memory", [
        M([("return tracker.peak_bytes - before", "return tracker.current_bytes - before")],
          "returned the CURRENT bytes after the step"),
        M([("    tracker.reset_peak()", "    pass")], "forgot to reset the peak first"),
        M([("return tracker.peak_bytes - before", "return tracker.peak_bytes")], "included the baseline"),
    ]),
    "2.2": Exercise("02_measuring_memory", "peak_phase", [
        M([("peaks = t.phase_peaks()", "peaks = {phase: total for phase, total, _ in t.timeline}")],
          "largest memory at its END"),
        M([("return max(peaks, key=peaks.get)", "return next(iter(peaks))")], "returned simply the first phase"),
        M([("return max(peaks, key=peaks.get)", "return [max(peaks, key=peaks.get)]")],
          "returned a list; expected a str"),
        M([("    with MemoryTracker(model, optimizer) as t:",
            "    return 'backward' if len(x) > 64 else 'optimizer'\n    with MemoryTracker(model, optimizer) as t:")],
          "guessed the phase from the batch size"),
    ]),
    "3.1": Exercise("03_data_parallel", "data_parallel_step", [
        M([(SUM_31, SUM_31.replace(".sum(0)", ".mean(0)"))], "averaged the replica gradients instead of summing them"),
        M([(SUM_31, SUM_31 + " / n_replicas")], "averaged the replica gradients"),
        M([(LOSS_31, "loss = torch.stack([F.cross_entropy(o, t) for o, t in zip(outputs, targets.chunk(n_replicas))])"
                     ".mean()")], "averaged per-replica losses without weighting the unequal chunks"),
        M([(REDUCE_31, "pass")], "never copied back"),
        M([(REDUCE_31, "p.grad = torch.zeros_like(p)")], "forgot to copy the replica gradients back"),
        M([("chunks = inputs.chunk(n_replicas)", "chunks = inputs.tensor_split(n_replicas)")], "torch.chunk"),
        M([("outputs = list(pool.map(lambda replica, x: replica(x), replicas, chunks))",
            "outputs = [replica(x) for replica, x in zip(replicas, chunks)]")], "in the calling thread"),
        M([("replicas = [copy.deepcopy(model) for _ in chunks]", "replicas = [model for _ in chunks]")],
          "the original model ran forward itself"),
        M([("return loss.detach()", "return None")], "returned None; expected the loss"),
        # One shared copy runs every chunk: autograd sums the chunks' gradients into it, so copying its .grad
        # back gives the right numbers without the reduce the lesson is about. The check counts the modules.
        M([("replicas = [copy.deepcopy(model) for _ in chunks]",
            "shared = copy.deepcopy(model)\n    replicas = [shared for _ in chunks]"),
           (SUM_31, "total = copies[0].grad")], "one shared copy ran every chunk"),
    ]),
    "4.1": Exercise("04_ddp", "average_gradients", [
        M([(DIVIDE_41, "            pass")], "summed with all_reduce but not divided by the world size"),
        M([(DIVIDE_41, DIVIDE_41 + "\n" + DIVIDE_41)], "divided by the world size twice"),
        M([(DIVIDE_41, "            p.grad /= 2")], "divided by 2 instead of the world size"),
        M([("dist.all_reduce(p.grad,", "dist.all_reduce(p.data,"), (DIVIDE_41, "            p.data /= world_size")],
          "averaged .data instead of .grad"),
        M([("        if p.grad is not None:\n", "        if True:\n")], "unused parameter, whose .grad is None"),
        M([("        if p.grad is not None:\n", "        if p.grad is not None and p.dim() > 1:\n")], ".bias differ"),
        M([(REDUCE_41, "            if dist.get_rank() == 0 or p.dim() > 1:\n    " + REDUCE_41)],
          "the ranks' collectives do not match"),
    ]),
    "4.2": Exercise("04_ddp", "allreduce_bucketed", [
        M([(RULE_42, "if current:")], "one all_reduce per parameter (no bucketing)"),
        M([(RULE_42, RULE_42.replace(">", ">="))], "exactly at the cap (>= instead of >)"),
        M([("            g.copy_(flat[offset:offset + g.numel()].view_as(g))", "            pass")],
          "the reduced flat buffer was never copied back into .grad"),
        M([(LAST_42, "")], "forgot the last bucket"),
        M([("        flat /= world_size\n", "")], "not divided by the world size"),
        M([("p.grad for p in model.parameters() if p.grad is not None", "p.grad for p in model.parameters()")],
          "unused parameter, whose .grad is None"),
        M([("    for bucket in buckets:\n", "    for bucket in (buckets if dist.get_rank() else buckets[:1]):\n")],
          "the ranks' collectives do not match"),
    ]),
    "5.1": Exercise("05_gradient_accumulation", "accumulate_gradients", [
        M([(LOSS_51, "loss = loss_fn(model(x), y) / k")], "weighted each micro-batch's mean loss by 1/k"),
        M([(LOSS_51, "loss = loss_fn(model(x), y)")], "loss not divided by k"),
        M([("        loss.backward()", "        model.zero_grad()\n        loss.backward()")],
          "zero_grad inside the loop"),
        M([("    total = 0.0", "    model.zero_grad()\n    total = 0.0")], "zeroed the gradients already in .grad"),
        M([("n = int((targets != -100).sum())", "n = len(targets)")], "counted the padding"),
        M([(LOSS_51, "loss = loss_fn(model(x), y) / n")], "divided the micro-batch's MEAN loss by the count"),
        M([(LOSS_51, "loss = loss_fn(model(x), y) / len(x)")], "divided by the micro-batch size instead of k"),
        M([("zip(inputs.tensor_split(k), targets.tensor_split(k))", "[(inputs, targets)]")],
          "one forward over the whole batch"),
        M([("total += loss.item()", "total = loss.item()")], "returned only the last micro-batch's share"),
        M([("total += loss.item()", "total = total + loss")], "returned a tensor"),
        M([("        loss.backward()                      # adds into .grad: never zero it, here or before the loop\n"
            "        total += loss.item()\n    return total",
            "        total = total + loss\n    total.backward()\n    return total.item()")],
          "the losses were summed and backward called once"),
    ]),
    "5.2": Exercise("05_gradient_accumulation", "accumulate_ddp", [
        M([(CTX_52, "contextlib.nullcontext()")], "no no_sync"),
        M([(CTX_52, "ddp_model.no_sync()")], "no_sync on every micro-step, including the last"),
        M([(LOSS_52, "loss = loss_fn(ddp_model(x), y)")], "loss not divided by k"),
        M([("total += loss.item()", "total = loss.item()")], "returned only the last micro-batch's loss"),
        M([(f"        with {CTX_52}:   # forward AND backward inside\n            {LOSS_52}\n",
            f"        {LOSS_52}\n        with {CTX_52}:\n")], "the forward ran outside it"),
        M([("zip(inputs.tensor_split(k), targets.tensor_split(k))", "[(inputs, targets)]"),
           ("last = i == k - 1", "last = True"), (LOSS_52, "loss = loss_fn(ddp_model(x), y)")],
          "one forward over the whole batch"),
        M([("last = i == k - 1", "last = i == 0")], "synchronised on the FIRST micro-step instead of the last"),
        M([("import contextlib", "import contextlib\nimport torch.distributed as dist"),
           (CTX_52, "contextlib.nullcontext() if last or dist.get_rank() else ddp_model.no_sync()")],
          "the ranks' collectives do not match"),
        M([("            loss.backward()\n        total += loss.item()\n    return total",
            "            total = total + loss\n    total.backward()\n    return total.item()")],
          "the losses were summed and backward called once"),
    ]),
    "6.1": Exercise("06_mixed_precision", "DynamicLossScaler", [
        M([("if self.clean_steps == self.growth_interval:", "if self.clean_steps > self.growth_interval:")],
          "grew one step late"),
        M([(RESET_61, "            return False\n")], "not reset to 0 after an overflow"),
        M([(RESET_61 + "        optimizer.step()\n", "            self.clean_steps = 0\n        else:\n"
            "            optimizer.step()\n"), ("        return True", "        return not found_inf")],
          "counted the skipped step as a clean one"),
        M([(GROW_61, "            self.scale_value *= self.growth_factor\n")], "not reset to 0 after growing"),
        M([("not bool(torch.isfinite(p.grad).all())", "bool(torch.isinf(p.grad).any())")], "a nan was not detected"),
        M([("p.grad.div_(self.scale_value)", "p.grad")], "the gradients were not unscaled"),
        M([("            return False\n", "")], "the optimizer stepped although a gradient was inf"),
        M([("        for group in optimizer.param_groups:\n", "        for group in optimizer.param_groups[:1]:\n")],
          "only param_groups[0] was unscaled and checked"),
        # steps on an overflow but says it skipped: the weights turn nan and every later step skips; named
        # at the overflow (not as "a clean step was skipped" later)
        M([(RESET_61, "            self.clean_steps = 0\n"), ("        return True", "        return not found_inf")],
          "the optimizer stepped although a gradient was inf"),
    ]),
    "6.2": Exercise("06_mixed_precision", "mixed_precision_step", [
        M([(UNSCALE_62 + CLIP_62,
            "m.grad = p.grad.float()\n" + CLIP_62 + "    for m in master:\n        m.grad /= loss_scale\n")],
          "clipped the scaled gradients"),
        M([(UNSCALE_62, "m.grad = p.grad.float()\n")], "never divided by loss_scale"),
        M([("model(x.to(dtype)).float()", "model(x.to(dtype))")], "computed from 16-bit logits"),
        M([("            p.copy_(m)", "            pass")], "the model still has its old weights"),
        M([("            m.grad = None", "            pass")], "kept the fp32 gradient copies"),
        M([("    return loss.item()", "    return (loss * loss_scale).item()")], "returned the scaled loss"),
        M([("            m.grad = None", "            m.grad = p.grad = None")], "freed the 16-bit gradients"),
        M([("p.grad.float() / loss_scale", "(p.grad / loss_scale).float()")], "unscaled in 16 bits"),
        M([("model(x.to(dtype))", "model(x)")], "cast the batch to the model's dtype"),
        M([("    with torch.no_grad():\n        for m, p", "    if True:\n        for m, p")],
          "do it under torch.no_grad()"),
    ]),
    "7.1": Exercise("07_activation_checkpointing", "checkpoint_segments", [
        M([(LOOP_71, "    for start in range(len(blocks)):\n"), ("blocks[start:start + k]", "blocks[start:start + 1]")],
          "checkpointed every block on its own, whatever k"),
        M([("use_reentrant=False", "use_reentrant=True")],
          "use_reentrant=True with an input that does not require grad"),
        M([(CALL_71, "x = checkpoint(lambda seg=blocks[start:start + k]: run_segment(seg, x), use_reentrant=False)")],
          "the segment's input was not passed to checkpoint"),
        # the block range read from the loop's variables: at backward time it is the last segment's (with k = 1
        # there is no CheckpointError, only wrong gradients; either way the recomputed blocks name it)
        M([(CALL_71, "x = checkpoint(lambda h: run_segment(blocks[start:start + k], h), x, use_reentrant=False)")],
          "the recomputation ran the wrong blocks"),
        M([("use_reentrant=False)", "use_reentrant=False, preserve_rng_state=False)")], "preserve_rng_state=False"),
        M([(LOOP_71, "    blocks.eval()\n" + LOOP_71)], "dropout switched off (the blocks put in eval mode)"),
        M([(CALL_71, CALL_71.replace("use_reentrant=False)", "use_reentrant=False).detach().requires_grad_()"))],
          "a detach() of the segments' outputs"),
        M([(LOOP_71, "    for start in range(0, len(blocks), k + 1):\n"), ("start + k]", "start + k + 1]")],
          "segments of k + 1 blocks (off by one)"),
        M([(LOOP_71, "    x = blocks[0](x)\n    for start in range(1, len(blocks), k):\n")],
          "block 0 left out (segments started at block 1)"),
        M([(LOOP_71, "    for start in range(len(blocks)):\n"),
           (CALL_71, "x = checkpoint(blocks[start], x, use_reentrant=False) if start % k == 0 else blocks[start](x)")],
          "checkpointed only the blocks i with i % k == 0"),
        M([(LOOP_71, "    for start in range(0, len(blocks), k):\n        break\n"),
           ("    return x", "    return run_segment(blocks, x)")], "no checkpointing at all"),
        M([(LOOP_71, "    for start in range(0, len(blocks) - len(blocks) % k, k):\n")],
          "the last, shorter segment was never run"),
        M([(CHECK_71, "    if False:\n")], "must raise ValueError"),
    ]),
    "8.1": Exercise("08_sharding_zero", "ShardedOptimizer", [
        M([("                    dist.broadcast(p.data, src=r)", "                    pass")],
          "other ranks' updated parameters never arrived"),
        M([('mine["params"] = [p for p in fresh if self.owner[p] == self.rank]', 'mine["params"] = fresh')],
          "nothing is sharded"),
        M([(SYNC_81, "            pass")], "never reached the wrapped optimizer"),
        M([(SYNC_81, "            pass"), (MINE_81, "mine = {}")], "hyperparameters", ONE),
        M([("            if p not in self.owner and all(p is not q for q in fresh):", "            if True:")],
          "a tied tensor", ONE),
        M([("            self.local.add_param_group(mine)", "            pass")],
          "has optimizer state on no rank", ONE),
        M([("            raise TypeError(", "            print(")], "does not mention 'optimizer_cls'", ONE),
        M([("                raise ValueError(", "                print(")], "expected 'ValueError'", ONE),
        # Adam is nearly blind to a gradient's scale (2.9e-06 apart): the SGD case names it
        M([("        loss = self.local.step(closure)",
            "        [p.grad.div_(self.world) for p in self.owner if p.grad is not None]\n"
            "        loss = self.local.step(closure)")], "divided by the world size"),
        M([("        loss = self.local.step(closure)",
            "        [dist.all_reduce(p.grad) for p in self.owner if p.grad is not None]\n"
            "        loss = self.local.step(closure)")], "summed over the", ONE),
        # right values, nothing sharded on ranks 1..N-1: rank 0 owns (and keeps the state of) every parameter
        M([("            r = self.load.index(min(self.load))", "            r = 0")], "unbalanced: rank 0 owns"),
    ]),
    "8.2": Exercise("08_sharding_zero", "reduce_scatter_gradients", [
        M([("    return shard / world", "    return shard")], "summed over the ranks but not divided"),
        M([("        p.grad = None ", "        pass ")], "kept the full .grad"),
        M([("    flat = torch.nn.functional.pad(flat, (0, shard_len * world - flat.numel()))",
            "    flat = flat[:shard_len * world]"),
           ("shard_len = -(-flat.numel() // world)", "shard_len = flat.numel() // world")], "was not padded"),
        M([(RS_82, "    dist.all_reduce(flat); shard = flat[rank * shard_len:(rank + 1) * shard_len] #")],
          "all_reduce of the whole gradient, then a slice", ONE),
        # unequal shards (tensor_split, no padding): gloo alone ends in "Connection reset by peer"
        M([("    flat = torch.nn.functional.pad(flat, (0, shard_len * world - flat.numel()))",
            "    chunks = list(flat.tensor_split(world))"),
           (RS_82, "    shard = torch.empty_like(chunks[rank]); dist.reduce_scatter(shard, chunks) #")],
          "sizes that do not pair up: rank 0: output"),
        M([(RS_82, "    shard.copy_(flat[rank * shard_len:(rank + 1) * shard_len]) #"),
           ("    return shard / world", "    return shard")], "never reduced across ranks", ONE),
        # right values from every rank's whole gradient: N times the traffic and the memory
        M([(RS_82, "    bufs = [torch.empty_like(flat) for _ in range(world)]; dist.all_gather(bufs, flat); "
                   "shard = sum(bufs)[rank * shard_len:(rank + 1) * shard_len] #")],
          "all_gather of every rank's whole gradient", ONE),
    ]),
    "9.1": Exercise("09_model_sharding", "pipeline_step", [
        M([(BACKWARD_91, "")], "the gradient was never sent back"),
        M([("dist.send(x.grad, dst=rank - 1)", "pass")], "waited for a message that never came"),
        M([(SEND_91, SEND_91 + "\n            dist.recv(torch.empty_like(out), src=rank + 1)")], "deadlocked"),
        M([(LOSS_91, "out = F.cross_entropy(out, y) ")], "loss not divided by n_micro"),
        M([("per, extra = divmod(len(model), world)", "per, extra = len(model) // world, 0")], "belong to no stage"),
        M([(START_91, "start = rank * per")], "neighbouring stages overlap"),
        M([(START_91, "start = rank * per + max(0, rank - (world - extra))"),
           ("per + (rank < extra)", "per + (rank >= world - extra)")], "the extra layers went to the last ranks"),
        M([("zip(inputs.chunk(n_micro), targets.chunk(n_micro))", "[(inputs, targets)]"),
           (LOSS_91, "out = F.cross_entropy(out, y) ")], "one forward over the whole batch"),
        M([(CHECK_91, "")], "every rank must raise ValueError"),
        # the two places learners stick: the received activation untracked; neighbours' backward orders differ
        M([("            x.requires_grad_() ", "            pass ")], "call x.requires_grad_() on it"),
        M([("    for x, out in saved: ", "    for x, out in (saved[::-1] if last else saved): ")],
          "must run the micro-batches' backwards in the same order"),
    ]),
    "9.2": Exercise("09_model_sharding", "parallel_mlp", [
        M([("dist.all_reduce(grad)", "pass")], "no all_reduce in backward (f)"),
        M([("dist.all_reduce(total)", "pass")], "no all_reduce in forward"),
        M([("return Reduce.apply(partial) + self.fc2.bias", "return Reduce.apply(partial + self.fc2.bias)")],
          "fc2's bias added on every rank before the all_reduce"),
        M([("return Reduce.apply(partial) + self.fc2.bias",
            "return torch.distributed.nn.functional.all_reduce(partial) + self.fc2.bias")],
          "g's backward all-reduces too"),
        M([(W1_92, "self.fc1.weight = nn.Parameter(dense.fc1.weight.chunk(world_size, dim=1)[rank].clone())")],
          "split W1 along dim 1"),
        M([(W2_92, "self.fc2.weight = nn.Parameter(dense.fc2.weight.chunk(world_size, dim=0)[rank].clone())")],
          "split W2 along dim 0"),
        M([(W1_92, "self.fc1.weight = nn.Parameter(dense.fc1.weight[rows])"),
           (W2_92, "self.fc2.weight = nn.Parameter(dense.fc2.weight[:, rows])")], "views of the dense weights"),
        M([(CHECK_92, "")], "every rank must raise ValueError"),
        M([("            with torch.no_grad():                    # copies", "            if True:  # copies")],
          "under `with torch.no_grad():`"),
    ]),
    "10.1": Exercise("10_data_loading", "shard_indices", [
        M([("return order[rank:total:world_size]", "return order[rank * per_rank:(rank + 1) * per_rank]")],
          "contiguous blocks per rank"),
        M([("manual_seed(seed + epoch)", "manual_seed(seed)")], "set_epoch forgotten"),
        M([("        order = (order * -(-total // n))[:total]", "        pass")], "no padding"),
        M([("(order * -(-total // n))[:total]", "(order + order[:total - n])")],
          "padding that repeats the index list only once"),
        M([("    if drop_last and n % world_size:", "    if False:"), ("    if drop_last:\n", "    if False:\n")],
          "drop_last ignored"),
        # neither padded nor dropped (order[rank::world_size]): named "no padding" whichever case fails first
        # (it was unnamed when a drop_last=True case came first, under 4 of 20 seeds)
        M([("    if drop_last and n % world_size:",
            "    return order[rank::world_size]\n    if drop_last and n % world_size:")], "no padding"),
    ]),
    "11.1": Exercise("11_capstone_fit_the_budget", "choose_plan", [
        M([(FIT_111, FIT_111.replace("<=", "<"))], "a plan whose device total equals the capacity fits"),
        M([(FIT_111, 'fitting = [p for p in plans if p.device_bytes * p.config["world_size"] <= capacity]')],
          "the capacity is per device"),
        M([(FIT_111, FIT_111.replace("p.device_bytes", "p.peak_bytes"))],
          "a card must hold more than the allocated peak"),
        M([(KEY_111, "key=lambda p: p.step_cost")], "the lowest step cost first, ignoring the number of ranks"),
        M([(KEY_111, 'key=lambda p: p.config["world_size"]')], "fewest ranks, but not the lowest step cost"),
        M([(KEY_111, "key=lambda p: p.device_bytes")], "the plan with the smallest device total"),
        M([("        return None", "        return min(plans, key=lambda p: p.device_bytes)")],
          "when nothing fits, return None"),
        M([(f"return min(fitting, {KEY_111})", f"return min(fitting, {KEY_111}).config")],
          "expected one of the Plan objects"),
    ]),
    # 12.1's judge reads bytes, the forward's issue order and which modules are units; its draw is only the
    # model's and the batch's values, which none of those depend on (tests/test_mutants.py proves it): two seeds
    # say as much as twenty, which took 219 s of 4 profiled ranks on 2 cores.
    "12.1": Exercise("12_fsdp2_in_practice", "shard_for_budget", [
        M([(RAF_121, "reshard_after_forward=True)")], "the communication budget was missed", TWO),
        M([(RAF_121, "reshard_after_forward=False)")], "the memory budget was missed", TWO),
        M([(PREFETCH_121, "        pass")], "no explicit forward prefetch", TWO),
        M([(PREFETCH_121, "        block.set_modules_to_forward_prefetch(units[units.index(block) + 1:][:2])")],
          "prefetched two blocks ahead", TWO),
        M([(ROOT_121, "    pass")], "the root is not a fully_shard unit", TWO),
    ]),
    # 12.2's draw is the model's and the batches' values, the steps before the save and the lr set. What names
    # most mistakes below reads none of them: the checkpoint's files, its metadata, which tensors are stored
    # whole or in part and the bytes gathered follow from the ranks and the model's shapes (the same in every
    # draw), and a load that did nothing leaves exactly the new model's initial parameters. The two about Adam's
    # state and lr are named by the judge's own one-process rerun of that mistake (Adam restarted; Adam at the
    # fresh lr), equal to the mutant's parameters in every draw, and told from the right run by the draw's edge
    # case (steps before the save, an lr other than the fresh one: tests/test_mutants.py, in every draw; Adam's
    # steps then differ by about the lr, 1e-3, against the judge's rtol of 1e-5). Two seeds say as much as
    # twenty (a seed costs two launches of 2-4 FSDP2 ranks: 20 took 59 s each on 2 busy cores).
    "12.2": Exercise("12_fsdp2_in_practice", "ShardedCheckpoint", [
        M([(STATE_122, '        state = {"model": model_sd}'),
           (SET_122, SET_122.replace('state["optim"]', "optim_sd"))],
          "optimizer state was not saved or not loaded", TWO),
        M([(LOAD_122, "            pass  #")], "nothing was loaded", TWO),
        M([(SET_122, "            pass")], "the learning rate was not restored", TWO),
        M([(SAVE_122, f"            __import__('torch').save(state, f'{{path}}/rank{{{RANK}}}.pt')")],
          "each rank's shards were written with torch.save", TWO),
        M([(GET_122, f"        model_sd, optim_sd = get_state_dict(model, optimizer, {FULL_122})"),
           (SAVE_122, f"            {RANK} == 0 and __import__('torch').save(state, f'{{path}}/model.pt')")],
          "the whole model was gathered to one rank", TWO),
        M([(GET_122, "        model_sd, optim_sd = get_state_dict(model, optimizer, "
                     f"{FULL_122.replace(', cpu_offload=True', '')})")],
          "a rank held whole parameters while saving", TWO),
        M([(SAVE_122, f"            {RANK} == 0 and dcp.save(state, checkpoint_id=path, no_dist=True)")],
          "only some ranks' shards are in the checkpoint", TWO),
        # the optimizer's own state_dict(): keyed by position, right only while the parameter order is the same
        # (every draw has the case whose optimizer lists them in reverse: two seeds say as much as twenty)
        M([(GET_122, "        model_sd, _ = get_state_dict(model, optimizer); optim_sd = optimizer.state_dict()")],
          "keyed by position", TWO),
    ]),
}
