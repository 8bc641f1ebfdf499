"""Kiln's benchmark entry points (`python -m bench.NAME` from the repository root) and their one harness. A regular
package, so that no other `bench` on the path (a site-packages one) can stand in for it."""
