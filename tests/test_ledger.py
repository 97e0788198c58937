"""The ledger's fingerprint of a run's config (vrl/experiments/ledger.py): what names a run across machines,
sittings and code versions."""

from __future__ import annotations

import dataclasses

from vrl.experiments import ledger
from vrl.train.config import Config

# the default config's fingerprint since ledgers began (2026-12-06): every committed ledger's rows were named
# by fingerprints of this scheme
DEFAULT_FINGERPRINT = '68c470735f2a2979'


def test_a_new_config_field_at_its_default_names_the_same_runs():
    """A field added to the config with a default that computes what runs computed before it must leave the
    fingerprints as they were, or every ledger's runs would train again: list it in
    ledger.ADDED_AFTER_LEDGERS. Set to another value, it names another run."""
    assert ledger.fingerprint(Config()) == DEFAULT_FINGERPRINT, (
        'a config field changed every fingerprint; if it was added with a neutral default, list it in '
        'vrl/experiments/ledger.py ADDED_AFTER_LEDGERS'
    )
    base = Config()
    cut = dataclasses.replace(base, train=dataclasses.replace(base.train, init_value_heads='first'))
    assert ledger.fingerprint(cut) != DEFAULT_FINGERPRINT


def test_where_and_how_a_run_ran_does_not_change_its_name():
    """Fields that say where or how (a data directory, checkpoint cadence, microbatches) leave the fingerprint."""
    base = Config()
    moved = dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, data_dir='/elsewhere'),
        train=dataclasses.replace(base.train, checkpoint_every=7, microbatches=2),
    )
    assert ledger.fingerprint(moved) == ledger.fingerprint(base)
    other_lr = dataclasses.replace(base, optimizer=dataclasses.replace(base.optimizer, peak_lr=0.5))
    assert ledger.fingerprint(other_lr) != ledger.fingerprint(base)
