"""The paired A/B load test: coding tasks replayed against every arm at once, one record per request, a verdict."""
