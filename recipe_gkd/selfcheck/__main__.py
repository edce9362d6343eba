import sys

from recipe_gkd.selfcheck import main

sys.exit(main())
