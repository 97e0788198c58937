"""How the layers connect: the hooks every residual-stream method implements (model.residual).

vrl/model/decoder.py walks the layers and calls these hooks; it names no method. Between sublayers a
method keeps the stream `h` (B, L, D) (hyper-connections: (n, B, L, D)) and, where it needs one, a
depth `history` (the earlier layers' outputs), which the layer scan carries:

- `begin`: the stream and the history before layer 1, from the embedding output.
- `sublayer_input`: the input (B, L, D) of a layer's attention (sublayer 0) or MLP (1) before its
  pre-norm, and what `add` needs to add the sublayer's output.
- `attention_inputs`: the attention's normalised query, key and value inputs: the pre-norm of
  `sublayer_input` for all three, unless the method mixes them apart (MUDD).
- `add`: the stream (and the history) after a sublayer's output is added.
- `after_layer`: what a layer hands the next: the stream, the history, and the next attention's own
  inputs where the method mixes them apart (None otherwise).
- `written`: where each scanned step starts writing the history (vrl/model/history_scan.py keeps
  it once for the backward pass).
- `hidden`: the hidden state (B, L, D) the statistics read; `readout`: the final norm's input.
- `stream_axes`: the stream's logical axes, given a hidden state's.

Parameters: `model_params` are held by the Decoder and `block_params` by each Block (stacked over
layers 2..L), under the names they are returned with: those names are the checkpoint's and the
export's paths. `per_layer` turns the model's parameters into per-layer inputs with a leading axis
over the L layers, which the layer scan slices.

Config: model.residual names the method, its own fields sit beside it in vrl/model/config.py
(RESIDUAL_FIELDS, with their checks), which the method reads.

Accounting: vrl/model/accounting.py counts every parameter from the abstract model; what the parameters
do not say comes from the method: `matmul_params`, its weights used once per token in a matmul;
`mix_macs`, the multiply-adds per token of the rest of its work (its mixes, its weights used more than
once); `history_vectors`, the vectors of D a forward holds per token beside the hidden state;
`constant_params`, its parameters that never get a gradient.

`Plain` is the standard residual stream, h + each sublayer's output; the other methods subclass it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from vrl.model.config import ModelConfig

Array = jax.Array
History = Any  # a method's depth history: None, a buffer the scan carries, or a tuple of unrolled outputs


@dataclasses.dataclass(frozen=True)
class Plain:
    """The standard residual stream: each sublayer reads h and adds its output to it."""

    cfg: ModelConfig

    def model_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        return {}

    def block_params(self, *, first: bool, stack: int | None, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        return {}

    def per_layer(self, model: nnx.Module) -> Any:
        return None

    def begin(self, model: nnx.Module, embedded_BxLxD: Array, scanned: bool) -> tuple[Array, History]:
        return embedded_BxLxD, None

    def sublayer_input(
        self, block: nnx.Module, h: Array, history: History, layer: int | Array, sublayer: int
    ) -> tuple[Array, Any]:
        return h, None

    def attention_inputs(
        self, block: nnx.Module, h: Array, history: History, inputs: Array | None, layer: int | Array
    ) -> tuple[Array, Array, Array, Any]:
        """The normalised query, key and value inputs (B, L, D) and what `add` needs."""
        x, adding = self.sublayer_input(block, h, history, layer, 0)
        x_BxLxD = block.attn_norm(x)
        return x_BxLxD, x_BxLxD, x_BxLxD, adding

    def add(
        self,
        block: nnx.Module,
        h: Array,
        history: History,
        out_BxLxD: Array,
        adding: Any,
        layer: int | Array,
        sublayer: int,
    ) -> tuple[Array, History]:
        return h + out_BxLxD, history

    def after_layer(
        self, model: nnx.Module, h: Array, history: History, weights: Any, layer: int | Array
    ) -> tuple[Array, History, Array | None]:
        return h, history, None

    def written(self, first_layers: list[int]) -> tuple[int, ...]:
        """How many history entries a scanned step that starts at each 0-based layer receives."""
        raise NotImplementedError(f'{type(self).__name__} keeps no history')

    def hidden(self, h: Array, history: History) -> Array:
        return h

    def readout(self, model: nnx.Module, h: Array, history: History) -> Array:
        return self.hidden(h, history)

    def stream_axes(self, activation: tuple) -> tuple:
        return activation

    def matmul_params(self) -> int:
        return 0

    def mix_macs(self) -> int:
        return 0

    def history_vectors(self) -> int:
        return 0

    def constant_params(self) -> int:
        return 0
