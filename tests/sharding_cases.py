"""Sharding cases for launched ranks: tp_cases.train_case under the collective recorder, with
what went over this rank's sharding group summed per operation (the wire level: what gloo was
asked to move) and, where dp > 1, the same for its dp group, so tests/test_sharding.py and
tests/test_sharding_all.py can assert what each stage communicates."""


def sharding_case(ckpt, out_dir, **kw):
    from paddletune.parallel import recorder
    from paddletune.parallel.topology import group_ranks
    from tp_cases import train_case

    with recorder.record() as log:
        result = train_case(ckpt, out_dir, **kw)
    for axis in ("sharding", "dp"):   # (dp: only where its degree is above 1)
        group = group_ranks(result["rank"], result["degrees"], axis)
        if len(group) > 1 or axis == "sharding":
            result[f"{axis}_wire"] = _wire(log, group)
    return result


def _wire(log, group):
    wire = {}
    for e in log:
        if e["level"] == "pg" and e["ranks"] == group and e["op"] != "barrier":
            w = wire.setdefault(e["op"], {"calls": 0, "numel": 0, "dtypes": []})
            w["calls"] += 1
            w["numel"] += sum(_numel(s) for s in e["shapes"])
            w["dtypes"] = sorted(set(w["dtypes"]) | set(e["dtypes"]))
            if "float32" in e["dtypes"]:   # each float32 call's element count, in order
                w.setdefault("float32_numels", []).append(sum(_numel(s) for s in e["shapes"]))
    return wire


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def offload_case(ckpt, out_dir, **kw):
    """sharding_case, and after each of paddle's stage-3 steps what its offload path holds
    (group_sharded.GroupShardedStage3.step wrapped for the run): paddle's offload flags (the
    GroupShardedStage3 wrapper, the optimizer wrapper), per trainable slice whether it has a float32
    master on the host and whether the tensor the trainer's AdamW updated shares that master's
    memory, and where the AdamW moments live."""
    from paddletune.parallel import group_sharded as gs

    facts, original = [], gs.GroupShardedStage3.step

    def step(self, optimizer, named, grads, update):
        out = original(self, optimizer, named, grads, update)
        masters = {n: getattr(p, "master_weight", None) for n, p in self.sliced.items() if p.trainable}
        whole = {n: getattr(optimizer.params[n], "master_weight", None) for n in self.whole}
        facts.append({
            "wrapper_offload": bool(self.model._offload), "optimizer_offload": bool(self.opt.offload),
            "trainable_slices": len(masters),
            "host_masters": sum(m is not None and m.place.is_cpu_place() and str(m.dtype) == "paddle.float32"
                                for m in masters.values()),
            "update_on_master": sum(m is not None and optimizer.targets[n].data_ptr() == m.data_ptr()
                                    for n, m in masters.items()),
            "moments_on_host": all(t.place.is_cpu_place() for d in (optimizer.exp_avg, optimizer.exp_avg_sq)
                                   for t in d.values()),
            # tensors paddle keeps whole (at most segment_size elements): the parameter itself is
            # its host master during the step
            "whole": len(whole),
            "whole_on_master": sum(m is not None and optimizer.targets[n].data_ptr() == m.data_ptr()
                                   for n, m in whole.items()),
            "frozen_slices_on_host": all(p.fw_storage.place.is_cpu_place() for p in self.sliced.values()
                                         if not p.trainable and getattr(p, "fw_storage", None) is not None)})
        return out

    gs.GroupShardedStage3.step = step
    try:
        result = sharding_case(ckpt, out_dir, **kw)
    finally:
        gs.GroupShardedStage3.step = original
    result["offload_facts"] = facts
    return result
