"""The ``speedtronic`` command end to end with its exit codes, run in this process
(``cli_runner``; ``test_cli_namespaces.py`` covers the real launchers)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import ClassVar, TypeVar

import pytest
import yaml
from cli_runner import run_cli as speedtronic

from speedtronic import Callback
from speedtronic.plugins import (
    PluginOptions,
    PluginSpec,
    SectionData,
    Sections,
    callback_registry,
    register_plugin,
)

T = TypeVar("T")

TINY = {
    "run": {"name": "cli", "device": "cpu", "max_steps": 4, "seed": 3},
    "model": {
        "vocab_size": 32,
        "max_seq_len": 8,
        "n_layer": 1,
        "n_head": 2,
        "d_model": 16,
        "d_ff": 32,
    },
    "data": {
        "synthetic_kind": "learnable",
        "num_tokens": 64,
        "micro_batch_size": 2,
        "target_batch_size": 4,
    },
    "optimizer": {"lr": 0.01},
    "logging": {"every_steps": 2},
    "checkpoint": {"every_steps": 2},
    "distributed": {"token": "hf_supersecret"},
}


@pytest.fixture()
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_fit_writes_run_directory_and_summary(config_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "completed steps=4 samples=16 tokens=128 loss=" in done.stdout
    assert "step 2/4" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    saved = (out / "config.yaml").read_text()
    assert "hf_supersecret" not in saved and "<redacted>" in saved
    assert (out / "checkpoints" / "latest.json").is_file()

    resumed = speedtronic(
        "fit",
        "--config",
        str(config_file),
        "--output-dir",
        str(out),
        "--max-steps",
        "6",
        "--resume",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "completed steps=6 samples=24" in resumed.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]


def test_train_alias_and_set_override(config_file: Path, tmp_path: Path) -> None:
    done = speedtronic(
        "train",
        "--config",
        str(config_file),
        "--set",
        "run.max_steps=2",
        "--set",
        f"run.output_dir={tmp_path / 'o2'}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "completed steps=2" in done.stdout


def test_validate_prints_redacted_config_and_plan(config_file: Path, tmp_path: Path) -> None:
    done = speedtronic("validate", "--config", str(config_file), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "hf_supersecret" not in done.stdout and "<redacted>" in done.stdout
    assert "# callbacks: console, jsonl, checkpoint" in done.stdout
    assert "metrics" in done.stdout and "console -> jsonl" in done.stdout
    assert "optimizer routing" in done.stdout
    assert "transformer.wte.weight (= lm_head.weight)" in done.stdout  # tied weight listed once
    muon = speedtronic(
        "validate", "--config", str(config_file), "--set", "optimizer.name=muon", cwd=tmp_path
    )
    assert muon.returncode == 0, muon.stderr
    assert "attn.q_proj.weight" in muon.stdout and "muon: 7 tensors" in muon.stdout
    as_json = speedtronic(
        "validate", "--config", str(config_file), "--format", "json", cwd=tmp_path
    )
    assert json.loads(as_json.stdout.split("\n# callbacks")[0])["run"]["name"] == "cli"


def test_validate_lists_every_error_with_exit_2(tmp_path: Path) -> None:
    bad = dict(TINY, optimizer={"lr": -1}, data={"micro_batch_size": 3, "target_batch_size": 4})
    bad["run"] = dict(TINY["run"], nmae="typo")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    done = speedtronic("validate", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("speedtronic: error:")
    assert "optimizer.lr" in done.stderr
    assert "nmae" in done.stderr
    assert "target_batch_size" in done.stderr


def test_user_mistakes_exit_2_without_traceback(tmp_path: Path) -> None:
    missing = speedtronic("fit", "--config", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert missing.returncode == 2 and "not found" in missing.stderr
    path = tmp_path / "plugin.yaml"
    path.write_text(yaml.safe_dump(dict(TINY, callbacks=[{"name": "no_such_plugin"}])))
    unknown = speedtronic("fit", "--config", str(path), cwd=tmp_path)
    assert unknown.returncode == 2 and "no_such_plugin" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    syntax = speedtronic("validate", "--config", str(broken), cwd=tmp_path)
    assert syntax.returncode == 2 and "Traceback" not in syntax.stderr


def test_schema_and_plugins(tmp_path: Path) -> None:
    schema = speedtronic("schema", cwd=tmp_path)
    assert schema.returncode == 0
    document = json.loads(schema.stdout)
    assert document["$schema"].startswith("https://json-schema.org/draft/2020-12")
    plugins = speedtronic("plugins", cwd=tmp_path)
    assert plugins.returncode == 0
    for name in ("reference_transformer", "learnable", "checkpoint", "console", "tensorboard"):
        assert name in plugins.stdout
    assert "entry point speedtronic_callbacks.checkpoint:CheckpointCallback" in plugins.stdout


def test_user_plugin_via_imports(tmp_path: Path) -> None:
    (tmp_path / "my_plugins.py").write_text(
        "from speedtronic import Callback, register_callback\n"
        "@register_callback('hello')\n"
        "class Hello(Callback):\n"
        "    options_schema = {'type': 'object', 'additionalProperties': False,\n"
        "                      'properties': {'greeting': {'type': 'string'}}}\n"
        "    def __init__(self, greeting: str = 'hi') -> None:\n"
        "        self.greeting = greeting\n"
        "    def on_fit_start(self, trainer, ctx):\n"
        "        print('HELLO', self.greeting)\n"
    )
    config = dict(TINY, imports=["my_plugins"], callbacks=[{"name": "hello", "greeting": "yo"}])
    config["run"] = dict(TINY["run"], max_steps=1, output_dir=str(tmp_path / "o"))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    done = speedtronic("fit", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "HELLO yo" in done.stdout
    wrong = dict(config, callbacks=[{"name": "hello", "greeting": 5}])
    path.write_text(yaml.safe_dump(wrong))
    invalid = speedtronic("validate", "--config", str(path), cwd=tmp_path)
    assert invalid.returncode == 2 and "callbacks[0].greeting" in invalid.stderr


def test_a_typod_hook_in_an_imported_callback_exits_2_naming_its_line(tmp_path: Path) -> None:
    (tmp_path / "my_plugins.py").write_text(
        "from speedtronic import Callback, register_callback\n"
        "@register_callback('typo')\n"
        "class Typo(Callback):\n"
        "    def on_step_ended(self, trainer, ctx):\n"
        "        pass\n"
    )
    config = dict(TINY, imports=["my_plugins"], callbacks=[{"name": "typo"}])
    config["run"] = dict(TINY["run"], max_steps=1, output_dir=str(tmp_path / "o"))
    config["scheduler"] = {"warmup_steps": 0}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    for command in ("validate", "fit"):
        done = speedtronic(command, "--config", str(path), cwd=tmp_path)
        assert done.returncode == 2, (command, done.stderr)
        (line,) = done.stderr.splitlines()  # one line, no traceback
        assert line.startswith("speedtronic: error: callback "), command
        assert f"defines 'on_step_ended' (at {tmp_path / 'my_plugins.py'}:4)" in line
        assert "did you mean 'on_step_end'?" in line
    # it stopped before training: no config copy, metrics or checkpoints
    assert not {"config.yaml", "metrics.jsonl", "checkpoints"} & set(os.listdir(tmp_path / "o"))


def test_two_callbacks_with_one_state_key_exit_2(config_file: Path, tmp_path: Path) -> None:
    twice = "callbacks=[{name: nan_guard}, {name: nan_guard}]"
    done = speedtronic("fit", "--config", str(config_file), "--set", twice, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "speedtronic: error: callbacks 'nan_guard' and 'nan_guard' both use state_key "
        "'nan_guard'; give one of them another state_key"
    )


def test_stop_and_resume_from_the_cli_is_bitwise_identical(tmp_path: Path) -> None:
    """The issue's user story: --max-steps 6, then --max-steps 12 --resume, equals one
    uninterrupted 12-step run, loss for loss (shuffled data, K=2, dropout)."""
    config = dict(
        TINY,
        model=dict(TINY["model"], dropout=0.1),
        data=dict(TINY["data"], shuffle=True),
        logging={"every_steps": 1},
        checkpoint={"every_steps": 4},
        scheduler={"warmup_steps": 3},
    )
    config["run"] = dict(TINY["run"], max_steps=12)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))

    def losses(out: Path) -> list[float]:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    straight = speedtronic(
        "fit", "--config", str(path), "--output-dir", str(tmp_path / "a"), cwd=tmp_path
    )
    assert straight.returncode == 0, straight.stderr
    first = speedtronic(
        "fit",
        "--config",
        str(path),
        "--output-dir",
        str(tmp_path / "b"),
        "--max-steps",
        "6",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    second = speedtronic(
        "fit",
        "--config",
        str(path),
        "--output-dir",
        str(tmp_path / "b"),
        "--max-steps",
        "12",
        "--resume",
        cwd=tmp_path,
    )
    assert second.returncode == 0, second.stderr
    assert len(losses(tmp_path / "a")) == 12
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


class _SectionProbe(Callback):
    """A plugin that reads a section of its own: its 2.0-section adapter (normalise, the
    section rules, the section -> options step) counts its runs."""

    runs: ClassVar[list[str]] = []


def _section_probe_spec() -> PluginSpec:
    def normalise(data: dict[str, object]) -> None:
        _SectionProbe.runs.append("normalise")

    def errors(sections: SectionData) -> Iterator[str]:
        _SectionProbe.runs.append("errors")
        return iter(())

    def to_options(
        sections: SectionData, options: Mapping[str, object] | None
    ) -> PluginOptions | None:
        _SectionProbe.runs.append("to_options")
        return None  # never built: only the passes are counted

    section = {"type": "object", "additionalProperties": False, "properties": {}}
    return PluginSpec(
        name="test-section-probe",
        callback=_SectionProbe,
        sections=Sections(
            keys=("probe_section",),
            schema={"probe_section": section},
            to_options=to_options,
            normalise=normalise,
            errors=errors,
        ),
    )


def test_a_cli_fit_normalises_validates_and_imports_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pass each (issue 24; before it, 5 whole-config validations, 11 of single
    sections, 6 imports and 2 plugin rewrites of a fit): reading the config, preflight,
    building the runtime, the callbacks, the logger and the trainer check nothing again.
    Counted: the composed-schema pass, the normalisation (with its case folds), every
    plugin's section adapter, and the import of ``imports:``."""
    import speedtronic.config.loading as loading
    import speedtronic.config.sections as sections
    import speedtronic.config.validation as schema
    import speedtronic.plugins as plugins

    calls: dict[str, list[object]] = {"schema": [], "normalise": [], "folds": [], "imports": []}

    def counted(name: str, function: Callable[..., T]) -> Callable[..., T]:
        def wrapper(*args: object) -> T:
            calls[name].append(args[-1])
            return function(*args)

        return wrapper

    monkeypatch.setattr(schema, "_schema_errors", counted("schema", schema._schema_errors))
    monkeypatch.setattr(sections, "normalise", counted("normalise", sections.normalise))
    monkeypatch.setattr(loading, "_fold_values", counted("folds", loading._fold_values))
    monkeypatch.setattr(plugins, "import_modules", counted("imports", plugins.import_modules))
    (tmp_path / "fit_probe.py").write_text("PROBE = 1\n")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY, "imports": ["fit_probe"], "probe_section": {}}))
    _SectionProbe.runs.clear()
    register_plugin(_section_probe_spec())
    try:
        done = speedtronic("fit", "--config", str(path), "--output-dir", "out", cwd=tmp_path)
    finally:
        callback_registry.unregister("test-section-probe")
    assert done.returncode == 0, done.stderr
    assert len(calls["schema"]) == 1
    assert len(calls["normalise"]) == 1
    assert len(calls["folds"]) == 1
    assert calls["imports"] == [["fit_probe"]]
    assert sorted(_SectionProbe.runs) == ["errors", "normalise", "to_options"]


FOLDING_PLUGIN = '''
from speedtronic import Callback, register_callback


@register_callback("test-folding-probe")
class FoldingProbe(Callback):
    """Reads a section of its own whose one key is case-insensitive (2.0-style API)."""

    legacy_sections = ("fold_probe",)
    legacy_schema = {
        "fold_probe": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"mode": {"enum": ["fast", "slow"]}},
        }
    }

    @classmethod
    def normalise_legacy(cls, data):
        section = data.get("fold_probe")
        if isinstance(section, dict) and isinstance(section.get("mode"), str):
            section["mode"] = section["mode"].lower()
'''


def test_a_plugin_from_imports_rewrites_its_own_keys_in_the_one_pass(tmp_path: Path) -> None:
    """The config's ``imports:`` are imported before it is normalised: a plugin they
    register folds its own section's keys before the one validation (``FAST`` -> ``fast``),
    and a value it cannot fold is still reported with its path."""
    (tmp_path / "folding_plugin.py").write_text(FOLDING_PLUGIN)
    path = tmp_path / "run.yaml"
    config = {**TINY, "imports": ["folding_plugin"], "fold_probe": {"mode": "FAST"}}
    path.write_text(yaml.safe_dump(config))
    done = speedtronic("validate", "--config", str(path), "--format", "json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.split("\n# callbacks")[0])["fold_probe"] == {"mode": "fast"}
    path.write_text(yaml.safe_dump({**config, "fold_probe": {"mode": "Quick"}}))
    bad = speedtronic("validate", "--config", str(path), cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "fold_probe.mode: 'quick' is not one of ['fast', 'slow']" in bad.stderr
