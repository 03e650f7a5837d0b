import sys

from kasoku.cli import main

sys.exit(main())
