"""Helpers shared by the tests and the benchmarks (not part of the installed package): driving a real
fleet, fault injection, Redis scans. Nothing under api/, workers/, jobs/, models/ or fleet/ imports it."""
