"""The main job: a small decoder-only transformer in JAX fed by the full Zephon chain.

    python examples/train_lm.py train --workdir run --steps 200 --crash-at 120   # dies
    python examples/train_lm.py train --workdir run --steps 200                  # resumes
    python examples/train_lm.py demo                                             # both, compared

The code lives in ``zephon/demo/train_lm.py`` so that ``zephon demo`` can run it from an
installed package; this file is the entry point for readers of ``examples/``.
"""

import sys

from zephon.demo.train_lm import main

if __name__ == "__main__":
    sys.exit(main())
