"""Bytes that cross the `context` axis in one train step, per variant, read from the compiled program.

    python bench/context_collectives.py [--size tiny|82m|180m|468m] [--contexts 2,4] [--seq_len 256]
                                        [--variants vanilla,resformer,svformer,cla2]

On fake CPU devices (no accelerator needed): the real train step for each variant on a mesh of
`context` devices (the rest fsdp) is compiled, and every collective in its HLO is counted: those
in the scanned layers' loops (forward and backward) times the loop's trip count, the rest once.
The `context` groups are told from fsdp's by their replica groups. Columns, in MB per device per
step, float32 (XLA:CPU may carry bfloat16 collectives in float32; a collective counts the whole
array it assembles or reduces): the attention's all-gathers
and reduce-scatters over the context axis (K and V, forward and backward), their sum as a share
of vanilla's, the least that the attention needs (each layer's K and V gathered forward and their
gradients reduce-scattered backward; SVFormer's V_1 once, not once a layer; a CLA group's K and
V once a group), the rest of the
sequence moved over the context axis (hidden states, token ids: any all-gather, reduce-scatter,
all-to-all or collective-permute outside the attention), the all-reduces over it (the weight
gradients: a context group's devices hold the same parameters, as data parallelism's do), and the
collectives over the other axes (fsdp's parameter gathers and gradient reductions).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from pathlib import Path

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import base, tiny  # noqa: E402
from vrl.core import sharding  # noqa: E402
from vrl.core.sharding import MeshConfig  # noqa: E402
from vrl.model import presets  # noqa: E402
from vrl.train import aot  # noqa: E402
from vrl.train.config import from_configdict  # noqa: E402
from vrl.train.step import TrainSteps  # noqa: E402

BYTES = {'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4, 'pred': 1, 's8': 1, 'u8': 1, 'f64': 8, 's64': 8}
_COLLECTIVE = re.compile(
    r'= (\(.*?\)|\S+) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\((.*)$'
)


def _bytes(result_type: str) -> int:
    """Bytes of an HLO result type: one array (f32[2,64]{1,0}) or a tuple of them."""
    return sum(
        BYTES[dtype] * math.prod(int(d) for d in dims.split(',') if d)
        for dtype, dims in re.findall(r'(\w+)\[([\d,]*)\]', result_type)
    )


def _groups(line: str) -> list[list[int]]:
    """The device groups of a collective, from its replica_groups: explicit ({{0,1},{2,3}}), iota
    ([4,2]<=[8]), or over axes of a mesh of device ids in order (mesh['axis_0'=2,'axis_1'=4] {'axis_1'});
    a collective-permute's (source, target) pairs."""
    pairs = re.search(r'source_target_pairs=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}', line)
    if pairs:  # a collective-permute: each (source, target) pair
        return [[int(i) for i in pair.split(',')] for pair in re.findall(r'\{([\d,]*)\}', pairs.group(1))]
    explicit = re.search(r'replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}', line)
    if explicit:
        return [[int(i) for i in group.split(',') if i] for group in re.findall(r'\{([\d,]*)\}', explicit.group(1))]
    iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', line)
    if iota:  # [groups,size]<=[dims] with an optional transpose T(perm) of the ids before the reshape
        ids = np.arange(math.prod(int(d) for d in iota.group(3).split(','))).reshape(
            [int(d) for d in iota.group(3).split(',')]
        )
        if iota.group(4):
            ids = ids.transpose([int(d) for d in iota.group(4).split(',')])
        return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    meshed = re.search(
        r'replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? '
        r'\{([^}]*)\}',
        line,
    )
    if not meshed:
        raise ValueError(f'replica groups not understood: {line[:300]}')
    sizes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", meshed.group(1))}
    over = re.findall(r"'(\w+)'", meshed.group(4))
    ids = np.arange(math.prod(sizes.values()))
    if meshed.group(2):  # the mesh's devices in an order of their own: ids reshaped, then transposed
        ids = ids.reshape([int(d) for d in meshed.group(2).split(',')])
        if meshed.group(3):
            ids = ids.transpose([int(d) for d in meshed.group(3).split(',')])
    ids = ids.reshape(list(sizes.values()))
    axes = list(sizes)
    ids = np.moveaxis(ids, [axes.index(a) for a in over], range(len(axes) - len(over), len(axes)))
    return ids.reshape(-1, math.prod(sizes[a] for a in over)).tolist()


def count(hlo: str, context_groups: set[tuple[int, ...]]) -> dict[str, int]:
    """Bytes per device per step of each collective kind: the attention's over the context axis (in
    its shard_map), the rest over the context axis, and those over other axes. A collective counts
    the whole array it assembles or reduces (a reduce-scatter's operand, not its shard)."""
    trips = {body: int(n) for body, n in re.findall(r'body=%?([\w.\-]+).*?"known_trip_count":\{"n":"(\d+)"\}', hlo)}
    totals: dict[str, int] = {}
    for computation in re.split(r'\n(?=\S)', hlo):
        name = re.match(r'(?:ENTRY )?%?([\w.\-]+)', computation)
        times = trips.get(name.group(1), 1) if name else 1
        for line in computation.splitlines():
            match = _COLLECTIVE.search(line)
            if not match:
                continue
            result_type, kind, rest = match.groups()
            groups = _groups(rest)
            within = all(any(set(g) <= set(c) for c in context_groups) for g in groups)
            axis = 'other' if not within else 'attention' if '/shard_map/' in rest else 'context'
            whole = _bytes(result_type) * (len(groups[0]) if kind == 'reduce-scatter' else 1)
            totals[f'{kind} {axis}'] = totals.get(f'{kind} {axis}', 0) + times * whole
    return totals


def least_bytes(config, mesh_shape: dict[str, int]) -> int:
    """The attention's own exchange per device per step: whole-sequence K and V (in the compute
    dtype) of this device's rows, gathered forward and reduce-scattered backward, once for each
    layer that projects them: SVFormer's V_1 once, a CLA group's K (and V, without value
    embeddings) once a group."""
    m = config.model
    rows = config.data.batch_size // (mesh_shape['data'] * mesh_shape['fsdp'])
    kv = rows * config.data.seq_len * (m.n_kv_heads // mesh_shape['tensor']) * m.head_dim
    kv *= jnp.dtype(m.compute_dtype).itemsize
    groups = -(-m.n_layers // m.kv_share)
    values = 1 if m.attention == 'svformer' else m.n_layers if m.value_embed_layers else groups
    return 2 * (groups + values) * kv


def measure(config) -> tuple[dict[str, int], int]:
    """`count` of the train step compiled for `config` on this process' devices, and `least_bytes`."""
    config = aot.execution(config, jax.devices()[0].platform, say=lambda line: None)
    mesh = sharding.make_mesh(config.mesh)
    trainer = TrainSteps(config, mesh)
    shape = (config.data.batch_size, config.data.seq_len)
    batch = {
        k: jax.ShapeDtypeStruct(shape, jnp.int32 if k != 'loss_mask' else jnp.float32, sharding=trainer.batch_sharding)
        for k in ('inputs', 'targets', 'loss_mask')
    }
    hlo = trainer.train_step.lower(trainer.abstract_state, batch).compile().as_text()
    ids = mesh.device_ids  # (data, fsdp, context, tensor)
    context = mesh.shape['context']
    groups = {tuple(sorted(int(i) for i in row)) for row in ids.transpose(0, 1, 3, 2).reshape(-1, context)}
    return count(hlo, groups), least_bytes(config, dict(mesh.shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        '--size', default='tiny', help='tiny (configs/tiny.py) or a configs/base.py size: 82m, 180m, 468m'
    )
    parser.add_argument('--contexts', default='2,4')
    parser.add_argument('--seq_len', type=int, default=256)
    parser.add_argument(
        '--variants',
        default='vanilla,resformer,svformer,cla2',
        help='vrl/model/presets.py names; the first is the one the others are compared with',
    )
    args = parser.parse_args()
    start = from_configdict(tiny.get_config() if args.size == 'tiny' else base.get_config(f'vanilla,{args.size}'))
    start = dataclasses.replace(
        start,
        data=dataclasses.replace(start.data, seq_len=args.seq_len, batch_size=jax.device_count()),
        train=dataclasses.replace(start.train, microbatches=1),  # base.py's are auto
        model=dataclasses.replace(start.model, remat='none', compute_dtype='float32'),
    )
    print(
        f'{args.size}, seq_len {args.seq_len}, {jax.device_count()} {jax.devices()[0].platform} devices; '
        'MB per device per step'
    )
    print(
        '| variant | context | K/V all-gather | K/V reduce-scatter | vs vanilla | attention needs '
        '| sequence moved | gradient all-reduce | other axes |'
    )
    print('|---|---|---|---|---|---|---|---|---|')
    for context in [int(c) for c in args.contexts.split(',')]:
        vanilla = None
        for variant in args.variants.split(','):
            model = dataclasses.replace(presets.apply(variant, start.model), attention_impl='xla')
            mesh = MeshConfig(data=1, fsdp=-1, tensor=1, context=context)
            config = dataclasses.replace(start, model=model, mesh=mesh)
            totals, least = measure(config)
            exchanged = totals.get('all-gather attention', 0) + totals.get('reduce-scatter attention', 0)
            vanilla = vanilla or exchanged
            moved = sum(v for k, v in totals.items() if k.endswith(' context') and not k.startswith('all-reduce'))
            other = sum(v for k, v in totals.items() if k.endswith(' other'))
            print(
                f'| {variant} | {context} | {totals.get("all-gather attention", 0) / 1e6:.2f} | '
                f'{totals.get("reduce-scatter attention", 0) / 1e6:.2f} | {exchanged / vanilla:.2f} | '
                f'{least / 1e6:.2f} | {moved / 1e6:.2f} | {totals.get("all-reduce context", 0) / 1e6:.2f} | '
                f'{other / 1e6:.2f} |'
            )


if __name__ == '__main__':
    main()
