"""LoRA through peft: only the adapters train and are checkpointed, a resume continues bit
for bit, ``export --adapter`` writes what ``peft.PeftModel.from_pretrained`` loads onto the
exported base, ``export --merge`` gives the same logits; the reference transformer and an
HF Llama started from a local ``pretrained`` directory; bad input exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from distributed_worker import base_config
from forked import Forked

from speedtronic.config import SpeedtronicConfig, load_config
from speedtronic.models.adapters import FINGERPRINT
from speedtronic.models.export import export_model
from speedtronic.models.registry import build_model
from speedtronic.runtime import checkpoint_model, train_from_config
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.rng import seed_everything
from tests.cli_runner import run_cli
from tests.hf_helpers import LLAMA, logits
from tests.lora_rank_worker import fit_rank
from tests.test_distributed import free_port, rank_env

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]}
IDS = torch.tensor([[3, 9, 1, 17, 5, 2, 40, 11]])


def write_config(tmp_path: Path, model: dict[str, object], name: str = "run") -> Path:
    config = {
        "run": {"device": "cpu", "max_steps": 6, "output_dir": str(tmp_path / name)},
        "model": {"vocab_size": 64, "max_seq_len": 16, "adapters": {"lora": LORA}, **model},
        "data": {"synthetic_kind": "learnable", "num_tokens": 256, "micro_batch_size": 4},
        "optimizer": {"name": "adamw", "lr": 1e-2},
        "scheduler": {"warmup_steps": 0},
        "logging": {"console": False, "jsonl": False},
        "checkpoint": {"every_steps": 3, "keep_last": None},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def fit(config: Path, *extra: str) -> None:
    result = run_cli("fit", "--config", str(config), *extra, cwd=config.parent)
    assert result.returncode == 0, result.stderr


def latest_weights(config: Path) -> dict[str, torch.Tensor]:
    directory = config.parent / config.stem / "checkpoints"
    loaded = CheckpointManager(directory, enabled=False).load_latest_checkpoint()
    assert loaded is not None
    weights = loaded.state["model"]
    assert isinstance(weights, dict)
    return weights


REFERENCE = {"n_layer": 2, "n_head": 2, "d_model": 16}


def plain_model(cfg: SpeedtronicConfig) -> torch.nn.Module:
    """The run's model without adapters, seeded as the run seeds it: its frozen base."""
    seed_everything(cfg.run.seed)
    cfg.model.adapters = None
    return build_model(cfg.model)


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp_path = tmp_path_factory.mktemp("lora_reference")
    straight = write_config(tmp_path, REFERENCE, "straight")
    fit(straight)
    resumed = write_config(tmp_path, REFERENCE, "resumed")
    fit(resumed, "--max-steps", "3")
    fit(resumed, "--resume")
    return straight, resumed


def test_only_the_adapters_train_and_are_checkpointed(
    reference_runs: tuple[Path, Path],
) -> None:
    straight, _ = reference_runs
    weights = latest_weights(straight)
    assert weights and all("lora_" in key or key == FINGERPRINT for key in weights)
    assert {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in weights if "lora_" in key} == {
        "q_proj",
        "v_proj",
        "down_proj",
    }
    # The adapters moved (B starts at zero), the base did not.
    assert any(
        key.endswith("lora_B.default.weight") and w.abs().sum() > 0 for key, w in weights.items()
    )
    cfg = load_config(straight)
    _, trained = checkpoint_model(cfg)
    seed_everything(cfg.run.seed)
    base = plain_model(cfg)
    base_state = base.state_dict()
    for name, param in trained.named_parameters():
        if not param.requires_grad:
            plain = name.replace(".base_layer", "")
            assert torch.equal(param, base_state[plain]), name


def test_a_resumed_lora_run_equals_the_straight_one_bit_for_bit(
    reference_runs: tuple[Path, Path],
) -> None:
    straight, resumed = (latest_weights(config) for config in reference_runs)
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def test_reference_adapter_loads_in_peft_and_merge_gives_the_same_logits(
    reference_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    import peft

    config, _ = reference_runs
    cfg = load_config(config)
    _, adapted = checkpoint_model(cfg)
    expected = logits(adapted, IDS)
    for flag, out in (("--adapter", "adapter"), ("--merge", "merged")):
        result = run_cli(
            "export",
            "--config",
            str(config),
            "--output",
            str(tmp_path / out),
            flag,
            cwd=config.parent,
        )
        assert result.returncode == 0, result.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    torch.testing.assert_close(logits(merged, IDS), expected, rtol=1e-5, atol=1e-5)
    # The base the adapters were trained on, exported as Llama, plus the adapter directory.
    export_model(plain_model(cfg), tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    torch.testing.assert_close(logits(with_adapter, IDS), expected, rtol=1e-5, atol=1e-5)


def test_two_ddp_ranks_train_the_adapters_as_one_process(tmp_path: Path, forked: Forked) -> None:
    adapters = {"adapters": {"lora": LORA}}
    # 2 ranks x micro-batch 2 x K=2 is one process's 4 x K=2 (target_batch_size is per rank).
    single = base_config(
        tmp_path / "single", model=adapters, data={"micro_batch_size": 4, "target_batch_size": 8}
    )
    ddp = base_config(tmp_path / "ddp", model=adapters)
    paths = []
    for name, config in (("single", single), ("ddp", ddp)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        paths.append(path)
    train_from_config(paths[0])
    port = free_port()
    children = [
        forked.start(fit_rank, str(paths[1]), env=rank_env(rank, 2, port), cwd=tmp_path)
        for rank in (0, 1)
    ]
    assert [child.wait(timeout=180) for child in children] == [0, 0], children[0].output
    alone, ranks = latest_weights(paths[0]), latest_weights(paths[1])
    assert ranks.keys() == alone.keys()
    assert all("lora_" in key or key == FINGERPRINT for key in ranks)
    for key in ranks:
        torch.testing.assert_close(ranks[key], alone[key], rtol=1e-4, atol=1e-5)


def test_bad_targets_and_another_base_exit_2(
    reference_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    config, _ = reference_runs
    bad = run_cli(
        "validate",
        "--config",
        str(config),
        "--set",
        'model.adapters.lora.targets=["qkv"]',
        cwd=config.parent,
    )
    assert bad.returncode == 2
    assert (
        "model.adapters.lora.targets: qkv matches no module; the model's Linear modules "
        "are: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in bad.stderr
    )
    other_base = run_cli(
        "fit",
        "--config",
        str(config),
        "--resume",
        "--max-steps",
        "9",
        "--set",
        "run.seed=7",
        cwd=config.parent,
    )
    assert other_base.returncode == 2
    assert "trained on other base weights" in other_base.stderr
    plain = run_cli(
        "export", "--config", str(config), "--output", str(tmp_path / "x"), cwd=config.parent
    )
    assert plain.returncode == 2 and "export them with --adapter" in plain.stderr


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pretrained") / "llama"
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        **{k: v for k, v in LLAMA.items() if k != "model_type"}, vocab_size=64
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


def test_hf_llama_from_pretrained_with_lora_exports_for_peft(
    pretrained: Path, tmp_path: Path
) -> None:
    import peft

    model = {"name": "hf_causal_lm", "options": {"pretrained": str(pretrained)}}
    config = write_config(tmp_path, model)
    fit(config)
    weights = latest_weights(config)
    assert all("lora_" in key or key == FINGERPRINT for key in weights)
    _, adapted = checkpoint_model(load_config(config))
    expected = logits(adapted, IDS)
    result = run_cli(
        "export",
        "--config",
        str(config),
        "--output",
        str(tmp_path / "adapter"),
        "--adapter",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    base = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained))
    with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    torch.testing.assert_close(logits(with_adapter, IDS), expected, rtol=1e-5, atol=1e-5)
    # Fine-tuning moved the model away from the pretrained weights (peft adapted ``base``
    # in place: a fresh copy is the pretrained model).
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained))
    assert not torch.allclose(logits(fresh, IDS), expected)


def test_a_pretrained_directory_that_does_not_fit_exits_2(pretrained: Path, tmp_path: Path) -> None:
    model = {"name": "hf_causal_lm", "vocab_size": 96, "options": {"pretrained": str(pretrained)}}
    config = write_config(tmp_path, model)
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "model.vocab_size: 96" in result.stderr and "Traceback" not in result.stderr


def test_pretrained_weights_of_other_shapes_exit_2_naming_the_option(
    pretrained: Path, tmp_path: Path
) -> None:
    """The config fits ``model:`` but the weights file holds another MLP width."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(pretrained, other)
    narrow = transformers.LlamaConfig(
        **{k: v for k, v in LLAMA.items() if k not in ("model_type", "intermediate_size")},
        intermediate_size=40,
        vocab_size=64,
    )
    transformers.LlamaForCausalLM(narrow).save_pretrained(str(tmp_path / "narrow"))
    shutil.copy(tmp_path / "narrow" / "model.safetensors", other / "model.safetensors")
    config = write_config(tmp_path, {"name": "hf_causal_lm", "options": {"pretrained": str(other)}})
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"model.options.pretrained: the weights in {other} do not fit the model" in (
        result.stderr
    )
    assert "shape: model.layers.0.mlp.down_proj.weight (32, 40) vs (32, 48)" in result.stderr
