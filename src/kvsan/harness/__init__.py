"""Experiments that drive the real engine through its public API: the
classic cancel-and-pressure reproduction (``kvsan repro``), the stress run
(``kvsan stress``), the demo, their traffic and the generated tiny model.
They use kvsan as a user does (``KVSAN=1``, the report file); the checks
never import them.
"""
