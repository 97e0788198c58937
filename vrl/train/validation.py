"""Validation: each validation set's loss (nats per target token) and bits per byte, of one run or of
each run of a group (the loop's Evaluation hook, the tests and the tools read it the same way)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from vrl.data import pipeline
from vrl.train.config import Config
from vrl.train.step import RunGroup, TrainSteps


@dataclasses.dataclass(frozen=True)
class Validation:
    """Per evaluation set (data.eval's, or the eval_split of data.name or of each dataset of
    data.mixture), named NAME, or NAME:SPLIT for another split: (nats per target token,
    bits per byte = summed token losses / ln 2 / UTF-8 bytes of the text they stand for)."""

    domains: dict[str, tuple[float, float]]

    @property
    def loss(self) -> float:
        """The unweighted mean over the validation sets (the paper's metric for SlimPajama's 7 domains)."""
        return float(np.mean([loss for loss, _ in self.domains.values()]))

    @property
    def bits_per_byte(self) -> float:
        return float(np.mean([bpb for _, bpb in self.domains.values()]))

    def record(self) -> dict[str, float]:
        record = {
            'eval_loss': self.loss,
            'eval_perplexity': math.exp(min(self.loss, 50)),
            'eval_bpb': self.bits_per_byte,
        }
        if len(self.domains) > 1:
            for name, (loss, bpb) in self.domains.items():
                record |= {f'eval_loss/{name}': loss, f'eval_bpb/{name}': bpb}
        return record


def validate(trainer: TrainSteps, params: Any, config: Config, tokenizer) -> Validation:
    """train.eval_batches batches of each validation set."""
    return validations(trainer, params, config, pipeline.EvalSets(config.data, tokenizer))[0]


def validations(
    stepper: TrainSteps | RunGroup, params: Any, config: Config, sets: pipeline.EvalSets
) -> list[Validation]:
    """One Validation per run: `params` are one TrainSteps's run's, or a RunGroup's (a leading run axis)."""
    domains: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, split in config.data.evaluated():
        loss_sum = tokens = n_bytes = np.zeros(1)
        for batch in sets.batches(config.train.eval_batches, *stepper.row_share, name, split):
            out = jax.device_get(stepper.eval_step(params, stepper.device_batch(batch)))
            loss_sum, tokens, n_bytes = (loss_sum + out['loss_sum'], tokens + out['tokens'], n_bytes + out['bytes'])
        domains[name if split == config.data.eval_split else f'{name}:{split}'] = (
            loss_sum / np.maximum(tokens, 1.0),
            loss_sum / math.log(2) / np.maximum(n_bytes, 1.0),
        )
    runs = len(next(iter(domains.values()))[0])
    return [
        Validation({name: (float(loss[i]), float(bpb[i])) for name, (loss, bpb) in domains.items()})
        for i in range(runs)
    ]
