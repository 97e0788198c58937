"""The CPU's instruction set, read from /proc/cpuinfo and XLA_FLAGS (vrl/core/backend.py), and the choice made
from it: model.compute_dtype=auto is bfloat16 only where the CPU has bf16 dot instructions (vrl/model/resolve.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import rel_err, small_model_config
from tests.test_model import _loss
from vrl.core import backend
from vrl.core.config import ConfigError
from vrl.model import resolve
from vrl.model.decoder import Decoder
from vrl.train import aot
from vrl.train.config import Config

ZEN3 = 'fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2'  # AVX2, no AVX-512
ZEN4 = ZEN3 + ' avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16'
SKYLAKE_X = ZEN3 + ' avx512f avx512dq avx512cd avx512bw avx512vl'


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / f'cpuinfo-{len(flags)}'
    path.write_text(f'processor\t: 0\nvendor_id\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n')
    return path


@pytest.mark.parametrize(
    'flags, isa', [(ZEN3, 'AVX2'), (ZEN4, 'AVX512_BF16'), (SKYLAKE_X, 'AVX512'), ('fpu sse sse2', None)]
)
def test_the_host_isa_is_the_newest_whose_flags_are_all_there(tmp_path, flags, isa):
    assert backend.host_cpu_isa(_cpuinfo(tmp_path, flags)) == isa
    assert backend.host_cpu_isa(tmp_path / 'absent') is None


def test_xla_flags_limit_the_isa_but_never_raise_it(tmp_path):
    zen4 = _cpuinfo(tmp_path, ZEN4)
    assert (
        backend.cpu_isa({'XLA_FLAGS': '--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=avx2'}, zen4)
        == 'AVX2'
    )
    assert backend.cpu_isa({'XLA_FLAGS': '--xla_cpu_max_isa=AMX'}, _cpuinfo(tmp_path, ZEN3)) == 'AVX2'
    assert backend.cpu_isa({}, zen4) == 'AVX512_BF16'


def test_auto_compute_dtype_follows_the_bf16_dot_instructions():
    auto = small_model_config(compute_dtype='auto')
    assert resolve.compute_dtype(auto, 'cpu', 'AVX2')[0] == 'float32'
    assert resolve.compute_dtype(auto, 'cpu', 'AVX512')[0] == 'float32'
    assert resolve.compute_dtype(auto, 'cpu', 'AVX512_BF16')[0] == 'bfloat16'
    assert resolve.compute_dtype(auto, 'cpu', 'AMX')[0] == 'bfloat16'
    assert resolve.compute_dtype(auto, 'tpu')[0] == 'bfloat16'
    dtype, why = resolve.compute_dtype(dataclasses.replace(auto, compute_dtype='bfloat16'), 'cpu', 'AVX2')
    assert dtype == 'bfloat16' and 'no bf16 dot instructions' in why  # an explicit choice stands, with a note
    with pytest.raises(ConfigError, match='^model.compute_dtype=auto unresolved: a Decoder that runs'):
        Decoder(auto, rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize('isa, dtype', [('AVX2', 'float32'), ('AVX512_BF16', 'bfloat16')])
def test_each_isa_path_computes_the_float32_loss_and_gradients(monkeypatch, isa, dtype):
    """The ISA forced both ways (what the host reports): the resolved config says it and logs why, and
    the chosen path's loss and gradients are the float32 model's (bfloat16 to its rounding)."""
    monkeypatch.setattr(backend, 'cpu_isa', lambda *_: isa)
    lines = []
    config = aot.execution(Config(model=small_model_config(compute_dtype='auto')), 'cpu', lines.append)
    assert config.model.compute_dtype == dtype
    assert any(line.startswith(f'model.compute_dtype={dtype} (auto on cpu: CPU ISA {isa}') for line in lines)
    reference = Decoder(small_model_config(), rngs=nnx.Rngs(0))
    chosen = Decoder(config.model, rngs=nnx.Rngs(1))
    nnx.update(chosen, nnx.state(reference, nnx.Param))
    tokens = jax.random.randint(jax.random.key(3), (2, 11), 0, 97)
    tolerance = 1e-6 if dtype == 'float32' else 3e-2
    (loss, grads), (ref_loss, ref_grads) = (nnx.value_and_grad(_loss)(m, tokens) for m in (chosen, reference))
    assert rel_err(loss, ref_loss) < tolerance
    flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for g in (grads, ref_grads)]
    assert rel_err(*flat) < tolerance


SAPPHIRE_RAPIDS = ZEN4 + ' amx_tile amx_bf16 amx_int8'


def test_onednn_is_on_where_the_cpu_has_amx_and_off_elsewhere(tmp_path):
    """XLA:CPU's oneDNN custom call (backend.ONEDNN_FLAG) joins XLA_FLAGS on an AMX CPU only; VRL_CPU_ONEDNN
    decides either way, and an XLA_FLAGS that names the flag stands."""
    amx, zen4 = _cpuinfo(tmp_path, SAPPHIRE_RAPIDS), _cpuinfo(tmp_path, ZEN4)
    assert backend.host_cpu_isa(amx) == 'AMX'
    environ = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
    backend.choose_cpu_options(environ, amx)
    assert environ['XLA_FLAGS'] == f'--xla_force_host_platform_device_count=8 {backend.ONEDNN_FLAG}=true'
    assert backend.cpu_matmul_path(environ, amx) == 'onednn'
    for off in ({}, {'XLA_FLAGS': '--xla_cpu_max_isa=AVX512_BF16'}):  # no AMX, or XLA limited below it
        environ, cpu = dict(off), zen4 if not off else amx
        backend.choose_cpu_options(environ, cpu)
        assert environ == off and backend.cpu_matmul_path(environ, cpu) == 'xla'
    forced = {backend.ONEDNN_ENV: '1'}
    backend.choose_cpu_options(forced, zen4)
    assert forced['XLA_FLAGS'] == f'{backend.ONEDNN_FLAG}=true'
    refused = {backend.ONEDNN_ENV: '0'}
    backend.choose_cpu_options(refused, amx)
    assert 'XLA_FLAGS' not in refused
    given = {'XLA_FLAGS': f'{backend.ONEDNN_FLAG}=false', backend.ONEDNN_ENV: '1'}
    backend.choose_cpu_options(given, amx)
    assert given['XLA_FLAGS'] == f'{backend.ONEDNN_FLAG}=false'
    assert backend.onednn_choice(given, amx) == (False, f'XLA_FLAGS sets {backend.ONEDNN_FLAG}')


def test_this_host_runs_xlas_own_kernels_unless_it_has_amx():
    """What `import vrl` chose in this process: oneDNN exactly where this CPU reports AMX."""
    import os

    on = backend.cpu_isa() in backend.ONEDNN_ISAS and os.environ.get(backend.ONEDNN_ENV) != '0'
    assert backend.cpu_matmul_path() == ('onednn' if on else 'xla')
    assert (f'{backend.ONEDNN_FLAG}=true' in os.environ.get('XLA_FLAGS', '')) == on


def test_this_jax_starts_its_cpu_client_with_the_onednn_flag():
    """On an AMX host every vrl process starts with backend.ONEDNN_FLAG: a jax whose XLA no longer knows
    it would abort them all, so it is checked here on any host (forced on through VRL_CPU_ONEDNN), with a
    bf16 matmul's value that of float32 to bf16's rounding."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = (
        'import vrl, os, jax, jax.numpy as jnp, numpy as np\n'
        'a = jax.random.normal(jax.random.key(0), (64, 64))\n'
        'low = jnp.dot(a.astype(jnp.bfloat16), a.astype(jnp.bfloat16), preferred_element_type=jnp.float32)\n'
        'print(os.environ["XLA_FLAGS"].split()[-1], float(jnp.linalg.norm(low - a @ a) / jnp.linalg.norm(a @ a)))\n'
    )
    env = {**os.environ, backend.ONEDNN_ENV: '1', 'XLA_FLAGS': ''}
    out = subprocess.run([sys.executable, '-c', script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    flag, error = out.stdout.split()
    assert flag == f'{backend.ONEDNN_FLAG}=true' and 0 < float(error) < 1e-2, out.stdout
