"""The parts of the composition root (``speedtronic.runtime``), one concept a module:
``run_callbacks``, the callbacks of a run and what they ask of it; ``trainer_settings``, a
run's ``TrainerSettings`` from its config. They sit below the runtime, which composes a run
from them, and below the 2.0 layer (2.0's ``Trainer(config=...)`` resolves its settings with
``trainer_settings``), above the engine; they never import the 2.0 layer."""
