"""``python -m zephon.cli`` is the ``zephon`` command."""

import sys

from zephon.cli.main import main

sys.exit(main())
