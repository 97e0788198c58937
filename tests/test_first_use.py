"""A new user's first runs, through the real commands in a fresh HOME, as the README and
docs/data.md tell them: the demo on the built-in corpus, then one's own corpus (a .jsonl.zst, a
tokenizer.json, prepare, tokenize, train). Every line they see is vrl's: no traceback, no download
banner, no native library's noise (tests/runs.py `not_for_users`); the start names what the run
reads and where it writes. The one-machine pod rehearsal's lines are checked in tests/test_pod.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.runs import not_for_users
from vrl.core import cli
from vrl.data import pipeline
from vrl.data.config import DataConfig
from vrl.data.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


@pytest.fixture
def user(tmp_path):
    """Runs `python -m ARGS` in a new folder as a user whose HOME is new (the compiled programs' cache kept, to save
    time); returns everything it printed, stdout and stderr together, after checking it succeeded."""
    env = {
        **os.environ,
        'HOME': str(tmp_path / 'home'),
        'JAX_COMPILATION_CACHE_DIR': cli.compilation_cache_dir(),
        'PYTHONPATH': str(ROOT),
    }

    def run(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, '-m', *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        said = out.stdout + out.stderr
        assert out.returncode == 0, said[-3000:]
        assert not not_for_users(said), not_for_users(said)
        return said

    return run


def test_the_demo_says_what_it_reads_and_where_it_writes(user, tmp_path):
    said = user(
        'vrl.main',
        f'--config={ROOT / "configs/tiny.py"}',
        '--workdir=runs/tiny',
        '--config.train.steps=2',
        '--config.train.sample_tokens=4',
    )
    data_dir = tmp_path / 'home/.cache/vrl/tensorflow_datasets'
    assert 'training a 1024-piece tokenizer on shakespeare' in said and 'trained the tokenizer in ' in said
    assert re.search(
        r'^data shakespeare: [\d,]+ train tokens \(estimated from [\d,]+ documents, '
        r'tokenized on the fly, shuffled by document\)',
        said,
        re.M,
    ), said
    assert (
        f'tokenizer {data_dir}/vrl_tokenizers/shakespeare_1024.model (1,024 pieces); writing to {tmp_path}/runs/tiny'
    ) in said
    # a new HOME: the peak is probed now, and kept only if nothing else took the cores meanwhile
    assert re.search(
        r"^MFU against [\d,.]+ GFLOP/s \(this host's float32 matmul rate on CPU ISA \w+ with (xla|onednn) kernels, "
        f'measured (idle now, kept in {tmp_path}/home/.cache/vrl/cpu_peak.json|now, provisional: other work '
        'took \\d+% of the cores meanwhile, so it is not kept as the reference and MFU may read high)\\)$',
        said,
        re.M,
    ), said
    # the schedule follows train.steps, but 2 steps stop inside the warmup: said, with the warmup that fits
    assert 'it stops inside the warmup (optimizer.warmup_steps=30): set --config.optimizer.warmup_steps=0' in said
    loss = re.findall(r'^step 2/2 +loss (\S+)', said, re.M)[-1]
    assert said.rstrip().endswith(f'done at step 2: loss {loss}; checkpoint in {tmp_path}/runs/tiny/checkpoints/2')


def test_ones_own_corpus_from_a_jsonl_zst_to_a_trained_smoke_run(user, tmp_path, plays_dir):
    import zstandard

    texts = [block for play in sorted(plays_dir.iterdir()) for block in play.read_text().split('\n\n') if block.strip()]
    (tmp_path / 'corpus').mkdir()
    (tmp_path / 'corpus/part-0.jsonl.zst').write_bytes(
        zstandard.ZstdCompressor().compress(''.join(json.dumps({'text': text}) + '\n' for text in texts).encode())
    )
    data = ['--name=my_corpus', f'--data_dir={tmp_path}/tfds']
    prepared = user('vrl.data', 'prepare', '--input=corpus/*.jsonl.zst', *data, '--validation_fraction=0.05')
    assert re.search(r'^prepared dataset my_corpus: [\d,]+ train, [\d,]+ validation documents in ', prepared, re.M)
    user('vrl.data.tokenizer', 'train', *data, '--vocab_size=512', '--out=tok.json')
    tokenized = user('vrl.data', 'tokenize', *data, '--tokenizer=tok.json')
    assert 'tokenized my_corpus' in tokenized, tokenized
    said = user(
        'vrl.main',
        f'--config={ROOT / "configs/tiny.py"}',
        '--workdir=runs/smoke',
        '--config.train.steps=2',
        '--config.train.sample_tokens=4',
        '--config.data.name=my_corpus',
        f'--config.data.data_dir={tmp_path}/tfds',
        '--config.data.tokenizer=tok.json',
        '--config.model.vocab_size=512',
    )
    assert re.search(
        r'^data my_corpus: [\d,]+ train tokens \(counted, pre-tokenized, shuffled by document\)', said, re.M
    ), said
    assert f'tokenizer tok.json (512 pieces); writing to {tmp_path}/runs/smoke' in said
    run = DataConfig(name='my_corpus', data_dir=f'{tmp_path}/tfds', tokenizer=str(tmp_path / 'tok.json'))
    prompt = pipeline.opening_words(run, Tokenizer.load(run.tokenizer))  # the validation split's first words
    assert any(text.startswith(prompt) for text in texts) and not prompt.startswith('ROMEO')
    assert re.search(r'^sample \(greedy\): \[(.*?)\]', said, re.M)[1].startswith(prompt)
    assert said.rstrip().endswith(f'checkpoint in {tmp_path}/runs/smoke/checkpoints/2')


TINY = f'--config={ROOT / "configs/tiny.py"}'


@pytest.mark.parametrize(
    'missing, args, message',
    [
        (
            'matplotlib',
            ['vrl.experiments.compare', TINY, '--variants=vanilla', '--workdir=out'],
            'compare (for its figures)',
        ),
        (
            'matplotlib',
            ['vrl.experiments.study', TINY, '--variants=vanilla', '--workdir=out'],
            'study (for its figures)',
        ),
        ('matplotlib', ['vrl.experiments.analyze', '--workdir=runs/a', '--out=out'], 'analyze (for its figures)'),
        ('lm_eval', ['vrl.tools.evaluate', '--workdir=runs/a', '--tasks=piqa'], 'vrl.tools.evaluate'),
        (
            'lm_eval',
            ['vrl.experiments.compare', TINY, '--variants=vanilla', '--workdir=out', '--tasks=piqa'],
            '--tasks',
        ),
        ('wandb', ['vrl.main', TINY, '--workdir=out', '--config.train.wandb_project=p'], 'train.wandb_project'),
        ('safetensors', ['vrl.main', TINY, '--workdir=out', '--init_from=hf:somewhere'], '--init_from=hf:DIR'),
        ('libtpu', ['vrl.main', TINY, '--compile_only', '--topology=v5e:4x4'], '--topology=v5e:4x4'),
    ],
    ids=['compare', 'study', 'analyze', 'evaluate', 'compare-tasks', 'wandb', 'init-from-hf', 'topology'],
)
def test_a_missing_extra_is_said_before_any_work(tmp_path, missing, args, message):
    """Each command that needs a package of requirements-extra.txt for its last stage names it, and the
    install line, in one line before it trains or reads anything; nothing is written."""
    from tests.helpers import hiding

    (tmp_path / 'work').mkdir()
    out = subprocess.run(
        [sys.executable, '-m', *args],
        cwd=tmp_path / 'work',
        env={**hiding(tmp_path / 'hide', missing), 'PYTHONPATH': f'{tmp_path / "hide"}{os.pathsep}{ROOT}'},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.fullmatch(
        f'error: [^\n]*{re.escape(message)}[^\n]* needs {missing}, which is not installed: pip install -r '
        f'requirements-{"tpu" if missing == "libtpu" else "extra"}.txt \\(nothing was run\\)\n',
        out.stderr,
    ), out.stderr
    assert not list((tmp_path / 'work').iterdir())


def test_an_error_after_the_info_lines_comes_after_them_in_a_log(tmp_path):
    """stdout and stderr into one file (a log, CI): the run's info lines, then the refusal, in the order
    they were said (a block-buffered stdout used to put the error first)."""
    log = tmp_path / 'log'
    with log.open('w') as out:
        done = subprocess.run(
            [
                *[sys.executable, '-m', 'vrl.main', TINY, f'--workdir={tmp_path / "run"}'],
                *['--config.train.steps=20', '--config.optimizer.schedule=wsd'],
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
            env={**os.environ, 'PYTHONPATH': str(ROOT)},
        )
    lines = log.read_text().splitlines()
    assert done.returncode == 1 and lines[-1].startswith('error: train.steps=20 is too short'), lines
    assert lines[0].startswith('model.'), lines
