"""The benchmark harness: what every question script (``benchmarks/<question>.py``) shares.

One concern per module:

* :mod:`.cpu` - CPU seconds of this process and its descendants over a window (``/proc``);
* :mod:`.timing` - throughput of a batch iterator, interleaved repetitions, timed calls;
* :mod:`.stats` - median / min / max of repeated measurements, as table columns;
* :mod:`.batches` - token counts of a batch, copies and comparison of batches;
* :mod:`.machine` - the machine and package versions a result was measured with;
* :mod:`.results` - the result JSON (rows plus the machine), written atomically;
* :mod:`.tables` - aligned text tables of result rows.
"""
