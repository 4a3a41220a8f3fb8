"""The engine: events, callbacks and their dispatch, the per-step loop, the Trainer."""
