"""The device side of training: the train state, the loss, and the jitted train and eval steps.

Parameters live in a pure nested dict (float32) that `nnx.merge` turns back into the model
inside the step; the whole state is sharded by vrl/sharding.py's rules, initialised directly
into that layout, and donated to the step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from vrl import ops, resolve
from vrl import optimizer as vrl_optimizer
from vrl import sharding
from vrl.config import Config, ConfigError, ModelConfig
from vrl.model import Decoder

Batch = dict[str, jax.Array]  # (B, L) int32: inputs, targets, loss_mask [, segment_ids, positions]
Metrics = dict[str, jax.Array]  # scalars


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: updates applied so far
    params: dict[str, Any]
    opt_state: Any


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and parameter shapes/metadata, without allocating weights."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def loss_sums(graphdef: nnx.GraphDef, params: dict[str, Any], batch: Batch, z_loss: float
              ) -> tuple[jax.Array, jax.Array]:
    """Sums over unmasked tokens of (cross-entropy + z_loss * logZ^2) and of cross-entropy alone;
    the second carries no gradient (vrl.ops.cross_entropy_sums)."""
    model = nnx.merge(graphdef, params)
    hidden_BxLxD = model.hidden(batch['inputs'], batch.get('positions'), batch.get('segment_ids'))
    return ops.hot_ops(model.cfg.hand_vjp).cross_entropy_sums(
        hidden_BxLxD, model.head_DxV(), batch['targets'], batch['loss_mask'].astype(jnp.float32),
        model.cfg.vocab_size, z_loss, model.cfg.head_chunks)


class Trainer:
    """Builds the sharded initial state and the jitted steps for one config on one mesh."""

    def __init__(self, config: Config, mesh: Mesh):
        if config.train.microbatches == 0 or config.model.remat == 'auto':
            raise ConfigError('train.microbatches=0 and model.remat=auto must be resolved before a Trainer is '
                              'built: vrl.resolve.memory does it (vrl.main and train.run call it).')
        config = resolve.execution(config, mesh.devices.flat[0].platform)
        self.config, self.mesh = config, mesh
        self.graphdef, abstract_params = abstract_model(config.model)
        self.tx = vrl_optimizer.make(config.optimizer)
        self.learning_rate = vrl_optimizer.learning_rate(config.optimizer)
        self.param_shardings = sharding.param_shardings(abstract_params, mesh)
        abstract = jax.eval_shape(self._init, jax.random.key(0))
        self.state_shardings = TrainState(
            step=sharding.replicated(mesh), params=self.param_shardings,
            opt_state=self._opt_state_shardings(abstract.opt_state))
        self.abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                           abstract, self.state_shardings)
        self.batch_sharding = sharding.batch_sharding(mesh)
        replicated = sharding.replicated(mesh)
        self.train_step = jax.jit(sharding.traced_in(mesh, self._train_step), in_shardings=(self.state_shardings, self.batch_sharding),
                                  out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        self.eval_step = jax.jit(sharding.traced_in(mesh, self._eval_step), in_shardings=(self.param_shardings, self.batch_sharding),
                                 out_shardings=replicated)

    def _opt_state_shardings(self, abstract_opt_state: Any) -> Any:
        """Moments are sharded like their parameters; counters are replicated."""
        param_tree = jax.tree.structure(self.param_shardings)

        def match(subtree):
            if jax.tree.structure(subtree) == param_tree:
                return self.param_shardings
            return jax.tree.map(lambda _: sharding.replicated(self.mesh), subtree)

        return jax.tree.map(match, abstract_opt_state,
                            is_leaf=lambda x: jax.tree.structure(x) == param_tree)

    def _init(self, key: jax.Array) -> TrainState:
        model = Decoder(self.config.model, rngs=nnx.Rngs(params=key))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

    def init_state(self, seed: int) -> TrainState:
        """A fresh state, created on the devices directly in its sharded layout."""
        return jax.jit(self._init, out_shardings=self.state_shardings)(jax.random.key(seed))

    def _loss_and_grads(self, params: dict, batch: Batch) -> tuple[tuple[jax.Array, jax.Array], Any]:
        return jax.value_and_grad(loss_sums, argnums=1, has_aux=True)(self.graphdef, params, batch,
                                                                      self.config.optimizer.z_loss)

    def _train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        k = self.config.train.microbatches
        if k == 1:
            (total, cross_entropy), grads = self._loss_and_grads(state.params, batch)
        else:  # gradient accumulation: sums over microbatches, one normalisation at the end
            micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

            def accumulate(carry, microbatch):
                (total, ce), grads = self._loss_and_grads(state.params, microbatch)
                return jax.tree.map(jnp.add, carry, ((total, ce), grads)), None

            zeros = ((jnp.zeros(()), jnp.zeros(())), jax.tree.map(jnp.zeros_like, state.params))
            ((total, cross_entropy), grads), _ = jax.lax.scan(accumulate, zeros, micro)
        tokens = jnp.maximum(jnp.sum(batch['loss_mask']), 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g: g / tokens, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # finite weights also rule out an update that overflowed; the check fuses into the update
        finite = (jnp.isfinite(total) & jnp.isfinite(grad_norm)
                  & jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)])))
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        if self.config.train.nan_policy == 'skip':  # keep the old state; under 'error' the host stops
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
            new_state = new_state._replace(step=state.step + 1)
        return new_state, {'loss': cross_entropy / tokens, 'grad_norm': grad_norm,
                           'lr': self.learning_rate(state.step), 'tokens': tokens, 'finite': finite}

    def _eval_step(self, params: dict, batch: Batch) -> Metrics:
        """Sums over the batch's unmasked targets: cross-entropy (nats), tokens, and the UTF-8 bytes
        they stand for (batch['target_bytes'], from Tokenizer.utf8_bytes)."""
        _, cross_entropy = loss_sums(self.graphdef, params, batch, 0.0)
        mask = batch['loss_mask'].astype(jnp.float32)
        return {'loss_sum': cross_entropy, 'tokens': jnp.sum(mask),
                'bytes': jnp.sum(batch['target_bytes'].astype(jnp.float32) * mask)}

    def device_batch(self, local_batch: dict[str, np.ndarray]) -> Batch:
        """This process's rows -> one global array per field, sharded over ('data', 'fsdp')."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local_batch.items()}
