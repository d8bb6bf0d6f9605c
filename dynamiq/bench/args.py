"""Argument checks and JSON output shared by the ``dynamiq`` subcommands.

Every subcommand checks all its arguments with these before it builds data, models or
clusters (docs/design.md, "CLI"): a check raises ``ValueError`` naming the argument, and the
command line prints the subcommand's usage with it.

JSON output keys are identifiers: :func:`identifier` turns a table's column title into one
(``"bits/value"`` -> ``"bits_per_value"``, ``"vnmse median"`` -> ``"vnmse_median"``,
``"bound |x̂ - x| <="`` -> ``"bound_abs_error"``); text and Markdown tables keep the titles.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

__all__ = [
    "check_int",
    "identifier",
    "json_keys",
    "parse_codecs",
    "parse_ints",
    "parse_schedules",
    "print_json",
    "split_list",
]

#: column titles whose identifier is not the mechanical one
_NAMED = {"bound |x̂ - x| <=": "bound_abs_error"}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# a column title (words, units, ratios), as opposed to data used as a key (a sysctl name,
# a seed number): only titles are renamed
_TITLE = re.compile(r"[ /|()<=-]")


def split_list(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated list."""
    return [t.strip() for t in text.split(",") if t.strip()]


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an int in ``lo..hi``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer (got {value!r})")
    if value < lo or (hi is not None and value > hi):
        rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {rng} (got {value})")


def parse_ints(text: str, name: str, lo: int, hi: int | None = None) -> list[int]:
    """A non-empty comma-separated list of integers in ``lo..hi``.

    >>> parse_ints("4, 8", "--workers", 1)
    [4, 8]
    """
    items = split_list(text)
    if not items:
        raise ValueError(f"{name} must list at least one integer (got {text!r})")
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{name} must be comma-separated integers (got {item!r})") from None
        check_int(name, value, lo, hi)
        out.append(value)
    return out


def parse_codecs(text: str, name: str = "--codecs") -> list[Any]:
    """Codecs from a comma-separated list of ids or a JSON list of ids and configs; each
    one is looked up (an unknown id raises ``UnknownCodecError``, which lists the known ids).
    An empty text gives an empty list.

    >>> parse_codecs('int8, mxfp4')
    ['int8', 'mxfp4']
    >>> parse_codecs('["int8", {"id": "int", "bits": 4}]')
    ['int8', {'id': 'int', 'bits': 4}]
    """
    from dynamiq.codecs import get_codec

    text = text.strip()
    if text.startswith("["):
        try:
            specs = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{name} is not a valid JSON list: {exc.msg} at line {exc.lineno}, column "
                f"{exc.colno} (character {exc.pos})"
            ) from None
        if not isinstance(specs, list) or not all(isinstance(s, (str, dict)) for s in specs):
            raise ValueError(f"{name} as JSON must be a list of ids and config objects")
    else:
        specs = split_list(text)
    for spec in specs:
        try:
            get_codec(spec)
        except TypeError as exc:  # e.g. a config whose id is not a string
            raise ValueError(f"{name}: {exc}") from None
    return specs


def parse_schedules(text: str, world_sizes: list[int], name: str = "--schedules") -> list[str]:
    """Schedule names, each checked by building it for every world size."""
    from dynamiq.collectives import get_schedule

    names = split_list(text)
    if not names:
        raise ValueError(f"{name} must name at least one schedule (got {text!r})")
    for sched in names:
        for n in world_sizes:
            get_schedule(sched, n)  # ScheduleError (a ValueError) names the problem
    return names


def identifier(key: str) -> str:
    """The JSON key of a column title: lower case, ``a/b`` -> ``a_per_b``, ``a / b`` ->
    ``a_over_b``, other punctuation -> ``_``.

    >>> identifier("copy bandwidth GB/s"), identifier("fused / torch.add"), identifier("bit-exact")
    ('copy_bandwidth_gb_per_s', 'fused_over_torch_add', 'bit_exact')
    """
    if key in _NAMED:
        return _NAMED[key]
    text = key.strip().lower().replace(" / ", " over ").replace("/", " per ")
    return re.sub(r"[^0-9a-z]+", "_", text).strip("_") or "_"


def json_keys(obj: Any) -> Any:
    """``obj`` with every column-title key (at any depth) renamed to its :func:`identifier`;
    other keys (identifiers already, or data such as a sysctl name) are kept."""
    if isinstance(obj, dict):
        out: dict[Any, Any] = {}
        for k, v in obj.items():
            new = k
            if isinstance(k, str) and not _IDENT.fullmatch(k) and _TITLE.search(k):
                new = identifier(k)
                if new in obj or new in out:  # never lose a value to a collision
                    new = k
            out[new] = json_keys(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [json_keys(v) for v in obj]
    return obj


def print_json(obj: Any, indent: int = 2) -> None:
    """Print ``obj`` as JSON with identifier keys (see :func:`json_keys`)."""
    print(json.dumps(json_keys(obj), indent=indent), file=sys.stdout)
