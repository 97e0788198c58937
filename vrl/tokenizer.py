"""A sentencepiece tokenizer: train one from a dataset split, or load a `.model` (local or gs://).

    python -m vrl.tokenizer train --name=NAME --data_dir=DIR --vocab_size=N --out=PATH [--model_type=bpe]

Trained tokenizers use identity normalisation and byte fallback, so decode(encode(x)) == x for
any UTF-8 text, and declare the special ids below.
"""

from __future__ import annotations

import functools
import io
import logging
import re
import time
from typing import Iterable, Iterator

import numpy as np
import sentencepiece as spm

from vrl import storage
from vrl.errors import VrlError

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_TYPES = ('bpe', 'unigram')


class TokenizerError(VrlError, ValueError):
    """A missing or unusable tokenizer; the message says where it looked and what to do."""


class Tokenizer:
    """A loaded sentencepiece model. Picklable (grain worker processes get a copy)."""

    def __init__(self, model_proto: bytes, path: str = '<memory>'):
        self.path = path
        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)

    @classmethod
    def load(cls, path: str) -> 'Tokenizer':
        file = storage.path(path)
        if not storage.exists(file, 'data.tokenizer'):
            raise TokenizerError(
                f'tokenizer {path!r} does not exist. Train one with `python -m vrl.tokenizer train '
                f'--name=NAME --data_dir=DIR --vocab_size=N --out={path}`, or leave data.tokenizer '
                "empty ('') to train and cache one from the training split on first use.")
        try:
            return cls(file.read_bytes(), path)
        except RuntimeError as e:
            raise TokenizerError(f'{path!r} is not a sentencepiece model: {e}') from e

    @property
    def model_proto(self) -> bytes:
        """The sentencepiece model, as its .model file holds it."""
        return self._proto

    def __getstate__(self):
        return {'model_proto': self._proto, 'path': self.path}

    def __setstate__(self, state):
        self.__init__(state['model_proto'], state['path'])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @functools.cached_property
    def utf8_bytes(self) -> np.ndarray:
        """(vocab_size,) int32: the UTF-8 bytes of text each token stands for (a byte-fallback
        piece is one byte; control tokens none), so summing over a text's ids gives its length in
        bytes: the denominator of bits per byte."""
        sizes = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            if self._sp.is_byte(i):
                sizes[i] = 1
            elif not (self._sp.is_control(i) or self._sp.is_unknown(i)):
                sizes[i] = len(self._sp.id_to_piece(i).replace('\u2581', ' ').encode('utf-8'))
        return sizes

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """`context + continuation` encoded as one text, split before the first token that covers
        any of the continuation's bytes: a token merging the context's last characters with the
        continuation's first belongs to the continuation, so the pair's ids are exactly the whole
        text's ids and the continuation's are the ones the model must predict."""
        boundary = len(context.encode('utf-8'))
        pieces = self._sp.encode(context + continuation, out_type='proto').pieces
        # byte-fallback pieces of one character: all but the last are empty spans at its start
        split = next((i for i, p in enumerate(pieces) if p.end > boundary or p.begin >= boundary), len(pieces))
        ids = [p.id for p in pieces]
        return ids[:split], ids[split:]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def difference(self, other: 'Tokenizer') -> str | None:
        """How `other` encodes differently (piece count, or the first id whose piece or type differs);
        None when every id is the same piece of the same kind, so both give the same ids."""
        if self.vocab_size != other.vocab_size:
            return f'{self.vocab_size} vs {other.vocab_size} pieces'
        for i in range(self.vocab_size):
            mine, theirs = _describe(self._sp, i), _describe(other._sp, i)
            if mine != theirs:
                return f'id {i} is {mine} vs {theirs}'
        return None


def _describe(sp: spm.SentencePieceProcessor, i: int) -> str:
    kind = next((k for k in ('control', 'unknown', 'byte', 'unused') if getattr(sp, f'is_{k}')(i)), 'normal')
    return f'{sp.id_to_piece(i)!r}' + ('' if kind == 'normal' else f' ({kind})')


def train(texts: Iterable[str], vocab_size: int, out: str, model_type: str = 'bpe') -> Tokenizer:
    """Trains on `texts` (each split into lines) and writes the model to `out`."""
    if model_type not in MODEL_TYPES:
        raise TokenizerError(f'model_type={model_type!r} is invalid: allowed one of {MODEL_TYPES}.')

    def lines() -> Iterator[str]:
        for text in texts:
            yield from (line for line in text.split('\n') if line.strip())

    model = io.BytesIO()
    start = time.perf_counter()
    try:
        _train_sentencepiece(lines(), model, vocab_size, model_type)
    except RuntimeError as e:
        too_high = re.search(r'Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)', str(e))
        if not too_high:
            raise
        raise TokenizerError(f'vocab_size={vocab_size} is too large for this corpus: sentencepiece can make at '
                             f'most {too_high.group(2)} pieces from it; use a smaller vocabulary (model.vocab_size '
                             'or --vocab_size) or more text.') from None
    logging.info('trained a %d-piece %s tokenizer in %.1fs', vocab_size, model_type, time.perf_counter() - start)
    out_path = storage.path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(model.getvalue())
    return Tokenizer(model.getvalue(), out)


def _train_sentencepiece(lines: Iterator[str], model: io.BytesIO, vocab_size: int, model_type: str) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, vocab_size=vocab_size, model_type=model_type,
        byte_fallback=True, pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
        normalization_rule_name='identity', add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, character_coverage=0.9995,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, max_sentence_length=1 << 16,
        num_threads=2, minloglevel=2)


def _define_flags() -> dict:
    from absl import flags
    return {
        'name': flags.DEFINE_string('name', None, 'TFDS dataset name'),
        'data_dir': flags.DEFINE_string('data_dir', '', "TFDS data_dir ('' = vrl's cache)"),
        'split': flags.DEFINE_string('split', 'train', 'split to train on'),
        'text_field': flags.DEFINE_string('text_field', 'text', 'feature holding the text'),
        'vocab_size': flags.DEFINE_integer('vocab_size', None, 'pieces in the vocabulary'),
        'out': flags.DEFINE_string('out', None, 'where to write the .model file'),
        'model_type': flags.DEFINE_enum('model_type', 'bpe', MODEL_TYPES, 'sentencepiece model type'),
        'max_docs': flags.DEFINE_integer('max_docs', 100_000, 'documents read from the split'),
    }


def main(args: dict, command: str) -> None:
    from vrl import cli, corpus
    cli.require(args, 'name', 'vocab_size', 'out')
    texts = corpus.texts(corpus.open_split(args['name'].value, args['data_dir'].value, args['split'].value),
                         args['text_field'].value, limit=args['max_docs'].value)
    tok = train(texts, args['vocab_size'].value, args['out'].value, args['model_type'].value)
    print(f'wrote {args["out"].value}: {tok.vocab_size} pieces, pad={tok.pad_id} eos={tok.eos_id} bos={tok.bos_id}')


if __name__ == '__main__':
    from vrl import cli
    cli.run(main, _define_flags, ('train',))
