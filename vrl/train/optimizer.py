"""The update rule: AdamW (docs/paper.md's recipe) or Muon on the hidden matrices, and the LR schedule.

Every parameter belongs to one group, named by its leaf name (`group`):
  matrix  the hidden weight matrices (attention wq, wk, wv, wo; MLP w_gate, w_up, w_down)
  embed   the token embedding and the value-embedding tables (lookups, not matrix products)
  head    the output projection
  scalar  the rest: norm weights, lambdas, gates, the per-token mix, DenseFormer's weights
Under `adamw` all four share one AdamW; under `muon` the matrices get Muon (optax.contrib's
Newton-Schulz on Nesterov momentum) and the other groups AdamW. Each non-matrix group's LR is
peak_lr times its ratio, one schedule for all.

Muon orthogonalises each weight as the matrix it multiplies by: the `embed` axis against the rest
(heads x head_dim, or mlp), and a scanned stack's `layers` axis is a batch axis, so each layer's
matrix is orthogonalised on its own (optax vmaps over it). The momentum is sharded like its weight
(vrl/train/step.py); on a mesh XLA partitions the iteration's matrix products, which stay exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from vrl.core.config import ConfigError
from vrl.train.config import OptimizerConfig

GROUPS = ('matrix', 'embed', 'head', 'scalar')
_MATRICES = ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', 'w_down')
_EMBEDDINGS = ('embed', 'tables')
# RMSNorm weights (leaf 'scale'), QK-norm's scales, ResFormer's lambdas and DenseFormer's averaging weights
_NOT_DECAYED = ('scale', 'q_norm', 'k_norm', 'lambdas', 'depth_weights')

Axes = tuple[str | None, ...]  # a parameter's logical axis names (vrl/model/params.py)


# Each optimizer's recipe: the fields it sets over a config's optimizer section (the schedule's
# length and warmup stay the config's). muon starts from the speedruns' (nanochat's) relative LRs:
# Muon at 0.02 on the matrices; AdamW with betas (0.8, 0.95) at 10x that on the embeddings, 0.2x on
# the head, no weight decay, and a wsd schedule that decays over the last 40%.
RECIPES: dict[str, dict[str, Any]] = {
    'adamw': {},
    'muon': dict(
        name='muon',
        peak_lr=0.02,
        schedule='wsd',
        decay_fraction=0.4,
        embed_lr_ratio=10.0,
        head_lr_ratio=0.2,
        scalar_lr_ratio=1.0,
        b1=0.8,
        weight_decay=0.0,
    ),
}


def recipe(cfg: OptimizerConfig, name: str) -> OptimizerConfig:
    """`cfg` under optimizer `name`'s recipe, with final_lr and init_lr kept in proportion to peak_lr."""
    if name not in RECIPES:
        raise ConfigError(f'optimizer recipe {name!r} is invalid: allowed one of {sorted(RECIPES)}.')
    fields = dict(RECIPES[name])
    if 'peak_lr' in fields:
        scale = fields['peak_lr'] / cfg.peak_lr
        fields.update(init_lr=cfg.init_lr * scale, final_lr=cfg.final_lr * scale)
    return dataclasses.replace(cfg, **fields)


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, 'key', k)) for k in path)


def group(path) -> str:
    """The group of the parameter at `path` (a pytree key path or tuple of names)."""
    name = _keys(path)[-1]
    if name in _MATRICES:
        return 'matrix'
    if name in _EMBEDDINGS:
        return 'embed'
    return 'head' if name == 'head' else 'scalar'


def matrix_dims(axes: Axes) -> MuonDimensionNumbers:
    """How Muon sees a weight with these logical axes: the model dimension ('embed') is the input
    axis unless it is the last (an output projection: wo, w_down); `layers` is a batch axis."""
    axes = tuple(axes)
    own = [i for i, name in enumerate(axes) if name != 'layers']
    if 'embed' not in axes or len(own) < 2:
        raise ValueError(f'a Muon weight needs an embed axis and another: got axes {axes}')
    if axes[-1] == 'embed':
        return MuonDimensionNumbers(reduction_axis=tuple(own[:-1]), output_axis=own[-1])
    embed = axes.index('embed')
    return MuonDimensionNumbers(reduction_axis=embed, output_axis=tuple(i for i in own if i != embed))


def weight_decay_mask(params: Any) -> Any:
    """True for parameters that are decayed: every weight matrix and the embeddings, the gates'
    d_model x kv_heads projections (value embeddings, the per-token mix) among them; the paper's
    recipe decays neither norms nor scalars, so norm scales, lambdas and DenseFormer's weights are
    not."""

    def decayed(path, _):
        return not set(_keys(path)) & set(_NOT_DECAYED)

    return jax.tree_util.tree_map_with_path(decayed, params)


def learning_rate(cfg: OptimizerConfig, peak: float | None = None) -> optax.Schedule:
    """The LR at each step, peaking at `peak` (default peak_lr; init_lr and final_lr scale with it).

    cosine: init -> peak linearly over warmup_steps, then a cosine to final at decay_steps.
    wsd: the same warmup, peak until decay_start, then linear (or 1 - sqrt) to final at decay_steps.
    """
    if not cfg.decay_steps:
        raise ValueError(
            'optimizer.decay_steps=0 stands for train.steps: take the OptimizerConfig of a Config, which resolves it'
        )
    peak = cfg.peak_lr if peak is None else peak
    init, final = cfg.init_lr * peak / cfg.peak_lr, cfg.final_lr * peak / cfg.peak_lr
    if cfg.schedule == 'cosine':
        return optax.warmup_cosine_decay_schedule(
            init_value=init,
            peak_value=peak,
            warmup_steps=cfg.warmup_steps,
            decay_steps=cfg.decay_steps,
            end_value=final,
        )
    decay_length = cfg.decay_steps - cfg.decay_start
    power = 1.0 if cfg.decay_shape == 'linear' else 0.5

    def decay(step):
        progress = jax.numpy.clip(step / decay_length, 0.0, 1.0)
        return final + (peak - final) * (1.0 - progress**power)

    warmup = optax.linear_schedule(init, peak, cfg.warmup_steps)
    stable = optax.constant_schedule(peak)
    return optax.join_schedules([warmup, stable, decay], boundaries=[cfg.warmup_steps, cfg.decay_start])


def schedule_note(cfg: OptimizerConfig, steps: int) -> str:
    """A line for the start of a run whose train.steps stops before the schedule's end ('' if it
    does not): where its LR will be, and how to make the schedule end with the run."""
    if not 0 < steps < cfg.decay_steps:
        return ''
    ends = (
        f'train.steps={steps} ends before the {cfg.schedule} schedule does (optimizer.decay_steps='
        f'{cfg.decay_steps}): its last step trains at lr {float(learning_rate(cfg)(steps - 1)):.2e} (the '
        f'schedule peaks at {cfg.peak_lr:g} and ends at final_lr {cfg.final_lr:g}); '
    )
    if steps <= cfg.warmup_steps:
        return ends + (
            f'it stops inside the warmup (optimizer.warmup_steps={cfg.warmup_steps}): set '
            f'--config.optimizer.warmup_steps={steps // 4} to decay within the run'
        )
    return ends + f'set --config.optimizer.decay_steps={steps} to end the schedule with the run'


def _scale_each(factor: Callable[[tuple[str, ...], jax.Array], float]) -> optax.GradientTransformation:
    """Multiplies each update by factor(its key path, it) (stateless)."""

    def scale(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(lambda path, u: u * factor(_keys(path), u), updates), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), scale)


def _adamw(cfg: OptimizerConfig) -> optax.GradientTransformation:
    return optax.adamw(
        learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=weight_decay_mask
    )


def _width_scale(axes: Axes, shape: tuple[int, ...]) -> float:
    """Muon's update scale for a weight: sqrt(max(1, fan_out / fan_in)) (Keller Jordan's Muon)."""
    dims = matrix_dims(axes)
    size = lambda ax: math.prod(shape[i] for i in ((ax,) if isinstance(ax, int) else ax))  # noqa: E731
    return math.sqrt(max(1.0, size(dims.output_axis) / size(dims.reduction_axis)))


def _muon(cfg: OptimizerConfig, axes: dict[tuple[str, ...], Axes]) -> optax.GradientTransformation:
    """Muon for the hidden matrices, AdamW for the rest, as one partitioned transformation."""

    def dims(tree):  # called on the matrix group's tree: its other leaves are optax's MaskedNode
        return jax.tree_util.tree_map_with_path(lambda path, _: matrix_dims(axes[_keys(path)]), tree)

    muon = optax.chain(
        scale_by_muon(ns_steps=cfg.muon_ns_steps, beta=cfg.muon_momentum, nesterov=True, weight_dimension_numbers=dims),
        _scale_each(lambda path, u: _width_scale(axes[path], u.shape)),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(learning_rate(cfg)),
    )
    labels = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: 'muon' if group(path) == 'matrix' else 'adamw', params
    )
    return optax.partition({'muon': muon, 'adamw': _adamw(cfg)}, labels)


def make(cfg: OptimizerConfig, axes: dict[tuple[str, ...], Axes]) -> optax.GradientTransformation:
    """The optimizer for parameters whose logical axes are `axes` (key path -> axis names)."""
    core = _adamw(cfg) if cfg.name == 'adamw' else _muon(cfg, axes)
    parts = [core]
    ratios = {'matrix': 1.0, 'embed': cfg.embed_lr_ratio, 'head': cfg.head_lr_ratio, 'scalar': cfg.scalar_lr_ratio}
    if any(r != 1.0 for r in ratios.values()):
        parts.append(_scale_each(lambda path, _: ratios[group(path)]))
    if cfg.grad_clip:
        parts.insert(0, optax.clip_by_global_norm(cfg.grad_clip))
    return optax.chain(*parts) if len(parts) > 1 else core


def param_axes(abstract_state: Any) -> dict[tuple[str, ...], Axes]:
    """Key path -> logical axis names of each parameter of an abstract nnx.State (vrl/model/params.py)."""
    leaves = jax.tree_util.tree_leaves_with_path(abstract_state, is_leaf=lambda x: hasattr(x, 'out_sharding'))
    return {_keys(path): tuple(v.out_sharding or ()) for path, v in leaves}
