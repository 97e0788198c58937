"""Where a run starts from, decided in one place: its workdir's checkpoint (resumed), another run's
step (--branch_from: the whole state), weights from elsewhere (--init_from: a checkpoint or a
Hugging Face directory, hf:DIR), or a fresh init."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from vrl.core import storage
from vrl.core.config import Config
from vrl.core.errors import VrlError
from vrl.train import checkpoint
from vrl.train.step import TrainState, TrainSteps


class TrainingError(VrlError, RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message names the step."""


@dataclasses.dataclass(frozen=True)
class Request:
    """How the command asked a run to start: `fresh` moves an old run aside; `init_from` and
    `branch_from` name where a workdir without a checkpoint starts; `take_over_lease` takes a
    bucket workdir from a holder known to be gone."""

    fresh: bool = False
    init_from: str | None = None
    branch_from: str | None = None
    take_over_lease: bool = False

    def check(self, runs: int) -> None:
        if self.init_from and self.branch_from:
            raise TrainingError(
                '--init_from and --branch_from both name a start: give one (--init_from: weights '
                "only; --branch_from: the whole state of another run's step)."
            )
        if runs > 1 and (self.init_from or self.branch_from):
            raise TrainingError('--init_from / --branch_from start one run; train it alone.')


class Origin(enum.Enum):
    FRESH = 'started'  # at random, or from --init_from's weights
    RESUMED = 'resumed'
    BRANCHED = 'branched'


@dataclasses.dataclass(frozen=True)
class Start:
    origin: Origin
    state: TrainState | None  # None: a fresh init, made for a whole group at once

    def step(self) -> int:
        return 0 if self.state is None else int(self.state.step)

    def describe(self) -> str:
        """How the run begins, for its start line."""
        return {
            Origin.RESUMED: f'resumed at step {self.step()}',
            Origin.BRANCHED: f'branched at step {self.step()}',
            Origin.FRESH: 'fresh start',
        }[self.origin]


def decide(
    trainer: TrainSteps,
    config: Config,
    path: epath.Path,
    manager: ocp.CheckpointManager,
    data_iterator: grain.DatasetIterator,
    request: Request,
    say: Callable[[str], None],
) -> Start:
    """The start of the run in `path` (its `manager`'s checkpoints), with the data position restored
    into `data_iterator`; `say` tells the user what was chosen."""
    checkpoint.check_committed(path)
    latest = manager.latest_step()
    if latest is not None and latest > config.train.steps:
        raise TrainingError(
            f'train.steps={config.train.steps} is below the step of the checkpoint in {path} '
            f'({latest}): raise train.steps to go on, or use --fresh to start over.'
        )
    restored = checkpoint.restore_latest(manager, trainer.abstract_state, data_iterator, config, say)
    if restored is not None:
        if request.init_from or request.branch_from:
            flag = '--init_from' if request.init_from else '--branch_from'
            say(
                f'{flag} ignored: the workdir has a checkpoint, so this run resumes from step {restored[1]} '
                f'(use --fresh to start over from {flag})'
            )
        return Start(Origin.RESUMED, restored[0])
    if request.branch_from:
        state, branched = checkpoint.restore_branch(request.branch_from, trainer.abstract_state, data_iterator, config)
        say(f'branched from {request.branch_from}: its step-{branched} parameters, optimizer state and data position')
        return Start(Origin.BRANCHED, state)
    if not request.init_from:
        return Start(Origin.FRESH, None)
    params, note = initial_params(request.init_from, trainer, config)
    say(f'initialised from {request.init_from}{note}')
    return Start(Origin.FRESH, trainer.init_state(config.train.seed)._replace(params=params))


INIT_FROM_FIX = (
    '--init_from loads weights into a model of the same variant and shapes: train with the model '
    "settings of the run they came from (its config.json's model section), or leave --init_from out to "
    'start at random.'
)


def initial_params(init_from: str, trainer: TrainSteps, config: Config) -> tuple[Any, str]:
    """--init_from: another run's checkpoint (any model whose shapes match), or `hf:DIR`, a Hugging
    Face Llama directory (vrl/interop/hf.py), placed in the training layout; and what to log about it.
    A source that does not fit is a CheckpointMismatchError naming the flag, the cause and the fix."""
    try:
        return _initial_params(init_from, trainer, config)
    except checkpoint.CheckpointMismatchError as e:
        raise checkpoint.CheckpointMismatchError(f'--init_from={init_from}: {e} {INIT_FROM_FIX}') from None


def _initial_params(init_from: str, trainer: TrainSteps, config: Config) -> tuple[Any, str]:
    if not init_from.startswith('hf:'):
        return checkpoint.restore_params(init_from, trainer.abstract_state.params), ''
    from vrl.interop import hf  # safetensors: requirements-extra.txt

    shapes = jax.tree.map(lambda a: a.shape, trainer.abstract_state.params)
    imported = hf.load_params(_hf_dir(init_from), config.model, shapes)
    note = f' ({imported.tensors} tensors), tokenizer {config.data.tokenizer}'
    return jax.device_put(imported.params, trainer.param_shardings), note + (
        f'; {imported.note}' if imported.note else ''
    )


def _hf_dir(init_from: str) -> str:
    """The folder of --init_from=hf:DIR, local (a DIR on an object store is copied down once)."""
    folder = storage.path(init_from.removeprefix('hf:'))
    if storage.is_remote(folder) and not storage.exists(folder / 'config.json', '--init_from'):
        raise TrainingError(
            f'--init_from={init_from}: no config.json in {folder}; hf:DIR needs a Hugging Face '
            'model directory (config.json + *.safetensors).'
        )
    return str(storage.local_copy(folder))


def hf_tokenizer(config: Config, init_from: str | None, path: epath.Path) -> tuple[Config, epath.Path | None, str]:
    """A run started from hf:DIR trains with the tokenizer its weights came with (vrl/interop/hf.py's
    `run_tokenizer`), kept in the workdir under its file's name so that the run's tools find it after
    DIR is gone: (the config naming it, the file to copy there or None, how it was chosen)."""
    if not (init_from and init_from.startswith('hf:')):
        return config, None, ''
    from vrl.interop import hf  # safetensors: requirements-extra.txt

    chosen, line = hf.run_tokenizer(_hf_dir(init_from), config.data.tokenizer)
    if config.data.tokenizer:
        return config, None, line
    kept = path / epath.Path(chosen).name
    return (
        dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=str(kept))),
        epath.Path(chosen),
        line,
    )
