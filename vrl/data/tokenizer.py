"""Tokenizers: a sentencepiece `.model` or a Hugging Face `tokenizer.json` (the `tokenizers`
library: GPT-2's, GPT-NeoX's (the paper's), Llama 3's), local or on an object store. Train one from
a dataset split, or load one; the file's name says which kind it is.

    python -m vrl.data.tokenizer train --name=NAME --data_dir=DIR --vocab_size=N --out=PATH.model [--model_type=bpe]
    python -m vrl.data.tokenizer train --name=NAME --data_dir=DIR --vocab_size=N --out=PATH.json   (byte-level BPE)

Both kinds of trained tokenizer reproduce any UTF-8 text exactly (decode(encode(x)) == x: identity
normalisation and byte fallback, or byte-level BPE) and declare the special ids below. A loaded
`tokenizer.json` gets EOS, BOS and padding from the tokenizer_config.json beside it, or else from
the usual names of its special tokens.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import re
import time
from typing import Any, Iterable, Iterator

import numpy as np
import sentencepiece as spm

from vrl.core import storage
from vrl.core.errors import VrlError

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_TYPES = ('bpe', 'unigram')


class TokenizerError(VrlError, ValueError):
    """A missing or unusable tokenizer; the message says where it looked and what to do."""


class Tokenizer:
    """What the pipeline, the evaluations and the exports need of a tokenizer, whichever its kind.
    Picklable (grain worker processes get a copy): the state is the file's bytes."""

    FILE_NAME: str  # what a Hugging Face directory calls this kind's file

    def __init__(self, file_bytes: bytes, path: str = '<memory>'):
        self.path, self.file_bytes = path, file_bytes

    @staticmethod
    def load(path: str, setting: str = 'data.tokenizer', name: str = 'NAME', data_dir: str = 'DIR') -> 'Tokenizer':
        """The tokenizer in file `path`: tokenizer.json-style (`*.json`) or sentencepiece (any other);
        or in folder `path` (a Hugging Face model directory): its tokenizer.json, else its
        tokenizer.model. A missing one is a TokenizerError naming `setting` (the flag or field that
        gave `path`) and the command that trains one on dataset `name` in `data_dir`."""
        file = storage.path(path)
        if not storage.exists(file, setting):
            raise TokenizerError(
                f'tokenizer {path!r} ({setting}) does not exist. Train one with `python -m vrl.data.tokenizer '
                f'train --name={name} --data_dir={data_dir} --vocab_size=N --out={path}`'
                + (
                    ", or leave data.tokenizer empty ('') to train and cache one from the training split on first use."
                    if setting == 'data.tokenizer'
                    else '.'
                )
            )
        if file.is_dir():
            found = next(
                (file / name for name in ('tokenizer.json', 'tokenizer.model') if (file / name).exists()), None
            )
            if found is None:
                raise TokenizerError(
                    f'folder {path!r} holds neither tokenizer.json nor tokenizer.model (a Hugging '
                    'Face model directory has one): name the tokenizer file in data.tokenizer'
                )
            file, path = found, str(found)
        kind = HuggingFaceTokenizer if path.endswith('.json') else SentencePieceTokenizer
        return kind(file.read_bytes(), path)

    def __getstate__(self):
        return {'file_bytes': self.file_bytes, 'path': self.path}

    def __setstate__(self, state):
        self.__init__(state['file_bytes'], state['path'])

    @functools.cached_property
    def fingerprint(self) -> str:
        """The first 16 hex digits of the file's SHA-256: the same ids whatever the path."""
        return hashlib.sha256(self.file_bytes).hexdigest()[:16]

    vocab_size: int
    eos_id: int
    bos_id: int
    pad_id: int

    def encode(self, text: str) -> np.ndarray:
        """(n,) int32 ids of `text`, no special tokens added."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def spans(self, text: str) -> list[tuple[int, int, int]]:
        """(id, start, end) of each token of `text`, with start/end offsets into `text` in this
        kind's unit (the pieces of one character share its span)."""
        raise NotImplementedError

    def offset(self, text: str) -> int:
        """len(text) in the unit of `spans`' offsets."""
        raise NotImplementedError

    def piece(self, i: int) -> tuple[str, str]:
        """Token i's string and kind ('normal', 'control', 'byte', ...)."""
        raise NotImplementedError

    def encode_counting_bytes(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each text's (n,) int32 ids and (n,) int32 UTF-8 bytes of the text each id stands for,
        from the tokens' offsets into the text as given, before any normaliser: summed, exactly the
        text's bytes (the denominator of bits per byte), whatever a normaliser composes or a
        pre-tokenizer prepends. A character's bytes go to the first token that covers it; text no
        token covers goes to the next token (to the last at the end)."""
        counted = []
        for text, (ids, ends) in zip(texts, self._ends_in_bytes(texts)):
            total = len(text.encode('utf-8'))
            if not len(ids):
                counted.append((ids, np.zeros(0, np.int32)))
                continue
            bounds = np.minimum(np.maximum.accumulate(ends), total)
            bounds[-1] = total
            counted.append((ids, np.diff(bounds, prepend=0).astype(np.int32)))
        return counted

    def _ends_in_bytes(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each text's (n,) ids and (n,) the UTF-8 byte offset into the text where each token ends."""
        raise NotImplementedError

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """`context + continuation` encoded as one text, split before the first token that covers
        any of the continuation: a token merging the context's last characters with the
        continuation's first belongs to the continuation, so the pair's ids are exactly the whole
        text's ids and the continuation's are the ones the model must predict."""
        boundary = self.offset(context)
        spans = self.spans(context + continuation)
        split = next((i for i, (_, start, end) in enumerate(spans) if end > boundary or start >= boundary), len(spans))
        ids = [i for i, _, _ in spans]
        return ids[:split], ids[split:]

    def difference(self, other: 'Tokenizer') -> str | None:
        """How `other` encodes differently (its kind, piece count, or the first id whose piece or
        type differs); None when every id is the same piece of the same kind."""
        if type(self) is not type(other):
            return f'a {self.FILE_NAME} vs a {other.FILE_NAME}'
        if self.vocab_size != other.vocab_size:
            return f'{self.vocab_size} vs {other.vocab_size} pieces'
        for i in range(self.vocab_size):
            mine, theirs = _describe(*self.piece(i)), _describe(*other.piece(i))
            if mine != theirs:
                return f'id {i} is {mine} vs {theirs}'
        return None


def _describe(piece: str, kind: str) -> str:
    return f'{piece!r}' + ('' if kind == 'normal' else f' ({kind})')


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (`.model`)."""

    FILE_NAME = 'tokenizer.model'

    def __init__(self, file_bytes: bytes, path: str = '<memory>'):
        super().__init__(file_bytes, path)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=file_bytes)
        except RuntimeError as e:
            raise TokenizerError(
                f'{path!r} is not a sentencepiece model ({e}); a Hugging Face tokenizer must be a file named *.json'
            ) from None
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id, self.bos_id, self.pad_id = self._sp.eos_id(), self._sp.bos_id(), self._sp.pad_id()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def spans(self, text: str) -> list[tuple[int, int, int]]:
        return [(p.id, p.begin, p.end) for p in self._sp.encode(text, out_type='proto').pieces]

    def offset(self, text: str) -> int:
        return len(text.encode('utf-8'))  # sentencepiece's offsets count bytes

    def piece(self, i: int) -> tuple[str, str]:
        kind = next((k for k in ('control', 'unknown', 'byte', 'unused') if getattr(self._sp, f'is_{k}')(i)), 'normal')
        return self._sp.id_to_piece(i), kind

    def _ends_in_bytes(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        encoded = self._sp.encode(texts, out_type='proto')
        return [
            (np.array([p.id for p in e.pieces], np.int32), np.array([p.end for p in e.pieces], np.int64))
            for e in encoded
        ]


# special tokens by their usual names, for a tokenizer.json without a tokenizer_config.json
_EOS_NAMES = ('</s>', '<|endoftext|>', '<|end_of_text|>', '<eos>', '<|eos|>')
_BOS_NAMES = ('<s>', '<|begin_of_text|>', '<bos>', '<|startoftext|>')
_PAD_NAMES = ('<pad>', '<|padding|>', '<|pad|>', '[PAD]')


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, run by the `tokenizers` library (its Rust encoder; batches
    are encoded on all cores)."""

    FILE_NAME = 'tokenizer.json'

    def __init__(self, file_bytes: bytes, path: str = '<memory>'):
        super().__init__(file_bytes, path)
        import tokenizers

        try:
            self._tok = tokenizers.Tokenizer.from_str(file_bytes.decode('utf-8'))
        except Exception as e:  # noqa: BLE001 - the Rust parser's errors are one kind to the user
            raise TokenizerError(f'{path!r} is not a Hugging Face tokenizer.json ({str(e)[:200]})') from None
        # a special token's text inside a document (web pages quote '<|endoftext|>') is text: only the
        # pipeline puts special ids into the stream
        self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        named = _config_tokens(path)
        self.eos_id = self._special(named.get('eos_token'), _EOS_NAMES, special, 'EOS')
        self.bos_id = self._special(named.get('bos_token'), _BOS_NAMES, special, 'BOS', self.eos_id)
        self.pad_id = self._special(named.get('pad_token'), _PAD_NAMES, special, 'padding', self.eos_id)

    def _special(
        self,
        configured: str | None,
        usual: tuple[str, ...],
        special: dict[str, int],
        what: str,
        fallback: int | None = None,
    ) -> int:
        if configured is not None:
            i = self._tok.token_to_id(configured)
            if i is None:
                raise TokenizerError(
                    f'{self.path}: tokenizer_config.json names {what} token {configured!r}, which '
                    'is not in the vocabulary'
                )
            return i
        found = next((special[name] for name in usual if name in special), fallback)
        if found is None:
            raise TokenizerError(
                f'{self.path}: no {what} token (special tokens: {sorted(special) or "none"}); '
                'put a tokenizer_config.json with "eos_token" beside it, as Hugging Face '
                'model directories have'
            )
        return found

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def spans(self, text: str) -> list[tuple[int, int, int]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return [(i, start, end) for i, (start, end) in zip(encoding.ids, encoding.offsets)]

    def offset(self, text: str) -> int:
        return len(text)  # tokenizers' offsets count characters

    @functools.cached_property
    def _added(self) -> dict[int, Any]:
        return self._tok.get_added_tokens_decoder()

    def piece(self, i: int) -> tuple[str, str]:
        added = self._added.get(i)
        kind = 'normal' if added is None else ('control' if added.special else 'added')
        return self._tok.id_to_token(i) or '', kind

    def _ends_in_bytes(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        ends = []
        for text, encoding in zip(texts, self._tok.encode_batch(texts, add_special_tokens=False)):
            chars = np.array([end for _, end in encoding.offsets], np.int64)
            ends.append((np.asarray(encoding.ids, np.int32), chars if text.isascii() else _utf8_offsets(text)[chars]))
        return ends


def _utf8_offsets(text: str) -> np.ndarray:
    """(len(text) + 1,) the UTF-8 byte offset of each character offset of `text`."""
    code_points = np.frombuffer(text.encode('utf-32-le'), np.uint32)
    lengths = 1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    return np.concatenate([[0], np.cumsum(lengths)])


def _config_tokens(path: str) -> dict[str, str]:
    """eos_token/bos_token/pad_token as transformers reads them beside tokenizer file `path`: from
    tokenizer_config.json, overridden by special_tokens_map.json unless the config lists its
    added_tokens_decoder (then that file is legacy and unread)."""
    folder = storage.path(path).parent
    config_file, map_file = folder / 'tokenizer_config.json', folder / 'special_tokens_map.json'
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if 'added_tokens_decoder' not in config and map_file.exists():
        config |= json.loads(map_file.read_text())
    named = {}
    for key in ('eos_token', 'bos_token', 'pad_token'):
        value = config.get(key)
        value = value.get('content') if isinstance(value, dict) else value
        if isinstance(value, str):
            named[key] = value
    return named


def train(texts: Iterable[str], vocab_size: int, out: str, model_type: str = 'bpe') -> Tokenizer:
    """Trains on `texts` (each split into lines) and writes the tokenizer to `out`: a byte-level
    BPE tokenizer.json (the `tokenizers` library) when `out` ends with .json, else a sentencepiece
    model of `model_type`."""
    if model_type not in MODEL_TYPES:
        raise TokenizerError(f'model_type={model_type!r} is invalid: allowed one of {MODEL_TYPES}.')

    def lines() -> Iterator[str]:
        for text in texts:
            yield from (line for line in text.split('\n') if line.strip())

    start = time.perf_counter()
    if out.endswith('.json'):
        file_bytes, kind = _train_byte_level_bpe(lines(), vocab_size), HuggingFaceTokenizer
    else:
        file_bytes, kind = _train_sentencepiece(lines(), vocab_size, model_type), SentencePieceTokenizer
    tokenizer = kind(file_bytes, out)
    logging.info(
        'trained a %d-piece tokenizer (%s) in %.1fs',
        tokenizer.vocab_size,
        tokenizer.FILE_NAME,
        time.perf_counter() - start,
    )
    out_path = storage.path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(file_bytes)
    return tokenizer


def _train_byte_level_bpe(lines: Iterator[str], vocab_size: int) -> bytes:
    """GPT-2-style byte-level BPE: every byte is a base token, so any text encodes without unknowns;
    the special tokens take ids PAD_ID, EOS_ID, BOS_ID, UNK_ID as in the sentencepiece models."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted({PAD_ID: '<pad>', EOS_ID: '</s>', BOS_ID: '<s>', UNK_ID: '<unk>'}.items())
    if vocab_size < len(specials) + 256:
        raise TokenizerError(
            f'vocab_size={vocab_size} is too small for a byte-level BPE tokenizer: it needs at least '
            f'{len(specials) + 256} (the special tokens and the 256 bytes).'
        )
    tok.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[name for _, name in specials],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return tok.to_str().encode('utf-8')


def _train_sentencepiece(lines: Iterator[str], vocab_size: int, model_type: str) -> bytes:
    model = io.BytesIO()
    try:
        _run_sentencepiece_trainer(lines, model, vocab_size, model_type)
    except RuntimeError as e:
        too_high = re.search(r'Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)', str(e))
        if not too_high:
            raise
        raise TokenizerError(
            f'vocab_size={vocab_size} is too large for this corpus: sentencepiece can make at '
            f'most {too_high.group(2)} pieces from it; use a smaller vocabulary (model.vocab_size '
            'or --vocab_size) or more text.'
        ) from None
    return model.getvalue()


def _run_sentencepiece_trainer(lines: Iterator[str], model: io.BytesIO, vocab_size: int, model_type: str) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        bos_id=BOS_ID,
        unk_id=UNK_ID,
        normalization_rule_name='identity',
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        character_coverage=0.9995,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        max_sentence_length=1 << 16,
        num_threads=2,
        minloglevel=2,
    )


def _define_flags() -> dict:
    from absl import flags

    return {
        'name': flags.DEFINE_string('name', None, 'TFDS dataset name'),
        'data_dir': flags.DEFINE_string('data_dir', '', "TFDS data_dir ('' = vrl's cache)"),
        'split': flags.DEFINE_string('split', 'train', 'split to train on'),
        'text_field': flags.DEFINE_string('text_field', 'text', 'feature holding the text'),
        'vocab_size': flags.DEFINE_integer('vocab_size', None, 'pieces in the vocabulary'),
        'out': flags.DEFINE_string(
            'out',
            None,
            'where to write the tokenizer: PATH.model (sentencepiece) or PATH.json (a byte-level BPE tokenizer.json)',
        ),
        'model_type': flags.DEFINE_enum('model_type', 'bpe', MODEL_TYPES, 'sentencepiece model type (.model only)'),
        'max_docs': flags.DEFINE_integer('max_docs', 100_000, 'documents read from the split'),
    }


def main(args: dict, command: str) -> None:
    from vrl.core import cli
    from vrl.data import corpus

    cli.require(args, 'name', 'vocab_size', 'out')
    print(
        f'training a {args["vocab_size"].value:,}-piece tokenizer on up to {args["max_docs"].value:,} documents of '
        f'{args["name"].value} {args["split"].value} (reading them, then fitting: a minute or so per 100,000) ...',
        flush=True,
    )
    texts = corpus.texts(
        corpus.open_split(args['name'].value, args['data_dir'].value, args['split'].value),
        args['text_field'].value,
        limit=args['max_docs'].value,
    )
    tok = train(texts, args['vocab_size'].value, args['out'].value, args['model_type'].value)
    print(f'wrote {args["out"].value}: {tok.vocab_size} pieces, pad={tok.pad_id} eos={tok.eos_id} bos={tok.bos_id}')


def cli_main() -> None:
    """`vrl-tokenizer` (pyproject.toml's scripts): `python -m vrl.data.tokenizer` by another name."""
    from vrl.core import cli

    cli.run(main, _define_flags, ('train',))


if __name__ == '__main__':
    cli_main()
