"""The codec registry: a dict, three functions and one entry-point group (docs/design.md,
"House style", item 4).

Built-in codecs register with the :func:`register_codec` decorator. Third-party packages add
codecs through the entry-point group ``dynamiq.codecs``; entry points are loaded lazily, on the
first lookup that misses (and by :func:`list_codecs`)::

    # the plugin's pyproject.toml
    [project.entry-points."dynamiq.codecs"]
    nf4 = "dynamiq_nf4:NF4Codec"

>>> get_codec("int8").get_config()["bits"]
8
>>> get_codec({"id": "int", "bits": 4}) == get_codec("int4")
True
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, TypeVar

from .base import Codec

__all__ = [
    "ENTRY_POINT_GROUP",
    "UnknownCodecError",
    "get_codec",
    "list_codecs",
    "register_codec",
]

ENTRY_POINT_GROUP = "dynamiq.codecs"

# name -> (codec class, preset keyword arguments)
_REGISTRY: dict[str, tuple[type[Codec], dict[str, Any]]] = {}
_entry_points_loaded = False
# entry-point name -> why it failed to load
_BROKEN: dict[str, str] = {}

C = TypeVar("C", bound=type[Codec])


class UnknownCodecError(ValueError):
    """No codec is registered under the requested id."""


def register_codec(cls: C, *, replace: bool = False) -> C:
    """Register ``cls`` under ``cls.codec_id`` and under each of its ``presets``.

    Usable as a decorator. Registering a name that is taken raises ``ValueError`` unless
    ``replace=True``: there is no silent overwrite.
    """
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec takes a Codec subclass (got {cls!r})")
    cid = getattr(cls, "codec_id", None)
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"{cls.__name__}.codec_id must be a non-empty string (got {cid!r})")
    names = {cid: {}, **{name: dict(kw) for name, kw in cls.presets.items()}}
    for name in names:
        old = _REGISTRY.get(name)
        if old is not None and old[0] is not cls and not replace:
            raise ValueError(
                f"codec id {name!r} is already registered by {old[0].__module__}."
                f"{old[0].__qualname__}; pass replace=True to override it"
            )
    for name, kwargs in names.items():
        _REGISTRY[name] = (cls, kwargs)
    return cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            cls = ep.load()
            register_codec(cls)
        except Exception as exc:  # a broken plugin must not break the built-ins
            _BROKEN[ep.name] = f"{ep.value}: {type(exc).__name__}: {exc}"
            warnings.warn(
                f"dynamiq codec plugin {ep.name!r} failed to load ({_BROKEN[ep.name]})",
                RuntimeWarning,
                stacklevel=3,
            )


def _reset_entry_points() -> None:
    """Forget that entry points were loaded (tests that add a plugin to ``sys.path``)."""
    global _entry_points_loaded
    _entry_points_loaded = False
    _BROKEN.clear()


def get_codec(name_or_config: str | Mapping[str, Any] | Codec) -> Codec:
    """A codec from its id, a preset name, a config mapping (or JSON string), or a codec.

    Raises :class:`UnknownCodecError` (a ``ValueError``) listing the known ids on a miss, and
    a ``ValueError`` naming the line, column and character of a malformed JSON string.
    """
    if isinstance(name_or_config, Codec):
        return name_or_config
    if isinstance(name_or_config, str):
        text = name_or_config.strip()
        if text.startswith("{"):
            config: Mapping[str, Any] = _parse_json_config(text)
        else:
            config = {"id": text}
    elif isinstance(name_or_config, Mapping):
        config = name_or_config
    else:
        raise TypeError(
            "codec must be an id, a config mapping or a Codec "
            f"(got {type(name_or_config).__name__})"
        )
    if "id" not in config:
        raise ValueError(f"codec config must have an 'id' key (got keys {sorted(config)})")
    name = config["id"]
    if not isinstance(name, str):
        raise TypeError(f"codec id must be a string (got {type(name).__name__} {name!r})")
    if name not in _REGISTRY:
        _load_entry_points()
    if name in _BROKEN:
        raise ImportError(f"dynamiq codec plugin {name!r} failed to load ({_BROKEN[name]})")
    if name not in _REGISTRY:
        raise UnknownCodecError(
            f"unknown codec {name!r}; known codecs: {', '.join(list_codecs(all_names=True))}"
        )
    cls, preset = _REGISTRY[name]
    params = {k: v for k, v in config.items() if k != "id"}
    return cls.from_config({**preset, **params})


def _parse_json_config(text: str) -> Mapping[str, Any]:
    """A codec config from a JSON object; a ``ValueError`` naming the position otherwise."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"codec config is not valid JSON: {exc.msg} at line {exc.lineno}, column "
            f"{exc.colno} (character {exc.pos}), before {text[exc.pos : exc.pos + 24]!r}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"codec config must be a JSON object (got {type(config).__name__})")
    return config


def list_codecs(*, all_names: bool = False) -> list[str]:
    """Registered codec names, sorted: the presets of codecs that have them, else the ids.

    With ``all_names=True`` also the ids of codecs that have presets (``"int"``).
    """
    _load_entry_points()
    names = []
    for name, (cls, preset) in _REGISTRY.items():
        if all_names or preset or not cls.presets:
            names.append(name)
    return sorted(names)


def registered_classes() -> set[type[Codec]]:
    """Every registered codec class (for the test that no ``Codec`` subclass is missed)."""
    _load_entry_points()
    return {cls for cls, _ in _REGISTRY.values()}
