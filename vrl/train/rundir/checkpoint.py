"""Orbax checkpoints of {train state, data iterator position, meta} in `WORKDIR/checkpoints`.

Saves are asynchronous; Orbax writes each step to a temporary folder and renames it when
complete, so a process killed mid-save leaves the previous step restorable. The data
iterator state is one JSON file per process (grain's handler). `meta` (JSON) holds the
model config the step was trained with and a fingerprint of every array of the state.

On an object store, where a run's lease fences it (vrl/train/rundir/lease.py), each step is
written to `checkpoints/STEP.eEPOCH` (the lease's epoch) and is readable only once the lease record
commits it (`_FencedSteps`), which Orbax asks for after the step's files and before its own commit
marker; a step must have both. A run that lost its lease can still finish writing its own folders,
never commit them, and never delete a newer epoch's. Locally, the flock fences and step folders keep
Orbax's names (`checkpoints/STEP`, made whole by a rename).

Restoring checks the saved model config against the config (a different model is refused,
naming the field), then the parameter shapes, then restores and recomputes the fingerprint.
A step that cannot be read or whose fingerprint differs is moved to
`WORKDIR/rejected_checkpoints/` (never deleted) and the previous complete step is restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import re
import time
from typing import Any, Callable, Iterator

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import step as step_lib
from orbax.checkpoint.checkpoint_managers import preservation_policy as preservation

from vrl.core import multihost, storage
from vrl.core.errors import CheckpointError, VrlError
from vrl.model.config import EXECUTION_FIELDS, ModelConfig, upgraded
from vrl.train.config import Config
from vrl.train.rundir import guard as guard_lib
from vrl.train.rundir import lease, orbax_noise
from vrl.train.rundir import workdir as workdir_lib
from vrl.train.rundir.workdir import COMMITTED, step_of


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the config; the message names the first difference."""


class SaveError(CheckpointError, RuntimeError):
    """An asynchronous save failed (e.g. a full disk); its partial folder has been removed."""


class CorruptCheckpointError(CheckpointError, RuntimeError):
    """A checkpoint step cannot be read, or its arrays are not the ones saved."""


class StepRemovedError(CheckpointError, FileNotFoundError):
    """The step being read was removed meanwhile (the run that writes it keeps only its newest)."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """There is no checkpoint where one was asked for; the message says where vrl looked."""


def make_manager(workdir: str, config: Config, guard: guard_lib.Guard) -> ocp.CheckpointManager:
    """The run's checkpoints, of which Orbax keeps the newest (whatever made it), the newest
    train.keep_checkpoints of the permanent steps (`permanent`), and every train.keep_period-th;
    process 0 commits each step with `guard` once its files are written."""
    policies = [
        _NewestPermanent(config.train.keep_checkpoints, functools.partial(permanent, config)),
        preservation.LatestN(1),
    ]
    if config.train.keep_period:
        policies.append(preservation.EveryNSteps(config.train.keep_period))
    made: list[ocp.CheckpointManager] = []

    def commit() -> None:  # Orbax's finalizing thread, before its own marker: the step saved is the latest
        if jax.process_index() == 0:
            guard.commit(step=made[0].latest_step())

    folder = epath.Path(workdir) / 'checkpoints'
    made.append(
        _manager(
            folder,
            ocp.CheckpointManagerOptions(
                preservation_policy=preservation.AnyPreservationPolicy(policies),
                enable_async_checkpointing=True,
                create=True,
                step_name_format=_step_names(folder, guard.epoch),
                async_options=ocp.AsyncOptions(post_finalization_callback=commit),
            ),
        )
    )
    return made[0]


@dataclasses.dataclass(frozen=True)
class _FencedSteps(step_lib.NameFormat):
    """A remote checkpoint folder's steps: written as STEP.eEPOCH; readable when the lease record
    commits STEP to EPOCH and Orbax's marker is there, or (a run from before fencing) named STEP
    with the marker."""

    epoch: int

    def build_name(self, step: int) -> str:
        return workdir_lib.step_name(step, self.epoch)

    def find_all(self, base_path: epath.PathLike) -> Iterator[step_lib.Metadata]:
        return iter(readable_steps(epath.Path(base_path)).values())

    def find_step(self, base_path: epath.PathLike, step: int) -> step_lib.Metadata:
        found = readable_steps(epath.Path(base_path)).get(step)
        if found is None:
            raise ValueError(f'no committed step {step} in {base_path}')
        return found


def _step_names(folder: epath.Path, epoch: int) -> step_lib.NameFormat | None:
    """How a run of `epoch` names its steps in `folder`: fenced on an object store, Orbax's own locally."""
    return _FencedSteps(epoch) if storage.is_remote(folder) else None


def step_path(workdir: epath.Path, step: int, epoch: int) -> epath.Path:
    """Where a run of lease `epoch` saves `step` in `workdir`."""
    folder = workdir / 'checkpoints'
    names = _step_names(folder, epoch)
    return folder / (names.build_name(step) if names else str(step))


def readable_steps(folder: epath.Path) -> dict[int, step_lib.Metadata]:
    """The steps of checkpoint folder `folder` that a reader may restore, by step. On an object store:
    those the lease record commits (or, from before fencing, named STEP) that carry Orbax's marker."""
    if not storage.is_remote(folder):
        steps = ocp.utils.checkpoint_steps(folder) if folder.is_dir() else []
        return {s: step_lib.Metadata(step=s, path=folder / str(s)) for s in steps}
    names = workdir_lib.steps_in(folder)
    wanted = {s[0]: str(s[0]) for s in map(step_of, names) if s is not None and s[1] == 0}
    wanted |= {
        s: workdir_lib.step_name(s, e)
        for s, e in lease.read_fence(folder.parent).committed.items()
        if workdir_lib.step_name(s, e) in names
    }
    return {
        s: step_lib.Metadata(step=s, path=folder / name)
        for s, name in sorted(wanted.items())
        if (folder / name / COMMITTED).exists()
    }


def permanent(config: Config, step: int) -> bool:
    """A step saved on schedule (train.checkpoint_every, the last, the end of WSD's stable phase), not
    for a preemption or by train.checkpoint_minutes, whose saves are kept only until the next save."""
    opt = config.optimizer
    return (
        step % config.train.checkpoint_every == 0
        or step == config.train.steps
        or (opt.schedule == 'wsd' and step == opt.decay_start)
    )


@dataclasses.dataclass
class _NewestPermanent:
    """Orbax's preservation policy keeping the newest `n` steps of those `keep` accepts."""

    n: int
    keep: Callable[[int], bool]

    def should_preserve(self, checkpoints: Any, *, context: Any) -> list[bool]:
        kept = [c.step for c in checkpoints if self.keep(c.step)][-self.n :]
        return [c.step in kept for c in checkpoints]


def _manager(folder: epath.Path, options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManager:
    orbax_noise.quiet()
    return ocp.CheckpointManager(
        folder,
        options=options,
        item_handlers={
            'state': ocp.StandardCheckpointHandler(),
            'data': grain.checkpoint.CheckpointHandler(),
            'meta': ocp.JsonCheckpointHandler(),
        },
    )


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """[sum of the bit patterns, sum of bit pattern x (2 i + 1)] mod 2^32: any single flipped bit
    or swapped pair of elements changes it."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f'uint{8 * x.dtype.itemsize}')).astype(jnp.uint32)
    odd = (2 * jnp.arange(x.size, dtype=jnp.uint32) + 1).reshape(x.shape)
    return jnp.stack([bits.sum(dtype=jnp.uint32), (bits * odd).sum(dtype=jnp.uint32)])


_fingerprints = jax.jit(lambda tree: jax.tree.map(_leaf_fingerprint, tree))


def fingerprint(tree: Any) -> dict[str, list[int]]:
    """Per array of `tree` (by path name), two uint32 checksums computed where the array lies."""
    host = jax.device_get(_fingerprints(tree))
    return {path_name(p): [int(v) for v in np.asarray(x)] for p, x in jax.tree_util.tree_leaves_with_path(host)}


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: Any,
    data_iterator: grain.DatasetIterator | None,
    config: Config,
    force: bool = False,
) -> bool:
    """Starts an async save of `state`, the iterator's position (if any) and the meta record."""
    meta = {
        'model': dataclasses.asdict(config.model),
        'optimizer': config.optimizer.name,
        'fingerprint': fingerprint(state),
    }
    items = {'state': ocp.args.StandardSave(state), 'meta': ocp.args.JsonSave(meta)}
    if data_iterator is not None:
        items['data'] = grain.checkpoint.CheckpointSave(data_iterator)
    with _save_errors(manager):  # the save waits for the previous one, which may have failed
        return manager.save(step, args=ocp.args.Composite(**items), force=force)


def check_saves(manager: ocp.CheckpointManager, wait: bool = False) -> None:
    """Raises SaveError if an earlier asynchronous save failed; with `wait`, waits for the one in
    flight first. Without, it costs nothing while a save is still running."""
    if wait or not manager.is_saving_in_progress():
        with _save_errors(manager):
            manager.wait_until_finished()  # returns at once when done, raises if that save failed


@contextlib.contextmanager
def _save_errors(manager: ocp.CheckpointManager) -> Iterator[None]:
    """A failed save as one SaveError line (`close` removes its partial folder; the steps before it stay)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - whatever the writer raised, the save is lost
        reason = 'no space left on device' if 'No space left on device' in str(e) else _one_line(e)
        folder = epath.Path(manager.directory)
        latest = latest_step(folder.parent)
        kept = (
            f'the latest complete checkpoint is step {latest}'
            if latest is not None
            else 'no checkpoint is complete yet'
        )
        raise SaveError(
            f'saving a checkpoint in {folder} failed ({reason}); its partial folder is removed (or, '
            f'left by a process that died, ignored on resume) and {kept}. Fix the cause and run the same '
            'command to resume.'
        ) from None


def close(manager: ocp.CheckpointManager, epoch: int) -> None:
    """Closes the manager (which waits for a save in flight: SaveError if it failed); then, either
    way, process 0 removes what failed saves left: locally `*.orbax-checkpoint-tmp` folders, on an
    object store step folders without COMMITTED (Orbax writes a step in place there) of lease epochs
    up to `epoch`, the run's own (a newer epoch's are another run's)."""
    try:
        with _save_errors(manager):
            manager.close()
    finally:
        if jax.process_index() == 0:
            _remove_partials(epath.Path(manager.directory), epoch)


PARTIAL_QUIET_SECONDS = 1.0  # a failed save's folder must stay gone this long to count as removed


def _remove_partials(folder: epath.Path, epoch: int, tries: int = 10) -> None:
    """Removes the folders failed saves left. Orbax reports a failed save at its first failed write,
    while the save's other writes may still be in flight and recreate the folder (a full disk, a
    loaded host): it is removed again until it stays gone for PARTIAL_QUIET_SECONDS."""
    for _ in range(tries):
        partials = (
            _unfinished(folder, epoch) if storage.is_remote(folder) else list(folder.glob('*.orbax-checkpoint-tmp*'))
        )
        if not partials:
            return
        for partial in partials:
            partial.rmtree(missing_ok=True)
        time.sleep(PARTIAL_QUIET_SECONDS)


def _unfinished(folder: epath.Path, epoch: int) -> list[epath.Path]:
    """The step folders of lease epochs up to `epoch` under remote `folder` that a save began and never
    finished."""
    steps = [folder / name for name in workdir_lib.steps_in(folder) if (parsed := step_of(name)) and parsed[1] <= epoch]
    return [p for p in steps if not (p / COMMITTED).exists() and not _finished_elsewhere(p)]


def _finished_elsewhere(step: epath.Path) -> bool:
    """Whether Orbax recorded a commit in the step's metadata: a step finished on local disk (where the
    commit is a rename, not COMMITTED), e.g. a workdir copied up to a bucket."""
    try:
        return bool(json.loads((step / '_CHECKPOINT_METADATA').read_text()).get('commit_timestamp_nsecs'))
    except (OSError, ValueError):
        return False


def check_committed(workdir: epath.Path) -> None:
    """A workdir on an object store whose finished steps lack COMMITTED (a local workdir copied up)
    would be taken for one without checkpoints and trained over from step 0: CheckpointError
    naming them and the fix, before anything is written."""
    folder = workdir / 'checkpoints'
    if not storage.is_remote(folder) or not folder.exists():
        return
    copied = sorted(
        int(p.name)
        for p in folder.iterdir()
        if p.name.isdigit() and not (p / COMMITTED).exists() and _finished_elsewhere(p)
    )  # (fenced steps, STEP.eEPOCH, are never copied from local disk)
    if copied:
        raise CheckpointError(
            f'{folder} holds steps {copied} that Orbax finished but that lack {COMMITTED}, the marker a step on an '
            'object store needs (a workdir copied from local disk?); resuming would start over from step 0 beside '
            f'them. Add the marker to each (gcloud storage cp /dev/null {folder}/STEP/{COMMITTED}), or use --fresh '
            'to move them aside.'
        )


def path_name(path) -> str:
    return '.'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def check_compatible(saved: Any, expected: Any, where: str, subset: bool = False) -> None:
    """Raises CheckpointMismatchError naming the first parameter whose presence or shape differs
    (`subset`: parameters saved beyond the expected ones are allowed)."""
    saved_leaves, expected_leaves = param_shapes(saved), param_shapes(expected)
    for name, want in expected_leaves.items():
        if name not in saved_leaves:
            raise CheckpointMismatchError(
                f'{where} has no parameter {name} (shape {want}) that '
                'the config needs: it was written for another model config.'
            )
        got = saved_leaves[name]
        if got != want:
            raise CheckpointMismatchError(
                f'{where}: parameter {name} has shape {got} but the config '
                f'needs {want}; it was written for another model config.'
            )
    extra = sorted(set(saved_leaves) - set(expected_leaves))
    if extra and not subset:
        raise CheckpointMismatchError(
            f'{where} has parameter {extra[0]} that the config does not: it was written for another model config.'
        )


def _read_meta(step_dir: epath.Path) -> dict | None:
    """The step's meta record; None for a checkpoint written before vrl saved one."""
    if not (step_dir / 'meta').exists():
        return None
    try:
        return ocp.JsonCheckpointHandler().restore(step_dir / 'meta')
    except Exception as e:  # noqa: BLE001 - any read failure means the step is damaged
        raise CorruptCheckpointError(f'its meta record cannot be read ({_one_line(e)})') from e


def check_model(saved: dict | None, model: ModelConfig, where: str) -> None:
    """Refuses a checkpoint whose saved model config differs from `model` in a field that changes
    the model (execution settings such as remat may change); names the field and both values."""
    if saved is None:
        return
    current = dataclasses.asdict(model)
    for name, value in upgraded(saved['model']).items():  # a config before model.residual, in today's fields
        if name in EXECUTION_FIELDS or name not in current:
            continue
        if _normalized(value) != _normalized(current[name]):
            raise CheckpointMismatchError(
                f'{where} was trained with model.{name}={_normalized(value)!r} but the config has '
                f'model.{name}={_normalized(current[name])!r}; a different model cannot resume this run '
                '(train it in a new --workdir: from these weights with --init_from where its parameter '
                'shapes are the same (another attention_window, say), else from scratch).'
            )


def check_optimizer(saved: dict | None, optimizer: str, saved_state: Any, expected_state: Any, where: str) -> None:
    """Refuses a checkpoint whose optimizer (by name) or optimizer-state layout differs from the config's."""
    was = (saved or {}).get('optimizer', 'adamw')  # checkpoints from before Muon are AdamW's
    if was != optimizer:
        raise CheckpointMismatchError(
            f'{where} was trained with optimizer.name={was!r} but the config has optimizer.name={optimizer!r}; '
            'its optimizer state cannot continue under another optimizer (start from its weights in a new '
            '--workdir with --init_from).'
        )
    saved_names = {path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved_state)}
    expected_names = {path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(expected_state)}
    if saved_names != expected_names:
        first = sorted(saved_names ^ expected_names)[0]
        side = 'only the checkpoint' if first in saved_names else 'only the config'
        raise CheckpointMismatchError(
            f"{where}: its optimizer state differs from the config's ({first} is in {side}); were "
            'optimizer.grad_clip or an optimizer.*_lr_ratio switched between 0/1 and another value? Resume '
            "with the run's optimizer settings."
        )


def _normalized(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _damage(e: BaseException) -> str:
    """What TensorStore found wrong, in one line: its innermost cause and the file (its error nests every
    layer it passed through, paths and specs included); `_one_line` of any other error."""
    text = _one_line(e) if 'local file "' not in str(e) else ' '.join(str(e).split())
    found = re.search(r'.*local file "([^"]+)": ([^\[]*)', text)
    return f'{found.group(2).strip()} in {found.group(1)}' if found else text


def _one_line(e: BaseException) -> str:
    text = ' '.join(str(e).split()).split(' See full TensorStore details')[0].split(' [tensorstore_spec=')[0]
    text = text or type(e).__name__
    return text if len(text) <= 300 else text[:297] + '...'


def _restore_step(
    manager: ocp.CheckpointManager,
    step: int,
    abstract_state: Any,
    data_iterator: grain.DatasetIterator | None,
    config: Config,
) -> Any:
    """Step `step`'s verified state; CheckpointMismatchError for another model, CorruptCheckpointError
    for a step that cannot be read or whose arrays differ from the ones saved."""
    folder = _step_dir(manager, step)
    where = f'checkpoint {folder}'
    meta = _read_meta(folder)
    check_model(meta, config.model, where)
    try:
        metadata = manager.item_metadata(step)['state']
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f'its array metadata cannot be read ({_one_line(e)})') from e
    check_compatible(metadata['params'], abstract_state.params, where)
    check_optimizer(meta, config.optimizer.name, metadata['opt_state'], abstract_state.opt_state, where)
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
        items['data'] = grain.checkpoint.CheckpointRestore(data_iterator)
    try:
        state = manager.restore(step, args=ocp.args.Composite(**items))['state']
    except VrlError:  # the data iterator refusing a position it cannot take: not damage
        raise
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f'it cannot be read ({_one_line(e)})') from e
    if meta is not None:
        restored = fingerprint(state)
        for name, saved in meta['fingerprint'].items():
            if restored.get(name) != saved:
                raise CorruptCheckpointError(f'array {name} differs from the one saved (checksum mismatch)')
    return state


def restore_latest(
    manager: ocp.CheckpointManager,
    abstract_state: Any,
    data_iterator: grain.DatasetIterator | None,
    config: Config,
    say: Callable[[str], None] = print,
) -> tuple[Any, int] | None:
    """The newest step that reads back intact, as (state, step); None if there is no checkpoint.

    Newer steps that are damaged are reported in one line each and moved to
    `rejected_checkpoints/` next to `checkpoints/` (never deleted), so the run re-saves those steps.
    If no step can be restored, nothing is moved and CorruptCheckpointError names each reason.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    damaged: list[tuple[int, str]] = []
    for step in steps:
        state, reason = None, ''
        try:
            state = _restore_step(manager, step, abstract_state, data_iterator, config)
        except CorruptCheckpointError as e:
            reason = str(e)
        if not multihost.every_process(not reason):  # every host restored its own shards: all must have succeeded
            reason = reason or 'another host could not read its shards'
        if not reason:
            for bad_step, why in damaged:
                moved = _reject(manager, bad_step, why)
                say(f'checkpoint step {bad_step} is damaged: {why}; moved to {moved}, resuming from step {step}')
            if damaged:
                manager.reload()
            logging.info('restored step %d from %s', step, manager.directory)
            return state, step
        damaged.append((step, reason))
    if damaged:
        raise CorruptCheckpointError(
            f'no checkpoint in {manager.directory} can be restored: '
            + '; '.join(f'step {s}: {why}' for s, why in damaged)
            + '. Nothing was moved; start a new --workdir (optionally --init_from a copy you trust).'
        )
    return None


def _reject(manager: ocp.CheckpointManager, step: int, reason: str) -> epath.Path:
    """Moves a damaged step out of the manager's sight, with a note of why (process 0 only)."""
    source = _step_dir(manager, step)
    target = epath.Path(manager.directory).parent / 'rejected_checkpoints' / f'{step}-{time.strftime("%Y%m%dT%H%M%S")}'
    if jax.process_index() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        storage.move(source, target)
        (target / 'REJECTED.txt').write_text(reason + '\n')
    multihost.sync(f'vrl rejected checkpoint {step}')
    return target


def _step_dir(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    """The folder of readable step `step` of the manager's checkpoints."""
    return readable_steps(epath.Path(manager.directory))[step].path


def latest_step(workdir: str | epath.Path) -> int | None:
    """The newest readable step saved in `workdir` (None if none), without a manager."""
    return max(readable_steps(epath.Path(workdir) / 'checkpoints'), default=None)


def step_folder(path: str) -> tuple[epath.Path, int | None]:
    """The folder holding `state/` for a workdir (its latest step) or a step folder, and its step
    (None if the folder name is not one); NoCheckpointError names the place and how to make one."""
    root = storage.path(path)
    if storage.exists(root / 'checkpoints', 'the checkpoint'):
        root = root / 'checkpoints'
    if (root / 'state').exists():
        step = (step_of(root.name) or (None,))[0]
        if storage.is_remote(root) and step is not None and _committed_at(root) != root:
            raise NoCheckpointError(
                f'{root} is not a committed checkpoint step (its run lost its lease before '
                f'committing it, or it is still being written); the committed ones: '
                f'{sorted(readable_steps(root.parent))}.'
            )
        return root, step
    steps = readable_steps(root)
    if not steps:
        raise NoCheckpointError(
            f'no checkpoint in {path}: expected a workdir with checkpoints/ or a step '
            'folder holding state/ (train one with `python -m vrl.main --workdir=...`).'
        )
    return steps[max(steps)].path, max(steps)


def _committed_at(step_dir: epath.Path) -> epath.Path | None:
    """The committed folder of the step that remote folder `step_dir` names (None if that step has none)."""
    found = readable_steps(step_dir.parent).get(step_of(step_dir.name)[0])
    return found and found.path


def restore_branch(
    path: str, abstract_state: Any, data_iterator: grain.DatasetIterator | None, config: Config
) -> tuple[Any, int]:
    """Another run's whole state at one step (parameters, optimizer, data position), as (state, step):
    `--branch_from`, e.g. to extend a wsd run from its last stable step in a new workdir."""
    root, step = step_folder(path)
    if step is None:
        raise NoCheckpointError(
            f'{path} is not a checkpoint step folder (DIR/checkpoints/STEP): --branch_from needs one.'
        )
    manager = _manager(
        root.parent, ocp.CheckpointManagerOptions(read_only=True, step_name_format=_step_names(root.parent, 0))
    )
    try:
        return _restore_step(manager, step, abstract_state, data_iterator, config), step
    finally:
        manager.close()


def param_shapes(params: Any) -> dict[str, tuple[int, ...]]:
    """{parameter name (its path, dotted): shape} of a parameter tree, concrete or abstract."""
    return {path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def saved_param_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """param_shapes of a workdir's latest step (or a step folder), from its metadata."""
    root, _ = step_folder(path)
    return param_shapes(_saved_params(root))


def _saved_params(root: epath.Path) -> Any:
    """The array metadata of step folder `root`'s parameters; CorruptCheckpointError naming the array whose
    metadata cannot be read. (The handler's metadata: the checkpointer's also looks for step metadata,
    which the manager writes one folder up, and logs a warning that it is missing.)"""
    try:
        return ocp.PyTreeCheckpointHandler().metadata(root / 'state')['params']
    except Exception as e:  # noqa: BLE001 - any failure to read it means the step is damaged
        raise CorruptCheckpointError(
            f'checkpoint {root}: {_array_in(e) or "its array metadata"} cannot be read ({_damage(e)})'
        ) from None


def _array_in(e: BaseException) -> str | None:
    """The array a TensorStore error names ('array params.first.attn.wq'), if it names one."""
    found = re.search(r'"((?:params|opt_state|step)[^"/]*)/', str(e))
    return found and f'array {found.group(1)}'


def restore_params(path: str, abstract_params: Any, model: ModelConfig | None = None, *, subset: bool = False) -> Any:
    """Parameters only, from a workdir (its latest step) or a step folder: for --init_from (any
    model whose shapes match) and for decoding (`model` given: the saved model config must match).
    `subset`: the checkpoint may hold parameters that abstract_params leaves out (not read). Verified as
    a resume verifies: an array that cannot be read, or whose checksum differs from the one saved, is a
    CorruptCheckpointError naming the step folder and the array."""
    root, _ = step_folder(path)
    meta = _read_meta_of(root)
    if model is not None:
        check_model(meta, model, f'checkpoint {root}')
    check_compatible(_saved_params(root), abstract_params, f'checkpoint {root}', subset=subset)
    try:
        restored = _read_params(root, abstract_params)
    except Exception as e:  # noqa: BLE001 - whatever TensorStore raised: removed meanwhile, or damaged
        if not storage.exists(root / 'state', 'the checkpoint'):
            raise StepRemovedError(
                f'checkpoint {root} was removed while it was read (its run keeps train.keep_checkpoints of them '
                'and saved a newer one): read the workdir again for its newest step.'
            ) from None
        raise CorruptCheckpointError(
            f'checkpoint {root}: {_array_in(e) or _unreadable_array(root, abstract_params) or "its parameters"} '
            f'cannot be read ({_damage(e)})'
        ) from None
    if meta is not None:
        for name, value in fingerprint(restored).items():
            if meta['fingerprint'].get(f'params.{name}', value) != value:
                raise CorruptCheckpointError(
                    f'checkpoint {root}: array params.{name} differs from the one saved (checksum mismatch)'
                )
    return restored


def params_digest(params: Any) -> str:
    """A short hex digest of `params`' per-array checksums (`fingerprint`): the same parameters, the same
    digest, wherever they were read from (what a run started with --init_from records of its source)."""
    checksums = json.dumps(fingerprint(params), sort_keys=True).encode()
    return hashlib.sha256(checksums).hexdigest()[:16]


def _read_meta_of(root: epath.Path) -> dict | None:
    try:
        return _read_meta(root)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f'checkpoint {root}: {e}') from None


def _read_params(root: epath.Path, abstract_params: Any) -> Any:
    """The parameters of step folder `root` that `abstract_params` names, placed as its shardings say."""
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), abstract_params)
    return ocp.PyTreeCheckpointer().restore(
        root / 'state',
        args=ocp.args.PyTreeRestore(
            item={'params': abstract_params}, restore_args={'params': restore_args}, partial_restore=True
        ),
    )['params']


def _unreadable_array(root: epath.Path, abstract_params: Any) -> str | None:
    """The first array of `abstract_params` that step folder `root` cannot give back, read one at a time
    (after a read of them all failed: TensorStore's error names a file, not the array)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
        alone: Any = leaf
        for key in reversed(path):
            alone = {key.key: alone}
        try:
            _read_params(root, alone)
        except Exception:  # noqa: BLE001 - this one is damaged
            return f'array params.{path_name(path)}'
    return None
