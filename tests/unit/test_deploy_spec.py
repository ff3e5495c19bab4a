"""Profiles, target and drafter resolution, and the one spec's renderings: pure logic, no servers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dfserve.baselines import BaselineRegistry, entry
from dfserve.deploy.assets import (
    _tensor_info,
    drafter_layer_types,
    expected_tensors,
    read_json,
    sliding_window,
    verify_drafter_config,
)
from dfserve.deploy.cli import deploy
from dfserve.deploy.drafters import hf_cached_file, resolve_drafter, resolve_target
from dfserve.deploy.engines.sglang import server_args
from dfserve.deploy.engines.sim import sim_argv
from dfserve.deploy.profiles import load_profile, profile_names
from dfserve.deploy.spec import build_spec
from dfserve.errors import FieldError, UserError, command_flags
from tests.fixtures.deploy.synth import TINY_TARGET, tiny_config

PROFILE = load_profile("pro6000")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def zlab_spec(**kwargs):  # type: ignore[no-untyped-def]
    target = resolve_target(None, PROFILE, None)
    drafter = resolve_drafter("zlab", PROFILE, target, Path("unused"))
    return build_spec(PROFILE, target, drafter, engine=kwargs.pop("engine", "sglang"), port=30000, **kwargs)


def test_pro6000_profile_fits_qwen36_with_zlab_drafter() -> None:
    assert "pro6000" in profile_names()
    assert PROFILE.target.model_path == "Qwen/Qwen3.6-27B"
    assert PROFILE.zlab.model_path == "z-lab/Qwen3.6-27B-DFlash"
    assert PROFILE.sglang.tp_size == 1 and PROFILE.sglang.enable_metrics


def test_profile_from_file_and_bad_profiles(tmp_path: Path) -> None:
    with pytest.raises(FieldError, match="neither a known profile") as unknown:
        load_profile("h100x8")
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 1\nname: x\n")
    with pytest.raises(FieldError, match=r"bad.yaml: gpu: Field required") as invalid:
        load_profile(str(bad))
    assert unknown.value.field == invalid.value.field == "profile_name"
    assert "--" not in str(unknown.value) + str(invalid.value)


@pytest.mark.parametrize(("env", "message"), [
    ('{"A B": "1"}', r"env: 'A B' is not an environment variable name"),
    ('{"X=Y": "1"}', r"env: 'X=Y' is not an environment variable name"),
    ('{"": "1"}', r"env: '' is not an environment variable name"),
    ('{A: "x\\0y"}', r"'x\\x00y': a NUL character \(\\0\) in a value"),
])
def test_a_profile_whose_environment_no_process_can_be_given_is_refused(tmp_path: Path, env: str, message: str) -> None:
    """A posix_spawn of it raised a traceback; the Kubernetes manifest had an env var with an empty name."""
    text = (Path(__file__).parents[2] / "dfserve/deploy/profiles/pro6000.yaml").read_text()
    profile = tmp_path / "host.yaml"
    profile.write_text(text.split("\nenv:\n")[0] + f"\nenv: {env}\n")
    with pytest.raises(FieldError, match=message) as refused:
        load_profile(str(profile))
    assert refused.value.field == "profile_name"


def test_yaml_whose_aliases_expand_past_a_million_values_is_refused(tmp_path: Path) -> None:
    levels = ["a: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, 8)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    with pytest.raises(FieldError, match=r"bomb\.yaml: more than 1,000,000 values once its aliases are expanded"):
        load_profile(str(bomb))


def test_zlab_tensor_table_matches_the_released_drafter() -> None:
    """z-lab's drafters have 3 + 11 per layer tensors (58 for 5 layers); fc fuses 5 target layers of 5120."""
    target = resolve_target(None, PROFILE, None)
    arch = verify_drafter_config(PROFILE.zlab.config, target)
    table = expected_tensors(arch)
    assert len(table) == 58
    assert table["fc.weight"] == (5120, 5 * 5120)
    assert table["layers.4.self_attn.q_proj.weight"] == (32 * 128, 5120)
    assert table["layers.0.self_attn.k_proj.weight"] == (8 * 128, 5120)
    assert table["layers.2.mlp.down_proj.weight"] == (5120, 17408)


def test_target_from_profile_facts_local_folder_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    facts = resolve_target(None, PROFILE, None)
    assert facts.config_source.startswith("profile pro6000") and facts.num_hidden_layers == 64
    for empty in ("", "  "):  # taken for the profile's target, without a word
        with pytest.raises(FieldError, match=r"^target: empty: give a local model folder"):
            resolve_target(empty, PROFILE, None)
    local = resolve_target(str(TINY_TARGET), PROFILE, None)
    assert local.hidden_size == 64 and local.model_path == str(TINY_TARGET.resolve())
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3.6-27B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((TINY_TARGET / "config.json").read_text())
    (tmp_path / "hub" / "models--Qwen--Qwen3.6-27B" / "refs").mkdir()
    (tmp_path / "hub" / "models--Qwen--Qwen3.6-27B" / "refs" / "main").write_text("abc123")
    assert hf_cached_file("Qwen/Qwen3.6-27B", "config.json") == snapshot / "config.json"
    cached = resolve_target(None, PROFILE, None)
    assert cached.config_source == str(snapshot / "config.json") and cached.hidden_size == 64


def test_missing_or_wrong_target_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"has no config\.json"):
        resolve_target(str(tmp_path / "empty"), PROFILE, None)
    with pytest.raises(UserError, match=r"no config\.json for Qwen/Qwen3-8B"):
        resolve_target("Qwen/Qwen3-8B", PROFILE, None)
    with pytest.raises(UserError, match="is not a model folder"):
        resolve_target(str(tmp_path / "nowhere"), PROFILE, None)
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 9}))
    with pytest.raises(UserError, match=r"model_type 'llama' is not one of"):
        resolve_target(None, PROFILE, llama)


def test_library_errors_name_the_field_and_the_cli_names_its_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dfserve.cli import main

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    target = resolve_target(str(TINY_TARGET), PROFILE, None)
    with pytest.raises(FieldError) as info:
        resolve_drafter(str(tmp_path / "nope.pt"), PROFILE, target, tmp_path / "store")
    assert info.value.field == "drafter" and str(info.value).startswith("drafter: ")
    with pytest.raises(FieldError, match=r"^target: no config\.json for Qwen/Qwen3-8B: .*; pass target_config FILE$"):
        resolve_target("Qwen/Qwen3-8B", PROFILE, None)
    cases = [
        (["--drafter", str(tmp_path / "nope.pt")], f"dfserve: error: --drafter: {tmp_path / 'nope.pt'} does not exist (nor is it 'zlab', 'baseline' or sim:PROFILE)"),
        (["--drafter", "zlab", "--target", "Qwen/Qwen3-8B"], "; pass --target-config FILE"),
        (["--drafter", "zlab", "--target-config", str(tmp_path / "none.json")], f"--target-config: {tmp_path / 'none.json'} not found"),
    ]
    for args, expected in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["deploy", *args, "--dry-run"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and expected in err and err.count("\n") == 1, err


def test_drafter_config_mismatches_are_all_named() -> None:
    target = resolve_target(str(TINY_TARGET), PROFILE, None)
    config = tiny_config()
    config["hidden_size"] = 32
    config["num_target_layers"] = 64
    config["dflash_config"] = {"mask_token_id": 9999, "target_layer_ids": [1, 12]}
    config["layer_types"] = ["full_attention"]
    with pytest.raises(UserError) as info:
        verify_drafter_config(config, target)
    message = str(info.value)
    for part in ("hidden_size 32 does not match the target's 64", "num_target_layers 64 does not match the target's 8",
                 "target_layer_ids [12] outside", "mask_token_id must be a token id below 512",
                 "layer_types must list one type per layer (2)"):
        assert part in message


@pytest.mark.parametrize(("change", "said"), [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 0}, "sliding_window of 1 token"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": True}, "sliding_window of 1 token"),
    # transformers' Qwen3Config, read by z-lab's code and SGLang, drops the window without use_sliding_window:
    # z-lab's code then runs those layers unwindowed, and SGLang refuses to start
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": False},
     "sliding_attention layers without use_sliding_window: true get no window"),
    # transformers 5 refuses anything but a bool here; the string "false" was read as a window
    ({"use_sliding_window": "false"}, "use_sliding_window must be true or false, got 'false'"),
    ({"max_window_layers": "1"}, "max_window_layers must be an integer, got '1'"),
    # without layer_types transformers makes layers from max_window_layers on sliding, windowed or not
    ({"layer_types": None, "max_window_layers": 1, "sliding_window": 0}, "sliding_window of 1 token"),
    ({"num_key_value_heads": 3}, "is not a multiple of num_key_value_heads 3"),
    ({"num_hidden_layers": 10**7}, "num_hidden_layers must be at most 1024"),
    ({"dflash_config": {"block_size": 100000, "mask_token_id": 1, "target_layer_ids": [1]}},
     "block_size must be an integer from 2 to 1024"),
])
def test_a_drafter_config_no_model_can_be_built_from_is_refused_before_anything_is_allocated(
        change: dict[str, object], said: str) -> None:
    """Each of these loaded, then failed in the first forward (or allocated terabytes), or scored every key masked."""
    target = resolve_target(str(TINY_TARGET), PROFILE, None)
    with pytest.raises(UserError, match=said):
        verify_drafter_config({**tiny_config(), **change}, target)


def test_a_drafter_config_is_read_as_transformers_reads_it() -> None:
    """Without `head_dim` a qwen3 config has transformers' 128 (not hidden_size / heads), as z-lab's code and SGLang
    build it: the tensors then do not fit, and say so; without `sliding_window` the window is transformers' 4096."""
    target = resolve_target(str(TINY_TARGET), PROFILE, None)
    config = {k: v for k, v in tiny_config().items() if k not in ("head_dim", "sliding_window")}
    assert verify_drafter_config(config, target).head_dim == 128
    assert sliding_window(config) == 4096 and sliding_window({**config, "use_sliding_window": False}) is None
    assert sliding_window({**config, "use_sliding_window": 1}) is None
    assert verify_drafter_config({**config, "model_type": "llama"}, target).head_dim == 64 // 4


@pytest.mark.parametrize("use_sliding_window", [True, False])
@pytest.mark.parametrize("max_window_layers", [0, 1, 3, -1, None])
@pytest.mark.parametrize("window", [16, None, "unset"])
def test_layer_types_are_those_transformers_builds(use_sliding_window: bool, max_window_layers: int | None,
                                                   window: int | str | None) -> None:
    """Without `layer_types`, `Qwen3Config` derives them; deploy checks and eval describes the layers it builds."""
    from transformers import Qwen3Config

    config: dict[str, object] = {"num_hidden_layers": 3, "use_sliding_window": use_sliding_window}
    if max_window_layers is not None:
        config["max_window_layers"] = max_window_layers
    if window != "unset":
        config["sliding_window"] = window
    assert drafter_layer_types(config, 3) == Qwen3Config(**config).layer_types
    given = ["full_attention", "sliding_attention", "full_attention"]
    built = Qwen3Config(**config, layer_types=given).layer_types
    assert drafter_layer_types({**config, "layer_types": given}, 3) == built == given


def test_a_safetensors_tensor_whose_bytes_do_not_fit_its_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"w: data_offsets span 7 bytes, its BF16 shape \[2, 2\] needs 8"):
        _tensor_info("w", {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 7]}, 0)
    assert _tensor_info("w", {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]}, 100).data_offsets == (108, 116)


def test_zlab_drafter_does_not_fit_a_different_target() -> None:
    target = resolve_target(str(TINY_TARGET), PROFILE, None)
    with pytest.raises(UserError, match="hidden_size 5120 does not match the target's 64"):
        resolve_drafter("zlab", PROFILE, target, Path("unused"))


def test_spec_renders_dflash_argv_from_profile_and_flags() -> None:
    argv = server_args(zlab_spec())
    assert flag(argv, "--speculative-algorithm") == "DFLASH"
    assert flag(argv, "--speculative-draft-model-path") == "z-lab/Qwen3.6-27B-DFlash"
    assert flag(argv, "--speculative-dflash-block-size") == "16"
    assert flag(argv, "--max-running-requests") == "32"
    assert flag(argv, "--served-model-name") == "qwen3.6-27b-dflash-zlab"
    assert "--enable-metrics" in argv
    tuned_spec = zlab_spec(overrides={"max_running_requests": 8, "context_length": None}, sglang_args=["--log-level=debug"])
    assert tuned_spec.overrides == {"max_running_requests": 8}
    tuned = server_args(tuned_spec)
    assert flag(tuned, "--max-running-requests") == "8"
    assert flag(tuned, "--context-length") == "65536"
    assert tuned[-1] == "--log-level=debug"


def test_spec_refuses_conflicting_and_invalid_flags() -> None:
    with pytest.raises(FieldError, match=r"^sglang_args: --tp-size: set by the deployment spec"):
        zlab_spec(sglang_args=["--tp-size=2"])
    with pytest.raises(FieldError, match=r"^mem_fraction_static: Input should be less than 1") as fraction:
        zlab_spec(overrides={"mem_fraction_static": 1.5})
    assert fraction.value.render(command_flags(deploy)).startswith("--mem-fraction-static: Input should be")
    with pytest.raises(FieldError, match=r"^draft_attention_backend: "):
        zlab_spec(overrides={"draft_attention_backend": "trtllm_mha"})
    with pytest.raises(FieldError, match=r"^name: 'Bad_Name' must be lowercase"):
        zlab_spec(name="Bad_Name")
    with pytest.raises(FieldError, match=r"^name: '1zlab' must be .*start with a letter"):
        zlab_spec(name="1zlab")  # a Service name is a DNS-1035 label


@pytest.mark.parametrize(("args", "said"), [
    (["--model=evil/model"], "--model: SGLang's alias of --model-path"),
    (["--speculative-draft-model", "evil/drafter"], "--speculative-draft-model: SGLang's alias of --speculative-draft-model-path"),
    (["--mem-fraction=0.99"], "--mem-fraction: SGLang expands a prefix to the flag it begins: --mem-fraction-static"),
    (["--log-level=debug", "--max-running", "4"], "--max-running: SGLang expands a prefix to the flag it begins: --max-running-requests"),
    (["--speculative-draft-mod=x"], "--speculative-draft-model-path, set by the deployment spec"),
])
def test_passthrough_refuses_what_sglang_reads_as_a_spec_flag(args: list[str], said: str) -> None:
    """SGLang's parser has aliases and allow_abbrev: these reach fields the spec sets as surely as the flags."""
    with pytest.raises(FieldError) as caught:
        zlab_spec(sglang_args=args)
    assert caught.value.field == "sglang_args" and said in str(caught.value)
    assert zlab_spec(sglang_args=["--enable-metrics-for-all-schedulers"]).extra_sglang_args  # longer, not a prefix


@pytest.mark.parametrize(("args", "expected"), [
    (["--drafter-config", "/nonexistent.json", "--out", "somewhere", "--model-cache", "/nowhere", "--sim-profile", "inhouse"],
     "--out: only with --emit k8s"),
    (["--model-cache", "/nowhere"], "--model-cache: only with --emit k8s"),
    (["--node-selector", "pool=gpu"], "--node-selector: only with --emit k8s"),
    (["--sim-profile", "inhouse"], "--sim-profile: only with a simulated engine (--engine sim)"),
    (["--engine", "sim", "--sim-profile", "nope", "--dry-run"],
     "--sim-profile: 'nope' is neither one of zlab, inhouse, none nor a .json file"),
    (["--seed", "3"], "--seed: only with a simulated engine (--engine sim)"),
    (["--drafter-config", "/nonexistent.json"], "--drafter-config: only with a checkpoint --drafter (the config it is converted with), not zlab"),
    (["--registry", "runs"], "--registry: only with --drafter baseline"),
    (["--emit", "k8s", "--host", "0.0.0.0"], "--host: not with --emit k8s"),
    (["--emit", "k8s", "--health-timeout", "1e300"], "--health-timeout: must be a finite number of seconds > 0, at most 86400"),
    (["--emit", "k8s", "--name", "1zlab"], "--name: '1zlab' must be"),
    (["--emit", "k8s", "--namespace", "Bad NS_!"], "--namespace: 'Bad NS_!' is not a namespace name"),
    (["--emit", "k8s", "--image", ""], "--image: '' is not an image reference"),
    (["--emit", "k8s", "--image", "UPPER/Case:tag"], "--image: 'UPPER/Case:tag' is not an image reference ("),
    (["--emit", "k8s", "--node-selector", "a=1", "--node-selector", "a=2"], "--node-selector: 'a' given twice ('1' and '2')"),
    (["--emit", "k8s", "--node-selector", "bad key=value"], "--node-selector: 'bad key' is not a label key"),
    (["--emit", "k8s", "--node-selector", "example.com/pool=va lue/"], "--node-selector: example.com/pool='va lue/': not a label value"),
])
def test_deploy_refuses_flags_without_effect_and_values_kubernetes_refuses(
    args: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dfserve.cli import main

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("DFSERVE_DEPLOY_ROOT", str(tmp_path / "root"))
    with pytest.raises(SystemExit) as exit_info:
        main(["deploy", "--drafter", "zlab", *args, "--dry-run"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "", captured.out
    assert captured.err.count("\n") == 1 and expected in captured.err, captured.err


def test_sim_argv_carries_the_same_deployment() -> None:
    spec = zlab_spec(engine="sim", time_scale=0.05, seed=3)
    assert spec.name == "pro6000-zlab-sim"
    argv = sim_argv(spec, python="py")
    assert argv[:4] == ["py", "-m", "dfserve", "sim"]
    assert flag(argv, "--profile") == "zlab"
    assert flag(argv, "--draft-model-path") == "z-lab/Qwen3.6-27B-DFlash"
    assert flag(argv, "--served-model-name") == spec.served_model_name
    assert flag(argv, "--block-size") == "16" and flag(argv, "--time-scale") == "0.05"
    assert flag(argv, "--context-length") == "65536"  # the profile's, as SGLang with it would serve


@pytest.mark.parametrize(("flags", "error"), [
    (["--served-model-name", "{drafter.x}"], "--served-model-name: '{drafter.x}': only {drafter} may stand in "
                                             "braces, not {drafter.x}"),
    (["--served-model-name", "{drafter!r}"], "not {drafter!r}"),
    (["--served-model-name", "{drafter:>9}"], "not {drafter:>9}"),
    (["--served-model-name", "{drafter"], "only {drafter} may stand in braces (expected '}' before end of string)"),
    (["--max-running-requests", "99999999999999999999"], "--max-running-requests: Input should be less than or "
                                                         "equal to 2147483647"),
])
def test_a_setting_no_engine_could_take_is_one_line_naming_its_flag(flags: list[str], error: str) -> None:
    refused = CliRunner().invoke(deploy, ["--drafter", "zlab", "--dry-run", *flags], standalone_mode=False)
    assert isinstance(refused.exception, UserError) and error in str(refused.exception)


def test_a_negative_grace_is_refused_before_any_stop(tmp_path: Path) -> None:
    refused = CliRunner().invoke(deploy, ["stop", "pro6000-zlab", "--root", str(tmp_path), "--grace", "-1"])
    assert refused.exit_code == 2 and "'--grace': -1.0 is not in the range x>=0" in refused.output


def test_a_served_model_name_template_keeps_literal_braces() -> None:
    shown = CliRunner().invoke(deploy, ["--drafter", "zlab", "--dry-run", "--served-model-name", "{{x}}-{drafter}"])
    assert shown.exit_code == 0 and "--served-model-name '{x}-" in shown.output


def test_zlab_dry_run_never_imports_torch() -> None:
    code = (
        "import sys\nfrom dfserve.cli import main\n"
        "try:\n    main(['deploy', '--drafter', 'zlab', '--dry-run'])\nexcept SystemExit as exc:\n    assert not exc.code\n"
        "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_baseline_resolves_from_registry(tmp_path: Path) -> None:
    target = resolve_target(None, PROFILE, None)
    with pytest.raises(UserError, match=r"no baseline for Qwen/Qwen3\.6-27B"):
        resolve_drafter("baseline", PROFILE, target, tmp_path / "store", registry=tmp_path / "runs")
    BaselineRegistry(tmp_path / "runs").append(entry("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash", "run-1", "zlab"))
    assert resolve_drafter("baseline", PROFILE, target, tmp_path / "store", registry=tmp_path / "runs").label == "zlab"
    BaselineRegistry(tmp_path / "runs").append(entry("Qwen/Qwen3.6-27B", "/gone/inhouse", "run-2", "inhouse"))
    with pytest.raises(UserError, match="not on this machine"):
        resolve_drafter("baseline", PROFILE, target, tmp_path / "store", registry=tmp_path / "runs")


def test_a_simulated_drafter_runs_only_on_the_simulator_under_a_simulated_identity() -> None:
    from dfserve.deploy.drafters import simulated_drafter

    drafter = simulated_drafter("inhouse")
    assert (drafter.kind, drafter.label, drafter.model_path, drafter.sim_profile) == (
        "simulated", "sim-inhouse", "dfserve-sim/inhouse", "inhouse")
    with pytest.raises(UserError, match="no drafter"):
        simulated_drafter("none")
    with pytest.raises(UserError, match="drafter: sim:nope"):
        simulated_drafter("nope")
    target = resolve_target(None, PROFILE, None)
    with pytest.raises(FieldError, match=r"^drafter: sim:inhouse: exists only as a simulator profile, so it runs only on a simulated engine, not engine sglang$"):
        build_spec(PROFILE, target, drafter, engine="sglang", port=30000)
    spec = build_spec(PROFILE, target, drafter, engine="sim", port=30000)
    assert flag(sim_argv(spec), "--draft-model-path") == "dfserve-sim/inhouse"
    assert flag(sim_argv(spec), "--profile") == "inhouse"


@pytest.mark.parametrize(("data", "said"), [(b"[" * 100_000, "nested too deeply"), (b'{"a": ' + b"9" * 5000 + b"}", "4300")])
def test_a_json_file_python_cannot_parse_is_a_field_error(tmp_path: Path, data: bytes, said: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(data)
    with pytest.raises(FieldError) as caught:
        read_json(path, "drafter")
    assert caught.value.field == "drafter" and said in str(caught.value)


@pytest.mark.parametrize("command", ["status", "stop"])
@pytest.mark.parametrize("name", ["../../etc", "", "Upper"])
def test_status_and_stop_refuse_what_is_no_deployment_name(command: str, name: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`status ../../etc` looked for a deployment two folders above the deploy root."""
    from dfserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["deploy", command, name, "--root", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"dfserve: error: name: {name!r} must be lowercase letters, digits and '-', "
                                       "start with a letter, end with a letter or digit, at most 63 characters (it "
                                       "names the Kubernetes Deployment and Service)\n")


def test_a_default_name_that_is_no_deployment_name_blames_the_profile(tmp_path: Path) -> None:
    """It blamed --name, which the user never gave."""
    text = (Path(__file__).parents[2] / "dfserve/deploy/profiles/pro6000.yaml").read_text()
    digits = tmp_path / "host.yaml"
    digits.write_text(re.sub(r"(?m)^name: .*$", 'name: "6000"', text))
    profile = load_profile(str(digits))
    target = resolve_target(None, profile, None)
    drafter = resolve_drafter("zlab", profile, target, Path("unused"))
    with pytest.raises(FieldError, match=r"the name made of profile '6000' and the drafter, '6000-zlab', is no "
                                         r"deployment name; give one with name$") as caught:
        build_spec(profile, target, drafter, engine="sglang", port=30000)
    assert caught.value.field == "name"


def test_a_drafter_config_that_does_not_fit_names_its_flag_and_file(tmp_path: Path) -> None:
    """It said `drafter config: 1 problem(s): ...`, naming neither."""
    target = resolve_target(str(TINY_TARGET), PROFILE, None)
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({**tiny_config(), "architectures": ["LlamaForCausalLM"]}))
    checkpoint = tmp_path / "step.pt"
    checkpoint.write_bytes(b"never read: the config is checked first")
    with pytest.raises(FieldError) as caught:
        resolve_drafter(str(checkpoint), PROFILE, target, tmp_path / "store", llama)
    assert caught.value.field == "drafter_config"
    assert caught.value.message == (f"drafter config {llama}: 1 problem(s): architectures must include "
                                    "'DFlashDraftModel', got ['LlamaForCausalLM']")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(llama.read_text())
    with pytest.raises(FieldError, match=rf"^drafter: drafter config {folder}/config\.json: 1 problem") as caught:
        resolve_drafter(str(folder), PROFILE, target, tmp_path / "store")
