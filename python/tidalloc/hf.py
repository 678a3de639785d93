"""tidalloc.hf: a Hugging Face `transformers` cache whose keys and values grow
in place (tidalloc.kv.KVCache per layer), for decoder-only models on the
standard attention path:

    from tidalloc.hf import GrowableCache
    out = model.generate(**inputs, past_key_values=GrowableCache(config=model.config))

DynamicCache grows each layer's [B, H, T, D] keys and values by torch.cat at
every step, copying the whole cache; here a step copies its own keys and
values, and every layer's cache keeps its address. The tensors handed to the
attention are views of [B, H, T, D] with a contiguous last dimension
(tidalloc.kv explains the layout), which scaled_dot_product_attention's
kernels take as they are.

Layers: full attention (GrowableLayer) and sliding-window attention
(GrowableSlidingWindowLayer: the window in a ring buffer, dropping the oldest
tokens without copying the rest). Other layer kinds (linear attention, indexed
and compressed attention, KV sharing) raise an error naming them.

Generation features: greedy and sampling, beam search (reorder_cache in
place), crop (assisted decoding on full-attention layers), batch
repeat/select (a copy into new storage, as DynamicCache copies). Not
supported: offloading (raises), torch.compile of the whole decode step
through generate (is_compileable is False: generate then runs eager, as
with DynamicCache; CUDA graphs over a KVCache are in docs/kv_cache.md).

Needs transformers 5.x (the Cache / CacheLayerMixin layer API)."""
import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .kv import KVCache

__all__ = ["GrowableCache", "GrowableLayer", "GrowableSlidingWindowLayer"]

# Tokens of address space each layer reserves when neither max_cache_len nor a
# config's max_position_embeddings says (address space only: pages are mapped
# as the cache grows).
DEFAULT_MAX_CACHE_LEN = 1 << 16


def _indices(indices, batch, device):
    """A long index tensor from DynamicLayer's `indices` (long or bool)."""
    idx = torch.as_tensor(indices, device=device)
    if idx.dtype == torch.bool:
        idx = idx.nonzero().flatten()
    if idx.numel() == 0:
        raise ValueError("GrowableCache: selecting no batch entry out of %d" % batch)
    return idx.long()


class _KVLayer:
    """What both layers share: a KVCache `self.kv` behind keys/values."""

    is_compileable = False

    def _refresh(self):
        self.keys, self.values = self.kv.keys, self.kv.values

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def get_seq_length(self):
        return len(self.kv) if self.is_initialized else 0

    def reset(self):
        """Drop the tokens and the storage (a later generate may have another
        batch size or dtype)."""
        self.kv.close()
        self.keys = self.values = None
        self.is_initialized = False
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = 0

    def reorder_cache(self, beam_idx):
        """Beam search: batch entries reordered in place (one gather)."""
        if self.get_seq_length() > 0:
            self.kv.reorder(beam_idx)
            self._refresh()

    def batch_repeat_interleave(self, repeats):
        if self.get_seq_length() > 0:
            b = self.kv.keys.shape[0]
            self.kv.rebatch(torch.arange(b, device=self.device).repeat_interleave(repeats))
            self._refresh()

    def batch_select_indices(self, indices):
        if self.get_seq_length() > 0:
            b = self.kv.keys.shape[0]
            self.kv.rebatch(_indices(indices, b, self.device))
            self._refresh()

    def offload(self):
        raise NotImplementedError("GrowableCache does not offload to the CPU: its storage is "
                                  "device memory of fixed address; use DynamicCache(offloading=True)")

    def prefetch(self):
        self.offload()

    def close(self):
        self.kv.close()
        self.keys = self.values = None
        self.is_initialized = False


class GrowableLayer(_KVLayer, DynamicLayer):
    """A full-attention layer: all tokens, appended in place."""

    is_sliding = False
    is_croppable = True

    def __init__(self, max_cache_len=DEFAULT_MAX_CACHE_LEN, map_ahead_tokens=None, **kwargs):
        DynamicLayer.__init__(self)
        self.max_cache_len = max_cache_len
        self.kv = KVCache(max_len=max_cache_len, map_ahead_steps=map_ahead_tokens)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.kv.append(key_states, value_states)
        return self.keys, self.values

    def get_max_length(self):
        # Grows like DynamicLayer (-1: no fixed shape); the capacity is max_cache_len.
        return -1

    def crop(self, tokens_to_remove):
        """A negative count removes that many of the last tokens; a positive
        one is the length to keep (the older transformers' meaning)."""
        if not self.is_initialized or tokens_to_remove == 0:
            return
        held = len(self.kv)
        keep = held + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, held)
        self.kv.truncate(max(0, keep))
        self._refresh()


class GrowableSlidingWindowLayer(_KVLayer, DynamicSlidingWindowLayer):
    """A sliding-window layer: the last sliding_window - 1 tokens kept in a
    ring buffer, as DynamicSlidingWindowLayer keeps them. A one-token step
    attends to a view of the ring (no copy); a longer step (the prompt)
    attends to the tokens kept followed by its own, as DynamicSlidingWindowLayer
    returns them (one concatenation, that step only)."""

    is_croppable = False

    def __init__(self, sliding_window, map_ahead_tokens=None, **kwargs):
        DynamicSlidingWindowLayer.__init__(self, sliding_window=sliding_window)
        # The ring holds the window: the sliding_window - 1 tokens kept and the
        # new one of a decode step.
        self.kv = KVCache(window=sliding_window, map_ahead_steps=map_ahead_tokens)

    def lazy_initialization(self, key_states, value_states):
        _KVLayer.lazy_initialization(self, key_states, value_states)
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)

    def activate_past_recording(self, **kwargs):
        raise NotImplementedError("GrowableCache: sliding-window layers do not record past states "
                                  "(assisted decoding); use DynamicCache")

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        self.cumulative_length += t
        if t == 1:
            self.kv.append(key_states, value_states)
            self._refresh_kept()
            return self.kv.keys, self.kv.values
        # The tokens kept (at most sliding_window - 1), then this step's.
        kept_k, kept_v = self._kept()
        full_k = key_states if kept_k is None else torch.cat([kept_k, key_states], dim=-2)
        full_v = value_states if kept_v is None else torch.cat([kept_v, value_states], dim=-2)
        self.kv.append(key_states, value_states)
        self._refresh_kept()
        return full_k, full_v

    def _kept(self):
        """The last sliding_window - 1 tokens held, as views (None if none)."""
        n = len(self.kv)
        if n == 0:
            return None, None
        keep = min(n, self.sliding_window - 1)
        return self.kv.keys[:, :, n - keep:], self.kv.values[:, :, n - keep:]

    def _refresh_kept(self):
        self.keys, self.values = self._kept()

    def _refresh(self):
        self._refresh_kept()

    def get_seq_length(self):
        return self.cumulative_length

    def crop(self, tokens_to_remove):
        if tokens_to_remove == 0:
            return
        raise NotImplementedError("GrowableCache: cropping a sliding-window layer is not supported "
                                  "(use DynamicCache for assisted decoding on such models)")


_FULL = ("full_attention",)
_SLIDING = ("sliding_attention", "chunked_attention")


def _layer_kinds(config):
    """(kind, window) per layer from a model's config: kind "full" or
    "sliding"; raises for layer kinds this cache does not hold."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    if types is None:
        if n is None:
            raise ValueError("GrowableCache: the config has neither layer_types nor "
                             "num_hidden_layers")
        kind = ("sliding_attention" if window is not None else
                "chunked_attention" if chunk is not None else "full_attention")
        types = [kind] * n
    if getattr(text, "kv_sharing_modes", None) is not None:
        raise ValueError("GrowableCache: models sharing KV caches between layers are not "
                         "supported; use DynamicCache")
    out = []
    for t in types:
        if t in _FULL:
            out.append(("full", None))
        elif t in _SLIDING:
            out.append(("sliding", window if t == "sliding_attention" else chunk))
        else:
            raise ValueError("GrowableCache: layer type %r is not supported (full and sliding "
                             "attention are); use DynamicCache for this model" % t)
    return out, text


class GrowableCache(Cache):
    """A transformers Cache of tidalloc growable layers.

    config: the model's config (model.config): one layer per decoder layer,
    full or sliding window as the config says, each reserving
    max_position_embeddings tokens of address space unless max_cache_len is
    given. Without config, full-attention layers are made as the model asks
    for them, each reserving max_cache_len (default 65536) tokens.
    map_ahead_tokens: tokens kept mapped beyond the length (default:
    tidalloc.kv.KVCache's, up to 4 MiB worth and at most a sixteenth of the
    tokens held)."""

    def __init__(self, config=None, max_cache_len=None, map_ahead_tokens=None):
        if config is not None:
            kinds, text = _layer_kinds(config)
            if max_cache_len is None:
                max_cache_len = getattr(text, "max_position_embeddings", None) or \
                    DEFAULT_MAX_CACHE_LEN
            layers = [GrowableLayer(max_cache_len, map_ahead_tokens) if kind == "full" else
                      GrowableSlidingWindowLayer(window, map_ahead_tokens)
                      for kind, window in kinds]
            super().__init__(layers=layers)
        else:
            if max_cache_len is None:
                max_cache_len = DEFAULT_MAX_CACHE_LEN
            super().__init__(layer_class_to_replicate=functools.partial(
                GrowableLayer, max_cache_len, map_ahead_tokens))
        # Not `max_cache_len`: some transformers releases define that on Cache.
        self.capacity = max_cache_len

    def close(self):
        """Give every layer's storage back now."""
        for layer in self.layers:
            layer.close()
