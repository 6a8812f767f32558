"""``python -m fuselm``: the ``fuselm`` command."""

import sys

from fuselm.cli import main

sys.exit(main())
