import sys

from narrate.cli import main

sys.exit(main())
