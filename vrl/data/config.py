"""The data's config: the datasets read, the tokenizer, packing, mixtures and their phases."""

from __future__ import annotations

import dataclasses
import math
import re

from vrl.core.config import require


def _eval_set(entry: str, default_split: str) -> tuple[str, str]:
    """'NAME:SPLIT' -> (NAME, SPLIT); 'NAME' (a TFDS name may end in ':VERSION') -> (NAME, default_split)."""
    name, _, split = entry.rpartition(':')
    if not name or re.fullmatch(r'\d+(\.\d+)*', split):
        return entry, default_split
    return name, split


SHUFFLES = ('auto', 'documents', 'windows')  # data.shuffle


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline: a TFDS array_record dataset, a tokenizer, packing, grain."""

    name: str = 'shakespeare'  # a TFDS name ('c4/en:3.1.0', 'lm1b') or one built by `vrl.data prepare`
    data_dir: str = ''  # '' = ~/.cache/vrl/tensorflow_datasets; gs:// works on Cloud
    train_split: str = 'train'
    eval_split: str = 'validation'
    text_field: str = 'text'
    # a sentencepiece .model or a Hugging Face tokenizer.json; '' = train a .model on the train split, cached
    tokenizer: str = ''
    tokenizer_train_docs: int = 100_000  # documents read to train a tokenizer when none is given
    seq_len: int = 2048
    batch_size: int = 1024  # global, over all processes
    seed: int = 0
    num_epochs: int = 0  # 0 = repeat forever
    # read a dataset's ids from its pre-tokenized copy for this tokenizer when it has one (`vrl.data
    # tokenize`; the log says which); false = tokenize on the fly
    pretokenized: bool = True
    num_workers: int = 0  # grain worker processes; 0 = in the main process
    # threads reading blocks of documents ahead in each process (on an object store, the ranged reads
    # in flight); 0 = read when needed; -1 = auto: 0 on local disk, 64 for a data_dir on a store
    read_threads: int = -1
    prefetch: int = 2  # batches packed ahead, on a thread beside the step
    # how training's documents are shuffled (docs/data.md): 'documents' = globally, in small blocks of
    # about a sequence of text each; 'windows' = whole I/O blocks of data.block_tokens tokens (one
    # read each), permuted every epoch, documents shuffled within windows of data.window_blocks
    # blocks, each process taking whole windows; 'auto' = windows for a pre-tokenized copy on an
    # object store, documents otherwise
    shuffle: str = 'auto'
    block_tokens: int = 0  # tokens of an I/O block in windows (never across a shard); 0 = auto: 256K or a shard
    window_blocks: int = 64  # blocks whose documents are shuffled together
    add_bos: bool = False  # put BOS at every document start (EOS always ends one)
    document_masking: bool = False  # segment ids + per-document positions: no attention across docs
    # several datasets instead of `name`: 'NAME=WEIGHT,NAME=WEIGHT' (each dataset's share of the tokens;
    # each dataset's validation split is evaluated on its own); '' = `name` alone
    mixture: str = ''
    # the mixture's weights from a step on: 'STEP:NAME=WEIGHT,...;STEP:...' (a dataset left out, or at
    # weight 0, is not read from STEP on); '' = data.mixture's weights throughout
    mixture_schedule: str = ''
    # what evaluation reads: 'NAME' or 'NAME:SPLIT' (a prepared dataset's split; SPLIT defaults to
    # eval_split), comma-separated, each reported by name; '' = eval_split of each dataset trained on
    eval: str = ''
    # resume although the tokenizer or a dataset's contents changed since the run's last start (said in
    # the log; config.json records what each start read)
    allow_data_change: bool = False

    def __post_init__(self):
        for name in ('seq_len', 'batch_size', 'tokenizer_train_docs'):
            require(getattr(self, name) >= 1, f'data.{name}', getattr(self, name), 'an integer >= 1')
        for name in ('num_epochs', 'num_workers', 'prefetch'):
            require(getattr(self, name) >= 0, f'data.{name}', getattr(self, name), 'an integer >= 0')
        require(self.shuffle in SHUFFLES, 'data.shuffle', self.shuffle, f'one of {SHUFFLES}')
        require(self.block_tokens >= 0, 'data.block_tokens', self.block_tokens, 'an integer >= 1, or 0 (auto)')
        require(self.window_blocks >= 1, 'data.window_blocks', self.window_blocks, 'an integer >= 1')
        require(self.read_threads >= -1, 'data.read_threads', self.read_threads, 'an integer >= 0, or -1 (auto)')
        require(bool(self.name), 'data.name', self.name, 'a non-empty TFDS dataset name')
        self.evaluated()  # parses data.eval, or names what is wrong
        if self.mixture:
            self.sources()  # parses, or names what is wrong
            require(
                self.num_epochs == 0,
                'data.num_epochs',
                self.num_epochs,
                '0 with data.mixture (a mixture repeats its datasets forever; stop with train.steps)',
            )
        require(
            not self.mixture_schedule or bool(self.mixture),
            'data.mixture_schedule',
            self.mixture_schedule,
            "'' without data.mixture (it changes the mixture's weights)",
        )
        self.phases()  # parses data.mixture_schedule, or names what is wrong

    def evaluated(self) -> list[tuple[str, str]]:
        """(dataset name, split) of each evaluation set: data.eval's, or each trained dataset's eval_split."""
        if not self.eval:
            return [(name, self.eval_split) for name, _ in self.sources()]
        sets = [_eval_set(entry.strip(), self.eval_split) for entry in self.eval.split(',')]
        require(
            all(name for name, _ in sets) and len(set(sets)) == len(sets),
            'data.eval',
            self.eval,
            "comma-separated distinct NAME or NAME:SPLIT entries, e.g. 'web,books:test'",
        )
        return sets

    def sources(self) -> list[tuple[str, float]]:
        """(dataset name, weight) for each dataset trained on: data.mixture's, or [(data.name, 1.0)]."""
        if not self.mixture:
            return [(self.name, 1.0)]
        return list(_weights('data.mixture', self.mixture, self.mixture, 'weights > 0, e.g. wiki=3,books=1').items())

    def phases(self) -> list[tuple[int, tuple[float, ...]]]:
        """(first step, each of sources()' datasets' weight) of each phase of the mixture, by step:
        data.mixture's from step 0, then data.mixture_schedule's."""
        names = [name for name, _ in self.sources()]
        phases = [(0, tuple(weight for _, weight in self.sources()))]
        if not self.mixture_schedule:
            return phases
        field, allowed = 'data.mixture_schedule', "';'-separated STEP:NAME=WEIGHT,... entries with rising steps > 0"
        for entry in self.mixture_schedule.split(';'):
            step, _, weights = entry.strip().partition(':')
            require(
                step.isdigit() and int(step) > phases[-1][0],
                field,
                self.mixture_schedule,
                f'{allowed} ({entry.strip()!r} is not)',
            )
            given = _weights(
                field, self.mixture_schedule, weights, "weights >= 0 of data.mixture's datasets", zero_allowed=True
            )
            require(
                set(given) <= set(names) and any(given.values()),
                field,
                self.mixture_schedule,
                f"{allowed}, naming only data.mixture's datasets ({', '.join(names)}), one at weight > 0 "
                f'({entry.strip()!r} is not)',
            )
            phases.append((int(step), tuple(given.get(name, 0.0) for name in names)))
        return phases


def _weights(field: str, value: str, pairs: str, allowed: str, zero_allowed: bool = False) -> dict[str, float]:
    """'NAME=WEIGHT,...' -> {name: weight}, each weight finite and > 0 (or 0 where `zero_allowed`)."""
    allowed = f'comma-separated NAME=WEIGHT pairs with distinct names and {allowed}'
    weights = {}
    for entry in pairs.split(','):
        name, _, weight = entry.strip().rpartition('=')
        try:
            number = float(weight)
        except ValueError:
            number = math.nan
        require(
            bool(name)
            and name not in weights
            and math.isfinite(number)
            and (number > 0 or zero_allowed and number == 0),
            field,
            value,
            f'{allowed} ({entry.strip()!r} is not)',
        )
        weights[name] = number
    return weights
