"""The registry: lookups, errors, no silent overwrite, the entry-point plugin path."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import dynamiq.codecs as codecs
from dynamiq.codecs import Codec, IntCodec, UnknownCodecError, get_codec, list_codecs
from dynamiq.codecs import registry as reg

BUILTIN = {
    "fp32",
    "bf16",
    "fp16",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
    "int8",
    "mxfp8_e4m3",
    "mxfp8_e5m2",
    "mxfp6_e3m2",
    "mxfp6_e2m3",
    "mxfp4",
    "mxint8",
}


def test_builtins_listed() -> None:
    assert set(list_codecs()) >= BUILTIN
    assert "int" in list_codecs(all_names=True) and "int" not in list_codecs()


def test_lookup_forms_agree() -> None:
    c = get_codec("int4")
    assert c == get_codec({"id": "int", "bits": 4})
    assert c == get_codec('{"id": "int", "bits": 4}')
    assert c == get_codec(json.loads(json.dumps(c.get_config())))
    assert get_codec(c) is c
    assert get_codec({"id": "int4", "rounding": "stochastic"}) == IntCodec(
        bits=4, rounding="stochastic"
    )


def test_unknown_codec_lists_known_ids() -> None:
    with pytest.raises(UnknownCodecError) as info:
        get_codec("mxfp3")
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "'mxfp3'" in msg and all(name in msg for name in BUILTIN)


@pytest.mark.parametrize(
    "config,exc,words",
    [
        ({"bits": 4}, ValueError, "'id'"),
        ({"id": "int", "bits": 9}, ValueError, "bits must be in 2..8 (got 9)"),
        ({"id": "int", "bits": 4.0}, TypeError, "bits must be an int"),
        ({"id": "int", "bits": True}, TypeError, "bits must be an int"),
        ({"id": "int", "block_size": 0}, ValueError, "block_size must be in 2..1048576 (got 0)"),
        ({"id": "int", "rounding": "up"}, ValueError, "rounding must be one of"),
        ({"id": "int", "scale_format": "fp8"}, ValueError, "scale_format must be one of"),
        ({"id": "int", "bitz": 4}, ValueError, "unknown config key(s) 'bitz'"),
        ({"id": "mxfp4", "block_size": 16}, ValueError, "unknown config key(s) 'block_size'"),
    ],
)
def test_bad_configs(config: dict, exc: type[Exception], words: str) -> None:
    with pytest.raises(exc) as info:
        get_codec(config)
    assert words in str(info.value)


def test_bad_lookup_type() -> None:
    with pytest.raises(TypeError, match="codec must be an id"):
        get_codec(4)  # type: ignore[arg-type]


def test_no_silent_overwrite() -> None:
    class Other(IntCodec):
        codec_id = "int"

    with pytest.raises(ValueError, match="already registered.*replace=True"):
        reg.register_codec(Other)
    assert type(get_codec("int8")) is IntCodec
    reg.register_codec(Other, replace=True)
    try:
        assert type(get_codec("int8")) is Other
    finally:
        reg.register_codec(IntCodec, replace=True)
    assert type(get_codec("int8")) is IntCodec
    # registering the same class again is a no-op, not an error
    reg.register_codec(IntCodec)


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


def test_every_codec_subclass_is_registered() -> None:
    """A concrete Codec subclass of the package that is not in the registry is a defect."""
    registered = reg.registered_classes()
    missing = [
        c.__qualname__
        for c in _all_subclasses(Codec)
        if c.__module__.startswith("dynamiq.") and "codec_id" in vars(c) and c not in registered
    ]
    abstract = [c for c in _all_subclasses(Codec) if "codec_id" not in vars(c)]
    assert not missing, f"unregistered codecs: {missing}"
    # abstract bases are exactly the family bases
    assert {c.__name__ for c in abstract if c.__module__.startswith("dynamiq.")} == {
        "PassThroughCodec",
        "MXCodec",
    }


PLUGIN = textwrap.dedent(
    '''
    from dataclasses import dataclass
    from typing import ClassVar

    from dynamiq.codecs.passthrough import FP16Codec


    @dataclass(frozen=True, kw_only=True)
    class HalfPlugin(FP16Codec):
        """A plugin codec: fp16 under another id (enough to exercise the entry point)."""

        codec_id: ClassVar[str] = "fake_plugin_fp16"
    '''
)


@pytest.fixture
def plugin_on_path(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "fake_dynamiq_plugin.py").write_text(PLUGIN)
    dist = tmp_path / "fake_dynamiq_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fake-dynamiq-plugin\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text(
        "[dynamiq.codecs]\nfake_plugin_fp16 = fake_dynamiq_plugin:HalfPlugin\n"
    )
    sys.path.insert(0, str(tmp_path))
    reg._reset_entry_points()
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("fake_dynamiq_plugin", None)
        reg._REGISTRY.pop("fake_plugin_fp16", None)
        reg._reset_entry_points()


def test_plugin_loaded_lazily_from_entry_point(plugin_on_path: Path) -> None:
    assert "fake_plugin_fp16" not in reg._REGISTRY  # nothing loaded before the lookup
    codec = get_codec("fake_plugin_fp16")
    assert type(codec).__name__ == "HalfPlugin"
    assert "fake_plugin_fp16" in list_codecs()
    assert get_codec(codec.get_config()) == codec
    from dynamiq.testing import run_conformance

    run_conformance(codec)


def test_broken_plugin_is_a_clear_error(tmp_path: Path) -> None:
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[dynamiq.codecs]\nbroken = no_such_module:Codec\n")
    sys.path.insert(0, str(tmp_path))
    reg._reset_entry_points()
    try:
        with pytest.warns(RuntimeWarning, match="'broken' failed to load.*no_such_module"):
            assert "fp32" in list_codecs()  # the built-ins still work
        with pytest.raises(ImportError, match="'broken' failed to load.*no_such_module"):
            get_codec("broken")
    finally:
        sys.path.remove(str(tmp_path))
        reg._reset_entry_points()


def test_public_names() -> None:
    for name in (
        "get_codec",
        "list_codecs",
        "register_codec",
        "UnknownCodecError",
        "HopContext",
        "ErrorBound",
        "Codec",
    ):
        assert hasattr(codecs, name)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"id": "int" "bits": 4}', "line 1, column 14 (character 13)"),  # a missing comma
        ('{"id": "int",\n "bits": }', "line 2, column 10 (character 23)"),  # a missing value
        ('{"id": "int"', "line 1, column 13 (character 12)"),  # unterminated
    ],
)
def test_malformed_json_config_names_the_position(text: str, where: str) -> None:
    with pytest.raises(ValueError, match="not valid JSON") as info:
        get_codec(text)
    assert where in str(info.value)
    assert not isinstance(info.value, json.JSONDecodeError)  # our message, not the parser's
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_config_that_is_not_an_object_or_has_a_bad_id() -> None:
    with pytest.raises(ValueError, match="must be a JSON object"):
        reg._parse_json_config("[1]")
    with pytest.raises(TypeError, match="codec id must be a string"):
        get_codec({"id": ["int"]})
    assert get_codec(' {"id": "int", "bits": 4} ') == get_codec("int4")
