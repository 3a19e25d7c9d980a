"""apcctl: admin tools for the lineage prompt cache."""
