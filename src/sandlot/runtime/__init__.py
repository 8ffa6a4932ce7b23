"""sandlot.runtime."""
