"""Reusable dashboard widgets: each renders plain data handed to it and never fetches."""
