"""What scoring lm-eval tasks while training costs (train.downstream_tasks, vrl/train/downstream.py).

    python bench/downstream_cost.py [--size 82m] [--limit 500] [--rows 32] [--train_rows 2] [--every 1000]

One evaluation of a small standard suite, shaped like hellaswag (4 endings), piqa (2 solutions),
arc_easy (4 short answers) and lambada (one last word, loglikelihood), `--limit` examples each,
on a freshly initialised model of the base config's size at 2,048 tokens (the cost does not
depend on the weights), through the same call the training hook makes. The tasks are local
JSONL files cut from the embedded Shakespeare corpus (nothing is downloaded), tokenized by the
tiny config's tokenizer. The first evaluation compiles and is not timed.

Then a train step of `--train_rows` sequences, timed after its compile, gives this device's
training tokens/s; the fraction is one evaluation's seconds over the training seconds of
`--every` steps of the config's batch (1,024 x 2,048 tokens for the base sizes) at that rate.
Float32 on CPU, the config's compute dtype elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import base, tiny  # noqa: E402
from vrl.core import sharding  # noqa: E402
from vrl.data import corpus, pipeline  # noqa: E402
from vrl.train import aot  # noqa: E402
from vrl.train.config import from_configdict  # noqa: E402
from vrl.train.scoring import lm_eval_model, lm_eval_tasks  # noqa: E402
from vrl.train.step import TrainSteps  # noqa: E402
from vrl.train.trained import TrainedRun  # noqa: E402

# name: (choices, words of context, words per choice); 1 choice = a loglikelihood task (lambada's kind)
SHAPES = {
    'hellaswag_like': (4, 40, 20),
    'piqa_like': (2, 15, 20),
    'arc_easy_like': (4, 25, 4),
    'lambada_like': (1, 70, 1),
}
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
doc_to_text: "{{{{question}}}}"
{kind}
"""
CHOICE = """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}, {metric: acc_norm}]"""
LAST_WORD = """output_type: loglikelihood
doc_to_target: "{{choices[0]}}"
metric_list: [{metric: perplexity, aggregation: perplexity, higher_is_better: false}, {metric: acc}]"""


def write_tasks(folder: Path, examples: int) -> list[str]:
    """The four tasks' YAML and JSONL in `folder`, cut from the corpus at word boundaries."""
    words = ' '.join(corpus.texts(corpus.open_split('shakespeare', '', 'train'), limit=4000)).split()
    rng = np.random.default_rng(0)
    for name, (choices, context, length) in SHAPES.items():
        docs = []
        for _ in range(examples):
            starts = rng.integers(0, len(words) - context - length, size=choices + 1)
            docs.append(
                {
                    'question': ' '.join(words[starts[0] : starts[0] + context]),
                    'choices': [' ' + ' '.join(words[s : s + length]) for s in starts[1:]],
                    'answer': 0,
                }
            )
        (folder / f'{name}.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in docs))
        kind = LAST_WORD if choices == 1 else CHOICE
        (folder / f'{name}.yaml').write_text(TASK_YAML.format(name=name, data=folder / f'{name}.jsonl', kind=kind))
    return list(SHAPES)


def train_tokens_per_sec(config, trainer: TrainSteps, rows: int) -> float:
    state = trainer.init_state(0)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (rows, config.data.seq_len + 1))
    batch = trainer.device_batch(
        {
            'inputs': tokens[:, :-1].astype(np.int32),
            'targets': tokens[:, 1:].astype(np.int32),
            'loss_mask': np.ones((rows, config.data.seq_len), np.int32),
        }
    )
    state, out = trainer.train_step(state, batch)  # compiles
    jax.block_until_ready(out)
    start = time.perf_counter()
    state, out = trainer.train_step(state, batch)
    jax.block_until_ready(out)
    return rows * config.data.seq_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--size', default='82m', help='a base.py size: 82m, 180m, 468m')
    parser.add_argument('--limit', type=int, default=500, help='examples per task')
    parser.add_argument('--rows', type=int, default=32, help='sequences per scoring batch')
    parser.add_argument('--train_rows', type=int, default=2, help='sequences of the timed train step')
    parser.add_argument('--every', type=int, default=1000, help='steps between evaluations (train.downstream_every)')
    parser.add_argument('--layers', type=int, default=0, help="n_layers instead of the size's (0: the size's)")
    args = parser.parse_args()
    tokenizer_config = from_configdict(tiny.get_config())
    config = from_configdict(base.get_config(f'vanilla,{args.size}'))
    steps_tokens = config.data.batch_size * config.data.seq_len
    model = dataclasses.replace(config.model, vocab_size=tokenizer_config.model.vocab_size)
    if args.layers:
        model = dataclasses.replace(model, n_layers=args.layers)
    if jax.default_backend() == 'cpu':
        model = dataclasses.replace(model, compute_dtype='float32')
    model = dataclasses.replace(model, remat='none')
    data = dataclasses.replace(config.data, batch_size=args.train_rows)
    config = dataclasses.replace(
        config, model=model, data=data, train=dataclasses.replace(config.train, microbatches=1)
    )
    trainer = TrainSteps(
        aot.execution(config, jax.default_backend(), lambda line: None), sharding.make_mesh(config.mesh)
    )
    tokenizer = pipeline.load_tokenizer(tokenizer_config.data, model.vocab_size)
    run = TrainedRun(config, tokenizer, trainer, trainer.init_state(0).params, 0)
    lm = lm_eval_model.VrlLM(run, batch_size=args.rows)
    with tempfile.TemporaryDirectory() as folder:
        tasks = write_tasks(Path(folder), args.limit)
        task_manager = lm_eval_tasks.load_tasks(tasks, folder)
        lm_eval_model.run_tasks(lm, tasks, task_manager, limit=args.limit, quiet=True)  # compiles
        start = time.perf_counter()
        results = lm_eval_model.run_tasks(lm, tasks, task_manager, limit=args.limit, quiet=True)
        seconds = time.perf_counter() - start
    requests = sum(results['n-samples'][t]['effective'] * max(1, SHAPES[t][0]) for t in tasks)
    rate = train_tokens_per_sec(config, trainer, args.train_rows)
    train_seconds = args.every * steps_tokens / rate
    print(
        f'{jax.devices()[0].device_kind} x {jax.device_count()}; vanilla {args.size}, seq_len {config.data.seq_len}, '
        f'{args.rows} rows per scoring batch; {", ".join(tasks)}: {args.limit} examples each'
    )
    print('| requests | evaluation s | requests/s | train tokens/s | train s per evaluation | fraction |')
    print('|---|---|---|---|---|---|')
    print(
        f'| {requests:,} | {seconds:.1f} | {requests / seconds:,.1f} | {rate:,.0f} | {train_seconds:,.0f} '
        f'({args.every} steps of {steps_tokens:,} tokens) | {seconds / (seconds + train_seconds):.3%} |'
    )


if __name__ == '__main__':
    main()
