"""Per-layer diagnostics of a model on fixed validation sequences: one code for what `vrl.experiments.analyze`
reports of a checkpoint and what training logs every `train.diagnostics_every` steps, so that the
two agree to rounding on the same parameters and sequences.

The statistics are vrl/model/layer_stats.py's (attention entropy, attention on the first token, value and
hidden-state norms, token similarity, value-embedding gates), each averaged over the sequences, one
value per layer; for a ResFormer with scalar lambdas also the (lambda_1, lambda_2) each layer n >= 2
uses now.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from vrl.core import sharding
from vrl.core.errors import VrlError
from vrl.data import pipeline
from vrl.data.tokenizer import Tokenizer
from vrl.model import layer_stats
from vrl.train.config import Config
from vrl.train.step import TrainSteps

STATISTICS = layer_stats.LayerStats._fields


class DiagnosticsError(VrlError, ValueError):
    """The validation split cannot give the sequences asked for; the message says what to lower."""


def validation_sequences(config: Config, tok: Tokenizer, n: int, seq_len: int, setting: str) -> np.ndarray:
    """The first n full windows (every token real) of the run's validation split (a mixture's first
    dataset's): (n, seq_len) int32. `setting` names what asked for n, for the error."""
    cfg = dataclasses.replace(config.data, seq_len=seq_len, batch_size=n, num_workers=0, document_masking=False)
    name = cfg.sources()[0][0]
    rows = []
    for batch in pipeline.eval_batches(cfg, tok, 0, name=name):
        rows += [x for x, mask in zip(batch['inputs'], batch['loss_mask']) if mask.all()]
        if len(rows) >= n:
            return np.stack(rows[:n])
    raise DiagnosticsError(
        f'the {cfg.eval_split} split of {name!r} holds only {len(rows)} full sequences of '
        f'{seq_len} tokens, fewer than {setting}={n}: lower {setting} or the sequence length.'
    )


def summed_stats(trainer: TrainSteps) -> Callable[[Any, jax.Array], dict[str, jax.Array]]:
    """A jitted function of (params, tokens (B, L)) to each statistic summed over the B sequences:
    (layers,) each, (layers + 1,) for similarity (from the embedding); replicated on every device,
    so that every process can read it."""

    def sums(params: Any, tokens_BxL: jax.Array) -> dict[str, jax.Array]:
        stats = nnx.merge(trainer.graphdef, params).layer_stats(tokens_BxL)
        return {name: jnp.sum(value, axis=1) for name, value in stats._asdict().items()}

    return jax.jit(sharding.traced_in(trainer.mesh, sums), out_shardings=NamedSharding(trainer.mesh, PartitionSpec()))


def averaged(
    stats_fn: Callable, trainer: TrainSteps, params: Any, tokens_NxL: np.ndarray, batch_size: int
) -> dict[str, list[float]]:
    """Each statistic per layer, averaged over the N sequences, taken batch_size at a time; the
    value-embedding gate only for a model with value embeddings, null in the layers without one."""
    sums: dict[str, np.ndarray] = {}
    for start in range(0, len(tokens_NxL), batch_size):
        batch = tokens_NxL[start : start + batch_size]
        placed = jax.device_put(batch, sharding.fitted_sharding(trainer.mesh, ('batch', 'length'), batch.shape))
        for name, value in jax.device_get(stats_fn(params, placed)).items():
            sums[name] = sums.get(name, 0.0) + np.asarray(value, np.float64)
    means = {name: [None if np.isnan(x) else x for x in (sums[name] / len(tokens_NxL)).tolist()] for name in STATISTICS}
    return means if trainer.config.model.value_embed_layers else {n: v for n, v in means.items() if n != 'value_gate'}


def lambdas(trainer: TrainSteps, params: Any) -> dict[str, list[float]]:
    """ResFormer's (lambda_1, lambda_2) for layers 2..L as the model uses them now; {} for a model
    without scalar lambdas."""
    model = nnx.merge(trainer.graphdef, params)
    if getattr(model, 'lambdas', None) is None:
        return {}
    mix = jax.device_get(model.lambdas.for_stack())
    return {'lambda_1': np.asarray(mix.v1, np.float64).tolist(), 'lambda_2': np.asarray(mix.vn, np.float64).tolist()}


class TrainingDiagnostics:
    """What training logs every train.diagnostics_every steps: the statistics on the first
    train.diagnostics_sequences full validation sequences (read once), and the lambdas."""

    def __init__(self, trainer: TrainSteps, tokenizer: Tokenizer):
        cfg = trainer.config
        self.trainer, self.stats_fn = trainer, summed_stats(trainer)
        self.tokens = validation_sequences(
            cfg, tokenizer, cfg.train.diagnostics_sequences, cfg.data.seq_len, 'train.diagnostics_sequences'
        )
        self.batch_size = cfg.data.batch_size

    def __call__(self, params: Any) -> dict[str, list[float]]:
        return averaged(self.stats_fn, self.trainer, params, self.tokens, self.batch_size) | lambdas(
            self.trainer, params
        )
