"""`python -m engine` = the `engine` console script (one import of engine.cli, so its errors are caught)."""
from engine.cli import entry

entry()
