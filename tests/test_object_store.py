"""A run that lives on an object store: workdir, dataset and tokenizer on gs://, against a real GCS
emulator (fake-gcs-server) on 127.0.0.1. Every credential and metadata look-up is pinned to
127.0.0.1, so nothing here can reach a real cloud."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gcs_emulator import Emulator, environment
from tests.runs import overrides, tiny_config

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier

ROOT = Path(__file__).resolve().parents[1]
@pytest.fixture(scope='module')
def gcs(tmp_path_factory):
    """The emulator's URL, with this process's clients pointed at it (bucket `vrl`)."""
    import socket
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        port = probe.getsockname()[1]
    emulator = Emulator(port, str(tmp_path_factory.mktemp('gcs') / 'objects'))
    emulator.create_bucket('vrl')
    env = environment(emulator.url)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield emulator.url
    emulator.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _fs():
    import gcsfs
    fs = gcsfs.GCSFileSystem()
    fs.invalidate_cache()
    return fs


def _env(gcs_url: str, home: Path) -> dict[str, str]:
    """A process of its own machine: its own HOME, TMPDIR; the emulator; nothing else to reach."""
    home.mkdir(parents=True, exist_ok=True)
    (home / 'tmp').mkdir(exist_ok=True)
    return {**os.environ, **environment(gcs_url), 'HOME': str(home), 'TMPDIR': str(home / 'tmp'),
            'PYTHONPATH': str(ROOT)}


@pytest.fixture(scope='module')
def bucket_config(gcs, plays_dir, small_corpus):
    """tiny_config with its dataset built into gs://vrl/tfds and its tokenizer at gs://vrl/plays.model."""
    from etils import epath
    from vrl import corpus
    _, tokenizer = small_corpus
    built = corpus.prepare_from_glob(str(plays_dir), 'plays', 'gs://vrl/tfds', split_mode='blank_line',
                                     validation_fraction=0.1)
    assert built.startswith('gs://vrl/tfds/plays/') and _fs().exists(built.removeprefix('gs://') + '/dataset_info.json')
    epath.Path('gs://vrl/plays.model').write_bytes(Path(tokenizer.path).read_bytes())
    config = tiny_config(small_corpus, attention='svformer', steps=8, checkpoint_every=4, log_every=1,
                         lease_stale_seconds=3)
    return dataclasses.replace(config, data=dataclasses.replace(config.data, data_dir='gs://vrl/tfds',
                                                                  tokenizer='gs://vrl/plays.model'))


def _command(config, workdir: str) -> list[str]:
    return [sys.executable, '-m', 'vrl.main', f'--config={ROOT / "configs/tiny.py"}', f'--workdir={workdir}',
            *overrides(config)]


def _run(config, workdir: str, gcs_url: str, home: Path, **popen) -> subprocess.CompletedProcess:
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.run(_command(config, workdir), cwd=home, env=_env(gcs_url, home), capture_output=True,
                          text=True, timeout=600, **popen)


def _losses(workdir: str) -> dict[int, float]:
    """Per step, the last loss metrics.jsonl holds (a resumed run's record supersedes)."""
    records = [json.loads(line) for line in _fs().cat(workdir.removeprefix('gs://') + '/metrics.jsonl').decode().splitlines()]
    return {r['step']: r['loss'] for r in records if 'loss' in r}


def test_the_lookups_are_pinned_to_localhost(gcs):
    env = _env(gcs, Path('/tmp'))
    assert env['STORAGE_EMULATOR_HOST'].startswith('http://127.0.0.1:')
    assert env['TENSORSTORE_GCS_HTTP_URL'] == env['STORAGE_EMULATOR_HOST']
    for key in ('GCE_METADATA_HOST', 'GCE_METADATA_IP', 'GCE_METADATA_ROOT'):
        assert env[key].startswith('127.0.0.1:')


def test_a_run_lives_in_the_bucket_and_resumes_after_kill_9_on_fresh_machines(gcs, bucket_config, tmp_path):
    """Uninterrupted vs killed after a checkpoint and restarted with no local file kept: the same
    losses step by step, every step in the bucket's metrics.jsonl, both starts in config.json, no
    local folder named gs:."""
    whole = _run(bucket_config, 'gs://vrl/whole', gcs, tmp_path / 'host_a')
    assert whole.returncode == 0, whole.stderr[-3000:]
    fs = _fs()
    names = {p.rsplit('/', 1)[1] for p in fs.ls('vrl/whole')}
    assert {'checkpoints', 'metrics.jsonl', 'config.json', 'tensorboard'} <= names and '.lock' not in names
    assert fs.ls('vrl/whole/tensorboard') and {'4', '8'} <= {p.rsplit('/', 1)[1] for p in fs.ls('vrl/whole/checkpoints')}
    want = _losses('gs://vrl/whole')
    assert sorted(want) == list(range(1, 9))

    first = tmp_path / 'host_b'
    first.mkdir()
    proc = subprocess.Popen(_command(bucket_config, 'gs://vrl/killed'), cwd=first, env=_env(gcs, first),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not _fs().exists('vrl/killed/checkpoints/4/commit_success.txt'):  # GCS: Orbax's last object of a step
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    time.sleep(bucket_config.train.lease_stale_seconds)  # the killed holder's lease goes stale
    resumed = _run(bucket_config, 'gs://vrl/killed', gcs, tmp_path / 'host_c')  # a fresh machine
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'took over the lease of workdir gs://vrl/killed' in resumed.stdout + resumed.stderr
    assert "resumed at step" in resumed.stdout, resumed.stdout
    got = _losses('gs://vrl/killed')
    assert sorted(got) == list(range(1, 9))
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), (got, want)
    history = json.loads(_fs().cat('vrl/killed/config.json'))['history']
    assert len(history) == 2 and history[1]['step'] >= 4
    for folder in (tmp_path, ROOT):
        assert not list(folder.rglob('gs:')), f'a local gs: folder under {folder}'


def test_a_second_writer_is_refused_and_a_stale_lease_taken_over(gcs, bucket_config, tmp_path):
    fs = _fs()
    held = {'holder': 'host pod-w-0, pid 77, since 2026-11-25 10:00:00', 'token': 'x', 'renewed': time.time() + 60}
    fs.pipe_file('vrl/held/.lock', json.dumps(held).encode())
    config = dataclasses.replace(bucket_config, train=dataclasses.replace(bucket_config.train, steps=0,
                                                                        eval_batches=1))
    refused = _run(config, 'gs://vrl/held', gcs, tmp_path / 'host')
    assert refused.returncode != 0 and 'Traceback' not in refused.stderr
    assert ('workdir gs://vrl/held is in use by another run (host pod-w-0, pid 77, since 2026-11-25 10:00:00'
            in refused.stderr)
    assert {p.rsplit('/', 1)[1] for p in _fs().ls('vrl/held')} == {'.lock'}  # nothing written
    fs.pipe_file('vrl/held/.lock', json.dumps({**held, 'renewed': time.time() - 3600}).encode())
    taken = _run(config, 'gs://vrl/held', gcs, tmp_path / 'host2')
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert 'took over the lease of workdir gs://vrl/held from host pod-w-0, pid 77' in taken.stdout + taken.stderr
    assert not _fs().exists('vrl/held/.lock')  # released at the end


@pytest.mark.parametrize('where, emulator, message', [
    ('gs://no-such-bucket/run', None, 'bucket no-such-bucket does not exist'),
    ('gs://vrl/run', 'http://127.0.0.1:9', 'the object store cannot be reached'),
])
def test_a_bad_store_is_one_line_before_anything_runs(gcs, bucket_config, tmp_path, where, emulator, message):
    env = _env(emulator or gcs, tmp_path)
    config = dataclasses.replace(bucket_config, data=dataclasses.replace(bucket_config.data, data_dir=str(tmp_path)))
    out = subprocess.run(_command(config, where), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and 'Traceback' not in out.stderr, out.stderr[-3000:]
    assert f'error: cannot write to --workdir {where} (' in out.stderr and message in out.stderr, out.stderr[-3000:]
    assert 'params, mesh' not in out.stdout  # nothing was built or compiled


def test_storage_on_the_bucket_creates_once_moves_folders_and_lists(gcs):
    """What the workdir code asks of an object store: create-if-absent, whole-object replace, a
    folder moved (--fresh, rejected checkpoints), every file listed (datasets)."""
    from vrl import storage
    root = storage.path('gs://vrl/storage_check')
    assert storage.is_remote(root) and str(root) == 'gs://vrl/storage_check'
    assert storage.create_exclusive(root / 'lease', b'first')
    assert not storage.create_exclusive(root / 'lease', b'second')
    assert (root / 'lease').read_bytes() == b'first'
    storage.write_bytes(root / 'run/config.json', b'{"a": 1}')
    storage.write_bytes(root / 'run/checkpoints/4/state', b'x' * 1000)
    storage.move(root / 'run', root / 'previous_runs/then')
    assert list(storage.files(root)) == ['lease', 'previous_runs/then/checkpoints/4/state', 'previous_runs/then/config.json']
    assert not (root / 'run').exists()
    local = storage.path('relative/folder')
    assert not storage.is_remote(local) and str(local) == os.path.abspath('relative/folder')
