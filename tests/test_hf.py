"""The Hugging Face way out and in: vrl.tools.export -> transformers (PyTorch, CPU) and --init_from=hf:.

A trained vanilla run goes through the real command as a plain LlamaForCausalLM; every variant
(random parameters) goes through hf.export as a VrlForCausalLM with vrl's modeling file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    'torch', reason='torch and transformers are in requirements-extra.txt: pip install -r requirements-extra.txt'
)

import torch  # noqa: E402
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import (
    EXPORT_VARIANTS,
    FAST_TIER,
    SKIP_V1_VARIANTS,
    randomize,
    rel_err,
    small_model_config,
    variant_params,
)
from tests.runs import SHARED_RUN_STEPS, cli_args, params_equal
from vrl.data import pipeline
from vrl.interop import hf
from vrl.model import cache as kv_cache
from vrl.model import decode
from vrl.model.decoder import Decoder
from vrl.train import start, trained, validation
from vrl.train.step import TrainSteps

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier
UNDER_OLDEST_TRANSFORMERS = os.environ.get('VRL_UNDER_OLDEST_TRANSFORMERS') == '1'


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def exported(shared_runs, tmp_path_factory):
    """The session's trained vanilla MQA run (2 heads, 1 kv head) and its export."""
    run, out_dir = shared_runs('vanilla'), tmp_path_factory.mktemp('hf') / 'hf'
    out = subprocess.run(
        [sys.executable, '-m', 'vrl.tools.export', f'--workdir={run}', f'--out={out_dir}'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f'vanilla + MQA at step {SHARED_RUN_STEPS}' in out.stdout
    return trained.load_trained(str(run)), out_dir


def _export(workdir: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, '-m', 'vrl.tools.export', f'--workdir={workdir}', f'--out={out}', *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _train_from(config, workdir: Path, folder: Path) -> subprocess.CompletedProcess:
    """`python -m vrl.main` on `config` in `workdir`, its weights from the export in `folder` (hf:)."""
    return subprocess.run(
        [*cli_args(config, workdir), f'--init_from=hf:{folder}'], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_export_overwrites_nothing_it_did_not_write(exported, shared_runs, tmp_path):
    run, folder = exported
    workdir = shared_runs('vanilla')
    again = _export(workdir, folder)  # an earlier export of the same run is replaced
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((folder / 'vrl_export.json').read_text())['workdir'] == str(workdir)
    mine = tmp_path / 'mine'
    mine.mkdir()
    (mine / 'config.json').write_text('{"mine": true}')
    (mine / 'notes.txt').write_text('my notes')
    before = _hashes(mine)
    refused = _export(workdir, mine)
    assert refused.returncode != 0 and 'Traceback' not in refused.stderr
    assert f'--out={mine} holds other files: config.json, notes.txt; choose an empty or new directory' in refused.stderr
    assert _hashes(mine) == before and sorted(p.name for p in tmp_path.iterdir()) == ['mine']  # no staging left
    replaced = _export(workdir, mine, '--overwrite')
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert not (mine / 'notes.txt').exists() and (mine / 'model.safetensors').exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['mine']


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(shared_runs, tmp_path):
    """--out on a disk too small for the weights (a 64 KiB tmpfs in a mount namespace of its own): one line
    saying so and what to do, exit 1, and nothing left on that disk (no staging folder, no half export)."""
    disk = tmp_path / 'small_disk'
    disk.mkdir()
    script = 'mount -t tmpfs -o size=64k tmpfs "$0" && "${@:1}"; code=$?; ls -A "$0"; exit $code'
    command = [sys.executable, '-m', 'vrl.tools.export', f'--workdir={shared_runs("vanilla")}', f'--out={disk}/hf']
    done = subprocess.run(
        ['unshare', '--user', '--map-root-user', '--mount', 'bash', '-c', script, str(disk), *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f'error: no space left on device writing the export to {disk}; nothing of it was kept and {disk}/hf is as it '
        "was: free space (the export needs about its weights' size) and run the same command."
    ], done.stderr[-3000:]
    assert done.stdout == '', done.stdout  # `ls -A` of the small disk after the export: empty


def test_the_manuals_transformers_snippet_prints_the_text_alone(exported, tmp_path):
    """docs/interop.md's Python snippet, run as written on an export (its folder substituted): it prints the
    prompt and what follows, without the EOS the tokenizer puts in front of every text."""
    run, folder = exported
    page = (ROOT / 'docs' / 'interop.md').read_text()
    snippet = page.split('```python\n', 1)[1].split('```', 1)[0]
    assert "'runs/tiny-hf'" in snippet
    done = subprocess.run(
        [sys.executable, '-c', snippet.replace("'runs/tiny-hf'", repr(str(folder)))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith('ROMEO:'), done.stdout


def test_an_export_is_readable_as_any_file_its_user_writes(exported):
    """The export's folder and every file in it carry the modes the umask gives a new folder and file
    (0755 / 0644 under 022), not mkdtemp's 0700 or safetensors' 0600: another user, or a serving
    container under one, can read it."""
    _, folder = exported
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [folder, *folder.iterdir()]}
    assert modes == {folder.name: 0o777 & ~umask, **{p.name: 0o666 & ~umask for p in folder.iterdir()}}, modes


def test_an_interrupted_export_leaves_the_old_directory_and_no_half_one(tmp_path):
    from vrl.tools import export

    out = tmp_path / 'hf'
    export.publish(out, {'workdir': 'a'}, False, lambda folder: (folder / 'model.safetensors').write_text('first'))
    before = _hashes(out)

    def interrupted(folder: Path) -> None:
        (folder / 'model.safetensors').write_text('half')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export.publish(out, {'workdir': 'a'}, False, interrupted)
    assert _hashes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ['hf']
    with pytest.raises(export.ExportError, match='holds an export of a; choose'):
        export.publish(out, {'workdir': 'b'}, False, lambda folder: None)


def test_transformers_loads_the_export_and_agrees(exported):
    run, folder = exported
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == 'LlamaForCausalLM'
    text = 'HAMLET: To be, or not to be, that is the question. naïve café'
    ids = pipeline.prompt_tokens(run.config.data, run.tokenizer, text)
    assert AutoTokenizer.from_pretrained(folder)(text)['input_ids'] == ids  # the same ids, EOS in front
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(nnx.merge(run.trainer.graphdef, run.params)(jnp.asarray([ids])))[
        ..., : run.config.model.vocab_size
    ]
    assert theirs.shape == ours.shape
    assert np.max(np.abs(theirs - ours)) / np.max(np.abs(ours)) < 1e-4
    # greedy decoding: transformers' generate and vrl's KV-cache decoder pick the same tokens
    prompt = pipeline.prompt_tokens(run.config.data, run.tokenizer, 'ROMEO:')
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    generator = decode.Generator(
        run.config.model, run.trainer.graphdef, run.params, max_len=64, eos_id=run.tokenizer.eos_id
    )
    assert generator.generate([prompt], decode.Sampling(max_new_tokens=16)).tokens[0] == generated


def test_init_from_hf_restores_identical_parameters(exported):
    run, folder = exported
    trainer = TrainSteps(run.config, run.trainer.mesh)
    params, note, _ = start.initial_params(f'hf:{folder}', trainer, run.config)
    assert params_equal(jax.device_get(params), jax.device_get(run.params))
    assert note.startswith(f' ({len(load_file(str(folder / "model.safetensors")))} tensors), tokenizer ')
    assert 'also fit a fixed-lambda ResFormer' in note  # a plain Llama config.json cannot say


def test_bad_directories_are_named(exported, tmp_path):
    run, folder = exported
    trainer = TrainSteps(run.config, run.trainer.mesh)

    def copy(edit_config=None, drop=None) -> str:
        bad = tmp_path / f'bad{len(list(tmp_path.iterdir()))}'
        bad.mkdir()
        config = json.loads((folder / 'config.json').read_text())
        (bad / 'config.json').write_text(json.dumps({**config, **(edit_config or {})}))
        tensors = load_file(str(folder / 'model.safetensors'))
        save_file({k: v for k, v in tensors.items() if k != drop}, str(bad / 'model.safetensors'))
        return f'hf:{bad}'

    with pytest.raises(hf.HFError, match=r"holds a 'gpt2' model .*Llama models"):
        start.initial_params(copy({'model_type': 'gpt2'}), trainer, run.config)
    with pytest.raises(hf.HFError, match=r'vocab_size=9999 but model.vocab_size=512'):
        start.initial_params(copy({'vocab_size': 9999}), trainer, run.config)
    with pytest.raises(hf.HFError, match=r"no 'model.layers.1.mlp.up_proj.weight'"):
        start.initial_params(copy(drop='model.layers.1.mlp.up_proj.weight'), trainer, run.config)
    with pytest.raises(hf.HFError, match=r'num_key_value_heads=2 but the config has model.n_kv_heads=1'):
        start.initial_params(copy({'num_key_value_heads': 2}), trainer, run.config)
    # a plain Llama into another variant (ResFormer's lambdas, SVFormer's missing v_proj) is uptraining:
    # test_init_from_a_llama_export_uptrains_another_variant_and_refuses_another_shape


def test_a_skipv1_export_whose_config_and_weights_disagree_is_one_line(exported, tmp_path):
    """A SkipV1Former export whose config.json says another skip_v1 than its v_proj rows hold: vrl's import
    names the tensor and the field; transformers refuses the size mismatch by the tensor's name."""
    run, _ = exported
    cfg, model = _variant('skipv1-mha', run.tokenizer)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.export(params, cfg, 64, run.tokenizer, tmp_path)
    config = json.loads((tmp_path / 'config.json').read_text())
    (tmp_path / 'config.json').write_text(json.dumps({**config, 'skip_v1': 1}))
    claimed = dataclasses.replace(cfg, skip_v1=1)
    shapes = jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(Decoder(claimed, rngs=nnx.Rngs(0)), nnx.Param)))
    with pytest.raises(hf.HFError) as refused:
        hf.load_params(str(tmp_path), claimed, shapes)
    message = str(refused.value)
    assert '\n' not in message
    assert 'model.layers.1.self_attn.v_proj.weight has shape (16, 32) but this config needs (24, 32)' in message
    assert 'model.skip_v1=1 leaves layers >= 2 projecting 3 of 4 value heads; these weights project 2' in message
    with pytest.raises(RuntimeError, match='ignore_mismatched_sizes'):  # after its report naming the tensor
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)


def test_a_damaged_export_is_refused_by_its_checksums(exported, tmp_path):
    """--init_from=hf: an export whose weights changed after it was written (SHA256SUMS disagrees), or whose
    safetensors file was cut short: one HFError naming the file, before any weight is placed."""
    import shutil

    run, folder = exported
    trainer = run.trainer
    flipped = Path(shutil.copytree(folder, tmp_path / 'flipped'))
    data = bytearray((flipped / 'model.safetensors').read_bytes())
    data[-5] ^= 0x10  # a bit of the last tensor's data: the file still parses
    (flipped / 'model.safetensors').write_bytes(bytes(data))
    with pytest.raises(hf.HFError, match=r"model.safetensors's SHA-256 differs from the one .*SHA256SUMS records"):
        start.initial_params(f'hf:{flipped}', trainer, run.config)
    cut = Path(shutil.copytree(folder, tmp_path / 'cut'))
    (cut / 'SHA256SUMS').unlink()  # a directory from elsewhere, no checksums to read
    (cut / 'model.safetensors').write_bytes((folder / 'model.safetensors').read_bytes()[:1000])
    with pytest.raises(hf.HFError, match=r'model.safetensors cannot be read as safetensors \(.*\): damaged\?'):
        start.initial_params(f'hf:{cut}', trainer, run.config)


def _variant(name: str, tokenizer) -> tuple:
    """A random model of the named variant (the tokenizer's vocabulary) and its parameters."""
    cfg = small_model_config(vocab_size=tokenizer.vocab_size, **EXPORT_VARIANTS[name])
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, seed=len(name))
    return cfg, model


@pytest.mark.parametrize(
    'name',
    [*FAST_TIER, 'skipv1-resformer', 'skipv1-mha']
    if UNDER_OLDEST_TRANSFORMERS
    else [
        *variant_params(by_name=True),
        'svformer-cla2-qk_norm',
        'resformer-soft_caps',
        'svformer-windows',
        'modern-resformer',
        'modern-svformer',
        'mhc',
        'resformer-hc-static-3',
        'svformer-cla2-mhc-2',
        'attnres-full',
        'attnres-block1-resformer',
        'attnres-block3-svformer-cla2',
        'attnres-full-skipv1-value_embeds-qk_norm-windows',
        *SKIP_V1_VARIANTS,
        'skipv1-mha',
    ],
)
def test_every_variant_exports_and_comes_back(name, exported, tmp_path):
    run, _ = exported
    cfg, model = _variant(name, run.tokenizer)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.export(params, cfg, 64, run.tokenizer, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(theirs).__name__ == ('LlamaForCausalLM' if name == 'vanilla' else 'VrlForCausalLM')
    tokens = np.random.default_rng(len(name)).integers(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        their_logits = theirs(torch.tensor(tokens)).logits.numpy()
    assert rel_err(their_logits, np.asarray(model(jnp.asarray(tokens)))) < 1e-4
    back = hf.load_params(str(tmp_path), cfg, jax.tree.map(np.shape, params)).params
    assert params_equal(back, params)


def test_a_tied_head_exports_as_llama_and_a_larger_vocabulary_pads_zero_rows(exported, tmp_path):
    """A vanilla with its head tied to the embedding is a LlamaForCausalLM with tie_word_embeddings
    and no lm_head tensor; imported into a model with a larger vocabulary, the new rows are zero, so
    the old tokens' logits are unchanged and the new ones' are 0."""
    run, _ = exported
    cfg = small_model_config(vocab_size=run.tokenizer.vocab_size, attention='vanilla', tie_embeddings=True)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, seed=11)
    hf.export(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, 64, run.tokenizer, tmp_path)
    assert json.loads((tmp_path / 'config.json').read_text())['tie_word_embeddings'] is True
    assert 'lm_head.weight' not in load_file(str(tmp_path / 'model.safetensors'))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == 'LlamaForCausalLM'
    tokens = np.random.default_rng(11).integers(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        their_logits = theirs(torch.tensor(tokens)).logits.numpy()
    assert rel_err(their_logits, np.asarray(model(jnp.asarray(tokens)))[..., : cfg.vocab_size]) < 1e-4

    V, wider = cfg.vocab_size, dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 100)
    wide_model = Decoder(wider, rngs=nnx.Rngs(1))
    shapes = jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(wide_model, nnx.Param)))
    imported = hf.load_params(str(tmp_path), wider, shapes).params
    exported_rows = load_file(str(tmp_path / 'model.safetensors'))['model.embed_tokens.weight']
    np.testing.assert_array_equal(imported['embed'][:V], exported_rows)
    assert not imported['embed'][V:].any()
    nnx.update(wide_model, imported)
    wide_logits = np.asarray(wide_model(jnp.asarray(tokens)))
    assert rel_err(wide_logits[..., :V], their_logits) < 1e-4
    assert not wide_logits[..., V : wider.vocab_size].any()


def _until_eos(tokens: list[int], eos_id: int) -> list[int]:
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


# under the oldest transformers: every kind of cache entry (CLA2's), and the modern recipe's fields
@pytest.mark.parametrize(
    'name',
    ['svformer-cla2', 'modern-svformer', 'skipv1-cla2-value_embeds-qk_norm']
    if UNDER_OLDEST_TRANSFORMERS
    else [
        'svformer-cla2',
        'resformer-per_token',
        'all-baselines',
        'resformer-value_embeds-shared',
        'svformer-cla2-qk_norm',
        'resformer-soft_caps',
        'svformer-windows',
        'modern-svformer',
        'resformer-mudd-vr',
        'hc',
        'neutreno-mhc-3',
        'attnres-block1-resformer',
        'skipv1-resformer',
        'skipv1-cla2-value_embeds-qk_norm',
        'skipv1-mha',
    ],
)
def test_transformers_generate_matches_vrl_decoding(name, exported, tmp_path):
    """Greedy tokens of two left-padded prompts, through transformers' cache (every kind of cache
    entry: keys and values, keys and own value heads, keys only, none) and vrl's."""
    run, _ = exported
    cfg, model = _variant(name, run.tokenizer)
    hf.export(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, 64, run.tokenizer, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    eos = run.tokenizer.eos_id
    prompts = [pipeline.prompt_tokens(run.config.data, run.tokenizer, text) for text in ('ROMEO: What say', 'KING:')]
    want = (
        decode.Generator(cfg, nnx.graphdef(model), nnx.state(model), max_len=48, eos_id=eos)
        .generate(prompts, decode.Sampling(max_new_tokens=12))
        .tokens
    )
    P = max(map(len, prompts))
    ids = torch.tensor([[run.tokenizer.pad_id] * (P - len(p)) + p for p in prompts])
    real = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        got = theirs.generate(ids, attention_mask=real, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert [_until_eos(row, eos) for row in got[:, P:].tolist()] == want


@pytest.mark.parametrize('name', ['svformer-cla2', 'all-baselines', 'resformer-per_token', 'svformer-windows'])
def test_sdpa_and_eager_attention_give_the_same_logits(name, exported, tmp_path):
    """Attention goes through transformers' attention interface: its `sdpa` (the default) and vrl's
    `eager` agree, on left-padded prompts and in cached decoding."""
    run, _ = exported
    cfg, model = _variant(name, run.tokenizer)
    hf.export(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, 64, run.tokenizer, tmp_path)
    tokens = torch.tensor(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 13)))
    real = torch.ones_like(tokens)
    real[0, :4] = 0
    outputs = {}
    for implementation in ('sdpa', 'eager'):
        theirs = AutoModelForCausalLM.from_pretrained(
            tmp_path, trust_remote_code=True, dtype=torch.float32, attn_implementation=implementation
        ).eval()
        assert theirs.config._attn_implementation == implementation
        with torch.no_grad():
            logits = theirs(tokens, attention_mask=real).logits.numpy()
            generated = theirs.generate(tokens, attention_mask=real, max_new_tokens=8, do_sample=False).numpy()
        outputs[implementation] = logits, generated
    assert rel_err(outputs['sdpa'][0], outputs['eager'][0]) < 1e-5
    np.testing.assert_array_equal(outputs['sdpa'][1], outputs['eager'][1])


def test_a_soft_capped_model_attends_eagerly(exported, tmp_path):
    """PyTorch's fused attention has no soft cap: a capped export loads with `eager` by default, and
    transformers refuses `sdpa` for it, naming `eager`."""
    run, _ = exported
    cfg, model = _variant('resformer-soft_caps', run.tokenizer)
    hf.export(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, 64, run.tokenizer, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32)
    assert theirs.config._attn_implementation == 'eager'
    with pytest.raises(ValueError, match='scaled_dot_product_attention'):
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, attn_implementation='sdpa')


def test_the_pytorch_cache_holds_what_vrls_holds(exported, tmp_path):
    """Cache bytes after the same generation, per token: SVFormer's (L + 1) / (2 L) of vanilla's, SkipV1Former's
    1 - (L - 1) s / (2 K L) with s of K value heads V_1's; each what vrl's cache holds (cache.cache_bytes)."""
    run, _ = exported
    nbytes, cfgs = {}, {}
    for name in ('vanilla', 'svformer', 'skipv1', 'skipv1-mha', 'skipv1-cla2'):
        cfg, model = _variant(name, run.tokenizer)
        cfgs[name] = cfg
        hf.export(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, 64, run.tokenizer, tmp_path / name)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True).eval()
        with torch.no_grad():
            out = theirs.generate(
                torch.tensor([[1, 5, 9, 33]]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                return_dict_in_generate=True,
            )
        cache = _cache_of(out)
        assert cache.get_seq_length() == 9
        nbytes[name] = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        assert nbytes[name] == kv_cache.cache_bytes(kv_cache.init_cache(cfg, 1, 9))  # vrl's, float32 as compute_dtype
    L = cfgs['vanilla'].n_layers
    assert nbytes['svformer'] * 2 * L == nbytes['vanilla'] * (L + 1)
    for name in ('skipv1', 'skipv1-mha'):  # against a vanilla of as many kv heads: vanilla's K / 2 times its bytes
        K, s = cfgs[name].n_kv_heads, cfgs[name].skip_v1
        assert nbytes[name] * 2 * K * L * 2 == nbytes['vanilla'] * K * (2 * K * L - (L - 1) * s)


def _cache_of(output) -> object:
    """The cache a transformers output holds, under the field name of the installed release."""
    return output['cache'] if 'cache' in output.__dataclass_fields__ else output['past_key_values']


@pytest.mark.parametrize('argument', ['cache', 'past_key_values'])
def test_the_cache_arrives_under_its_new_and_its_old_name(argument, exported, tmp_path):
    """Token-by-token logits through the cache, given as `cache` (transformers >= 5.24) or
    `past_key_values` (before), equal one forward over the whole sequence (SVFormer + CLA2: entries
    of keys and values, keys only and nothing)."""
    run, _ = exported
    cfg, model = _variant('svformer-cla2', run.tokenizer)
    hf.export(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, 64, run.tokenizer, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    tokens = torch.tensor(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 9)))
    with torch.no_grad():
        whole = theirs(tokens, use_cache=False).logits.numpy()
        out = theirs(tokens[:, :4], use_cache=True)
        steps = [out.logits.numpy()]
        for t in range(4, tokens.shape[1]):
            out = theirs(tokens[:, t : t + 1], use_cache=True, **{argument: _cache_of(out)})
            steps.append(out.logits.numpy())
    assert _cache_of(out).get_seq_length() == tokens.shape[1]
    assert rel_err(np.concatenate(steps, axis=1), whole) < 1e-5
    assert rel_err(whole, np.asarray(model(jnp.asarray(tokens.numpy())))) < 1e-4


def test_every_export_says_which_transformers_it_needs(tmp_path):
    """The model card names vrl's supported range, which requirements-extra.txt installs and whose
    lower bound requirements-oldest.txt pins for the test below."""
    cfg = small_model_config(vocab_size=64, attention='resformer')
    card = hf.model_card(cfg)
    assert f'Needs `{hf.TRANSFORMERS}`' in card and 'trust_remote_code=True' in card
    assert 'trust_remote_code' not in hf.model_card(small_model_config(vocab_size=64))
    assert hf.TRANSFORMERS in (ROOT / 'requirements-extra.txt').read_text().splitlines()
    oldest = hf.TRANSFORMERS.split('>=')[1]
    assert f'transformers=={oldest}' in (ROOT / 'requirements-oldest.txt').read_text().splitlines()


INTEROP_TESTS = (
    'loads_the_export or every_variant_exports or generate_matches or holds_what_vrls_holds '
    'or under_its_new_and_its_old_name'
)
OLDEST_TRANSFORMERS = Path(os.environ.get('VRL_OLDEST_TRANSFORMERS', Path(sys.prefix) / 'oldest-transformers'))


@pytest.mark.skipif(UNDER_OLDEST_TRANSFORMERS, reason='this is that run')
def test_the_oldest_supported_transformers_passes_the_interop_tests(tmp_path, shared_runs_folder):
    """This module's interop tests again (every_variant_exports on the fast tier's four variants and two
    SkipV1Formers; the current transformers takes them all), in a subprocess whose path starts with the oldest
    transformers vrl supports (installed apart: requirements-oldest.txt), reading this session's shared runs."""
    oldest = hf.TRANSFORMERS.split('>=')[1]
    if not (OLDEST_TRANSFORMERS / 'transformers').is_dir():
        pytest.fail(
            f'no transformers in {OLDEST_TRANSFORMERS}: install the oldest supported one with '
            f'`pip install --no-deps --target {OLDEST_TRANSFORMERS} -r requirements-oldest.txt` '
            '(or point VRL_OLDEST_TRANSFORMERS at such a folder)'
        )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith('PYTEST_XDIST')},  # a session of its own
        'PYTHONPATH': os.pathsep.join([str(OLDEST_TRANSFORMERS), str(ROOT)]),
        'VRL_UNDER_OLDEST_TRANSFORMERS': '1',
        'VRL_SHARED_RUNS': str(shared_runs_folder),
    }
    version = subprocess.run(
        [sys.executable, '-c', 'import transformers; print(transformers.__version__)'],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert version.stdout.strip() == oldest, version.stderr[-2000:]
    out = subprocess.run(
        [
            sys.executable,
            '-m',
            'pytest',
            '-q',
            '-p',
            'no:cacheprovider',
            '-p',
            'no:xdist',
            f'--basetemp={tmp_path / "pytest"}',
            'tests/test_hf.py',
            '-k',
            INTEROP_TESTS,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:]
    assert ' passed' in out.stdout.splitlines()[-1] and 'failed' not in out.stdout.splitlines()[-1]


def test_an_export_must_match_the_variant_it_starts(exported, tmp_path):
    """A vrl.tools.export directory starts only the variant it holds; the first field that differs is named."""
    run, _ = exported
    cfg, model = _variant('resformer-learnable', run.tokenizer)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.export(params, cfg, 64, run.tokenizer, tmp_path)
    shapes = jax.tree.map(np.shape, params)
    with pytest.raises(
        hf.HFError, match=r"lambda_mode='learnable' but the config has model.lambda_mode='learnable_plus'"
    ):
        hf.load_params(str(tmp_path), dataclasses.replace(cfg, lambda_mode='learnable_plus'), shapes)


def test_a_llama_directory_without_later_v_proj_starts_svformer(exported, tmp_path):
    """The paper's official SVFormer checkpoints: Llama names and config, no v_proj in layers >= 2."""
    run, folder = exported
    cfg = dataclasses.replace(run.config.model, attention='svformer')
    tensors = load_file(str(folder / 'model.safetensors'))
    (tmp_path / 'config.json').write_text((folder / 'config.json').read_text())
    save_file(
        {k: v for k, v in tensors.items() if not (k.endswith('v_proj.weight') and '.0.' not in k)},
        str(tmp_path / 'model.safetensors'),
    )
    shapes = jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    imported = hf.load_params(str(tmp_path), cfg, shapes)
    params = imported.params
    assert imported.note == ''  # no v_proj in layers >= 2: only SVFormer fits
    np.testing.assert_array_equal(
        params['first']['attn']['wv'].reshape(cfg.d_model, -1).T, tensors['model.layers.0.self_attn.v_proj.weight']
    )
    assert 'wv' not in params['layers']['attn']


def test_a_plain_llama_starting_a_fixed_lambda_resformer_is_flagged(exported):
    """ResFormer with fixed lambdas has no tensors of its own: the Llama tensors cannot tell it from vanilla."""
    run, folder = exported
    cfg = dataclasses.replace(run.config.model, attention='resformer', lambda_mode='identity')
    shapes = jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    assert hf.load_params(str(folder), cfg, shapes).note.startswith('WARNING: a plain Llama config.json')


def test_an_import_trains_with_the_tokenizer_its_weights_came_with(exported, tmp_path):
    """The run trains no tokenizer of its own (whatever model.vocab_size says): it uses the export's,
    or a named one with the same pieces; another named one, or none at all, is refused naming both."""
    run, folder = exported
    config = dataclasses.replace(
        run.config,
        model=dataclasses.replace(run.config.model, vocab_size=1024),
        data=dataclasses.replace(run.config.data, tokenizer=''),
    )
    chosen, source, line = start.hf_tokenizer(config, f'hf:{folder}', tmp_path / 'run')
    assert (source, chosen.data.tokenizer) == (folder / 'tokenizer.model', str(tmp_path / 'run' / 'tokenizer.model'))
    assert line == f'tokenizer {folder / "tokenizer.model"}'
    named = dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=run.tokenizer.path))
    assert start.hf_tokenizer(named, f'hf:{folder}', tmp_path)[:2] == (named, None)  # the same pieces

    from vrl.data import corpus
    from vrl.data import tokenizer as tokenizer_lib

    texts = corpus.texts(corpus.open_split(run.config.data.name, run.config.data.data_dir, 'train'))
    other = tokenizer_lib.train(texts, 600, str(tmp_path / 'other.model'))
    named = dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=other.path))
    with pytest.raises(
        hf.HFError,
        match=rf'data.tokenizer={other.path} is not the tokenizer the weights in '
        rf'{folder} were trained with .*: 600 vs 512 pieces',
    ):
        start.hf_tokenizer(named, f'hf:{folder}', tmp_path)
    bare = tmp_path / 'bare'
    bare.mkdir()
    for name in ('config.json', 'model.safetensors'):
        (bare / name).write_bytes((folder / name).read_bytes())
    (bare / 'tokenizer_config.json').write_text('{}')
    with pytest.raises(
        hf.HFError,
        match=r'has no tokenizer.model or tokenizer.json \(only tokenizer_config.json\)'
        r'.*--config.data.tokenizer=PATH',
    ):
        start.hf_tokenizer(config, f'hf:{bare}', tmp_path)


def test_init_from_a_llama_export_uptrains_another_variant_and_refuses_another_shape(exported, tmp_path):
    """`--init_from=hf:` the vanilla (Llama) export into SVFormer: uptrained (layers >= 2's v_proj left
    out, said in the log) and trained; into a deeper model: one line naming the cause and the fix, exit 1,
    and no workdir (not even the tokenizer the run would have copied in)."""
    run, folder = exported
    model = dataclasses.replace(run.config.model, attention='svformer')
    config = dataclasses.replace(run.config, model=model, data=dataclasses.replace(run.config.data, tokenizer=''))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=1))
    out = _train_from(config, tmp_path / 'svformer', folder)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(
        r'uptraining into svformer \+ MQA: (\d+) of its \1 parameters read; .*left out: layers.attn.wv', out.stdout
    )
    deeper = dataclasses.replace(config, model=dataclasses.replace(model, n_layers=model.n_layers + 1))
    out = _train_from(deeper, tmp_path / 'deeper', folder)
    assert out.returncode == 1 and out.stderr.count('\n') == 1, out.stderr[-3000:]
    assert re.fullmatch(r'error: .*n_layers.*\n', out.stderr), out.stderr
    assert not (tmp_path / 'deeper').exists()


def test_init_from_a_llama_export_into_skipv1former_pools_value_head_pairs(small_corpus, tmp_path):
    """`--init_from=hf:` a Llama export of 2 kv heads into SkipV1Former (skip_v1=1): the one head layers >= 2
    project is the mean of the export's two v_proj heads, layer 1's v_proj is kept whole, the rest as read."""
    from tests.helpers import train_steps
    from tests.runs import tiny_config
    from vrl.core import sharding
    from vrl.train import loop

    vanilla = tiny_config(small_corpus, attention='vanilla', steps=2, checkpoint_every=2)
    loop.run(vanilla, str(tmp_path / 'v'))
    exported = _export(tmp_path / 'v', tmp_path / 'hf')
    assert exported.returncode == 0, exported.stderr[-3000:]
    imported = hf.load_params(
        str(tmp_path / 'hf'),
        vanilla.model,
        jax.tree.map(lambda a: a.shape, train_steps(vanilla, sharding.make_mesh(vanilla.mesh)).abstract_state.params),
    ).params
    target = dataclasses.replace(vanilla, model=dataclasses.replace(vanilla.model, skip_v1=1))
    trainer = train_steps(target, sharding.make_mesh(target.mesh))
    params, note, _ = start.initial_params(f'hf:{tmp_path / "hf"}', trainer, target)
    wv = np.asarray(imported['layers']['attn']['wv'])  # (L - 1, D, 2, Dh)
    np.testing.assert_allclose(np.asarray(params['layers']['attn']['wv']), wv.mean(-2, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(params['first']['attn']['wv']), np.asarray(imported['first']['attn']['wv'])
    )
    assert 'pooled: layers.attn.wv, its 2 value heads averaged in groups of 2' in note, note


def test_train_steps_0_converts_to_a_step_0_checkpoint_the_tools_read(exported, tmp_path):
    """`--init_from=hf:DIR --config.train.steps=0`: a step-0 checkpoint of the imported weights, with
    the export's tokenizer kept in the workdir; its evaluation and its export equal the original's,
    and it trains on."""
    run, folder = exported
    config = dataclasses.replace(
        run.config,
        train=dataclasses.replace(run.config.train, steps=0),
        data=dataclasses.replace(run.config.data, tokenizer=''),
    )
    out = _train_from(config, tmp_path / 'run', folder)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert f'initialised from hf:{folder} (' in log and f'tokenizer {tmp_path / "run" / "tokenizer.model"}' in log
    assert 'train.steps=0: saved the initial parameters as step 0' in log
    assert 'compiling the train step' not in log  # a conversion trains no step
    assert (tmp_path / 'run' / 'tokenizer.model').read_bytes() == (folder / 'tokenizer.model').read_bytes()
    recorded = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    eval_loss = next(r['eval_loss'] for r in recorded if 'eval_loss' in r)
    expected = validation.validate(run.trainer, run.params, run.config, run.tokenizer).loss
    assert abs(eval_loss - expected) < 1e-5 * expected
    again = _export(tmp_path / 'run', tmp_path / 'hf')
    assert again.returncode == 0, again.stderr[-3000:]
    assert 'at step 0' in again.stdout
    original, converted = (
        load_file(str(folder / 'model.safetensors')),
        load_file(str(tmp_path / 'hf' / 'model.safetensors')),
    )
    assert original.keys() == converted.keys()
    assert all(np.array_equal(original[k], converted[k]) for k in original)
    # the converted workdir trains on: the same command with more steps resumes step 0 (--init_from is then
    # ignored, said), with the tokenizer its weights came with
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2, checkpoint_every=2))
    on = _train_from(longer, tmp_path / 'run', folder)
    assert on.returncode == 0, on.stderr[-3000:]
    assert 'resumed at step 0' in on.stdout and 'the workdir keeps the one its run trained with' in on.stdout, on.stdout
    assert f'\ntokenizer {tmp_path / "run" / "tokenizer.model"} (' in on.stdout  # it reads the workdir's copy
    assert 'done at step 2: loss ' in on.stdout and (tmp_path / 'run' / 'checkpoints' / '2').is_dir()
