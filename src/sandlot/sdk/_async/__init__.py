"""SDK client sources: async originals here, sync twins generated into ``_sync``."""
