"""The chart, checked with the real tools of its consumers (promtool)."""
