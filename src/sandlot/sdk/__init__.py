"""sandlot.sdk."""
