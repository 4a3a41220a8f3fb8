"""Packed documents (``data.document_mask``): block-causal attention and restarting positions.

Changing any token of the first document of a window leaves the next document's logits and
loss unchanged, for the reference transformer and a ``transformers`` Llama; without
``position_ids`` nothing changes, bitwise; token shards with ``document_mask`` carry the
positions, also through a mixture.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import LLAMA
from torch import nn

from speedtronic.data.documents import document_ids, document_positions
from speedtronic.data.mixture import MixtureDataset, open_mixture
from speedtronic.data.windows import open_token_dataset
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import MicrobatchContext
from speedtronic.models.transformer import ReferenceTransformer

EOS = 0
VOCAB, SEQ = 64, 16
FIRST = 6
"""Document 1 is tokens 0..5 of the window, its last one the end-of-document id."""


def window(seed: int) -> torch.Tensor:
    tokens = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    tokens[0, FIRST - 1] = EOS
    return tokens


def reference() -> nn.Module:
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=VOCAB, max_seq_len=SEQ, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64
    ).eval()


def llama() -> nn.Module:
    from speedtronic.models.hf import build_hf_causal_lm

    torch.manual_seed(0)
    return build_hf_causal_lm(config=LLAMA, vocab_size=VOCAB, block_size=SEQ).eval()


def test_positions_restart_after_every_end_of_document_id() -> None:
    ids = torch.tensor([[5, 0, 7, 8, 0, 0, 3], [0, 1, 2, 3, 4, 5, 6]])
    positions = document_positions(ids, 0)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    assert document_ids(positions).tolist() == [[1, 1, 2, 2, 2, 3, 4], [1, 2, 2, 2, 2, 2, 2]]


@pytest.mark.parametrize("build", [reference, llama], ids=["reference", "hf_llama"])
def test_changing_document_one_leaves_document_two_unchanged(build: object) -> None:
    assert callable(build)
    model = build()
    first = window(1)
    labels = torch.roll(first, -1, dims=1)
    # The window, then one copy per token of document 1 but its end with that token changed:
    # one forward over all of them.
    variants = first.repeat(FIRST, 1)
    for change in range(FIRST - 1):
        variants[change + 1, change] = (int(first[0, change]) % (VOCAB - 1)) + 1
    with torch.no_grad():
        logits = model(variants, position_ids=document_positions(variants, EOS))["logits"]
    outputs = [logits[row, FIRST:] for row in range(FIRST)]
    for change in range(FIRST - 1):
        assert torch.equal(outputs[change + 1], outputs[0]), f"token {change} leaked"
    assert not torch.equal(logits[1, :FIRST], logits[0, :FIRST])  # document 1 did change
    # Document 2 alone, at the start of a window, has the same logits (positions restart).
    with torch.no_grad():
        alone = model(first[:, FIRST:])["logits"][0]
    torch.testing.assert_close(alone, outputs[0], rtol=1e-4, atol=1e-5)
    # Its loss too: labels of document 2 only.
    masked = labels.clone()
    masked[0, :FIRST] = -100
    other = first.clone()
    other[0, 0] = (int(other[0, 0]) % (VOCAB - 1)) + 1
    with torch.no_grad():
        losses = [
            model(ids, labels=masked, position_ids=document_positions(ids, EOS))["loss"]
            for ids in (first, other)
        ]
    assert torch.equal(losses[0], losses[1])
    # Without the positions, document 1 does reach document 2 (the test can tell).
    with torch.no_grad():
        plain = [model(ids)["logits"][0, FIRST:] for ids in (first, other)]
    assert not torch.equal(plain[0], plain[1])


def test_one_document_is_plain_causal_attention() -> None:
    model = reference()
    ids = window(2)
    with torch.no_grad():
        plain = model(ids)["logits"]
        one_document = model(ids, position_ids=torch.arange(SEQ)[None])["logits"]
    torch.testing.assert_close(plain, one_document, rtol=1e-5, atol=1e-6)


def test_a_run_with_document_mask_trains_on_the_positions(tmp_path: Path) -> None:
    from speedtronic.runtime import build_runtime

    texts = [("lorem ipsum " * (3 + i % 5))[: 5 + 3 * i] for i in range(40)]
    directory = byte_shards(tmp_path, "docs", texts)
    seen: list[set[str]] = []

    def config(name: str, mask: bool) -> dict[str, object]:
        return {
            "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path / name)},
            "model": {
                "vocab_size": 257,
                "max_seq_len": 16,
                "n_layer": 1,
                "n_head": 2,
                "d_model": 16,
                "d_ff": 32,
            },
            "data": {"tokens": str(directory), "micro_batch_size": 4, "document_mask": mask},
            "logging": {"console": False},
            "checkpoint": {"enabled": False},
        }

    class Keys(Callback):
        def on_microbatch_start(self, trainer: object, ctx: MicrobatchContext) -> None:
            assert isinstance(ctx.batch, dict)
            seen.append(set(ctx.batch))

    results = {}
    for mask in (False, True):
        trainer, _ = build_runtime(config(f"run{mask}", mask), extra_callbacks=[Keys()])
        results[mask] = trainer.fit().final_loss
    plain, documented = {"input_ids", "labels"}, {"input_ids", "labels", "position_ids"}
    assert seen == [plain, plain, documented, documented]
    assert results[False] != results[True]  # the masks changed what the model saw


def byte_shards(tmp_path: Path, name: str, texts: list[str]) -> Path:
    """Token shards of ``texts`` (one document each) with the byte tokenizer (EOS 256)."""
    from speedtronic.cli import main

    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    output = tmp_path / name
    argv = ["prepare", "--input", str(corpus), "--tokenizer", "bytes", "--output", str(output)]
    assert main([*argv, "--eval-fraction", "0"]) == 0
    return output


def test_token_shards_carry_positions_that_restart_per_document(tmp_path: Path) -> None:
    texts = ["abc", "de", "fghijklmnopq", "rs", "tuvwxyz0123456789"]
    directory = byte_shards(tmp_path, "docs", texts)
    plain = open_token_dataset(directory, block_size=8)
    masked = open_token_dataset(directory, block_size=8, document_mask=True)
    indices = list(range(len(plain)))
    batch = plain.__getitems__(indices).batch()
    documented = masked.__getitems__(indices).batch()
    assert set(batch) == {"input_ids", "labels"}  # without document_mask: as before
    assert torch.equal(batch["input_ids"], documented["input_ids"])
    assert torch.equal(batch["labels"], documented["labels"])
    expected = document_positions(batch["input_ids"], 256)
    assert torch.equal(documented["position_ids"], expected)
    assert documented["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]  # abc<eos>de<eos>
    assert torch.equal(masked[1]["position_ids"], expected[1])  # one record, the same
    mixture = open_mixture(
        [(str(directory), 1.0), (str(byte_shards(tmp_path, "more", texts[::-1])), 1.0)],
        block_size=8,
        seed=3,
        document_mask=True,
    )
    assert isinstance(mixture, MixtureDataset)
    mixed = mixture.__getitems__(list(range(4))).batch()
    assert torch.equal(mixed["position_ids"], document_positions(mixed["input_ids"], 256))


def test_document_mask_without_token_shards_is_an_error() -> None:
    from speedtronic.config import load_config
    from speedtronic.data import DataSourceError
    from speedtronic.data.loader import resolve_dataset

    config = load_config({"data": {"synthetic": True, "document_mask": True}})
    with pytest.raises(DataSourceError, match="data.document_mask applies to token shards"):
        resolve_dataset(config.data)


def test_hf_llama_through_the_trainer_keeps_documents_apart(tmp_path: Path) -> None:
    """``hf_causal_lm`` (a Llama built from a config) trained by the Trainer on token shards
    with ``document_mask``: changing any token of document 1 leaves document 2's logits and
    loss unchanged. Without ``document_mask`` no positions reach the model: its forward is
    the plain one, bitwise."""
    from speedtronic.runtime import build_runtime

    second = "a second document, longer"
    base = ["abc", second] + [f"more text {i}" for i in range(20)]
    length = len(base[0]) + 1  # document 1 and its end-of-document id
    doc2 = slice(length, length + len(second))

    def first_forward(texts: list[str], name: str, mask: bool) -> dict[str, object]:
        """The first forward of a one-step run: its inputs, outputs and the weights."""
        config = {
            "run": {"device": "cpu", "max_steps": 1, "output_dir": str(tmp_path / f"run-{name}")},
            "model": {"name": "hf_causal_lm", "vocab_size": 257, "max_seq_len": 24,
                      "options": {"config": LLAMA}},
            "data": {"tokens": str(byte_shards(tmp_path, name, texts)), "micro_batch_size": 1,
                     "document_mask": mask, "shuffle": False},
            "optimizer": {"name": "adamw", "lr": 1e-2},
            "logging": {"console": False},
            "checkpoint": {"enabled": False},
        }  # fmt: skip
        trainer, _ = build_runtime(config)
        seen: dict[str, object] = {}

        def keep(module: nn.Module, args: object, kwargs: dict[str, object], out: object) -> None:
            if not seen:
                assert isinstance(out, dict)
                seen.update({key: value for key, value in kwargs.items() if value is not None})
                seen["output"] = {key: value.detach().clone() for key, value in out.items()}
                seen["weights"] = {k: v.clone() for k, v in module.state_dict().items()}
                seen["model"] = module

        trainer.model.register_forward_hook(keep, with_kwargs=True)
        trainer.fit()
        return seen

    def doc2_logits_and_loss(run: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor]:
        output, labels = run["output"], run["labels"]
        assert isinstance(output, dict) and isinstance(labels, torch.Tensor)
        logits = output["logits"][0, doc2]
        return logits, torch.nn.functional.cross_entropy(logits, labels[0, doc2])

    original = first_forward(base, "original", True)
    ids, positions = original["input_ids"], original["position_ids"]
    assert isinstance(ids, torch.Tensor) and isinstance(positions, torch.Tensor)
    assert ids[0, length - 1] == 256 and positions[0, length] == 0  # document 2 starts there
    logits, loss = doc2_logits_and_loss(original)
    for change in range(length - 1):  # every token of document 1 but its end
        texts = [base[0][:change] + "Z" + base[0][change + 1 :], *base[1:]]
        run = first_forward(texts, f"changed{change}", True)
        assert not torch.equal(run["input_ids"], ids)  # type: ignore[arg-type]
        changed_logits, changed_loss = doc2_logits_and_loss(run)
        assert torch.equal(changed_logits, logits), f"token {change} of document 1 leaked"
        assert torch.equal(changed_loss, loss)
    # Without document_mask: the Trainer's forward is the model's own without positions.
    plain = first_forward(base, "plain", False)
    assert "position_ids" not in plain
    model, weights, output = plain["model"], plain["weights"], plain["output"]
    assert isinstance(model, nn.Module) and isinstance(weights, dict) and isinstance(output, dict)
    model.load_state_dict(weights)
    with torch.no_grad():
        again = model(plain["input_ids"], labels=plain["labels"])
    assert torch.equal(again["logits"], output["logits"]) and torch.equal(
        again["loss"], output["loss"]
    )
    # ... and there document 1 does reach document 2 (the test can tell).
    leaked = first_forward(["Zbc", *base[1:]], "plain-changed", False)
    assert not torch.equal(doc2_logits_and_loss(leaked)[0], doc2_logits_and_loss(plain)[0])


def test_hf_packed_documents_with_padding_are_refused() -> None:
    """transformers finds packed documents only without an ``attention_mask``: a mask of no
    padding is dropped (the documents stay apart), a padded batch is an error."""
    model = llama()
    ids = window(3)
    positions = document_positions(ids, EOS)
    with torch.no_grad():
        alone = model(ids, position_ids=positions)["logits"]
        unpadded = model(ids, position_ids=positions, attention_mask=torch.ones_like(ids))
    assert torch.equal(unpadded["logits"], alone)
    padded = torch.ones_like(ids)
    padded[0, -2:] = 0
    with pytest.raises(ValueError, match="would attend across the documents"):
        model(ids, position_ids=positions, attention_mask=padded)
