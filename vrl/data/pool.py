"""A pool of spawned processes for the data commands' parallel work (building, tokenizing), with a
progress bar on a terminal."""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable, Iterator, TypeVar

import tqdm

T = TypeVar('T')


def in_pool(
    fn: Callable[[tuple], T], tasks: list[tuple], workers: int, desc: str, sizes: list[int] | None = None
) -> Iterator[T]:
    """fn(task) for each task, as each is done, on `workers` spawned processes (each on one core: the
    processes are the parallelism), or in this process for one; a terminal shows a bar (of `sizes`,
    bytes, when given). What a task raises stops the rest and is raised here."""
    workers = max(1, min(workers, len(tasks)))
    total = sum(sizes) if sizes else len(tasks)
    with tqdm.tqdm(
        total=total, unit='B' if sizes else 'task', unit_scale=bool(sizes), desc=desc, disable=None, mininterval=1.0
    ) as bar:
        if workers == 1:
            for k, task in enumerate(tasks):
                yield fn(task)
                bar.update(sizes[k] if sizes else 1)
            return
        with multiprocessing.get_context('spawn').Pool(workers, initializer=_one_thread) as pool:
            for k, result in pool.imap_unordered(_indexed, [(fn, k, task) for k, task in enumerate(tasks)]):
                yield result
                bar.update(sizes[k] if sizes else 1)


def _indexed(job: tuple) -> tuple:
    fn, k, task = job
    return k, fn(task)


def _one_thread() -> None:
    os.environ['TOKENIZERS_PARALLELISM'] = 'false'
