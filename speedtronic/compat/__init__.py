"""The original (2.0) API's shims, kept together outside the engine core.

* ``metric_logger`` -- ``MetricLogger``, its hooks and ``MetricLoggerCallback``
  (``Trainer(logger=...)``)
* ``hooks`` -- ``on_event``
* ``integrations`` -- ``WandbHook`` and ``TensorboardHook`` for ``MetricLogger(hooks=[...])``
* ``coordinator`` -- the ``SyncCoordinator`` protocol and its adapter (``Trainer(coordinator=...)``)
* ``trainer`` -- 2.0's trainer, the subclass ``speedtronic.Trainer(...)`` builds when given
  2.0's arguments (``config=`` defaults, ``logger=``, ``checkpoint_manager=``,
  ``coordinator=``, ``shape_report=``), and 2.0's members of any trainer (``logger``,
  ``provide_logger``, ``train``, ``resume``), reached through
  ``speedtronic.engine.compat_route``

The 2.0 import paths (``speedtronic.profiling``, ``speedtronic.hooks``,
``speedtronic.integrations``, ``speedtronic.trainer``) and the package re-export these names,
so 2.0 code keeps working unchanged. New code should use the callbacks in
``speedtronic_callbacks``.
"""
