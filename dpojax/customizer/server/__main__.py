"""`python -m dpojax.customizer.server`: see `dpojax.customizer.server.serve`."""

import sys

from dpojax.customizer.server.serve import main

sys.exit(main())
