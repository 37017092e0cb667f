import logging
import os

from flagserve.serve.server import main

code = main()
# Everything this process started is down by now (Serve, then Ray). Python's own teardown
# would spend another ~1.5 s in Ray's native destructors, which `action=stop` waits for.
logging.shutdown()
os._exit(code)
