"""Jobs, the source sensor and the daily rebuild schedule."""
