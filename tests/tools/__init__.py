"""Tests of the scripts in tools/, the documented commands and the Slurm launcher."""
