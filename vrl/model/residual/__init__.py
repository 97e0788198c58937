"""How the layers connect (model.residual): one module per method, each implementing base.Plain's
hooks, and this registry, the one place a method is named."""

from vrl.model.residual import attnres, base, dense, hyper, mudd

METHODS = {
    'plain': base.Plain,
    'dense': dense.DenseFormer,
    'mudd': mudd.Mudd,
    'hc': hyper.Hyper,
    'mhc': hyper.Hyper,
    'attnres': attnres.AttnRes,
}


def of(cfg) -> base.Plain:
    """The config's method, its hooks bound to the config."""
    return METHODS[cfg.residual](cfg)
