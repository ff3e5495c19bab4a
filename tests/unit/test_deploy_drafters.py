"""A drafter is used only as what it claims to be: weight files that disagree on a tensor are refused, and a converted
folder is reused only for the config it was converted with and only while it still passes a folder's checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dfserve.deploy.drafters import resolve_drafter, resolve_target
from dfserve.deploy.profiles import load_profile
from dfserve.errors import FieldError
from tests.fixtures.deploy.synth import (
    TINY_DRAFTER_CONFIG,
    TINY_TARGET,
    tiny_config,
    tiny_state_dict,
    write_checkpoint,
)

PROFILE = load_profile("pro6000")
TARGET = resolve_target(str(TINY_TARGET), PROFILE, None)


def test_a_tensor_in_two_weight_files_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "drafter"
    folder.mkdir()
    state = tiny_state_dict()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(TINY_DRAFTER_CONFIG.read_text())
    resolve_drafter(str(folder), PROFILE, TARGET, tmp_path / "store")
    save_file({name: tensor.flatten().contiguous() for name, tensor in state.items()}, str(folder / "a-stale.safetensors"))
    with pytest.raises(FieldError) as caught:
        resolve_drafter(str(folder), PROFILE, TARGET, tmp_path / "store")
    message = str(caught.value)
    assert caught.value.field == "drafter" and "\n" not in message
    assert "tensor fc.weight is in both a-stale.safetensors and model.safetensors" in message


def test_a_checkpoint_converted_with_another_config_gets_its_own_folder(tmp_path: Path) -> None:
    store = tmp_path / "store"
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", {"model": tiny_state_dict()})
    block_4 = tmp_path / "cfg-b4.json"
    block_4.write_text(json.dumps({**tiny_config(), "block_size": 4}))
    first = resolve_drafter(str(checkpoint), PROFILE, TARGET, store, TINY_DRAFTER_CONFIG)
    second = resolve_drafter(str(checkpoint), PROFILE, TARGET, store, block_4)
    assert second.converted and second.model_path != first.model_path and second.sha256 != first.sha256
    assert second.block_size == 4 and json.loads((Path(second.model_path) / "config.json").read_text())["block_size"] == 4
    assert json.loads((Path(first.model_path) / "config.json").read_text())["block_size"] == 8
    again = resolve_drafter(str(checkpoint), PROFILE, TARGET, store, TINY_DRAFTER_CONFIG)
    assert not again.converted and again.model_path == first.model_path and again.sha256 == first.sha256


def damage(folder: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size - 100)
    elif how == "nan":
        data = bytearray((folder / "model.safetensors").read_bytes())
        data[-2:] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
        (folder / "model.safetensors").write_bytes(bytes(data))
    else:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "block_size": 4}))


@pytest.mark.parametrize(("how", "problem"), [
    ("truncated", "truncated"),
    ("nan", "has 1 NaN and 0 Inf values"),
    ("config", "config.json is not the one this conversion writes"),
])
def test_a_converted_folder_damaged_since_is_refused_on_reuse(tmp_path: Path, how: str, problem: str) -> None:
    store = tmp_path / "store"
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", {"model": tiny_state_dict()})
    folder = Path(resolve_drafter(str(checkpoint), PROFILE, TARGET, store, TINY_DRAFTER_CONFIG).model_path)
    damage(folder, how)
    with pytest.raises(FieldError) as caught:
        resolve_drafter(str(checkpoint), PROFILE, TARGET, store, TINY_DRAFTER_CONFIG)
    message = str(caught.value)
    assert caught.value.field == "drafter" and "\n" not in message
    assert message.startswith(f"drafter: {folder}, converted earlier from {checkpoint}") and problem in message
    assert "remove it to convert again" in message
