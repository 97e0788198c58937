"""The workdir under mistakes and failures: a second writer, a killed holder, Ctrl-C, damaged
checkpoints, --fresh, restarts in the record. Real processes, real Orbax, temp dirs."""

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import tensorstore as ts

from tests.conftest import ROOT
from tests.runs import cli_args, logged_steps, saved_steps, start_run, tiny_config, wait_for
from vrl.core.sharding import MeshConfig
from vrl.train import loop, trained
from vrl.train.rundir import checkpoint
from vrl.train.rundir.workdir import WorkdirError

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


def _records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]


def test_one_writer_a_killed_holder_does_not_block_and_ctrl_c_saves(small_corpus, tmp_path):
    config = tiny_config(small_corpus, steps=100_000, log_every=1, checkpoint_every=100_000)
    workdir = tmp_path / 'run'
    first = start_run(config, workdir)
    wait_for(lambda: logged_steps(workdir) >= 2, 180, first)
    second = subprocess.run(cli_args(config, workdir), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert second.returncode != 0 and 'Traceback' not in second.stderr
    assert f'is in use by another run (host {os.uname().nodename}, pid {first.pid}' in second.stderr

    first.send_signal(signal.SIGINT)  # Ctrl-C: the step finishes, is saved, the run exits normally
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output
    assert 'Ctrl-C: the run saves a checkpoint at the next step' in output and 'Traceback' not in output
    (interrupted_at,) = saved_steps(workdir)
    assert interrupted_at >= 2

    killed = start_run(config, workdir)
    wait_for(lambda: logged_steps(workdir) >= interrupted_at + 2, 180, killed)
    killed.kill()  # kill -9 while holding the lock
    killed.wait()
    resumed = loop.run(
        dataclasses.replace(config, train=dataclasses.replace(config.train, steps=interrupted_at + 1)), str(workdir)
    )
    assert min(resumed.losses) == interrupted_at + 1
    starts = [r['event'] for r in _records(workdir) if 'event' in r]
    assert starts == ['started', 'resumed', 'resumed']


def _array_files(step_dir: Path) -> list[Path]:
    """The step's array data files: OCDBT data of each process and of the merged root."""
    state = step_dir / 'state'
    return sorted(p for p in [*state.glob('d/*'), *state.glob('ocdbt.process_*/d/*')] if p.is_file())


def _flip_a_bit_of_a_saved_weight(step_dir: Path) -> None:
    """One bit of one query weight flipped through TensorStore, so the chunk still decodes: damage
    that TensorStore's own checks (OCDBT node checksums, zstd framing) cannot see and the saved
    fingerprint must. (A bit flipped in a data file's bytes lands in zstd-compressed chunk data or
    a checksummed node as often as in a raw block, and reads as unreadable instead.)"""
    kvstore = {'driver': 'ocdbt', 'base': f'file://{step_dir / "state"}/'}
    weights = ts.open({'driver': 'zarr', 'kvstore': kvstore, 'path': 'params.first.attn.wq'}).result()
    value = weights[0, 0, :1].read().result()
    weights[0, 0, :1].write((value.view(np.uint32) ^ 0x10).view(np.float32)).result()


def _truncate_each(step_dir: Path) -> None:
    for file in _array_files(step_dir):
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 3])


def _delete_a_folder(step_dir: Path) -> None:
    shutil.rmtree(next((step_dir / 'state').glob('ocdbt.process_*')))


def test_a_live_runs_lock_removed_by_hand_stops_it_before_a_second_writes_beside_it(small_corpus, tmp_path):
    """Deleting a running run's .lock lets a second run lock a new file: the first notices at its next
    step (the path no longer names the file it holds) and stops in one line, exit 1, writing no
    checkpoint; the second holds the workdir alone."""
    config = tiny_config(small_corpus, steps=100_000, log_every=1, checkpoint_every=100_000)
    workdir = tmp_path / 'run'
    first = start_run(config, workdir)
    wait_for(lambda: logged_steps(workdir) >= 2, 180, first)
    (workdir / '.lock').unlink()
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 1, output
    assert output.rstrip().splitlines()[-1] == (
        f'error: the lock file {workdir / ".lock"} was removed or replaced while this run held it, so another one '
        'may be writing in the workdir: this one stopped without writing more; its last checkpoint is intact (never '
        'delete the .lock of a live run).'
    ), output[-2000:]
    assert 'Traceback' not in output and saved_steps(workdir) == []


def test_damaged_checkpoints_fall_back_to_the_newest_intact_one(small_corpus, tmp_path, capsys):
    """Steps 12, 9 and 6 damaged three ways: each is named in one line and set aside, with its
    reason; the run resumes from step 3 and retraces the first run's losses exactly."""
    workdir = tmp_path / 'run'
    config = tiny_config(small_corpus, steps=12, checkpoint_every=3, keep_checkpoints=4)
    first = loop.run(config, str(workdir))
    assert saved_steps(workdir) == [3, 6, 9, 12]
    damages = {
        12: (_flip_a_bit_of_a_saved_weight, 'differs from the one saved (checksum mismatch)'),
        9: (_truncate_each, 'cannot be read'),
        6: (_delete_a_folder, 'cannot be read'),
    }
    for step, (damage, _) in damages.items():
        damage(workdir / 'checkpoints' / str(step))
    capsys.readouterr()
    resumed = loop.run(config, str(workdir))
    said = capsys.readouterr().out
    damaged_lines = [line for line in said.splitlines() if ' is damaged: ' in line]
    assert len(damaged_lines) == 3, said  # one line each, no traceback
    for step, (_, reason) in damages.items():
        assert any(f'checkpoint step {step} is damaged: ' in line and reason in line for line in damaged_lines), said
        (rejected,) = (workdir / 'rejected_checkpoints').glob(f'{step}-*')  # kept, with the reason
        assert reason in (rejected / 'REJECTED.txt').read_text()
    assert 'resuming from step 3' in said
    assert resumed.losses == {s: first.losses[s] for s in range(4, 13)}
    assert saved_steps(workdir) == [3, 6, 9, 12]  # saved again by the resumed run


def test_timed_saves_are_kept_until_the_next_and_scheduled_ones_as_configured(small_corpus, tmp_path, monkeypatch):
    """train.checkpoint_minutes saves between the scheduled steps (here every step: the clock always
    says it is due); of those only the newest stays. keep_checkpoints counts scheduled steps
    (checkpoint_every and the last), and keep_period keeps every k-th beside them."""
    saves = []
    save = checkpoint.save
    monkeypatch.setattr(
        checkpoint, 'save', lambda manager, step, *rest, **kw: (saves.append(step), save(manager, step, *rest, **kw))[1]
    )
    config = tiny_config(
        small_corpus,
        steps=10,
        checkpoint_every=4,
        keep_checkpoints=1,
        keep_period=4,
        checkpoint_minutes=1e-6,
        eval_every=0,
    )
    loop.run(config, str(tmp_path / 'kept'))
    assert saves == list(range(1, 11))
    assert saved_steps(tmp_path / 'kept') == [4, 8, 10]
    saves.clear()
    untimed = dataclasses.replace(config, train=dataclasses.replace(config.train, keep_period=0, checkpoint_minutes=0))
    loop.run(untimed, str(tmp_path / 'scheduled'))
    assert saves == [4, 8, 10] and saved_steps(tmp_path / 'scheduled') == [10]
    wsd = dataclasses.replace(
        config, optimizer=dataclasses.replace(config.optimizer, schedule='wsd', decay_steps=10, decay_fraction=0.3)
    )
    assert [s for s in range(1, 11) if checkpoint.permanent(wsd, s)] == [4, 7, 8, 10]  # 7: the stable phase's end


def test_no_restorable_checkpoint_moves_nothing(small_corpus, tmp_path):
    workdir = tmp_path / 'run'
    config = tiny_config(small_corpus, steps=4, checkpoint_every=4)
    loop.run(config, str(workdir))
    _flip_a_bit_of_a_saved_weight(workdir / 'checkpoints' / '4')
    with pytest.raises(checkpoint.CorruptCheckpointError, match='no checkpoint in .* can be restored: step 4: '):
        loop.run(dataclasses.replace(config, train=dataclasses.replace(config.train, steps=8)), str(workdir))
    assert saved_steps(workdir) == [4] and not (workdir / 'rejected_checkpoints').exists()


@contextlib.contextmanager
def _sigterm_after(workdir: Path, steps: int) -> Iterator[None]:
    """SIGTERM to this process (what a preemption sends) once `steps` steps are logged, unless the
    block ends first (a run that failed early must not stop a later test)."""
    done = threading.Event()

    def watch():
        while logged_steps(workdir) < steps:
            if done.wait(0.02):
                return
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_fresh_keeps_the_old_run_and_resumes_its_own(small_corpus, tmp_path, capsys):
    workdir = tmp_path / 'run'
    old = loop.run(tiny_config(small_corpus, steps=8, checkpoint_every=4), str(workdir))
    config = tiny_config(small_corpus, steps=30, log_every=1, checkpoint_every=1000, seed=1)
    with _sigterm_after(workdir, 3):
        preempted = loop.run(config, str(workdir), fresh=True)
    assert preempted.preempted and min(preempted.losses) == 1
    (previous,) = (workdir / 'previous_runs').iterdir()  # the old run, whole
    assert saved_steps(previous) == [4, 8] and (previous / 'metrics.jsonl').exists()
    assert old.step == 8 and saved_steps(workdir) == [preempted.step]

    capsys.readouterr()
    again = loop.run(config, str(workdir), fresh=True)  # the same command: the fresh run goes on
    assert '--fresh: resuming the run that --fresh started' in capsys.readouterr().out
    assert min(again.losses) == preempted.step + 1 and again.step == 30
    assert len(list((workdir / 'previous_runs').iterdir())) == 1
    record = json.loads((workdir / 'config.json').read_text())
    assert [h['step'] for h in record['history']] == [0, preempted.step] and record['started_fresh']

    finished = loop.run(config, str(workdir), fresh=True)  # a finished fresh run: --fresh starts over
    assert min(finished.losses) == 1 and len(list((workdir / 'previous_runs').iterdir())) == 2


def test_restarts_say_what_they_do(small_corpus, tmp_path, capsys):
    workdir = tmp_path / 'run'
    config = tiny_config(small_corpus, steps=4, checkpoint_every=2)
    loop.run(config, str(workdir))
    with pytest.raises(loop.TrainingError, match=r'train.steps=2 is below the step of the checkpoint .* \(4\)'):
        loop.run(dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2)), str(workdir))
    capsys.readouterr()
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=6))
    loop.run(longer, str(workdir), init_from=str(workdir))
    said = capsys.readouterr().out
    assert '--init_from ignored: the workdir has a checkpoint, so this run resumes from step 4' in said
    assert 'train.steps changed since the last start: 4 -> 6' in said
    loop.run(longer, str(workdir))
    assert 'nothing to train: the checkpoint is at step 6' in capsys.readouterr().out
    history = json.loads((workdir / 'config.json').read_text())['history']
    assert history[1]['changed'] == {'train.steps': [4, 6]} and history[2]['changed'] == {}
    events = [(r['step'], r['event']) for r in _records(workdir) if 'event' in r]
    assert events == [(0, 'started'), (4, 'resumed'), (6, 'resumed')]


def _free(disk: Path) -> int:
    room = os.statvfs(disk)
    return room.f_bavail * room.f_frsize


def _fill(disk: Path, leave: int) -> None:
    """Fills `disk` but `leave` bytes while a run goes on writing to it: a megabyte at a time, then to
    the byte; where the run took the room first, the ballast gives `leave` back."""
    fd = os.open(disk / 'ballast', os.O_WRONLY | os.O_CREAT)
    try:
        while (room := _free(disk) - leave) > 0:
            try:
                os.write(fd, b'\0' * min(room, 1 << 20))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
        if _free(disk) < leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - (leave - _free(disk))))
    finally:
        os.close(fd)


@contextlib.contextmanager
def _run_on_a_small_disk(config, folder: Path, size: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`python -m vrl.main` with its workdir on a tmpfs of `size` mounted at `folder` in a user and
    mount namespace of its own (no root needed), and that disk as this process reaches it
    (/proc/PID/root). The namespace's shell prints `run exited: CODE` after the run, then keeps
    the disk until the context ends."""
    script = 'mount -t tmpfs -o size="$1" tmpfs "$0" && "${@:2}"; echo "run exited: $?"; read _'
    run = subprocess.Popen(
        [
            'unshare',
            '--user',
            '--map-root-user',
            '--mount',
            'bash',
            '-c',
            script,
            str(folder),
            size,
            *cli_args(config, folder / 'run'),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield run, Path(f'/proc/{run.pid}/root') / folder.relative_to('/')
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()


def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(small_corpus, tmp_path):
    config = tiny_config(small_corpus, steps=100_000, checkpoint_every=2, log_every=1)
    (tmp_path / 'small_disk').mkdir()
    with _run_on_a_small_disk(config, tmp_path / 'small_disk', '64m') as (run, disk):
        workdir = disk / 'run'
        wait_for(lambda: saved_steps(workdir), 300, run)
        _fill(disk, leave=300_000)  # room for the run's logs, not for another checkpoint (over 1 MB)
        lines = []
        while (line := run.stdout.readline()) and not line.startswith('run exited: '):
            lines.append(line)
        assert line.startswith('run exited: ') and line != 'run exited: 0\n', ''.join(lines[-30:])
        last_line = lines[-1]
        assert last_line.startswith('error: saving a checkpoint in') and 'no space left on device' in last_line
        assert not list((workdir / 'checkpoints').glob('*.orbax-checkpoint-tmp*'))  # no partial folder
        kept = saved_steps(workdir)[-1]  # the steps saved before the disk filled up are intact
        copy = tmp_path / 'copy'
        shutil.copytree(workdir, copy)
    resumed = loop.run(dataclasses.replace(config, train=dataclasses.replace(config.train, steps=kept + 1)), str(copy))
    assert min(resumed.losses) == kept + 1


@pytest.mark.parametrize(
    'text, reason',
    [
        ('{"config": {"model": {', 'Expecting'),
        ('{"config": {"model": {"n_layerz": 2}}}', 'model.n_layerz is not a config field'),
        ('{"params": 3}', "'config'"),
    ],
)
def test_a_damaged_run_record_is_one_line(tmp_path, text, reason):
    (tmp_path / 'config.json').write_text(text)
    with pytest.raises(WorkdirError, match=f'config.json is not a readable vrl run record .*{re.escape(reason)}'):
        trained.load_run(str(tmp_path))


def test_resume_on_another_mesh_split(small_corpus, tmp_path, capsys):
    config = tiny_config(small_corpus, steps=4, checkpoint_every=2)
    straight = loop.run(config, str(tmp_path / 'straight'))  # fsdp over all 8 devices
    first = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2))
    loop.run(first, str(tmp_path / 'resharded'))
    other_mesh = dataclasses.replace(config, mesh=MeshConfig(data=1, fsdp=2, tensor=2, context=2))  # sequences split
    capsys.readouterr()
    resumed = loop.run(other_mesh, str(tmp_path / 'resharded'))
    said = capsys.readouterr().out
    assert 'mesh.fsdp changed since the last start: -1 -> 2' in said and 'mesh.context changed' in said, said
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert abs(resumed.losses[step] - straight.losses[step]) / straight.losses[step] < 1e-5


def test_a_damaged_checkpoint_is_one_line_on_the_command_line(small_corpus, tmp_path):
    """What Orbax and tensorstore leave behind after a failed read (hundreds of traceback lines)
    does not reach the terminal."""
    workdir = tmp_path / 'run'
    config = tiny_config(small_corpus, steps=4, checkpoint_every=2)
    loop.run(config, str(workdir))
    _truncate_each(workdir / 'checkpoints' / '4')
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=6))
    out = subprocess.run(cli_args(longer, workdir), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r'checkpoint step 4 is damaged: .*cannot be read', out.stdout), out.stdout
    assert 'resuming from step 2' in out.stdout
    printed = out.stdout + out.stderr
    assert 'Traceback' not in printed and 'Exception ignored' not in printed


_UNRETRIEVED_TASK_ERROR = """
import asyncio, gc, sys
import tensorstore as ts
from vrl.train.rundir import orbax_noise

async def plain_failure():
    raise ValueError('a failure of something else')

async def leave_a_failed_task():
    if sys.argv[1] == 'tensorstore':
        spec = {'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': sys.argv[2]}}
        task = asyncio.ensure_future(ts.open(spec, open=True))
    else:
        task = asyncio.ensure_future(plain_failure())
    await asyncio.wait([task])

orbax_noise.quiet()
asyncio.run(leave_a_failed_task())
gc.collect()
"""


@pytest.mark.parametrize('source', ['tensorstore', 'other'])
def test_a_failed_tensorstore_task_left_unretrieved_is_not_printed(source, tmp_path):
    """A tensorstore future that Orbax gathered and left behind when another failed ends as asyncio's
    'Task exception was never retrieved' whose only frame is asyncio's; it is dropped, and the same log
    for any other task's failure is printed."""
    script = [sys.executable, '-c', _UNRETRIEVED_TASK_ERROR, source, str(tmp_path / 'absent')]
    out = subprocess.run(script, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if source == 'tensorstore':
        assert out.stderr == ''
    else:
        assert 'Task exception was never retrieved' in out.stderr and 'a failure of something else' in out.stderr


def test_a_resume_that_reads_another_tokenizer_is_refused_unless_allowed(small_corpus, tmp_path, capsys):
    """config.json records what a start read (tokenizer fingerprint and special ids, each dataset's
    version and fingerprint, pre-tokenized or not); a resume with another tokenizer is one line naming
    both, and data.allow_data_change=true resumes, saying so."""
    from vrl.data import corpus
    from vrl.data.tokenizer import train as train_tokenizer

    config = tiny_config(small_corpus, steps=2, checkpoint_every=2)
    workdir = tmp_path / 'run'
    loop.run(config, str(workdir))
    cfg, tokenizer = small_corpus
    read = json.loads((workdir / 'config.json').read_text())['data']
    assert read['tokenizer'] == {
        'path': tokenizer.path,
        'fingerprint': tokenizer.fingerprint,
        'vocab_size': tokenizer.vocab_size,
        'eos_id': tokenizer.eos_id,
        'bos_id': tokenizer.bos_id,
        'pad_id': tokenizer.pad_id,
    }
    assert (
        read['datasets']['plays'].items()
        >= {
            'version': '1.0.0',
            'weight': 1.0,
            'pretokenized': False,
            'fingerprint': corpus.fingerprint('plays', cfg.data_dir),
        }.items()
    )
    other = train_tokenizer(
        corpus.texts(corpus.open_split('plays', cfg.data_dir, 'train')), 400, str(tmp_path / 'other.model')
    )
    longer = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, steps=4),
        data=dataclasses.replace(config.data, tokenizer=other.path),
    )
    capsys.readouterr()
    with pytest.raises(
        loop.TrainingError,
        match=rf'{workdir} was trained on other data than this run reads: the '
        rf'tokenizer: {re.escape(tokenizer.path)} \(fingerprint '
        rf'{tokenizer.fingerprint}\) then, {re.escape(other.path)} '
        rf'\({other.fingerprint}\) now\..*data.allow_data_change=true',
    ):
        loop.run(longer, str(workdir))
    assert checkpoint.latest_step(workdir) == 2  # nothing trained
    allowed = dataclasses.replace(longer, data=dataclasses.replace(longer.data, allow_data_change=True))
    assert max(loop.run(allowed, str(workdir)).losses) == 4
    said = capsys.readouterr().out
    assert 'resuming on changed data (data.allow_data_change=true): the tokenizer:' in said
    assert json.loads((workdir / 'config.json').read_text())['data']['tokenizer']['fingerprint'] == other.fingerprint


def test_a_run_refused_before_writing_leaves_no_workdir_behind(small_corpus, tmp_path):
    """A missing tokenizer stops the run after it claimed its new workdir: the folder (with its lock
    file) goes; a workdir that was there already stays."""
    from vrl.data.tokenizer import TokenizerError

    config = tiny_config(small_corpus, steps=2)
    missing = dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=str(tmp_path / 'none.model')))
    with pytest.raises(TokenizerError, match='does not exist'):
        loop.run(missing, str(tmp_path / 'new'))
    assert not (tmp_path / 'new').exists()
    (tmp_path / 'old').mkdir()
    with pytest.raises(TokenizerError, match='does not exist'):
        loop.run(missing, str(tmp_path / 'old'))
    assert [p.name for p in (tmp_path / 'old').iterdir()] == ['.lock']


def test_a_torn_metrics_line_is_set_aside_on_resume_and_skipped_by_readers(small_corpus, tmp_path, capsys, caplog):
    """A run killed mid-write leaves half a record at the end of metrics.jsonl: the resumed run moves it to
    metrics.torn.txt (one line said) and appends whole records only, its `resumed` record among them; a
    reader of a file torn at the end, or in the middle by an older vrl, skips those lines with one warning
    naming the file, and the report's numbers come from the rest."""
    from vrl.experiments import grid

    workdir = tmp_path / 'run'
    config = tiny_config(small_corpus, steps=4, checkpoint_every=4, log_every=1)
    loop.run(config, str(workdir))
    half = '{"step": 5, "loss": 3.1'
    with open(workdir / 'metrics.jsonl', 'a') as f:
        f.write(half)
    kept = (workdir / 'metrics.jsonl').read_text()[: -len(half)]
    capsys.readouterr()
    loop.run(dataclasses.replace(config, train=dataclasses.replace(config.train, steps=6)), str(workdir))
    said = capsys.readouterr().out
    assert f'{workdir / "metrics.jsonl"} ended in half a record ({len(half)} bytes' in said, said
    assert (workdir / 'metrics.torn.txt').read_text() == half + '\n'
    text = (workdir / 'metrics.jsonl').read_text()
    assert text.startswith(kept) and text.endswith('\n')
    records = _records(workdir)  # every line parses
    assert [r['event'] for r in records if 'event' in r] == ['started', 'resumed']
    assert {5, 6} <= {r['step'] for r in records if 'loss' in r}

    torn = tmp_path / 'torn'
    torn.mkdir()
    lines = text.splitlines()
    (torn / 'metrics.jsonl').write_text('\n'.join([lines[0][:10] + lines[1], *lines[2:], lines[3][:15]]))
    with caplog.at_level('WARNING'):
        by_step = grid.read_metrics(torn)
    (warning,) = [r.getMessage() for r in caplog.records if 'not a whole record' in r.getMessage()]
    assert warning.startswith(f'{torn / "metrics.jsonl"}: line 1, {len(lines)} is not a whole record'), warning
    whole: dict[int, dict] = {}
    for line in lines[2:]:
        whole.setdefault(json.loads(line)['step'], {}).update(json.loads(line))
    assert by_step == whole
