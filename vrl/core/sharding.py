"""The device mesh and the logical-to-mesh sharding rules: the only place either is decided.

Mesh axes ('data', 'fsdp', 'context', 'tensor'). Parameters are fully sharded over `fsdp` on their
`embed` axis and tensor-parallel over `tensor` on heads / kv_heads / mlp / vocab; the batch
is split over ('data', 'fsdp') and each sequence over `context` (context parallelism: attention
gathers the keys and values, vrl/model/attention.py). Across TPU slices (mesh.slices), `data` is
outermost and spans them, so the data-center network carries only data parallelism. The model only
names logical axes (vrl/model/decoder.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vrl.core.config import ConfigError, require, require_resolved

MESH_AXES = ('data', 'fsdp', 'context', 'tensor')
BATCH_AXES = ('data', 'fsdp')


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; -1 = all remaining devices (at most one axis)."""

    AUTOS: ClassVar[dict] = {'context': 0}  # resolved once per run: vrl/train/aot.py

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    slices: int = 1  # TPU slices joined over the data-center network: the outer part of `data`
    context: int = 1  # devices each sequence is split over (context parallelism), within a slice; 0 = auto

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        require(
            all(s == -1 or s >= 1 for s in sizes) and sizes.count(-1) <= 1,
            'mesh',
            sizes,
            'sizes >= 1 with at most one -1',
        )
        require(self.slices >= 1, 'mesh.slices', self.slices, 'an integer >= 1')
        require(
            self.context >= 1 or (self.context == 0 and -1 in sizes),
            'mesh.context',
            self.context,
            'an integer >= 1, or 0 (auto: vrl/train/aot.py picks it) with one of mesh.data, mesh.fsdp, '
            'mesh.tensor at -1 to take the rest',
        )


class Axis:
    """The logical axes the model names its arrays' dimensions by (LOGICAL_RULES maps each to the mesh)."""

    BATCH = 'batch'
    LENGTH = 'length'
    EMBED = 'embed'  # d_model of a parameter
    HEADS = 'heads'
    KV_HEADS = 'kv_heads'
    MLP = 'mlp'
    VOCAB = 'vocab'
    HEAD_DIM = 'head_dim'
    LAYERS = 'layers'  # the stacked (scanned) layers
    ACT_EMBED = 'act_embed'  # d_model of an activation


# logical axis -> mesh axis (None = replicated)
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    Axis.BATCH: BATCH_AXES,
    Axis.LENGTH: 'context',
    Axis.EMBED: 'fsdp',
    Axis.HEADS: 'tensor',
    Axis.KV_HEADS: 'tensor',
    Axis.MLP: 'tensor',
    Axis.VOCAB: 'tensor',
    Axis.HEAD_DIM: None,
    Axis.LAYERS: None,
    Axis.ACT_EMBED: None,  # activations keep d_model whole; their batch is what is split
}


def mesh_shape(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """The size of each mesh axis (MESH_AXES' order): resolves -1 within a slice and checks that the
    sizes multiply to the device count; `data` spans all cfg.slices slices (slices x cfg.data)."""
    if n_devices % cfg.slices:
        raise ConfigError(f'mesh.slices={cfg.slices} is invalid: it must divide the {n_devices} devices.')
    require_resolved(cfg, 'mesh', 'a mesh')
    per_slice = n_devices // cfg.slices
    sizes = [getattr(cfg, axis) for axis in MESH_AXES]
    known = math.prod(s for s in sizes if s != -1)
    where = f' per slice ({per_slice} of them)' if cfg.slices > 1 else ''
    named = ', '.join(f'{axis}={size}' for axis, size in zip(MESH_AXES, sizes))
    if -1 in sizes:
        if per_slice % known:
            raise ConfigError(
                f'mesh=({named}) is invalid: the fixed sizes ({known}) must divide the {per_slice} devices{where}.'
            )
        sizes[sizes.index(-1)] = per_slice // known
    if math.prod(sizes) != per_slice:
        raise ConfigError(
            f'mesh=({named}) is invalid: the sizes multiply to {math.prod(sizes)} but there are '
            f'{per_slice} devices{where}; make them multiply to the device count or set one to -1.'
        )
    return dict(zip(MESH_AXES, (cfg.slices * sizes[0], *sizes[1:])))


def without_context(cfg: MeshConfig) -> MeshConfig:
    """The same devices with every sequence whole: `fsdp` takes the context axis' devices (with
    context 0, auto, the axis at -1 takes them)."""
    if cfg.context in (0, 1):
        return dataclasses.replace(cfg, context=1)
    return dataclasses.replace(cfg, context=1, fsdp=-1 if cfg.fsdp == -1 else cfg.fsdp * cfg.context)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh over `devices`. With several slices, `data`'s outer part runs across them (the
    data-center network carries only data parallelism); fsdp, context and tensor stay within a slice."""
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(mesh_shape(cfg, len(devices)).values())
    spanned = len({getattr(d, 'slice_index', 0) for d in devices})
    if spanned != cfg.slices and spanned > 1:
        raise ConfigError(
            f'mesh.slices={cfg.slices} is invalid: the devices span {spanned} slices; '
            f'set --config.mesh.slices={spanned}.'
        )
    if spanned > 1:
        per_slice = (shape[0] // cfg.slices, *shape[1:])
        return Mesh(mesh_utils.create_hybrid_device_mesh(per_slice, (cfg.slices, 1, 1, 1), devices), MESH_AXES)
    try:
        device_array = mesh_utils.create_device_mesh(shape, devices)
    except Exception:  # fake CPU devices and odd shapes have no physical topology to follow
        device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, MESH_AXES)


def row_share(mesh: Mesh, process_index: int | None = None) -> tuple[int, int]:
    """(which share, how many shares) of every batch's rows a process supplies (`jax.process_index()`'s
    by default). Processes whose devices hold the same rows (a sequence split over `context` across
    hosts) form one share: each supplies the same whole sequences. With a share per process, share i
    is process i's."""
    index = jax.process_index() if process_index is None else process_index
    assert mesh.axis_names == MESH_AXES, mesh.axis_names  # the batch axes lead
    rows_of: dict[int, set[int]] = {}
    for row, devices in enumerate(mesh.devices.reshape(math.prod(mesh.shape[a] for a in BATCH_AXES), -1)):
        for device in devices:
            rows_of.setdefault(device.process_index, set()).add(row)
    shares: list[frozenset[int]] = []  # in the order of their first process
    for process in sorted(rows_of):
        if frozenset(rows_of[process]) not in shares:
            shares.append(frozenset(rows_of[process]))
    if len({len(rows) for rows in shares}) > 1 or len(set().union(*shares)) != sum(map(len, shares)):
        held = ', '.join(f'process {p}: rows {sorted(r)}' for p, r in sorted(rows_of.items()))
        raise ConfigError(
            f'mesh={dict(mesh.shape)} cannot feed its hosts: processes must hold the same or '
            f'disjoint equal shares of the batch rows ({held}).'
        )
    return shares.index(frozenset(rows_of[index])), len(shares)


def spec_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (or of a rule): a name, several, or none."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def logical_spec(logical_axes: Sequence[str | None]) -> PartitionSpec:
    """PartitionSpec for logical axis names (Axis; None: replicated); a mesh axis is used at most
    once per array. A name without a rule is a ValueError, not a silently replicated dimension."""
    used: set[str] = set()
    spec = []
    for name in logical_axes:
        if name is not None and name not in LOGICAL_RULES:
            raise ValueError(f'logical axis {name!r} has no sharding rule; the axes are {sorted(LOGICAL_RULES)}')
        axes = tuple(a for a in spec_axes(LOGICAL_RULES[name] if name else None) if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def fitted_sharding(mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    """Like the rules, but a dimension that the mesh axes do not divide stays whole (replicated).

    For arrays whose sizes come from the request rather than the config, such as a decode
    batch of 1 on an 8-way ('data', 'fsdp') mesh.
    """
    fitted = []
    for axes, size in zip(logical_spec(logical_axes), shape):
        fitted.append(axes if size % math.prod(mesh.shape[a] for a in spec_axes(axes)) == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*fitted))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Pins an activation's sharding by the rules inside a `jax.set_mesh` context; else a no-op."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(logical_axes))


def context_parts() -> int:
    """How many devices each sequence is split over: the traced-in mesh's `context` axis (1 outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get('context', 1)


def traced_in(mesh: Mesh | None, fn: Callable) -> Callable:
    """`fn`, traced with `mesh` as the context that `constrain` reads (for jax.jit to wrap)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return wrapped


def param_shardings(abstract_state: nnx.State, mesh: Mesh) -> dict[str, Any]:
    """A pure-dict tree of NamedShardings for the model's parameters, from their metadata."""
    shardings = jax.tree.map(
        lambda v: NamedSharding(mesh, logical_spec(v.out_sharding or ())),
        abstract_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.to_pure_dict(shardings)


def like_params(abstract_opt_state: Any, abstract_params: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state: a leaf whose key path ends in a parameter's path, with that
    parameter's shape (a moment, whatever transformation holds it), is sharded like the parameter;
    counters and the rest are replicated."""

    def names(path) -> tuple[str, ...]:
        return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))

    params = {
        names(p): (x.shape, s)
        for (p, x), s in zip(jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(param_shardings))
    }

    def pick(path, leaf):
        keys = names(path)
        for start in range(len(keys)):
            shape, spec = params.get(keys[start:], (None, None))
            if spec is not None and tuple(shape) == tuple(leaf.shape):
                return spec
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """(batch, length) arrays: batch over ('data', 'fsdp')."""
    return NamedSharding(mesh, logical_spec(('batch', 'length')))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
