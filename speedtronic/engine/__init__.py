"""The engine: events, callbacks and their dispatch, the training state, the per-step loop,
the Trainer -- built from resolved values (it imports neither ``speedtronic.config`` nor the
2.0 layer in ``speedtronic.compat``)."""
