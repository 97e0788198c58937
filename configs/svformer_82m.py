"""svformer at the paper's 82m size (see base.py for the recipe)."""

from configs import base


def get_config():
    return base.get_config('svformer,82m')
