"""sandlot.providers."""
