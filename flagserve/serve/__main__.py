import sys

from flagserve.serve.server import main

sys.exit(main())
