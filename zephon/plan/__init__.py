"""Operators to a plan, and what the plan runs.

:mod:`zephon.plan.compile` decides the plan (eviction mode, flush cadence, where the replay
filter goes, which operators a fused stage stands for); :mod:`zephon.plan.read` is its head,
which turns a work chunk into records, and :mod:`zephon.plan.steps` its steps. A step is one
operator or a stage that stands for several (:class:`~zephon.operators.pack.fused.SplitPack`
for ``[tokenize ->] split -> pack``); the chain runner runs the steps in order without
knowing which is which.
"""
