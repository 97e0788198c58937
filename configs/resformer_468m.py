"""resformer at the paper's 468m size (see base.py for the recipe)."""

from configs import base


def get_config():
    return base.get_config('resformer,468m')
