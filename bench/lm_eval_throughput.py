"""lm-eval adapter throughput: loglikelihood requests/s through vrl.train.scoring.lm_eval_model.VrlLM.

    python bench/lm_eval_throughput.py [--configs tiny,82m] [--batches 1,32] [--requests 64]

Requests look like a multiple-choice task's (hellaswag-like): a ~100-token Shakespeare context
and a ~20-token continuation, four continuations per context. The model is freshly initialised
(throughput does not depend on the weights), the tokenizer is the tiny config's; the first call
compiles and is not timed. Float32 on CPU, the config's compute dtype elsewhere. Like
`python -m vrl.tools.evaluate`, it runs without huge-page malloc (vrl/core/host_memory.py): for scoring it
measured about 5% slower (82M, batch 32: 4.3-4.4 against 4.5-4.7 requests/s, 2026-11-24).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from configs import base, tiny  # noqa: E402
from vrl.core import sharding  # noqa: E402
from vrl.data import corpus, pipeline  # noqa: E402
from vrl.train import aot  # noqa: E402
from vrl.train.config import from_configdict  # noqa: E402
from vrl.train.scoring.lm_eval_model import VrlLM  # noqa: E402
from vrl.train.step import TrainSteps  # noqa: E402
from vrl.train.trained import TrainedRun  # noqa: E402


def requests(tokenizer, n: int) -> list[Instance]:
    """n (context, continuation) pairs cut from the Shakespeare corpus at word boundaries."""
    words = ' '.join(corpus.texts(corpus.open_split('shakespeare', '', 'train'), limit=2000)).split()
    out = []
    for i in range(n):
        start = (i // 4) * 120
        context, continuation = ' '.join(words[start : start + 70]), ' ' + ' '.join(words[start + 70 + i % 4 :][:14])
        out.append(Instance('loglikelihood', {}, (context, continuation), i))
    return out


def requests_per_sec(lm: VrlLM, reqs: list[Instance]) -> float:
    lm.loglikelihood(reqs)  # compiles the program of the requests' row length
    start = time.perf_counter()
    lm.loglikelihood(reqs)
    return len(reqs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--configs', default='tiny,82m', help="'tiny' or base.py sizes (82m, 180m, 468m)")
    parser.add_argument('--batches', default='1,32')
    parser.add_argument('--requests', type=int, default=64)
    args = parser.parse_args()
    tiny_config = from_configdict(tiny.get_config())
    tokenizer = pipeline.load_tokenizer(tiny_config.data, tiny_config.model.vocab_size)
    reqs = requests(tokenizer, args.requests)
    tokens = sum(len(tokenizer.encode(''.join(r.args))) for r in reqs) / len(reqs)
    print(f'{jax.devices()[0].device_kind}; {len(reqs)} loglikelihood requests of {tokens:.0f} tokens on average')
    print(f'{"config":>6} | {"batch":>5} | {"requests/s":>10} | {"tokens/s":>8}')
    for name in args.configs.split(','):
        config = tiny_config if name == 'tiny' else from_configdict(base.get_config(f'vanilla,{name}'))
        if jax.default_backend() == 'cpu':
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, compute_dtype='float32'))
        config = aot.resolve(config, jax.devices(), aot.local_hbm_bytes(), lambda line: None)[
            0
        ]  # named configs: microbatches=0
        trainer = TrainSteps(config, sharding.make_mesh(config.mesh))
        run = TrainedRun(config, tokenizer, trainer, trainer.init_state(0).params, None)
        for batch in map(int, args.batches.split(',')):
            rate = requests_per_sec(VrlLM(run, batch_size=batch), reqs)
            print(f'{name:>6} | {batch:>5} | {rate:>10,.1f} | {rate * tokens:>8,.0f}')


if __name__ == '__main__':
    main()
