"""specdec package."""
