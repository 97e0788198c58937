"""Sums of log-probabilities of chosen tokens under a trained vrl model, sequences packed into rows
(`Scorer`): what lm-eval's loglikelihood requests cost (vrl/train/scoring/lm_eval_model.py) without lm-eval
itself."""

from __future__ import annotations

import bisect
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.core import sharding
from vrl.core.errors import VrlError
from vrl.train.trained import TrainedRun


class EvaluateError(VrlError, ValueError):
    """Bad evaluation input (unknown task, unloadable task data, bad batch size); the message says what to do."""


Sequence = tuple[list[int], int]  # (token ids, n): score ids[n:], each given the ids before it


class Scorer:
    """Sums of log-probabilities of chosen tokens under a model. The sequences are packed into rows
    (each row's sequences masked from each other, positions restarting at each, as
    data.document_masking trains); a row is the power of two of tokens (from `chunk` up to
    seq_len) that holds four of the longest sequences, so its attention costs little more than the
    sequences' own, and a batch holds batch_size x seq_len tokens. A set of requests is one program
    (a program per row length: a handful at most). On several processes each supplies its share of
    every batch's rows (sharded as the train step's batch: TrainSteps.row_share) and every process
    receives all the scores."""

    def __init__(self, run: TrainedRun, batch_size: int, chunk: int = 64):
        """batch_size: seq_len-token rows' worth per batch, rounded up to a multiple of the devices the
        batch is split over; chunk: positions whose logits exist at once ((B, L, V) float32 would be GiBs)."""
        mesh, self.max_len = run.trainer.mesh, run.config.data.seq_len
        self.run, self.chunk = run, chunk
        splits = math.prod(mesh.shape[a] for a in sharding.spec_axes(run.trainer.batch_sharding.spec[0]))
        self.batch_size = -(-batch_size // splits) * splits
        self._scores = jax.jit(sharding.traced_in(mesh, self._token_scores), out_shardings=sharding.replicated(mesh))

    def row_length(self, longest: int) -> int:
        """Tokens per packed row for sequences of at most `longest` tokens."""
        length = self.chunk
        while length < min(4 * longest, self.max_len):
            length *= 2
        return min(length, self.max_len)

    def _token_scores(self, params: Any, rows: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Float32 log p(target) (B, L) and whether the target is the most likely token (B, L), from
        the logits of `chunk` positions at a time."""
        model = nnx.merge(self.run.trainer.graphdef, params)
        hidden_BxLxD = model.hidden(rows['inputs'], rows['positions'], rows['segment_ids'])
        B, L, D = hidden_BxLxD.shape
        C = math.gcd(L, self.chunk)

        def score(chunk):
            hidden_BxCxD, targets_BxC = chunk
            logits_BxCxV = model.logits(hidden_BxCxD)
            target_logits_BxC = jnp.take_along_axis(logits_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
            return (
                target_logits_BxC - jax.nn.logsumexp(logits_BxCxV, axis=-1),
                logits_BxCxV.argmax(axis=-1) == targets_BxC,
            )

        chunks = (
            hidden_BxLxD.reshape(B, L // C, C, D).swapaxes(0, 1),
            rows['targets'].reshape(B, L // C, C).swapaxes(0, 1),
        )
        log_probs_NxBxC, greedy_NxBxC = jax.lax.map(score, chunks)
        return log_probs_NxBxC.swapaxes(0, 1).reshape(B, L), greedy_NxBxC.swapaxes(0, 1).reshape(B, L)

    def score(self, sequences: list[Sequence]) -> list[tuple[float, bool]]:
        """For each (ids, n), 1 <= n < len(ids) <= seq_len + 1: (sum over t >= n of log p(ids[t] | ids[:t])
        in nats, whether every ids[t] is the model's argmax)."""
        for ids, n in sequences:
            if not 1 <= n < len(ids) <= self.max_len + 1:
                raise EvaluateError(
                    f'cannot score {len(ids)} tokens from position {n}: allowed 1 <= n < length '
                    f'<= seq_len + 1 = {self.max_len + 1}.'
                )
        lengths = [len(ids) - 1 for ids, _ in sequences]
        L = self.row_length(max(lengths, default=1))
        rows, per_batch = _pack(lengths, L), self.batch_size * max(1, self.max_len // L)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(sequences)
        index, shares = self.run.trainer.row_share
        share = per_batch // shares
        for start in range(0, len(rows), per_batch):
            batch = rows[start : start + per_batch]
            placed = self.run.trainer.device_batch(
                _row_arrays(batch[share * index : share * (index + 1)], sequences, share, L)
            )
            log_probs_BxL, greedy_BxL = jax.device_get(self._scores(self.run.params, placed))
            for b, row in enumerate(batch):
                for i, offset in row:
                    ids, n = sequences[i]
                    scored = slice(offset + n - 1, offset + len(ids) - 1)  # position t - 1 predicts ids[t]
                    results[i] = (
                        float(np.sum(log_probs_BxL[b, scored], dtype=np.float64)),
                        bool(np.all(greedy_BxL[b, scored])),
                    )
        return results


def _pack(lengths: list[int], row_length: int) -> list[list[tuple[int, int]]]:
    """Rows of (sequence index, offset) holding sequences of the given lengths, each at most
    row_length: best fit, longest first, so few rows are left part empty."""
    rows: list[list[tuple[int, int]]] = []
    free: list[tuple[int, int]] = []  # (positions left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([])
            left, row = row_length, len(rows) - 1
        else:
            left, row = free.pop(at)
        rows[row].append((i, row_length - left))
        if left - lengths[i]:
            bisect.insort(free, (left - lengths[i], row))
    return rows


def _row_arrays(
    rows: list[list[tuple[int, int]]], sequences: list[Sequence], n_rows: int, length: int
) -> dict[str, np.ndarray]:
    """(n_rows, length) int32 inputs, targets, positions and segment ids (1, 2, ... per sequence of a row;
    0 after them) of packed rows; rows past `rows` are empty."""
    arrays = {k: np.zeros((n_rows, length), np.int32) for k in ('inputs', 'targets', 'positions', 'segment_ids')}
    for b, row in enumerate(rows):
        for segment, (i, offset) in enumerate(row, 1):
            ids = sequences[i][0]
            span = slice(offset, offset + len(ids) - 1)
            arrays['inputs'][b, span], arrays['targets'][b, span] = ids[:-1], ids[1:]
            arrays['positions'][b, span] = np.arange(len(ids) - 1)
            arrays['segment_ids'][b, span] = segment
    return arrays
