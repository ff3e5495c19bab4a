"""The docs against the code: every gate file the README shows loads with the real gate loader, every gate example
in a `--gate` help loads too, and every flag of a `dfserve ...` command the docs show is in that command's --help."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import pytest
import yaml

from dfserve.cli import root
from dfserve.eval.verdict import DEFAULT_EVAL_GATE
from dfserve.loadtest.judge import DEFAULT_GATE, read_gate

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "dfserve/gateway/README.md", "k8s/README.md", "dashboards/README.md")
GATES = {"gate.yaml": DEFAULT_GATE, "eval-gate.yaml": DEFAULT_EVAL_GATE}
"""The file name a README gate block opens with (`# gate.yaml ...`) -> the default of the gate it is read as."""
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`(dfserve\s[^`]+)`")


def code_blocks(text: str, language: str | None = None) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if language is None or lang == language]


def commands(doc: str) -> list[str]:
    """Each `dfserve ...` command in a code block (continued over `\\` line ends) or an inline code span."""
    text = (REPO / doc).read_text()
    found = []
    for block in code_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        found += [line.split("#")[0].strip() for line in joined.splitlines() if line.startswith("dfserve ")]
    return found + [" ".join(span.split()) for span in INLINE.findall(FENCE.sub("", text))]


def command_of(words: list[str]) -> tuple[click.Command, list[str]]:
    """The (sub)command the words name, and the words naming it."""
    command: click.Command = root
    path = ["dfserve"]
    for word in words:
        if not isinstance(command, click.Group):
            break
        sub = command.get_command(click.Context(command), word)
        if sub is None:
            break
        command, path = sub, [*path, word]
    return command, path


def help_text(command: click.Command, path: list[str]) -> str:
    return command.get_help(click.Context(command, info_name=" ".join(path)))


def flags(command_line: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"(?:^|[\s\[])(--[a-z][a-z0-9-]*)", command_line)]


DOC_COMMANDS = [(doc, line) for doc in DOCS for line in commands(doc)]


def test_the_docs_show_commands_of_every_kind() -> None:
    shown = {tuple(command_of(line.split()[1:])[1]) for _, line in DOC_COMMANDS}
    for expected in (("dfserve", "demo"), ("dfserve", "eval", "run"), ("dfserve", "loadtest", "run"),
                     ("dfserve", "compare"), ("dfserve", "deploy"), ("dfserve", "gateway"), ("dfserve", "promote")):
        assert expected in shown
    assert sum(len(flags(line)) for _, line in DOC_COMMANDS) > 50


@pytest.mark.parametrize(("doc", "line"), DOC_COMMANDS)
def test_every_flag_the_docs_show_is_in_the_commands_help(doc: str, line: str) -> None:
    command, path = command_of(line.split()[1:])
    text = help_text(command, path)
    missing = [flag for flag in flags(line) if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    assert not missing, f"{doc}: `{line}`: {' '.join(path)} --help has no {', '.join(missing)}"


def readme_gates() -> list[tuple[str, str]]:
    """(file name, YAML) of each ```yaml block of the README that opens with `# NAME` of a gate file."""
    blocks = code_blocks((REPO / "README.md").read_text(), "yaml")
    return [(name, block) for block in blocks for name in GATES if block.startswith(f"# {name}")]


def test_the_readme_shows_a_gate_file_of_each_kind() -> None:
    assert sorted({name for name, _ in readme_gates()}) == sorted(GATES)


@pytest.mark.parametrize(("name", "block"), readme_gates())
def test_every_readme_gate_loads_with_the_gate_loader(name: str, block: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(block)
    gate = read_gate(path, GATES[name])
    assert type(gate) is type(GATES[name]) and gate.rules


GATE_OPTIONS = [("compare",), ("loadtest", "run"), ("eval", "run"), ("eval", "compare")]


@pytest.mark.parametrize("words", GATE_OPTIONS, ids=" ".join)
def test_every_gate_help_shows_a_gate_that_loads(words: tuple[str, ...], tmp_path: Path) -> None:
    command, _ = command_of(list(words))
    (option,) = [p for p in command.params if "--gate" in p.opts]
    example = re.search(r"`(rules: [^`]+)`", option.help or "")  # type: ignore[attr-defined]
    assert example, f"{' '.join(words)} --gate's help shows no gate file"
    path = tmp_path / "gate.yaml"
    path.write_text(example.group(1))
    default = DEFAULT_EVAL_GATE if words[0] == "eval" else DEFAULT_GATE
    gate = read_gate(path, default)
    assert gate.rules == tuple(type(default.rules[0]).model_validate(r) for r in yaml.safe_load(example.group(1))["rules"])


def test_the_readme_gate_said_to_be_the_defaults_is_the_defaults(tmp_path: Path) -> None:
    (block,) = [b for name, b in readme_gates() if name == "gate.yaml" and b.splitlines()[0].endswith("the defaults")]
    path = tmp_path / "gate.yaml"
    path.write_text(block)
    assert read_gate(path, DEFAULT_GATE) == DEFAULT_GATE


def test_make_python_as_the_readme_documents_it_makes_the_venv(tmp_path: Path) -> None:
    (python,) = re.findall(r"`make\s+demo\s+PYTHON=([^`\s]+)`", (REPO / "README.md").read_text())
    venv = tmp_path / "venv"
    plan = subprocess.run(["make", "-n", "-C", str(REPO), "demo", f"PYTHON={python}", f"VENV={venv}"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert f"{python} -m venv {venv}" in plan
    assert f"{venv}/bin/python -m pip install -q -r requirements/demo.txt" in plan
    assert not any("requirements/ci.txt" in line for line in plan)  # the demo installs the demo's packages only
