"""``model.options.document_attention``: the reference transformer's document mask through
SDPA or flex_attention gives the same logits and loss (flex runs forward-only on the CPU:
compared there), keeps documents apart, and ``flex`` where it cannot run is a clear
configuration error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli
from test_documents import byte_shards

from speedtronic.config import ConfigError, load_config
from speedtronic.data.documents import document_positions
from speedtronic.models.document_attention import flex_available, uses_flex
from speedtronic.models.transformer import ReferenceTransformer

EOS, VOCAB, SEQ = 0, 64, 48
needs_flex = pytest.mark.skipif(not flex_available(), reason="this torch has no flex_attention")


def model(kernel: str) -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        d_ff=64,
        document_attention=kernel,
    )


def packed(batch: int = 3) -> torch.Tensor:
    """Windows of several documents (an end-of-document id every 3-14 tokens)."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (batch, SEQ), generator=generator)
    ids[torch.rand(batch, SEQ, generator=generator) < 0.15] = EOS
    return ids


@needs_flex
def test_flex_and_sdpa_give_the_same_logits_and_loss() -> None:
    torch.set_num_threads(1)
    ids = packed()
    labels = torch.roll(ids, -1, dims=1)
    positions = document_positions(ids, EOS)
    padding = torch.ones_like(ids)
    padding[0, -5:] = 0  # a right-padded row: the padding mask and the documents together
    results = {}
    for kernel in ("sdpa", "flex"):
        net = model(kernel).eval()
        with torch.no_grad():
            results[kernel] = (
                net(ids, labels=labels, position_ids=positions),
                net(ids, labels=labels, position_ids=positions, attention_mask=padding),
            )
    for sdpa, flex in zip(results["sdpa"], results["flex"], strict=True):
        torch.testing.assert_close(flex["logits"], sdpa["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flex["loss"], sdpa["loss"], rtol=1e-6, atol=1e-6)


@needs_flex
def test_flex_keeps_documents_apart() -> None:
    net = model("flex").eval()
    ids = packed(1)
    ids[0, 5] = EOS  # document 1 is tokens 0..5
    first_end = int((ids[0] == EOS).nonzero()[0])
    changed = ids.clone()
    changed[0, 0] = (int(ids[0, 0]) % (VOCAB - 1)) + 1
    with torch.no_grad():
        logits = [
            net(window, position_ids=document_positions(window, EOS))["logits"]
            for window in (ids, changed)
        ]
    assert torch.equal(logits[0][0, first_end + 1 :], logits[1][0, first_end + 1 :])
    assert not torch.equal(logits[0][0, :first_end], logits[1][0, :first_end])


@needs_flex
def test_flex_where_it_cannot_run_is_a_clear_error() -> None:
    net = model("flex").train()
    ids = packed(1)
    with pytest.raises(ConfigError, match="flex cannot train on cpu.*use sdpa"):
        net(ids, labels=ids, position_ids=document_positions(ids, EOS))
    with pytest.raises(ConfigError, match="flex has no attention dropout"):
        ReferenceTransformer(vocab_size=VOCAB, dropout=0.1, document_attention="flex")
    # Plain causal attention never goes through flex: it trains anywhere.
    net(ids, labels=ids)["loss"].backward()  # type: ignore[no-untyped-call]


@needs_flex
def test_training_with_flex_on_the_cpu_exits_2_with_one_message(tmp_path: Path) -> None:
    shards = byte_shards(tmp_path, "docs", [("lorem ipsum " * 3)[: 4 + i] for i in range(30)])
    config = {
        "run": {"device": "cpu", "max_steps": 1, "output_dir": str(tmp_path / "run")},
        "model": {"vocab_size": 257, "max_seq_len": 16, "n_layer": 1, "n_head": 2,
                  "d_model": 16, "d_ff": 32, "options": {"document_attention": "flex"}},
        "data": {"tokens": str(shards), "micro_batch_size": 2, "document_mask": True},
        "logging": {"console": False},
        "checkpoint": {"enabled": False},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = run_cli("fit", "--config", str(tmp_path / "run.yaml"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "document_attention: flex cannot train on cpu" in result.stderr
    assert "Traceback" not in result.stderr


def test_auto_is_flex_on_cuda_only_and_the_option_is_checked() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not uses_flex("auto", cpu, 0.0)
    assert uses_flex("auto", cuda, 0.0) == flex_available()
    assert not uses_flex("auto", cuda, 0.1)  # flex has no dropout: SDPA
    assert not uses_flex("sdpa", cuda, 0.0) and uses_flex("flex", cpu, 0.0)
    config = load_config({"model": {"options": {"document_attention": "flex"}}})
    assert config.model.options == {"document_attention": "flex"}
    with pytest.raises(ConfigError, match="model.options.document_attention"):
        load_config({"model": {"options": {"document_attention": "flash"}}})
