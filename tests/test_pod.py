"""The pod rehearsal: a two-host pod whose hosts share nothing but a bucket (a real GCS emulator,
fake-gcs-server, on 127.0.0.1), killed and resumed. A file of its own, the suite's longest test, so
that pytest-xdist's per-file scheduling can run it beside the others."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.gcs_emulator import bucket_fs, free_port, machine_env
from tests.runs import ROOT, cli_args, host_xla_flags, not_for_users, tiny_config
from tests.slow_store import Fault, SlowStore
from vrl.core import storage
from vrl.train.config import Config
from vrl.train.rundir import lease as lease_lib
from vrl.train.trackers import stored

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier
STORE_TIMEOUT_S = 3  # a request unanswered for this long is abandoned and tried again


def _losses(workdir: str) -> dict[int, float]:
    """Per step, the last loss of the run's metrics (a resumed run's record supersedes)."""
    return {r['step']: r['loss'] for r in stored.read_metrics(storage.path(workdir)) if 'loss' in r}


def _pod_config(small_corpus) -> Config:
    """tiny_config on the built-in Shakespeare corpus, its dataset and tokenizer made in the bucket by
    the first run; a lease goes stale 40 s after its last renewal (every 10 s)."""
    config = tiny_config(
        small_corpus, attention='svformer', steps=8, checkpoint_every=4, log_every=1, lease_stale_seconds=40
    )
    return dataclasses.replace(
        config,
        data=dataclasses.replace(
            config.data, name='shakespeare', data_dir='gs://vrl/pod_data', tokenizer='', tokenizer_train_docs=400
        ),
    )


def _pod(config, workdir: str, gcs_url: str, hosts: list[Path]) -> list[subprocess.Popen]:
    """`python -m vrl.main` on a pod of len(hosts) machines: one process each (2 CPU devices), with
    its own HOME, TMPDIR and working directory, joined by jax.distributed on 127.0.0.1."""
    port = free_port()
    processes = []
    for i, host in enumerate(hosts):
        env = {
            **machine_env(gcs_url, host),
            'XLA_FLAGS': host_xla_flags(2),
            'JAX_PLATFORMS': 'cpu',
            'VRL_STORE_TIMEOUT_S': str(STORE_TIMEOUT_S),
        }
        processes.append(
            subprocess.Popen(
                cli_args(config, workdir)
                + [f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={len(hosts)}', f'--process_id={i}'],
                cwd=host,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return processes


def _finish(pod: list[subprocess.Popen]) -> list[tuple[int, str]]:
    return [(p.wait(timeout=600), p.stdout.read()) for p in pod]


def _faults() -> tuple[Fault, ...]:
    """What a bucket does now and then, to each kind of object the pod reads and writes: 503s, resets,
    requests never answered (their client times out after STORE_TIMEOUT_S and tries again)."""
    named = {
        'lease': r'pod_whole(%2F|/)\.lock',
        'metrics': r'pod_whole(%2F|/)metrics\.e\d+\.jsonl',
        'config': r'pod_whole(%2F|/)config\.json',
        'checkpoints': r'pod_whole(%2F|/)checkpoints',
        'data': r'pod_data(%2F|/)',
    }
    return (
        Fault(named['lease'], '503', 2),
        Fault(named['lease'], 'reset', 1),
        Fault(named['metrics'], '503', 2),
        Fault(named['metrics'], 'reset', 1),
        Fault(named['metrics'], 'stall', 1),
        Fault(named['config'], 'stall', 1),
        Fault(named['checkpoints'], '503', 2),
        Fault(named['checkpoints'], 'reset', 2),
        Fault(named['checkpoints'], 'stall', 1),
        Fault(named['data'], '503', 3),
        Fault(named['data'], 'reset', 2),
    )


def test_a_two_host_pod_lives_in_the_bucket_and_resumes_after_both_hosts_die(gcs, small_corpus, tmp_path):
    """The pod rehearsal: two jax.distributed processes that share no local disk, with workdir,
    data_dir and tokenizer on gs://. The first run builds the dataset and trains the tokenizer in the
    bucket through a store that answers 503, resets connections and leaves requests unanswered; a pod
    killed (-9, both hosts) after a checkpoint and restarted on fresh machines, on a clean store,
    equals it step by step; a second pod on a held workdir is refused by both its hosts."""
    config = _pod_config(small_corpus)
    with SlowStore(gcs, latency_s=0.005, faults=_faults()) as faulty:
        whole = _finish(_pod(config, 'gs://vrl/pod_whole', faulty.url, [tmp_path / 'a0', tmp_path / 'a1']))
        assert [rc for rc, _ in whole] == [0, 0], [out[-3000:] for _, out in whole]
        missed = [f for f in faulty.faults if f.injected < f.times]
        assert not missed, missed
        assert 'a request to the object store failed (' in whole[0][1]  # each retry said, none silent
        for _, out in whole:  # what a faulty store makes TensorStore warn about stays; no noise beside it
            assert not [line for line in out.splitlines() if re.search(r'Traceback|\[Gloo\]|google_auth', line)], out
    fs = bucket_fs()
    assert fs.exists('vrl/pod_data/vrl_tokenizers/shakespeare_512.model')
    # the built-in corpus, built by the pod's two hosts on first use, is the one a machine alone builds
    from vrl.data import corpus

    alone = json.loads((corpus.dataset_path('shakespeare', str(tmp_path / 'alone')) / 'dataset_info.json').read_text())
    pod = json.loads(fs.cat(fs.glob('vrl/pod_data/shakespeare/*/dataset_info.json')[0]))
    assert [(s['name'], s['shardLengths'], s['numBytes']) for s in pod['splits']] == [
        (s['name'], s['shardLengths'], s['numBytes']) for s in alone['splits']
    ]
    assert sum(map(int, alone['splits'][0]['shardLengths'])) > 30_000
    want = _losses('gs://vrl/pod_whole')
    assert sorted(want) == list(range(1, 9))

    killed = _pod(config, 'gs://vrl/pod_killed', gcs, [tmp_path / 'b0', tmp_path / 'b1'])
    deadline = time.time() + 300
    while not bucket_fs().exists('vrl/pod_killed/checkpoints/4.e1/commit_success.txt'):  # Orbax's last object
        assert all(p.poll() is None for p in killed) and time.time() < deadline, [
            p.stdout.read()[-3000:] for p in killed
        ]
        time.sleep(0.2)
    for p in killed:
        p.kill()
        p.wait()

    # a live holder's lease (the test's own, taken from the dead pod at once): another pod is refused
    # by both hosts, before writing; released, the next pod takes it at once and resumes
    objects = set(bucket_fs().find('vrl/pod_killed'))
    live = lease_lib.Lease(
        storage.path('gs://vrl/pod_killed'), stale_after=config.train.lease_stale_seconds, take_over=True
    )
    assert live.acquire().startswith('took over the lease of workdir gs://vrl/pod_killed from host ')
    refused = _finish(_pod(config, 'gs://vrl/pod_killed', gcs, [tmp_path / 'c0', tmp_path / 'c1']))
    assert all(rc != 0 and 'Traceback' not in out for rc, out in refused), [out[-3000:] for _, out in refused]
    assert 'error: workdir gs://vrl/pod_killed is in use by another run (host ' in refused[0][1], refused[0][1][-3000:]
    assert 'error: process 0 stopped: workdir gs://vrl/pod_killed is in use' in refused[1][1], refused[1][1][-3000:]
    assert set(bucket_fs().find('vrl/pod_killed')) == objects
    live.release()

    resumed = _finish(_pod(config, 'gs://vrl/pod_killed', gcs, [tmp_path / 'd0', tmp_path / 'd1']))
    assert [rc for rc, _ in resumed] == [0, 0], [out[-3000:] for _, out in resumed]
    assert 'resumed at step' in resumed[0][1], resumed[0][1]
    assert not not_for_users(resumed[0][1]) and not not_for_users(resumed[1][1]), resumed
    assert re.search(
        r'^data shakespeare: .*\ntokenizer gs://vrl/pod_data/vrl_tokenizers/shakespeare_512.model '
        r'\(512 pieces\); writing to gs://vrl/pod_killed$',
        resumed[0][1],
        re.M,
    ), resumed[0][1]
    assert re.search(r'^process 1 of 2: svformer, resumed at step \d, to step 8;', resumed[1][1], re.M), resumed[1][1]
    got = _losses('gs://vrl/pod_killed')
    assert sorted(got) == list(range(1, 9))
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), (got, want)
    history = json.loads(bucket_fs().cat('vrl/pod_killed/config.json'))['history']
    assert len(history) == 2 and 4 <= history[1]['step'] < 8, history  # resumed from the checkpoint of step 4
    assert {'process_0-of-2.json', 'process_1-of-2.json'} <= {
        p.rsplit('/', 1)[1] for p in bucket_fs().find('vrl/pod_killed/checkpoints/8.e3')
    }  # epochs: killed, test, resumed
    for folder in (tmp_path, ROOT):
        assert not list(folder.rglob('gs:')), f'a local gs: folder under {folder}'
