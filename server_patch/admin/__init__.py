"""The /admin endpoint of the patched server: read, pin/evict, flush, drain, metrics."""
