"""``speedtronic export`` (``speedtronic.models.export``): a run's checkpoint as a Hugging
Face directory that ``AutoModelForCausalLM.from_pretrained`` loads with the same logits --
the reference transformer as ``LlamaForCausalLM``, an ``hf_causal_lm`` model as itself, a
sharded (DCP) checkpoint consolidated -- the run's tokenizer beside it, atomic writes, and
the refusals (a non-empty output, a model part Llama has no place for, a missing extra)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from cli_runner import run_cli
from hf_helpers import BLOCK, LLAMA, VOCAB, logits, run_config
from torch import nn

from speedtronic.models.export import ExportError, export_model, tokenizer_file
from speedtronic.models.hf import HFCausalLM, HFModelError
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.runtime import build_runtime

REFERENCE = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "d_ff": 64}
"""GQA (two query heads per K/V head), SwiGLU width 44."""


def trained(config: Path) -> nn.Module:
    """Fit the run in this process; its model holds the final checkpoint's weights."""
    trainer, _ = build_runtime(config)
    trainer.fit()
    return trainer.model


def export(tmp_path: Path, config: Path, *extra: str) -> tuple[int, str, str]:
    result = run_cli("export", "--config", str(config), *extra, cwd=tmp_path)
    return result.returncode, result.stdout, result.stderr


def loaded(directory: Path) -> nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    assert isinstance(model, nn.Module)
    return model


def assert_same_logits(ours: nn.Module, theirs: nn.Module) -> None:
    ids = torch.randint(0, VOCAB, (3, BLOCK), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-5, rtol=0)


def only_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("speedtronic: error:"), stderr
    return lines[0]


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_the_reference_transformer_exports_as_llama_with_equal_logits(
    tmp_path: Path, tie: bool
) -> None:
    model = {**REFERENCE, "rope_base": 500.0, "tie_weights": tie}
    config = run_config(tmp_path, {"name": "reference_transformer", **model})
    ours = trained(config)
    code, out, err = export(tmp_path, config, "--output", str(tmp_path / "hf"))
    assert code == 0, err
    assert out.startswith(f"wrote {tmp_path / 'hf'} (LlamaForCausalLM: config.json, ")
    assert "step=4 checkpoint=" in out
    theirs = loaded(tmp_path / "hf")
    assert type(theirs).__name__ == "LlamaForCausalLM"
    fields = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (fields["num_key_value_heads"], fields["tie_word_embeddings"]) == (2, tie)
    assert_same_logits(ours, theirs)  # a wrong rope_theta, GQA order or tie would differ


def test_an_hf_causal_lm_run_exports_its_own_model(tmp_path: Path) -> None:
    config = run_config(tmp_path, {"name": "hf_causal_lm", "options": {"config": LLAMA}})
    ours = trained(config)
    assert isinstance(ours, HFCausalLM)
    code, out, err = export(tmp_path, config, "--output", str(tmp_path / "hf"))
    assert code == 0, err
    assert "(LlamaForCausalLM: " in out and "model.safetensors" in out
    assert not any((tmp_path / "hf").glob("*.bin"))
    assert_same_logits(ours, loaded(tmp_path / "hf"))


def test_a_sharded_checkpoint_exports_consolidated(tmp_path: Path) -> None:
    config = run_config(
        tmp_path, {"name": "reference_transformer", **REFERENCE}, parallel={"strategy": "fsdp"}
    )
    with pytest.warns(UserWarning, match="one whole shard"):
        ours = trained(config)
    sharded = tmp_path / "run" / "checkpoints" / "step_000000000004.dcp"
    assert sharded.is_dir()
    code, out, err = export(
        tmp_path, config, "--checkpoint", str(sharded), "--output", str(tmp_path / "hf")
    )
    assert code == 0, err
    assert f"checkpoint={sharded}" in out
    assert_same_logits(ours, loaded(tmp_path / "hf"))


def test_a_non_empty_output_is_kept_unless_overwrite(tmp_path: Path) -> None:
    config = run_config(tmp_path, {"name": "reference_transformer", **REFERENCE}, steps=2)
    trained(config)
    output = tmp_path / "hf"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    code, _, err = export(tmp_path, config, "--output", str(output))
    assert code == 2
    assert f"--output {output} is not empty; pass --overwrite" in only_error(err)
    assert [p.name for p in output.iterdir()] == ["notes.txt"]
    code, _, err = export(tmp_path, config, "--output", str(output), "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in output.iterdir()) == ["config.json", "model.safetensors"]
    code, _, err = export(tmp_path, config, "--output", str(output / "config.json"))
    assert code == 2 and "exists and is not a directory" in only_error(err)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")]  # no temp left


QK_NORM_MODULE = """
import torch
from speedtronic import register_model
from speedtronic.models.transformer import CausalSelfAttention, RMSNorm, ReferenceTransformer


class QKNormAttention(CausalSelfAttention):
    def __init__(self, config):
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim)


@register_model("qk_norm_transformer")
class QKNormTransformer(ReferenceTransformer):
    def __init__(self, **fields):
        super().__init__(**fields)
        for block in self.blocks:
            block.attn = QKNormAttention(self.config)
"""


def test_a_reference_part_without_a_llama_equivalent_is_refused(tmp_path: Path) -> None:
    (tmp_path / "qk_model.py").write_text(QK_NORM_MODULE)
    config = run_config(
        tmp_path, {"name": "qk_norm_transformer", **REFERENCE}, steps=2, imports=["qk_model"]
    )
    assert run_cli("fit", "--config", str(config), cwd=tmp_path).returncode == 0
    code, _, err = export(tmp_path, config, "--output", str(tmp_path / "hf"))
    assert code == 2
    assert (
        "cannot export the reference transformer as LlamaForCausalLM: transformer.h.0.attn is "
        "QKNormAttention, not the reference's CausalSelfAttention" in only_error(err)
    )
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ExportError, match="cannot export a Linear: speedtronic export writes"):
        export_model(nn.Linear(2, 2), tmp_path / "linear")


def test_export_without_the_hf_extra_names_the_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    model = ReferenceTransformer(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16)
    with pytest.raises(HFModelError, match="needs transformers, part of the hf extra: pip"):
        export_model(model, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp directory left


def test_the_runs_tokenizer_is_found_and_copied(tmp_path: Path) -> None:
    tokenizer = tmp_path / "bpe.json"
    tokenizer.write_text('{"model": "bpe"}')
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "tokenizer.json").write_text('{"model": "shards"}')
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"model": "other"}')
    assert tokenizer_file({"tokenizer": str(tokenizer)}) == tokenizer
    assert tokenizer_file({"tokenizer": "bytes"}) is None  # the byte tokenizer has no file
    assert tokenizer_file({"tokens": str(shards)}) == shards / "tokenizer.json"
    assert tokenizer_file({"text_path": "x.txt"}) is None
    same = [{"tokens": str(shards), "weight": 0.5}, {"tokens": str(shards), "weight": 0.5}]
    assert tokenizer_file({"mixture": same}) == shards / "tokenizer.json"
    with pytest.raises(ExportError, match="different tokenizer.json files"):
        tokenizer_file({"mixture": [{"tokens": str(shards)}, {"tokens": str(other)}]})
    model = ReferenceTransformer(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16, dropout=0.1)
    with pytest.warns(UserWarning, match="Llama has attention_dropout only"):
        result = export_model(model, tmp_path / "hf", tokenizer=tokenizer)
    assert result.files == ("config.json", "model.safetensors", "tokenizer.json")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
