"""The ``zephon`` command: ``demo``, ``lengths``, ``inspect`` (:mod:`~zephon.cli.inspect`)."""
