"""The guard around code we do not own: ``sanitize()`` (one block, one thread, at torch's
dispatcher) and the process guard (every thread, from start-up: ``SAFEVIEW_GUARD``), with the
torch boundary they stand on. Its public modules are ``safeview.guard.sanitize`` and
``safeview.guard.process``; ``safeview.sanitize()`` is the first one's function.
"""
