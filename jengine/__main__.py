"""`python -m jengine` is the `jengine` command."""

import sys

from jengine.cli import main

sys.exit(main())
