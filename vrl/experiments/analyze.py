"""Attention concentration of trained runs: `python -m vrl.experiments.analyze --workdir=A --workdir=B --out=OUT`.

For the latest checkpoint of each run, over --sequences validation sequences of --seq_len tokens
from the run's own dataset, computes per layer (vrl/model/layer_stats.py): attention entropy, first-token
attention, token similarity (embedding output first), and value- and hidden-state norms of the
first token and of the rest, and for value embeddings their gates. Writes OUT/<run name>/analysis.json
(one float per layer for each statistic, null where a layer has no value embedding, plus `variant`,
`step`, `sequences`, `seq_len`) and OUT/*.png, one line per run.
The model runs one layer at a time, so only one layer's (L x L) attention maps exist at once.
"""

from __future__ import annotations

import json

from absl import flags
from etils import epath

from vrl.core import cli, extras, storage
from vrl.core.errors import VrlError
from vrl.experiments import plots
from vrl.model import layer_stats
from vrl.train import diagnostics
from vrl.train.trained import load_trained

STATISTICS = diagnostics.STATISTICS


class AnalysisError(VrlError, ValueError):
    """Bad analysis input; the message names the problem."""


def analyze_run(workdir: str, sequences: int, seq_len: int, batch_size: int) -> dict:
    """The run's per-layer statistics averaged over `sequences` validation sequences."""
    if sequences < 1:
        raise AnalysisError(f'--sequences={sequences} is invalid: allowed an integer >= 1.')
    config, tok, trainer, params, step = load_trained(workdir)
    seq_len = seq_len or config.data.seq_len
    if not 2 <= seq_len <= config.data.seq_len:
        raise AnalysisError(
            f'--seq_len={seq_len} is invalid: allowed 2..{config.data.seq_len}, the sequence length '
            f'{workdir} was trained at (RoPE positions beyond it were never seen).'
        )
    tokens = diagnostics.validation_sequences(config, tok, sequences, seq_len, '--sequences')
    stats = diagnostics.averaged(diagnostics.summed_stats(trainer), trainer, params, tokens, batch_size)
    return {'variant': config.model.variant_name, 'step': step, 'sequences': sequences, 'seq_len': seq_len, **stats}


_PLOTS = {  # file -> (title, y label, [(statistic, line style)])
    'entropy': ('Attention entropy (key importance)', 'entropy (nats)', [('entropy', '-')]),
    'similarity': ('Token similarity', 'mean pairwise cosine', [('similarity', '-')]),
    'first_token_attention': ('Attention on the first token', 'mass', [('first_token_attention', '-')]),
    'value_norms': (
        'Value-state norms (solid: first token, dashed: the rest)',
        'L2 norm',
        [('value_norm_first', '-'), ('value_norm_rest', '--')],
    ),
    'hidden_norms': (
        'Hidden-state norms (solid: first token, dashed: the rest)',
        'L2 norm',
        [('hidden_norm_first', '-'), ('hidden_norm_rest', '--')],
    ),
}
PLOTTED = [statistic for _, _, statistics in _PLOTS.values() for statistic, _ in statistics]


def plot(results: dict[str, dict], out: epath.Path) -> list[epath.Path]:
    """One PNG per statistic in `out`, one colour per run, layers on the x axis."""
    written = []
    for name, (title, ylabel, statistics) in _PLOTS.items():
        lines = []
        for color, (run, result) in enumerate(results.items()):
            for statistic, style in statistics:
                first_layer = layer_stats.first_layer(statistic)
                values = result[statistic]
                lines.append(
                    plots.Line(
                        f'{run} ({result["variant"]})' if style == '-' else None,
                        range(first_layer, first_layer + len(values)),
                        values,
                        style,
                        color,
                    )
                )
        xlabel = 'layer (0 = embedding output)' if name == 'similarity' else 'layer'
        written.append(plots.line_plot(out / f'{name}.png', title, xlabel, ylabel, lines))
    return written


def run_names(workdirs: list[str]) -> list[str]:
    names = [storage.path(w).name for w in workdirs]
    for name in names:
        if names.count(name) > 1:
            raise AnalysisError(
                f'two --workdir folders are named {name!r}; their results would share '
                f'OUT/{name}: give each run a distinct folder name.'
            )
    return names


def _define_flags() -> dict[str, flags.FlagHolder]:
    """The command's flags, defined only when it runs (vrl.experiments.compare imports this module's functions)."""
    return {
        'workdir': flags.DEFINE_multi_string('workdir', [], 'A training workdir; repeat the flag for several runs.'),
        'out': flags.DEFINE_string('out', None, 'Where analysis.json files and plots go.'),
        'sequences': flags.DEFINE_integer('sequences', 32, 'Validation sequences to average over.'),
        'seq_len': flags.DEFINE_integer('seq_len', 0, "Tokens per sequence; 0 = the run's trained data.seq_len."),
        'batch_size': flags.DEFINE_integer('batch_size', 8, 'Sequences per forward pass.'),
    }


def main(args: cli.Args) -> None:
    cli.require(args, 'workdir', 'out')
    extras.require('vrl.experiments.analyze (for its figures)', 'matplotlib')
    workdirs = args['workdir'].value
    out = storage.path(args['out'].value)
    storage.check_writable(out.parent, '--out')  # before any work; out itself only once there are results
    names = run_names(workdirs)
    results = {
        name: analyze_run(workdir, args['sequences'].value, args['seq_len'].value, args['batch_size'].value)
        for name, workdir in zip(names, workdirs)
    }
    for name, result in results.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / 'analysis.json').write_text(json.dumps(result, indent=2))
    figures = plot(results, out)
    for name, result in results.items():
        entropy = ' '.join(f'{x:.2f}' for x in result['entropy'])
        print(f'{name} ({result["variant"]}, step {result["step"]}): entropy per layer {entropy}')
    print(f'wrote {len(results)} analysis.json and {len(figures)} plots to {out}')


def cli_main() -> None:
    """`vrl-analyze` (pyproject.toml's scripts): `python -m vrl.experiments.analyze` by another name."""
    cli.run(main, _define_flags)


if __name__ == '__main__':
    cli_main()
