"""`python -m recipe_gkd.selfcheck`: the self-check's command line (recipe_gkd/selfcheck/__init__.py `main`)."""

import sys

from recipe_gkd.selfcheck import main

sys.exit(main())
