"""Pipeline parallelism: the decoder split into stages, one 1F1B schedule over point-to-point sends.

Stage s of P holds a contiguous run of decoder blocks (`stage_layers`: as even as possible, the
first stages take the extra ones); the first stage also holds the embedding, the last the final
norm, the head and the loss. Every rank of a replica reads the same batch, so each stage builds
its own attention context (positions, masks, packed rows) from the micro-batch; only hidden
states [mb, S, H] travel forward and their gradients backward.

Schedule (1F1B, non-interleaved; M micro-batches = gradient_accumulation_steps):
    stage s runs w = min(P - 1 - s, M) warm-up forwards, then alternates one forward and one
    backward, then the remaining w backwards. At most P - s micro-batches are in flight on stage
    s (their activations kept for backward), whatever M is.
Each activation is preceded by a 4-number int64 header (its shape), so every micro-batch may have
its own length (padded SFT batches, packed rows): nothing is fixed at the first micro-batch.
gloo's sends block until the peer receives, so a forward send and a backward receive between the
same two stages are ordered by rank: the lower rank sends first, the higher receives first.

Why not paddle's pipelining schedules (paddle 3.3.1, measured here): a PipelineStage given its
input/output TensorMeta cannot run backward (KeyError in _shape_inference_bwd); without them it
runs a whole extra forward and backward on zeros at start (drawing from the RNG, so dropout masks
no longer match one process) and exchanges shapes with send_object_list (pickle), then fixes the
receive buffers for every later step. The communication here is two functions (send_activation /
recv_activation) over paddle.distributed.send / recv.

The loss: the last stage back-propagates loss_sum / N (N = target tokens of the global batch, as
without pipelining), so gradients equal the single-process run's; logged losses are broadcast.
"""
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn


def stage_layers(num_layers, num_stages, stage):
    """range of the decoder blocks of `stage`: 5 blocks on 2 stages -> [0, 3) and [3, 5)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class Absent(nn.Layer):
    """Placeholder for a part of the model another pipeline stage holds (no parameters)."""

    def __init__(self, what):
        super().__init__()
        self.what = what

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.what} lives on another pipeline stage")


def stage_parts(model, stage, num_stages):
    """[(module, kept?, what)] of the stage-divided parts of the model: every decoder block, the
    embedding (first stage, and the last when it is tied to the head), the final norm and head
    (last stage). Everything else (a prefix encoder) is on every stage."""
    keep = stage_layers(len(model.decoder_layers()), num_stages, stage)
    first, last = stage == 0, stage == num_stages - 1
    tied = model.get_output_embeddings() is None
    parts = [(layer, i in keep, f"decoder block {i}") for i, layer in enumerate(model.decoder_layers())]
    parts += [(model.get_input_embeddings(), first or (last and tied), "the embedding"),
              (model.final_norm(), last, "the final norm")]
    if not tied:
        parts.append((model.get_output_embeddings(), last, "the LM head"))
    return parts


def owned(model, stage, num_stages):
    """predicate(parameter name): whether this stage loads and trains the tensor."""
    absent = set()
    for module, kept, _ in stage_parts(model, stage, num_stages):
        if not kept:
            absent |= {id(p) for p in module.parameters()}
            absent |= {id(m) for m in module.sublayers(include_self=True)}
    names = {n for n, p in model.named_parameters() if id(p) in absent}
    quantized = {m.weight_name for m in model.sublayers() if id(m) in absent and getattr(m, "weight_name", None)}
    return lambda name: name not in names and name not in quantized


def prune_to_stage(model, stage, num_stages):
    """Replace what this stage does not hold by Absent modules (their parameters were never
    loaded: loading.load_model reads only the stage's). Done after PEFT wrapped the layers, so
    adapters are drawn as in one process and then dropped with the blocks they belong to. Names of
    what stays are unchanged (full-model names in checkpoints and exports)."""
    from ..peft.common import replace_module

    names = {id(m): n for n, m in model.named_sublayers()}
    layers = model.decoder_layers()
    for module, kept, what in stage_parts(model, stage, num_stages):
        if kept:
            continue
        if what.startswith("decoder block"):
            layers[int(what.rsplit(" ", 1)[1])] = Absent(what)
        else:
            replace_module(model, names[id(module)], Absent(what))


class Pipeline:
    """This rank's stage: p2p neighbours, the 1F1B step, eval forward, and what the Trainer needs
    (stage-local gradient norm, tied-embedding sync, logged-loss broadcast)."""

    def __init__(self, model, topo):
        self.model, self.topo = model, topo
        self.stage, self.num_stages = topo.pp_rank, topo.pp_degree
        ranks = topo.ranks("pp")
        self.prev = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage < self.num_stages - 1 else None
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        self.layer_ids = stage_layers(len(model.decoder_layers()), self.num_stages, self.stage)
        self.group = None if len(ranks) == topo.world_size else topo.groups["pp"]
        self.trace = None   # when a list: ("F"|"B", micro-batch) and sends/recvs, in order
        self.replicated = set()   # trainable names held whole on every stage (a prefix encoder)
        tied = model.get_output_embeddings() is None and self.num_stages > 1
        pairs = self._pair_groups(tied)
        # point-to-point goes over the 2-rank group of the two stages (see _pair_groups)
        self.prev_group = pairs.get((self.prev, topo.rank)) if self.prev is not None else None
        self.next_group = pairs.get((topo.rank, self.next)) if self.next is not None else None
        self.tied_group = pairs.get((ranks[0], ranks[-1])) if tied else None
        # the tied embedding's name where this stage holds a copy (first and last stage)
        self.tied_name = None
        if tied and (self.first or self.last):
            w = model.get_input_embeddings().weight
            self.tied_name = next(n for n, p in model.named_parameters() if p is w)

    def _pair_groups(self, tied):
        """{(rank a, rank b): 2-rank group} of this rank: its pairs of adjacent stages (and the
        {first, last stage} pair when the embedding is tied: its two copies get their gradients
        summed there), each family created collectively by topology.create_groups.

        Why point-to-point needs its own groups: a gloo process group gives every operation,
        sends and receives included, the next number of one per-group counter as its tag, so
        a collective matches only if every member issued equally many operations on the group
        before it. Sends over the world group break that whenever replicas exchange different
        numbers of activations (an evaluation whose last, short share leaves one data rank with
        no batch; pipelines of 3+ stages, whose middle stages send and receive more than the
        ends), and the next world collective (a checkpoint's all_gather) waits forever. On a
        pair group every send has its receive, so both counters stay equal."""
        from .topology import create_groups, group_ranks

        def stages(r):
            return group_ranks(r, self.topo.degrees, "pp")

        mine, ranks = {}, stages(self.topo.rank)
        for s in range(self.num_stages - 1):   # the boundary between stage s and s + 1
            g = create_groups(self.topo.rank, self.topo.world_size,
                              lambda r, s=s: [[stages(r)[s], stages(r)[s + 1]]])
            mine[(ranks[s], ranks[s + 1])] = g
        if tied and self.num_stages > 2:       # (two stages: the boundary pair is that pair)
            mine[(ranks[0], ranks[-1])] = create_groups(
                self.topo.rank, self.topo.world_size, lambda r: [[stages(r)[0], stages(r)[-1]]])
        return {pair: g for pair, g in mine.items() if self.topo.rank in pair}

    # ------------------------------------------------------------------ point to point
    def _log(self, *event):
        if self.trace is not None:
            self.trace.append(event)

    def _pair(self, peer):
        return self.prev_group if peer == self.prev else self.next_group

    def send_activation(self, t, peer, grad=False):
        if not grad:   # the receiver learns the shape first: every micro-batch may differ
            header = paddle.to_tensor(np.array(list(t.shape) + [0] * (4 - t.ndim) + [t.ndim], np.int64))
            dist.send(header, dst=peer, group=self._pair(peer))
        self._log("send_grad" if grad else "send", peer, list(t.shape))
        dist.send(t.contiguous() if hasattr(t, "contiguous") else t, dst=peer, group=self._pair(peer))

    def recv_activation(self, peer, like=None):
        """Receive an activation (shape from its header) or, with `like`, a gradient of its shape."""
        if like is None:
            header = paddle.zeros([5], "int64")
            dist.recv(header, src=peer, group=self._pair(peer))
            h = header.numpy().tolist()
            shape = h[:h[4]]
        else:
            shape = list(like.shape)
        buf = paddle.zeros(shape, "float32" if like is None else like.dtype)
        dist.recv(buf, src=peer, group=self._pair(peer))
        self._log("recv_grad" if like is not None else "recv", peer, shape)
        return buf

    def _exchange(self, send_t, recv_like, peer, grad_send):
        """One send and one receive with the same peer, lower rank sending first (gloo blocks)."""
        if self.topo.rank < peer:
            self.send_activation(send_t, peer, grad_send)
            return self.recv_activation(peer, recv_like)
        got = self.recv_activation(peer, recv_like)
        self.send_activation(send_t, peer, grad_send)
        return got

    # ------------------------------------------------------------------ compute
    def forward_stage(self, batch, h=None):
        """This stage's part of the forward for one micro-batch (tensors); returns hidden states
        (after the final norm on the last stage)."""
        m = self.model
        ids = batch["input_ids"]
        if self.first:
            h = m.embed(ids)
        ctx = m.context(ids.shape[0], ids.shape[1], batch.get("attention_mask"), batch.get("position_ids"),
                        None, batch.get("segment_ids"), h.dtype)
        h = m.run_layers(h, ctx, [m.decoder_layers()[i] for i in self.layer_ids])
        return m.final_norm()(h) if self.last else h

    def _local(self):
        """Under tensor parallelism the non-block parts run on their local shards too."""
        tp = getattr(self.model, "tensor_parallel", None)
        if tp is None:
            import contextlib

            return contextlib.nullcontext()
        from .tensor import local_params

        return local_params(self.model, skip=list(self.model.decoder_layers()))

    # ------------------------------------------------------------------ 1F1B
    def train_step(self, micro_batches, loss_of, n_global):
        """Forward and backward of this replica's micro-batches in 1F1B order (module docstring).
        loss_of(hidden, batch) -> LossOutput on the last stage. Returns the summed loss_sum of
        the micro-batches (the last stage's; 0 on the others), a float32 scalar tensor."""
        M, P = len(micro_batches), self.num_stages
        warm = min(P - 1 - self.stage, M)
        self._log("step", M, time.perf_counter())
        state = {}                        # micro-batch -> (stage input, output or scaled loss)
        loss_acc = paddle.zeros([], "float32")

        def forward(k, h_in):
            nonlocal loss_acc
            self._log("F", k, time.perf_counter())
            with self._local():
                out = self.forward_stage(micro_batches[k], h_in)
                if self.last:
                    res = loss_of(out, micro_batches[k])
                    loss_acc = loss_acc + res.loss_sum.detach().astype("float32")
                    out = res.loss_sum / max(n_global, 1.0)
            state[k] = (h_in, out)
            self._log("F_end", k, time.perf_counter())
            return None if self.last else out

        def backward(k, grad_out):
            self._log("B", k, time.perf_counter())
            h_in, out = state.pop(k)
            if self.last:
                out.backward()
            else:
                paddle.autograd.backward([out], [grad_out])
            self._log("B_end", k, time.perf_counter())
            return None if self.first else h_in.grad

        def recv_input():
            if self.first:
                return None
            h = self.recv_activation(self.prev)
            h.stop_gradient = False
            return h

        for k in range(warm):
            out = forward(k, recv_input())
            if not self.last:
                self.send_activation(out, self.next)
        remaining = M - warm
        h_in = recv_input() if remaining > 0 else None
        for i in range(remaining):
            out = forward(warm + i, h_in)
            grad = None if self.last else self._exchange(out, state[i][1], self.next, False)
            g_in = backward(i, grad)
            if self.first:
                continue
            if i == remaining - 1:
                self.send_activation(g_in, self.prev, grad=True)
            else:
                h_in = self._exchange(g_in, None, self.prev, True)
                h_in.stop_gradient = False
        for i in range(remaining, M):
            grad = None if self.last else self.recv_activation(self.next, like=state[i][1])
            g_in = backward(i, grad)
            if not self.first:
                self.send_activation(g_in, self.prev, grad=True)
        self._log("step_end", M, time.perf_counter())
        return loss_acc

    @paddle.no_grad()
    def eval_batch(self, batch, metrics_of):
        """Forward only; the last stage returns metrics_of(hidden, batch), the others None."""
        h = None if self.first else self.recv_activation(self.prev)
        with self._local():
            out = self.forward_stage(batch, h)
        if not self.last:
            self.send_activation(out, self.next)
            return None
        return metrics_of(out, batch)

    # ------------------------------------------------------------------ what the Trainer needs
    def sum_over_stages(self, t):
        """Sum a tensor over the pipeline stages (in place; the loss / counts of other stages are 0)."""
        if self.num_stages > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def finalize(self, trainable):
        """After PEFT: drop what other stages hold (prune_to_stage) and note the trainable tensors
        every stage holds whole (they get their gradients summed over the stages). Returns the
        names of `trainable` that stay on this stage."""
        prune_to_stage(self.model, self.stage, self.num_stages)
        held = dict(self.model.named_parameters())
        stage_ids = {id(p) for m, kept, _ in stage_parts(self.model, self.stage, self.num_stages) if kept
                     for p in m.parameters()}
        self.replicated = {n for n in trainable if n in held and id(held[n]) not in stage_ids}
        return [n for n in trainable if n in held]

    def counts_once(self, name):
        """False for the copies norms and checkpoints must not count again: the last stage's
        tied embedding, and a replicated tensor on every stage but the first."""
        if name in self.replicated:
            return self.first
        return not (self.tied_name == name and self.last and not self.first)

    def sum_replicated_grads(self, named, grads):
        """A tensor every stage holds (a prefix: one slice per block) gets each stage's part of the
        gradient: summed over the stages, every copy takes the same update."""
        for i, (n, _) in enumerate(named):
            if n in self.replicated and self.num_stages > 1:
                dist.all_reduce(grads[i], group=self.group)
        return grads

    def sum_tied_grads(self, named, grads):
        """The tied embedding's gradient from the embedding (first stage) plus the head's (last
        stage): summed over the two copies, so both apply the same update."""
        if self.tied_name is None:
            return grads
        for i, (n, _) in enumerate(named):
            if n == self.tied_name:
                dist.all_reduce(grads[i], group=self.tied_group)
        return grads


def check_stages(config, num_stages):
    """Refuse, before loading, a pipeline with more stages than decoder blocks."""
    if config.num_hidden_layers < num_stages:
        raise ValueError(f"pipeline_parallel_degree ({num_stages}) exceeds the model's "
                         f"num_hidden_layers ({config.num_hidden_layers}): every stage needs a block")
