"""lm-evaluation-harness on a speedtronic checkpoint: a local task YAML over a local JSONL
(no download) gives the accuracy speedtronic's own multiple-choice task gives; rolling
log-likelihood and generation answer as the harness expects."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: no network
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from speedtronic.config import load_config  # noqa: E402
from speedtronic.evaluation.tasks import MultipleChoiceTask, read_task  # noqa: E402
from speedtronic.evaluation.text import run_text  # noqa: E402
from speedtronic.lm_harness import SpeedtronicLM  # noqa: E402
from speedtronic.runtime import checkpoint_model, train_from_config  # noqa: E402
from tests.text_runs import text_run_config, write_rows  # noqa: E402

ROWS = [
    {"context": "the cat sat on the", "choices": ["mat.", "park.", "dog"], "answer": 0},
    {"context": "the dog ran in the", "choices": ["mat.", "park."], "answer": 1},
    {"context": "the cat", "choices": ["sat", "ran", "on"], "answer": 0},
    {"context": "on the", "choices": ["mat.", "cat"], "answer": 0},
    {"context": "the dog ran", "choices": ["in", "on the mat"], "answer": 0},
]

TASK_YAML = """\
task: speedtronic_animals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("harness")
    config = text_run_config(tmp_path, steps=6)
    train_from_config(config)
    write_rows(tmp_path / "animals.jsonl", ROWS)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "animals.jsonl"
    (tasks / "animals.yaml").write_text(TASK_YAML.format(data=data), encoding="utf-8")
    return config


def test_a_local_task_yaml_scores_as_the_multiple_choice_task(run: Path) -> None:
    model = SpeedtronicLM.from_run(str(run), batch_size=4)
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=["speedtronic_animals"],
        task_manager=TaskManager(include_path=str(run.parent / "tasks"), include_defaults=False),
        num_fewshot=0,
    )
    assert results is not None
    scores = results["results"]["speedtronic_animals"]
    cfg = load_config(run)
    _, net = checkpoint_model(cfg)
    own = MultipleChoiceTask(
        "animals",
        read_task(run.parent / "animals.jsonl"),
        run_text(cfg.data.to_dict()).encode,
        context=cfg.model.max_seq_len,
    )
    score = own.score(net, device=torch.device("cpu"))
    assert scores["acc,none"] == pytest.approx(score.acc)
    assert scores["acc_norm,none"] == pytest.approx(score.acc_norm)


def test_rolling_loglikelihood_and_generation(run: Path) -> None:
    model = SpeedtronicLM.from_run(str(run))
    text = "the cat sat on the mat. " * 3  # longer than the 32-token context: several windows
    rolling = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = model.text.encode(text)
    net = model.model
    with torch.no_grad():  # the first window by hand: eot, then the first 31 tokens
        window = torch.tensor([[model.eot, *ids[:31]]])
        logits = net(window)["logits"][0].log_softmax(-1)
        first = float(logits[torch.arange(32), torch.tensor(ids[:32])].sum())
    assert rolling[0] < first < 0  # every window adds a negative log-probability
    request = Instance("generate_until", {}, ("the cat", {"until": ["."], "max_gen_toks": 20}), 0)
    (written,) = model.generate_until([request])
    assert isinstance(written, str) and "." not in written and len(written) <= 20
