"""The Hugging Face way out and in: vrl.export -> transformers (PyTorch, CPU) and --init_from=hf:."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.runs import params_equal, tiny_config
from vrl import data, decode, hf, train
from vrl.step import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def exported(small_corpus, tmp_path_factory):
    """A trained vanilla MQA run (2 heads, 1 kv head) and its export."""
    root = tmp_path_factory.mktemp('hf')
    config = tiny_config(small_corpus, attention='vanilla', steps=4, checkpoint_every=4)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_kv_heads=1))
    train.run(config, str(root / 'run'))
    out = subprocess.run([sys.executable, '-m', 'vrl.export', f'--workdir={root / "run"}', f'--out={root / "hf"}'],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'vanilla + MQA at step 4' in out.stdout
    return train.load_trained(str(root / 'run')), root / 'hf'


def test_transformers_loads_the_export_and_agrees(exported):
    run, folder = exported
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == 'LlamaForCausalLM'
    text = 'HAMLET: To be, or not to be, that is the question. naïve café'
    ids = data.prompt_tokens(run.config.data, run.tokenizer, text)
    assert AutoTokenizer.from_pretrained(folder)(text)['input_ids'] == ids  # the same ids, EOS in front
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(nnx.merge(run.trainer.graphdef, run.params)(jnp.asarray([ids])))[..., :run.config.model.vocab_size]
    assert theirs.shape == ours.shape
    assert np.max(np.abs(theirs - ours)) / np.max(np.abs(ours)) < 1e-4
    # greedy decoding: transformers' generate and vrl's KV-cache decoder pick the same tokens
    prompt = data.prompt_tokens(run.config.data, run.tokenizer, 'ROMEO:')
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    generator = decode.Generator(run.config.model, run.trainer.graphdef, run.params, max_len=64,
                                 eos_id=run.tokenizer.eos_id)
    assert generator.generate([prompt], decode.Sampling(max_new_tokens=16)).tokens[0] == generated


def test_init_from_hf_restores_identical_parameters(exported):
    run, folder = exported
    trainer = Trainer(run.config, run.trainer.mesh)
    params = train._initial_params(f'hf:{folder}', trainer, run.config)
    assert params_equal(jax.device_get(params), jax.device_get(run.params))


def test_bad_directories_are_named(exported, tmp_path):
    run, folder = exported
    trainer = Trainer(run.config, run.trainer.mesh)

    def copy(edit_config=None, drop=None) -> str:
        bad = tmp_path / f'bad{len(list(tmp_path.iterdir()))}'
        bad.mkdir()
        config = json.loads((folder / 'config.json').read_text())
        (bad / 'config.json').write_text(json.dumps({**config, **(edit_config or {})}))
        tensors = load_file(str(folder / 'model.safetensors'))
        save_file({k: v for k, v in tensors.items() if k != drop}, str(bad / 'model.safetensors'))
        return f'hf:{bad}'

    with pytest.raises(hf.HFError, match=r"holds a 'gpt2' model .*Llama models"):
        train._initial_params(copy({'model_type': 'gpt2'}), trainer, run.config)
    with pytest.raises(hf.HFError, match=r'vocab_size=9999 but model.vocab_size=512'):
        train._initial_params(copy({'vocab_size': 9999}), trainer, run.config)
    with pytest.raises(hf.HFError, match=r"no 'model.layers.1.mlp.up_proj.weight'"):
        train._initial_params(copy(drop='model.layers.1.mlp.up_proj.weight'), trainer, run.config)
    with pytest.raises(hf.HFError, match=r'num_key_value_heads=2 but the config has model.n_kv_heads=1'):
        train._initial_params(copy({'num_key_value_heads': 2}), trainer, run.config)
    with pytest.raises(hf.HFError, match=r'svformer \+ MQA is not a plain Llama decoder'):
        hf.check_exportable(dataclasses.replace(run.config.model, attention='svformer'))
