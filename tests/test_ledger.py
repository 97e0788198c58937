"""The ledger's fingerprint of a run's config (vrl/experiments/ledger.py): what names a run across machines,
sittings and code versions."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from configs import reproduce_cpu
from vrl.core.config import from_dict
from vrl.experiments import ledger
from vrl.model.config import ModelConfig, before_residual
from vrl.train.config import Config, from_configdict
from vrl.train.rundir import workdir as workdir_lib

REPO = pathlib.Path(__file__).resolve().parents[1]

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


def test_the_committed_family_ledger_names_its_runs_under_today_s_fields():
    """docs/scaling/family.results.jsonl was written while each residual method had its own switch
    (model.attn_residuals='block'): each row's config, rebuilt from the grid's base and the row's
    `differs` as a config of that time reads today, still has the row's fingerprint, so a study finds
    the runs instead of training them again."""
    base = workdir_lib.as_json(from_configdict(reproduce_cpu.get_config()))
    rows = [json.loads(line) for line in (REPO / 'docs/scaling/family.results.jsonl').read_text().splitlines()]
    assert any('model.attn_residuals' in row['differs'] for row in rows)
    for row in rows:
        values = {section: dict(fields) for section, fields in base.items()}
        values['model'] = before_residual(values['model'])  # the base as that time spelled it
        for name, value in row['differs'].items():
            section, field = name.split('.')
            values[section][field] = value
        assert ledger.fingerprint(from_dict(Config, values)) == row['fingerprint'], row['name']


def test_each_residual_method_has_its_own_fingerprint():
    """model.residual's methods (and a method added after the first ledgers) name different runs: the
    fingerprint's spelling before model.residual keeps the field where a method has no earlier switch."""
    configs = [Config(model=ModelConfig(residual=method)) for method in ('plain', 'dense', 'mudd', 'hc', 'mhc')]
    configs += [Config(model=ModelConfig(residual='attnres', attn_residual_blocks=blocks)) for blocks in (0, 8)]
    assert len({ledger.fingerprint(config) for config in configs}) == len(configs)
    assert before_residual({'residual': 'a_later_method'})['residual'] == 'a_later_method'
