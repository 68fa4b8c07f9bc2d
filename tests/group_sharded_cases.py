"""paddle's group_sharded_parallel (stage 2 "os_g", stage 3 "p_g_os") on launched CPU ranks
through parallel/cpu_compat.py's shim 4, against one process at the same global batch computed
in the same worker (plain paddle AdamW on the whole batch, same initial weights).

A frozen two-layer float backbone (stop_gradient, as PEFT leaves it) feeds a trainable head, so
stage 3's sharding of frozen weights is measured: this rank's resident elements of each
parameter between steps (its slice in `fw_storage` when paddle sharded it, else the whole
tensor when it still holds storage)."""
import numpy as np

STEPS, BATCH = 3, 8


def _model(seed):
    import paddle

    paddle.seed(seed)
    model = paddle.nn.Sequential(paddle.nn.Linear(16, 128), paddle.nn.Tanh(), paddle.nn.Linear(128, 96),
                                 paddle.nn.Tanh(), paddle.nn.Linear(96, 8))
    for layer in (model[0], model[2]):   # the frozen backbone
        for p in layer.parameters():
            p.stop_gradient = True
    return model


def _data(step):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, 16)).astype("float32"), rng.standard_normal((BATCH, 8)).astype("float32")


def _optimizer(model):
    import paddle

    return paddle.optimizer.AdamW(learning_rate=0.01, weight_decay=0.01,
                                  parameters=[p for p in model.parameters() if not p.stop_gradient])


def _resident(p):
    """Elements of p this rank holds now: its stage-3 slice, or the tensor when it has storage."""
    fw = getattr(p, "fw_storage", None)
    if fw is not None:
        return int(fw._numel())
    return int(p._numel()) if p._is_initialized() else 0


def reference():
    """One process, the whole batch per step: (losses, {name: array})."""
    import paddle

    model, losses = _model(0), []
    opt = _optimizer(model)
    for s in range(STEPS):
        x, y = _data(s)
        loss = ((model(paddle.to_tensor(x)) - paddle.to_tensor(y)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


def group_sharded_case(level, segment_size=0):
    """level: "os_g" / "p_g_os"; segment_size: paddle's (tensors of at most that many elements
    stay whole under stage 3; its default 2**20 shards nothing here)."""
    import paddle
    import paddle.distributed as dist

    from paddletune import parallel
    from paddletune.parallel import cpu_compat

    ref_losses, ref_params = reference()
    topo = parallel.init()
    installed = cpu_compat.install_group_sharded()
    from paddle.distributed.sharding import group_sharded_parallel

    model = _model(0)
    names = [n for n, _ in model.named_parameters()]
    frozen = {n: int(p._numel()) for n, p in model.named_parameters() if p.stop_gradient}
    params = dict(model.named_parameters())
    wrapped, opt, _ = group_sharded_parallel(model, _optimizer(model), level=level, segment_size=segment_size)
    r, n = topo.rank, topo.world_size
    per = BATCH // n
    losses, held = [], []
    for s in range(STEPS):
        x, y = _data(s)
        mine = slice(r * per, (r + 1) * per)   # this rank's share of the global batch
        loss = ((wrapped(paddle.to_tensor(x[mine])) - paddle.to_tensor(y[mine])) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / n)
        held.append({k: _resident(params[k]) for k in frozen})   # between steps
    if level == "p_g_os":
        wrapped.get_all_parameters(with_freeze_param=True)   # (frozen ones too)
    got = {k: params[k].numpy().reshape(ref_params[k].shape) for k in names}
    return {"installed": installed, "losses": losses, "ref_losses": ref_losses,
            "max_param_diff": max(float(np.abs(got[k] - ref_params[k]).max()) for k in names),
            "wrapper": type(wrapped).__name__, "optimizer": type(opt).__name__,
            "frozen_numel": frozen, "frozen_held": held, "rank": r, "world": n,
            "align_bytes": _alignment()}


def _alignment():
    """paddle's stage-3 buffer alignment on this device, in bytes (a slice is padded to it)."""
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage3 as s3

    return s3.alignment["cpu"]
