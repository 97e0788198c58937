"""The package's layout holds: every module imports only its own wing and the wings before it in
vrl.WINGS (vrl/main.py on top of them all), no import circle anywhere (imports inside functions
count), and each wing's __init__ says in at most three lines what it owns and may import. The
imports are read with `ast`, nothing is imported."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT
from vrl import WINGS

PACKAGE = ROOT / 'vrl'


def modules() -> dict[str, ast.Module]:
    """Dotted name -> parsed source, of every vrl module (the exported PyTorch code imports no vrl)."""
    found = {}
    for path in sorted(PACKAGE.rglob('*.py')):
        if 'hf_modeling' in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix('').parts
        name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
        found[name] = ast.parse(path.read_text())
    return found


def import_graph(parsed: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the vrl modules it imports (`from vrl.x import y` is module vrl.x.y where that is one)."""
    graph = {}
    for name, tree in parsed.items():
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith('vrl')}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split('.')[0] == 'vrl':
                for alias in node.names:
                    sub = f'{node.module}.{alias.name}'
                    imported.add(sub if sub in parsed else node.module)
        graph[name] = imported - {name}
    return graph


def rank(module: str) -> int:
    """Where a module's wing stands in vrl.WINGS; vrl itself (WINGS and the backend hook) with core,
    vrl.main above every wing."""
    parts = module.split('.')
    if len(parts) == 1:
        return 0
    return WINGS.index(parts[1]) if parts[1] in WINGS else len(WINGS)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f'{module} imports {target}'
        for module, targets in graph.items()
        for target in targets
        if rank(target) > rank(module)
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_module_is_in_a_wing_or_is_the_training_command():
    stray = [
        name for name in modules() if name.count('.') == 1 and name != 'vrl.main' and name.split('.')[1] not in WINGS
    ]
    assert not stray, f'modules outside the wings of vrl.WINGS: {stray}'


def test_imports_run_downward_between_wings_and_never_in_a_circle():
    graph = import_graph(modules())
    assert (
        'vrl.train.aot' in graph['vrl.train.plan']
        and 'vrl.train.plan' in graph['vrl.train.loop']
        and 'vrl.model.decoder' in graph['vrl.train.step']
    )
    assert not upward_imports(graph)
    assert not circles(graph)


SHARED_ROOMS = ('vrl.train.config', 'vrl.train.trained', 'vrl.train.rundir', 'vrl.train.scoring')


def reaches_past_shared_rooms(graph: dict[str, set[str]], importers: tuple[str, ...]) -> list[str]:
    """Imports of vrl.train by the modules under `importers` that are not of SHARED_ROOMS."""
    return sorted(
        f'{module} imports {target}'
        for module, targets in graph.items()
        if module.startswith(importers)
        for target in targets
        if target.startswith('vrl.train') and target != 'vrl.train' and not target.startswith(SHARED_ROOMS)
    )


def test_the_tools_and_trains_shared_rooms_reach_no_further_into_train():
    """The workdir's ownership (vrl/train/rundir) and scoring (vrl/train/scoring) are rooms of their own:
    they, and the tools that read a trained run, import of vrl.train only the config, a trained run read
    back and each other, never the loop's modules (loop, hooks, plan, start, downstream)."""
    graph = import_graph(modules())
    assert not reaches_past_shared_rooms(graph, ('vrl.tools', 'vrl.train.rundir', 'vrl.train.scoring'))
    leaky = dict(graph, **{'vrl.train.scoring.scorer': graph['vrl.train.scoring.scorer'] | {'vrl.train.hooks'}})
    assert reaches_past_shared_rooms(leaky, ('vrl.train.scoring',)) == [
        'vrl.train.scoring.scorer imports vrl.train.hooks'
    ]


def test_the_checks_catch_an_upward_import_and_a_circle():
    graph = {
        'vrl.model.decoder': {'vrl.train.step'},
        'vrl.train.step': {'vrl.train.aot'},
        'vrl.train.aot': {'vrl.train.resolve'},
        'vrl.train.resolve': {'vrl.train.aot'},
    }
    assert upward_imports(graph) == ['vrl.model.decoder imports vrl.train.step']
    assert circles(graph) == [['vrl.train.aot', 'vrl.train.resolve']]


@pytest.mark.parametrize('wing', WINGS)
def test_each_wing_says_in_three_lines_what_it_owns_and_may_import(wing):
    doc = ast.get_docstring(modules()[f'vrl.{wing}'])
    assert doc and len(doc.splitlines()) <= 3 and 'import' in doc.lower(), doc


WHAT_CHANGED_SINCE = '0f4f1e6'  # the first commit since subjects name no review round
SUBJECTS_KEPT_SINCE = '3dbc217'  # the commit after which every subject keeps docs/contributing.md's rule


def test_commit_subjects_fit_in_72_characters():
    """`git log --oneline` reads: each commit since the rule began says what changed in one short line."""
    import subprocess

    known = (
        subprocess.run(
            ['git', 'cat-file', '-e', f'{SUBJECTS_KEPT_SINCE}^{{commit}}'], cwd=ROOT, capture_output=True
        ).returncode
        == 0
    )
    since = [f'{SUBJECTS_KEPT_SINCE}..HEAD'] if known else ['-1', 'HEAD']  # a clone without it: the newest
    subjects = subprocess.run(
        ['git', 'log', '--format=%s', *since], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert subjects and not [s for s in subjects if len(s) > 72], [s for s in subjects if len(s) > 72]


def test_commit_subjects_say_what_changed_not_how_it_came_about():
    """Since the rule began, no subject opens with how the change was made ("Review mend:")."""
    import subprocess

    known = (
        subprocess.run(
            ['git', 'cat-file', '-e', f'{WHAT_CHANGED_SINCE}^{{commit}}'], cwd=ROOT, capture_output=True
        ).returncode
        == 0
    )
    since = [f'{WHAT_CHANGED_SINCE}~1..HEAD'] if known else ['-1', 'HEAD']
    subjects = subprocess.run(
        ['git', 'log', '--format=%s', *since], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert subjects and not [s for s in subjects if s.lower().startswith(('review mend', 'mend:', 'fixup'))], subjects


@pytest.mark.parametrize(
    'command',
    [['check', '--output-format', 'concise'], ['format', '--check']],
    ids=['lint', 'format'],
)
def test_the_code_passes_the_lint_and_format_in_pyproject(command):
    """ruff's checks (pyflakes, import order, whitespace, syntax) and its formatter, as pyproject.toml
    sets them, on every Python file of the checkout: `ruff format .` fixes what the second names."""
    import subprocess
    import sys

    pytest.importorskip('ruff', reason='ruff is in requirements-test.txt: pip install -r requirements-test.txt')
    checked = subprocess.run(
        [sys.executable, '-m', 'ruff', command[0], '--no-cache', *command[1:], '.'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
