"""``python -m selfextend``: the same as the ``selfextend`` command."""

from selfextend.cli.main import main

main()
