"""A run that lives on an object store: workdir, dataset and tokenizer on gs://, against a real GCS
emulator (fake-gcs-server) on 127.0.0.1. Every credential and metadata look-up is pinned to
127.0.0.1, so nothing here can reach a real cloud."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gcs_emulator import RefusingStore, bucket_fs, clients_through, machine_env
from tests.runs import ROOT, cli_args, host_xla_flags, tiny_config, write_choice_task

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


@pytest.fixture(scope='module')
def bucket_config(gcs, plays_dir, small_corpus):
    """tiny_config with its dataset built into gs://vrl/tfds and its tokenizer at gs://vrl/plays.model."""
    from etils import epath

    from vrl.data import build

    _, tokenizer = small_corpus
    built = build.prepare_from_glob(
        str(plays_dir), 'plays', 'gs://vrl/tfds', split_mode='blank_line', validation_fraction=0.1
    )
    assert built.startswith('gs://vrl/tfds/plays/') and bucket_fs().exists(
        built.removeprefix('gs://') + '/dataset_info.json'
    )
    epath.Path('gs://vrl/plays.model').write_bytes(Path(tokenizer.path).read_bytes())
    config = tiny_config(
        small_corpus, attention='svformer', steps=8, checkpoint_every=4, log_every=1, lease_stale_seconds=8
    )
    return dataclasses.replace(
        config, data=dataclasses.replace(config.data, data_dir='gs://vrl/tfds', tokenizer='gs://vrl/plays.model')
    )


def _run(
    config, workdir: str, gcs_url: str, home: Path, extra: tuple[str, ...] = (), **popen
) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_args(config, workdir) + list(extra),
        cwd=home,
        env=machine_env(gcs_url, home),
        capture_output=True,
        text=True,
        timeout=600,
        **popen,
    )


INET_ADDRESS = re.compile(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"')  # in strace's connect() lines


def test_a_bucket_run_connects_to_nothing_but_this_machine(gcs, bucket_config, tmp_path):
    """Every connect() of a run on a gs:// workdir and of the evaluation of its checkpoint, their
    Python clients (gcsfs, google-auth) and C++ ones (TensorStore under Orbax) alike, recorded by
    strace: each goes to 127.0.0.1 (or ::1) or a local socket, so no client reached for a real cloud
    (a DNS look-up of a cloud name would show as a connect to the resolver)."""
    config = dataclasses.replace(
        bucket_config, train=dataclasses.replace(bucket_config.train, steps=2, checkpoint_every=2)
    )
    home, trace = tmp_path / 'host', tmp_path / 'connect.trace'
    env = machine_env(gcs, home)
    tasks = write_choice_task(tmp_path / 'tasks')
    for args in (
        cli_args(config, 'gs://vrl/traced'),
        [
            sys.executable,
            '-m',
            'vrl.tools.evaluate',
            '--workdir=gs://vrl/traced',
            '--tasks=toy_choice',
            f'--include_path={tasks}',
            '--batch_size=4',
        ],
    ):
        out = subprocess.run(
            [
                'strace',
                '-f',
                '-qq',
                '--seccomp-bpf',
                '-e',
                'trace=connect',
                '-e',
                'signal=none',
                '-o',
                str(trace),
                *args,
            ],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        calls = [line for line in trace.read_text().splitlines() if 'connect(' in line]
        inet = [line for line in calls if 'AF_INET' in line]
        found = [INET_ADDRESS.search(line) for line in inet]
        assert len(inet) > 10, calls[:20]  # the emulator was reached, so the trace saw the clients
        assert all(found), [line for line, m in zip(inet, found) if not m]
        addresses = {m.group(1) or m.group(2) for m in found}
        assert addresses <= {'127.0.0.1', '::1', '::ffff:127.0.0.1'}, addresses


def test_the_emulator_stopped_by_its_pid_leaves_no_server_or_folder():
    from tests.gcs_emulator import free_port

    emulator = subprocess.Popen(
        [sys.executable, '-m', 'tests.gcs_emulator', f'--port={free_port()}'],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    serving = next(line for line in emulator.stdout if line.startswith('# serving'))  # after the exports
    root = serving.split(', objects in ', 1)[1].split(';', 1)[0]
    server = subprocess.run(['pgrep', '-P', str(emulator.pid)], capture_output=True, text=True).stdout.split()
    assert len(server) == 1 and Path(root).is_dir()
    emulator.terminate()
    assert emulator.wait(timeout=30) == 0
    assert not Path(f'/proc/{server[0]}').exists() and not Path(root).exists() and not Path(f'{root}.log').exists()


def test_a_second_writer_is_refused_and_a_stale_lease_taken_over(gcs, bucket_config, tmp_path):
    """A live holder (renewing) refuses a run before it writes anything; a dead one's lease is taken
    over once unchanged for train.lease_stale_seconds (said while waiting), or at once with
    --take_over_lease; a finished run leaves its lease released."""
    from vrl.core import storage
    from vrl.train.rundir import lease as lease_lib

    config = dataclasses.replace(bucket_config, train=dataclasses.replace(bucket_config.train, steps=0, eval_batches=1))
    live = lease_lib.Lease(storage.path('gs://vrl/held'), stale_after=config.train.lease_stale_seconds)
    live.holder = 'host pod-w-0, pid 77, since 2026-11-25 10:00:00'
    live.acquire()
    refused = _run(config, 'gs://vrl/held', gcs, tmp_path / 'host')
    assert refused.returncode != 0 and 'Traceback' not in refused.stderr
    assert (
        'workdir gs://vrl/held is in use by another run (host pod-w-0, pid 77, since 2026-11-25 10:00:00'
        in refused.stderr
    ), refused.stderr[-3000:]
    assert {p.rsplit('/', 1)[1] for p in bucket_fs().ls('vrl/held')} == {'.lock'}  # nothing written
    live._stop.set()  # the holder dies: its lease stays, unrenewed
    live._renewer.join()
    taken = _run(config, 'gs://vrl/held', gcs, tmp_path / 'host2')
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert 'is leased by host pod-w-0, pid 77, since 2026-11-25 10:00:00: taking it over in 8 s' in taken.stdout
    assert 'took over the lease of workdir gs://vrl/held from host pod-w-0, pid 77' in taken.stdout
    released = json.loads(bucket_fs().cat('vrl/held/.lock'))
    assert released['released'] and released['token'] != live.token

    fs = bucket_fs()
    fs.pipe_file('vrl/held/.lock', json.dumps({**released, 'released': False, 'holder': 'host gone'}).encode())
    a_day = dataclasses.replace(config, train=dataclasses.replace(config.train, lease_stale_seconds=86_400))
    forced = _run(a_day, 'gs://vrl/held', gcs, tmp_path / 'host3', extra=['--take_over_lease'])  # waiting: a day
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert 'took over the lease of workdir gs://vrl/held from host gone: --take_over_lease' in forced.stdout
    assert 'taking it over in' not in forced.stdout


def test_a_deleted_lease_does_not_make_the_run_start_over(gcs, bucket_config, tmp_path):
    """A run on the bucket to step 4, its .lock then deleted: the same command with more steps resumes
    at step 4 in epoch 2 (recovered from the step folders' markers) and leaves every object of epoch 1
    as it was; the metrics keep epoch 1's steps before epoch 2's."""
    from vrl.core import storage
    from vrl.train.trackers import stored

    short = dataclasses.replace(bucket_config, train=dataclasses.replace(bucket_config.train, steps=4))
    first = _run(short, 'gs://vrl/unleased', gcs, tmp_path / 'host')
    assert first.returncode == 0, first.stderr[-3000:]
    before = _objects('vrl/unleased/')
    assert 'vrl/unleased/checkpoints/4.e1/commit_success.txt' in before
    bucket_fs().rm('vrl/unleased/.lock')
    again = _run(bucket_config, 'gs://vrl/unleased', gcs, tmp_path / 'host2')
    assert again.returncode == 0, again.stderr[-3000:]
    assert 'resumed at step 4' in again.stdout and 'fresh start' not in again.stdout, again.stdout
    assert 'the lease gs://vrl/unleased/.lock was missing, but the workdir holds objects of lease epochs up to 1' in (
        again.stdout
    )
    after = _objects('vrl/unleased/')
    restarted = {'vrl/unleased/.lock', 'vrl/unleased/config.json'}  # every start records itself in config.json
    assert {k: v for k, v in after.items() if k in before and k not in restarted} == {
        k: v for k, v in before.items() if k not in restarted
    }
    assert 'vrl/unleased/checkpoints/8.e2/commit_success.txt' in after
    assert [r['step'] for r in stored.read_metrics(storage.path('gs://vrl/unleased')) if 'loss' in r] == list(
        range(1, 9)
    )


def _objects(prefix: str) -> dict[str, int]:
    """Every object under `prefix` and its generation (which any rewrite changes)."""
    return {name: int(info['generation']) for name, info in bucket_fs().find(prefix, detail=True).items()}


@pytest.mark.parametrize(
    'held_at', [r'checkpoints(%2F|/)8\.e1', r'metrics\.e1\.jsonl/compose'], ids=['mid-save', 'mid-flush']
)
def test_a_holder_held_mid_write_never_changes_what_its_successor_committed(gcs, bucket_config, tmp_path, held_at):
    """A run whose traffic is held (by a proxy, from its first request to `held_at`: saving step 8, or
    appending to its metrics) is taken over by a second run, which resumes and finishes; then the held
    writes land. The first run stops in one line; every object of the second run keeps its generation;
    what the first adds lies in its own epoch's names (and its TensorBoard file); and what readers see
    (the committed steps and the metrics) is what they saw before the release."""
    from tests.slow_store import Fault, SlowStore
    from vrl.core import storage
    from vrl.train.rundir import checkpoint
    from vrl.train.trackers import stored

    config = dataclasses.replace(
        bucket_config,
        train=dataclasses.replace(bucket_config.train, steps=12, checkpoint_every=4, eval_every=0, diagnostics_every=0),
    )
    workdir = f'gs://vrl/held_{held_at[:7]}'
    with SlowStore(gcs, latency_s=0.001, faults=(Fault(held_at, 'hold'),)) as store:
        env = {**machine_env(store.url, tmp_path / 'first'), 'VRL_STORE_TIMEOUT_S': '600'}  # held, not timed out
        first = subprocess.Popen(
            cli_args(config, workdir), cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        deadline = time.time() + 300
        while not store.held.wait(0.2):
            assert first.poll() is None and time.time() < deadline, first.communicate()
        at_hold = _objects(workdir[5:])
        second = _run(config, workdir, gcs, tmp_path / 'second', ('--take_over_lease',))
        assert second.returncode == 0, second.stderr[-3000:]
        assert 'took over the lease of workdir' in second.stdout  # (held mid-save: resumed at step 4)
        assert ('resumed at step 4' in second.stdout) == (held_at.startswith('checkpoints')), second.stdout
        assert f'checkpoint in {workdir}/checkpoints/12.e2' in second.stdout
        after_second = _objects(workdir[5:])
        path = storage.path(workdir)
        seen = (checkpoint.readable_steps(path / 'checkpoints'), stored.read_metrics(path))
        assert max(seen[0]) == 12 and [r['step'] for r in seen[1] if 'loss' in r][-1] == 12
        store.release()
        out, err = first.communicate(timeout=300)
    assert first.returncode != 0 and 'Traceback' not in err, err[-3000:]
    assert re.search(r'error: the lease of workdir gs://vrl/held_\S+ was taken over by host ', err), err[-3000:]
    after_first = _objects(workdir[5:])
    seconds = {name: generation for name, generation in after_second.items() if at_hold.get(name) != generation}
    assert {name: after_first.get(name) for name in seconds} == seconds
    changed = {name for name, generation in after_first.items() if after_second.get(name) != generation}
    assert all('.e1' in name or name in at_hold and '/tensorboard/' in name for name in changed), changed
    assert not [name for name in after_first if name.endswith('.part') and not name.rsplit('/', 1)[1].startswith('.')]
    assert (checkpoint.readable_steps(path / 'checkpoints'), stored.read_metrics(path)) == seen


def test_a_checkpoint_held_at_the_store_is_waited_for_out_loud_with_its_time(gcs, small_corpus, tmp_path):
    """The last save's traffic held at the proxy (from its first request) until the run has said what
    it waits on (starting the save, or writing it, whichever part the hold caught): once released, it
    says how long that took and ends as usual (docs/training.md: a wait of over 2 s on a checkpoint is
    said, with its time)."""
    import threading

    from tests.slow_store import Fault, SlowStore

    config = tiny_config(small_corpus, attention='svformer', steps=4, checkpoint_every=4, lease_stale_seconds=600)
    waits = {
        'starting the save of step 4 in gs://vrl/waited ...': 'the save of step 4 started in',
        'writing the checkpoint of step 4 to gs://vrl/waited ...': 'checkpoint of step 4 written in',
    }
    with SlowStore(gcs, latency_s=0.001, faults=(Fault(r'checkpoints(%2F|/)4\.e1', 'hold'),)) as store:
        env = {**machine_env(store.url, tmp_path / 'host'), 'VRL_STORE_TIMEOUT_S': '600'}
        run = subprocess.Popen(
            cli_args(config, 'gs://vrl/waited'),
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=(tmp_path / 'stderr').open('w'),
        )
        lines: list[str] = []
        waiting = threading.Event()

        def read() -> None:
            for line in run.stdout:
                lines.append(line.rstrip('\n'))
                waiting.set() if lines[-1] in waits else None

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        said = waiting.wait(120)
        held_s = 3
        time.sleep(held_s if said else 0)
        store.release()
        run.wait(timeout=300)
        reader.join(10)
    err = (tmp_path / 'stderr').read_text()
    assert said and store.held.is_set(), '\n'.join(lines) + err[-3000:]
    assert run.returncode == 0, err[-3000:]
    doing = next(i for i, line in enumerate(lines) if line in waits)
    done = next(i for i, line in enumerate(lines) if line.startswith(waits[lines[doing]]))
    assert doing < done < next(i for i, line in enumerate(lines) if line.startswith('done at step 4')), lines
    assert int(re.fullmatch(r'.* in (\d+) s', lines[done]).group(1)) >= held_s, lines


def test_checkpoints_without_their_commit_marker_are_refused_and_partial_steps_cleaned(gcs, bucket_config, tmp_path):
    """A local run copied up to the bucket without its steps' commit_success.txt is refused in one
    line, not trained over from step 0 (its flock file, copied too, is no lease and holds nothing up); with the
    markers added it resumes, and the folder of a save that
    never finished (no marker, no commit in its metadata) is ignored and then removed."""
    from vrl.core import storage
    from vrl.train.rundir import checkpoint

    config = dataclasses.replace(bucket_config, train=dataclasses.replace(bucket_config.train, steps=4))
    local = _run(config, str(tmp_path / 'local_run'), gcs, tmp_path / 'host')
    assert local.returncode == 0, local.stderr[-3000:]
    storage.copy_tree(storage.path(str(tmp_path / 'local_run')), storage.path('gs://vrl/copied'))  # its .lock too
    bucket_fs().rm_file('vrl/copied/checkpoints/4/commit_success.txt')  # as a copy made without it
    before = {name: generation for name, generation in _objects('vrl/copied').items() if not name.endswith('/.lock')}
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=8))
    refused = _run(longer, 'gs://vrl/copied', gcs, tmp_path / 'host')
    assert refused.returncode != 0 and 'Traceback' not in refused.stderr, refused.stderr[-3000:]
    assert (
        'gs://vrl/copied/checkpoints holds steps [4] that Orbax finished but that lack commit_success.txt'
        in refused.stderr
    ), refused.stderr[-3000:]
    assert {k: v for k, v in _objects('vrl/copied').items() if not k.endswith('/.lock')} == before

    fs = bucket_fs()
    fs.pipe_file('vrl/copied/checkpoints/4/commit_success.txt', b'')
    for name in fs.find('vrl/copied/checkpoints/4/state'):  # a save of step 6 that died half way
        fs.pipe_file(name.replace('/checkpoints/4/', '/checkpoints/6/'), fs.cat(name))
    resumed = _run(longer, 'gs://vrl/copied', gcs, tmp_path / 'host')
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'resumed at step 4' in resumed.stdout
    after = bucket_fs()
    assert not after.exists('vrl/copied/checkpoints/6') and checkpoint.latest_step('gs://vrl/copied') == 8
    assert re.fullmatch(r'8\.e\d+', checkpoint.readable_steps(storage.path('gs://vrl/copied/checkpoints'))[8].path.name)


def test_every_command_reads_and_writes_runs_in_the_bucket(gcs, bucket_config, tmp_path):
    """The tools on gs://: a run's workdir read by vrl.tools.export (--out on gs://), vrl.experiments.analyze (--out on
    gs://), vrl.tools.generate (--prompts_file on gs://) and vrl.tools.evaluate (its lm_eval/ in the workdir);
    runs started from a gs:// checkpoint and from an hf:gs:// export; a grid directory's lease and
    reports; dataset statistics from a gs:// data_dir."""
    from tests.runs import write_choice_task
    from vrl.core import storage
    from vrl.data import pipeline
    from vrl.data.tokenizer import Tokenizer
    from vrl.experiments import grid
    from vrl.tools import evaluate
    from vrl.train import loop

    config = dataclasses.replace(bucket_config, train=dataclasses.replace(bucket_config.train, steps=4))
    source = loop.run(config, 'gs://vrl/tools/run')
    env = machine_env(gcs, tmp_path / 'host')

    def command(module: str, *flags: str) -> str:
        out = subprocess.run(
            [sys.executable, '-m', module, *flags],
            cwd=tmp_path / 'host',
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    command('vrl.tools.export', '--workdir=gs://vrl/tools/run', '--out=gs://vrl/tools/hf')
    exported = {p.rsplit('/', 1)[1] for p in bucket_fs().ls('vrl/tools/hf')}
    assert {'config.json', 'model.safetensors', 'tokenizer.model', 'vrl_export.json', 'README.md'} <= exported
    assert json.loads(bucket_fs().cat('vrl/tools/hf/vrl_export.json'))['workdir'] == 'gs://vrl/tools/run'
    command(
        'vrl.experiments.analyze',
        '--workdir=gs://vrl/tools/run',
        '--out=gs://vrl/tools/analysis',
        '--sequences=2',
        '--batch_size=2',
    )
    assert bucket_fs().exists('vrl/tools/analysis/run/analysis.json') and bucket_fs().glob('vrl/tools/analysis/*.png')
    bucket_fs().pipe_file('vrl/tools/prompts.txt', b'KING:\nHAMLET:\n')
    generated = command(
        'vrl.tools.generate',
        '--workdir=gs://vrl/tools/run',
        '--prompts_file=gs://vrl/tools/prompts.txt',
        '--max_new_tokens=4',
    )
    assert 'KING:' in generated and 'HAMLET:' in generated

    outputs = evaluate.evaluate(
        'gs://vrl/tools/run', ['toy_choice'], include_path=str(write_choice_task(tmp_path / 'tasks')), batch_size=4
    )
    assert all(str(f).startswith('gs://vrl/tools/run/lm_eval/') for f in outputs.files)
    assert json.loads(bucket_fs().cat(str(outputs.files[0]).removeprefix('gs://')))['vrl']['step'] == 4

    short = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2, checkpoint_every=2))
    for start, workdir in (
        ('gs://vrl/tools/run', 'gs://vrl/tools/from_run'),
        ('hf:gs://vrl/tools/hf', 'gs://vrl/tools/from_hf'),
    ):
        first = loop.run(short, workdir, init_from=start)
        assert first.step == 2 and first.losses[1] < source.losses[1], (
            start,
            first.losses,
            source.losses,
        )  # trained weights

    directory = grid.GridDirectory(storage.path('gs://vrl/tools/grid'), 'compare.json', 'comparison')
    directory.open(config)
    assert not json.loads(bucket_fs().cat('vrl/tools/grid/.lock'))['released']  # the grid's lease
    directory.write_text('report.md', '# report')
    directory.close()
    assert bucket_fs().cat('vrl/tools/grid/report.md') == b'# report'
    assert json.loads(bucket_fs().cat('vrl/tools/grid/.lock'))['released']

    stats = pipeline.split_stats('plays', 'gs://vrl/tfds', Tokenizer.load('gs://vrl/plays.model'))
    assert stats['train']['documents'] > 100 and stats['validation']['tokens'] > 0
    assert not list(tmp_path.rglob('gs:')) and not list(ROOT.rglob('gs:'))


@pytest.mark.parametrize(
    'where, store, message',
    [
        ('gs://no-such-bucket/run', 'emulator', 'bucket no-such-bucket does not exist'),
        ('gs://vrl/run', 'closed', 'the object store cannot be reached'),
        ('gs://vrl/run', 401, 'no credentials for the object store'),
        ('gs://vrl/run', 403, 'permission denied on bucket vrl'),
    ],
)
def test_a_bad_store_is_one_line_before_anything_runs(gcs, bucket_config, tmp_path, where, store, message):
    refusing = RefusingStore(store) if isinstance(store, int) else None
    url = {'emulator': gcs, 'closed': 'http://127.0.0.1:9'}.get(store) or refusing.url
    config = dataclasses.replace(bucket_config, data=dataclasses.replace(bucket_config.data, data_dir=str(tmp_path)))
    try:
        out = subprocess.run(
            cli_args(config, where),
            cwd=tmp_path,
            env=machine_env(url, tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        if refusing:
            refusing.stop()
    assert out.returncode != 0 and 'Traceback' not in out.stderr, out.stderr[-3000:]
    assert f'error: cannot write to --workdir {where} (' in out.stderr and message in out.stderr, out.stderr[-3000:]
    assert 'params, mesh' not in out.stdout  # nothing was built or compiled


@pytest.mark.parametrize(
    'field, value, message',
    [
        (
            'data_dir',
            'gs://no-such-bucket/tfds',
            'cannot read data_dir gs://no-such-bucket/tfds (bucket no-such-bucket does not exist',
        ),
        (
            'tokenizer',
            'gs://no-such-bucket/plays.model',
            'cannot read data.tokenizer gs://no-such-bucket/plays.model (bucket no-such-bucket does not exist',
        ),
        (
            'tokenizer',
            'gs://vrl/none.model',
            "tokenizer 'gs://vrl/none.model' (data.tokenizer) does not exist. Train one with",
        ),
    ],
)
def test_data_on_a_missing_bucket_is_one_line(gcs, bucket_config, tmp_path, field, value, message):
    """What a run's first data step (process 0's, vrl/core/multihost.py) says; vrl.main prints it as `error: ...`."""
    from vrl.core.errors import VrlError
    from vrl.data import pipeline

    config = dataclasses.replace(bucket_config.data, **{field: value})
    with pytest.raises(VrlError) as raised:
        pipeline.tokenizer_for_run(config, bucket_config.model.vocab_size)
    assert str(raised.value).startswith(message) and '\n' not in str(raised.value), raised.value
    assert not list(tmp_path.rglob('gs:')) and not list(ROOT.rglob('gs:'))


def test_storage_on_the_bucket_creates_once_moves_folders_and_lists(gcs):
    """What the workdir code asks of an object store: create-if-absent, whole-object replace, a
    folder moved (--fresh, rejected checkpoints), every file listed (datasets)."""
    from vrl.core import storage

    root = storage.path('gs://vrl/storage_check')
    assert storage.is_remote(root) and str(root) == 'gs://vrl/storage_check'
    assert storage.create_exclusive(root / 'lease', b'first')
    assert not storage.create_exclusive(root / 'lease', b'second')
    assert (root / 'lease').read_bytes() == b'first'
    storage.write_bytes(root / 'run/config.json', b'{"a": 1}')
    storage.write_bytes(root / 'run/checkpoints/4/state', b'x' * 1000)
    storage.move(root / 'run', root / 'previous_runs/then')
    assert list(storage.files(root)) == [
        'lease',
        'previous_runs/then/checkpoints/4/state',
        'previous_runs/then/config.json',
    ]
    assert not (root / 'run').exists()
    local = storage.path('relative/folder')
    assert not storage.is_remote(local) and str(local) == os.path.abspath('relative/folder')
    # a scratch copy follows the object's version, not its size: replaced by as many other bytes, it is read anew
    storage.write_bytes(root / 'model/weights', b'a' * 100)
    assert (storage.local_copy(root / 'model') / 'weights').read_bytes() == b'a' * 100
    storage.write_bytes(root / 'model/weights', b'b' * 100)
    assert (storage.local_copy(root / 'model') / 'weights').read_bytes() == b'b' * 100


def test_a_failing_request_is_tried_six_times_1_to_32_s_apart_each_retry_said(gcs, monkeypatch, caplog):
    """docs/scaling-out.md's promise, on gcsfs's own clock (its backoff waits recorded, not slept):
    a download (one request) answered 503 five times succeeds on its sixth try, one answered 503 six times fails after
    the sixth; the waits between tries double from 1 s, and each retry is one warning line."""
    import types

    import gcsfs.retry

    from tests.slow_store import Fault, SlowStore
    from vrl.core import storage

    storage.path('gs://vrl/tried')  # vrl's client settings, as a run makes them before its first request
    waits: list[float] = []

    async def wait(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(gcsfs.retry, 'asyncio', types.SimpleNamespace(sleep=wait))
    fs = bucket_fs()
    fs.pipe_file('vrl/tried/five', b'answered')
    fs.pipe_file('vrl/tried/six', b'never read')
    five, six = Fault(r'tried(%2F|/)five', '503', 5), Fault(r'tried(%2F|/)six', '503', 6)
    with SlowStore(gcs, latency_s=0.0, faults=(five, six)) as store, clients_through(store.url):
        through = bucket_fs()
        assert through.cat_file('vrl/tried/five') == b'answered'
        assert (five.injected, len(waits)) == (5, 5)
        with pytest.raises(Exception, match='503|injected'):
            through.cat_file('vrl/tried/six')
        assert six.injected == 6
    assert len(waits) == 10 and [int(w) for w in waits] == [1, 2, 4, 8, 16] * 2, waits  # 1-32 s: 2**k + [0, 1)
    said = [r.getMessage() for r in caplog.records if r.name == 'gcsfs' and r.levelno == logging.WARNING]
    assert len(said) == 10 and all(
        line.startswith('a request to the object store failed (') and line.endswith('; retrying') for line in said
    ), said


def test_compressed_records_in_the_bucket_are_prepared_and_pretokenized_there(gcs):
    """A glob of .jsonl.zst / .jsonl objects prepared into a gs:// data_dir, a tokenizer.json trained
    into the bucket, the dataset pre-tokenized there (tokens.json last) and found by the pipeline."""
    import zstandard

    from vrl.data import build, corpus, tokens
    from vrl.data.tokenizer import train

    fs = bucket_fs()
    lines = ''.join(json.dumps({'text': f'record {i} ' * 20}) + '\n' for i in range(50)).encode()
    fs.pipe_file('vrl/raw/a.jsonl.zst', zstandard.ZstdCompressor().compress(lines))
    fs.pipe_file('vrl/raw/b.jsonl', lines)
    built = build.prepare_from_glob('gs://vrl/raw/*', 'raw', 'gs://vrl/rawtfds', validation_fraction=0.1)
    assert built == 'gs://vrl/rawtfds/raw/1.0.0'
    sizes = [len(corpus.open_split('raw', 'gs://vrl/rawtfds', split)) for split in ('train', 'validation')]
    assert sum(sizes) == 100 and min(sizes) > 0, sizes  # each record held out with chance 0.1
    tok = train(corpus.texts(corpus.open_split('raw', 'gs://vrl/rawtfds', 'train')), 300, 'gs://vrl/raw.json')
    folder = tokens.tokenize('raw', 'gs://vrl/rawtfds', tok, workers=1)
    assert str(folder).startswith('gs://vrl/rawtfds/raw/1.0.0/vrl_tokens/') and fs.exists(
        f'{str(folder)[5:]}/tokens.json'
    )
    source = tokens.find('raw', 'gs://vrl/rawtfds', 'validation', tok)
    texts = list(corpus.texts(corpus.open_split('raw', 'gs://vrl/rawtfds', 'validation')))
    assert [source[i].tolist() for i in range(len(source))] == [tok.encode(t).tolist() for t in texts]


def test_pretokenized_shards_are_read_in_place_through_a_slow_store(gcs, small_corpus, tmp_path, monkeypatch):
    """A dataset pre-tokenized in the bucket, read through a proxy adding 20 ms a request and a
    bandwidth cap, with its offsets held in memory and read by range: every process's batches (in
    windows of whole blocks, with document masking) equal those read from
    the same files on local disk, the iterator's position carries over between the two, nothing the
    training reads is copied into local scratch, and the bytes fetched are those of the batches read;
    a second evaluation reads nothing (its batches are kept)."""
    import itertools
    import shutil
    import tempfile

    import gcsfs

    from tests.slow_store import SlowStore
    from vrl.core import storage
    from vrl.data import pipeline, shards, tokens

    cfg, tokenizer = small_corpus
    local_dir = tmp_path / 'tfds'
    shutil.copytree(Path(cfg.data_dir) / 'plays', local_dir / 'plays')
    made = tokens.tokenize('plays', str(local_dir), tokenizer, workers=1)
    storage.copy_tree(storage.path(str(local_dir)), storage.path('gs://vrl/inplace'))
    token_bytes = sum(f.stat().st_size for f in Path(made).glob('*.tokens'))
    local = dataclasses.replace(
        cfg,
        data_dir=str(local_dir),
        document_masking=True,
        num_epochs=0,
        seq_len=128,
        batch_size=4,
        read_threads=2,
        shuffle='windows',
        block_tokens=1000,
        window_blocks=4,
    )
    remote = dataclasses.replace(local, data_dir='gs://vrl/inplace')
    with SlowStore(gcs, latency_s=0.02, bandwidth=20e6) as slow:
        monkeypatch.setenv('STORAGE_EMULATOR_HOST', slow.url)
        gcsfs.GCSFileSystem.clear_instance_cache()
        try:
            for index in range(2):  # process 1 reads each block's offsets by range, process 0 a shard's at once
                monkeypatch.setattr(shards, 'OFFSETS_HELD_BYTES', 0 if index else 256 << 20)
                in_place = iter(pipeline.train_dataset(remote, tokenizer, index, 2))
                from_disk = iter(pipeline.train_dataset(local, tokenizer, index, 2))
                for a, b in zip(itertools.islice(in_place, 6), itertools.islice(from_disk, 6)):
                    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
                resumed = iter(pipeline.train_dataset(local, tokenizer, index, 2))
                resumed.set_state(json.loads(json.dumps(in_place.get_state())))
                for a, b in zip(itertools.islice(in_place, 3), itertools.islice(resumed, 3)):
                    assert all((a[k] == b[k]).all() for k in a)
            served = slow.bytes_served
            sets = pipeline.EvalSets(remote, tokenizer)  # a run's evaluations: the first reads, the rest are kept
            first = list(sets.batches(2))
            opened = len(slow.request_lines)
            again = list(sets.batches(2))
            assert all((a[k] == b[k]).all() for a, b in zip(first, again) for k in a)
            # the training iterators' read-ahead threads may still fetch; evaluation itself asks nothing
            assert [line for line in slow.request_lines[opened:] if 'train-' not in line] == []
        finally:
            gcsfs.GCSFileSystem.clear_instance_cache()
        # two processes' iterators, each with its next window read ahead: a copy would be twice the
        # tokens, four times this bound
        assert slow.requests > 20 and served < token_bytes / 2
    # training copied nothing down; evaluation, which counts each token's bytes in the text, its split's text
    scratch = Path(tempfile.gettempdir()) / 'vrl-scratch' / 'gs' / 'vrl' / 'inplace'
    copied = [p.name for p in scratch.rglob('*') if p.is_file()]
    assert any('validation' in name for name in copied)
    assert not [name for name in copied if 'train' in name or name.endswith('.tokens')], copied


def test_a_run_on_a_pretokenized_bucket_copies_no_text_to_its_host(gcs, bucket_config, small_corpus, tmp_path):
    """A run on a dataset pre-tokenized in the bucket, on a fresh machine (its own HOME and TMPDIR):
    after its steps, nothing of the train split's text or tokens is on the host, and what was copied
    besides the validation split's text (which exact bits per byte counts) is under 2% of the token
    bytes it trained on. It reads in windows ('auto' on a store), and says so."""
    import shutil

    from vrl.core import storage
    from vrl.data import tokens

    cfg, tokenizer = small_corpus
    local_dir = tmp_path / 'tfds'
    shutil.copytree(Path(cfg.data_dir) / 'plays', local_dir / 'plays')
    made = Path(tokens.tokenize('plays', str(local_dir), tokenizer, workers=1))
    storage.copy_tree(storage.path(str(local_dir)), storage.path('gs://vrl/pretokenized'))
    token_bytes = sum(f.stat().st_size for f in made.glob('*.tokens'))
    text_bytes = sum(f.stat().st_size for f in (local_dir / 'plays').rglob('*train.array_record*'))
    config = dataclasses.replace(
        bucket_config,
        data=dataclasses.replace(bucket_config.data, data_dir='gs://vrl/pretokenized'),
        train=dataclasses.replace(bucket_config.train, steps=6, checkpoint_every=6),
    )
    home = tmp_path / 'host'
    out = _run(config, 'gs://vrl/pretokenized_run', gcs, home, ('--config.data.block_tokens=2000',))
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(
        r'data plays: [\d,]+ train tokens \(counted, pre-tokenized, shuffled in windows of 64 blocks of '
        r'~[\d,]+ tokens\)',
        out.stdout,
    ), out.stdout
    on_host = {p: p.stat().st_size for p in home.rglob('*') if p.is_file()}
    assert not [p for p in on_host if 'train' in p.name and ('array_record' in p.name or p.suffix == '.tokens')], (
        on_host
    )
    assert not [p for p in on_host if p.suffix == '.tokens']
    # the validation split's text, which evaluation reads by design, aside: metadata alone
    metadata = sum(size for p, size in on_host.items() if '-validation.array_record' not in p.name)
    assert text_bytes > 0.5 * token_bytes and metadata < 0.02 * token_bytes, sorted(on_host.items())


def _broken_at(
    args: list[str], env: dict[str, str], cwd: Path, at: str, fault, timeout_s: float
) -> tuple[subprocess.Popen, list[str], float]:
    """Runs `args` until it prints a line starting with `at`, then calls `fault()`; returns the ended
    process, its lines (stdout and stderr) and the seconds it took to end after the fault. A run that
    does not end within `timeout_s` of the fault fails the test with its last lines."""
    import threading

    run = subprocess.Popen(args, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, reached = [], threading.Event()

    def read() -> None:
        for line in run.stdout:
            lines.append(line.rstrip('\n'))
            if line.startswith(at):
                reached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert reached.wait(300), lines
        fault()
        broken = time.monotonic()
        try:
            run.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f'the run did not end in {timeout_s:g} s:\n' + '\n'.join(lines[-30:]))
        ended = time.monotonic() - broken
        reader.join(10)
    finally:
        run.kill()
    return run, lines, ended


def test_a_store_that_stops_answering_ends_the_run_within_three_timeouts_in_one_line(gcs, bucket_config, tmp_path):
    """Every byte to and from the bucket held, mid-run: the run ends within ~3 VRL_STORE_TIMEOUT_S
    (the lease's renewals, each given up after one timeout, fail for two), with one line naming
    the operation, the object and the cause, and no traceback."""

    from tests.slow_store import SlowStore

    config = dataclasses.replace(
        bucket_config,
        train=dataclasses.replace(
            bucket_config.train, steps=100_000, checkpoint_every=100_000, log_every=1, eval_every=100_000
        ),
    )
    timeout_s = 3
    with SlowStore(gcs, latency_s=0.001) as store:
        env = {**machine_env(store.url, tmp_path / 'host'), 'VRL_STORE_TIMEOUT_S': str(timeout_s)}
        run, lines, ended = _broken_at(
            cli_args(config, 'gs://vrl/held_store'), env, tmp_path, 'step 3/', store.hold, 120
        )
        store.release()
    after = lines[next(i for i, line in enumerate(lines) if line.startswith('step 3/')) + 1 :]
    errors = [line for line in after if line.startswith('error')]
    assert run.returncode == 1 and len(errors) == 1, lines[-30:]
    assert re.fullmatch(
        r'error: the object store stopped answering: renewing the lease gs://vrl/held_store/\.lock '
        r'failed for \d+ s \(TimeoutError: no answer in 3 s; VRL_STORE_TIMEOUT_S=3\)\. This run stops '
        r'here, its last checkpoint intact: run the same command once the store answers\.',
        errors[0],
    ), errors
    assert not [line for line in after if 'Traceback' in line], after
    assert ended < 3 * timeout_s + 5, ended


def _on_a_vm(gcs: str, home: Path, metadata, gcsfs_token: str) -> dict[str, str]:
    """A machine whose credentials come from `metadata` (a MetadataServer): TensorStore's always,
    gcsfs's where `gcsfs_token` is 'google_default' (google-auth's look-up) rather than 'anon'."""
    env = {
        **machine_env(gcs, home),
        **metadata.environment(),
        'FSSPEC_GCS_TOKEN': gcsfs_token,
        'VRL_STORE_TIMEOUT_S': '2',
    }
    env.pop('NO_GCE_CHECK')  # google-auth asks the metadata server only without it
    return env


@pytest.mark.parametrize('client', ['gcsfs', 'tensorstore'])
def test_a_token_endpoint_that_never_answers_refuses_the_start_in_one_line(gcs, bucket_config, tmp_path, client):
    """A Cloud VM whose metadata server holds every token request: the run refuses its gs:// workdir
    within 3 VRL_STORE_TIMEOUT_S of asking, in one line naming the workdir and where credentials
    come from, and writes nothing. gcsfs's own retries took 214 s at VRL_STORE_TIMEOUT_S=5;
    TensorStore's (the checkpoints' writer, which fetches its own token) held the first save ~15
    minutes."""
    from tests.gcs_emulator import MetadataServer

    metadata = MetadataServer()
    metadata.hold_tokens()
    workdir = f'gs://vrl/no_token_{client}'
    env = _on_a_vm(gcs, tmp_path / 'host', metadata, 'google_default' if client == 'gcsfs' else 'anon')
    try:
        run = subprocess.run(
            cli_args(bucket_config, workdir), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        metadata.stop()
    lines = (run.stdout + run.stderr).splitlines()
    errors = [line for line in lines if line.startswith('error')]
    assert run.returncode != 0 and len(errors) == 1, lines[-20:]
    if client == 'gcsfs':
        expected = (
            rf'error: cannot write to --workdir {workdir} \(no answer in 6 s from the object store or from the '
            r'token endpoint of its credentials: .*GOOGLE_APPLICATION_CREDENTIALS.*metadata server.*\)'
        )
    else:
        expected = (
            rf'error: cannot write checkpoints to --workdir {workdir}: TensorStore, the checkpoints\' array '
            r'writer, failed \(no answer in 6 s\)\. It reads its credentials from GOOGLE_APPLICATION_CREDENTIALS.*'
        )
    assert re.fullmatch(expected, errors[0]), errors
    assert metadata.token_requests >= 1 and not [line for line in lines if 'Traceback' in line], lines[-20:]
    assert not bucket_fs().exists(workdir.removeprefix('gs://'))


def test_a_token_endpoint_that_stops_answering_mid_run_ends_the_save_in_one_line(gcs, bucket_config, tmp_path):
    """TensorStore's token requests held from step 1 on: the first save (step 4) gives up after its 6
    tries (each ended after VRL_STORE_TIMEOUT_S=2 s without a byte) and the run ends in one line
    naming the step and the workdir, instead of after TensorStore's own 32 tries up to 32 s apart
    (~15 minutes)."""

    from tests.gcs_emulator import MetadataServer

    metadata = MetadataServer()
    env = _on_a_vm(gcs, tmp_path / 'host', metadata, 'anon')
    try:
        args = cli_args(bucket_config, 'gs://vrl/token_lost')
        run, lines, ended = _broken_at(args, env, tmp_path, 'step 1/', metadata.hold_tokens, 200)
    finally:
        metadata.stop()
    errors = [line for line in lines if line.startswith('error')]
    assert run.returncode == 1 and len(errors) == 1, lines[-30:]
    assert errors[0].startswith('error: saving a checkpoint in gs://vrl/token_lost/checkpoints failed'), errors
    assert 'token_lost/checkpoints/4.e1/' in errors[0] and 'All 6 retry attempts failed' in errors[0], errors
    assert not [line for line in lines if 'Traceback' in line], lines[-30:]
    assert ended < 120, ended


def test_two_hosts_tokenize_into_the_bucket_what_one_machine_makes(gcs, bucket_config, small_corpus, tmp_path):
    """`python -m vrl.data tokenize` on two hosts joined by jax.distributed, sharing nothing but the
    bucket: each writes its share of the shards straight into it, and the folder equals what one
    process makes on local disk, shard for shard (tokens.json names the tokenizer's path as given)."""
    import shutil

    from tests.gcs_emulator import free_port
    from vrl.data import tokens

    cfg, tokenizer = small_corpus
    local_dir = tmp_path / 'tfds'
    shutil.copytree(Path(cfg.data_dir) / 'plays', local_dir / 'plays')
    reference = Path(tokens.tokenize('plays', str(local_dir), tokenizer, workers=1))
    port = free_port()
    hosts = [tmp_path / f'host{i}' for i in range(2)]
    pod = [
        subprocess.Popen(
            [
                sys.executable,
                '-m',
                'vrl.data',
                'tokenize',
                '--name=plays',
                '--data_dir=gs://vrl/tfds',
                '--tokenizer=gs://vrl/plays.model',
                '--workers=1',
                f'--coordinator_address=127.0.0.1:{port}',
                '--num_processes=2',
                f'--process_id={i}',
                '--verbosity=0',
            ],
            cwd=host,
            env={**machine_env(gcs, host), 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': host_xla_flags(1)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, host in enumerate(hosts)
    ]
    outputs = [(p.wait(timeout=300), p.stdout.read()) for p in pod]
    assert all(code == 0 for code, _ in outputs), outputs
    shares = [re.search(r'(\d+) of (\d+) shards to write here', text).groups() for _, text in outputs]
    assert (
        int(shares[0][0]) + int(shares[1][0]) == int(shares[0][1]) and abs(int(shares[0][0]) - int(shares[1][0])) <= 1
    )
    written = f'vrl/tfds/plays/1.0.0/vrl_tokens/{tokenizer.fingerprint}'
    fs = bucket_fs()
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(f.rsplit('/', 1)[1] for f in fs.find(written)) == names and len(names) > 30
    for name in names:
        got, want = fs.cat(f'{written}/{name}'), (reference / name).read_bytes()
        if name == tokens.MARKER:
            got, want = json.loads(got), json.loads(want)
            assert got.pop('tokenizer') == 'gs://vrl/plays.model' and want.pop('tokenizer') == tokenizer.path
        assert got == want, name


def _raw_files(count: int, documents: int) -> dict[str, bytes]:
    """JSON lines files of web-page-like records, one of them compressed, the last with an empty record."""
    import zstandard

    files = {}
    for f in range(count):
        lines = ''.join(
            json.dumps({'text': f'file {f} record {i}: ' + 'words of a page ' * (1 + i % 7)}) + '\n'
            for i in range(documents)
        ) + ('{"text": ""}\n' if f == count - 1 else '')
        files[f'part{f}.jsonl'] = lines.encode()
    files['part0.jsonl.zst'] = zstandard.ZstdCompressor().compress(files.pop('part0.jsonl'))
    return files


def test_two_hosts_prepare_into_the_bucket_what_one_machine_makes(gcs, bucket_config, small_corpus, tmp_path):
    """`python -m vrl.data prepare --tokenizer` on two hosts joined by jax.distributed, reading raw
    files from the bucket and sharing nothing else: each writes its files' shards (text and ids)
    straight into the bucket, and the dataset equals what a pool of two processes makes on local
    disk, file for file."""
    from tests.gcs_emulator import free_port
    from vrl.data import build, corpus, tokens

    _, tokenizer = small_corpus
    raw = tmp_path / 'raw'
    raw.mkdir()
    fs = bucket_fs()
    for name, data in _raw_files(5, 120).items():
        (raw / name).write_bytes(data)
        fs.pipe_file(f'vrl/raw5/{name}', data)
    reference = Path(
        build.prepare_from_glob(
            str(raw), 'web', str(tmp_path / 'tfds'), validation_fraction=0.1, tokenizer=tokenizer, workers=2
        )
    )
    port = free_port()
    pod = [
        subprocess.Popen(
            [
                sys.executable,
                '-m',
                'vrl.data',
                'prepare',
                '--input=gs://vrl/raw5',
                '--name=web',
                '--data_dir=gs://vrl/tfds5',
                '--validation_fraction=0.1',
                '--tokenizer=gs://vrl/plays.model',
                '--workers=1',
                f'--coordinator_address=127.0.0.1:{port}',
                '--num_processes=2',
                f'--process_id={i}',
            ],
            cwd=tmp_path,
            env={**machine_env(gcs, tmp_path / f'host{i}'), 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': host_xla_flags(1)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [(p.wait(timeout=300), p.stdout.read()) for p in pod]
    assert all(code == 0 for code, _ in outputs), outputs
    assert re.search(
        r'prepared dataset web: [\d,]+ train, [\d,]+ validation documents \(skipped 1 empty', outputs[0][1]
    )
    written = 'vrl/tfds5/web/1.0.0'
    names = sorted(str(p.relative_to(reference)) for p in reference.rglob('*') if p.is_file())
    assert sorted(f[len(written) + 1 :] for f in fs.find(written)) == names
    assert not any('vrl_units' in n or 'vrl_plan' in n for n in names)  # the build's own files are gone
    for name in names:
        got, want = fs.cat(f'{written}/{name}'), (reference / name).read_bytes()
        if name.endswith('.json'):
            got, want = json.loads(got), json.loads(want)
            if name.endswith(tokens.MARKER):
                assert got.pop('tokenizer') == 'gs://vrl/plays.model' and want.pop('tokenizer') == tokenizer.path
            if name.endswith('dataset_info.json'):
                got, want = got['splits'], want['splits']
        assert got == want, name
    texts = list(corpus.texts(corpus.open_split('web', 'gs://vrl/tfds5', 'train')))
    source = tokens.find('web', 'gs://vrl/tfds5', 'train', tokenizer)
    assert len(texts) == len(source) > 400
    assert all(source[i].tolist() == tokenizer.encode(texts[i]).tolist() for i in range(0, len(texts), 7))


def test_a_truncated_shard_in_the_bucket_is_named_in_one_line(gcs, small_corpus, tmp_path):
    """A pre-tokenized copy in the bucket with one .tokens object cut to half: refused when the split is
    opened, naming the object and its sizes (one listing), instead of a ranged read's HTTP 416 traceback
    mid-training."""
    import shutil

    from vrl.core import storage
    from vrl.data import corpus, tokens

    cfg, tokenizer = small_corpus
    local_dir = tmp_path / 'tfds'
    shutil.copytree(Path(cfg.data_dir) / 'plays', local_dir / 'plays')
    made = Path(tokens.tokenize('plays', str(local_dir), tokenizer, workers=1))
    storage.copy_tree(storage.path(str(local_dir)), storage.path('gs://vrl/truncated'))
    name = json.loads((made / tokens.MARKER).read_text())['splits']['train']['shards'][0]
    shard = f'vrl/truncated/{made.relative_to(local_dir)}/{name}.tokens'
    whole = bucket_fs().cat(shard)
    bucket_fs().pipe_file(shard, whole[: len(whole) // 4 * 2])
    with pytest.raises(corpus.DataError) as refused:
        tokens.find('plays', 'gs://vrl/truncated', 'train', tokenizer)
    assert str(refused.value).startswith(f'gs://{shard} holds {len(whole) // 4 * 2:,} bytes, but its offsets end at')
