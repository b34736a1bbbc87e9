import sys

from prefix_router.ops.cli import main

sys.exit(main())
