"""Any named variant (vrl/model/presets.py) at one of base.py's sizes: `configs/preset.py:mudd,82m`.

arg: 'PRESET,SIZE[,SEQ[,OPTIMIZER]]', e.g. 'mudd,468m', 'mudd:vr,82m,2k,muon', 'denseformer,180m':
base.py's recipe, shape and data with the preset's model fields (`python -m vrl.experiments.compare
--list_variants` lists the presets).
"""

import dataclasses

import ml_collections

from configs import base
from vrl.model import presets
from vrl.train import config as vrl_config


def get_config(arg: str = 'mudd,82m') -> ml_collections.ConfigDict:
    name, _, rest = arg.partition(',')
    if name not in presets.PRESETS:
        raise vrl_config.ConfigError(
            f'configs/preset.py:{arg} is invalid: allowed PRESET,SIZE[,SEQ[,OPTIMIZER]] with PRESET one of '
            f'{", ".join(presets.PRESETS)}.'
        )
    config = vrl_config.from_configdict(base.get_config(f'vanilla,{rest}'))
    return vrl_config.to_configdict(dataclasses.replace(config, model=presets.apply(name, config.model)))
