"""vrl.tools.evaluate: lm-evaluation-harness requests against direct forward passes, and the command on a
local multiple-choice task."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip('lm_eval', reason='lm-eval is in requirements-extra.txt: pip install -r requirements-extra.txt')

from flax import nnx  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from tests.helpers import piece_bytes
from tests.runs import CHOICE_DOCS, SHARED_RUN_STEPS, write_choice_task
from vrl.tools import evaluate
from vrl.train.scoring import lm_eval_model, scorer

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def workdir(shared_runs, tmp_path_factory) -> Path:
    """A copy of the session's trained ResFormer run (the command writes lm_eval/ into its workdir)."""
    return Path(shutil.copytree(shared_runs('resformer'), tmp_path_factory.mktemp('evaluate') / 'resformer'))


@pytest.fixture(scope='module')
def lm(workdir) -> lm_eval_model.VrlLM:
    return lm_eval_model.VrlLM(str(workdir), batch_size=3)


def forward_log_probs(lm: lm_eval_model.VrlLM, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """float64 log p(ids[t] | ids[:t]) for t = 1.., and whether ids[t] is the argmax: one forward pass."""
    model = nnx.merge(lm.run.trainer.graphdef, jax.device_get(lm.run.params))
    logits = np.asarray(model(jnp.asarray([ids[:-1]])), np.float64)[0]
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    targets = np.asarray(ids[1:])
    return log_probs[np.arange(len(targets)), targets], logits.argmax(-1) == targets


def expected_loglikelihood(lm: lm_eval_model.VrlLM, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's tokens are those of the whole text past the last token that ends within
    the context's bytes (counted from the pieces' text, tests/helpers.py's piece_bytes, not from
    the tokenizer's offsets)."""
    tok = lm.tokenizer
    whole = tok.encode(context + continuation).tolist()
    ends = np.cumsum(piece_bytes(tok)[whole])
    n_context = int(np.sum(ends <= len(context.encode('utf-8'))))
    ids = (lm.separator + whole)[-(lm.max_len + 1) :]
    n_scored = len(whole) - n_context
    log_probs, greedy = forward_log_probs(lm, ids)
    return float(log_probs[-n_scored:].sum()), bool(greedy[-n_scored:].all())


def test_loglikelihood_equals_the_forward_pass(lm):
    long_context = 'To be, or not to be, that is the question. ' * 12
    pairs = [
        ('To be, or not to b', 'e, that is the question'),  # '▁be' spans the boundary
        ('', 'HAMLET: Who is there?'),
        ('The queen said: ', 'café naïve 日本'),  # multi-byte characters, byte-fallback pieces
        ('Good my lord,', ' I pray you'),
        (long_context, ' Whether tis nobler'),
    ]  # longer than seq_len: left-truncated
    tok = lm.tokenizer
    merged = [c for c, x in pairs if c and tok.encode(c).tolist() != tok.encode(c + x).tolist()[: len(tok.encode(c))]]
    assert merged, 'no pair has a token merging context and continuation: the test would not test that'
    assert len(tok.encode(long_context)) > lm.max_len
    requests = [Instance('loglikelihood', {}, pair, i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    for pair, (log_prob, greedy) in zip(pairs, results):
        expected, expected_greedy = expected_loglikelihood(lm, *pair)
        assert log_prob < 0
        assert abs(log_prob - expected) <= 1e-5 * abs(expected), pair
        assert greedy == expected_greedy
    # logits 16 positions at a time (4 chunks of a 64-token row): the same sums
    in_chunks = scorer.Scorer(lm.run, batch_size=2, chunk=16).score([lm._request_sequence(*p) for p in pairs])
    np.testing.assert_allclose([r[0] for r in in_chunks], [r[0] for r in results], rtol=1e-5)


def test_loglikelihood_rolling_sums_every_token_once(lm):
    tok = lm.tokenizer
    short = 'Who is there? Nay, answer me: stand, and unfold yourself.'
    long = ' '.join(['Long live the king!', 'Bernardo?', 'He.', 'You come most carefully upon your hour.'] * 12)
    ids = tok.encode(long).tolist()
    assert len(ids) > 2 * lm.max_len
    results = lm.loglikelihood_rolling(
        [Instance('loglikelihood_rolling', {}, (t,), i) for i, t in enumerate([short, long])]
    )

    short_ids = lm.separator + tok.encode(short).tolist()
    assert abs(results[0] - forward_log_probs(lm, short_ids)[0][len(lm.separator) - 1 :].sum()) <= 1e-5 * abs(
        results[0]
    )

    # lm-eval's windows by hand: predictions stream[s:e], at most L at a time, each window's inputs
    # the L tokens before e - 1 (the first from the stream's start); the separator is not scored
    stream, L = lm.separator + ids, lm.max_len
    total, s = 0.0, 1
    while s < len(stream):
        e = min(len(stream), s + L)
        first = max(0, e - 1 - L)
        log_probs = forward_log_probs(lm, stream[first:e])[0]
        total += log_probs[max(s, len(lm.separator)) - first - 1 :].sum()
        s = e
    assert abs(results[1] - total) <= 1e-5 * abs(total)


def test_generate_until_cuts_at_the_first_stop_string(lm):
    context = 'HAMLET:'
    free = lm.generate_until([Instance('generate_until', {}, (context, {'until': [], 'max_gen_toks': 24}), 0)])[0]
    assert len(free) > 8
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    requests = [
        Instance('generate_until', {}, (context, {'until': [stop], 'max_gen_toks': 24}), 0),
        Instance('generate_until', {}, ('OPHELIA:', {'until': ['\n'], 'max_gen_toks': 24}), 1),
    ]
    cut, other = lm.generate_until(requests)
    assert cut == free[: free.index(stop)]
    assert '\n' not in other


def test_the_command_runs_a_local_task_and_its_scores_are_the_models(lm, workdir, tmp_path):
    tasks = write_choice_task(tmp_path / 'tasks')
    out = subprocess.run(
        [
            sys.executable,
            '-m',
            'vrl.tools.evaluate',
            f'--workdir={workdir}',
            '--tasks=toy_choice',
            f'--include_path={tasks}',
            '--log_samples',
            '--batch_size=4',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert '|toy_choice|' in out.stdout
    results = json.loads(next((workdir / 'lm_eval').glob('results_*.json')).read_text())
    assert results['vrl']['step'] == SHARED_RUN_STEPS
    assert results['pretty_env_info'].startswith('jax: ')  # JAX's report, not PyTorch's
    samples = [json.loads(line) for line in next((workdir / 'lm_eval').glob('samples_toy_choice_*.jsonl')).open()]
    assert len(samples) == len(CHOICE_DOCS)
    correct = []
    for sample in samples:
        scores = (
            [expected_loglikelihood(lm, *request)[0] for request in sample['arguments'].values()]
            if isinstance(sample['arguments'], dict)
            else [expected_loglikelihood(lm, *a)[0] for a in sample['arguments']]
        )
        returned = [float(r[0][0]) for r in sample['resps']]
        np.testing.assert_allclose(returned, scores, rtol=1e-5)
        correct.append(float(np.argmax(scores) == sample['target']))
    assert results['results']['toy_choice']['acc,none'] == pytest.approx(np.mean(correct))


def test_bad_input_is_named(workdir, small_corpus, tmp_path):
    with pytest.raises(scorer.EvaluateError, match=r"unknown task\(s\) 'hellaswagg'.*did you mean hellaswag"):
        evaluate.evaluate(str(workdir), ['hellaswagg'])
    tasks = write_choice_task(tmp_path / 'tasks', docs=None)
    with pytest.raises(scorer.EvaluateError, match=r"task 'toy_choice': its data could not be loaded"):
        evaluate.evaluate(str(workdir), ['toy_choice'], include_path=str(tasks))
    empty = tmp_path / 'untrained'
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match='no checkpoint in'):
        evaluate.evaluate(str(empty), ['toy_choice'], include_path=str(tasks))
    with pytest.raises(scorer.EvaluateError, match='batch_size=0 is invalid'):
        lm_eval_model.VrlLM(str(workdir), batch_size=0)


def _evaluate(workdir: Path, tasks: Path, task: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            '-m',
            'vrl.tools.evaluate',
            f'--workdir={workdir}',
            f'--tasks={task}',
            f'--include_path={tasks}',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_task_file_that_does_not_parse_is_named_with_its_line(workdir, tmp_path):
    tasks = write_choice_task(tmp_path / 'tasks')
    (tasks / 'bad_yaml.yaml').write_text('task: bad_yaml\ndataset_path: json\n  output_type: [unclosed\n')
    result = _evaluate(workdir, tasks, 'bad_yaml')
    assert result.returncode != 0 and 'Traceback' not in result.stderr
    line = [x for x in result.stderr.splitlines() if x.startswith('error:')]
    assert (
        len(line) == 1 and f'task files in --include_path that do not parse: {tasks / "bad_yaml.yaml"}:3: ' in line[0]
    )
    assert 'mapping values are not allowed here' in line[0]


def test_a_data_line_that_does_not_parse_is_named_with_its_file_and_line(workdir, tmp_path):
    tasks = write_choice_task(tmp_path / 'tasks')
    data = tasks / 'toy_choice.jsonl'
    lines = data.read_text().splitlines()
    data.write_text('\n'.join([lines[0], lines[1][:-5], *lines[2:]]) + '\n')  # the second row cut short
    result = _evaluate(workdir, tasks, 'toy_choice')
    assert result.returncode != 0 and 'Traceback' not in result.stderr
    assert f"error: task 'toy_choice': its data could not be loaded: {data}:2 is not valid JSON (" in result.stderr


def _contexts(sample: dict) -> list[str]:
    """The contexts of a logged sample's requests (lm-eval logs them as a dict or a list)."""
    arguments = sample['arguments']
    return [a['arg_0'] for a in arguments.values()] if isinstance(arguments, dict) else [a[0] for a in arguments]


def test_lm_eval_finds_vrl_by_name_and_limit_and_num_fewshot_do_what_they_say(workdir, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = write_choice_task(tmp_path / 'tasks')
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model='vrl',
        model_args=f'workdir={workdir},batch_size=4',
        tasks=['toy_choice'],
        task_manager=manager,
        limit=3,
        num_fewshot=1,
        log_samples=True,
    )
    assert results['n-samples']['toy_choice'] == {'original': len(CHOICE_DOCS), 'effective': 3}
    samples = results['samples']['toy_choice']
    assert sorted(s['doc_id'] for s in samples) == [0, 1, 2]
    for sample in samples:
        own = CHOICE_DOCS[sample['doc_id']]['question']
        for context in _contexts(
            sample
        ):  # one solved example (lm-eval draws it from the same split), then the question
            example = context[: -len(own)]
            assert context.endswith(own) and example.endswith('\n\n'), context
            assert any(example == d['question'] + ' ' + d['choices'][d['answer']] + '\n\n' for d in CHOICE_DOCS), (
                context
            )
    # the command's function: the same numbers
    again = evaluate.evaluate(
        str(workdir), ['toy_choice'], num_fewshot=1, limit=3, batch_size=4, include_path=str(tasks)
    ).results
    assert again['results']['toy_choice']['acc,none'] == results['results']['toy_choice']['acc,none']
    zero_shot = evaluate.evaluate(str(workdir), ['toy_choice'], limit=3, include_path=str(tasks), log_samples=True)
    logged = [json.loads(line) for line in zero_shot.files[-1].read_text().splitlines()]
    assert len(logged) == 3 and all(set(_contexts(s)) == {CHOICE_DOCS[s['doc_id']]['question']} for s in logged)
