"""vrl's train step against a PyTorch one at the same shape, their steps alternated in one process.

    python bench/against_pytorch.py [--config 82m] [--variants vanilla,resformer,svformer]
                                    [--dtype float32|bfloat16] [--seq_len 512] [--batch 4] [--steps 5]

The PyTorch step is transformers' LlamaForCausalLM with eager attention (the paper's official code
is a fork of it; its value-residual variants add elementwise work only), the same layers, widths,
heads and vocabulary (vrl pads its output head to `model.vocab_pad_multiple`; PyTorch's is the
exact vocabulary), parameters in float32, `torch.optim.AdamW` with gradient clipping at 1.0 as
vrl's step does; `--dtype bfloat16` runs PyTorch's forward and loss under
`torch.autocast('cpu', torch.bfloat16)` and vrl with `model.compute_dtype=bfloat16`. Every vrl
variant is measured against the same Llama step, in `--steps` rounds that alternate the two,
because this shared host drifts by several percent over minutes: a round runs two steps of each
and times the second (the first after a switch pays for memory the other just freed). Step time
is the median over the rounds.

To imitate a smaller ISA on a bigger machine, limit both libraries (docs/performance.md):

    XLA_FLAGS=--xla_cpu_max_isa=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/against_pytorch.py

Needs requirements-extra.txt (torch, transformers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.train_throughput import Stepper, bench_config  # noqa: E402
from vrl.core import backend, host_memory  # noqa: E402
from vrl.train.config import Config  # noqa: E402

try:
    import torch
    import transformers
except ImportError as e:
    raise SystemExit(
        f'bench/against_pytorch.py needs PyTorch and transformers ({e}): pip install -r requirements-extra.txt'
    ) from e


class TorchStep:
    """LlamaForCausalLM at `config`'s shape, one AdamW step per call on a fixed random batch."""

    def __init__(self, config: Config, dtype: str):
        model, data = config.model, config.data
        torch.manual_seed(0)
        llama = transformers.LlamaConfig(
            vocab_size=model.vocab_size,
            hidden_size=model.d_model,
            intermediate_size=model.d_ff,
            num_hidden_layers=model.n_layers,
            num_attention_heads=model.n_heads,
            num_key_value_heads=model.n_kv_heads,
            head_dim=model.head_dim,
            max_position_embeddings=data.seq_len,
            rms_norm_eps=model.norm_eps,
            rope_theta=model.rope_theta,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            attn_implementation='eager',
        )
        self.model = transformers.LlamaForCausalLM(llama).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        self.autocast = dtype == 'bfloat16'
        rng = np.random.default_rng(0)
        self.tokens = torch.from_numpy(rng.integers(0, model.vocab_size, (data.batch_size, data.seq_len)))
        self.step()  # warm up

    def step(self) -> float:
        """Seconds for one train step."""
        start = time.perf_counter()
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def _second(stepper: TorchStep | Stepper) -> float:
    """Seconds of the second of two steps: the first after the other framework's steps pays for
    memory pages the other has given back (1-2 s more on this 2-core host, for either framework)."""
    stepper.step()
    return stepper.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--config', default='82m')
    parser.add_argument('--variants', default='vanilla,resformer,svformer')
    parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
    parser.add_argument('--seq_len', type=int, default=512)
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--steps', type=int, default=5)
    args = parser.parse_args()
    limits = ' '.join(
        f'{k}={os.environ[k]}'
        for k in ('ONEDNN_MAX_CPU_ISA', 'ATEN_CPU_CAPABILITY', 'MKL_ENABLE_INSTRUCTIONS')
        if k in os.environ
    )
    print(
        f'{backend.describe_cpu_isa()}; PyTorch {torch.__version__} ({torch.get_num_threads()} threads, '
        f'ATen {torch.backends.cpu.get_cpu_capability()}{"; " + limits if limits else ""}); {args.dtype}, '
        f'batch {args.batch} x {args.seq_len}; vrl on {jax.device_count()} {jax.devices()[0].platform} device(s)'
    )
    print(
        f'{"variant":>12} | {"vrl step s":>10} | {"PyTorch s":>9} | {"vrl tok/s":>9} | {"PyTorch tok/s":>13} | '
        f'{"vrl / PyTorch":>13}'
    )
    torch_step = None
    for variant in args.variants.split(','):
        vrl_step = Stepper(bench_config(args.config, variant, args.seq_len, args.batch, 'none', args.dtype))
        torch_step = torch_step or TorchStep(vrl_step.config, args.dtype)
        vrl_times, torch_times = [], []
        for _ in range(args.steps):
            torch_times.append(_second(torch_step))
            vrl_times.append(_second(vrl_step))
        vrl_s, torch_s = statistics.median(vrl_times), statistics.median(torch_times)
        tokens = args.batch * args.seq_len
        print(
            f'{variant:>12} | {vrl_s:>10.3f} | {torch_s:>9.3f} | {tokens / vrl_s:>9,.0f} | '
            f'{tokens / torch_s:>13,.0f} | '
            f'{torch_s / vrl_s:>12.2f}x',
            flush=True,
        )
        del vrl_step


if __name__ == '__main__':
    host_memory.use_huge_pages()
    main()
