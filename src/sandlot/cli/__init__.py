"""sandlot.cli."""
