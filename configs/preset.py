"""Any named variant (vrl/model/presets.py) at one of base.py's sizes: `configs/preset.py:mudd,82m`.

arg: 'PRESET,SIZE[,SEQ[,OPTIMIZER]]', e.g. 'mudd,468m', 'mudd:vr,82m,2k,muon', 'denseformer,180m':
base.py's recipe, shape and data with the preset's model fields, exactly `configs/base.py:ARG`
(`python -m vrl.experiments.compare --list_variants` lists the presets).
"""

import ml_collections

from configs import base


def get_config(arg: str = 'mudd,82m') -> ml_collections.ConfigDict:
    return base.get_config(arg)
