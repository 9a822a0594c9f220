"""Stored sweep grids (TOML, read by ``sgrld sweep --config``) and the paper's reference numbers."""
