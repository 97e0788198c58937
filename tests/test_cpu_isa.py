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
from vrl.core.config import Config, ConfigError
from vrl.model import resolve
from vrl.model.decoder import Decoder

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
    with pytest.raises(ConfigError, match="compute_dtype='auto' is unresolved"):
        Decoder(auto, rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize('isa, dtype', [('AVX2', 'float32'), ('AVX512_BF16', 'bfloat16')])
def test_each_isa_path_computes_the_float32_loss_and_gradients(monkeypatch, isa, dtype):
    """The ISA forced both ways (what the host reports): the resolved config says it and logs why, and
    the chosen path's loss and gradients are the float32 model's (bfloat16 to its rounding)."""
    monkeypatch.setattr(backend, 'cpu_isa', lambda *_: isa)
    lines = []
    config = resolve.execution(Config(model=small_model_config(compute_dtype='auto')), 'cpu', lines.append)
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
