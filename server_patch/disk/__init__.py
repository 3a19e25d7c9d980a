"""The lineage cache's disk tier."""
