"""Experiment configs: small files returning an ml_collections.ConfigDict (see base.py)."""
