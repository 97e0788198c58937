"""The manual's commands run as written: every `python -m vrl.<command> ...` in README.md and docs/*.md
parses with that command's real flags (and a --config file and its overrides load and validate), and
every bench/ and launch/ script it names exists. Training them is what the other tests do."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]


def shell_blocks(page: Path) -> list[str]:
    """The lines of the page's ```bash / ```sh / ``` blocks, continuation lines joined, comments dropped."""
    lines, block, out = page.read_text().splitlines(), None, []
    for line in lines:
        fence = re.match(r'^\s*```(\w*)\s*$', line)
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block in ('bash', 'sh', ''):
            out.append(line)
    joined = re.sub(r'\\\n', '', '\n'.join(out))  # as the shell joins them
    return [re.sub(r'\s+#.*$', '', line).strip() for line in joined.splitlines() if line.strip()]


def commands() -> list[tuple[str, str, list[str]]]:
    """(page, module, arguments) for each vrl command; [optional] brackets opened, $HOME kept literal."""
    found = []
    for page in PAGES:
        for line in shell_blocks(page):
            for part in re.split(r'&&|;', line):
                match = re.search(r'python -m (vrl(?:\.\w+)+)(.*)', part)
                if match:
                    args = re.sub(r'\[(--[^\]]+)\]', r'\1', match.group(2))
                    found.append((page.name, match.group(1), shlex.split(args)))
    return found


CHECK = r"""
import json, sys
from absl import flags
from vrl.train.config import from_configdict
import importlib
results = []
for page, module, args in json.loads(sys.stdin.read()):
    mod = importlib.import_module(module)
    if not hasattr(mod, '_define_flags'):  # a package's command: its __main__
        mod = importlib.import_module(module + '.__main__')
    defined = mod._define_flags()
    sys.argv = ['prog', *args]  # config_flags reads its overrides from sys.argv
    try:
        flags.FLAGS(sys.argv)
        if 'config' in defined and defined['config'].value is not None:
            from_configdict(defined['config'].value)
        results.append(None)
    except Exception as e:  # the test names the page and the command
        results.append(f'{page}: python -m {module} {" ".join(args)}: {type(e).__name__}: {e}')
    flags.FLAGS.unparse_flags()
    for name in [*(holder.name for holder in defined.values()), *(n for n in flags.FLAGS if n.startswith('config.'))]:
        delattr(flags.FLAGS, name)
print(json.dumps(results))
"""


NEEDS_EXTRA = {'vrl.tools.evaluate': 'lm_eval'}  # module -> the package of requirements-extra.txt it imports


def test_every_vrl_command_in_the_docs_parses_with_the_real_flags():
    found = commands()
    modules = {module for _, module, _ in found}
    assert {
        'vrl.main',
        'vrl.experiments.compare',
        'vrl.experiments.study',
        'vrl.experiments.analyze',
        'vrl.tools.generate',
        'vrl.tools.evaluate',
        'vrl.tools.export',
        'vrl.data',
        'vrl.data.tokenizer',
    } <= modules, modules
    # a command whose module needs requirements-extra.txt is checked where that is installed (.ci/run)
    missing = {module for module, package in NEEDS_EXTRA.items() if importlib.util.find_spec(package) is None}
    out = subprocess.run(
        [sys.executable, '-c', CHECK],
        input=json.dumps([c for c in found if c[1] not in missing]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    failures = [r for r in json.loads(out.stdout.strip().splitlines()[-1]) if r]
    assert not failures, '\n'.join(failures)


def test_every_script_the_docs_name_exists():
    named = {m for page in PAGES for m in re.findall(r'\b((?:bench|launch)/[\w.]+\.(?:py|sh))', page.read_text())}
    assert named, 'the docs name no bench/ or launch/ script'
    assert not [path for path in sorted(named) if not (ROOT / path).is_file()]


def test_a_mistyped_flag_in_a_command_is_caught():
    """The check can fail: a flag no command defines is reported with its page."""
    out = subprocess.run(
        [sys.executable, '-c', CHECK],
        input=json.dumps([['x.md', 'vrl.tools.export', ['--wrkdir=a']]]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert failures[0].startswith('x.md: python -m vrl.tools.export --wrkdir=a: UnrecognizedFlagError')


def _anchor(heading: str) -> str:
    """The fragment a Markdown renderer (GitHub's) gives a heading: lower case, punctuation but
    hyphens dropped, spaces as hyphens."""
    return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def broken_links(pages: list[Path]) -> list[str]:
    """Each `[text](target)` of `pages` whose target file (relative to its page) or #heading is not there."""
    broken = []
    for page in pages:
        text = re.sub(r'```.*?```', '', page.read_text(), flags=re.S)
        for target in re.findall(r'\]\(([^)\s]+)\)', text):
            if re.match(r'[a-z]+:', target):
                continue  # a web address: not checked here (tests reach nothing but 127.0.0.1)
            file, _, fragment = target.partition('#')
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                broken.append(f'{page.name}: {target} (no such file)')
            elif (
                fragment
                and linked.suffix == '.md'
                and fragment
                not in {
                    _anchor(h)
                    for h in re.findall(r'^#+ (.+)$', re.sub(r'```.*?```', '', linked.read_text(), flags=re.S), re.M)
                }
            ):
                broken.append(f'{page.name}: {target} (no such heading)')
    return broken


def test_every_link_in_the_manual_leads_somewhere(tmp_path):
    assert not broken_links(PAGES)
    page = tmp_path / 'page.md'  # the check can fail: a missing file and a missing heading are named
    page.write_text('# One heading\n\n[a](#one-heading) [b](#two) [c](gone.md) [d](page.md#one-heading)\n')
    assert broken_links([page]) == ['page.md: #two (no such heading)', 'page.md: gone.md (no such file)']


def test_every_table_made_from_a_ledger_is_what_its_ledger_makes():
    """The docs' tables between `<!-- table KIND: LEDGER -->` markers equal what
    `python -m vrl.experiments.tables` makes from their ledgers (run it to remake them)."""
    from vrl.experiments import tables

    for page in PAGES:
        _, changed = tables.remade(page.read_text(), ROOT)
        assert not changed, f'{page}: remake the tables of {changed} with python -m vrl.experiments.tables'


def test_an_lr_sweep_table_is_the_ledgers_numbers_and_a_changed_one_is_found(tmp_path):
    """lr_sweep from a synthetic ledger against numbers computed here: each cell the seeds' mean and sample
    deviation, the best LR in bold, the gap at each variant's best LR; a hand-edited cell is a difference."""
    import numpy as np

    from vrl.experiments import tables

    rng = np.random.default_rng(3)
    rows, finals = [], {}
    for variant, shift in (('vanilla', 0.0), ('skipv1', -0.05)):
        for lr, lr_shift in ((1e-3, 0.3), (3e-3, 0.0), (1e-2, 0.4)):
            for seed in range(3):
                loss = 4.0 + shift + lr_shift + 0.01 * rng.standard_normal()
                finals.setdefault((variant, lr), []).append(loss)
                curve = {str(s): loss + (400 - s) / 100 for s in (100, 200, 300, 400)}
                rows.append(
                    {
                        'fingerprint': f'{variant}{lr}{seed}',
                        'variant': variant,
                        'seed': seed,
                        'peak_lr': lr,
                        'seq_len': 128,
                        'step': 400,
                        'tokens_per_step': 2048,
                        'coordinates': {'size': 'base', 'lr': f'lr{lr:g}', 'seq': 'L128'},
                        'eval_loss': loss,
                        'eval_curve': curve,
                        'train_loss': {'400': loss},
                    }
                )
    (tmp_path / 'family.results.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    page = '# x\n\n<!-- table lr_sweep: family.results.jsonl -->\nold\n<!-- end table -->\n'
    made, changed = tables.remade(page, tmp_path)
    assert changed == ['family.results.jsonl']
    for (variant, lr), losses in finals.items():
        cell = f'{np.mean(losses):.4f} ± {np.std(losses, ddof=1):.4f}'
        assert (f'**{cell}**' if lr == 3e-3 else cell) in made, (cell, made)
    gap = np.mean(finals[('skipv1', 3e-3)]) - np.mean(finals[('vanilla', 3e-3)])
    assert re.search(rf'^\| skipv1 \|.*\| {gap:+.3f} \(spread [\d.]+\) \|', made, re.M), made
    assert tables.remade(made, tmp_path)[1] == []  # made again: the same
    edited = made.replace(f'{np.mean(finals[("vanilla", 1e-3)]):.4f}', '9.9999')
    assert tables.remade(edited, tmp_path)[1] == ['family.results.jsonl']
    # with the step costs bench/train_throughput.py --json wrote: two more columns, and where they ran
    costs = [
        {'config': '82m', 'variant': v, 'batch': 4, 'seq_len': 512, 'dtype': 'float32', 'step_seconds': s}
        | {'vs_vanilla': rel, 'gib': gib, 'machine': '1 x cpu, 2 cores', 'date': '2026-12-07'}
        for v, s, rel, gib in (('skipv1', 4.489, '-2.2%', 2.32), ('vanilla', 4.591, '(reference)', 2.331))
    ]
    (tmp_path / 'cost.jsonl').write_text(''.join(json.dumps(c) + '\n' for c in costs))
    with_cost = made.replace('family.results.jsonl -->', 'family.results.jsonl cost=cost.jsonl -->')
    costed, changed = tables.remade(with_cost, tmp_path)
    assert changed == ['family.results.jsonl'] and '| 82m step vs vanilla | GiB |' in costed
    assert re.search(r'^\| skipv1 \|.* \| -2\.2% \| 2\.32 \|$', costed, re.M), costed
    assert 'on 1 x cpu, 2 cores, 2026-12-07 (vanilla 4.591 s a step)' in costed
    # a grid still running: skipv1 has only LR 1e-3 so far
    (tmp_path / 'family.results.jsonl').write_text(
        ''.join(json.dumps(r) + '\n' for r in rows if r['variant'] == 'vanilla' or r['peak_lr'] == 1e-3)
    )
    partial, _ = tables.remade(page, tmp_path)
    still = r'^\| skipv1 \| [\d.]+ ± [\d.]+ \| — \| — \| not yet: LR 0.003, 0.01 to run \| — \|$'
    assert re.search(still, partial, re.M), partial
    (tmp_path / 'family.results.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    with pytest.raises(tables.TableError, match='bench/train_throughput.py --json gone.jsonl'):
        tables.remade(with_cost.replace('cost=cost.jsonl', 'cost=gone.jsonl'), tmp_path)
