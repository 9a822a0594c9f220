"""The paper's grids: ``sgrld sweep --config paper/<name>`` (spec §7, §8)."""
