"""A run's plan: everything a run (or a group of runs that differ only in seed) depends on, settled
once, in the order that fails fastest: the mesh the config asks for, the tokenizer (an hf: start's
own), the data (every split it reads found, every training dataset opened), the downstream tasks,
then the choices `auto` leaves to a compile (vrl/train/aot.py) and the final mesh, this process's
share of the rows, and the peak that MFU is measured against. The loop builds the dataset, the
members and the hooks once from it (vrl/train/loop.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
from etils import epath
from jax.sharding import Mesh

from vrl.core import multihost, sharding
from vrl.data import pipeline
from vrl.data.config import DataConfig
from vrl.data.tokenizer import Tokenizer
from vrl.model import resolve
from vrl.train import aot, downstream, metrics, start
from vrl.train.config import Config, check_fits_mesh
from vrl.train.rundir import guard as guard_lib
from vrl.train.rundir import workdir as workdir_lib


class PlannedRun(NamedTuple):
    """One run of a plan: its config (the plan's but for train.seed), its workdir, the guard that keeps
    it and the label before its lines ('[WORKDIR NAME] ' in a group, '' for a run alone)."""

    config: Config
    path: epath.Path
    guard: guard_lib.Guard
    label: str


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run's setup settled. `config` is resolved (auto choices made; an hf: start's tokenizer
    named) and is each run's but for train.seed (`runs`: one for a run alone, a group's members);
    `train_data` reads from a tokenizer's source where the tokenizer is copied into the workdir later."""

    config: Config
    runs: tuple[PlannedRun, ...]
    mesh: Mesh
    row_share: tuple[int, int]  # (which share, how many) of every batch's rows this process supplies
    train_data: pipeline.TrainData  # the training datasets, opened
    tokenizer: Tokenizer
    tokenizer_copy: tuple[epath.Path, str] | None  # an hf: start's tokenizer file and how it was chosen
    task_manager: Any  # the downstream tasks (lm-eval's TaskManager) or None
    peak: metrics.Peak


def settle(
    configs: list[Config],
    paths: list[epath.Path],
    guards: list[guard_lib.Guard],
    request: start.Request,
    say: Callable[[str], None],
) -> RunPlan:
    """The plan of the runs `configs` in `paths`, kept by `guards` (they differ only in train.seed)."""
    given = configs[0].mesh  # a bad mesh fails here, before the data and the compiles (context 0, auto: as 1)
    early = sharding.make_mesh(sharding.without_context(given) if given.context == 0 else given)
    check_fits_mesh(configs[0], dict(early.shape))
    config, tokenizer_source, tokenizer_line = start.hf_tokenizer(configs[0], request.init_from, paths[0])
    # a new run's copy of an hf: tokenizer is made in the workdir once the plan is settled: until then its
    # source stands in for it
    copied_later = tokenizer_source is not None and (
        request.fresh or not workdir_lib.trained_tokenizer(paths[0], tokenizer_source)
    )
    data = dataclasses.replace(config.data, tokenizer=str(tokenizer_source)) if copied_later else config.data
    pipeline.build_built_ins(data)
    tokenizer = multihost.process_0_first(lambda: pipeline.tokenizer_for_run(data, config.model.vocab_size))
    train_data = pipeline.TrainData.open(data, tokenizer)  # before anything compiles (auto-fit compiles for minutes)
    task_manager = downstream.load(config.train)  # a task that cannot be loaded stops the run before a compile
    config, _ = aot.resolve(config, jax.devices(), aot.local_hbm_bytes(), say)
    mesh = sharding.make_mesh(config.mesh)
    return RunPlan(
        config=config,
        runs=tuple(
            PlannedRun(
                dataclasses.replace(config, train=dataclasses.replace(config.train, seed=c.train.seed)),
                path,
                guard,
                f'[{path.name}] ' if len(paths) > 1 else '',
            )
            for c, path, guard in zip(configs, paths, guards)
        ),
        mesh=mesh,
        row_share=sharding.row_share(mesh),
        train_data=train_data,
        tokenizer=tokenizer,
        tokenizer_copy=(tokenizer_source, tokenizer_line) if tokenizer_source else None,
        task_manager=task_manager,
        # before the data's workers start: a CPU's matmul probe must not share the cores with them
        peak=metrics.peak_flops(config.train.peak_flops, resolve.local_compute_dtype(config.model)),
    )


def idle_settings(config: Config, datasets: dict[str, dict[str, Any]]) -> list[str]:
    """Notes for settings that change nothing in this run as it reads and trains here, though they may
    on another machine or at another shape: the windows' block settings where every dataset is read
    by document (`datasets`: pipeline.provenance's), and a local attention window that covers the
    whole sequence."""
    notes, data, defaults = [], config.data, DataConfig()
    by_document = all(d['shuffle'] == 'by document' for d in datasets.values())
    for name in ('block_tokens', 'window_blocks'):
        if by_document and getattr(data, name) != getattr(defaults, name):
            notes.append(
                f'note: data.{name}={getattr(data, name)} does nothing here: the training data is read by document '
                f"(data.shuffle={data.shuffle!r}; 'auto' reads windows of blocks from an object store only, "
                "'windows' everywhere)"
            )
    window = config.model.attention_window
    if window and window >= data.seq_len:
        notes.append(
            f'note: model.attention_window={window} covers the whole sequence (data.seq_len={data.seq_len}): '
            'every layer attends to all positions in this run; local layers differ at longer sequences only'
        )
    return notes
