"""``selfextend`` from a checkout that is only on ``PYTHONPATH`` (a GPU machine where the package cannot be
installed): the CLI package ``cli/`` installs as ``selfextend.cli``, so it is put there by hand.

    PYTHONPATH=. python experiments/gpu/cli.py generate --device cuda ...
"""

from pathlib import Path

import selfextend

ROOT = Path(__file__).resolve().parents[2]
if not (Path(selfextend.__path__[0]) / "cli").exists():
    selfextend.__path__.append(str(ROOT))  # selfextend.cli -> ROOT/cli

from selfextend.cli.main import main  # noqa: E402

main()
