"""vrl's entry point: `python -m vrl.main --config=configs/tiny.py --workdir=DIR`.

`--summary` prints the model's size and cost from the config alone and exits;
otherwise the config is trained (vrl/train/loop.py). Overrides: `--config.train.steps=200`.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import re
import sys

from absl import app, flags
from ml_collections import config_flags

from vrl.core import cli, extras, multihost, peers
from vrl.core.config import ConfigError
from vrl.model import accounting, resolve
from vrl.model.config import ModelConfig
from vrl.train.config import Config, from_configdict


def _define_flags() -> cli.Args:
    return {
        'config': config_flags.DEFINE_config_file(
            'config', None, 'A configs/*.py file (":arg" passes an argument).', lock_config=True
        ),
        'workdir': flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and TensorBoard logs go here.'),
        'summary': flags.DEFINE_bool('summary', False, 'Print the model summary and exit.'),
        'summary_json': flags.DEFINE_bool('summary_json', False, 'With --summary: also one JSON line at the end.'),
        'fresh': flags.DEFINE_bool(
            'fresh',
            False,
            'Start over from step 0: the run in --workdir moves to '
            'WORKDIR/previous_runs/ (a run --fresh started resumes under the same command).',
        ),
        'compile_only': flags.DEFINE_bool(
            'compile_only',
            False,
            'Compile the train step ahead of time, print '
            'per-device memory and FLOPs, exit non-zero if it does not fit.',
        ),
        'topology': flags.DEFINE_string(
            'topology',
            None,
            'With --compile_only: a TPU slice such as v5e:4x4 '
            '(needs libtpu; no TPU needed). Default: the local devices.',
        ),
        'num_slices': flags.DEFINE_integer(
            'num_slices',
            1,
            'With --topology: compile for this many such slices '
            'joined over the data-center network (sets mesh.slices).',
        ),
        'take_over_lease': flags.DEFINE_bool(
            'take_over_lease',
            False,
            'A --workdir on a bucket: take its lease at '
            'once, without waiting train.lease_stale_seconds for its holder to '
            'renew it; only when that run is surely gone (its VMs deleted).',
        ),
        **multihost.define_flags(),
        'init_from': flags.DEFINE_string(
            'init_from',
            None,
            'Initialise parameters from this checkpoint directory '
            '(a step folder or a workdir), or from a Hugging Face Llama directory as '
            'hf:DIR, instead of at random.',
        ),
        'branch_from': flags.DEFINE_string(
            'branch_from',
            None,
            "Continue another run's state (parameters, "
            'optimizer, data position) from its step folder DIR/checkpoints/STEP '
            'in this new workdir, e.g. to extend a wsd run from its last stable '
            'step.',
        ),
    }


ASSUMED_MFU = 0.4  # --summary's step-time estimate: about what a tuned run reaches (docs/performance.md)


def _human(n: float) -> str:
    for unit, scale in (('G', 1e9), ('M', 1e6), ('K', 1e3)):
        if abs(n) >= scale:
            return f'{n / scale:.2f}{unit}'
    return f'{n:.0f}'


def summary_rows(config: Config) -> list[tuple[str, str]]:
    m, acc = config.model, accounting.account(config.model, config.data.seq_len)
    mha = accounting.account(accounting.vanilla_mha(m), config.data.seq_len)
    tokens = config.data.batch_size * config.data.seq_len
    vocab = (
        f'{m.vocab_size} (padded to {m.padded_vocab_size})'
        if m.padded_vocab_size != m.vocab_size
        else str(m.vocab_size)
    )
    history_bytes = accounting.layer_history_bytes_per_token(m)  # block outputs, or hyper-connections' streams
    kept = 'once per layer, as the hidden state' if m.residual in ('hc', 'mhc') else 'once, not once per layer'
    history = [
        (
            f'layer history / token ({resolve.local_compute_dtype(m)})',
            f'{history_bytes:,} B (kept for the backward pass {kept})',
        )
    ]
    return [
        ('variant', m.variant_name),
        ('layers', str(m.n_layers)),
        ('d_model', str(m.d_model)),
        ('heads / kv heads / head dim', f'{m.n_heads} / {m.n_kv_heads} / {m.head_dim}'),
        ('d_ff (SwiGLU)', str(m.d_ff)),
        ('vocab', vocab),
        ('tied embeddings', str(m.tie_embeddings)),
        ('params', f'{_human(acc.params)} ({acc.params:,})'),
        ('params, unpadded vocab', f'{_human(acc.params_unpadded)} ({acc.params_unpadded:,})'),
        ('non-embedding params', f'{_human(acc.non_embedding_params)} ({acc.non_embedding_params:,})'),
        (f'train FLOPs / token (seq {config.data.seq_len})', _human(acc.flops_per_token)),
        (
            f'KV cache / token ({resolve.local_compute_dtype(m)})',
            f'{acc.kv_cache_bytes_per_token:,} B '
            f'({acc.kv_cache_bytes_per_token / mha.kv_cache_bytes_per_token:.3f} of vanilla MHA, '
            f'{mha.kv_cache_bytes_per_token:,} B)',
        ),
        ('KV cache / token, exported', _served_cache(m, acc.kv_cache_bytes_per_token)),
        (
            f'KV cache at seq {config.data.seq_len}',
            f'{accounting.kv_cache_bytes(m, config.data.seq_len):,} B a sequence'
            + (f' (local layers keep {m.attention_window} positions)' if m.attention_window else ''),
        ),
        *(history if history_bytes else []),
        ('batch', f'{config.data.batch_size} sequences x {config.data.seq_len} tokens = {tokens:,} tokens a step'),
        ('training', f'{config.train.steps:,} steps = {_human(config.train.steps * tokens)} tokens'),
    ]


def _served_cache(m: ModelConfig, ours: int) -> str:
    """The cache per token in the Hugging Face export's DynamicCache and in vLLM's pages: vrl's slots, all
    holding every position in the export (no ring buffers), and in vLLM where V_1's heads are paged apart
    (SVFormer, SkipV1Former: one block table for every page); vLLM keeps other models' windows."""
    served = accounting.served_kv_cache_bytes_per_token(m)
    if served == ours:
        return 'the same in transformers and vLLM'
    paged_apart = m.attention == 'svformer' or m.skip_v1
    return (
        f'{served:,} B in transformers'
        + (' and vLLM' if paged_apart else '')
        + ", which keep a local layer's keys for every position"
        + ('' if paged_apart else "; vLLM keeps the windows, as vrl's own cache does")
    )


def step_time_row(config: Config) -> tuple[str, str]:
    """The train step's time on this machine's devices at ASSUMED_MFU of their peak FLOP/s: an
    estimate to plan by, not a measurement."""
    import jax

    from vrl.train import metrics

    devices = jax.devices()
    peak = metrics.peak_flops(config.train.peak_flops, resolve.local_compute_dtype(config.model), devices)
    flops = accounting.account(config.model, config.data.seq_len).flops_per_token
    seconds = flops * config.data.batch_size * config.data.seq_len / (ASSUMED_MFU * peak.flops)
    return (
        f'step time, estimated ({len(devices)} {jax.default_backend()} device(s))',
        f'{seconds:.3g} s at {ASSUMED_MFU:.0%} MFU of {peak}',
    )


def print_summary(config: Config, as_json: bool) -> None:
    rows = summary_rows(config) + [step_time_row(config)]
    width = max(len(k) for k, _ in rows)
    print('\n'.join(f'{k:<{width}}  {v}' for k, v in rows))
    if as_json:
        m = config.model
        acc = accounting.account(m, config.data.seq_len)
        mha = accounting.account(accounting.vanilla_mha(m), config.data.seq_len)
        print(
            json.dumps(
                {
                    'variant': m.variant_name,
                    'attention': m.attention,
                    'lambda_mode': m.lambda_mode,
                    'n_layers': m.n_layers,
                    **dataclasses.asdict(acc),
                    'kv_cache_vs_vanilla_mha': acc.kv_cache_bytes_per_token / mha.kv_cache_bytes_per_token,
                }
            )
        )


def _compile_only(config: Config, topology: str | None, num_slices: int) -> None:
    from vrl.train import aot

    if topology:
        import jax

        # compile for the described slice only: no TPU runtime here to start, no executable to cache
        jax.config.update('jax_platforms', 'cpu')
        jax.config.update('jax_compilation_cache_dir', None)
        devices, hbm = aot.tpu_devices(topology, num_slices)
        config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, slices=num_slices))
    else:
        import jax

        devices, hbm = jax.devices(), aot.local_hbm_bytes()
    fitted, report = aot.resolve(config, devices, hbm, lambda line: print(line, flush=True))
    report = report or aot.compile_train_step(fitted, devices, hbm)
    print(report.table())
    if not report.fits:
        sys.exit(
            f'error: the train step needs {report.total_bytes / aot.GiB:.2f} GiB per device but '
            f'{report.device_kind} has {report.hbm_bytes / aot.GiB:.2f} GiB: lower data.batch_size, '
            'use model.remat=full, or shard more (mesh.fsdp / mesh.tensor).'
        )


def _require_extras(config: Config, init_from: str | None) -> None:
    """The packages of requirements-extra.txt that this run will need, checked before any work."""
    if init_from and init_from.startswith('hf:'):
        extras.require('--init_from=hf:DIR', 'safetensors')
    if config.train.wandb_project:
        extras.require('train.wandb_project (Weights & Biases)', 'wandb')
    if config.train.task_names:
        extras.require('train.downstream_tasks (lm-evaluation-harness)', 'lm_eval')


def main(args: cli.Args) -> None:
    if not args['topology'].value:
        cli.enable_compilation_cache()
    if args['config'].value is None:
        raise app.UsageError('--config is required, e.g. --config=configs/tiny.py')
    try:
        config = from_configdict(args['config'].value)
    except OSError as e:  # config_flags defers a missing or broken config file to here
        missing = re.search(r"No such file or directory: '([^']+)'", str(e))
        if missing:
            sys.exit(
                f'error: the config file {missing.group(1)} does not exist (looked from {os.getcwd()}): name one '
                'of configs/*.py, e.g. --config=configs/tiny.py'
            )
        sys.exit(f'error: {" ".join(str(e).split())}')
    except ConfigError as e:
        sys.exit(f'error: invalid config: {e}')
    if args['summary'].value:
        print_summary(config, args['summary_json'].value)
        return
    if args['compile_only'].value:
        _compile_only(config, args['topology'].value, args['num_slices'].value)
        return
    _require_extras(config, args['init_from'].value)
    multihost.initialize(args)
    cli.require(args, 'workdir')
    from vrl.train import loop  # here, so that --summary needs no data stack
    from vrl.train.rundir import checkpoint  # here, so that --summary needs no data stack
    from vrl.train.rundir.lease import LeaseLostError

    try:
        loop.run(
            config,
            args['workdir'].value,
            fresh=args['fresh'].value,
            init_from=args['init_from'].value,
            branch_from=args['branch_from'].value,
            take_over_lease=args['take_over_lease'].value,
        )
    except (checkpoint.SaveError, LeaseLostError) as e:
        # a failed save's writer threads can still print asyncio noise while Python shuts down, and a
        # save in flight when the lease was lost must write no more: end the process here
        say = functools.partial(print, f'error: {e}', file=sys.stderr, flush=True)
        peers.stop(multihost.line_of(e), say)  # several processes: the others stop too
        say()
        os._exit(1)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        sys.exit(
            f'error: no space left on device writing {e.filename or args["workdir"].value}; free space and '
            'run the same command to resume.'
        )


def cli_main() -> None:
    """`vrl-train` (pyproject.toml's scripts): `python -m vrl.main` by another name."""
    cli.run(main, _define_flags, schema=Config)


if __name__ == '__main__':
    cli_main()
