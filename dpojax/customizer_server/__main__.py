"""`python -m dpojax.customizer_server`: see `dpojax.customizer_server.serve`."""

import sys

from dpojax.customizer_server.serve import main

sys.exit(main())
