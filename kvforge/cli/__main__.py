"""`python -m kvforge.cli`: the command line, as the `kvforge` script runs it."""

from kvforge.cli import main

main()
