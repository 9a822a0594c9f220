"""``python -m sgrld``: the same CLI as the ``sgrld`` command."""

from sgrld.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
