"""The optimizers: Muon's update against a float64 Newton-Schulz reference, the parameter groups,
stacked layers, the wsd schedule, Muon sharded on 8 fake devices, and resume/branch through Orbax."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from configs import base as base_configs
from configs import reproduce_cpu
from tests.helpers import NAMED_VARIANTS, small_model_config
from tests.runs import params_equal, tiny_config, train_losses
from vrl.core.config import ConfigError
from vrl.core.sharding import MeshConfig
from vrl.data.config import DataConfig
from vrl.train import loop, optimizer
from vrl.train.config import Config, OptimizerConfig, TrainConfig, from_configdict
from vrl.train.rundir import checkpoint
from vrl.train.step import abstract_model

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic Newton-Schulz iteration's (a, b, c)


def newton_schulz_reference(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Muon's orthogonalisation of one (fan_in, fan_out) matrix, in float64."""
    x = g.astype(np.float64) / (np.linalg.norm(g) + 1e-8)
    wide = x.shape[0] > x.shape[1]
    x = x.T if wide else x
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if wide else x


def _first_update(cfg: OptimizerConfig, params: dict, axes: dict, grads: dict) -> dict:
    tx = optimizer.make(cfg, axes)
    updates, _ = tx.update(grads, tx.init(params), params)
    return updates


def _muon(**fields) -> OptimizerConfig:
    return OptimizerConfig(
        **{
            **dict(name='muon', peak_lr=0.02, warmup_steps=0, decay_steps=10_000, weight_decay=0.0, grad_clip=0.0),
            **fields,
        }
    )


def test_muon_update_is_the_newton_schulz_of_the_gradient():
    rng = np.random.default_rng(7)
    w_up, w_down, embed = (rng.normal(size=s).astype(np.float32) for s in ((24, 40), (40, 24), (50, 24)))
    params = {'first': {'mlp': {'w_up': w_up, 'w_down': w_down}}, 'embed': embed}
    axes = {
        ('first', 'mlp', 'w_up'): ('embed', 'mlp'),
        ('first', 'mlp', 'w_down'): ('mlp', 'embed'),
        ('embed',): ('vocab', 'embed'),
    }
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    updates = _first_update(_muon(embed_lr_ratio=5.0), params, axes, grads)
    # the first Nesterov momentum is a multiple of the gradient; the iteration is scale-free
    up = newton_schulz_reference(grads['first']['mlp']['w_up'])
    down = newton_schulz_reference(grads['first']['mlp']['w_down'])
    want_up = -0.02 * np.sqrt(40 / 24) * up  # the width scale: sqrt(fan_out / fan_in) when > 1
    want_down = -0.02 * down
    for got, want in ((updates['first']['mlp']['w_up'], want_up), (updates['first']['mlp']['w_down'], want_down)):
        assert np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want) < 1e-4
    singular = np.linalg.svd(up, compute_uv=False)
    assert 0.6 < singular.min() and singular.max() < 1.25, singular  # orthogonalised: all near 1
    # the embedding is AdamW's: its first step is -lr x ratio x g / (|g| + eps)
    g = grads['embed']
    np.testing.assert_allclose(updates['embed'], -0.02 * 5.0 * g / (np.abs(g) + 1e-8), rtol=1e-5)


def test_a_stack_of_layers_is_orthogonalised_layer_by_layer():
    rng = np.random.default_rng(3)
    stack = rng.normal(size=(3, 16, 4, 8)).astype(np.float32)  # (layers, embed, heads, head_dim)
    grads = rng.normal(size=stack.shape).astype(np.float32)
    axes = ('layers', 'embed', 'heads', 'head_dim')
    stacked = _first_update(
        _muon(),
        {'layers': {'attn': {'wq': stack}}},
        {('layers', 'attn', 'wq'): axes},
        {'layers': {'attn': {'wq': grads}}},
    )['layers']['attn']['wq']
    for layer in range(3):
        alone = _first_update(
            _muon(),
            {'first': {'attn': {'wq': stack[layer]}}},
            {('first', 'attn', 'wq'): axes[1:]},
            {'first': {'attn': {'wq': grads[layer]}}},
        )['first']['attn']['wq']
        np.testing.assert_allclose(stacked[layer], alone, rtol=1e-5, atol=1e-7)
        want = -0.02 * np.sqrt(32 / 16) * newton_schulz_reference(grads[layer].reshape(16, 32)).reshape(16, 4, 8)
        assert np.linalg.norm(np.asarray(alone) - want) / np.linalg.norm(want) < 1e-4


@pytest.mark.parametrize(
    'variant', ['all-baselines', 'resformer-per_token', 'resformer-value_embeds-shared', 'svformer-cla2']
)
def test_every_parameter_is_in_one_group_and_muon_gets_only_hidden_matrices(variant):
    cfg = small_model_config(n_layers=4, **{'lambda_mode': 'identity', **NAMED_VARIANTS[variant]})
    _, abstract = abstract_model(cfg)
    axes = optimizer.param_axes(abstract)
    params = jax.tree.map(lambda v: jnp.zeros(v.shape), nnx.to_pure_dict(abstract))
    state = jax.eval_shape(optimizer.make(_muon(), axes).init, params)
    inner = state.inner_states  # no clipping in _muon(): the partition is the whole state
    in_muon = {path for path, _ in _leaf_paths(inner['muon'].inner_state[0].mu)}
    in_adam = {path for path, _ in _leaf_paths(inner['adamw'].inner_state[0].mu)}
    assert in_muon | in_adam == set(axes) and not in_muon & in_adam
    for path in in_muon:
        assert 'vocab' not in axes[path] and path[-1] in ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', 'w_down'), path
    matrices = {p for p in axes if len([a for a in axes[p] if a not in ('layers', None)]) >= 2}
    small = {p for p in matrices - in_muon if p[-1] in ('gates', 'w_mix')}  # the variants' gates stay AdamW's
    assert matrices - in_muon == small | {p for p in matrices if 'vocab' in axes[p]}
    assert {optimizer.group(p) for p in axes} <= set(optimizer.GROUPS)


def _leaf_paths(tree):
    return [(tuple(str(k.key) for k in path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def test_muon_dims_name_the_matrix_each_weight_multiplies():
    dims = optimizer.matrix_dims(('layers', 'embed', 'heads', 'head_dim'))  # a stacked wq: embed -> heads x head_dim
    assert (dims.reduction_axis, dims.output_axis) == (1, (2, 3))
    dims = optimizer.matrix_dims(('heads', 'head_dim', 'embed'))  # wo: heads x head_dim -> embed
    assert (dims.reduction_axis, dims.output_axis) == ((0, 1), 2)
    with pytest.raises(ValueError, match='needs an embed axis'):
        optimizer.matrix_dims(('layers', 'mlp'))


def test_wsd_schedule_against_a_hand_computed_table():
    cfg = OptimizerConfig(
        peak_lr=1.0, init_lr=0.1, final_lr=0.2, warmup_steps=10, decay_steps=100, schedule='wsd', decay_fraction=0.2
    )
    assert cfg.decay_start == 80
    lr = optimizer.learning_rate(cfg)
    table = {0: 0.1, 5: 0.55, 10: 1.0, 50: 1.0, 80: 1.0, 85: 0.8, 90: 0.6, 100: 0.2, 150: 0.2}
    for step, want in table.items():
        assert float(lr(step)) == pytest.approx(want, rel=1e-6), step
    sqrt = optimizer.learning_rate(dataclasses.replace(cfg, decay_shape='sqrt'))
    assert float(sqrt(90)) == pytest.approx(0.2 + 0.8 * (1 - np.sqrt(0.5)), rel=1e-6)
    assert float(sqrt(100)) == pytest.approx(0.2, rel=1e-6)
    # another peak (a group's LR) scales the whole schedule
    assert float(optimizer.learning_rate(cfg, peak=3.0)(90)) == pytest.approx(1.8, rel=1e-6)


def test_a_run_shorter_than_its_schedule_is_told_where_its_lr_ends():
    cfg = OptimizerConfig(
        peak_lr=1.0, init_lr=0.1, final_lr=0.2, warmup_steps=10, decay_steps=100, schedule='wsd', decay_fraction=0.2
    )
    note = optimizer.schedule_note(cfg, 86)  # step 86 trains at the schedule's count 85: 0.8 by the table above
    assert note == (
        'train.steps=86 ends before the wsd schedule does (optimizer.decay_steps=100): its last step '
        'trains at lr 8.00e-01 (the schedule peaks at 1 and ends at final_lr 0.2); set '
        '--config.optimizer.decay_steps=86 to end the schedule with the run'
    )
    assert optimizer.schedule_note(cfg, 100) == optimizer.schedule_note(cfg, 150) == ''
    assert optimizer.schedule_note(cfg, 0) == ''  # a conversion trains no step


@pytest.mark.parametrize(
    'fields, message',
    [
        (dict(name='sgd'), "optimizer.name='sgd' is invalid: allowed one of 'adamw', 'muon'"),
        (dict(schedule='wsd', warmup_steps=50, decay_steps=100, decay_fraction=0.6), 'decay starts after warmup'),
        (dict(head_lr_ratio=0.0), 'optimizer.head_lr_ratio=0.0 is invalid'),
        (dict(decay_shape='cubic'), "optimizer.decay_shape='cubic' is invalid"),
    ],
)
def test_bad_optimizer_settings_are_named(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        OptimizerConfig(**fields)


def test_recipes_keep_the_schedule_length_and_name_a_bad_recipe():
    base = OptimizerConfig(peak_lr=3e-3, final_lr=3e-4, warmup_steps=30, decay_steps=400)
    muon = optimizer.recipe(base, 'muon')
    assert (muon.name, muon.schedule, muon.warmup_steps, muon.decay_steps) == ('muon', 'wsd', 30, 400)
    assert muon.final_lr / muon.peak_lr == pytest.approx(0.1)
    assert optimizer.recipe(base, 'adamw') == base
    with pytest.raises(ConfigError, match="optimizer recipe 'lion' is invalid"):
        optimizer.recipe(base, 'lion')
    named = from_configdict(base_configs.get_config('svformer,82m,2k,muon'))  # the fourth part of a named config
    assert (named.optimizer.name, named.model.attention, named.data.seq_len) == ('muon', 'svformer', 2048)
    assert from_configdict(reproduce_cpu.get_config('muon')).optimizer == optimizer.recipe(
        from_configdict(reproduce_cpu.get_config()).optimizer, 'muon'
    )


def _random_batches(n: int, batch: int, length: int, vocab: int) -> list[dict]:
    rng = np.random.default_rng(11)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, (batch, length + 1)).astype(np.int32)
        out.append(
            {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'loss_mask': np.ones((batch, length), np.int32)}
        )
    return out


@pytest.mark.slow
def test_muon_sharded_on_8_devices_trains_as_on_one():
    model = small_model_config(
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        head_dim=8,
        d_model=32,
        d_ff=64,
        vocab_size=128,
        vocab_pad_multiple=64,
        attention='resformer',
        lambda_mode='learnable',
    )
    config = Config(
        model=model,
        data=DataConfig(seq_len=16, batch_size=8),
        optimizer=optimizer.recipe(OptimizerConfig(warmup_steps=1, decay_steps=10), 'muon'),
        train=TrainConfig(steps=4),
    )
    batches = _random_batches(1, 8, 16, 128) * 4  # one batch again and again: the loss must fall

    reference, _ = train_losses(config, jax.devices()[:1], batches)
    sharded, state = train_losses(dataclasses.replace(config, mesh=MeshConfig(2, 2, 2)), jax.devices(), batches)
    np.testing.assert_allclose(sharded, reference, rtol=1e-5)
    assert reference[-1] < reference[0]
    muon_state = state.opt_state[1].inner_states['muon'].inner_state[0]
    assert muon_state.mu['layers']['mlp']['w_down'].sharding.spec == PartitionSpec(None, 'tensor', 'fsdp')
    assert muon_state.mu['layers']['attn']['wq'].sharding.spec == PartitionSpec(None, 'fsdp', 'tensor', None)


def _muon_run(small_corpus, **train_fields) -> Config:
    config = tiny_config(small_corpus, **train_fields)
    opt = optimizer.recipe(dataclasses.replace(config.optimizer, decay_steps=12), 'muon')
    return dataclasses.replace(config, optimizer=dataclasses.replace(opt, decay_fraction=0.5))


@pytest.mark.slow
def test_muon_resumes_exactly_refuses_adamw_and_branches_from_the_stable_phase(small_corpus, tmp_path):
    straight = loop.run(_muon_run(small_corpus, steps=12, checkpoint_every=100), str(tmp_path / 'straight'))
    assert sorted(int(p.name) for p in (tmp_path / 'straight' / 'checkpoints').iterdir() if p.name.isdigit()) == [
        6,
        12,
    ]  # wsd saves its last stable step (decay_start 6) as well as the end
    first = loop.run(_muon_run(small_corpus, steps=8, checkpoint_every=4), str(tmp_path / 'resumed'))
    second = loop.run(_muon_run(small_corpus, steps=12, checkpoint_every=4), str(tmp_path / 'resumed'))
    assert {**first.losses, **second.losses} == straight.losses
    assert params_equal(second.state.params, straight.state.params)
    assert params_equal(second.state.opt_state, straight.state.opt_state)

    adamw = tiny_config(small_corpus, steps=16)
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=re.escape("trained with optimizer.name='muon' but the config has optimizer.name='adamw'"),
    ):
        loop.run(adamw, str(tmp_path / 'resumed'))

    longer = _muon_run(small_corpus, steps=16, checkpoint_every=100)
    longer = dataclasses.replace(longer, optimizer=dataclasses.replace(longer.optimizer, decay_steps=16))
    branched = loop.run(
        longer, str(tmp_path / 'extended'), branch_from=str(tmp_path / 'straight' / 'checkpoints' / '6')
    )
    assert min(branched.losses) == 7 and branched.step == 16
    # steps 7 and 8 see the step-6 state, and step 7's update is at the peak LR in both; from step 8's
    # update on, the longer run stays at the peak while the straight one decays
    assert branched.losses[7] == straight.losses[7] and branched.losses[8] == straight.losses[8]
    assert branched.losses[9] != straight.losses[9]


def _adamw_reference(
    params: dict, grads: list[dict], cfg: OptimizerConfig, ratios: dict[str, float], decayed: set[str]
) -> dict:
    """The paper's AdamW recipe in float64 NumPy, written from its definition: gradients clipped to
    a global norm of cfg.grad_clip, Adam moments with bias correction, decoupled weight decay on the
    `decayed` leaves only, all times the LR of the step (linear warmup from init_lr, then a cosine
    to final_lr at decay_steps) and the leaf's ratio."""

    def lr(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.init_lr + (cfg.peak_lr - cfg.init_lr) * step / cfg.warmup_steps
        progress = min(step - cfg.warmup_steps, cfg.decay_steps - cfg.warmup_steps) / (
            cfg.decay_steps - cfg.warmup_steps
        )
        return cfg.final_lr + (cfg.peak_lr - cfg.final_lr) * 0.5 * (1 + np.cos(np.pi * progress))

    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    for t, g in enumerate(grads, start=1):
        g = {k: np.asarray(v, np.float64) for k, v in g.items()}
        norm = np.sqrt(sum((v**2).sum() for v in g.values()))
        g = {k: v * min(1.0, cfg.grad_clip / norm) for k, v in g.items()}
        for k in p:
            mu[k] = cfg.b1 * mu[k] + (1 - cfg.b1) * g[k]
            nu[k] = cfg.b2 * nu[k] + (1 - cfg.b2) * g[k] ** 2
            update = (mu[k] / (1 - cfg.b1**t)) / (np.sqrt(nu[k] / (1 - cfg.b2**t)) + cfg.eps)
            if k in decayed:
                update = update + cfg.weight_decay * p[k]
            p[k] = p[k] - lr(t - 1) * ratios[k] * update
    return p


def test_adamw_with_its_mask_clipping_and_schedule_equals_a_float64_reference():
    """Six steps through warmup into the cosine, one of them clipped: AdamW's betas, eps, decoupled
    decay (not on norm weights or lambdas) and each group's LR ratio, against _adamw_reference."""
    cfg = OptimizerConfig(
        peak_lr=0.05,
        init_lr=0.001,
        final_lr=0.005,
        warmup_steps=3,
        decay_steps=8,
        b1=0.8,
        b2=0.9,
        eps=1e-6,
        weight_decay=0.3,
        grad_clip=1.0,
        embed_lr_ratio=2.0,
        head_lr_ratio=0.5,
        scalar_lr_ratio=3.0,
    )
    rng = np.random.default_rng(7)
    shapes = {
        'wq': (4, 3),
        'embed': (5, 4),
        'head': (4, 5),
        'scale': (4,),
        'q_norm': (3,),
        'lambdas': (2,),
        'gate': (3,),
    }
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    grads = [
        {k: (rng.normal(size=s) * (5.0 if t == 2 else 0.1)).astype(np.float32) for k, s in shapes.items()}
        for t in range(6)
    ]  # step 3's global norm is far above grad_clip
    assert np.sqrt(sum((g**2).sum() for g in grads[2].values())) > 10 * cfg.grad_clip
    tx = optimizer.make(cfg, {})
    state, got = tx.init(params), {k: jnp.asarray(v) for k, v in params.items()}
    for g in grads:
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, got)
        got = optax.apply_updates(got, updates)
    ratios = {'wq': 1.0, 'embed': 2.0, 'head': 0.5, 'scale': 3.0, 'q_norm': 3.0, 'lambdas': 3.0, 'gate': 3.0}
    want = _adamw_reference(params, grads, cfg, ratios, decayed={'wq', 'embed', 'head', 'gate'})
    for k in shapes:
        err = np.abs(np.asarray(got[k], np.float64) - want[k]).max() / np.abs(want[k] - params[k]).max()
        assert err < 1e-4, (k, err)


def test_cosine_schedule_against_a_hand_computed_table():
    cfg = OptimizerConfig(peak_lr=1.0, init_lr=0.1, final_lr=0.2, warmup_steps=10, decay_steps=110)
    lr = optimizer.learning_rate(cfg)
    table = {0: 0.1, 5: 0.55, 10: 1.0, 35: 0.2 + 0.8 * (1 + np.cos(np.pi / 4)) / 2, 60: 0.6, 110: 0.2, 200: 0.2}
    for step, want in table.items():
        assert float(lr(step)) == pytest.approx(want, rel=1e-6), step


def test_the_schedule_follows_train_steps_unless_its_length_is_set():
    """decay_steps=0 (the default, and the presets') ends the schedule with the run: a 20-step smoke
    run of the tiny config ends at final_lr, and says nothing; one set explicitly stays, with its note."""
    from configs import tiny
    from vrl.train import aot
    from vrl.train.config import from_configdict

    short = from_configdict(tiny.get_config())
    short = dataclasses.replace(short, train=dataclasses.replace(short.train, steps=40))
    assert short.optimizer.decay_steps == 0
    opt = aot.execution(short, 'cpu', say=lambda line: None).optimizer
    assert opt.decay_steps == 40 and optimizer.schedule_note(opt, 40) == ''
    assert float(optimizer.learning_rate(opt)(40)) == pytest.approx(short.optimizer.final_lr, rel=1e-6)
    smoke = dataclasses.replace(short, train=dataclasses.replace(short.train, steps=20))  # inside the warmup of 30
    opt = aot.execution(smoke, 'cpu', say=lambda line: None).optimizer
    assert opt.decay_steps == 31 and optimizer.schedule_note(opt, 20).endswith(
        'it stops inside the warmup (optimizer.warmup_steps=30): set --config.optimizer.warmup_steps=5 to decay '
        'within the run'
    )
    fixed = dataclasses.replace(short, optimizer=dataclasses.replace(short.optimizer, decay_steps=400))
    opt = aot.execution(fixed, 'cpu', say=lambda line: None).optimizer
    assert opt.decay_steps == 400 and 'set --config.optimizer.decay_steps=40' in optimizer.schedule_note(opt, 40)
    with pytest.raises(ValueError, match='decay_steps=0 stands for train.steps'):
        optimizer.learning_rate(short.optimizer)


def test_a_wsd_run_shorter_than_its_warmup_is_refused_naming_the_warmup_that_fits():
    """modern.py's wsd recipe at train.steps=30 (warmup 120, decay over the last 0.4): the refusal names
    train.steps and the warmup, not decay_fraction that the user never set, and the warmup it offers runs."""
    from configs import modern
    from vrl.core.config import ConfigError
    from vrl.train import aot
    from vrl.train.config import from_configdict

    config = from_configdict(modern.get_config('svformer,82m'))
    short = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=30))
    assert short.optimizer.schedule == 'wsd' and short.optimizer.decay_steps == 0
    warmup, fraction = short.optimizer.warmup_steps, short.optimizer.decay_fraction
    with pytest.raises(ConfigError) as refused:
        aot.execution(short, 'cpu', say=lambda line: None)
    assert str(refused.value) == (
        f'train.steps=30 is too short for optimizer.warmup_steps={warmup}: the wsd schedule decays over the last '
        f'{fraction:g} of the run, from step {30 - round(fraction * 30)}, inside the warmup; set '
        '--config.optimizer.warmup_steps=7 (or more train.steps)'
    )
    fitted = dataclasses.replace(short, optimizer=dataclasses.replace(short.optimizer, warmup_steps=7))
    opt = aot.execution(fitted, 'cpu', say=lambda line: None).optimizer
    assert opt.decay_steps == 30 and float(optimizer.learning_rate(opt)(30)) == pytest.approx(opt.final_lr, rel=1e-6)
