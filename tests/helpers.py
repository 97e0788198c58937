"""Small shared builders for the tests."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import modern
from vrl.model import presets
from vrl.model.config import ModelConfig


def small_model_config(**overrides) -> ModelConfig:
    """A 3-layer GQA model in float32: big enough to exercise every path, fast on CPU; its execution
    settings resolved (XLA attention, every hand-written backward), as a model built outside a TrainSteps needs."""
    base = ModelConfig(
        vocab_size=97,
        vocab_pad_multiple=32,
        n_layers=3,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        compute_dtype='float32',
        attention_impl='xla',
        hand_vjp='all',
    )
    return dataclasses.replace(base, **overrides)


# Every variant, every ResFormer lambda mode, the paper's baselines and the later family,
# and some of their compositions (the small config has 3 layers and GQA: 4 heads, 2 kv heads).
NAMED_VARIANTS = {
    'vanilla': dict(attention='vanilla'),
    'svformer': dict(attention='svformer'),
    'resformer-identity': dict(attention='resformer', lambda_mode='identity'),
    'resformer-constant': dict(attention='resformer', lambda_mode='constant', lambda1=1.5, lambda2=0.7),
    'resformer-learnable': dict(attention='resformer', lambda_mode='learnable'),
    'resformer-learnable_plus': dict(attention='resformer', lambda_mode='learnable_plus'),
    'resformer-sparse': dict(attention='resformer', lambda_mode='sparse', sparse_layers=(3,), lambda1=5.0),
    'resformer-per_token': dict(attention='resformer', lambda_mode='per_token'),
    'neutreno': dict(attention='vanilla', neutreno=True),
    'resformer-neutreno': dict(attention='resformer', neutreno=True, neutreno_lambda=0.2),
    'denseformer': dict(attention='vanilla', residual='dense'),
    'cla2': dict(attention='vanilla', kv_share=2),
    'svformer-cla2': dict(attention='svformer', kv_share=2),
    'value_embeds': dict(attention='vanilla', value_embed_layers=(1, 3)),
    'resformer-value_embeds-shared': dict(
        attention='resformer', lambda_mode='learnable', value_embed_layers=(1, 2, 3), value_embed_tables=(0, 1, 0)
    ),
    'all-baselines': dict(attention='vanilla', neutreno=True, residual='dense', kv_share=2, value_embed_layers=(3,)),
    'mudd-qkvr': dict(attention='vanilla', residual='mudd', mudd_ways='qkvr'),
    'resformer-mudd-vr': dict(
        attention='resformer',
        lambda_mode='per_token',
        residual='mudd',
        mudd_ways='vr',
        mudd_layers=(1, 3),
        value_embed_layers=(2,),
    ),
    'svformer-mudd-r': dict(attention='svformer', residual='mudd', mudd_ways='r', mudd_layers=(2,)),
}

# SkipV1Former (model.skip_v1: V_1 gives layers >= 2 their last value head of the small config's 2), alone
# and with the variants it composes with: ResFormer's mix, CLA, layer 1's value embedding, QK-norm
SKIP_V1_VARIANTS = {
    'skipv1': dict(attention='vanilla', skip_v1=1),
    'skipv1-resformer': dict(attention='resformer', lambda_mode='learnable', skip_v1=1),
    'skipv1-cla2-value_embeds-qk_norm': dict(
        attention='vanilla', skip_v1=1, kv_share=2, value_embed_layers=(1,), qk_norm=True
    ),
}

# Attention residuals (vrl/model/residual/attnres.py) on the small config's 3 layers: full, Block AttnRes as one
# block (a partial sum throughout) and as a block per layer, on the value-residual variants and beside CLA,
# SkipV1Former, a value embedding, QK-norm and windows
ATTN_RES_VARIANTS = {
    'attnres-full': dict(attention='vanilla', residual='attnres', attn_residual_blocks=0),
    'attnres-block1-resformer': dict(
        attention='resformer', lambda_mode='learnable_plus', residual='attnres', attn_residual_blocks=1
    ),
    'attnres-block3-svformer-cla2': dict(attention='svformer', kv_share=2, residual='attnres', attn_residual_blocks=3),
    'attnres-full-skipv1-value_embeds-qk_norm-windows': dict(
        attention='vanilla',
        residual='attnres',
        attn_residual_blocks=0,
        skip_v1=1,
        value_embed_layers=(1,),
        qk_norm=True,
        attention_window=3,
        global_layers=(2,),
    ),
}

# Hyper-connections (vrl/model/residual/hyper.py), both kinds, static and dynamic, with other streams counts and on
# the value-residual variants (checked by the tests of the model, decoding, accounting and sharding)
HYPER_VARIANTS = {
    'hc': dict(attention='vanilla', residual='hc'),
    'mhc': dict(attention='vanilla', residual='mhc'),
    'resformer-hc-static-3': dict(
        attention='resformer',
        lambda_mode='per_token',
        residual='hc',
        hyper_dynamic=False,
        hyper_streams=3,
        value_embed_layers=(2,),
    ),
    'svformer-cla2-mhc-2': dict(attention='svformer', kv_share=2, residual='mhc', hyper_streams=2),
    'neutreno-mhc-3': dict(attention='vanilla', neutreno=True, residual='mhc', hyper_streams=3),
}

# The named variants whose code paths differ where a compiled program is checked (the scan against the
# loop, bfloat16 gradients, cached decoding): the scalar lambda modes that learnable_plus's path runs
# with other values, and the baselines that a composition runs too (CLA in svformer-cla2, NeuTRENO in
# resformer-neutreno, value embeddings in resformer-value_embeds-shared), left out
_RUN_BY_ANOTHER = {'resformer-identity', 'resformer-constant', 'resformer-learnable', 'resformer-sparse'}
_RUN_BY_ANOTHER |= {'cla2', 'neutreno', 'value_embeds'}
DISTINCT_PATHS = {name: fields for name, fields in NAMED_VARIANTS.items() if name not in _RUN_BY_ANOTHER}


def modern_fields(variant: str) -> dict:
    """configs/modern.py's model fields on a 4-layer small shape (layer 4 global), the window cut to 5
    tokens and the final cap to 3 so that both bend what a test's short, random model computes."""
    small = small_model_config(n_layers=4)
    cfg = modern.modern(presets.apply(modern.PRESET[variant], small))
    cfg = dataclasses.replace(cfg, attention_window=5, final_logits_soft_cap=3.0)
    changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(small, f.name)}
    return {name: getattr(cfg, name) for name in changed | {'n_layers'}}


# What the export tests (Hugging Face, vLLM) check: the named variants, QK-norm on the one whose keys
# are stacked apart (CLA) and whose V is V_1, soft caps that bend the logits (a final cap of 1 flattens
# a random model's into float32 near-ties, which two correct implementations break apart), windows of 5
# (layer 2 global) over longer sequences, and the modern recipe (all of these with value embeddings)
# on ResFormer and SVFormer, the hyper-connected ones, attention residuals and SkipV1Former (also on MHA:
# 4 kv heads, 2 of them V_1's)
EXPORT_VARIANTS = {
    **NAMED_VARIANTS,
    'svformer-cla2-qk_norm': dict(attention='svformer', kv_share=2, qk_norm=True),
    'resformer-soft_caps': dict(
        attention='resformer', lambda_mode='learnable_plus', attn_logits_soft_cap=0.5, final_logits_soft_cap=3.0
    ),
    'svformer-windows': dict(attention='svformer', attention_window=5, global_layers=(2,)),
    'modern-resformer': modern_fields('resformer'),
    'modern-svformer': modern_fields('svformer'),
    **HYPER_VARIANTS,
    **ATTN_RES_VARIANTS,
    **SKIP_V1_VARIANTS,
    'skipv1-mha': dict(attention='vanilla', n_kv_heads=4, skip_v1=2),
    'skipv1-cla2': dict(attention='vanilla', skip_v1=1, kv_share=2),
}
VARIANTS = list(NAMED_VARIANTS.values())
VARIANT_IDS = list(NAMED_VARIANTS)
FAST_TIER = ('vanilla', 'resformer-learnable_plus', 'svformer', 'all-baselines')  # the rest are marked slow


def cases(named: dict[str, Any], fast: Iterable[str]) -> list:
    """pytest parameters {id: value, or a tuple of values}, each id outside `fast` marked slow:
    `pytest -m "not slow"` runs the `fast` ones, the full suite all of them."""
    return [
        pytest.param(
            *(value if isinstance(value, tuple) else (value,)), id=name, marks=() if name in fast else pytest.mark.slow
        )
        for name, value in named.items()
    ]


def variant_params(by_name: bool = False) -> list:
    """Every named variant as a pytest parameter (its fields, or its name), the ones outside FAST_TIER
    marked slow: `pytest -m "not slow"` checks four variants, the full suite all of them."""
    return cases({name: name if by_name else fields for name, fields in NAMED_VARIANTS.items()}, FAST_TIER)


def random_tokens(seed: int, B: int = 2, L: int = 11, vocab: int = 97) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (B, L), 0, vocab)


def randomize(model: nnx.Module, seed: int) -> None:
    """Fresh random values for every parameter (norm scales, lambdas and gates included): each moved by
    0.3 N(0, 1) noise drawn on the host (NumPy: no program to compile per parameter shape)."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    new = [jnp.asarray(np.asarray(x) + 0.3 * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    nnx.update(model, jax.tree.unflatten(treedef, new))


def piece_bytes(tok) -> np.ndarray:
    """(vocab,) the UTF-8 bytes of text each piece of sentencepiece model `tok` stands for, from its
    pieces alone: a reference, independent of offsets, that holds for a model without a normaliser."""
    sp = tok._sp
    return np.array(
        [
            1
            if sp.is_byte(i)
            else 0
            if sp.is_control(i) or sp.is_unknown(i)
            else len(sp.id_to_piece(i).replace('\u2581', ' ').encode('utf-8'))
            for i in range(sp.get_piece_size())
        ],
        np.int64,
    )


def module_matmul_params(cfg: ModelConfig) -> int:
    """The weights of `cfg`'s real Decoder that take part in a matmul per token, found by their
    parameter paths: every parameter but the norms' scales (QK-norm's too), ResFormer's lambdas, DenseFormer's
    weights, MUDD's static weights, hyper-connections' and attention residuals' weights (accounting counts their
    multiply-adds apart) and
    the lookup tables (the input embedding, unless tied, when it is the head, and the value-embedding tables)."""
    from vrl.model.decoder import Decoder

    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(abstract, nnx.Param)):
        keys = [str(getattr(k, 'key', k)) for k in path]
        lookup = keys[0] == 'embed' and not cfg.tie_embeddings or 'tables' in keys
        hyper = any(k.endswith(('_hyper', '_depth')) for k in keys) or keys[0] == 'depth_output'
        norm = 'scale' in keys or 'q_norm' in keys or 'k_norm' in keys
        if not (lookup or hyper or norm or keys[0] in ('lambdas', 'depth_weights') or 'static' in keys):
            total += leaf.size
    return total


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def copy_params(src: nnx.Module, dst: nnx.Module) -> None:
    """Copies into dst every parameter that src has at the same path; dst keeps its own others
    (e.g. a gate vanilla lacks), and may lack some of src's (e.g. SVFormer's W_V)."""
    src_params = nnx.to_pure_dict(nnx.state(src, nnx.Param))

    def pick(path, own):
        tree = src_params
        for key in path:
            if key.key not in tree:
                return own
            tree = tree[key.key]
        return tree

    dst_state = nnx.state(dst, nnx.Param)
    nnx.replace_by_pure_dict(dst_state, jax.tree_util.tree_map_with_path(pick, nnx.to_pure_dict(dst_state)))
    nnx.update(dst, dst_state)


def tensorboard_scalars(folder) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under `folder`, read with tensorboardX's own
    protos: {(event file's folder relative to `folder`, tag): [(step, value), ...]}, as TensorBoard
    shows them: a session start at step S (a resumed run's purge_step) drops the points at S and later
    that the files before it hold."""
    import os
    import struct

    from tensorboardX.proto import event_pb2

    scalars: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for directory, _, names in os.walk(folder):
        for name in sorted(n for n in names if n.startswith('events.')):
            with open(os.path.join(directory, name), 'rb') as f:
                data = f.read()
            offset = 0
            while offset < len(data):  # records: u64 length, u32 crc, payload, u32 crc
                (length,) = struct.unpack_from('<Q', data, offset)
                event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
                offset += 16 + length
                if event.session_log.status == event_pb2.SessionLog.START:
                    for (where, tag), points in scalars.items():
                        if where == os.path.relpath(directory, folder):
                            points[:] = [(step, value) for step, value in points if step < event.step]
                for value in event.summary.value:
                    key = (os.path.relpath(directory, folder), value.tag)
                    scalars.setdefault(key, []).append((event.step, value.simple_value))
    return scalars


def wandb_records(path) -> list:
    """The records (wandb's protobuf `Record`) of an offline run's run-ID.wandb file: a 7-byte header
    (':W&B', magic, version), then LevelDB-log records in 32 KiB blocks, each a 7-byte header
    (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    with open(path, 'rb') as f:
        data = f.read()
    assert data[:4] == b':W&B', path
    block, offset, pending, records = 32768, 7, b'', []
    while offset + 7 <= len(data):
        room = block - offset % block
        if room < 7:  # a block's tail too short for a header is padding
            offset += room
            continue
        length, kind = int.from_bytes(data[offset + 4 : offset + 6], 'little'), data[offset + 6]
        if kind == 0:  # zero padding to the block's end
            offset += room
            continue
        pending = (b'' if kind in (1, 2) else pending) + data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def assert_resumes_exactly(make: Callable[[], Iterator[dict]], uninterrupted: list[dict], taken: int) -> None:
    """An iterator from `make()`, restored to the position another one saved after `taken` batches
    (through JSON, as a checkpoint stores it), yields `uninterrupted[taken:]` bit for bit."""
    first = iter(make())
    for _ in range(taken):
        next(first)
    resumed = iter(make())
    resumed.set_state(json.loads(json.dumps(first.get_state())))
    for want in uninterrupted[taken:]:
        got = next(resumed)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def hiding(folder, *packages: str) -> dict[str, str]:
    """An environment for a subprocess in which `packages` (importable names) cannot be imported, as
    where requirements-extra.txt is not installed: a sitecustomize.py in `folder`, on PYTHONPATH,
    puts a finder before every other that refuses them."""
    import os
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / 'sitecustomize.py').write_text(
        'import sys\n\n\n'
        'class _Hidden:\n'
        f'    names = {set(packages)!r}\n\n'
        '    def find_spec(self, name, path=None, target=None):\n'
        "        if name.split('.')[0] in self.names:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n\n\n"
        'sys.meta_path.insert(0, _Hidden())\n'
    )
    return {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [str(folder), os.environ.get('PYTHONPATH')]))}


def train_steps(config: Any, mesh: Any) -> Any:
    """A TrainSteps for `config` on `mesh`, its per-platform autos resolved first (vrl.train.aot's
    `execution`, what a run's resolve does before it fits what needs a compile)."""
    from vrl.train import aot
    from vrl.train.step import TrainSteps

    return TrainSteps(aot.execution(config, mesh.devices.flat[0].platform, lambda line: None), mesh)
