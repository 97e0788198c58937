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
from vrl.core.errors import VrlError
from vrl.model.config import ModelConfig
from vrl.train.config import Config
from vrl.train.rundir import checkpoint
from vrl.train.rundir import guard as guard_lib
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
class Source:
    """What --init_from read: where (a step folder, or hf:DIR), the step (None for hf:), the digest of
    the parameters read (checkpoint.params_digest), and whether a run still held the source's workdir
    (its newest committed step was read; a later read may find a newer one)."""

    where: str
    step: int | None
    fingerprint: str
    live: bool = False

    def describe(self) -> str:
        step = '' if self.step is None else f' step {self.step}'
        live = ', its newest committed step: the run there is still training' if self.live else ''
        return f'{self.where}{step} (parameters {self.fingerprint}{live})'

    def record(self) -> dict[str, Any]:
        """What the run's start record and config history keep of it."""
        return {'init_from': self.where, 'init_step': self.step, 'init_fingerprint': self.fingerprint}


@dataclasses.dataclass(frozen=True)
class Start:
    origin: Origin
    state: TrainState | None  # None: a fresh init, made for a whole group at once
    source: Source | None = None  # --init_from's

    def step(self) -> int:
        return 0 if self.state is None else int(self.state.step)

    def describe(self) -> str:
        """How the run begins, for its start line."""
        return {
            Origin.RESUMED: f'resumed at step {self.step()}',
            Origin.BRANCHED: f'branched at step {self.step()}',
            Origin.FRESH: f'initialised from {self.source.where}' if self.source else 'fresh start',
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
    state = trainer.init_state(config.train.seed)
    params, note, source = initial_params(request.init_from, trainer, config, state.params)
    say(f'initialised from {source.describe()}{note}')
    return Start(Origin.FRESH, state._replace(params=params), source)


INIT_FROM_FIX = (
    '--init_from loads weights into a model of the same shapes (the same variant, or another one '
    "uptrained from them): train with the model shape of the run they came from (its config.json's model "
    'section), or leave --init_from out to start at random.'
)


def initial_params(init_from: str, trainer: TrainSteps, config: Config, fresh: Any = None) -> tuple[Any, str, Source]:
    """--init_from: another run's checkpoint (any model whose shapes match, or another variant of them:
    `uptrained`), or `hf:DIR`, a Hugging Face Llama directory (vrl/interop/hf.py), placed in the
    training layout; what to log about it; and the Source read. `fresh`: the run's initial parameters
    (None: made here where uptraining needs them). A checkpoint is verified as a resume verifies it. A
    source that does not fit is a CheckpointMismatchError naming the flag, the cause and the fix; one
    that is damaged a CorruptCheckpointError naming the flag, the step and the array."""
    try:
        if init_from.startswith('hf:'):
            params, note = _from_hf(init_from, trainer, config, fresh)
            return params, note, Source(init_from, None, checkpoint.params_digest(params))
        folder, step = checkpoint.step_folder(init_from)  # resolved once: a live source may save a newer one
        params, note = _from_checkpoint(str(folder), trainer, config, fresh)
        live = step is not None and guard_lib.in_use(folder.parent.parent)
        return params, note, Source(str(folder), step, checkpoint.params_digest(params), live)
    except checkpoint.CheckpointMismatchError as e:
        raise checkpoint.CheckpointMismatchError(f'--init_from={init_from}: {e} {INIT_FROM_FIX}') from None
    except checkpoint.CorruptCheckpointError as e:
        raise checkpoint.CorruptCheckpointError(
            f'--init_from={init_from}: {e}; nothing was started. Train from an intact copy or another step '
            '(DIR/checkpoints/STEP).'
        ) from None


def uptrained(saved: dict, read: Callable[[Any], Any], abstract: Any, fresh: Any, config: Config) -> tuple[Any, str]:
    """Another variant's parameters (`saved`: their shapes by name; `read`: the subset of them an abstract
    tree names) as the start of this run (docs/training.md, "Uptraining"): the parameters both have, read;
    this variant's own (ResFormer's lambdas, gates, connections) at their initialisation in `fresh`; the
    source's that this variant lacks (SVFormer's value projections in layers >= 2) left out. Refused: a
    parameter both have in other shapes (check_compatible), and one that vanilla has too and the source
    lacks (a weight it never learned, such as the W_V of layers >= 2 for a vanilla model from SVFormer)."""
    wanted = checkpoint.param_shapes(abstract)
    vanilla = checkpoint.param_shapes(_abstract_params(config.model.as_vanilla()))
    missing = sorted((wanted.keys() - saved.keys()) & vanilla.keys())
    if missing:
        raise checkpoint.CheckpointMismatchError(
            f'the source has no parameter {missing[0]}, which {config.model.variant_name} needs: a weight of '
            'the vanilla model, not one that a variant adds, so it cannot start at its initialisation.'
        )
    kept, how = {name for name in wanted if name in saved}, config.train.init_value_heads
    groups = {
        name: _value_head_groups(name, saved[name], wanted[name], config)
        for name in kept
        if saved[name] != wanted[name]
    }
    at_source_shape = jax.tree_util.tree_map_with_path(
        lambda path, x: _reshaped(x, saved[checkpoint.path_name(path)]) if checkpoint.path_name(path) in groups else x,
        _only(abstract, kept),
    )
    restored = read(at_source_shape)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            _fewer_heads(_leaf(restored, path), groups.get(checkpoint.path_name(path), 1), how)
            if checkpoint.path_name(path) in kept
            else x
        ),
        fresh,
    )
    new, dropped = sorted(wanted.keys() - kept), sorted(saved.keys() - kept)
    # a weight left out of the scanned layers 2..L but read for layer 1 (SVFormer's W_V: V_1's projection)
    layer_1 = [
        f'first.{n.removeprefix("layers.")}'
        for n in [*dropped, *groups]
        if f'first.{n.removeprefix("layers.")}' in kept
    ]
    pooled = '; '.join(
        f'pooled: {name}, its {saved[name][-2]} value heads averaged in groups of {g} '
        f'((0..{g - 1}), ({g}..{2 * g - 1}), ...) into the {wanted[name][-2]} that layers >= 2 project'
        if how == 'pool'
        else f'cut: {name}, its first {wanted[name][-2]} of {saved[name][-2]} value heads kept for layers >= 2 '
        f'(train.init_value_heads=first), the other {saved[name][-2] - wanted[name][-2]} dropped'
        for name, g in groups.items()
    )
    return params, (
        f'uptraining into {config.model.variant_name}: {len(kept)} of its {len(wanted)} parameters read; '
        + (f'{pooled}; ' if pooled else '')
        + f'new, at their initialisation: {", ".join(new) or "none"}; left out: {", ".join(dropped) or "none"}'
        + (f" (layers >= 2 only; layer 1's {', '.join(layer_1)} is read and kept whole)" if layer_1 else '')
    )


def _value_head_groups(name: str, source: tuple, target: tuple, config: Config) -> int:
    """How many of the source's value heads one head of SkipV1Former's layers >= 2 averages (the paper's
    uptraining: mean-pooled pairs when half the heads come from V_1), for `name` read at `source` shape
    into `target`; CheckpointMismatchError, saying why and what would work, for anything else."""
    skip = config.model.skip_v1
    heads, own = source[-2] if len(source) > 1 else 0, target[-2] if len(target) > 1 else 0
    same_otherwise = len(source) == len(target) and source[:-2] + source[-1:] == target[:-2] + target[-1:]
    if name != 'layers.attn.wv' or not skip or not same_otherwise or heads != config.model.n_kv_heads:
        raise checkpoint.CheckpointMismatchError(
            f'parameter {name} has shape {source} in the source but {config.model.variant_name} needs {target}; '
            'it was written for another model config.'
        )
    if heads % own:
        divisors = [k for k in range(1, heads) if heads % (heads - k) == 0]
        raise checkpoint.CheckpointMismatchError(
            f"the source's {heads} value heads per layer cannot be pooled evenly into the {own} that "
            f'model.skip_v1={skip} leaves layers >= 2 to project ({heads} is not a multiple of {own}); '
            f"model.skip_v1 of {' or '.join(map(str, divisors))} would pool them ({heads // 2} for pairs, the paper's)."
        )
    return heads // own


def _reshaped(leaf: jax.ShapeDtypeStruct, shape: tuple) -> jax.ShapeDtypeStruct:
    """`leaf` (an abstract parameter) at the source's `shape`, placed as the run's parameter is."""
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=getattr(leaf, 'sharding', None))


def _fewer_heads(x: Any, group: int, how: str) -> Any:
    """Value projections (..., heads, head_dim) brought to heads // group: each `group` adjacent heads averaged
    into one ('pool'), or the first heads // group kept ('first'; train.init_value_heads)."""
    if group == 1:
        return x
    *lead, heads, head_dim = x.shape
    if how == 'first':
        return x[..., : heads // group, :]
    return x.reshape(*lead, heads // group, group, head_dim).mean(axis=-2)


def _abstract_params(model: ModelConfig) -> dict:
    """`model`'s parameters as a pure dict of shapes and dtypes (an abstract init: nothing allocated)."""
    from flax import nnx

    from vrl.model.decoder import Decoder

    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(model, rngs=nnx.Rngs(0))), nnx.Param))


def _only(tree: dict, names: set[str], prefix: tuple = ()) -> dict:
    """The nested dict `tree` with only the leaves named in `names`."""
    kept = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            if sub := _only(value, names, (*prefix, key)):
                kept[key] = sub
        elif '.'.join(map(str, (*prefix, key))) in names:
            kept[key] = value
    return kept


def _leaf(tree: dict, path) -> Any:
    for key in path:
        tree = tree[key.key]
    return tree


def _from_checkpoint(folder: str, trainer: TrainSteps, config: Config, fresh: Any) -> tuple[Any, str]:
    """The parameters of step folder `folder` in the run's layout (uptrained into another variant)."""
    abstract = trainer.abstract_state.params
    saved = checkpoint.saved_param_shapes(folder)
    shapes = checkpoint.param_shapes(abstract)
    if saved == shapes or (saved.keys() == shapes.keys() and not config.model.skip_v1):  # else: uptraining
        return checkpoint.restore_params(folder, abstract), ''
    if fresh is None:
        fresh = trainer.init_state(config.train.seed).params
    params, note = uptrained(
        saved, lambda subset: checkpoint.restore_params(folder, subset, subset=True), abstract, fresh, config
    )
    return params, f' ({note})'


def _from_hf(init_from: str, trainer: TrainSteps, config: Config, fresh: Any) -> tuple[Any, str]:
    """The parameters of Hugging Face directory hf:DIR in the run's layout (uptrained from a Llama one)."""
    abstract = trainer.abstract_state.params
    if fresh is None:
        fresh = trainer.init_state(config.train.seed).params
    from vrl.interop import hf  # safetensors: requirements-extra.txt

    folder = _hf_dir(init_from)
    if hf.plain_llama_for(folder, config.model):  # a Llama checkpoint into another variant: uptraining
        vanilla_shapes = jax.tree.map(lambda a: a.shape, _abstract_params(config.model.as_vanilla()))
        vanilla = hf.load_params(folder, config.model.as_vanilla(), vanilla_shapes)
        params, note = uptrained(
            checkpoint.param_shapes(vanilla.params), lambda subset: vanilla.params, abstract, fresh, config
        )
        note = f' ({vanilla.tensors} tensors, tokenizer {config.data.tokenizer}; {note})'
        return jax.device_put(params, trainer.param_shardings), note
    imported = hf.load_params(folder, config.model, jax.tree.map(lambda a: a.shape, abstract))
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
