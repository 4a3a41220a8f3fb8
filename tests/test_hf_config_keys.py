"""An unknown key in ``model.options.config`` of ``hf_causal_lm`` (issue 36, item 1): a typo
such as ``hiden_size`` would build the model at the config class's default width, so
``validate`` and ``fit`` stop with exit 2 and the closest field; ``extra_config_keys`` lets a
custom config class's own keys through. Through real processes (forked, tests/forked.py)."""

from __future__ import annotations

from pathlib import Path

from forked import Forked, cli_main
from hf_helpers import LLAMA, run_config


def test_a_typo_in_an_hf_config_key_stops_validate_and_fit(forked: Forked, tmp_path: Path) -> None:
    typo = run_config(
        tmp_path, {"name": "hf_causal_lm", "options": {"config": {**LLAMA, "hiden_size": 8}}}
    )
    opted_out = run_config(
        tmp_path,
        {
            "name": "hf_causal_lm",
            "options": {
                "config": {**LLAMA, "my_routing_table": [1, 2]},
                "extra_config_keys": ["my_routing_table"],
            },
        },
        name="custom",
    )
    children = [
        forked.start(cli_main, "validate", "--config", str(typo), cwd=tmp_path),
        forked.start(cli_main, "fit", "--config", str(typo), cwd=tmp_path),
        forked.start(cli_main, "validate", "--config", str(opted_out), cwd=tmp_path),
    ]
    codes = [child.wait(timeout=120) for child in children]
    assert codes == [2, 2, 0], [child.output[-2000:] for child in children]
    for child in children[:2]:
        assert (
            "model.options.config: hiden_size (did you mean 'hidden_size'?) is not a "
            "LlamaConfig field" in child.output
        )
        assert "model.options.extra_config_keys" in child.output
        assert "Traceback" not in child.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # fit built nothing
    assert "LlamaForCausalLM" in children[2].output
