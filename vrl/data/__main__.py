"""`python -m vrl.data prepare|tokenize|stats`: build a TFDS dataset from text, JSON lines or parquet
files (vrl/data/build.py), with its pre-tokenized copy in the same pass, pre-tokenize a prepared one
(vrl/data/tokens.py), or count its documents, characters and tokens.

    python -m vrl.data prepare --input=GLOB --name=NAME --data_dir=DIR [--tokenizer=PATH] [--workers=N]
                               [--validation_fraction=F] [--overwrite] [--limit=N] (the first N documents only)
                               [--text_field=text] [--domain_field=meta.redpajama_set_name] (one dataset per domain)
    python -m vrl.data tokenize --name=NAME --data_dir=DIR --tokenizer=PATH [--workers=N]   (vrl/data/tokens.py)
        prepare and tokenize on several machines at once: the same command on each, joined by
        jax.distributed (auto on a Cloud TPU pod or under SLURM; elsewhere --coordinator_address=HOST:PORT
        --num_processes=N --process_id=I); each writes its share of the input files or shards
    python -m vrl.data stats --name=NAME --data_dir=DIR [--tokenizer=PATH]
"""

from __future__ import annotations

from absl import flags

from vrl.core import cli, multihost
from vrl.data import build, pipeline, sources, tokens
from vrl.data.tokenizer import Tokenizer


def _define_flags() -> cli.Args:
    return {
        'input': flags.DEFINE_string(
            'input',
            None,
            'prepare: a folder or glob (local or gs://) of text, JSON lines '
            '(.jsonl, .jsonl.gz, .jsonl.zst) or parquet files',
        ),
        'name': flags.DEFINE_string('name', None, 'TFDS dataset name (lower_snake_case for prepare)'),
        'data_dir': flags.DEFINE_string('data_dir', '', "TFDS data_dir ('' = ~/.cache/vrl/tensorflow_datasets)"),
        'validation_fraction': flags.DEFINE_float(
            'validation_fraction', 0.05, 'prepare: documents held out for validation'
        ),
        'split_mode': flags.DEFINE_enum(
            'split_mode',
            'file',
            sources.SPLIT_MODES,
            'prepare, text files: one document per file, per blank-line block, or per '
            'JSON line (JSON lines and parquet files: always one per record)',
        ),
        'text_field': flags.DEFINE_string(
            'text_field',
            'text',
            'prepare: the field (JSON lines; dotted for nested) or column (parquet) holding the text',
        ),
        'domain_field': flags.DEFINE_string(
            'domain_field', None, 'prepare: one dataset per value of this field or column, e.g. meta.redpajama_set_name'
        ),
        'overwrite': flags.DEFINE_bool(
            'overwrite',
            False,
            'prepare: rebuild a dataset that was prepared from other '
            'inputs; tokenize: make the pre-tokenized copy again',
        ),
        'limit': flags.DEFINE_integer(
            'limit',
            0,
            'prepare: only the first N non-empty documents (of each dataset '
            'with --domain_field): a subset to try things on; 0 = all',
        ),
        'workers': flags.DEFINE_integer(
            'workers',
            None,
            'prepare, tokenize: processes on this host (default: every core; prepare: one for inputs under 64 MB)',
        ),
        'tokenizer': flags.DEFINE_string(
            'tokenizer',
            None,
            'prepare: also write the ids, in the same pass; stats, '
            'tokenize: the tokenizer (.model, tokenizer.json or a folder)',
        ),
        **multihost.define_flags(),
    }


def main(args: cli.Args, command: str) -> None:
    cli.require(args, 'name')
    name, data_dir = args['name'].value, args['data_dir'].value
    tokenizer = (
        Tokenizer.load(args['tokenizer'].value, '--tokenizer', name, data_dir) if args['tokenizer'].value else None
    )
    if command == 'prepare':
        cli.require(args, 'input')
        multihost.initialize(args)
        source, fraction, overwrite = args['input'].value, args['validation_fraction'].value, args['overwrite'].value
        common = dict(
            overwrite=overwrite,
            tokenizer=tokenizer,
            workers=args['workers'].value,
            text_field=args['text_field'].value,
            validation_fraction=fraction,
            limit=args['limit'].value,
        )
        if args['domain_field'].value:
            names = build.prepare_domains(source, name, data_dir, args['domain_field'].value, **common)
            for domain, dataset in names.items():
                print(f'prepared {dataset} ({args["domain_field"].value} = {domain!r})')
            print(
                'train on all of them, equally weighted: --config.data.mixture='
                + ','.join(f'{dataset}=1' for dataset in names.values())
            )
            return
        path = build.prepare_from_glob(source, name, data_dir, split_mode=args['split_mode'].value, **common)
        print(f'prepared {name} in {path}')
        if tokenizer:  # a dataset prepared before from the same inputs has no copy of this tokenizer's yet
            tokens.tokenize(name, data_dir, tokenizer, args['workers'].value, text_field='text')
        return
    if command == 'tokenize':
        cli.require(args, 'tokenizer')
        multihost.initialize(args)
        print(
            f'tokenizing {name} with {tokenizer.path} ({args["workers"].value or "every core"} processes; a bar on a '
            'terminal) ...',
            flush=True,
        )
        folder = tokens.tokenize(
            name, data_dir, tokenizer, args['workers'].value, args['overwrite'].value, args['text_field'].value
        )
        print(
            f'pre-tokenized {name} with {tokenizer.path} into {folder}; training with this dataset and tokenizer '
            'reads it (data.pretokenized=false: tokenize on the fly)'
        )
        return
    print(
        f'counting the documents, characters{" and tokens" if tokenizer else ""} of {name}, split by split '
        '(a full read of each) ...',
        flush=True,
    )
    for split, row in pipeline.split_stats(name, data_dir, tokenizer).items():
        print(f'{split:<11}' + '  '.join(f'{k} {v:,}' for k, v in row.items()), flush=True)


def cli_main() -> None:
    """`vrl-data` (pyproject.toml's scripts): `python -m vrl.data` by another name."""
    cli.run(main, _define_flags, ('prepare', 'tokenize', 'stats'))


if __name__ == '__main__':
    cli_main()
