"""``python -m kiln.cli`` == ``kiln``."""

from kiln.cli.main import main

main()
