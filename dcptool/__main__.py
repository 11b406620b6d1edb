"""`python -m dcptool`."""

from dcptool.cli import main

main()
