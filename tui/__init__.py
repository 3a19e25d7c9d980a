"""The apcctl dashboard (Textual)."""
