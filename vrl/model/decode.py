"""KV-cache decoding: a jitted prefill, then a `lax.while_loop` of one-token steps.

Prompts of different lengths are left-padded to one length P, so every sequence writes the
same cache position each step; padding is masked out and RoPE positions count real tokens
only. The cache (vrl/model/cache.py) holds a key array and a value array, a slot, per layer that
owns them: SVFormer's layers >= 2 all read layer 1's V ((L + 1) / (2L) of vanilla's bytes),
CLA's groups share one slot of each (half with CLA2).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from vrl.core import sharding
from vrl.core.errors import VrlError
from vrl.model.cache import KVCache, cache_bytes, cache_shardings, init_cache
from vrl.model.config import ModelConfig
from vrl.model.decoder import Decoder


class DecodeError(VrlError, ValueError):
    """Bad generation input (empty prompt, too long for the cache)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are drawn; DecodeError names a value outside its range."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 64
    seed: int = 0

    def __post_init__(self):
        for name, ok, allowed in (
            ('temperature', self.temperature >= 0, '>= 0 (0 = greedy)'),
            ('top_k', self.top_k >= 0, '>= 0 (0 = off)'),
            ('top_p', 0 < self.top_p <= 1, 'in (0, 1] (1 = off)'),
            ('max_new_tokens', self.max_new_tokens >= 1, '>= 1'),
        ):
            if not ok:
                raise DecodeError(f'{name}={getattr(self, name)!r} is invalid: allowed {allowed}.')

    def check_vocab(self, vocab_size: int) -> None:
        if self.top_k > vocab_size:
            raise DecodeError(f'top_k={self.top_k} is invalid: allowed 0..{vocab_size} (the vocabulary).')


def sample(logits_BxV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens (B,): greedy, or temperature with optional top-k and top-p (nucleus) filtering."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits = logits_BxV / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        sorted_desc = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
        # smallest set whose probability reaches top_p: keep tokens whose preceding mass < top_p
        keep = jnp.concatenate([jnp.ones_like(cumulative[:, :1], bool), cumulative[:, :-1] < sampling.top_p], -1)
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # the new tokens of each prompt (up to and including EOS)
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    cache_bytes: int


class Generator:
    """Jitted prefill and decode loop for one model, batch size and cache length."""

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        params: Any,
        max_len: int,
        eos_id: int,
        mesh: Mesh | None = None,
        prefill_chunk: int = 512,
    ):
        self.cfg, self.graphdef, self.params = cfg, graphdef, params
        self.max_len, self.eos_id, self.mesh = max_len, eos_id, mesh
        self.prefill_chunk = prefill_chunk
        self._compiled: dict[tuple, tuple[Any, Any]] = {}  # (B, P, sampling) -> (prefill, decode)

    def _model(self, params) -> Decoder:
        return nnx.merge(self.graphdef, params)

    def _pinned(self, cache: KVCache) -> KVCache:
        """The cache laid out over the mesh as `new_cache` lays it, so that prefill hands the decode
        loop the layout it was compiled for (GSPMD may otherwise choose another for an output)."""
        if self.mesh is None:
            return cache
        batch = cache.k[0].shape[0] // self.cfg.n_kv_heads
        return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, batch, self.mesh))

    def _prefill_fn(self, params, cache: KVCache, tokens_BxP, pad_B):
        """The prompt in chunks of at most `prefill_chunk` tokens (the first takes the remainder), so
        attention scores are (chunk x cache length) at a time, never (prompt x cache length)."""
        model, (B, P), C = self._model(params), tokens_BxP.shape, self.prefill_chunk
        layers = model.split_layers()
        head = P % C or min(P, C)
        logits_BxTxV, cache = model.decode(tokens_BxP[:, :head], pad_B, cache, layers)
        if P == head:
            return logits_BxTxV[:, -1], self._pinned(cache)
        chunks_NxBxC = tokens_BxP[:, head:].reshape(B, -1, C).swapaxes(0, 1)

        def chunk(cache, tokens_BxC):
            logits_BxCxV, cache = model.decode(tokens_BxC, pad_B, cache, layers)
            return cache, logits_BxCxV[:, -1]

        cache, last_NxBxV = jax.lax.scan(chunk, cache, chunks_NxBxC)
        return last_NxBxV[-1], self._pinned(cache)

    def _decode_fn(self, params, cache: KVCache, first_logits_BxV, pad_B, key, sampling: Sampling):
        B = first_logits_BxV.shape[0]
        steps = sampling.max_new_tokens
        out_BxN = jnp.zeros((B, sampling.max_new_tokens), jnp.int32)
        model = self._model(params)
        layers = model.split_layers()  # once, not every step: costs one copy of the layer weights

        def cond(carry):
            _, _, _, done_B, step, _ = carry
            return (step < steps) & ~jnp.all(done_B)

        def body(carry):
            cache, logits_BxV, out_BxN, done_B, step, key = carry
            key, sample_key = jax.random.split(key)
            token_B = jnp.where(done_B, self.eos_id, sample(logits_BxV, sample_key, sampling))
            out_BxN = out_BxN.at[:, step].set(token_B)
            done_B = done_B | (token_B == self.eos_id)
            logits_Bx1xV, cache = model.decode(token_B[:, None], pad_B, cache, layers)
            return self._pinned(cache), logits_Bx1xV[:, 0], out_BxN, done_B, step + 1, key

        carry = (cache, first_logits_BxV, out_BxN, jnp.zeros((B,), bool), jnp.zeros((), jnp.int32), key)
        cache, _, out_BxN, _, step, _ = jax.lax.while_loop(cond, body, carry)
        return out_BxN, step, cache

    def _compile(self, cache: KVCache, tokens_BxP, pad_B, key, sampling: Sampling) -> tuple[Any, Any]:
        """Ahead-of-time compiled prefill and decode loop, once per (batch, prompt length, sampling)."""
        signature = (*tokens_BxP.shape, sampling)
        if signature not in self._compiled:
            prefill = (
                jax.jit(sharding.traced_in(self.mesh, self._prefill_fn), donate_argnums=1)
                .lower(self.params, cache, tokens_BxP, pad_B)
                .compile()
            )
            logits, cache = jax.eval_shape(self._prefill_fn, self.params, cache, tokens_BxP, pad_B)
            decode = self.decode_fn(sampling).lower(self.params, cache, logits, pad_B, key).compile()
            self._compiled[signature] = (prefill, decode)
        return self._compiled[signature]

    def decode_fn(self, sampling: Sampling):
        """The jitted decode loop: (params, cache, first logits (B, V), pad (B,), key) -> (tokens (B, N),
        steps, cache). The cache is donated and returned: the loop writes into it where it lies."""
        return jax.jit(
            sharding.traced_in(self.mesh, functools.partial(self._decode_fn, sampling=sampling)), donate_argnums=1
        )

    def new_cache(self, batch: int) -> KVCache:
        cache = init_cache(self.cfg, batch, self.max_len)
        if self.mesh is not None:
            cache = jax.device_put(cache, cache_shardings(cache, batch, self.mesh))
        return cache

    def generate(self, prompts: list[list[int]], sampling: Sampling = Sampling()) -> Generation:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise DecodeError('empty prompt: every prompt needs at least one token.')
        P = max(len(p) for p in prompts)
        if P + sampling.max_new_tokens > self.max_len:
            raise DecodeError(
                f'prompt of {P} tokens + {sampling.max_new_tokens} new tokens exceeds the '
                f'maximum length {self.max_len}; shorten the prompt or ask for fewer tokens.'
            )
        tokens_BxP = np.zeros((len(prompts), P), np.int32)
        pad_B = np.array([P - len(p) for p in prompts], np.int32)
        for row, prompt in enumerate(prompts):
            tokens_BxP[row, P - len(prompt) :] = prompt
        cache = self.new_cache(len(prompts))
        n_bytes = cache_bytes(cache)
        tokens_BxP, pad_B, key = jnp.asarray(tokens_BxP), jnp.asarray(pad_B), jax.random.key(sampling.seed)
        prefill, decode = self._compile(cache, tokens_BxP, pad_B, key, sampling)  # not timed
        start = time.perf_counter()
        logits, cache = prefill(self.params, cache, tokens_BxP, pad_B)
        jax.block_until_ready(logits)
        prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        out_BxN, steps, _ = decode(self.params, cache, logits, pad_B, key)
        out_BxN, steps = np.asarray(out_BxN), int(steps)
        decode_seconds = time.perf_counter() - start
        completions = []
        for row in out_BxN[:, :steps].tolist():
            completions.append(row[: row.index(self.eos_id) + 1] if self.eos_id in row else row)
        return Generation(completions, prefill_seconds, decode_seconds, steps, n_bytes)
