"""The pack family: the ``pack`` operator (:mod:`~zephon.operators.pack.pack`), where its
pieces go (:mod:`~zephon.operators.pack.placement`, :mod:`~zephon.operators.pack.bins`), how
a row is assembled (:mod:`~zephon.operators.pack.assembly`), and the fused
``[tokenize ->] split -> pack`` stage the plan may choose (:mod:`~zephon.operators.pack.fused`).
"""
