"""vrl's entry point: `python -m vrl.main --config=configs/tiny.py --workdir=DIR`.

`--summary` prints the model's size and cost from the config alone and exits;
otherwise the config is trained (vrl/train.py). Overrides: `--config.train.steps=200`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from vrl import accounting, host_memory
from vrl.config import Config, ConfigError, from_configdict

_CONFIG = config_flags.DEFINE_config_file('config', None, 'A configs/*.py file (":arg" passes an argument).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and TensorBoard logs go here.')
_SUMMARY = flags.DEFINE_bool('summary', False, 'Print the model summary and exit.')
_SUMMARY_JSON = flags.DEFINE_bool('summary_json', False, 'With --summary: also one JSON line at the end.')
_FRESH = flags.DEFINE_bool('fresh', False, 'Start over from step 0: the run in --workdir moves to '
                           'WORKDIR/previous_runs/ (a run --fresh started resumes under the same command).')
_COMPILE_ONLY = flags.DEFINE_bool('compile_only', False, 'Compile the train step ahead of time, print '
                                   'per-device memory and FLOPs, exit non-zero if it does not fit.')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'With --compile_only: a TPU slice such as v5e:4x4 '
                                '(needs libtpu; no TPU needed). Default: the local devices.')
_NUM_SLICES = flags.DEFINE_integer('num_slices', 1, 'With --topology: compile for this many such slices '
                                   'joined over the data-center network (sets mesh.slices).')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'Multi-process: host:port of process 0 '
                                   '(GPU clusters, localhost tests). Cloud TPU and SLURM are auto-detected.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Multi-process: how many processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'Multi-process: this process\'s index.')
_INIT_FROM = flags.DEFINE_string('init_from', None, 'Initialise parameters from this checkpoint '
                                 'directory (a step folder or a workdir), or from a Hugging Face Llama '
                                 'directory as hf:DIR, instead of at random.')


def _human(n: float) -> str:
    for unit, scale in (('G', 1e9), ('M', 1e6), ('K', 1e3)):
        if abs(n) >= scale:
            return f'{n / scale:.2f}{unit}'
    return f'{n:.0f}'


def summary_rows(config: Config) -> list[tuple[str, str]]:
    m, acc = config.model, accounting.account(config.model, config.data.seq_len)
    mha = accounting.account(accounting.vanilla_mha(m), config.data.seq_len)
    vocab = (f'{m.vocab_size} (padded to {m.padded_vocab_size})' if m.padded_vocab_size != m.vocab_size
             else str(m.vocab_size))
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
        (f'KV cache / token ({m.compute_dtype})', f'{acc.kv_cache_bytes_per_token:,} B '
         f'({acc.kv_cache_bytes_per_token / mha.kv_cache_bytes_per_token:.3f} of vanilla MHA, '
         f'{mha.kv_cache_bytes_per_token:,} B)'),
    ]


def print_summary(config: Config, as_json: bool) -> None:
    rows = summary_rows(config)
    width = max(len(k) for k, _ in rows)
    print('\n'.join(f'{k:<{width}}  {v}' for k, v in rows))
    if as_json:
        m = config.model
        acc = accounting.account(m, config.data.seq_len)
        mha = accounting.account(accounting.vanilla_mha(m), config.data.seq_len)
        print(json.dumps({'variant': m.variant_name, 'attention': m.attention, 'lambda_mode': m.lambda_mode,
                          'n_layers': m.n_layers, **dataclasses.asdict(acc),
                          'kv_cache_vs_vanilla_mha': acc.kv_cache_bytes_per_token / mha.kv_cache_bytes_per_token}))


def _enable_compilation_cache() -> None:
    """Compiled steps are reused across runs (JAX_COMPILATION_CACHE_DIR overrides the place)."""
    import jax
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update('jax_compilation_cache_dir', str(Path.home() / '.cache' / 'vrl' / 'jax_cache'))


def _initialize_distributed() -> None:
    """jax.distributed for several processes: explicit flags, or a detected Cloud TPU pod / SLURM job."""
    import jax
    if _COORDINATOR.value:
        jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU processes talk over gloo
        jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    elif ',' in os.environ.get('TPU_WORKER_HOSTNAMES', '') or int(os.environ.get('SLURM_NTASKS', '1')) > 1:
        jax.distributed.initialize()


def _compile_only(config: Config) -> None:
    from vrl import aot
    if _TOPOLOGY.value:
        import jax
        # compile for the described slice only: no TPU runtime here to start, no executable to cache
        jax.config.update('jax_platforms', 'cpu')
        jax.config.update('jax_compilation_cache_dir', None)
        devices, hbm = aot.tpu_devices(_TOPOLOGY.value, _NUM_SLICES.value)
        config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, slices=_NUM_SLICES.value))
    else:
        import jax
        devices, hbm = jax.devices(), aot.local_hbm_bytes()
    fitted, report = aot.auto_fit(config, devices, hbm)
    if fitted is not config:
        print(aot.fit_line(fitted, report))
    report = report or aot.compile_train_step(fitted, devices, hbm)
    print(report.table())
    if not report.fits:
        sys.exit(f'error: the train step needs {report.total_bytes / aot.GiB:.2f} GiB per device but '
                 f'{report.device_kind} has {report.hbm_bytes / aot.GiB:.2f} GiB: lower data.batch_size, '
                 'use model.remat=full, or shard more (mesh.fsdp / mesh.tensor).')


def main(argv: list[str]) -> None:
    if not flags.FLAGS['verbosity'].present:  # library INFO chatter off unless asked for
        logging.set_verbosity(logging.WARNING)
    if not _TOPOLOGY.value:
        _enable_compilation_cache()
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    try:
        if _CONFIG.value is None:
            raise app.UsageError('--config is required, e.g. --config=configs/tiny.py')
        config = from_configdict(_CONFIG.value)
    except OSError as e:  # config_flags defers a missing or broken config file to here
        sys.exit(f'error: {" ".join(str(e).split())}')
    except ConfigError as e:
        sys.exit(f'error: invalid config: {e}')
    if _SUMMARY.value:
        print_summary(config, _SUMMARY_JSON.value)
        return
    if _COMPILE_ONLY.value:
        from vrl import aot
        try:
            _compile_only(config)
        except (aot.CompileError, ConfigError) as e:
            sys.exit(f'error: {e}')
        return
    _initialize_distributed()
    if not _WORKDIR.value:
        raise app.UsageError('--workdir is required to train, e.g. --workdir=runs/tiny')
    from vrl import checkpoint, corpus, tokenizer, train, workdir  # here, so that --summary needs no data stack
    try:
        train.run(config, _WORKDIR.value, fresh=_FRESH.value, init_from=_INIT_FROM.value)
    except checkpoint.SaveError as e:
        # the failed save's writer threads can still print asyncio noise while Python shuts down:
        # end the process here, so that this line is the last one
        print(f'error: {e}', file=sys.stderr, flush=True)
        os._exit(1)
    except (ConfigError, corpus.DataError, tokenizer.TokenizerError, checkpoint.CheckpointError,
            train.TrainingError, workdir.WorkdirError, FileNotFoundError) as e:
        sys.exit(f'error: {e}')
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        sys.exit(f'error: no space left on device writing {e.filename or _WORKDIR.value}; free space and run the '
                 'same command to resume.')


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with config errors (unknown key, missing or broken file) as one clear line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        text = str(e)
        if 'Traceback' in text:  # a config file raised: its exception's last line says why
            text = text.strip().splitlines()[-1].split(': ', 1)[-1]
        sys.exit(f'error: {" ".join(text.split())}\nPass --help for usage.')
    except SyntaxError as e:
        sys.exit(f'error: the config file {e.filename} does not parse: {e.msg} (line {e.lineno})')
    except KeyError as e:  # --config.SECTION.x=... with an unknown SECTION
        text = str(e.args[0]) if e.args else '?'
        key = re.split(r"['\\\n]", text.strip("'"), maxsplit=1)[0]
        given = next((a.split('=')[0] for a in argv if a.startswith(f'--config.{key}.')), f'--config.{key}')
        hint = re.search(r'Did you mean "(\w+)"', text)
        sys.exit(f'error: {given}: {key!r} is not a config section; allowed: '
                 + ', '.join(f.name for f in dataclasses.fields(Config))
                 + (f' (did you mean {hint.group(1)!r}?)' if hint else ''))
    except (AttributeError, TypeError, ValueError, OSError) as e:  # raised by --config.x=...
        message = ' '.join(str(e.args[0] if e.args else e).replace("\\'", "'").replace('\\n', ' ').split())
        sys.exit(f'error: bad --config or override: {message.strip(chr(39))}'.replace("' Did you", ': Did you'))


if __name__ == '__main__':
    host_memory.use_huge_pages()
    app.run(main, flags_parser=_parse_flags)
