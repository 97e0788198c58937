"""The run's config: the optimizer's and the training loop's sections, and `Config`, the whole of it
composed from every wing's section; `to_configdict` / `from_configdict` are the ConfigDict form that
configs/*.py return and the command line overrides. Code below vrl.main only ever sees the frozen
dataclasses, so an undeclared key can never be read with a silent default."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import ml_collections

from vrl.core.config import ConfigError, choice, from_dict, require
from vrl.core.sharding import Axis, MeshConfig, logical_spec, spec_axes
from vrl.data.config import DataConfig
from vrl.model.config import ModelConfig

NAN_POLICIES = ('error', 'skip')
INIT_VALUE_HEADS = ('pool', 'first')  # train.init_value_heads
MIN_LEASE_STALE_SECONDS = 8  # vrl/train/rundir/lease.py's Lease renews every quarter of it
OPTIMIZERS = ('adamw', 'muon')  # vrl/train/optimizer.py
SCHEDULES = ('cosine', 'wsd')
DECAY_SHAPES = ('linear', 'sqrt')  # wsd's decay: linear, or 1 - sqrt


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The update rule and its LR schedule (vrl/train/optimizer.py; docs/training.md, 'Optimizers').

    adamw is docs/paper.md's recipe; muon puts the hidden weight matrices under Muon at peak_lr and
    the rest under AdamW at peak_lr times its group's ratio. cosine warms up, then follows a cosine
    to final_lr at decay_steps; wsd warms up, holds peak_lr, then decays to final_lr over the last
    decay_fraction of decay_steps.
    """

    name: str = 'adamw'  # adamw | muon
    peak_lr: float = 6e-4  # the hidden matrices' peak LR (under muon: Muon's)
    init_lr: float = 1e-7
    final_lr: float = 6e-5
    warmup_steps: int = 120
    decay_steps: int = 0  # step at which the schedule reaches final_lr; 0 = train.steps (ends with the run)
    schedule: str = 'cosine'  # cosine | wsd
    decay_fraction: float = 0.2  # wsd: decays over the last this fraction of decay_steps
    decay_shape: str = 'linear'  # wsd: linear | sqrt (1 - sqrt of the decay's progress)
    # each AdamW group's LR / peak_lr (the schedule scales them all alike)
    embed_lr_ratio: float = 1.0  # token and value embedding tables
    head_lr_ratio: float = 1.0  # the output projection
    scalar_lr_ratio: float = 1.0  # norms, lambdas, gates, DenseFormer weights
    b1: float = 0.9  # AdamW
    b2: float = 0.95
    eps: float = 1e-8
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the hidden matrices
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per update
    weight_decay: float = 0.1  # decoupled (times the LR); not on norm weights or lambdas
    grad_clip: float = 1.0  # global norm; 0 = off
    z_loss: float = 0.0  # weight of log(Z)^2; 0 = off

    def __post_init__(self):
        choice('optimizer.name', self.name, OPTIMIZERS)
        choice('optimizer.schedule', self.schedule, SCHEDULES)
        choice('optimizer.decay_shape', self.decay_shape, DECAY_SHAPES)
        require(self.peak_lr > 0, 'optimizer.peak_lr', self.peak_lr, 'a float > 0')
        require(self.warmup_steps >= 0, 'optimizer.warmup_steps', self.warmup_steps, 'an integer >= 0')
        require(
            self.decay_steps == 0 or self.decay_steps > self.warmup_steps,
            'optimizer.decay_steps',
            self.decay_steps,
            f'0 (train.steps) or an integer > optimizer.warmup_steps={self.warmup_steps}',
        )
        require(0 < self.decay_fraction <= 1, 'optimizer.decay_fraction', self.decay_fraction, 'a float in (0, 1]')
        if self.schedule == 'wsd' and self.decay_steps:
            require(
                self.decay_start >= self.warmup_steps,
                'optimizer.decay_fraction',
                self.decay_fraction,
                f'a fraction whose decay starts after warmup (decay_steps={self.decay_steps} x (1 - '
                f'{self.decay_fraction}) = {self.decay_start} < warmup_steps={self.warmup_steps})',
            )
        require(self.eps > 0, 'optimizer.eps', self.eps, 'a float > 0')
        require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, 'optimizer.b1/b2', (self.b1, self.b2), 'floats in [0, 1)')
        require(0 <= self.muon_momentum < 1, 'optimizer.muon_momentum', self.muon_momentum, 'a float in [0, 1)')
        require(self.muon_ns_steps >= 1, 'optimizer.muon_ns_steps', self.muon_ns_steps, 'an integer >= 1')
        for name in ('embed_lr_ratio', 'head_lr_ratio', 'scalar_lr_ratio'):
            require(getattr(self, name) > 0, f'optimizer.{name}', getattr(self, name), 'a float > 0')
        for name in ('init_lr', 'final_lr', 'weight_decay', 'grad_clip', 'z_loss'):
            require(getattr(self, name) >= 0, f'optimizer.{name}', getattr(self, name), 'a float >= 0')

    @property
    def decay_start(self) -> int:
        """wsd: the last step at peak_lr (the stable phase's end; a run extends from its checkpoint)."""
        return self.decay_steps - round(self.decay_fraction * self.decay_steps)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop: length, logging, eval, checkpoints."""

    AUTOS: ClassVar[dict] = {'microbatches': 0}  # resolved once per run: vrl/train/aot.py

    steps: int = 10_000  # 0: save the initial (e.g. --init_from) parameters as step 0 and stop
    microbatches: int = 1  # gradient accumulation: data.batch_size is split into this many; 0 = auto (vrl/train/aot.py)
    seed: int = 0  # parameter init
    log_every: int = 10
    # the terminal's training line every this many steps (0: at every log_every record; compare and study
    # record every step for their curves and print at the config's log_every)
    print_every: int = 0
    eval_every: int = 500  # 0 = only at the end
    eval_batches: int = 16  # 0 = the whole validation split
    checkpoint_every: int = 1000
    # also save after this many minutes without a save (a slice preempted without notice loses at most that);
    # such a step is kept only until the next save, apart from the checkpoint_every ones; 0 = off
    checkpoint_minutes: float = 0.0
    keep_checkpoints: int = 3
    keep_period: int = 0  # also keep every k-th step forever; 0 = off
    nan_policy: str = 'error'  # error: stop naming the step | skip: drop that update
    # --init_from into SkipV1Former from a model with every value head in layers >= 2: pool (the paper's uptraining:
    # each own head the mean of its group of source heads) | first (the first K - model.skip_v1 heads kept, the
    # rest dropped)
    init_value_heads: str = 'pool'
    # with nan_policy=skip: stop after more non-finite steps than this in a row; a run that skipped more than
    # half of its steps also ends with an error (after saving)
    max_skipped_steps: int = 20
    # at the end, a greedy continuation of sample_prompt ('' = the opening words of the validation split's first
    # document) of up to sample_tokens tokens (0 = none)
    sample_prompt: str = ''
    sample_tokens: int = 48
    peak_flops: float = 0.0  # per device, for MFU; 0 = device table, or a matmul probe on CPU
    # a workdir on an object store: a writer's lease not renewed for this long is taken over
    # (vrl/train/rundir/lease.py); at least MIN_LEASE_STALE_SECONDS, as it is renewed every quarter of it and GCS
    # takes one write a second per object
    lease_stale_seconds: int = 300
    # per-layer attention diagnostics (vrl/train/diagnostics.py) on the first diagnostics_sequences full validation
    # sequences, every this many steps, into metrics.jsonl and TensorBoard; 0 = off
    diagnostics_every: int = 100
    diagnostics_sequences: int = 8
    # lm-eval tasks (comma-separated names; requirements-extra.txt) scored on the live parameters every
    # downstream_every steps (0 = only at the end) and at the end, logged as downstream/TASK/METRIC
    # (vrl/train/downstream.py); '' = none
    downstream_tasks: str = ''
    downstream_every: int = 1000
    downstream_limit: int = 0  # examples per task; 0 = all
    downstream_fewshot: int = -1  # few-shot examples; -1 = each task's default
    downstream_include_path: str = ''  # a folder of task YAMLs of your own (lm-eval's include_path)
    # Weights & Biases (vrl/train/trackers/wandb.py, requirements-extra.txt): everything the run logs, from process
    # 0; '' = off
    wandb_project: str = ''
    wandb_entity: str = ''  # '' = your default entity
    wandb_run_name: str = ''  # '' = the workdir's name

    def __post_init__(self):
        choice('train.nan_policy', self.nan_policy, NAN_POLICIES)
        choice('train.init_value_heads', self.init_value_heads, INIT_VALUE_HEADS)
        require(
            self.lease_stale_seconds >= MIN_LEASE_STALE_SECONDS,
            'train.lease_stale_seconds',
            self.lease_stale_seconds,
            f'an integer >= {MIN_LEASE_STALE_SECONDS}',
        )
        for name in ('log_every', 'checkpoint_every', 'keep_checkpoints', 'diagnostics_sequences'):
            require(getattr(self, name) >= 1, f'train.{name}', getattr(self, name), 'an integer >= 1')
        for name in (
            'steps',
            'microbatches',
            'print_every',
            'eval_every',
            'eval_batches',
            'keep_period',
            'sample_tokens',
            'max_skipped_steps',
            'diagnostics_every',
            'checkpoint_minutes',
            'downstream_every',
            'downstream_limit',
        ):
            require(getattr(self, name) >= 0, f'train.{name}', getattr(self, name), 'an integer >= 0')
        require(
            self.downstream_fewshot >= -1,
            'train.downstream_fewshot',
            self.downstream_fewshot,
            "-1 (each task's default) or an integer >= 0",
        )
        require(
            all(self.task_names) or not self.downstream_tasks.strip(),
            'train.downstream_tasks',
            self.downstream_tasks,
            "lm-eval task names separated by commas, such as 'hellaswag,piqa'",
        )

    @property
    def task_names(self) -> list[str]:
        """train.downstream_tasks as a list ([] = none)."""
        return [t.strip() for t in self.downstream_tasks.split(',')] if self.downstream_tasks.strip() else []


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        require(
            self.train.microbatches == 0 or self.data.batch_size % self.train.microbatches == 0,
            'train.microbatches',
            self.train.microbatches,
            f'0 (auto) or a divisor of data.batch_size={self.data.batch_size}',
        )


# what sets the size of a parameter's dimension, by its logical axis (vrl/core/sharding.py's Axis)
AXIS_FIELDS = {
    Axis.EMBED: 'model.d_model',
    Axis.HEADS: 'model.n_heads',
    Axis.KV_HEADS: 'model.n_kv_heads, or the value heads a layer projects of them',
    Axis.MLP: 'model.d_ff',
    Axis.VOCAB: 'model.vocab_size padded to model.vocab_pad_multiple',
}


def check_fits_mesh(config: Config, shape: dict[str, int]) -> None:
    """ConfigError naming the mesh axis and the field if a parameter, the batch or a sequence cannot split
    evenly over the mesh (`shape`: each mesh axis' size). The parameters are read from the abstract model
    with their logical axes, split as vrl/core/sharding.py's rules split them: whatever a variant adds is
    checked as it is built."""
    for name, size, logical, mesh_axes in split_dimensions(config.model):
        parts = math.prod(shape[axis] for axis in mesh_axes)
        if size % parts:
            over = ' x '.join(f'mesh.{axis}={shape[axis]}' for axis in mesh_axes)
            raise ConfigError(
                f"{over} is invalid: it must divide {name}'s {logical} dimension, {size} ({AXIS_FIELDS[logical]})."
            )
    data, fsdp, context = (shape[axis] for axis in ('data', 'fsdp', 'context'))
    batch, parts = config.data.batch_size, max(config.train.microbatches, 1)  # 0 = auto: vrl/train/aot.py picks
    if (batch // parts) % (data * fsdp):
        raise ConfigError(
            f'data.batch_size={batch} is invalid: each of its train.microbatches={parts} '
            f'part(s) is split over mesh data x fsdp = {data * fsdp} devices; use a multiple '
            f'of {parts * data * fsdp}.'
        )
    if config.data.seq_len % context:
        raise ConfigError(
            f'mesh.context={context} is invalid: it must divide data.seq_len={config.data.seq_len} '
            '(each device holds every context-th token of each sequence).'
        )


@functools.cache
def split_dimensions(model: ModelConfig) -> tuple[tuple[str, int, str, tuple[str, ...]], ...]:
    """Every dimension of the model's parameters that the sharding rules split: (parameter, size, logical
    axis, mesh axes), from the abstract model (nothing allocated)."""
    from vrl.model import accounting

    dimensions = []
    for p in accounting.parameters(model):
        for size, logical, split in zip(p.shape, p.axes, logical_spec(p.axes)):
            if split is not None:
                dimensions.append(('.'.join(p.path), size, logical, spec_axes(split)))
    return tuple(dimensions)


def to_configdict(config: Config) -> ml_collections.ConfigDict:
    """The mutable form that configs/*.py return and the command line overrides."""
    return ml_collections.ConfigDict(dataclasses.asdict(config))


def from_configdict(config_dict: ml_collections.ConfigDict) -> Config:
    """Validates every field; raises ConfigError naming the first bad one."""
    return from_dict(Config, config_dict.to_dict())
