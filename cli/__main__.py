"""``python -m cli``: the same as the ``selfextend`` command."""

from cli.main import main

main()
