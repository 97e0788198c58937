"""Helpers for tests that train real runs: a tiny config over the test corpus, the runs a pytest
session trains once for the tests that only read them, the same config as `python -m vrl.main`
arguments, waiting on a run in a subprocess, and a local lm-eval task."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from vrl.model.config import ModelConfig
from vrl.train.config import Config, OptimizerConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]

TINY_MODEL = dict(
    vocab_size=512,
    vocab_pad_multiple=64,
    n_layers=2,
    d_model=32,
    n_heads=2,
    n_kv_heads=2,
    head_dim=16,
    d_ff=64,
    compute_dtype='float32',
)


def host_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process that stands for one host of `devices` fake CPU devices: the suite's
    (tests/conftest.py, compiling for compile time) with that device count."""
    kept = [f for f in os.environ['VRL_TEST_XLA_FLAGS'].split() if not f.startswith('--xla_force_host_platform_')]
    return ' '.join([*kept, f'--xla_force_host_platform_device_count={devices}'])


def tiny_config(small_corpus, attention='resformer', **train_fields) -> Config:
    data_cfg, _ = small_corpus
    # MFU against a stated peak: the CPU's matmul probe (a second of both cores per process) has its
    # own tests (tests/test_hooks.py, tests/test_first_use.py)
    train_cfg = dict(
        steps=12, log_every=4, eval_every=0, eval_batches=2, checkpoint_every=4, sample_tokens=0, peak_flops=1e11
    )
    train_cfg.update(train_fields)
    return Config(
        model=ModelConfig(attention=attention, lambda_mode='learnable', **TINY_MODEL),
        data=dataclasses.replace(data_cfg, num_epochs=0),
        optimizer=OptimizerConfig(peak_lr=3e-3, final_lr=3e-4, warmup_steps=3, decay_steps=60),
        train=TrainConfig(**train_cfg),
    )


SHARED_RUN_STEPS = 4


def shared_run_config(small_corpus, attention: str) -> Config:
    """The config of a shared read-only run: tiny_config's model with 3 layers (a layer above the
    first two, for per-layer statistics) and MQA (2 heads, 1 kv head, for the export's head mapping),
    trained SHARED_RUN_STEPS steps with a checkpoint at the end."""
    config = tiny_config(small_corpus, attention=attention, steps=SHARED_RUN_STEPS, checkpoint_every=SHARED_RUN_STEPS)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=3, n_kv_heads=1))


def shared_run(small_corpus, folder: Path, attention: str) -> Path:
    """The workdir of the shared run of `attention` under `folder`, trained by the first process that
    asks (an exclusive file lock serializes the pytest-xdist workers; the others wait, then read)."""
    from vrl.train import loop

    workdir, done = folder / attention, folder / f'{attention}.done'
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f'{attention}.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            loop.run(shared_run_config(small_corpus, attention), str(workdir))
            done.touch()
    return workdir


def train_losses(config: Config, devices, batches: list[dict]) -> tuple[list[float], Any]:
    """The loss of each step of a fresh seed-0 state over `batches` on a mesh of `devices`, and the final state."""
    from tests.helpers import train_steps
    from vrl.core import sharding

    trainer = train_steps(config, sharding.make_mesh(config.mesh, devices))
    state = trainer.init_state(0)
    losses = []
    for batch in batches:  # as the loop does, the tokens read stay on the host
        state, out = trainer.train_step(
            state, trainer.device_batch({k: v for k, v in batch.items() if k != 'tokens_read'})
        )
        losses.append(float(out['loss']))
    return losses, state


def overrides(config: Config) -> list[str]:
    """Every field of `config` as a command-line override (of configs/tiny.py)."""
    return [
        f'--config.{section}.{key}={value}'
        for section, values in dataclasses.asdict(config).items()
        for key, value in values.items()
    ]


def cli_args(config: Config, workdir: Path | str, module: str = 'vrl.main') -> list[str]:
    """`python -m module` on the same config, as overrides of configs/tiny.py (from any folder)."""
    return [
        sys.executable,
        '-m',
        module,
        f'--config={ROOT / "configs/tiny.py"}',
        f'--workdir={workdir}',
        *overrides(config),
    ]


_NOT_FOR_USERS = re.compile(r'Traceback|ownload|\[Gloo\]|^[IWEF]\d{4} \d\d:\d\d:\d\d')


def not_for_users(said: str) -> list[str]:
    """The lines of a command's output that a user should not see: a traceback, a download banner,
    Gloo's connections or any other native library's log line (absl's format)."""
    return [line for line in said.splitlines() if _NOT_FOR_USERS.search(line)]


def start_run(config: Config, workdir: Path) -> subprocess.Popen:
    """`python -m vrl.main` on `config` in the background, stdout and stderr together."""
    return subprocess.Popen(
        cli_args(config, workdir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def params_equal(a, b) -> bool:
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f'run ended early: {proc.stdout.read()}')
        if time.time() > deadline:
            proc.kill()
            raise AssertionError('timed out waiting for the run')
        time.sleep(0.05)


def logged_steps(workdir: Path) -> int:
    """How many training-loss records metrics.jsonl holds."""
    path = workdir / 'metrics.jsonl'
    return path.read_text().count('"loss"') if path.exists() else 0


def saved_steps(workdir: Path) -> list[int]:
    folder = workdir / 'checkpoints'
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []


CHOICE_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

# questions with two or three continuations, some right by the plays' text and some not
CHOICE_DOCS = [
    {'question': q, 'choices': c, 'answer': a}
    for q, c, a in [
        ('HAMLET: To be, or not to b', ['e', 'ee', 'lue'], 0),
        ('KING: My lord, what news from', [' France?', ' the moon?'], 0),
        ('Who is there?', [' Nay, answer me.', ' café', ' 日本'], 1),
        ('ROMEO: But, soft! what light through yonder', [' window breaks?', ' door squeaks?'], 0),
        ('Good my lord, I pray', [' you', ' them', ' thee'], 0),
        ('The king is', [' dead', ' blue', ' seven'], 0),
        ('My', [' lord', ' dog'], 0),
        ('Exeunt', [' all', ' none'], 1),
    ]
]


def write_choice_task(folder: Path, docs: list[dict] | None = CHOICE_DOCS, name: str = 'toy_choice') -> Path:
    """An lm-eval multiple-choice task `name` over local JSONL (missing when docs is None), in folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f'{name}.jsonl'
    if docs is not None:
        data.write_text(''.join(json.dumps(d) + '\n' for d in docs))
    (folder / f'{name}.yaml').write_text(CHOICE_TASK.format(name=name, data=data))
    return folder


TEXT_TASK = """task: toy_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""


def write_text_task(folder: Path) -> Path:
    """An lm-eval perplexity task `toy_text` (loglikelihood_rolling) over CHOICE_DOCS' questions, in folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / 'toy_text.jsonl'
    data.write_text(
        ''.join(json.dumps({'text': d['question'] + d['choices'][d['answer']]}) + '\n' for d in CHOICE_DOCS)
    )
    (folder / 'toy_text.yaml').write_text(TEXT_TASK.format(data=data))
    return folder
