"""``python -m lmcache_bsr CONFIG`` runs the LMCache host with bsr's admin API."""

import sys

from .host import main

sys.exit(main(sys.argv[1:]))
