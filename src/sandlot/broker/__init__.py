"""sandlot.broker."""
