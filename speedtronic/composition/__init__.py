"""The parts of the composition root (``speedtronic.runtime``), one concept a module:
``run_callbacks``, the callbacks of a run and what they ask of it. They sit below the
runtime, which composes a run from them, and above the engine and the 2.0 layer they never
import."""
