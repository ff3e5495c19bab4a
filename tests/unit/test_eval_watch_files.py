"""The watch's reads of a checkpoint folder and its staging: layouts trainers write, loads that fail on a cut file,
steps stored in checkpoints, and staging that never writes on the checkpoint side."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dfserve.errors import FieldError
from dfserve.eval.watch_files import Gone, Incomplete, StageMode, probe, scan, stage


def _tree(folder: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    (root / "step_100").mkdir(parents=True)
    torch.save({"step": 100, "model": {"w": torch.ones(3)}}, root / "step_100" / "checkpoint.pt")
    torch.save({"global_step": 7, "model": {"w": torch.ones(3)}}, root / "latest.pt")
    save_file({"w": torch.ones(2)}, str(root / "drafter_step200.safetensors"), metadata={"step": "200"})
    hf = root / "checkpoint-300"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(hf / "model.safetensors"))
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 300}))
    (root / "step_400.pt.tmp").write_bytes(b"half")
    (root / ".step_500.pt").write_bytes(b"hidden")
    (root / "tmp-600").mkdir()
    (root / "tmp-600" / "checkpoint.pt").write_bytes(b"staging")
    (root / "notes.txt").write_text("not weights")
    (root / "step_800").mkdir()  # a trainer's own config beside its torch checkpoint: no Hugging Face folder
    (root / "step_800" / "config.json").write_text("{}")
    torch.save({"step": 800, "model": {"w": torch.ones(3)}}, root / "step_800" / "checkpoint.pt")
    torch.save({"global_step": 900, "state_dict": {"model.w": torch.ones(3)}}, root / "epoch=2-step=900.ckpt")
    for state in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "training_args.bin", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"state": {}}, root / "step_100" / state)  # a trainer's own state beside its weights
    return root


def test_scan_finds_each_layout_once_and_never_a_temporary_name(checkpoints: Path) -> None:
    seen = {s.key: s for s in scan(checkpoints)}
    assert sorted(seen) == ["checkpoint-300", "drafter_step200.safetensors", "epoch=2-step=900.ckpt", "latest.pt",
                            "step_100/checkpoint.pt", "step_800/checkpoint.pt"]
    folder = seen["checkpoint-300"]
    assert folder.folder and folder.size == sum(p.stat().st_size for p in (checkpoints / "checkpoint-300").iterdir())


def test_a_link_to_a_checkpoint_elsewhere_is_found_and_one_to_a_checkpoint_here_is_not_found_twice(
        checkpoints: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "ck.pt"
    elsewhere.parent.mkdir()
    torch.save({"step": 700, "model": {"w": torch.ones(3)}}, elsewhere)
    (checkpoints / "step_700.pt").symlink_to(elsewhere)
    (checkpoints / "newest.pt").symlink_to(checkpoints / "latest.pt")
    seen = {s.key: s for s in scan(checkpoints)}
    assert "step_700.pt" in seen and "newest.pt" not in seen
    assert seen["step_700.pt"].size == elsewhere.stat().st_size and probe(checkpoints / "step_700.pt").step == 700


def test_probe_reads_the_step_trainers_store_and_refuses_a_cut_file(checkpoints: Path) -> None:
    assert probe(checkpoints / "latest.pt").step == 7
    assert probe(checkpoints / "step_100" / "checkpoint.pt").step == 100
    assert probe(checkpoints / "drafter_step200.safetensors").step == 200
    assert probe(checkpoints / "checkpoint-300").step == 300
    whole = (checkpoints / "latest.pt").read_bytes()
    cut = checkpoints / "cut.pt"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(FieldError, match=r"cut\.pt does not load"):
        probe(cut)
    cut_safetensors = checkpoints / "cut.safetensors"
    cut_safetensors.write_bytes((checkpoints / "drafter_step200.safetensors").read_bytes()[:-4])
    with pytest.raises(FieldError, match=r"cut\.safetensors does not load"):
        probe(cut_safetensors)


def test_a_trainers_folder_is_probed_by_its_model_weights_alone(checkpoints: Path) -> None:
    """Hugging Face's Trainer saves its RNG state (numpy's, pickled), its arguments (a pickled dataclass) and the
    optimizer beside the model: none loads as weights, and the optimizer is larger than the model."""
    import numpy as np

    hf = checkpoints / "checkpoint-300"
    torch.save({"numpy": np.random.get_state()}, hf / "rng_state.pth")
    torch.save({"args": np.dtype("float32")}, hf / "training_args.bin")
    (hf / "optimizer.pt").write_bytes(b"not even a checkpoint")
    assert probe(hf).step == 300
    (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:-4])
    with pytest.raises(FieldError, match=r"checkpoint-300/model\.safetensors does not load"):
        probe(hf)


def test_staging_links_files_and_folders_and_writes_nothing_on_the_checkpoint_side(
        checkpoints: Path, tmp_path: Path) -> None:
    before = _tree(checkpoints)
    staged = stage(checkpoints / "step_100" / "checkpoint.pt", tmp_path / "watch" / "staged" / "step-100.pt", "link")
    assert staged.samefile(checkpoints / "step_100" / "checkpoint.pt")
    folder = stage(checkpoints / "checkpoint-300", tmp_path / "watch" / "staged" / "step-300", "link")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "trainer_state.json"]
    assert (folder / "model.safetensors").samefile(checkpoints / "checkpoint-300" / "model.safetensors")
    copied = stage(checkpoints / "latest.pt", tmp_path / "watch" / "staged" / "step-7.pt", "copy")
    assert not copied.samefile(checkpoints / "latest.pt") and copied.read_bytes() == (checkpoints / "latest.pt").read_bytes()
    assert stage(checkpoints / "latest.pt", copied, "copy") == copied  # staged once
    assert _tree(checkpoints) == before
    assert [p.name for p in (tmp_path / "watch" / "staged").iterdir() if p.name.startswith(".")] == []


def test_a_staging_cut_short_leaves_nothing_under_the_staged_name(checkpoints: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Another file system half way through a folder (EXDEV): refused in one line, no half-staged folder."""
    real_link, calls = os.link, []

    def link(source: object, target: object) -> None:
        calls.append(source)
        if len(calls) == 2:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_link(source, target)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", link)
    staged = tmp_path / "watch" / "staged" / "step-300"
    with pytest.raises(FieldError, match=r"on another file system than .*checkpoint-300"):
        stage(checkpoints / "checkpoint-300", staged, "link")
    assert not staged.exists()
    monkeypatch.setattr(os, "link", real_link)
    assert stage(checkpoints / "checkpoint-300", staged, "link") == staged  # the next try starts clean
    assert sorted(p.name for p in staged.iterdir()) == ["config.json", "model.safetensors", "trainer_state.json"]


def _replace(path: Path, data: dict[str, torch.Tensor]) -> None:
    """As trainers publish: the whole file beside the old one, renamed over it (a new inode)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(data, tmp)
    tmp.rename(path)


@pytest.mark.parametrize("mode", ["link", "copy"])
def test_a_staged_file_is_staged_again_once_the_trainer_replaced_its_source(
        checkpoints: Path, tmp_path: Path, mode: StageMode) -> None:
    source = checkpoints / "step_100" / "checkpoint.pt"
    staged = stage(source, tmp_path / "watch" / "staged" / "step-100.pt", mode)
    first = staged.stat().st_ino
    assert stage(source, staged, mode).stat().st_ino == first  # unchanged: staged once
    _replace(source, {"step": 100, "model": {"w": torch.full((3,), 2.0)}})
    later = source.stat().st_mtime_ns + 10**9  # a later write, whatever the clock's resolution
    os.utime(source, ns=(later, later))
    assert stage(source, staged, mode) == staged
    now = staged.stat()  # an inode number freed by the old copy may be reused: the new one is told by its source
    assert (now.st_ino == source.stat().st_ino) if mode == "link" else (now.st_mtime_ns == later)
    assert torch.load(staged, weights_only=True)["model"]["w"].tolist() == [2.0, 2.0, 2.0]


def _sharded(folder: Path, shards: int) -> list[Path]:
    """A Hugging Face folder whose weights are split in `shards` files, each of one tensor, and their index."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for i, name in enumerate(names):
        save_file({f"w{i}": torch.ones(2)}, str(folder / name))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {f"w{i}": name for i, name in enumerate(names)}}))
    return [folder / name for name in names] + [index]


def _withhold(*paths: Path) -> dict[Path, bytes]:
    """Files a trainer has not written yet: removed, their bytes kept to write later."""
    kept = {p: p.read_bytes() for p in paths}
    for p in paths:
        p.unlink()
    return kept


def test_a_sharded_folder_is_incomplete_until_its_index_and_every_shard_it_names_are_there(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt" / "checkpoint-40"
    first, second, index = _sharded(folder, 2)
    kept = _withhold(second, index)
    with pytest.raises(Incomplete, match=r"holds the shard model-00001-of-00002\.safetensors but no \*\.index\.json"):
        probe(folder)
    index.write_bytes(kept[index])  # the index first, a shard still to come
    with pytest.raises(Incomplete, match=r"names model-00002-of-00002\.safetensors, not there yet"):
        probe(folder)
    second.write_bytes(kept[second])
    assert probe(folder).step is None and first.exists()
    index.write_text("{}")
    with pytest.raises(FieldError, match="not a shard index") as refused:
        probe(folder)
    assert not isinstance(refused.value, Incomplete)  # a broken index is corrupt, not waited for


def test_a_staged_folder_that_was_staged_short_of_a_shard_is_staged_again_whole(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt" / "checkpoint-40"
    _, second, index = _sharded(folder, 2)
    kept = _withhold(second, index)
    staged = stage(folder, tmp_path / "watch" / "staged" / "step-40", "link")
    assert sorted(p.name for p in staged.iterdir()) == ["config.json", "model-00001-of-00002.safetensors"]
    for path, data in kept.items():
        path.write_bytes(data)
    assert stage(folder, staged, "link") == staged
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert (staged / second.name).samefile(second)


def test_a_checkpoint_removed_before_it_is_read_or_staged_is_gone(checkpoints: Path, tmp_path: Path) -> None:
    source = checkpoints / "latest.pt"
    source.unlink()
    with pytest.raises(Gone, match=r"latest\.pt was removed before it was read"):
        probe(source)
    staged = tmp_path / "watch" / "staged" / "step-7.pt"
    with pytest.raises(Gone, match=r"latest\.pt was removed before it was staged"):
        stage(source, staged, "copy")
    assert list(staged.parent.iterdir()) == []  # no half-staged file left behind
