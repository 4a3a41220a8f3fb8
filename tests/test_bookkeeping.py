"""Export and bookkeeping details of issue 36, item 8, through real processes (forked,
tests/forked.py): the exported ``config.json`` takes its token ids from the run's tokenizer
(Llama's default ``bos_token_id`` 1 is an ordinary token of it) and warns only about an id
the model's config set itself; ``plot`` marks a resume at the step it resumed from; and
``validate`` refuses two callbacks with one ``state_key`` as ``fit`` does. (The 2-rank
``latest.json`` loss is checked in test_eval_ranks.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import yaml
from cli_runner import run_cli
from forked import Forked, cli_main
from hf_helpers import LLAMA
from test_export import prepare_shards, token_run, token_workspace
from test_plot import RUN, lines_of
from token_data import BPE_VOCAB

from speedtronic.plotting import draw_run


def write_run(tmp_path: Path, *, max_steps: int = 8, callbacks: object = ()) -> None:
    """test_plot's run as ``run.yaml`` (into ``out``), with ``callbacks``."""
    run = {**cast("dict[str, object]", RUN["run"]), "output_dir": "out", "max_steps": max_steps}
    config = {**RUN, "run": run, "callbacks": list(cast("list[object]", callbacks))}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))


def test_export_takes_the_token_ids_of_the_runs_tokenizer(forked: Forked, tmp_path: Path) -> None:
    workspace = token_workspace(tmp_path)
    shards = prepare_shards(workspace, "shards", "--eval-fraction", "0")
    data: dict[str, object] = {"tokens": str(shards)}
    llama: dict[str, object] = {**LLAMA, "vocab_size": BPE_VOCAB}  # default ids: bos 1, eos 2
    model: dict[str, object] = {"name": "hf_causal_lm", "options": {"config": llama}}
    reference = token_run(workspace, data, model).rename(workspace / "reference.yaml")
    assert run_cli("fit", "--config", str(reference), cwd=workspace).returncode == 0
    llama = {**llama, "eos_token_id": 5}  # set by the user
    own = token_run(workspace, data, {"name": "hf_causal_lm", "options": {"config": llama}})
    mine = ("--config", str(own), "--output-dir", "own-run")
    assert run_cli("fit", *mine, cwd=workspace).returncode == 0
    children = [
        forked.start(cli_main, "export", *argv, cwd=workspace)
        for argv in (("--config", str(reference), "--output", "hf"), (*mine, "--output", "own"))
    ]
    assert [child.wait(timeout=120) for child in children] == [0, 0], children[0].output
    assert "warning" not in children[0].output  # no id of its config was the user's
    fields = json.loads((workspace / "hf" / "config.json").read_text())
    assert (fields["eos_token_id"], fields["bos_token_id"]) == (0, None)
    assert fields.get("pad_token_id") is None
    assert (
        "warning: config.json: eos_token_id 5 of the model's config replaced by 0, the id the "
        "run's data uses (data.tokens)" in children[1].output
    )
    fields = json.loads((workspace / "own" / "config.json").read_text())
    assert (fields["eos_token_id"], fields["bos_token_id"]) == (0, None)


def test_plot_marks_a_resume_at_the_step_it_resumed_from(forked: Forked, tmp_path: Path) -> None:
    # Logged every 2 steps, saved at 7; the record of step 7 is lost (a run stopped between
    # its checkpoint and its log line), so the last step logged before the resume is 6. The
    # resumed fit's first record (step 8, one step in) restarts elapsed_s well below step 6's.
    write_run(tmp_path, max_steps=10)
    child = forked.start(cli_main, "fit", "--config", "run.yaml", "--max-steps", "7", cwd=tmp_path)
    assert child.wait(timeout=120) == 0, child.output
    metrics = tmp_path / "out" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6, 7]
    metrics.write_text("".join(lines[:-1]))
    child = forked.start(cli_main, "fit", "--config", "run.yaml", "--resume", cwd=tmp_path)
    assert child.wait(timeout=120) == 0, child.output
    child = forked.start(cli_main, "plot", "out", cwd=tmp_path)
    assert child.wait(timeout=120) == 0, child.output
    loss = lines_of(draw_run(tmp_path / "out").axes[0])
    assert [label for label in loss if label.startswith("resumed")] == ["resumed at 7"]
    assert loss["resumed at 7"][0] == [7, 7]


def test_validate_refuses_two_callbacks_with_one_state_key_as_fit_does(
    forked: Forked, tmp_path: Path
) -> None:
    guards = [{"name": "nan_guard", "action": "stop"}, {"name": "nan_guard", "action": "skip"}]
    write_run(tmp_path, callbacks=guards)
    children = [
        forked.start(cli_main, command, "--config", "run.yaml", cwd=tmp_path)
        for command in ("validate", "fit")
    ]
    assert [child.wait(timeout=120) for child in children] == [2, 2]
    line = (
        "speedtronic: error: callbacks 'nan_guard' and 'nan_guard' both use state_key "
        "'nan_guard'; give one of them another state_key"
    )
    for child in children:
        assert line in child.output and "Traceback" not in child.output
    assert "# OK" not in children[0].output
