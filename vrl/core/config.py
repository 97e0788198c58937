"""The config schema's machinery: the error an invalid value raises, the checks each section's
`__post_init__` runs, and the walk from a plain dict to nested frozen dataclasses that validates every
field. The sections live with the wings that read them (vrl/model/config.py, vrl/data/config.py,
vrl/train/config.py, the mesh's in vrl/core/sharding.py) and vrl/train/config.py composes them."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Sequence

from vrl.core.errors import VrlError


class ConfigError(VrlError, ValueError):
    """An invalid config value; the message names the field and what is allowed."""


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f'{field}={value!r} is invalid: allowed {allowed}.')


def choice(field: str, value: Any, allowed: Sequence[str]) -> None:
    require(value in allowed, field, value, 'one of ' + ', '.join(map(repr, allowed)))


def not_a_field(name: str, known: Sequence[str], what: str = 'field') -> str:
    """`name` (SECTION.FIELD, or SECTION) naming no config field: one short line with the nearest
    names of `known`, or all of them where none is near (not a typo, so the reader needs the list)."""
    key = name.rsplit('.', 1)[-1]
    near = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    if near:
        return f'{name} is not a config {what}; did you mean {" or ".join(map(repr, near))}?'
    return f'{name} is not a config {what}; allowed: {", ".join(known)}.'


def int_tuple(field: str, value: Any) -> tuple[int, ...]:
    """A tuple of ints from a tuple/list, one int, or '1,2,3' as typed on the command line."""
    if isinstance(value, str):
        value = [v for v in value.replace('(', '').replace(')', '').split(',') if v.strip()]
    try:
        return tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else [value]))
    except (TypeError, ValueError):
        raise ConfigError(f'{field}={value!r} is invalid: allowed integers such as 1,2,3.') from None


def from_dict(root: type, values: dict[str, Any]) -> Any:
    """`root` (a dataclass of section dataclasses) from {section: {field: value}}, every section's
    fields validated by its own `__post_init__`; raises ConfigError naming the first unknown or bad one."""
    values, sections = dict(values), {}
    for name, section_cls in typing.get_type_hints(root).items():
        given = dict(values.pop(name, {}))
        if hasattr(section_cls, 'UPGRADE'):  # fields of earlier configs, read as today's
            given = section_cls.UPGRADE(given)
        known = {f.name: f for f in dataclasses.fields(section_cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ConfigError(not_a_field(f'{name}.{unknown[0]}', sorted(known)))
        for field in given:  # tuples of ints from JSON lists or a command line's '1,3,5'
            if known[field].type == 'tuple[int, ...]':  # the annotation, a string in every section's module
                given[field] = int_tuple(f'{name}.{field}', given[field])
        sections[name] = section_cls(**given)
    if values:
        raise ConfigError(not_a_field(sorted(values)[0], [f.name for f in dataclasses.fields(root)], 'section'))
    return root(**sections)


def unresolved(section: Any, name: str) -> list[str]:
    """The fields of `section` (a config section called `name`, or '' and the whole config) still at
    their `auto` value, as 'model.remat=auto': a section's class names its autos in AUTOS ({field: the
    value that means auto}); nested sections are searched too."""
    prefix = f'{name}.' if name else ''
    left = [
        f'{prefix}{field}={auto}'
        for field, auto in getattr(section, 'AUTOS', {}).items()
        if getattr(section, field) == auto
    ]
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        left += unresolved(value, prefix + f.name) if dataclasses.is_dataclass(value) else []
    return left


def require_resolved(section: Any, name: str, user: str, unused: tuple[str, ...] = ()) -> None:
    """A ConfigError naming every `auto` left in `section` (see `unresolved`) but the `unused` fields
    ('model.remat': what `user` never reads): `user` takes concrete values only, which a run's plan
    resolves once (vrl.train.aot.resolve)."""
    left = [entry for entry in unresolved(section, name) if entry.split('=')[0] not in unused]
    if left:
        raise ConfigError(
            f'{", ".join(left)} unresolved: {user} takes concrete values. vrl.train.aot.resolve resolves a '
            "run's autos once (vrl.main and vrl.train.loop.run do it); vrl.model.resolve.execution a model's "
            'attention_impl, hand_vjp and compute_dtype for a platform.'
        )
