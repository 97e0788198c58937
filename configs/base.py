"""The paper's recipe (vrl/core/config.py defaults) at one of its three sizes, for one variant.

Use directly as `--config=configs/base.py:svformer,468m` (the variant: any preset of
vrl/model/presets.py, e.g. `configs/base.py:attnres:block,82m`), or through the thin named files
(`configs/svformer_468m.py`). Sizes are docs/paper.md's sizes table. A third part picks
one of the paper's sequence lengths with its batch, ~2M tokens per step (docs/paper.md):
`configs/base.py:svformer,82m,64k` is 65,536 x 32. RoPE theta stays the paper's 10,000;
override it with `--config.model.rope_theta=...`. A fourth part picks the optimizer recipe
(vrl/train/optimizer.py's RECIPES): `configs/base.py:svformer,468m,2k,muon`. Microbatches and
remat are `auto` (vrl/train/aot.py): the fewest microbatches and the cheapest remat whose step
fits the devices' memory, chosen by compiling before step 1; set them to override. From 64k on,
`mesh.context` is auto too: each sequence is split over chips only where a whole one does not fit.
"""

import dataclasses

import ml_collections

from vrl.model import presets
from vrl.train import config as vrl_config
from vrl.train import optimizer

SIZES = {
    '82m': dict(n_layers=8, n_heads=8, n_kv_heads=8, d_model=512, d_ff=1792),
    '180m': dict(n_layers=12, n_heads=12, n_kv_heads=12, d_model=768, d_ff=2688),
    '468m': dict(n_layers=24, n_heads=16, n_kv_heads=16, d_model=1024, d_ff=3584),
}


# sequence length -> sequences per step (~2M tokens): the paper's study (512 to 64k) and, for
# context parallelism (mesh.context), 128k and 256k
SEQUENCES = {
    '512': (512, 4096),
    '2k': (2048, 1024),
    '8k': (8192, 256),
    '32k': (32768, 64),
    '64k': (65536, 32),
    '128k': (131072, 16),
    '256k': (262144, 8),
}
LONG = 65536  # from this length, mesh.context is auto: split each sequence over chips only if it must


def get_config(arg: str = 'vanilla,82m') -> ml_collections.ConfigDict:
    """arg: 'PRESET,SIZE[,SEQ[,OPTIMIZER]]', e.g. 'resformer,180m', 'svformer,82m,64k,muon' or 'mudd:vr,82m'."""
    parts = arg.split(',')
    if len(parts) not in (2, 3, 4):
        raise vrl_config.ConfigError(
            f'configs/base.py:{arg} is invalid: allowed PRESET,SIZE[,SEQ[,OPTIMIZER]] '
            'such as resformer,180m (presets: python -m vrl.experiments.compare --list_variants; sizes: '
            f'{", ".join(sorted(SIZES))}; sequence lengths: '
            f'{", ".join(SEQUENCES)}; optimizers: {", ".join(optimizer.RECIPES)}).'
        )
    preset, size, seq, optimizer_name = (*parts, *('2k', 'adamw')[len(parts) - 2 :])
    if size not in SIZES:
        raise vrl_config.ConfigError(f'size {size!r} is invalid: allowed one of {sorted(SIZES)}.')
    if seq not in SEQUENCES:
        raise vrl_config.ConfigError(f'sequence length {seq!r} is invalid: allowed one of {list(SEQUENCES)}.')
    seq_len, batch_size = SEQUENCES[seq]
    model = presets.apply(preset, dataclasses.replace(vrl_config.ModelConfig(), remat='auto', **SIZES[size]))
    data = dataclasses.replace(vrl_config.DataConfig(), name='c4/en:3.1.0', seq_len=seq_len, batch_size=batch_size)
    train = dataclasses.replace(vrl_config.TrainConfig(), microbatches=0)
    mesh = dataclasses.replace(vrl_config.MeshConfig(), context=0 if seq_len >= LONG else 1)
    opt = optimizer.recipe(vrl_config.OptimizerConfig(), optimizer_name)
    return vrl_config.to_configdict(vrl_config.Config(model=model, data=data, optimizer=opt, train=train, mesh=mesh))
