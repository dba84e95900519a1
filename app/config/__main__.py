"""``python -m app.config [--markdown]``: every key with its help (the reference page with --markdown)."""

from app.config.loading import main

main()
