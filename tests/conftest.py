"""Test setup: 8 fake CPU devices for the sharding tests, set before jax is imported."""

import os
import sys
from pathlib import Path

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
