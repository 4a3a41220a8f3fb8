"""Hugging Face causal LMs as speedtronic models (``model.name: hf_causal_lm``,
``speedtronic.models.hf``): the loss shifts speedtronic's labels exactly once, a raw
``transformers`` model registered with ``register_model`` gets the same objective, the
model's own gradient checkpointing, Muon routing of HF names, ``speedtronic evaluate``, and
the bad inputs (hub id, missing extra, pickle weights, a vocabulary that does not fit)."""

from __future__ import annotations

import copy
import json
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from cli_runner import run_cli
from hf_helpers import BLOCK, LLAMA, VOCAB, logits, run_config
from torch import nn

from speedtronic import Callback, Trainer, TrainerView, register_model
from speedtronic.config import load_config
from speedtronic.data import build_dataloader, collate_causal
from speedtronic.engine.contexts import StepContext
from speedtronic.models.hf import HFCausalLM, HFModelError, build_hf_causal_lm
from speedtronic.models.registry import registry
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.models.vocabulary import model_vocab_size
from speedtronic.optimizers import route_parameters
from speedtronic.runtime import build_runtime
from speedtronic.systems.sharding import find_shard_blocks
from speedtronic_callbacks.gradient_checkpointing import GradientCheckpointing


def tiny_llama(**overrides: object) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    fields = {key: value for key, value in LLAMA.items() if key != "model_type"}
    config = transformers.LlamaConfig(vocab_size=VOCAB, **{**fields, **overrides})
    return transformers.LlamaForCausalLM(config)


def hand_loss(raw: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a hand-written loop computes on speedtronic's already-shifted labels: the
    logits at position t against labels[t], -100 ignored, mean over the real labels."""
    out = raw(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    flat = out.logits.reshape(-1, out.logits.shape[-1])
    return F.cross_entropy(flat, batch["labels"].reshape(-1), ignore_index=-100)


def cli_error(result_stderr: str) -> str:
    """The one ``speedtronic: error:`` line of a failed command (and nothing else)."""
    lines = [line for line in result_stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("speedtronic: error:")]
    assert len(errors) == 1, result_stderr
    assert "Traceback" not in result_stderr
    return errors[0]


@pytest.fixture
def raw_registered() -> Iterator[str]:
    """A raw ``LlamaForCausalLM`` registered directly: the obvious first try."""
    register_model("raw_llama_for_test", lambda **_: tiny_llama())
    yield "raw_llama_for_test"
    registry.unregister("raw_llama_for_test")


# -- the objective ----------------------------------------------------------------------------


def test_a_registered_transformers_model_learns_the_next_token_not_two_ahead(
    tmp_path: Path, raw_registered: str
) -> None:
    # Before the adapter, the Trainer's loss here was transformers' own (labels shifted a
    # second time): 4.846 against 4.832 on the first batch, and on the smoke data the final
    # loss stopped at 2.17 against the language's entropy floor of 1.09.
    config = load_config(run_config(tmp_path, {"name": raw_registered}, steps=1))
    trainer, _ = build_runtime(config)
    assert isinstance(trainer.model, HFCausalLM)
    batch = next(iter(build_dataloader(config.data)))
    raw = tiny_llama()
    with torch.no_grad():
        once = hand_loss(raw, batch)
        twice = raw(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    assert abs(float(once) - float(twice)) > 1e-3  # the two objectives are told apart
    result = trainer.fit()
    assert result.final_loss == float(once)
    # A model handed to build_runtime is wrapped too when the data is the config's; with
    # a DataLoader of your own the batches (and so the labels' convention) are yours.
    assert isinstance(build_runtime(config, model=tiny_llama())[0].model, HFCausalLM)
    own_data = build_runtime(config, model=raw, dataloader=[batch])[0].model
    assert own_data is raw


def test_hf_causal_lm_losses_equal_a_hand_written_loop_with_padding() -> None:
    model = build_hf_causal_lm(config=LLAMA, vocab_size=VOCAB, block_size=BLOCK)
    raw = copy.deepcopy(model.hf)  # the same weights, trained by hand below
    generator = torch.Generator().manual_seed(1)

    def item(length: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (length + 1,), generator=generator)
        return {"input_ids": tokens[:-1], "labels": tokens[1:].clone()}

    ignored = item(BLOCK)
    ignored["labels"][:5] = -100  # e.g. a prompt that is not trained on
    batches = [
        collate_causal([item(BLOCK) for _ in range(3)]),
        collate_causal([item(BLOCK), item(11), item(6)]),  # padded: attention_mask, -100
        collate_causal([ignored, item(BLOCK)]),
    ]
    assert "attention_mask" in batches[1] and (batches[1]["labels"] == -100).any()
    result = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        batches,
        device="cpu",
        max_steps=len(batches),
    ).fit()
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    expected = []
    raw.train()
    for batch in batches:
        loss = hand_loss(raw, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expected.append(float(loss.detach()))
    # Bitwise: the same ops in the same order (one cross-entropy over the same logits).
    assert [float(record["loss"]) for record in result.metrics] == expected


# -- building ---------------------------------------------------------------------------------


def test_init_weights_from_a_local_safetensors_directory(tmp_path: Path) -> None:
    saved = tiny_llama(tie_word_embeddings=True)  # saved under one name: the tie is restored
    saved.save_pretrained(str(tmp_path / "base"))
    assert (tmp_path / "base" / "model.safetensors").is_file()
    model = build_hf_causal_lm(
        init_weights_from=str(tmp_path / "base"), vocab_size=VOCAB, block_size=BLOCK
    )
    ids = torch.randint(0, VOCAB, (2, BLOCK))
    assert torch.equal(logits(model, ids), logits(saved, ids))
    typo = "hiden_size (did you mean 'hidden_size'?) is not a LlamaConfig field"
    with pytest.raises(HFModelError, match=re.escape(typo)):
        build_hf_causal_lm(config={**LLAMA, "hiden_size": 8}, vocab_size=VOCAB)


def test_model_vocab_size_reads_the_built_model() -> None:
    hf = build_hf_causal_lm(config={**LLAMA, "vocab_size": 40}, vocab_size=40)
    assert model_vocab_size(hf) == 40
    assert model_vocab_size(ReferenceTransformer(vocab_size=24, n_layer=1, d_model=16)) == 24
    assert model_vocab_size(nn.Linear(2, 2)) is None
    with torch.device("meta"):
        assert model_vocab_size(build_hf_causal_lm(config=LLAMA, vocab_size=VOCAB)) == VOCAB


def layers_checkpointed(model: HFCausalLM) -> bool:
    """transformers' own flag on each decoder layer (the same name in 4.x and 5)."""
    flags = {bool(layer.gradient_checkpointing) for layer in model.hf.model.layers}
    assert len(flags) == 1
    return flags.pop()


class SeesCheckpointing(Callback):
    """Records, at every step's end, whether the HF model's own checkpointing is on."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        model = trainer.model
        assert isinstance(model, HFCausalLM)
        self.seen.append(layers_checkpointed(model))


def saved_activations(model: HFCausalLM, batch: dict[str, torch.Tensor]) -> int:
    """How many tensors autograd keeps for backward outside checkpointed regions (those
    inside are dropped and recomputed: the checkpoint's own hooks take them)."""
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch)["loss"]
    loss.backward()
    return count


def test_gradient_checkpointing_callback_uses_the_models_own_switch() -> None:
    model = build_hf_causal_lm(config=LLAMA, vocab_size=VOCAB, block_size=BLOCK)
    plain = copy.deepcopy(model)
    batches = [
        collate_causal([{"input_ids": ids[:-1], "labels": ids[1:]} for ids in group])
        for group in torch.randint(0, VOCAB, (2, 2, BLOCK + 1), generator=torch.Generator())
    ]

    def fit(net: HFCausalLM, callbacks: list[Callback]) -> list[float]:
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        trainer = Trainer(net, optimizer, batches, device="cpu", callbacks=callbacks, max_steps=2)
        return [float(record["loss"]) for record in trainer.fit().metrics]

    seen = SeesCheckpointing()
    losses = fit(model, [GradientCheckpointing(), seen])
    assert seen.seen == [True, True]
    assert not layers_checkpointed(model)  # teardown switched it off again
    assert losses == pytest.approx(fit(plain, []), abs=1e-6, rel=0)
    checkpointing = GradientCheckpointing()
    kept = saved_activations(model, batches[0])
    checkpointing.apply(model)
    assert checkpointing.uses_model_hook and checkpointing.wrapped_modules == []
    assert saved_activations(model, batches[0]) < kept / 2  # the layers' activations dropped
    checkpointing.remove()


def test_muon_keeps_hf_embeddings_and_heads_on_adamw() -> None:
    llama = route_parameters(HFCausalLM(tiny_llama()), optimizer="muon")
    adamw = {name for name, _ in llama.adamw}
    muon = {name for name, _ in llama.muon}
    assert {"hf.model.embed_tokens.weight", "hf.lm_head.weight", "hf.model.norm.weight"} <= adamw
    assert "hf.model.layers.0.self_attn.q_proj.weight" in muon
    assert "hf.model.layers.1.mlp.down_proj.weight" in muon
    assert not any("embed" in name or "lm_head" in name or "norm" in name for name in muon)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=16, n_layer=1, n_head=2)
    )
    routed = route_parameters(HFCausalLM(gpt2), optimizer="muon")
    assert {"hf.transformer.wte.weight", "hf.transformer.wpe.weight"} <= {
        name for name, _ in routed.adamw
    }  # the tied head is the embedding: routed once, to AdamW
    assert "hf.transformer.h.0.attn.c_attn.weight" in {name for name, _ in routed.muon}


# -- from run.yaml ----------------------------------------------------------------------------


def losses(run_directory: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_directory / "metrics.jsonl").open()]
    return {record["step"]: record["loss"] for record in records}


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step hf_causal_lm run from run.yaml: checkpoints and evaluation every 2 steps."""
    tmp_path = tmp_path_factory.mktemp("hf_run")
    config = run_config(tmp_path, {"name": "hf_causal_lm", "options": {"config": LLAMA}})
    fit = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr
    return config


def test_speedtronic_evaluate_scores_an_hf_causal_lm_run(hf_run: Path) -> None:
    records = [json.loads(line) for line in (hf_run.parent / "run" / "metrics.jsonl").open()]
    trained = {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r}
    assert sorted(trained) == [2, 4] and trained[4] < trained[2]
    evaluated = run_cli("evaluate", "--config", str(hf_run), cwd=hf_run.parent)
    assert evaluated.returncode == 0, evaluated.stderr
    match = re.match(r"eval/loss=(\S+) ", evaluated.stdout)
    assert match is not None and float(match.group(1)) == trained[4]
    validate = run_cli("validate", "--config", str(hf_run), cwd=hf_run.parent)
    assert validate.returncode == 0, validate.stderr
    assert "LlamaForCausalLM" in validate.stdout


def test_an_hf_causal_lm_run_resumes_exactly(hf_run: Path) -> None:
    directory = hf_run.parent
    split = ("fit", "--config", str(hf_run), "--output-dir", str(directory / "split"))
    assert run_cli(*split, "--max-steps", "2", cwd=directory).returncode == 0
    resumed = run_cli(*split, "--resume", cwd=directory)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(directory / "split") == losses(directory / "run")  # bit for bit
    model = build_hf_causal_lm(config=LLAMA, vocab_size=VOCAB)
    assert find_shard_blocks(model) == list(model.hf.model.layers)  # FSDP's units


def test_a_hub_id_is_refused_without_a_download(tmp_path: Path) -> None:
    for name in ("meta-llama/Llama-2-7b", "missing/config.json"):
        config = run_config(tmp_path, {"name": "hf_causal_lm", "options": {"config": name}})
        result = run_cli("fit", "--config", str(config), cwd=tmp_path)
        assert result.returncode == 2
        message = cli_error(result.stderr)
        assert f"model.options.config: {name!r} is not a local file or directory" in message
        assert "never downloads" in message


def test_a_missing_hf_extra_names_the_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # ``import transformers`` fails
    with pytest.raises(HFModelError, match=re.escape('pip install "speedtronic[hf]"')):
        build_hf_causal_lm(config=LLAMA)
    config = run_config(tmp_path, {"name": "hf_causal_lm", "options": {"config": LLAMA}})
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert 'needs transformers, part of the hf extra: pip install "speedtronic[hf]"' in (
        cli_error(result.stderr)
    )


class _RunsCode:
    """Unpickling this touches a marker file: what loading pickle weights could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.marker,)


def test_pickle_weights_are_refused_unopened(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": VOCAB}))
    marker = tmp_path / "code-ran"
    (base / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(marker)))
    options = {"init_weights_from": str(base)}
    config = run_config(tmp_path, {"name": "hf_causal_lm", "options": options})
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    message = cli_error(result.stderr)
    assert "holds only pickle-format weights (pytorch_model.bin), which are never loaded" in (
        message
    )
    assert not marker.exists()


def test_a_vocabulary_that_does_not_fit_names_both_numbers(tmp_path: Path) -> None:
    options = {"config": {**LLAMA, "vocab_size": 100}}
    config = run_config(tmp_path, {"name": "hf_causal_lm", "options": options})
    result = run_cli("validate", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    message = cli_error(result.stderr)
    assert f"model.vocab_size: {VOCAB} but model.options.config has vocab_size 100" in message


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_init_weights_from_refuses_a_non_float_tensor_for_a_float_parameter(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    # Issue 30: load_state_dict converted int64 / bool tensors into the float weights
    # without a word.
    import safetensors.torch

    base = tmp_path / "base"
    tiny_llama().save_pretrained(str(base))
    weights = safetensors.torch.load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"], dtype=dtype)
    safetensors.torch.save_file(weights, str(base / "model.safetensors"))
    config = run_config(
        tmp_path, {"name": "hf_causal_lm", "options": {"init_weights_from": str(base)}}
    )
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    have = str(dtype).removeprefix("torch.")
    assert (
        f"model.options.init_weights_from: tensor model.norm.weight in {base}/model.safetensors "
        f"is {have}, not floating point, for the float32 parameter of that name"
    ) in cli_error(result.stderr)
    assert not list((tmp_path / "run").rglob("step_*"))  # it never trained


def test_an_unknown_model_type_is_named_with_near_matches(tmp_path: Path) -> None:
    # Issue 30: transformers' own message lists every model type it knows (12 KB, one line).
    for model_type, hint in (("lama", "(near matches: llama"), ("zzzzqqq", "types, none close)")):
        options = {"config": {**LLAMA, "model_type": model_type}}
        config = run_config(tmp_path, {"name": "hf_causal_lm", "options": options})
        result = run_cli("validate", "--config", str(config), cwd=tmp_path)
        assert result.returncode == 2
        message = cli_error(result.stderr)
        assert (
            f"model.options.config: model_type {model_type!r} is not a transformers model type "
            in message
        )
        assert hint in message and len(message) < 300, message


def test_a_fifo_named_as_the_config_is_refused_not_waited_on(tmp_path: Path) -> None:
    # Issue 30.6 (every file a run opens by name): reading a FIFO blocks forever.
    import os

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    config = run_config(tmp_path, {"name": "hf_causal_lm", "options": {"config": str(fifo)}})
    result = run_cli("validate", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert f"model.options.config: {fifo} is not a regular file" in cli_error(result.stderr)
