"""Where prepared datasets live and what names their folders hold, for the builder (build.py) and
every reader (corpus.py, pipeline.py, tokens.py):

    DATA_DIR/NAME/VERSION/      TFDS's files (TEMPLATE names the shards) and INPUTS, the record of
                                what the dataset was made from (its hash: the dataset's fingerprint)
    DATA_DIR/NAME/DOMAINS       a build by domain: the datasets it made
    DATA_DIR/NAME/BUILD/        a build's state until it is done: PLAN and the finished UNITS

DATA_DIR is data.data_dir, or VRL_DATA_DIR, or ~/.cache/vrl/tensorflow_datasets.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from vrl.core import storage
from vrl.data.sources import DataError

VERSION = '1.0.0'
TEMPLATE = '{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}'
BUILD, PLAN, UNITS = 'vrl_build', 'plan.json', 'units'
INPUTS, DOMAINS = 'vrl_inputs.json', 'vrl_domains.json'


def default_data_dir() -> str:
    """VRL_DATA_DIR, or ~/.cache/vrl/tensorflow_datasets."""
    return os.environ.get('VRL_DATA_DIR', str(Path.home() / '.cache' / 'vrl' / 'tensorflow_datasets'))


def checked_data_dir(data_dir: str) -> str:
    """`data_dir`, or the default for ''; DataError for a local file or a missing bucket."""
    data_dir = data_dir or default_data_dir()
    if storage.is_remote(data_dir):
        storage.exists(storage.path(data_dir), 'data_dir')  # a missing bucket or store: one line
        return data_dir
    if Path(data_dir).exists() and not Path(data_dir).is_dir():
        raise DataError(
            f'data_dir {data_dir!r} is a file, not a folder: point data.data_dir (or --data_dir) '
            'at the folder that holds the prepared datasets.'
        )
    return data_dir


def fingerprint_of(inputs_record: bytes) -> str:
    """What a prepared dataset holds, in 16 hex digits: the SHA-256 of its vrl_inputs.json."""
    return hashlib.sha256(inputs_record).hexdigest()[:16]
