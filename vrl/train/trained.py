"""A finished (or interrupted) run, read back: its config, tokenizer and latest parameters, for the
read-side tools (generate, evaluate, analyze, export, the notebook). Nothing here trains."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import ml_collections

from vrl.core import sharding, storage
from vrl.data import pipeline
from vrl.data.tokenizer import Tokenizer
from vrl.train import aot
from vrl.train.config import Config, from_configdict
from vrl.train.rundir import checkpoint
from vrl.train.rundir import workdir as workdir_lib
from vrl.train.step import TrainSteps


def load_run(workdir: str) -> tuple[Config, Tokenizer]:
    """The config a workdir was trained with (its config.json) and the run's tokenizer."""
    config_file = storage.path(workdir) / 'config.json'
    if not storage.exists(config_file, '--workdir'):
        raise workdir_lib.NotARunError(
            f'{config_file} not found: --workdir must be a directory that '
            '`python -m vrl.main --workdir=...` trained in.'
        )
    try:
        config = from_configdict(ml_collections.ConfigDict(json.loads(config_file.read_text())['config']))
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # bad JSON, no 'config', unknown field
        raise workdir_lib.WorkdirError(
            f'{config_file} is not a readable vrl run record ({" ".join(str(e).split())}); restore it from the run.'
        ) from None
    return config, pipeline.load_tokenizer(config.data, config.model.vocab_size)


class TrainedRun(NamedTuple):
    """A workdir's latest checkpoint, ready to run: parameters sharded by the training rules on a
    mesh of this machine's devices shaped by the run's mesh config."""

    config: Config
    tokenizer: Tokenizer
    trainer: TrainSteps
    params: Any
    step: int | None


def load_trained(workdir: str, context: int = 1) -> TrainedRun:
    """The run's config, tokenizer and latest parameters (checked against the saved model config).
    The attention kernel and hand-written backwards are chosen for this machine (`auto`), not the
    one the run trained on: they change how the model runs, not what it computes. No training
    sequence is split: mesh.context is `context`, what decoding splits a KV cache's positions over
    (vrl/model/decode.py), its devices taken from the mesh axis at -1."""
    config, tokenizer = load_run(workdir)
    here = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, attention_impl='auto', hand_vjp='auto'),
        mesh=dataclasses.replace(sharding.without_context(config.mesh), context=context),
    )
    mesh = sharding.make_mesh(here.mesh)
    trainer = TrainSteps(aot.execution(here, mesh.devices.flat[0].platform), mesh)

    def newest() -> TrainedRun:  # the step resolved once, and that folder read
        folder, step = checkpoint.step_folder(workdir)
        params = checkpoint.restore_params(str(folder), trainer.abstract_state.params, config.model)
        return TrainedRun(trainer.config, tokenizer, trainer, params, step)

    try:
        return newest()
    except checkpoint.StepRemovedError:  # a newer step replaced it while it was read: that one
        return newest()
