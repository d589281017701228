"""zephon.jax.global_batches — global jax.Array batches, device prefetch, the cut at the
last returned batch. The cases are in _jax_cases_global_batches.py and run in a fresh
process, with 1 and with 4 CPU devices (see _jax_common.py for why not in this one)."""

from __future__ import annotations

import pytest

from tests.integration._jax_common import require, run_cases

require("jax", "orbax.checkpoint")

pytestmark = pytest.mark.jax


@pytest.mark.parametrize("devices", [1, 4])
def test_global_batches(devices):
    run_cases("_jax_cases_global_batches.py", devices=devices)
