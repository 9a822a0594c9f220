"""The paper's grids: ``sgrld sweep --config paper/<name>``."""
