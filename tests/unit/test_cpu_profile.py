"""The `cpu` host profile (SGLang's CPU engine): the flags it renders, and what it leaves to the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfserve.deploy.drafters import Drafter, resolve_drafter, resolve_target
from dfserve.deploy.engines.sglang import server_args
from dfserve.deploy.profiles import load_profile
from dfserve.deploy.spec import build_spec
from dfserve.errors import FieldError

CPU = load_profile("cpu")
TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096}
DRAFTER = Drafter("tiny", "folder", "/models/tiny", 8, None, "/models/tiny", "inhouse")


def target_folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    return tmp_path


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_cpu_profile_renders_sglangs_cpu_engine_flags_and_environment(tmp_path: Path) -> None:
    target = resolve_target(str(target_folder(tmp_path)), CPU, None)
    spec = build_spec(CPU, target, DRAFTER, engine="sglang", port=30001)
    argv = server_args(spec)
    assert (flag(argv, "--device"), flag(argv, "--dtype"), flag(argv, "--grammar-backend")) == ("cpu", "bfloat16", "none")
    assert flag(argv, "--attention-backend") == flag(argv, "--speculative-draft-attention-backend") == "torch_native"
    assert flag(argv, "--max-total-tokens") == "16384"
    assert "--disable-overlap-schedule" in argv and "--disable-cuda-graph" in argv
    assert spec.env["SGLANG_USE_CPU_ENGINE"] == "1" and spec.env["OMP_NUM_THREADS"] == "1"
    gpu = load_profile("pro6000")
    gpu_argv = server_args(build_spec(gpu, resolve_target(None, gpu, None), DRAFTER, engine="sglang", port=30001))
    assert not {"--device", "--dtype", "--max-total-tokens", "--disable-overlap-schedule"} & set(gpu_argv)


def test_the_cpu_profile_names_no_target_or_zlab_drafter_and_its_flags_are_not_passed_through(tmp_path: Path) -> None:
    with pytest.raises(FieldError, match="profile cpu names no target") as missing:
        resolve_target(None, CPU, None)
    assert missing.value.field == "target"
    target = resolve_target(str(target_folder(tmp_path)), CPU, None)
    with pytest.raises(FieldError, match="names no z-lab drafter"):
        resolve_drafter("zlab", CPU, target, tmp_path / "store")
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"")
    with pytest.raises(FieldError, match="no z-lab config") as no_config:
        resolve_drafter(str(checkpoint), CPU, target, tmp_path / "store")
    assert no_config.value.field == "drafter_config"
    with pytest.raises(FieldError, match="--device: set by the deployment spec") as passed_through:
        build_spec(CPU, target, DRAFTER, engine="sglang", port=30001, sglang_args=["--device=cuda"])
    assert passed_through.value.field == "sglang_args"
