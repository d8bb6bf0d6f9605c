"""Every code block of the user guide and the READMEs runs, so the docs cannot rot (docs/design.md,
"House style", item 11).

Fenced blocks are checked by their language and by an optional ``<!-- run: SPEC -->`` comment
on the line before the fence:

* ``python``: executed in a fresh namespace in this process, from the repository root;
  ``<!-- run: torchrun N -->``: saved to a file and run with ``torchrun --standalone
  --nproc-per-node N``, as the doc tells the reader to; ``<!-- run: excerpt PATH -->``: its
  lines appear consecutively in PATH (up to a common indentation).
* ``sh``: every command (``#`` comments dropped, ``\\`` continuations joined) runs from the
  repository root with this interpreter's ``bin`` first on ``PATH`` and must exit 0, except
  ``make TARGET...``, which is dry-run (``make -n``: the real run is the CI itself),
  ``pip install -e PATH``, which checks that PATH is what is installed (``make venv`` installs
  it), and ``dynamiq ...``, which runs in this process. ``<!-- run: nodes N -->``: the block
  runs N times at once as N "nodes" of this machine (``NODE_RANK`` 0..N-1,
  ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``).
* ``toml``: an ``excerpt``.
* ``text``: prose (diagrams, output), unless ``<!-- run: tree DIR -->``: every path listed
  under DIR exists.
* A table after ``<!-- run: numbers from FILE -->``: each cell that is a number appears in
  FILE (numbers are read from the benchmarks page, never invented).

And every relative link (and same-page anchor) resolves; the README links every ``docs/*.md``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

from dynamiq.testing.distributed import free_port

ROOT = Path(__file__).parents[1]
DOCS = ("docs/guide.md", "docs/testing.md", "README.md", "examples/dynamiq-nf4/README.md")
BIN = Path(sys.executable).parent
TIMEOUT = 300

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*$")
_MARKER = re.compile(r"^\s*<!--\s*run:\s*(?P<spec>.*?)\s*-->\s*$")
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:e[-+]?\d+)?$")


@dataclass(frozen=True)
class Block:
    """A fenced block of a doc (its body without the fence's indentation)."""

    doc: str
    line: int
    lang: str
    spec: str  # the <!-- run: ... --> comment before it, or ""
    code: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def kind(self) -> str:
        return self.spec.split()[0] if self.spec else ""

    @property
    def arg(self) -> str:
        return self.spec.split(None, 1)[1] if " " in self.spec else ""


@functools.cache
def parse(doc: str) -> tuple[tuple[Block, ...], tuple[tuple[int, str, tuple[str, ...]], ...]]:
    """The fenced blocks of ``doc`` and its marked tables ``(line, spec, rows)``."""
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    tables: list[tuple[int, str, tuple[str, ...]]] = []
    spec = ""
    spec_line = 0
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        fence = _FENCE.match(lines[i])
        if marker:
            spec, spec_line = marker.group("spec"), i + 1
            following = lines[i + 1] if i + 1 < len(lines) else ""
            assert _FENCE.match(following) or following.startswith("|"), (
                f"{doc}:{spec_line}: <!-- run: {spec} --> must sit right above a block or table"
            )
            i += 1
            continue
        if fence:
            indent = fence.group("indent")
            start = i + 1
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i] != f"{indent}```":
                assert lines[i].startswith(indent) or not lines[i].strip(), f"{doc}:{i + 1}"
                body.append(lines[i][len(indent) :])
                i += 1
            assert i < len(lines), f"{doc}:{start}: unterminated fence"
            code = "\n".join(body) + "\n"
            blocks.append(Block(doc, start, fence.group("lang"), spec, code))
            spec = ""
        elif lines[i].startswith("|") and spec:
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            tables.append((spec_line, spec, tuple(rows)))
            spec = ""
            continue
        i += 1
    return tuple(blocks), tuple(tables)


def blocks(lang: str, kinds: tuple[str, ...] = ("",)) -> list:
    return [
        pytest.param(b, id=b.id)
        for doc in DOCS
        for b in parse(doc)[0]
        if b.lang == lang and b.kind in kinds
    ]


def test_every_block_is_checked() -> None:
    known = {
        "python": {"", "torchrun", "excerpt"},
        "sh": {"", "nodes"},
        "toml": {"excerpt"},
        "text": {"", "tree"},
    }
    for doc in DOCS:
        for b in parse(doc)[0]:
            assert b.lang in known, f"{b.id}: a ```{b.lang} block: no test knows how to run it"
            assert b.kind in known[b.lang], f"{b.id}: <!-- run: {b.spec} --> on a {b.lang} block"
    assert blocks("python") and blocks("python", ("torchrun",)) and blocks("sh", ("nodes",))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    assert proc.returncode == 0, (
        f"{what} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-4000:]}"
    )


# -- python ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", blocks("python"))
def test_python_block_runs(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    exec(compile(block.code, block.id, "exec"), {"__name__": "__main__"})


def _torchrun_blocks() -> list:
    """The guide's DDP training script (the block that registers the comm hook) runs by
    default; the other torchrun blocks (~20 s each: processes that import torch) run with
    ``-m slow``."""
    got = blocks("python", ("torchrun",))
    first = next(p for p in got if "register_comm_hook" in p.values[0].code)
    return [
        p if p is first else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow) for p in got
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("block", _torchrun_blocks())
def test_python_block_runs_under_torchrun(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", block.arg, str(script)]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    _check(proc, f"{block.id} under torchrun")


def _excerpt_found(code: str, path: Path) -> bool:
    want = code.rstrip("\n").split("\n")
    have = path.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(have):
        if not line.endswith(want[0]) or line[: len(line) - len(want[0])].strip():
            continue
        pad = line[: len(line) - len(want[0])]
        window = have[i : i + len(want)]
        if len(window) == len(want) and all(
            h == (pad + w if w.strip() else "") or (not w.strip() and not h.strip())
            for h, w in zip(window, want, strict=True)
        ):
            return True
    return False


@pytest.mark.parametrize("block", blocks("python", ("excerpt",)) + blocks("toml", ("excerpt",)))
def test_excerpt_is_in_its_file(block: Block) -> None:
    path = ROOT / block.arg
    assert _excerpt_found(block.code, path), f"{block.id}: not a verbatim excerpt of {block.arg}"


def test_excerpt_check_can_fail(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("class A:\n    x = 1\n\n    y = 2\n")
    assert _excerpt_found("x = 1\n\ny = 2\n", f)
    assert not _excerpt_found("x = 1\ny = 2\n", f)
    assert not _excerpt_found("x = 2\n", f)


# -- sh ----------------------------------------------------------------------------------------


def commands(code: str) -> list[list[str]]:
    """The block's commands as argument lists (comments dropped, continuations joined)."""
    out = []
    for logical in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(logical, comments=True)
        if argv:
            out.append(argv)
    return out


def _installed_from(path: Path) -> list[str]:
    """Distributions installed in editable mode from ``path``."""
    found = []
    for dist in metadata.distributions():
        raw = dist.read_text("direct_url.json")
        if not raw:
            continue
        info = json.loads(raw)
        if info.get("url") == path.resolve().as_uri() and info.get("dir_info", {}).get("editable"):
            found.append(dist.metadata["Name"])
    return found


def run_command(argv: list[str], block: Block) -> None:
    where = f"{block.id}: {shlex.join(argv)}"
    if argv[0] == "make":
        proc = subprocess.run(
            ["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        _check(proc, where)
    elif argv[:3] == ["pip", "install", "-e"] or argv[:5] == [
        "python",
        "-m",
        "pip",
        "install",
        "-e",
    ]:
        target = re.sub(r"\[.*\]$", "", argv[-1])
        assert _installed_from(ROOT / target), f"{where}: nothing is installed from {target}"
    elif argv[0] == "dynamiq":
        from dynamiq.bench.cli import main

        try:
            rc = main(argv[1:])
        except SystemExit as exc:  # --help
            rc = exc.code if isinstance(exc.code, int) else 1
        assert rc == 0, f"{where}: exit status {rc}"
    else:
        proc = subprocess.run(
            argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT
        )
        _check(proc, where)


@pytest.mark.parametrize("block", blocks("sh"))
def test_shell_block_runs(block: Block) -> None:
    argvs = commands(block.code)
    assert argvs, f"{block.id}: empty"
    for argv in argvs:
        run_command(argv, block)


@pytest.mark.parametrize("block", blocks("sh", ("nodes",)))
def test_multi_node_block_parses(block: Block) -> None:
    """The quick check of a multi-node launch (the slow test below runs it): torchrun's own
    parser takes the command, and the script exists and declares every option it is given."""
    from torch.distributed.run import get_args_parser

    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for argv in commands(block.code):
        argv = [env.get(a[1:], a) if a.startswith("$") else a for a in argv]
        assert argv[0] == "torchrun", f"{block.id}: {shlex.join(argv)}"
        args = get_args_parser().parse_args(argv[1:])
        assert args.nnodes == block.arg and args.node_rank == 1, block.id
        script = ROOT / args.training_script
        source = script.read_text(encoding="utf-8")
        for opt in (a for a in args.training_script_args if a.startswith("--")):
            assert f'"{opt}"' in source, f"{block.id}: {script.name} has no option {opt}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("block", blocks("sh", ("nodes",)))
def test_multi_node_block_runs_as_nodes_of_this_machine(block: Block) -> None:
    """The documented multi-node launch, verbatim, with every "node" on 127.0.0.1 (4 worker
    processes and 2 agents: about 20 s on 2 cores)."""
    nodes = int(block.arg)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=ROOT,
            env=_env(NODE_RANK=str(k), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(nodes)
    ]
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for k, (p, (out, err)) in enumerate(zip(procs, results, strict=True)):
        _check(subprocess.CompletedProcess(p.args, p.returncode, out, err), f"{block.id} node {k}")
    assert "final loss" in results[0][0], results[0][0][-2000:]


# -- text, tables, links -----------------------------------------------------------------------


@pytest.mark.parametrize("block", blocks("text", ("tree",)))
def test_tree_lists_existing_paths(block: Block) -> None:
    root = ROOT / block.arg
    lines = [ln for ln in block.code.splitlines() if ln.strip()]
    assert lines[0].rstrip("/") == block.arg.rstrip("/"), block.id
    for line in lines[1:]:
        path = root / line.split()[0]
        assert path.exists(), f"{block.id}: {path.relative_to(ROOT)} does not exist"


def test_numbers_are_read_from_their_source() -> None:
    checked = 0
    for doc in DOCS:
        for line, spec, rows in parse(doc)[1]:
            kind, _, source = spec.partition(" from ")
            assert kind == "numbers", f"{doc}:{line}: <!-- run: {spec} -->"
            text = (ROOT / source).read_text(encoding="utf-8")
            tokens = set(re.findall(r"[\d.]+(?:e[-+]?\d+)?", text))
            for row in rows[2:]:
                for cell in row.strip().strip("|").split("|"):
                    value = cell.strip()
                    if _NUMBER.match(value):
                        assert value in tokens, f"{doc}:{line}: {value} is not in {source}"
                        checked += 1
    assert checked >= 20


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    base = (ROOT / doc).parent
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (base / path) if path else ROOT / doc
        assert dest.exists(), f"{doc}: broken link {target}"
        if anchor and dest.suffix == ".md":
            heads = re.findall(r"^#+ (.*)$", dest.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {_slug(h) for h in heads}, f"{doc}: no heading for #{anchor}"


def test_readme_links_every_doc() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", text))
    docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert docs <= linked, f"README does not link {sorted(docs - linked)}"
    assert "examples/dynamiq-nf4/README.md" in text
    # the README opens with the two set-up commands
    assert text.startswith(
        "# dynamiq\n\n```sh\nmake demo   # set up .venv, print the codec table and every codec's "
        "error on real gradients\nmake test   # set up .venv, run lint (ruff, mypy) and the test "
        "suite\n```\n"
    )
