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
