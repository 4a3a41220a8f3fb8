"""Capture and restore every random number generator a run touches.

The captured state uses only tensors, ints, floats, strings, lists and dicts, so it
survives ``torch.load(weights_only=True)`` (no pickled objects in checkpoints).
"""

from __future__ import annotations

import operator
import os
import random
from collections.abc import Mapping

import numpy as np
import torch

_RNGState = dict[str, object]


def capture_rng_state() -> _RNGState:
    """Python ``random``, NumPy, torch CPU and every CUDA device."""
    version, internal, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: _RNGState = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: Mapping[str, object] | None) -> None:
    """Restore what ``capture_rng_state`` returned (missing parts are left alone)."""
    if not state:
        return
    py = state.get("python")
    if isinstance(py, Mapping):
        internal = tuple(int(v) for v in py["state"])
        random.setstate((int(py["version"]), internal, py["gauss"]))
    npy = state.get("numpy")
    if isinstance(npy, Mapping):
        keys = npy["keys"]
        keys_array = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state(
            (
                str(npy["kind"]),
                keys_array.astype(np.uint32),
                int(npy["pos"]),
                int(npy["has_gauss"]),
                float(npy["gauss"]),
            )
        )
    cpu = state.get("torch")
    if isinstance(cpu, torch.Tensor):
        torch.set_rng_state(cpu)
    cuda = state.get("cuda")
    if isinstance(cuda, list) and torch.cuda.is_available():
        for index, device_state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)


def seed_everything(seed: int) -> int:
    """Seed every random number generator a run uses: Python ``random``, NumPy's global
    generator, torch on the CPU and on every CUDA device (``PYTHONHASHSEED`` is set too, for
    subprocesses such as DataLoader workers started afterwards). ``seed`` is an int (or a
    NumPy integer); NumPy gets it modulo 2**32. Returns ``seed``. A run built from config
    calls it with ``run.seed`` first."""
    if isinstance(seed, bool):
        raise TypeError("seed must be an int, got bool")
    seed = operator.index(seed)  # ints and integer-like values (NumPy integers); else TypeError
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # the CPU generator and, lazily, every CUDA device's
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return seed
