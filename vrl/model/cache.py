"""The KV cache: which slot each layer reads and writes (`CacheLayout`), and the slots (`KVCache`).

A slot is one (B * K, S, Dh) array of keys or of attended values. Vanilla and ResFormer (which caches
its mixed values) have one of each per layer; CLA one of each per group of model.kv_share layers;
SVFormer one value slot for every layer, V_1's, so its cache holds (L + 1) / (2L) of vanilla's bytes;
SkipV1Former's value slots after V_1's hold only the heads a layer projects (K - model.skip_v1 of K),
the others read from V_1's slot. A slot only one local layer reads keeps its window (a ring buffer).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vrl.core import sharding
from vrl.core.config import require_resolved
from vrl.core.sharding import Axis, context_parts
from vrl.model.config import ModelConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Which cache slot each 0-based layer's keys and values live in. Slot functions work on traced
    layer indices (the scan's)."""

    n_layers: int
    kv_share: int  # model.kv_share: CLA's group size (1: every layer its own K/V)
    shared_values: bool  # SVFormer: every layer attends over V_1
    local: tuple[bool, ...]  # per layer: attends within model.attention_window
    kv_heads: int  # model.n_kv_heads
    borrowed_heads: int = 0  # SkipV1Former (model.skip_v1): the last value heads layers >= 2 read from V_1

    def value_heads(self, slot: int) -> int:
        """The kv heads value slot `slot` holds: V_1's slot all of them, a later one those its layers
        project (SkipV1Former's own heads)."""
        return self.kv_heads - (self.borrowed_heads if slot else 0)

    def owns_kv(self, layer: int) -> bool:
        """Whether `layer` projects its own K (and V): the first of each CLA group does."""
        return layer % self.kv_share == 0

    def key_slot(self, layer):
        """The slot of `layer`'s keys: one per CLA group."""
        return layer // self.kv_share

    def value_slot(self, layer):
        """The slot of the values `layer` attends over: SVFormer's are all V_1 (slot 0)."""
        return 0 * layer if self.shared_values else layer // self.kv_share

    def writes(self, kind: str, layer: int) -> bool:
        """Whether `layer` writes its `kind` ('k' or 'v') slot: the first layer of a slot does; the
        layers after it would write the same rows (V_1, CLA's borrowed K/V), and a second write made
        XLA copy the slot."""
        slot_of = self.key_slot if kind == 'k' else self.value_slot
        return layer == 0 or slot_of(layer - 1) != slot_of(layer)

    def ring_slot(self, kind: str, slot: int) -> bool:
        """Whether slot `slot` of `kind` holds only a window (a ring buffer): one local layer reads it
        and no other (a slot shared by a CLA group or SVFormer's V_1 stays whole)."""
        slot_of = self.key_slot if kind == 'k' else self.value_slot
        readers = [layer for layer in range(self.n_layers) if slot_of(layer) == slot]
        borrowed_from = kind == 'v' and slot == 0 and self.borrowed_heads  # every layer reads V_1's heads
        return len(readers) == 1 and self.local[readers[0]] and not borrowed_from

    @property
    def n_key_slots(self) -> int:
        return self.key_slot(self.n_layers - 1) + 1

    @property
    def n_value_slots(self) -> int:
        return self.value_slot(self.n_layers - 1) + 1


@functools.cache
def layout_of(cfg: ModelConfig) -> CacheLayout:
    """`cfg`'s cache layout."""
    return CacheLayout(
        cfg.n_layers, cfg.kv_share, cfg.attention == 'svformer', cfg.local_layers, cfg.n_kv_heads, cfg.skip_v1
    )


class KVCache(NamedTuple):
    """Cached keys and attended values: one (B * K, S, Dh) array per slot, row b * K + k holding
    sequence b's kv head k, positions before head dims as attention reads them. Each slot is its
    own buffer: a step writes its new position in place and the attention matmuls read the slot
    where it lies. (XLA:CPU copies a slice of a stacked array before a matmul reads it, and copies
    or transposes a (B, K, S, Dh) slot whose batch of 1 it drops; either made a step move about
    three times the cache's bytes.)

    Layer n reads slots layout.key_slot(n) and layout.value_slot(n) and writes those that
    layout.writes says it does (CacheLayout).

    A slot that only one local layer reads (layout.ring_slot) is a ring buffer of its window,
    min(model.attention_window, S) positions, position p holding the latest token whose index is
    p modulo that size: its layer attends over it as it was before the step, then the step's
    tokens (a copy of the window and the new rows, small beside a whole slot), and writes them
    after. Every other slot holds every position (a local layer among its readers masks the rest).
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    index: Array  # int32 scalar: cache positions [0, index) are filled

    def update(
        self, layout: CacheLayout, layer: int, k_BxTxKxDh: Array, v_BxTxKxDh: Array
    ) -> tuple[Array, Array, Array, KVCache]:
        """Writes T new keys and values of the slots `layer` owns, in place; returns the (B * K, S', Dh)
        keys and values the layer attends over, each key's token index (S',) (negative: none yet), and
        the cache."""
        k_slot, v_slot = layout.key_slot(layer), layout.value_slot(layer)
        k_ring, v_ring = layout.ring_slot('k', k_slot), layout.ring_slot('v', v_slot)
        assert k_ring or not v_ring, 'a ring of values is read by one local layer, which also owns its keys'
        own = layout.value_heads(v_slot)
        keys, values, key_index, cache = self._own(layout, layer, k_BxTxKxDh, v_BxTxKxDh[:, :, :own])
        if own == layout.kv_heads:
            return keys, values, key_index, cache
        borrowed = cache.v[0] if not k_ring else jnp.take(cache.v[0], jnp.maximum(key_index, 0), axis=1)
        return keys, _heads_joined(values, borrowed, own), key_index, cache

    def _own(
        self, layout: CacheLayout, layer: int, k_BxTxKxDh: Array, v_BxTxKxDh: Array
    ) -> tuple[Array, Array, Array, KVCache]:
        """`update` for the heads `layer`'s slots hold (all but SkipV1Former's borrowed value heads)."""
        k_slot, v_slot = layout.key_slot(layer), layout.value_slot(layer)
        k_ring, v_ring = layout.ring_slot('k', k_slot), layout.ring_slot('v', v_slot)
        T = k_BxTxKxDh.shape[1]
        new_index_T = self.index + jnp.arange(T, dtype=jnp.int32)
        if k_ring:  # the window before this step, then the step's tokens
            R = self.k[k_slot].shape[1]
            ring_index_R = self.index - 1 - jnp.mod(self.index - 1 - jnp.arange(R, dtype=jnp.int32), R)
            key_index = jnp.concatenate([ring_index_R, new_index_T])
            keys = jnp.concatenate([self.k[k_slot], _rows(k_BxTxKxDh, self.k[k_slot].dtype)], axis=1)
            values = None
            if v_ring:
                values = jnp.concatenate([self.v[v_slot], _rows(v_BxTxKxDh, self.v[v_slot].dtype)], axis=1)
        cache = self._written(layout, layer, k_BxTxKxDh, v_BxTxKxDh)
        if not k_ring:
            return cache.k[k_slot], cache.v[v_slot], jnp.arange(cache.k[k_slot].shape[1], dtype=jnp.int32), cache
        if values is None:  # V_1 (SVFormer), whole: the positions of the window's keys
            values = jnp.take(cache.v[v_slot], jnp.maximum(key_index, 0), axis=1)
        return keys, values, key_index, cache

    def _written(self, layout: CacheLayout, layer: int, k_BxTxKxDh: Array, v_BxTxKxDh: Array) -> KVCache:
        """The cache with T new keys and values in the slots `layer` owns: at [index, index + T), or
        in a ring buffer at their indices modulo its size."""

        def write(slots: tuple[Array, ...], slot: int, new_BxTxKxDh: Array, ring: bool) -> tuple[Array, ...]:
            T = new_BxTxKxDh.shape[1]
            new_NxTxDh = _rows(new_BxTxKxDh, slots[slot].dtype)
            if ring:  # the last R of the new tokens, each at its index modulo R
                R = slots[slot].shape[1]
                kept = min(T, R)
                at_R = jnp.mod(self.index + T - kept + jnp.arange(kept), R)
                written = slots[slot].at[:, at_R].set(new_NxTxDh[:, T - kept :])
            elif T > 1 and context_parts() > 1:  # positions split over devices: each writes its own (a window
                # written as a slice could straddle two devices' positions, and XLA gathered the slot)
                offset_S = jnp.arange(slots[slot].shape[1]) - self.index
                new_NxSxDh = jnp.take(new_NxTxDh, jnp.clip(offset_S, 0, T - 1), axis=1)
                written = jnp.where(((offset_S >= 0) & (offset_S < T))[None, :, None], new_NxSxDh, slots[slot])
            else:
                zero = jnp.zeros((), jnp.int32)
                written = jax.lax.dynamic_update_slice(slots[slot], new_NxTxDh, (zero, self.index, zero))
            return (*slots[:slot], written, *slots[slot + 1 :])

        k_slot, v_slot = layout.key_slot(layer), layout.value_slot(layer)
        k = write(self.k, k_slot, k_BxTxKxDh, layout.ring_slot('k', k_slot)) if layout.writes('k', layer) else self.k
        v = write(self.v, v_slot, v_BxTxKxDh, layout.ring_slot('v', v_slot)) if layout.writes('v', layer) else self.v
        return KVCache(k, v, self.index)


def _heads_joined(own_NxSxDh: Array, v1_MxSxDh: Array, own: int) -> Array:
    """A layer's (B * K, S, Dh) values from the `own` heads of its slot (B * own rows) and the rest of
    V_1's slot (B * K rows): each sequence's own heads, then V_1's heads own..K-1."""
    S, Dh = own_NxSxDh.shape[1:]
    B = own_NxSxDh.shape[0] // own
    K = v1_MxSxDh.shape[0] // B
    joined = jnp.concatenate([own_NxSxDh.reshape(B, own, S, Dh), v1_MxSxDh.reshape(B, K, S, Dh)[:, own:]], axis=1)
    return joined.reshape(B * K, S, Dh)


def _rows(x_BxTxKxDh: Array, dtype: jnp.dtype) -> Array:
    """(B, T, K, Dh) -> a slot's (B * K, T, Dh) rows."""
    B, T, K, Dh = x_BxTxKxDh.shape
    return x_BxTxKxDh.transpose(0, 2, 1, 3).reshape(B * K, T, Dh).astype(dtype)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    """Zeros in the compute dtype: the layout's n_key_slots key and n_value_slots value arrays, each
    (B * heads, S, Dh): K heads, or a SkipV1Former value slot's own (CacheLayout.value_heads); S =
    max_len, or min(model.attention_window, max_len) for a ring buffer (CacheLayout.ring_slot)."""
    require_resolved(cfg, 'model', 'a KV cache', unused=('model.remat',))  # decoding recomputes nothing
    slots_of = layout_of(cfg)

    def slots(kind: str, n: int) -> tuple[jax.Array, ...]:
        def length(slot: int) -> int:
            return min(cfg.attention_window, max_len) if slots_of.ring_slot(kind, slot) else max_len

        def heads(slot: int) -> int:
            return slots_of.kv_heads if kind == 'k' else slots_of.value_heads(slot)

        return tuple(jnp.zeros((batch * heads(i), length(i), cfg.head_dim), cfg.compute_dtype) for i in range(n))

    keys, values = slots('k', slots_of.n_key_slots), slots('v', slots_of.n_value_slots)
    return KVCache(k=keys, v=values, index=jnp.zeros((), jnp.int32))


def cache_bytes(cache: KVCache) -> int:
    """Bytes of the allocated key/value arrays."""
    return sum(x.nbytes for x in (*cache.k, *cache.v))


def cache_shardings(cache: KVCache, batch: int, mesh: Mesh) -> KVCache:
    """A slot's rows (B * K, sequence-major) split as training splits batch and kv heads: over
    ('data', 'fsdp') then 'tensor' (vrl/core/sharding.py's rules); a part the mesh does not divide
    stays whole (a batch of 1 keeps only the kv-head split, an undivided larger batch neither). Its
    positions are split over 'context' (a long prompt's cache over several devices: each attends
    over its positions and the softmax's sums are reduced across them), where the mesh divides them;
    a ring buffer's window (shorter than the others) stays whole."""

    def mesh_axes(logical: str, size: int) -> tuple[str, ...]:
        return sharding.spec_axes(sharding.fitted_sharding(mesh, (logical,), (size,)).spec[0])

    batch_axes = mesh_axes(Axis.BATCH, batch)
    rows = batch_axes + mesh_axes(Axis.KV_HEADS, cache.k[0].shape[0] // batch) if batch_axes or batch == 1 else ()
    longest = max(slot.shape[1] for slot in (*cache.k, *cache.v))

    def spec(slot: jax.Array) -> NamedSharding:
        split = slot.shape[1] == longest
        positions = tuple(a for a in mesh_axes(Axis.LENGTH, slot.shape[1]) if mesh.shape[a] > 1) if split else ()
        return NamedSharding(mesh, PartitionSpec(rows or None, positions or None, None))

    return KVCache(k=tuple(map(spec, cache.k)), v=tuple(map(spec, cache.v)), index=sharding.replicated(mesh))
