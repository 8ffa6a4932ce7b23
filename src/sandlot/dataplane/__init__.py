"""sandlot.dataplane."""
