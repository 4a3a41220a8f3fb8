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
import tokenizers
import torch
import transformers
from cli_runner import run_cli
from hf_helpers import BLOCK, LLAMA, VOCAB, logits, run_config
from token_data import BPE_VOCAB, bpe_tokenizer, documents, write_config, write_jsonl
from token_data import run_config as run_token_config
from torch import nn

from speedtronic.data import read_manifest
from speedtronic.data.tokenizer import FileTokenizer
from speedtronic.models.export import (
    EXPORT_RECORD,
    ExportError,
    export_model,
    export_tokens,
    tokenizer_file,
)
from speedtronic.models.export_tokens import RunTokens
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


def test_overwrite_replaces_an_earlier_export_and_nothing_else(tmp_path: Path) -> None:
    config = run_config(tmp_path, {"name": "reference_transformer", **REFERENCE}, steps=2)
    trained(config)
    output = tmp_path / "hf"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    code, _, err = export(tmp_path, config, "--output", str(output))
    assert code == 2
    assert f"--output {output} is not empty; pass --overwrite" in only_error(err)
    # --overwrite used to delete whatever was there: it replaces an earlier export only.
    code, _, err = export(tmp_path, config, "--output", str(output), "--overwrite")
    assert code == 2
    assert (
        f"--output {output} is not a directory speedtronic export wrote (it holds no "
        ".speedtronic-export.json); --overwrite replaces only an earlier export, and would "
        "remove notes.txt" in only_error(err)
    )
    assert [p.name for p in output.iterdir()] == ["notes.txt"]
    assert (output / "notes.txt").read_text() == "mine"
    (output / "notes.txt").unlink()
    code, _, err = export(tmp_path, config, "--output", str(output))
    assert code == 0, err  # an empty directory is no one's
    written = ["config.json", "model.safetensors"]
    assert sorted(p.name for p in output.iterdir()) == [EXPORT_RECORD, *written]
    assert json.loads((output / EXPORT_RECORD).read_text())["files"] == written
    before = (output / "model.safetensors").stat().st_ino
    code, _, err = export(tmp_path, config, "--output", str(output), "--overwrite")
    assert code == 0, err  # an earlier export: replaced
    assert (output / "model.safetensors").stat().st_ino != before
    (output / "README.md").write_text("added by hand")
    code, _, err = export(tmp_path, config, "--output", str(output), "--overwrite")
    assert code == 2
    assert "(it holds files the export did not write)" in only_error(err)
    assert "would remove README.md: remove them" in only_error(err)
    assert (output / "README.md").read_text() == "added by hand"
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


# -- the run's tokenizer and token ids ---------------------------------------------------------

SAMPLE = "the cat sat on a mat while seven dogs ran past naïve cafés and 日本 tea"


def token_workspace(tmp_path: Path) -> Path:
    """The test BPE (``<|endoftext|>`` is id 0) and a corpus of JSONL documents."""
    bpe_tokenizer(tmp_path)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", documents(80, seed=3))
    return tmp_path


def prepare_shards(workspace: Path, output: str, *extra: str) -> Path:
    done = run_cli(
        "prepare", "--input", "corpus/*.jsonl", "--tokenizer", "tokenizer.json",
        "--output", output, "--shard-tokens", "400", *extra, cwd=workspace,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return workspace / output


def token_run(
    workspace: Path, data: dict[str, object], model: dict[str, object] | None = None
) -> Path:
    """A few steps of the tiny reference transformer of ``token_data.run_config`` on
    ``data`` (or of ``model``, replacing its model section)."""
    config = run_token_config(workspace / "run", data)
    if model is not None:
        config["model"] = {"vocab_size": BPE_VOCAB, "max_seq_len": 16, **model}
    return write_config(workspace / "run.yaml", config)


def assert_loads_as_the_tokenizer(output: Path, original: Path) -> None:
    """``AutoTokenizer`` loads the export and encodes as the ``tokenizers`` object does."""
    assert (output / "tokenizer.json").read_bytes() == original.read_bytes()
    auto = transformers.AutoTokenizer.from_pretrained(str(output))
    expected = tokenizers.Tokenizer.from_file(str(original)).encode(SAMPLE).ids
    assert auto(SAMPLE)["input_ids"] == expected == FileTokenizer(original).encode(SAMPLE)
    assert (auto.eos_token, auto.eos_token_id) == ("<|endoftext|>", 0)


def test_prepare_fit_export_carries_the_tokenizer_and_its_ids(tmp_path: Path) -> None:
    workspace = token_workspace(tmp_path)
    shards = prepare_shards(workspace, "shards", "--eval-fraction", "0.1")
    manifest = read_manifest(shards)
    config = token_run(workspace, {"tokens": str(shards)})  # the shards' own tokenizer copy
    ours = trained(config)
    code, out, err = export(workspace, config, "--output", "hf")
    assert code == 0, err
    output = workspace / "hf"
    assert "config.json, model.safetensors, tokenizer.json, tokenizer_config.json)" in out
    fields = json.loads((output / "config.json").read_text())
    assert fields["eos_token_id"] == manifest.eos_id == 0
    assert fields.get("bos_token_id") is None  # the BPE has no beginning-of-text token
    assert fields["vocab_size"] == BPE_VOCAB >= manifest.vocab_size
    theirs = loaded(output)
    ids = torch.randint(0, BPE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-5, rtol=0)
    assert_loads_as_the_tokenizer(output, workspace / "tokenizer.json")


def test_a_text_run_with_a_tokenizer_exports_it(tmp_path: Path) -> None:
    workspace = token_workspace(tmp_path)
    (workspace / "corpus.txt").write_text(" ".join(documents(60, seed=4)), encoding="utf-8")
    text = {
        "text_path": str(workspace / "corpus.txt"),
        "tokenizer": str(workspace / "tokenizer.json"),
    }
    config = token_run(workspace, text)
    ours = trained(config)
    code, _, err = export(workspace, config, "--output", "hf")
    assert code == 0, err
    fields = json.loads((workspace / "hf" / "config.json").read_text())
    assert fields["eos_token_id"] == 0  # the tokenizer's own <|endoftext|>
    ids = torch.randint(0, BPE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    assert_close = torch.testing.assert_close
    assert_close(logits(ours, ids), logits(loaded(workspace / "hf"), ids), atol=1e-5, rtol=0)
    assert_loads_as_the_tokenizer(workspace / "hf", workspace / "tokenizer.json")


def test_an_hf_model_on_a_mixture_gets_the_datas_ids(tmp_path: Path) -> None:
    workspace = token_workspace(tmp_path)
    prepare_shards(workspace, "web", "--eval-fraction", "0")
    prepare_shards(workspace, "code", "--eval-fraction", "0")
    mixture = [{"tokens": "web", "weight": 0.7}, {"tokens": "code", "weight": 0.3}]
    llama = {**LLAMA, "vocab_size": BPE_VOCAB}  # LlamaConfig's own ids: bos 1, eos 2
    model = {"name": "hf_causal_lm", "options": {"config": llama}}
    config = token_run(workspace, {"mixture": mixture}, model)
    assert run_cli("fit", "--config", str(config), cwd=workspace).returncode == 0
    done = run_cli("export", "--config", str(config), "--output", "hf", cwd=workspace)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr  # LlamaConfig's default ids: the user set none
    for name in ("config.json", "generation_config.json"):
        fields = json.loads((workspace / "hf" / name).read_text())
        assert fields["eos_token_id"] == 0, name
        assert fields["bos_token_id"] is None, name  # Llama's 1: an ordinary token here
    assert_loads_as_the_tokenizer(workspace / "hf", workspace / "tokenizer.json")
    assert loaded(workspace / "hf").config.eos_token_id == 0


def test_a_tokenizer_that_does_not_belong_to_the_shards_is_refused(tmp_path: Path) -> None:
    workspace = token_workspace(tmp_path)
    shards = prepare_shards(workspace, "shards")
    other = workspace / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(  # the same tokenizer, other bytes: another sha256
        json.dumps(json.loads((workspace / "tokenizer.json").read_text()), indent=1)
    )
    prepare_other = run_cli(
        "prepare", "--input", "corpus/*.jsonl", "--tokenizer", "other/tokenizer.json",
        "--output", "other-shards", cwd=workspace,
    )  # fmt: skip
    assert prepare_other.returncode == 0, prepare_other.stderr
    assert export_tokens({"tokens": str(shards)}).file == shards / "tokenizer.json"
    assert tokenizer_file({"tokenizer": "bytes", "text_path": "x.txt"}) is None
    assert export_tokens({"text_path": "x.txt"}) == RunTokens()  # the byte tokenizer: none
    mixed = [{"tokens": str(shards)}, {"tokens": str(workspace / "other-shards")}]
    with pytest.raises(ExportError, match="prepared with different tokenizers"):
        export_tokens({"mixture": mixed})
    (shards / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    config = token_run(workspace, {"tokens": str(shards)})
    code, _, err = export(workspace, config, "--output", "hf")  # no checkpoint is read first
    assert code == 2
    assert (
        f"data.tokens: {shards / 'tokenizer.json'} is not the tokenizer the shards were "
        "made with (its sha256 differs from index.json's)" in only_error(err)
    )
    assert not (workspace / "hf").exists()


def test_a_tokenizer_file_given_alone_is_copied_with_its_config(tmp_path: Path) -> None:
    tokenizer = bpe_tokenizer(tmp_path / "bpe")
    model = ReferenceTransformer(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16, dropout=0.1)
    with pytest.warns(UserWarning, match="Llama has attention_dropout only"):
        result = export_model(model, tmp_path / "hf", tokenizer=tokenizer)
    assert result.files == (
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    )  # fmt: skip
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    fields = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert fields.get("eos_token_id") is None  # nothing known about the ids: none claimed
    too_large = RunTokens(file=tokenizer, eos_ids=(0,), vocab_size=BPE_VOCAB, source="data.tokens")
    small = ReferenceTransformer(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16)
    with pytest.raises(ExportError, match=f"up to id {BPE_VOCAB - 1}, beyond the exported model's"):
        export_model(small, tmp_path / "small", tokenizer=too_large)
    assert not (tmp_path / "small").exists()
