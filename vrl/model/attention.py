"""Training attention: which implementation computes it (`model.attention_impl`), and the kernels.

- xla: vrl.model.ops.attention on every backend. It materialises (L / attention_chunks, S) float32
  logits per head and query chunk, which is what keeps long sequences out of reach.
- splash: TPU Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention). The
  causal mask and the segment ids (data.document_masking) are applied inside the kernel, and GQA
  kv heads are read in place. Blocks of min(512, L) tokens, so L must be a multiple of 128 (or
  shorter than 512 and a multiple of 128). Chosen off TPU, it runs in Pallas' interpreter
  (it becomes `splash_interpret`): slow, for checking numerics on CPU.
- cudnn: jax.nn.dot_product_attention(implementation='cudnn') on NVIDIA GPUs: causal, GQA,
  bfloat16. cuDNN through JAX takes no segment ids and no logit soft cap, so document masking and
  model.attn_logits_soft_cap fall back to xla.
  Tests on CPU run the same calls with JAX's reference for them (DOT_PRODUCT_ATTENTION = 'xla').
- auto (the default): splash on TPU, cudnn on GPU where it can serve the config, else xla;
  resolved by vrl/model/resolve.py, which logs the choice and its reason. The code here takes only
  a resolved value.

With the mesh's `context` axis above 1 (context parallelism, docs/scaling-out.md), each device
gathers the whole sequence's keys and values and every implementation attends with the device's
share of the queries over them (`_context_parallel`).

model.attn_logits_soft_cap caps q.k / sqrt(Dh) in the XLA path and in splash (its
attn_logits_soft_cap). A local layer (model.attention_window, `Causal.local`) keeps the keys within
its window: in the XLA path's mask, splash's LocalMask (or a windowed `_StripedRows` on a split
sequence), cuDNN's local_window_size; under the layer scan lax.cond picks each layer's kernel.

Value residual only changes V, so every variant runs on every implementation. Decoding (a KV
cache) and vrl.experiments.analyze's attention statistics always take the XLA path, which works
everywhere.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from vrl.core.config import ConfigError
from vrl.core.sharding import Axis, context_parts, logical_spec
from vrl.model import ops
from vrl.model.config import ATTENTION_IMPLS, ModelConfig

Array = jax.Array

_Q_SPEC = logical_spec((Axis.BATCH, Axis.LENGTH, Axis.HEADS, Axis.HEAD_DIM))  # queries', as the mesh splits them
_KV_SPEC = logical_spec((Axis.BATCH, Axis.LENGTH, Axis.KV_HEADS, Axis.HEAD_DIM))  # keys' and values'
SPLASH_BLOCK = 512  # tokens per splash block (queries and keys), or L when shorter
DOT_PRODUCT_ATTENTION = 'cudnn'  # jax.nn.dot_product_attention's implementation behind impl 'cudnn'
_LANES = 128  # splash blocks must be multiples of the TPU's 128 lanes


class Copies(NamedTuple):
    """With sequences split over `context`: the whole sequence of keys and of values that several
    layers attend with, each (C, B, L, K, Dh) (`whole_copies`), made once by the layer that projects
    them; None: that layer gathers its own."""

    k: Array | None
    v: Array | None


class Causal(NamedTuple):
    """Training's mask, never materialised whole: key j is seen by query i when j <= i and, with
    segment ids, both are in the same document; in a local layer (`local`, a traced bool under the
    layer scan) also i - j < `window`. With sequences split over `context`, the tokens come in
    `balanced_order` (order[i]: where the token at i stands in the sequence)."""

    segment_ids_BxL: Array | None
    order: np.ndarray | None = None
    window: int = 0  # model.attention_window; 0: none
    local: Array | bool = False  # whether this layer attends within the window

    def dense(self, B: int, L: int) -> Array:
        """The (B, L, L) boolean mask, for the XLA path."""
        position_L = jnp.arange(L) if self.order is None else jnp.asarray(self.order)
        mask_LxL = _seen(position_L[:, None], position_L[None, :], self.window, self.local)
        if self.segment_ids_BxL is None:
            return jnp.broadcast_to(mask_LxL, (B, L, L))
        ids = self.segment_ids_BxL
        return mask_LxL[None] & (ids[:, :, None] == ids[:, None, :])


def _seen(query_position: Array, key_position: Array, window: int, local: Array | bool) -> Array:
    """Whether a query sees a key, from their positions in the sequence (broadcast): causal, and within
    `window` where `local`."""
    causal = key_position <= query_position
    return causal & ((query_position - key_position < window) | jnp.logical_not(local)) if window else causal


def _local_or_global(local: Array | bool, attend: Callable[[bool], Array]) -> Array:
    """attend(True) where the layer is local, attend(False) where not: a kernel's window is static, so
    under the layer scan (a traced `local`) both are traced and lax.cond runs the layer's."""
    if isinstance(local, (bool, np.bool_)):
        return attend(bool(local))
    return jax.lax.cond(local, lambda: attend(True), lambda: attend(False))


def why_not(
    impl: str, cfg: ModelConfig, platform: str, seq_len: int, document_masking: bool, context: int = 1
) -> str | None:
    """Why `impl` cannot compute this model's training attention on `platform` with each sequence
    split over `context` devices, or None if it can."""
    if impl in ('splash', 'splash_interpret'):
        part, name = seq_len // context, 'data.seq_len' if context == 1 else f'data.seq_len / mesh.context={context}'
        block = min(SPLASH_BLOCK, part)
        if block % _LANES or part % block:
            return f'splash needs {name} a multiple of {_LANES} (and of {SPLASH_BLOCK} above it); it is {part}'
    if impl == 'cudnn':
        if platform != 'gpu':
            return f'cuDNN attention runs on NVIDIA GPUs (this is {platform})'
        if cfg.compute_dtype != 'bfloat16':
            return f'cuDNN attention needs model.compute_dtype=bfloat16 (it is {cfg.compute_dtype})'
        if cfg.head_dim % 8 or cfg.head_dim > 128:
            return f'cuDNN attention needs head_dim a multiple of 8 and at most 128 (it is {cfg.head_dim})'
        if document_masking:
            return 'cuDNN attention through JAX takes no segment ids (data.document_masking=True)'
        if cfg.attn_logits_soft_cap:
            cap = cfg.attn_logits_soft_cap
            return f'cuDNN attention through JAX has no logit soft cap (model.attn_logits_soft_cap={cap:g})'
        if context > 1 and seq_len // context % (2 * cfg.attention_chunks):  # even chunks: cuDNN trains with a
            # mask (a bias) on even lengths only
            return (
                f'cuDNN attention on a split sequence needs data.seq_len / mesh.context={context} a multiple of '
                f'2 x model.attention_chunks={cfg.attention_chunks}; it is {seq_len // context}'
            )
    return None


def choose(cfg: ModelConfig, platform: str, seq_len: int, document_masking: bool, context: int = 1) -> tuple[str, str]:
    """(the implementation to trace for `cfg` on `platform` ('cpu', 'gpu', 'tpu'), why). `auto` picks
    the platform's kernel where it can serve the config, else xla; an explicit choice that cannot
    serve is a ConfigError with the reason (vrl/model/resolve.py calls this)."""
    impl = cfg.attention_impl
    if impl == 'xla':
        return impl, 'as configured'
    if impl != 'auto':
        reason = why_not(impl, cfg, platform, seq_len, document_masking, context)
        if reason:
            raise ConfigError(
                f'model.attention_impl={impl!r} cannot run here: {reason}. Allowed: {", ".join(ATTENTION_IMPLS[:-1])}.'
            )
        if impl.startswith('splash') and platform != 'tpu':
            return 'splash_interpret', f"splash in Pallas' interpreter on {platform} (slow; for checking numerics)"
        return impl, 'as configured'
    kernel = {'tpu': 'splash', 'gpu': 'cudnn'}.get(platform)
    if kernel is None:
        return 'xla', f'no attention kernel on {platform}'
    reason = why_not(kernel, cfg, platform, seq_len, document_masking, context)
    return ('xla', reason) if reason else (kernel, f'the {platform} kernel serves this config')


def attention(
    impl: str,
    q_BxLxHxDh: Array,
    k_BxSxKxDh: Array,
    v_BxSxKxDh: Array,
    mask: Causal | Array,
    causal_chunks: int,
    xla_attention: Callable[..., Array] = ops.attention,
    copies: Copies | None = None,
    logits_cap: float = 0.0,
) -> Array:
    """Softmax attention (B, L, H, Dh) of training (a `Causal` mask) or of an explicit (B, L, S) one,
    by `impl` (a resolved one: xla, splash, splash_interpret or cudnn); an explicit mask always takes
    the XLA path, which computes each query chunk with `xla_attention` (vrl.model.ops' attention,
    hand-written backward or autodiff). With sequences split over `context`, `copies` of the keys or
    values (made once for the layers that share them) stand in for gathering them. The logits
    q.k / sqrt(Dh) are soft-capped at `logits_cap` (0: not capped; cudnn takes none)."""
    attend = functools.partial(xla_attention, logits_cap=logits_cap) if logits_cap else xla_attention
    if isinstance(mask, Causal) and context_parts() > 1:  # the sequence split over devices
        assert mask.order is not None, 'a split sequence comes in balanced_order (Decoder.hidden)'
        return _context_parallel(
            impl,
            q_BxLxHxDh,
            k_BxSxKxDh,
            v_BxSxKxDh,
            mask,
            causal_chunks,
            attend,
            copies or Copies(None, None),
            logits_cap,
        )
    # cuDNN through JAX takes no segment ids: packed sequences (vrl.tools.evaluate's) take the XLA path
    if impl == 'xla' or not isinstance(mask, Causal) or (impl == 'cudnn' and mask.segment_ids_BxL is not None):
        B, L = q_BxLxHxDh.shape[:2]
        dense = mask.dense(B, L) if isinstance(mask, Causal) else mask
        return _xla(q_BxLxHxDh, k_BxSxKxDh, v_BxSxKxDh, dense, causal_chunks if isinstance(mask, Causal) else 1, attend)
    if impl == 'cudnn':
        assert not logits_cap, 'cuDNN takes no logit soft cap (why_not)'
        return _local_or_global(
            mask.local,
            lambda local: jax.nn.dot_product_attention(
                q_BxLxHxDh,
                k_BxSxKxDh,
                v_BxSxKxDh,
                is_causal=True,
                local_window_size=(mask.window - 1, 0) if local and mask.window else None,
                implementation=DOT_PRODUCT_ATTENTION,
            ),
        )
    interpret = impl == 'splash_interpret'
    L = q_BxLxHxDh.shape[1]
    return _local_or_global(
        mask.local,
        lambda local: _per_shard(
            lambda q, k, v, ids: _splash(q, k, v, ids, ids, interpret, _whole_rows(L, mask.window, local), logits_cap),
            q_BxLxHxDh,
            k_BxSxKxDh,
            v_BxSxKxDh,
            mask.segment_ids_BxL,
        ),
    )


def _xla(
    q_BxLxHxDh: Array,
    k_BxSxKxDh: Array,
    v_BxSxKxDh: Array,
    mask_BxLxS: Array,
    causal_chunks: int,
    xla_attention: Callable[..., Array],
) -> Array:
    """`xla_attention` (vrl.model.ops' attention, or `_cudnn_attention`) in `causal_chunks` query
    chunks, one after another (only a chunk's logits exist at a time). causal_chunks > 1 promises a
    causal mask with the L queries spread evenly over the S key positions, the last at the end
    (S / L apart: 1 on one device, mesh.context on a split sequence): no query sees a key after
    S - (S / L)(L - 1 - i) - 1, so each chunk skips the keys after its last query's."""
    B, L, H, Dh = q_BxLxHxDh.shape
    S, K = k_BxSxKxDh.shape[1:3]
    q_BxLxKxGxDh = q_BxLxHxDh.reshape(B, L, K, H // K, Dh)
    bounds = sorted({L * i // causal_chunks for i in range(causal_chunks + 1)})
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        seen = S - S // L * (L - end)  # keys [0, seen) are all the chunk's queries can see
        outs.append(
            xla_attention(
                q_BxLxKxGxDh[:, start:end], k_BxSxKxDh[:, :seen], v_BxSxKxDh[:, :seen], mask_BxLxS[:, start:end, :seen]
            )
        )
    return jnp.concatenate(outs, axis=1).reshape(B, L, H, Dh)


def _cudnn_attention(q_BxLxKxGxDh: Array, k_BxSxKxDh: Array, v_BxSxKxDh: Array, mask_BxLxS: Array) -> Array:
    """vrl.model.ops.attention's signature by jax.nn.dot_product_attention (DOT_PRODUCT_ATTENTION), for
    a mask that is the same for every row of the batch (no segment ids): cuDNN reads it as a
    (1, 1, L, S) bias, computing the masked logits too."""
    B, L, K, G, Dh = q_BxLxKxGxDh.shape
    out_BxLxHxDh = jax.nn.dot_product_attention(
        q_BxLxKxGxDh.reshape(B, L, K * G, Dh),
        k_BxSxKxDh,
        v_BxSxKxDh,
        mask=mask_BxLxS[:1, None],
        implementation=DOT_PRODUCT_ATTENTION,
    )
    return out_BxLxHxDh.reshape(B, L, K, G, Dh)


def balanced_order(L: int) -> np.ndarray | None:
    """The order (L,) that the model puts a sequence's tokens in when sequences are split over the
    traced-in mesh's `context` axis (None: whole sequences): striped, device p of c holding positions
    p, p + c, p + 2c, ... (order[i]: where the token at i stands in the sequence). With causal
    attention every device then has the same work, and its i-th query sees the keys before
    (i + 1) c, whatever p is; with the plain split, the last device's queries see every key and
    the first's only their own."""
    parts = context_parts()
    if parts == 1:
        return None
    return np.arange(L).reshape(L // parts, parts).T.reshape(L)


def _context_parallel(
    impl: str,
    q_BxLxHxDh: Array,
    k_BxLxKxDh: Array,
    v_BxLxKxDh: Array,
    mask: Causal,
    query_chunks: int,
    xla_attention: Callable[..., Array],
    copies: Copies,
    logits_cap: float,
) -> Array:
    """Causal attention with each sequence split over the mesh's `context` axis (L is the whole
    sequence here, in `balanced_order`; a device holds P = L / c of it): each device keeps its queries
    and gathers the keys, values and segment ids of the whole sequence (in the backward pass, their
    gradients are reduce-scattered back). Keys or values given as `copies` are not gathered: each
    device reads its own copy.

    xla and cudnn: the keys are put in sequence order and each device attends in `query_chunks`
    chunks, a chunk over the keys up to its last query's (`_xla`): every device computes the
    same (chunks + 1) / chunks of the causal need, and its part index only enters the mask.
    cuDNN is given the mask as a bias (cuDNN through JAX knows only the causal mask of queries and
    keys that stand together). splash: one kernel per device (lax.switch on its index), its mask
    that device's rows of the causal mask over the keys as gathered (`_StripedRows`); masked
    blocks are skipped, and every device keeps the same number. A local layer's mask keeps only
    the keys within the window (`Causal`)."""
    ids_BxL = mask.segment_ids_BxL
    mesh = jax.sharding.get_abstract_mesh()
    ids_spec = None if ids_BxL is None else logical_spec((Axis.BATCH, Axis.LENGTH))
    k_given, k_spec = (k_BxLxKxDh, _KV_SPEC) if copies.k is None else (copies.k, _copies_spec())
    v_given, v_spec = (v_BxLxKxDh, _KV_SPEC) if copies.v is None else (copies.v, _copies_spec())
    parts = context_parts()
    attend = _cudnn_attention if impl == 'cudnn' and ids_BxL is None else xla_attention  # cuDNN takes no ids

    def local(q_BxPxHxDh, k_local, v_local, ids_BxP):
        k_BxLxKxDh = _whole(k_local) if copies.k is None else k_local[0]
        v_BxLxKxDh = _whole(v_local) if copies.v is None else v_local[0]
        ids_whole_BxL = None if ids_BxP is None else _whole(ids_BxP)
        B, P = q_BxPxHxDh.shape[:2]
        L = k_BxLxKxDh.shape[1]
        part = jax.lax.axis_index('context')
        if impl.startswith('splash'):
            interpret = impl == 'splash_interpret'

            def kernels(local: bool) -> Array:
                window = mask.window if local else 0
                each = [
                    functools.partial(
                        _splash, interpret=interpret, causal=_StripedRows(i, parts, L, window), logits_cap=logits_cap
                    )
                    for i in range(parts)
                ]
                return jax.lax.switch(part, each, q_BxPxHxDh, k_BxLxKxDh, v_BxLxKxDh, ids_BxP, ids_whole_BxL)

            return _local_or_global(mask.local, kernels)
        k_seq, v_seq = _in_sequence(k_BxLxKxDh, parts), _in_sequence(v_BxLxKxDh, parts)
        query_position_P = parts * jnp.arange(P) + part  # balanced_order's positions of this device's queries
        seen_PxL = _seen(query_position_P[:, None], jnp.arange(L)[None, :], mask.window, mask.local)
        mask_BxPxL = jnp.broadcast_to(seen_PxL, (B, P, L))
        if ids_BxP is not None:
            mask_BxPxL = mask_BxPxL & (ids_BxP[:, :, None] == _in_sequence(ids_whole_BxL, parts)[:, None, :])
        return _xla(q_BxPxHxDh, k_seq, v_seq, mask_BxPxL, query_chunks, attend)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(_Q_SPEC, k_spec, v_spec, ids_spec), out_specs=_Q_SPEC, check_vma=False
    )(q_BxLxHxDh, k_given, v_given, ids_BxL)


def _in_sequence(x_BxLx_: Array, parts: int) -> Array:
    """A whole sequence gathered device after device (balanced_order) -> in sequence order."""
    B, L = x_BxLx_.shape[:2]
    x_BxCxPx_ = x_BxLx_.reshape(B, parts, L // parts, *x_BxLx_.shape[2:])
    return jnp.swapaxes(x_BxCxPx_, 1, 2).reshape(x_BxLx_.shape)


def whole_copies(x_BxLxKxDh: Array) -> Array:
    """(C, B, L, K, Dh): the whole sequence of keys or values `x` on each of the C = context devices,
    axis 0 split over `context`, for `attention` to read in place of gathering them in every layer
    that attends with them (SVFormer's V_1, a CLA group's K and V): they cross the context axis once,
    this gather forward and one reduce-scatter of the gradients every such layer added backward."""
    return jax.shard_map(
        lambda x: _whole(x)[None],
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=_KV_SPEC,
        out_specs=_copies_spec(),
        check_vma=False,
    )(x_BxLxKxDh)


def _copies_spec() -> PartitionSpec:
    batch, _, heads, head_dim = _KV_SPEC
    return PartitionSpec('context', batch, None, heads, head_dim)


def _whole(part_BxPx_: Array) -> Array:
    """A device's part of the sequence -> the whole sequence (axis 1), inside a shard_map."""
    return jax.lax.all_gather(part_BxPx_, 'context', axis=1, tiled=True)


def _per_shard(kernel, q_BxLxHxDh: Array, k_BxSxKxDh: Array, v_BxSxKxDh: Array, ids_BxL: Array | None) -> Array:
    """Runs a Pallas kernel on each device's shard (batch over data x fsdp, heads over tensor):
    a custom call cannot be partitioned by XLA, only placed whole per device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(q_BxLxHxDh, k_BxSxKxDh, v_BxSxKxDh, ids_BxL)
    ids_spec = None if ids_BxL is None else logical_spec((Axis.BATCH, Axis.LENGTH))
    return jax.shard_map(
        kernel, mesh=mesh, in_specs=(_Q_SPEC, _KV_SPEC, _KV_SPEC, ids_spec), out_specs=_Q_SPEC, check_vma=False
    )(q_BxLxHxDh, k_BxSxKxDh, v_BxSxKxDh, ids_BxL)


def _whole_rows(L: int, window: int, local: bool) -> splash_mask.Mask:
    """Splash's own mask for whole sequences: causal, or its sliding window (LocalMask) in a local layer."""
    if local and window:
        return splash_mask.LocalMask((L, L), window_size=(window - 1, 0), offset=0)
    return splash_mask.CausalMask((L, L))


class _StripedRows(splash_mask._ComputableMask):
    """Device `part`'s rows of the causal mask over L tokens in `balanced_order`: (L / parts, L),
    its rows (queries) at positions parts * i + part and the keys as gathered, device after device,
    key j of device d at position parts * j + d; with a `window`, only the keys within it. Computed
    from indices (numpy when splash plans its blocks, in the kernel when it runs), with comparisons
    and products only. A subclass of splash's own base for computed masks, as its CausalMask is."""

    def __init__(self, part: int, parts: int, L: int, window: int = 0):
        self.part, self.parts, self.window = part, parts, window
        super().__init__((L // parts, L), self._seen)

    def _seen(self, q_ids, kv_ids):
        P = self.shape[0]
        kv_position = sum(
            ((kv_ids >= d * P) & (kv_ids < (d + 1) * P)) * (self.parts * (kv_ids - d * P) + d)
            for d in range(self.parts)
        )
        q_position = self.parts * q_ids + self.part
        seen = q_position >= kv_position
        return seen & (q_position - kv_position < self.window) if self.window else seen

    def _key(self) -> tuple:
        return (self.part, self.parts, self.window, self.shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StripedRows) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((_StripedRows, *self._key()))


def _splash(
    q_BxLxHxDh: Array,
    k_BxSxKxDh: Array,
    v_BxSxKxDh: Array,
    ids_BxL: Array | None,
    ids_BxS: Array | None,
    interpret: bool,
    causal: splash_mask.Mask,
    logits_cap: float = 0.0,
) -> Array:
    """Causal splash attention of L queries over S keys (`causal`, (L, S): the rows of the causal
    mask these queries hold), heads-major inside; q is scaled by 1/sqrt(Dh) here (splash does not),
    and the logits soft-capped at `logits_cap` (0: not capped) by splash."""
    B, L, H, Dh = q_BxLxHxDh.shape
    S = k_BxSxKxDh.shape[1]
    block_q, block_kv = min(SPLASH_BLOCK, L), min(SPLASH_BLOCK, S)
    sizes = splash.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )
    mask = splash_mask.MultiHeadMask([causal] * H)
    kernel = splash.make_splash_mha(
        mask,
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
        attn_logits_soft_cap=logits_cap or None,
    )
    q_BxHxLxDh = (q_BxLxHxDh * (1 / math.sqrt(Dh))).transpose(0, 2, 1, 3)
    k_BxKxSxDh, v_BxKxSxDh = k_BxSxKxDh.transpose(0, 2, 1, 3), v_BxSxKxDh.transpose(0, 2, 1, 3)
    if ids_BxL is None:
        out_BxHxLxDh = jax.vmap(kernel)(q_BxHxLxDh, k_BxKxSxDh, v_BxKxSxDh)
    else:
        out_BxHxLxDh = jax.vmap(kernel)(q_BxHxLxDh, k_BxKxSxDh, v_BxKxSxDh, splash.SegmentIds(q=ids_BxL, kv=ids_BxS))
    return out_BxHxLxDh.transpose(0, 2, 1, 3)
