"""The items of the pipeline's fleet `PipelineLayer` (parallel/pipeline.py builds it): each holds
this stage's real, loaded (PEFT-wrapped) module, or nothing where another stage holds the part.

    PipeEmbedding        input ids -> {hidden, the [B, S] tensors}; first stage (finish_embedding:
                         GPT-2 / OPT / BLOOM positions or norms, on that stage)
    PipeSharedEmbedding  a tied embedding: fleet's SharedLayerDesc item on the first stage (embeds)
                         and the last (passes hidden on to the loss, which uses its weight as head)
    PipeDecoderBlock     one decoder block
    PipeFinalNorm        the final norm (-> hidden for the loss); holds an untied head
    PipeLoss             the last stage's loss function
"""
import paddle
import paddle.nn as nn

CTX_KEYS = ("position_ids", "attention_mask", "segment_ids")   # [B, S] each, when present


class Absent(nn.Layer):
    """Placeholder for a part of the model another pipeline stage holds (no parameters)."""

    def __init__(self, what):
        super().__init__()
        self.what = what

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.what} lives on another pipeline stage")



class _Item(nn.Layer):
    """An item of the PipelineLayer. The Pipeline is kept outside paddle's sublayer registry (it
    is not a Layer); `module`, this stage's real part, is a sublayer (the PipelineLayer's
    parameters are the stage's)."""

    def __init__(self, pipe, module=None):
        super().__init__()
        self._pipe = [pipe]
        self.ends_chunk = False   # the last item of a chunk: what it sends is cleared after
        if isinstance(module, nn.Layer) and not isinstance(module, Absent):
            self.module = module

    @property
    def pipe(self):
        return self._pipe[0]

    def passed_on(self, x, h):
        """{hidden, the [B, S] tensors} for the next item; copies at a chunk's end (fleet frees
        the tensors it has sent, and the inputs stay alive for backward)."""
        if self.ends_chunk and not paddle.is_grad_enabled() and self.pipe.virtual > 1:
            # fleet's interleaved eval checks what it sends against the shapes cached in training,
            # where the hidden states carry a gradient (its send message lists those only)
            h.stop_gradient = False
        out = {"hidden": h}
        for k in CTX_KEYS:
            if k in x:
                out[k] = x[k].clone() if self.ends_chunk else x[k]
        return out


class PipeEmbedding(_Item):
    def forward(self, x):
        pipe, m = self.pipe, self.pipe.model
        with pipe.local():
            h = m.embed(x["input_ids"])
            h = m.finish_embedding(h, pipe.context(x, h))
        return self.passed_on(x, h)


class PipeSharedEmbedding(PipeEmbedding):
    """The tied embedding as fleet's shared layer (a SharedLayerDesc item, built by PipelineLayer
    on the stages that hold a copy: the first, where it embeds, and the last, where the loss uses
    its weight as the head). `weight` is the attribute fleet's shared comm names: the embedding's
    own parameter (the loaded one, not a copy).

    Under tensor parallelism that parameter is a DTensor (this rank's vocabulary rows), which
    paddle's process-group calls cannot take (with the DTensor as `weight`, TP2 x PP2 on gloo
    ends in a segmentation fault in DenseTensor's copy while the PipelineLayer is built, where
    fleet broadcasts the shared weight; paddle.distributed.broadcast / all_reduce have no DTensor
    path): `weight` is then
    the DTensor's local shard (same storage), and its gradient reaches fleet as that shard's
    `main_grad` (fleet's shared all-reduce reads main_grad where a tensor has one), set after
    every micro-batch's backward (share_grad, from fleet's BACKWARD_END micro-step hook) to the
    local shard of the accumulated DTensor gradient: summed in place, the DTensor's gradient."""

    def __init__(self, pipe, module=None):
        super().__init__(pipe, module)
        w = getattr(getattr(self, "module", None), "weight", None)
        self._shard = [w._local_value()] if w is not None and w.is_dist() else None

    @property
    def weight(self):
        return self.module.weight if self._shard is None else self._shard[0]

    def share_grad(self):
        g = self.module.weight.grad
        if self._shard is not None and g is not None:
            self._shard[0].main_grad = g._local_value()

    def release_grad(self):
        if self._shard is not None and hasattr(self._shard[0], "main_grad"):
            del self._shard[0].main_grad


def _head_copy(shared, h):
    """The last stage's shared item (forward_func of its SharedLayerDesc): the hidden states pass
    on unchanged; the head's matmul runs in the loss function (PipeLoss -> linear_ce: logits only
    at the positions that carry a label), on this same weight."""
    return h


class PipeDecoderBlock(_Item):
    def __init__(self, pipe, index, module=None):
        super().__init__(pipe, module)
        self.index = index

    def forward(self, x):
        pipe, m = self.pipe, self.pipe.model
        h = x["hidden"]
        h = m.run_layers(h, pipe.context(x, h), [m.decoder_layers()[self.index]])
        return self.passed_on(x, h)


class PipeFinalNorm(_Item):
    """The final norm (-> the hidden states the loss takes); holds an untied head as a
    sublayer, which the loss uses (a tied head is the last stage's PipeSharedEmbedding)."""

    def __init__(self, pipe, module=None, head=None):
        super().__init__(pipe, module)
        if isinstance(head, nn.Layer) and not isinstance(head, Absent):
            self.head = head

    def forward(self, x):
        with self.pipe.local():
            return self.pipe.model.final_norm()(x["hidden"])


class PipeLoss(nn.Layer):
    """The last stage's loss function: (hidden, {"labels"}) -> loss_sum x scale (dp / N), in
    float32 (fleet broadcasts the loss as float32 or float16 only). Each micro-batch's loss_sum
    is kept (detached) for the Trainer's logged loss."""

    def __init__(self, pipe):
        super().__init__()
        self._pipe = [pipe]

    def forward(self, h, labels):
        pipe = self._pipe[0]
        with pipe.local():
            out = pipe.loss_of(h, labels)
        pipe.losses.append(out.loss_sum.detach())
        return (out.loss_sum * pipe.loss_scale).astype("float32")


