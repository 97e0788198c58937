"""Orbax checkpoints of {train state, data iterator position} in `WORKDIR/checkpoints`.

Saves are asynchronous; Orbax writes each step to a temporary folder and renames it when
complete, so a process killed mid-save leaves the previous step restorable. The data
iterator state is one JSON file per process (grain's handler). Restoring checks the
checkpoint's parameter shapes against the config first and names the first mismatch.
"""

from __future__ import annotations

import logging
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from vrl.config import TrainConfig


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the config; the message names the first difference."""


def make_manager(workdir: str, cfg: TrainConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep_checkpoints, keep_period=cfg.keep_period or None,
        enable_async_checkpointing=True, create=True)
    return ocp.CheckpointManager(epath.Path(workdir) / 'checkpoints', options=options,
                                 item_handlers={'state': ocp.StandardCheckpointHandler(),
                                                'data': grain.checkpoint.CheckpointHandler()})


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_iterator: Any,
         force: bool = False) -> bool:
    """Starts an async save of `state` (and the iterator's position, if any)."""
    items = {'state': ocp.args.StandardSave(state)}
    if data_iterator is not None:
        items['data'] = grain.checkpoint.CheckpointSave(data_iterator)
    return manager.save(step, args=ocp.args.Composite(**items), force=force)


def _path_name(path) -> str:
    return '.'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def check_compatible(saved: Any, expected: Any, where: str) -> None:
    """Raises CheckpointMismatchError naming the first parameter whose presence or shape differs."""
    saved_leaves = {_path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(saved)}
    expected_leaves = {_path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    for name, want in expected_leaves.items():
        if name not in saved_leaves:
            raise CheckpointMismatchError(f'{where} has no parameter {name} (shape {tuple(want.shape)}) that '
                                          'the config needs: it was written for another model config.')
        got = tuple(saved_leaves[name].shape)
        if got != tuple(want.shape):
            raise CheckpointMismatchError(f'{where}: parameter {name} has shape {got} but the config '
                                          f'needs {tuple(want.shape)}; it was written for another model config.')
    extra = sorted(set(saved_leaves) - set(expected_leaves))
    if extra:
        raise CheckpointMismatchError(f'{where} has parameter {extra[0]} that the config does not: it was '
                                      'written for another model config.')


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any, data_iterator: Any) -> Any:
    """The train state at `step` (and the iterator moved to its saved position)."""
    metadata = manager.item_metadata(step)['state']
    check_compatible(metadata['params'], abstract_state.params, f'checkpoint {manager.directory}/{step}')
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
        items['data'] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    logging.info('restored step %d from %s', step, manager.directory)
    return restored['state']


def step_folder(path: str) -> tuple[epath.Path, int | None]:
    """The folder holding `state/` for a workdir (its latest step) or a step folder, and its step
    (None if the folder name is not one); FileNotFoundError names the place and how to make one."""
    root = epath.Path(path).absolute()
    if (root / 'checkpoints').exists():
        root = root / 'checkpoints'
    if (root / 'state').exists():
        return root, int(root.name) if root.name.isdigit() else None
    steps = ocp.utils.checkpoint_steps(root) if root.is_dir() else []
    if not steps:
        raise FileNotFoundError(f'no checkpoint in {path}: expected a workdir with checkpoints/ or a step '
                                'folder holding state/ (train one with `python -m vrl.main --workdir=...`).')
    return root / str(max(steps)), max(steps)


def restore_params(path: str, abstract_params: Any) -> Any:
    """Parameters only, from a workdir (its latest step) or a step folder: for --init_from."""
    root, _ = step_folder(path)
    checkpointer = ocp.PyTreeCheckpointer()
    check_compatible(checkpointer.metadata(root / 'state').item_metadata['params'], abstract_params,
                     f'checkpoint {root}')
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), abstract_params)
    restored = checkpointer.restore(root / 'state', args=ocp.args.PyTreeRestore(
        item={'params': abstract_params}, restore_args={'params': restore_args}, partial_restore=True))
    return restored['params']
