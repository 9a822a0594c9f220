"""Experiments behind the ``sgrld`` command (one module per sub-command)."""
