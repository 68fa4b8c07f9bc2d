"""The KV-cache structure shared by every model, by generation and by prefix tuning.

Attention layers call `cache.update(layer_idx, k, v)` with this step's keys/values
([batch, kv_heads, new, head_dim]) and get back every key/value to attend to
([batch, kv_heads, past + new, head_dim]). After the whole forward, the model calls
`cache.advance(new)`. `cache.length` is how many positions are already held (the past).

Two implementations of that interface:
- `KVCache`: pre-allocated buffers [batch, kv_heads, max_length, head_dim] per layer; each step
  writes its slice in place; nothing is re-concatenated. For inference (no autograd).
- `PrefixCache`: learned per-layer prefixes [kv_heads, P, head_dim] (prefix tuning). `update`
  concatenates the prefix in front of the fresh keys, so gradients reach the prefix. It never grows;
  its `length` is P, so positions of real tokens start at P.
"""
import paddle


class KVCache:
    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, max_length,
                 dtype="float32"):
        shape = [batch_size, num_kv_heads, max_length, head_dim]
        self.keys = [paddle.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [paddle.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.max_length = max_length
        self.length = 0

    @classmethod
    def for_model(cls, model, batch_size, max_length, dtype="float32"):
        layers, kv_heads, head_dim = model.spec.prefix_layout(model.config)
        tp = getattr(model, "tensor_parallel", None)
        if tp is not None:   # attention runs on this rank's key/value heads only: K / TP, or
            kv_heads = tp.local_heads(kv_heads)   # one replicated head when K < TP (parallel/plan.py)
        return cls(layers, batch_size, kv_heads, head_dim, max_length, dtype)

    def update(self, layer_idx, k, v):
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"KV cache is full: {end} positions needed, {self.max_length} "
                             "allocated; allocate a larger max_length")
        self.keys[layer_idx][:, :, start:end] = k
        self.values[layer_idx][:, :, start:end] = v
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def advance(self, n):
        self.length += n

    def fill_prefix(self, prefix_keys, prefix_values):
        """Start from learned prefixes (lists of [kv_heads, P, head_dim]), broadcast over batch."""
        p = prefix_keys[0].shape[1]
        for i, (k, v) in enumerate(zip(prefix_keys, prefix_values)):
            self.keys[i][:, :, :p] = k.unsqueeze(0).expand([self.keys[i].shape[0]] + k.shape)
            self.values[i][:, :, :p] = v.unsqueeze(0).expand([self.values[i].shape[0]] + v.shape)
        self.length = p

    def select(self, batch_index):
        """Keep rows `batch_index` (e.g. drop finished sequences)."""
        idx = paddle.to_tensor(batch_index, dtype="int64")
        self.keys = [paddle.gather(k, idx) for k in self.keys]
        self.values = [paddle.gather(v, idx) for v in self.values]


class PrefixCache:
    def __init__(self, prefix_keys, prefix_values):
        self.prefix_keys = prefix_keys      # per layer [kv_heads, P, head_dim], trainable
        self.prefix_values = prefix_values
        self.length = prefix_keys[0].shape[1] if prefix_keys else 0

    def update(self, layer_idx, k, v):
        b = k.shape[0]
        pk = self.prefix_keys[layer_idx].unsqueeze(0).expand([b] + self.prefix_keys[layer_idx].shape)
        pv = self.prefix_values[layer_idx].unsqueeze(0).expand(
            [b] + self.prefix_values[layer_idx].shape)
        return paddle.concat([pk.astype(k.dtype), k], axis=2), paddle.concat(
            [pv.astype(v.dtype), v], axis=2)

    def advance(self, n):
        pass  # a prefix never grows; fresh tokens are not kept
