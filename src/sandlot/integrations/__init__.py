"""sandlot.integrations."""
