"""distill package."""
