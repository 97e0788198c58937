"""Scale-out on 8 fake CPU devices: meshes agree with one device, two real processes agree with one,
the AOT compile for a TPU slice works, and the launch scripts say every step they would run."""

import dataclasses
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from tests.conftest import ROOT
from tests.helpers import ATTN_RES_VARIANTS, HYPER_VARIANTS, NAMED_VARIANTS, train_steps
from tests.runs import TINY_MODEL, cli_args, host_xla_flags, tiny_config, train_losses, write_choice_task
from vrl.core import sharding
from vrl.core.config import ConfigError
from vrl.core.sharding import MeshConfig
from vrl.data import pipeline
from vrl.data.config import DataConfig
from vrl.model.config import ModelConfig
from vrl.train import aot
from vrl.train.config import Config, check_fits_mesh

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier
VARIANTS = (
    NAMED_VARIANTS | HYPER_VARIANTS | ATTN_RES_VARIANTS | {'skipv1': dict(attention='vanilla', skip_v1=2)}
)  # 2 of 4 kv heads


def _sharding_config(small_corpus, mesh: MeshConfig) -> Config:
    config = tiny_config(small_corpus)  # d_model 32, 2 heads of 16
    model = dataclasses.replace(config.model, n_heads=4, n_kv_heads=4, head_dim=8, d_ff=64)
    return dataclasses.replace(config, model=model, mesh=mesh)


def test_meshes_agree_with_one_device_and_shard_as_the_rules_say(small_corpus):
    assert jax.device_count() == 8
    _, tokenizer = small_corpus
    config = _sharding_config(small_corpus, MeshConfig(data=1, fsdp=1, tensor=1))
    iterator = iter(pipeline.train_dataset(config.data, tokenizer))
    batches = [next(iterator) for _ in range(3)]
    reference, _ = train_losses(config, jax.devices()[:1], batches)
    for shape in ((8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)):
        mesh_config = MeshConfig(*shape)
        losses, state = train_losses(dataclasses.replace(config, mesh=mesh_config), jax.devices(), batches)
        for got, want in zip(losses, reference):
            assert abs(got - want) / want < 1e-5, (shape, losses, reference)
        data_size, fsdp, tensor = shape
        wq = state.params['layers']['attn']['wq']  # (layers, embed, heads, head_dim)
        assert wq.sharding.spec == PartitionSpec(None, 'fsdp', 'tensor', None)
        assert wq.addressable_shards[0].data.shape == (1, 32 // fsdp, 4 // tensor, 8)
        embed = state.params['embed']  # (vocab, embed)
        assert embed.addressable_shards[0].data.shape == (512 // tensor, 32 // fsdp)
        mu = state.opt_state[1][0].mu['layers']['mlp']['w_down']  # Adam's moment, sharded like its weight
        assert mu.sharding.spec == PartitionSpec(None, 'tensor', 'fsdp')


# between them every kind of parameter the baselines add: the per-token mix, gates, value tables,
# CLA's K/V stacked over the owning layers, DenseFormer's weights, NeuTRENO, MUDD's per-connection weights,
# Attention Residuals' depth queries and their hand-written mix (mHC's stacked connections: the context
# test's mhc case, whose mesh shards fsdp and tensor too)
@pytest.mark.parametrize(
    'variant', ['resformer-per_token', 'all-baselines', 'resformer-mudd-vr', 'attnres-block1-resformer']
)
def test_every_baseline_trains_sharded_as_on_one_device(small_corpus, variant):
    """The new variants' parameters (gates, tables, shared K/V, averaging weights) shard by the rules
    and a (data, fsdp, tensor) = (2, 2, 2) mesh trains exactly as one device does."""
    _, tokenizer = small_corpus
    config = _sharding_config(small_corpus, MeshConfig(data=1, fsdp=1, tensor=1))
    model = dataclasses.replace(config.model, n_layers=4, **{'lambda_mode': 'identity', **VARIANTS[variant]})
    config = dataclasses.replace(config, model=model)
    iterator = iter(pipeline.train_dataset(config.data, tokenizer))
    batches = [next(iterator) for _ in range(2)]
    reference, _ = train_losses(config, jax.devices()[:1], batches)
    losses, _ = train_losses(dataclasses.replace(config, mesh=MeshConfig(2, 2, 2)), jax.devices(), batches)
    for got, want in zip(losses, reference):
        assert abs(got - want) / want < 1e-5, (losses, reference)


CONTEXT_MESHES = {
    'two': MeshConfig(data=1, fsdp=2, tensor=2, context=2),
    'four': MeshConfig(data=2, fsdp=1, tensor=1, context=4),
    'eight': MeshConfig(data=1, fsdp=1, tensor=1, context=8),
}


@pytest.mark.parametrize(
    'variant, mesh',
    [
        ('vanilla', 'eight'),
        ('resformer-learnable_plus', 'two'),
        ('svformer', 'four'),
        ('all-baselines', 'two'),
        ('mhc', 'two'),
        ('svformer-cla2', 'four'),
        ('mudd-qkvr', 'two'),
        ('skipv1', 'two'),
    ],
)
def test_a_sequence_split_over_the_context_axis_trains_as_on_one_device(small_corpus, variant, mesh):
    """mesh.context = 2, 4 and 8, beside the other axes (between them every variant kind: the
    all-baselines one has the per-token mix, value tables, CLA's shared K/V, DenseFormer and NeuTRENO;
    mhc's connections shard over fsdp and tensor, and it widens the stream that crosses the layers):
    with document masking (segment ids and per-document RoPE positions across the parts) a split
    sequence trains exactly as on one device; so do the whole-sequence copies of what layers share
    (SVFormer's V_1, a CLA group's K and V)."""
    _, tokenizer = small_corpus
    config = _sharding_config(small_corpus, MeshConfig(data=1, fsdp=1, tensor=1))
    model = dataclasses.replace(
        config.model, n_layers=4, attention_impl='xla', **{'lambda_mode': 'identity', **VARIANTS[variant]}
    )
    config = dataclasses.replace(config, model=model, data=dataclasses.replace(config.data, document_masking=True))
    iterator = iter(pipeline.train_dataset(config.data, tokenizer))
    batches = [next(iterator) for _ in range(3)]
    assert sum(len(set(row.tolist()) - {0}) > 1 for row in batches[0]['segment_ids']) >= 2  # rows of 2+ documents
    reference, _ = train_losses(config, jax.devices()[:1], batches)
    losses, state = train_losses(dataclasses.replace(config, mesh=CONTEXT_MESHES[mesh]), jax.devices(), batches)
    assert dict(state.params['embed'].sharding.mesh.shape)['context'] == CONTEXT_MESHES[mesh].context
    for got, want in zip(losses, reference):
        assert abs(got - want) / want < 1e-5, (mesh, losses, reference)


def test_only_keys_and_values_cross_the_context_axis_once_for_the_layers_that_share_them(small_corpus):
    """The compiled train step at mesh.context=4 (bench/context_collectives.py's count of its HLO): the
    attention exchanges exactly the K and V of each layer that projects them (gathered forward,
    reduce-scattered backward): every layer's for vanilla, K per layer and V_1 once for SVFormer (the
    (N + 1) / (2N) of vanilla's the paper's single V allows), K and V once per group for CLA2 and for
    SVFormer with CLA2; outside it, the weight gradients' all-reduce and no more of the sequence than
    three hidden states and the token ids: the embedding lookup's one forward and one backward, and the
    hidden states out of the balanced order (the partitioner once moved whole hidden states around
    every matmul of every layer)."""
    spec = importlib.util.spec_from_file_location('context_collectives', ROOT / 'bench' / 'context_collectives.py')
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = _sharding_config(small_corpus, MeshConfig(data=1, fsdp=2, tensor=1, context=4))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=4, attention_impl='xla'))
    sent = {}
    for variant in ('vanilla', 'svformer', 'cla2', 'svformer-cla2'):
        totals, least = bench.measure(
            dataclasses.replace(config, model=dataclasses.replace(config.model, **NAMED_VARIANTS[variant]))
        )
        sent[variant] = totals.get('all-gather attention', 0) + totals.get('reduce-scatter attention', 0)
        rows = config.data.batch_size // 2  # fsdp 2; float32 hidden states and int32 token ids
        moved = sum(v for k, v in totals.items() if k.endswith(' context') and not k.startswith('all-reduce'))
        assert moved <= rows * config.data.seq_len * (3 * config.model.d_model + 1) * 4, totals
        assert sent[variant] == least, (variant, totals)
    N = config.model.n_layers
    assert (sent['svformer'] * 2 * N, sent['cla2'] * 2, sent['svformer-cla2'] * 8) == (
        sent['vanilla'] * (N + 1),
        sent['vanilla'],
        sent['vanilla'] * 3,
    ), sent  # N = 4: 2 groups; K twice, V once


@pytest.mark.parametrize(
    'mesh, message',
    [
        (MeshConfig(data=2, fsdp=3, tensor=1), 'multiply to 6 but there are 8 devices'),
        (MeshConfig(data=3, fsdp=-1, tensor=1), 'fixed sizes (3) must divide the 8 devices'),
    ],
)
def test_bad_mesh_sizes(mesh, message):
    with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
        sharding.make_mesh(mesh)


@pytest.mark.parametrize(
    'mesh, batch, d_model, seq_len, message',
    [
        (MeshConfig(1, 1, 8), 8, 32, 64, r"mesh.tensor=8 is invalid: it must divide \S+'s k?v?_?heads dimension, 4 "),
        (
            MeshConfig(1, 8, 1),
            6,
            32,
            64,
            'data.batch_size=6 is invalid: .* split over mesh data x fsdp = 8 devices; use a multiple of 8',
        ),
        (
            MeshConfig(1, 8, 1),
            8,
            36,
            64,
            r"mesh.fsdp=8 is invalid: it must divide \S+'s embed dimension, 36 \(model.d_model\)",
        ),
        (MeshConfig(1, 2, 1, context=4), 8, 32, 66, 'mesh.context=4 is invalid: it must divide data.seq_len=66'),
        (
            MeshConfig(1, 4, 2),
            8,
            32,
            64,
            r"mesh.tensor=2 is invalid: it must divide layers.attn.wv's kv_heads dimension, 3 \(model.n_kv_heads, or "
            'the value heads a layer projects of them',
        ),
    ],
)
def test_what_does_not_split_over_the_mesh_is_named(small_corpus, mesh, batch, d_model, seq_len, message):
    config = _sharding_config(small_corpus, mesh)
    skip_v1 = 1 if 'layers.attn.wv' in message else 0  # 1 of the 4 kv heads from V_1: 3 projected
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, batch_size=batch, seq_len=seq_len),
        model=dataclasses.replace(config.model, d_model=d_model, skip_v1=skip_v1),
    )
    with pytest.raises(ConfigError, match=message):
        check_fits_mesh(config, sharding.mesh_shape(mesh, jax.device_count()))


def test_context_parallelism_takes_each_platforms_kernel_and_the_tools_split_no_sequence():
    """mesh.context > 1: auto attention resolves to splash on TPU where each device's part is whole
    splash blocks, to cuDNN on GPU where each part is whole even query chunks (cuDNN trains with a
    mask on even lengths), else xla, with the reason; an explicit cuDNN that cannot serve is
    refused naming it; and the tools that read a trained run (decoding, scoring) split no sequence."""
    from vrl.model import attention

    cfg = ModelConfig(**{**TINY_MODEL, 'compute_dtype': 'bfloat16', 'head_dim': 64})
    assert attention.choose(cfg, 'tpu', 2048, False, context=4) == ('splash', 'the tpu kernel serves this config')
    assert attention.choose(cfg, 'tpu', 512, False, context=8) == (
        'xla',
        'splash needs data.seq_len / mesh.context=8 a multiple of 128 (and of 512 above it); it is 64',
    )
    assert attention.choose(cfg, 'gpu', 2048, False, context=2) == ('cudnn', 'the gpu kernel serves this config')
    assert attention.choose(cfg, 'gpu', 2048, True, context=2)[0] == 'xla'  # document masking: no segment ids
    assert attention.choose(cfg, 'gpu', 1000, False, context=4) == (
        'xla',
        'cuDNN attention on a split sequence needs data.seq_len / mesh.context=4 a multiple of 2 x '
        'model.attention_chunks=4; it is 250',
    )
    with pytest.raises(
        ConfigError,
        match=r"model.attention_impl='cudnn' cannot run here: cuDNN attention on a split "
        r'sequence needs data.seq_len / mesh.context=4 a multiple of 2 x '
        r'model.attention_chunks=4; it is 250',
    ):
        attention.choose(dataclasses.replace(cfg, attention_impl='cudnn'), 'gpu', 1000, False, context=4)
    assert sharding.without_context(MeshConfig(data=2, fsdp=2, tensor=1, context=2)) == MeshConfig(2, 4, 1)
    assert sharding.without_context(MeshConfig(data=2, fsdp=-1, tensor=1, context=2)) == MeshConfig(2, -1, 1)
    assert sharding.mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=1, context=2), 8) == {
        'data': 2,
        'fsdp': 2,
        'context': 2,
        'tensor': 1,
    }
    # context 0 (auto): picked by compiling (tests/test_attention.py), never a mesh as it stands
    assert sharding.without_context(MeshConfig(data=2, fsdp=-1, tensor=1, context=0)) == MeshConfig(2, -1, 1)
    with pytest.raises(ConfigError, match=r'^mesh.context=0 unresolved: a mesh takes concrete values. vrl.train.aot'):
        sharding.mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=1, context=0), 8)
    with pytest.raises(
        ConfigError,
        match=r'mesh.context.*0 \(auto: .*\) with one of mesh.data, mesh.fsdp, '
        r'mesh.tensor at -1',
    ):
        MeshConfig(data=2, fsdp=4, tensor=1, context=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _start_two_processes(config: Config, workdir) -> list[subprocess.Popen]:
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=host_xla_flags(4), JAX_PLATFORMS='cpu')
    return [
        subprocess.Popen(
            cli_args(config, workdir)
            + [f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', f'--process_id={i}'],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def _run_two_processes(config: Config, workdir) -> list[str]:
    procs = _start_two_processes(config, workdir)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs


def test_two_processes_match_one_process_checkpoint_and_resume(small_corpus, tmp_path):
    """Also the downstream tasks scored while training: each process supplies half of every batch's
    rows, and the scores equal vrl.tools.evaluate's in one process."""
    tasks = write_choice_task(tmp_path / 'tasks')
    config = _sharding_config(small_corpus, MeshConfig(data=2, fsdp=-1, tensor=1))
    config = dataclasses.replace(
        config,
        train=dataclasses.replace(
            config.train,
            log_every=1,
            checkpoint_every=3,
            steps=3,
            downstream_tasks='toy_choice',
            downstream_every=3,
            downstream_include_path=str(tasks),
        ),
    )
    workdir = tmp_path / 'two_processes'
    outputs = _run_two_processes(config, workdir)
    assert (workdir / 'checkpoints' / '3' / 'data' / 'process_1-of-2.json').exists()
    # process 1 says when it joins, when it starts and where it ended, and nothing of the progress
    said = [line for line in outputs[1].splitlines() if line.startswith('process 1 of 2: ')]
    assert len(said) == 3 and said[0].startswith('process 1 of 2: joining the job at 127.0.0.1:'), outputs[1]
    assert 'fresh start, to step 3; process 0 prints the progress' in said[1], outputs[1]
    assert re.fullmatch(
        rf'process 1 of 2: done at step 3: loss \d+\.\d{{4}}; checkpoint in {workdir}/checkpoints/3', said[2]
    ), said
    assert 'step 3/3' not in outputs[1] and 'step 3/3' in outputs[0]
    assert 'done at step 3: loss ' in outputs[0]
    resumed = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=6))
    _run_two_processes(resumed, workdir)  # restores step 3 in both processes, runs 4..6
    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    two_process_losses = [r['loss'] for r in records if 'loss' in r]
    assert [r['step'] for r in records if 'loss' in r] == [1, 2, 3, 4, 5, 6]

    # one process, 8 devices, fed the concatenation of the two processes' shards
    _, tokenizer = small_corpus
    shards = [iter(pipeline.train_dataset(config.data, tokenizer, i, 2)) for i in range(2)]
    batches = []
    for _ in range(6):
        parts = [next(shard) for shard in shards]
        batches.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    reference, _ = train_losses(resumed, jax.devices(), batches)
    for got, want in zip(two_process_losses, reference):
        assert abs(got - want) / want < 1e-5, (two_process_losses, reference)

    from vrl.tools import evaluate

    scored = {r['step']: r['downstream/toy_choice/acc'] for r in records if 'downstream/toy_choice/acc' in r}
    assert sorted(scored) == [3, 6]
    one_process = evaluate.evaluate(
        str(workdir), ['toy_choice'], batch_size=config.data.batch_size, include_path=str(tasks)
    ).results
    assert one_process['results']['toy_choice']['acc,none'] == scored[6]


def test_a_sequence_split_across_two_hosts_trains_as_one_process_does(small_corpus, tmp_path):
    """mesh.context=8 over two processes of 4 devices: both hosts read the same whole sequences (one
    share of the rows, the same data position saved by each) and SVFormer trains as on one device."""
    config = _sharding_config(small_corpus, MeshConfig(data=1, fsdp=1, tensor=1, context=8))
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, attention='svformer'),
        train=dataclasses.replace(config.train, log_every=1, checkpoint_every=2, steps=2),
    )
    workdir = tmp_path / 'split_across_hosts'
    _run_two_processes(config, workdir)
    saved = [
        json.loads((workdir / 'checkpoints' / '2' / 'data' / f'process_{i}-of-2.json').read_text()) for i in range(2)
    ]
    assert saved[0] == saved[1] and saved[0]['share'] == [0, 1], saved
    losses = [
        json.loads(line)['loss']
        for line in (workdir / 'metrics.jsonl').read_text().splitlines()
        if 'loss' in json.loads(line)
    ]
    iterator = iter(pipeline.train_dataset(config.data, small_corpus[1]))
    reference, _ = train_losses(
        dataclasses.replace(config, mesh=MeshConfig(1, 1, 1)), jax.devices()[:1], [next(iterator) for _ in range(2)]
    )
    assert len(losses) == 2 and all(abs(got - want) / want < 1e-5 for got, want in zip(losses, reference)), (
        losses,
        reference,
    )


FAIL_ON_PROCESS_0 = """
import sys, time
import jax
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from vrl.core import multihost
def build():
    raise OSError(28, 'No space left on device', '/data/shard-3')
started = time.monotonic()
try:
    multihost.on_process_0(build)
except Exception as e:
    print(f'{time.monotonic() - started:.1f} {type(e).__name__}: {e}', flush=True)
"""


def test_whatever_fails_on_process_0_reaches_the_other_host_in_one_line():
    """Not only vrl's own errors: an OSError in what process 0 does alone (a full disk while building)
    stops the other process at once with its type and message, instead of leaving it waiting."""
    address = f'127.0.0.1:{_free_port()}'
    procs = [
        subprocess.Popen(
            [sys.executable, '-c', FAIL_ON_PROCESS_0, address, str(i)],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=host_xla_flags(1)),
        )
        for i in range(2)
    ]
    zero, one = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]  # after gloo's lines
    assert zero.split(' ', 1)[1].strip() == "OSError: [Errno 28] No space left on device: '/data/shard-3'", zero
    seconds, said = one.split(' ', 1)
    assert said.strip() == (
        "PeerError: process 0 stopped: OSError: [Errno 28] No space left on device: '/data/shard-3'"
    ), one
    assert float(seconds) < 30


def test_a_preemption_notice_to_one_host_saves_the_same_step_on_every_host(small_corpus, tmp_path):
    """SIGTERM to process 1 alone: JAX's preemption service agrees on a step, both processes save it
    and exit 0 within a few steps (two processes resuming a checkpoint: the test above)."""
    config = _sharding_config(small_corpus, MeshConfig(data=2, fsdp=-1, tensor=1))
    config = dataclasses.replace(
        config,
        train=dataclasses.replace(
            config.train, log_every=1, checkpoint_every=10_000, steps=3_000, eval_every=0, diagnostics_every=0
        ),
    )
    workdir = tmp_path / 'preempted'
    procs = _start_two_processes(config, workdir)
    deadline = time.time() + 300
    while not (workdir / 'metrics.jsonl').exists() or '"step": 3,' not in (workdir / 'metrics.jsonl').read_text():
        assert all(p.poll() is None for p in procs) and time.time() < deadline, [p.communicate() for p in procs]
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    saved = sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 3 < saved[0] < 100, (saved, outputs)
    assert {'process_0-of-2.json', 'process_1-of-2.json'} <= {
        p.name for p in (workdir / 'checkpoints' / str(saved[0]) / 'data').iterdir()
    }
    assert all(f'every host saves step {saved[0]}, then exits' in out for out in outputs), outputs
    said = f'preempted: saved step {saved[0]} in {workdir}; run the same command to resume'
    assert said in outputs[0] and f'process 1 of 2: {said}' in outputs[1], outputs


@pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason='libtpu is not installed (pip install "jax[tpu]"), so no TPU topology can be described',
)
def test_aot_compile_for_v5e_4x4_says_each_auto_choice():
    """`--compile_only --topology`: the real train step for a TPU slice, compiled on this CPU machine, every
    `auto` resolved and said (the tiny model: test_attention compiles the 82M 64K step)."""
    out = subprocess.run(
        [
            sys.executable,
            '-m',
            'vrl.main',
            '--config=configs/tiny.py',
            '--compile_only',
            '--topology=v5e:4x4',
            '--config.train.microbatches=0',
            '--config.model.remat=auto',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert 'model.attention_impl=splash (auto on tpu: the tpu kernel serves this config)' in lines
    assert 'model.hand_vjp=all (auto on tpu: what pays on tpu)' in lines
    progress = [line for line in lines if line.startswith('auto fit: microbatches=')]  # each candidate, as compiled
    assert progress and all(
        re.search(r'GiB per device, (fits|does not fit) \(compiled in \d+ s\)$', line) for line in progress
    ), progress
    fit = next(i for i, line in enumerate(lines) if line.startswith('auto fit: train.microbatches='))
    assert lines[fit].startswith('auto fit: train.microbatches=1, model.remat=none (')
    rows = dict(
        line.split(None, 1)
        if not line.startswith(('arguments', 'outputs', 'temporaries', 'total', 'HBM', 'aliased', 'model'))
        else (line[:22].strip(), line[22:].strip())
        for line in lines[fit + 1 :]
    )
    assert rows['devices'] == '16 x TPU v5 lite'
    assert rows['fits'] == 'yes' and rows['HBM / device'] == '16.00 GiB'
    assert 0 < float(rows['total / device'].split()[0]) < 16
    for error_mark in ('E0000', 'INVALID_ARGUMENT', 'Failed to find host bounds'):  # libtpu kept quiet
        assert error_mark not in out.stdout + out.stderr

    def compile_468m(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                '-m',
                'vrl.main',
                '--config=configs/svformer_468m.py',
                '--compile_only',
                '--topology=v5e:2x2',
                *flags,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )

    too_big = compile_468m('--config.data.batch_size=256', '--config.train.microbatches=1', '--config.model.remat=none')
    assert too_big.returncode != 0 and 'does not fit TPU v5 lite' in too_big.stderr  # explicit values win
    nowhere = compile_468m(
        '--config.data.batch_size=4', '--config.data.seq_len=65536', '--config.model.attention_impl=xla'
    )
    assert nowhere.returncode != 0
    assert 'does not fit TPU v5 lite (16.0 GiB) at any setting: even microbatches=1 with remat=full' in nowhere.stderr


def test_launch_scripts_dry_run_name_every_step():
    tpu = subprocess.run(
        [
            'bash',
            'launch/tpu_pod.sh',
            '--dry-run',
            'all',
            '--name=pod1',
            '--config=configs/vanilla_82m.py',
            '--workdir=gs://bucket/run',
            '--',
            '--config.train.steps=100',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(tpu) == 3
    assert tpu[0].startswith('gcloud compute tpus tpu-vm create pod1')
    assert all('--worker=all' in line for line in tpu[1:])
    assert 'pip' in tpu[1] and 'vrl.main' in tpu[2] and 'gs://bucket/run' in tpu[2]
    for step in ('logs', 'delete'):
        line = subprocess.run(
            ['bash', 'launch/tpu_pod.sh', '--dry-run', step, '--name=pod1'],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert line.startswith(f'gcloud compute tpus tpu-vm {"ssh" if step == "logs" else "delete"} pod1')
    tokenize = subprocess.run(
        [
            'bash',
            'launch/tpu_pod.sh',
            '--dry-run',
            'tokenize',
            '--name=pod1',
            '--dataset=web',
            '--data_dir=gs://bucket/tfds',
            '--tokenizer=gs://bucket/tokenizer.json',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(tokenize) == 1 and '--worker=all' in tokenize[0]
    assert (
        r'vrl.data\ tokenize\ --name=web\ --data_dir=gs://bucket/tfds\ --tokenizer=gs://bucket/tokenizer.json'
        in tokenize[0]
    )
    incomplete = subprocess.run(
        ['bash', 'launch/tpu_pod.sh', '--dry-run', 'tokenize', '--name=pod1'], cwd=ROOT, capture_output=True, text=True
    )
    assert incomplete.returncode == 2 and 'tokenize needs --dataset=NAME' in incomplete.stderr
    prepare = subprocess.run(
        [
            'bash',
            'launch/tpu_pod.sh',
            '--dry-run',
            'prepare',
            '--name=pod1',
            '--dataset=web',
            '--input=gs://bucket/raw/*.jsonl.zst',
            '--data_dir=gs://bucket/tfds',
            '--tokenizer=gs://bucket/tokenizer.json',
            '--',
            '--validation_fraction=0.01',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(prepare) == 1 and '--worker=all' in prepare[0]
    assert (
        r'vrl.data\ prepare\ --input=\'gs://bucket/raw/\*.jsonl.zst\'\ --name=web\ --data_dir=gs://bucket/tfds\ '
        r'--tokenizer=gs://bucket/tokenizer.json\ --validation_fraction=0.01'
    ) in prepare[0]
    multi = subprocess.run(
        ['bash', 'launch/tpu_pod.sh', '--dry-run', 'all', '--name=pods', '--slices=2'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(multi) == 5  # one queued resource, then install and train on each of its two slices
    assert multi[0].startswith('gcloud compute tpus queued-resources create pods') and '--node-count=2' in multi[0]
    assert [line.split()[5] for line in multi[1:]] == ['pods-0', 'pods-1'] * 2
    assert all('--config.mesh.slices=2' in line for line in multi[3:])
    slurm = subprocess.run(
        ['bash', 'launch/slurm_gpu.sh', '--dry-run', '--nodes=4', '--gpus_per_node=8'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '#SBATCH --nodes=4' in slurm and '#SBATCH --ntasks-per-node=8' in slurm
    assert '--num_processes=$SLURM_NTASKS --process_id=$SLURM_PROCID' in slurm and '--coordinator_address=' in slurm


@pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason='libtpu is not installed (pip install "jax[tpu]"), so no TPU topology can be described',
)
def test_two_slices_compile_and_only_data_parallelism_crosses_them():
    """v5e:2x2 twice: the outer `data` axis is the slice, fsdp runs within one; no parameter or
    optimizer state is split over `data`, so the data-center network carries only gradients."""
    devices, hbm = aot.tpu_devices('v5e:2x2', num_slices=2)
    config = Config(
        model=ModelConfig(**TINY_MODEL), data=DataConfig(seq_len=128, batch_size=8), mesh=MeshConfig(slices=2)
    )
    mesh = sharding.make_mesh(config.mesh, devices)
    assert dict(mesh.shape) == {'data': 2, 'fsdp': 4, 'context': 1, 'tensor': 1}
    for i in range(2):
        assert {d.slice_index for d in mesh.devices[i].flat} == {i}
    report = aot.compile_train_step(aot.execution(config, 'tpu', lambda line: None), devices, hbm)
    assert report.fits and report.devices == 8
    assert report.hlo_flops > 0 and report.hlo_bytes_accessed > report.argument_bytes  # XLA's cost analysis
    specs = jax.tree.leaves(train_steps(config, mesh).state_shardings, is_leaf=lambda x: hasattr(x, 'spec'))
    assert specs and not any('data' in jax.tree.leaves(tuple(s.spec)) for s in specs)
    assert 'data' in jax.tree.leaves(tuple(sharding.batch_sharding(mesh).spec))
    with pytest.raises(ConfigError, match=r'mesh.slices=1 is invalid: the devices span 2 slices'):
        sharding.make_mesh(MeshConfig(), devices)
