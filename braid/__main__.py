"""`python -m braid serve ...`"""

from braid.runtime.server.cli import main

main()
