"""In-house checkpoint conversion: every trainer layout, every broken checkpoint named, idempotent, nothing half-written;
a converted folder reused only for the config it was converted with and only while it still passes a folder's
checks; weight files that disagree on a tensor refused."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dfserve.deploy.assets import verify_drafter_config
from dfserve.deploy.convert import convert_checkpoint, strip_prefixes
from dfserve.deploy.drafters import RECORD_NAME, resolve_drafter, resolve_target
from dfserve.deploy.profiles import load_profile
from dfserve.errors import FieldError, UserError
from tests.fixtures.deploy.synth import (
    TINY_DRAFTER_CONFIG,
    TINY_TARGET,
    tiny_config,
    tiny_state_dict,
    trainer_checkpoint,
    with_prefix,
    write_checkpoint,
)

PROFILE = load_profile("pro6000")
TARGET = resolve_target(str(TINY_TARGET), PROFILE, None)
ARCH = verify_drafter_config(tiny_config(), TARGET)


def convert(path: Path, store: Path):  # type: ignore[no-untyped-def]
    return convert_checkpoint(path, store, TARGET, tiny_config(), ARCH, store / ".hashes")


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.mark.parametrize("layout", ["flat", "model", "state_dict-module", "model-draft_model", "ddp-draft_model"])
def test_every_trainer_layout_converts_to_zlab_names_in_bf16(tmp_path: Path, layout: str) -> None:
    state = tiny_state_dict()
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", trainer_checkpoint(state, layout))
    result = convert(checkpoint, tmp_path / "store")
    assert result.converted
    with safe_open(str(result.folder / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert names == set(state)
        for name in names:
            tensor = handle.get_tensor(name)
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, state[name].to(torch.bfloat16))
    config = json.loads((result.folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 500, "target_layer_ids": [1, 4, 6]}
    assert config["block_size"] == 8 and config["num_target_layers"] == 8 and config["dtype"] == "bfloat16"
    record = json.loads((result.folder / RECORD_NAME).read_text())
    assert record["sha256"] == result.sha256 and record["tensors"] == len(state)


def test_a_checkpoint_in_torchs_legacy_format_converts(tmp_path: Path) -> None:
    """Saved without the zip format (`_use_new_zipfile_serialization=False`): it loads with weights_only, unmapped
    (it was refused with torch's message that mmap needs the zip format)."""
    state = tiny_state_dict()
    checkpoint = tmp_path / "legacy.pt"
    torch.save({"model": state}, checkpoint, _use_new_zipfile_serialization=False)
    result = convert(checkpoint, tmp_path / "store")
    with safe_open(str(result.folder / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(state)


def test_safetensors_input_with_prefix(tmp_path: Path) -> None:
    state = tiny_state_dict(dtype=torch.float16)
    checkpoint = write_checkpoint(tmp_path / "drafter.safetensors", with_prefix(state, "module."))
    result = convert(checkpoint, tmp_path / "store")
    with safe_open(str(result.folder / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(state)


def test_second_conversion_of_same_content_reuses_folder(tmp_path: Path) -> None:
    store = tmp_path / "store"
    state = tiny_state_dict()
    first = convert(write_checkpoint(tmp_path / "a" / "checkpoint.pt", trainer_checkpoint(state, "model")), store)
    weights = first.folder / "model.safetensors"
    inode, mtime = weights.stat().st_ino, weights.stat().st_mtime_ns
    again = convert(tmp_path / "a" / "checkpoint.pt", store)
    assert not again.converted and again.folder == first.folder
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == (inode, mtime)
    # A copy of the same bytes elsewhere is the same drafter; different weights are a different folder.
    copy = tmp_path / "b" / "checkpoint.pt"
    copy.parent.mkdir()
    copy.write_bytes((tmp_path / "a" / "checkpoint.pt").read_bytes())
    assert convert(copy, store).folder == first.folder
    other = convert(write_checkpoint(tmp_path / "c.pt", tiny_state_dict(seed=1)), store)
    assert other.folder != first.folder and other.converted


def test_hash_is_cached_per_file_identity(tmp_path: Path) -> None:
    store = tmp_path / "store"
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", tiny_state_dict())
    result = convert(checkpoint, store)
    cached = list((store / ".hashes").iterdir())
    assert len(cached) == 1 and cached[0].read_text().strip() == result.sha256


def broken(state: dict[str, torch.Tensor], case: str) -> dict[str, torch.Tensor]:
    state = dict(state)
    if case == "missing":
        del state["layers.1.mlp.down_proj.weight"]
    elif case == "shape":
        state["fc.weight"] = torch.zeros(64, 2 * 64)
    elif case == "nan":
        state["layers.0.self_attn.q_proj.weight"][0, :3] = float("nan")
    elif case == "inf":
        state["norm.weight"][5] = float("inf")
    elif case == "unexpected":
        state["lm_head.weight"] = torch.zeros(512, 64)
    elif case == "prefix":
        state = with_prefix(state, "drafter_net.")
    elif case == "int":
        state["hidden_norm.weight"] = torch.ones(64, dtype=torch.int32)
    return state


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "missing tensor layers.1.mlp.down_proj.weight"),
        ("shape", "fc.weight has shape [64, 128], expected [64, 192]"),
        ("nan", "layers.0.self_attn.q_proj.weight has 3 NaN and 0 Inf values"),
        ("inf", "norm.weight has 0 NaN and 1 Inf values"),
        ("unexpected", "unexpected tensor lm_head.weight"),
        ("prefix", "missing tensor fc.weight"),
        ("int", "hidden_norm.weight has dtype int32, expected a floating-point type"),
    ],
)
def test_broken_checkpoint_names_the_problem_and_leaves_nothing(tmp_path: Path, case: str, message: str) -> None:
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", {"model": broken(tiny_state_dict(), case), "step": 7})
    store = tmp_path / "store"
    with pytest.raises(UserError, match="problem") as info:
        convert(checkpoint, store)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert tree(store) == []


def test_wrong_prefix_counts_every_missing_and_unexpected_tensor(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "c.pt", broken(tiny_state_dict(), "prefix"))
    with pytest.raises(UserError) as info:
        convert(checkpoint, tmp_path / "store")
    assert "50 problem(s)" in str(info.value)  # 25 expected names missing, 25 prefixed names unexpected
    assert "and 42 more" in str(info.value)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"optimizer": {"lr": 1.0}, "step": 3}, "no drafter state dict"),
        ([1, 2, 3], "not a state dict"),
    ],
)
def test_checkpoint_without_state_dict(tmp_path: Path, payload: object, message: str) -> None:
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(payload, checkpoint)
    with pytest.raises(UserError, match=message):
        convert(checkpoint, tmp_path / "store")
    assert tree(tmp_path / "store") == []


def test_a_state_dict_under_a_later_wrapper_key_is_found_past_a_config_under_an_earlier_one(tmp_path: Path) -> None:
    state = tiny_state_dict()
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", {"model": {"hidden_size": 64}, "model_state_dict": state})
    assert convert(checkpoint, tmp_path / "store").converted
    nested = write_checkpoint(tmp_path / "nested.pt", {"model": {**state, "step": 3}, "optimizer": {}})
    with pytest.raises(UserError, match=rf"nested.pt\['model'\]: {len(state)} tensors beside entries that are not "
                                        r"tensors \(step\)"):
        convert(nested, tmp_path / "store")
    flat = write_checkpoint(tmp_path / "flat.pt", {**state, "step": 3})
    with pytest.raises(UserError, match=rf"{len(state)} tensors beside entries that are not tensors \(step\): not a "
                                        "state dict"):
        convert(flat, tmp_path / "store")


def test_a_checkpoint_saved_over_while_it_is_converted_is_refused_and_nothing_is_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashed, then loaded: a trainer's rename in between stored the newer weights under the older bytes' hash."""
    from dfserve.deploy import convert as converting

    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", {"model": tiny_state_dict()})
    newer = write_checkpoint(tmp_path / "newer.pt", {"model": {k: v + 1 for k, v in tiny_state_dict().items()}})
    loading = converting.load_checkpoint

    def saved_over_first(path: Path) -> Any:
        os.replace(newer, checkpoint)
        return loading(path)

    monkeypatch.setattr(converting, "load_checkpoint", saved_over_first)
    with pytest.raises(FieldError, match=r"checkpoint\.pt changed while it was converted .*; convert it again"):
        convert(checkpoint, tmp_path / "store")
    assert [p for p in tree(tmp_path / "store") if not p.startswith(".hashes")] == []


def test_garbage_file_is_one_clear_error(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"not a checkpoint at all")
    with pytest.raises(UserError, match="not a torch checkpoint"):
        convert(checkpoint, tmp_path / "store")
    bad_st = tmp_path / "x.safetensors"
    bad_st.write_bytes(b"\x00" * 4)
    with pytest.raises(UserError, match="not a readable safetensors file"):
        convert(bad_st, tmp_path / "store")


def test_pickled_code_is_refused(tmp_path: Path) -> None:
    """weights_only loading: a checkpoint that would run code on load is rejected, not executed."""
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({"model": tiny_state_dict(), "hook": Path("/etc/passwd")}, checkpoint)
    with pytest.raises(UserError, match="weights_only"):
        convert(checkpoint, tmp_path / "store")


def test_prefix_collision_is_an_error() -> None:
    with pytest.raises(UserError, match="more than one prefix"):
        strip_prefixes(["module.fc.weight", "fc.weight"])
    assert strip_prefixes(["module.draft_model.norm.weight"]) == {"module.draft_model.norm.weight": "norm.weight"}


def test_resolve_drafter_converts_and_labels_checkpoint(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", trainer_checkpoint(tiny_state_dict(), "model"))
    drafter = resolve_drafter(str(checkpoint), PROFILE, TARGET, tmp_path / "store", TINY_DRAFTER_CONFIG)
    assert drafter.kind == "checkpoint" and drafter.converted and drafter.sim_profile == "inhouse"
    assert drafter.sha256 is not None and drafter.label == f"inhouse-{drafter.sha256[:8]}"
    assert drafter.block_size == 8
    folder = resolve_drafter(drafter.model_path, PROFILE, TARGET, tmp_path / "store")
    assert folder.kind == "folder" and folder.block_size == 8 and folder.sha256


def test_converted_folder_with_a_tensor_removed_is_rejected(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", tiny_state_dict())
    result = convert(checkpoint, tmp_path / "store")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(result.folder / "model.safetensors"))
    del tensors["layers.0.mlp.up_proj.weight"]
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    save_file(tensors, str(damaged / "model.safetensors"))
    (damaged / "config.json").write_text((result.folder / "config.json").read_text())
    with pytest.raises(UserError, match=r"missing tensor layers\.0\.mlp\.up_proj\.weight"):
        resolve_drafter(str(damaged), PROFILE, TARGET, tmp_path / "store")


def test_raw_bit_scan_counts_nan_and_inf_like_torch(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from dfserve.deploy.assets import read_safetensors_header, safetensors_nonfinite

    generator = torch.Generator().manual_seed(3)
    tensors = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        t = torch.randn(40, 7, generator=generator).to(dtype)
        t[0, :2] = float("nan")
        t[5, 3] = float("inf")
        t[9, :3] = float("-inf")
        tensors[str(dtype)] = t
    tensors["clean"] = torch.randn(3, 3, generator=generator).to(torch.bfloat16)
    tensors["ints"] = torch.full((4,), -1, dtype=torch.int32)  # all bits set, but not a float: ignored
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    problems = safetensors_nonfinite(path, read_safetensors_header(path))
    assert sorted(problems) == sorted(f"{name} has 2 NaN and 4 Inf values" for name in tensors if name.startswith("torch"))


def test_converted_folder_with_nan_is_rejected(tmp_path: Path) -> None:
    result = convert(write_checkpoint(tmp_path / "checkpoint.pt", tiny_state_dict()), tmp_path / "store")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(result.folder / "model.safetensors"))
    tensors["layers.1.self_attn.o_proj.weight"][2, 2] = float("nan")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    save_file(tensors, str(damaged / "model.safetensors"))
    (damaged / "config.json").write_text((result.folder / "config.json").read_text())
    with pytest.raises(UserError, match=r"layers\.1\.self_attn\.o_proj\.weight has 1 NaN and 0 Inf values"):
        resolve_drafter(str(damaged), PROFILE, TARGET, tmp_path / "store")


def _header(document: object) -> bytes:
    text = json.dumps(document).encode()
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize(("payload", "problem"), [
    (b"\x05\x00", "unpack requires a buffer of 8 bytes"),
    (b"\xff" * 8 + b"{}", "header length implausible"),
    (b"\x03\x00\x00\x00\x00\x00\x00\x00{\xff}", "UnicodeDecodeError"),
    (_header([1, 2]), "not a JSON object"),
    (_header({"w": "F32"}), "w: not an object"),
    (_header({"w": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 8]}}), "w: shape is not a list of sizes"),
    (_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}), "w: data_offsets is not [begin, end]"),
    (_header({"w": {"shape": [2], "data_offsets": [0, 8]}}), "w: dtype is not a string"),
    (b"\x20\x00\x00\x00\x00\x00\x00\x00" + b"[" * 32, "JSONDecodeError"),
    (_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}) + b"\0" * 4,
     "end at byte 77, the file at 73: truncated"),
])
def test_a_corrupted_safetensors_header_is_one_line_about_its_field(tmp_path: Path, payload: bytes,
                                                                    problem: str) -> None:
    from dfserve.deploy.assets import read_safetensors_header
    from dfserve.errors import FieldError

    path = tmp_path / "model.safetensors"
    path.write_bytes(payload)
    with pytest.raises(FieldError) as caught:
        read_safetensors_header(path, "target")
    assert caught.value.field == "target" and str(path) in str(caught.value) and problem in str(caught.value)
    assert "\n" not in str(caught.value)


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


def test_a_sharded_folder_is_checked_against_its_index(tmp_path: Path) -> None:
    """transformers opens every file the index names and SGLang loads only those: a file it names that is not there
    (eval fails), or a shard it leaves out (SGLang loads without its tensors), is refused; where it says a tensor
    is, neither reads. transformers also reads the index's `metadata` object: an index without one fails in eval."""
    folder = tmp_path / "drafter"
    folder.mkdir()
    state = tiny_state_dict()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, held in shards.items():
        save_file({name: state[name] for name in held}, str(folder / file))
    (folder / "config.json").write_text(TINY_DRAFTER_CONFIG.read_text())
    index = folder / "model.safetensors.index.json"
    swapped = {name: file for file, held in reversed(shards.items()) for name in held[:1]}
    whole = {**{n: f for f, held in shards.items() for n in held}, **swapped}
    index.write_text(json.dumps({"metadata": {}, "weight_map": whole}))
    resolve_drafter(str(folder), PROFILE, TARGET, tmp_path / "store")
    for written, said in (
            ({"metadata": {}, "weight_map": {names[0]: "model-00003-of-00003.safetensors",
                                             names[1]: "model-00002-of-00002.safetensors"}},
             "model.safetensors.index.json names model-00003-of-00003.safetensors, which is not in the folder"),
            ({"metadata": {}, "weight_map": {names[0]: "model-00001-of-00002.safetensors"}},
             "model-00002-of-00002.safetensors is not in model.safetensors.index.json: loaders skip it"),
            ({"metadata": {}, "weight_map": {names[0]: 7}},
             "model.safetensors.index.json has no weight_map of tensor names to file names"),
            ({"weight_map": whole}, "model.safetensors.index.json has no metadata object"),
            ({"metadata": None, "weight_map": whole}, "model.safetensors.index.json has no metadata object")):
        index.write_text(json.dumps(written))
        with pytest.raises(FieldError) as caught:
            resolve_drafter(str(folder), PROFILE, TARGET, tmp_path / "store")
        assert caught.value.field == "drafter" and said in str(caught.value) and "\n" not in str(caught.value)


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
    elif how == "zeroed":  # reads as well-formed, finite weights: only its hash tells (it scored τ 1.0)
        data = bytearray((folder / "model.safetensors").read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        data[start:] = bytes(len(data) - start)
        (folder / "model.safetensors").write_bytes(bytes(data))
    elif how == "unsealed":
        record = json.loads((folder / RECORD_NAME).read_text())
        del record["weights_sha256"]
        (folder / RECORD_NAME).write_text(json.dumps(record))
    else:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "block_size": 4}))


@pytest.mark.parametrize(("how", "problem"), [
    ("truncated", "truncated"),
    ("nan", "has 1 NaN and 0 Inf values"),
    ("config", "config.json is not the one this conversion writes"),
    ("zeroed", "model.safetensors no longer hashes to the weights_sha256 of dfserve-conversion.json: edited or damaged"),
    ("unsealed", "holds no hash of its weights (converted by an earlier dfserve)"),
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
    if how in ("zeroed", "unsealed"):  # named as a folder, it would claim its checkpoint's identity in eval
        with pytest.raises(FieldError, match=f"drafter: {folder}: .*{re.escape(problem)}.*; remove it to convert again"):
            resolve_drafter(str(folder), PROFILE, TARGET, store, TINY_DRAFTER_CONFIG)


def test_a_pipe_where_weights_should_be_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO named model.safetensors made `eval run` wait forever, reading its header or hashing it."""
    from dfserve.deploy.assets import read_safetensors_header
    from dfserve.deploy.hashes import file_sha256

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(FieldError, match=r"model\.safetensors is not a safetensors file \(OSError: .*not a regular"):
        read_safetensors_header(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        file_sha256(fifo)
