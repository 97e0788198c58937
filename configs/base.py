"""The paper's recipe (vrl/config.py defaults) at one of its three sizes, for one variant.

Use directly as `--config=configs/base.py:svformer,468m`, or through the thin named files
(`configs/svformer_468m.py`). Sizes are PAPER.md's 'Model sizes' table.
"""

import dataclasses

import ml_collections

from vrl import config as vrl_config

SIZES = {
    '82m': dict(n_layers=8, n_heads=8, n_kv_heads=8, d_model=512, d_ff=1792),
    '180m': dict(n_layers=12, n_heads=12, n_kv_heads=12, d_model=768, d_ff=2688),
    '468m': dict(n_layers=24, n_heads=16, n_kv_heads=16, d_model=1024, d_ff=3584),
}


def get_config(arg: str = 'vanilla,82m') -> ml_collections.ConfigDict:
    """arg: 'VARIANT,SIZE', e.g. 'resformer,180m'."""
    parts = arg.split(',')
    if len(parts) != 2:
        raise vrl_config.ConfigError(f'configs/base.py:{arg} is invalid: allowed VARIANT,SIZE such as '
                                     f'resformer,180m (sizes: {", ".join(sorted(SIZES))}).')
    attention, size = parts
    if size not in SIZES:
        raise vrl_config.ConfigError(f'size {size!r} is invalid: allowed one of {sorted(SIZES)}.')
    model = dataclasses.replace(vrl_config.ModelConfig(), attention=attention, **SIZES[size])
    data = dataclasses.replace(vrl_config.DataConfig(), name='c4/en:3.1.0')
    return vrl_config.to_configdict(vrl_config.Config(model=model, data=data))
