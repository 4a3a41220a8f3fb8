"""LoRA under FSDP2 on two real gloo ranks: the adapters are sharded like every other
parameter (each rank holds half of each LoRA matrix), only they are checkpointed (a DCP
directory), a resumed run equals the straight one bit for bit, ``export --adapter`` writes
what ``peft.PeftModel.from_pretrained`` loads onto the base, and ``export --merge`` gives the
adapted model's logits -- for the reference transformer and an HF Llama started from a
local ``pretrained`` directory."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
import yaml
from forked import Forked, cli_main

from speedtronic.config import load_config
from speedtronic.models.adapters import FINGERPRINT, lora_state
from speedtronic.models.export import export_model
from speedtronic.models.registry import build_model
from speedtronic.runtime import checkpoint_model
from speedtronic.state import dcp_io
from speedtronic.state.rng import seed_everything
from tests.cli_runner import run_cli
from tests.hf_helpers import LLAMA, logits
from tests.lora_rank_worker import fit_sharded_rank
from tests.rank_env import free_port, rank_env

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]}
IDS = torch.tensor([[3, 9, 1, 17, 5, 2, 40, 11]])
REFERENCE = {"n_layer": 2, "n_head": 2, "d_model": 16}


def write_config(tmp_path: Path, model: dict[str, object], name: str) -> Path:
    config = {
        "run": {"device": "cpu", "max_steps": 6, "output_dir": str(tmp_path / name)},
        "model": {"vocab_size": 64, "max_seq_len": 16, "adapters": {"lora": LORA}, **model},
        "data": {"synthetic_kind": "learnable", "num_tokens": 256, "micro_batch_size": 4},
        "optimizer": {"name": "adamw", "lr": 1e-2},
        "scheduler": {"warmup_steps": 0},
        "logging": {"console": False, "jsonl": False},
        "checkpoint": {"every_steps": 3, "keep_last": None},
        "parallel": {"strategy": "fsdp"},
        "distributed": {"timeout_s": 60.0},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def two_ranks(
    forked: Forked, config: Path, *, max_steps: int | None = None, resume: bool = False
) -> Path:
    report = config.parent / f"{config.stem}-held"
    port = free_port()
    children = [
        forked.start(
            fit_sharded_rank,
            str(config),
            str(report),
            max_steps,
            resume,
            env=rank_env(rank, 2, port),
            cwd=config.parent,
        )
        for rank in (0, 1)
    ]
    assert [child.wait(timeout=240) for child in children] == [0, 0], children[0].output[-3000:]
    return report


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pretrained") / "llama"
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        **{k: v for k, v in LLAMA.items() if k != "model_type"}, vocab_size=64
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


def base_model(config: Path, pretrained: Path) -> torch.nn.Module:
    """The frozen base the adapters were trained on, as ``transformers`` loads it."""
    cfg = load_config(config)
    if cfg.model.name == "hf_causal_lm":
        return transformers.AutoModelForCausalLM.from_pretrained(str(pretrained))
    seed_everything(cfg.run.seed)  # the reference base is the run's seeded initialisation
    cfg.model.adapters = None
    export_model(build_model(cfg.model), config.parent / "base")
    return transformers.AutoModelForCausalLM.from_pretrained(str(config.parent / "base"))


@pytest.mark.parametrize("kind", ["reference", "hf_llama"])
def test_lora_under_fsdp_shards_resumes_bitwise_and_exports_for_peft(
    kind: str, tmp_path: Path, forked: Forked, pretrained: Path
) -> None:
    import peft

    model: dict[str, object] = (
        dict(REFERENCE)
        if kind == "reference"
        else {"name": "hf_causal_lm", "options": {"pretrained": str(pretrained)}}
    )
    straight = write_config(tmp_path, model, "straight")
    resumed = write_config(tmp_path, model, "resumed")
    report = two_ranks(forked, straight)
    two_ranks(forked, resumed, max_steps=3)
    two_ranks(forked, resumed, resume=True)

    # Each rank holds half of every adapter matrix (dim 0), and the adapters train.
    held = [json.loads(Path(f"{report}.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert held[0] and held[0].keys() == held[1].keys()
    for name, entry in held[0].items():
        assert entry["placements"] == ["Shard(dim=0)"], name
        assert entry["local"][0] * 2 == entry["whole"][0] and entry["trains"], name

    # The checkpoint holds the adapters (and their optimizer state) only.
    last = "step_000000000006.dcp"
    saved = dcp_io.read_metadata(tmp_path / "straight/checkpoints" / last).state_dict_metadata
    weights = [key.removeprefix("model.") for key in saved if key.startswith("model.")]
    assert weights and all("lora_" in key or key == FINGERPRINT for key in weights)
    # Resumed at step 3 on two ranks: the same shards, byte for byte.
    for shard in ("__0_0.distcp", "__1_0.distcp"):
        assert filecmp.cmp(
            tmp_path / "straight/checkpoints" / last / shard,
            tmp_path / "resumed/checkpoints" / last / shard,
            shallow=False,
        )
    _, adapted = checkpoint_model(load_config(straight))
    _, again = checkpoint_model(load_config(resumed))
    ours, theirs = lora_state(adapted), lora_state(again)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(k.endswith("lora_B.default.weight") and w.abs().sum() > 0 for k, w in ours.items())

    if kind == "reference":  # the base is the seeded initialisation: another seed, another base
        other = run_cli(
            "fit", "--config", str(resumed), "--resume", "--max-steps", "9",
            "--set", "run.seed=99", cwd=tmp_path,
        )  # fmt: skip
        assert other.returncode == 2 and "trained on other base weights" in other.stderr
        port = free_port()
        ranks = [
            forked.start(cli_main, "fit", "--config", str(resumed), "--resume", "--max-steps",
                         "9", "--set", "run.seed=99", env=rank_env(r, 2, port), cwd=tmp_path)
            for r in (0, 1)
        ]  # fmt: skip
        assert [child.wait(timeout=120) for child in ranks] == [2, 2]
        assert "trained on other base weights" in ranks[0].output

    expected = logits(adapted, IDS)
    for flag in ("--adapter", "--merge"):
        out = str(tmp_path / flag.strip("-"))
        result = run_cli("export", "--config", str(straight), "--output", out, flag, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    with_adapter = peft.PeftModel.from_pretrained(
        base_model(straight, pretrained), str(tmp_path / "adapter")
    )
    torch.testing.assert_close(logits(with_adapter, IDS), expected, rtol=1e-5, atol=1e-5)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merge"))
    torch.testing.assert_close(logits(merged, IDS), expected, rtol=1e-5, atol=1e-5)
