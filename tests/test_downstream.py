"""lm-eval tasks scored while a run trains (train.downstream_tasks, vrl/train/downstream.py): the
series in metrics.jsonl, equal to vrl.tools.evaluate on each step's checkpoint, continued by a
resume, and a task that cannot be loaded refused at start-up."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

pytest.importorskip('lm_eval', reason='lm-eval is in requirements-extra.txt: pip install -r requirements-extra.txt')

from tests.helpers import tensorboard_scalars  # noqa: E402
from tests.runs import tiny_config as tiny  # noqa: E402
from tests.runs import write_choice_task, write_text_task  # noqa: E402
from vrl.experiments.grid import read_metrics  # noqa: E402
from vrl.tools import evaluate  # noqa: E402
from vrl.train import loop  # noqa: E402
from vrl.train.scoring import lm_eval_tasks, scorer  # noqa: E402
from vrl.train.start import TrainingError  # noqa: E402


def _config(small_corpus, tasks, steps: int, names: str = 'toy_choice', **train):
    return tiny(
        small_corpus,
        steps=steps,
        downstream_tasks=names,
        downstream_every=4,
        downstream_include_path=str(tasks),
        checkpoint_every=4,
        keep_checkpoints=10,
        **train,
    )


def test_scores_while_training_come_from_the_weights_of_their_step(small_corpus, tmp_path):
    """The edit loop's tier of the test below: scored at steps 2 and 4 of one short run, the two
    differ (scores of the initial weights, or of one step's, would not); resumed to step 7 with
    train.downstream_every=0, scored at its last step only."""
    tasks = write_text_task(tmp_path / 'tasks')
    for steps, every in ((4, 2), (7, 0)):
        config = _config(small_corpus, tasks, steps, 'toy_text')
        loop.run(
            dataclasses.replace(config, train=dataclasses.replace(config.train, downstream_every=every)),
            str(tmp_path / 'run'),
        )
    scored = {
        step: r['downstream/toy_text/bits_per_byte']
        for step, r in read_metrics(tmp_path / 'run').items()
        if 'downstream_seconds' in r
    }
    assert sorted(scored) == [2, 4, 7] and len(set(scored.values())) == 3, scored


@pytest.mark.slow  # trains two runs and runs lm-eval on each checkpoint
def test_scores_while_training_equal_the_command_on_each_checkpoint_and_resume_continues(small_corpus, tmp_path):
    tasks = write_text_task(write_choice_task(tmp_path / 'tasks'))
    workdir, names = tmp_path / 'run', ['toy_choice', 'toy_text']
    loop.run(_config(small_corpus, tasks, 4, ','.join(names)), str(workdir))
    loop.run(_config(small_corpus, tasks, 8, ','.join(names)), str(workdir))  # resumed from step 4, to 8
    records = read_metrics(workdir)
    scored = {
        step: {k[len('downstream/') :]: v for k, v in r.items() if k.startswith('downstream/')}
        for step, r in records.items()
        if 'downstream_seconds' in r
    }
    assert sorted(scored) == [4, 8]
    assert set(scored[8]) == {'toy_choice/acc', 'toy_text/word_perplexity', 'toy_text/bits_per_byte'}
    assert (workdir / 'metrics.jsonl').read_text().count('downstream_seconds') == 2, 'the resume scored step 4 again'
    assert scored[4]['toy_text/bits_per_byte'] != scored[8]['toy_text/bits_per_byte']  # each step's own weights
    for step in (4, 8):  # the command on a copy holding only that step's checkpoint
        copy = tmp_path / f'at{step}'
        shutil.copytree(workdir, copy)
        for other in (copy / 'checkpoints').iterdir():
            if other.name.isdigit() and int(other.name) != step:
                shutil.rmtree(other)
        rows = small_corpus[0].batch_size
        results = evaluate.evaluate(str(copy), names, batch_size=rows, include_path=str(tasks)).results
        assert results['vrl']['step'] == step
        assert {
            f'{task}/{metric}': value
            for task, metrics in lm_eval_tasks.task_metrics(results, names).items()
            for metric, value in metrics.items()
        } == scored[step]
    board = {key[1]: points for key, points in tensorboard_scalars(workdir).items()}
    assert board['downstream/toy_choice/acc'] == [
        (4, pytest.approx(scored[4]['toy_choice/acc'])),
        (8, pytest.approx(scored[8]['toy_choice/acc'])),
    ]


@pytest.mark.slow  # starts runs
def test_a_task_that_cannot_be_loaded_stops_the_run_at_start_up(small_corpus, tmp_path):
    tasks = write_choice_task(tmp_path / 'tasks', docs=None)  # the YAML names a data file that is missing
    with pytest.raises(TrainingError, match=r"task 'toy_choice': its data could not be loaded"):
        loop.run(_config(small_corpus, tasks, steps=4), str(tmp_path / 'run'))
    assert not (tmp_path / 'run' / 'checkpoints').exists()
    bad = _config(small_corpus, tasks, steps=4)
    bad = dataclasses.replace(bad, train=dataclasses.replace(bad.train, downstream_tasks='toy_choise'))
    with pytest.raises(TrainingError, match=r"unknown task\(s\) 'toy_choise'.*did you mean toy_choice"):
        loop.run(bad, str(tmp_path / 'run2'))


def test_packing_places_every_sequence_once_in_few_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=300).tolist()
    rows = scorer._pack(lengths, 64)
    placed = sorted(i for row in rows for i, _ in row)
    assert placed == list(range(len(lengths)))
    for row in rows:  # in order, not overlapping, within the row
        spans = sorted((offset, offset + lengths[i]) for i, offset in row)
        assert spans[0][0] == 0 and spans[-1][1] <= 64
        assert all(end == start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert len(rows) <= -(-sum(lengths) // 64) * 1.05 + 1  # best fit leaves little room unused
