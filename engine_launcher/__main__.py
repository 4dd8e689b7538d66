"""`python -m engine_launcher` is `engine-launcher`."""

import sys

from engine_launcher.cli import main

sys.exit(main())
