"""zephon.jax.CheckpointSave / CheckpointRestore in an Orbax CheckpointManager, one
process. The cases are in _jax_cases_orbax.py and run in a fresh process, with 1 and with 4
CPU devices (see _jax_common.py for why not in this one); the two-process test is
test_jax_multiprocess.py."""

from __future__ import annotations

import pytest

from tests.integration._jax_common import require, run_cases

require("jax", "orbax.checkpoint")

pytestmark = pytest.mark.jax


@pytest.mark.parametrize("devices", [1, 4])
def test_orbax_handler(devices):
    run_cases("_jax_cases_orbax.py", devices=devices)
