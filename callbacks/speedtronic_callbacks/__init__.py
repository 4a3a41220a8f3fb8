"""The built-in callbacks, one feature per module (``speedtronic_callbacks.checkpoint``, ...).

Each is a ``speedtronic.callback.Callback`` plugin found through the
``speedtronic.callbacks`` entry-point group, exactly like a third-party plugin. Nothing is
imported here: importing ``callbacks`` costs nothing, and a run loads only the features its
config names.
"""
