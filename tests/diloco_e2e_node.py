"""The node processes of ``tests/test_diloco_e2e.py``: one DiLoCo master or worker on a
directory hub, forked from the preloaded fork server (``tests/forked.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset

from speedtronic import Trainer
from speedtronic.data import LearnableLanguageDataset
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic_callbacks.diloco import DiLoCoCallback


def run_node(raw: str) -> None:
    """One node; ``raw`` holds its JSON arguments (``test_diloco_e2e.launch``). It writes
    ``<out>/result-<tag>.json`` and, when it ends, ``<hub>/../<tag>.done``."""
    args = json.loads(raw)
    hub, out = Path(args["hub"]), Path(args["out"])
    torch.manual_seed(0)
    model = ReferenceTransformer(vocab_size=32, block_size=16, n_layer=1, n_head=2, d_model=32)
    data = LearnableLanguageDataset(num_samples=1024, block_size=16, vocab_size=32, seed=7)
    loader = DataLoader(
        Subset(data, range(args["shard"], 1024, 3)),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(args["shard"]),
    )
    diloco = DiLoCoCallback(
        role=args["role"],
        node_id=args["node"],
        hub_dir=str(hub),
        inner_steps=10,
        poll_interval=0.2,
        retry_initial=0.05,
        retry_max=0.5,
        # Asynchronous rounds of mostly one delta each, in whatever order the three nodes
        # happen to run: outer momentum would amplify each round's single, stale delta and
        # make the final global depend on that order (with the default 0.9, the final
        # loss ranged from 2.5 to 3.98 against 3.46 untrained over a dozen runs). Without
        # it the outcome holds for every interleaving (1.60-1.79 measured). The default
        # momentum trains end to end in test_callback_in_trainers_syncs_resets_and_checkpoints.
        outer_momentum=0.0,
    )

    class Pace(Callback):
        # Tiny CPU steps take milliseconds; a short pause makes a step last about as long as
        # a hub round trip, so that nodes overlap in time as real ones would.
        def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
            time.sleep(args["pace"])

    class MasterStop(Callback):
        # Keep aggregating until every worker is done and its last delta was applied.
        def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
            done = all((hub.parent / f"{name}.done").exists() for name in args["wait_for"])
            pending = list((hub / "nodes").glob("w*/*.safetensors")) if done else [1]
            node = diloco.node
            if done and not pending and node is not None and not node.master_lane.busy:
                trainer.request_stop("workers finished")
            if time.monotonic() - started > args["deadline"]:
                trainer.request_stop("deadline")

    callbacks: list[Callback] = [diloco, Pace()]
    if args["role"] == "master":
        callbacks.append(MasterStop())
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        loader,
        callbacks=callbacks,
        output_dir=out,
        metrics_every=1,
    )
    if args.get("resume"):
        trainer.load_state_dict(torch.load(out / "state.pt", weights_only=False))
    started = time.monotonic()
    result = trainer.fit(args["steps"])
    torch.save(trainer.state_dict(), out / "state.pt")
    records = [
        {k: v for k, v in r.items() if k.startswith("diloco/") or k == "step"}
        for r in result.metrics
    ]
    assert diloco.node is not None
    summary = {
        "steps": result.steps,
        "stop_reason": result.stop_reason,
        "records": records,
        "uploads": diloco.node.stats.uploads,
        "unconfirmed": diloco.node.unconfirmed is not None,
    }
    (out / f"result-{args['tag']}.json").write_text(json.dumps(summary))
    (hub.parent / f"{args['tag']}.done").write_text("ok")
