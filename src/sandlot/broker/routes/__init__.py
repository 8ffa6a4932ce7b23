"""HTTP routes of the broker: thin adapters over the services."""
