"""Sharding cases for launched ranks: tp_cases.train_case under the collective recorder, with
what went over this rank's sharding group summed per operation (the wire level: what gloo was
asked to move), so tests/test_sharding.py can assert what each stage communicates."""


def sharding_case(ckpt, out_dir, **kw):
    from paddletune.parallel import recorder
    from paddletune.parallel.topology import group_ranks
    from tp_cases import train_case

    with recorder.record() as log:
        result = train_case(ckpt, out_dir, **kw)
    group = group_ranks(result["rank"], result["degrees"], "sharding")
    wire = {}
    for e in log:
        if e["level"] == "pg" and e["ranks"] == group and e["op"] != "barrier":
            w = wire.setdefault(e["op"], {"calls": 0, "numel": 0, "dtypes": []})
            w["calls"] += 1
            w["numel"] += sum(_numel(s) for s in e["shapes"])
            w["dtypes"] = sorted(set(w["dtypes"]) | set(e["dtypes"]))
            if "float32" in e["dtypes"]:   # each float32 call's element count, in order
                w.setdefault("float32_numels", []).append(sum(_numel(s) for s in e["shapes"]))
    result["sharding_wire"] = wire
    return result


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n
