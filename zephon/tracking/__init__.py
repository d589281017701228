"""The parent's books on every lane: in-flight chunks, per-offset completion, eviction and
the replay cursor (:mod:`~zephon.tracking.tracker`), and the checks of a lane's saved state
(:mod:`~zephon.tracking.checks`).
"""
