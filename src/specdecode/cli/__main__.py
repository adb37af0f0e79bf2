"""`python -m specdecode.cli`: the `specdecode` command where its script is not on PATH (the
tests start servers and batch runs this way)."""

from specdecode.cli import main

main()
