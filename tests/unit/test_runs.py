from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from dfserve.capture.read import read_capture
from dfserve.deploy.assets import read_json
from dfserve.deploy.sim.profiles import load_profile
from dfserve.errors import FieldError, UserError
from dfserve.runs import (
    JsonlAppender,
    Provenance,
    create_run_dir,
    read_jsonl,
    read_model,
    redacted,
    run_name,
    staged_folder,
    write_atomic,
    write_model,
)
from dfserve.yamlfile import read_yaml


class Row(BaseModel):
    n: int


def test_run_dirs_are_unique_and_never_reused(tmp_path: Path) -> None:
    first = create_run_dir(tmp_path)
    second = create_run_dir(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()
    named = create_run_dir(tmp_path, "baseline")
    with pytest.raises(UserError, match="already exists"):
        create_run_dir(tmp_path, "baseline")
    assert named.exists()


def test_run_ids_sort_in_creation_order_within_one_second(tmp_path: Path) -> None:
    made = [create_run_dir(tmp_path, prefix="start").name for _ in range(50)]
    assert sorted(made) == made


def test_write_atomic_refuses_to_replace_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    write_atomic(target, "{}\n")
    with pytest.raises(FileExistsError):
        write_atomic(target, "other")
    assert target.read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_run_files_and_staged_folders_are_readable_by_other_users(tmp_path: Path) -> None:
    """A converted drafter copied onto a volume is read by the engine pod's uid, not its writer's: not mkstemp's
    0600 and mkdtemp's 0700."""
    write_atomic(tmp_path / "config.json", "{}\n")
    with staged_folder(tmp_path / "drafter") as folder:
        write_atomic(folder / "model.safetensors", b"weights")
    assert (tmp_path / "config.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "drafter").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "drafter" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_jsonl_appender_flushes_each_record_and_refuses_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    with JsonlAppender(path) as out:
        out.append(Row(n=1))
        assert path.read_text() == '{"n":1}\n'  # visible before close: a crash keeps it
        out.append(Row(n=2))
    assert path.read_text().splitlines() == ['{"n":1}', '{"n":2}']
    with pytest.raises(FileExistsError):
        JsonlAppender(path)


def test_provenance_records_versions(tmp_path: Path) -> None:
    prov = Provenance.here()
    assert prov.versions["dfserve"] != "not installed"
    write_model(tmp_path / "p.json", prov)
    assert Provenance.model_validate_json((tmp_path / "p.json").read_text()) == prov


def test_secrets_on_the_command_line_never_reach_a_file() -> None:
    argv = ["dfserve", "loadtest", "run", "--api-key", "k1", "--api-key=k2", "--header", "Authorization: Bearer k3",
            "--header=X-Token: k4", "--name", "--api-key"]
    written = " ".join(redacted(argv))
    assert not any(secret in written for secret in ("k1", "k2", "k3", "k4"))
    assert redacted(argv) == ["dfserve", "loadtest", "run", "--api-key", "***", "--api-key=***", "--header",
                              "Authorization: ***", "--header=X-Token: ***", "--name", "--api-key"]


@pytest.mark.parametrize(("name", "problem"), [
    ("../../x", "holds a path separator or NUL"), ("..", "begins with a dot"), (".", "begins with a dot"),
    (".staged", "begins with a dot"), ("", "is empty"), ("a/b", "holds a path separator"),
    ("a\\b", "holds a path separator"), ("a\0b", "holds a path separator or NUL"), ("é" * 128, "longer than 255 bytes"),
])
def test_a_run_name_is_one_plain_folder_name(tmp_path: Path, name: str, problem: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(FieldError, match=re.escape(problem)) as refused:
        create_run_dir(out, name)
    assert refused.value.field == "name" and repr(name) in str(refused.value)
    assert not tmp_path.joinpath("x").exists() and not out.exists()
    assert run_name("run-1.v2") == "run-1.v2" and create_run_dir(out, "run-1.v2") == out / "run-1.v2"


class Document(BaseModel):
    kind: Literal["eval-run"] = "eval-run"
    n: int


def test_a_document_of_another_kind_is_named_as_such_not_by_its_first_field(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"kind": "loadtest-run", "run_id": "r"}')
    with pytest.raises(UserError) as caught:
        read_model(path, Document, "missing")
    assert str(caught.value) == f"{path}: kind is loadtest-run, not eval-run (another command's folder)"
    path.write_text('{"kind": "eval-run", "n": "x"}')
    with pytest.raises(UserError, match=r"config\.json: n: "):
        read_model(path, Document, "missing")


def test_a_folder_where_a_document_should_be_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    with pytest.raises(UserError, match=r"config\.json: cannot read \(Is a directory\)"):
        read_model(tmp_path / "config.json", Document, "missing")


def test_a_key_given_twice_is_refused_however_valid_either_copy(tmp_path: Path) -> None:
    """`{"n": 1, "n": 2}` is valid JSON to most readers, each keeping one of the two: a verdict or summary with
    two `verdict` keys says two things."""
    path = tmp_path / "config.json"
    path.write_text('{"kind": "eval-run", "n": 1, "n": 2}')
    with pytest.raises(UserError, match=r"config\.json: key 'n' given twice in one object \(edited\?\)"):
        read_model(path, Document, "missing")


def test_a_pipe_where_a_runs_file_should_be_is_refused_without_waiting(tmp_path: Path) -> None:
    """A FIFO put in place of requests.jsonl made `compare` wait forever for a writer."""
    os.mkfifo(tmp_path / "requests.jsonl")
    with pytest.raises(UserError, match=r"requests\.jsonl: cannot read \(not a regular file\)"):
        list(read_jsonl(tmp_path / "requests.jsonl", Row, "a row"))
    with pytest.raises(UserError, match=r"requests\.jsonl: cannot read \(not a regular file\)"):
        read_model(tmp_path / "requests.jsonl", Row, "missing")
    (tmp_path / "rows.jsonl").write_text('{"n": 1}\n')
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "rows.jsonl")
    assert [row.n for row in read_jsonl(tmp_path / "link.jsonl", Row, "a row")] == [1]


def _capture_with_a_pipe(path: Path) -> None:
    path.mkdir()
    os.mkfifo(path / "manifest.json")
    read_capture(path)


@pytest.mark.parametrize(("name", "read"), [
    ("gate.yaml", read_yaml),  # gates and gateway configs
    ("capture", _capture_with_a_pipe),
    ("profile.json", lambda path: load_profile(str(path))),  # the simulator's drafter profile
    ("config.json", lambda path: read_json(path, "drafter")),  # a checkpoint's config
])
def test_a_pipe_or_device_named_as_a_users_file_is_refused_without_waiting(
        tmp_path: Path, name: str, read: Callable[[Path], object]) -> None:
    """A FIFO given as --gate, a gateway --config, a capture's manifest or a sim profile waited forever for a
    writer; /dev/zero as --gate read 23 GB before the kernel killed it."""
    path = tmp_path / name
    if name != "capture":
        os.mkfifo(path)
    with pytest.raises((UserError, FieldError), match=r"not a regular file"):
        read(path)
    if name == "gate.yaml":
        with pytest.raises(UserError, match=r"not a regular file"):
            read_yaml(Path("/dev/zero"))
