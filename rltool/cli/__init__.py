"""The Typer app: one small module per ``rltool`` command."""
