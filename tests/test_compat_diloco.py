"""The original (2.0) DiLoCo API and configs, issue 15 items 3, 4 and 6: the names of 2.0's
``speedtronic.distributed``, ``HubClient``'s 2.0 signature, the ``distributed:`` keys (used or
refused at validation, never ignored), and a master continuing a hub written by 2.0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.plugins import PluginContext
from speedtronic.runtime import build_callbacks
from speedtronic_callbacks.diloco import DiLoCoCallback, HubTransport


def _enabled(**keys: object) -> dict[str, object]:
    return {"distributed": {"enabled": True, "repo_id": "team/run", **keys}}


# -- item 4: distributed: keys ---------------------------------------------------------------


def test_distributed_token_is_used_for_the_hub_and_never_shown(tmp_path: Path) -> None:
    config = SpeedtronicConfig.from_dict(_enabled(token="hf_secret_token"))
    context = PluginContext(config=config, output_dir=tmp_path, device=torch.device("cpu"))
    (diloco,) = [cb for cb in build_callbacks(config, context) if isinstance(cb, DiLoCoCallback)]
    assert diloco.options.token == "hf_secret_token"
    transport = diloco._build_transport().inner
    assert isinstance(transport, HubTransport)
    assert transport._token() == "hf_secret_token"  # used instead of $HF_TOKEN
    assert "hf_secret_token" not in repr(diloco.options)
    assert "hf_secret_token" not in config.to_yaml(redact_secrets=True)
    assert "hf_secret_token" not in str(transport._fail("put x", ValueError("hf_secret_token")))


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("collaborators", ["alice"], "organization"),
        ("cache_dir", "/tmp/cache", "into memory"),
        ("state_dir", "state", "checkpoint.directory"),
        ("async_delta_upload", False, "mode: collective"),
        ("async_global_poll", False, "mode: collective"),
    ],
)
def test_2_0_keys_without_a_counterpart_are_refused_at_validate(
    key: str, value: object, instead: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict(_enabled(**{key: value}))
    message = str(caught.value)
    assert f"distributed.{key}" in message and "not supported" in message
    assert instead in message
    # the values that mean what the plugin does anyway, and a disabled section, are fine
    SpeedtronicConfig.from_dict(_enabled(async_delta_upload=True, cache_dir=".speedtronic/hub"))
    SpeedtronicConfig.from_dict({"distributed": {"enabled": False, key: value}})
