"""vrl's hc connection against an independent implementation of Zhu et al.'s dynamic hyper-connections:
the `hyper-connections` package's HyperConnections (PyTorch), on the same random weights.

Its conventions, mapped onto vrl's: the streams are folded into the batch ((b s) ... d); static_alpha
(n, 1 + n) is [input weights | remix], column 1 + j holding the weights of every stream in stream j
(vrl's static_res transposed); dynamic_alpha_fn (D, 1 + n) and dynamic_beta_fn (D,) are vrl's W; its
RMSNorm scales by gamma + 1 and has no eps (vrl's model then runs with a negligible one). Its mHC is
not DeepSeek's formulation (it normalises each stream apart), so only hc is compared.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import rel_err, small_model_config

torch = pytest.importorskip(
    'torch', reason='PyTorch is in requirements-extra.txt: pip install -r requirements-extra.txt'
)
hyper_connections = pytest.importorskip(
    'hyper_connections', reason='hyper-connections is in requirements-extra.txt: pip install -r requirements-extra.txt'
)

from flax import nnx  # noqa: E402

from vrl.model.residual import hyper  # noqa: E402


@pytest.mark.parametrize('streams, sublayer', [(4, 0), (3, 1)])
def test_hc_equals_the_hyper_connections_package(streams, sublayer):
    cfg = dataclasses.replace(small_model_config(residual='hc', hyper_streams=streams, norm_eps=1e-30), d_model=16)
    n, D, B, T = streams, cfg.d_model, 2, 5
    ours = hyper.HyperConnection(cfg, sublayer=sublayer, stack=None, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(streams)
    weights = {
        'static_pre': rng.standard_normal(n),
        'static_res': rng.standard_normal((n, n)),
        'static_post': rng.standard_normal(n),
        'norm': 1 + 0.3 * rng.standard_normal(D),
        'w': 0.5 * rng.standard_normal((D, n + 2)),
        'gates': rng.uniform(0.2, 0.8, 2),
    }
    for name, value in weights.items():
        getattr(ours, name)[...] = jnp.asarray(value, jnp.float32)
    theirs = hyper_connections.HyperConnections(n, dim=D, layer_index=sublayer)
    with torch.no_grad():
        static_alpha = np.concatenate([weights['static_pre'][:, None], weights['static_res'].T], axis=1)
        theirs.static_alpha.copy_(torch.tensor(static_alpha))
        theirs.static_beta.copy_(torch.tensor(weights['static_post']))
        theirs.norm.gamma.copy_(torch.tensor(weights['norm'] - 1))
        theirs.dynamic_alpha_fn.copy_(torch.tensor(weights['w'][:, : n + 1]))
        theirs.dynamic_beta_fn.copy_(torch.tensor(weights['w'][:, n + 1]))
        theirs.dynamic_alpha_scale.fill_(weights['gates'][0])
        theirs.dynamic_beta_scale.fill_(weights['gates'][1])

    h_NxBxTxD = rng.standard_normal((n, B, T, D)).astype(np.float32)
    branch_DxD = (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)  # a sublayer: tanh(x M)
    x_BxTxD, coefficients = hyper.enter(ours, jnp.asarray(h_NxBxTxD))
    ours_after = coefficients.add(jnp.asarray(h_NxBxTxD), jnp.tanh(x_BxTxD @ branch_DxD))

    folded = torch.tensor(h_NxBxTxD.transpose(1, 0, 2, 3).reshape(B * n, T, D))  # (b s) t d
    with torch.no_grad():
        their_input, add_residual = theirs(folded)
        their_after = add_residual(torch.tanh(their_input @ torch.tensor(branch_DxD)))
    their_after = their_after.numpy().reshape(B, n, T, D).transpose(1, 0, 2, 3)
    assert rel_err(np.asarray(x_BxTxD), their_input.numpy()) < 1e-5
    assert rel_err(np.asarray(ours_after), their_after) < 1e-5


def test_mhc_sinkhorn_follows_the_papers_order_each_destination_summing_to_one():
    """The mHC paper's Eq. 9, M_t = T_r(T_c(M_{t-1})) on H_res[destination, source]: the last scaling is
    the rows', so each stream's weights over its sources sum to 1 exactly after 20 iterations, and each
    source's only approximately. The other order (rows, then columns) leaves rows off by up to 3e-2 at
    these logits. vrl's, the NumPy reference's and the export's (PyTorch) agree."""
    from tests import numpy_reference
    from vrl.interop.hf_modeling import modeling_vrl

    logits = 2.0 * np.random.default_rng(7).standard_normal((256, 4, 4))
    ours = np.asarray(hyper.sinkhorn(jnp.asarray(logits, jnp.float32)), np.float64)
    assert np.abs(ours.sum(-1) - 1).max() < 1e-5  # each destination's weights
    assert np.abs(ours.sum(-2) - 1).max() > 1e-3  # each source's: within what 20 iterations leave
    reference = numpy_reference._np_sinkhorn(logits)
    exported = modeling_vrl.sinkhorn(torch.tensor(logits)).numpy()
    assert rel_err(ours, reference) < 1e-5 and rel_err(exported, reference) < 1e-12
