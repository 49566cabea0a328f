"""Rich and JSON rendering of what the commands show; the one place rich consoles are made."""
