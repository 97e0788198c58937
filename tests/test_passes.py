"""Finite passes end together: every process of a jax.distributed job evaluates the whole validation
split in the same number of batches and ends a data.num_epochs pass at the same step, though their
shares of the data hold different numbers of batches; a run whose data ends before train.steps
says so, saved and evaluated. Real processes on 127.0.0.1 (gloo)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
import sys
import threading

import pytest

from tests.gcs_emulator import free_port
from tests.runs import ROOT, host_xla_flags, tiny_config
from vrl.core import multihost
from vrl.data import pipeline

COUNT = """
import json, sys
import jax
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
address, count, index, config = sys.argv[1:]
jax.distributed.initialize(address, int(count), int(index))
from vrl.data.config import DataConfig
from vrl.core import multihost
from vrl.data import pipeline
from vrl.data.tokenizer import Tokenizer
cfg = DataConfig(**json.loads(config))
tokenizer = Tokenizer.load(cfg.tokenizer)
evaluated = list(pipeline.eval_batches(cfg, tokenizer, 0, jax.process_index(), jax.process_count()))
train = iter(pipeline.train_dataset(cfg, tokenizer, jax.process_index(), jax.process_count()))
trained = 0
while pipeline.next_batch(train, finite=True) is not None:
    trained += 1
print(json.dumps({'eval': len(evaluated), 'eval_tokens': int(sum(b['loss_mask'].sum() for b in evaluated)),
                  'train': trained}))
"""


def _batches(cfg, tokenizer, process_count: int) -> tuple[list[int], list[int], list[int]]:
    """Each process's share as it stands alone: eval batches, their real tokens, train batches."""
    evaluated = [list(pipeline.eval_batches(cfg, tokenizer, 0, i, process_count)) for i in range(process_count)]
    trained = [sum(1 for _ in pipeline.train_dataset(cfg, tokenizer, i, process_count)) for i in range(process_count)]
    return [len(e) for e in evaluated], [int(sum(b['loss_mask'].sum() for b in e)) for e in evaluated], trained


def _uneven(small_corpus, process_count: int):
    """A config at which the processes' shares hold different numbers of batches (which the tests are
    about), and each share as it stands alone (`_batches`)."""
    cfg, tokenizer = small_corpus
    for seq_len in (64, 48, 80, 96, 56):
        cfg = dataclasses.replace(cfg, batch_size=process_count, seq_len=seq_len, num_epochs=1, read_threads=0)
        alone = _batches(cfg, tokenizer, process_count)
        if len(set(alone[0])) > 1 and len(set(alone[2])) > 1:
            return cfg, alone
    raise AssertionError(f'every window length gives even shares: {alone}')


class _ThreadsAsProcesses:
    """`multihost.every_process` for `count` threads standing for the processes of a job: each thread's
    flag is and-ed with the others' at a barrier, as the all-gather does across processes."""

    def __init__(self, count: int):
        self.barrier, self.flags, self.index = threading.Barrier(count, timeout=60), [True] * count, threading.local()

    def every_process(self, flag: bool) -> bool:
        self.flags[self.index.value] = flag
        self.barrier.wait()
        agreed = all(self.flags)
        self.barrier.wait()
        return agreed


@pytest.mark.parametrize('process_count', [2, 3])
def test_the_processes_of_a_finite_pass_agree_on_its_batches(small_corpus, process_count, monkeypatch):
    """The edit loop's tier of the test below: the processes as threads, their agreement at a barrier."""
    cfg, (eval_alone, tokens_alone, train_alone) = _uneven(small_corpus, process_count)
    tokenizer = small_corpus[1]
    job = _ThreadsAsProcesses(process_count)
    monkeypatch.setattr(multihost, 'every_process', job.every_process)

    def process(index: int) -> tuple[int, int, int]:
        job.index.value = index
        evaluated = list(pipeline.eval_batches(cfg, tokenizer, 0, index, process_count))
        train, trained = iter(pipeline.train_dataset(cfg, tokenizer, index, process_count)), 0
        while pipeline.next_batch(train, finite=True) is not None:
            trained += 1
        return len(evaluated), int(sum(b['loss_mask'].sum() for b in evaluated)), trained

    with concurrent.futures.ThreadPoolExecutor(process_count) as pool:
        results = list(pool.map(process, range(process_count)))
    assert [r[0] for r in results] == [max(eval_alone)] * process_count  # padded up to the longest share
    assert [r[1] for r in results] == tokens_alone  # every real token, once
    assert [r[2] for r in results] == [min(train_alone)] * process_count  # stopped with the shortest


@pytest.mark.slow  # real processes
@pytest.mark.parametrize('process_count', [2, 4])
def test_every_process_runs_the_same_number_of_batches_in_a_finite_pass(small_corpus, process_count):
    cfg, (eval_alone, tokens_alone, train_alone) = _uneven(small_corpus, process_count)
    address = f'127.0.0.1:{free_port()}'
    processes = [
        subprocess.Popen(
            [sys.executable, '-c', COUNT, address, str(process_count), str(i), json.dumps(dataclasses.asdict(cfg))],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                'PYTHONPATH': str(ROOT),
                'JAX_PLATFORMS': 'cpu',
                'PATH': '/usr/bin:/bin',
                'XLA_FLAGS': host_xla_flags(1),
            },
        )
        for i in range(process_count)
    ]
    results = []
    for p in processes:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r['eval'] for r in results] == [max(eval_alone)] * process_count  # padded up to the longest share
    assert [r['eval_tokens'] for r in results] == tokens_alone  # every real token, once
    assert [r['train'] for r in results] == [min(train_alone)] * process_count  # stopped with the shortest


@pytest.mark.slow  # trains a run
def test_a_run_whose_data_ends_first_says_so_saved_and_evaluated(small_corpus, tmp_path, capsys):
    from vrl.train import loop
    from vrl.train.rundir import checkpoint

    config = tiny_config(small_corpus, steps=10_000, checkpoint_every=1000, log_every=1000)
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, num_epochs=1, seq_len=128, batch_size=32)
    )
    _, _, (steps,) = _batches(config.data, small_corpus[1], 1)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, eval_every=steps))
    result = loop.run(config, str(tmp_path / 'run'))
    out = capsys.readouterr().out
    assert result.step == max(result.losses) == steps < 10_000
    assert (
        f'the data ended after step {steps}: data.num_epochs=1 passes over it are done, before train.steps=10000; step'
    ) in out
    assert checkpoint.latest_step(tmp_path / 'run') == steps and result.eval_loss is not None
    records = [json.loads(line) for line in (tmp_path / 'run/metrics.jsonl').read_text().splitlines()]
    assert [r['step'] for r in records if 'eval_loss' in r] == [steps]  # due and the data's end: evaluated once
