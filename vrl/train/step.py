"""The device side of training: the train state, the loss, and the jitted train and eval steps.

Parameters live in a pure nested dict (float32) that `nnx.merge` turns back into the model
inside the step; the whole state is sharded by vrl/core/sharding.py's rules, initialised directly
into that layout, and donated to the step.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vrl.core import sharding
from vrl.core.config import require_resolved
from vrl.model import ops
from vrl.model.config import ModelConfig
from vrl.model.decoder import Decoder
from vrl.train import optimizer as vrl_optimizer
from vrl.train.config import Config

Batch = dict[str, jax.Array]  # (B, L) int32: inputs, targets, loss_mask [, segment_ids, positions]
Metrics = dict[str, jax.Array]  # scalars


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: updates applied so far
    params: dict[str, Any]
    opt_state: Any


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and parameter shapes/metadata, without allocating weights."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def loss_sums(
    graphdef: nnx.GraphDef, params: dict[str, Any], batch: Batch, z_loss: float
) -> tuple[jax.Array, jax.Array]:
    """Sums over unmasked tokens of (cross-entropy + z_loss * logZ^2) and of cross-entropy alone;
    the second carries no gradient (vrl.model.ops.cross_entropy_sums)."""
    model = nnx.merge(graphdef, params)
    hidden_BxLxD = model.hidden(batch['inputs'], batch.get('positions'), batch.get('segment_ids'))
    return ops.hand_vjp_ops(model.cfg.hand_vjp).cross_entropy_sums(
        hidden_BxLxD,
        model.head_DxV(),
        batch['targets'],
        batch['loss_mask'].astype(jnp.float32),
        model.cfg.vocab_size,
        z_loss,
        model.cfg.head_chunks,
        model.cfg.final_logits_soft_cap,
    )


class _Programs(NamedTuple):
    """The jitted functions of one step program: init(seed) -> state, train_step(state, batch) ->
    (state, metrics), eval_step(params, batch) -> sums, and (for a group) stack(*states) -> state."""

    init: Callable
    train_step: Callable
    eval_step: Callable
    stack: Callable | None


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()  # step program -> _Programs
_PROGRAMS_KEPT = 8


def _programs(trainer: 'TrainSteps', members: int = 1) -> _Programs:
    """The TrainSteps's jitted init, train and eval steps; with members > 1, the same vmapped over a
    leading run axis of the state (the batch shared; init over a vector of seeds). TrainSteps whose
    steps are the same program (they differ only in seed, length, logging or data) share them, and
    with them their compiled executables: a grid's seeds, or a resumed run in the same process,
    compile once."""
    config, mesh = trainer.config, trainer.mesh
    key = (config.model, config.optimizer, config.train.microbatches, config.train.nan_policy, mesh, members)
    if key not in _PROGRAMS:
        replicated = sharding.replicated(mesh)
        init = lambda seed: trainer._init(jax.random.key(seed))  # noqa: E731
        train_step, eval_step, stack = trainer._train_step, trainer._eval_step, None
        state_shardings, param_shardings = trainer.state_shardings, trainer.param_shardings
        if members > 1:
            init = jax.vmap(init)
            train_step, eval_step = jax.vmap(train_step, in_axes=(0, None)), jax.vmap(eval_step, in_axes=(0, None))
            state_shardings, param_shardings = _with_run_axis(state_shardings), _with_run_axis(param_shardings)
            stack = jax.jit(
                lambda *states: jax.tree.map(lambda *xs: jnp.stack(xs), *states), out_shardings=state_shardings
            )
        _PROGRAMS[key] = _Programs(
            init=jax.jit(init, out_shardings=state_shardings),
            train_step=jax.jit(
                sharding.traced_in(mesh, train_step),
                donate_argnums=0,
                in_shardings=(state_shardings, trainer.batch_sharding),
                out_shardings=(state_shardings, replicated),
            ),
            eval_step=jax.jit(
                sharding.traced_in(mesh, eval_step),
                out_shardings=replicated,
                in_shardings=(param_shardings, trainer.batch_sharding),
            ),
            stack=stack,
        )
        while len(_PROGRAMS) > _PROGRAMS_KEPT:
            _PROGRAMS.popitem(last=False)
    _PROGRAMS.move_to_end(key)
    return _PROGRAMS[key]


def _with_run_axis(shardings: Any) -> Any:
    """The shardings of a tree stacked on a leading run axis, that axis replicated: each member keeps
    the layout it has alone, so a member is a slice on every device and its reductions run as alone."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, PartitionSpec(None, *s.spec)), shardings)


class TrainSteps:
    """Builds the sharded initial state and the jitted steps for one config on one mesh."""

    def __init__(self, config: Config, mesh: Mesh):
        require_resolved(config, '', 'a TrainSteps')
        self.config, self.mesh = config, mesh
        self.graphdef, abstract_params = abstract_model(config.model)
        self.tx = vrl_optimizer.make(config.optimizer, vrl_optimizer.param_axes(abstract_params))
        self.learning_rate = vrl_optimizer.learning_rate(config.optimizer)
        self.param_shardings = sharding.param_shardings(abstract_params, mesh)
        abstract = jax.eval_shape(self._init, jax.random.key(0))
        self.state_shardings = TrainState(
            step=sharding.replicated(mesh),
            params=self.param_shardings,
            opt_state=sharding.like_params(abstract.opt_state, abstract.params, self.param_shardings, mesh),
        )
        self.abstract_state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, self.state_shardings
        )
        self.batch_sharding = sharding.batch_sharding(mesh)
        self._jitted = _programs(self)
        self.train_step, self.eval_step = self._jitted.train_step, self._jitted.eval_step

    def group(self, members: int) -> 'RunGroup':
        """`members` runs of this TrainSteps's config (differing only in seed) stepped together."""
        return RunGroup(self, members)

    def _init(self, key: jax.Array) -> TrainState:
        model = Decoder(self.config.model, rngs=nnx.Rngs(params=key))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

    def init_state(self, seed: int) -> TrainState:
        """A fresh state, created on the devices directly in its sharded layout."""
        return self._jitted.init(jnp.int32(seed))

    def _loss_and_grads(self, params: dict, batch: Batch) -> tuple[tuple[jax.Array, jax.Array], Any]:
        return jax.value_and_grad(loss_sums, argnums=1, has_aux=True)(
            self.graphdef, params, batch, self.config.optimizer.z_loss
        )

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
        finite = (
            jnp.isfinite(total)
            & jnp.isfinite(grad_norm)
            & jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]))
        )
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        if self.config.train.nan_policy == 'skip':  # keep the old state; under 'error' the host stops
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
            new_state = new_state._replace(step=state.step + 1)
        return new_state, {
            'loss': cross_entropy / tokens,
            'grad_norm': grad_norm,
            'lr': self.learning_rate(state.step),
            'tokens': tokens,
            'finite': finite,
        }

    def _eval_step(self, params: dict, batch: Batch) -> Metrics:
        """Sums over the batch's unmasked targets: cross-entropy (nats), tokens, and the UTF-8 bytes
        they stand for (batch['target_bytes'], from Tokenizer.encode_counting_bytes)."""
        _, cross_entropy = loss_sums(self.graphdef, params, batch, 0.0)
        mask = batch['loss_mask'].astype(jnp.float32)
        return {
            'loss_sum': cross_entropy,
            'tokens': jnp.sum(mask),
            'bytes': jnp.sum(batch['target_bytes'].astype(jnp.float32) * mask),
        }

    @functools.cached_property
    def row_share(self) -> tuple[int, int]:
        """(which share, how many) of every batch's rows this process supplies: sharding.row_share."""
        return sharding.row_share(self.mesh)

    def device_batch(self, local_batch: dict[str, np.ndarray]) -> Batch:
        """This process's share of the rows, whole sequences (B / shares, L) -> one global array per
        field, rows over ('data', 'fsdp') and each sequence over `context`."""
        shares = self.row_share[1]
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v, (len(v) * shares, *v.shape[1:]))
            for k, v in local_batch.items()
        }


class RunGroup:
    """Runs of one step program (one TrainSteps; they differ only in seed) stepped together: each state
    leaf gets a leading run axis (replicated, see `_with_run_axis`), the batch is shared, and one
    compiled step (the TrainSteps's, vmapped) updates every member. One member is the TrainSteps's own
    step, with no run axis."""

    def __init__(self, trainer: TrainSteps, members: int):
        self.trainer, self.members = trainer, members
        self._jitted = _programs(trainer, members)
        self.train_step, self.eval_step = self._jitted.train_step, self._jitted.eval_step
        self.device_batch, self.row_share = trainer.device_batch, trainer.row_share

    def init_state(self, seeds: list[int]) -> TrainState:
        """Fresh states for the members' seeds (each the state its TrainSteps's `init_state` gives)."""
        if len(seeds) != self.members:
            raise ValueError(f'{len(seeds)} seeds for a group of {self.members}')
        return self._jitted.init(jnp.asarray(seeds[0] if self.members == 1 else seeds, jnp.int32))

    def stack(self, states: list[TrainState]) -> TrainState:
        """The group's state from its members' (in member order)."""
        if len(states) != self.members:
            raise ValueError(f'{len(states)} states for a group of {self.members}')
        return states[0] if self.members == 1 else self._jitted.stack(*states)

    def member(self, tree: Any, index: int) -> Any:
        """Member `index`'s part of a group's state, parameters or metrics."""
        return tree if self.members == 1 else jax.tree.map(lambda x: x[index], tree)
