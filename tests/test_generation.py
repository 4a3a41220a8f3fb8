"""``generate``: the reference transformer's KV cache gives the logits and tokens of the full
forward; sampling is deterministic under a seed; the HF path uses ``generate()``; the CLI
prints the decoded continuation and refuses what does not fit (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic.models import decoding
from speedtronic.models.decoding import lean_decoder
from speedtronic.models.generation import GenerationError, Sampling, generate_ids
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.runtime import train_from_config
from tests.cli_runner import run_cli
from tests.text_runs import text_run_config

PROMPT = [5, 9, 2, 7, 1]


@pytest.fixture(scope="module")
def model() -> ReferenceTransformer:
    torch.manual_seed(0)
    net = ReferenceTransformer(
        vocab_size=48, block_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32
    )
    with torch.no_grad():  # a larger spread than the 0.02 init: greedy picks vary
        for param in net.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    return net.eval()


def test_cached_logits_equal_the_full_forward_in_any_chunking(
    model: ReferenceTransformer,
) -> None:
    ids = torch.randint(0, 48, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)["logits"]
        cache = model.new_kv_cache(2)
        parts = [model.forward_cached(ids[:, a:b], cache) for a, b in ((0, 9), (9, 14), (14, 15))]
        parts += [model.forward_cached(ids[:, t : t + 1], cache) for t in range(15, 24)]
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_greedy_is_the_same_with_and_without_the_cache(model: ReferenceTransformer) -> None:
    greedy = Sampling(max_new_tokens=40, temperature=0.0)
    cached = generate_ids(model, PROMPT, greedy)
    recomputed = generate_ids(model, PROMPT, greedy, use_cache=False)
    assert cached == recomputed
    assert len(cached) == 40 and len(set(cached)) > 3  # a real sequence, not one token


def test_sampling_is_deterministic_under_a_seed(model: ReferenceTransformer) -> None:
    def sample(seed: int, use_cache: bool = True) -> list[int]:
        sampling = Sampling(max_new_tokens=30, temperature=1.0, top_k=10, seed=seed)
        return generate_ids(model, PROMPT, sampling, use_cache=use_cache)

    state = torch.get_rng_state()
    first = sample(3)
    assert sample(3) == first
    assert sample(3, use_cache=False) == first
    assert sample(4) != first
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is untouched


def test_top_k_one_is_greedy_and_stop_ids_end_early(model: ReferenceTransformer) -> None:
    greedy = generate_ids(model, PROMPT, Sampling(max_new_tokens=20, temperature=0.0))
    top1 = generate_ids(model, PROMPT, Sampling(max_new_tokens=20, top_k=1, seed=9))
    assert top1 == greedy
    stop = Sampling(max_new_tokens=20, temperature=0.0, stop_ids=(greedy[3],))
    assert generate_ids(model, PROMPT, stop) == greedy[: greedy.index(greedy[3]) + 1]


@pytest.mark.parametrize("rotation", [True, False], ids=["rotation-matrix", "elementwise"])
def test_lean_decoder_steps_give_the_cached_forward_logits(
    model: ReferenceTransformer, rotation: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not rotation:
        monkeypatch.setattr(decoding, "ROTATION_BUDGET", 0)
    ids = torch.randint(0, 48, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        reference = model.new_kv_cache(2)
        expected = model.forward_cached(ids, reference)[:, 8:]
        cache = model.new_kv_cache(2)
        model.forward_cached(ids[:, :8], cache)
        decoder = lean_decoder(model, cache)
        assert decoder is not None and (decoder.rotation is not None) == rotation
        steps = [decoder.step(ids[:, t : t + 1]) for t in range(8, 20)]  # positions 8..19
    torch.testing.assert_close(torch.stack(steps, 1), expected, rtol=1e-5, atol=1e-5)
    assert cache.length == 20
    for index in range(2):
        torch.testing.assert_close(cache.keys[index][:, :, :20], reference.keys[index][:, :, :20])


def test_a_stop_id_past_the_first_check_ends_generation_there(
    model: ReferenceTransformer,
) -> None:
    greedy = generate_ids(model, PROMPT, Sampling(max_new_tokens=56, temperature=0.0))
    late = next(i for i in range(33, 56) if greedy[i] not in greedy[:i])  # first seen past 32
    stop = Sampling(max_new_tokens=56, temperature=0.0, stop_ids=(greedy[late],))
    assert generate_ids(model, PROMPT, stop) == greedy[: late + 1]


def test_an_adapted_model_decodes_through_its_modules(model: ReferenceTransformer) -> None:
    from speedtronic.config.sections import LoraAdapterConfig
    from speedtronic.models.adapters import apply_lora

    pytest.importorskip("peft")
    torch.manual_seed(0)
    net = ReferenceTransformer(vocab_size=48, block_size=64, n_layer=1, n_head=2, d_model=16)
    apply_lora(net, LoraAdapterConfig(r=2, alpha=4.0, targets=["q_proj"]))
    with torch.no_grad():
        for name, param in net.named_parameters():
            if "lora_B" in name or param.dim() == 2:
                param.normal_(0.0, 0.3)
    assert lean_decoder(net, net.new_kv_cache(1)) is None  # the adapters must run
    greedy = Sampling(max_new_tokens=12, temperature=0.0)
    assert generate_ids(net, PROMPT, greedy) == generate_ids(net, PROMPT, greedy, use_cache=False)


def test_a_prompt_that_does_not_fit_is_refused(model: ReferenceTransformer) -> None:
    with pytest.raises(GenerationError, match="longer than the model's context of 64"):
        generate_ids(model, list(range(65)), Sampling(max_new_tokens=1))
    with pytest.raises(GenerationError, match="at most 4 new tokens"):
        generate_ids(model, list(range(60)), Sampling(max_new_tokens=5))


def test_hf_generate_greedy_is_the_same_with_and_without_its_cache() -> None:
    pytest.importorskip("transformers")
    from speedtronic.models.hf import build_hf_causal_lm
    from tests.hf_helpers import LLAMA

    torch.manual_seed(0)
    model = build_hf_causal_lm(config=dict(LLAMA), vocab_size=64)
    greedy = Sampling(max_new_tokens=12, temperature=0.0)
    cached = generate_ids(model, PROMPT, greedy)
    assert cached == generate_ids(model, PROMPT, greedy, use_cache=False)
    # The HF path's greedy tokens are the argmax of the model's own logits.
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        first = int(model(ids)["logits"][0, -1].argmax())
    assert cached[0] == first
    sampled = Sampling(max_new_tokens=12, temperature=1.0, seed=5)
    assert generate_ids(model, PROMPT, sampled) == generate_ids(model, PROMPT, sampled)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = text_run_config(tmp_path_factory.mktemp("generate"))
    train_from_config(config)
    return config


def test_generate_prints_the_decoded_continuation(text_run: Path) -> None:
    argv = ("generate", "--config", str(text_run), "--prompt", "the cat", "--max-new-tokens")
    greedy = run_cli(*argv, "12", "--temperature", "0", cwd=text_run.parent)
    assert greedy.returncode == 0, greedy.stderr
    assert greedy.stdout.startswith("the cat") and greedy.stdout.endswith("\n")
    again = run_cli(*argv, "12", "--temperature", "0", cwd=text_run.parent)
    assert again.stdout == greedy.stdout
    sampled = run_cli(*argv, "12", "--seed", "1", cwd=text_run.parent)
    assert sampled.returncode == 0 and sampled.stdout.startswith("the cat")


def test_generate_refuses_what_does_not_fit(text_run: Path, tmp_path: Path) -> None:
    base = ("generate", "--config", str(text_run))
    long = run_cli(*base, "--prompt", "x" * 40, cwd=text_run.parent)
    assert long.returncode == 2
    assert "--prompt: the prompt is 40 tokens, longer than the model's context of 32" in (
        long.stderr
    )
    much = run_cli(*base, "--prompt", "the", "--max-new-tokens", "40", cwd=text_run.parent)
    assert much.returncode == 2 and "--max-new-tokens:" in much.stderr
    assert "Traceback" not in long.stderr + much.stderr


def test_generate_on_synthetic_tokens_is_refused(tmp_path: Path) -> None:
    from tests.hf_helpers import run_config

    config = run_config(tmp_path, {"name": "reference_transformer", "d_model": 16})
    result = run_cli("generate", "--config", str(config), "--prompt", "hi", cwd=tmp_path)
    assert result.returncode == 2
    assert "synthetic tokens, which have no text" in result.stderr
