"""Training end to end on the real corpus: loss falls, resume is exact, preemption and kills are safe."""

import collections
import dataclasses
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from tests.conftest import ROOT
from tests.helpers import module_matmul_params, rel_err, train_steps
from tests.runs import logged_steps, params_equal, saved_steps, start_run, tiny_config, wait_for
from vrl.core import sharding
from vrl.data import corpus, pipeline
from vrl.model import accounting
from vrl.train import loop, start, validation
from vrl.train.rundir import checkpoint

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


def _unigram_entropy(small_corpus) -> float:
    """Nats per token of the training split's token frequencies: what a model that ignores context
    reaches at best."""
    cfg, tokenizer = small_corpus
    counts = collections.Counter()
    for text in corpus.texts(corpus.open_split('plays', cfg.data_dir, 'train')):
        counts.update(tokenizer.encode(text).tolist())
    frequencies = np.array(list(counts.values()), np.float64) / sum(counts.values())
    return float(-(frequencies * np.log(frequencies)).sum())


def test_end_to_end_loss_falls_and_artifacts_written(small_corpus, tmp_path, capsys):
    config = tiny_config(
        small_corpus,
        steps=200,
        eval_every=100,
        sample_prompt='HAMLET.',
        sample_tokens=8,
        log_every=50,
        checkpoint_every=100,
    )
    result = loop.run(config, str(tmp_path))
    assert result.step == 200 and not result.preempted
    said = capsys.readouterr().out  # the prompt in brackets; no blank line between the sample and what follows
    sample = said[said.index('\nsample (greedy): ') : said.index('\ndone at step 200')]
    assert sample.startswith('\nsample (greedy): [HAMLET.]') and '\n\n' not in sample and sample == sample.rstrip()
    # it learns from context: well below the corpus's unigram entropy (5.1 nats; ln V = 6.2), which
    # a model that ignores context cannot pass
    entropy = _unigram_entropy(small_corpus)
    assert result.losses[1] > math.log(512) - 0.1
    assert np.mean([result.losses[s] for s in range(191, 201)]) < entropy - 0.2
    assert result.eval_loss < entropy - 0.25, (result.eval_loss, entropy)
    # bf16 compute (bf16 matmuls accumulating in float32, float32 parameters) learns like float32 (the
    # schedule does not depend on train.steps, so its first 40 steps are those of the run above)
    bf16 = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, compute_dtype='bfloat16'),
        train=dataclasses.replace(
            config.train, steps=40, eval_every=0, sample_prompt='', sample_tokens=4, peak_flops=1e11
        ),
    )
    bf16_losses = loop.run(bf16, str(tmp_path / 'bf16')).losses
    # MFU by hand for its logged step: FLOPs per token from the module's matmul weights and attention,
    # tokens per second from the step time, over train.peak_flops x devices
    m, d = bf16.model, bf16.data
    flops_per_token = 6 * module_matmul_params(m) + 6 * m.n_layers * m.n_heads * m.head_dim * d.seq_len
    (logged,) = [
        json.loads(line) for line in (tmp_path / 'bf16' / 'metrics.jsonl').read_text().splitlines() if '"mfu"' in line
    ]
    assert logged['tokens_per_sec'] == pytest.approx(d.batch_size * d.seq_len / logged['step_time'], rel=1e-6)
    assert logged['mfu'] == pytest.approx(
        flops_per_token * logged['tokens_per_sec'] / (1e11 * jax.device_count()), rel=1e-6
    )
    final = [np.mean([losses[s] for s in range(36, 41)]) for losses in (result.losses, bf16_losses)]
    assert abs(final[1] - final[0]) < 0.05, final
    said = capsys.readouterr().out
    assert 'train.steps=40 ends before the cosine schedule does (optimizer.decay_steps=60)' in said
    _, tokenizer = small_corpus  # no prompt given: the opening words of the run's own validation data
    opening = pipeline.opening_words(config.data, tokenizer)
    assert opening and f'\nsample (greedy): [{opening}]' in said
    records = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
    train_records = [r for r in records if 'loss' in r]
    assert [r['step'] for r in train_records] == [50, 100, 150, 200]
    for key in ('step', 'loss', 'lr', 'grad_norm', 'tokens_per_sec', 'step_time', 'mfu'):
        assert all(key in r for r in train_records), key
    assert [r['step'] for r in records if 'eval_loss' in r] == [100, 200]
    assert json.loads((tmp_path / 'config.json').read_text())['params'] > 0
    assert list((tmp_path / 'tensorboard').iterdir())
    assert sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir() if p.name.isdigit())[-1] == 200

    # the generate command on this run, and its errors
    def generate(workdir, *prompts, flags=('--max_new_tokens=5',)):
        return subprocess.run(
            [
                sys.executable,
                '-m',
                'vrl.tools.generate',
                f'--workdir={workdir}',
                *flags,
                *[f'--prompt={p}' for p in prompts],
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )

    out = generate(tmp_path, 'HAMLET.', 'To be')
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count('--- ') == 2 and 'decode' in out.stdout and 'KV cache' in out.stdout
    assert 'warning' not in out.stderr
    # the caches' positions split over 4 of the 8 devices: the same greedy completions
    split = generate(tmp_path, 'HAMLET.', 'To be', flags=('--max_new_tokens=5', '--context=4'))
    assert split.returncode == 0, split.stderr[-2000:]
    assert [line for line in split.stdout.splitlines() if line.startswith('--- ')] == [
        line for line in out.stdout.splitlines() if line.startswith('--- ')
    ]
    # a --max_len far past what the prompts need allocates only what they need; past the trained length, a warning
    out = generate(tmp_path, 'HAMLET.', flags=('--max_new_tokens=70', '--max_len=1000000'))
    assert out.returncode == 0, out.stderr[-2000:]
    bytes_per_token = accounting.kv_cache_bytes_per_token(config.model)
    positions = int(re.search(r'warning: (\d+) positions', out.stderr).group(1))
    assert config.data.seq_len < positions <= 70 + 8 and f'KV cache {positions * bytes_per_token:,} bytes' in out.stdout
    no_checkpoint = tmp_path / 'no_checkpoint'
    no_checkpoint.mkdir()
    (no_checkpoint / 'config.json').write_text((tmp_path / 'config.json').read_text())
    out = generate(no_checkpoint, 'HAMLET.')
    assert out.returncode != 0 and 'no checkpoint in' in out.stderr and 'Traceback' not in out.stderr
    out = generate(tmp_path, ' ')
    assert out.returncode != 0 and 'empty prompt' in out.stderr


def test_resume_is_exact(small_corpus, tmp_path):
    straight = loop.run(tiny_config(small_corpus, steps=12), str(tmp_path / 'straight'))
    first = loop.run(tiny_config(small_corpus, steps=6, checkpoint_every=3), str(tmp_path / 'resumed'))
    second = loop.run(tiny_config(small_corpus, steps=12), str(tmp_path / 'resumed'))
    assert first.step == 6 and min(second.losses) == 7  # the second run started at step 7
    assert {**first.losses, **second.losses} == straight.losses
    assert params_equal(second.state.params, straight.state.params)
    assert params_equal(second.state.opt_state, straight.state.opt_state)


def test_sigterm_saves_and_resume_matches_uninterrupted(small_corpus, tmp_path):
    config = tiny_config(small_corpus, steps=60, log_every=1, checkpoint_every=1000)
    workdir = tmp_path / 'preempted'
    proc = start_run(config, workdir)
    wait_for(lambda: logged_steps(workdir) >= 3, 120, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    saved = saved_steps(workdir)
    assert len(saved) == 1 and 3 <= saved[0] < 60 and 'preempted: saved step' in output
    resumed = loop.run(config, str(workdir))
    straight = loop.run(config, str(tmp_path / 'straight'))
    assert min(resumed.losses) == saved[0] + 1
    assert params_equal(resumed.state.params, straight.state.params)


def test_kill_during_async_save_leaves_last_complete_checkpoint(small_corpus, tmp_path):
    config = tiny_config(small_corpus, steps=10_000, log_every=1, checkpoint_every=1, keep_checkpoints=2)
    workdir = tmp_path / 'killed'
    proc = start_run(config, workdir)
    in_flight = lambda: list((workdir / 'checkpoints').glob('*.orbax-checkpoint-tmp*'))  # noqa: E731
    while True:  # stopped (SIGSTOP) with a save's temporary folder there, then killed: surely mid-save
        wait_for(lambda: len(saved_steps(workdir)) >= 2 and logged_steps(workdir) >= 8 and in_flight(), 120, proc)
        proc.send_signal(signal.SIGSTOP)
        if in_flight():
            break
        proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()
    assert in_flight()
    complete = saved_steps(workdir)
    ending = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=complete[-1] + 2))
    resumed = loop.run(ending, str(workdir))
    assert min(resumed.losses) == complete[-1] + 1 and resumed.step == complete[-1] + 2
    assert not in_flight()
    assert params_equal(resumed.state.params, loop.run(ending, str(tmp_path / 'straight')).state.params)


def test_gradient_accumulation_equals_one_big_batch(small_corpus):
    config = tiny_config(small_corpus)
    _, tokenizer = small_corpus
    mesh = sharding.make_mesh(config.mesh)
    batch = next(iter(pipeline.train_dataset(config.data, tokenizer)))
    results = []
    for k in (1, 4):
        cfg = dataclasses.replace(config, train=dataclasses.replace(config.train, microbatches=k))
        trainer = train_steps(cfg, mesh)
        state, step_metrics = trainer.train_step(trainer.init_state(0), trainer.device_batch(batch))
        results.append((jax.device_get(state.params), float(step_metrics['loss'])))
    (p1, loss1), (p4, loss4) = results
    assert abs(loss1 - loss4) / loss1 < 1e-5
    flat1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(p1)])
    flat4 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(p4)])
    assert np.linalg.norm(flat1 - flat4) / np.linalg.norm(flat1) < 1e-5


def test_non_finite_step_stops_or_is_skipped(small_corpus, tmp_path, capfd):
    """LR 1e38: step 1 leaves huge but finite weights (saved); step 2's loss is not finite."""
    config = tiny_config(small_corpus, steps=4, checkpoint_every=1)
    exploding = dataclasses.replace(
        config, optimizer=dataclasses.replace(config.optimizer, peak_lr=1e38, init_lr=1e38, final_lr=1e38)
    )
    with pytest.raises(loop.TrainingError, match=r'at step 2; no checkpoint of it was written \(latest saved: 1\)'):
        loop.run(exploding, str(tmp_path / 'error'))
    assert saved_steps(tmp_path / 'error') == [1]  # no checkpoint of the bad step
    skipping = dataclasses.replace(exploding, train=dataclasses.replace(exploding.train, nan_policy='skip'))
    # steps 2, 3, 4 are skipped: the run saves step 4, then ends with an error, since most of it was skipped
    with pytest.raises(loop.TrainingError, match=r'3 of the 4 steps this run took were non-finite and skipped'):
        loop.run(skipping, str(tmp_path / 'skip'))
    abstract_params = train_steps(skipping, sharding.make_mesh(skipping.mesh)).abstract_state.params
    after_step_1 = checkpoint.restore_params(str(tmp_path / 'error'), abstract_params)
    assert saved_steps(tmp_path / 'skip')[-1] == 4
    # the skip run's step program is another compile of step 1 (it also selects), so equal up to rounding
    skipped = checkpoint.restore_params(str(tmp_path / 'skip'), abstract_params)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(jax.tree.leaves(skipped), jax.tree.leaves(after_step_1)))
    assert 'NaN or Inf' not in capfd.readouterr().err  # TensorBoard gets no non-finite scalar
    # steps 2, 3, 4 are non-finite: a limit of 2 skips in a row stops at step 4, naming it
    limited = dataclasses.replace(skipping, train=dataclasses.replace(skipping.train, max_skipped_steps=2, steps=6))
    with pytest.raises(
        loop.TrainingError,
        match=r'3 steps in a row up to step 4 were non-finite and skipped '
        r'\(train.max_skipped_steps=2\)',
    ):
        loop.run(limited, str(tmp_path / 'limited'))


def test_update_that_overflows_is_not_finite(small_corpus):
    """Finite loss and gradients, but Adam moments (mu >> sqrt(nu)) times the LR overflow float32:
    the step reports non-finite weights, and under nan_policy=skip leaves the state as it was."""
    config = tiny_config(small_corpus, nan_policy='skip')
    config = dataclasses.replace(
        config, optimizer=dataclasses.replace(config.optimizer, peak_lr=1e34, init_lr=1e34, final_lr=1e34)
    )
    trainer = train_steps(config, sharding.make_mesh(config.mesh))
    state = trainer.init_state(0)

    def extreme_moments(opt_state):
        if isinstance(opt_state, optax.ScaleByAdamState):
            return opt_state._replace(
                mu=jax.tree.map(lambda m: m + 1e3, opt_state.mu), nu=jax.tree.map(lambda n: n + 1e-12, opt_state.nu)
            )
        return opt_state

    state = state._replace(
        opt_state=jax.tree.map(
            extreme_moments, state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
    )
    before = jax.device_get(state)
    batch = next(iter(pipeline.train_dataset(config.data, pipeline.load_tokenizer(config.data, 512), 0, 1)))
    after, step_metrics = trainer.train_step(state, trainer.device_batch(batch))
    assert np.isfinite(float(step_metrics['loss'])) and np.isfinite(float(step_metrics['grad_norm']))
    assert not bool(step_metrics['finite'])
    assert params_equal(after.params, before.params) and params_equal(after.opt_state, before.opt_state)


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


@pytest.mark.parametrize(
    'field, value',
    [('attention', 'svformer'), ('rope_theta', 500_000.0), ('lambda_mode', 'learnable_plus'), ('d_ff', 96)],
)
def test_resuming_another_model_is_refused_and_changes_nothing(small_corpus, tmp_path_factory, field, value):
    workdir = tmp_path_factory.getbasetemp() / 'mismatch_run'
    if not workdir.exists():
        loop.run(tiny_config(small_corpus, steps=4), str(workdir))
    before = _tree_bytes(workdir)
    config = tiny_config(small_corpus, steps=8)
    other = dataclasses.replace(config, model=dataclasses.replace(config.model, **{field: value}))
    saved = getattr(config.model, field)
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=re.escape(f'trained with model.{field}={saved!r} but the config has model.{field}={value!r}'),
    ):
        loop.run(other, str(workdir))
    assert _tree_bytes(workdir) == before


def test_execution_settings_may_change_on_resume_and_the_run_goes_on_as_before(small_corpus, tmp_path):
    """remat, scan_layers, attention_impl, hand_vjp and both chunk counts change how the model runs, not
    what it computes: a resume under all of them continues the run's losses; compute_dtype may change
    too (the numbers then differ by bfloat16's rounding)."""
    config = tiny_config(small_corpus, steps=8)
    straight = loop.run(config, str(tmp_path / 'straight'))
    loop.run(tiny_config(small_corpus, steps=4), str(tmp_path / 'changed'))
    model = dataclasses.replace(
        config.model,
        remat='full',
        scan_layers=not config.model.scan_layers,
        attention_impl='xla',
        hand_vjp='none',
        attention_chunks=2,
        head_chunks=2,
    )
    resumed = loop.run(dataclasses.replace(config, model=model), str(tmp_path / 'changed'))
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    for step, loss in resumed.losses.items():
        assert abs(loss - straight.losses[step]) <= 1e-5 * straight.losses[step], (step, loss, straight.losses[step])
    bf16 = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, compute_dtype='bfloat16'),
        train=dataclasses.replace(config.train, steps=10),
    )
    assert loop.run(bf16, str(tmp_path / 'changed')).step == 10


@pytest.mark.parametrize(
    'changes, message',
    [
        (
            dict(name='muon', peak_lr=0.02),
            "was trained with optimizer.name='adamw' but the config has optimizer.name='muon'",
        ),
        (dict(grad_clip=0.0), "its optimizer state differs from the config's"),
    ],
)
def test_resuming_under_another_optimizer_state_is_refused_and_changes_nothing(
    small_corpus, tmp_path_factory, changes, message
):
    workdir = tmp_path_factory.getbasetemp() / 'mismatch_run'
    if not workdir.exists():
        loop.run(tiny_config(small_corpus, steps=4), str(workdir))
    before = _tree_bytes(workdir)
    config = tiny_config(small_corpus, steps=8)
    other = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, **changes))
    with pytest.raises(checkpoint.CheckpointMismatchError, match=re.escape(message)):
        loop.run(other, str(workdir))
    assert _tree_bytes(workdir) == before


def test_a_data_position_saved_in_other_blocks_is_refused_and_changes_nothing(small_corpus, tmp_path, monkeypatch):
    """A checkpoint whose data iterator counted one document per grain element (as vrl did before it
    read blocks) is not restored into a pipeline of blocks: one line, and the run's files untouched."""
    workdir = tmp_path / 'run'
    loop.run(tiny_config(small_corpus, steps=4), str(workdir))
    before = _tree_bytes(workdir)
    monkeypatch.setattr(pipeline, 'BYTES_PER_TOKEN', 128)  # a few speeches a block at this seq_len
    with pytest.raises(
        corpus.DataError,
        match=re.escape(
            'the saved data position counts grain elements of [1] documents (per dataset), but this pipeline reads ['
        ),
    ):
        loop.run(tiny_config(small_corpus, steps=8), str(workdir))
    assert _tree_bytes(workdir) == before


def test_init_from_checks_shapes(small_corpus, tmp_path):
    loop.run(tiny_config(small_corpus, steps=1, checkpoint_every=1), str(tmp_path))
    config = tiny_config(small_corpus)
    wider = dataclasses.replace(config, model=dataclasses.replace(config.model, d_ff=96))
    abstract = train_steps(wider, sharding.make_mesh(wider.mesh)).abstract_state.params
    with pytest.raises(
        checkpoint.CheckpointMismatchError, match=r'mlp.w_down has shape \(64, 32\) but the config needs \(96, 32\)'
    ):
        checkpoint.restore_params(str(tmp_path), abstract)
    svformer = tiny_config(small_corpus, attention='svformer')
    abstract = train_steps(svformer, sharding.make_mesh(svformer.mesh)).abstract_state.params
    with pytest.raises(
        checkpoint.CheckpointMismatchError, match='has parameter (lambdas|layers).* that the config does not'
    ):
        checkpoint.restore_params(str(tmp_path), abstract)


def test_an_init_from_that_does_not_fit_is_one_error_naming_the_fix_and_leaves_no_workdir(small_corpus, tmp_path):
    """--init_from a run of another shape, or a folder with no checkpoint, into a new workdir: the cause
    and the fix in one error, and the workdir the run made (with its checkpoints/ folder) gone."""
    source = tmp_path / 'source'
    loop.run(tiny_config(small_corpus, steps=1, checkpoint_every=1), str(source))
    config = tiny_config(small_corpus, steps=2)
    deeper = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=3))
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=rf'^--init_from={source}: checkpoint .* has shape \(1,.* needs \(2,.*' + re.escape(start.INIT_FROM_FIX),
    ):
        loop.run(deeper, str(tmp_path / 'deeper'), init_from=str(source))
    assert not (tmp_path / 'deeper').exists()
    (tmp_path / 'empty').mkdir()
    with pytest.raises(checkpoint.NoCheckpointError, match=f'no checkpoint in {tmp_path / "empty"}: .*train one'):
        loop.run(config, str(tmp_path / 'new'), init_from=str(tmp_path / 'empty'))
    assert not (tmp_path / 'new').exists()


def _overwrite_64k_of_the_data_files(step_dir: Path) -> None:
    """64 KiB in the middle of each array data file of the step overwritten with other bytes (a copy gone
    wrong): TensorStore finds the damage in the first array it reads."""
    for file in (step_dir / 'state').rglob('d/*'):
        data = bytearray(file.read_bytes())
        if len(data) > 64 * 1024:
            middle = len(data) // 2 - 32 * 1024
            data[middle : middle + 64 * 1024] = np.random.default_rng(0).bytes(64 * 1024)
            file.write_bytes(bytes(data))


def _flip_a_bit_of_a_query_weight(step_dir: Path) -> None:
    """A bit of a saved weight flipped through TensorStore: the chunk decodes, the checksum must see it."""
    import tensorstore as ts

    kvstore = {'driver': 'ocdbt', 'base': f'file://{step_dir / "state"}/'}
    weights = ts.open({'driver': 'zarr', 'kvstore': kvstore, 'path': 'params.first.attn.wq'}).result()
    value = weights[0, 0, :1].read().result()
    weights[0, 0, :1].write((value.view(np.uint32) ^ 0x10).view(np.float32)).result()


@pytest.mark.parametrize(
    'damage, reason',
    [
        (
            _flip_a_bit_of_a_query_weight,
            r'array params\.first\.attn\.wq differs from the one saved \(checksum mismatch\)',
        ),
        # the data files pack several arrays (OCDBT): the first one read that lies in damaged bytes is named
        (
            _overwrite_64k_of_the_data_files,
            r': array (step|(params|opt_state)\.\S+) cannot be read \(.*Data corruption',
        ),
    ],
)
def test_a_damaged_init_from_source_is_one_line_naming_the_step_and_array(small_corpus, tmp_path, damage, reason):
    """--init_from a copy whose parameters were damaged: verified as a resume verifies, one error naming
    the flag, the source's step folder and the array; nothing started, no workdir left."""
    source = tmp_path / 'source'
    loop.run(tiny_config(small_corpus, steps=2, checkpoint_every=2), str(source))
    damage(source / 'checkpoints' / '2')
    with pytest.raises(checkpoint.CorruptCheckpointError) as raised:
        loop.run(tiny_config(small_corpus, steps=2), str(tmp_path / 'new'), init_from=str(source))
    message = str(raised.value)
    assert '\n' not in message and len(message) < 700, message
    assert message.startswith(f'--init_from={source}: checkpoint {source / "checkpoints/2"}: '), message
    assert re.search(reason, message) and 'nothing was started' in message, message
    assert not (tmp_path / 'new').exists()


def test_init_from_records_the_step_and_parameters_it_read(small_corpus, tmp_path, capsys, monkeypatch):
    """The start line, the start record and config.json's history name the source's step folder, step and
    parameter digest; a source whose run still holds its workdir is read at its newest committed step,
    said so; a non-finite loss at the first steps of an initialised run names the source among the causes."""
    from vrl.train.rundir import guard as guard_lib

    source = tmp_path / 'source'
    trained = loop.run(tiny_config(small_corpus, steps=4, checkpoint_every=2), str(source))
    digest = checkpoint.params_digest(trained.state.params)
    holder = guard_lib.make(source)
    holder.acquire()  # the source's run still trains
    try:
        capsys.readouterr()
        loop.run(tiny_config(small_corpus, steps=1), str(tmp_path / 'new'), init_from=str(source))
    finally:
        holder.release()
    said = capsys.readouterr().out
    folder = source / 'checkpoints' / '4'
    assert (
        f'initialised from {folder} step 4 (parameters {digest}, its newest committed step: the run there is '
        'still training)' in said
    ), said
    started = json.loads((tmp_path / 'new' / 'metrics.jsonl').read_text().splitlines()[0])
    assert (started['event'], started['init_from'], started['init_step'], started['init_fingerprint']) == (
        'started',
        str(folder),
        4,
        digest,
    )
    (entry,) = json.loads((tmp_path / 'new' / 'config.json').read_text())['history']
    assert (entry['init_from'], entry['init_step'], entry['init_fingerprint']) == (str(folder), 4, digest)

    read = checkpoint.restore_params
    monkeypatch.setattr(  # weights of another scale: finite in the source, not once trained on
        checkpoint, 'restore_params', lambda *a, **k: jax.tree.map(lambda x: x * np.float32(3e38), read(*a, **k))
    )
    with pytest.raises(start.TrainingError, match=rf'check the weights it started from: --init_from={folder} \(step 4'):
        loop.run(tiny_config(small_corpus, steps=3), str(tmp_path / 'diverged'), init_from=str(source))


def _named(params) -> dict[str, np.ndarray]:
    return {checkpoint.path_name(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def test_init_from_a_vanilla_run_uptrains_svformer_and_resformer(small_corpus, tmp_path, capsys):
    """--init_from a vanilla run into SVFormer and into ResFormer (learnable lambdas): every parameter both
    have is the run's, ResFormer's lambdas are the new run's own initialisation, SVFormer has no value
    projection in layers >= 2, and the log line says which were read, new and left out; a vanilla run
    from the SVFormer one is refused in one line (its W_V of layers >= 2 was never learned)."""
    source = loop.run(tiny_config(small_corpus, attention='vanilla', steps=2, checkpoint_every=2), str(tmp_path / 'v'))
    trained = _named(source.state.params)
    for attention in ('svformer', 'resformer'):
        config = tiny_config(small_corpus, attention=attention, steps=0, seed=5)
        params = _named(loop.run(config, str(tmp_path / attention), init_from=str(tmp_path / 'v')).state.params)
        fresh = _named(train_steps(config, sharding.make_mesh(config.mesh)).init_state(5).params)
        for name, value in params.items():
            np.testing.assert_array_equal(value, trained[name] if name in trained else fresh[name], err_msg=name)
        assert set(trained) - set(params) == ({'layers.attn.wv'} if attention == 'svformer' else set())
    said = capsys.readouterr().out
    assert re.search(
        r'uptraining into svformer: (\d+) of its \1 parameters read; new, .*: none; left out: layers.attn.wv '
        r"\(layers >= 2 only; layer 1's first.attn.wv is read and kept whole\)",
        said,
    )
    lambdas = 'new, at their initialisation: lambdas.v1, lambdas.vn; left out: none'
    assert re.search(r'uptraining into resformer \(learnable\): \d+ of its \d+ parameters read; ' + lambdas, said)
    with pytest.raises(
        checkpoint.CheckpointMismatchError, match='the source has no parameter layers.attn.wv, which vanilla'
    ):
        back = tiny_config(small_corpus, attention='vanilla', steps=1)
        loop.run(back, str(tmp_path / 'back'), init_from=str(tmp_path / 'svformer'))
    assert not (tmp_path / 'back').exists()


def test_init_from_a_vanilla_run_uptrains_skipv1former_by_pooling_value_head_pairs(small_corpus, tmp_path, capsys):
    """The SkipV1Former paper's uptraining: a vanilla run of 4 value heads into SkipV1Former with 2 of them from
    V_1 (model.skip_v1=2): layers >= 2 project 2 heads, each the mean of a pair of the source's (0, 1) and
    (2, 3); layer 1's W_V kept whole; every other parameter read as it is; the line says what was pooled.
    With train.init_value_heads=first, heads 0 and 1 are kept and 2, 3 dropped. skip_v1=1 (4 heads into 3)
    is refused in one line saying why and which skip_v1 would pool."""
    four_heads = dict(n_heads=4, n_kv_heads=4, head_dim=8)
    vanilla = tiny_config(small_corpus, attention='vanilla', steps=2, checkpoint_every=2)
    vanilla = dataclasses.replace(vanilla, model=dataclasses.replace(vanilla.model, **four_heads))
    trained = _named(loop.run(vanilla, str(tmp_path / 'v')).state.params)
    target = tiny_config(small_corpus, attention='vanilla', steps=0, seed=5)
    target = dataclasses.replace(target, model=dataclasses.replace(target.model, skip_v1=2, **four_heads))
    capsys.readouterr()
    params = _named(loop.run(target, str(tmp_path / 'skipv1'), init_from=str(tmp_path / 'v')).state.params)
    said = capsys.readouterr().out
    source_wv = trained['layers.attn.wv']  # (L - 1, D, 4, Dh)
    pooled = np.stack([source_wv[..., 0:2, :].mean(-2), source_wv[..., 2:4, :].mean(-2)], axis=-2)
    np.testing.assert_allclose(params['layers.attn.wv'], pooled, rtol=1e-6)
    assert set(params) == set(trained)
    for name, value in params.items():
        if name != 'layers.attn.wv':
            np.testing.assert_array_equal(value, trained[name], err_msg=name)
    assert (
        'pooled: layers.attn.wv, its 4 value heads averaged in groups of 2 ((0..1), (2..3), ...) into the 2 that '
        "layers >= 2 project; new, at their initialisation: none; left out: none (layers >= 2 only; layer 1's "
        'first.attn.wv is read and kept whole)'
    ) in said, said
    first = dataclasses.replace(target, train=dataclasses.replace(target.train, init_value_heads='first'))
    cut = _named(loop.run(first, str(tmp_path / 'first'), init_from=str(tmp_path / 'v')).state.params)
    np.testing.assert_array_equal(cut['layers.attn.wv'], source_wv[..., 0:2, :])  # heads 2, 3 dropped
    assert 'cut: layers.attn.wv, its first 2 of 4 value heads kept for layers >= 2' in capsys.readouterr().out
    three = dataclasses.replace(target, model=dataclasses.replace(target.model, skip_v1=1))
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=r"the source's 4 value heads per layer cannot be pooled evenly into the 3 that model.skip_v1=1 leaves "
        r'layers >= 2 to project .* model.skip_v1 of 2 or 3 would pool them \(2 for pairs',
    ):
        loop.run(three, str(tmp_path / 'three'), init_from=str(tmp_path / 'v'))
    assert not (tmp_path / 'three').exists()


def test_a_step_removed_while_a_reader_reads_it_is_read_again_from_the_newest(small_corpus, tmp_path, monkeypatch):
    """The writer's garbage collection removes the step a reader (export, generate, a notebook's
    load_trained) is restoring: the reader resolves the newest step again and reads that one, labelled
    with its own step; a step folder read alone says it was removed, in one line."""
    import shutil

    import orbax.checkpoint as ocp

    from vrl.train import trained

    workdir = tmp_path / 'run'
    loop.run(tiny_config(small_corpus, steps=4, checkpoint_every=2), str(workdir))
    real, calls = ocp.PyTreeCheckpointer.restore, []

    def collected_meanwhile(self, directory, *args, **kwargs):
        calls.append(str(directory))
        if len(calls) == 1:  # the first read: its step goes, as the writer's collection would take it
            shutil.rmtree(directory.parent)
            raise FileNotFoundError(f'NOT_FOUND: {directory}/params/.zarray')
        return real(self, directory, *args, **kwargs)

    monkeypatch.setattr(ocp.PyTreeCheckpointer, 'restore', collected_meanwhile)
    run = trained.load_trained(str(workdir))
    assert run.step == 2 and calls == [str(workdir / 'checkpoints/4/state'), str(workdir / 'checkpoints/2/state')]
    shutil.copytree(workdir / 'checkpoints/2', tmp_path / 'alone/2')
    calls.clear()
    with pytest.raises(checkpoint.StepRemovedError, match=r'checkpoint .*/alone/2 was removed while it was read'):
        checkpoint.restore_params(str(tmp_path / 'alone/2'), run.trainer.abstract_state.params)


def test_init_from_another_run_with_relative_workdirs(small_corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = loop.run(tiny_config(small_corpus, steps=4), 'runs/source')
    config = tiny_config(small_corpus, steps=1)
    mesh = sharding.make_mesh(config.mesh)
    restored = checkpoint.restore_params('runs/source', train_steps(config, mesh).abstract_state.params)
    assert params_equal(restored, source.state.params)


@pytest.mark.parametrize(
    'args, message',
    [
        (
            ['--config=configs/tiny.py', '--summary', '--config.train.stepz=3'],
            "--config.train.stepz: train.stepz is not a config field; did you mean 'steps'?",
        ),
        (
            ['--config=configs/tiny.py', '--summary', '--config.model.bogus=1'],
            '--config.model.bogus: model.bogus is not a config field; allowed: attention, lambda_mode,',
        ),
        (
            ['--config=configs/tiny.py', '--summary', '--config.model.atention=svformer'],
            "--config.model.atention: model.atention is not a config field; did you mean 'attention' or ",
        ),
        (
            ['--config=configs/tiny.py:atnres', '--summary'],
            "unknown variant preset 'atnres'; did you mean 'attnres'",
        ),
        (
            ['--config=configs/tiny.py', '--summary', '--config.model.attention=mamba'],
            "model.attention='mamba' is invalid: allowed one of 'vanilla', 'resformer', 'svformer'",
        ),
        (
            ['--config=configs/tiny.py', '--workdir=/proc/vrl_cannot_write'],
            'cannot write to --workdir /proc/vrl_cannot_write (',
        ),
        (
            ['--config=configs/base.py:resformer', '--summary'],
            'configs/base.py:resformer is invalid: allowed PRESET,SIZE',
        ),
        (
            ['--config=configs/tiny.py', '--summary', '--config.trian.steps=3'],
            "--config.trian.steps: trian is not a config section; did you mean 'train'?",
        ),
        (
            ['--config=configs/tiny.py', '--summary', '--config.optimizer.final_lr=-1e-4'],
            'optimizer.final_lr=-0.0001 is invalid: allowed a float >= 0',
        ),
        (
            ['--config=configs/tinny.py', '--summary'],
            f'error: the config file configs/tinny.py does not exist (looked from {ROOT}): name one of configs/*.py, '
            'e.g. --config=configs/tiny.py\n',
        ),
    ],
)
def test_command_line_errors_are_clear(args, message):
    out = subprocess.run([sys.executable, '-m', 'vrl.main', *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0
    assert message in out.stderr and 'Traceback' not in out.stderr


def test_config_file_with_a_syntax_error(tmp_path):
    (tmp_path / 'broken.py').write_text('def get_config(:\n    pass\n')
    out = subprocess.run(
        [sys.executable, '-m', 'vrl.main', f'--config={tmp_path}/broken.py', '--summary'],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and 'Traceback' not in out.stderr
    assert f'the config file {tmp_path}/broken.py does not parse: invalid syntax (line 1)' in out.stderr


def test_eval_bits_per_byte_is_the_loss_over_the_bytes(small_corpus):
    config = tiny_config(small_corpus, eval_batches=3)
    _, tokenizer = small_corpus
    trainer = train_steps(config, sharding.make_mesh(config.mesh))
    params = trainer.init_state(0).params
    evaluation = validation.validate(trainer, params, config, tokenizer)
    tokens = n_bytes = 0
    for batch in pipeline.eval_batches(config.data, tokenizer, 3):
        mask = batch['loss_mask'] > 0
        tokens += int(mask.sum())
        n_bytes += sum(len(tokenizer.decode(row[m]).encode('utf-8')) for row, m in zip(batch['targets'], mask))
    assert n_bytes > tokens > 0
    # the independent byte count decodes each row's targets, so it can differ by a cut multi-byte character
    want = evaluation.loss * tokens / math.log(2) / n_bytes
    assert abs(evaluation.bits_per_byte - want) / want < 1e-3


def test_weights_and_biases_gets_every_record_and_a_resumed_run_continues_it(small_corpus, tmp_path, monkeypatch):
    """train.wandb_project in W&B's offline mode (no network): the offline run files, read back,
    hold the config, every logged loss of metrics.jsonl and the diagnostics per layer; the resumed
    run logs to the same W&B run."""
    from tests.helpers import wandb_records

    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_DIR', str(tmp_path))
    monkeypatch.setenv('WANDB_SILENT', 'true')
    monkeypatch.setenv('WANDB_ERROR_REPORTING', 'false')
    config = tiny_config(
        small_corpus,
        steps=4,
        log_every=1,
        checkpoint_every=2,
        diagnostics_every=2,
        diagnostics_sequences=2,
        wandb_project='vrl-test',
    )
    workdir = tmp_path / 'run'
    loop.run(config, str(workdir))
    loop.run(dataclasses.replace(config, train=dataclasses.replace(config.train, steps=6)), str(workdir))
    run_id = (workdir / 'wandb_run_id').read_text()
    files = sorted(tmp_path.glob('wandb/offline-run-*/run-*.wandb'))
    assert [f.name for f in files] == [f'run-{run_id}.wandb'] * 2  # both starts: one W&B run

    history, configs = {}, []
    for file in files:
        for record in wandb_records(file):
            kind = record.WhichOneof('record_type')
            if kind == 'history':
                items = {
                    item.key or '/'.join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history.setdefault(record.history.step.num, {}).update(items)
            elif kind == 'run':
                configs.append({u.key: json.loads(u.value_json) for u in record.run.config.update})
    assert all(c['train']['wandb_project'] == 'vrl-test' and c['model']['n_layers'] == 2 for c in configs)
    logged = {}
    for line in (workdir / 'metrics.jsonl').read_text().splitlines():
        record = json.loads(line)
        logged.setdefault(record['step'], {}).update(record)
    assert sorted(s for s in history if 'loss' in history[s]) == list(range(1, 7))
    for step in range(1, 7):
        assert history[step]['loss'] == pytest.approx(logged[step]['loss'], rel=1e-6)
    for step in (2, 4, 6):
        for layer, value in enumerate(logged[step]['diagnostics']['entropy'], 1):
            assert history[step][f'diagnostics/entropy/layer_{layer}'] == pytest.approx(value, rel=1e-6)
    assert 'eval_loss' in history[6]

    loop.run(config, str(workdir), fresh=True)  # --fresh: a new W&B run, its own id
    fresh_id = (workdir / 'wandb_run_id').read_text()
    assert fresh_id != run_id and (workdir / 'previous_runs').exists()
    assert sorted(f.name for f in tmp_path.glob('wandb/offline-run-*/run-*.wandb')) == sorted(
        [f'run-{run_id}.wandb'] * 2 + [f'run-{fresh_id}.wandb']
    )
